"""Reductions: sum_squared and mean_abs (kernels/reduction.cu).

The reduced axes are mapped onto x[outer][R][inner]: a reduction over
trailing axes is a row reduction (any row stride), one over a block of axes
of a C-contiguous array with axes after it is a column reduction; anything
else goes through a contiguous copy with the reduced axes moved last. float16
and float32 accumulate in float32, float64 (data or ``dtype=``) in float64.
"""
from __future__ import annotations

import warnings

import numpy as np

from .. import _arrays as A
from .._arrays import Array, DType
from .. import _autograd as AG
from .. import _dask as DK
from .. import _driver as D
from .. import _runtime as R
from .. import _torch_ops as TO
from . import _rows

FAMILY = "reduction"
_PACKS_PER_THREAD = 32      # short rows (reduce_rows): 16-byte packs each thread adds at most
_COL_BLOCKS_PER_SM = 4      # column reductions: rows are split while there are fewer 256-thread blocks per SM
# dtypes whose column reductions take reduce_cols_deep (12 rows in flight per
# thread; kernels/reduction.cu has the measurements), and its blocks per SM
_COL_DEEP = dict.fromkeys(A.HALVES, 1)  # (bfloat16 as float16: the same bytes per element)
_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)


def _acc(in_dt, out_dt):
    return _F64 if _F64 in (in_dt, out_dt) else _F32


def _exprs(map_, tin, tout):
    targs = (map_, R.FLOAT_CTYPES[tin], R.FLOAT_CTYPES[_acc(tin, tout)], R.FLOAT_CTYPES[tout])
    return tuple(R.name_expression(k, *targs) for k in ("reduce_rows", "reduce_cols", "reduce_rows_block")) + (
        R.name_expression("reduce_rows_block", *targs, "true"),) + (
        (R.name_expression("reduce_cols_deep", *targs),) if tin in _COL_DEEP else ())


# The second pass (partial sums of split rows or columns) for every accumulation and result type.
_FINAL = {}
for _a in (_F32, _F64):
    for _t in A.FLOAT_DTYPES:
        if _acc(_a, _t) == _a:
            _fam = f"{FAMILY}:final:{_a.name}"
            _FINAL[(_a, _t)] = [(_fam, R.register(_fam, e, "reduction (second pass)", f"{_a.name}->{_t.name}"))
                                for e in _exprs("Identity", _a, _t)[:2]]


