"""Shared test helpers: tolerances, the float64 reference, inputs, backends.

The reference is written here, independently of cufuse (never its
``numpy_impl`` lambdas): every operand is widened to float64 (a scalar is
first rounded to the result dtype, as NumPy does when a Python scalar meets
an array), the function is evaluated in float64, and the result is rounded to
the output dtype (so that overflow to inf happens where it must).
"""
from __future__ import annotations

import numpy as np
import pytest

import cufuse

# ----------------------------------------------------------------- tolerances
# (rtol, atol) per output dtype, stated once. The expected value is the float64
# reference rounded to the output dtype, so float16 may differ from it by one
# half-precision ulp (2**-10 ~ 9.8e-4 relative: float32 compute, then rounding);
# float32 by a few ulps (expf/tanhf, fma vs. mul+add cancellation near 0);
# float64 by a few ulps.
TOL = {
    np.dtype(np.float16): (2e-3, 1e-4),
    np.dtype(np.float32): (1e-5, 1e-5),
    np.dtype(np.float64): (1e-12, 1e-12),
}

DTYPES = [np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)]

# bfloat16 (ml_dtypes' dtype, where installed): one rounding of a float32
# result, one ulp at most 2**-7 of the value; atol for float32's own error
# where the result cancels (fma).
try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
    TOL[BF16] = (1e-2, 1e-5)
except ImportError:  # pragma: no cover - depends on the machine
    BF16 = None


def promote(dtypes):
    """The result dtype of float array operands (cufuse's spec, docs/ops.md):
    numpy.result_type, with bfloat16 promoting as float16 does except that
    bfloat16 with float16 gives float32."""
    dtypes = [np.dtype(d) for d in dtypes]
    if BF16 is None or BF16 not in dtypes:
        return np.result_type(*dtypes)
    f16 = np.dtype(np.float16)
    r = np.result_type(*[f16 if d == BF16 else d for d in dtypes])
    if r == f16:
        return np.dtype(np.float32) if f16 in dtypes else BF16
    return r

# ------------------------------------------------------------------ reference
_REF = {
    "add_relu": lambda a, b: np.maximum(a + b, 0.0),        # np.maximum propagates NaN
    "mul_tanh": lambda a, b: np.tanh(a * b),
    "add_mul_exp": lambda x, y: np.exp((x + y) * 2.0),
    "fma": lambda q, k, v: q * k + v,
}
ARITY = {"add_relu": 2, "mul_tanh": 2, "add_mul_exp": 2, "fma": 3}
OP_NAMES = list(_REF)
OPS = {name: getattr(cufuse, name) for name in OP_NAMES}


def _widen(v, result_dtype):
    if isinstance(v, np.ndarray):
        return v.astype(np.float64)
    # Python / NumPy scalar: rounded to the result dtype first (NumPy semantics)
    return np.asarray(v, dtype=result_dtype).astype(np.float64)


def reference(op, inputs, result_dtype):
    """float64 reference of ``op`` on NumPy arrays / scalars (not yet rounded)."""
    result_dtype = np.dtype(result_dtype)
    vals = [_widen(v, result_dtype) for v in inputs]
    with np.errstate(all="ignore"):
        r = _REF[op](*vals)
    return np.asarray(r, dtype=np.float64)


def assert_close(got, ref, dtype, tol=None):
    """``got`` (NumPy, output dtype) against the float64 reference ``ref``;
    ``tol`` = (rtol, atol) overrides the dtype's entry in TOL."""
    dtype = np.dtype(dtype)
    assert isinstance(got, np.ndarray)
    assert got.dtype == dtype, f"result dtype {got.dtype}, expected {dtype}"
    assert got.shape == ref.shape, f"result shape {got.shape}, expected {ref.shape}"
    with np.errstate(all="ignore"):
        expected = ref.astype(dtype).astype(np.float64)
    g = got.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(expected), err_msg="NaN positions differ")
    np.testing.assert_array_equal(np.isposinf(g), np.isposinf(expected), err_msg="+inf positions differ")
    np.testing.assert_array_equal(np.isneginf(g), np.isneginf(expected), err_msg="-inf positions differ")
    rtol, atol = tol or TOL[dtype]
    np.testing.assert_allclose(g, expected, rtol=rtol, atol=atol, equal_nan=True)


# ---------------------------------------------------------------------- inputs
def compiled_matches_eager(f, args, rtol, atol, grad_rtol=None, grad_atol=None):
    """``f`` compiled with ``torch.compile(fullgraph=True)`` against ``f``
    eager, each on its own copies of ``args``: the results (a scalar, which
    is then back-propagated) and the gradients of the tensors that require
    grad agree. Returns the compiled run's arguments (with their ``.grad``)."""
    import torch

    def copies():
        return [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                for a in args]
    ca, ea = copies(), copies()
    yc, ye = torch.compile(f, fullgraph=True)(*ca), f(*ea)
    torch.testing.assert_close(yc, ye, rtol=rtol, atol=atol)
    yc.backward()
    ye.backward()
    for a, b in zip(ca, ea):
        if isinstance(a, torch.Tensor) and a.requires_grad:
            torch.testing.assert_close(a.grad, b.grad, rtol=rtol if grad_rtol is None else grad_rtol,
                                       atol=atol if grad_atol is None else grad_atol)
    return ca


