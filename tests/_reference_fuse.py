"""Helpers for tests/test_fuse.py: tolerances, float64 references, inputs, views
and the random expression trees.

Everything here is written independently of cufuse's implementation: the
references are float64 NumPy (``math.erf`` vectorized for erf), and the only
cufuse names used are the public functions a traced function calls
(``cufuse.exp`` ...), looked up when the traced function runs.

Random trees
------------
A tree is built ONCE as a structure of small Python functions ``fn(F, args)``
over a function namespace ``F``. It is then evaluated twice:

* ``F = CF`` (cufuse.<name>, or NumPy ufuncs on traced values for some nodes):
  this is the Python function given to ``cufuse.fuse``;
* ``F = REF``: float64 NumPy on the inputs widened to float64 (scalars stay
  Python floats, which NumPy keeps float64 against float64 arrays).

Domains are safe by construction: every node tracks a bound on |value|;
log / sqrt / rsqrt see ``abs(t) + c`` (c >= 0.25), exp / exp2 / expm1 see
tanh- or clip-bounded arguments, divisors are ``abs(t) + 0.5`` or nonzero
constants, and whenever a bound exceeds 6 the node is squashed (tanh, clip,
sin or a scale). Discontinuous operations (comparisons, floor / ceil /
round, //, %) are applied to input leaves only, multiplied by powers of two,
so both sides see exactly the same operand values; all scalars are exactly
representable in float16.
"""
from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Callable, NamedTuple

import numpy as np

import cufuse

F16, F32, F64 = (np.dtype(t) for t in (np.float16, np.float32, np.float64))
I8, U8, I16, I32, I64 = (np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.int32, np.int64))
BOOL = np.dtype(np.bool_)
FLOATS = [F16, F32, F64]
INTS = [I8, U8, I16, I32, I64]
ALL_DTYPES = FLOATS + INTS + [BOOL]

# ----------------------------------------------------------------- tolerances
# (rtol, atol), per result dtype, against the float64 reference rounded to the
# result dtype. Stated once:
# * one function / operator: float16 is computed in float32 and rounded once
#   (1 half ulp, 2**-11 ~ 4.9e-4 relative, a further ulp allowed); float32 a few
#   ulps (CUDA's expf/erff/tanhf are within 2-3 ulp; sigmoid/silu/gelu/softplus
#   compose two of them); float64 a few ulps.
FUNC_TOL = {F16: (2e-3, 1e-4), F32: (2e-5, 1e-5), F64: (1e-12, 1e-12)}
# * random trees (chains of up to ~10 transcendental functions and products of
#   values bounded by ~36): float16 still rounds once (float32 inside), so it
#   stays at two half-precision ulps; float32 allows ~400 ulps of accumulated
#   error, float64 ~5e4 ulps (amplification through products / exp / rsqrt).
#   Calibrated by evaluating the trees in float32 NumPy: the worst tree uses
#   under 5% of the float32 entry and under 40% of the float16 one.
TREE_TOL = {F16: (2e-3, 1e-3), F32: (5e-5, 5e-5), F64: (1e-11, 1e-11)}
# * trailing reductions of non-negative terms (relative): float16 accumulates in
#   float32 and rounds once; float32 up to 4097 terms; float64 accumulates in
#   float64.
RED_TOL = {F16: (3e-3, 1e-4), F32: (1e-4, 1e-6), F64: (1e-12, 1e-14)}
# * the Adam step in float32 against float64 over 3 steps: (1 - b2) evaluated in
#   float32 from float32(0.999) is off by 1.3e-5 relative, which v inherits.
ADAM_TOL = (1e-4, 1e-6)
# * signed sums (cancellation): absolute slack of a few float32 / float16 ulps of the terms.
SIGNED_SUM_TOL = {F16: (3e-3, 3e-3), F32: (1e-4, 2e-5), F64: (1e-12, 1e-12)}


# ------------------------------------------------------------------ references
_erf_scalar = np.vectorize(math.erf, otypes=[np.float64])


def ref_erf(x):
    x = np.asarray(x, dtype=np.float64)
    return np.asarray(_erf_scalar(x), dtype=np.float64) if x.size else x.copy()


