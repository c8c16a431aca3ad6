"""Numerics of the fused elementwise ops on every backend, against a float64 reference.

Each test body runs on the backends numpy, torch_cpu, cupy and torch_cuda
(the last two marked ``cuda``). Views are made in the backend's own kind so
that the kernels see non-contiguous / misaligned memory.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import cufuse

from _reference import (ARITY, DTYPES, OP_NAMES, OPS, assert_close, check_kind, rand,
                        reference, scale_for)

F16, F32, F64 = (np.dtype(t) for t in (np.float16, np.float32, np.float64))
SIZES = [0, 1, 7, 4095, 4097, 1_000_003]
dtype_param = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
op_param = pytest.mark.parametrize("op", OP_NAMES)


def run_checked(backend, op, args, np_inputs, launches, dtype, out=None, like=None):
    """Call ``op`` and check kind, shape, dtype, values and the number of launches.

    ``np_inputs`` are the operand values as NumPy arrays / scalars, taken
    before the call (the call may overwrite an aliased input)."""
    shape = np.broadcast_shapes(*[np.shape(v) for v in np_inputs])
    before = len(launches)
    res = OPS[op](*args) if out is None else OPS[op](*args, out=out)
    if out is not None:
        assert res is out
    check_kind(backend, res, shape, dtype, like=like)
    got = backend.to_numpy(res)
    assert_close(got, reference(op, np_inputs, dtype), dtype)
    size = math.prod(shape)
    # GPU kinds run exactly one kernel (none when empty); NumPy / torch CPU run none.
    assert len(launches) - before == (1 if backend.gpu and size else 0)
    return got


def random_operands(backend, op, dtype, shapes, seed):
    """Backend arrays (contiguous) for ``shapes``, and their NumPy values."""
    np_in = [rand(s, dtype, seed + 7 * k, scale_for(op)) for k, s in enumerate(shapes)]
    return [backend.asarray(a) for a in np_in], np_in


# ----------------------------------------------------------------------- sizes
@op_param
@dtype_param
@pytest.mark.parametrize("n", SIZES)
def test_sizes(backend, op, dtype, n, launches):
    args, np_in = random_operands(backend, op, dtype, [(n,)] * ARITY[op], seed=n)
    run_checked(backend, op, args, np_in, launches, dtype, like=args[0])


# ----------------------------------------------------------------------- views
VIEWS = ["transposed", "transposed_first", "permuted_3d", "step", "step_2d", "offset",
         "offset_first", "sliced_2d", "negative_step"]


def _permute(backend, x, axes):
    return x.permute(*axes) if backend.is_torch else x.transpose(axes)


def make_view(backend, view, k, dtype, seed, scale):
    """Operand ``k`` for the layout ``view``, made in the backend's own kind."""
    def dev(shape):
        return backend.asarray(rand(shape, dtype, seed, scale))

    if view == "transposed":                    # (33, 65), strides (1, 33)
        return dev((65, 33)).T
    if view == "transposed_first":              # only the first operand transposed
        return dev((65, 33)).T if k == 0 else dev((33, 65))
    if view == "permuted_3d":                   # (6, 4, 5) from (4, 5, 6)
        return _permute(backend, dev((4, 5, 6)), (2, 0, 1))
    if view == "step":                          # 1-D, stride 2
        return dev((2 * 4097,))[::2]
    if view == "step_2d":
        return dev((30, 50))[::3, ::2]
    if view == "offset":                        # contiguous, misaligned for 16-byte loads
        return dev((4097 + 1,))[1:]
    if view == "offset_first":                  # one misaligned pointer among aligned ones
        return dev((4097 + 1,))[1:] if k == 0 else dev((4097,))
    if view == "sliced_2d":                     # rows not adjacent
        return dev((40, 70))[:, 3:67]
    if view == "negative_step":
        return dev((4097,))[::-1]
    raise AssertionError(view)


