"""The distribution name: "cufuse" on the package index is an unrelated
project, so the project is distributed as cufuse-nvrtc, and no instruction or
message sends a user to ``pip install cufuse``."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAME = "cufuse-nvrtc"
# "cufuse[extra]" or "pip install cufuse" (the bare name), not part of another name or path
BAD = re.compile(r"(?<![\w./-])cufuse\[|pip install ['\"]?cufuse(?![\w-])")


def test_distribution_name():
    text = (ROOT / "pyproject.toml").read_text()
    names = re.findall(r'^name\s*=\s*"([^"]+)"', text, re.M)
    assert names == [NAME], names


def _texts():
    files = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "cufuse").rglob("*.py"))]
    docs = ROOT / "docs"
    if docs.is_dir():
        files += sorted(docs.rglob("*.md"))
    return [(f, f.read_text()) for f in files if f.is_file()]


def test_no_instruction_installs_the_other_project():
    bad = [f"{f.relative_to(ROOT)}:{n}: {line.strip()}"
           for f, text in _texts() for n, line in enumerate(text.splitlines(), 1)
           if BAD.search(line) and "never" not in line]
    assert not bad, "\n".join(bad)


def test_the_check_can_fail():
    assert BAD.search('pip install "cufuse[cuda12]"') and BAD.search("pip install cufuse")
    assert BAD.search("install cufuse[cuda12] or cufuse[cuda13]")
    assert not BAD.search('pip install -e ".[cuda12]"') and not BAD.search("pip install cufuse-nvrtc")


def test_public_api_is_typed():
    """py.typed ships in the package, and every public function states the type
    of each parameter and of its result (mypy checks them in CI)."""
    import inspect

    import cufuse
    assert (ROOT / "cufuse" / "py.typed").is_file()
    bare = []
    for name in cufuse.__all__:
        obj = getattr(cufuse, name)
        if not inspect.isfunction(obj):
            continue
        sig = inspect.signature(obj)
        if sig.return_annotation is inspect.Signature.empty:
            bare.append(f"{name} -> ?")
        bare += [f"{name}({p.name})" for p in sig.parameters.values() if p.annotation is inspect.Parameter.empty]
    assert not bare, bare
