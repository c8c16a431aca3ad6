"""cufuse in a few lines: the same calls on NumPy (CPU fallback), CuPy and torch.

    python examples/basic.py
"""
import numpy as np

import cufuse

rng = np.random.default_rng(0)
x = rng.standard_normal((1024, 512), dtype=np.float32)
y = rng.standard_normal((1024, 512), dtype=np.float32)
bias = rng.standard_normal(512, dtype=np.float32)

# NumPy in, NumPy out (the fallback; same semantics as the kernels).
z = cufuse.add_mul_exp(x, y)
assert np.allclose(z, np.exp((x + y) * 2), rtol=1e-5)
print("numpy:", type(z).__name__, z.dtype, z.shape)

if cufuse.CUDA_AVAILABLE:
    import cupy as cp

    gx, gy, gb = cp.asarray(x), cp.asarray(y), cp.asarray(bias)
    h = cufuse.add_relu(gx, gb)                 # bias broadcasts along the last axis
    out = cp.empty_like(gx)
    cufuse.fma(gx, gy, h, out=out)              # no allocation
    assert np.allclose(out.get(), x * y + np.maximum(x + bias, 0), rtol=1e-5, atol=1e-6)
    print("cupy:", type(out).__name__, out.dtype, out.shape)

    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        t = torch.from_numpy(x).cuda()
        r = cufuse.mul_tanh(t, 0.5)             # torch in, torch out, on torch's stream
        a = cufuse.from_torch(r)                # zero-copy CuPy view of the same memory
        print("torch:", type(r).__name__, r.device, "shares memory:", a.data.ptr == r.data_ptr())
else:
    print("no GPU: CuPy and torch CUDA parts skipped")
