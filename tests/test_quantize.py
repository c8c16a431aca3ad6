"""cufuse.quantize_int8 and cufuse.dequantize_int8 on every backend.

quantize: EXACT integer equality with clip(rint(x / scale + zp), -128, 127)
computed in float32 (float16 / float32 x, scale and zp rounded to float32) or
float64 (float64 x), rounding half to even, true division; NaN -> 0,
+inf -> 127, -inf -> -128 (tests/_reference_fused.py: quantize_ref).

dequantize: (q - zp) * scale in float32 (float64 when dtype is float64),
result in dtype; against the float64 reference within ``TOL`` of
tests/_reference.py, and bit for bit against the formula evaluated in the
compute dtype (NumPy's float32 arithmetic is IEEE-rounded like the GPU's).
"""
from __future__ import annotations

import math
import re

import numpy as np
import pytest

import cufuse

from _reference import DTYPES, Backend, check_kind, cpu_runs_one, gpu_count, rand
from _reference_fused import (F16, F32, F64, I8, assert_close_tol, dequantize_ref, quant_compute_dtype,
                              quantize_ref)

dtype_param = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
OTHER_KIND = {"numpy": "torch_cpu", "torch_cpu": "numpy", "cupy": "numpy", "torch_cuda": "cupy"}


def quantize(backend, x, scale, zp, axis, launches, np_x, np_scale=None, np_zp=None, out=None):
    """Run quantize_int8, check kind / shape / dtype and EXACT values; return the NumPy result."""
    np_scale = scale if np_scale is None else np_scale
    np_zp = zp if np_zp is None else np_zp
    kw = {} if out is None else {"out": out}
    res = cufuse.quantize_int8(x, scale, zp, axis, **kw)
    if out is not None:
        assert res is out
    check_kind(backend, res, np_x.shape, I8)
    got = backend.to_numpy(res)
    expected = quantize_ref(np_x, np_scale, np_zp, axis)
    if not np.array_equal(got, expected):
        bad = np.flatnonzero(got.ravel() != expected.ravel())
        i = bad[0]
        raise AssertionError(
            f"{bad.size} of {got.size} values differ; first at flat index {i}: x={np_x.ravel()[i]!r} "
            f"got {got.ravel()[i]} expected {expected.ravel()[i]}")
    if np_x.size == 0:
        assert launches == []
    return got


def value_pattern(v):
    """A regex finding ``v`` in a message, however it is formatted."""
    v = float(v)
    if math.isnan(v):
        return r"(?i)nan"
    if math.isinf(v):
        return r"(?i)-inf" if v < 0 else r"(?i)inf"
    s = f"{v:g}"
    return rf"(?<![\d.]){re.escape(s)}(\.0*)?(?![\d.]*[1-9])"


# =================================================================== quantize
# ------------------------------------------------------------------ per-tensor
SCALES = [(0.1, 0.0), (0.0731, 3.0), (np.float32(0.05), -2.5), (np.float64(0.37), np.float64(0.3)),
          (2.0, 0.0), (1, 0), (0.5, 7), (1e-3, -100.25), (123.456, 0.0)]
SHAPES = [(1,), (7,), (4097,), (33, 65), (3, 5, 7)]


@dtype_param
@pytest.mark.parametrize("scale, zp", SCALES, ids=lambda v: repr(v))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_quantize_per_tensor(backend, dtype, scale, zp, shape, launches):
    # values spread well beyond the clamp range for most scales
    x = rand(shape, dtype, 11, 80.0 * float(scale))
    quantize(backend, backend.asarray(x), scale, zp, None, launches, x)


@dtype_param
def test_quantize_defaults(backend, dtype):
    x = rand((100,), dtype, 12, 3.0)
    res = cufuse.quantize_int8(backend.asarray(x), 0.05)
    np.testing.assert_array_equal(backend.to_numpy(res), quantize_ref(x, 0.05))
    res = cufuse.quantize_int8(backend.asarray(x), scale=0.05, zero_point=1.5, axis=None)
    np.testing.assert_array_equal(backend.to_numpy(res), quantize_ref(x, 0.05, 1.5))


@pytest.mark.parametrize("n", [1_000_003])
@dtype_param
def test_quantize_large(backend, dtype, n, launches):
    x = rand((n,), dtype, 13, 10.0)
    quantize(backend, backend.asarray(x), 0.0625, 0.0, None, launches, x)
    quantize(backend, backend.asarray(x), 0.07, 1.0, None, launches, x)


# -------------------------------------------------------------------- ties
def test_ties_reference_itself():
    """The reference rounds half to even and clamps (a hand-written answer)."""
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 126.5, 127.5, -127.5, -128.5, 200.0, -200.0])
    want = np.array([0, 2, 2, 0, -2, -2, 4, 126, 127, -128, -128, 127, -128], dtype=np.int8)
    for dt in DTYPES:
        np.testing.assert_array_equal(quantize_ref(x.astype(dt), 1.0), want)


@dtype_param
@pytest.mark.parametrize("scale", [1.0, 0.25, 2.0 ** -3, 4.0])
@pytest.mark.parametrize("zp", [0.0, 5.0, -3.0, 0.5, -0.25])
def test_quantize_exact_ties(backend, dtype, scale, zp, launches):
    """x = (k + 1/2) * scale with scale a power of two: x / scale is exact, and
    so is + zp, so every value with an integral zp is an exact tie; rint
    rounds it to even, never away from zero."""
    k = np.arange(-140, 141, dtype=np.float64)
    x64 = (k + 0.5) * scale
    x = x64.astype(dtype)
    assert np.array_equal(x.astype(np.float64), x64)  # representable: the ties are real
    got = quantize(backend, backend.asarray(x), scale, zp, None, launches, x)
    v = k + 0.5 + zp
    want = np.clip(np.where(v - np.floor(v) == 0.5,
                            2 * np.round(v / 2),          # a tie: the even neighbour
                            np.round(v)), -128, 127)
    np.testing.assert_array_equal(got, want.astype(np.int8))
    if zp == int(zp):
        assert (got[np.abs(v) < 127] % 2 == 0).all()


@pytest.mark.parametrize("dtype", [F32, F64], ids=lambda d: d.name)
@pytest.mark.parametrize("scale", [0.1, 0.07, 1 / 3, 0.0123, 0.37])
def test_quantize_true_division_near_ties(backend, dtype, scale, launches):
    """Values at and next to (k + 1/2) * scale for a scale that is not a power
    of two: for some of them x * (1 / scale) rounds differently from
    x / scale (asserted), so a reciprocal multiply fails here."""
    cdt = quant_compute_dtype(dtype)
    s = cdt.type(scale)
    k = np.arange(-128, 128, dtype=np.float64)
    centre = ((k + 0.5) * float(s)).astype(dtype)
    cand = np.concatenate([centre, np.nextafter(centre, dtype.type(np.inf)),
                           np.nextafter(centre, dtype.type(-np.inf))])
    recip = np.clip(np.rint(cand.astype(cdt) * (cdt.type(1) / s)), -128, 127).astype(np.int8)
    assert (recip != quantize_ref(cand, scale)).any()   # the test is sensitive
    quantize(backend, backend.asarray(cand), scale, 0.0, None, launches, cand)


# ------------------------------------------------------------ special values
@dtype_param
@pytest.mark.parametrize("scale, zp", [(0.1, 0.0), (1.0, 0.0), (2.0 ** -4, 3.0), (1e-30, 0.0), (1e30, 0.0)],
                         ids=lambda v: repr(v))
