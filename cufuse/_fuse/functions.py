"""The functions ``cufuse.fuse`` traces: ``cufuse.exp``, ``cufuse.where``, ...

Inside a fused function they add a node to the trace. Called on concrete
arrays, each runs as a one-function fused kernel (cached per function, so a
second call neither traces nor compiles).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from . import graph as G

_SINGLE: dict = {}  # (name, fixed args) -> Fused of that one function


def _is_traced(*vals):
    return any(isinstance(v, G.Traced) for v in vals) or G.tracing() is not None


def _concrete(key, fn, args):
    from .api import Fused
    f = _SINGLE.get(key)
    if f is None:
        f = _SINGLE[key] = Fused(fn, name=key[0])
    return f(*args)


def _unary(name: str, op: str | None = None, doc: str = "") -> Callable[[Any], Any]:
    op = op or name

    def f(x: Any, /) -> Any:
        if _is_traced(x):
            return G.unary(op, x)
        return _concrete((name,), f, (x,))

    f.__name__ = f.__qualname__ = name
    f.__module__ = "cufuse"
    f.__doc__ = doc or f"Elementwise {name}; traced inside cufuse.fuse, one fused kernel on arrays."
    return f


exp = _unary("exp")
exp2 = _unary("exp2", doc="Elementwise 2 ** x.")
log = _unary("log")
log1p = _unary("log1p", doc="Elementwise log(1 + x), accurate near 0.")
expm1 = _unary("expm1", doc="Elementwise exp(x) - 1, accurate near 0.")
sqrt = _unary("sqrt")
rsqrt = _unary("rsqrt", doc="Elementwise 1 / sqrt(x).")
sin = _unary("sin")
cos = _unary("cos")
tanh = _unary("tanh")
sigmoid = _unary("sigmoid", doc="Elementwise 1 / (1 + exp(-x)).")
erf = _unary("erf", doc="Elementwise error function.")
relu = _unary("relu", doc="Elementwise max(x, 0); NaN stays NaN.")
silu = _unary("silu", doc="Elementwise x * sigmoid(x).")
softplus = _unary("softplus", doc="Elementwise log(1 + exp(x)), computed as max(x, 0) + log1p(exp(-|x|)).")
round = _unary("round", doc="Elementwise rounding to the nearest integer, half to even (numpy.round); "
                            "integers are returned unchanged.")
floor = _unary("floor", doc="Elementwise floor; integers are returned unchanged.")
ceil = _unary("ceil", doc="Elementwise ceil; integers are returned unchanged.")
abs = _unary("abs", doc="Elementwise absolute value.")


def gelu(x: Any, /, approximate: str = "none") -> Any:
    """GELU with PyTorch's definitions: approximate="none" (erf) or "tanh"."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"cufuse.gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    op = "gelu" if approximate == "none" else "gelu_tanh"
    if _is_traced(x):
        return G.unary(op, x)
    return _concrete(("gelu", approximate), lambda v: gelu(v, approximate), (x,))


def _binary(name: str) -> Callable[[Any, Any], Any]:
    def f(a: Any, b: Any, /) -> Any:
        if _is_traced(a, b):
            return G.binary(name, a, b)
        return _concrete((name,), f, (a, b))

    f.__name__ = f.__qualname__ = name
    f.__module__ = "cufuse"
    f.__doc__ = f"Elementwise {name} (NaN-propagating, as NumPy's); traced inside cufuse.fuse."
    return f


minimum = _binary("minimum")
maximum = _binary("maximum")

# Division, subtraction and multiplication as NumPy computes them, for the
# quantization ops built on cufuse.fuse (fake_quantize_int8): the GPU's other
# float32 arithmetic flushes subnormal operands and results (-ftz), these do
# not, so a subnormal scale or zero point gives what quantize_int8 and
# dequantize_int8 give. Not public, and without a gradient.
QUANT_OPS = ("qdiv", "qsub", "qmul")
qdiv, qsub, qmul = (_binary(op) for op in QUANT_OPS)


def where(cond: Any, a: Any, b: Any, /) -> Any:
    """``a`` where ``cond`` is true, else ``b`` (numpy.where with three arguments)."""
    if _is_traced(cond, a, b):
        return G.where(cond, a, b)
    return _concrete(("where",), where, (cond, a, b))


def clip(x: Any, lo: Any, hi: Any, /) -> Any:
    """minimum(maximum(x, lo), hi), as numpy.clip."""
    if _is_traced(x, lo, hi):
        return G.clip(x, lo, hi)
    return _concrete(("clip",), clip, (x, lo, hi))


def _np_reduction(kind):
    def f(x, axis=None, dtype=None, out=None, keepdims=False, **kw):
        if dtype is not None or out is not None or kw:
            raise G.TraceError(f"cufuse.fuse: numpy.{kind} inside a fused function takes axis and keepdims only")
        return G.reduce(kind, x, axis, keepdims, {})  # (no axis: as the method, a 1-d value's only)
    return f