class _Reduction:
    def __init__(self, name, map_, mean):
        self.name, self.mean = name, mean
        self.exprs = {}
        self.fast = D.FastPath(name)
        for tin in A.FLOAT_DTYPES:
            fam = f"{FAMILY}:{name}:{tin.name}"
            for tout in A.FLOAT_DTYPES:
                label = tin.name if tin == tout else f"{tin.name}->{tout.name}"
                self.exprs[(tin, tout)] = [(fam, R.register(fam, e, name, label)) for e in _exprs(map_, tin, tout)]

    def numpy(self, v, axes, keepdims):
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # mean of nothing is NaN, as the GPU gives
            if self.mean:
                return np.mean(np.abs(v), axis=axes, keepdims=keepdims)
            return np.sum(np.square(v), axis=axes, keepdims=keepdims)

    def _recorded(self, x, axis, keepdims, dtype, out):
        """The call through its registered operator (autograd, torch.compile)."""
        name = self.name
        AG.no_out(name, out)
        if not isinstance(keepdims, (bool, np.bool_)):
            raise TypeError(f"cufuse.{name}: keepdims must be a bool, got {type(keepdims).__name__}")
        odt = None if dtype is None else A.torch_float_dtype_arg(name, dtype)
        return TO.call_row("reduction", x, list(_axes(name, axis, x.dim())), bool(keepdims), odt, self.mean)

    def __call__(self, x, axis, keepdims, dtype, out):
        name = self.name
        if TO.compiling():  # torch.compile: the registered operator (cufuse/_torch_ops.py)
            return self._recorded(x, axis, keepdims, dtype, out)
        key = None
        ak = _axis_key(axis)
        if ak is not None:
            s = D.signature((x, out))
            if s is not None:
                key, ptrs = (s[0], ak, type(keepdims), keepdims, dtype), s[1]
                try:
                    res = self.fast.run(key, ptrs, 1, None if out is None else (out,))
                except TypeError:  # an unhashable dtype: the general path says what is wrong
                    res = key = None
                if res is not None:
                    return res[0]
        if not isinstance(keepdims, (bool, np.bool_)):
            raise TypeError(f"cufuse.{name}: keepdims must be a bool, got {type(keepdims).__name__}")
        if DK.is_dask(x):
            odt = np.dtype(x.dtype) if dtype is None else A.float_dtype_arg(name, dtype)
            _axes(name, axis, x.ndim)  # the same errors
            return DK.reduction(name, x, axis, bool(keepdims), odt, self.mean,
                                lambda b, ax, kd, acc: self(b, ax, kd, acc, None), out)
        if AG.wants_grad((x,)):  # recorded (no fast-path signature: _driver.signature)
            return self._recorded(x, axis, keepdims, dtype, out)
        kind, dt, dev = _rows.data_arg(name, x)
        odt = dt if dtype is None else A.float_dtype_arg(name, dtype)
        shape = tuple(x.shape)
        axes = _axes(name, axis, len(shape))
        kept = tuple(n for i, n in enumerate(shape) if i not in axes)
        res_shape = tuple(1 if i in axes else n for i, n in enumerate(shape)) if keepdims else kept
        if out is not None:
            A.check_out(name, out, kind, odt, res_shape, dev)
        acc = _acc(dt, odt)
        if kind not in A.GPU_KINDS:
            v = _rows.to_numpy(x, kind).astype(acc, copy=False)  # (read only: no copy in the accumulator dtype)
            with np.errstate(over="ignore"):  # a float16 result may overflow to inf, as on the GPU
                res = np.asarray(self.numpy(v, axes, bool(keepdims))).astype(odt)
            return _rows.from_numpy(res, kind, out)
        with R._cp.cuda.Device(dev):
            return self._gpu(x, kind, dt, odt, acc, dev, shape, axes, res_shape, out, key)

    def _gpu(self, x, kind, dt, odt, acc, dev, shape, axes, res_shape, out, key):
        count = A.count([shape[i] for i in axes])
        if A.count(res_shape) == 0:
            return out if out is not None else D.empty(res_shape, odt, kind, dev)
        if count == 0:  # a sum of nothing is 0, a mean of nothing NaN (NumPy)
            y = out if out is not None else D.empty(res_shape, odt, kind, dev)
            y[...] = float("nan") if self.mean else 0.0
            return y
        keep = key is not None
        target = out
        if out is not None and (not A.is_c_contiguous(tuple(out.shape), A.strides_of(out, kind))
                                or D.overlaps(out, x, kind)):
            target, keep = None, False
        scale = 1.0 / count if self.mean else 1.0
        fns = [R.get_function(f, e, dev) for f, e in self.exprs[(dt, odt)]]
        rows_fn, cols_fn, block_fn, block_whole_fn = fns[:4]
        final = [R.get_function(f, e, dev) for f, e in _FINAL[(acc, odt)]]
        view = _view(x, kind, shape, axes)
        xv = view[1]
        xp = A.pointer_of(xv, kind)
        keep = keep and xp == A.pointer_of(x, kind)  # x itself (or a view of it at its address), not a copy
        b = D.RecipeBuilder(kind, dev, 1, 1)
        if view[0] == "rows":
            _, _, rows, cols, ldx = view
            _reduce_rows(b, (rows_fn, block_fn, block_whole_fn), final[0], xp, rows, cols, ldx, dt, acc, odt,
                         scale, dev)
        else:
            _, _, outer, r, inner = view
            deep = dt in _COL_DEEP  # fns[4]: reduce_cols_deep
            _reduce_cols(b, fns[4] if deep else cols_fn, _COL_DEEP[dt] if deep else _COL_BLOCKS_PER_SM,
                         final[1], xp, outer, r, inner, dt, acc, scale, dev)
        isz = A.dtype_of(x, kind).itemsize
        rec = b.build([D.output(res_shape, odt, kind)],
                      [(0, 0) if target is None else D.view_span(res_shape, A.strides_of(target, kind),
                                                                 odt.itemsize)],
                      [D.view_span(shape, A.strides_of(x, kind), isz)], [()])
        return D.run_general(rec, None if target is None else [target], None if out is None else [out], [xp],
                             fast=self.fast, key=key if keep else None)[0]


def _axis_key(axis):
    """``axis`` as a fast-path key: None, an int or a tuple of ints (else None: the general path)."""
    if axis is None:
        return ("all",)
    if type(axis) is int or (type(axis) is tuple and all(type(a) is int for a in axis)):
        return axis
    return None


def _axes(name, axis, ndim):
    if axis is None:
        return tuple(range(ndim))
    items = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
    res = []
    for a in items:
        if isinstance(a, (bool, np.bool_)) or not isinstance(a, (int, np.integer)):
            raise TypeError(f"cufuse.{name}: axis must be an int, a tuple of ints or None, got {axis!r}")
        if not -ndim <= a < ndim:
            raise ValueError(f"cufuse.{name}: axis {int(a)} is out of range for x with {ndim} dimensions")
        a = int(a) % ndim
        if a in res:
            raise ValueError(f"cufuse.{name}: axis {a} is repeated in axis={axis!r}")
        res.append(a)
    return tuple(sorted(res))


