"""Tracing: a Python function over symbolic arrays becomes a typed graph.

``trace(fn, sig)`` calls ``fn`` once with a ``Traced`` value per argument.
Every operation on a ``Traced`` appends a ``Node`` to the graph; NumPy's
dtype rules (NEP 50: Python scalars are weak) are applied as it grows, and
explicit ``cast`` nodes are inserted wherever an operand changes type, so
that code generation and the NumPy evaluator read one fully typed program.

Scalars, literals included, become parameters (kernel arguments), never
constants in the source: a new value never recompiles. Python operators
between Python numbers only (scalar arguments, literals and what is computed
from them alone, such as ``2 ** (n - 3)``) are what Python computes when the
function runs eagerly, so they are not traced: they become ``HostExpr``
parameters, evaluated by Python at each call (``2 ** -1`` is 0.5, not the
int64 0; no int64 wrap-around).
"""
from __future__ import annotations

import operator
import threading
from dataclasses import dataclass, field

import numpy as np

from .. import _arrays as A


class TraceError(TypeError):
    """A construct that cufuse.fuse cannot trace (raised at trace time)."""


# dtypes an array input may have, and every dtype a node may take
INPUT_DTYPES = tuple(np.dtype(d) for d in (np.bool_, np.int8, np.uint8, np.int16, np.int32, np.int64)) + \
    A.FLOAT_DTYPES
ASTYPE_DTYPES = INPUT_DTYPES
_F16, _F32, _F64 = A.F16, A.F32, A.F64
_BOOL, _I64, _U64 = np.dtype(np.bool_), np.dtype(np.int64), np.dtype(np.uint64)
DTYPE_NAMES = ", ".join(d.name for d in INPUT_DTYPES)


# bfloat16 is a float (NumPy kind "V"); float16 and bfloat16 are computed in
# float32, as in the hand-written kernels; bfloat16 promotes as A.result_type says
is_float = A.is_float
compute_dtype = A.compute_dtype


def float_result(dt):
    """dtype of a float function (exp, sin, ...) of ``dt``, as NumPy's ufuncs give."""
    return dt if is_float(dt) else np.promote_types(dt, _F16)


@dataclass(frozen=True)
class Node:
    op: str
    args: tuple = ()
    dtype: np.dtype | None = None
    attr: object = None   # input/param index, cast target, reduction kind, ...


@dataclass
class Graph:
    nodes: list = field(default_factory=list)
    inputs: list = field(default_factory=list)   # per array input: (argument position, dtype, ndim)
    params: list = field(default_factory=list)   # per scalar parameter: ("arg", position) or ("const", value), C kind
    outputs: list = field(default_factory=list)  # per output: (node id, reduction or None, keepdims)
    # per-call checks of scalar parameters, as NumPy 2 raises: (param index, dtype, side):
    # the value must fit dtype (side "both": a Python int cast into an integer
    # operation; "lo" / "hi": a clip bound must not lie above / below the range),
    # or dtype None: an integer power's exponent must not be negative
    checks: list = field(default_factory=list)
    ndim: int = 0                                # of the broadcast (elementwise) shape
    tuple_out: bool = False
    # None: NumPy 2's type rules (NumPy and CuPy arrays); else torch's, with this
    # default float dtype (torch.get_default_dtype()) for Python floats and for
    # float results of integers; uses_default: some type was that default
    torch_float: np.dtype | None = None
    uses_default: bool = False

    def default_float(self):
        self.uses_default = True
        return self.torch_float

    def add(self, op, args=(), dtype=None, attr=None):
        self.nodes.append(Node(op, tuple(args), dtype, attr))
        return len(self.nodes) - 1

    @property
    def reduction(self):
        return self.outputs[0][1] if self.outputs else None


# ---------------------------------------------------------------------- tracer
# The graphs being traced, per thread (nested fused calls trace inline): another
# thread's calls run as calls while this one traces.
_STATE = threading.local()


def tracing():
    stack = getattr(_STATE, "stack", None)
    return stack[-1] if stack else None


def _stack():
    stack = getattr(_STATE, "stack", None)
    if stack is None:
        stack = _STATE.stack = []
    return stack