def _np_clip(x, a_min=None, a_max=None, *, min=None, max=None, **kw):
    lo, hi = (a if a is not None else b for a, b in ((a_min, min), (a_max, max)))  # (NumPy 2.1's min= and max=)
    if kw or lo is None or hi is None:
        raise G.TraceError("cufuse.fuse: numpy.clip inside a fused function takes both bounds, (x, lo, hi) or "
                           "min= and max=; for one bound use numpy.maximum(x, lo) or numpy.minimum(x, hi)")
    return clip(x, lo, hi)


def _np_round(x, decimals=0, out=None):
    if decimals != 0 or out is not None:
        raise G.TraceError("cufuse.fuse: numpy.round inside a fused function takes no decimals or out")
    a = G.lift(G._graph_of(x), x)
    if a.dtype == np.bool_:  # NumPy rounds booleans in its rint loop's type (float16), integers as they are
        return _np_rounding(np.rint, "round")(a)
    return round(a)


def _np_rounding(ufunc, op):
    """numpy.rint / floor / ceil on a traced value: the installed NumPy's loop
    decides the result type (NumPy 2: rint of int8 gives float16)."""
    def f(x):
        a = G.lift(G._graph_of(x), x)
        dt = ufunc.resolve_dtypes((a.dtype, None))[0]
        return G.unary(op, a if dt == a.dtype else _loop_cast(a, dt))
    f.__name__ = ufunc.__name__
    return f


def _loop_cast(a, dt):
    """``a`` as ``dt`` for a NumPy ufunc's loop, a Python scalar staying weak (under NumPy's rules
    Traced.__array_ufunc__ makes the result strong; torch takes NumPy scalars as weak)."""
    c = G.cast(a, dt)
    return G.Traced(c.graph, c.node, c.dtype, weak=True, ndim=c.ndim) if a.weak else c


def _np_fabs(x):
    """numpy.fabs: abs in the float type NumPy's loop gives (float16 for int8 and bool, float64 for int32)."""
    a = G.lift(G._graph_of(x), x)
    if not G.is_float(a.dtype):
        a = _loop_cast(a, np.fabs.resolve_dtypes((a.dtype, None))[0])
    return abs(a)


def _np_where(c, a=None, b=None):
    if a is None or b is None:
        raise G.TraceError("cufuse.fuse: numpy.where needs three arguments inside a fused function")
    return where(c, a, b)


# NumPy ufuncs a traced value answers to (Traced.__array_ufunc__)
NUMPY_UFUNCS = {
    # graph ops directly: `a * b` with a NumPy scalar on the left would come back here
    "add": lambda a, b: G.binary("add", a, b), "subtract": lambda a, b: G.binary("sub", a, b),
    "multiply": lambda a, b: G.binary("mul", a, b), "true_divide": lambda a, b: G.binary("truediv", a, b),
    "divide": lambda a, b: G.binary("truediv", a, b), "floor_divide": lambda a, b: G.binary("floordiv", a, b),
    "remainder": lambda a, b: G.binary("mod", a, b), "power": lambda a, b: G.binary("pow", a, b),
    "negative": lambda a: G.unary("neg", a),
    "less": lambda a, b: G.binary("lt", a, b), "less_equal": lambda a, b: G.binary("le", a, b),
    "greater": lambda a, b: G.binary("gt", a, b), "greater_equal": lambda a, b: G.binary("ge", a, b),
    "equal": lambda a, b: G.binary("eq", a, b), "not_equal": lambda a, b: G.binary("ne", a, b),
    "bitwise_and": lambda a, b: G.binary("and", a, b), "bitwise_or": lambda a, b: G.binary("or", a, b),
    "bitwise_xor": lambda a, b: G.binary("xor", a, b), "invert": lambda a: G.unary("invert", a),
    "absolute": abs, "fabs": _np_fabs, "exp": exp, "exp2": exp2, "log": log, "log1p": log1p, "expm1": expm1,
    "sqrt": sqrt, "sin": sin, "cos": cos, "tanh": tanh, "rint": _np_rounding(np.rint, "round"), "floor": _np_rounding(np.floor, "floor"),
    "ceil": _np_rounding(np.ceil, "ceil"),
    "minimum": minimum, "maximum": maximum,
}

NUMPY_FUNCTIONS = {
    "where": _np_where, "clip": _np_clip, "round": _np_round, "around": _np_round,
    "sum": _np_reduction("sum"), "mean": _np_reduction("mean"), "max": _np_reduction("max"),
    "min": _np_reduction("min"), "amax": _np_reduction("max"), "amin": _np_reduction("min"),
}

PUBLIC = ["where", "abs", "exp", "exp2", "log", "log1p", "expm1", "sqrt", "rsqrt", "sin", "cos", "tanh",
          "sigmoid", "erf", "relu", "gelu", "silu", "softplus", "clip", "minimum", "maximum", "round",
          "floor", "ceil"]
