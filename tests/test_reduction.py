"""cufuse.sum_squared and cufuse.mean_abs on every backend.

sum_squared(x, axis=-1, keepdims=False, dtype=None, *, out=None) = sum(x*x)
mean_abs(x, axis=-1, keepdims=False, dtype=None, *, out=None)    = mean(|x|)

Checked against float64 NumPy references (tests/_reference_norm.py) rounded
to the result dtype, within the per-dtype tolerances stated once there
(REDUCE_TOL / REDUCE_TOL_LONG): float16 2e-3 (float32 accumulation, one
rounding), float32 2e-5 (1e-4 beyond 4097 reduced elements), float64 1e-12.
The sums are of non-negative terms, so the checks are relative (atol 0
except for float16 subnormals). A float64 result (float64 x or dtype=float64)
must be accumulated in float64: it is held to 1e-12, which a float32
accumulation misses by orders of magnitude.
"""
from __future__ import annotations

import numpy as np
import pytest

import cufuse
from cufuse import _driver as D
from cufuse import _runtime as R
from cufuse.ops import reduction as RD

from _reference import DTYPES, Backend, check_kind, cpu_runs_one, gpu_count, rand
from _reference_norm import (F16, F32, F64, REDUCE_REF, check, raises_each, reduce_shape, reduced_length,
                             result_dtype, tol)

OP_NAMES = ["sum_squared", "mean_abs"]
op_param = pytest.mark.parametrize("op", OP_NAMES)
dtype_param = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
OTHER_KIND = {"numpy": "torch_cpu", "torch_cpu": "numpy", "cupy": "numpy", "torch_cuda": "cupy"}
ROW_LENGTHS = [1, 2, 3, 7, 31, 32, 33, 127, 129, 768, 1000, 1023, 1024, 4097]
_UNSET = object()


def fn(op):
    return getattr(cufuse, op)


def np_dtype(d):
    """A dtype argument (NumPy dtype / type / string / torch dtype / None) as a NumPy dtype or None."""
    if d is None:
        return None
    if type(d).__module__.startswith("torch"):
        import torch
        return {torch.float16: F16, torch.float32: F32, torch.float64: F64}[d]
    return np.dtype(d)


def reduce(backend, op, x, nx, axis=_UNSET, keepdims=_UNSET, dtype=_UNSET, out=None, tolerance=None):
    """Run ``op`` on ``x`` (backend kind; ``nx`` its NumPy values), check the
    result's kind, shape, dtype and values; return the result as NumPy."""
    kw = {}
    if axis is not _UNSET:
        kw["axis"] = axis
    if keepdims is not _UNSET:
        kw["keepdims"] = keepdims
    if dtype is not _UNSET:
        kw["dtype"] = dtype
    if out is not None:
        kw["out"] = out
    res = fn(op)(x, **kw)
    if out is not None:
        assert res is out
    axis = -1 if axis is _UNSET else axis
    keepdims = False if keepdims is _UNSET else keepdims
    rdt = result_dtype(nx.dtype, np_dtype(None if dtype is _UNSET else dtype))
    shape = reduce_shape(nx.shape, axis, keepdims)
    check_kind(backend, res, shape, rdt, like=x)
    got = backend.to_numpy(res)
    ref = REDUCE_REF[op](nx, axis, keepdims)
    check(op, got, ref, rdt, reduced_length(nx.shape, axis), tolerance)
    return got


def permute(backend, a, axes):
    return a.permute(*axes) if backend.is_torch else a.transpose(*axes)


def broadcast_to(backend, a, shape):
    if backend.is_torch:
        return a.expand(*shape)
    if backend.name == "cupy":
        return backend.cp.broadcast_to(a, shape)
    return np.broadcast_to(a, shape)


# ====================================================================== rows
@op_param
@dtype_param
@pytest.mark.parametrize("n", ROW_LENGTHS)
def test_rows(backend, op, dtype, n):
    """Last axis (the contiguous fast path) of a (3, 5, n) array."""
    x = rand((3, 5, n), dtype, 100 + n)
    reduce(backend, op, backend.asarray(x), x)