class Traced:
    """A symbolic array (or scalar) inside ``cufuse.fuse``."""

    __slots__ = ("graph", "_node", "dtype", "weak", "ndim", "reduced", "host")
    __array_priority__ = 1000

    def __init__(self, graph, node, dtype, weak=False, ndim=0, reduced=False, host=None):
        self.graph, self._node, self.dtype, self.weak, self.ndim, self.reduced = (
            graph, node, np.dtype(dtype), weak, ndim, reduced)
        self.host = host  # a HostExpr: a Python number, computed by Python at each call

    @property
    def node(self):
        """Its graph node; a Python number's (``host``) is made at its first use in the graph."""
        if self._node is None:
            self._node = self.graph.add("param", (), self.dtype, len(self.graph.params))
            self.graph.params.append((("host", self.host), _ckind(self.dtype)))
        return self._node

    def __repr__(self):
        kind = "scalar" if self.weak else f"{self.ndim}-d array"
        return f"<cufuse traced {kind} of {self.dtype}>"

    # --- what cannot be traced
    def __bool__(self):
        raise TraceError("cufuse.fuse: a traced value was used as a Python bool (an `if`/`while` on it, "
                         "`and`/`or`/`not`, or a chained comparison such as a < x < b); the kernel cannot "
                         "branch in Python: use cufuse.where(cond, a, b), `&`, `|` and `~` instead")

    def __float__(self):
        raise TraceError("cufuse.fuse: float() of a traced value is not traceable (its value is not known "
                         "while tracing). Python's math functions (math.exp, math.sqrt, math.tanh, ...) call "
                         "float() on their argument: use cufuse.exp, cufuse.sqrt, ... (or numpy's) instead; to "
                         "change the dtype, use .astype(numpy.float32)")

    def __int__(self):
        raise TraceError("cufuse.fuse: int() of a traced value is not traceable (its value is not known "
                         "while tracing); use .astype(numpy.int32)")

    __index__ = __int__

    def __complex__(self):
        raise TraceError("cufuse.fuse: complex() of a traced value is not traceable")

    def __len__(self):
        raise TraceError("cufuse.fuse: len() of a traced value is not traceable (shapes are not known "
                         "while tracing)")

    def __iter__(self):
        raise TraceError("cufuse.fuse: iterating over a traced value is not traceable; write the "
                         "computation elementwise")

    def __getitem__(self, key):
        raise TraceError("cufuse.fuse: indexing or slicing a traced value (x[...]) is not traceable; "
                         "slice the arrays before calling the fused function")

    def __setitem__(self, key, value):
        raise TraceError("cufuse.fuse: index assignment (x[...] = v) to a traced value is not traceable; "
                         "use cufuse.where")

    @property
    def shape(self):
        raise TraceError("cufuse.fuse: .shape of a traced value is not known while tracing")

    # --- arithmetic
    def __add__(self, o): return _py_binary("add", self, o)
    def __radd__(self, o): return _py_binary("add", o, self)
    def __sub__(self, o): return _py_binary("sub", self, o)
    def __rsub__(self, o): return _py_binary("sub", o, self)
    def __mul__(self, o): return _py_binary("mul", self, o)
    def __rmul__(self, o): return _py_binary("mul", o, self)
    def __truediv__(self, o): return _py_binary("truediv", self, o)
    def __rtruediv__(self, o): return _py_binary("truediv", o, self)
    def __floordiv__(self, o): return _py_binary("floordiv", self, o)
    def __rfloordiv__(self, o): return _py_binary("floordiv", o, self)
    def __mod__(self, o): return _py_binary("mod", self, o)
    def __rmod__(self, o): return _py_binary("mod", o, self)
    def __pow__(self, o): return _py_binary("pow", self, o)
    def __rpow__(self, o): return _py_binary("pow", o, self)
    def __lt__(self, o): return _py_binary("lt", self, o)
    def __le__(self, o): return _py_binary("le", self, o)
    def __gt__(self, o): return _py_binary("gt", self, o)
    def __ge__(self, o): return _py_binary("ge", self, o)
    def __eq__(self, o): return _py_binary("eq", self, o)  # noqa: D105
    def __ne__(self, o): return _py_binary("ne", self, o)
    def __and__(self, o): return _py_binary("and", self, o)
    def __rand__(self, o): return _py_binary("and", o, self)
    def __or__(self, o): return _py_binary("or", self, o)
    def __ror__(self, o): return _py_binary("or", o, self)
    def __xor__(self, o): return _py_binary("xor", self, o)
    def __rxor__(self, o): return _py_binary("xor", o, self)
    def __neg__(self): return _py_unary("neg", self)
    def __pos__(self): return _py_unary("pos", self)
    def __invert__(self): return _py_unary("invert", self)
    def __abs__(self): return _py_unary("abs", self)
    __hash__ = None  # type: ignore[assignment]  # == builds a graph node: not hashable

    def astype(self, dtype, copy=True):
        dt = _dtype_arg(dtype)
        if self.reduced:  # (cast() would start from the value before the reduction)
            if dt == self.dtype:
                return self
            raise TraceError(f"cufuse.fuse: astype({dt}) after the reduction (sum/mean/max/min) is not supported: "
                             "cast before it (x.astype(t).sum(...)), or cast the result")
        if dt in A.HALVES and self.dtype == dt and not self.weak:
            # float16 / bfloat16 values are held in float32 until stored: astype rounds them now
            g = self.graph
            return Traced(g, g.add("cast", (self.node,), dt, dt), dt, ndim=self.ndim)
        return cast(self, dt)

    # --- the trailing reduction
    # (no axis: over every element, as NumPy and torch reduce: the last axis of a 1-d value only)
    def sum(self, axis=None, keepdims=False, **kw): return reduce("sum", self, axis, keepdims, kw)
    def mean(self, axis=None, keepdims=False, **kw): return reduce("mean", self, axis, keepdims, kw)
    def max(self, axis=None, keepdims=False, **kw): return reduce("max", self, axis, keepdims, kw)
    def min(self, axis=None, keepdims=False, **kw): return reduce("min", self, axis, keepdims, kw)

    # --- NumPy functions on traced values
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        from .functions import NUMPY_UFUNCS
        fn = NUMPY_UFUNCS.get(ufunc.__name__)
        if method != "__call__" or fn is None or kwargs:
            what = ufunc.__name__ if method == "__call__" else f"{ufunc.__name__}.{method}"
            extra = f" with keyword arguments {sorted(kwargs)}" if kwargs and fn is not None else ""
            raise TraceError(f"cufuse.fuse: numpy.{what}{extra} is not supported inside a fused function; "
                             f"supported NumPy ufuncs: {', '.join(sorted(NUMPY_UFUNCS))}")
        return _numpy_result(self.graph, fn(*inputs))

    def __array_function__(self, func, types, args, kwargs):
        from .functions import NUMPY_FUNCTIONS
        fn = NUMPY_FUNCTIONS.get(func.__name__)
        if fn is None:
            raise TraceError(f"cufuse.fuse: numpy.{func.__name__} is not supported inside a fused function; "
                             f"supported NumPy functions: {', '.join(sorted(NUMPY_FUNCTIONS))} and the ufuncs")
        return _numpy_result(self.graph, fn(*args, **kwargs))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """torch's functions and tensor methods (torch.exp(x), t + x of a captured tensor t) are not
        traced: a clear error instead of torch's own about a Traced argument."""
        def flat(v):
            return [w for u in v for w in flat(u)] if isinstance(v, (list, tuple)) else [v]
        if any(type(v).__module__.startswith("torch") for v in flat(list(args)) + list((kwargs or {}).values())):
            raise TraceError("cufuse.fuse: a torch tensor captured from outside the fused function was used in "
                             "it; pass it as an argument instead")
        name = getattr(func, "__name__", repr(func))
        raise TraceError(f"cufuse.fuse: torch.{name} is not traceable inside a fused function; use cufuse's "
                         "functions (cufuse.exp, cufuse.where, cufuse.clip, ...), NumPy's ufuncs or Python's "
                         "operators on the traced values (and .astype to cast)")

    def __getattr__(self, name):
        # (only names a Traced lacks: x.exp(), x.clamp(), x.to(); dunders stay plain for hasattr and copy)
        if name.startswith("__"):
            raise AttributeError(name)
        import cufuse
        use = _METHOD_INSTEAD.get(name) or (f"cufuse.{name}(x)" if name in cufuse.__all__ else
                                            "cufuse's functions or NumPy's ufuncs")
        raise AttributeError(f"cufuse.fuse: a traced value has no .{name} (tensor and array methods other than "
                             f".astype/.sum/.mean/.max/.min are not traced); use {use}")

    def __array__(self, *a, **k):
        raise TraceError("cufuse.fuse: a traced value was converted to a NumPy array (numpy.asarray or a "
                         "non-NumPy function); only cufuse's functions and NumPy ufuncs can be traced")


