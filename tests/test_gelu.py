"""cufuse.bias_gelu(x, bias, approximate="none", *, out=None) = gelu(x + bias),
on every backend, against a float64 reference (tests/_reference_fused.py) and,
where torch is installed, against torch.nn.functional.gelu on CPU.

Tolerances are ``TOL`` of tests/_reference.py, stated once there: float16
2e-3 rel / 1e-4 abs (float32 compute, then one half-precision rounding),
float32 1e-5 rel / 1e-5 abs, float64 1e-12 rel / 1e-12 abs. The erf form
keeps its relative accuracy in the left tail (test_erf_left_tail_relative:
the same rtol there, with no atol).
"""
from __future__ import annotations

import functools
import math
import re

import numpy as np
import pytest

import cufuse

from _reference import DTYPES, TOL, Backend, check_kind, rand
from _reference_fused import (F16, F32, F64, assert_close_tol, assert_within_one_ulp, bias_gelu_ref,
                              finite_float16, gelu64)

APPROX = ["none", "tanh"]
SIZES = [0, 1, 7, 4097, 1_000_003]
dtype_param = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
approx_param = pytest.mark.parametrize("approximate", APPROX)


def call(backend, x, bias, approximate, launches, np_x, np_bias, dtype, out=None, ref=None):
    """Run bias_gelu, check kind / shape / dtype / values, return the NumPy result."""
    shape = np.broadcast_shapes(np.shape(np_x), np.shape(np_bias))
    kw = {} if out is None else {"out": out}
    res = cufuse.bias_gelu(x, bias, approximate, **kw)
    if out is not None:
        assert res is out
    check_kind(backend, res, shape, dtype)
    got = backend.to_numpy(res)
    if ref is None:
        ref = bias_gelu_ref(np_x, np_bias, approximate, dtype)
    assert_close_tol(got, ref, dtype)
    if math.prod(shape) == 0:
        assert launches == []
    return got


@functools.lru_cache(maxsize=8)
def _sized_case(n, dtype, approximate):
    x = rand((n,), dtype, 10 + n, 2.0)
    b = rand((n,), dtype, 20 + n, 0.5)
    return x, b, bias_gelu_ref(x, b, approximate, dtype)


# ----------------------------------------------------------------------- sizes
@dtype_param
@approx_param
@pytest.mark.parametrize("n", SIZES)
def test_sizes(backend, dtype, approximate, n, launches):
    x, b, ref = _sized_case(n, dtype, approximate)
    call(backend, backend.asarray(x), backend.asarray(b), approximate, launches, x, b, dtype, ref=ref)


def test_default_is_exact_erf(backend):
    x = rand((1000,), F64, 1, 3.0)
    b = rand((1000,), F64, 2, 0.5)
    got = backend.to_numpy(cufuse.bias_gelu(backend.asarray(x), backend.asarray(b)))
    assert_close_tol(got, bias_gelu_ref(x, b, "none", F64), F64)
    # and the two forms really differ by more than the tolerance here
    assert np.abs(bias_gelu_ref(x, b, "tanh", F64) - bias_gelu_ref(x, b, "none", F64)).max() > 1e-5


def test_keyword_approximate(backend):
    x = rand((33,), F32, 3)
    got = backend.to_numpy(cufuse.bias_gelu(backend.asarray(x), 0.25, approximate="tanh"))
    assert_close_tol(got, bias_gelu_ref(x, 0.25, "tanh", F32), F32)


# --------------------------------------------------------------------- layouts
LAYOUTS = ["contiguous_2d", "transposed", "transposed_bias_col", "offset", "offset_bias", "step",
           "negative_step", "bias_last_axis", "bias_last_axis_3d", "bias_column", "bias_middle_3d",
           "bias_row_2d", "bias_0d", "bias_py_float", "bias_py_int", "bias_np_scalar",
           "x_py_float", "x_0d", "both_0d", "bias_larger_than_x", "bias_last_axis_large",
           "bias_last_axis_large_sliced"]


