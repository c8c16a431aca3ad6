"""cufuse.fake_quantize_int8: equal bit for bit to the int8 round trip
(dequantize_int8(quantize_int8(x))) for every dtype, array kind, per tensor
and per channel (first, middle and last axis), with infinities and odd
sizes; NaN stays NaN; the straight-through gradient against a mask computed
here; errors."""
from __future__ import annotations

import numpy as np
import pytest

import cufuse
from _reference import BF16, DTYPES, compiled_matches_eager, rand

DTYPES_ALL = DTYPES + ([BF16] if BF16 is not None else [])


def _data(shape, dtype, seed):
    x = rand(shape, dtype, seed, scale=6.0)
    flat = x.reshape(-1)
    if flat.size > 3:
        flat[1], flat[2] = np.inf, -np.inf
    return x


def _params(shape, axis, seed):
    g = np.random.default_rng(seed)
    if axis is None:
        return 0.04, 3.0
    n = shape[axis]
    return g.uniform(0.02, 0.1, n).astype(np.float32), np.round(g.uniform(-5, 5, n)).astype(np.float32)


@pytest.mark.parametrize("dtype", DTYPES_ALL, ids=str)
@pytest.mark.parametrize("shape,axis", [((37,), None), ((6, 33), None), ((6, 33), 0), ((6, 33), 1),
                                        ((4, 5, 9), 1), ((1,), 0)], ids=str)
def test_equals_the_int8_round_trip(backend, shape, axis, dtype):
    x = _data(shape, dtype, 1)
    s, z = _params(shape, axis, 2)
    xa = backend.asarray(x)
    sa, za = (v if axis is None else backend.asarray(v) for v in (s, z))
    got = backend.to_numpy(cufuse.fake_quantize_int8(xa, sa, za, axis=axis))
    q = cufuse.quantize_int8(xa, sa, za, axis=axis)
    want = backend.to_numpy(cufuse.dequantize_int8(q, sa, za, axis=axis, dtype=dtype))
    assert got.dtype == dtype and got.shape == x.shape
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float64)], ids=str)
def test_subnormal_scales_equal_the_round_trip(backend, dtype):
    """Subnormal float32 scales and zero points, and subnormal products: the
    generated kernel kept neither (-ftz flushed a 1e-40 scale to 0: codes of
    +-127 and values of 0), where quantize_int8 and dequantize_int8 keep them."""
    scales = [1e-40, 2.0 ** -149, 3e-39, 2.0 ** -126, 0.37]
    zps = [0.0, 1e-40, -3e-39, 7.0, -1e-45]
    x0 = np.random.default_rng(3).integers(-140, 140, (64, len(scales))).astype(np.float64)
    x = (x0 * np.array(scales)).astype(dtype)  # codes across the range and past its ends
    for s, z in zip(scales, zps):
        xa = backend.asarray(x)
        got = backend.to_numpy(cufuse.fake_quantize_int8(xa, s, z))
        want = backend.to_numpy(cufuse.dequantize_int8(cufuse.quantize_int8(xa, s, z), s, z, dtype=dtype))
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=f"scale {s} zero point {z}")
    sc, zc = np.array(scales, np.float32), np.array(zps, np.float32)
    xa, sa, za = backend.asarray(x), backend.asarray(sc), backend.asarray(zc)
    got = backend.to_numpy(cufuse.fake_quantize_int8(xa, sa, za, axis=1))
    want = backend.to_numpy(cufuse.dequantize_int8(cufuse.quantize_int8(xa, sa, za, axis=1), sa, za, axis=1,
                                                   dtype=dtype))
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg="per channel")
    assert np.count_nonzero(got[:, 0]) > 32  # (1e-40: the test can fail)


def test_no_negative_zero(backend):
    """A small negative value rounds to the code 0, whose value is +0.0 (the
    int8 round trip's bits), not rint's -0.0."""
    x = np.array([-0.01, 0.01, -0.3], dtype=np.float32)
    got = backend.to_numpy(cufuse.fake_quantize_int8(backend.asarray(x), 1.0))
    assert got.tolist() == [0.0, 0.0, 0.0] and not np.signbit(got).any()


def test_nan_stays_nan(backend):
    x = np.array([0.5, np.nan, -1.0], dtype=np.float32)
    got = backend.to_numpy(cufuse.fake_quantize_int8(backend.asarray(x), 0.1))
    assert np.isnan(got[1]) and got[0] == pytest.approx(0.5) and got[2] == pytest.approx(-1.0)