# what to use for tensor and array methods a traced value lacks (others: cufuse.<name> where it exists)
_METHOD_INSTEAD = {"clamp": "cufuse.clip(x, lo, hi)", "clamp_min": "cufuse.maximum(x, lo)",
                   "clamp_max": "cufuse.minimum(x, hi)", "to": ".astype(dtype)", "type": ".astype(dtype)",
                   "float": ".astype(numpy.float32)", "double": ".astype(numpy.float64)",
                   "half": ".astype(numpy.float16)", "int": ".astype(numpy.int32)", "long": ".astype(numpy.int64)",
                   "pow": "x ** y", "square": "x * x", "reshape": "reshaping outside the fused function",
                   "view": "reshaping outside the fused function", "T": "transposing outside the fused function"}


def _numpy_result(g, r):
    """A NumPy function's result: under NumPy 2's rules a NumPy function of
    Python scalars gives a NumPy scalar, which is strongly typed
    (``int8_array + numpy.maximum(s, 0)`` is int64); torch takes NumPy
    scalars as it takes Python ones (weak)."""
    if isinstance(r, Traced) and (r.weak and r.graph.torch_float is None or r.host is not None):
        return Traced(r.graph, r.node, r.dtype, weak=r.weak and r.graph.torch_float is not None, ndim=r.ndim,
                      reduced=r.reduced)
    return r