def ref_sigmoid(x):
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def ref_gelu(x, approximate="none"):
    if approximate == "tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    assert approximate == "none", approximate
    return 0.5 * x * (1.0 + ref_erf(x / math.sqrt(2.0)))


def ref_where(c, a, b):
    return np.where(c, a, b)


REF = SimpleNamespace(
    abs=np.abs, exp=np.exp, exp2=np.exp2, log=np.log, log1p=np.log1p, expm1=np.expm1,
    sqrt=np.sqrt, rsqrt=lambda x: 1.0 / np.sqrt(x), sin=np.sin, cos=np.cos, tanh=np.tanh,
    sigmoid=ref_sigmoid, erf=ref_erf, relu=lambda x: np.maximum(x, 0.0),   # np.maximum propagates NaN
    gelu=ref_gelu, silu=lambda x: x * ref_sigmoid(x), softplus=lambda x: np.logaddexp(0.0, x),
    clip=lambda x, lo, hi: np.minimum(np.maximum(x, lo), hi), minimum=np.minimum, maximum=np.maximum,
    round=np.round,  # half to even
    floor=np.floor, ceil=np.ceil, where=ref_where,
    cast=lambda t, dt: np.asarray(t).astype(dt).astype(np.float64),
)


class _Cufuse:
    """cufuse's top-level functions, looked up when called (the module may be incomplete)."""

    def __getattr__(self, name):
        return getattr(cufuse, name)

    @staticmethod
    def cast(t, dt):
        return t.astype(dt)


CF = _Cufuse()
# NumPy ufuncs applied to traced values (the spec: "np.exp etc. work too").
NPNS = SimpleNamespace(abs=np.abs, exp=np.exp, exp2=np.exp2, log=np.log, log1p=np.log1p, expm1=np.expm1,
                       sqrt=np.sqrt, sin=np.sin, cos=np.cos, tanh=np.tanh, floor=np.floor, ceil=np.ceil,
                       minimum=np.minimum, maximum=np.maximum, cast=_Cufuse.cast)


# ------------------------------------------------------------------- functions
class Func(NamedTuple):
    name: str
    arity: int
    call: Callable          # call(F, *arrays) -> value ; F is CF (cufuse) or REF
    domain: Callable        # domain(rng, shape) -> float64 values (before the cast to the dtype)


def _normal(scale):
    def d(rng, shape):
        return rng.standard_normal(shape) * scale
    return d


def _uniform(lo, hi):
    def d(rng, shape):
        return rng.uniform(lo, hi, shape)
    return d


def _with_halves(rng, shape):
    """Values in (-10, 10), every 4th one an exact .5 (round is half to even)."""
    x = rng.uniform(-10.0, 10.0, shape)
    flat = x.reshape(-1)
    flat[::4] = rng.integers(-10, 10, flat[::4].shape) + 0.5
    return x


FUNCS = [
    Func("abs", 1, lambda F, x: F.abs(x), _normal(2.0)),
    Func("exp", 1, lambda F, x: F.exp(x), _uniform(-5.0, 5.0)),
    Func("exp2", 1, lambda F, x: F.exp2(x), _uniform(-7.0, 7.0)),
    Func("log", 1, lambda F, x: F.log(x), _uniform(0.25, 8.0)),
    Func("log1p", 1, lambda F, x: F.log1p(x), _uniform(-0.75, 8.0)),
    Func("expm1", 1, lambda F, x: F.expm1(x), _uniform(-4.0, 4.0)),
    Func("sqrt", 1, lambda F, x: F.sqrt(x), _uniform(0.25, 8.0)),
    Func("rsqrt", 1, lambda F, x: F.rsqrt(x), _uniform(0.25, 8.0)),
    Func("sin", 1, lambda F, x: F.sin(x), _uniform(-6.0, 6.0)),
    Func("cos", 1, lambda F, x: F.cos(x), _uniform(-6.0, 6.0)),
    Func("tanh", 1, lambda F, x: F.tanh(x), _normal(2.0)),
    Func("sigmoid", 1, lambda F, x: F.sigmoid(x), _normal(3.0)),
    Func("erf", 1, lambda F, x: F.erf(x), _normal(1.5)),
    Func("relu", 1, lambda F, x: F.relu(x), _normal(2.0)),
    Func("gelu", 1, lambda F, x: F.gelu(x), _normal(2.5)),
    Func("gelu_none", 1, lambda F, x: F.gelu(x, approximate="none"), _normal(2.5)),
    Func("gelu_tanh", 1, lambda F, x: F.gelu(x, approximate="tanh"), _normal(2.5)),
    Func("silu", 1, lambda F, x: F.silu(x), _normal(3.0)),
    Func("softplus", 1, lambda F, x: F.softplus(x), _normal(4.0)),
    Func("clip", 1, lambda F, x: F.clip(x, -0.5, 0.75), _normal(1.0)),
    Func("round", 1, lambda F, x: F.round(x), _with_halves),
    Func("floor", 1, lambda F, x: F.floor(x), _uniform(-10.0, 10.0)),
    Func("ceil", 1, lambda F, x: F.ceil(x), _uniform(-10.0, 10.0)),
    Func("minimum", 2, lambda F, x, y: F.minimum(x, y), _normal(1.0)),
    Func("maximum", 2, lambda F, x, y: F.maximum(x, y), _normal(1.0)),
    Func("where", 3, lambda F, c, x, y: F.where(c, x, y), _normal(1.0)),  # c: a bool array
]
FUNC_BY_NAME = {f.name: f for f in FUNCS}


