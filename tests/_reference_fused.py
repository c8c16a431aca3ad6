"""float64 / bit-exact references for bias_gelu, quantize_int8, dequantize_int8
and gelu_dropout, written from the spec, independently of cufuse.

* GELU: evaluated in float64 with ``math.erfc`` (0.5 v erfc(-v/sqrt 2), which
  equals PyTorch's 0.5 v (1 + erf(v/sqrt 2)) without its cancellation for
  negative v) or the tanh form (1 + tanh(u) written as 2 / (1 + exp(-2u))).
* quantize: the exact float32 (float16/float32 input) or float64 arithmetic.
* Philox4x32-10 (Random123) in NumPy, uint64 products for mulhilo, checked in
  test_dropout.py against Random123's known-answer vectors.
"""
from __future__ import annotations

import math

import numpy as np

from _reference import TOL, assert_close

F16, F32, F64 = (np.dtype(t) for t in (np.float16, np.float32, np.float64))
I8 = np.dtype(np.int8)

# -------------------------------------------------------------------- GELU
_erfc = np.frompyfunc(math.erfc, 1, 1)
_SQRT2 = math.sqrt(2.0)
_K_TANH = math.sqrt(2.0 / math.pi)


def gelu64(v, approximate="none"):
    """float64 GELU of ``v`` (anything NumPy converts to float64)."""
    v = np.asarray(v, dtype=np.float64)
    with np.errstate(all="ignore"):
        if approximate == "none":
            e = np.asarray(_erfc(-v / _SQRT2), dtype=np.float64).reshape(v.shape)
            r = 0.5 * v * e
        elif approximate == "tanh":
            u = _K_TANH * (v + 0.044715 * v ** 3)
            r = 0.5 * v * (2.0 / (1.0 + np.exp(-2.0 * u)))
        else:
            raise AssertionError(approximate)
        # gelu(nan) = nan; gelu(+inf) = inf; gelu(-inf) = -0 (0 * inf above gives nan)
        r = np.where(np.isposinf(v), np.inf, r)
        r = np.where(np.isneginf(v), 0.0, r)
    return r


def finite_float16():
    """Every finite float16 value, in bit-pattern order."""
    bits = np.arange(65536, dtype=np.uint16).view(np.float16)
    return bits[np.isfinite(bits)]


def assert_within_one_ulp(got, expected, inputs, what):
    """float16 ``got`` within one ulp of ``expected`` (float16, finite)
    everywhere; the message names the worst input."""
    ulp = np.spacing(np.abs(expected)).astype(np.float64)
    err = np.abs(got.astype(np.float64) - expected.astype(np.float64)) / ulp
    worst = int(np.argmax(err))
    assert err.max() <= 1.0, f"{what}: x={inputs[worst]!r} gave {got[worst]!r}, expected {expected[worst]!r}"


def widen_operand(v, result_dtype):
    """An operand as float64: an array as is, a scalar first rounded to the
    result dtype (NumPy's rule for a Python scalar meeting an array)."""
    if isinstance(v, np.ndarray):
        return v.astype(np.float64)
    return np.asarray(v, dtype=result_dtype).astype(np.float64)


def bias_gelu_ref(x, bias, approximate, result_dtype):
    return gelu64(widen_operand(x, result_dtype) + widen_operand(bias, result_dtype), approximate)


assert_close_tol = assert_close  # one comparison for every op (tests/_reference.py)


# ---------------------------------------------------------------- quantize
def quant_compute_dtype(x_dtype):
    return F64 if np.dtype(x_dtype) == F64 else F32


def _channel(v, ndim, axis, cdt):
    """A scalar or per-channel 1-D vector, in ``cdt``, shaped to broadcast along ``axis``."""
    a = np.asarray(v, dtype=np.float64).astype(cdt)
    if a.ndim == 0 or axis is None:
        return a
    shape = [1] * ndim
    shape[axis] = -1
    return a.reshape(shape)


