"""Attention: ``softmax(q k^T * scale) v`` per head, as FlashAttention
computes it (kernels/attention.cu): on the GPU, float16 and bfloat16 run on
tensor cores with an online softmax, so nothing sequence x sequence is ever
written to memory, forward and backward (the backward recomputes the
probabilities from the per-row log-sum-exp the forward keeps).

float32 and float64 (on the GPU) and every CPU array take the dense path:
the same math with the score matrix materialized (NumPy on the CPU, in
float64; CuPy on the GPU, in the array's dtype); it serves small problems and
is the reference the kernels are tested against.
"""
from __future__ import annotations

import math

import numpy as np

from .. import _arrays as A
from .._arrays import Array
from .. import _autograd as AG
from .. import _dask as DK
from .. import _driver as D
from .. import _runtime as R
from .. import _torch_ops as TO
from . import _rows

FAMILY = "attention"
HEAD_DIMS = (16, 32, 48, 64, 80, 96, 112, 128)  # the kernels' head dims (16-bit dtypes on the GPU)
# the backward per head dim: attention_backward_kv's (warps, key tiles of 16
# per warp, query rows per tile) and attention_backward_q's (warps, row
# tiles of 16 per warp, keys per tile)
_BWD_CFG = {d: ((4, 1, 64 if d <= 64 else 32), (4, 1, 64 if d <= 64 else 32)) for d in HEAD_DIMS}
# the forward per head dim: (row tiles of 16 per warp, keys per tile, warps
# per block). Two row tiles let each K and V fragment read from shared
# memory feed two products; above head dim 64, eight warps share each K and
# V tile (H200 sweep, bench/NOTES.md: `attention_probe.py float16 sweep`).
_FWD_CFG = {d: (2, 64, 4 if d <= 64 else 8) for d in HEAD_DIMS}
_KERNELS = ("attention_forward", "attention_backward_kv", "attention_backward_q")
# The Hopper forward (kernels/attention_sm90.cu: wgmma, compiled for sm_90a and run on compute capability 9.0
# only) per head dim: (keys per tile, warpgroups of 64 query rows per block). Other head dims and GPUs: the
# mma.sync forward above. _PATH = "sm80" forces that one (the tests run both on a Hopper GPU).
_SM90_CFG = {64: (64, 2), 128: (128, 2)}
_PATH = None
_LOG2E = 1.4426950408889634
_F32 = np.dtype(np.float32)


def _part(d, dt):
    return f"{FAMILY}:{d}_{dt.name}"  # one module per head dim and dtype: a first call compiles three kernels


_EXPRS: dict = {}


def _expr(kern, d, dt):
    """The name expression of a kernel, its head dim's part registered on first use (the three kernels
    together, so that the part compiles once)."""
    key = (kern, d, dt, _FWD_CFG[d], _BWD_CFG[d])
    e = _EXPRS.get(key)
    if e is None:
        mt, bn, warps = _FWD_CFG[d]
        cfg = {"attention_forward": (warps, mt, bn), "attention_backward_kv": _BWD_CFG[d][0],
               "attention_backward_q": _BWD_CFG[d][1]}
        for kn in _KERNELS:
            _EXPRS[(kn, d, dt, _FWD_CFG[d], _BWD_CFG[d])] = R.register(
                _part(d, dt), R.name_expression(kn, R.FLOAT_CTYPES[dt], str(d), *map(str, cfg[kn])),
                f"{kn.replace('attention_', '')} d{d}", dt.name, min_arch=80)
        e = _EXPRS[key]
    return e


def register_all():
    """Register every kernel (``python -m cufuse build`` compiles what is registered)."""
    for dt in A.HALVES:
        for d in HEAD_DIMS:
            _expr(_KERNELS[0], d, dt)


register_all()


def _sm90_part(d, dt):
    return f"{FAMILY}_sm90:{d}_{dt.name}"


def _sm90_expr(d, dt):
    """The Hopper forward's name expression (registered on first use of a tile choice)."""
    key = (d, dt, _SM90_CFG[d])
    e = _SM90_EXPRS.get(key)
    if e is None:
        bn, wgs = _SM90_CFG[d]
        e = _SM90_EXPRS[key] = R.register(
            _sm90_part(d, dt), R.name_expression("attention_forward_sm90", R.FLOAT_CTYPES[dt], str(d), str(bn),
                                                 str(wgs)), f"forward sm90 d{d}", dt.name, min_arch=90, specific=True)
    return e


_SM90_EXPRS: dict = {}
for _dt in A.HALVES:
    for _d in _SM90_CFG:
        _sm90_expr(_d, _dt)
_DELTA = {dt: R.register(f"{FAMILY}:delta", R.name_expression("attention_delta", R.FLOAT_CTYPES[dt]), "delta",
                         dt.name) for dt in A.HALVES}


SCORE_DIMS = tuple(range(16, 257, 16))  # attention_score's kernel head dims
_MASKS = (0, 1, 2)  # none, additive, boolean


_SCORE_MT, _SCORE_BN = 2, 64  # attention_score: row tiles of 16 per warp (4 warps), keys per tile


def _score_expr(d, dt, mask):
    return R.register(f"{FAMILY}:score_{d}_{dt.name}",
                      R.name_expression("attention_score", R.FLOAT_CTYPES[dt], str(d), str(mask), str(_SCORE_MT),
                                        str(_SCORE_BN)),
                      f"score d{d}", dt.name, min_arch=80)


