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
        raise TypeError(f"cufuse.{name}: {what} must be {'an int' if kind is int else 'a float'}, got "
                        f"{type(v).__name__}")
    if kind is int:
        if not isinstance(v, (int, np.integer)):
            raise TypeError(f"cufuse.{name}: {what} must be an int, got {type(v).__name__}")
        if not -2**63 <= int(v) < 2**63:  # (the kernels compare int64 targets with it)
            raise ValueError(f"cufuse.{name}: {what} must be in int64's range, got {v!r}")
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
    kind, dt, dev = _rows.data_arg(name, logits, "logits")
    shape = tuple(logits.shape)
    if len(shape) != 2:
        raise ValueError(f"cufuse.{name}: logits must be 2-D (rows, classes), got shape {shape}; flatten the "
                         "leading dims with the classes last (logits.reshape(-1, classes), target.reshape(-1); "
                         "torch's (N, classes, d1, ...) form: logits.movedim(1, -1) first)")
    if shape[1] == 0:
        raise ValueError(f"cufuse.{name}: logits have no classes (shape {shape})")
    target, ignore, eps, z = _target_args(name, logits, "logits", kind, dev, shape[:1], target, ignore_index,
                                          label_smoothing, z_loss, reduction)
    return kind, dt, dev, shape[0], shape[1], target, ignore, eps, z


def _target_args(name, data, what, kind, dev, need, target, ignore_index, label_smoothing, z_loss, reduction):
    """(target as int64, ignore, eps, z) of a loss over ``data`` (called
    ``what``), whose target must have the shape ``need``; or TypeError / ValueError."""
    owner = what + ("'" if what.endswith("s") else "'s")
    why = ""
    try:
        tk = A.kind_of(target) if not isinstance(target, (int, float)) else None
    except A.RefusedArray as e:  # (masked, matrix, a negative bit: its reason says what to pass)
        tk, why = None, str(e)
    except TypeError:  # (a list, a bool: no array kind)
        tk = None
    if tk != kind:
        raise TypeError(f"cufuse.{name}: target must be the {owner} array kind ({A.describe(data, kind)}), "
                        f"{why or f'got {type(target).__module__}.{type(target).__name__}'}")
    tdt = A.dtype_of(target, kind)
    if tdt not in _TARGET_DTYPES:
        raise TypeError(f"cufuse.{name}: target must hold int64 (or int32) class indices, got dtype {tdt}")
    if tuple(target.shape) != tuple(need):
        raise ValueError(f"cufuse.{name}: target has shape {tuple(target.shape)}; {what} of shape "
                         f"{tuple(data.shape)} need {tuple(need)}")
    if kind in A.GPU_KINDS and A.device_of(target, kind) != dev:
        raise ValueError(f"cufuse.{name}: {what} on GPU {dev}, target on GPU {A.device_of(target, kind)}")
    if not isinstance(reduction, str) or reduction not in _REDUCTIONS:
        raise ValueError(f"cufuse.{name}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    ignore = _number(name, "ignore_index", ignore_index, None, None, int)
    eps = _number(name, "label_smoothing", label_smoothing, 0.0, 1.0)
    z = _number(name, "z_loss", z_loss, 0.0, math.inf)
    if math.isinf(z):
        raise ValueError(f"cufuse.{name}: z_loss must be finite, got {z_loss!r}")
    if tdt != _TARGET_DTYPES[0]:
        target = target.to(A.torch().int64) if kind in (A.TORCH_CPU, A.TORCH_CUDA) else target.astype(np.int64)
    return target, ignore, eps, z


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
        d[rows, np.clip(t, 0, x.shape[1] - 1)] -= np.where(inside, 1 - eps, 0.0)
        d = np.where(inside[:, None], d * scale.reshape(-1, 1), np.nan)  # (a target out of range: NaN, as its loss)
    return np.where((t != ignore)[:, None], d, 0).astype(x.dtype)


def _vec(dt, *views):
    """Whether every row of the (pointer, row stride) views starts on a 16-byte
    pack (the kernels read whole packs, then the elements after the last one)."""
    v = 16 // dt.itemsize
    return all(p % 16 == 0 and ld % v == 0 for p, ld in views)


def _launcher(kind, dev, expr):
    """The kernel of ``expr`` as a call ``go(rows, args)`` on the caller's
    stream, looked up once for many launches (inside ``Device(dev)``)."""
    fn = R.get_function(FAMILY, expr, dev)
    blocks = R.sm_count(dev) * (2048 // _THREADS) * 4
    stream = D.stream_for(kind, dev)

    def go(rows, args):
        fn((max(1, min(rows, blocks)),), (_THREADS,), args, stream=stream)
    return go


def _launch(kind, dev, expr, rows, args):
    with R._cp.cuda.Device(dev):
        _launcher(kind, dev, expr)(rows, args)


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
                 np.bool_(_vec(dt, (px, ld)))))
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
                 np.bool_(_vec(dt, (px, ldx), (pd, ldd)))))
    return dx