def _dtype_arg(dtype):
    try:
        t = __import__("sys").modules.get("torch")
        if t is not None and isinstance(dtype, t.dtype):
            from .._arrays import torch_to_numpy_dtype
            dt = torch_to_numpy_dtype(dtype)
        else:
            dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt not in ASTYPE_DTYPES:
        raise TraceError(f"cufuse.fuse: astype({dtype!r}): the dtypes are {DTYPE_NAMES}")
    return dt


# ------------------------------------------------------------- building nodes
def _graph_of(*vals):
    for v in vals:
        if isinstance(v, Traced):
            return v.graph
    return tracing()


_OTHER_TRACE = "cufuse.fuse: a traced value from another fused function's trace was used"


def lift(g, v):
    """A Traced for ``v``: itself, or a new scalar parameter for a Python/NumPy scalar."""
    if isinstance(v, Traced):
        if v.graph is not g:
            raise TraceError(_OTHER_TRACE)
        if v.reduced:
            raise TraceError("cufuse.fuse: a value computed after the reduction: the reduction "
                             "(sum/mean/max/min over the last axis) must be the last step of a fused function")
        if v.host is not None:  # a Python number entering a traced operation: a parameter of the kernel from here
            return Traced(g, v.node, v.dtype, weak=v.weak, ndim=v.ndim)
        return v
    if isinstance(v, (bool, np.bool_)):
        return param(g, ("const", bool(v)), _BOOL, weak=False)
    if isinstance(v, A.NP_SCALARS) and g.torch_float is not None:
        v = v.item()  # torch: a NumPy scalar is a number like Python's
    if isinstance(v, A.NP_SCALARS):  # before float: numpy.float64 is a float
        dt = np.dtype(type(v))
        if dt not in INPUT_DTYPES:
            raise TraceError(f"cufuse.fuse: a NumPy scalar of dtype {dt} is not supported; the dtypes are {DTYPE_NAMES}")
        return param(g, ("const", v.item()), dt, weak=False)
    if isinstance(v, int):
        return param(g, ("const", v), _I64, weak=True)
    if isinstance(v, float):
        return param(g, ("const", v), _F64, weak=True)
    what = f"{type(v).__module__}.{type(v).__name__}"
    if hasattr(v, "shape"):
        raise TraceError(f"cufuse.fuse: an array ({what}) captured from outside the fused function was used "
                         "in it; pass it as an argument instead")
    raise TraceError(f"cufuse.fuse: a value of type {what} cannot be used in a fused function "
                     "(only traced arrays and Python/NumPy int, float and bool scalars)")


def _ckind(dtype):
    return "double" if is_float(dtype) else "long long"


def param(g, source, dtype, weak):
    """A scalar kernel argument: ``source`` is ("arg", position), ("const", value) or ("host", HostExpr)."""
    g.params.append((source, _ckind(dtype)))
    node = g.add("param", (), dtype, len(g.params) - 1)
    return Traced(g, node, dtype, weak=weak, ndim=0)


def _param_index(v):
    nd = v.graph.nodes[v.node]
    return nd.attr if nd.op == "param" else None