def _view(x, kind, shape, axes):
    """("rows", x', rows, cols, ldx) or ("cols", x', outer, R, inner) describing
    the reduction over x' (x itself, a view of it, or a contiguous copy)."""
    keep = [i for i, n in enumerate(shape) if n != 1]            # dims that matter
    red = [k for k, i in enumerate(keep) if i in axes]          # their positions among `keep`
    xs = x.reshape(tuple(shape[i] for i in keep))               # size-1 dims dropped: a view
    nd, nred = len(keep), len(red)
    size = A.count([shape[i] for i in keep])
    if nred == 0:  # nothing of length > 1 is reduced: rows of one element
        return "rows", D.contiguous(xs, kind).reshape(-1), size, 1, 1
    count = A.count([shape[keep[k]] for k in red])
    if red == list(range(nd - nred, nd)):  # trailing: a row reduction
        ld = _rows.row_stride(xs, kind, nd - nred)
        if ld is None:
            xs, ld = D.contiguous(xs, kind), count
        return "rows", xs, size // count, count, ld
    st = A.strides_of(xs, kind)
    if red == list(range(red[0], red[-1] + 1)) and A.is_c_contiguous(tuple(xs.shape), st) \
            and A.pointer_of(xs, kind) % A.dtype_of(xs, kind).itemsize == 0:
        outer = A.count(xs.shape[:red[0]])
        return "cols", xs, outer, count, size // (outer * count)
    order = [k for k in range(nd) if k not in red] + red        # reduced axes last, then rows
    xt = xs.permute(*order) if kind == A.TORCH_CUDA else xs.transpose(order)
    return "rows", D.contiguous(xt, kind), size // count, count, count


def _split(want, most):
    return max(1, min(want, most))


# Rows of at least _BLOCK_MIN_PACKS packs take reduce_rows_block: one block
# per row (or split of a row) of _BLOCK_PACKS packs at most, the block as
# small as lets each thread add _BLOCK_THREAD_PACKS packs (2 passes of
# kRowBlockU = 2; aligned whole rows: one of 4), at most _ROW_BLOCK
# (kRowBlock) threads, and rows split
# until there are _BLOCK_WAVES blocks per SM: faster than reduce_rows' groups
# on long rows; other packs per thread, block sizes and waves were within a few
# points (bench/NOTES.md, "Figures from code comments").
_ROW_BLOCK = 512
_BLOCK_THREAD_PACKS = 4
_BLOCK_MIN_PACKS = 512
_BLOCK_PACKS = 4096
_BLOCK_WAVES = 16