def _reduce(kind, loss, t, ignore, reduction, dt, count=None):
    """(the loss as the caller asked, the count of rows that count: a mean's divisor, unless given)."""
    count = (t != ignore).sum() if count is None else count
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
    logits are a CUDA intermediate of the autograd graph (the output of an
    ``lm_head``, not a leaf nor a view of one) and ``inplace_backward`` is true, it writes the
    gradient into the logits' own memory (no second vocabulary-sized buffer);
    the logits then hold their gradient, and another backward that saved
    them raises torch's in-place error rather than reading the gradient.

    A target outside [0, classes) other than ``ignore_index`` gives NaN for
    its row (checking would take a host synchronization).
    """
    name = "cross_entropy"
    if not isinstance(inplace_backward, (bool, np.bool_)):  # ("False" would be true)
        raise TypeError(f"cufuse.{name}: inplace_backward must be a bool, got {type(inplace_backward).__name__}")
    if TO.compiling():  # torch.compile: the registered operator (cufuse/_torch_ops.py)
        return TO.cross_entropy(logits, target, ignore_index, label_smoothing, z_loss, reduction, dtype)
    if AG.wants_grad((logits,)):
        args = _args(name, logits.detach(), target, ignore_index, label_smoothing, z_loss, reduction)
        odt = args[1] if dtype is None else A.float_dtype_arg(name, dtype)
        # in place only into an intermediate's memory: a view's root (its _base) decides, so that a
        # slice of a leaf (user data, a Parameter) is never overwritten
        root = logits._base if logits._is_view() else logits
        inplace = bool(inplace_backward) and not root.is_leaf
        return AG.apply("cross_entropy", _function, logits, args, reduction, odt, inplace)
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
            ctx.save_for_backward(logits, lse, count, t)  # (saved: a target changed in place since raises)
            return res

        @staticmethod
        @AG.once_differentiable
        def backward(ctx, g):
            logits, lse, count, t = ctx.saved_tensors
            kind, dt, dev, rows, cols, _, ignore, eps, z = ctx.args
            cdt = lse.dtype
            scale = g.to(cdt) / count.to(cdt) if ctx.reduction == "mean" else g.to(cdt).contiguous()
            x = logits.detach()
            dx = _backward(kind, dt, dev, x, t, lse, scale, ignore, eps, z, ctx.inplace)
            if dx is x:  # the logits now hold their gradient: a backward that saved them must say so
                torch.autograd.graph.increment_version(logits)
            return dx, None, None, None, None

    return CrossEntropyFn


# ------------------------------------------------- the loss of a linear layer
def _traced_int(v):
    """chunk_rows under torch.compile: a NumPy integer as an int (torch 2.11's Dynamo traces one as a
    tensor, refusing operator.index on it and answering False to isinstance(v, np.integer), but int()
    works); anything without a dtype goes on as given, for the registered operator's wrapper to check."""
    return int(v) if hasattr(v, "dtype") and not isinstance(v, np.floating) else v