def _score_shared(d, item):
    return ((16 * _SCORE_MT * 4 + 2 * _SCORE_BN) * (d + 8) + 4 * 16 * _SCORE_MT * (_SCORE_BN + 8)) * item


for _dt in A.HALVES:
    for _d in SCORE_DIMS:
        for _m in _MASKS:
            _score_expr(_d, _dt, _m)


def _fwd_rows(d):
    return 16 * _FWD_CFG[d][0] * _FWD_CFG[d][2]


def _sm90_rows(d):
    return 64 * _SM90_CFG[d][1]


def _shared_bytes(kern, d, item):
    """Dynamic shared memory of a launch (kernels/attention.cu's and attention_sm90.cu's tiles)."""
    if kern == "attention_forward_sm90":  # Q, then K and V double-buffered, unpadded (swizzled)
        return (_sm90_rows(d) + 4 * _SM90_CFG[d][0]) * d * item
    lds = d + 8
    if kern == "attention_forward":
        return (_fwd_rows(d) + 4 * _FWD_CFG[d][1]) * lds * item
    warps, mt, other = _BWD_CFG[d][0 if kern == "attention_backward_kv" else 1]
    extra = 4 * other * 4 if kern == "attention_backward_kv" else 0  # (lse and delta of two query tiles)
    return (2 * 16 * warps * mt + 4 * other) * lds * item + extra


# --------------------------------------------------------------- validation
def _operands(name, q, others):
    """(kind, dtype, device) of q, a float array; each of ``others`` ((name, array) pairs) of its kind, dtype
    and GPU."""
    kind = A.array_kind(name, q, "q")
    dt = A.dtype_of(q, kind)
    if dt not in A.FLOAT_DTYPES:
        raise TypeError(f"cufuse.{name}: q is {A.describe(q, kind)}; accepted dtypes are {A.FLOAT_NAMES}")
    dev = A.device_of(q, kind)
    for what, x in others:
        xk = A.array_kind(name, x, what)
        if xk != kind:
            raise TypeError(f"cufuse.{name}: {what} is {A.describe(x, xk)} but q is a {kind}; pass the same "
                            "array kind")
        if A.dtype_of(x, xk) != dt:
            raise TypeError(f"cufuse.{name}: {what} has dtype {A.dtype_of(x, xk)} and q {dt}; pass one dtype")
        if kind in A.GPU_KINDS and A.device_of(x, xk) != dev:
            raise ValueError(f"cufuse.{name}: {what} is on GPU {A.device_of(x, xk)} and q on GPU {dev}")
    return kind, dt, dev


def _check_heads(name, h, hk, what, of):
    """ValueError unless q's h heads are a whole multiple of k's hk (none of none: an empty result)."""
    if (h % hk if hk else h):
        raise ValueError(f"cufuse.{name}: q has {h} heads and {what} {hk}: the query heads must be a whole multiple "
                         f"of the {of}")


def _group(q, k):
    """Query heads per key head (0 for a q of no heads)."""
    return q.shape[1] // k.shape[1] if k.shape[1] else 0


def _scale_arg(name, scale, d):
    """The scale as a float: 1/sqrt(d) by default, else a finite number."""
    if scale is None:
        return 1.0 / math.sqrt(d) if d else 1.0
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"cufuse.{name}: scale must be a float or None, got {type(scale).__name__}")
    try:
        f = float(scale)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f):
        raise ValueError(f"cufuse.{name}: scale must be finite, got {scale!r}")
    return f


def _args(name, q, k, v, causal, scale):
    """(kind, dtype, device, q, k, v as 4-D (batch, heads, seq, dim) views, scale, causal, 3-D input)."""
    if any(DK.is_dask(x) for x in (q, k, v)):
        raise TypeError(f"cufuse.{name}: Dask arrays are not supported")
    kind, dt, dev = _operands(name, q, (("k", k), ("v", v)))
    nd = len(q.shape)
    if nd not in (3, 4) or len(k.shape) != nd or len(v.shape) != nd:
        raise ValueError(f"cufuse.{name}: q, k and v must all be (batch, seq, dim) or all (batch, heads, seq, "
                         f"dim); got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if nd == 3:  # one head
        q, k, v = q[:, None], k[:, None], v[:, None]
    (b, h, sq, d), (bk, hk, sk, dk), vs = tuple(q.shape), tuple(k.shape), tuple(v.shape)
    if bk != b or vs[0] != b:
        raise ValueError(f"cufuse.{name}: batch sizes differ: q {b}, k {bk}, v {vs[0]}")
    if dk != d:
        raise ValueError(f"cufuse.{name}: q's head dim is {d} and k's {dk}; they must agree")
    if vs[1:3] != (hk, sk):
        raise ValueError(f"cufuse.{name}: v must have k's heads and sequence length ({hk}, {sk}), got {vs[1:3]}")
    if vs[3] != d:
        raise ValueError(f"cufuse.{name}: v's head dim is {vs[3]} and q's {d}; a different value head dim is not "
                         "supported")
    _check_heads(name, h, hk, "k, v", "key/value heads (grouped-query attention)")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"cufuse.{name}: causal must be a bool, got {type(causal).__name__}")
    scale = _scale_arg(name, scale, d)
    if kind in A.GPU_KINDS and dt in A.HALVES and _kernels_fit(dev, d) and d not in HEAD_DIMS and d:
        raise ValueError(f"cufuse.{name}: head dim {d} is not supported by the float16/bfloat16 GPU kernels "
                         f"(supported: {', '.join(map(str, HEAD_DIMS))})")
    return kind, dt, dev, q, k, v, float(scale), bool(causal), nd == 3