def test_quantize_specials(backend, dtype, scale, zp, launches):
    """NaN -> 0, +inf -> 127, -inf -> -128, beyond the clamp -> the bound; -0
    and values that round to 0 from either side -> 0; x / scale overflowing
    to inf -> the bound."""
    fmax = float(np.finfo(dtype).max)
    vals = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e4, -1e4, fmax, -fmax,
                     127.4 * scale, 127.6 * scale, -128.4 * scale, -128.6 * scale,
                     0.3 * scale, -0.3 * scale, 0.5 * scale, -0.5 * scale], dtype=np.float64)
    with np.errstate(over="ignore"):
        x = vals.astype(dtype)
    got = quantize(backend, backend.asarray(x), scale, zp, None, launches, x)
    assert got[0] == 0 and got[1] == 127 and got[2] == -128
    assert got[5] == 127 or scale >= 1e30
    assert got[6] == -128 or scale >= 1e30


@pytest.mark.parametrize("dtype", [F16, F32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("axis", [None, 0, -1], ids=lambda a: f"axis={a}")
def test_quantize_random_bits(backend, dtype, axis, launches):
    """Every float16 bit pattern, or 2**20 random float32 ones (every exponent,
    subnormals, NaN payloads, infinities), per tensor and per channel: the
    rounding and clamping of any quotient, not only of the usual range."""
    if dtype == F16:
        bits = np.arange(1 << 16, dtype=np.uint16)
        np.random.default_rng(90).shuffle(bits)
    else:
        bits = np.random.default_rng(91).integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    x = bits.view(dtype).reshape(-1, 64)
    if axis is None:
        scale, zp = 0.37, 0.5
    else:
        rng = np.random.default_rng(92)
        scale = rng.uniform(0.01, 3.0, x.shape[axis]).astype(F32)
        zp = rng.uniform(-4.0, 4.0, x.shape[axis]).astype(F32)
    bx = backend.asarray(x)
    args = (scale, zp) if axis is None else (backend.asarray(scale), backend.asarray(zp))
    quantize(backend, bx, *args, axis, launches, x, scale, zp)


# float32 scales at both ends of the range where the kernels multiply by the
# reciprocal (kernels/common.cuh: math::reciprocal_ok, [2**-60, 2**60]) and
# just outside it, where they divide; 2**127, whose reciprocal is subnormal;
# 1e-40, itself subnormal; and ordinary ones, 16 in all (a pack of channels).
_EDGE = [2.0 ** -60, float(np.nextafter(np.float32(2.0 ** -60), np.float32(0))), 2.0 ** 60,
         float(np.nextafter(np.float32(2.0 ** 60), np.float32(np.inf))), 2.0 ** 127, 2.0 ** -126, 1.7e-10, 3.3e12,
         1e-40, 0.37, 3.0, 0.013, 2.0 ** -20, 1e5, 7.5e-3, 1.0]


@pytest.mark.parametrize("dtype", [F16, F32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("axis", [None, 0, -1], ids=lambda a: f"axis={a}")
def test_quantize_scale_range(backend, dtype, axis, launches):
    """Scales around the reciprocal range's ends, per tensor (one launch per
    scale) and per channel (every scale in one launch; axis 0 with one scale
    per 16-element pack, the last axis with 16 consecutive channels): for
    each scale k * scale for k around the clamp bounds and ties (in x's dtype,
    which rounds some of them to 0 or inf), 2**14 random bit patterns, NaN,
    infinities and subnormals, exact against the NumPy reference."""
    rng = np.random.default_rng(93)
    scales = np.array(_EDGE, dtype=F32)
    k = np.arange(-130, 131, dtype=np.float64) + rng.choice([0.0, 0.5, 0.25], 261)
    if dtype == F16:
        rand_bits = rng.integers(0, 1 << 16, 1 << 14, dtype=np.uint64).astype(np.uint16).view(F16)
    else:
        rand_bits = rng.integers(0, 1 << 32, 1 << 14, dtype=np.uint64).astype(np.uint32).view(F32)
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 3e38, -3e38, 65504.0, 1e-38, 5e-39, -1e-45],
                        np.float64)
    with np.errstate(over="ignore"):
        rows = [np.concatenate([(k * float(sc)).astype(dtype), rand_bits, specials.astype(dtype)])
                for sc in scales]
    x = np.stack(rows)                      # one row per scale, 16656 = 16 * 1041 long
    zp = rng.uniform(-3.0, 3.0, len(scales)).round(1).astype(F32)
    if axis is None:
        for i, sc in enumerate(scales):
            quantize(backend, backend.asarray(x[i]), float(sc), float(zp[i]), None, launches, x[i])
        return
    xa = x if axis == 0 else np.ascontiguousarray(x.T)
    quantize(backend, backend.asarray(xa), backend.asarray(scales), backend.asarray(zp), axis, launches, xa,
             scales, zp)


@pytest.mark.parametrize("axis", [None, 0, -1], ids=lambda a: f"axis={a}")
def test_quantize_large_zero_point(backend, axis, launches):
    """|zero point| beyond 2**20 (the kernels then divide): quotients past
    2**30 that a large negative zero point brings back into the int8 range."""
    s, zp = np.float32(1.7), np.float32(-1.5e9)
    centre = np.float32(-float(zp) * float(s))
    x = (centre + np.arange(-2000, 2000, dtype=np.float32) * np.float32(256.0)).astype(F32).reshape(10, 400)  # rows of 25 packs
    assert np.abs(quantize_ref(x, s, zp)).min() < 100        # codes inside the range: the test can fail
    if axis is None:
        quantize(backend, backend.asarray(x), float(s), float(zp), None, launches, x)
    else:
        n = x.shape[axis]
        sc, z = np.full(n, s, F32), np.full(n, zp, F32)
        quantize(backend, backend.asarray(x), backend.asarray(sc), backend.asarray(z), axis, launches, x, sc, z)


def test_quantize_nan_with_zero_point(backend, launches):
    x = np.array([np.nan, -np.nan, np.inf, -np.inf], F32)
    got = quantize(backend, backend.asarray(x), 0.5, 10.0, None, launches, x)
    np.testing.assert_array_equal(got, [0, 0, 127, -128])


# ------------------------------------------------------------------ layouts
VIEWS = ["transposed", "permuted_3d", "step", "step_2d", "offset", "sliced_2d", "negative_step"]


def make_view(backend, view, dtype, seed, scale):
    def dev(shape):
        return backend.asarray(rand(shape, dtype, seed, scale))

    if view == "transposed":
        return dev((65, 33)).T
    if view == "permuted_3d":
        x = dev((4, 5, 6))
        return x.permute(2, 0, 1) if backend.is_torch else x.transpose(2, 0, 1)
    if view == "step":
        return dev((2 * 4097,))[::2]
    if view == "step_2d":
        return dev((30, 50))[::3, ::2]
    if view == "offset":
        return dev((4098,))[1:]
    if view == "sliced_2d":
        return dev((40, 70))[:, 3:67]
    if view == "negative_step":
        if not backend.negative_strides:
            pytest.skip("torch tensors have no negative strides")
        return dev((4097,))[::-1]
    raise AssertionError(view)


@dtype_param
@pytest.mark.parametrize("view", VIEWS)
def test_quantize_views(backend, dtype, view, launches):
    x = make_view(backend, view, dtype, 20, 12.0)
    nx = backend.to_numpy(x)
    quantize(backend, x, 0.1, 1.0, None, launches, nx)


# --------------------------------------------------------------- per-channel
PER_CHANNEL = [((16, 33), 0), ((16, 33), 1), ((16, 33), -1), ((16, 33), -2), ((4, 5, 6), 0),
               ((4, 5, 6), 1), ((4, 5, 6), -2), ((4, 5, 6), 2), ((1000,), 0), ((3, 1, 4), 1)]
SCALE_KINDS = ["backend", "numpy", "list"]
ZP_KINDS = ["none", "scalar", "backend", "numpy"]


def channel_values(backend, kind, values):
    if kind == "numpy":
        return values
    if kind == "list":
        return [float(v) for v in values]
    return backend.asarray(values)


def per_channel_operands(backend, shape, axis, scale_kind, zp_kind, seed, scale_dtype=F32):
    n = shape[axis]
    rng = np.random.default_rng(seed)
    s = rng.uniform(0.01, 0.3, n).astype(scale_dtype)
    if scale_kind == "list":
        s = s.astype(np.float64)
    scale = channel_values(backend, scale_kind, s)
    if zp_kind == "none":
        return scale, s, 0.0, 0.0
    if zp_kind == "scalar":
        return scale, s, -3.5, -3.5
    z = np.round(rng.uniform(-20, 20, n), 1).astype(F32)
    return scale, s, channel_values(backend, zp_kind, z), z


@dtype_param
@pytest.mark.parametrize("shape, axis", PER_CHANNEL, ids=str)
@pytest.mark.parametrize("scale_kind", SCALE_KINDS)
@pytest.mark.parametrize("zp_kind", ZP_KINDS)
def test_quantize_per_channel(backend, dtype, shape, axis, scale_kind, zp_kind, launches):
    x = rand(shape, dtype, 30, 20.0)
    scale, ns, zp, nz = per_channel_operands(backend, shape, axis, scale_kind, zp_kind, 31)
    got = quantize(backend, backend.asarray(x), scale, zp, axis, launches, x, ns, nz)
    # per-channel really means per channel: channel c alone, per-tensor, gives the same
    c = shape[axis] // 2
    sub = np.take(x, [c], axis=axis)
    zc = nz if np.ndim(nz) == 0 else float(nz[c])
    np.testing.assert_array_equal(np.take(got, [c], axis=axis), quantize_ref(sub, float(ns[c]), zc))


@dtype_param
@pytest.mark.parametrize("scale_dtype", DTYPES, ids=lambda d: "scale_" + d.name)
def test_quantize_per_channel_scale_dtypes(backend, dtype, scale_dtype, launches):
    x = rand((9, 40), dtype, 32, 10.0)
    scale, ns, zp, nz = per_channel_operands(backend, (9, 40), 1, "backend", "numpy", 33, scale_dtype)
    quantize(backend, backend.asarray(x), scale, zp, 1, launches, x, ns, nz)


@dtype_param
@pytest.mark.parametrize("axis", [0, 1])
def test_quantize_per_channel_ties(backend, dtype, axis, launches):
    """Power-of-two scales per channel and exact ties in every channel."""
    n = 6
    s = 2.0 ** -np.arange(n)
    k = np.arange(-130, 131, dtype=np.float64)
    x64 = (k[None, :] + 0.5) * s[:, None]          # (channels, values)
    if axis == 1:
        x64 = x64.T
    x = x64.astype(dtype)
    assert np.array_equal(x.astype(np.float64), x64)
    got = quantize(backend, backend.asarray(x), s, 0.0, axis, launches, x)
    assert (got[np.abs(x64 / (s[:, None] if axis == 0 else s[None, :])) < 127] % 2 == 0).all()


@dtype_param
@pytest.mark.parametrize("view, axis", [("transposed", 0), ("transposed", 1), ("transposed", -1),
                                        ("step_2d", 0), ("step_2d", 1), ("sliced_2d", 1),
                                        ("permuted_3d", 1), ("permuted_3d", 0), ("permuted_3d", 2)])
def test_quantize_per_channel_views(backend, dtype, view, axis, launches):
    x = make_view(backend, view, dtype, 34, 12.0)
    nx = backend.to_numpy(x)
    rng = np.random.default_rng(35)
    s = rng.uniform(0.02, 0.2, nx.shape[axis]).astype(F32)
    z = np.round(rng.uniform(-5, 5, nx.shape[axis]), 2)
    quantize(backend, x, backend.asarray(s), z, axis, launches, nx, s, z)


@dtype_param
def test_quantize_per_channel_specials(backend, dtype, launches):
    x = np.array([[np.nan, np.inf, -np.inf, 0.0, 1e4, -1e4, 0.75]] * 3, dtype=dtype)
    s = np.array([0.5, 0.01, 2.0], F32)
    got = quantize(backend, backend.asarray(x), s, np.array([1.0, -2.0, 0.0]), 0, launches, x)
    np.testing.assert_array_equal(got[:, :3], [[0, 127, -128]] * 3)


# ---------------------------------------------------------------------- out=
@pytest.mark.parametrize("layout", ["contiguous", "strided", "transposed", "offset"])
@pytest.mark.parametrize("axis", [None, 1])
def test_quantize_out(backend, layout, axis, launches):
    outside = None
    shape = (37, 41)
    if layout == "offset":
        shape = (4097,)
        axis = None if axis is None else 0
        big = backend.full((4098,), 99, I8)
        out, outside = big[1:], (slice(0, 1),)
    elif layout == "strided":
        big = backend.full((37, 82), 99, I8)
        out, outside = big[:, ::2], (slice(None), slice(1, None, 2))
    elif layout == "transposed":
        big = backend.full((41, 37), 99, I8)
        out = big.T
    else:
        big = out = backend.full(shape, 99, I8)
    x = rand(shape, F32, 40, 30.0)
    if axis is None:
        s, ns = 0.1, 0.1
    else:
        ns = np.random.default_rng(41).uniform(0.05, 0.5, shape[axis]).astype(F32)
        s = backend.asarray(ns)
    quantize(backend, backend.asarray(x), s, 0.0, axis, launches, x, ns, out=out)
    if outside is not None:
        assert (backend.to_numpy(big)[outside] == 99).all()


# --------------------------------------------------------------------- empty
EMPTY = [((0,), None, 0), ((0, 3), None, 0), ((0, 3), 1, 3), ((3, 0), 0, 3), ((0, 3), 0, 0), ((2, 0, 4), -1, 4)]


@pytest.mark.parametrize("shape, axis, n", EMPTY, ids=str)
@pytest.mark.parametrize("with_out", [False, True])
def test_quantize_empty(backend, shape, axis, n, with_out, launches):
    x = np.zeros(shape, F32)
    scale = 0.5 if axis is None else np.full(n, 0.5, F32)
    out = backend.full(shape, 0, I8) if with_out else None
    quantize(backend, backend.asarray(x), scale, 0.0, axis, launches, x, out=out)
    assert launches == []


# -------------------------------------------------------------------- errors
@pytest.mark.parametrize("bad", [np.int8, np.int32, np.int64, np.uint8, np.bool_, np.complex64],
                         ids=lambda t: np.dtype(t).name)
def test_quantize_bad_x_dtype(backend, bad, launches):
    x = backend.asarray(np.ones((4, 5), dtype=bad))
    with pytest.raises(TypeError):
        cufuse.quantize_int8(x, 0.1)
    assert launches == []


@pytest.mark.parametrize("bad", [1.5, [1.0, 2.0], "x", None], ids=repr)
def test_quantize_x_not_an_array(bad):
    with pytest.raises(TypeError):
        cufuse.quantize_int8(bad, 0.1)


BAD_SCALES = [0.0, -0.0, -1.0, -1e-3, np.nan, np.inf, -np.inf, np.float32(0.0), np.float64(-2.5)]


@pytest.mark.parametrize("scale", BAD_SCALES, ids=repr)
def test_quantize_bad_scale(backend, scale, launches):
    x = backend.asarray(rand((4, 5), F32, 50))
    with pytest.raises(ValueError, match=value_pattern(scale)):
        cufuse.quantize_int8(x, scale)
    assert launches == []


@pytest.mark.parametrize("zp", [np.nan, np.inf, -np.inf, np.float32(np.nan)], ids=repr)
def test_quantize_bad_zero_point(backend, zp, launches):
    x = backend.asarray(rand((4, 5), F32, 51))
    with pytest.raises(ValueError, match=value_pattern(zp)):
        cufuse.quantize_int8(x, 0.1, zp)
    assert launches == []


@pytest.mark.parametrize("shape, axis", [((4, 5), 2), ((4, 5), -3), ((7,), 1), ((7,), -2), ((2, 3, 4), 3)], ids=str)
def test_quantize_axis_out_of_range(backend, shape, axis, launches):
    x = backend.asarray(rand(shape, F32, 52))
    with pytest.raises(ValueError):
        cufuse.quantize_int8(x, np.full(4, 0.1, F32), 0.0, axis)
    assert launches == []


@pytest.mark.parametrize("what", ["scale_short", "scale_long", "zp_short", "zp_long", "scale_list_short"])
def test_quantize_per_channel_wrong_length(backend, what, launches):
    x = backend.asarray(rand((4, 5), F32, 53))
    scale, zp = np.full(5, 0.1, F32), 0.0
    if what == "scale_short":
        scale = backend.asarray(np.full(4, 0.1, F32))
    elif what == "scale_long":
        scale = backend.asarray(np.full(6, 0.1, F32))
    elif what == "zp_short":
        zp = np.zeros(4, F32)
    elif what == "zp_long":
        zp = backend.asarray(np.zeros(6, F32))
    else:
        scale = [0.1] * 4
    with pytest.raises(ValueError):
        cufuse.quantize_int8(x, scale, zp, 1)
    assert launches == []


@pytest.mark.parametrize("bad", [np.int32, np.int64, np.int8, np.bool_], ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("kind", ["backend", "numpy"])
def test_quantize_per_channel_scale_not_float(backend, bad, kind, launches):
    x = backend.asarray(rand((4, 5), F32, 54))
    s = np.ones(5, dtype=bad)
    with pytest.raises(TypeError):
        cufuse.quantize_int8(x, backend.asarray(s) if kind == "backend" else s, 0.0, 1)
    assert launches == []


def test_quantize_per_channel_scale_2d(backend, launches):
    x = backend.asarray(rand((4, 5), F32, 55))
    with pytest.raises((ValueError, TypeError)):
        cufuse.quantize_int8(x, np.full((1, 5), 0.1, F32), 0.0, 1)
    assert launches == []


@pytest.mark.parametrize("shape, out_dtype", [((4, 5), np.int16), ((4, 5), np.uint8), ((4, 5), np.float32),
                                              ((4, 5), np.int32)], ids=str)
def test_quantize_out_wrong_dtype(backend, shape, out_dtype, launches):
    x = backend.asarray(rand((4, 5), F32, 56))
    out = backend.asarray(np.zeros(shape, out_dtype))
    with pytest.raises(TypeError):
        cufuse.quantize_int8(x, 0.1, out=out)
    assert launches == []


@pytest.mark.parametrize("shape", [(5, 4), (4, 5, 1), (20,), ()], ids=str)
def test_quantize_out_wrong_shape(backend, shape, launches):
    x = backend.asarray(rand((4, 5), F32, 57))
    out = backend.full(shape, 99, I8)
    with pytest.raises(ValueError):
        cufuse.quantize_int8(x, 0.1, out=out)
    assert (backend.to_numpy(out) == 99).all()
    assert launches == []


def test_quantize_out_wrong_kind(backend, launches):
    other = Backend(OTHER_KIND[backend.name])
    x = backend.asarray(rand((4, 5), F32, 58))
    out = other.full((4, 5), 99, I8)
    with pytest.raises(TypeError):
        cufuse.quantize_int8(x, 0.1, out=out)
    assert (other.to_numpy(out) == 99).all()
    assert launches == []


# ================================================================= dequantize
def all_int8(shape, seed):
    """int8 values covering -128..127 (all of them when there is room)."""
    n = math.prod(shape)
    v = np.arange(n, dtype=np.int64) % 256 - 128
    np.random.default_rng(seed).shuffle(v)
    return v.astype(np.int8).reshape(shape)


def dequantize(backend, q, scale, zp, axis, dtype, launches, np_q, np_scale=None, np_zp=None, out=None,
               pass_dtype=True):
    np_scale = scale if np_scale is None else np_scale
    np_zp = zp if np_zp is None else np_zp
    kw = {} if out is None else {"out": out}
    if pass_dtype:
        kw["dtype"] = dtype
    res = cufuse.dequantize_int8(q, scale, zp, axis, **kw)
    if out is not None:
        assert res is out
    check_kind(backend, res, np_q.shape, dtype)
    got = backend.to_numpy(res)
    ref = dequantize_ref(np_q, np_scale, np_zp, axis, dtype)
    assert_close_tol(got, ref, dtype)
    # bit for bit the formula in the compute dtype
    cdt = F64 if dtype == F64 else F32
    s = np.asarray(np_scale, np.float64).astype(cdt)
    z = np.asarray(np_zp, np.float64).astype(cdt)
    if axis is not None:
        bshape = [1] * np_q.ndim
        bshape[axis] = -1
        s = s.reshape(bshape) if s.ndim else s
        z = z.reshape(bshape) if z.ndim else z
    exact = ((np_q.astype(cdt) - z) * s).astype(dtype)
    np.testing.assert_array_equal(got, exact, err_msg="not (q - zero_point) * scale in the compute dtype")
    if np_q.size == 0:
        assert launches == []
    return got


@dtype_param
@pytest.mark.parametrize("scale, zp", SCALES, ids=lambda v: repr(v))
@pytest.mark.parametrize("shape", [(1,), (7,), (4097,), (33, 65), (3, 5, 7)], ids=str)
def test_dequantize_per_tensor(backend, dtype, scale, zp, shape, launches):
    q = all_int8(shape, 60)
    dequantize(backend, backend.asarray(q), scale, zp, None, dtype, launches, q)


def test_dequantize_default_dtype_is_float32(backend, launches):
    q = all_int8((300,), 61)
    dequantize(backend, backend.asarray(q), 0.05, 2.0, None, F32, launches, q, pass_dtype=False)
    res = cufuse.dequantize_int8(backend.asarray(q), 0.05)
    check_kind(backend, res, (300,), F32)
    np.testing.assert_array_equal(backend.to_numpy(res), (q.astype(F32) * F32.type(0.05)))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, "float32", "float64"], ids=str)
def test_dequantize_dtype_spellings(backend, dtype):
    q = all_int8((50,), 62)
    res = cufuse.dequantize_int8(backend.asarray(q), 0.5, dtype=dtype)
    check_kind(backend, res, (50,), np.dtype(dtype))


def test_dequantize_large(backend, launches):
    q = all_int8((1_000_003,), 63)
    dequantize(backend, backend.asarray(q), 0.0123, -4.0, None, F32, launches, q)


@dtype_param
@pytest.mark.parametrize("view", ["transposed", "step", "offset", "sliced_2d", "negative_step"])
def test_dequantize_views(backend, dtype, view, launches):
    if view == "negative_step" and not backend.negative_strides:
        pytest.skip("torch tensors have no negative strides")
    base = {"transposed": (65, 33), "step": (2 * 4097,), "offset": (4098,), "sliced_2d": (40, 70),
            "negative_step": (4097,)}[view]
    q0 = backend.asarray(all_int8(base, 64))
    q = {"transposed": lambda a: a.T, "step": lambda a: a[::2], "offset": lambda a: a[1:],
         "sliced_2d": lambda a: a[:, 3:67], "negative_step": lambda a: a[::-1]}[view](q0)
    nq = backend.to_numpy(q)
    dequantize(backend, q, 0.1, 1.5, None, dtype, launches, nq)


@dtype_param
@pytest.mark.parametrize("shape, axis", PER_CHANNEL, ids=str)
@pytest.mark.parametrize("scale_kind", SCALE_KINDS)
@pytest.mark.parametrize("zp_kind", ["scalar", "backend", "numpy"])
def test_dequantize_per_channel(backend, dtype, shape, axis, scale_kind, zp_kind, launches):
    q = all_int8(shape, 65)
    scale, ns, zp, nz = per_channel_operands(backend, shape, axis, scale_kind, zp_kind, 66)
    dequantize(backend, backend.asarray(q), scale, zp, axis, dtype, launches, q, ns, nz)


# subnormal float32 scales and zero points, and products that are subnormal: the kernels compile with
# -ftz, which flushed them to zero where NumPy keeps them
_SUBNORMAL_SCALES = [1e-40, 2.0 ** -149, 2.0 ** -130, 3e-39, 1.1754942e-38, 2.0 ** -126, 1e-30, 0.37]
_SUBNORMAL_ZPS = [0.0, 1e-40, -3e-39, 2.0 ** -149, 0.5, -2.0 ** -140, 7.0, -1e-45]


@pytest.mark.parametrize("dtype", [F32, F64], ids=lambda d: d.name)
def test_dequantize_subnormal_scale(backend, dtype, launches):
    q = all_int8((4096,), 69)
    for s in _SUBNORMAL_SCALES:
        for z in _SUBNORMAL_ZPS[:3]:
            got = dequantize(backend, backend.asarray(q), s, z, None, dtype, launches, q)
            assert dtype == F64 or s > 2.0 ** -126 or np.count_nonzero(got) > 0  # the test can fail
    qc = all_int8((300, 16), 70)
    for pdt in (F32, F64):  # parameter arrays in the data's compute dtype or the other: converted exactly
        s = np.array(_SUBNORMAL_SCALES * 2, pdt)
        z = np.array(_SUBNORMAL_ZPS * 2, pdt)
        bs, bz = backend.asarray(s), backend.asarray(z)
        dequantize(backend, backend.asarray(qc), bs, bz, -1, dtype, launches, qc, s, z)
        qt = np.ascontiguousarray(qc.T)
        dequantize(backend, backend.asarray(qt), bs, bz, 0, dtype, launches, qt, s, z)
        # and quantize, which divides by them: a scale flushed to 0 gave +-127 / -128 everywhere
        x = (qc.astype(np.float64) * s.astype(np.float64)).astype(dtype)
        quantize(backend, backend.asarray(x), bs, bz, -1, launches, x, s, z)


@pytest.mark.parametrize("view, axis", [("transposed", 0), ("transposed", 1), ("permuted", 1)])
def test_dequantize_per_channel_views(backend, view, axis, launches):
    q0 = backend.asarray(all_int8((4, 5, 6), 67))
    if view == "transposed":
        q = q0[1]
        q = q.T
    else:
        q = q0.permute(2, 0, 1) if backend.is_torch else q0.transpose(2, 0, 1)
    nq = backend.to_numpy(q)
    s = np.random.default_rng(68).uniform(0.01, 1.0, nq.shape[axis])
    dequantize(backend, q, s, 0.25, axis, F32, launches, nq)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_dequantize_out(backend, dtype, launches):
    big = backend.full((37, 82), np.nan, dtype)
    out = big[:, ::2]
    q = all_int8((37, 41), 69)
    dequantize(backend, backend.asarray(q), 0.3, -1.0, None, dtype, launches, q, out=out)
    assert np.isnan(backend.to_numpy(big)[:, 1::2]).all()


@pytest.mark.parametrize("shape, axis, n", EMPTY, ids=str)
@pytest.mark.parametrize("with_out", [False, True])
def test_dequantize_empty(backend, shape, axis, n, with_out, launches):
    q = np.zeros(shape, I8)
    scale = 0.5 if axis is None else np.full(n, 0.5, F32)
    out = backend.full(shape, 0, F64) if with_out else None
    dequantize(backend, backend.asarray(q), scale, 0.0, axis, F64, launches, q, out=out)
    assert launches == []


# ------------------------------------------------------ per-channel walks
# Shapes that take each walk of the per-channel kernels (kernels/quantize.cu
# Channels; packs of 8 codes for quantize of float32, 16 for float16/64; 8 /
# 4 / 2 values for dequantize to float16 / float32 / float64): a pack in one
# channel ((6, 48) axis 0, (3, 4, 32) axis 1), a pack across channels
# ((5, 48) and (7, 64) on the last axis; (5, 40) for all but quantize of
# float16/64 and dequantize to float64), and the stepping walk ((9, 1) axis
# 0, float64 output on the last axis).
WALK_CASES = [((6, 48), 0), ((3, 4, 32), 1), ((5, 48), -1), ((7, 64), 1), ((5, 40), -1), ((9, 1), 0)]


@dtype_param
@pytest.mark.parametrize("shape, axis", WALK_CASES, ids=str)
@pytest.mark.parametrize("layout", ["aligned", "data_offset", "param_offset", "both_offset", "sliced"])
def test_per_channel_walks(backend, dtype, shape, axis, layout, launches):
    """Each walk on data and parameters that start at a 16-byte boundary or
    one element past it (a parameter offset misaligns the packs of
    parameters that the across-channels walk reads, so the host must take
    the stepping walk; a data offset sends every pack through the partial
    packs), and on data that is a column slice of a wider array (the
    strided kernel's packs)."""
    n, size = shape[axis], math.prod(shape)
    xo = 1 if layout in ("data_offset", "both_offset") else 0
    po = 1 if layout in ("param_offset", "both_offset") else 0
    rng = np.random.default_rng(36)
    s = rng.uniform(0.02, 0.3, n + 1).astype(F32)
    z = np.round(rng.uniform(-9, 9, n + 1), 1).astype(F32)
    ns, nz = s[po:po + n], z[po:po + n]
    bs, bz = backend.asarray(s)[po:po + n], backend.asarray(z)[po:po + n]

    def place(a):  # (NumPy view, backend view) of ``a``'s first ``size`` elements laid out per ``layout``
        if layout == "sliced":
            wide = np.concatenate([a[:size].reshape(-1, shape[-1]), a[:size].reshape(-1, shape[-1])], axis=1)
            return a[:size].reshape(shape), backend.asarray(wide)[:, :shape[-1]].reshape(shape)
        return a[xo:xo + size].reshape(shape), backend.asarray(a)[xo:xo + size].reshape(shape)

    x, bx = place(rand((size + 1,), dtype, 37, 15.0))
    quantize(backend, bx, bs, bz, axis, launches, x, ns, nz)
    q, bq = place(all_int8((size + 1,), 38))
    for odt in DTYPES:
        dequantize(backend, bq, bs, bz, axis, odt, launches, q, ns, nz)


@pytest.mark.parametrize("dtype", [F32, F16], ids=lambda d: d.name)
@pytest.mark.parametrize("shape, axis, param_offset, walk", [
    ((6, 48), 0, 0, 0), ((3, 4, 32), 1, 0, 0),     # a pack in one channel
    ((5, 48), -1, 0, 1), ((7, 64), 1, 0, 1),       # a pack across channels
    ((5, 48), -1, 1, 2), ((9, 1), 0, 0, 2)])       # misaligned parameters; a channel shorter than a pack
def test_per_channel_walk_taken(backend, dtype, shape, axis, param_offset, walk, launches):
    """The kernel that runs is the walk's own (kernels/quantize.cu Channels'
    Walk: 0 in one channel, 1 across, 2 stepping): results alone would not
    show a host that always took the slow stepping walk."""
    if not backend.gpu:
        pytest.skip("GPU backends only")
    n = shape[axis]
    s = backend.asarray(np.linspace(0.02, 0.3, n + 1).astype(F32))[param_offset:param_offset + n]
    z = backend.asarray(np.zeros(n + 1, F32))[param_offset:param_offset + n]
    x = rand(shape, dtype, 42, 15.0)
    quantize(backend, backend.asarray(x), s, z, axis, launches, x, backend.to_numpy(s), backend.to_numpy(z))
    assert [k for k in (ln.kernel for ln in launches) if "QuantizeCh" in k], launches
    for ln in launches:
        if "QuantizeCh" in ln.kernel:
            assert f"QuantizeCh<float, {walk}, false" in ln.kernel, (ln.kernel, walk)


@pytest.mark.parametrize("dtype", [F32, F16], ids=lambda d: d.name)
@pytest.mark.parametrize("axis", [0, -1, None], ids=["axis0", "last_axis", "per_tensor"])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "data_offset"])
def test_several_packs_per_thread(backend, dtype, axis, offset, launches):
    """(129, 1024): large enough that the kernels' threads take several packs
    each, one grid stride apart (ElementwiseOp's packs_per_thread; on axis 0
    the next stride is in another channel), partial packs with a data
    offset."""
    shape, size = (129, 1024), 129 * 1024
    n = 1024 if axis == -1 else 129 if axis == 0 else None
    rng = np.random.default_rng(46)
    if n is None:
        ns, nz, bs, bz = 0.07, 2.0, 0.07, 2.0
    else:
        ns = rng.uniform(0.02, 0.3, n).astype(F32)
        nz = np.round(rng.uniform(-9, 9, n), 1).astype(F32)
        bs, bz = backend.asarray(ns), backend.asarray(nz)
    x = rand((size + offset,), dtype, 47, 15.0)
    quantize(backend, backend.asarray(x)[offset:].reshape(shape), bs, bz, axis, launches,
             x[offset:].reshape(shape), ns, nz)
    q = all_int8((size + offset,), 48)
    for odt in DTYPES:
        dequantize(backend, backend.asarray(q)[offset:].reshape(shape), bs, bz, axis, odt, launches,
                   q[offset:].reshape(shape), ns, nz)