@op_param
@dtype_param
@pytest.mark.parametrize("n", [1, 2, 7, 32, 33, 1023, 4097])
def test_first_axis(backend, op, dtype, n):
    """axis=0 of a C-contiguous (n, m) array (the first-axis fast path)."""
    for m in [1, 5, 130]:
        x = rand((n, m), dtype, 200 + n + m)
        reduce(backend, op, backend.asarray(x), x, axis=0)
        reduce(backend, op, backend.asarray(x), x, axis=-2, keepdims=True)


@op_param
@pytest.mark.parametrize("lead", [(), (0,), (1,), (3, 5), (2, 3, 4)], ids=str)
@pytest.mark.parametrize("n", [1, 33, 1024])
def test_leading_shapes(backend, op, lead, n):
    x = rand(lead + (n,), F32, 300 + n)
    got = reduce(backend, op, backend.asarray(x), x)
    assert got.shape == lead


@op_param
@pytest.mark.parametrize("n", [65536, 262144, 300000])
def test_long_rows(backend, op, n):
    x = rand((2, n), F32, 400 + n)
    reduce(backend, op, backend.asarray(x), x)


@op_param
@dtype_param
@pytest.mark.parametrize("rows, n", [(7, 2049), (5, 4096), (3, 8195), (2, 300001)], ids=str)
@pytest.mark.parametrize("offset", [0, 1, 3, 7])
def test_long_rows_misaligned(backend, op, dtype, rows, n, offset):
    """Rows around and above 512 16-byte packs (from there one block per row,
    and rows split across blocks when they are few), starting `offset`
    elements into the buffer and n + 1 elements apart, so that rows differ
    in their partial head and tail packs."""
    flat = rand((offset + rows * (n + 1),), dtype, 450 + n + offset, 0.25)
    x = flat[offset:].reshape(rows, n + 1)[:, :n]
    reduce(backend, op, backend.asarray(flat)[offset:].reshape(rows, n + 1)[:, :n], x)


@op_param
@dtype_param
@pytest.mark.parametrize("case", ["whole", "split", "offset", "odd_stride", "odd_length"])
def test_long_rows_whole_kernel(backend, op, dtype, case, launches):
    """Rows of at least 512 packs that start on 16-byte boundaries and hold
    whole packs take the block kernel without head and tail packs
    (reduce_rows_block<..., true>); a row one element into the buffer, rows
    an odd number of elements apart, or a length that is not a whole number
    of packs take the general one. "split": 3 rows of 2**17 packs, each split
    over several blocks whose partial sums a second launch adds."""
    v = 16 // np.dtype(dtype).itemsize
    rows, n = (3, v << 17) if case == "split" else (5, 8000 if v == 8 else 4000)
    if case == "odd_length":
        n += 1
    pitch = n + (1 if case == "odd_stride" else 0)
    lead = 1 if case == "offset" else 0
    flat = rand((lead + rows * pitch,), dtype, 490 + n + lead + pitch, 0.25)
    x = flat[lead:].reshape(rows, pitch)[:, :n]
    reduce(backend, op, backend.asarray(flat)[lead:].reshape(rows, pitch)[:, :n], x)
    if not backend.gpu:
        return
    blocks = [ln for ln in launches if ln.kernel.startswith("reduce_rows_block<")]
    assert blocks, launches
    assert blocks[0].kernel.endswith(", true>") == (case in ("whole", "split")), blocks[0].kernel
    if case == "split":
        assert blocks[0].grid[1] > 1 and len(launches) == 2, launches


@op_param
def test_long_row_last_split_only_tail(backend, op):
    """One float16 row split so that its last split holds no whole pack, only
    the partial tail pack (1 x 2093049 one element into the buffer)."""
    flat = rand((1 + 2093049,), F16, 460, 0.1)
    reduce(backend, op, backend.asarray(flat)[1:].reshape(1, -1), flat[1:].reshape(1, -1))