def make_layout(backend, layout, dtype):
    """(x, bias) in the backend's kind, views made there, and their NumPy values."""
    def dev(shape, seed, scale=2.0):
        return backend.asarray(rand(shape, dtype, seed, scale))

    if layout == "contiguous_2d":
        x, b = dev((37, 129), 1), dev((37, 129), 2, 0.5)
    elif layout == "transposed":                 # (33, 65), strides (1, 33), bias along the last axis
        x, b = dev((65, 33), 1).T, dev((65,), 2, 0.5)
    elif layout == "transposed_bias_col":
        x, b = dev((65, 33), 1).T, dev((65, 33), 2, 0.5).T
    elif layout == "offset":                     # contiguous, misaligned by one element
        x, b = dev((4098,), 1)[1:], dev((4097,), 2, 0.5)
    elif layout == "offset_bias":
        x, b = dev((4098,), 1)[1:], dev((4098,), 2, 0.5)[1:]
    elif layout == "step":
        x, b = dev((2 * 4097,), 1)[::2], dev((4097,), 2, 0.5)
    elif layout == "negative_step":
        if not backend.negative_strides:
            pytest.skip("torch tensors have no negative strides")
        x, b = dev((4097,), 1)[::-1], dev((4097,), 2, 0.5)
    elif layout == "bias_last_axis":
        x, b = dev((37, 129), 1), dev((129,), 2, 0.5)
    elif layout == "bias_last_axis_large":     # float16: several packs per thread (tiled kernel)
        x, b = dev((517, 1024), 1), dev((1024,), 2, 0.5)
    elif layout == "bias_last_axis_large_sliced":  # the same in the strided kernel
        x, b = dev((517, 1025), 1)[:, 1:], dev((1024,), 2, 0.5)
    elif layout == "bias_last_axis_3d":
        x, b = dev((5, 7, 96), 1), dev((96,), 2, 0.5)
    elif layout == "bias_column":
        x, b = dev((37, 129), 1), dev((37, 1), 2, 0.5)
    elif layout == "bias_middle_3d":
        x, b = dev((5, 7, 9), 1), dev((7, 1), 2, 0.5)
    elif layout == "bias_row_2d":
        x, b = dev((37, 129), 1), dev((1, 129), 2, 0.5)
    elif layout == "bias_0d":
        x, b = dev((37, 129), 1), dev((), 2, 0.5)
    elif layout == "bias_py_float":
        x, b = dev((37, 129), 1), -0.3
    elif layout == "bias_py_int":
        x, b = dev((37, 129), 1), 1
    elif layout == "bias_np_scalar":
        x, b = dev((37, 129), 1), dtype.type(0.625)
    elif layout == "x_py_float":
        x, b = 0.75, dev((37, 129), 2, 0.5)
    elif layout == "x_0d":
        x, b = dev((), 1), dev((129,), 2, 0.5)
    elif layout == "both_0d":
        x, b = dev((), 1), dev((), 2, 0.5)
    elif layout == "bias_larger_than_x":       # the result takes the broadcast shape
        x, b = dev((129,), 1), dev((5, 129), 2, 0.5)
    else:
        raise AssertionError(layout)
    np_vals = [v if isinstance(v, (int, float, np.generic)) else backend.to_numpy(v) for v in (x, b)]
    return x, b, np_vals[0], np_vals[1]


@dtype_param
@approx_param
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts(backend, dtype, approximate, layout, launches):
    x, b, nx, nb = make_layout(backend, layout, dtype)
    call(backend, x, b, approximate, launches, nx, nb, dtype)


def test_inputs_unchanged(backend):
    x0, b0 = rand((4097,), F32, 5), rand((4097,), F32, 6)
    x, b = backend.asarray(x0), backend.asarray(b0)
    cufuse.bias_gelu(x, b)
    backend.synchronize()
    np.testing.assert_array_equal(backend.to_numpy(x), x0)
    np.testing.assert_array_equal(backend.to_numpy(b), b0)


# ------------------------------------------------------------------- promotion
PROMOTIONS = [
    (F16, F32), (F32, F16), (F16, F64), (F64, F16), (F32, F64), (F64, F32),
    (F16, np.float32(0.5)), (F32, np.float64(-0.5)), (F16, 0.5), (F32, 2), (F64, np.float16(0.25)),
]


@approx_param
@pytest.mark.parametrize("xdt, bias", PROMOTIONS,
                         ids=[f"{a.name}-" + (b.name if isinstance(b, np.dtype) else f"scalar_{type(b).__name__}")
                              for a, b in PROMOTIONS])