def _linear_args(name, hidden, weight, bias, target, ignore_index, label_smoothing, z_loss, reduction, chunk_rows):
    """(kind, dtype, device, features, classes, target as int64, ignore, eps, z, rows per chunk)
    of linear_cross_entropy, or TypeError / ValueError (torch tensors given detached)."""
    if any(DK.is_dask(a) for a in (hidden, weight, bias, target)):
        raise TypeError(f"cufuse.{name}: Dask arrays are not supported")
    kind, dt, dev = _rows.data_arg(name, hidden, "hidden")
    hs = tuple(hidden.shape)
    if not hs:
        raise ValueError(f"cufuse.{name}: hidden must have a features dim ([..., features]), got a 0-d array")
    feats = hs[-1]
    for what, a, dims in (("weight", weight, 2), ("bias", bias, 1)):
        if a is None and what == "bias":
            continue
        if A.array_kind(name, a, what) != kind:
            raise TypeError(f"cufuse.{name}: {what} must be the hidden states' array kind ({A.describe(hidden, kind)}), "
                            f"got {type(a).__module__}.{type(a).__name__}")
        if A.dtype_of(a, kind) != dt:
            raise TypeError(f"cufuse.{name}: {what} has dtype {A.dtype_of(a, kind)}, hidden {dt}: they must agree "
                            "(as torch.nn.functional.linear)")
        if kind in A.GPU_KINDS and A.device_of(a, kind) != dev:
            raise ValueError(f"cufuse.{name}: hidden on GPU {dev}, {what} on GPU {A.device_of(a, kind)}")
        if len(a.shape) != dims:
            raise ValueError(f"cufuse.{name}: {what} must be {dims}-D, got shape {tuple(a.shape)}")
    ws = tuple(weight.shape)
    if ws[1] != feats:
        raise ValueError(f"cufuse.{name}: weight of shape {ws} needs hidden states of {ws[1]} features, "
                         f"got shape {hs}")
    if ws[0] == 0:
        raise ValueError(f"cufuse.{name}: weight has no classes (shape {ws})")
    if bias is not None and tuple(bias.shape) != ws[:1]:
        raise ValueError(f"cufuse.{name}: bias has shape {tuple(bias.shape)}; weight of shape {ws} needs {ws[:1]}")
    target, ignore, eps, z = _target_args(name, hidden, "hidden states", kind, dev, hs[:-1], target, ignore_index,
                                          label_smoothing, z_loss, reduction)
    if chunk_rows is not None:
        chunk_rows = _number(name, "chunk_rows", chunk_rows, None, None, int)
        if chunk_rows < 1:
            raise ValueError(f"cufuse.{name}: chunk_rows must be >= 1, got {chunk_rows}")
    return kind, dt, dev, feats, ws[0], target, ignore, eps, z, chunk_rows