@pytest.mark.parametrize("dt", [F16, F32, F64], ids=str)
@pytest.mark.parametrize("rows, cols, offset", [(1, 46395, 33), (3, 300001, 1), (2, 8195, 0)], ids=str)
def test_split_row_partials_are_whole_packs(monkeypatch, dt, rows, cols, offset):
    """Split rows' partial sums go to a temporary rounded up to 16 bytes: the
    second pass reads its last pack whole, past the sums, where the first
    pass's last block writes zeros (compute-sanitizer initcheck, issue 37:
    scripts/sanitize_all.py's sum_squared(axis=(0, 1)) of 45 x 1031 one
    element in, 11 float32 partial sums). Host side, on an H200's 132 SMs."""
    class Fn:
        ptr = 0

    monkeypatch.setattr(R, "sm_count", lambda dev: 132)
    acc = RD._acc(dt, dt)
    b = D.RecipeBuilder("cupy.ndarray", 0, 1, 1)
    RD._reduce_rows(b, (Fn(), Fn(), Fn()), Fn(), 4096 + offset * dt.itemsize, rows, cols, cols, dt, acc, dt, 1.0,
                    0)
    first, second = [st for st in b.steps if st[0] == "launch"]
    splits = first[2][1]
    assert splits > 1 and second[5][3:5] == (rows, splits)
    assert b.temps == [-(-rows * splits * acc.itemsize // 16) * 16]


@op_param
@pytest.mark.parametrize("n", [65536, 131072])
def test_long_columns(backend, op, n):
    x = rand((n, 3), F32, 410 + n)
    reduce(backend, op, backend.asarray(x), x, axis=0)


# Column reductions whose rows are split into chunks (too few tiles of
# columns to fill the GPU): each chunk's block writes its sums, and a second
# launch adds them up in a fixed order (kernels/reduction.cu). Cases: many chunks of one tile;
# columns that are not a whole number of packs (one column per thread);
# several slabs (the middle axes of a 3-D / 4-D array); a base one element
# past a 16-byte boundary (one column per thread).
# The first five split the rows in more chunks than one launch adds up
# (cufuse/ops/reduction.py _COL_ONE_LAUNCH_SPLITS: a second launch does), the
# last three in fewer (for float32: the last block of each tile does; with
# several tiles, an outer dimension, misaligned columns).
SPLIT_COLUMN_CASES = [((20000, 24), (0,), 0), ((6001, 257), (0,), 0), ((3, 4000, 100), (1,), 0),
                      ((2, 3, 5000, 8), (1, 2), 0), ((4099, 64), (0,), 1),
                      ((600, 8192), (0,), 0), ((8, 400, 2048), (1,), 0), ((601, 4099), (0,), 1)]


def split_columns_case(backend, dtype, shape, offset, seed):
    """(x in the backend, its NumPy values): C-contiguous, ``offset`` elements into its buffer."""
    n = int(np.prod(shape))
    flat = rand((offset + n,), dtype, seed, 0.25)
    return backend.asarray(flat)[offset:].reshape(shape), flat[offset:].reshape(shape)


@op_param
@dtype_param
@pytest.mark.parametrize("shape, axis, offset", SPLIT_COLUMN_CASES, ids=str)
def test_split_columns(backend, op, dtype, shape, axis, offset):
    cpu_runs_one(backend, op == OP_NAMES[0] and dtype == F32)  # (every shape, axis and offset)
    x, nx = split_columns_case(backend, dtype, shape, offset, 470 + sum(shape))
    reduce(backend, op, x, nx, axis=axis)


@op_param
@pytest.mark.parametrize("dtype", [F32, F16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape, axis, offset", SPLIT_COLUMN_CASES, ids=str)
def test_split_columns_same_bits(backend, op, dtype, shape, axis, offset, launches):
    """The rows are split (the first launch has several chunks), and the
    result has the same bits on every run, whatever order the blocks ran in
    (the chunks added up by a second launch, or by each tile's last block).
    float16 takes reduce_cols_deep, with fewer blocks (and chunks)."""
    if not backend.gpu:
        pytest.skip("GPU backends only")
    x, nx = split_columns_case(backend, dtype, shape, offset, 480 + sum(shape))
    first = reduce(backend, op, x, nx, axis=axis)
    chunks = launches[0].grid[1]
    assert ("reduce_cols_deep" in launches[0].kernel) == (dtype == F16), launches
    if chunks == 1:  # float16's fewer blocks: a case with enough tiles needs no split
        assert dtype == F16 and len(launches) == 1, launches
    else:
        assert len(launches) == (1 if chunks <= RD._COL_ONE_LAUNCH_SPLITS else 2), launches
    if dtype == F32 and R.sm_count(0) <= 132:  # as many chunks as the list's comment says (more SMs: more chunks)
        assert (chunks <= RD._COL_ONE_LAUNCH_SPLITS) == (SPLIT_COLUMN_CASES.index((shape, axis, offset)) >= 5)
    for _ in range(5):
        assert np.array_equal(backend.to_numpy(fn(op)(x, axis=axis)), first)


@op_param
@dtype_param
def test_long_row_other_dtypes(backend, op, dtype):
    x = rand((1, 262144), dtype, 420, 0.25)   # float16: sum_squared ~ 16384, no overflow
    reduce(backend, op, backend.asarray(x), x)


@op_param
@dtype_param
def test_all_axes_large(backend, op, dtype):
    """axis=None over a 1M-element array (float16 sum_squared overflows to inf
    in the result dtype, as the rounded reference does)."""
    x = rand((1024, 1024), dtype, 430)
    reduce(backend, op, backend.asarray(x), x, axis=None)


@pytest.mark.slow
@op_param
@pytest.mark.parametrize("axis", [-1, None, 0])
def test_very_large(backend, op, axis):
    cpu_runs_one(backend, axis is None)
    x = rand((40, 300000), F32, 440)        # 1.2e7 elements
    reduce(backend, op, backend.asarray(x), x, axis=axis)


# ====================================================================== axes
AXES = [-1, 0, 1, 2, -2, (1, 2), (0, 2), (0, 3), (1, 3), (2, 0), (-1, -2), (0, 1, 2, 3), (3,), None, ()]


@op_param
@dtype_param
@pytest.mark.parametrize("axis", AXES, ids=repr)
def test_axes(backend, op, dtype, axis):
    x = rand((5, 6, 7, 8), dtype, 500)
    for keepdims in (False, True):
        reduce(backend, op, backend.asarray(x), x, axis=axis, keepdims=keepdims)


@op_param
@pytest.mark.parametrize("axis", [1, (0, 2), (1, 2), None])
def test_axes_big_middle(backend, op, axis):
    """A middle axis long enough to need more than one block (or thread) per output."""
    x = rand((3, 4099, 5), F32, 510)
    reduce(backend, op, backend.asarray(x), x, axis=axis)


def test_axis_none_is_every_axis(backend):
    x = rand((4, 9, 11), F64, 520)
    a = backend.to_numpy(cufuse.sum_squared(backend.asarray(x), axis=None))
    b = backend.to_numpy(cufuse.sum_squared(backend.asarray(x), axis=(0, 1, 2)))
    assert a.shape == b.shape == ()
    np.testing.assert_allclose(a, b, rtol=1e-12)
    np.testing.assert_allclose(a, np.sum(x.astype(np.float64) ** 2), rtol=1e-12)


@op_param
@dtype_param
def test_empty_axis_tuple_is_elementwise(backend, op, dtype):
    """axis=() reduces nothing: x*x or |x| elementwise, x's shape."""
    x = rand((7, 129), dtype, 530, 3.0)
    got = reduce(backend, op, backend.asarray(x), x, axis=())
    want = x.astype(np.float64) ** 2 if op == "sum_squared" else np.abs(x.astype(np.float64))
    np.testing.assert_allclose(got.astype(np.float64), want.astype(dtype).astype(np.float64),
                               rtol=tol(op, dtype, 1)[0])


def test_default_axis_is_last(backend):
    x = rand((6, 50), F32, 540)
    reduce(backend, "sum_squared", backend.asarray(x), x)             # axis unset: -1
    got = backend.to_numpy(cufuse.mean_abs(backend.asarray(x)))
    assert got.shape == (6,)


def test_positional_arguments(backend):
    x = rand((6, 7, 8), F32, 541)
    res = cufuse.sum_squared(backend.asarray(x), 1, True, np.float64)
    check_kind(backend, res, (6, 1, 8), F64)
    check("sum_squared", backend.to_numpy(res), np.sum(x.astype(np.float64) ** 2, axis=1, keepdims=True), F64, 7)
    res = cufuse.mean_abs(backend.asarray(x), (0, 2), False, "float16")
    check_kind(backend, res, (7,), F16)
    check("mean_abs", backend.to_numpy(res), np.abs(x.astype(np.float64)).mean(axis=(0, 2)), F16, 48)


# =================================================================== layouts
VIEWS = ["transposed", "step", "step_rows", "offset_flat", "sliced_cols", "permuted_3d", "broadcast_rows",
         "broadcast_cols", "negative_step"]


def make_view(backend, view, dtype, seed):
    def dev(shape):
        return backend.asarray(rand(shape, dtype, seed))

    if view == "transposed":
        return dev((129, 9)).T                           # (9, 129), strides (1, 9)
    if view == "step":
        return dev((9, 2 * 129))[:, ::2]
    if view == "step_rows":
        return dev((18, 129))[::2]
    if view == "offset_flat":                            # contiguous, misaligned by one element
        return dev((1 + 9 * 129,))[1:].reshape(9, 129)
    if view == "sliced_cols":
        return dev((9, 130))[:, 1:]
    if view == "permuted_3d":
        return permute(backend, dev((4, 5, 6)), (2, 0, 1))
    if view == "broadcast_rows":                         # stride 0 on axis 0
        return broadcast_to(backend, dev((129,)), (9, 129))
    if view == "broadcast_cols":                         # stride 0 on the last axis
        return broadcast_to(backend, dev((9, 1)), (9, 129))
    if view == "negative_step":
        if not backend.negative_strides:
            pytest.skip("torch tensors have no negative strides")
        return dev((9, 129))[:, ::-1]
    raise AssertionError(view)


@op_param
@dtype_param
@pytest.mark.parametrize("view", VIEWS)
def test_views(backend, op, dtype, view):
    x = make_view(backend, view, dtype, 600)
    nx = backend.to_numpy(x)
    for axis in (-1, 0, None, (0, 1)):
        reduce(backend, op, x, nx, axis=axis)


@op_param
def test_view_middle_axis_of_permuted(backend, op):
    x = permute(backend, backend.asarray(rand((6, 40, 7), F32, 610)), (1, 2, 0))   # (40, 7, 6)
    nx = backend.to_numpy(x)
    for axis in [1, (0, 2), (0, 1)]:
        reduce(backend, op, x, nx, axis=axis)


def test_inputs_unchanged(backend):
    x0 = rand((5, 333), F32, 620)
    x = backend.asarray(x0)
    cufuse.sum_squared(x, axis=0)
    cufuse.mean_abs(x, axis=None)
    backend.synchronize()
    np.testing.assert_array_equal(backend.to_numpy(x), x0)


# ==================================================================== dtype=
DTYPE_ARGS = [None, F16, F32, F64]


@op_param
@pytest.mark.parametrize("xdt", DTYPES, ids=lambda d: "x_" + d.name)
@pytest.mark.parametrize("dt", DTYPE_ARGS, ids=lambda d: "dtype_" + ("None" if d is None else d.name))
def test_dtype_argument(backend, op, xdt, dt):
    """The result has ``dtype`` (x's when None); a float64 result is held to
    the float64 tolerance, so it must be accumulated in float64."""
    x = rand((6, 1000), xdt, 700, 2.0)
    reduce(backend, op, backend.asarray(x), x, dtype=dt)
    reduce(backend, op, backend.asarray(x), x, axis=0, dtype=dt)


def test_float64_result_is_not_float32_accumulated():
    """The float64 tolerance really rejects a float32 accumulation (the
    dtype=float64 checks above are sensitive)."""
    x = rand((6, 1000), F32, 700, 2.0)
    acc32 = np.sum(x.astype(np.float32) ** 2, axis=-1, dtype=np.float32).astype(np.float64)
    with pytest.raises(AssertionError):
        check("sum_squared", acc32, REDUCE_REF["sum_squared"](x), F64, 1000)


@op_param
@pytest.mark.parametrize("spelling", ["dtype", "type", "str", "torch"])
@pytest.mark.parametrize("target", [F16, F32, F64], ids=lambda d: d.name)
def test_dtype_spellings(backend, op, spelling, target):
    x = rand((4, 300), F32, 710)
    if spelling == "torch":
        torch = pytest.importorskip("torch")
        dt = {F16: torch.float16, F32: torch.float32, F64: torch.float64}[target]
    else:
        dt = {"dtype": target, "type": target.type, "str": target.name}[spelling]
    reduce(backend, op, backend.asarray(x), x, dtype=dt)


def test_float16_accumulates_in_float32(backend):
    """float16 x whose squares / sums overflow float16: the float32
    accumulation gives the finite answer when the result dtype can hold it."""
    x = rand((4, 1024), F16, 720, 300.0)      # |x| up to ~1200: x*x up to ~1.4e6 > 65504
    dx = backend.asarray(x)
    got = reduce(backend, "sum_squared", dx, x, dtype=F32)
    assert np.isfinite(got).all()
    got = reduce(backend, "sum_squared", dx, x, axis=(), dtype=F64)
    assert np.isfinite(got).all()
    got = reduce(backend, "sum_squared", dx, x)                       # float16 result: inf, as rounded
    assert np.isinf(got).all()
    big = np.random.default_rng(721).uniform(-60000, 60000, (4, 1024)).astype(F16)
    big[big == 0] = 1.0
    got = reduce(backend, "mean_abs", backend.asarray(big), big)      # sum ~ 1.6e7, mean ~ 16000
    assert np.isfinite(got).all() and (got > 1000).all()


# ===================================================================== empty
EMPTY = [((3, 0), -1, False), ((3, 0), -1, True), ((0, 4), -1, False), ((0, 4), 0, False),
         ((0, 4), 0, True), ((0,), None, False), ((0,), None, True), ((2, 0, 3), (0, 1), False),
         ((2, 0, 3), 1, True), ((0, 5), (), False), ((4, 0, 2), None, False)]


@op_param
@pytest.mark.parametrize("shape, axis, keepdims", EMPTY, ids=str)
def test_empty(backend, op, shape, axis, keepdims):
    """A reduction over nothing: sum_squared 0, mean_abs NaN (NumPy's mean of nothing)."""
    for dtype in DTYPES:
        x = np.empty(shape, dtype)
        got = reduce(backend, op, backend.asarray(x), x, axis=axis, keepdims=keepdims)
        if got.size and reduced_length(shape, axis) == 0:
            if op == "sum_squared":
                assert (got == 0).all()
            else:
                assert np.isnan(got).all()


@op_param
@pytest.mark.parametrize("shape, axis", [((3, 0), -1), ((0,), None), ((0, 4), 0)], ids=str)
def test_empty_with_out(backend, op, shape, axis):
    x = np.empty(shape, F32)
    rshape = reduce_shape(shape, axis, False)
    out = backend.full(rshape, 7.0, F32)
    got = reduce(backend, op, backend.asarray(x), x, axis=axis, out=out)
    assert not (got == 7.0).any()


# ====================================================================== 0-d
@op_param
@dtype_param
@pytest.mark.parametrize("axis", [None, ()], ids=repr)
@pytest.mark.parametrize("keepdims", [False, True])
def test_zero_d(backend, op, dtype, axis, keepdims):
    x = np.asarray(dtype.type(-1.75))
    got = reduce(backend, op, backend.asarray(x), x, axis=axis, keepdims=keepdims)
    assert got.shape == ()
    assert float(got) == (3.0625 if op == "sum_squared" else 1.75)


@op_param
@pytest.mark.parametrize("axis", [0, -1, (0,)], ids=repr)
def test_zero_d_axis_out_of_range(backend, op, axis, launches):
    x = backend.asarray(np.asarray(np.float32(2.0)))
    with pytest.raises(ValueError):
        fn(op)(x, axis=axis)
    assert launches == []


# ====================================================================== out=
OUT_LAYOUTS = ["contiguous", "strided", "transposed", "offset", "keepdims", "zero_d", "dtype_f64"]


@op_param
@pytest.mark.parametrize("layout", OUT_LAYOUTS)
def test_out(backend, op, layout):
    """out (a view into a NaN-poisoned buffer) gets every element, nothing else is touched."""
    outside, big = None, None
    x = rand((37, 41, 65), F32, 800)
    axis, keepdims, dtype = -1, False, _UNSET
    if layout == "contiguous":
        out = backend.full((37, 41), np.nan, F32)
    elif layout == "strided":
        big = backend.full((37, 82), np.nan, F32)
        out, outside = big[:, ::2], (slice(None), slice(1, None, 2))
    elif layout == "transposed":
        big = backend.full((41, 37), np.nan, F32)
        out = big.T
    elif layout == "offset":
        axis = (0, 1)
        big = backend.full((66,), np.nan, F32)
        out, outside = big[1:], (slice(0, 1),)
    elif layout == "keepdims":
        keepdims = True
        out = backend.full((37, 41, 1), np.nan, F32)
    elif layout == "zero_d":
        axis = None
        out = backend.full((), np.nan, F32)
    else:
        axis, dtype = 0, F64
        out = backend.full((41, 65), np.nan, F64)
    got = reduce(backend, op, backend.asarray(x), x, axis=axis, keepdims=keepdims, dtype=dtype, out=out)
    assert not np.isnan(got).any()
    if outside is not None:
        assert np.isnan(backend.to_numpy(big)[outside]).all()


@op_param
def test_out_wrong_shape(backend, op, launches):
    x = backend.asarray(rand((5, 4), F32, 810))

    def call(case):
        shape, kw = case
        out = backend.full(shape, 7.0, F32)
        try:
            fn(op)(x, out=out, **kw)
        finally:
            assert (backend.to_numpy(out) == 7.0).all()

    raises_each(ValueError, [((4,), {}), ((5, 1), {}), ((5,), {"keepdims": True}), ((1, 5), {}), ((), {}),
                             ((5, 4), {"axis": 0}), ((20,), {"axis": None}), ((4, 5), {"axis": ()})], call)
    assert launches == []


@op_param
def test_out_wrong_dtype(backend, op, launches):
    def call(case):
        xdt, dt, odt = case
        out = backend.full((5,), 7, odt)
        try:
            fn(op)(backend.asarray(rand((5, 4), xdt, 820)), dtype=dt, out=out)
        finally:
            assert (backend.to_numpy(out) == 7).all()

    raises_each(TypeError, [(F32, None, F64), (F32, None, F16), (F64, None, F32), (F16, None, F32), (F32, F64, F32),
                            (F16, F32, F16), (F32, None, np.dtype(np.int32))], call)
    assert launches == []


@op_param
def test_out_wrong_kind(backend, op, launches):
    other = Backend(OTHER_KIND[backend.name])
    x = backend.asarray(rand((5, 4), F32, 830))
    out = other.full((5,), 7.0, F32)
    with pytest.raises(TypeError):
        fn(op)(x, out=out)
    assert (other.to_numpy(out) == 7.0).all()
    assert launches == []


@op_param
def test_out_not_an_array(backend, op, launches):
    x = backend.asarray(rand((5, 4), F32, 831))
    with pytest.raises(TypeError):
        fn(op)(x, out=[0.0] * 5)
    assert launches == []


@pytest.mark.cuda
@op_param
def test_out_on_another_gpu(op, launches):
    if gpu_count() < 2:
        pytest.skip("needs two GPUs")
    import cupy as cp
    with cp.cuda.Device(0):
        x = cp.asarray(rand((5, 4), F32, 832))
    with cp.cuda.Device(1):
        out = cp.full((5,), 7.0, F32)
    with pytest.raises(ValueError):
        fn(op)(x, out=out)
    assert launches == []


# ==================================================================== errors
@op_param
def test_axis_out_of_range(backend, op, launches):
    def call(case):
        shape, axis = case
        fn(op)(backend.asarray(rand(shape, F32, 900)), axis=axis)

    raises_each(ValueError, [((4, 5), 2), ((4, 5), -3), ((4, 5), (0, 2)), ((4, 5), (-3,)), ((7,), 1),
                             ((2, 3, 4), (1, 3)), ((2, 3, 4), 100)], call)
    assert launches == []


@op_param
def test_axis_repeated(backend, op, launches):
    x = backend.asarray(rand((4, 5, 6), F32, 901))
    raises_each(ValueError, [(0, 0), (2, -1), (0, 1, 0), (-2, 0, 1)], lambda axis: fn(op)(x, axis=axis))
    assert launches == []


@op_param
def test_axis_not_int(backend, op, launches):
    x = backend.asarray(rand((4, 5, 6), F32, 902))
    raises_each(TypeError, [1.0, np.float64(0.0), True, False, np.bool_(True), (0, 1.0), (True,), (0, False), "1",
                            (None,)], lambda axis: fn(op)(x, axis=axis))
    assert launches == []


@op_param
def test_x_not_an_array(op):
    raises_each(TypeError, [[1.0, 2.0], 3.0, 2, np.float32(2.0), None, "abc", (1.0, 2.0)], lambda x: fn(op)(x))


@op_param
def test_x_bad_dtype(backend, op, launches):
    bad = [np.int32, np.int64, np.uint8, np.int8, np.bool_, np.complex64]
    raises_each(TypeError, bad, lambda t: fn(op)(backend.asarray(np.ones((4, 5), dtype=t))))
    raises_each(TypeError, bad, lambda t: fn(op)(backend.asarray(np.ones((4, 5), dtype=t)), dtype=F32))
    assert launches == []


@op_param
@pytest.mark.parametrize("dt", [np.int32, "int8", np.complex64, np.bool_, "torch.int32", "torch.complex64"], ids=str)
def test_bad_dtype_argument(backend, op, dt, launches):
    if isinstance(dt, str) and dt.startswith("torch."):
        torch = pytest.importorskip("torch")
        dt = getattr(torch, dt[6:])
    x = backend.asarray(rand((4, 5), F32, 904))
    with pytest.raises(TypeError):
        fn(op)(x, dtype=dt)
    assert launches == []


# ============================================================== GPU specifics
@op_param
def test_gpu_launches_are_seen(backend, op, launches):
    """The launch recorder sees these ops' kernels (so the ``launches == []``
    checks above mean something on the GPU backends)."""
    if not backend.gpu:
        pytest.skip("GPU backends only")
    x = rand((8, 100), F32, 950)
    reduce(backend, op, backend.asarray(x), x)
    assert len(launches) >= 1


@pytest.mark.cuda
@op_param
@pytest.mark.parametrize("axis", [-1, 0, None], ids=repr)
def test_torch_cuda_uses_current_stream(op, axis, launches):
    """Input produced by a long torch op on a side stream is read correctly when
    the op is called in that stream's context; every kernel is queued on it."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    base = torch.from_numpy(rand((2048, 4096), F32, 960, 0.1)).cuda()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        a = base.clone()
        for _ in range(20):
            a.add_(0.125)
        y = fn(op)(a, axis=axis)
    s.synchronize()
    assert isinstance(y, torch.Tensor) and y.device == a.device
    assert launches and all(ln.stream is not None and ln.stream.ptr == s.cuda_stream for ln in launches)
    nx = a.cpu().numpy()
    check(op, y.cpu().numpy(), REDUCE_REF[op](nx, axis), F32, reduced_length(nx.shape, axis))


@pytest.mark.cuda
@op_param
def test_split_columns_one_launch_on_several_streams(op, launches):
    """Column reductions whose tiles' last blocks add the chunks up (one
    launch; tickets per stream) queued on three CuPy streams at once, four
    times each: every result is right, so no stream's launches took another
    stream's tickets."""
    import cupy as cp
    xs = [rand((600, 8192), F32, 990 + k, 0.25) for k in range(3)]
    dev = [cp.asarray(x) for x in xs]
    streams = [cp.cuda.Stream(non_blocking=True) for _ in xs]
    cp.cuda.Device().synchronize()
    outs = []
    for _ in range(4):
        for k, (s, x) in enumerate(zip(streams, dev)):
            with s:
                outs.append((k, fn(op)(x, axis=0)))
    for s in streams:
        s.synchronize()
    if R.sm_count(0) <= 132:  # more SMs split the rows in more chunks: two launches each
        assert len(launches) == 12 and all(1 < ln.grid[1] <= RD._COL_ONE_LAUNCH_SPLITS for ln in launches), launches
    for k, y in outs:
        check(op, cp.asnumpy(y), REDUCE_REF[op](xs[k], 0), F32, 600)


@pytest.mark.cuda
@op_param
@dtype_param
@pytest.mark.parametrize("axis", [-1, 0, 1, None], ids=repr)
def test_gpu_matches_fallback(op, dtype, axis):
    import cupy as cp
    x = rand((33, 257, 65), dtype, 970)
    cpu = cufuse.sum_squared(x, axis=axis) if op == "sum_squared" else cufuse.mean_abs(x, axis=axis)
    gpu = cp.asnumpy(fn(op)(cp.asarray(x), axis=axis))
    assert gpu.dtype == cpu.dtype and gpu.shape == cpu.shape
    rtol, atol = tol(op, dtype, reduced_length(x.shape, axis))
    np.testing.assert_allclose(gpu.astype(np.float64), cpu.astype(np.float64), rtol=2 * rtol, atol=atol)