def test_promotion(backend, xdt, bias, approximate, launches):
    x = rand((7, 65), xdt, 30, 2.0)
    if isinstance(bias, np.dtype):
        nb = rand((65,), bias, 31, 0.5)
        b = backend.asarray(nb)
    else:
        nb = b = bias
    expected = np.result_type(x, nb)
    if backend.is_torch and not isinstance(bias, np.dtype):
        expected = xdt  # torch's rule: a number keeps the tensor's type
        torch = backend.torch
        assert (torch.from_numpy(x) + bias).dtype == torch.from_numpy(x).dtype   # torch itself
    call(backend, backend.asarray(x), b, approximate, launches, x, nb, expected)


# ----------------------------------------------------------- against PyTorch
@pytest.mark.parametrize("dtype", [F32, F64], ids=lambda d: d.name)
@approx_param
def test_matches_torch_gelu(backend, dtype, approximate):
    torch = pytest.importorskip("torch")
    x = rand((3, 4097), dtype, 40, 3.0)
    b = rand((4097,), dtype, 41, 0.5)
    expected = torch.nn.functional.gelu(torch.from_numpy(x + b), approximate=approximate).numpy()
    got = backend.to_numpy(cufuse.bias_gelu(backend.asarray(x), backend.asarray(b), approximate))
    assert got.dtype == dtype
    rtol, atol = TOL[dtype]
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol)


# ------------------------------------------------------------ special values
@dtype_param
@approx_param
def test_nan_and_large_values(backend, dtype, approximate, launches):
    """NaN propagates; far in the tails gelu(v) is v or (-)0. (+-inf are left
    out: PyTorch's own results there differ between forms and dtypes.)"""
    big = 60000.0 if dtype == F16 else 1e30
    vals = np.array([np.nan, 0.0, -0.0, 1e-3, -1e-3, 0.5, -0.5, 8.0, -8.0, 12.0, -12.0, 30.0, -30.0,
                     1000.0, -1000.0, big, -big], dtype=dtype)
    got = call(backend, backend.asarray(vals), 0.0, approximate, launches, vals, 0.0, dtype)
    assert np.isnan(got[0]) and not np.isnan(got[1:]).any()
    assert got[-2] == vals[-2] and got[-1] == 0


# ------------------------------------------- accuracy where gelu(v) is tiny
@dtype_param
def test_erf_left_tail_relative(backend, dtype, launches):
    """For v < -2, gelu(v) = v Phi(v) is small and 1 + erf(v / sqrt 2) would
    cancel (float32 erff's form is off by 6% near v = -5): every backend keeps
    the relative tolerance there, with no absolute one. float16 down to
    v = -3.9, where results are still normal numbers."""
    lo = -3.9 if dtype == F16 else -12.0
    x = np.linspace(lo, -2.0, 4001).astype(dtype)
    got = backend.to_numpy(cufuse.bias_gelu(backend.asarray(x), 0.0))
    assert got.dtype == dtype
    np.testing.assert_allclose(got.astype(np.float64), gelu64(x), rtol=TOL[dtype][0], atol=0)


@pytest.mark.cuda
def test_float16_every_value_within_one_ulp():
    """Every finite float16 input: bias_gelu and cufuse.fuse's gelu are within
    one float16 ulp of the float64 value rounded to float16 (the kernels use a
    cheaper erf tail for float16 results, common.cuh: gelu_erf_to)."""
    import cupy as cp
    x = finite_float16()
    expected = gelu64(x).astype(F16)
    fused = cufuse.fuse(lambda v: cufuse.gelu(v))
    for what, res in (("bias_gelu", cufuse.bias_gelu(cp.asarray(x), np.float16(0))),
                      ("fuse gelu", fused(cp.asarray(x)))):
        got = cp.asnumpy(res)
        assert got.dtype == F16, what
        assert_within_one_ulp(got, expected, x, what)


# ------------------------------------------------------------------------ out=
OUT_LAYOUTS = ["contiguous", "strided", "transposed", "offset"]


