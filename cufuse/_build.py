"""``python -m cufuse build``: compile every kernel for every dtype, no GPU needed.

NVRTC (from pip: nvidia-cuda-nvrtc-*) compiles each kernel family's source with
all its registered name expressions to a cubin per architecture, exactly as the
runtime would, without touching a driver.
"""
from __future__ import annotations

import sys
import time

from . import _runtime as R


def _compile(source, options, arch, names):
    """(binary kind, {name expression: mangled name}) for one architecture."""
    import cupy.cuda.compiler as cc
    target = R.arch_options(names, int(arch)) or (f"-arch=sm_{arch}",)
    try:  # a real cubin (ptxas runs too); private CuPy API, so keep a fallback
        prog = cc._NVRTCProgram(source, "cufuse_build.cu", (), (), name_expressions=names, method="cubin")
        _, mapping = prog.compile(options + target + ("--device-as-default-execution-space",))
        return "cubin", mapping
    except (AttributeError, TypeError):
        _, mapping = cc.compile_using_nvrtc(source, options=options + R.arch_options(names, int(arch)) + ("-dlto",), arch=arch,
                                            name_expressions=names, method="lto")
        return "ltoir", mapping


def build(archs, out=sys.stdout, family="", verbose=False) -> int:
    """Compile every registered family whose name starts with ``family`` for
    each architecture; 0 when every kernel compiled, 1 on failures, 2 without
    CuPy or when no family matches. Prints a line per family and
    architecture (``verbose``: also one per kernel; failures always), then a
    summary."""
    from . import ops  # noqa: F401 - registers every family's kernels
    try:
        import cupy  # noqa: F401
        from cupy.cuda.compiler import CompileException
    except Exception as e:
        print(f"cufuse build: CuPy is not importable ({e}); install the cuda12 or cuda13 extra of "
              "cufuse-nvrtc (pip install -e '.[cuda12]' in a clone)", file=out)
        return 2
    options = R.compile_options()
    failures = built = 0
    start = time.perf_counter()
    families = {f: e for f, e in R.registry().items() if f.startswith(family)}
    if not families:
        print(f"cufuse build: no kernel family starts with {family!r}", file=out)
        return 2
    for family, entries in sorted(families.items()):
        source = R.load_source(family)
        for arch in archs:
            names = sorted(e for e in entries if R.builds_for(e, int(arch)))
            skipped = len(entries) - len(names)
            if skipped:
                print(f"skip sm_{arch} {family}: {skipped} kernels need another architecture", file=out)
            if not names:
                continue
            t0 = time.perf_counter()
            try:
                kind, mapping = _compile(source, options, arch, names)
            except CompileException as e:
                failures += 1
                print(f"FAIL sm_{arch} {family}: compiler log follows\n{e}", file=out)
                continue
            except Exception as e:  # NVRTC missing, etc.
                failures += 1
                print(f"FAIL sm_{arch} {family}: {type(e).__name__}: {e}", file=out)
                continue
            dt = time.perf_counter() - t0
            bad = 0
            for name in names:
                label, dtype = entries[name]
                ok = bool(mapping.get(name))
                bad += not ok
                if verbose or not ok:
                    print(f"{'ok  ' if ok else 'FAIL'} sm_{arch} {family:12s} {label:28s} {dtype:8s} {name}", file=out)
            failures += bad
            built += len(names) - bad
            print(f"{'    ' if not bad else 'FAIL'} sm_{arch} {family}: {len(names)} kernels, {kind}, {dt:.1f} s",
                  file=out)
    print(f"cufuse build: {'FAILED' if failures else 'all kernels compiled'}: {built} kernel builds of "
          f"{len(families)} families for {', '.join('sm_' + a for a in archs)} in "
          f"{time.perf_counter() - start:.0f} s, {failures} failed "
          f"(NVRTC {R.nvrtc_version()}, include {R.cuda_include_dirs() or 'none found'})", file=out)
    return 1 if failures else 0


def parse_archs(text: str):
    archs = []
    for a in text.split(","):
        a = a.strip().lower().removeprefix("sm_").removeprefix("compute_")
        if not a.isdigit():
            raise SystemExit(f"cufuse build: bad architecture {a!r}; use e.g. --arch sm_80,sm_90")
        archs.append(a)
    return archs