def func_inputs(func, dtype, shapes, seed):
    """NumPy inputs for ``func`` (contiguous), in ``dtype`` (where's first is bool), never zero."""
    rng = np.random.default_rng(seed)
    res = []
    for k, shape in enumerate(shapes):
        if func.name == "where" and k == 0:
            res.append(rng.random(shape) < 0.5)
            continue
        x = np.asarray(func.domain(rng, shape)).astype(dtype)
        x[x == 0] = 0.5
        res.append(x)
    return res


def func_reference(func, np_inputs):
    """float64 reference of ``func`` (inputs widened to float64; where's condition kept bool)."""
    vals = [a if a.dtype == BOOL else a.astype(np.float64) for a in np_inputs]
    with np.errstate(all="ignore"):
        return np.asarray(func.call(REF, *vals), dtype=np.float64)


# ------------------------------------------------------------------ comparisons
def assert_close(got, ref, dtype, tol, err_msg="", scale_atol=False):
    """``got`` (NumPy, of ``dtype``) against the float64 ``ref`` rounded to ``dtype``."""
    dtype = np.dtype(dtype)
    assert isinstance(got, np.ndarray), type(got)
    assert got.dtype == dtype, f"result dtype {got.dtype}, expected {dtype} {err_msg}"
    assert got.shape == ref.shape, f"result shape {got.shape}, expected {ref.shape} {err_msg}"
    with np.errstate(all="ignore"):
        expected = np.asarray(ref).astype(dtype).astype(np.float64)
    g = got.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(expected), err_msg="NaN positions differ " + err_msg)
    np.testing.assert_array_equal(np.isposinf(g), np.isposinf(expected), err_msg="+inf positions differ " + err_msg)
    np.testing.assert_array_equal(np.isneginf(g), np.isneginf(expected), err_msg="-inf positions differ " + err_msg)
    rtol, atol = tol
    if scale_atol and expected.size:
        finite = expected[np.isfinite(expected)]
        atol *= max(1.0, float(np.max(np.abs(finite)))) if finite.size else 1.0
    np.testing.assert_allclose(g, expected, rtol=rtol, atol=atol, equal_nan=True, err_msg=err_msg)


def assert_exact(got, expected, dtype, err_msg=""):
    dtype = np.dtype(dtype)
    assert isinstance(got, np.ndarray), type(got)
    assert got.dtype == dtype, f"result dtype {got.dtype}, expected {dtype} {err_msg}"
    assert got.shape == np.shape(expected), f"result shape {got.shape}, expected {np.shape(expected)} {err_msg}"
    np.testing.assert_array_equal(got, np.asarray(expected).astype(dtype), err_msg=err_msg)


