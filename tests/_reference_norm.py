"""float64 references and tolerances for the reductions (sum_squared,
mean_abs), the normalizations (layer_norm, layer_norm_relu, rms_norm) and
softmax / log_softmax, written from scratch/ISSUE4_API.md independently of
cufuse (never its NumPy fallbacks).

Every reference widens its operands to float64, evaluates the definition
there and returns float64; ``assert_close`` (tests/_reference.py) rounds it to
the result dtype before comparing, so a result that overflows the result
dtype (float16 sums) must be inf where the rounded reference is.
"""
from __future__ import annotations

import math

import numpy as np

from _reference import assert_close

F16, F32, F64 = (np.dtype(t) for t in (np.float16, np.float32, np.float64))

# ================================================================= tolerances
# (rtol, atol) per result dtype, one table per op family; stated here once.
#
# Reductions sum non-negative terms (x*x, |x|): no cancellation, so a relative
# tolerance alone bounds them (atol 0 except float16 subnormals).
# * float16: computed in float32 and rounded once: the result may sit one
#   half-precision ulp (2**-10 relative) from the rounded reference; 2e-3.
#   atol 1e-7 covers float16 subnormal results (ulp 6e-8) of axis=() squares.
# * float32: float32 accumulation over n terms. A pairwise / tree sum is good
#   to ~1e-7; a sequential sum (NumPy along a non-contiguous axis, one GPU
#   thread walking a column) is biased low: measured for x*x of randn columns
#   1e-6 at n = 4097, 1.6e-5 at 65536, 2.3e-5 at 131072, 9e-5 at 300000.
#   2e-5 up to n = 4097, 1e-4 beyond (the tests keep sequential-prone columns
#   at n <= 131072).
# * float64: 1e-12 at every length (sequential error ~1e-16 * sqrt(n)).
REDUCE_TOL = {F16: (2e-3, 1e-7), F32: (2e-5, 0.0), F64: (1e-12, 0.0)}
REDUCE_TOL_LONG = {F16: (2e-3, 1e-7), F32: (1e-4, 0.0), F64: (1e-12, 0.0)}
LONG = 4097  # reduced lengths above this use the _LONG tables

# layer_norm / layer_norm_relu / rms_norm. Outputs are O(1) (normalized values
# times O(1) weights plus O(1) bias, where y * w + b may cancel to ~0: atol).
# * float16: float32 compute, one rounding of the result (plus a float16
#   weight / bias product rounded in float32): 5e-3 / 2e-3 (a result is
#   within one ulp, 9.8e-4 relative, of the rounded reference).
# * float32: mean / variance of n terms in float32 (relative error of the
#   variance ~ eps32 * sqrt(n), halved by the square root), then a few
#   roundings: 1e-5 / 1e-5 up to n = 4097, 5e-5 / 5e-5 for long rows.
# * float64: 1e-12 / 1e-12 (long rows 1e-11).
NORM_TOL = {F16: (5e-3, 2e-3), F32: (1e-5, 1e-5), F64: (1e-12, 1e-12)}
NORM_TOL_LONG = {F16: (5e-3, 2e-3), F32: (5e-5, 5e-5), F64: (1e-11, 1e-11)}
# Rows x = OFFSET + randn (mean 1000, standard deviation 1), n >= 33. Even a
# good float32 algorithm carries the mean's rounding (ulp(1000) / 2 = 3e-5,
# plus the accumulation's rounding: ~1e-4 measured for two-pass with tree or
# pairwise sums at n = 33 .. 65536, ~2e-4 with 32 sequential lanes per row)
# into x - mean; float32 gets 5e-4 on the normalized output. A one-pass
# E[x^2] - E[x]^2 variance is off by 2e-2 .. 3e-1 there (or NaN) and the tests
# assert that this tolerance rejects it. float64: good algorithms 1e-13 ..
# 3e-12, one-pass 3e-11 .. 2e-10 (also asserted): 1e-11.
OFFSET = 1000.0
NORM_TOL_OFFSET = {F32: (5e-4, 5e-4), F64: (1e-11, 1e-11)}

