"""Rotary position embedding applied to q and k (Hugging Face's
``apply_rotary_pos_emb``): on the GPU one kernel (kernels/rope.cu) rotates
q and k in one launch, reading each element once and writing each once,
forward and backward (the transposed rotation); cos and sin are read
through their broadcast strides (nothing head-sized is built).

On the CPU backends the rotation is a fused function of the two halves (or
the even and odd elements) of the rotary dims and of cos and sin
(``cufuse.fuse``'s NumPy evaluation); it also serves layouts the kernel does
not take (more than 2**31 rows).
"""
from __future__ import annotations

import numpy as np

from .. import _arrays as A
from .._arrays import Array
from .. import _autograd as AG
from .. import _dask as DK
from .. import _driver as D
from .. import _runtime as R
from .. import _torch_ops as TO
from .._fuse.api import Fused

FAMILY = "rope"
_EXPRS = {dt: R.register(FAMILY, R.name_expression("rope", ct), "rope", dt.name) for dt, ct in R.FLOAT_CTYPES.items()}
_THREADS = 256  # kernels/rope.cu: kRopeThreads
_MAX_ROWS = 2 ** 31  # the kernel counts rows in 32 bits

# out1 = x1 c1 - x2 s1, out2 = x2 c2 + x1 s2 (HF: x * cos + rotate_half(x) * sin, per element)
_ROT = Fused(lambda x1, x2, c1, c2, s1, s2: (x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), name="rope")
# its transpose: the gradient of x from the gradient of out
_ROT_T = Fused(lambda g1, g2, c1, c2, s1, s2: (g1 * c1 + g2 * s2, g2 * c2 - g1 * s1), name="rope_backward")