# ---------------------------------------------------------------------- layouts
def backend_view(backend, a, layout):
    """``a`` (NumPy, values of the result) as a backend array with the given memory layout.

    "C": contiguous copy; "T": transposed view of a contiguous (n, m) array
    (2-D only); "S": every other element of the last axis of a NaN-padded
    buffer; "O": contiguous at a misaligned offset (element 1 of a buffer);
    "N": negative step (NumPy / CuPy only); "B": a broadcast view (stride 0)
    of the first row: its values are NOT ``a``'s (read them back with
    backend.to_numpy)."""
    if layout == "C":
        return backend.asarray(a)
    if layout == "T":
        assert a.ndim == 2
        return backend.asarray(np.ascontiguousarray(a.T)).T
    if layout == "S":
        pad = _poisoned(a.shape[:-1] + (2 * a.shape[-1],), a.dtype) if a.ndim else _poisoned((2,), a.dtype)
        if a.ndim:
            pad[..., ::2] = a
            return backend.asarray(pad)[..., ::2]
        pad[0] = a
        return backend.asarray(pad)[0]
    if layout == "O":
        buf = _poisoned((a.size + 1,), a.dtype)
        buf[1:] = a.reshape(-1)
        return backend.asarray(buf)[1:].reshape(a.shape)
    if layout == "N":
        assert backend.negative_strides
        return backend.asarray(a[::-1].copy())[::-1] if a.ndim else backend.asarray(a)
    if layout == "B":                    # the first row (along axis 0), broadcast
        return broadcast_to(backend, backend.asarray(a[:1]), a.shape) if a.ndim else backend.asarray(a)
    raise AssertionError(layout)


def broadcast_to(backend, x, shape):
    if backend.is_torch:
        return x.expand(*shape)
    if backend.name == "cupy":
        return backend.cp.broadcast_to(x, shape)
    return np.broadcast_to(x, shape)


def _poisoned(shape, dtype):
    if np.dtype(dtype).kind == "f":
        return np.full(shape, np.nan, dtype=dtype)
    if np.dtype(dtype) == BOOL:
        return np.ones(shape, dtype=dtype)
    return np.full(shape, 77, dtype=dtype)


def poisoned(backend, shape, dtype):
    """An ``out=`` array filled with NaN (floats) / a sentinel (ints, bool)."""
    return backend.asarray(_poisoned(shape, dtype))


def rand(shape, dtype, seed, lo=-2.5, hi=2.5):
    """Uniform values in [lo, hi) in ``dtype``, never zero."""
    rng = np.random.default_rng(seed)
    x = np.asarray(rng.uniform(lo, hi, shape)).astype(dtype)
    x[x == 0] = 0.5
    return x


def rand_int(shape, dtype, seed, lo=-6, hi=7, nonzero=True):
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype == BOOL:
        return rng.random(shape) < 0.5
    if dtype.kind == "u":
        lo = max(lo, 0)
    x = rng.integers(lo, hi, shape).astype(dtype)
    if nonzero:
        x[x == 0] = 1
    return x


# ---------------------------------------------------------------- random trees
class Expr(NamedTuple):
    fn: Callable      # fn(args) -> value; args: the traced arguments (or their float64 values)
    text: str
    bound: float      # |value| <= bound on the inputs made by TreeCase
    uses: frozenset   # indices of the array arguments used


# Scalars exactly representable in float16 (so that NumPy's rounding of a weak
# scalar to the array dtype and a float32 kernel argument agree).
SAFE_SCALARS = (0.75, -1.25, 1.5, 0.5, -0.625, 2.0, 0.25, -1.5, 3.0)
INPUT_BOUND = 2.5
SQUASH_ABOVE = 6.0

# Broadcast patterns: (layout, shape) per array argument, see backend_view.
PATTERNS = [
    [("C", (7, 33)), ("C", (33,)), ("C", (7, 1))],
    [("C", (7, 33)), ("C", (1, 33)), ("T", (7, 33))],
    [("C", (7, 1)), ("C", (1, 33)), ("C", (33,))],
    [("S", (7, 33)), ("C", ()), ("C", (7, 33))],
    [("O", (7, 33)), ("C", (33,)), ("C", (1, 1))],
    [("C", (7, 33)), ("C", (7, 33)), ("C", (7, 33))],
    [("C", (33,)), ("C", (7, 33)), ("S", (7, 1))],
]