# ------------------------------------------------------------- dense path
def _xp(kind):
    return np if kind in (A.NUMPY, A.TORCH_CPU) else R._cp


def _to_xp(x, kind):
    """x as a NumPy (CPU kinds) or CuPy (GPU kinds) array, sharing memory."""
    if kind == A.TORCH_CPU:
        return _rows.to_numpy(x, kind)
    if kind == A.TORCH_CUDA:
        from .._interop import from_torch
        return from_torch(x)
    return x


def _from_xp(a, kind):
    if kind == A.TORCH_CPU:
        return _rows.from_numpy(a, kind, None)
    if kind == A.TORCH_CUDA:
        from .._interop import to_torch
        return to_torch(R._cp.ascontiguousarray(a))
    return a


def _compute_dtype(kind, dt):
    return np.dtype(np.float64) if kind in (A.NUMPY, A.TORCH_CPU) else A.compute_dtype(dt)


def _lse_dtype(dt):
    return dt if dt == np.float64 else _F32


def _qk(xp, q, k):
    """q k^T over the last dims ([b, h, sq, d] by [b, h, sk, d]); zeros for d = 0 (written: a matmul of
    an empty inner dim need not write its result)."""
    if q.shape[-1] == 0:
        return xp.zeros((*q.shape[:-1], k.shape[-2]), q.dtype)
    return xp.matmul(q, xp.swapaxes(k, -1, -2))


def _scores(xp, q, k, scale, causal):
    """Scaled scores [b, h, sq, sk] with the causal mask as -inf; k already repeated per query head."""
    s = _qk(xp, q, k) * scale
    if causal:
        sq, sk = s.shape[-2], s.shape[-1]
        row = xp.arange(sq).reshape(-1, 1)
        s = xp.where(xp.arange(sk).reshape(1, -1) > row + (sk - sq), -xp.inf, s)
    return s


def _repeat(xp, x, group):
    """x's heads each ``group`` times (0: none, for a q of no heads)."""
    return xp.repeat(x, group, axis=1) if group != 1 else x


def _not_captured(kind, dev, name):
    """The dense path computes with CuPy, whose temporaries go back to its
    pool when the call returns: a CUDA graph that captured them would replay
    into memory reused since. Raised before anything is queued."""
    if kind in A.GPU_KINDS and D.capturing(kind, dev):
        raise RuntimeError(f"cufuse.{name}: this call takes the dense path (float32 or float64, a negative "
                           "scale, or a head dim or GPU the kernels do not cover), which cannot be captured in "
                           "a CUDA graph; capture float16/bfloat16 calls the kernels take, or make this call "
                           "outside the capture")


def _dense_forward(kind, dt, q, k, v, scale, causal):
    """(o in dt, lse float32) by the dense math, in the compute dtype."""
    xp, cdt = _xp(kind), _compute_dtype(kind, dt)
    qc, kc, vc = (_to_xp(x, kind).astype(cdt) for x in (q, k, v))
    group = _group(qc, kc)
    kc, vc = _repeat(xp, kc, group), _repeat(xp, vc, group)
    b, h, sq, d = qc.shape
    if kc.shape[2] == 0:
        o, lse = xp.zeros((b, h, sq, d), cdt), xp.full((b, h, sq), -xp.inf, cdt)
    else:
        s = _scores(xp, qc, kc, scale, causal)
        with np.errstate(all="ignore"):
            m = s.max(axis=-1, keepdims=True)
            m = xp.where(xp.isfinite(m), m, 0)  # a row that sees no key: exp(-inf) = 0 everywhere
            e = xp.exp(s - m)
            den = e.sum(axis=-1, keepdims=True)
            o = xp.matmul(e, vc) / xp.where(den > 0, den, 1)
            lse = xp.where(den > 0, xp.log(den) + m, -xp.inf)[..., 0]
    return _from_xp(o.astype(dt), kind), _from_xp(lse.astype(_lse_dtype(dt)), kind)


def _dense_backward(kind, dt, q, k, v, o, lse, do, scale, causal, glse=None):
    """(dq, dk, dv) by the dense math from the forward's output and lse (and
    the gradient ``glse`` of the lse, if any: d lse / d s = p, so it enters
    as ``delta - glse``)."""
    xp, cdt = _xp(kind), _compute_dtype(kind, dt)
    qc, kc, vc, oc, dc = (_to_xp(x, kind).astype(cdt) for x in (q, k, v, o, do))
    lc = _to_xp(lse, kind).astype(cdt)[..., None]
    b, hk, sk, d = kc.shape
    group = _group(qc, kc)
    kr, vr = _repeat(xp, kc, group), _repeat(xp, vc, group)
    s = _scores(xp, qc, kr, scale, causal)
    with np.errstate(all="ignore"):
        p = xp.where(xp.isfinite(lc), xp.exp(s - xp.where(xp.isfinite(lc), lc, 0)), 0)
    dv = xp.matmul(xp.swapaxes(p, -1, -2), dc)
    dp = _qk(xp, dc, vr)
    delta = (dc * oc).sum(axis=-1, keepdims=True)
    if glse is not None:
        delta = delta - _to_xp(glse, kind).astype(cdt)[..., None]
    ds = p * (dp - delta)
    dq = xp.matmul(ds, kr) * scale
    dk = xp.matmul(xp.swapaxes(ds, -1, -2), qc) * scale
    if group != 1:
        dk, dv = (g.reshape(b, hk, group, sk, d).sum(axis=2) for g in (dk, dv))
    return tuple(_from_xp(g.astype(dt), kind) for g in (dq, dk, dv))