@op_param
@dtype_param
@pytest.mark.parametrize("view", VIEWS)
def test_views(backend, op, dtype, view, launches):
    if view == "negative_step" and not backend.negative_strides:
        pytest.skip("torch tensors have no negative strides")
    args = [make_view(backend, view, k, dtype, seed=100 + k, scale=scale_for(op)) for k in range(ARITY[op])]
    np_in = [backend.to_numpy(a) for a in args]
    run_checked(backend, op, args, np_in, launches, dtype)


MANY_DIMS = ["reversed_9d", "broadcast_10d"]


@op_param
@pytest.mark.parametrize("layout", MANY_DIMS)
def test_many_dims(backend, op, layout, launches):
    """Layouts that stay more than 8-D after merging contiguous dims (the
    strided kernel's Layout holds 8) still give NumPy's answer; per
    kernels/elementwise.cuh, 'more falls back to a copy'."""
    sc = scale_for(op)
    if layout == "reversed_9d":   # every dim's stride differs: nothing merges
        args = [_permute(backend, backend.asarray(rand((2,) * 9, F32, 1300 + k, sc)), tuple(range(8, -1, -1)))
                for k in range(ARITY[op])]
    else:                         # the second operand broadcasts along every other dim
        shapes = [(2,) * 10, (2, 1) * 5] + [(2,) * 10] * (ARITY[op] - 2)
        args = [backend.asarray(rand(s, F32, 1310 + k, sc)) for k, s in enumerate(shapes)]
    np_in = [backend.to_numpy(a) for a in args]
    run_checked(backend, op, args, np_in, launches, F32)


# ------------------------------------------------------------------- broadcast
# An operand is a shape (an array), or "float" / "int" (Python scalar), or
# "npscalar" (a NumPy scalar of the test dtype).
BROADCAST_2 = [
    [(4, 5), (5,)],
    [(4, 5), (1, 5)],
    [(3, 1), (1, 4)],
    [(4, 5), ()],
    [(), (4, 5)],
    [(4, 5), "float"],
    ["float", (4, 5)],
    [(4, 5), "int"],
    [(4, 5), "npscalar"],
    ["npscalar", (3, 1)],
    [(2, 1, 3, 1), (1, 4, 1, 5)],
    [(4097, 1), (7,)],
    [(), ()],
    [(), "float"],
]
BROADCAST_3 = [
    [(4, 5), (5,), ()],
    [(3, 1), (1, 4), "float"],
    ["int", (4, 5), (4, 1)],
    [(4, 5), "npscalar", "float"],
    [(2, 1, 3), (4, 1), (3,)],
    [(4097, 1), (1, 7), (4097, 7)],
    [(), (), ()],
]
_SCALARS = {"float": -0.75, "int": 2}


def _operand(backend, spec, dtype, seed, scale):
    """(backend operand, NumPy value) for a broadcast spec."""
    if spec in _SCALARS:
        return _SCALARS[spec], _SCALARS[spec]
    if spec == "npscalar":
        s = dtype.type(0.625)
        return s, s
    a = rand(spec, dtype, seed, scale)
    return backend.asarray(a), a


def _broadcast_cases():
    for op in OP_NAMES:
        for case in (BROADCAST_3 if ARITY[op] == 3 else BROADCAST_2):
            yield pytest.param(op, case, id=f"{op}-" + "-".join(map(str, case)).replace(" ", ""))


@dtype_param
@pytest.mark.parametrize("op, case", list(_broadcast_cases()))
def test_broadcast(backend, op, case, dtype, launches):
    pairs = [_operand(backend, spec, dtype, 200 + k, scale_for(op)) for k, spec in enumerate(case)]
    args = [p[0] for p in pairs]
    np_in = [p[1] for p in pairs]
    run_checked(backend, op, args, np_in, launches, dtype)


# ------------------------------------------------------------------- promotion
ARRAY_PROMOTIONS = [
    (F16, F32), (F32, F16), (F16, F64), (F64, F16), (F32, F64), (F64, F32),
]
ARRAY_PROMOTIONS_3 = [(F16, F16, F32), (F16, F32, F64), (F64, F32, F16), (F32, F16, F16)]


