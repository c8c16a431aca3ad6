"""bfloat16 in every op and in cufuse.fuse, on every backend (NumPy arrays of
``ml_dtypes.bfloat16``, CuPy arrays, torch tensors), against the float64
references of the other test files (written independently of cufuse).

bfloat16 is computed in float32 and rounded once, so a result may sit one
bfloat16 ulp (at most 2**-7 of its value) from the float64 reference rounded
to bfloat16. Tolerances, stated once (rtol, atol):
* ONE_ROUNDING: 1e-2 relative (one ulp, 7.8e-3, plus float32 noise).
* NORM: the same, atol 1e-5 for outputs near 0 (t * w + b cancelling; the
  float32 statistics are off by ~1e-6 relative).
* GELU: atol 1e-6 for the tanh form's left tail, where 1 + tanh cancels in
  float32 (about 6e-8 absolute at v = -5; float16's atol covers it too).
* FLOAT32_RESULT: float32 results of bfloat16 data (sum_squared with
  dtype=float32): float32 accumulation over rows up to 70000 terms.
Quantize codes are exact (the float32 arithmetic of the reference).
"""
from __future__ import annotations

import numpy as np
import pytest

import cufuse

from _reference import Backend, check_kind, rand, reference
from _reference_fused import bias_gelu_ref, dequantize_ref, dropout_keep_mask, gelu64, quantize_ref
from _reference_norm import (layer_norm_ref, log_softmax_ref, mean_abs_ref, rms_norm_ref, softmax_ref,
                             sum_squared_ref)

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)

ONE_ROUNDING = (1e-2, 1e-30)
NORM = (1e-2, 1e-5)
GELU = (1e-2, 1e-6)
FLOAT32_RESULT = (1e-4, 1e-30)

BACKENDS = [pytest.param("numpy", id="numpy"), pytest.param("torch_cpu", id="torch_cpu"),
            pytest.param("cupy", id="cupy", marks=pytest.mark.cuda),
            pytest.param("torch_cuda", id="torch_cuda", marks=pytest.mark.cuda)]
SIZES = [0, 1, 7, 8, 9, 33, 1000]


@pytest.fixture(params=BACKENDS)
def bk(request):
    return Backend(request.param)


def bf(x):
    return np.asarray(x).astype(BF16)


def assert_bf16(got, ref, tol=ONE_ROUNDING, dtype=BF16):
    """``got`` (NumPy, ``dtype``) against the float64 ``ref`` rounded to ``dtype``."""
    assert got.dtype == dtype, f"result dtype {got.dtype}, expected {dtype}"
    assert got.shape == ref.shape, f"shape {got.shape}, expected {ref.shape}"
    with np.errstate(all="ignore"):
        expected = np.asarray(ref, dtype=np.float64).astype(dtype).astype(np.float64)
    g = got.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(expected), err_msg="NaN positions differ")
    np.testing.assert_array_equal(np.isinf(g) * np.sign(g), np.isinf(expected) * np.sign(expected),
                                  err_msg="inf positions differ")
    fin = np.isfinite(expected)
    np.testing.assert_allclose(g[fin], expected[fin], rtol=tol[0], atol=tol[1])


def views(bk, shape, seed):
    """(name, array in the backend's kind, its NumPy values): contiguous, a
    strided view, a view offset by one element (misaligned for 16-byte packs)
    and, where the kind has them, negative strides."""
    base = bf(rand((shape[0], 2 * shape[1] + 2), F32, seed))
    arr = bk.asarray(base)
    out = [("contiguous", bk.asarray(base[:, :shape[1]].copy()), base[:, :shape[1]]),
           ("strided", arr[:, :2 * shape[1]:2], base[:, :2 * shape[1]:2]),
           ("offset", arr[:, 1:shape[1] + 1], base[:, 1:shape[1] + 1])]
    if bk.negative_strides:
        out.append(("reversed", arr[:, shape[1] - 1::-1][:, :shape[1]], base[:, shape[1] - 1::-1][:, :shape[1]]))
    return out


