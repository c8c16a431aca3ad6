"""cufuse.fuse, the tracing composition engine, against scratch/FUSE_API.md.

Every value is checked against a float64 NumPy reference written independently
of cufuse (tests/_reference_fuse.py), rounded to the result dtype, within the
per-dtype tolerances stated once there (FUNC_TOL for one function / operator,
TREE_TOL for random expression trees, RED_TOL for reductions, ADAM_TOL);
integer and bool results are compared exactly. Inputs are seeded random data,
never zeros, in domains where each function is well conditioned; ``out=``
arrays are poisoned (NaN / a sentinel) before a call.

Each test body runs on the backends numpy and torch_cpu (NumPy fallback) and
cupy and torch_cuda (marked ``cuda``; deselected without a GPU). Views are made
in the backend's own kind, so the kernels see non-contiguous, misaligned and
broadcast (stride 0) memory.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Callable, NamedTuple

import numpy as np
import pytest

import cufuse

from _reference import BACKEND_PARAMS, Backend, check_kind
from _reference_fuse import (ADAM_TOL, ALL_DTYPES, BOOL, CF, F16, F32, F64, FLOATS, FUNC_TOL, FUNCS, I8, I16, I32,
                             I64, NPNS, RED_TOL, REF, SIGNED_SUM_TOL, TREE_TOL, U8, TreeCase, adam_reference,
                             assert_close, assert_exact, backend_view, func_inputs, func_reference, poisoned, rand,
                             rand_int)

dtype_param = pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
GPU_BACKEND_PARAMS = [p for p in BACKEND_PARAMS if p.id in ("cupy", "torch_cuda")]
TORCH_BACKEND_PARAMS = [p for p in BACKEND_PARAMS if p.id in ("torch_cpu", "torch_cuda")]
STATS_KEYS = {"traces", "compiles", "disk_loads", "shared", "launches", "foreach_checks"}
NPCHK = SimpleNamespace(**vars(NPNS), where=np.where, round=np.round)   # NumPy's own dtype rules


def labelled(label):
    """Context manager: prefixes an AssertionError with ``label`` (a layout, a case)."""
    class _L:
        def __enter__(self):
            return self

        def __exit__(self, typ, exc, tb):
            if typ is not None and issubclass(typ, AssertionError):
                raise AssertionError(f"[{label}] {exc}") from None
            return False
    return _L()


def fixed_arity(fn, n):
    """``fn(CF, *args)`` as a Python function of exactly ``n`` positional parameters."""
    if n == 1:
        return lambda a: fn(CF, a)
    if n == 2:
        return lambda a, b: fn(CF, a, b)
    if n == 3:
        return lambda a, b, c: fn(CF, a, b, c)
    raise AssertionError(n)


def stats(f):
    s = dict(f.stats)
    assert STATS_KEYS <= set(s), f"f.stats has keys {sorted(s)}"
    return s


# =============================================================================
# 1. Random expression trees
# =============================================================================
N_TREES = 40  # per dtype


@dtype_param
@pytest.mark.parametrize("k", range(N_TREES))
def test_random_tree(backend, dtype, k):
    case = TreeCase(seed=1000 * FLOATS.index(dtype) + k, dtype=dtype)
    vals, layouts = case.np_args()
    args = [v if lay is None else backend_view(backend, v, lay) for v, lay in zip(vals, layouts)]
    refs = case.reference(vals)
    shape = np.broadcast_shapes(*[v.shape for v in vals if isinstance(v, np.ndarray)])
    for r in refs:                      # the generator's guarantees (domain safety, every array used)
        assert r.shape == shape and np.isfinite(r).all(), case.text

    f = cufuse.fuse(case.traced())
    res = f(*args)
    if len(refs) > 1:
        assert isinstance(res, tuple) and len(res) == len(refs), type(res)
    else:
        res = (res,)
    like = next(a for a in args if not isinstance(a, float))
    for r, got in zip(refs, res):
        with labelled(case.text):
            check_kind(backend, got, shape, dtype, like=like)
            assert_close(backend.to_numpy(got), r, dtype, TREE_TOL[dtype], err_msg=case.text)


# =============================================================================
# 2. Each function alone: every float dtype, sizes and layouts
# =============================================================================
SIZE_SHAPES = [(0,), (1,), (3,), (5,), (7,), (9,), (15,), (17,), (31,), (33,), (), (3, 0), (4097,), (5, 7)]
VIEW_SHAPE = (9, 33)
BROADCAST_SHAPES = {2: [[(9, 33), (33,)], [(9, 1), (1, 33)], [(9, 33), ()]],
                    3: [[(9, 33), (33,), (9, 1)], [(33,), (9, 1), ()], [(1, 33), (9, 33), (9, 33)]]}
FUNC_IDS = [f.name for f in FUNCS]
func_param = pytest.mark.parametrize("func", FUNCS, ids=FUNC_IDS)


def fused_func(func):
    return cufuse.fuse(fixed_arity(func.call, func.arity))


def check_func(backend, call, func, dtype, args, label):
    """``call(*args)`` (backend arrays) against the float64 reference of ``func``."""
    with labelled(label):
        np_in = [backend.to_numpy(a) for a in args]
        shape = np.broadcast_shapes(*[a.shape for a in np_in])
        res = call(*args)
        check_kind(backend, res, shape, dtype, like=args[-1])
        assert_close(backend.to_numpy(res), func_reference(func, np_in), dtype, FUNC_TOL[dtype], err_msg=label)


def func_layout_cases(backend, func, dtype):
    """(label, backend args) for every size and layout of ``func``'s operands."""
    n = func.arity
    for shape in SIZE_SHAPES:
        np_in = func_inputs(func, dtype, [shape] * n, seed=len(shape) * 100 + sum(shape))
        yield f"contiguous {shape}", [backend.asarray(a) for a in np_in]
    layouts = ["T", "S", "O", "B"] + (["N"] if backend.negative_strides else [])
    for lay in layouts:
        np_in = func_inputs(func, dtype, [VIEW_SHAPE] * n, seed=500 + ord(lay))
        yield f"all operands {lay}", [backend_view(backend, a, lay) for a in np_in]
        if n > 1:
            yield f"first operand {lay}", [backend_view(backend, np_in[0], lay)] + \
                [backend.asarray(a) for a in np_in[1:]]
    for shapes in BROADCAST_SHAPES.get(n, []):
        np_in = func_inputs(func, dtype, shapes, seed=700)
        yield f"broadcast {shapes}", [backend.asarray(a) for a in np_in]
    yield "0-d", [backend.asarray(a) for a in func_inputs(func, dtype, [()] * n, seed=800)]


@func_param
@dtype_param
def test_function(backend, func, dtype):
    """cufuse.fuse(lambda x: cufuse.<func>(x)) on sizes 0, 1, odd sizes, 0-d,
    transposed / strided / offset / broadcast / negative-step views."""
    f = fused_func(func)
    for label, args in func_layout_cases(backend, func, dtype):
        check_func(backend, f, func, dtype, args, label)


@func_param
def test_function_direct(backend, func):
    """cufuse.<func>(x) on concrete arrays, outside any trace (spec: 'one fused kernel')."""
    for dtype in FLOATS:
        for lay in ["C", "T"]:
            np_in = func_inputs(func, dtype, [VIEW_SHAPE] * func.arity, seed=900 + FLOATS.index(dtype))
            args = [backend_view(backend, a, lay) for a in np_in]
            check_func(backend, lambda *a: func.call(CF, *a), func, dtype, args, f"direct {dtype.name} {lay}")