def cast(v, dt, checked=True):
    """``v`` as ``dt``. A Python int cast into an integer type must fit it, as in
    NumPy 2 (``uint8_array + 300`` raises OverflowError), unless ``checked`` is
    False (numpy.where converts unchecked)."""
    dt = np.dtype(dt)
    if checked and v.weak and v.dtype.kind == "i" and dt.kind in "iu" and dt != _I64:
        k = _param_index(v)
        if k is not None:
            v.graph.checks.append((k, dt, "both"))
    if v.dtype == dt:
        return Traced(v.graph, v.node, dt, weak=False, ndim=v.ndim) if v.weak else v
    return Traced(v.graph, v.graph.add("cast", (v.node,), dt, dt), dt, weak=False, ndim=v.ndim)


def _torch_pair(a, b):
    """torch.promote_types on the dtypes fuse takes: a float beats any integer."""
    if a is None or b is None:
        return a if b is None else b
    if is_float(a) != is_float(b):
        return a if is_float(a) else b
    return A.promote_types(a, b)


def _torch_combine(higher, lower):
    """torch's combine_categories: a lower priority group (zero-dim tensors,
    then numbers) counts only where its category (bool < int < float) is higher."""
    if higher is None or lower is None:
        return lower if higher is None else higher
    if is_float(higher):
        return higher
    if higher == _BOOL or is_float(lower):
        return _torch_pair(higher, lower)
    return higher


def _torch_promote(g, vals):
    dim = zero = number = None
    for v in vals:
        if v.weak:  # a number: Python's, or a NumPy scalar (torch reads its value)
            d = g.default_float() if is_float(v.dtype) else v.dtype
            number = _torch_pair(number, d)
        elif v.ndim > 0:
            dim = _torch_pair(dim, v.dtype)
        else:
            zero = _torch_pair(zero, v.dtype)
    if dim is None and zero is None:  # numbers only: Python's own types
        return _F64 if is_float(number) else number
    return _torch_combine(dim, _torch_combine(zero, number))


def promote(*vals):
    """The result dtype of traced values: NumPy 2 promotion (weak Python
    scalars), or torch's (graph.torch_float) for torch tensors."""
    g = vals[0].graph
    if g.torch_float is not None:
        return _torch_promote(g, vals)
    strong = [v.dtype for v in vals if not v.weak]
    weak = [v.dtype for v in vals if v.weak]
    if not strong:  # Python scalars only: Python's own types
        return _F64 if any(is_float(d) for d in weak) else _I64
    dt = A.result_type(*strong)
    for w in weak:
        if is_float(w) and not is_float(dt):
            dt = _F64
        elif dt == _BOOL and w.kind in "iu":
            dt = _I64
    return dt


def _result(g, op, args, dt, attr=None, weak=False):
    ndim = max((a.ndim for a in args), default=0)
    return Traced(g, g.add(op, [a.node for a in args], dt, attr), dt, weak=weak, ndim=ndim)


_COMPARE = {"lt", "le", "gt", "ge", "eq", "ne"}
_BITWISE = {"and", "or", "xor"}
_SYMBOL = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%", "pow": "**",
           "and": "&", "or": "|", "xor": "^", "neg": "unary -", "invert": "~"}


class HostExpr:
    """A Python number computed from the call's arguments by Python's own
    operators: ``fn(args)``; ``kind`` (bool, int or float) is its type as
    traced, ``text`` says what it is in errors."""

    __slots__ = ("fn", "kind", "text", "sample")

    def __init__(self, fn, kind, text, sample=None):
        self.fn, self.kind, self.text = fn, kind, text
        # a value of its kind, to find an operator's result type while tracing: a literal's own
        # (n ** -1 is a float at every call), else one of the kind (int ** int is an int)
        self.sample = _SAMPLE[kind] if sample is None else sample

    def shifted(self, k):
        """The same value from argument lists with ``k`` more arguments in front."""
        fn = self.fn
        return HostExpr(lambda args: fn(args[k:]), self.kind, self.text, self.sample)


_HOST_DTYPE = {bool: _BOOL, int: _I64, float: _F64}
_PY_OPS = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
           "floordiv": operator.floordiv, "mod": operator.mod, "pow": operator.pow, "lt": operator.lt,
           "le": operator.le, "gt": operator.gt, "ge": operator.ge, "eq": operator.eq, "ne": operator.ne,
           "and": operator.and_, "or": operator.or_, "xor": operator.xor, "neg": operator.neg,
           "invert": operator.invert, "abs": operator.abs, "pos": operator.pos}