# softmax: results in (0, 1], often tiny, so mostly relative. exp's argument
# x - max carries a rounding error up to ulp(|x - max|) / 2, which becomes the
# same relative error in the result (~4e-6 at |x - max| = 80; 7.5e-6 for an
# exp2f(x * log2 e) form), plus the sum's rounding: float32 2e-5 relative;
# atol 1e-36 exempts only float32 subnormal results. float16: one rounding
# (5e-3) and atol 1e-7 for float16 subnormals (ulp 6e-8). float64: 1e-12,
# atol 1e-300. Beyond 4097 elements float32 gets 1e-4: a sequential float32
# sum of many small exp terms (softmax along axis 0 of a C-contiguous array)
# is biased low, 7.7e-5 measured at n = 65536 (every element of the column
# shares the sum's relative error).
SOFTMAX_TOL = {F16: (5e-3, 1e-7), F32: (2e-5, 1e-36), F64: (1e-12, 1e-300)}
SOFTMAX_TOL_LONG = {F16: (5e-3, 1e-7), F32: (1e-4, 1e-36), F64: (1e-11, 1e-300)}
# log_softmax = (x - max) - log(sum): absolute error ~ eps * (|x - max| +
# log n) plus the sum's relative error, so relative except near 0 (the row
# maximum of a peaked row): float32 2e-5 / 2e-6 (long rows 5e-5 / 1e-4, the
# sum's 7.7e-5 above as an absolute error), float16 5e-3 / 1e-3 (one ulp at
# |y| < 1), float64 1e-12 / 1e-13.
LOG_SOFTMAX_TOL = {F16: (5e-3, 1e-3), F32: (2e-5, 2e-6), F64: (1e-12, 1e-13)}
LOG_SOFTMAX_TOL_LONG = {F16: (5e-3, 1e-3), F32: (5e-5, 1e-4), F64: (1e-11, 1e-12)}

_TABLES = {
    "reduce": (REDUCE_TOL, REDUCE_TOL_LONG),
    "norm": (NORM_TOL, NORM_TOL_LONG),
    "softmax": (SOFTMAX_TOL, SOFTMAX_TOL_LONG),
    "log_softmax": (LOG_SOFTMAX_TOL, LOG_SOFTMAX_TOL_LONG),
}
FAMILY = {"sum_squared": "reduce", "mean_abs": "reduce", "layer_norm": "norm", "layer_norm_relu": "norm",
          "rms_norm": "norm", "softmax": "softmax", "log_softmax": "log_softmax"}


def tol(op, dtype, n):
    """(rtol, atol) for ``op`` with result dtype ``dtype`` over ``n`` reduced /
    normalized elements."""
    short, long_ = _TABLES[FAMILY[op]]
    return (long_ if n > LONG else short)[np.dtype(dtype)]


def check(op, got, ref, dtype, n, tolerance=None):
    """``got`` (NumPy, result dtype) against the float64 ``ref`` with ``op``'s tolerance."""
    assert_close(got, ref, dtype, tolerance or tol(op, dtype, n))


# ================================================================ reductions
def _f64(x):
    return np.asarray(x).astype(np.float64)


def sum_squared_ref(x, axis=-1, keepdims=False):
    v = _f64(x)
    with np.errstate(all="ignore"):
        return np.asarray(np.sum(v * v, axis=axis, keepdims=keepdims), dtype=np.float64)


def mean_abs_ref(x, axis=-1, keepdims=False):
    v = np.abs(_f64(x))
    axes = tuple(range(v.ndim)) if axis is None else (axis if isinstance(axis, tuple) else (axis,))
    axes = tuple(a % v.ndim for a in axes) if v.ndim else ()
    n = math.prod(v.shape[a] for a in axes)
    s = np.sum(v, axis=axis, keepdims=keepdims)
    with np.errstate(all="ignore"):
        r = s / n if n else np.full(np.shape(s), np.nan)   # the mean of nothing is NaN
    return np.asarray(r, dtype=np.float64)


REDUCE_REF = {"sum_squared": sum_squared_ref, "mean_abs": mean_abs_ref}


def reduced_length(shape, axis):
    """Number of elements each result element reduces."""
    if axis is None:
        return math.prod(shape)
    axes = axis if isinstance(axis, tuple) else (axis,)
    return math.prod(shape[a] for a in axes)