torch = pytest.importorskip("torch")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("axis", [None, 1])
def test_straight_through_gradient(device, axis):
    """The gradient is the incoming one where rint(x / scale + zero_point) is
    in [-128, 127] (float32 arithmetic, as the forward) and 0 elsewhere."""
    shape = (5, 40)
    x = _data(shape, np.float32, 3)
    s, z = _params(shape, axis, 4)
    g = rand(shape, np.float32, 5)
    xt = torch.from_numpy(x).to(device).requires_grad_(True)
    sa, za = (v if axis is None else torch.from_numpy(v).to(device) for v in (s, z))
    y = cufuse.fake_quantize_int8(xt, sa, za, axis=axis)
    y.backward(torch.from_numpy(g).to(device))
    sb, zb = (np.float32(s), np.float32(z)) if axis is None else (s[None, :], z[None, :])
    with np.errstate(invalid="ignore"):
        v = np.rint(x / sb + zb)
    want = np.where((v >= -128) & (v <= 127), g, 0.0).astype(np.float32)
    assert 0 < np.count_nonzero(want == 0) < want.size  # both sides of the clamp occur
    np.testing.assert_array_equal(xt.grad.cpu().numpy(), want)
    with pytest.raises(NotImplementedError, match="requires grad"):
        cufuse.fake_quantize_int8(xt, torch.full((40,), 0.1, device=device, requires_grad=True), 0.0, axis=1)


def test_errors():
    x = np.ones((3, 4), np.float32)
    with pytest.raises(ValueError, match="scale must be finite and > 0"):
        cufuse.fake_quantize_int8(x, 0.0)
    with pytest.raises(TypeError, match="accepted dtypes"):
        cufuse.fake_quantize_int8(x.astype(np.int8), 0.1)
    with pytest.raises(ValueError, match="\\(4,\\) is needed"):
        cufuse.fake_quantize_int8(x, np.ones(3, np.float32), axis=1)
    with pytest.raises(TypeError, match="per channel"):
        cufuse.fake_quantize_int8(x, 0.1, axis=0)
    # per-channel values given as CPU tensors are checked as NumPy's are (zero, negative, NaN, 0 in float32)
    t = torch.from_numpy(x)
    for bad in (torch.tensor([0.5, 0.0, 1.0, 1.0]), torch.tensor([1.0, -1.0, 1.0, 1.0]),
                torch.tensor([1.0, float("nan"), 1.0, 1.0]), torch.full((4,), 1e-46, dtype=torch.float64)):
        for fn in (cufuse.fake_quantize_int8, cufuse.quantize_int8):
            with pytest.raises(ValueError, match="every scale must be finite and > 0"):
                fn(t, bad, axis=1)
    with pytest.raises(ValueError, match="every zero_point must be finite"):
        cufuse.quantize_int8(t, torch.ones(4), torch.full((4,), float("inf")), axis=1)


def test_compiled_checks_like_eager():
    """Under torch.compile an axis out of range and a scale that is 0 in float32 raise, as in eager mode
    (the axis was taken modulo the dims, the scale checked in float64 only)."""
    torch._dynamo.reset()
    x = torch.randn(2, 3)
    with pytest.raises(Exception, match="axis 5 is out of range"):
        torch.compile(lambda t: cufuse.fake_quantize_int8(t, torch.ones(3), axis=5), fullgraph=True)(x)
    with pytest.raises(Exception, match="in torch.float32"):
        torch.compile(lambda t: cufuse.fake_quantize_int8(t, 1e-46), fullgraph=True)(x)
    # per-channel values are checked when the compiled graph runs, as eager checks them (they ran: zeros, NaN)
    f = torch.compile(lambda t, s, z: cufuse.fake_quantize_int8(t, s, z, axis=1), fullgraph=True)
    for s, z in ((torch.tensor([0.1, 0.0, -0.1]), torch.zeros(3)),
                 (torch.tensor([0.1, 1e-46, 0.1], dtype=torch.float64), torch.zeros(3)),
                 (torch.full((3,), 0.1), torch.tensor([0.0, float("nan"), 0.0]))):
        with pytest.raises(Exception, match="must be finite"):
            f(x, s, z)
    # a per-channel scale that requires grad: eager refuses it; compiled, it had been detached (no gradient)
    s = torch.tensor([0.1, 0.2, 0.05], requires_grad=True)
    with pytest.raises(NotImplementedError, match="scale requires grad; the quantization parameters get no gradient"):
        cufuse.fake_quantize_int8(x.clone().requires_grad_(True), s, 0.0, axis=1)
    with pytest.raises(Exception, match="requires grad"):
        torch.compile(lambda t, s: cufuse.fake_quantize_int8(t, s, 0.0, axis=1), fullgraph=True)(
            x.clone().requires_grad_(True), s)


@pytest.mark.parametrize("device", DEVICES)
def test_under_compile(device):
    """torch.compile(fullgraph=True) traces it (per tensor: Python numbers;
    per channel: 1-D tensors), values and straight-through gradients equal eager."""
    torch._dynamo.reset()
    x0 = torch.from_numpy(_data((5, 40), np.float32, 6)).to(device)
    x0[0, 1:3] = 0.0  # (finite data: sums of squares stay comparable)
    for s, z, axis in ((0.05, 1.0, None), (torch.linspace(0.02, 0.1, 40, device=device), 2.0, 1)):
        def f(t):
            return cufuse.fake_quantize_int8(t, s, z, axis=axis).square().sum()
        (xa,) = compiled_matches_eager(f, [x0.clone().requires_grad_(True)], 1e-5, 1e-5, 1e-6, 1e-6)
        assert (xa.grad == 0).any() and (xa.grad != 0).any()