def test_gelu_approximations_differ():
    """The two gelu definitions are distinguishable on these inputs (so each test above can fail)."""
    x = np.linspace(-3, 3, 100)                 # (no exact 0)
    d = np.abs(REF.gelu(x) - REF.gelu(x, approximate="tanh")).max()
    assert d > 1e-4
    f = cufuse.fuse(lambda x: (cufuse.gelu(x), cufuse.gelu(x, approximate="tanh")))
    a, b = f(x)
    np.testing.assert_allclose(a, REF.gelu(x), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(b, REF.gelu(x, approximate="tanh"), rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ operators
class Op(NamedTuple):
    fn: Callable       # fn(a, b) on traced values and float64 NumPy alike
    arity: int
    domain: str        # how to draw the operands


FLOAT_OPERATORS = {
    "add": Op(lambda a, b: a + b, 2, "normal"),
    "sub": Op(lambda a, b: a - b, 2, "normal"),
    "mul": Op(lambda a, b: a * b, 2, "normal"),
    "truediv": Op(lambda a, b: a / b, 2, "divisor"),
    "floordiv": Op(lambda a, b: a // b, 2, "quotient"),
    "mod": Op(lambda a, b: a % b, 2, "quotient"),
    "pow": Op(lambda a, b: a ** b, 2, "pow"),
    "neg": Op(lambda a: -a, 1, "normal"),
    "pyabs": Op(lambda a: abs(a), 1, "normal"),
    "pow_int": Op(lambda a: a ** 3, 1, "normal"),
    "rsub_scalar": Op(lambda a: 1.5 - a, 1, "normal"),
    "rtruediv_scalar": Op(lambda a: 3 / a, 1, "divisor_only"),
    "rpow_scalar": Op(lambda a: 2.0 ** a, 1, "normal"),
    "mod_scalar_neg": Op(lambda a: a % -0.75, 1, "normal"),
    "floordiv_scalar": Op(lambda a: a // 0.25, 1, "normal"),
}


def operator_inputs(op, dtype, seed):
    """Operands (7, 33) and (33,) (broadcast); divisors away from 0; a // b, a % b
    with quotients at least 0.1 away from an integer (so rounding cannot flip floor)."""
    rng = np.random.default_rng(seed)
    shapes = [(7, 33), (33,)][:op.arity]
    if op.domain == "normal":
        vals = [rng.uniform(-2.5, 2.5, s) for s in shapes]
    elif op.domain == "divisor_only":
        vals = [rng.uniform(0.5, 2.5, shapes[0]) * rng.choice([-1, 1], shapes[0])]
    elif op.domain == "divisor":
        vals = [rng.uniform(-2.5, 2.5, shapes[0]), rng.uniform(0.5, 2.5, shapes[1]) * rng.choice([-1, 1], shapes[1])]
    elif op.domain == "pow":
        vals = [rng.uniform(0.5, 2.5, shapes[0]), rng.uniform(-2.0, 2.0, shapes[1])]
    else:  # quotient
        b = (rng.uniform(0.5, 2.0, shapes[1]) * rng.choice([-1, 1], shapes[1])).astype(dtype).astype(np.float64)
        q = rng.integers(-10, 10, shapes[0]) + rng.uniform(0.1, 0.9, shapes[0])
        vals = [q * b, b]
    res = []
    for v in vals:
        v = np.asarray(v).astype(dtype)
        v[v == 0] = 0.5
        res.append(v)
    return res


@dtype_param
def test_float_operators(backend, dtype):
    """+ - * / // % ** unary - abs() and reflected scalar forms; operands (7, 33) with (33,)."""
    def check(name):
        op = FLOAT_OPERATORS[name]
        np_in = operator_inputs(op, dtype, seed=sum(map(ord, name)))
        args = [backend.asarray(a) for a in np_in]
        res = cufuse.fuse(op.fn)(*args)
        shape = np.broadcast_shapes(*[a.shape for a in np_in])
        check_kind(backend, res, shape, dtype, like=args[0])
        with np.errstate(all="ignore"):
            ref = np.asarray(op.fn(*[a.astype(np.float64) for a in np_in]), dtype=np.float64)
        assert_close(backend.to_numpy(res), ref, dtype, FUNC_TOL[dtype], err_msg=name)
    check_cases(list(FLOAT_OPERATORS), check)


# ------------------------------------------------------------- special values
@dtype_param
def test_nan_propagation(backend, dtype):
    """relu(NaN) is NaN; minimum / maximum propagate NaN from either side (like NumPy)."""
    x = rand((5, 33), dtype, 31)
    y = rand((5, 33), dtype, 32)
    x[0, ::3] = np.nan
    y[1, ::4] = np.nan
    y[2, 5] = np.nan
    x[2, 5] = np.nan
    f = cufuse.fuse(lambda x, y: (cufuse.relu(x), cufuse.minimum(x, y), cufuse.maximum(x, y),
                                  cufuse.maximum(y, 0.0), cufuse.minimum(0.0, x)))
    res = f(backend.asarray(x), backend.asarray(y))
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    refs = [np.maximum(x64, 0.0), np.minimum(x64, y64), np.maximum(x64, y64), np.maximum(y64, 0.0),
            np.minimum(0.0, x64)]
    assert isinstance(res, tuple) and len(res) == len(refs)
    for i, (got, ref) in enumerate(zip(res, refs)):
        assert np.isnan(ref).any()
        assert_close(backend.to_numpy(got), ref, dtype, FUNC_TOL[dtype], err_msg=f"output {i}")


def test_float16_computed_in_float32(backend):
    """float16 values are computed in float32 and rounded only when stored (or by astype(float16))."""
    rng = np.random.default_rng(41)
    x = (rng.integers(-1000, 1000, (7, 33)) / 256).astype(F16)   # exact in float16; x + 1024 exact in float32
    x[x == 0] = 0.5
    xa = backend.asarray(x)
    x64 = x.astype(np.float64)

    f = cufuse.fuse(lambda x: (x + 1024.0) - 1024.0)                 # float16 intermediates would round to 0.5
    assert_exact(backend.to_numpy(f(xa)), x, F16, "float16 intermediate rounded")

    g = cufuse.fuse(lambda x: (x + 1024.0).astype(np.float16) - 1024.0)  # astype(float16) rounds (half to even)
    assert_exact(backend.to_numpy(g(xa)), (x64 + 1024.0).astype(F16).astype(np.float64) - 1024.0, F16,
                 "astype(float16) did not round")

    big = rand((7, 33), F16, 42, lo=20.0, hi=60.0)
    h = cufuse.fuse(lambda x: (x * 4096.0) * (1.0 / 4096.0))          # x*4096 > 65504: overflows in float16
    assert_exact(backend.to_numpy(h(backend.asarray(big))), big, F16, "float16 intermediate overflowed")

    e = cufuse.fuse(lambda x: cufuse.exp(x))                          # overflow when stored: inf
    over = np.array([12.0, 11.5, -3.0, 10.0], dtype=F16)
    assert_close(backend.to_numpy(e(backend.asarray(over))), np.exp(over.astype(np.float64)), F16, FUNC_TOL[F16])


# =============================================================================
# 3 and 4. Integer / bool dtypes, promotion rules (result dtypes and values)
# =============================================================================
ARRAY_SHAPES = [(7, 33), (33,), (7, 1)]


class PCase(NamedTuple):
    id: str
    fn: Callable        # fn(F, *args): F is CF (traced), NPCHK (NumPy's dtype) or REF (reference)
    args: list          # per argument: a dtype (an array) or ("py", v) / ("np", v) (a scalar)
    expected: np.dtype  # the result dtype (NumPy 2's rules: NumPy and CuPy arrays)
    torch: object       # the result dtype under torch's rules (torch tensors), or RAISES


RAISES = "raises"   # torch gives no result (a TraceError)


def P(id, fn, args, expected, torch=None):
    """A case; ``torch``: torch's result dtype where it is not NumPy's."""
    return PCase(id, fn, args, np.dtype(expected), expected if torch is None else
                 (torch if torch is RAISES else np.dtype(torch)))


def py(v):
    return ("py", v)


def nps(v):
    return ("np", v)


PROMOTION_GROUPS = {
    # weak Python scalars (NEP 50)
    "weak_python_scalars": [
        P("f32*2.0", lambda F, x: x * 2.0, [F32], F32),
        P("f16*2.0", lambda F, x: x * 2.0, [F16], F16),
        P("f16+2", lambda F, x: x + 2, [F16], F16),
        P("2.0-f16", lambda F, x: 2.0 - x, [F16], F16),
        P("i32*2.5", lambda F, x: x * 2.5, [I32], F64, torch=F32),
        P("i32+2", lambda F, x: x + 2, [I32], I32),
        P("i8+2", lambda F, x: x + 2, [I8], I8),
        P("u8*3", lambda F, x: x * 3, [U8], U8),
        P("bool*2.0", lambda F, c: c * 2.0, [BOOL], F64, torch=F32),
        P("bool+1", lambda F, c: c + 1, [BOOL], I64),
        P("i32*arg_float", lambda F, x, s: x * s, [I32, py(2.5)], F64, torch=F32),
        P("i32+arg_int", lambda F, x, s: x + s, [I32, py(3)], I32),
        P("f16*arg_float", lambda F, x, s: x * s, [F16, py(0.75)], F16),
        P("arg_int-f16", lambda F, x, s: s - x, [F16, py(3)], F16),
    ],
    # strong NumPy scalars
    "strong_numpy_scalars": [
        P("f32*arg_np.float64", lambda F, x, s: x * s, [F32, nps(np.float64(0.75))], F64, torch=F32),
        P("f16*arg_np.float32", lambda F, x, s: x * s, [F16, nps(np.float32(0.75))], F32, torch=F16),
        P("f32*arg_np.float16", lambda F, x, s: x * s, [F32, nps(np.float16(0.75))], F32),
        P("f16*arg_np.float16", lambda F, x, s: x * s, [F16, nps(np.float16(0.75))], F16),
        P("i8*arg_np.int32", lambda F, x, s: x * s, [I8, nps(np.int32(3))], I32, torch=I8),
        P("f16*arg_np.int64", lambda F, x, s: x * s, [F16, nps(np.int64(3))], F64, torch=F16),
        P("f16*arg_np.int8", lambda F, x, s: x * s, [F16, nps(np.int8(3))], F16),
        P("np.float64_literal*f32", lambda F, x: np.float64(0.75) * x, [F32], F64, torch=F32),
        P("np.float32_literal*f16", lambda F, x: x * np.float32(0.75), [F16], F32, torch=F16),
    ],
    # array with array
    "array_with_array": [
        P("f16+f32", lambda F, x, y: x + y, [F16, F32], F32),
        P("f32+f64", lambda F, x, y: x + y, [F32, F64], F64),
        P("i16+f16", lambda F, x, y: x + y, [I16, F16], F32, torch=F16),
        P("i32+f32", lambda F, x, y: x + y, [I32, F32], F64, torch=F32),
        P("i64*f16", lambda F, x, y: x * y, [I64, F16], F64, torch=F16),
        P("u8+i8", lambda F, x, y: x + y, [U8, I8], I16),
        P("i16+i32", lambda F, x, y: x + y, [I16, I32], I32),
        P("bool+f16", lambda F, c, x: c + x, [BOOL, F16], F16),
    ],
    # integer arithmetic
    "integer_arithmetic": [
        P("i32+i32", lambda F, x, y: x + y, [I32, I32], I32),
        P("i32-i32", lambda F, x, y: x - y, [I32, I32], I32),
        P("i32*i32", lambda F, x, y: x * y, [I32, I32], I32),
        P("i64*i64+1", lambda F, x, y: x * y + 1, [I64, I64], I64),
        P("-i16", lambda F, x: -x, [I16], I16),
        P("abs(i32)", lambda F, x: F.abs(x), [I32], I32),
        P("pyabs(i8)", lambda F, x: abs(x), [I8], I8),
        P("i32**2", lambda F, x: x ** 2, [I32], I32),
        P("i32/i32", lambda F, x, y: x / y, [I32, I32], F64, torch=F32),
        P("i8/i8", lambda F, x, y: x / y, [I8, I8], F64, torch=F32),
        P("u8/2", lambda F, x: x / 2, [U8], F64, torch=F32),
        P("f16/f16", lambda F, x, y: x / y, [F16, F16], F16),
        P("i32//i32", lambda F, x, y: x // y, [I32, I32], I32),
        P("i32%i32", lambda F, x, y: x % y, [I32, I32], I32),
        P("i8//i8", lambda F, x, y: x // y, [I8, I8], I8),
        P("i64%i64", lambda F, x, y: x % y, [I64, I64], I64),
        P("u8//u8", lambda F, x, y: x // y, [U8, U8], U8),
        P("i32//3", lambda F, x: x // 3, [I32], I32),
        P("i32%-3", lambda F, x: x % -3, [I32], I32),
        P("i16//-2", lambda F, x: x // -2, [I16], I16),
        P("7%i32", lambda F, x: 7 % x, [I32], I32),
        P("i32//2.5", lambda F, x: x // 2.5, [I32], F64, torch=F32),
        P("i32%2.0", lambda F, x: x % 2.0, [I32], F64, torch=F32),
    ],
    # float functions of integers / bools (NumPy ufunc loops)
    "float_functions_of_ints": [
        P("exp(i8)", lambda F, x: F.exp(x), [I8], F16, torch=F32),
        P("exp(u8)", lambda F, x: F.exp(x), [U8], F16, torch=F32),
        P("exp(bool)", lambda F, x: F.exp(x), [BOOL], F16, torch=F32),
        P("exp(i16)", lambda F, x: F.exp(x), [I16], F32, torch=F32),
        P("exp(i32)", lambda F, x: F.exp(x), [I32], F64, torch=F32),
        P("exp(i64)", lambda F, x: F.exp(x), [I64], F64, torch=F32),
        P("exp2(i8)", lambda F, x: F.exp2(x), [I8], F16, torch=F32),
        P("sqrt(u8)", lambda F, x: F.sqrt(x), [U8], F16, torch=F32),
        P("rsqrt(u8)", lambda F, x: F.rsqrt(x), [U8], F16, torch=F32),
        P("log1p(u8)", lambda F, x: F.log1p(x), [U8], F16, torch=F32),
        P("expm1(i8)", lambda F, x: F.expm1(x), [I8], F16, torch=F32),
        P("sin(i32)", lambda F, x: F.sin(x), [I32], F64, torch=F32),
        P("cos(i16)", lambda F, x: F.cos(x), [I16], F32, torch=F32),
        P("tanh(i16)", lambda F, x: F.tanh(x), [I16], F32, torch=F32),
        P("sigmoid(i8)", lambda F, x: F.sigmoid(x), [I8], F16, torch=F32),
        P("erf(i16)", lambda F, x: F.erf(x), [I16], F32, torch=F32),
        P("gelu(i32)", lambda F, x: F.gelu(x), [I32], F64, torch=F32),
        P("softplus(i8)", lambda F, x: F.softplus(x), [I8], F16, torch=F32),
        P("silu(bool)", lambda F, x: F.silu(x), [BOOL], F16, torch=F32),
    ],
    # floor / ceil / round of integers: unchanged
    "round_of_ints": [
        P("floor(i32)", lambda F, x: F.floor(x), [I32], I32),
        P("ceil(i8)", lambda F, x: F.ceil(x), [I8], I8),
        P("round(i16)", lambda F, x: F.round(x), [I16], I16),
        P("floor(u8)", lambda F, x: F.floor(x), [U8], U8),
    ],
    # comparisons -> bool
    "comparisons": [
        P("i32<2.5", lambda F, x: x < 2.5, [I32], BOOL),
        P("i32==i32", lambda F, x, y: x == y, [I32, I32], BOOL),
        P("i32!=i32", lambda F, x, y: x != y, [I32, I32], BOOL),
        P("f16>=f32", lambda F, x, y: x >= y, [F16, F32], BOOL),
        P("2<u8", lambda F, x: 2 < x, [U8], BOOL),
        P("f64<=arg", lambda F, x, s: x <= s, [F64, py(0.5)], BOOL),
    ],
    # bool logic and integer bitwise
    "bool_logic_and_bitwise": [
        P("bool&bool", lambda F, a, b: a & b, [BOOL, BOOL], BOOL),
        P("bool|bool", lambda F, a, b: a | b, [BOOL, BOOL], BOOL),
        P("~bool", lambda F, a: ~a, [BOOL], BOOL),
        P("(f32>0)&~bool", lambda F, x, c: (x > 0) & ~c, [F32, BOOL], BOOL),
        P("(i32>y)|(i32<-2)", lambda F, x, y: (x > y) | (x < -2), [I32, I32], BOOL),
        P("i32&i32", lambda F, x, y: x & y, [I32, I32], I32),
        P("u8|u8", lambda F, x, y: x | y, [U8, U8], U8),
        P("~i16", lambda F, x: ~x, [I16], I16),
        P("~u8", lambda F, x: ~x, [U8], U8),
        P("i64&3", lambda F, x: x & 3, [I64], I64),
        # NumPy computes //, % and ** of booleans as int8 (cufuse raised "as in NumPy"); torch has none
        P("bool//bool", lambda F, a, b: a // b, [BOOL, BOOL], I8, torch=RAISES),
        P("bool%bool", lambda F, a, b: a % b, [BOOL, BOOL], I8, torch=RAISES),
        P("bool**bool", lambda F, a, b: a ** b, [BOOL, BOOL], I8, torch=RAISES),
    ],
    # where with a bool condition
    "where_minimum_maximum": [
        P("where(c,i32,i32)", lambda F, c, x, y: F.where(c, x, y), [BOOL, I32, I32], I32),
        P("where(c,f16,2)", lambda F, c, x: F.where(c, x, 2), [BOOL, F16], F16),
        P("where(c,i32,2.5)", lambda F, c, x: F.where(c, x, 2.5), [BOOL, I32], F64, torch=F32),
        P("where(c,2.5,-1.0)", lambda F, c: F.where(c, 2.5, -1.0), [BOOL], F64, torch=F32),
        P("where(c,2,-1)", lambda F, c: F.where(c, 2, -1), [BOOL], I64),
        P("where(c,f16,f32)", lambda F, c, x, y: F.where(c, x, y), [BOOL, F16, F32], F32),
        P("where(x>y,x,y)", lambda F, x, y: F.where(x > y, x, y), [F32, F32], F32),
        P("minimum(i32,2.5)", lambda F, x: F.minimum(x, 2.5), [I32], F64, torch=F32),
        P("maximum(f16,0)", lambda F, x: F.maximum(x, 0), [F16], F16),
        P("maximum(i32,i32)", lambda F, x, y: F.maximum(x, y), [I32, I32], I32),
        P("minimum(u8,i8)", lambda F, x, y: F.minimum(x, y), [U8, I8], I16),
    ],
    # astype inside a computation
    "astype_in_computation": [
        P("astype(i32)+1->f16", lambda F, x: (x.astype(np.int32) + 1).astype(np.float16), [F32], F16),
        P("(x>y).astype(f32)*x", lambda F, x, y: (x > y).astype(np.float32) * x, [F32, F32], F32),
        P("i8.astype(f64)/3", lambda F, x: x.astype(np.float64) / 3, [I8], F64),
    ],
    # reductions of integers / bools
    "int_bool_reductions": [
        P("sum(bool)", lambda F, c: c.sum(axis=-1), [BOOL], I64),
        P("sum(x>y)", lambda F, x, y: (x > y).sum(axis=-1), [F32, F32], I64),
        P("sum(i32)", lambda F, x: x.sum(axis=-1), [I32], I64),
        P("sum(i8)", lambda F, x: x.sum(axis=-1), [I8], I64),
        P("mean(bool)", lambda F, c: c.mean(axis=-1), [BOOL], F64, torch=RAISES),
        P("mean(i32)", lambda F, x: x.mean(axis=-1), [I32], F64, torch=RAISES),
        P("max(i16)", lambda F, x: x.max(axis=-1), [I16], I16),
        P("min(u8)", lambda F, x: x.min(axis=-1, keepdims=True), [U8], U8),
    ],
}


def _pcase_args(case, seed):
    """NumPy values of the arguments: small nonzero ints (ties between operands
    are frequent), floats in [-2.5, 2.5), random bools; scalars as given."""
    vals, k = [], 0
    for spec in case.args:
        if isinstance(spec, tuple):
            vals.append(spec[1])
            continue
        shape = ARRAY_SHAPES[k]
        k += 1
        if spec.kind == "f":
            vals.append(rand(shape, spec, seed + k))
        else:
            vals.append(rand_int(shape, spec, seed + k, lo=-6, hi=7))
    return vals


def _pcase_reference(case, vals):
    """float64 reference for float results (arrays widened to float64); NumPy's
    own integer / bool semantics on the original arrays otherwise."""
    if case.expected.kind == "f":
        vals = [v.astype(np.float64) if isinstance(v, np.ndarray) else v for v in vals]
    with np.errstate(all="ignore"):
        return np.asarray(case.fn(REF, *vals))


def check_cases(cases, check):
    """Run ``check(case)`` for every case; report every failing case, not only the first."""
    failures = []
    for case in cases:
        try:
            check(case)
        except Exception as e:  # noqa: BLE001 - each failure is reported below with its case
            failures.append(f"{getattr(case, 'id', case)}: {type(e).__name__}: {str(e).strip()[:600]}")
    if failures:
        pytest.fail(f"{len(failures)} of {len(cases)} cases failed:\n" + "\n".join(failures), pytrace=False)


def _torch_dtype_of(case, vals):
    """The result dtype torch itself gives for the case on CPU tensors, or None
    where torch cannot run it (.astype, a function torch lacks for the types)."""
    import torch
    import torch.nn.functional as TF
    ns = SimpleNamespace(abs=torch.abs, exp=torch.exp, exp2=torch.exp2, log=torch.log, log1p=torch.log1p,
                         expm1=torch.expm1, sqrt=torch.sqrt, rsqrt=torch.rsqrt, sin=torch.sin, cos=torch.cos,
                         tanh=torch.tanh, sigmoid=torch.sigmoid, erf=torch.erf, floor=torch.floor,
                         ceil=torch.ceil, round=torch.round, minimum=torch.minimum, maximum=torch.maximum,
                         where=torch.where, gelu=TF.gelu, silu=TF.silu, softplus=TF.softplus)
    args = [torch.from_numpy(v) if isinstance(v, np.ndarray) else v for v in vals]
    try:
        res = case.fn(ns, *args)
    except (AttributeError, TypeError, RuntimeError, NotImplementedError):
        return None
    from cufuse._arrays import torch_to_numpy_dtype
    return torch_to_numpy_dtype(res.dtype) if isinstance(res, torch.Tensor) else None


def check_pcase(backend, case):
    vals = _pcase_args(case, seed=sum(map(ord, case.id)))
    # The table agrees with NumPy 2 itself wherever NumPy has the function, and
    # (torch tensors) with torch itself wherever torch can run the case.
    try:
        with np.errstate(all="ignore"):
            numpy_dtype = np.asarray(case.fn(NPCHK, *vals)).dtype
    except AttributeError:      # a cufuse-only function (sigmoid, erf, rsqrt, gelu ...)
        numpy_dtype = None
    if numpy_dtype is not None:
        assert numpy_dtype == case.expected, f"table says {case.expected}, NumPy says {numpy_dtype}"
    expected = case.torch if backend.is_torch else case.expected
    if backend.is_torch and expected is not RAISES:
        torch_dtype = _torch_dtype_of(case, vals)
        assert torch_dtype in (None, expected), f"table says {expected} for torch, torch says {torch_dtype}"

    args = [v if isinstance(v, (int, float, np.generic)) else backend.asarray(v) for v in vals]
    f = cufuse.fuse(fixed_arity(case.fn, len(args)))
    if expected is RAISES:
        with pytest.raises(cufuse.TraceError, match="torch"):
            f(*args)
        return
    res = f(*args)
    ref = _pcase_reference(case, vals)
    like = next(a for a in args if not isinstance(a, (int, float, np.generic)))
    check_kind(backend, res, ref.shape, expected, like=like)
    got = backend.to_numpy(res)
    if expected.kind == "f":
        assert_close(got, ref, expected, FUNC_TOL[expected], err_msg=case.id)
    else:
        assert_exact(got, ref, expected, case.id)


@pytest.mark.parametrize("group", list(PROMOTION_GROUPS))
def test_dtype_rules(backend, group):
    """Result dtype (NumPy 2 / NEP 50 rules of the spec) and values of each case in the group."""
    check_cases(PROMOTION_GROUPS[group], lambda case: check_pcase(backend, case))


def _astype_fn(dst):
    return lambda x: x.astype(dst)


@pytest.mark.parametrize("src", ALL_DTYPES, ids=lambda d: d.name)
def test_astype(backend, src):
    """x.astype(dst) for every supported pair (values in range of both dtypes;
    float -> int truncates toward zero; nonzero -> True)."""
    rng = np.random.default_rng(60 + ALL_DTYPES.index(src))
    for dst in ALL_DTYPES:
        if src == BOOL:
            x = rng.random(41) < 0.5
        else:
            lo = 0 if (src.kind == "u" or dst.kind == "u") else -100
            if src.kind == "f":
                x = rng.uniform(lo, 100, 41).astype(src)
                x[::7] = 0.0            # exact zeros: astype(bool) must give False there
                x[1::7] = -0.0 if lo < 0 else 0.25
            else:
                x = rng.integers(lo, 101, 41).astype(src)
                x[::7] = 0
        f = cufuse.fuse(_astype_fn(dst))
        res = f(backend.asarray(x))
        with labelled(f"{src.name} -> {dst.name}"):
            check_kind(backend, res, x.shape, dst)
            got = backend.to_numpy(res)
            if dst.kind == "f":
                assert_close(got, x.astype(np.float64), dst, FUNC_TOL[dst])
            else:
                assert_exact(got, x.astype(dst), dst)


@pytest.mark.parametrize("dtype", [I8, U8, I16, I32, I64], ids=lambda d: d.name)
def test_int_floordiv_mod(backend, dtype):
    """// and % of integers: floor division, % takes the divisor's sign (NumPy / Python);
    by 0 both give 0."""
    rng = np.random.default_rng(70)
    lo = 0 if dtype.kind == "u" else -50
    a = rng.integers(lo, 51, (9, 31)).astype(dtype)
    b = rng.integers(-7 if lo else 1, 8, (9, 31)).astype(dtype)
    b[b == 0] = 3
    b[0, ::5] = 0                               # division by zero -> 0
    a[a == 0] = 5
    f = cufuse.fuse(lambda a, b: (a // b, a % b))
    q, r = f(backend.asarray(a), backend.asarray(b))
    with np.errstate(all="ignore"):
        ref_q, ref_r = np.floor_divide(a, b), np.remainder(a, b)
    assert (ref_q[0, ::5] == 0).all() and (ref_r[0, ::5] == 0).all()
    assert_exact(backend.to_numpy(q), ref_q, dtype, "a // b")
    assert_exact(backend.to_numpy(r), ref_r, dtype, "a % b")
    # against Python's own integers where the divisor is nonzero
    qq, rr = backend.to_numpy(q), backend.to_numpy(r)
    for (i, j) in [(1, 0), (2, 3), (4, 7), (8, 30)]:
        assert int(qq[i, j]) == int(a[i, j]) // int(b[i, j])
        assert int(rr[i, j]) == int(a[i, j]) % int(b[i, j])


@dtype_param
def test_float_floordiv_mod_signs(backend, dtype):
    """Float // and % with every sign combination, against Python's float semantics."""
    a = np.array([5.5, -5.5, 5.5, -5.5, 0.75, -0.75, 7.0, -7.0], dtype=dtype)
    b = np.array([2.0, 2.0, -2.0, -2.0, 0.5, 0.5, -1.5, 1.5], dtype=dtype)
    f = cufuse.fuse(lambda a, b: (a // b, a % b))
    q, r = f(backend.asarray(a), backend.asarray(b))
    ref_q = np.array([float(x) // float(y) for x, y in zip(a, b)])
    ref_r = np.array([float(x) % float(y) for x, y in zip(a, b)])
    assert_exact(backend.to_numpy(q), ref_q, dtype, "a // b")
    assert_close(backend.to_numpy(r), ref_r, dtype, FUNC_TOL[dtype], err_msg="a % b")
    assert (np.sign(backend.to_numpy(r)[ref_r != 0]) == np.sign(b[ref_r != 0])).all()


@pytest.mark.parametrize("dtype", [F16, F32, F64, I32, U8, I64], ids=lambda d: d.name)
def test_comparisons(backend, dtype):
    """< <= > >= == != give bool, with frequent ties; also against a Python scalar."""
    rng = np.random.default_rng(80)
    lo = 0 if dtype.kind == "u" else -4
    x = (rng.integers(lo, 5, (7, 33)) / (2 if dtype.kind == "f" else 1)).astype(dtype)
    y = (rng.integers(lo, 5, (33,)) / (2 if dtype.kind == "f" else 1)).astype(dtype)
    f = cufuse.fuse(lambda x, y: (x < y, x <= y, x > y, x >= y, x == y, x != y, x < 2, 1 >= x))
    res = f(backend.asarray(x), backend.asarray(y))
    refs = [x < y, x <= y, x > y, x >= y, x == y, x != y, x < 2, 1 >= x]
    assert isinstance(res, tuple) and len(res) == len(refs)
    assert (x == y).any() and (x != y).any()
    for i, (got, ref) in enumerate(zip(res, refs)):
        check_kind(backend, got, ref.shape, BOOL)
        assert_exact(backend.to_numpy(got), ref, BOOL, f"comparison {i}")


# =============================================================================
# 5. Several outputs, out=
# =============================================================================
def _two_inputs(backend, dtype, seed):
    x = rand((7, 33), dtype, seed)
    y = rand((33,), dtype, seed + 1)
    return x, y, backend.asarray(x), backend.asarray(y)


def _three_outputs_ref(x, y):
    x, y = x.astype(np.float64), y.astype(np.float64)
    return [x + y, x * y, np.exp(x * 0.5) - y]


def _three_outputs(x, y):
    return x + y, x * y, cufuse.exp(x * 0.5) - y


@dtype_param
def test_several_outputs(backend, dtype):
    x, y, xa, ya = _two_inputs(backend, dtype, 90)
    res = cufuse.fuse(_three_outputs)(xa, ya)
    assert isinstance(res, tuple) and len(res) == 3
    for i, (got, ref) in enumerate(zip(res, _three_outputs_ref(x, y))):
        check_kind(backend, got, (7, 33), dtype, like=xa)
        assert_close(backend.to_numpy(got), ref, dtype, FUNC_TOL[dtype], err_msg=f"output {i}")


def _check_returned(backend, res, out):
    """What f returns with out= (if anything) holds the same values as out."""
    if res is None:
        return
    for r, o in zip(res if isinstance(res, tuple) else (res,), out if isinstance(out, tuple) else (out,)):
        np.testing.assert_array_equal(backend.to_numpy(r), backend.to_numpy(o))


@dtype_param
def test_out_one_output(backend, dtype):
    x, y, xa, ya = _two_inputs(backend, dtype, 91)
    f = cufuse.fuse(lambda x, y: cufuse.tanh(x) * y + 0.5)
    out = poisoned(backend, (7, 33), dtype)
    res = f(xa, ya, out=out)
    ref = np.tanh(x.astype(np.float64)) * y.astype(np.float64) + 0.5
    assert_close(backend.to_numpy(out), ref, dtype, FUNC_TOL[dtype])
    _check_returned(backend, res, out)
    # a non-contiguous out (every other column of a poisoned buffer)
    buf = poisoned(backend, (7, 66), dtype)
    view = buf[:, ::2]
    f(xa, ya, out=view)
    got = backend.to_numpy(buf)
    assert_close(got[:, ::2], ref, dtype, FUNC_TOL[dtype])
    assert np.isnan(got[:, 1::2]).all(), "out= wrote outside its view"


@dtype_param
def test_out_several_outputs(backend, dtype):
    x, y, xa, ya = _two_inputs(backend, dtype, 92)
    f = cufuse.fuse(_three_outputs)
    outs = tuple(poisoned(backend, (7, 33), dtype) for _ in range(3))
    res = f(xa, ya, out=outs)
    for i, (o, ref) in enumerate(zip(outs, _three_outputs_ref(x, y))):
        assert_close(backend.to_numpy(o), ref, dtype, FUNC_TOL[dtype], err_msg=f"out[{i}]")
    _check_returned(backend, res, outs)


@dtype_param
def test_out_aliases_input(backend, dtype):
    """In place: out is an input (one output), and two outputs written over both inputs."""
    x = rand((7, 33), dtype, 93)
    y = rand((7, 33), dtype, 94)
    xa, ya = backend.asarray(x), backend.asarray(y)
    f = cufuse.fuse(lambda x, y: x * 2.0 + cufuse.sin(y))
    f(xa, ya, out=xa)
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    assert_close(backend.to_numpy(xa), x64 * 2.0 + np.sin(y64), dtype, FUNC_TOL[dtype], err_msg="out=x")

    p = rand((7, 33), dtype, 95)
    g = rand((7, 33), dtype, 96)
    pa, ga = backend.asarray(p), backend.asarray(g)
    step = cufuse.fuse(lambda p, g: (p - 0.5 * g, g * 0.25 + p))   # each output reads both inputs
    step(pa, ga, out=(pa, ga))
    p64, g64 = p.astype(np.float64), g.astype(np.float64)
    assert_close(backend.to_numpy(pa), p64 - 0.5 * g64, dtype, FUNC_TOL[dtype], err_msg="out[0] = p")
    assert_close(backend.to_numpy(ga), g64 * 0.25 + p64, dtype, FUNC_TOL[dtype], err_msg="out[1] = g")


def test_out_errors(backend):
    x, y, xa, ya = _two_inputs(backend, F32, 97)
    f = cufuse.fuse(lambda x, y: x + y)
    with pytest.raises((TypeError, ValueError)):
        f(xa, ya, out=poisoned(backend, (7, 32), F32))         # wrong shape
    with pytest.raises((TypeError, ValueError)):
        f(xa, ya, out=poisoned(backend, (7, 33), F64))         # wrong dtype
    other = np.full((7, 33), np.nan, np.float32) if backend.name != "numpy" else None
    if other is not None:
        with pytest.raises((TypeError, ValueError)):
            f(xa, ya, out=other)                                   # wrong kind
    g = cufuse.fuse(lambda x, y: (x + y, x - y))
    with pytest.raises((TypeError, ValueError)):
        g(xa, ya, out=(poisoned(backend, (7, 33), F32),))      # one out for two outputs


# =============================================================================
# 6. Trailing reductions
# =============================================================================
RED_SHAPES = [(0, 5), (1, 1), (3, 1), (5, 7), (4, 1000), (2, 3, 4097), (33,)]
RED_OPS = ["sum", "mean", "max", "min"]


def _squared_distance_reduction(op, keepdims):
    return lambda x, y: getattr((x - y) ** 2, op)(axis=-1, keepdims=keepdims)


def _red_ref(op, v, keepdims):
    return getattr(np, op)(v, axis=-1, keepdims=keepdims)


@pytest.mark.parametrize("shape", RED_SHAPES, ids=lambda s: "x".join(map(str, s)))
@dtype_param
def test_reduction(backend, dtype, shape):
    """((x - y) ** 2).<op>(axis=-1, keepdims) with y broadcast along the rows;
    float16 accumulates in float32 (a float16 accumulator of 1000 terms ~2 is far off)."""
    x = rand(shape, dtype, 110)
    y = rand(shape[-1:], dtype, 111)
    xa, ya = backend.asarray(x), backend.asarray(y)
    sq = (x.astype(np.float64) - y.astype(np.float64)) ** 2
    for op in RED_OPS:
        for keepdims in (False, True):
            f = cufuse.fuse(_squared_distance_reduction(op, keepdims))
            ref = _red_ref(op, sq, keepdims)
            with labelled(f"{op} keepdims={keepdims}"):
                res = f(xa, ya)
                check_kind(backend, res, ref.shape, dtype, like=xa)
                assert_close(backend.to_numpy(res), ref, dtype, RED_TOL[dtype])


def test_reduction_spellings_and_layouts(backend):
    """np.sum / np.mean / np.max / np.min(axis=-1), axis=ndim-1, broadcast and transposed inputs."""
    x = rand((4, 1), F32, 120)
    y = rand((1000,), F32, 121)
    z = rand((5, 7), F32, 122)
    xa, ya = backend.asarray(x), backend.asarray(y)
    za = backend_view(backend, z, "T")            # transposed: the reduced axis is strided
    x64, y64, z64 = (a.astype(np.float64) for a in (x, y, z))
    cases = [
        ("np.sum", cufuse.fuse(lambda x, y: np.sum((x - y) ** 2, axis=-1)), (xa, ya), np.sum((x64 - y64) ** 2, -1)),
        ("np.mean", cufuse.fuse(lambda x, y: np.mean(abs(x * y), axis=-1)), (xa, ya), np.mean(abs(x64 * y64), -1)),
        ("np.max", cufuse.fuse(lambda x, y: np.max(x * y, axis=-1)), (xa, ya), np.max(x64 * y64, -1)),
        ("np.min", cufuse.fuse(lambda x, y: np.min(x - y, axis=-1, keepdims=True)), (xa, ya),
         np.min(x64 - y64, -1, keepdims=True)),
        ("axis=1", cufuse.fuse(lambda z: (z * z).sum(axis=1)), (za,), (z64 * z64).sum(1)),
        ("transposed", cufuse.fuse(lambda z: cufuse.exp(z).max(axis=-1)), (za,), np.exp(z64).max(-1)),
    ]
    for name, f, args, ref in cases:
        with labelled(name):
            res = f(*args)
            check_kind(backend, res, ref.shape, F32, like=args[0])
            assert_close(backend.to_numpy(res), ref, F32, RED_TOL[F32])


def test_reduction_several_outputs(backend):
    x = rand((6, 257), F32, 130)
    xa = backend.asarray(x)
    f = cufuse.fuse(lambda x: (x.sum(axis=-1), x.max(axis=-1), (x * x).mean(axis=-1), x.min(axis=-1)))
    res = f(xa)
    x64 = x.astype(np.float64)
    refs = [x64.sum(-1), x64.max(-1), (x64 * x64).mean(-1), x64.min(-1)]
    assert isinstance(res, tuple) and len(res) == 4
    for i, (got, ref) in enumerate(zip(res, refs)):
        check_kind(backend, got, (6,), F32, like=xa)
        assert_close(backend.to_numpy(got), ref, F32, SIGNED_SUM_TOL[F32], err_msg=f"output {i}")
    outs = tuple(poisoned(backend, (6,), F32) for _ in range(4))       # out= for reductions
    f(xa, out=outs)
    for i, (o, ref) in enumerate(zip(outs, refs)):
        assert_close(backend.to_numpy(o), ref, F32, SIGNED_SUM_TOL[F32], err_msg=f"out[{i}]")


def _method_reduction(op):
    return lambda x: getattr(x * 1.0, op)(axis=-1)


@dtype_param
def test_reduction_nan(backend, dtype):
    """NaN in a row makes that row's max / min NaN (and its sum NaN)."""
    x = rand((4, 33), dtype, 140)
    x[1, 7] = np.nan
    x[3, 0] = np.nan
    xa = backend.asarray(x)
    x64 = x.astype(np.float64)
    for op in ["max", "min", "sum"]:
        f = cufuse.fuse(_method_reduction(op))
        ref = getattr(np, op)(x64, axis=-1)
        assert np.isnan(ref).tolist() == [False, True, False, True]
        with labelled(op):
            assert_close(backend.to_numpy(f(xa)), ref, dtype, SIGNED_SUM_TOL[dtype] if op == "sum" else FUNC_TOL[dtype])


def test_reduction_errors(backend):
    x = rand((5, 7), F32, 150)
    x3 = rand((2, 3, 4), F32, 151)
    xa, x3a = backend.asarray(x), backend.asarray(x3)
    for fn, args in [(lambda x: x.sum(axis=0), (xa,)), (lambda x: (x * 2).max(axis=0), (xa,)),
                     (lambda x: np.mean(x, axis=1), (x3a,))]:
        with pytest.raises(cufuse.TraceError) as ei:
            cufuse.fuse(fn)(*args)
        assert "axis" in str(ei.value).lower()
    for fn in [lambda x: x.sum(axis=-1) * 2.0, lambda x: cufuse.exp(x.max(axis=-1)),
               lambda x: x.sum(axis=-1, keepdims=True) + x]:
        with pytest.raises(cufuse.TraceError) as ei:
            cufuse.fuse(fn)(xa)
        assert "reduction" in str(ei.value).lower()
    with pytest.raises((TypeError, ValueError)):   # several outputs: all reductions or none
        cufuse.fuse(lambda x: (x.sum(axis=-1), x * 2.0))(xa)
    # astype after the reduction: refused (it cast the input, elementwise, and dropped the sum); to the
    # reduction's own dtype it is the value itself
    with pytest.raises(cufuse.TraceError, match=r"astype\(float64\) after the reduction"):
        cufuse.fuse(lambda x: x.sum(axis=-1).astype(np.float64))(xa)
    got = backend.to_numpy(cufuse.fuse(lambda x: x.sum(axis=-1).astype(np.float32))(xa))
    np.testing.assert_allclose(got, x.astype(np.float64).sum(-1), rtol=1e-5)


# =============================================================================
# 7. Horizontal fusion: f.foreach
# =============================================================================
FOREACH_SIZES = [0, 1, 5, 100, 4097, 100000]


def _foreach_lists(backend, dtype, shapes, seed, n_lists):
    nps = [[rand(s, dtype, seed + 10 * k + i) for i, s in enumerate(shapes)] for k in range(n_lists)]
    return nps, [[backend.asarray(a) for a in lst] for lst in nps]


def _foreach_shapes(extra=()):
    return [(n,) for n in FOREACH_SIZES] + list(extra)


@dtype_param
def test_foreach(backend, dtype):
    """One result per item (sizes 0 .. 100000 and a 2-D item), a shared scalar,
    lists or tuples; the same Fused also works item by item."""
    shapes = _foreach_shapes([(3, 7)])
    (xs, ys), (xa, ya) = _foreach_lists(backend, dtype, shapes, 160, 2)
    f = cufuse.fuse(lambda x, y, a: x * a + cufuse.tanh(y))
    res = f.foreach(xa, tuple(ya), 0.5)
    assert isinstance(res, list) and len(res) == len(shapes)
    for i, (got, x, y) in enumerate(zip(res, xs, ys)):
        with labelled(f"item {i} {x.shape}"):
            check_kind(backend, got, x.shape, dtype, like=xa[i])
            ref = x.astype(np.float64) * 0.5 + np.tanh(y.astype(np.float64))
            assert_close(backend.to_numpy(got), ref, dtype, FUNC_TOL[dtype])
    # a new scalar value, and one item alone
    res2 = f.foreach(xa, ya, -1.25)
    ref = xs[4].astype(np.float64) * -1.25 + np.tanh(ys[4].astype(np.float64))
    assert_close(backend.to_numpy(res2[4]), ref, dtype, FUNC_TOL[dtype])
    assert_close(backend.to_numpy(f(xa[3], ya[3], 2.0)),
                 xs[3].astype(np.float64) * 2.0 + np.tanh(ys[3].astype(np.float64)), dtype, FUNC_TOL[dtype])


def test_foreach_mixed_layouts(backend):
    """Non-contiguous and offset items among contiguous ones (run separately, same results)."""
    rng = np.random.default_rng(170)
    vals = [rng.uniform(-2, 2, s).astype(F32) for s in [(9, 33), (4097,), (9, 33), (100,), (0,)]]
    lays = ["T", "C", "S", "O", "C"]
    xa = [backend_view(backend, v, lay) for v, lay in zip(vals, lays)]
    ya = [backend.asarray(v[::-1].copy() if v.ndim == 1 else v * 0.5) for v in vals]
    f = cufuse.fuse(lambda x, y: cufuse.sigmoid(x) * y)
    res = f.foreach(xa, ya)
    for i, (got, x, y) in enumerate(zip(res, xa, ya)):
        with labelled(f"item {i} {lays[i]}"):
            x64, y64 = backend.to_numpy(x).astype(np.float64), backend.to_numpy(y).astype(np.float64)
            assert_close(backend.to_numpy(got), REF.sigmoid(x64) * y64, F32, FUNC_TOL[F32])


def test_foreach_several_outputs_and_out(backend):
    shapes = _foreach_shapes()
    (xs, ys), (xa, ya) = _foreach_lists(backend, F32, shapes, 180, 2)
    f = cufuse.fuse(lambda x, y: (x + y, x * y))
    res = f.foreach(xa, ya)
    assert len(res) == len(shapes)
    for i, (item, x, y) in enumerate(zip(res, xs, ys)):
        assert isinstance(item, tuple) and len(item) == 2
        x64, y64 = x.astype(np.float64), y.astype(np.float64)
        assert_close(backend.to_numpy(item[0]), x64 + y64, F32, FUNC_TOL[F32], err_msg=f"item {i}[0]")
        assert_close(backend.to_numpy(item[1]), x64 * y64, F32, FUNC_TOL[F32], err_msg=f"item {i}[1]")
    # out=: a tuple of lists (one list per output), poisoned
    outs = ([poisoned(backend, s, F32) for s in shapes], [poisoned(backend, s, F32) for s in shapes])
    f.foreach(xa, ya, out=outs)
    for i, (x, y) in enumerate(zip(xs, ys)):
        x64, y64 = x.astype(np.float64), y.astype(np.float64)
        assert_close(backend.to_numpy(outs[0][i]), x64 + y64, F32, FUNC_TOL[F32], err_msg=f"out[0][{i}]")
        assert_close(backend.to_numpy(outs[1][i]), x64 * y64, F32, FUNC_TOL[F32], err_msg=f"out[1][{i}]")
    # out=: one list for a one-output function
    g = cufuse.fuse(lambda x, y: cufuse.maximum(x, y) - 1.0)
    out = [poisoned(backend, s, F32) for s in shapes]
    g.foreach(xa, ya, out=out)
    for i, (x, y) in enumerate(zip(xs, ys)):
        ref = np.maximum(x.astype(np.float64), y.astype(np.float64)) - 1.0
        assert_close(backend.to_numpy(out[i]), ref, F32, FUNC_TOL[F32], err_msg=f"out[{i}]")


def test_foreach_in_place(backend):
    """out= the inputs themselves: an SGD step over a list of parameters."""
    shapes = _foreach_shapes([(64, 33)])
    (ps, gs), (pa, ga) = _foreach_lists(backend, F32, shapes, 190, 2)
    sgd = cufuse.fuse(lambda p, g, lr: p - lr * g)
    sgd.foreach(pa, ga, 0.1, out=pa)
    for i, (p, g) in enumerate(zip(ps, gs)):
        assert_close(backend.to_numpy(pa[i]), p.astype(np.float64) - 0.1 * g.astype(np.float64), F32,
                     FUNC_TOL[F32], err_msg=f"item {i}")


def test_foreach_items_that_alias_each_other(backend):
    """An item's output that is another item's input (or overlaps it, or
    another item's output): the items run in order, as the NumPy path does,
    on every backend alike; foreach_plan refuses such lists."""
    f = cufuse.fuse(lambda a, s: a * s + 1.0)
    n = 4096
    base = rand((4 * n,), F32, 195)
    buf = backend.asarray(base)
    # item k reads [k*n, (k+1)*n) and writes [(k+1)*n - n//2, ...): half over the next item's input
    ins = [buf[k * n:(k + 1) * n] for k in range(3)]
    outs = [buf[(k + 1) * n - n // 2:(k + 2) * n - n // 2] for k in range(3)]
    res = f.foreach(ins, 0.5, out=outs)
    ref = base.astype(np.float64)
    for k in range(3):                                    # one item after another
        ref[(k + 1) * n - n // 2:(k + 2) * n - n // 2] = ref[k * n:(k + 1) * n] * 0.5 + 1.0
    assert_close(backend.to_numpy(buf), ref, F32, FUNC_TOL[F32])
    assert all(r is o for r, o in zip(res, outs))
    # a chain: item k writes exactly item k+1's input
    xs = [backend.asarray(rand((n,), F32, 196 + k)) for k in range(4)]
    want = [backend.to_numpy(x).astype(np.float64) for x in xs]
    f.foreach(xs[:3], 2.0, out=xs[1:])
    for k in range(1, 4):
        want[k] = want[k - 1] * 2.0 + 1.0
    for k in range(4):
        assert_close(backend.to_numpy(xs[k]), want[k], F32, FUNC_TOL[F32], err_msg=f"chain item {k}")
    if backend.gpu:  # (a NumPy plan runs foreach, item by item)
        with pytest.raises(ValueError, match="another item's input or output"):
            f.foreach_plan(xs[:3], 2.0, out=xs[1:])


def _adam():
    """The spec's Adam example as a fused function."""
    @cufuse.fuse
    def adam(p, g, m, v, lr, b1, b2, eps, bc1, bc2):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * (m / bc1) / (cufuse.sqrt(v / bc2) + eps)
        return p, m, v
    return adam


def _adam_state(backend, shapes, rng):
    """(params, ms, vs) as NumPy float32, their backend arrays, and float64 copies."""
    params = [rng.standard_normal(s).astype(F32) for s in shapes]
    ms = [(rng.standard_normal(s) * 0.1).astype(F32) for s in shapes]
    vs = [(rng.uniform(0.0, 0.01, s)).astype(F32) for s in shapes]
    arrays = [[backend.asarray(a) for a in lst] for lst in (params, ms, vs)]
    return params, arrays, [[a.astype(np.float64) for a in lst] for lst in (params, ms, vs)]


def test_foreach_adam(backend):
    """The spec's Adam example, in place, 3 steps, against a float64 Adam."""
    adam = _adam()
    shapes = _foreach_shapes([(16, 33)])
    rng = np.random.default_rng(200)
    params, (pa, ma, va), ref = _adam_state(backend, shapes, rng)
    lr, b1, b2, eps = 1e-3, 0.9, 0.999, 1e-8
    for t in range(1, 4):
        grads = [rng.standard_normal(s).astype(F32) for s in shapes]
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        adam.foreach(pa, [backend.asarray(g) for g in grads], ma, va, lr, b1, b2, eps, bc1, bc2, out=(pa, ma, va))
        for i in range(len(shapes)):
            p, m, v = adam_reference(ref[0][i], grads[i], ref[1][i], ref[2][i], lr, b1, b2, eps, bc1, bc2)
            ref[0][i], ref[1][i], ref[2][i] = p, m, v
    for i in range(len(shapes)):
        for name, arr, r in zip("pmv", (pa, ma, va), ref):
            assert_close(backend.to_numpy(arr[i]), r[i], F32, ADAM_TOL, err_msg=f"{name}[{i}] {shapes[i]}")
    assert params[5].size and not np.allclose(backend.to_numpy(pa[5]), params[5])   # it moved


def test_foreach_errors(backend):
    (xs, ys), (xa, ya) = _foreach_lists(backend, F32, [(5,), (7,), (9,)], 210, 2)
    f = cufuse.fuse(lambda x, y: x + y)
    with pytest.raises((TypeError, ValueError)):
        f.foreach(xa, ya[:2])                                   # list lengths differ
    with pytest.raises((TypeError, ValueError)):
        f.foreach(xa, [ya[1], ya[0], ya[2]])                    # shapes differ within an item
    with pytest.raises((TypeError, ValueError)):
        f.foreach(xa, ya, out=[poisoned(backend, (5,), F32)])   # out list of the wrong length
    with pytest.raises((TypeError, ValueError)):               # reductions are not supported in foreach
        cufuse.fuse(lambda x: x.sum(axis=-1)).foreach(xa)
    # an item that fails its checks raises before any item is written (an optimizer step half applied)
    g = cufuse.fuse(lambda a, b, s: a * s + b)
    for bad, exc in (([ya[0], ya[1], backend.asarray(rand((4,), F32, 211))], ValueError),   # no broadcast
                     ([ya[0], ya[1], backend.asarray(rand((9,), np.float64, 212))], TypeError)):  # float64 result
        before = [backend.to_numpy(a).copy() for a in xa]
        with pytest.raises(exc):
            g.foreach(xa, bad, 2.0, out=xa)
        for a, b0 in zip(xa, before):
            np.testing.assert_array_equal(backend.to_numpy(a), b0)


@pytest.mark.parametrize("name", [p.id for p in GPU_BACKEND_PARAMS], ids=str)
@pytest.mark.cuda
def test_foreach_checks_counter(name):
    """A foreach call repeated with out= on the same arrays reuses its first
    check (foreach_checks stays, one launch each, new scalars used); a call
    without out=, or on another list of arrays, checks again."""
    backend = Backend(name)
    shapes = [(n,) for n in [3, 100, 4097]]
    (xs, ys), (xa, ya) = _foreach_lists(backend, F32, shapes, 221, 2)
    outs = [backend.asarray(np.zeros(s, F32)) for s in shapes]
    f = cufuse.fuse(lambda x, y, a: x * a + y)
    f.foreach(xa, ya, 1.5, out=outs)
    first = stats(f)
    for a in (2.0, -0.5):
        f.foreach(xa, ya, a, out=outs)
        backend.synchronize()
        for i in range(len(shapes)):
            assert_close(backend.to_numpy(outs[i]), xs[i].astype(np.float64) * a + ys[i], F32, FUNC_TOL[F32])
    after = stats(f)
    assert after["foreach_checks"] == first["foreach_checks"], (first, after)
    assert after["launches"] - first["launches"] == 2
    f.foreach(xa, ya, 1.5)
    f.foreach(list(reversed(xa)), list(reversed(ya)), 1.5, out=list(reversed(outs)))
    assert stats(f)["foreach_checks"] == after["foreach_checks"] + 2


@pytest.mark.parametrize("name", [p.id for p in GPU_BACKEND_PARAMS], ids=str)
@pytest.mark.cuda
def test_foreach_one_launch(name):
    """On the GPU, a foreach over contiguous items is ONE kernel launch."""
    backend = Backend(name)
    shapes = [(n,) for n in [1, 5, 100, 4097, 100000]] + [(64, 33)]
    (xs, ys), (xa, ya) = _foreach_lists(backend, F32, shapes, 220, 2)
    f = cufuse.fuse(lambda x, y, a: x * a + y)
    for _ in range(2):                              # the first call traces and compiles
        before = stats(f)["launches"]
        res = f.foreach(xa, ya, 1.5)
        backend.synchronize()
        assert stats(f)["launches"] - before == 1
    for i, (got, x, y) in enumerate(zip(res, xs, ys)):
        assert_close(backend.to_numpy(got), x.astype(np.float64) * 1.5 + y, F32, FUNC_TOL[F32], err_msg=f"item {i}")


def test_foreach_plan(backend):
    """f.foreach_plan checks once and runs nothing; each call applies the
    function with that call's scalars (no retrace, no recompile; one launch
    on the GPU), in place too (the Adam of test_foreach_adam, 3 steps), and
    the plan keeps its own arrays when the lists change afterwards."""
    adam = _adam()
    shapes = _foreach_shapes([(16, 33)])
    rng = np.random.default_rng(205)
    params, (pa, ma, va), ref = _adam_state(backend, shapes, rng)
    grads = [rng.standard_normal(s).astype(F32) for s in shapes]
    ga = [backend.asarray(g) for g in grads]
    lr, b1, b2, eps = 1e-3, 0.9, 0.999, 1e-8
    plists = (list(pa), list(ma), list(va))
    step = adam.foreach_plan(pa, ga, ma, va, lr, b1, b2, eps, 1.0, 1.0, out=plists)
    assert "scalars at arguments [5, 6, 7, 8, 9, 10]" in repr(step)
    for i, p in enumerate(params):      # planning ran nothing
        assert np.array_equal(backend.to_numpy(pa[i]), p), f"item {i} changed before the plan was called"
    pa_list, plists[0][0] = plists[0][0], None   # a later change to the lists does not reach the plan
    before = stats(adam)
    for t in range(1, 4):
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        res = step(lr, b1, b2, eps, bc1, bc2)
        assert len(res) == len(shapes) and res[0][0] is pa_list and res[2][1] is ma[2]
        for i in range(len(shapes)):
            ref[0][i], ref[1][i], ref[2][i] = adam_reference(ref[0][i], grads[i], ref[1][i], ref[2][i],
                                                             lr, b1, b2, eps, bc1, bc2)
        if t == 1:   # (NumPy runs item by item: its first call traces the 2-D item's signature)
            first = stats(adam)
    after = stats(adam)
    assert after["traces"] == first["traces"] and after["compiles"] == first["compiles"]
    if backend.gpu:
        backend.synchronize()
        assert after["launches"] - before["launches"] == 3
        assert after["traces"] == before["traces"] and after["compiles"] == before["compiles"]
    for i in range(len(shapes)):
        for name, arr, r in zip("pmv", (pa, ma, va), ref):
            assert_close(backend.to_numpy(arr[i]), r[i], F32, ADAM_TOL, err_msg=f"{name}[{i}] {shapes[i]}")
    assert not np.allclose(backend.to_numpy(pa[5]), params[5])   # it moved

    # one output, no scalars; an empty list
    f = cufuse.fuse(lambda x, y: x * y)
    (xs, ys), (xa, ya) = _foreach_lists(backend, F32, shapes, 206, 2)
    out = [poisoned(backend, s, F32) for s in shapes]
    res = f.foreach_plan(xa, ya, out=out)()
    assert [r is o for r, o in zip(res, out)] == [True] * len(shapes)
    for i, (x, y) in enumerate(zip(xs, ys)):
        assert_close(backend.to_numpy(out[i]), x.astype(np.float64) * y, F32, FUNC_TOL[F32], err_msg=f"out[{i}]")
    assert f.foreach_plan([], [], out=[])() == []

    # several outputs with out= a list of lists (as well as a tuple): plan and
    # foreach's cached path give (out0[i], out1[i]) per item, call after call
    g = cufuse.fuse(lambda x, y: (x + y, x * y))
    o1, o2 = [poisoned(backend, s, F32) for s in shapes], [poisoned(backend, s, F32) for s in shapes]
    for run in (g.foreach_plan(xa, ya, out=[o1, o2]), lambda: g.foreach(xa, ya, out=[o1, o2])):
        for _ in range(2):
            res = run()
            assert all(isinstance(r, tuple) and r[0] is a and r[1] is b for r, a, b in zip(res, o1, o2))
    for i, (x, y) in enumerate(zip(xs, ys)):
        assert_close(backend.to_numpy(o2[i]), x.astype(np.float64) * y, F32, FUNC_TOL[F32], err_msg=f"o2[{i}]")


def test_foreach_plan_errors(backend):
    (xs, ys), (xa, ya) = _foreach_lists(backend, F32, [(5,), (7,), (9,)], 215, 2)
    f = cufuse.fuse(lambda x, y, s: x * s + y)
    out = [poisoned(backend, x.shape, F32) for x in xs]
    with pytest.raises(TypeError, match="out"):
        f.foreach_plan(xa, ya, 2.0)                              # out= is required
    with pytest.raises(TypeError, match="out= is required"):
        f.foreach_plan(xa, ya, 2.0, out=None)
    with pytest.raises(ValueError, match=r"different lengths \(argument 1 has 3, argument 2 has 2\)"):
        f.foreach_plan(xa, ya[:2], 2.0, out=out)                 # list lengths differ, named in argument order
    with pytest.raises(ValueError, match=r"different lengths \(argument 1 has 2, argument 2 has 3\)"):
        f.foreach(xa[:2], ya, 2.0)
    with pytest.raises(TypeError, match="out must be a list"):
        f.foreach_plan([], [], 2.0, out=7)
    with pytest.raises(ValueError, match="foreach_plan: out must be a list of 3"):
        f.foreach_plan(xa, ya, 2.0, out=out[:2])
    plan = f.foreach_plan(xa, ya, 2.0, out=out)
    with pytest.raises(TypeError, match="takes 1 scalar"):
        plan()
    with pytest.raises(TypeError, match="planned as float"):
        plan(2)                                                  # another scalar kind: another signature
    for o in out:                                                # nothing ran
        assert np.isnan(backend.to_numpy(o)).all()
    if backend.gpu:  # an item that cannot join the one launch (non-contiguous) is refused, and named
        xb = list(xa)
        xb[1] = backend_view(backend, rand((7,), F32, 216), "S")
        with pytest.raises(ValueError, match=r"item\(s\) \[1\]"):
            f.foreach_plan(xb, ya, 2.0, out=out)


# =============================================================================
# 8. Signatures: scalar values never retrace / recompile
# =============================================================================
def test_scalars_never_retrace(backend):
    x = rand((7, 33), F32, 230)
    xa = backend.asarray(x)
    x64 = x.astype(np.float64)
    f = cufuse.fuse(lambda x, s: x * s + 1.0)
    assert stats(f)["traces"] == 0
    r1 = f(xa, 2.0)
    s1 = stats(f)
    assert s1["traces"] == 1
    r2 = f(xa, 3.0)
    r3 = f(xa, -0.5)
    s2 = stats(f)
    assert s2["traces"] == s1["traces"], "a new scalar value traced again"
    if backend.gpu:
        assert s2["compiles"] == s1["compiles"], "a new scalar value compiled again"
    else:
        assert s2["compiles"] == 0 and s2["launches"] == 0
    for r, s in [(r1, 2.0), (r2, 3.0), (r3, -0.5)]:
        assert_close(backend.to_numpy(r), x64 * s + 1.0, F32, FUNC_TOL[F32], err_msg=f"s={s}")

    # a new dtype traces again; a new scalar kind (python int) is a new signature too
    x16 = rand((7, 33), F16, 231)
    r4 = f(backend.asarray(x16), 2.0)
    assert stats(f)["traces"] == s2["traces"] + 1
    assert_close(backend.to_numpy(r4), x16.astype(np.float64) * 2.0 + 1.0, F16, FUNC_TOL[F16])
    r5 = f(xa, 2)
    s5 = stats(f)
    assert s5["traces"] == s2["traces"] + 2
    r6 = f(xa, 5)
    s6 = stats(f)
    assert s6["traces"] == s5["traces"]
    if backend.gpu:
        assert s6["compiles"] == s5["compiles"]
    assert_close(backend.to_numpy(r5), x64 * 2 + 1.0, F32, FUNC_TOL[F32])
    assert_close(backend.to_numpy(r6), x64 * 5 + 1.0, F32, FUNC_TOL[F32])
    # a NumPy scalar is another kind again (torch takes it as a number like 2.0, but NumPy's operators, not
    # Python's, compute with it before torch sees it)
    r7 = f(xa, np.float32(1.5))
    assert stats(f)["traces"] == s6["traces"] + 1
    check_kind(backend, r7, (7, 33), F32)
    assert_close(backend.to_numpy(r7), x64 * 1.5 + 1.0, F32, FUNC_TOL[F32])


def test_same_signature_traces_once(backend):
    f = cufuse.fuse(lambda x, y: cufuse.exp(x) - y)
    for seed in range(3):
        x, y, xa, ya = _two_inputs(backend, F32, 240 + 2 * seed)
        res = f(xa, ya)
        assert_close(backend.to_numpy(res), np.exp(x.astype(np.float64)) - y, F32, FUNC_TOL[F32])
    assert stats(f)["traces"] == 1


@pytest.mark.parametrize("name", [p.id for p in GPU_BACKEND_PARAMS], ids=str)
@pytest.mark.cuda
def test_gpu_scalars_never_recompile(name):
    backend = Backend(name)
    x = rand((100, 33), F32, 250)
    xa = backend.asarray(x)
    f = cufuse.fuse(lambda x, s, t: cufuse.tanh(x * s) + t)
    f(xa, 0.5, 1.0)
    backend.synchronize()
    s1 = stats(f)
    assert s1["compiles"] + s1["disk_loads"] + s1["shared"] >= 1  # shared: the same kernel, another Fused
    for s, t in [(0.25, -1.0), (2.0, 3.0), (1e-3, 0.0)]:
        before = stats(f)["launches"]
        res = f(xa, s, t)
        backend.synchronize()
        assert stats(f)["launches"] - before == 1
        assert_close(backend.to_numpy(res), np.tanh(x.astype(np.float64) * s) + t, F32, FUNC_TOL[F32])
    s2 = stats(f)
    assert ((s2["traces"], s2["compiles"], s2["disk_loads"], s2["shared"])
            == (s1["traces"], s1["compiles"], s1["disk_loads"], s1["shared"]))


# =============================================================================
# 9. Errors
# =============================================================================
def _if_on_traced(x, y):
    if x > 0:
        return x
    return y


TRACE_ERRORS = {
    "if": (_if_on_traced, "bool"),
    "bool()": (lambda x, y: x * bool(y), "bool"),
    "and": (lambda x, y: (x > 0) and (y > 0), "bool"),
    "or": (lambda x, y: x or y, "bool"),
    "np.sinh": (lambda x, y: np.sinh(x) + y, "sinh"),
    "float()": (lambda x, y: x * float(y), "float"),
    "int()": (lambda x, y: x + int(y), "int"),
    "index": (lambda x, y: x[0] + y, "index"),
    "constant": (lambda x, y: 1.0, None),
    "numpy constant": (lambda x, y: np.ones(3), None),
}


@pytest.mark.parametrize("name", list(TRACE_ERRORS))
def test_trace_errors(backend, name):
    fn, word = TRACE_ERRORS[name]
    x, y, xa, ya = _two_inputs(backend, F32, 260)
    f = cufuse.fuse(fn)
    with pytest.raises(cufuse.TraceError) as ei:
        f(xa, ya)
    if word is not None:
        assert word in str(ei.value).lower(), str(ei.value)
    assert isinstance(ei.value, TypeError)


def test_torch_functions_and_methods_say_what_to_use(torch_backend):
    """torch functions and tensor methods on traced values raise a TraceError (torch's own TypeError
    about a 'Traced' argument before) or an AttributeError naming cufuse's functions."""
    torch = torch_backend.torch
    x = torch_backend.asarray(rand((3, 5), F32, 262))
    for fn in (lambda a: torch.exp(a), lambda a: torch.where(a > 0, a, 0.0), lambda a: torch.clamp(a, 0, 1)):
        with pytest.raises(cufuse.TraceError, match=r"torch\.\w+ is not traceable.*cufuse\.exp"):
            cufuse.fuse(fn)(x)
    for fn, name in ((lambda a: a.exp(), "exp"), (lambda a: a.to(torch.float64), "to")):
        with pytest.raises(AttributeError, match=f"a traced value has no \\.{name}"):
            cufuse.fuse(fn)(x)


def test_trace_error_is_type_error():
    assert issubclass(cufuse.TraceError, TypeError)


def test_call_errors(backend):
    x, y, xa, ya = _two_inputs(backend, F32, 270)
    f = cufuse.fuse(lambda x, y: x + y)
    with pytest.raises(TypeError):
        f(xa)                                                  # too few
    with pytest.raises(TypeError):
        f(xa, ya, ya)                                          # too many
    with pytest.raises(ValueError):
        f(xa, backend.asarray(rand((5,), F32, 271)))           # (7, 33) with (5,)
    with pytest.raises(TypeError):
        f(backend.asarray(x.astype(np.complex64)), ya)         # complex
    with pytest.raises((TypeError, ValueError)):
        f(1.0, 2.0)                                            # no array argument
    before = stats(f)["launches"]
    with pytest.raises(ValueError):
        f(backend.asarray(rand((3, 4), F32, 272)), backend.asarray(rand((5, 1, 3), F32, 273)))
    assert stats(f)["launches"] == before                      # raised before any launch


def test_mixed_kinds_cpu():
    torch = pytest.importorskip("torch")
    x = rand((7, 33), F32, 280)
    f = cufuse.fuse(lambda x, y: x * y)
    for a, b in [(x, torch.from_numpy(x.copy())), (torch.from_numpy(x.copy()), x)]:
        with pytest.raises(TypeError) as ei:
            f(a, b)
        msg = str(ei.value).lower()
        assert "numpy" in msg and "torch" in msg, msg


@pytest.mark.cuda
def test_mixed_kinds_gpu():
    import cupy
    x = rand((7, 33), F32, 281)
    f = cufuse.fuse(lambda x, y: x * y)
    with pytest.raises(TypeError) as ei:
        f(x, cupy.asarray(x))
    msg = str(ei.value).lower()
    assert "numpy" in msg and "cupy" in msg, msg
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        with pytest.raises(TypeError) as ei:
            f(cupy.asarray(x), torch.from_numpy(x).cuda())
        msg = str(ei.value).lower()
        assert "cupy" in msg and "torch" in msg, msg


# =============================================================================
# 10. f.source
# =============================================================================
def test_source(backend):
    """The generated CUDA source, without a GPU; the same for the same signature
    (scalar values are kernel arguments), different for another dtype."""
    f = cufuse.fuse(lambda x, y, s: cufuse.exp(x) * y + s)
    x, y, xa, ya = _two_inputs(backend, F32, 290)
    src = f.source(xa, ya, 1.0)
    assert isinstance(src, str) and "__global__" in src
    x2, y2, xa2, ya2 = _two_inputs(backend, F32, 292)
    assert f.source(xa2, ya2, 1.0) == src
    assert f.source(xa, ya, -7.5) == src
    x64, y64 = backend.asarray(x.astype(np.float64)), backend.asarray(y.astype(np.float64))
    src64 = f.source(x64, y64, 1.0)
    assert isinstance(src64, str) and "__global__" in src64 and src64 != src


# =============================================================================
# 11. Lambdas, NumPy ufuncs on traced values
# =============================================================================
@dtype_param
def test_lambda(backend, dtype):
    x = rand((7, 33), dtype, 300, lo=-1.0, hi=1.0)
    y = rand((7, 1), dtype, 301, lo=-1.0, hi=1.0)
    f = cufuse.fuse(lambda x, y: cufuse.exp((x + y) * 2))
    res = f(backend.asarray(x), backend.asarray(y))
    check_kind(backend, res, (7, 33), dtype)
    assert_close(backend.to_numpy(res), np.exp((x.astype(np.float64) + y.astype(np.float64)) * 2), dtype,
                 FUNC_TOL[dtype])


@dtype_param
def test_numpy_ufuncs_on_traced_values(backend, dtype):
    x = rand((5, 33), dtype, 310)
    y = rand((33,), dtype, 311)

    def fn(x, y):
        return (np.exp(x), np.maximum(x, 0), np.minimum(x, y), np.sqrt(np.abs(x) + 1), np.log(np.abs(y) + 0.5) * x,
                np.tanh(x) * np.sin(y) + np.cos(x), np.exp2(x) - np.expm1(y * 0.5), np.log1p(np.abs(x)),
                np.floor(x * 2) + np.ceil(y * 2))

    res = cufuse.fuse(fn)(backend.asarray(x), backend.asarray(y))
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    refs = fn(x64, y64)
    assert isinstance(res, tuple) and len(res) == len(refs)
    for i, (got, ref) in enumerate(zip(res, refs)):
        check_kind(backend, got, (5, 33), dtype)
        assert_close(backend.to_numpy(got), np.asarray(ref, np.float64), dtype, FUNC_TOL[dtype],
                     err_msg=f"output {i}")


def test_decorator_and_named_function(backend):
    @cufuse.fuse
    def bias_softplus(x, b):
        return cufuse.softplus(x + b) * 0.5

    x, y, xa, ya = _two_inputs(backend, F64, 320)
    res = bias_softplus(xa, ya)
    assert_close(backend.to_numpy(res), np.logaddexp(0.0, x + y) * 0.5, F64, FUNC_TOL[F64])


# =============================================================================
# 13. Torch tensors come back as torch tensors (dtype, device)
# =============================================================================
@pytest.fixture(params=TORCH_BACKEND_PARAMS)
def torch_backend(request):
    return Backend(request.param)


def test_torch_results(torch_backend):
    torch = torch_backend.torch
    x = torch_backend.asarray(rand((7, 33), F16, 330))
    i = torch_backend.asarray(rand_int((7, 33), I8, 331))
    f = cufuse.fuse(lambda x, i: (x * 2.0, cufuse.exp(i), x > 0, i + 1, i / 2))
    res = f(x, i)
    # torch's own types (torch's rules, not NumPy's: exp(int8) and int8 / 2 are float32)
    want = [torch.float16, torch.float32, torch.bool, torch.int8, torch.float32]
    assert want == [t.dtype for t in (x * 2.0, torch.exp(i), x > 0, i + 1, i / 2)]
    for k, (r, d) in enumerate(zip(res, want)):
        assert isinstance(r, torch.Tensor), f"output {k}: {type(r)}"
        assert r.dtype == d, f"output {k}: {r.dtype}, expected {d}"
        assert r.device == x.device, f"output {k}: on {r.device}"
    y = cufuse.exp(x)                                          # a direct call as well
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float16 and y.device == x.device
    s = cufuse.fuse(lambda c: c.sum(axis=-1))(torch_backend.asarray(rand_int((7, 33), BOOL, 332)))
    assert isinstance(s, torch.Tensor) and s.dtype == torch.int64 and s.device == x.device
    out = torch_backend.full((7, 33), np.nan, F16)
    cufuse.fuse(lambda x: x - 1.0)(x, out=out)
    assert_close(torch_backend.to_numpy(out), torch_backend.to_numpy(x).astype(np.float64) - 1.0, F16,
                 FUNC_TOL[F16])


# =============================================================================
# The call fast path (a repeated call of one kind launches without the checks)
# =============================================================================
@pytest.mark.parametrize("name", [p.id for p in GPU_BACKEND_PARAMS], ids=str)
@pytest.mark.cuda
def test_gpu_fast_path_repeated_calls(name):
    """Calls 2.. of one exact kind take __call__'s fast path: every result is
    still right when the values, the shape, the layout or out= change."""
    backend = Backend(name)
    f = cufuse.fuse(lambda x, y, s: cufuse.tanh(x * s) + y)
    tol = FUNC_TOL[F32]
    for seed, shape in enumerate([(64, 33), (64, 33), (64, 33), (7, 5), (64, 33), (0, 3), (1,)]):
        x, y = rand(shape, F32, 600 + seed), rand(shape, F32, 700 + seed)
        s = 0.25 * (seed + 1)
        got = f(backend.asarray(x), backend.asarray(y), s)
        backend.synchronize()
        check_kind(backend, got, shape, F32)
        assert_close(backend.to_numpy(got), np.tanh(x.astype(np.float64) * s) + y, F32, tol, err_msg=str(shape))
    # a non-contiguous view after the contiguous calls of the same shape
    x, y = rand((64, 66), F32, 801), rand((64, 33), F32, 802)
    got = f(backend.asarray(x)[:, ::2], backend.asarray(y), 0.5)
    assert_close(backend.to_numpy(got), np.tanh(x[:, ::2].astype(np.float64) * 0.5) + y, F32, tol)
    # out=: a fresh array, then an input itself (in place), poisoned first
    x, y = rand((64, 33), F32, 803), rand((64, 33), F32, 804)
    xa, ya = backend.asarray(x), backend.asarray(y)
    o = backend.asarray(np.full((64, 33), np.nan, F32))
    for _ in range(2):
        assert f(xa, ya, 0.5, out=o) is o
        assert_close(backend.to_numpy(o), np.tanh(x.astype(np.float64) * 0.5) + y, F32, tol)
    for k in range(2):
        assert f(xa, ya, 0.5, out=xa) is xa
        x = np.tanh(x.astype(np.float64) * 0.5) + y
        assert_close(backend.to_numpy(xa), x, F32, tol, err_msg=f"in place, round {k}")
        x = backend.to_numpy(xa)


def test_math_functions_get_a_message_that_names_them():
    """math.exp(traced) calls float() on it: the error says so and what to use instead."""
    import math
    f = cufuse.fuse(lambda a: math.exp(a) + 1)
    with pytest.raises(cufuse.TraceError, match=r"math functions \(math\.exp.*use cufuse\.exp"):
        f(np.ones(3, np.float32))


# =============================================================================
# 12. NumPy 2's rules for Python ints, integer powers and float -> int casts
# =============================================================================
INT_SAMPLE = [232, 7, 42, 0, 255, 128, 1]   # what uint8 holds; int8 etc. take these modulo their range
NUMPY_RULES_PARAMS = [p for p in BACKEND_PARAMS if p.id in ("numpy", "cupy")]


@pytest.fixture(params=NUMPY_RULES_PARAMS)
def numpy_rules_backend(request):
    """NumPy and CuPy arrays: NumPy 2's rules (torch tensors follow torch's: below)."""
    return Backend(request.param)


def _int_array(dtype):
    return np.array(INT_SAMPLE, dtype=np.int64).astype(dtype)


@pytest.mark.parametrize("dtype", [U8, I8, I16, I32, I64], ids=lambda d: d.name)
def test_python_int_compares_by_value(numpy_rules_backend, dtype):
    """uint8_array == 1000 is all False and < 300 all True: the Python int is not
    wrapped to the array's type (NumPy 2), as a literal and as an argument."""
    backend = numpy_rules_backend
    x = _int_array(dtype)
    xa = backend.asarray(x)
    consts = cufuse.fuse(lambda a: (a == 1000, a < 300, a > -1, a >= -129, a != 70000, 2 ** 40 > a, a <= 127))
    refs = [np.full(x.shape, v, bool) for v in (False, True, True, True, True, True, False)]
    refs[-1] = x.astype(np.int64) <= 127
    refs[2] = x.astype(np.int64) > -1
    with np.errstate(all="ignore"):  # NumPy itself agrees (NumPy 2 compares Python ints by value)
        for got_np, ref in zip([x == 1000, x < 300, x > -1, x >= -129, x != 70000, 2 ** 40 > x, x <= 127], refs):
            np.testing.assert_array_equal(got_np, ref)
    for i, (got, ref) in enumerate(zip(consts(xa), refs)):
        assert_exact(backend.to_numpy(got), ref, BOOL, f"literal comparison {i}")
    arg = cufuse.fuse(lambda a, s: (a == s, a < s, a > s))
    for s in (1000, -1, 300, 42, -2 ** 40):
        eq, lt, gt = arg(xa, s)
        wide = x.astype(np.int64)
        assert_exact(backend.to_numpy(eq), wide == s, BOOL, f"== {s}")
        assert_exact(backend.to_numpy(lt), wide < s, BOOL, f"< {s}")
        assert_exact(backend.to_numpy(gt), wide > s, BOOL, f"> {s}")


@pytest.mark.parametrize("dtype", [U8, I8, I16], ids=lambda d: d.name)
def test_python_int_out_of_range_raises(numpy_rules_backend, dtype):
    """uint8_array + 300 raises OverflowError as in NumPy 2 (the int takes the
    array's type), for a literal and for an argument, on every call of a
    signature already seen; an int beyond int64 raises a clear OverflowError."""
    backend = numpy_rules_backend
    x = _int_array(dtype)
    xa = backend.asarray(x)
    big = int(np.iinfo(dtype).max) + 1
    with pytest.raises(OverflowError, match=rf"Python integer {big} out of bounds for {dtype.name}"):
        x + big                                       # NumPy itself
    with pytest.raises(OverflowError, match=rf"Python integer {big} out of bounds for {dtype.name}"):
        cufuse.fuse(lambda a: a + big)(xa)
    with pytest.raises(OverflowError, match=rf"out of bounds for {dtype.name}"):
        cufuse.fuse(lambda a: cufuse.maximum(a, big))(xa)
    f = cufuse.fuse(lambda a, s: a * s)
    with np.errstate(over="ignore"):
        assert_exact(backend.to_numpy(f(xa, 3)), x * 3, dtype, "in range")
    before = stats(f)["launches"]
    for _ in range(2):                                # the second call is on the fast path
        with pytest.raises(OverflowError, match=rf"Python integer {big} out of bounds for {dtype.name}"):
            f(xa, big)
    assert stats(f)["launches"] == before             # raised before any launch
    with np.errstate(over="ignore"):
        assert_exact(backend.to_numpy(f(xa, 2)), x * 2, dtype, "in range after the error")
    with pytest.raises(OverflowError, match="out of bounds for int64"):
        cufuse.fuse(lambda a: a.astype(np.int64) + 2 ** 70)(xa)
    with pytest.raises(OverflowError, match="out of bounds for int64"):
        f(xa, -2 ** 64)
    # numpy.where: as the installed NumPy does (up to 2.4 it converts unchecked, 2.5 raises)
    try:
        with np.errstate(all="ignore"):
            ref = np.where(x > 10, x, big + 5)
    except OverflowError:
        with pytest.raises(OverflowError, match=f"out of bounds for {dtype.name}"):
            cufuse.fuse(lambda a: np.where(a > 10, a, big + 5))(xa)
    else:
        w = cufuse.fuse(lambda a: np.where(a > 10, a, big + 5))(xa)
        assert_exact(backend.to_numpy(w), ref, dtype, "where")


@pytest.mark.parametrize("dtype", [I8, I32, I64], ids=lambda d: d.name)
def test_integer_negative_power(numpy_rules_backend, dtype):
    """An integer to a negative scalar integer power raises ValueError (NumPy);
    an unsigned array with -1 raises OverflowError first, as NumPy does."""
    backend = numpy_rules_backend
    x = _int_array(dtype)
    xa = backend.asarray(x)
    with pytest.raises(ValueError, match="negative integer powers"):
        x ** -1                                       # NumPy itself
    with pytest.raises(ValueError, match="negative integer powers"):
        cufuse.fuse(lambda a: a ** -1)(xa)
    f = cufuse.fuse(lambda a, s: a ** s)
    with np.errstate(over="ignore"):
        assert_exact(backend.to_numpy(f(xa, 2)), x ** 2, dtype, "x ** 2")
    for _ in range(2):
        with pytest.raises(ValueError, match=r"negative integer powers.*exponent -2"):
            f(xa, -2)
    with pytest.raises(ValueError, match="negative integer powers"):
        f(xa, np.int64(-1))                           # a strong NumPy scalar too
    # float bases or exponents are fine
    with np.errstate(divide="ignore"):
        ref = 1.0 / x.astype(np.float64)               # 0 ** -1.0 is inf
    assert_close(backend.to_numpy(f(xa, -1.0)), ref, F64, FUNC_TOL[F64])
    with pytest.raises(OverflowError, match="Python integer -1 out of bounds for uint8"):
        cufuse.fuse(lambda a: a ** -1)(backend.asarray(_int_array(U8)))


def _int_power_ref(a, b):
    """a ** b of Python ints: exact for b >= 0 (wrapped later by the caller's
    dtype); for b < 0, 1 / a**|b| truncated toward zero, and 0 for a base of 0
    (torch's integer pow: there is no integer infinity)."""
    from fractions import Fraction
    if b >= 0:
        return a ** b
    return 0 if a == 0 else int(Fraction(1, a ** -b))


@pytest.mark.parametrize("dtype", [I8, I32, I64], ids=lambda d: d.name)
def test_integer_negative_exponents_in_an_array(backend, dtype):
    """Negative exponents held in an integer array (no error can be raised per
    element): 1 ** -n is 1, (-1) ** -n is -1 for odd n and 1 for even, any
    other base (0 too) gives 0, as torch gives them; torch's own result where
    the array is a tensor."""
    a = np.array([1, -1, -1, 2, -2, 0, 3, 1, -1, 5, -3, 0, 1, -1], dtype)
    b = np.array([-1, -1, -2, -1, -3, -2, 2, 0, 3, 1, 3, 0, -100, -101], dtype)
    want = np.array([_int_power_ref(int(x), int(y)) for x, y in zip(a, b)]).astype(dtype)
    for shape in ((14,), (2, 7)):
        got = backend.to_numpy(cufuse.fuse(lambda x, y: x ** y)(backend.asarray(a.reshape(shape)),
                                                                 backend.asarray(b.reshape(shape))))
        assert got.dtype == dtype
        np.testing.assert_array_equal(got.reshape(-1), want)
    if backend.is_torch:
        t = backend.torch
        np.testing.assert_array_equal(t.from_numpy(a) ** t.from_numpy(b), want)


@pytest.mark.parametrize("dtype", [U8, I8], ids=lambda d: d.name)
def test_clip_python_int_bounds(numpy_rules_backend, dtype):
    """numpy.clip / cufuse.clip of an integer array with Python int bounds beyond
    its range: a bound beyond it is no bound; a lower bound above the range or an
    upper bound below it raises OverflowError (NumPy 2's numpy.clip)."""
    backend = numpy_rules_backend
    x = _int_array(dtype)
    xa = backend.asarray(x)
    info = np.iinfo(dtype)
    cases = [(-5, 100), (50, 10), (int(info.min) - 1, int(info.max) + 1), (3, 1000), (-1000, 20)]
    for lo, hi in cases:
        ref = np.clip(x, lo, hi)                      # NumPy itself
        for fn in (lambda a: np.clip(a, lo, hi), lambda a: cufuse.clip(a, lo, hi)):
            assert_exact(backend.to_numpy(cufuse.fuse(fn)(xa)), ref, dtype, f"clip({lo}, {hi})")
        g = cufuse.fuse(lambda a, lo_, hi_: cufuse.clip(a, lo_, hi_))
        assert_exact(backend.to_numpy(g(xa, lo, hi)), ref, dtype, f"clip(arguments {lo}, {hi})")
    for lo, hi in [(int(info.max) + 1, int(info.max) + 2), (0, int(info.min) - 1)]:
        with pytest.raises(OverflowError):
            np.clip(x, lo, hi)
        with pytest.raises(OverflowError, match=f"out of bounds for {dtype.name}"):
            cufuse.fuse(lambda a: np.clip(a, lo, hi))(xa)


def test_clip_bound_that_promotes(numpy_rules_backend):
    """numpy.clip / cufuse.clip of an integer array whose lower bound promotes
    it (a Python float, a wider integer array) and whose upper bound is a
    Python int: NumPy's values and result dtype (the upper bound applies to
    the promoted values, not cast back to the array's type); and an upper
    bound that promotes (NumPy takes the type of all three)."""
    backend = numpy_rules_backend
    x32 = np.array([-5, 1, 5, 120], np.int32)
    x8 = x32.astype(np.int8)
    wide = np.array([100, 20, -3, 110], np.int32)
    for a, lo, hi in ((x32, -1.25, 3), (x8, wide, 105), (x8, wide, 1000), (x8, 0.5, 100), (x8, 300, 1e10),
                      (x8, 300, wide + 300), (x8, -1.5, wide.astype(np.float32)), (x8, -3, wide)):
        ref = np.clip(a, lo, hi)
        args = tuple(backend.asarray(v) if isinstance(v, np.ndarray) else v for v in (a, lo, hi))
        for fn in (lambda v, lo_, hi_: np.clip(v, lo_, hi_), lambda v, lo_, hi_: cufuse.clip(v, lo_, hi_)):
            assert_exact(backend.to_numpy(cufuse.fuse(fn)(*args)), ref, ref.dtype, f"clip({lo}, {hi}) of {a.dtype}")


def test_numpy_functions_of_python_scalars_are_strong(backend):
    """A NumPy function of Python scalars gives a NumPy scalar, which NumPy 2
    types strongly: int8_array + numpy.maximum(s, 0) is int64 and
    float32_array * numpy.exp(s) float64, where s + 0 stays weak. torch takes
    NumPy scalars as Python ones: the tensor's type."""
    x8 = np.array([100, 120, -7], np.int8)
    xf = np.array([1.5, -2.0, 3.0], np.float32)
    cases = [(lambda a, s: a + np.maximum(s, 0), x8, 100), (lambda a, s: a * np.exp(s), xf, 0.1),
             (lambda a, s: a + np.clip(s, 0, 5), x8, 3), (lambda a, s: a + (s + 0), x8, 100)]
    if not backend.is_torch:  # (a tensor minus a 0-d NumPy array is NumPy's to compute: no torch reference)
        cases.append((lambda a, s: a - np.where(s > 0, s, 0), xf, 2.5))
    for fn, a, s in cases:
        got = backend.to_numpy(cufuse.fuse(fn)(backend.asarray(a), s))
        ref = fn(backend.torch.from_numpy(a), s).numpy() if backend.is_torch else fn(a, s)
        assert got.dtype == ref.dtype, (backend, got.dtype, ref.dtype)
        np.testing.assert_allclose(got.astype(np.float64), ref.astype(np.float64), rtol=1e-6)


def _eager(backend, fn, x, *scalars):
    """``fn`` run eagerly on the host copy of x (NumPy, or torch on the CPU), in float64 for floats."""
    if backend.is_torch:
        return fn(backend.torch.from_numpy(x), *scalars).numpy()
    return fn(x, *scalars)


def test_python_number_arithmetic_is_pythons(backend):
    """Python operators between Python numbers only (scalar arguments and
    literals) give what Python gives when the function runs eagerly, at each
    call: 2 ** (n - 3) is 0.25 for n = 1 (a clear error where the traced
    function took it as an int: a kernel parameter has one type), -7 // 2 is
    -4, n * n beyond int64 raises OverflowError instead of wrapping around.
    A new value never traces again."""
    x = rand((5, 17), F32, 610)
    xa = backend.asarray(x)
    x64 = x.astype(np.float64)
    pow2 = lambda a, n: a * 2 ** (n - 3)  # noqa: E731
    f = cufuse.fuse(pow2)
    for n in (3, 5, 9):
        assert_close(backend.to_numpy(f(xa, n)), x64 * 2.0 ** (n - 3), F32, FUNC_TOL[F32], err_msg=f"n={n}")
    for _ in range(2):  # the fast path too
        with pytest.raises(ValueError, match=r"2 \*\* \(argument 2 - 3\) is 0.25 \(float\).*2\.0 \*\* k"):
            f(xa, 1)
    fl = cufuse.fuse(lambda a, n: a * 2.0 ** (n - 3))
    for n in (1, -4, 6):
        ref = _eager(backend, lambda a, n: a * 2.0 ** (n - 3), x, n)
        got = backend.to_numpy(fl(xa, n))
        assert got.dtype == ref.dtype
        assert_close(got, x64 * 2.0 ** (n - 3), F32, FUNC_TOL[F32], err_msg=f"n={n}")
    assert stats(fl)["traces"] == 1

    mixed = lambda a, n, m: a + (n // m + n % m - (-n) + abs(-n) + (n > m) + n / m)  # noqa: E731
    g = cufuse.fuse(mixed)
    for n, m in ((-7, 2), (7, -2), (9, 4), (-1, 3)):
        want = n // m + n % m + n + abs(n) + (n > m) + n / m
        assert_close(backend.to_numpy(g(xa, n, m)), x64 + want, F32, FUNC_TOL[F32], err_msg=f"{n}, {m}")
    with pytest.raises(ZeroDivisionError):
        g(xa, 1, 0)

    sq = cufuse.fuse(lambda a, n: a + n * n)
    assert_close(backend.to_numpy(sq(xa, 1 << 20)), x64 + float(1 << 40), F32, FUNC_TOL[F32])
    for _ in range(2):
        with pytest.raises(OverflowError, match="Python integer 9223372037000250000 out of bounds for int64"):
            sq(xa, 3037000500)                       # its square is past int64: no wrap-around

    # as eagerly: a literal fixes a result's type (n ** -1 is a float at every call); an int only Python
    # computes with need not fit int64; +, abs and NumPy functions of Python numbers; NumPy scalars
    # computed with by NumPy's operators (under torch's rules too: s / 0 is inf, not ZeroDivisionError)
    cases = [(lambda a, n: a * n ** -1, (4,)), (lambda a, n: a * (n * 1e-30), (10 ** 30,)),
             (lambda a, n: a + n // 10 ** 20, (10 ** 25,)), (lambda a, s, u: a * (np.abs(s) + np.abs(u)), (True, True)),
             (lambda a, s, u: a * ((+s) & u), (True, True)), (lambda a, s, n: a * (s / n), (np.float32(1), 0)),
             (lambda a, s, n: a * (s // n + 1), (np.int64(7), 0)),
             (lambda a, s: a * s ** 2000.0, (1.0,))]  # (a sample of s overflowing while tracing: no error)
    for k, (fn, scalars) in enumerate(cases):
        with np.errstate(divide="ignore"):
            ref = _eager(backend, fn, x, *scalars)
        got = backend.to_numpy(cufuse.fuse(fn)(xa, *scalars))
        assert got.dtype == ref.dtype, (k, got.dtype, ref.dtype)
        assert_close(got, ref.astype(np.float64), got.dtype, FUNC_TOL[got.dtype], err_msg=f"case {k}")

    # Python bools are Python numbers (True + True is 2); NumPy booleans are NumPy's (their logical or)
    bools = lambda a, s, t: a + (s + t) * 2  # noqa: E731
    b = cufuse.fuse(bools)
    assert_close(backend.to_numpy(b(xa, True, True)), x64 + 4.0, F32, FUNC_TOL[F32])
    assert_close(backend.to_numpy(b(xa, True, False)), x64 + 2.0, F32, FUNC_TOL[F32])
    if not backend.is_torch:  # (np.True_ + np.True_) * 2 is a strong int64: float64
        got, ref = backend.to_numpy(b(xa, np.True_, np.True_)), bools(x, np.True_, np.True_)
        assert got.dtype == ref.dtype == F64
        assert_close(got, x64 + 2.0, F64, FUNC_TOL[F64])

    # an integer array keeps NumPy's (torch's) rules with the Python int that results
    xi = rand_int((5, 17), I32, 611)
    h = cufuse.fuse(lambda a, n: a * (n - 1) + (n + 2) // 3)
    got, ref = backend.to_numpy(h(backend.asarray(xi), 4)), _eager(backend, lambda a, n: a * (n - 1) + (n + 2) // 3, xi, 4)
    assert got.dtype == ref.dtype == I32
    assert_exact(got, ref, I32, "int32 * (n - 1) + (n + 2) // 3")


def test_python_number_arithmetic_gradient(torch_backend):
    """The gradient through a Python-number factor computed at each call."""
    torch = torch_backend.torch
    x = torch_backend.asarray(rand((4, 9), F32, 612)).requires_grad_(True)
    f = cufuse.fuse(lambda a, n: a * a * 2.0 ** (n - 3))
    for n in (1, 5):
        x.grad = None
        f(x, n).sum().backward()
        ref = 2 * x.detach().double() * 2.0 ** (n - 3)
        torch.testing.assert_close(x.grad.double(), ref, rtol=1e-6, atol=1e-6)


def test_numpy_float_loops_of_python_scalars(torch_backend):
    """numpy.fabs / numpy.rint of a Python int under torch's rules: a float
    that stays weak (torch takes NumPy scalars as Python ones), so an int32
    tensor plus it is the default float, as eager torch gives."""
    t = torch_backend.torch
    x = torch_backend.asarray(np.array([1, -2, 3], np.int32))
    for fn in (lambda a, s: a + np.fabs(s), lambda a, s: a + np.rint(s)):
        got = cufuse.fuse(fn)(x, 3)
        ref = fn(t.tensor([1, -2, 3], dtype=t.int32), 3)
        assert got.dtype == ref.dtype, (got.dtype, ref.dtype)
        np.testing.assert_allclose(torch_backend.to_numpy(got), ref.numpy())


def test_numpy_fabs_gives_floats(backend):
    """numpy.fabs of integers and booleans: NumPy's float types (int8 and bool float16, int16
    float32, int32 and int64 float64), values |x|."""
    for dt in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.bool_, np.float32):
        a = np.array([1, 0, 1], dt) if dt == np.bool_ else np.array([3, 0, 5], dt) if dt == np.uint8 else \
            np.array([-3, 0, 5], dt)
        ref = np.fabs(a)
        assert_exact(backend.to_numpy(cufuse.fuse(lambda v: np.fabs(v))(backend.asarray(a))), ref, ref.dtype, dt.__name__)


def test_sum_over_an_axis_its_values_do_not_span(backend):
    """A trailing sum of values whose arguments all have size 1 on the last
    axis, against a broadcast shape longer there, raises ValueError (each value
    would count once per column; NumPy and torch count it once), before
    anything runs; mean, max and min of such values are their values and stay
    allowed, as does a sum of values that span the axis. A reduction without
    an axis is NumPy's over every element: the last axis of a 1-d value only."""
    a = backend.asarray(np.array([[1.0], [2.0]], np.float32))
    b = backend.asarray(np.ones((2, 4), np.float32))
    with pytest.raises(ValueError, match="count 4 times"):
        cufuse.fuse(lambda u, v: (u.sum(axis=-1), (u * v).sum(axis=-1)))(a, b)
    with pytest.raises(ValueError, match="count 4 times"):
        cufuse.fuse(lambda u, v: (v.sum(axis=-1, keepdims=True), (u * 2.0).sum(axis=-1, keepdims=True)))(a, b)
    m, s = cufuse.fuse(lambda u, v: (u.mean(axis=-1), (u * v).sum(axis=-1)))(a, b)
    assert_exact(backend.to_numpy(m), np.array([1.0, 2.0]), np.float32, "mean")
    assert_exact(backend.to_numpy(s), np.array([4.0, 8.0]), np.float32, "sum of u * v")
    one = backend.asarray(np.array([[1.0], [2.0]], np.float32))
    assert_exact(backend.to_numpy(cufuse.fuse(lambda u: u.sum(axis=-1))(one)), np.array([1.0, 2.0]), np.float32, "1 col")
    with pytest.raises(cufuse.TraceError, match=r"write \.sum\(axis=-1\)"):
        cufuse.fuse(lambda u: u.sum())(b)
    with pytest.raises(cufuse.TraceError, match=r"write \.max\(axis=-1\)"):
        cufuse.fuse(lambda u: np.max(u))(b)
    v = backend.asarray(np.arange(1.0, 4.0, dtype=np.float32))
    for f in (lambda u: u.sum(), lambda u: np.sum(u)):
        assert_exact(backend.to_numpy(cufuse.fuse(f)(v)), np.float32(6.0), np.float32, "1-d sum")


def _float_to_int_reference(v, dtype):
    """The documented float -> int conversion, element by element in Python:
    truncate; NaN or beyond int32 (int64 for 8-byte types) gives the minimum of
    that width; then the low bits of the target type."""
    bits = 64 if dtype.itemsize == 8 else 32
    lim = 2 ** (bits - 1)
    out = []
    for f in map(float, v):
        w = -lim if (f != f or not -lim <= f < lim) else int(f)
        nbits = 8 * dtype.itemsize
        w &= (1 << nbits) - 1
        if dtype.kind == "i" and w >= 1 << (nbits - 1):
            w -= 1 << nbits
        out.append(w)
    return np.array(out).astype(dtype)


@pytest.mark.parametrize("src", [F16, F32, F64], ids=lambda d: d.name)
def test_float_to_int_cast_edges(backend, src):
    """astype(int) of NaN, ±inf, values beyond the type and negatives into unsigned
    types: the same defined values on every path (what NumPy gives on x86-64)."""
    import platform
    with np.errstate(over="ignore"):                 # float16: the large ones become ±inf
        vals = np.array([np.inf, -np.inf, np.nan, 300.7, -1.5, 3e9, -3e9, 1e20, -2147483648.5, 2147483647.0,
                         65504.0, -0.9, 0.9, 129.0, -129.0, 9.3e18, -9.3e18], np.float64).astype(src)
    xa = backend.asarray(vals)
    for dst in (I8, U8, I16, I32, I64, BOOL):
        ref = vals != 0 if dst == BOOL else _float_to_int_reference(vals, dst)
        got = backend.to_numpy(cufuse.fuse(_astype_fn(dst))(xa))
        assert_exact(got, ref, dst, f"{src.name} -> {dst.name}")
        if platform.machine() in ("x86_64", "AMD64"):
            with np.errstate(invalid="ignore", over="ignore"):
                assert_exact(vals.astype(dst), ref, dst, f"NumPy's own {src.name} -> {dst.name}")


def test_clip_and_round_of_booleans(numpy_rules_backend):
    """numpy.clip of a boolean array takes NumPy's type of all three operands (a Python bound with an int8
    array gave int64, with a float32 scalar float64), and accepts NumPy 2.1's min= and max=; numpy.round
    of booleans is float16, as NumPy's (it stayed bool)."""
    backend = numpy_rules_backend
    m = np.array([True, False, True, True])
    b8 = np.array([1, 2, 3, 0], np.int8)
    ma, b8a = backend.asarray(m), backend.asarray(b8)
    for fn, args, np_args in [(lambda v, b: np.clip(v, 0, b), (ma, b8a), (m, b8)),
                              (lambda v: np.clip(v, 0.0, np.float32(0.5)), (ma,), (m,)),
                              (lambda v: np.clip(v, min=0, max=1), (ma,), (m,)),
                              (lambda v: np.round(v), (ma,), (m,))]:
        ref = fn(*np_args)
        assert_exact(backend.to_numpy(cufuse.fuse(fn)(*args)), ref, ref.dtype, str(ref.dtype))
    with pytest.raises(cufuse.TraceError, match="numpy.maximum"):
        cufuse.fuse(lambda v: np.clip(v, 0, None))(ma)


@pytest.mark.parametrize("dtype", [I32, I64], ids=str)
def test_lowest_int_over_minus_one(numpy_rules_backend, dtype):
    """The lowest value // -1 and % -1: NumPy's wrapped quotient (the value itself) and 0; in C++ both
    overflow (undefined), which the kernels now avoid."""
    backend = numpy_rules_backend
    lo = np.iinfo(dtype).min
    a = np.array([lo, lo, 7, -7, lo + 1], dtype)
    b = np.array([-1, 1, -1, 2, -1], dtype)
    with np.errstate(all="ignore"):
        want = (a // b, a % b)
    got = cufuse.fuse(lambda x, y: (x // y, x % y))(backend.asarray(a), backend.asarray(b))
    for g, w in zip(got, want):
        assert_exact(backend.to_numpy(g), w, dtype, "//, %")


def test_call_and_method_error_messages(backend):
    """Keyword arguments, a tensor method, a NumPy scalar type not taken: each says what to do."""
    x = backend.asarray(rand((4,), F32, 40))
    with pytest.raises(TypeError, match="pass the arguments positionally.*got b="):
        cufuse.fuse(lambda a, b: a * b)(x, b=2.0)
    with pytest.raises(AttributeError, match=r"use cufuse.clip\(x, lo, hi\)"):
        cufuse.fuse(lambda a: a.clamp(0, 1))(x)
    with pytest.raises(AttributeError, match=r"use \.astype\(dtype\)"):
        cufuse.fuse(lambda a: a.to(np.float16))(x)
    with pytest.raises(AttributeError, match=r"use cufuse's functions or NumPy's ufuncs$"):
        cufuse.fuse(lambda a: a.frobnicate())(x)
    with pytest.raises(TypeError, match="uint32 scalars are not accepted; pass a Python int, float or bool, or a "
                                        "NumPy scalar of bool"):
        cufuse.fuse(lambda a, s: a * s)(x, np.uint32(3))


def test_rounding_ufuncs_follow_numpy_result_types(backend):
    """numpy.rint of an integer array gives a float (float16 for int8), as the
    installed NumPy's loops say; floor / ceil keep integers where NumPy does."""
    for dtype in (I8, U8, I32, BOOL):
        x = rand_int((5, 9), dtype, 31)
        xa = backend.asarray(x)
        for fn in (np.rint, np.floor, np.ceil):
            ref = fn(x)
            got = cufuse.fuse(lambda a: fn(a))(xa)
            check_kind(backend, got, x.shape, ref.dtype)
            assert_exact(backend.to_numpy(got), ref, ref.dtype, f"{fn.__name__}({dtype.name})")


def test_nested_fused_functions_trace_inline(backend):
    """A fused function called inside another is traced into the outer kernel."""
    inner = cufuse.fuse(lambda a, s: (a * s, a - 1))
    outer = cufuse.fuse(lambda a, b: inner(a, 2.0)[0] + inner(b, 0.5)[1])
    x, y, xa, ya = _two_inputs(backend, F32, 900)
    got = outer(xa, ya)
    ref = x.astype(np.float64) * 2.0 + (y.astype(np.float64) - 1)
    assert_close(backend.to_numpy(got), ref, F32, FUNC_TOL[F32])
    assert stats(inner)["traces"] == 0 and stats(outer)["traces"] == 1
    bad = cufuse.fuse(lambda a: inner(a, 1.0, out=(a, a))[0])
    with pytest.raises(cufuse.TraceError, match="out="):
        bad(xa)


def test_tracing_state_is_per_thread(backend):
    """While one thread traces (its function blocked half way), another thread's
    calls run as calls: cufuse.exp on an array computes, a scalars-only
    cufuse.where is rejected as a call, and neither joins the first trace."""
    import threading
    x, y, xa, ya = _two_inputs(backend, F32, 910)
    inside, release = threading.Event(), threading.Event()

    def slow(a, b):
        t = a * b
        inside.set()
        assert release.wait(30)
        return t + 1

    f = cufuse.fuse(slow)
    box = {}
    th = threading.Thread(target=lambda: box.setdefault("r", f(xa, ya)))
    th.start()
    try:
        assert inside.wait(30)
        got = cufuse.exp(xa)                     # this thread is not tracing
        assert_close(backend.to_numpy(got), np.exp(x.astype(np.float64)), F32, FUNC_TOL[F32])
        with pytest.raises(TypeError, match="at least one argument must be an array"):
            cufuse.where(True, 1.0, 2.0)
    finally:
        release.set()
        th.join(60)
    assert_close(backend.to_numpy(box["r"]), x.astype(np.float64) * y + 1, F32, FUNC_TOL[F32])


def test_torch_tensors_follow_torch_int_rules(torch_backend):
    """On torch tensors a Python int takes the tensor's type as torch does
    (uint8 + 300 and uint8 < 300 wrap), torch.clip / torch.where bounds must
    fit, negative integer powers raise, int / int and float functions of ints
    give torch's default float; each against torch itself."""
    torch = torch_backend.torch
    x = _int_array(U8)
    xt = torch.from_numpy(x)                           # torch's own results, on the CPU
    xa = torch_backend.asarray(x)
    same = [lambda a: a + 300, lambda a: a < 300, lambda a: a == 1000, lambda a: a * -1, lambda a: a > -1,
            lambda a: a / 2]
    for fn, tfn in [(f, f) for f in same] + [(cufuse.exp, torch.exp), (cufuse.sqrt, torch.sqrt)]:
        want = tfn(xt)
        got = cufuse.fuse(fn)(xa)
        assert got.dtype == want.dtype, (got.dtype, want.dtype)
        np.testing.assert_allclose(got.cpu().numpy(), want.numpy(), rtol=1e-5)
    for fn in (lambda a: torch.clip(a, -1, 300), lambda a: torch.where(a > 10, a, 300)):
        with pytest.raises(RuntimeError, match="overflow"):
            fn(xt)
    for fn in (lambda a: cufuse.clip(a, -1, 300), lambda a: cufuse.where(a > 10, a, 300)):
        with pytest.raises(OverflowError, match="out of bounds for uint8"):
            cufuse.fuse(fn)(xa)
    i = torch_backend.asarray(_int_array(I32))
    with pytest.raises(RuntimeError, match="negative integer powers"):
        torch.from_numpy(_int_array(I32)) ** -1
    with pytest.raises(ValueError, match="negative integer powers"):
        cufuse.fuse(lambda a: a ** -1)(i)
    with pytest.raises(cufuse.TraceError, match="mean"):
        cufuse.fuse(lambda a: a.mean(axis=-1))(i)
    # torch's default dtype decides, also on the fast path after it changes
    f = cufuse.fuse(lambda a: a * 2.5)
    assert f(i).dtype == torch.float32
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert (torch.from_numpy(_int_array(I32)) * 2.5).dtype == torch.float64
        assert f(i).dtype == torch.float64
    finally:
        torch.set_default_dtype(old)
    assert f(i).dtype == torch.float32