def _halves(a, r, interleaved):
    """The two halves of the rotary dims [0, r) of ``a`` (views): [0, r/2) and
    [r/2, r), or the even and odd elements where ``interleaved``."""
    if interleaved:
        return a[..., 0:r:2], a[..., 1:r:2]
    return a[..., : r // 2], a[..., r // 2: r]


def _check(name, x, what, kind, dt, dev, ndim):
    k = A.array_kind(name, x, what)
    if k != kind:
        raise TypeError(f"cufuse.{name}: {what} is {A.describe(x, k)}; q is {kind}: pass the same array kind")
    if A.dtype_of(x, k) != dt:
        raise TypeError(f"cufuse.{name}: {what} has dtype {A.dtype_of(x, k)}, q has {dt}: pass the same dtype")
    if k in A.GPU_KINDS and A.device_of(x, k) != dev:
        raise ValueError(f"cufuse.{name}: {what} is on GPU {A.device_of(x, k)}, q on GPU {dev}")
    if len(x.shape) != ndim:
        raise ValueError(f"cufuse.{name}: {what} has shape {tuple(x.shape)}; q and k must have the same number of "
                         "dims")


def _tables(name, q, cos, sin, position_ids, unsqueeze_dim, kind, dt, dev):
    """cos and sin in q's kind and dtype, shaped to broadcast against q's rotary dims."""
    out = []
    for what, t in (("cos", cos), ("sin", sin)):
        k = A.array_kind(name, t, what)
        if k != kind:
            raise TypeError(f"cufuse.{name}: {what} is {A.describe(t, k)}; q is {kind}: pass the same array kind")
        if k in (A.TORCH_CPU, A.TORCH_CUDA) and t.requires_grad and A.torch().is_grad_enabled():
            raise NotImplementedError(f"cufuse.{name}: {what} requires grad; the rotary tables get no gradient "
                                      "(pass them detached)")
        tdt = A.dtype_of(t, k)
        if tdt not in A.FLOAT_DTYPES:
            raise TypeError(f"cufuse.{name}: {what} has dtype {tdt}; accepted dtypes are {A.FLOAT_NAMES}")
        if k in A.GPU_KINDS and A.device_of(t, k) != dev:
            raise ValueError(f"cufuse.{name}: {what} is on GPU {A.device_of(t, k)}, q on GPU {dev}")
        if k in (A.TORCH_CPU, A.TORCH_CUDA):
            t = t.detach()
        if tdt != dt:  # Hugging Face casts them to the activations' dtype
            t = D.astype(t, dt, kind)
        out.append(t)
    cos, sin = out
    if tuple(cos.shape) != tuple(sin.shape):
        raise ValueError(f"cufuse.{name}: cos has shape {tuple(cos.shape)} and sin {tuple(sin.shape)}")
    r = cos.shape[-1] if len(cos.shape) else 0
    d = q.shape[-1]
    if r == 0 or r % 2 or r > d:
        raise ValueError(f"cufuse.{name}: the rotary dims (cos.shape[-1] = {r}) must be even, at least 2 and at most "
                         f"q's head dim {d}")
    if position_ids is not None:  # cos and sin are tables [positions, r], gathered per (batch, token)
        if len(cos.shape) != 2:
            raise ValueError(f"cufuse.{name}: with position_ids, cos and sin are tables (positions, {r}); got shape "
                             f"{tuple(cos.shape)}")
        if A.array_kind(name, position_ids, "position_ids") != kind:
            raise TypeError(f"cufuse.{name}: position_ids must be q's array kind ({kind})")
        if A.dtype_of(position_ids, kind).kind not in "iu":
            raise TypeError(f"cufuse.{name}: position_ids must hold integers, got {A.dtype_of(position_ids, kind)}")
        if kind in A.GPU_KINDS and A.device_of(position_ids, kind) != dev:
            raise ValueError(f"cufuse.{name}: position_ids is on GPU {A.device_of(position_ids, kind)}, q on GPU "
                             f"{dev}")
        pos = D.astype(position_ids, np.dtype(np.int64), kind)  # (torch reads uint8 indices as a mask)
        n = cos.shape[0]
        if kind not in A.GPU_KINDS and A.count(tuple(pos.shape)) and not -n <= int(pos.min()) <= int(pos.max()) < n:
            # (negative ones count from the end, as the indexing of Hugging Face's tables; GPU ones are not
            # read: that would wait for the device)
            raise ValueError(f"cufuse.{name}: position_ids hold values in [{int(pos.min())}, {int(pos.max())}]; the "
                             f"tables have {n} positions")
        cos, sin = cos[pos], sin[pos]
    nd = len(q.shape)
    if nd > 2 and len(cos.shape) == nd - 1:  # (batch, tokens, r): the heads' dim added (HF's unsqueeze_dim)
        cos, sin = (t.reshape(tuple(t.shape[:unsqueeze_dim]) + (1,) + tuple(t.shape[unsqueeze_dim:]))
                    for t in (cos, sin))
    elif nd > 2 and len(cos.shape) == 2 and unsqueeze_dim == nd - 2:  # (tokens, r) with the heads after the tokens
        cos, sin = (t.reshape((t.shape[0], 1, r)) for t in (cos, sin))
    elif len(cos.shape) not in (2, nd):
        raise ValueError(f"cufuse.{name}: cos and sin of shape {tuple(cos.shape)} do not fit q of shape "
                         f"{tuple(q.shape)} (expected (batch, tokens, {r}), (tokens, {r}) or q's number of dims)")
    return cos, sin, r


def _apply(fn, x, cos, sin, r, interleaved, kind, dt, dev):
    """fn's rotation of x's rotary dims into a new array of x's shape (the rest copied)."""
    st = out_strides(tuple(x.shape), A.strides_of(x, kind), _aligned(x, kind)) if kind in A.GPU_KINDS else None
    with D.on_device(kind, dev):
        out = D.empty_like(x, kind) if st is None else D.empty_dense(tuple(x.shape), dt, kind, dev, st)
    fn(*_halves(x, r, interleaved), *_halves(cos, r, interleaved), *_halves(sin, r, interleaved),
       out=_halves(out, r, interleaved))
    if r < x.shape[-1]:
        D.copy_into(out[..., r:], x[..., r:], kind)
    return out


def _fits(table_lead, lead):
    """Whether tables with leading dims ``table_lead`` broadcast to rows ``lead`` (never growing them)."""
    if len(table_lead) > len(lead):
        return False
    # (== rather than `in`: under torch.compile `4 in (1, m)` of a symbolic m is False, not a guard)
    return all(n == 1 or n == m for n, m in zip(reversed(table_lead), reversed(lead)))


def _tables_for_kernel(cos, sin, kind):
    """cos and sin with one set of strides, rows contiguous and elements aligned
    (copies where they are not: they are small)."""
    cs, ss = A.strides_of(cos, kind), A.strides_of(sin, kind)
    item = A.dtype_of(cos, kind).itemsize
    if cs != ss or cs[-1] != 1 or A.pointer_of(cos, kind) % item or A.pointer_of(sin, kind) % item:
        cos, sin = D.fresh_copy(cos, kind), D.fresh_copy(sin, kind)
        if A.strides_of(cos, kind) != A.strides_of(sin, kind):  # (size-1 dims may differ)
            cos, sin = D.dense(cos, tuple(cos.shape), kind), D.dense(sin, tuple(sin.shape), kind)
    return cos, sin


def out_strides(shape, strides, aligned=True):
    """Element strides of the GPU result of rotating an array of ``shape`` and
    ``strides``: its own where it is dense (every element once, in some
    order of its dims, rows contiguous and ``aligned``: a transposed view of
    a projection's output keeps its layout, as ``torch.empty_like`` does),
    else None (C order)."""
    if not shape or len(shape) > 4 or 0 in shape or strides[-1] != 1 or not aligned or \
            A.is_c_contiguous(shape, strides):
        return None  # (more than 3 leading dims may not collapse to the kernel's 3: C order, as _plan makes them)
    expect = 1
    for s, n in sorted((s, n) for n, s in zip(shape, strides) if n != 1):
        if s != expect:
            return None
        expect *= n
    return tuple(strides)


def _aligned(x, kind):
    return A.pointer_of(x, kind) % A.dtype_of(x, kind).itemsize == 0


def _plan(x, cos, sin, r, kind, ostr):
    """(x, cos, sin, out strides, dims) for one tensor: x with contiguous rows,
    and its rows as at most 3 dims (outer first) with x's, the tables' and
    the output's strides (``ostr``, None: C order): dims = (rows, nb, nc, xa,
    xb, xc, ca, cb, cc, oa, ob, oc). Tables that need more dims (or x that
    does) are made dense first, and the output C order."""
    lead = tuple(x.shape[:-1])
    item = A.dtype_of(x, kind).itemsize
    if A.strides_of(x, kind)[-1] != 1 or A.pointer_of(x, kind) % item:
        x = D.fresh_copy(x, kind)
    for attempt in range(2):
        xs = list(A.strides_of(x, kind)[:-1])
        cst = A.broadcast_strides(tuple(cos.shape[:-1]), A.strides_of(cos, kind)[:-1], lead)
        ost = list((ostr or A.c_strides(tuple(x.shape)))[:-1])
        shp, (sx, sc, so) = A.collapse(lead, [xs, cst, ost])
        if len(shp) <= 3:
            break
        x, ostr = D.contiguous(x, kind), None
        cos, sin = (D.dense(t, lead + (r,), kind) for t in (cos, sin))
    pad = 3 - len(shp)
    shp, sx, sc, so = shp + [1] * pad, sx + [0] * pad, sc + [0] * pad, so + [0] * pad  # innermost first
    return x, cos, sin, ostr, (A.count(lead), shp[1], shp[0], sx[2], sx[1], sx[0], sc[2], sc[1], sc[0], so[2], so[1],
                               so[0])


def _vec(dt, d, r, dims, *ptrs):
    """Whether a tensor's rows take 16-byte packs: head dim, half the rotary
    dims and every stride whole packs, every pointer 16-byte aligned."""
    v = 16 // dt.itemsize
    return (d % v == 0 and (r // 2) % v == 0 and all(s % v == 0 for s in dims[3:])
            and all(p % 16 == 0 for p in ptrs))


def _steps(b, fn, dt, dev, jobs, tables, r, interleaved, bwd):
    """Add to recipe builder ``b`` one launch for one or two jobs (out slot,
    x slot, x pointer, dims) sharing the tables (cos, sin: slots, pointers)."""
    (cs, ps_cos), (ss, ps_sin) = tables
    d = jobs[0][4]
    args, units = [], 0
    for so, sx, px, dims, _ in jobs:
        # the output is a fresh allocation (16-byte aligned) with strides in dims
        vec = _vec(dt, d, r, dims, px, ps_cos, ps_sin)
        v = 16 // dt.itemsize if vec else 1
        units = max(units, r // 2 // v + (d - r) // v)
        args += [so, sx, *(np.uint32(n) for n in dims[:3]), *(np.int64(s) for s in dims[3:]), np.bool_(vec)]
    if len(jobs) == 1:
        args += args  # (blockIdx.y is 0 only)
    args += [cs, ss, np.int32(d), np.int32(r), np.bool_(interleaved), np.bool_(bwd)]
    bx = min(units, _THREADS)
    by = _THREADS // bx
    rows = max(dims[0] for _, _, _, dims, _ in jobs)
    grid = max(1, min(-(-rows // by), R.sm_count(dev) * (2048 // _THREADS) * 4))
    b.launch(fn, (grid, len(jobs)), (bx, by), args)


_FAST = D.FastPath("rope")


def rotate(xs, cos, sin, r, interleaved, bwd, kind, dt, dev, also=None):
    """Each array of ``xs`` (q, or q and k) rotated over its first ``r`` dims
    by cos and sin (shaped to broadcast against its rows), or by the
    transposed rotation where ``bwd`` (the gradient); new arrays of x's shape
    and kind, in x's layout where it is dense on the GPU (``out_strides``), else C order. One launch on the GPU, kept as the recipe of the
    call's signature (the driver's fast path) where it needed no copies;
    also under ``also`` = (key, input pointers) where those are the same."""
    if kind not in A.GPU_KINDS or any(A.count(tuple(x.shape[:-1])) >= _MAX_ROWS for x in xs):
        return [_apply(_ROT_T if bwd else _ROT, x, cos, sin, r, interleaved, kind, dt, dev) for x in xs]
    s = D.signature((*xs, cos, sin))
    key = None
    if s is not None:
        key = (s[0], interleaved, bwd)
        res = _FAST.run(key, s[1], len(s[1]), None)
        if res is not None:
            return res
    with D.on_device(kind, dev):  # (copies and outputs on the arrays' GPU, whichever is current)
        return _rotate_general(xs, cos, sin, r, interleaved, bwd, kind, dt, dev, s, key, also)


def _rotate_general(xs, cos, sin, r, interleaved, bwd, kind, dt, dev, s, key, also):
    """rotate's general path: the kernel's view of each array (copies where it
    needs them), one recipe, kept where nothing was copied."""
    tc, ts = _tables_for_kernel(cos, sin, kind)
    plans = [_plan(x, tc, ts, r, kind, out_strides(tuple(x.shape), A.strides_of(x, kind), _aligned(x, kind)))
             for x in xs]
    n = len(xs)
    ins = [p[0] for p in plans] + [tc, ts]
    b = D.RecipeBuilder(kind, dev, n, n + 2)
    fn = R.get_function(FAMILY, _EXPRS[dt], dev)
    shared, alone = [], []  # jobs that read the tables as given / through their own dense copies
    for i, (px, pc, pt, _, dims) in enumerate(plans):
        if dims[0] == 0 or px.shape[-1] == 0:
            continue
        job = (D.out_(i), D.in_(i), A.pointer_of(px, kind), dims, px.shape[-1])
        if pc is tc:
            shared.append(job)
        else:
            ins += [pc, pt]
            alone.append((job, pc, pt))
    tables = ((D.in_(n), A.pointer_of(tc, kind)), (D.in_(n + 1), A.pointer_of(ts, kind)))
    if shared:
        _steps(b, fn, dt, dev, shared, tables, r, interleaved, bwd)
    for job, pc, pt in alone:  # (their tables passed as values: this call's copies)
        _steps(b, fn, dt, dev, [job], ((A.pointer_of(pc, kind),) * 2, (A.pointer_of(pt, kind),) * 2), r,
               interleaved, bwd)
    item = dt.itemsize
    rec = b.build([D.output(tuple(x.shape), dt, kind, p[3]) for x, p in zip(xs, plans)],
                  [D.view_span(tuple(x.shape), p[3] or A.c_strides(tuple(x.shape)), item) for x, p in zip(xs, plans)],
                  [D.view_span(tuple(a.shape), A.strides_of(a, kind), item) for a in ins[:n + 2]])
    in_ptrs = [A.pointer_of(a, kind) for a in ins[:n + 2]]
    copied = alone or any(a is not x for a, x in zip(ins, (*xs, cos, sin)))
    res = D.run_general(rec, None, None, in_ptrs, fast=_FAST, key=None if copied or s is None else key)
    if also is not None and not copied and list(also[1]) == in_ptrs:
        _FAST.put(also[0], rec)
    return res


def rotate_tensors(xs, cos, sin, interleaved, bwd):
    """``rotate`` for torch tensors (the registered operator's body)."""
    kind = A.TORCH_CUDA if xs[0].is_cuda else A.TORCH_CPU
    return rotate(list(xs), cos, sin, cos.shape[-1], interleaved, bwd, kind, A.dtype_of(xs[0], kind),
                  A.device_of(xs[0], kind))


def rope(q: Array, k: Array | None, cos: Array, sin: Array, /, *, position_ids: Array | None = None,
         unsqueeze_dim: int = 1, interleaved: bool = False) -> tuple[Array, Array | None]:
    """Rotary position embedding of ``q`` and ``k`` (``k`` may be None):
    ``x * cos + rotate(x) * sin`` over the first ``r = cos.shape[-1]`` dims
    of the last axis (partial rotary: the rest pass through), with
    ``rotate`` Hugging Face's ``rotate_half`` (``[-x2, x1]`` of the two
    halves) or, with ``interleaved``, of the even and odd elements (GPT-J's
    layout). As ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)``:
    ``cos``/``sin`` of shape (batch, tokens, r) get a dim inserted at
    ``unsqueeze_dim`` (1 for q of (batch, heads, tokens, dim), 2 for
    (batch, tokens, heads, dim)); (tokens, r) tables broadcast too (a q of
    (tokens, dim) takes them as they are: no heads' dim); with
    ``position_ids`` (batch, tokens) integers, cos and sin are (positions,
    r) tables gathered per token. With ``interleaved`` the tables hold each
    frequency twice in a row (GPT-J's ``repeat_interleave``; Hugging Face's
    Llama tables, two copies of the frequencies one after the other, go with
    the default). q and k may have different head counts
    (grouped-query attention). cos and sin are cast to q's dtype first (as
    Hugging Face's rotary embedding does). Returns (q_rotated, k_rotated),
    new arrays of q's kind; differentiable for torch tensors (the backward:
    the transposed rotation, one kernel per tensor)."""
    name = "rope"
    if not isinstance(interleaved, (bool, np.bool_)):  # ("False" would be True)
        raise TypeError(f"cufuse.{name}: interleaved must be a bool, got {type(interleaved).__name__}")
    if TO.compiling():  # torch.compile: checked with torch's attributes only (Dynamo traces this)
        return _compiled(q, k, cos, sin, position_ids, unsqueeze_dim, bool(interleaved))
    top = None
    if position_ids is None:  # the fast path: a call of a signature seen before (no validation again)
        s = D.signature((q, k, cos, sin))
        if s is not None and type(unsqueeze_dim) is int:
            top = (("rope", s[0], unsqueeze_dim, bool(interleaved)), s[1])
            res = _FAST.run(top[0], s[1], len(s[1]), None)
            if res is not None:
                return res[0], (None if k is None else res[1])
    if DK.is_dask(q):
        raise TypeError(f"cufuse.{name}: Dask arrays are not supported")
    kind = A.array_kind(name, q, "q")
    dt = A.dtype_of(q, kind)
    if dt not in A.FLOAT_DTYPES:
        raise TypeError(f"cufuse.{name}: q is {A.describe(q, kind)}; accepted dtypes are {A.FLOAT_NAMES}")
    dev = A.device_of(q, kind)
    nd = len(q.shape)
    if nd < 2:
        raise ValueError(f"cufuse.{name}: q must have a head dim and at least one more dim, got shape {tuple(q.shape)}")
    if isinstance(unsqueeze_dim, (bool, np.bool_)) or not isinstance(unsqueeze_dim, (int, np.integer)):
        raise TypeError(f"cufuse.{name}: unsqueeze_dim must be an int, got {type(unsqueeze_dim).__name__}")
    unsqueeze_dim = int(unsqueeze_dim)
    if nd > 2 and not 0 <= unsqueeze_dim < nd - 1:  # (a q of (tokens, dim) has no heads' dim to insert)
        raise ValueError(f"cufuse.{name}: unsqueeze_dim must be an int in [0, {nd - 1}), got {unsqueeze_dim!r}")
    if k is not None:
        _check(name, k, "k", kind, dt, dev, nd)
        if k.shape[-1] != q.shape[-1]:
            raise ValueError(f"cufuse.{name}: q's head dim is {q.shape[-1]} and k's {k.shape[-1]}")
    grad = kind in (A.TORCH_CPU, A.TORCH_CUDA)
    with D.on_device(kind, dev):
        cos, sin, r = _tables(name, q, cos, sin, position_ids, unsqueeze_dim, kind, dt, dev)
    for what, x in (("q", q), ("k", k)):
        if x is not None and not _fits(tuple(cos.shape[:-1]), tuple(x.shape[:-1])):
            raise ValueError(f"cufuse.{name}: cos and sin (as shaped for q: {tuple(cos.shape)}) do not broadcast "
                             f"against {what}'s rows {tuple(x.shape[:-1])}" + (
                                 "; a 3-D q is read as (tokens, heads, dim) with unsqueeze_dim=1, as Hugging Face's "
                                 "function reads it: for (batch, tokens, dim) pass unsqueeze_dim=0"
                                 if nd == 3 and unsqueeze_dim == 1 else ""))
    interleaved = bool(interleaved)
    if grad and AG.wants_grad((q, k)):
        return AG.apply("rope", _function, q, k, cos, sin, r, interleaved)
    res = rotate([q] if k is None else [q, k], cos, sin, r, interleaved, False, kind, dt, dev, also=top)
    return res[0], (None if k is None else res[1])


def _compiled(q, k, cos, sin, position_ids, unsqueeze_dim, interleaved):
    """rope under torch.compile: the tables shaped by torch ops, the rotation
    of q and k through the registered operator (torch.ops.cufuse.rope, its
    backward the transposed rotation)."""
    import torch
    name = "cufuse.rope"
    for what, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dtype not in A.torch_floats()):
            raise TypeError(f"{name}: under torch.compile, {what} must be a float tensor")
    if k is not None and (k.dtype != q.dtype or k.shape[-1] != q.shape[-1] or k.dim() != q.dim()):
        raise ValueError(f"{name}: k must have q's dtype, head dim and number of dims")
    for what, t in (("k", k), ("cos", cos), ("sin", sin), ("position_ids", position_ids)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name}: {what} is on {t.device}, q on {q.device}")
    if isinstance(unsqueeze_dim, bool) or not isinstance(unsqueeze_dim, int) or (
            q.dim() > 2 and not 0 <= unsqueeze_dim < q.dim() - 1):
        raise ValueError(f"{name}: unsqueeze_dim must be an int in [0, {q.dim() - 1}), got {unsqueeze_dim!r}")
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise NotImplementedError(f"{name}: cos or sin requires grad; the rotary tables get no gradient (pass them "
                                  "detached)")
    r = cos.shape[-1]
    if r == 0 or r % 2 or r > q.shape[-1] or cos.shape != sin.shape:
        raise ValueError(f"{name}: cos and sin must have one shape whose last dim is even and at most q's head dim")
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    if position_ids is not None:
        if position_ids.dtype.is_floating_point or position_ids.dtype == torch.bool:
            raise TypeError(f"{name}: position_ids must hold integers, got {position_ids.dtype}")
        if cos.dim() != 2:
            raise ValueError(f"{name}: with position_ids, cos and sin are tables (positions, {r}); got shape "
                             f"{tuple(cos.shape)}")
        pos = position_ids.long()  # (torch reads uint8 indices as a mask)
        cos, sin = cos[pos], sin[pos]
    if q.dim() > 2 and cos.dim() == q.dim() - 1:
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    elif q.dim() > 2 and cos.dim() == 2 and unsqueeze_dim == q.dim() - 2:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    xs = [q] if k is None else [q, k]
    if not all(_fits(tuple(cos.shape[:-1]), tuple(x.shape[:-1])) for x in xs):
        raise ValueError(f"{name}: cos and sin (as shaped: {tuple(cos.shape)}) do not broadcast against q and k")
    res = TO.rope(xs, cos, sin, interleaved)
    return res[0], (None if k is None else res[1])


def _function(torch):
    class RopeFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, cos, sin, r, interleaved):
            ctx.r, ctx.interleaved = r, interleaved
            ctx.save_for_backward(cos, sin)
            kind = A.TORCH_CUDA if q.is_cuda else A.TORCH_CPU
            xs = [q.detach()] if k is None else [q.detach(), k.detach()]
            res = rotate(xs, cos, sin, r, interleaved, False, kind, A.dtype_of(q, kind), A.device_of(q, kind))
            return res[0], (None if k is None else res[1])

        @staticmethod
        @AG.once_differentiable
        def backward(ctx, gq, gk):
            cos, sin = ctx.saved_tensors
            want = [i for i, (g, needed) in enumerate(((gq, ctx.needs_input_grad[0]), (gk, ctx.needs_input_grad[1])))
                    if g is not None and needed]
            res = [None, None]
            if want:
                gs = [(gq, gk)[i] for i in want]
                kind = A.TORCH_CUDA if gs[0].is_cuda else A.TORCH_CPU
                got = rotate(gs, cos, sin, ctx.r, ctx.interleaved, True, kind, A.dtype_of(gs[0], kind),
                             A.device_of(gs[0], kind))
                for i, g in zip(want, got):
                    res[i] = g
            return res[0], res[1], None, None, None, None

    return RopeFn