def _chunk_rows(rows, feats, classes):
    """Rows of logits made at a time: as many elements as the hidden states
    hold (so the loss adds about as much memory as they take), and at least
    512 rows: each chunk reads and writes the weight's whole gradient once,
    and below that the traffic (and the host cost per chunk) becomes a large
    share of the matrix products' time (512 rows: 7-11% slower than 1024,
    but a Llama training step's peak no higher than Liger-Kernel's, whose
    chunks are smaller still: bench/NOTES.md); a multiple of 64 rows (the
    products' tiles) unless one chunk takes every row."""
    c = max(512, rows * feats // max(classes, 1))
    return max(rows, 1) if c >= rows else c - c % 64


def _linear_chunks(kind, dt, dev, h2, w, b, t, ignore, eps, z, per, scale=None, grads=(None, None, None)):
    """The per-row losses of the rows of ``h2 @ w.T + b`` made ``per`` rows
    at a time; with ``scale`` (one value or one per row, the compute dtype)
    also each chunk's logits gradient, in place, and from it, into ``grads``
    (dh rows, dw, db in float32; None: not wanted), the gradients of h2, w
    and b: written (dh), the first chunk's product (dw) or added (db)."""
    if kind == A.TORCH_CUDA:
        return _cuda_chunks(dt, dev, h2, w, b, t, ignore, eps, z, per, scale, grads)
    torch_kind = kind == A.TORCH_CPU
    if not torch_kind:  # NumPy and CuPy: products in the compute dtype, logits rounded once to dt (as torch's)
        cdt = A.compute_dtype(dt)
        w = w.astype(cdt, copy=False)
        b = None if b is None else b.astype(cdt, copy=False)
    losses = []
    for s in range(0, max(1, h2.shape[0]), per):  # (no rows: one empty chunk, for the empty results)
        e = min(h2.shape[0], s + per)
        hc, tc = h2[s:e], t[s:e]
        if torch_kind:
            logits = A.torch().mm(hc, w.t()) if b is None else A.torch().addmm(b, hc, w.t())
        else:
            logits = hc.astype(cdt, copy=False) @ w.T
            logits = (logits if b is None else logits + b).astype(dt, copy=False)
        loss, lse = _forward(kind, dt, dev, logits, tc, ignore, eps, z)
        losses.append(loss)
        if scale is not None:
            d = _backward(kind, dt, dev, logits, tc, lse, scale if A.count(tuple(scale.shape)) == 1 else scale[s:e],
                          ignore, eps, z, inplace=True)
            del logits
            _chunk_grads(d, hc, w, grads, s, e)
    if len(losses) == 1:
        return losses[0]
    if torch_kind:
        return A.torch().cat(losses)
    return (R._cp if kind == A.CUPY else np).concatenate(losses)


def _chunk_grads(d, hc, w, grads, s, e):
    """A chunk's share of (dh, dw, db) from its logits gradient ``d``: torch tensors."""
    gh, gw, gb = grads
    torch = A.torch()
    if gh is not None:
        torch.mm(d, w, out=gh[s:e])
    if gw is not None:
        if s:
            gw.addmm_(d.t(), hc)
        else:
            torch.mm(d.t(), hc, out=gw)
    if gb is not None:
        gb += d.sum(0, dtype=gb.dtype)


def _cuda_chunks(dt, dev, h2, w, b, t, ignore, eps, z, per, scale, grads):
    """``_linear_chunks`` of torch CUDA tensors. The weight (and bias) get
    zero rows up to ``_padded_classes`` (a copy for the call, where the
    vocabulary is not a multiple of 8), so that every product has aligned
    dimensions; the loss kernels read the first ``classes`` of each padded
    row of logits, and the padded ones (0) meet only the weight's zero rows
    and the gradients' padded rows, which ``_new_grads`` made and
    ``_final_grads`` drops. Each chunk's logits go into one buffer; the
    kernels are looked up once and launched on pointers into it (no
    per-chunk arrays): the host cost per chunk is the products' and two
    launches."""
    torch = A.torch()
    kind, rows, (classes, _) = A.TORCH_CUDA, h2.shape[0], tuple(w.shape)
    cdt = A.compute_dtype(dt)
    loss = D.empty((rows,), cdt, kind, dev)
    if not rows:  # no products: the weight's gradient (made by the first chunk's) is zero
        if grads[1] is not None:
            grads[1].zero_()
        return loss
    per, ld = min(per, rows), _padded_classes(classes)
    if ld != classes:
        F = torch.nn.functional
        w = F.pad(w, (0, 0, 0, ld - classes))
        b = None if b is None else F.pad(b, (0, ld - classes))
    buf = torch.empty((per, ld), dtype=h2.dtype, device=h2.device)
    lse = D.empty((per,), cdt, kind, dev)
    t = D.contiguous(t, kind)
    pb, pl, pt, pll = buf.data_ptr(), loss.data_ptr(), t.data_ptr(), lse.data_ptr()
    csize = cdt.itemsize
    fixed = (np.int64(classes), np.int64(ld))
    opts = (np.int64(ignore), np.float64(eps), np.float64(z), np.bool_(_vec(dt, (pb, ld))))
    if scale is not None:
        scale = scale.contiguous()
        sstride = 1 if A.count(tuple(scale.shape)) > 1 else 0
        psc = scale.data_ptr()
    with R._cp.cuda.Device(dev):
        fwd = _launcher(kind, dev, _EXPRS[(dt, "forward")])
        bwd = _launcher(kind, dev, _EXPRS[(dt, "backward")]) if scale is not None else None
        for s in range(0, rows, per):
            e = min(rows, s + per)
            n, hc, logits = np.int64(e - s), h2[s:e], buf[:e - s]
            if b is None:
                torch.mm(hc, w.t(), out=logits)
            else:
                torch.addmm(b, hc, w.t(), out=logits)
            fwd(e - s, (pl + s * csize, pll, pb, pt + 8 * s, n) + fixed + opts)
            if bwd is None:
                continue
            bwd(e - s, (pb, pb, pt + 8 * s, pll, psc + s * sstride * csize, np.int64(sstride), n) + fixed
                + (np.int64(ld),) + opts)
            _chunk_grads(logits, hc, w, grads, s, e)
    return loss


def linear_cross_entropy(hidden: Array, weight: Array, target: Array, /, *, bias: Array | None = None,
                         ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
                         reduction: str = "mean", dtype: DType | None = None, chunk_rows: int | None = None) -> Array:
    """``cross_entropy(hidden @ weight.T + bias, target)`` without the logits:
    a language model's head and loss in one call, made ``chunk_rows`` rows
    of logits at a time (default: as many elements as ``hidden`` holds, at
    least 512 rows). ``hidden`` is [..., features], ``weight``
    [classes, features] (an ``nn.Linear``'s), ``bias`` [classes] or None,
    ``target`` hidden's leading shape; the other arguments as
    ``cufuse.cross_entropy`` ("none" gives one loss per row of hidden's
    leading shape).

    On torch tensors it is differentiable. With reduction "mean" or "sum"
    (bfloat16, float32, float64) the forward computes the gradients chunk by chunk as it goes (each
    chunk's logits gradient in place, then its products with weight and
    hidden), so nothing vocabulary-sized outlives a chunk; the backward
    scales them by the incoming gradient. The weight's gradient is summed
    over the chunks in its own dtype (one rounding per chunk). With
    "none", and for float16 (whose logits gradient, scaled by 1 / rows before
    the loss scale of a GradScaler comes, would lose its small terms), the
    backward makes the chunks again. Under torch.compile it is a registered
    operator that does the same (no logits outlive a chunk).
    """
    name = "linear_cross_entropy"
    if TO.compiling():  # torch.compile: the registered operator (cufuse/_torch_ops.py)
        return TO.linear_cross_entropy(hidden, weight, bias, target, ignore_index, label_smoothing, z_loss, reduction,
                                       dtype, _traced_int(chunk_rows))
    grad = AG.wants_grad((hidden, weight, bias))
    given = [a.detach() if grad and a is not None and A.is_torch_tensor(a) else a for a in (hidden, weight, bias)]
    args = _linear_args(name, given[0], given[1], given[2], target, ignore_index, label_smoothing, z_loss, reduction,
                        chunk_rows)
    dt = args[1]
    odt = dt if dtype is None else A.float_dtype_arg(name, dtype)
    if grad:
        return AG.apply("linear_cross_entropy", _linear_function, hidden, weight, bias, args, reduction, odt)
    h, w, b = given
    loss, _ = _linear_loss(args, h, w, b, reduction, odt)
    return loss


def _linear_loss(args, h, w, b, reduction, odt, scale=None, grads=(None, None, None), count=None):
    """(the loss as asked, the count of rows that count, unless given) of linear_cross_entropy's
    ``args``, with the gradients of ``_linear_chunks`` where ``scale`` is given."""
    kind, dt, dev, feats, classes, t, ignore, eps, z, per = args
    h2, t2 = h.reshape(A.count(tuple(h.shape[:-1])), feats), t.reshape(-1)  # (rows given: feats may be 0)
    per = per or _chunk_rows(h2.shape[0], feats, classes)
    rows = _linear_chunks(kind, dt, dev, h2, w, b, t2, ignore, eps, z, per, scale, grads)
    res, count = _reduce(kind, rows, t2, ignore, reduction, odt, count)
    return (res.reshape(tuple(h.shape[:-1])) if reduction == "none" else res), count


def grads_in_forward(reduction, float16, need):
    """Whether a differentiable linear_cross_entropy makes its gradients in
    the forward: some are needed (``need``: of hidden, weight, bias) of a
    loss of one value (mean or sum) of other than float16 data (float16's
    logits gradient, scaled by 1 / rows before a GradScaler's loss scale
    comes, would lose its small terms; its backward makes the chunks again)."""
    return reduction != "none" and not float16 and any(need)


def _linear_forward(args, h, w, b, reduction, odt, need):
    """(loss, count, gradients or None) of a differentiable call on torch
    tensors (detached). Where ``grads_in_forward`` and a gradient is needed
    (``need``: of h, w, b), (dh in h's shape, dw, db; None where not needed)
    for an incoming gradient of 1, made chunk by chunk as the loss is: the
    forward's logits chunks are the only ones made, and nothing is saved (not
    even the hidden states, whose memory the layer before may then free)."""
    torch = A.torch()
    dt, feats, t, ignore = args[1], args[3], args[5], args[6]
    if not grads_in_forward(reduction, dt == np.float16, need):
        loss, count = _linear_loss(args, h, w, b, reduction, odt)
        return loss, count, None
    cdt = A.numpy_to_torch_dtype(A.compute_dtype(dt))
    count = (t != ignore).sum()
    scale = (1 / count.to(cdt)).reshape(1) if reduction == "mean" else torch.ones(1, dtype=cdt, device=h.device)
    grads = _new_grads(torch, need, h, w, b, A.count(tuple(h.shape[:-1])), feats)
    loss, _ = _linear_loss(args, h, w, b, reduction, odt, scale, grads, count)
    return loss, count, _final_grads(grads, w, b, tuple(h.shape))


def _linear_backward(args, h, w, b, reduction, odt, g, count, need):
    """(dh, dw, db; None where not ``need``ed) of a call whose forward made
    none: the chunks made again, each row's gradient scaled by its incoming
    one ``g`` (a mean's over ``count``)."""
    cdt = A.numpy_to_torch_dtype(A.compute_dtype(args[1]))
    scale = g.to(cdt).reshape(-1).contiguous()
    if reduction == "mean":
        scale = scale / count.to(cdt)
    grads = _new_grads(A.torch(), need, h, w, b, A.count(tuple(h.shape[:-1])), args[3])
    _linear_loss(args, h, w, b, "none", odt, scale, grads)
    return _final_grads(grads, w, b, tuple(h.shape))


def linear_forward_rows(hidden, weight, bias, target, ignore_index, label_smoothing, z_loss, reduction, dtype,
                        chunk_rows, need):
    """The registered operator's forward (torch tensors; ``dtype`` a torch
    dtype or None, ``chunk_rows`` 0: the default): [loss, count, dh, dw, db],
    the gradients as ``_linear_forward`` makes them, empty where not made."""
    args, h, w, b = _op_args(hidden, weight, bias, target, ignore_index, label_smoothing, z_loss, reduction,
                             chunk_rows)
    odt = args[1] if dtype is None else A.torch_to_numpy_dtype(dtype)
    loss, count, grads = _linear_forward(args, h, w, b, reduction, odt, need)
    return [loss, count] + _or_empty(h, grads or (None, None, None))


def linear_backward_rows(g, hidden, weight, bias, target, count, ignore_index, label_smoothing, z_loss, reduction,
                         chunk_rows, need):
    """The registered operator's backward where its forward made no
    gradients: [dh, dw, db], empty where not ``need``ed."""
    args, h, w, b = _op_args(hidden, weight, bias, target, ignore_index, label_smoothing, z_loss, reduction,
                             chunk_rows)
    return _or_empty(h, _linear_backward(args, h, w, b, reduction, args[1], g, count, need))


def _op_args(hidden, weight, bias, target, ignore_index, label_smoothing, z_loss, reduction, chunk_rows):
    """(``_linear_args``, hidden, weight, bias detached) of the registered operators' arguments."""
    h, w, b = hidden.detach(), weight.detach(), None if bias is None else bias.detach()
    return (_linear_args("linear_cross_entropy", h, w, b, target, ignore_index, label_smoothing, z_loss, reduction,
                         chunk_rows or None), h, w, b)


def _or_empty(h, grads):
    """The gradients with an empty tensor (one each: an operator's results
    may not alias one another) for each None."""
    return [h.new_empty((0,)) if d is None else d for d in grads]


def _linear_function(torch):
    class LinearCrossEntropyFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, bias, args, reduction, odt):
            h, w, b = hidden.detach(), weight.detach(), None if bias is None else bias.detach()
            ctx.args, ctx.reduction, ctx.odt = args, reduction, odt
            loss, ctx.count, ctx.grads = _linear_forward(args, h, w, b, reduction, odt, ctx.needs_input_grad[:3])
            ctx.made = ctx.grads is not None
            if not ctx.made:  # (the target saved too: one changed in place since raises)
                ctx.save_for_backward(h, w, b, args[5])
            return loss

        @staticmethod
        @AG.once_differentiable
        def backward(ctx, g):
            if ctx.made:  # the forward's, scaled: handed over once
                if ctx.grads is None:
                    raise RuntimeError("cufuse.linear_cross_entropy: a second backward through the same graph "
                                       "(retain_graph=True) of a mean or sum loss: its gradients were made in the "
                                       "forward and handed to the first one; use reduction='none' and reduce that")
                grads, ctx.grads = ctx.grads, None
                gh, gw, gb = _scaled(grads, g)
            else:
                h, w, b, t = ctx.saved_tensors
                args = ctx.args[:5] + (t,) + ctx.args[6:]
                gh, gw, gb = _linear_backward(args, h, w, b, ctx.reduction, ctx.odt, g, ctx.count,
                                              ctx.needs_input_grad[:3])
            return gh, gw, gb, None, None, None

    return LinearCrossEntropyFn


