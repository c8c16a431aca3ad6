"""Cross entropy over the vocabulary from the logits (kernels/cross_entropy.cu):
loss and gradient without a probability-sized buffer, the gradient written in
place of the logits where they are an intermediate of the autograd graph.

The forward reads the logits once (an online softmax per row: max and sum of
exponentials merged across threads) and keeps one log-sum-exp per row; the
backward reads them again and writes the gradient, scaled by the incoming
gradient on the device (no host synchronization, no extra pass).
"""
from __future__ import annotations

import math

import numpy as np

from .. import _arrays as A
from .._arrays import Array, DType
from .. import _autograd as AG
from .. import _dask as DK
from .. import _driver as D
from .. import _runtime as R
from .. import _torch_ops as TO
from . import _rows

FAMILY = "cross_entropy"
_THREADS = 512
_EXPRS = {(dt, d): R.register(FAMILY, R.name_expression(f"cross_entropy_{d}", ct), f"cross_entropy {d}", dt.name)
          for dt, ct in R.FLOAT_CTYPES.items() for d in ("forward", "backward")}
_REDUCTIONS = ("mean", "sum", "none")
_TARGET_DTYPES = (np.dtype(np.int64), np.dtype(np.int32))


# --------------------------------------------------------------- validation
def _number(name, what, v, lo, hi, kind=float):
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"cufuse.{name}: {what} must be a {kind.__name__}, got {type(v).__name__}")
    if kind is int:
        if not isinstance(v, (int, np.integer)):
            raise TypeError(f"cufuse.{name}: {what} must be an int, got {type(v).__name__}")
        return int(v)
    f = float(v)
    if not (lo <= f <= hi):
        raise ValueError(f"cufuse.{name}: {what} must be in [{lo}, {hi}], got {v!r}")
    return f


