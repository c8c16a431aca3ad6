"""Registers and local bytes of the split and pipe norm kernels (a GPU)."""
from cupy.cuda import driver

from cufuse import _runtime as R
from cufuse.ops import norm as N

for name, op in N._OPS.items():
    for k, e in sorted(op.exprs.items(), key=lambda kv: (str(kv[0][0]), kv[0][1:])):
        dt, key = k[0], k[1] + k[2:]  # (dtype, key[, "rescue"])
        if key[0] in ("split", "pipe") and dt.name in ("float16", "float32"):
            fn = R.get_function(*e, 0)
            print(f"{name:11} {dt.name:8} {'-'.join(map(str, key)):22} regs {driver.funcGetAttribute(4, fn.ptr):3d} "
                  f"local {driver.funcGetAttribute(3, fn.ptr)}")