# name, fn(F, t), bound(b), names used in F (NumPy ufuncs possible if all are in NPNS), max input bound
_UNARY = [
    ("neg", lambda F, t: -t, lambda b: b, (), None),
    ("abs", lambda F, t: F.abs(t), lambda b: b, ("abs",), None),
    ("pyabs", lambda F, t: abs(t), lambda b: b, (), None),
    ("exp", lambda F, t: F.exp(F.tanh(t) * 2.0), lambda b: math.exp(2.0), ("exp", "tanh"), None),
    ("exp2", lambda F, t: F.exp2(F.clip(t, -3.0, 2.5)), lambda b: 2 ** 2.5, ("exp2", "clip"), None),
    ("expm1", lambda F, t: F.expm1(F.tanh(t) * 1.5), lambda b: math.expm1(1.5), ("expm1", "tanh"), None),
    ("log", lambda F, t: F.log(abs(t) + 0.5), lambda b: max(0.7, math.log(b + 0.5)), ("log",), None),
    ("log1p", lambda F, t: F.log1p(abs(t)), lambda b: math.log1p(b), ("log1p",), None),
    ("log1p_neg", lambda F, t: F.log1p(F.tanh(t) * 0.5), lambda b: 0.7, ("log1p", "tanh"), None),
    ("sqrt", lambda F, t: F.sqrt(abs(t) + 0.25), lambda b: math.sqrt(b + 0.25), ("sqrt",), None),
    ("rsqrt", lambda F, t: F.rsqrt(abs(t) + 0.5), lambda b: 1.42, ("rsqrt",), None),
    ("sin", lambda F, t: F.sin(t), lambda b: 1.0, ("sin",), None),
    ("cos", lambda F, t: F.cos(t), lambda b: 1.0, ("cos",), None),
    ("tanh", lambda F, t: F.tanh(t), lambda b: 1.0, ("tanh",), None),
    ("sigmoid", lambda F, t: F.sigmoid(t), lambda b: 1.0, ("sigmoid",), None),
    ("erf", lambda F, t: F.erf(t), lambda b: 1.0, ("erf",), None),
    ("relu", lambda F, t: F.relu(t), lambda b: b, ("relu",), None),
    ("gelu", lambda F, t: F.gelu(t), lambda b: b, ("gelu",), None),
    ("gelu_tanh", lambda F, t: F.gelu(t, approximate="tanh"), lambda b: b, ("gelu",), None),
    ("silu", lambda F, t: F.silu(t), lambda b: b, ("silu",), None),
    ("softplus", lambda F, t: F.softplus(t), lambda b: b + 0.7, ("softplus",), None),
    ("clip", lambda F, t: F.clip(t, -1.5, 2.0), lambda b: 2.0, ("clip",), None),
    ("square", lambda F, t: t ** 2, lambda b: b * b, (), 2.5),
    ("pow15", lambda F, t: (abs(t) + 0.5) ** 1.5, lambda b: (b + 0.5) ** 1.5, (), 3.0),
    ("pow05", lambda F, t: (abs(t) + 0.25) ** 0.5, lambda b: math.sqrt(b + 0.25), (), None),
    ("half", lambda F, t: t * 0.5, lambda b: b / 2, (), None),
    ("rmul_int", lambda F, t: 3 * t, lambda b: 3 * b, (), None),
]

# name, fn(F, a, b), bound(ba, bb), names used
_BINARY = [
    ("add", lambda F, a, b: a + b, lambda x, y: x + y, ()),
    ("sub", lambda F, a, b: a - b, lambda x, y: x + y, ()),
    ("mul", lambda F, a, b: a * b, lambda x, y: x * y, ()),
    ("div", lambda F, a, b: a / (abs(b) + 0.5), lambda x, y: 2 * x, ()),
    ("minimum", lambda F, a, b: F.minimum(a, b), max, ("minimum",)),
    ("maximum", lambda F, a, b: F.maximum(a, b), max, ("maximum",)),
    ("pow", lambda F, a, b: (abs(a) + 0.5) ** F.tanh(b), lambda x, y: max(x + 0.5, 2.0), ("tanh",)),
]