# ------------------------------------------------------------- elementwise
@pytest.mark.parametrize("op", ["add_relu", "mul_tanh", "add_mul_exp", "fma"])
@pytest.mark.parametrize("n", SIZES)
def test_core_ops(bk, op, n):
    arity = 3 if op == "fma" else 2
    scale = 0.5 if op == "add_mul_exp" else 1.0
    xs = [bf(rand((n,), F32, 10 + k, scale)) for k in range(arity)]
    res = getattr(cufuse, op)(*[bk.asarray(x) for x in xs])
    check_kind(bk, res, (n,), BF16)
    assert_bf16(bk.to_numpy(res), reference(op, xs, BF16))


@pytest.mark.parametrize("op", ["add_relu", "fma"])
def test_views_broadcast_and_scalars(bk, op):
    """Strided, offset and reversed views, a broadcast row, Python and NumPy
    scalars (a Python float stays bfloat16; a float32 array widens)."""
    for what, x, xv in views(bk, (5, 37), 1):
        row = bf(rand((37,), F32, 2))
        args = (x, bk.asarray(row), 0.75) if op == "fma" else (x, bk.asarray(row))
        vals = (xv, row, 0.75) if op == "fma" else (xv, row)
        res = getattr(cufuse, op)(*args)
        check_kind(bk, res, (5, 37), BF16)
        assert_bf16(bk.to_numpy(res), reference(op, vals, BF16))
    x = bf(rand((4, 9), F32, 3))
    res = cufuse.add_relu(bk.asarray(x), 0.3)
    assert_bf16(bk.to_numpy(res), reference("add_relu", [x, 0.3], BF16))
    res = cufuse.add_relu(bk.asarray(x), bk.asarray(x.astype(F32)))
    check_kind(bk, res, (4, 9), F32)
    assert_bf16(bk.to_numpy(res), reference("add_relu", [x, x.astype(F32)], F32), FLOAT32_RESULT, F32)


def test_bfloat16_with_float16_is_float32(bk):
    """bfloat16 and float16 have no common 16-bit type: float32, as in torch."""
    x, y = bf(rand((3, 8), F32, 4)), rand((3, 8), F16, 5)
    res = cufuse.add_relu(bk.asarray(x), bk.asarray(y))
    check_kind(bk, res, (3, 8), F32)
    assert_bf16(bk.to_numpy(res), reference("add_relu", [x, y], F32), FLOAT32_RESULT, F32)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_zero_dim_float16_with_bfloat16_tensor(device):
    """torch: a zero-dim float16 tensor with a bfloat16 tensor gives bfloat16,
    the float16 value rounded to bfloat16 first (float16 holds 3 more bits);
    the NumPy path of torch CPU tensors rounded it only when wider (found by
    the device fuzz run: 2 bfloat16 ulps apart where the sum cancels)."""
    torch = pytest.importorskip("torch")
    x = torch.tensor(0.1257, dtype=torch.float16, device=device)
    y = torch.from_numpy(rand((5, 7), F32, 6)).to(device, torch.bfloat16) - 0.125
    got = cufuse.add_relu(x, y)
    want = torch.relu(x.to(torch.bfloat16).float() + y.float()).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.cpu(), want.cpu())


def test_out_and_poisoned_output(bk):
    x, y = bf(rand((6, 40), F32, 6)), bf(rand((40,), F32, 7))
    out = bk.asarray(bf(np.full((6, 40), np.nan)))
    res = cufuse.mul_tanh(bk.asarray(x), bk.asarray(y), out=out)
    assert res is out
    assert_bf16(bk.to_numpy(out), reference("mul_tanh", [x, y], BF16))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu(bk, approximate):
    for what, x, xv in views(bk, (7, 65), 8):
        b = bf(rand((65,), F32, 9))
        res = cufuse.bias_gelu(x, bk.asarray(b), approximate=approximate)
        check_kind(bk, res, (7, 65), BF16)
        assert_bf16(bk.to_numpy(res), bias_gelu_ref(xv, b, approximate, BF16), GELU)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_gelu_dropout_mask_and_values(bk, p):
    """The mask is the spec's (32-bit lanes for bfloat16); kept values are
    gelu(x) / (1 - p) rounded once; dropped ones exactly 0."""
    x = bf(rand((33, 129), F32, 11))
    res = bk.to_numpy(cufuse.gelu_dropout(bk.asarray(x), p, seed=1234))
    assert res.dtype == BF16
    keep = dropout_keep_mask(x.shape, 1234, p, BF16)
    np.testing.assert_array_equal(res.astype(np.float64) != 0, keep & (gelu64(x.astype(np.float64)) != 0))
    expected = gelu64(x.astype(np.float64)) * np.float64(np.float32(1.0 / (1.0 - p)))
    assert_bf16(res, np.where(keep, expected, 0.0), GELU)