@pytest.mark.cuda
@pytest.mark.parametrize("what", ["scale", "zero_point"])
@pytest.mark.parametrize("lib", ["cupy", "torch"])
def test_per_channel_parameters_on_another_gpu(what, lib, launches):
    """A CuPy or torch parameter on another GPU than the data is refused
    before any launch (the kernel would read a pointer of the other device)."""
    if gpu_count() < 2:
        pytest.skip("needs 2 GPUs")
    if lib == "cupy":
        import cupy as cp

        def on(a, dev):
            with cp.cuda.Device(dev):
                return cp.asarray(a)
    else:
        torch = pytest.importorskip("torch")

        def on(a, dev):
            return torch.from_numpy(a).to(f"cuda:{dev}")
    x = on(rand((6, 48), F32, 43, 15.0), 0)
    q = on(np.zeros((6, 48), np.int8), 0)
    kw = {"scale": on(np.full(48, 0.1, F32), 0), "zero_point": on(np.zeros(48, F32), 0)}
    kw[what] = on(np.full(48, 0.1 if what == "scale" else 0.0, F32), 1)
    with pytest.raises(ValueError, match=f"{what} is on GPU 1 but the data is on GPU 0"):
        cufuse.quantize_int8(x, kw["scale"], kw["zero_point"], axis=-1)
    with pytest.raises(ValueError, match=f"{what} is on GPU 1 but the data is on GPU 0"):
        cufuse.dequantize_int8(q, kw["scale"], kw["zero_point"], axis=-1)
    assert launches == []