# name, fn(F, a, s), bound(ba, |s|), names used; s is a scalar (argument or literal, nonzero)
_SCALAR_BINARY = [
    ("add", lambda F, a, s: a + s, lambda x, s: x + s, ()),
    ("radd", lambda F, a, s: s + a, lambda x, s: x + s, ()),
    ("sub", lambda F, a, s: a - s, lambda x, s: x + s, ()),
    ("rsub", lambda F, a, s: s - a, lambda x, s: x + s, ()),
    ("mul", lambda F, a, s: a * s, lambda x, s: x * s, ()),
    ("rmul", lambda F, a, s: s * a, lambda x, s: x * s, ()),
    ("div", lambda F, a, s: a / s, lambda x, s: x / 0.25, ()),
    ("rdiv", lambda F, a, s: s / (abs(a) + 0.5), lambda x, s: 2 * s, ()),
    ("minimum", lambda F, a, s: F.minimum(a, s), max, ("minimum",)),
    ("maximum", lambda F, a, s: F.maximum(s, a), max, ("maximum",)),
]

_SQUASH = [
    ("tanh4", lambda F, t: F.tanh(t * 0.25) * 4.0, 4.0, ("tanh",)),
    ("clip3", lambda F, t: F.clip(t, -3.0, 3.0), 3.0, ("clip",)),
    ("sin", lambda F, t: F.sin(t), 1.0, ("sin",)),
    ("eighth", lambda F, t: t * 0.125, None, ()),
]