def quantize_ref(x, scale, zero_point=0.0, axis=None):
    """clip(rint(x / scale + zp), -128, 127) in float32 (float16/32 x) or
    float64; NaN -> 0. Exact: NumPy's float32 arithmetic is IEEE-rounded."""
    x = np.asarray(x)
    cdt = quant_compute_dtype(x.dtype)
    s = _channel(scale, x.ndim, axis, cdt)
    z = _channel(zero_point, x.ndim, axis, cdt)
    with np.errstate(all="ignore"):
        v = x.astype(cdt) / s + z
        assert v.dtype == cdt
        r = np.clip(np.rint(v), -128, 127)
        r = np.where(np.isnan(r), 0, r)
    return r.astype(I8)


def dequantize_ref(q, scale, zero_point=0.0, axis=None, dtype=F32):
    """(q - zp) * scale in float64, with scale and zp first rounded to the
    compute dtype (float32, or float64 when dtype is float64); not yet rounded."""
    q = np.asarray(q)
    cdt = F64 if np.dtype(dtype) == F64 else F32
    s = _channel(scale, q.ndim, axis, cdt).astype(np.float64)
    z = _channel(zero_point, q.ndim, axis, cdt).astype(np.float64)
    return (q.astype(np.float64) - z) * s


# ------------------------------------------------------------------ Philox
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = np.uint64(0xFFFFFFFF)
_SH32 = np.uint64(32)


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on arrays of counters (uint32-valued, any int dtype) and a
    scalar key; returns four uint32 arrays."""
    c = [np.asarray(w, dtype=np.uint64) & _MASK32 for w in (c0, c1, c2, c3)]
    c = np.broadcast_arrays(*c)
    c = [np.array(w) for w in c]
    k0, k1 = int(k0) & 0xFFFFFFFF, int(k1) & 0xFFFFFFFF
    m0, m1 = np.uint64(PHILOX_M0), np.uint64(PHILOX_M1)
    for rnd in range(10):
        if rnd:
            k0 = (k0 + PHILOX_W0) & 0xFFFFFFFF
            k1 = (k1 + PHILOX_W1) & 0xFFFFFFFF
        p0 = m0 * c[0]            # < 2**64: exact in uint64
        p1 = m1 * c[2]
        hi0, lo0 = p0 >> _SH32, p0 & _MASK32
        hi1, lo1 = p1 >> _SH32, p1 & _MASK32
        c = [hi1 ^ c[1] ^ np.uint64(k0), lo1, hi0 ^ c[3] ^ np.uint64(k1), lo0]
    return tuple(w.astype(np.uint32) for w in c)


def mask_bits(dtype, p):
    """Bits of Philox output per mask element: 16 for float16 results when
    1/32 <= p <= 31/32 (the spec's bound for 16-bit lanes), 32 otherwise."""
    return 16 if np.dtype(dtype) == F16 and 0.03125 <= p <= 0.96875 else 32


def philox_words(n, seed, bits=32):
    """The lane (as uint32) used for C-order element i, i in range(n): with
    32 bits, word i % 4 of the block at counter i // 4; with 16 bits, lane
    i % 8 of the block at counter i // 8, lane 2j the low half of word j and
    lane 2j + 1 its high half."""
    seed = int(seed)
    per = 128 // bits
    b = np.arange(-(-n // per), dtype=np.uint64)
    out = philox4x32_10(b & _MASK32, b >> _SH32, 0, 0, seed & 0xFFFFFFFF, seed >> 32)
    words = np.stack(out, axis=1).astype(np.uint64)
    if bits == 16:
        words = np.stack([words % 65536, words // 65536], axis=2)
    return words.reshape(-1)[:n].astype(np.uint32)


def keep_threshold(p, bits=32):
    return math.floor(p * 2.0 ** bits)


def dropout_keep_mask(shape, seed, p, dtype=F32):
    """Boolean keep mask of the spec, for an array of ``shape`` (C-order index)
    and result dtype ``dtype``."""
    n = math.prod(shape)
    bits = mask_bits(dtype, p)
    w = philox_words(n, seed, bits)
    return (w.astype(np.uint64) >= np.uint64(keep_threshold(p, bits))).reshape(shape)