# a value of each Python type, to find an operator's result type while tracing
_SAMPLE = {bool: True, int: 3, float: 1.5}
_UNARY_SIGN = {"neg": "-", "invert": "~", "pos": "+"}


def host_value(v):
    """``v``'s HostExpr where it is a Python number (a Python scalar argument
    or literal, or computed from those alone), else None."""
    if isinstance(v, Traced):
        return v.host
    if isinstance(v, (bool, int, float)) and not isinstance(v, A.NP_SCALARS):
        return HostExpr(lambda args, v=v: v, type(v), repr(v), v)
    return None


def host_traced(g, h):
    """A Traced for the Python number ``h`` (a HostExpr): typed as a Python
    scalar of its kind is (int and float weak, bool not), its node made where it is used."""
    return Traced(g, None, _HOST_DTYPE[h.kind], weak=h.kind is not bool, host=h)


def _py_binary(op, a, b):
    """``a <op> b`` from a Python operator: computed by Python at each call
    where both are Python numbers and one is a traced argument's, else traced."""
    g = _graph_of(a, b)
    ha, hb = host_value(a), host_value(b)
    if ha is None or hb is None:
        return binary(op, a, b)
    for v in (a, b):
        if isinstance(v, Traced) and v.graph is not g:
            raise TraceError(_OTHER_TRACE)
    f, fa, fb = _PY_OPS[op], ha.fn, hb.fn
    try:
        kind = type(f(ha.sample, hb.sample))  # Python's TypeError for ones it does not take
    except ArithmeticError:  # a sample's overflow (1.5 ** 2000.0) or a literal 0 divisor: Python's type rules
        kind = float if float in (ha.kind, hb.kind) or op == "truediv" else int
    text = f"({ha.text} {_SYMBOL[op] if op in _SYMBOL else op} {hb.text})"
    return host_traced(g, HostExpr(lambda args: f(fa(args), fb(args)), kind, text))


def _py_unary(op, a):
    """``<op> a`` from a Python operator (+, -, ~, abs()): as _py_binary."""
    if a.host is None:
        return a if op == "pos" else unary(op, a)
    f, fa = _PY_OPS[op], a.host.fn
    # (~ of a bool is an int, Python 3.12 warning about it: not evaluated here, it warns at each call as eagerly)
    kind = int if op == "invert" and a.host.kind is bool else type(f(a.host.sample))
    text = f"abs({a.host.text})" if op == "abs" else f"{_UNARY_SIGN[op]}{a.host.text}"
    return host_traced(a.graph, HostExpr(lambda args: f(fa(args)), kind, text))


def binary(op, a, b):
    g = _graph_of(a, b)
    a, b = lift(g, a), lift(g, b)
    all_weak = a.weak and b.weak
    dt = promote(a, b)
    numpy_rules = g.torch_float is None  # torch wraps an int scalar to the tensor's type
    if op in _BITWISE:
        if is_float(dt):
            raise TraceError(f"cufuse.fuse: `{_SYMBOL[op]}` needs booleans or integers, got {a.dtype} and {b.dtype}")
        return _result(g, op, [cast(a, dt, numpy_rules), cast(b, dt, numpy_rules)], dt, weak=all_weak)
    if op in _COMPARE:
        if numpy_rules and dt.kind in "iu" and a.weak != b.weak and (a if a.weak else b).dtype.kind == "i":
            # a Python int against an integer array compares by value (NumPy 2:
            # uint8_array < 300 is all True): in int64, which holds both
            dt = _I64
        return _result(g, op, [cast(a, dt, numpy_rules), cast(b, dt, numpy_rules)], _BOOL)
    if op == "truediv" and not is_float(dt):
        dt = _F64 if numpy_rules or all_weak else g.default_float()
    if dt == _BOOL and op in ("floordiv", "mod", "pow") and numpy_rules:
        dt = np.dtype(np.int8)  # NumPy computes these on booleans as int8 (np.array([True]) // True is int8)
    if dt == _BOOL and op in ("sub", "truediv", "floordiv", "mod", "pow"):
        raise TraceError(f"cufuse.fuse: `{_SYMBOL.get(op, op)}` on booleans is not supported (as in "
                         f"{'NumPy' if numpy_rules else 'torch'}); use astype first")
    args = [cast(a, dt, numpy_rules), cast(b, dt, numpy_rules)]
    if op == "pow" and dt.kind in "iu" and _param_index(b) is not None:
        g.checks.append((_param_index(b), None, None))  # NumPy: integers to negative integer powers raise
    return _result(g, op, args, dt, weak=all_weak)