def _reduce_rows(b, fns, final, xp, rows, cols, ldx, dt, acc, odt, scale, dev):
    """Adds the row reduction of x (address ``xp``: its alignment is read) into
    output 0 to the recipe ``b``: one launch, or the rows split in chunks and
    a second launch over the chunks' partial sums."""
    v = 16 // dt.itemsize
    aligned = xp % 16 == 0 and (ldx * dt.itemsize) % 16 == 0
    npack = -(-cols // v) + (0 if aligned else 1)  # at least any row's packs
    xp, yp = D.in_(0), D.out_(0)
    if npack >= _BLOCK_MIN_PACKS:
        splits = -(-npack // _BLOCK_PACKS)
        target = R.sm_count(dev) * _BLOCK_WAVES
        if rows * splits < target:
            splits = max(splits, min(-(-target // rows), npack // _ROW_BLOCK))
        per = -(-npack // min(splits, 65535))
        splits = -(-npack // per)
        nt = min(max(_rows.pow2_at_least(-(-per // _BLOCK_THREAD_PACKS)), 32), _ROW_BLOCK)
        # aligned rows of whole packs: reduce_rows_block<..., true>, without the
        # head and tail pack logic (kernels/reduction.cu, with the measurement)
        whole = aligned and cols % v == 0
        fn, grid, block = fns[2 if whole else 1], (rows, splits), (nt,)

        def args(out, partial, s):
            return out, partial, xp, cols, ldx, per, s
    else:
        # fewer than 512 packs: never more than _PACKS_PER_THREAD per thread
        # of a group of 32, so the row is not split
        tpr = min(max(_rows.pow2_at_least(-(-npack // _PACKS_PER_THREAD)), 32), 512)
        splits, per = 1, npack
        nt = max(tpr, 256)
        fn, grid, block = fns[0], (-(-rows // (nt // tpr)), splits), (nt,)

        def args(out, partial, s):
            return out, partial, xp, rows, cols, ldx, np.int32(tpr), per, s
    if splits == 1:
        b.launch(fn, grid, block, args(yp, 0, scale))
        return
    # (rounded up to 16 bytes; the first launch zeroes the tail that the second reads as a whole pack)
    pp = b.temp(rows * splits * acc.itemsize)
    b.launch(fn, grid, block, args(0, pp, 1.0))
    npack2 = -(-splits // (16 // acc.itemsize)) + 1
    tpr2 = min(max(_rows.pow2_at_least(-(-npack2 // 4)), 32), 512)
    block2 = max(tpr2, 256)
    b.launch(final, (-(-rows // (block2 // tpr2)), 1), (block2,),
             (yp, 0, pp, rows, splits, splits, np.int32(tpr2), npack2, scale))


# reduce_cols' block: 64 packs of columns x 4 row phases, and rows split until
# there are 4 blocks per SM: the fastest of the shapes and waves tried
# (bench/NOTES.md, "Figures from code comments").
_COL_BLOCK = (64, 4)
# The second launch (the chunks' partial sums, `splits` rows of outer * inner
# float32/float64 columns) with the same kernel: its rows are few, so its
# block spans fewer columns and more row phases, for more blocks (6250 x 8000:
# 125 blocks, not 32; 50000 x 1000: 16, not 4); a few points at most
# (bench/NOTES.md, "Figures from code comments").
_COL_FINAL_BLOCK = (16, 16)


def _reduce_cols(b, fn, per_sm, final, xp, outer, r, inner, dt, acc, scale, dev):
    """Adds the column reduction of x (address ``xp``: its alignment is read)
    into output 0 to the recipe ``b``."""
    v = 16 // dt.itemsize
    vec = int(inner % v == 0 and xp % 16 == 0)
    xp, yp = D.in_(0), D.out_(0)
    block = _COL_BLOCK
    bx = outer * -(-inner // (block[0] * (v if vec else 1)))
    target = R.sm_count(dev) * per_sm  # 256-thread blocks
    # At most `target` blocks: every SM then has the same number, where one
    # more (ceil) left some SMs a block more than the rest (500 x 100000
    # float32: 75.6 -> 79.4% of copy).
    splits = _split(target // bx, min(-(-r // (4 * block[1])), 65535)) if bx < target else 1
    splits = max(splits, -(-r // (1 << 31)))  # the kernel counts a chunk's rows in an int
    chunk = -(-r // splits)
    splits = -(-r // chunk)
    if splits == 1:
        b.launch(fn, (bx, 1), block, (yp, 0, xp, outer, r, inner, chunk, np.int32(vec), scale, 0))
        return
    pp = b.temp(splits * outer * inner * acc.itemsize)
    if splits <= _COL_ONE_LAUNCH_SPLITS:
        tickets = b.stream_buffer(4 * bx)  # one uint32 ticket per column tile
        b.launch(fn, (bx, splits), block, (yp, pp, xp, outer, r, inner, chunk, np.int32(vec), scale, tickets))
        return
    b.launch(fn, (bx, splits), block, (0, pp, xp, outer, r, inner, chunk, np.int32(vec), 1.0, 0))
    n = outer * inner
    va = 16 // acc.itemsize
    vec2 = int(n % va == 0)
    block2 = _COL_FINAL_BLOCK
    b.launch(final, (-(-n // (block2[0] * (va if vec2 else 1))), 1), block2,
             (yp, 0, pp, 1, splits, n, splits, np.int32(vec2), scale, 0))


# Up to this many chunks, the last block of each column tile adds the
# chunks' partial sums up (kernels/reduction.cu reduce_cols' tickets): one
# launch. Beyond, the second launch above: one block's gather of many chunks
# is slower than it (bench/NOTES.md, "Figures from code comments").
_COL_ONE_LAUNCH_SPLITS = 16
_sum_squared = _Reduction("sum_squared", "Square", mean=False)
_mean_abs = _Reduction("mean_abs", "Abs", mean=True)


def sum_squared(x: Array, axis: int | tuple[int, ...] | None = -1, keepdims: bool = False, dtype: DType = None,
                *, out: Array | None = None) -> Array:
    """sum(x * x) over ``axis`` (an int, a tuple of ints, or None for all),
    with NumPy's ``keepdims``. float16, bfloat16 and float32 accumulate in float32,
    float64 in float64 (also when ``dtype=float64``); the result has x's
    dtype unless ``dtype`` (float16, bfloat16, float32, float64; NumPy or torch spelling) says
    otherwise. Fast paths: the last axes and the first axes of a contiguous
    array; any other axis or layout is correct (through a copy). Returns x's
    kind; ``out=`` receives the result."""
    return _sum_squared(x, axis, keepdims, dtype, out)


def mean_abs(x: Array, axis: int | tuple[int, ...] | None = -1, keepdims: bool = False, dtype: DType = None,
             *, out: Array | None = None) -> Array:
    """mean(|x|) over ``axis``; a mean over nothing is NaN. Otherwise as ``sum_squared``."""
    return _mean_abs(x, axis, keepdims, dtype, out)