@dtype_param
@pytest.mark.parametrize("layout", OUT_LAYOUTS)
def test_out(backend, dtype, layout, launches):
    """out (a view into a NaN-poisoned buffer) gets every element, nothing else is touched."""
    outside = None
    if layout == "offset":
        shape = (4097,)
        big = backend.full((4098,), np.nan, dtype)
        out, outside = big[1:], (slice(0, 1),)
    elif layout == "strided":
        shape = (37, 41)
        big = backend.full((37, 82), np.nan, dtype)
        out, outside = big[:, ::2], (slice(None), slice(1, None, 2))
    elif layout == "transposed":
        shape = (37, 41)
        big = backend.full((41, 37), np.nan, dtype)
        out = big.T
    else:
        shape = (37, 41)
        big = out = backend.full(shape, np.nan, dtype)
    x = rand(shape, dtype, 50, 2.0)
    b = rand(shape[-1:], dtype, 51, 0.5)
    got = call(backend, backend.asarray(x), backend.asarray(b), "none", launches, x, b, dtype, out=out)
    assert not np.isnan(got).any()
    if outside is not None:
        assert np.isnan(backend.to_numpy(big)[outside]).all()


@approx_param
def test_out_is_x(backend, approximate, launches):
    x = rand((1000,), F32, 60, 2.0)
    b = rand((1000,), F32, 61, 0.5)
    dx = backend.asarray(x)
    call(backend, dx, backend.asarray(b), approximate, launches, x, b, F32, out=dx)


def test_out_is_bias(backend, launches):
    x = rand((1000,), F64, 62, 2.0)
    b = rand((1000,), F64, 63, 0.5)
    db = backend.asarray(b)
    call(backend, backend.asarray(x), db, "tanh", launches, x, b, F64, out=db)


def test_out_shifted_overlap(backend, launches):
    """out overlaps x shifted by one element: as if computed into a temporary."""
    buf0 = rand((4098,), F32, 64, 2.0)
    buf = backend.asarray(buf0)
    x, out = buf[:-1], buf[1:]
    b = rand((4097,), F32, 65, 0.5)
    call(backend, x, backend.asarray(b), "none", launches, buf0[:-1], b, F32, out=out)
    assert backend.to_numpy(buf)[0] == buf0[0]


# ----------------------------------------------------------------------- empty
EMPTY = [((0,), (0,)), ((0, 3), (3,)), ((3, 0), (3, 1)), ((0,), "scalar"), ((2, 0, 4), (4,))]


@pytest.mark.parametrize("xs, bs", EMPTY, ids=lambda c: str(c).replace(" ", ""))
@pytest.mark.parametrize("with_out", [False, True])
def test_empty(backend, xs, bs, with_out, launches):
    x = rand(xs, F32, 70)
    b = 0.5 if bs == "scalar" else rand(bs, F32, 71)
    db = b if bs == "scalar" else backend.asarray(b)
    shape = np.broadcast_shapes(xs, np.shape(b))
    out = backend.full(shape, 0, F32) if with_out else None
    call(backend, backend.asarray(x), db, "none", launches, x, b, F32, out=out)
    assert launches == []


# ---------------------------------------------------------------------- errors
@pytest.mark.parametrize("bad", ["exact", "Tanh", "NONE", "", None, "sigmoid", True],
                         ids=lambda b: repr(b))
def test_bad_approximate(backend, bad, launches):
    x = backend.asarray(rand((5, 4), F32, 80))
    b = backend.asarray(rand((4,), F32, 81))
    with pytest.raises(ValueError) as exc:
        cufuse.bias_gelu(x, b, bad)
    msg = str(exc.value)
    assert "none" in msg and "tanh" in msg, msg
    with pytest.raises(ValueError):
        cufuse.bias_gelu(x, b, approximate=bad)
    assert launches == []


