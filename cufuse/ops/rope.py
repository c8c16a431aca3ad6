"""Rotary position embedding applied to q and k (Hugging Face's
``apply_rotary_pos_emb``): one generated kernel per tensor that reads each
element once and writes the rotated result into one output (the two halves
of each rotated pair are two strided views of it), forward and backward.

Built on ``cufuse.fuse``: the rotation is a fused function of the two halves
(or the even and odd elements) of the rotary dims and of cos and sin,
broadcast over the heads; its transpose is the backward.
"""
from __future__ import annotations

from .. import _arrays as A
from .._arrays import Array
from .. import _autograd as AG
from .. import _dask as DK
from .. import _driver as D
from .. import _runtime as R
from .. import _torch_ops as TO
from .._fuse.api import Fused

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
        cos, sin = cos[position_ids], sin[position_ids]
    nd = len(q.shape)
    if len(cos.shape) == nd - 1:  # (batch, tokens, r): the heads' dim added (HF's unsqueeze_dim)
        cos, sin = (t.reshape(tuple(t.shape[:unsqueeze_dim]) + (1,) + tuple(t.shape[unsqueeze_dim:]))
                    for t in (cos, sin))
    elif len(cos.shape) == 2 and unsqueeze_dim == nd - 2:  # (tokens, r) with the heads after the tokens
        cos, sin = (t.reshape((t.shape[0], 1, r)) for t in (cos, sin))
    elif len(cos.shape) not in (2, nd):
        raise ValueError(f"cufuse.{name}: cos and sin of shape {tuple(cos.shape)} do not fit q of shape "
                         f"{tuple(q.shape)} (expected (batch, tokens, {r}), (tokens, {r}) or q's number of dims)")
    return cos, sin, r


def _apply(fn, x, cos, sin, r, interleaved, kind, dt, dev):
    """fn's rotation of x's rotary dims into a new array of x's shape (the rest copied)."""
    if kind in A.GPU_KINDS:
        with R._cp.cuda.Device(dev):
            out = D.empty_like(x, kind)
    else:
        out = D.empty_like(x, kind)
    fn(*_halves(x, r, interleaved), *_halves(cos, r, interleaved), *_halves(sin, r, interleaved),
       out=_halves(out, r, interleaved))
    if r < x.shape[-1]:
        D.copy_into(out[..., r:], x[..., r:], kind)
    return out


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
    (batch, tokens, heads, dim)); (tokens, r) tables broadcast too; with
    ``position_ids`` (batch, tokens) integers, cos and sin are (positions,
    r) tables gathered per token. q and k may have different head counts
    (grouped-query attention). cos and sin are cast to q's dtype first (as
    Hugging Face's rotary embedding does). Returns (q_rotated, k_rotated),
    new arrays of q's kind; differentiable for torch tensors (the backward:
    the transposed rotation, one kernel per tensor)."""
    name = "rope"
    if TO.compiling():  # torch.compile: checked with torch's attributes only (Dynamo traces this)
        return _compiled(q, k, cos, sin, position_ids, unsqueeze_dim, bool(interleaved))
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
    if isinstance(unsqueeze_dim, bool) or not isinstance(unsqueeze_dim, int) or not 0 <= unsqueeze_dim < nd - 1:
        raise ValueError(f"cufuse.{name}: unsqueeze_dim must be an int in [0, {nd - 1}), got {unsqueeze_dim!r}")
    if k is not None:
        _check(name, k, "k", kind, dt, dev, nd)
        if k.shape[-1] != q.shape[-1]:
            raise ValueError(f"cufuse.{name}: q's head dim is {q.shape[-1]} and k's {k.shape[-1]}")
    grad = kind in (A.TORCH_CPU, A.TORCH_CUDA)
    cos, sin, r = _tables(name, q, cos, sin, position_ids, unsqueeze_dim, kind, dt, dev)
    interleaved = bool(interleaved)
    if grad and AG.wants_grad((q, k)):
        return AG._function_class("rope", _function).apply(q, k, cos, sin, r, interleaved)
    return (_apply(_ROT, q, cos, sin, r, interleaved, kind, dt, dev),
            None if k is None else _apply(_ROT, k, cos, sin, r, interleaved, kind, dt, dev))


def _compiled(q, k, cos, sin, position_ids, unsqueeze_dim, interleaved):
    """rope under torch.compile: the rotation through the fused functions'
    operator (its backward generated), the halves joined by torch."""
    import torch
    name = "cufuse.rope"
    for what, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dtype not in A.torch_floats()):
            raise TypeError(f"{name}: under torch.compile, {what} must be a float tensor")
    if k is not None and (k.dtype != q.dtype or k.shape[-1] != q.shape[-1] or k.dim() != q.dim()):
        raise ValueError(f"{name}: k must have q's dtype, head dim and number of dims")
    r = cos.shape[-1]
    if r == 0 or r % 2 or r > q.shape[-1] or cos.shape != sin.shape:
        raise ValueError(f"{name}: cos and sin must have one shape whose last dim is even and at most q's head dim")
    cos, sin = cos.detach().to(q.dtype), sin.detach().to(q.dtype)
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    if cos.dim() == q.dim() - 1:
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    elif cos.dim() == 2 and unsqueeze_dim == q.dim() - 2:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def one(x):
        o1, o2 = _ROT(*_halves(x, r, interleaved), *_halves(cos, r, interleaved), *_halves(sin, r, interleaved))
        rot = torch.stack((o1, o2), -1).flatten(-2) if interleaved else torch.cat((o1, o2), -1)
        return rot if r == x.shape[-1] else torch.cat((rot, x[..., r:]), -1)
    return one(q), (None if k is None else one(k))


def _function(torch):
    class RopeFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, cos, sin, r, interleaved):
            ctx.r, ctx.interleaved = r, interleaved
            ctx.save_for_backward(cos, sin)
            ctx.has_k = k is not None
            kind = A.TORCH_CUDA if q.is_cuda else A.TORCH_CPU
            dt, dev = A.dtype_of(q, kind), A.device_of(q, kind)
            return tuple(None if x is None else _apply(_ROT, x.detach(), cos, sin, r, interleaved, kind, dt, dev)
                         for x in (q, k))

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, gq, gk):
            cos, sin = ctx.saved_tensors
            res = []
            for g, needed in ((gq, ctx.needs_input_grad[0]), (gk, ctx.needs_input_grad[1])):
                if g is None or not needed:
                    res.append(None)
                    continue
                kind = A.TORCH_CUDA if g.is_cuda else A.TORCH_CPU
                res.append(_apply(_ROT_T, g, cos, sin, ctx.r, ctx.interleaved, kind, A.dtype_of(g, kind),
                                  A.device_of(g, kind)))
            return res[0], res[1], None, None, None, None

    return RopeFn
