"""Registers and local (spilled) bytes per thread of the one-pass norm kernels
(kernels/norm_backward.cu), per dtype, kind and packs per thread, from the
driver (cuFuncGetAttribute): python3 scripts/kernel_regs.py. Registers
bound how many 512-thread blocks an SM holds (65536 registers: 2 blocks at
64 a thread, 1 above)."""
from __future__ import annotations

from cupy.cuda import driver

from cufuse import _arrays as A
from cufuse import _runtime as R
from cufuse.ops import norm as N

NUM_REGS, LOCAL_SIZE_BYTES = 4, 3  # CUfunction_attribute


def main():
    for (dt, kind, np_), expr in sorted(N._BWD_EXPRS.items(), key=lambda kv: (str(kv[0][0]), kv[0][1], kv[0][2])):
        if dt not in (A.F32, A.BF16) or kind in ("softmax", "log_softmax"):
            continue
        fn = R.get_function(f"{N._BWD_FAMILY}:{dt.name}", expr, 0)
        regs = driver.funcGetAttribute(NUM_REGS, fn.ptr)
        local = driver.funcGetAttribute(LOCAL_SIZE_BYTES, fn.ptr)
        print(f"{dt.name:9} {kind:11} np {np_}: {regs:3d} registers, {local} local bytes")


if __name__ == "__main__":
    main()
