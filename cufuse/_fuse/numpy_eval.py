"""The traced graph run with NumPy: the fallback, same semantics as the kernel
(float16 computed in float32, Python's // and %, integer division by 0 gives 0)."""
from __future__ import annotations

import numpy as np

from . import graph as G


def _erf(v):
    from ..ops.elementwise import erf_numpy
    return erf_numpy(v)


def _gelu(v, approximate):
    from ..ops.elementwise import gelu_numpy
    return gelu_numpy(v, approximate)


def _relu(a):
    return np.where(a < 0, np.zeros((), a.dtype), a)


def _power(a, b):
    """a ** b; of integers with a negative exponent 1 / a**|b| truncated toward zero, as the kernels
    (and torch) give it: 1 for a base of 1, +-1 for -1, 0 for any other base."""
    if a.dtype.kind == "f":
        return np.power(a, b)
    neg = b < 0
    if not neg.any():
        return np.power(a, b)
    r = np.power(a, np.where(neg, np.zeros((), b.dtype), b))
    one = np.ones((), a.dtype)
    small = np.where(a == one, one, np.where((a == -1) if a.dtype.kind == "i" else False,
                                             np.where(b % 2 == 1, -one, one), np.zeros((), a.dtype)))
    return np.where(neg, small, r)


def float_to_int(v, dt):
    """A float array as integer type ``dt``, as the kernels' cast_to does:
    truncated toward zero; NaN and values beyond int32 (int64 for 8-byte
    types) give that type's minimum; narrower types take the low bits (what
    NumPy and torch give on x86-64, defined here for every platform)."""
    wide = np.dtype(np.int64 if dt.itemsize == 8 else np.int32)
    lim = float(2 ** (8 * wide.itemsize - 1))
    d = v.astype(np.float64)
    ok = (d >= -lim) & (d < lim)
    r = np.where(ok, d, 0.0).astype(wide)
    r[~ok] = np.iinfo(wide).min
    return r.astype(dt)


def _cast(v, dt):
    if v.dtype.kind == "f" and dt.kind in "iu":
        return float_to_int(v, dt)
    return v.astype(dt)


def _one(a):
    return a.dtype.type(1)


_FN = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "truediv": np.true_divide,
    "floordiv": np.floor_divide, "mod": np.remainder, "pow": _power,
    "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal, "eq": np.equal,
    "ne": np.not_equal, "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor,
    "minimum": np.minimum, "maximum": np.maximum, "clip_lo": np.maximum, "clip_hi": np.minimum,
    "qdiv": np.true_divide, "qsub": np.subtract, "qmul": np.multiply,
    "neg": np.negative, "invert": np.invert, "abs": np.abs, "relu": _relu, "round": np.rint,
    "floor": np.floor, "ceil": np.ceil, "exp": np.exp, "exp2": np.exp2, "log": np.log, "log1p": np.log1p,
    "expm1": np.expm1, "sqrt": np.sqrt, "sin": np.sin, "cos": np.cos, "tanh": np.tanh,
    "rsqrt": lambda a: _one(a) / np.sqrt(a),
    "sigmoid": lambda a: _one(a) / (_one(a) + np.exp(-a)),
    "silu": lambda a: a / (_one(a) + np.exp(-a)),
    "softplus": lambda a: np.maximum(a, np.zeros((), a.dtype)) + np.log1p(np.exp(-np.abs(a))),
    "erf": _erf, "gelu": lambda a: _gelu(a, "none"), "gelu_tanh": lambda a: _gelu(a, "tanh"),
    "where": np.where,
}


def _reusable(fn, node, i, args, last, inputs, cdt):
    """An argument of node ``i`` whose memory its ufunc ``fn`` may write: one
    this evaluation made (not an input, not a view), used for the last time
    here, of the result's dtype and shape; None if there is none."""
    if not isinstance(fn, np.ufunc) or fn.nout != 1:
        return None
    for j, a in zip(node.args, args):
        if (last.get(j) == i and isinstance(a, np.ndarray) and a.base is None and id(a) not in inputs
                and a.dtype == cdt and a.flags.writeable):
            if a.shape == np.broadcast_shapes(*[np.shape(b) for b in args]):
                return a
    return None


def evaluate(g, arrays, params, shape):
    """Outputs of ``g`` (NumPy arrays of the result dtypes) for NumPy ``arrays``
    (the array arguments) and ``params`` (scalar parameter values), with the
    elementwise iteration space ``shape``."""
    vals = {}
    # each intermediate is dropped after its last use: held to the end, they were fresh allocations every
    # call (page faults: 7-9x the plain NumPy chain at 1M elements)
    last = {}
    for i, node in enumerate(g.nodes):
        for j in node.args:
            last[j] = i
    for node, *_ in g.outputs:
        last[node] = len(g.nodes)
    inputs = {id(a) for a in arrays}
    with np.errstate(all="ignore"):
        for i, node in enumerate(g.nodes):
            cdt = G.compute_dtype(node.dtype)
            if node.op == "input":
                v = np.asarray(arrays[node.attr]).astype(cdt, copy=False)
            elif node.op == "param":
                v = np.asarray(params[node.attr]).astype(node.dtype).astype(cdt)
            elif node.op == "cast":
                v = _cast(np.asarray(vals[node.args[0]]), node.attr).astype(cdt, copy=False)
            else:
                fn, args = _FN[node.op], [vals[j] for j in node.args]
                into = _reusable(fn, node, i, args, last, inputs, cdt)
                v = np.asarray(fn(*args) if into is None else fn(*args, out=into))
                if v.dtype != cdt:
                    v = v.astype(cdt)
            for j in set(node.args):
                if last.get(j) == i:
                    del vals[j]
            vals[i] = v
        outs = []
        for node, kind, keep, odt in g.outputs:
            v = np.broadcast_to(vals[node], shape)
            if kind is None:
                w = vals[node]
                # an intermediate this call made, of the full shape, returned once: no copy
                owned = (w.base is None and id(w) not in inputs and w.shape == tuple(shape)
                         and not any(o is w for o in outs))
                outs.append(w.astype(odt, copy=False) if owned else np.array(v, dtype=odt))
                continue
            acc = G.compute_dtype(odt)
            if kind in ("sum", "mean"):
                r = v.sum(axis=-1, dtype=acc, keepdims=keep)
                if kind == "mean":
                    r = r / acc.type(shape[-1])  # 0 / 0 = NaN for an empty axis, as NumPy
            else:
                if shape[-1] == 0:
                    raise ValueError(f"cufuse.fuse: {kind} over an empty last axis (zero-size reduction)")
                r = (np.max if kind == "max" else np.min)(v, axis=-1, keepdims=keep)
            outs.append(np.asarray(r).astype(odt))
    return outs