def test_per_channel_strided_parameters(backend, launches):
    """Parameters given as strided views of the data's kind (every other
    element) are read as what they hold, not as a contiguous run."""
    rng = np.random.default_rng(39)
    x = rand((6, 48), F32, 40, 15.0)
    s = rng.uniform(0.02, 0.3, 96).astype(F32)
    z = np.round(rng.uniform(-9, 9, 96), 1).astype(F32)
    for axis, n in ((0, 6), (-1, 48)):
        bs, bz = backend.asarray(s)[:2 * n:2], backend.asarray(z)[:2 * n:2]
        quantize(backend, backend.asarray(x), bs, bz, axis, launches, x, s[:2 * n:2], z[:2 * n:2])
        q = all_int8((6, 48), 41)
        dequantize(backend, backend.asarray(q), bs, bz, axis, F32, launches, q, s[:2 * n:2], z[:2 * n:2])


def test_per_channel_walk_choice():
    """The host's choice of walk (cufuse/ops/quantize.py _walk): the
    conditions under which kernels/quantize.cu Channels may take each one."""
    from cufuse.ops import quantize as Q
    ok = (0, 256)                                            # 16-byte-aligned parameter pointers
    assert Q._walk(96, 48, 2, 16, ok, 4) == (Q.IN_CHANNEL, False)
    assert Q._walk(96, 48, 2, 2, ok, 8) == (Q.IN_CHANNEL, False)
    assert Q._walk(240, 1, 48, 16, ok, 4) == (Q.ACROSS, False)
    assert Q._walk(240, 1, 48, 16, (4, 256), 4) == (Q.ANY, False)    # scale one float past a boundary
    assert Q._walk(240, 1, 48, 16, (0, 8), 4) == (Q.ANY, False)      # zero point two floats past
    assert Q._walk(240, 1, 48, 16, (16, 32), 8) == (Q.ANY, False)    # doubles: 32-byte packs of 4
    assert Q._walk(200, 1, 40, 16, ok, 4) == (Q.ANY, False)          # a pack of 16 spans two rows of 40
    assert Q._walk(200, 1, 40, 8, ok, 4) == (Q.ACROSS, False)
    assert Q._walk(80, 1, 40, 2, ok, 8) == (Q.ANY, False)            # packs of 2: not a multiple of 4
    assert Q._walk(90, 10, 9, 16, ok, 4) == (Q.ANY, False)
    assert Q._walk(2**31, 2**20, 2**11, 16, ok, 4) == (Q.ANY, True)  # indices past 2**31: 64-bit division
    assert Q._walk(2**31 - 16, 16, 2**27 - 1, 16, ok, 4) == (Q.IN_CHANNEL, False)
    widths = {Q.IN_CHANNEL: 16, Q.ACROSS: 8, Q.ANY: 16}.get   # float16 quantize: 8 codes per pack across
    assert Q._walk(200, 1, 40, widths, ok, 4) == (Q.ACROSS, False)
    assert Q._walk(200, 1, 40, {Q.IN_CHANNEL: 8, Q.ACROSS: 16, Q.ANY: 8}.get, ok, 4) == (Q.ANY, False)
    assert Q._walk(160, 16, 10, widths, ok, 4) == (Q.IN_CHANNEL, False)
    assert Q._walk(160, 8, 20, widths, ok, 4) == (Q.ANY, False)       # inner 8: not a multiple of 16