# ------------------------------------------------------------------- norms
ROWS = [(3, 1), (2, 7), (5, 768), (3, 4097), (2, 40000), (2, 140000)]


@pytest.mark.parametrize("op", ["layer_norm", "layer_norm_relu", "rms_norm"])
@pytest.mark.parametrize("rows,cols", ROWS)
def test_norms(bk, op, rows, cols):
    x = bf(rand((rows, cols), F32, 20, 2.0) + 0.5)
    w, b = bf(rand((cols,), F32, 21)), bf(rand((cols,), F32, 22))
    kw = {"weight": bk.asarray(w)}
    if op != "rms_norm":
        kw["bias"] = bk.asarray(b)
        ref = (layer_norm_ref if op == "layer_norm" else
               lambda *a: np.maximum(layer_norm_ref(*a), 0.0))(x, cols, w, b)
    else:
        ref = rms_norm_ref(x, cols, w)
    res = getattr(cufuse, op)(bk.asarray(x), cols, **kw)
    check_kind(bk, res, (rows, cols), BF16)
    assert_bf16(bk.to_numpy(res), ref, NORM)


def test_norm_views_and_no_affine(bk):
    for what, x, xv in views(bk, (4, 300), 23):
        assert_bf16(bk.to_numpy(cufuse.layer_norm(x, 300)), layer_norm_ref(xv, 300), NORM)
        assert_bf16(bk.to_numpy(cufuse.rms_norm(x, (300,))), rms_norm_ref(xv, 300), NORM)


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("rows,cols", ROWS)
def test_softmax(bk, op, rows, cols):
    x = bf(rand((rows, cols), F32, 30, 3.0))
    ref = (softmax_ref if op == "softmax" else log_softmax_ref)(x)
    res = getattr(cufuse, op)(bk.asarray(x))
    check_kind(bk, res, (rows, cols), BF16)
    assert_bf16(bk.to_numpy(res), ref, NORM)
    xt = bf(rand((cols, 3), F32, 31, 3.0))  # another axis
    res = getattr(cufuse, op)(bk.asarray(xt), axis=0)
    assert_bf16(bk.to_numpy(res), (softmax_ref if op == "softmax" else log_softmax_ref)(xt, axis=0), NORM)


# -------------------------------------------------------------- reductions
@pytest.mark.parametrize("op", ["sum_squared", "mean_abs"])
@pytest.mark.parametrize("shape,axis", [((0,), -1), ((1,), -1), ((9, 33), -1), ((9, 33), 0), ((4, 5, 6), None),
                                        ((3, 70000), -1), ((5000, 7), 0), ((6, 5, 4), (0, 2))])
def test_reductions(bk, op, shape, axis):
    x = bf(rand(shape, F32, 40))
    ref = (sum_squared_ref if op == "sum_squared" else mean_abs_ref)(x, axis)
    fn = getattr(cufuse, op)
    res = bk.to_numpy(fn(bk.asarray(x), axis=axis))
    assert_bf16(res, ref)
    res32 = bk.to_numpy(fn(bk.asarray(x), axis=axis, dtype=np.float32))
    assert_bf16(res32, ref, FLOAT32_RESULT, F32)
    xf = rand(shape, F32, 41)  # float32 data summed into a bfloat16 result
    assert_bf16(bk.to_numpy(fn(bk.asarray(xf), axis=axis, dtype=BF16)),
                (sum_squared_ref if op == "sum_squared" else mean_abs_ref)(xf, axis))


def test_reduction_dtype_spellings(bk):
    x = bf(rand((4, 10), F32, 42))
    spellings = [BF16, "bfloat16", ml_dtypes.bfloat16]
    if bk.is_torch:
        spellings.append(bk.torch.bfloat16)
    for d in spellings:
        assert_bf16(bk.to_numpy(cufuse.sum_squared(bk.asarray(x.astype(F32)), dtype=d)), sum_squared_ref(x))