_SCALE: list = []  # the fused in-place multiply of _scaled, made on first use


def _scaled(grads, g):
    """The gradients (None where absent) times the 0-dim ``g``, in place. On
    CUDA the factor is cast to each gradient's dtype first (what torch's
    ``d.mul_(g)`` does: the same bits) and multiplied in by one fused kernel:
    torch's ``mul_`` by a 0-dim CUDA tensor takes its non-vectorized kernel,
    2.2x slower on a 32000x2048 gradient (bench/NOTES.md). The CPU kernel
    multiplies by the factor unrounded: kept."""
    factors: dict = {}
    out = []
    for d in grads:
        if d is not None:
            if d.is_cuda:
                f = factors.get(d.dtype)
                if f is None:
                    f = factors[d.dtype] = g.to(d.dtype)
                if not _SCALE:
                    from .._fuse.api import Fused
                    _SCALE.append(Fused(lambda a, b: a * b, name="linear_cross_entropy_scale"))
                _SCALE[0](d, f, out=d)
            else:
                d = d.mul_(g)
        out.append(d)
    return out


def _final_grads(grads, w, b, shape):
    """The gradients as autograd takes them: the hidden states' in their
    ``shape``, the weight's and bias's first ``classes`` rows (``_new_grads``
    may pad them), the bias's (summed in float32 or float64) in the bias's
    dtype."""
    gh, gw, gb = grads
    classes = w.shape[0]
    return (None if gh is None else gh.reshape(shape), None if gw is None else gw[:classes],
            None if gb is None else gb[:classes].to(b.dtype))


def _new_grads(torch, need, h, w, b, rows, feats):
    """(dh [rows, features] in h's dtype, dw in w's, db in float32 zeros) where
    ``need`` says; on CUDA dw and db have the padded classes' rows
    (``_padded_classes``) that ``_cuda_chunks`` makes its products with."""
    classes = _padded_classes(w.shape[0]) if w.is_cuda else w.shape[0]
    gh = torch.empty((rows, feats), dtype=h.dtype, device=h.device) if need[0] else None
    gw = torch.empty((classes, feats), dtype=w.dtype, device=w.device) if need[1] else None
    gb = torch.zeros(classes, dtype=torch.float64 if b.dtype == torch.float64 else torch.float32,
                     device=w.device) if b is not None and need[2] else None
    return gh, gw, gb


def _padded_classes(classes):
    """The weight's rows in ``_cuda_chunks``' products: a multiple of 8, since
    cuBLAS's fast kernels want every dimension 16-byte aligned (each product
    of GPT-2's 50257 classes is 5-7x slower than of 50264)."""
    return -(-classes // 8) * 8