@pytest.mark.parametrize("dtype", [F16, F32], ids=lambda d: d.name)
@pytest.mark.parametrize("shape", [(333, 72), (3, 81920), (2, 1 << 22), (9000, 1024)], ids=str)
def test_last_axis_thread_setup(backend, dtype, shape, launches):
    """Per-channel quantize on the last axis loads each thread's channel
    parameters once for all its packs (kernels/quantize.cu QuantizeCh on
    kAcross, elementwise.cuh op_periodic), so the grid stride is rounded
    down to a multiple of a row's packs: (333, 72) has 9 packs of 8 per row,
    and threads past the rounded stride do nothing. The grid is at most one
    wave (ElementwiseOp's one_wave), so a row of 2**22 elements has more
    packs than the grid has threads (on GPUs of up to 256 SMs), and each
    pack sets up its own. (9000, 1024) gives a thread 8-9 packs on an H200
    (4-5 on a GPU of 256 SMs), which float16 copies into shared memory 4
    packs ahead (elementwise.cuh op_async_stages), so that each thread's 4
    slots are reused. Some channels' scale or zero point is outside the
    reciprocal's range (math::reciprocal_ok): their packs divide."""
    cpu_runs_one(backend, shape == (333, 72))
    rng = np.random.default_rng(61)
    nch = shape[-1]
    s = rng.uniform(0.02, 0.3, nch).astype(F32)
    z = np.round(rng.uniform(-9, 9, nch), 1).astype(F32)
    s[5::37], s[11::53], z[17::41] = 1e-30, 3e19, -1.5e9
    x = rand(shape, dtype, 62, 15.0)
    quantize(backend, backend.asarray(x), backend.asarray(s), backend.asarray(z), -1, launches, x, s, z)
    for ln in launches:
        assert "QuantizeCh<float, 1, false" in ln.kernel, ln.kernel