# unary float functions: result is float_result(dtype)
FLOAT_UNARY = ("exp", "exp2", "log", "log1p", "expm1", "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid",
               "erf", "gelu", "gelu_tanh", "silu", "softplus")


def unary(op, a):
    g = _graph_of(a)
    a = lift(g, a)
    if op in FLOAT_UNARY:
        if is_float(a.dtype):
            dt = a.dtype
        elif a.weak:
            dt = _F64
        else:
            dt = float_result(a.dtype) if g.torch_float is None else g.default_float()
        return _result(g, op, [cast(a, dt)], dt, weak=a.weak)
    if op == "neg" and a.dtype == _BOOL:
        raise TraceError("cufuse.fuse: unary - on booleans is not supported (as in NumPy); use ~ for logical not")
    if op == "invert" and is_float(a.dtype):
        raise TraceError(f"cufuse.fuse: `~` needs booleans or integers, got {a.dtype}")
    if op in ("round", "floor", "ceil") and not is_float(a.dtype):
        return a  # integers are already whole
    if op == "abs" and a.dtype == _BOOL:
        return a
    return _result(g, op, [a], a.dtype, weak=a.weak)


def where(c, a, b):
    g = _graph_of(c, a, b)
    c, a, b = lift(g, c), lift(g, a), lift(g, b)
    dt = promote(a, b)
    if g.torch_float is not None and a.weak and b.weak and not c.weak and is_float(dt):
        dt = g.default_float()  # torch.where(tensor, 2.5, -1.0) is a tensor of the default dtype, not float64
    # torch.where raises for an int that does not fit; numpy.where converts unchecked
    # up to NumPy 2.4 and raises from 2.5: as the installed NumPy does
    chk = g.torch_float is not None or _numpy_where_checks()
    return _result(g, "where", [cast(c, _BOOL), cast(a, dt, chk), cast(b, dt, chk)], dt,
                   weak=a.weak and b.weak and c.weak)


def clip(x, lo, hi):
    """minimum(maximum(x, lo), hi), as numpy.clip: on an integer array a Python
    int bound beyond the type's range is no bound (a lower bound above it or an
    upper bound below it raises OverflowError at the call, as NumPy does)."""
    g = _graph_of(x, lo, hi)
    x, lo, hi = lift(g, x), lift(g, lo), lift(g, hi)
    if g.torch_float is not None and not x.weak and x.dtype.kind in "iu":
        # torch.clip: each int bound must fit the tensor's type
        lo, hi = (cast(v, x.dtype) if v.weak and v.dtype.kind == "i" else v for v in (lo, hi))
    # clip_lo / clip_hi: maximum / minimum by value, with torch.clamp's gradient (an input on a bound
    # keeps all of it; maximum and minimum split it at ties: half of it at the bounds)
    if x.weak or x.dtype.kind not in "iub" or g.torch_float is not None:
        return binary("clip_hi", binary("clip_lo", x, lo), hi)
    # NumPy: the result type of all three (Python scalars weak: a float bound makes it a float, a wider
    # integer array wider), each bound then applied in it
    dt = promote(x, lo, hi)
    if dt.kind not in "iu":
        return binary("clip_hi", binary("clip_lo", cast(x, dt), lo), hi)
    x = cast(x, dt)
    for bound, op, side in ((lo, "maximum", "lo"), (hi, "minimum", "hi")):
        if bound.weak and bound.dtype.kind == "i":
            k = _param_index(bound)
            if k is not None:
                g.checks.append((k, dt, side))
            x = cast(_result(g, op, [cast(x, _I64), bound], _I64), dt)  # by value, in int64
        else:
            x = binary(op, x, bound)
    return x


_WHERE_CHECKS: list = []


def _numpy_where_checks():
    """Whether the installed NumPy's where raises for a Python int beyond the array's type."""
    if not _WHERE_CHECKS:
        try:
            np.where(np.array([True]), np.zeros(1, np.uint8), 300)
            _WHERE_CHECKS.append(False)
        except OverflowError:
            _WHERE_CHECKS.append(True)
    return _WHERE_CHECKS[0]