@pytest.mark.parametrize("bad", [np.int32, np.int64, np.uint8, np.bool_, np.complex64],
                         ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("position", ["x", "bias"])
def test_non_float_dtype(backend, bad, position, launches):
    good = backend.asarray(rand((4, 5), F32, 82))
    wrong = backend.asarray(np.ones((4, 5), dtype=bad))
    args = (wrong, good) if position == "x" else (good, wrong)
    with pytest.raises(TypeError):
        cufuse.bias_gelu(*args)
    assert launches == []


def test_shapes_do_not_broadcast(backend, launches):
    x = backend.asarray(rand((3, 4), F32, 83))
    b = backend.asarray(rand((5,), F32, 84))
    with pytest.raises(ValueError):
        cufuse.bias_gelu(x, b)
    assert launches == []


@pytest.mark.parametrize("shape", [(5, 4), (4, 5, 1), (20,), ()], ids=str)
def test_out_wrong_shape(backend, shape, launches):
    x = backend.asarray(rand((4, 5), F32, 85))
    out = backend.full(shape, np.nan, F32)
    with pytest.raises(ValueError):
        cufuse.bias_gelu(x, 0.5, out=out)
    assert np.isnan(backend.to_numpy(out)).all()
    assert launches == []


@pytest.mark.parametrize("xdt, out_dtype", [(F32, F16), (F32, F64), (F32, np.dtype(np.int32)), (F16, F32),
                                             (F64, F32)], ids=lambda d: d.name)
def test_out_wrong_dtype(backend, xdt, out_dtype, launches):
    x = backend.asarray(rand((4, 5), xdt, 86))
    out = backend.asarray(np.zeros((4, 5), out_dtype))
    with pytest.raises(TypeError):
        cufuse.bias_gelu(x, 0.5, out=out)
    assert launches == []


OTHER_KIND = {"numpy": "torch_cpu", "torch_cpu": "numpy", "cupy": "numpy", "torch_cuda": "cupy"}


def test_out_wrong_kind(backend, launches):
    other = Backend(OTHER_KIND[backend.name])
    x = backend.asarray(rand((4, 5), F32, 87))
    out = other.full((4, 5), np.nan, F32)
    with pytest.raises(TypeError):
        cufuse.bias_gelu(x, 0.5, out=out)
    assert np.isnan(other.to_numpy(out)).all()
    assert launches == []


def test_mixed_kinds(launches):
    pytest.importorskip("torch")
    a, t = Backend("numpy"), Backend("torch_cpu")
    with pytest.raises(TypeError):
        cufuse.bias_gelu(a.asarray(rand((6,), F32, 88)), t.asarray(rand((6,), F32, 89)))
    assert launches == []


# ------------------------------------------------- GPU and fallback agree
@pytest.mark.cuda
@dtype_param
@approx_param
def test_gpu_matches_fallback(dtype, approximate):
    import cupy as cp
    x = rand((1000, 257), dtype, 90, 3.0)
    b = rand((257,), dtype, 91, 0.5)
    cpu = cufuse.bias_gelu(x, b, approximate)
    gpu = cp.asnumpy(cufuse.bias_gelu(cp.asarray(x), cp.asarray(b), approximate))
    rtol, atol = TOL[dtype]
    np.testing.assert_allclose(gpu.astype(np.float64), cpu.astype(np.float64), rtol=2 * rtol, atol=2 * atol)
    ref = bias_gelu_ref(x, b, approximate, dtype)
    assert_close_tol(gpu, ref, dtype)
    assert_close_tol(cpu, ref, dtype)


@pytest.mark.parametrize("name", ["erf", "erfc"])
def test_erf_without_scipy_matches_math(name):
    """The NumPy path's erf / erfc without SciPy (Cody's rational
    approximations, cufuse/ops/elementwise.py _erf_cody) against math's, an
    independent implementation: within 8 float64 ulps wherever the result is
    a normal number, within 1e-300 below, the same at 0, ±inf and NaN."""
    from cufuse.ops.elementwise import _erf_cody
    rng = np.random.default_rng(46)
    edges = [0.0, -0.0, 1e-300, -1e-17, 0.46875, -0.46875, np.nextafter(0.46875, 1.0), 4.0, -4.0,
             np.nextafter(4.0, 5.0), 26.5, 27.0, 27.29, 27.31, -27.5, 1e10, np.inf, -np.inf, np.nan]
    x = np.concatenate([rng.standard_normal(20000) * 3, rng.uniform(-30, 30, 20000), np.linspace(-6, 6, 2001),
                        np.linspace(25, 28, 301), edges])
    got = _erf_cody(x, name == "erfc")
    want = np.array([getattr(math, name)(v) for v in x])
    assert got.dtype == np.float64
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    normal = np.abs(want) >= np.finfo(np.float64).tiny
    ulps = np.abs(got - want)[normal] / np.spacing(np.abs(want[normal]))
    assert ulps.max() <= 8, (ulps.max(), x[normal][np.argmax(ulps)])
    small = ~normal & ~np.isnan(want)
    assert np.abs(got[small] - want[small]).max() <= 1e-300
