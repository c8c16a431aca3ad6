"""Generated sources compile (NVRTC, no GPU needed): every traced op and
operator, for every dtype, elementwise, reductions and several outputs.

The GPU tests (test_fuse.py) run these kernels; this file makes CI, which has
no GPU, prove that what codegen writes is valid CUDA for sm_80 and sm_90.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

import cufuse
from cufuse import _runtime as R

FLOAT_FNS = {
    "chain": (lambda x, y: cufuse.exp((x + y) * 2), 2, ()),
    "every_function": (lambda x: (
        cufuse.exp2(x) + cufuse.log(abs(x) + 1) + cufuse.log1p(abs(x)) + cufuse.expm1(x) + cufuse.sqrt(abs(x))
        + cufuse.rsqrt(abs(x) + 1) + cufuse.sin(x) + cufuse.cos(x) + cufuse.tanh(x) + cufuse.sigmoid(x)
        + cufuse.erf(x) + cufuse.relu(x) + cufuse.gelu(x) + cufuse.gelu(x, approximate="tanh") + cufuse.silu(x)
        + cufuse.softplus(x) + cufuse.round(x) + cufuse.floor(x) + cufuse.ceil(x) + cufuse.clip(x, -1, 1)
        + x // 3 + x % 3 + x ** 2.5 + cufuse.minimum(x, 1) + cufuse.maximum(x, -1)), 1, ()),
    "logic": (lambda x, y: (cufuse.where((x < y) & ~(x == 1) | (x >= 2), x, -y), x > y, x != y), 2, ()),
    "quantize": (lambda x, s, z: cufuse.clip(cufuse.round(x / s + z), -128, 127).astype(np.int8), 1, (0.05, 3.0)),
    "reductions": (lambda x, y: (((x - y) ** 2).sum(axis=-1), x.max(axis=-1), y.min(axis=-1),
                                 x.mean(axis=-1, keepdims=True)), 2, ()),
    "adam": (lambda p, g, m, v, lr, b1, b2, eps, bc1, bc2: (
        p - lr * ((b1 * m + (1 - b1) * g) / bc1) / (cufuse.sqrt((b2 * v + (1 - b2) * g * g) / bc2) + eps),
        b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g), 4, (1e-3, 0.9, np.float32(0.999), 1e-8, 0.1, 0.001)),
}
INT_FNS = {
    "int_ops": (lambda a, b: (a // b, a % b, a ** 2, a * b + 1, (a & b) | (a ^ b), -a, ~a, abs(a), a / b,
                              a.astype(np.float16), cufuse.exp(a), a.astype(bool)), 2, ()),
    "int_reductions": (lambda a: (a.sum(axis=-1), a.max(axis=-1), a.mean(axis=-1), a.min(axis=-1)), 1, ()),
    "bool_reductions": (lambda a: ((a > 0).sum(axis=-1), (a > 0).max(axis=-1), (a > 0).min(axis=-1)), 1, ()),
}
CASES = ([(n, dt) for n in FLOAT_FNS for dt in ("float16", "float32", "float64")]
         + [(n, dt) for n in INT_FNS for dt in ("int8", "uint8", "int16", "int32", "int64")])


@pytest.mark.parametrize("name,dtype", CASES)
def test_generated_source_compiles(name, dtype):
    try:
        import cupy
        cupy.cuda.nvrtc.getVersion()
    except Exception as e:
        pytest.skip(f"CuPy / NVRTC not usable: {type(e).__name__}: {e}")
    from cufuse._build import _compile
    fn, nin, scalars = {**FLOAT_FNS, **INT_FNS}[name]
    f = cufuse.fuse(fn)
    args = [np.ones((3, 8), dtype) for _ in range(nin)] + list(scalars)
    src = f.source(*args)
    assert "__global__" in src and f.stats["compiles"] == 0
    entries = ["fused_rows"] if "reductions" in name else ["fused_contig", "fused_strided", "fused_tiled", "fused_segments"]
    for e in entries:
        assert f" {e}(" in src
    full = R.expand_includes(src)
    # The headers a fused source includes hold no code that differs between
    # sm_80 and sm_90 (their guards are at 8.0; asserted): sm_90 too for the
    # first dtype of each function only (CPU suite time, issue 32)
    assert set(re.findall(r"__CUDA_ARCH__\s*>=\s*(\d+)", full)) <= {"700", "800"}
    for arch in ("80", "90") if dtype in ("float16", "int8") else ("80",):
        _compile(full, R.compile_options() + ("-ftz=true",), arch, None)  # raises CompileException on error