def reduce(kind, v, axis, keepdims, extra):
    if extra:
        raise TraceError(f"cufuse.fuse: .{kind}() takes axis and keepdims only inside a fused function, "
                         f"got {sorted(extra)}")
    g = _graph_of(v)
    v = lift(g, v)
    if v.weak or v.ndim == 0:
        raise TraceError(f"cufuse.fuse: .{kind}(axis=-1) needs an array of at least one dimension")
    if axis is None:
        if v.ndim > 1:
            raise TraceError(f"cufuse.fuse: .{kind}() without an axis reduces every element of this "
                             f"{v.ndim}-d value in NumPy and torch; a fused function reduces the last axis "
                             f"only: write .{kind}(axis=-1)")
        axis = -1
    if axis not in (-1, v.ndim - 1) or isinstance(axis, bool):
        raise TraceError(f"cufuse.fuse: only a reduction over the last axis is supported (axis=-1 or "
                         f"axis={v.ndim - 1} here); got axis={axis!r}")
    dt = v.dtype
    torch_rules = g.torch_float is not None
    if kind == "sum":
        out = dt if is_float(dt) else (_U64 if dt.kind == "u" and not torch_rules else _I64)
    elif kind == "mean":
        if torch_rules and not is_float(dt):
            raise TraceError(f"cufuse.fuse: .mean() of {dt} values: torch's mean takes floats only (torch "
                             "tensors follow torch's rules); use .astype(a float dtype) first")
        out = dt if is_float(dt) else _F64
    else:
        out = dt
    r = Traced(g, v.node, out, ndim=v.ndim - (0 if keepdims else 1), reduced=True)
    r.reduced = (kind, bool(keepdims))
    return r


def input_value(g, k, dtype, ndim):
    return Traced(g, g.add("input", (), dtype, k), dtype, ndim=ndim)


def trace(fn, spec, torch_float=None):
    """Trace ``fn``. ``spec``: per argument, ("array", dtype, ndim) or ("scalar", dtype, weak, python number);
    ``torch_float``: None for NumPy's type rules, torch's default float dtype for torch's."""
    g = Graph(torch_float=torch_float)
    args = []
    for pos, s in enumerate(spec):
        if s[0] == "array":
            g.inputs.append((pos, s[1], s[2]))
            args.append(input_value(g, len(g.inputs) - 1, s[1], s[2]))
        else:
            if s[3]:  # a Python number: Python's operators compute with it; a kernel parameter where it meets
                # an array (an int used only by Python, n in a * (n * 1e-30), need not fit int64)
                kind = float if is_float(s[1]) else bool if s[1] == _BOOL else int
                args.append(host_traced(g, HostExpr(lambda a, pos=pos, kind=kind: kind(a[pos]), kind,
                                                    f"argument {pos + 1}")))
            else:
                args.append(param(g, ("arg", pos), s[1], weak=s[2]))
    g.ndim = max((s[2] for s in spec if s[0] == "array"), default=0)
    stack = _stack()
    stack.append(g)
    try:
        res = fn(*args)
    finally:
        stack.pop()
    g.tuple_out = isinstance(res, (tuple, list))
    outs = list(res) if g.tuple_out else [res]
    if not outs:
        raise TraceError("cufuse.fuse: the function returned an empty tuple; return at least one array")
    for i, o in enumerate(outs):
        name = f"output {i}" if g.tuple_out else "the result"
        if not isinstance(o, Traced) or o.graph is not g:
            raise TraceError(f"cufuse.fuse: {name} is a {type(o).__name__}, not a value computed from the "
                             "arguments; return arrays computed from the inputs")
        if not _depends_on_input(g, o.node):
            raise TraceError(f"cufuse.fuse: {name} does not depend on any array argument (it is built from "
                             "scalars only); a fused function's results are arrays")
        if o.reduced:
            kind, keep = o.reduced
            # the reduced values enter the accumulator as the result dtype
            g.outputs.append((cast(Traced(g, o.node, g.nodes[o.node].dtype, ndim=1), o.dtype).node,
                              kind, keep, o.dtype))
        else:
            g.outputs.append((o.node, None, False, o.dtype))
    kinds = {o[1] is not None for o in g.outputs}
    if len(kinds) > 1:
        raise TraceError("cufuse.fuse: some outputs are reductions and some are not; with a trailing "
                         "reduction every output must be a reduction over the last axis")
    return g


def input_deps(g, node):
    """The indices (in ``g.inputs``) of the array inputs ``node`` is computed from."""
    stack, seen, deps = [node], set(), set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        nd = g.nodes[n]
        if nd.op == "input":
            deps.add(nd.attr)
        stack.extend(nd.args)
    return deps


def _depends_on_input(g, node):
    return bool(input_deps(g, node))