def scale_for(op):
    """Keep exp's argument small enough that float16 does not overflow."""
    return 0.5 if op == "add_mul_exp" else 1.0


def rand(shape, dtype, seed, scale=1.0):
    """Random normal values in ``dtype``, never zero."""
    rng = np.random.default_rng(seed)
    x = np.asarray(rng.standard_normal(shape) * scale).astype(dtype)
    x[x == 0] = 0.5
    return x


# -------------------------------------------------------------------- backends
class Backend:
    """Converts NumPy inputs to one array kind and results back to NumPy."""

    def __init__(self, name):
        self.name = name
        self.gpu = name in ("cupy", "torch_cuda")
        self.is_torch = name.startswith("torch")
        self.negative_strides = name in ("numpy", "cupy")  # torch has none
        if self.is_torch:
            self.torch = pytest.importorskip("torch")
            if name == "torch_cuda" and not self.torch.cuda.is_available():
                pytest.skip("torch without CUDA")
        if name == "cupy":
            if not cufuse.CUDA_AVAILABLE:
                pytest.skip("no CUDA GPU")
            import cupy
            self.cp = cupy

    def __repr__(self):
        return f"Backend({self.name})"

    def asarray(self, a):
        """A copy of NumPy array ``a`` in this kind (contiguous)."""
        a = np.array(a, order="C", copy=True)  # (np.ascontiguousarray makes 0-d arrays 1-d)
        if self.name == "numpy":
            return a
        if self.name == "cupy":
            return self.cp.asarray(a)
        if a.dtype.name == "bfloat16":  # (torch.from_numpy does not take ml_dtypes' bfloat16)
            t = self.torch.from_numpy(a.view(np.int16)).view(self.torch.bfloat16)
        else:
            t = self.torch.from_numpy(a)
        return t.to("cuda") if self.name == "torch_cuda" else t

    def to_numpy(self, x):
        if self.name == "numpy":
            return np.array(x)
        if self.name == "cupy":
            return self.cp.asnumpy(x)
        t = x.detach().cpu()
        if t.dtype == self.torch.bfloat16:  # (Tensor.numpy() does not give bfloat16)
            import ml_dtypes
            return np.array(t.view(self.torch.int16).numpy()).view(ml_dtypes.bfloat16)
        return np.array(t.numpy())

    def full(self, shape, value, dtype):
        return self.asarray(np.full(shape, value, dtype=dtype))

    def is_kind(self, x):
        if self.name == "numpy":
            return isinstance(x, np.ndarray)
        if self.name == "cupy":
            return isinstance(x, self.cp.ndarray)
        if not isinstance(x, self.torch.Tensor):
            return False
        return x.is_cuda if self.name == "torch_cuda" else x.device.type == "cpu"

    def synchronize(self):
        if self.name == "cupy":
            self.cp.cuda.get_current_stream().synchronize()
        elif self.name == "torch_cuda":
            self.torch.cuda.synchronize()


def cpu_runs_one(backend, first):
    """Cases that choose among GPU kernels (row lengths, splits, pipes,
    launch shapes): the CPU backends, whose NumPy path is the same for all
    of them, run only those where ``first`` is true (issue 32: the CPU
    suite's time); the GPU backends run every case."""
    if not backend.gpu and not first:
        pytest.skip("a case for the GPU kernels' choice: the CPU backends run one of these")


BACKEND_PARAMS = [
    pytest.param("numpy", id="numpy"),
    pytest.param("torch_cpu", id="torch_cpu"),
    pytest.param("cupy", id="cupy", marks=pytest.mark.cuda),
    pytest.param("torch_cuda", id="torch_cuda", marks=pytest.mark.cuda),
]


def check_kind(backend, res, shape, dtype, like=None):
    """The result is of the backend's kind, shape and dtype (on ``like``'s device)."""
    assert backend.is_kind(res), f"{backend.name}: result is {type(res)}"
    assert tuple(res.shape) == tuple(shape)
    if backend.is_torch:
        assert backend.to_numpy(res).dtype == np.dtype(dtype)
        if like is not None:
            assert res.device == like.device
    else:
        assert res.dtype == np.dtype(dtype)
        if backend.name == "cupy" and like is not None:
            assert res.data.device_id == like.data.device_id


def gpu_count():
    """Number of CUDA devices CuPy sees (0 without a usable GPU)."""
    if not cufuse.CUDA_AVAILABLE:
        return 0
    from cufuse import _runtime as R
    return R._cp.cuda.runtime.getDeviceCount()


def example_rows(script, *args, first=("eager", "cufuse")):
    """Run examples/<script> (a subprocess: its own process, as a user runs
    it) and return its table rows (split lines) keyed by their first word,
    for the first words ``first``; asserts it exits 0 and prints them all."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, os.path.join(root, "examples", script), *args], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines() if line.split()[:1] in
            [[f] for f in first]}
    assert set(rows) == set(first), r.stdout
    return rows, r.stdout