# ---------------------------------------------------------------- round trip
@dtype_param
@pytest.mark.parametrize("scale, zp", [(0.1, 0.0), (0.037, 5.0), (2.0, -20.0), (1e-3, 0.5)], ids=repr)
def test_round_trip_per_tensor(backend, dtype, scale, zp):
    """|dequantize(quantize(x)) - x| <= scale / 2 inside the clamp range."""
    lo, hi = (-128 - zp) * scale, (127 - zp) * scale
    x = np.random.default_rng(70).uniform(lo, hi, 20000).astype(dtype)
    x = x[(x >= lo) & (x <= hi)]
    q = cufuse.quantize_int8(backend.asarray(x), scale, zp)
    out_dt = F32 if dtype == F16 else dtype        # float16 x: compare in float32, no extra rounding
    d = backend.to_numpy(cufuse.dequantize_int8(q, scale, zp, dtype=out_dt)).astype(np.float64)
    err = np.abs(d - x.astype(np.float64))
    slack = 1e-5 * scale + 4 * np.finfo(out_dt).eps * np.abs(x.astype(np.float64))
    assert (err <= scale / 2 + slack).all(), err.max() / scale


@dtype_param
@pytest.mark.parametrize("axis", [0, -1])
def test_round_trip_per_channel(backend, dtype, axis):
    rng = np.random.default_rng(71)
    shape = (12, 300)
    n = shape[axis]
    s = rng.uniform(0.005, 0.5, n).astype(F32)
    z = np.round(rng.uniform(-10, 10, n)).astype(F32)
    bshape = [1, 1]
    bshape[axis] = n
    sb, zb = s.reshape(bshape).astype(np.float64), z.reshape(bshape).astype(np.float64)
    u = rng.uniform(0, 1, shape)
    x = (((-128 - zb) + u * 255) * sb).astype(dtype)
    q = cufuse.quantize_int8(backend.asarray(x), backend.asarray(s), backend.asarray(z), axis)
    out_dt = F32 if dtype == F16 else dtype
    d = backend.to_numpy(cufuse.dequantize_int8(q, s, z, axis, dtype=out_dt)).astype(np.float64)
    x64 = x.astype(np.float64)
    inside = (x64 / sb + zb >= -128) & (x64 / sb + zb <= 127)
    err = np.abs(d - x64)
    slack = 1e-5 * sb + 4 * np.finfo(out_dt).eps * np.abs(x64)
    assert (err <= sb / 2 + slack)[inside].all()
    assert inside.mean() > 0.99