def _promotion_cases():
    for op in OP_NAMES:
        for dts in (ARRAY_PROMOTIONS_3 if ARITY[op] == 3 else ARRAY_PROMOTIONS):
            yield pytest.param(op, dts, id=f"{op}-" + "-".join(d.name for d in dts))


@pytest.mark.parametrize("op, dtypes", list(_promotion_cases()))
def test_mixed_array_dtypes_promote(backend, op, dtypes, launches):
    np_in = [rand((3, 257), d, 300 + k, scale_for(op)) for k, d in enumerate(dtypes)]
    args = [backend.asarray(a) for a in np_in]
    expected = np.result_type(*dtypes)
    assert expected == max(dtypes, key=lambda d: d.itemsize)  # the rule, spelled out
    run_checked(backend, op, args, np_in, launches, expected)


def test_float16_plus_float32_is_float32(backend):
    a16, a32 = rand((5,), F16, 1), rand((5,), F32, 2)
    res = OPS["add_relu"](backend.asarray(a16), backend.asarray(a32))
    check_kind(backend, res, (5,), F32)


# (array dtype, scalar, result dtype): Python scalars are weak, NumPy scalars are not (NumPy 2).
# torch tensors follow torch's rules: any number keeps the tensor's float type.
SCALAR_PROMOTIONS = [
    (F16, 2.5, F16),
    (F16, 3, F16),
    (F32, -1.25, F32),
    (F16, np.float32(1.5), F32),
    (F32, np.float64(1.5), F64),
    (F32, np.float16(0.5), F32),
    (F64, np.float16(0.5), F64),
    (F16, np.int64(3), F64),
]


@op_param
@pytest.mark.parametrize("adt, scalar, expected", SCALAR_PROMOTIONS,
                         ids=[f"{a.name}-{type(s).__name__}-{e.name}" for a, s, e in SCALAR_PROMOTIONS])
def test_scalar_promotion(backend, op, adt, scalar, expected, launches):
    a = rand((4, 33), adt, 400, scale_for(op))
    assert np.result_type(a, scalar) == expected
    if backend.is_torch:
        expected = adt
        torch = backend.torch
        assert (torch.from_numpy(a) * scalar).dtype == torch.from_numpy(a).dtype   # torch itself
    np_in = [a, scalar] + [scalar] * (ARITY[op] - 2)
    args = [backend.asarray(a)] + np_in[1:]
    run_checked(backend, op, args, np_in, launches, expected)