# --------------------------------------------------------------- GPU path
def _kernel_view(x, kind):
    """x as the kernels read it (last dim contiguous, every stride whole
    16-byte packs, 16-byte aligned), or a contiguous copy."""
    st = A.strides_of(x, kind)
    if (st[-1] != 1 or any(s % 8 for n, s in zip(x.shape[:-1], st[:-1]) if n > 1)
            or A.pointer_of(x, kind) % 16):
        x = D.fresh_copy(x, kind)
    return x


def _strides(x, kind):
    return tuple(np.int64(s) for s in A.strides_of(x, kind)[:3])


def _warps(kern, d):
    if kern == "attention_forward_sm90":
        return 4 * _SM90_CFG[d][1]
    return {"attention_forward": _FWD_CFG[d][2], "attention_backward_kv": _BWD_CFG[d][0][0],
            "attention_backward_q": _BWD_CFG[d][1][0]}[kern]


def _launch(kind, dev, kern, d, dt, blocks, args):
    if kern == "attention_forward_sm90":
        fn = R.get_function(_sm90_part(d, dt), _sm90_expr(d, dt), dev)
    else:
        fn = R.get_function(_part(d, dt), _expr(kern, d, dt), dev)
    warps = _warps(kern, d)
    R.launch_grid(fn, (blocks,), (32 * warps,), args, D.stream_for(kind, dev), _shared_bytes(kern, d, dt.itemsize))


def _uses_sm90(dev, d):
    """The forward runs the wgmma kernel: a compute capability 9.0 GPU, a head dim it has, its shared memory
    within the block's opt-in, and not forced off (_PATH)."""
    key = (dev, d, _PATH, _SM90_CFG.get(d))
    use = _SM90_FITS.get(key)
    if use is None:
        use = _SM90_FITS[key] = (_PATH != "sm80" and d in _SM90_CFG and R.compute_capability(dev) == 90
                                 and _shared_bytes("attention_forward_sm90", d, 2) <= R.shared_optin(dev))
    return use


_SM90_FITS: dict = {}