# ------------------------------------------------------------ dequant errors
@pytest.mark.parametrize("bad", [np.uint8, np.int16, np.int32, np.float32, np.float16, np.bool_],
                         ids=lambda t: np.dtype(t).name)
def test_dequantize_bad_q_dtype(backend, bad, launches):
    q = backend.asarray(np.ones((4, 5), dtype=bad))
    with pytest.raises(TypeError):
        cufuse.dequantize_int8(q, 0.1)
    assert launches == []


@pytest.mark.parametrize("bad", [np.int8, np.int32, np.uint8, np.complex64, np.bool_, "int16"], ids=str)
def test_dequantize_bad_dtype(backend, bad, launches):
    q = backend.asarray(all_int8((4, 5), 80))
    with pytest.raises(TypeError):
        cufuse.dequantize_int8(q, 0.1, dtype=bad)
    assert launches == []


@pytest.mark.parametrize("scale", BAD_SCALES, ids=repr)
def test_dequantize_bad_scale(backend, scale, launches):
    q = backend.asarray(all_int8((4, 5), 81))
    with pytest.raises(ValueError, match=value_pattern(scale)):
        cufuse.dequantize_int8(q, scale)
    assert launches == []


@pytest.mark.parametrize("zp", [np.nan, np.inf, -np.inf], ids=repr)
def test_dequantize_bad_zero_point(backend, zp, launches):
    q = backend.asarray(all_int8((4, 5), 82))
    with pytest.raises(ValueError, match=value_pattern(zp)):
        cufuse.dequantize_int8(q, 0.1, zp)
    assert launches == []


@pytest.mark.parametrize("what", ["scale_short", "zp_long", "axis", "axis_neg", "scale_int"])
def test_dequantize_per_channel_errors(backend, what, launches):
    q = backend.asarray(all_int8((4, 5), 83))
    scale, zp, axis, exc = np.full(5, 0.1, F32), 0.0, 1, ValueError
    if what == "scale_short":
        scale = backend.asarray(np.full(4, 0.1, F32))
    elif what == "zp_long":
        zp = np.zeros(6, F32)
    elif what == "axis":
        axis = 2
    elif what == "axis_neg":
        axis = -3
    else:
        scale, exc = backend.asarray(np.ones(5, np.int32)), TypeError
    with pytest.raises(exc):
        cufuse.dequantize_int8(q, scale, zp, axis)
    assert launches == []