class TreeCase:
    """One random expression tree: its arguments, a traced function and a reference."""

    def __init__(self, seed, dtype):
        self.seed = seed
        self.dtype = np.dtype(dtype)
        rng = self.rng = np.random.default_rng(seed)
        pattern = PATTERNS[seed % len(PATTERNS)]
        n_arrays = int(rng.integers(1, 4))
        n_scalars = int(rng.integers(0, 2))
        specs = [("array",) + pattern[i] for i in range(n_arrays)]
        specs += [("scalar", float(rng.choice(SAFE_SCALARS))) for _ in range(n_scalars)]
        order = rng.permutation(len(specs))
        self.specs = [specs[i] for i in order]
        self.array_idx = [i for i, s in enumerate(self.specs) if s[0] == "array"]
        self.scalar_idx = [i for i, s in enumerate(self.specs) if s[0] == "scalar"]
        n_out = 2 if rng.random() < 0.15 else 1
        self.outputs = [self._root(int(rng.integers(2, 5))) for _ in range(n_out)]
        self.text = "; ".join(e.text for e in self.outputs)

    # ---------------------------------------------------------------- building
    def _ns(self, names):
        """CF, or (30% of the nodes whose functions all have a NumPy ufunc) NPNS."""
        if names and all(hasattr(NPNS, n) for n in names) and self.rng.random() < 0.3:
            return NPNS, "np."
        return CF, ""

    def _node(self, fn_of_F, names, children, text, bound):
        """A node whose traced side uses CF/NPNS and whose reference side uses REF."""
        ns, prefix = self._ns(names)
        kids = [c.fn for c in children]

        def fn(args, ref=False, _f=fn_of_F, _ns=ns, _kids=kids):
            return _f(REF if ref else _ns, *[k(args, ref) for k in _kids])

        uses = frozenset().union(*[c.uses for c in children]) if children else frozenset()
        return Expr(fn, prefix + text, bound, uses)

    def _array_leaf(self):
        i = int(self.rng.choice(self.array_idx))
        return Expr(lambda args, ref=False, i=i: args[i], f"a{i}", INPUT_BOUND, frozenset([i]))

    def _scalar(self):
        """(fn, text, |value|): a scalar argument or a literal."""
        if self.scalar_idx and self.rng.random() < 0.6:
            i = int(self.rng.choice(self.scalar_idx))
            return (lambda args, ref=False, i=i: args[i]), f"s{i}", abs(self.specs[i][1])
        v = float(self.rng.choice(SAFE_SCALARS))
        return (lambda args, ref=False, v=v: v), repr(v), abs(v)

    def _cond(self, depth=0):
        """A bool Expr from comparisons of array leaves (exact on both sides)."""
        rng = self.rng
        if depth < 1 and rng.random() < 0.35:
            a, b = self._cond(depth + 1), self._cond(depth + 1)
            op = rng.choice(["and", "or", "invert"])
            if op == "and":
                return self._node(lambda F, x, y: x & y, (), [a, b], f"({a.text} & {b.text})", 1.0)
            if op == "or":
                return self._node(lambda F, x, y: x | y, (), [a, b], f"({a.text} | {b.text})", 1.0)
            return self._node(lambda F, x: ~x, (), [a], f"~{a.text}", 1.0)
        x, y = self._array_leaf(), self._array_leaf()
        kind = rng.choice(["lt", "le_s", "gt", "ge", "eq", "ne"])
        if kind == "lt":
            return self._node(lambda F, p, q: p < q, (), [x, y], f"({x.text} < {y.text})", 1.0)
        if kind == "le_s":
            sfn, stext, _ = self._scalar()
            s = Expr(sfn, stext, 0.0, frozenset())
            return self._node(lambda F, p, q: p <= q, (), [x, s], f"({x.text} <= {stext})", 1.0)
        if kind == "gt":
            return self._node(lambda F, p: p > 0.25, (), [x], f"({x.text} > 0.25)", 1.0)
        if kind == "ge":
            return self._node(lambda F, p, q: p >= q, (), [x, y], f"({x.text} >= {y.text})", 1.0)
        if kind == "eq":
            return self._node(lambda F, p, q: F.floor(p * 2) == F.floor(q * 2), ("floor",), [x, y],
                              f"(floor({x.text}*2) == floor({y.text}*2))", 1.0)
        return self._node(lambda F, p: F.ceil(p) != 1.0, ("ceil",), [x], f"(ceil({x.text}) != 1)", 1.0)

    def _discontinuous_leaf(self):
        rng = self.rng
        x = self._array_leaf()
        dt = self.dtype
        kind = rng.choice(["floor", "ceil", "round", "floordiv", "mod", "mod_neg", "mask", "where", "cast"])
        if kind == "floor":
            return self._node(lambda F, p: F.floor(p * 2), ("floor",), [x], f"floor({x.text}*2)", 6.0)
        if kind == "ceil":
            return self._node(lambda F, p: F.ceil(p * 2), ("ceil",), [x], f"ceil({x.text}*2)", 6.0)
        if kind == "round":
            return self._node(lambda F, p: F.round(p * 4) * 0.25, ("round",), [x], f"round({x.text}*4)*0.25", 2.75)
        if kind == "floordiv":
            return self._node(lambda F, p: p // 0.5, (), [x], f"({x.text} // 0.5)", 6.0)
        if kind == "mod":
            return self._node(lambda F, p: p % 0.75, (), [x], f"({x.text} % 0.75)", 0.75)
        if kind == "mod_neg":
            return self._node(lambda F, p: p % -1.5, (), [x], f"({x.text} % -1.5)", 1.5)
        if kind == "mask":
            c = self._cond()
            return self._node(lambda F, m: F.cast(m, dt) * 1.5, (), [c], f"astype({c.text}, {dt.name})*1.5", 1.5)
        if kind == "cast" and dt != F16:
            # same-dtype astype: a no-op for float32/float64 (for float16 it would round a
            # float32 intermediate; that is checked separately in test_fuse.py)
            return self._node(lambda F, p: F.cast(p * 0.5, dt), (), [x], f"astype({x.text}*0.5, {dt.name})", 1.25)
        c = self._cond()
        y = self._array_leaf()
        return self._node(lambda F, m, p, q: F.where(m, p, q), ("where",), [c, x, y],
                          f"where({c.text}, {x.text}, {y.text})", INPUT_BOUND)

    def _squash(self, e):
        if e.bound <= SQUASH_ABOVE:
            return e
        name, fn, bound, names = _SQUASH[int(self.rng.integers(len(_SQUASH)))]
        if bound is None:
            bound = e.bound * 0.125
        return self._squash(self._node(fn, names, [e], f"{name}({e.text})", bound))

    def _value(self, depth):
        rng = self.rng
        if depth == 0 or rng.random() < 0.1:
            return self._array_leaf() if rng.random() < 0.7 else self._discontinuous_leaf()
        r = rng.random()
        if r < 0.45:
            t = self._value(depth - 1)
            ok = [u for u in _UNARY if u[4] is None or t.bound <= u[4]]
            name, fn, bf, names, _ = ok[int(rng.integers(len(ok)))]
            e = self._node(fn, names, [t], f"{name}({t.text})", bf(t.bound))
        elif r < 0.88:
            a = self._value(depth - 1)
            if rng.random() < 0.3:
                sfn, stext, sabs = self._scalar()
                name, fn, bf, names = _SCALAR_BINARY[int(rng.integers(len(_SCALAR_BINARY)))]
                s = Expr(sfn, stext, sabs, frozenset())
                e = self._node(fn, names, [a, s], f"{name}({a.text}, {stext})", bf(a.bound, sabs))
            else:
                b = self._value(depth - 1)
                name, fn, bf, names = _BINARY[int(rng.integers(len(_BINARY)))]
                e = self._node(fn, names, [a, b], f"{name}({a.text}, {b.text})", bf(a.bound, b.bound))
        else:
            c = self._cond()
            a, b = self._value(depth - 1), self._value(depth - 1)
            e = self._node(lambda F, m, p, q: F.where(m, p, q), ("where",), [c, a, b],
                           f"where({c.text}, {a.text}, {b.text})", max(a.bound, b.bound))
        return self._squash(e)

    def _root(self, depth):
        e = self._value(depth)
        for i in self.array_idx:          # every array argument takes part in every output
            if i not in e.uses:
                leaf = Expr(lambda args, ref=False, i=i: args[i], f"a{i}", INPUT_BOUND, frozenset([i]))
                e = self._node(lambda F, p, q: p + 0.5 * q, (), [e, leaf], f"({e.text} + 0.5*a{i})",
                               e.bound + 0.5 * INPUT_BOUND)
        for i in self.scalar_idx:         # and every scalar argument, next to an array
            if f"s{i}" not in e.text:
                leaf = Expr(lambda args, ref=False, i=i: args[i], f"s{i}", 3.0, frozenset())
                a0 = Expr(lambda args, ref=False, j=self.array_idx[0]: args[j], f"a{self.array_idx[0]}",
                          INPUT_BOUND, frozenset([self.array_idx[0]]))
                e = self._node(lambda F, p, q, r: p + 0.25 * (r * q), (), [e, leaf, a0],
                               f"({e.text} + 0.25*(a{self.array_idx[0]}*s{i}))", e.bound + 2.0)
        return e

    # -------------------------------------------------------------- evaluating
    def np_args(self):
        """The arguments as NumPy arrays (in the dtype) / Python floats, and their layouts."""
        vals, layouts = [], []
        for k, s in enumerate(self.specs):
            if s[0] == "scalar":
                vals.append(s[1])
                layouts.append(None)
            else:
                vals.append(rand(s[2], self.dtype, seed=self.seed * 31 + k, lo=-INPUT_BOUND, hi=INPUT_BOUND))
                layouts.append(s[1])
        return vals, layouts

    def traced(self):
        """The Python function for cufuse.fuse (one positional parameter per argument)."""
        outs = self.outputs

        def call(args):
            res = tuple(o.fn(args) for o in outs)
            return res if len(res) > 1 else res[0]
        # a fixed number of positional parameters (no *args), as a user would write it
        n = len(self.specs)
        if n == 1:
            return lambda a: call((a,))
        if n == 2:
            return lambda a, b: call((a, b))
        if n == 3:
            return lambda a, b, c: call((a, b, c))
        assert n == 4, n
        return lambda a, b, c, d: call((a, b, c, d))

    def reference(self, np_vals):
        """float64 results (a list, one per output)."""
        args = [v.astype(np.float64) if isinstance(v, np.ndarray) else v for v in np_vals]
        with np.errstate(divide="raise", over="raise", invalid="raise", under="ignore"):
            return [np.asarray(o.fn(args, True), dtype=np.float64) for o in self.outputs]


# ----------------------------------------------------------------- Adam (float64)
def adam_reference(p, g, m, v, lr, b1, b2, eps, bc1, bc2):
    p, g, m, v = (np.asarray(a, dtype=np.float64) for a in (p, g, m, v))
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    p = p - lr * (m / bc1) / (np.sqrt(v / bc2) + eps)
    return p, m, v