def _args(name, logits, target, ignore_index, label_smoothing, z_loss, reduction):
    """(kind, dtype, device, rows, cols, target as int64, ignore, eps, z) or TypeError / ValueError."""
    if DK.is_dask(logits) or DK.is_dask(target):
        raise TypeError(f"cufuse.{name}: Dask arrays are not supported (the classes of a row lie in one chunk: "
                        "call it per chunk with dask.array.map_blocks)")
    kind, dt, dev = _rows.data_arg(name, logits)
    shape = tuple(logits.shape)
    if len(shape) != 2:
        raise ValueError(f"cufuse.{name}: logits must be 2-D (rows, classes), got shape {shape}; flatten the "
                         "leading dims (logits.reshape(-1, classes), target.reshape(-1))")
    tk = A.kind_of(target) if not isinstance(target, (int, float)) else None
    if tk != kind:
        raise TypeError(f"cufuse.{name}: target must be the logits' array kind ({A.describe(logits, kind)}), "
                        f"got {type(target).__module__}.{type(target).__name__}")
    tdt = A.dtype_of(target, kind)
    if tdt not in _TARGET_DTYPES:
        raise TypeError(f"cufuse.{name}: target must hold int64 (or int32) class indices, got dtype {tdt}")
    if tuple(target.shape) != shape[:1]:
        raise ValueError(f"cufuse.{name}: target has shape {tuple(target.shape)}; logits of shape {shape} need "
                         f"({shape[0]},)")
    if kind in A.GPU_KINDS and A.device_of(target, kind) != dev:
        raise ValueError(f"cufuse.{name}: logits on GPU {dev}, target on GPU {A.device_of(target, kind)}")
    if shape[1] == 0:
        raise ValueError(f"cufuse.{name}: logits have no classes (shape {shape})")
    if not isinstance(reduction, str) or reduction not in _REDUCTIONS:
        raise ValueError(f"cufuse.{name}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    ignore = _number(name, "ignore_index", ignore_index, None, None, int)
    eps = _number(name, "label_smoothing", label_smoothing, 0.0, 1.0)
    z = _number(name, "z_loss", z_loss, 0.0, math.inf)
    if math.isinf(z):
        raise ValueError(f"cufuse.{name}: z_loss must be finite, got {z_loss!r}")
    if tdt != _TARGET_DTYPES[0]:
        target = target.to(A.torch().int64) if kind in (A.TORCH_CPU, A.TORCH_CUDA) else target.astype(np.int64)
    return kind, dt, dev, shape[0], shape[1], target, ignore, eps, z


# ---------------------------------------------------------------- the math
def _np_forward(x, t, ignore, eps, z):
    """(per-row loss, per-row log-sum-exp) in the compute dtype: the fallback."""
    m = np.max(x, axis=1, keepdims=True)
    with np.errstate(all="ignore"):
        shift = np.where(m == -np.inf, 0, m)  # all -inf: -inf; +inf: NaN (inf - inf), as the kernel and torch
        lse = (np.log(np.sum(np.exp(x - shift), axis=1, keepdims=True)) + shift)[:, 0]
        valid = t != ignore
        inside = (t >= 0) & (t < x.shape[1])
        xt = np.where(inside, x[np.arange(x.shape[0]), np.clip(t, 0, x.shape[1] - 1)], np.nan)
        loss = (1 - eps) * (lse - xt)  # (terms of weight 0 left out: 0 * inf would be NaN)
        if eps:
            loss = loss + eps * (lse - x.mean(axis=1))
        if z:
            loss = loss + z * lse * lse
    return np.where(valid, loss, 0).astype(x.dtype), lse.astype(x.dtype)


def _np_backward(x, t, lse, scale, ignore, eps, z):
    with np.errstate(all="ignore"):
        p = np.exp(x - lse[:, None])
        d = (p * (1 + 2 * z * lse[:, None]) if z else p) - eps / x.shape[1]
        rows = np.arange(x.shape[0])
        inside = (t >= 0) & (t < x.shape[1])
        d[rows, np.clip(t, 0, x.shape[1] - 1)] -= np.where(inside, 1 - eps, np.nan)
        d = d * scale.reshape(-1, 1)
    return np.where((t != ignore)[:, None], d, 0).astype(x.dtype)


def _vec(dt, cols, *views):
    """Whether every row of the (pointer, row stride) views is whole 16-byte packs."""
    v = 16 // dt.itemsize
    return cols % v == 0 and all(p % 16 == 0 and ld % v == 0 for p, ld in views)


def _launch(kind, dev, expr, rows, args):
    fn = R.get_function(FAMILY, expr, dev)
    grid = max(1, min(rows, R.sm_count(dev) * (2048 // _THREADS) * 4))
    with R._cp.cuda.Device(dev):
        fn((grid,), (_THREADS,), args, stream=D.stream_for(kind, dev))


def _rows_of(x, kind):
    """(x or a copy whose rows are contiguous, its row stride): the kernels' view."""
    ld = _rows.row_stride(x, kind, 1)
    if ld is None:
        x = D.contiguous(x, kind)
        ld = x.shape[1]
    return x, ld


def _forward(kind, dt, dev, x, t, ignore, eps, z):
    """(per-row loss, per-row lse), in the compute dtype, of x's kind."""
    cdt = A.compute_dtype(dt)
    rows, cols = tuple(x.shape)
    if kind not in A.GPU_KINDS:
        xv = _rows.to_numpy(x, kind).astype(cdt)
        loss, lse = _np_forward(xv, _rows.to_numpy(t, kind), ignore, eps, z)
        return _rows.from_numpy(loss, kind, None), _rows.from_numpy(lse, kind, None)
    x, ld = _rows_of(x, kind)
    t = D.contiguous(t, kind)
    loss, lse = D.empty((rows,), cdt, kind, dev), D.empty((rows,), cdt, kind, dev)
    if rows:
        px = A.pointer_of(x, kind)
        _launch(kind, dev, _EXPRS[(dt, "forward")], rows,
                (A.pointer_of(loss, kind), A.pointer_of(lse, kind), px, A.pointer_of(t, kind), np.int64(rows),
                 np.int64(cols), np.int64(ld), np.int64(ignore), np.float64(eps), np.float64(z),
                 np.bool_(_vec(dt, cols, (px, ld)))))
    return loss, lse


def _backward(kind, dt, dev, x, t, lse, scale, ignore, eps, z, inplace=False):
    """The gradient of the per-row losses times ``scale`` (per row, or one
    value): into x itself where ``inplace`` and its rows allow (GPU, rows
    contiguous and apart), else into a new array."""
    rows, cols = tuple(x.shape)
    if kind not in A.GPU_KINDS:
        cdt = A.compute_dtype(dt)
        res = _np_backward(_rows.to_numpy(x, kind).astype(cdt), _rows.to_numpy(t, kind),
                           _rows.to_numpy(lse, kind), np.asarray(_rows.to_numpy(scale, kind), dtype=cdt),
                           ignore, eps, z).astype(dt)
        return _rows.from_numpy(res, kind, None)
    xr, ldx = _rows_of(x, kind)
    if inplace and xr is x and (ldx >= cols or rows == 1):
        dx, ldd = x, ldx
    else:
        dx, ldd = D.empty((rows, cols), dt, kind, dev), cols
    x = xr
    t = D.contiguous(t, kind)
    if rows:
        px, pd = A.pointer_of(x, kind), A.pointer_of(dx, kind)
        _launch(kind, dev, _EXPRS[(dt, "backward")], rows,
                (pd, px, A.pointer_of(t, kind), A.pointer_of(lse, kind), A.pointer_of(scale, kind),
                 np.int64(1 if A.count(tuple(scale.shape)) > 1 else 0), np.int64(rows), np.int64(cols),
                 np.int64(ldx), np.int64(ldd), np.int64(ignore), np.float64(eps), np.float64(z),
                 np.bool_(_vec(dt, cols, (px, ldx), (pd, ldd)))))
    return dx


def _reduce(kind, loss, t, ignore, reduction, dt):
    """(the loss as the caller asked, the count of rows that count: a mean's divisor)."""
    count = (t != ignore).sum()
    if reduction == "none":
        res = loss
    elif reduction == "sum":
        res = loss.sum()
    else:
        with np.errstate(all="ignore"):  # every row ignored: 0 / 0 = NaN, as torch
            res = loss.sum() / count
    if kind in (A.TORCH_CPU, A.TORCH_CUDA):
        return res.to(A.numpy_to_torch_dtype(dt)), count
    return np.asarray(res).astype(dt) if kind == A.NUMPY else res.astype(dt), count


# --------------------------------------------------------------- the call
def cross_entropy(logits: Array, target: Array, /, *, ignore_index: int = -100, label_smoothing: float = 0.0,
                  z_loss: float = 0.0, reduction: str = "mean", dtype: DType | None = None,
                  inplace_backward: bool = True) -> Array:
    """Cross entropy of ``logits`` [rows, classes] against integer class
    indices ``target`` [rows], as ``torch.nn.functional.cross_entropy``
    (``ignore_index``, ``label_smoothing``, ``reduction`` "mean", "sum" or
    "none"; a mean over the rows not ignored), plus a z-loss
    ``z_loss * logsumexp(logits)**2`` per row (0: none). float16, bfloat16,
    float32 or float64 logits, computed in float32 (float64 for float64);
    the result has the logits' kind, and their dtype unless ``dtype`` (a
    float NumPy or torch dtype) says otherwise: a float32 loss of bfloat16
    logits is rounded once, from the float32 sum.

    Differentiable for torch tensors: the backward is one kernel. Where the
    logits are an intermediate of the autograd graph (the output of an
    ``lm_head``, not a leaf nor a view of one) and ``inplace_backward`` is true, it writes the
    gradient into the logits' own memory (no second vocabulary-sized buffer);
    the logits then hold their gradient, and another backward that saved
    them raises torch's in-place error rather than reading the gradient.

    A target outside [0, classes) other than ``ignore_index`` gives NaN for
    its row (checking would take a host synchronization).
    """
    name = "cross_entropy"
    if TO.compiling():  # torch.compile: the registered operator (cufuse/_torch_ops.py)
        return TO.cross_entropy(logits, target, ignore_index, label_smoothing, z_loss, reduction, dtype)
    if AG.wants_grad((logits,)):
        args = _args(name, logits.detach(), target, ignore_index, label_smoothing, z_loss, reduction)
        odt = args[1] if dtype is None else A.float_dtype_arg(name, dtype)
        # in place only into an intermediate's memory: a view's root (its _base) decides, so that a
        # slice of a leaf (user data, a Parameter) is never overwritten
        root = logits._base if logits._is_view() else logits
        inplace = bool(inplace_backward) and not root.is_leaf
        return AG._function_class("cross_entropy", _function).apply(logits, args, reduction, odt, inplace)
    kind, dt, dev, rows, cols, t, ignore, eps, z = _args(name, logits, target, ignore_index, label_smoothing,
                                                         z_loss, reduction)
    odt = dt if dtype is None else A.float_dtype_arg(name, dtype)
    loss, _ = _forward(kind, dt, dev, logits, t, ignore, eps, z)
    return _reduce(kind, loss, t, ignore, reduction, odt)[0]


def forward_rows(logits, target, ignore_index, label_smoothing, z_loss, reduction, dtype):
    """(the loss, the per-row lse, the count of rows not ignored) of torch
    tensors: the registered operator's forward (``dtype``: a torch dtype or None)."""
    kind, dt, dev, rows, cols, t, ignore, eps, z = _args("cross_entropy", logits, target, ignore_index,
                                                         label_smoothing, z_loss, reduction)
    loss, lse = _forward(kind, dt, dev, logits, t, ignore, eps, z)
    res, count = _reduce(kind, loss, t, ignore, reduction, dt if dtype is None else A.torch_to_numpy_dtype(dtype))
    return res, lse, count


def backward_rows(g, logits, target, lse, count, ignore_index, label_smoothing, z_loss, reduction):
    """The gradient with respect to the logits (a new tensor): the registered operator's backward."""
    kind, dt, dev, rows, cols, t, ignore, eps, z = _args("cross_entropy", logits, target, ignore_index,
                                                         label_smoothing, z_loss, reduction)
    cdt = lse.dtype
    scale = g.to(cdt) / count.to(cdt) if reduction == "mean" else g.to(cdt).contiguous()
    return _backward(kind, dt, dev, logits, t, lse, scale, ignore, eps, z)


def _function(torch):
    class CrossEntropyFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, args, reduction, odt, inplace):
            kind, dt, dev, rows, cols, t, ignore, eps, z = args
            loss, lse = _forward(kind, dt, dev, logits.detach(), t, ignore, eps, z)
            res, count = _reduce(kind, loss, t, ignore, reduction, odt)
            ctx.args, ctx.reduction, ctx.inplace = args, reduction, inplace
            ctx.save_for_backward(logits, lse, count)
            return res

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, g):
            logits, lse, count = ctx.saved_tensors
            kind, dt, dev, rows, cols, t, ignore, eps, z = ctx.args
            cdt = lse.dtype
            scale = g.to(cdt) / count.to(cdt) if ctx.reduction == "mean" else g.to(cdt).contiguous()
            x = logits.detach()
            dx = _backward(kind, dt, dev, x, t, lse, scale, ignore, eps, z, ctx.inplace)
            if dx is x:  # the logits now hold their gradient: a backward that saved them must say so
                torch.autograd.graph.increment_version(logits)
            return dx, None, None, None, None

    return CrossEntropyFn