def test_integer_zero_points_and_0d_scales(backend, launches):
    """Per-channel zero points of an integer dtype (torch's are int64 tensors) are taken as their
    values; a 0-d scale (NumPy, or a CPU tensor) per tensor is its number."""
    x = rand((6, 5), F32, 87, 4.0)
    s = np.linspace(0.05, 0.2, 5).astype(F32)
    zi = np.array([-3, 0, 2, 7, -1], np.int64)
    got = backend.to_numpy(cufuse.quantize_int8(backend.asarray(x), backend.asarray(s), backend.asarray(zi), 1))
    want = backend.to_numpy(cufuse.quantize_int8(backend.asarray(x), backend.asarray(s),
                                                 backend.asarray(zi.astype(F32)), 1))
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(got)) > 5
    if backend.name != "cupy":  # (a 0-d CuPy array would be read by waiting for the GPU: refused)
        zero_d = backend.torch.tensor(0.125) if backend.is_torch else np.array(0.125, F32)  # (a CPU tensor)
        got = backend.to_numpy(cufuse.quantize_int8(backend.asarray(x), zero_d, 1.0))
        np.testing.assert_array_equal(got, backend.to_numpy(cufuse.quantize_int8(backend.asarray(x), 0.125, 1.0)))


@pytest.mark.parametrize("bad, exc, match", [
    (["a", "b", "c", "d", "e"], TypeError, r"scale must be 5 real numbers"),
    ([0.1, [0.2], 0.3, 0.1, 0.1], TypeError, r"scale must be 5 real numbers"),
    ([1j] * 5, TypeError, r"scale must be 5 real numbers"),
    ([True] * 5, TypeError, r"scale must hold real numbers, got a bool"),
    ([0.1, 2**2000, 0.1, 0.1, 0.1], ValueError, r"every scale must be finite"),
])
def test_per_channel_list_errors(bad, exc, match):
    """Lists that do not make numbers: the op's own errors (NumPy's conversion errors came through)."""
    with pytest.raises(exc, match=r"^cufuse\.quantize_int8: " + match):
        cufuse.quantize_int8(rand((4, 5), F32, 88), bad, 0.0, 1)
    with pytest.raises(TypeError, match="zero_point has dtype bool"):
        cufuse.quantize_int8(rand((4, 5), F32, 88), [0.1] * 5, np.ones(5, np.bool_), 1)


@pytest.mark.parametrize("dtype, out_dtype", [(F32, F64), (F32, F16), (F64, F32), (F16, F32), (F32, I8)], ids=str)
def test_dequantize_out_wrong_dtype(backend, dtype, out_dtype, launches):
    q = backend.asarray(all_int8((4, 5), 84))
    out = backend.asarray(np.zeros((4, 5), out_dtype))
    with pytest.raises(TypeError):
        cufuse.dequantize_int8(q, 0.1, dtype=dtype, out=out)
    assert launches == []


@pytest.mark.parametrize("shape", [(5, 4), (4, 5, 1), (20,), ()], ids=str)
def test_dequantize_out_wrong_shape(backend, shape, launches):
    q = backend.asarray(all_int8((4, 5), 85))
    out = backend.full(shape, np.nan, F32)
    with pytest.raises(ValueError):
        cufuse.dequantize_int8(q, 0.1, out=out)
    assert np.isnan(backend.to_numpy(out)).all()
    assert launches == []


def test_dequantize_out_wrong_kind(backend, launches):
    other = Backend(OTHER_KIND[backend.name])
    q = backend.asarray(all_int8((4, 5), 86))
    out = other.full((4, 5), np.nan, F32)
    with pytest.raises(TypeError):
        cufuse.dequantize_int8(q, 0.1, out=out)
    assert launches == []


# --------------------------------------------------- GPU and fallback agree
@pytest.mark.cuda
@dtype_param
def test_gpu_quantize_matches_fallback_bitwise(dtype):
    import cupy as cp
    x = rand((1_000_003,), dtype, 90, 20.0)
    x[::1000] = np.nan
    for scale, zp in [(0.1, 0.0), (0.0731, 3.0), (0.25, -1.0)]:
        cpu = cufuse.quantize_int8(x, scale, zp)
        gpu = cp.asnumpy(cufuse.quantize_int8(cp.asarray(x), scale, zp))
        np.testing.assert_array_equal(gpu, cpu)
        np.testing.assert_array_equal(gpu, quantize_ref(x, scale, zp))


@pytest.mark.cuda
def test_scale_array_of_another_kind_refused(launches):
    import cupy as cp
    x = rand((4, 5), F32, 91)
    with pytest.raises((TypeError, ValueError)):
        cufuse.quantize_int8(x, cp.full(5, 0.1, F32), 0.0, 1)    # NumPy x, CuPy scale
    assert launches == []


# ------------------------------------------------------- more than 2**31 elements
@pytest.mark.slow
@pytest.mark.cuda
@pytest.mark.parametrize("axis", [0, -1])
def test_per_channel_more_than_2_31_elements(axis, launches):
    """32769 x 65537 (> 2**31) elements take the per-channel kernels' Wide
    walk (64-bit channel division, kernels/quantize.cu Channels<..., Wide>):
    quantize from float16 and dequantize to float16, checked exactly at
    sampled positions, the first/last elements and those around 2**31."""
    import cupy as cp
    from cufuse.ops import quantize as Q
    rows, cols = 32769, 65537
    n = rows * cols
    assert n > 2**31
    nch = rows if axis == 0 else cols
    rng = np.random.default_rng(44)
    s = rng.uniform(0.02, 0.3, nch).astype(F32)
    z = np.round(rng.uniform(-9, 9, nch), 1).astype(F32)
    xtile = rand((cols,), F16, 45, 15.0)
    qtile = all_int8((cols,), 46)
    idx = np.unique(np.concatenate([np.arange(4096), np.arange(n - 4096, n), np.arange(2**31 - 2048, 2**31 + 2048),
                                    rng.integers(0, n, 8192)]))
    ch = idx // cols if axis == 0 else idx % cols
    x = q = res = None
    try:
        x = cp.empty((rows, cols), F16)
        x[...] = cp.asarray(xtile)   # every row alike; the channels still vary along both axes
        res = cufuse.quantize_int8(x, s, z, axis=axis)
        assert len(launches) == 1 and all("QuantizeCh" in ln.kernel for ln in launches)
        assert ", true" in launches[0].kernel, launches[0].kernel  # the Wide instance
        assert Q._walk(n, 1 if axis == -1 else cols, nch, 16, (0, 0), 4) == (Q.ANY, True)
        got = res.reshape(-1)[cp.asarray(idx)].get()
        np.testing.assert_array_equal(got, quantize_ref(xtile[idx % cols], s[ch], z[ch]))
        x = res = None
        q = cp.empty((rows, cols), I8)
        q[...] = cp.asarray(qtile)
        res = cufuse.dequantize_int8(q, s, z, axis=axis, dtype=F16)
        assert ", true" in launches[-1].kernel, launches[-1].kernel
        got = res.reshape(-1)[cp.asarray(idx)].get()
        exact = ((qtile[idx % cols].astype(F32) - z[ch]) * s[ch]).astype(F16)
        np.testing.assert_array_equal(got, exact)
    finally:
        x = q = res = None
        cp.get_default_memory_pool().free_all_blocks()