# ---------------------------------------------------------------- quantize
@pytest.mark.parametrize("n", [1, 9, 1000])
def test_quantize_roundtrip(bk, n):
    x = bf(rand((4, n), F32, 50, 3.0))
    q = cufuse.quantize_int8(bk.asarray(x), 0.05, 3.0)
    np.testing.assert_array_equal(bk.to_numpy(q), quantize_ref(x, 0.05, 3.0))
    sc = np.linspace(0.02, 0.1, 4)
    qc = cufuse.quantize_int8(bk.asarray(x), sc, axis=0)
    np.testing.assert_array_equal(bk.to_numpy(qc), quantize_ref(x, sc, 0.0, axis=0))
    d = cufuse.dequantize_int8(q, 0.05, 3.0, dtype=BF16)
    check_kind(bk, d, (4, n), BF16)
    assert_bf16(bk.to_numpy(d), dequantize_ref(bk.to_numpy(q), 0.05, 3.0))


# ------------------------------------------------------------ cufuse.fuse
@cufuse.fuse
def _swish_scale(a, b):
    return a / (1.0 + np.exp(-a)) * b


@cufuse.fuse
def _sq_sum(a):
    return (a * a).sum(axis=-1)


@cufuse.fuse
def _round_trip(a):
    return (a * 3.0).astype(ml_dtypes.bfloat16) * 2.0  # astype rounds to bfloat16 there


def test_fuse(bk):
    x, y = bf(rand((9, 130), F32, 60)), bf(rand((130,), F32, 61))
    a, b = x.astype(np.float64), y.astype(np.float64)
    res = _swish_scale(bk.asarray(x), bk.asarray(y))
    check_kind(bk, res, (9, 130), BF16)
    assert_bf16(bk.to_numpy(res), a / (1.0 + np.exp(-a)) * b)
    assert_bf16(bk.to_numpy(_sq_sum(bk.asarray(x))), (a * a).sum(axis=-1))
    r = bk.to_numpy(_round_trip(bk.asarray(x)))
    np.testing.assert_array_equal(r.astype(np.float64), (a * 3.0).astype(BF16).astype(np.float64) * 2.0)
    for what, v, vv in views(bk, (5, 33), 62):
        w = vv.astype(np.float64)
        assert_bf16(bk.to_numpy(_swish_scale(v, 2.0)), w / (1.0 + np.exp(-w)) * 2.0)


def test_fuse_promotion(bk):
    """bfloat16 with float16 gives float32; with int8 stays bfloat16; with
    int16 float32 under NumPy's rules (as float16), bfloat16 under torch's."""
    x = bf(rand((20,), F32, 63))
    mixed = _swish_scale(bk.asarray(x), bk.asarray(rand((20,), F16, 64)))
    check_kind(bk, mixed, (20,), F32)
    i8 = np.arange(-10, 10, dtype=np.int8)
    res = _swish_scale(bk.asarray(x), bk.asarray(i8))
    check_kind(bk, res, (20,), BF16)
    a = x.astype(np.float64)
    assert_bf16(bk.to_numpy(res), a / (1.0 + np.exp(-a)) * i8)
    check_kind(bk, _swish_scale(bk.asarray(x), bk.asarray(i8.astype(np.int16))), (20,), BF16 if bk.is_torch else F32)


# ------------------------------------------------------------------ interop
def test_interop_round_trip():
    torch = pytest.importorskip("torch")
    t = torch.randn(3, 5).to(torch.bfloat16)
    a = cufuse.from_torch(t)
    assert a.dtype == BF16
    np.testing.assert_array_equal(a.astype(np.float32), t.float().numpy())
    back = cufuse.to_torch(a)
    assert back.dtype == torch.bfloat16 and torch.equal(back, t)


@pytest.mark.cuda
def test_interop_round_trip_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    t = torch.randn(3, 5, device="cuda").to(torch.bfloat16)
    a = cufuse.from_torch(t)
    assert a.dtype == BF16 and a.data.ptr == t.data_ptr()
    back = cufuse.to_torch(cufuse.add_relu(a, a))
    assert back.dtype == torch.bfloat16
    torch.testing.assert_close(back, torch.relu(t + t))