def reduce_shape(shape, axis, keepdims):
    nd = len(shape)
    if axis is None:
        axes = set(range(nd))
    else:
        axes = {a % nd for a in (axis if isinstance(axis, tuple) else (axis,))}
    if keepdims:
        return tuple(1 if d in axes else n for d, n in enumerate(shape))
    return tuple(n for d, n in enumerate(shape) if d not in axes)


def result_dtype(x_dtype, dtype):
    return np.dtype(x_dtype) if dtype is None else np.dtype(dtype)


# ============================================================ normalizations
def _norm_axes(x, normalized_shape):
    k = 1 if isinstance(normalized_shape, int) else len(normalized_shape)
    return tuple(range(x.ndim - k, x.ndim))


def layer_norm_ref(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """PyTorch's layer_norm in float64: biased variance, two passes."""
    v = _f64(x)
    axes = _norm_axes(v, normalized_shape)
    with np.errstate(all="ignore"):
        mean = v.mean(axis=axes, keepdims=True)
        d = v - mean
        var = (d * d).mean(axis=axes, keepdims=True)
        y = d / np.sqrt(var + float(eps))
        if weight is not None:
            y = y * _f64(weight)
        if bias is not None:
            y = y + _f64(bias)
    return y


def layer_norm_relu_ref(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    y = layer_norm_ref(x, normalized_shape, weight, bias, eps)
    return np.where(np.isnan(y), y, np.maximum(y, 0.0))   # relu keeps NaN (torch.relu does)


def rms_norm_ref(x, normalized_shape, weight=None, eps=1e-6):
    v = _f64(x)
    axes = _norm_axes(v, normalized_shape)
    with np.errstate(all="ignore"):
        ms = (v * v).mean(axis=axes, keepdims=True)
        y = v / np.sqrt(ms + float(eps))
        if weight is not None:
            y = y * _f64(weight)
    return y


NORM_REF = {"layer_norm": layer_norm_ref, "layer_norm_relu": layer_norm_relu_ref, "rms_norm": rms_norm_ref}


# ------------------------------------------- the algorithms the tests reject
def one_pass_layer_norm(x, normalized_shape, compute_dtype, eps=1e-5):
    """layer_norm with the naive one-pass variance E[x^2] - E[x]^2, all in
    ``compute_dtype`` (NumPy's pairwise sums): what the offset tests must reject."""
    c = np.dtype(compute_dtype)
    v = np.asarray(x).astype(c)
    axes = _norm_axes(v, normalized_shape)
    with np.errstate(all="ignore"):
        mean = v.mean(axis=axes, keepdims=True, dtype=c)
        msq = (v * v).mean(axis=axes, keepdims=True, dtype=c)
        var = msq - mean * mean
        y = (v - mean) / np.sqrt(var + c.type(eps))
    return y


# ================================================================== softmax
def softmax_ref(x, axis=-1):
    v = _f64(x)
    with np.errstate(all="ignore"):
        m = np.max(v, axis=axis, keepdims=True, initial=-np.inf)  # NaN if the row has one; -inf if all -inf
        e = np.exp(v - m)                          # -inf - -inf = NaN, inf - inf = NaN
        return e / np.sum(e, axis=axis, keepdims=True)


def log_softmax_ref(x, axis=-1):
    v = _f64(x)
    with np.errstate(all="ignore"):
        m = np.max(v, axis=axis, keepdims=True, initial=-np.inf)
        d = v - m
        return d - np.log(np.sum(np.exp(d), axis=axis, keepdims=True))


SOFTMAX_REF = {"softmax": softmax_ref, "log_softmax": log_softmax_ref}


# ==================================================================== errors
def raises_each(exc, cases, call):
    """``call(case)`` raises ``exc`` for every case; names the first that does not."""
    for case in cases:
        try:
            call(case)
        except exc:
            continue
        except Exception as e:
            raise AssertionError(f"{case!r}: raised {type(e).__name__}: {e}; expected {exc.__name__}") from e
        raise AssertionError(f"{case!r}: no {exc.__name__} raised")