@op_param
def test_torch_zero_dim_tensors_do_not_widen(op):
    """torch's rule: a zero-dim float64 tensor beside a float32 tensor gives float32."""
    torch = pytest.importorskip("torch")
    devices = ["cpu"] + (["cuda"] if cufuse.CUDA_AVAILABLE and torch.cuda.is_available() else [])
    a = rand((4, 33), F32, 401, scale_for(op))
    for dev in devices:
        t = torch.from_numpy(a).to(dev)
        z = torch.tensor(0.75, dtype=torch.float64, device=dev)
        args = [t, z] + [z] * (ARITY[op] - 2)
        assert (t * z).dtype == torch.float32                      # torch itself
        res = OPS[op](*args)
        assert isinstance(res, torch.Tensor) and res.dtype == torch.float32 and res.device == t.device
        want = reference(op, [a.astype(np.float64)] + [np.float64(0.75)] * (ARITY[op] - 1), F64)
        np.testing.assert_allclose(res.cpu().numpy(), want, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------- NaN and inf
SPECIALS = [np.nan, np.inf, -np.inf, 0.0, 0.5, -0.5, 3.0, -3.0, 30.0, 50.0, 400.0]


@op_param
@dtype_param
def test_nan_inf_propagate(backend, op, dtype, launches):
    """Every combination of special values: NaN, +-inf, overflow of exp and of
    float16, tanh(+-inf) = +-1, inf - inf = NaN, inf * 0 = NaN."""
    grids = np.meshgrid(*[np.array(SPECIALS)] * ARITY[op], indexing="ij")
    np_in = [g.reshape(-1).astype(dtype) for g in grids]
    args = [backend.asarray(a) for a in np_in]
    got = run_checked(backend, op, args, np_in, launches, dtype)
    assert np.isnan(got).any()
    assert np.isinf(got).any() or op == "mul_tanh"


def test_nan_through_add_relu(backend):
    a = np.full(9, np.nan, dtype=F32)
    b = rand((9,), F32, 5)
    b[:4] = -np.abs(b[:4]) - 1.0  # a negative sum must not turn NaN into 0
    got = backend.to_numpy(OPS["add_relu"](backend.asarray(a), backend.asarray(b)))
    assert np.isnan(reference("add_relu", [a, b], F32)).all()
    assert np.isnan(got).all()


# ------------------------------------------------------------------------ out=
OUT_LAYOUTS = ["contiguous", "strided", "transposed", "offset"]


@op_param
@dtype_param
@pytest.mark.parametrize("layout", OUT_LAYOUTS)
def test_out_every_element_written(backend, op, dtype, layout, launches):
    """``out`` (a view into a NaN-poisoned buffer) receives every element and
    nothing outside the view is touched."""
    if layout == "offset":
        shape = (4097,)
        big = backend.full((4097 + 1,), np.nan, dtype)
        out, outside = big[1:], (slice(0, 1),)
    elif layout == "strided":
        shape = (37, 41)
        big = backend.full((37, 82), np.nan, dtype)
        out, outside = big[:, ::2], (slice(None), slice(1, None, 2))
    elif layout == "transposed":
        shape = (37, 41)
        big = backend.full((41, 37), np.nan, dtype)
        out, outside = big.T, None
    else:
        shape = (37, 41)
        big = out = backend.full(shape, np.nan, dtype)
        outside = None
    args, np_in = random_operands(backend, op, dtype, [shape] * ARITY[op], seed=500)
    got = run_checked(backend, op, args, np_in, launches, dtype, out=out)
    assert not np.isnan(got).any()
    if outside is not None:
        assert np.isnan(backend.to_numpy(big)[outside]).all()


@op_param
@dtype_param
def test_out_with_broadcast_and_scalar(backend, op, dtype, launches):
    np_in = [rand((6, 1), dtype, 600, scale_for(op)), rand((9,), dtype, 601, scale_for(op))]
    np_in += [1.5] * (ARITY[op] - 2)
    args = [backend.asarray(np_in[0]), backend.asarray(np_in[1])] + np_in[2:]
    out = backend.full((6, 9), np.nan, dtype)
    run_checked(backend, op, args, np_in, launches, dtype, out=out)


def test_out_mixed_dtypes(backend, launches):
    a, b = rand((64,), F16, 700), rand((64,), F32, 701)
    out = backend.full((64,), np.nan, F32)
    run_checked(backend, "add_relu", [backend.asarray(a), backend.asarray(b)], [a, b], launches, F32, out=out)


ALIASES = ["first", "second", "last", "all", "transposed", "offset"]


@op_param
@dtype_param
@pytest.mark.parametrize("alias", ALIASES)
def test_out_aliases_input(backend, op, dtype, alias, launches):
    """out is exactly one of the inputs (same memory, same strides)."""
    arity = ARITY[op]
    sc = scale_for(op)
    if alias == "transposed":
        args = [backend.asarray(rand((45, 31), dtype, 800, sc)).T] + \
               [backend.asarray(rand((31, 45), dtype, 801 + k, sc)) for k in range(arity - 1)]
        target = 0
    elif alias == "offset":
        args = [backend.asarray(rand((4098,), dtype, 810, sc))[1:]] + \
               [backend.asarray(rand((4097,), dtype, 811 + k, sc)) for k in range(arity - 1)]
        target = 0
    elif alias == "all":
        x = backend.asarray(rand((1000,), dtype, 820, sc))
        args, target = [x] * arity, 0
    else:
        args, _ = random_operands(backend, op, dtype, [(1000,)] * arity, seed=830)
        target = {"first": 0, "second": 1, "last": arity - 1}[alias]
    np_in = [backend.to_numpy(a) for a in args]
    run_checked(backend, op, args, np_in, launches, dtype, out=args[target])


OVERLAPS = ["shift_forward", "shift_backward", "transpose", "broadcast_row", "reversed"]


@op_param
@dtype_param
@pytest.mark.parametrize("overlap", OVERLAPS)
def test_out_partial_overlap(backend, op, dtype, overlap, launches):
    """out overlaps an input other than element for element: the result is as
    if computed into a temporary (NumPy semantics)."""
    if overlap == "reversed" and not backend.negative_strides:
        pytest.skip("torch tensors have no negative strides")
    sc = scale_for(op)
    n = 4097
    untouched = None
    if overlap in ("shift_forward", "shift_backward", "reversed"):
        buf = backend.asarray(rand((n + 1,), dtype, 900, sc))
        if overlap == "shift_forward":
            x, out, untouched = buf[:-1], buf[1:], 0
        elif overlap == "shift_backward":
            x, out, untouched = buf[1:], buf[:-1], n
        else:
            x, out = buf[:n], buf[:n][::-1]
        shape = (n,)
        first = [x]
    elif overlap == "transpose":
        m = backend.asarray(rand((33, 33), dtype, 901, sc))
        shape = (33, 33)
        first, out = [m], m.T
    else:  # broadcast_row: the second operand is row 0 of out, broadcast to every row
        m = backend.asarray(rand((6, 7), dtype, 902, sc))
        shape = (6, 7)
        first, out = [m, m[:1]], m
    rest = [backend.asarray(rand(shape, dtype, 910 + k, sc)) for k in range(ARITY[op] - len(first))]
    args = first + rest
    np_in = [backend.to_numpy(a) for a in args]
    buf_before = backend.to_numpy(buf) if untouched is not None else None
    run_checked(backend, op, args, np_in, launches, dtype, out=out)
    if untouched is not None:
        assert backend.to_numpy(buf)[untouched] == buf_before[untouched]


# ----------------------------------------------------------------------- empty
EMPTY_2 = [[(0,), (0,)], [(0, 3), (3,)], [(2, 0), (1, 0)], [(0,), "float"], [(5, 0), ()]]


def _empty_case(backend, op, case):
    case = case + [(1,) if isinstance(case[1], tuple) else "float"] * (ARITY[op] - 2)
    pairs = [_operand(backend, spec, F32, 1000 + k, 1.0) for k, spec in enumerate(case)]
    shape = np.broadcast_shapes(*[np.shape(p[1]) for p in pairs])
    assert math.prod(shape) == 0
    return [p[0] for p in pairs], [p[1] for p in pairs], shape


@op_param
@pytest.mark.parametrize("case", EMPTY_2, ids=lambda c: "-".join(map(str, c)).replace(" ", ""))
def test_empty(backend, op, case, launches):
    args, np_in, shape = _empty_case(backend, op, case)
    run_checked(backend, op, args, np_in, launches, F32)
    assert launches == []


@pytest.mark.parametrize("case", EMPTY_2, ids=lambda c: "-".join(map(str, c)).replace(" ", ""))
def test_empty_with_out(backend, case, launches):
    """A freshly made empty out (NumPy gives zero-size arrays all-0 strides) is accepted."""
    args, np_in, shape = _empty_case(backend, "add_relu", case)
    out = backend.full(shape, 0, F32)
    run_checked(backend, "add_relu", args, np_in, launches, F32, out=out)
    assert launches == []


# ------------------------------------------------------- more than 2**31 elements
@pytest.mark.slow
@pytest.mark.cuda
@pytest.mark.parametrize("second", ["array", "scalar"])
def test_more_than_2_31_elements(second, launches):
    """float16, 2**31 + 17 elements (~4.3 GB per array): sampled positions,
    the first/last elements and those around 2**31 (catches 32-bit indices)."""
    import cupy as cp
    n = 2**31 + 17
    period = 65537  # values repeat with this period: cheap to build, index-dependent
    tiles = [rand((period,), F16, 1100 + k) for k in range(2)]

    def periodic(tile):
        m = -(-n // period)
        big = cp.empty((m, period), dtype=F16)
        big[...] = cp.asarray(tile)
        return big.reshape(-1)[:n]

    rng = np.random.default_rng(1102)
    idx = np.unique(np.concatenate([
        np.arange(2048), np.arange(n - 2048, n), np.arange(2**31 - 1024, 2**31 + 17),
        rng.integers(0, n, 4096)]))
    try:
        a = periodic(tiles[0])
        b = periodic(tiles[1]) if second == "array" else 0.75
        res = OPS["add_relu"](a, b)
        assert res.shape == (n,) and res.dtype == F16 and len(launches) == 1
        got = res[cp.asarray(idx)].get()
        bvals = tiles[1][idx % period] if second == "array" else 0.75
        assert_close(got, reference("add_relu", [tiles[0][idx % period], bvals], F16), F16)
    finally:
        a = b = res = None
        cp.get_default_memory_pool().free_all_blocks()


@pytest.mark.slow
@pytest.mark.cuda
def test_more_than_2_31_elements_strided(launches):
    """A broadcast (strided-kernel) result of 32769 x 65537 > 2**31 float16 elements."""
    import cupy as cp
    rows, cols = 32769, 65537
    assert rows * cols > 2**31
    col = rand((rows, 1), F16, 1200)
    row = rand((1, cols), F16, 1201)
    rng = np.random.default_rng(1202)
    n = rows * cols
    idx = np.unique(np.concatenate([
        np.arange(2048), np.arange(n - 2048, n), np.arange(2**31 - 1024, 2**31 + 1024),
        rng.integers(0, n, 4096)]))
    try:
        res = OPS["add_relu"](cp.asarray(col), cp.asarray(row))
        assert res.shape == (rows, cols) and len(launches) == 1
        got = res.reshape(-1)[cp.asarray(idx)].get()
        ref = reference("add_relu", [col[idx // cols, 0], row[0, idx % cols]], F16)
        assert_close(got, ref, F16)
    finally:
        res = None
        cp.get_default_memory_pool().free_all_blocks()


@pytest.mark.parametrize("shapes", [((3,), (3,), (2, 3)), ((0,), (0,), (0, 0)), ((1,), (4, 1), (2, 4, 5))],
                         ids=["2x3", "zero", "3d"])
def test_later_operand_broadcasts_the_result_larger(backend, shapes, launches):
    """fma(q, k, v) where v broadcasts q * k to a larger shape (found by the
    fuzz suite: the NumPy path wrote q * k + v into q * k's own array)."""
    np_in = [rand(s, F32, 90 + k) for k, s in enumerate(shapes)]
    args = [backend.asarray(a) for a in np_in]
    run_checked(backend, "fma", args, np_in, launches, F32)


def test_torch_zero_dim_wider_operand_is_rounded_first():
    """float16 tensor + zero-dim float32 tensor is float16 (torch's rule), and
    the float32 value is rounded to float16 before the add on the GPU and the
    CPU path alike, as torch does: the results equal torch's own."""
    torch = pytest.importorskip("torch")
    devices = ["cpu"] + (["cuda"] if cufuse.CUDA_AVAILABLE and torch.cuda.is_available() else [])
    for dev in devices:
        a = torch.from_numpy(rand((257,), F16, 7)).to(dev)
        b = torch.tensor(1.1720243, dtype=torch.float32, device=dev)
        got = cufuse.add_relu(a, b)
        assert got.dtype == torch.float16
        torch.testing.assert_close(got, torch.relu(a + b), rtol=0, atol=0)
