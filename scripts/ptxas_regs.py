"""Registers, stack frame and spills of every kernel of the families whose
names start with a prefix, from ptxas's report through NVRTC: no GPU needed
(NVRTC from pip, as `python -m cufuse build`). Usage:

    python scripts/ptxas_regs.py norm:layer_norm:float16 [arch=90]

One line per kernel: family, kernel, registers, and bytes of stack frame /
spill stores / spill loads. The figures are the local NVRTC's; the device's
(another CUDA version) may differ by a few registers: bench/split_regs.py
reads them from the driver there."""
from __future__ import annotations

import re
import sys

from cupy_backends.cuda.libs import nvrtc

from cufuse import _runtime as R
from cufuse import ops  # noqa: F401 - registers every family's kernels


def report(prefix: str, arch: str = "90") -> int:
    failed = 0
    for family, entries in sorted(R.registry().items()):
        if not family.startswith(prefix):
            continue
        names = sorted(e for e in entries if R.builds_for(e, int(arch)))
        if not names:
            continue
        prog = nvrtc.createProgram(R.load_source(family), "cufuse.cu", [], [])
        for n in names:
            nvrtc.addNameExpression(prog, n)
        try:
            nvrtc.compileProgram(prog, [*R.compile_options(), *(R.arch_options(names, int(arch)) or (f"-arch=sm_{arch}",)),
                                        "--ptxas-options=-v",
                                        "--device-as-default-execution-space"])
        except Exception as e:  # a compile error: NVRTC's log says where
            print(f"{family}: {e}\n{nvrtc.getProgramLog(prog)}")
            failed += 1
            continue
        mangled = {nvrtc.getLoweredName(prog, n): n for n in names}
        kernel, frame = None, ("?", "?", "?")
        for line in nvrtc.getProgramLog(prog).splitlines():
            m = re.search(r"Compiling entry function '(\S+)'", line)
            if m:
                kernel = mangled.get(m.group(1), m.group(1))
            m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
            if m:
                frame = m.groups()
            m = re.search(r"Used (\d+) registers", line)
            if m and kernel:
                print(f"{family:44} {kernel:60} regs {int(m.group(1)):3d}  frame/spill st/ld {'/'.join(frame)}")
    return failed


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sys.exit(1 if report(*sys.argv[1:3]) else 0)