def _gpu_forward(kind, dt, dev, q, k, v, scale, causal):
    b, h, sq, d = tuple(q.shape)
    hk, sk = k.shape[1], k.shape[2]
    with D.on_device(kind, dev):
        q, k, v = (_kernel_view(x, kind) for x in (q, k, v))
        o = D.empty((b, h, sq, d), dt, kind, dev)
        lse = D.empty((b, h, sq), _F32, kind, dev)
        sm90 = _uses_sm90(dev, d)
        tiles, bh = -(-sq // (_sm90_rows(d) if sm90 else _fwd_rows(d))), b * h
        if tiles and bh:
            p = A.pointer_of
            _launch(kind, dev, "attention_forward_sm90" if sm90 else "attention_forward", d, dt, tiles * bh,
                    (p(o, kind), p(lse, kind), p(q, kind), p(k, kind), p(v, kind), *_strides(q, kind),
                     *_strides(k, kind), *_strides(v, kind), *_strides(o, kind), np.int32(bh), np.int32(h),
                     np.int32(h // hk), np.int32(sq), np.int32(sk), np.int32(tiles), np.float32(scale * _LOG2E),
                     np.bool_(causal)))
    return o, lse


def _gpu_backward(kind, dt, dev, q, k, v, o, lse, do, scale, causal, glse=None):
    b, h, sq, d = tuple(q.shape)
    hk, sk = k.shape[1], k.shape[2]
    p = A.pointer_of
    with D.on_device(kind, dev):
        q, k, v, o, do = (_kernel_view(x, kind) for x in (q, k, v, o, do))
        lse = D.contiguous(lse, kind)
        dq, dk, dv = (D.empty(tuple(x.shape), dt, kind, dev) for x in (q, k, v))
        delta = D.empty((b, h, sq), _F32, kind, dev)
        rows = b * h * sq
        stream = D.stream_for(kind, dev)
        if rows:
            fn = R.get_function(f"{FAMILY}:delta", _DELTA[dt], dev)
            R.launch_grid(fn, (max(1, min(-(-rows // 8), R.sm_count(dev) * 16)),), (256,),
                          (p(delta, kind), p(o, kind), p(do, kind), *_strides(o, kind), *_strides(do, kind),
                           np.int32(h), np.int32(sq), np.int32(d), np.int64(rows)), stream)
            if glse is not None:  # the lse's gradient: the kernels take delta - glse (on the call's stream)
                if kind == A.TORCH_CUDA:
                    delta.sub_(glse.to(delta.dtype))
                else:
                    delta -= glse.astype(delta.dtype, copy=False)
        common = (*_strides(q, kind), *_strides(k, kind), *_strides(v, kind), *_strides(do, kind))
        kt, bhk = -(-sk // (16 * _BWD_CFG[d][0][0] * _BWD_CFG[d][0][1])), b * hk
        if kt and bhk:
            _launch(kind, dev, "attention_backward_kv", d, dt, kt * bhk,
                    (p(dk, kind), p(dv, kind), p(q, kind), p(k, kind), p(v, kind), p(do, kind), p(lse, kind),
                     p(delta, kind), *common, *_strides(dk, kind), *_strides(dv, kind), np.int32(bhk),
                     np.int32(hk), np.int32(h // hk), np.int32(sq), np.int32(sk), np.int32(kt),
                     np.float32(scale * _LOG2E), np.float32(scale), np.bool_(causal)))
        qt, bh = -(-sq // (16 * _BWD_CFG[d][1][0] * _BWD_CFG[d][1][1])), b * h
        if qt and bh:
            _launch(kind, dev, "attention_backward_q", d, dt, qt * bh,
                    (p(dq, kind), p(q, kind), p(k, kind), p(v, kind), p(do, kind), p(lse, kind), p(delta, kind),
                     *common, *_strides(dq, kind), np.int32(bh), np.int32(h), np.int32(h // hk), np.int32(sq),
                     np.int32(sk), np.int32(qt), np.float32(scale * _LOG2E), np.float32(scale), np.bool_(causal)))
    return dq, dk, dv


def _kernels_fit(dev, d, kernels=_KERNELS):
    """The tensor-core kernels run on ``dev`` at head dim ``d``: compute capability 8.0 or newer (cp.async,
    bfloat16 mma) and their shared memory within what a block may opt in to there (other GPUs: the dense
    path). Head dims the kernels lack are refused by the callers, not sent dense."""
    key = (dev, d, kernels, _FWD_CFG.get(d), _BWD_CFG.get(d))  # (once per GPU, head dim and tile choice)
    fit = _FITS.get(key)
    if fit is None:
        fit = _FITS[key] = R.compute_capability(dev) >= 80 and (
            d not in HEAD_DIMS or all(_shared_bytes(kern, d, 2) <= R.shared_optin(dev) for kern in kernels))
    return fit


_FITS: dict = {}


def _scale_fits(scale):
    # the kernels' softmax takes the row max of the raw scores: a positive scale whose float32 log2 form is a
    # normal number (another, e.g. negative or 1e-50, goes dense)
    with np.errstate(over="ignore"):
        s2 = np.float32(scale * _LOG2E)
    return bool(np.isfinite(s2)) and s2 >= np.finfo(np.float32).tiny


def _uses_kernels(kind, dt, dev, q, scale):
    """The flash kernels (a head dim of 0 takes the dense math: nothing to multiply, and a row's lse is
    the log of the keys it sees)."""
    return (kind in A.GPU_KINDS and dt in A.HALVES and _scale_fits(scale) and q.shape[-1] > 0
            and _kernels_fit(dev, q.shape[-1]))


def forward(kind, dt, dev, q, k, v, scale, causal):
    """(o, lse) of 4-D q, k, v: the kernels or the dense path (on the arrays' GPU, whichever is current)."""
    if _uses_kernels(kind, dt, dev, q, scale):
        return _gpu_forward(kind, dt, dev, q, k, v, scale, causal)
    _not_captured(kind, dev, "attention")
    with D.on_device(kind, dev):
        return _dense_forward(kind, dt, q, k, v, scale, causal)


def backward(kind, dt, dev, q, k, v, o, lse, do, scale, causal, glse=None):
    """(dq, dk, dv) from the forward's o and lse, the gradient do of o and
    the gradient glse of lse (None: none). A q of no heads takes the dense
    path (dk and dv are zeros; the kernels map query heads to key heads)."""
    if _uses_kernels(kind, dt, dev, q, scale) and q.shape[1]:
        return _gpu_backward(kind, dt, dev, q, k, v, o, lse, do, scale, causal, glse)
    _not_captured(kind, dev, "attention")
    with D.on_device(kind, dev):
        return _dense_backward(kind, dt, q, k, v, o, lse, do, scale, causal, glse)


# --------------------------------------------------------------- the call
def attention(q: Array, k: Array, v: Array, /, *, causal: bool = False, scale: float | None = None,
              return_lse: bool = False) -> Array | tuple[Array, Array]:
    """``softmax(q k^T * scale) v`` over the last two dims, per batch and
    head: q of shape (batch, heads, seq_q, dim) and k, v of (batch,
    kv_heads, seq_k, dim), or all three (batch, seq, dim) (one head).
    ``kv_heads`` may divide ``heads`` (grouped-query attention: query head
    h reads key/value head h // (heads // kv_heads)). ``scale`` defaults to
    1/sqrt(dim). ``causal``: query row i sees keys j <= i + seq_k - seq_q
    (aligned to the bottom right as FlashAttention; for seq_q == seq_k the
    lower triangle; a row that sees no key gives 0). With ``return_lse``
    also the natural log-sum-exp of each row's scaled scores, (batch,
    heads, seq_q) ((batch, seq_q) for 3-D input), float32 (float64 for
    float64 input; -inf for a row that sees no key), differentiable.

    float16 and bfloat16 on the GPU: flash attention on tensor cores (head
    dims 16 to 128 in steps of 16; compute capability 8.0 or newer),
    nothing seq x seq in memory. Other dtypes and the CPU: the dense math
    (the score matrix materialized; float64 on the CPU). Differentiable for
    torch tensors (the backward: two deterministic kernels, no atomics);
    under torch.compile the operator torch.ops.cufuse.attention."""
    name = "attention"
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"cufuse.{name}: return_lse must be a bool, got {type(return_lse).__name__}")
    if TO.compiling():  # torch.compile: checked with torch's attributes (Dynamo traces this), the operator
        return _compiled(q, k, v, causal, scale, return_lse)
    kind, dt, dev, q4, k4, v4, scale, causal, three = _args(name, q, k, v, causal, scale)
    if kind in (A.TORCH_CPU, A.TORCH_CUDA) and AG.wants_grad((q, k, v)):
        o, lse = AG.apply("attention", _function, q4, k4, v4, scale, causal)
    else:
        if kind in (A.TORCH_CPU, A.TORCH_CUDA):
            q4, k4, v4 = (x.detach() for x in (q4, k4, v4))
        o, lse = forward(kind, dt, dev, q4, k4, v4, scale, causal)
    if three:
        o, lse = o[:, 0], lse[:, 0]
    return (o, lse) if return_lse else o


# ------------------------------------------------------------ the scores
def _score_args(name, q, k, scale, mask):
    """(kind, dtype, device, q, k as 4-D, scale, mask or None (q's dtype, or bool), 3-D input)."""
    if any(DK.is_dask(x) for x in (q, k, mask)):
        raise TypeError(f"cufuse.{name}: Dask arrays are not supported")
    kind, dt, dev = _operands(name, q, (("k", k),))
    nd = len(q.shape)
    if nd not in (3, 4) or len(k.shape) != nd:
        raise ValueError(f"cufuse.{name}: q and k must both be (batch, seq, dim) or (batch, heads, seq, dim); got "
                         f"shapes {tuple(q.shape)} and {tuple(k.shape)}")
    q4, k4 = (q[:, None], k[:, None]) if nd == 3 else (q, k)
    (b, h, sq, d), (bk, hk, sk, dk) = tuple(q4.shape), tuple(k4.shape)
    if bk != b or dk != d:
        raise ValueError(f"cufuse.{name}: q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch and head dim")
    _check_heads(name, h, hk, "k", "key heads")
    scale = _scale_arg(name, scale, d)
    out_shape = (b, sq, sk) if nd == 3 else (b, h, sq, sk)
    if mask is not None:
        mk = A.array_kind(name, mask, "mask")
        if mk != kind:
            raise TypeError(f"cufuse.{name}: mask is {A.describe(mask, mk)} but q is a {kind}; pass the same "
                            "array kind")
        if kind in A.GPU_KINDS and A.device_of(mask, mk) != dev:
            raise ValueError(f"cufuse.{name}: mask is on GPU {A.device_of(mask, mk)} and q on GPU {dev}")
        mdt = A.dtype_of(mask, mk)
        if mdt != np.bool_ and mdt not in A.FLOAT_DTYPES:
            raise TypeError(f"cufuse.{name}: mask must be boolean (True: keep) or a float additive mask, got dtype "
                            f"{mdt}")
        try:
            np.broadcast_shapes(tuple(mask.shape), out_shape)
        except ValueError:
            raise ValueError(f"cufuse.{name}: mask of shape {tuple(mask.shape)} does not broadcast to the scores' "
                             f"shape {out_shape}") from None
        if np.broadcast_shapes(tuple(mask.shape), out_shape) != out_shape:
            raise ValueError(f"cufuse.{name}: mask of shape {tuple(mask.shape)} would grow the scores' shape "
                             f"{out_shape}")
        if kind in (A.TORCH_CPU, A.TORCH_CUDA):
            if mask.requires_grad and A.torch().is_grad_enabled():
                raise NotImplementedError(f"cufuse.{name}: the mask gets no gradient (pass it detached)")
            mask = mask.detach()
        if mdt != np.bool_ and mdt != dt:
            with D.on_device(kind, dev):
                mask = D.astype(mask, dt, kind)  # (added in the scores' dtype, as torch adds a mask)
        if nd == 3:
            mask = mask.reshape((1,) * (3 - len(mask.shape)) + tuple(mask.shape))[:, None]
    return kind, dt, dev, q4, k4, float(scale), mask, nd == 3


def _score_dense(kind, dt, q, k, scale, mask):
    xp, cdt = _xp(kind), _compute_dtype(kind, dt)
    qc, kc = (_to_xp(x, kind).astype(cdt) for x in (q, k))
    s = _qk(xp, qc, _repeat(xp, kc, _group(qc, kc))) * scale
    if mask is not None:
        m = _to_xp(mask, kind)
        s = xp.where(m, s, -xp.inf) if m.dtype == np.bool_ else s + m.astype(cdt)
    return _from_xp(s.astype(dt), kind)


def _score_gpu(kind, dt, dev, q, k, scale, mask):
    b, h, sq, d = tuple(q.shape)
    hk, sk = k.shape[1], k.shape[2]
    p = A.pointer_of
    with D.on_device(kind, dev):
        q, k = (_kernel_view(x, kind) for x in (q, k))
        out = D.empty((b, h, sq, sk), dt, kind, dev)
        mkind, mptr, mst = 0, 0, (0, 0, 0, 0)
        if mask is not None:
            mkind = 2 if A.dtype_of(mask, kind) == np.bool_ else 1
            mst = A.broadcast_strides(tuple(mask.shape), A.strides_of(mask, kind), (b, h, sq, sk))
            mptr = p(mask, kind)
        tm, bh = -(-sq // (64 * _SCORE_MT)), b * h
        if tm and sk and bh:
            fn = R.get_function(f"{FAMILY}:score_{d}_{dt.name}", _score_expr(d, dt, mkind), dev)
            vec = sk % (16 // dt.itemsize) == 0 and p(out, kind) % 16 == 0  # (rows of whole 16-byte chunks)
            R.launch_grid(fn, (tm * bh,), (128,),
                          (p(out, kind), p(q, kind), p(k, kind), mptr, *_strides(q, kind), *_strides(k, kind),
                           *_strides(out, kind), *(np.int64(x) for x in mst), np.int32(bh), np.int32(h),
                           np.int32(h // hk), np.int32(sq), np.int32(sk), np.int32(tm), np.float32(scale),
                           np.bool_(vec)),
                          D.stream_for(kind, dev), _score_shared(d, dt.itemsize))
    return out


def scores(kind, dt, dev, q, k, scale, mask):
    """q k^T * scale (+ mask) of 4-D q and k: the kernel (compute capability 8.0 or newer, its shared memory
    allowed there) or the dense math, on the arrays' GPU whichever is current."""
    d = q.shape[-1]
    if (kind in A.GPU_KINDS and dt in A.HALVES and d in SCORE_DIMS and R.compute_capability(dev) >= 80
            and _score_shared(d, dt.itemsize) <= R.shared_optin(dev)):
        return _score_gpu(kind, dt, dev, q, k, scale, mask)
    _not_captured(kind, dev, "attention_score")
    with D.on_device(kind, dev):
        return _score_dense(kind, dt, q, k, scale, mask)


def attention_score(q: Array, k: Array, /, *, scale: float | None = None, mask: Array | None = None) -> Array:
    """The attention scores ``q k^T * scale`` (``scale`` defaults to
    1/sqrt(dim)) with an optional ``mask`` fused in: a float mask is added
    (in q's dtype), a boolean one keeps the scores where it is True and puts
    -inf elsewhere (torch's scaled_dot_product_attention convention). q and
    k are (batch, seq, dim) or (batch, heads, seq, dim) (k may have fewer
    heads, dividing q's); the mask broadcasts to the result, (batch, seq_q,
    seq_k) or (batch, heads, seq_q, seq_k), in q's dtype and kind.

    float16 and bfloat16 on the GPU: one tensor-core kernel (head dims 16 to
    256 in steps of 16) that applies the scale and the mask before its one
    write. Other dtypes and the CPU: matmul, then the scale and mask.
    Differentiable for torch tensors with respect to q and k."""
    name = "attention_score"
    if TO.compiling():  # torch.compile: checked with torch's attributes, the operator
        return _score_compiled(q, k, scale, mask)
    kind, dt, dev, q4, k4, scale, mask, three = _score_args(name, q, k, scale, mask)
    if kind in (A.TORCH_CPU, A.TORCH_CUDA) and AG.wants_grad((q, k)):
        s = AG.apply("attention_score", _score_function, q4, k4, scale, mask)
    else:
        if kind in (A.TORCH_CPU, A.TORCH_CUDA):
            q4, k4 = q4.detach(), k4.detach()
        s = scores(kind, dt, dev, q4, k4, scale, mask)
    return s[:, 0] if three else s


def score_tensors(q, k, scale, mask):
    """q k^T * scale (+ mask) of 4-D torch tensors: the registered operator's body."""
    kind, dt, dev = _kind_of(q)
    return scores(kind, dt, dev, q, k, scale, mask)


def _score_compiled(q, k, scale, mask):
    import torch
    name = "cufuse.attention_score"
    for what, x in (("q", q), ("k", k)):
        if not isinstance(x, torch.Tensor) or x.dtype not in A.torch_floats():
            raise TypeError(f"{name}: under torch.compile, {what} must be a float tensor")
    if k.dtype != q.dtype or k.device != q.device or k.dim() != q.dim() or q.dim() not in (3, 4):
        raise ValueError(f"{name}: q and k must share dtype, device and number of dims (3 or 4)")
    three = q.dim() == 3
    if three:
        q, k = q.unsqueeze(1), k.unsqueeze(1)
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] or (q.shape[1] % k.shape[1] if k.shape[1]
                                                                  else q.shape[1]):
        raise ValueError(f"{name}: q {tuple(q.shape)} and k {tuple(k.shape)} do not agree")
    scale = _scale_arg("attention_score", scale, q.shape[-1])  # as eager mode checks it
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.device != q.device:
            raise TypeError(f"{name}: mask must be a tensor on q's device")
        want = (*q.shape[:3], k.shape[2]) if not three else (q.shape[0], q.shape[2], k.shape[2])
        ms = tuple(mask.shape)  # (compared by hand: Dynamo traces torch.broadcast_shapes)
        # (== rather than `in`: under torch.compile `4 in (1, w)` of a symbolic w is False, not a guard)
        if len(ms) > len(want) or any(not (m == 1 or m == w) for m, w in zip(reversed(ms), reversed(want))):
            raise ValueError(f"{name}: mask of shape {tuple(mask.shape)} does not broadcast to the scores' shape "
                             f"{tuple(want)}")
        if mask.dtype != torch.bool:
            if not mask.dtype.is_floating_point:
                raise TypeError(f"{name}: mask must be boolean or float, got {mask.dtype}")
            if mask.requires_grad and torch.is_grad_enabled():  # as eager: it would get no gradient, silently
                raise NotImplementedError(f"{name}: the mask gets no gradient (pass it detached)")
            mask = mask.detach().to(q.dtype)
        if three:
            mask = mask.reshape((1,) * (3 - mask.dim()) + tuple(mask.shape)).unsqueeze(1)
    s = TO.attention_score(q, k, scale, mask)
    return s.squeeze(1) if three else s


def score_backward(g, q, k, scale, mask, want_q=True, want_k=True):
    """(dq, dk) of the scores q k^T * scale (+ mask) from their gradient g: two matmuls (torch ops, so that
    torch.compile traces them too); a boolean mask's -inf entries pass no gradient."""
    if mask is not None and mask.dtype == A.torch().bool:
        g = g.masked_fill(~mask, 0)
    g = g * scale
    group = _group(q, k)
    dq = dk = None
    if want_q:
        dq = g @ (k.repeat_interleave(group, 1) if group != 1 else k)
    if want_k:
        dk = g.transpose(-1, -2) @ q
        if group != 1:
            dk = dk.reshape(k.shape[0], k.shape[1], group, *k.shape[2:]).sum(2)
    return dq, dk


def _score_function(torch):
    class AttentionScoreFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, scale, mask):
            kind, dt, dev = _kind_of(q)
            ctx.scale, ctx.mask = scale, mask
            ctx.save_for_backward(q, k)
            return scores(kind, dt, dev, q.detach(), k.detach(), scale, mask)

        @staticmethod
        @AG.once_differentiable
        def backward(ctx, g):
            q, k = ctx.saved_tensors
            dq, dk = score_backward(g, q, k, ctx.scale, ctx.mask, *ctx.needs_input_grad[:2])
            return dq, dk, None, None

    return AttentionScoreFn


def _compiled(q, k, v, causal, scale, return_lse):
    import torch
    name = "cufuse.attention"
    for what, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dtype not in A.torch_floats():
            raise TypeError(f"{name}: under torch.compile, {what} must be a float tensor")
        if x.dtype != q.dtype or x.device != q.device or x.dim() != q.dim():
            raise ValueError(f"{name}: q, k and v must share dtype, device and number of dims")
    three = q.dim() == 3
    if three:
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
    if q.dim() != 4:
        raise ValueError(f"{name}: q, k and v must be (batch, seq, dim) or (batch, heads, seq, dim)")
    b, h, sq, d = q.shape
    if (k.shape[0] != b or k.shape[3] != d or v.shape != k.shape
            or (h % k.shape[1] if k.shape[1] else h)):
        raise ValueError(f"{name}: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not agree "
                         "(k and v of one shape, q's batch and head dim, heads a multiple of k's)")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"{name}: causal must be a bool")
    causal = bool(causal)
    scale = _scale_arg("attention", scale, d)  # as eager mode checks it
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and d not in HEAD_DIMS and d:
        raise ValueError(f"{name}: head dim {d} is not supported by the float16/bfloat16 GPU kernels "
                         f"(supported: {', '.join(map(str, HEAD_DIMS))})")
    o, lse = TO.attention(q, k, v, scale, causal)
    if three:
        o, lse = o.squeeze(1), lse.squeeze(1)
    return (o, lse) if return_lse else o


def _kind_of(t):
    kind = A.TORCH_CUDA if t.is_cuda else A.TORCH_CPU
    return kind, A.dtype_of(t, kind), A.device_of(t, kind)


def forward_tensors(q, k, v, scale, causal):
    """(o, lse) of 4-D torch tensors: the registered operator's body."""
    kind, dt, dev = _kind_of(q)
    return forward(kind, dt, dev, q, k, v, scale, causal)


def backward_tensors(q, k, v, o, lse, go, scale, causal, glse=None):
    """(dq, dk, dv) of 4-D torch tensors: the registered backward operator's body
    (``go`` None: only the lse has a gradient)."""
    kind, dt, dev = _kind_of(q)
    if go is None:
        go = A.torch().zeros_like(o)
    return backward(kind, dt, dev, q, k, v, o, lse, go.contiguous(), scale, causal, glse)


def _function(torch):
    class AttentionFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, scale, causal):
            o, lse = forward_tensors(q.detach(), k.detach(), v.detach(), scale, causal)
            ctx.scale, ctx.causal = scale, causal
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.set_materialize_grads(False)  # an unused output's gradient stays None (the lse's, mostly)
            return o, lse

        @staticmethod
        @AG.once_differentiable
        def backward(ctx, go, glse):
            q, k, v, o, lse = ctx.saved_tensors
            dq, dk, dv = backward_tensors(q, k, v, o, lse, go, ctx.scale, ctx.causal, glse)
            return dq, dk, dv, None, None

    return AttentionFn
