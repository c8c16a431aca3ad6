"""Differential fuzzing (hypothesis): random shapes, layouts, dtypes, scalars
and aliasing for every op family and random fused programs, each result
against an independent float64 reference (tests/_reference*.py), and on the
GPU also against cufuse's own NumPy path.

Two profiles: ``ci`` (the default: a few dozen cases per test, derandomized,
so a CI run is reproducible) and ``device`` (``CUFUSE_FUZZ=device``; cases
per test from ``CUFUSE_FUZZ_EXAMPLES``, default 2000): the long run on a GPU
machine. A failure prints the drawn case; hypothesis shrinks it first.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import cufuse  # noqa: E402

from _reference import BF16, TOL, promote, reference, scale_for  # noqa: E402
from _reference import assert_close as ew_close  # noqa: E402
from _reference_fuse import FLOATS, TREE_TOL, TreeCase  # noqa: E402
from _reference_fuse import assert_close as fuse_close  # noqa: E402
from _reference_norm import (NORM_REF, REDUCE_REF, SOFTMAX_REF, check, reduce_shape, reduced_length,  # noqa: E402
                             tol)

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True,
                          suppress_health_check=list(HealthCheck))
settings.register_profile("device", max_examples=int(os.environ.get("CUFUSE_FUZZ_EXAMPLES", "2000")),
                          deadline=None, suppress_health_check=list(HealthCheck))
PROFILE = os.environ.get("CUFUSE_FUZZ", "ci")
fuzz = settings.get_profile(PROFILE)

KINDS = ["numpy"] + (["cupy", "torch_cuda"] if cufuse.CUDA_AVAILABLE else [])
DIMS = [0, 1, 2, 3, 5, 7, 8, 9, 16, 17, 33]
LAYOUTS = ["C", "T", "step", "offset", "broadcast"]


# --------------------------------------------------------------- array kinds
def to_kind(a, kind):
    """A copy of NumPy array ``a`` in ``kind`` (the drawn values stay intact for the reference)."""
    if kind == "numpy":
        return np.array(a)
    if kind == "cupy":
        import cupy as cp
        return cp.asarray(a)
    import torch
    a = np.array(a, order="C")  # (np.ascontiguousarray makes 0-d arrays 1-d)
    if a.dtype == BF16:  # (torch.from_numpy does not take ml_dtypes' bfloat16)
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).cuda()
    return torch.from_numpy(a).cuda()


def to_numpy(a):
    if isinstance(a, np.ndarray):
        return a
    if hasattr(a, "get"):
        return a.get()
    import torch
    if a.dtype == torch.bfloat16:
        return a.cpu().view(torch.int16).numpy().view(BF16)
    return a.cpu().numpy()


def view(values, kind, layout):
    """``values`` (NumPy) as an array of ``kind`` laid out as ``layout``, the
    same logical values: C-contiguous, transposed memory, a stepped slice, one
    element off the allocation's alignment, or a stride-0 broadcast."""
    shape = values.shape
    if layout == "T" and values.ndim >= 2:
        return to_kind(np.ascontiguousarray(values.T), kind).T
    if layout == "step" and values.ndim >= 1:
        big = np.repeat(values, 2, axis=-1)
        return to_kind(big, kind)[..., ::2]
    if layout == "offset":
        flat = np.concatenate([np.ones(1, values.dtype), values.reshape(-1)])
        return to_kind(flat, kind)[1:].reshape(shape)
    if layout == "broadcast" and values.ndim >= 1 and shape[0] > 1 and np.all(values == values[:1]):
        one = to_kind(np.ascontiguousarray(values[:1]), kind)
        if kind == "torch_cuda":
            return one.expand(*shape)
        import cupy as cp
        return cp.broadcast_to(one, shape) if kind == "cupy" else np.broadcast_to(one, shape)
    return to_kind(values, kind)


@st.composite
def arrays(draw, dtype, ndim=None, min_dims=0, shape=None, scale=1.0):
    """(values, layout): random normal values (never zero) of a drawn shape."""
    if shape is None:
        nd = draw(st.integers(min_dims, 3)) if ndim is None else ndim
        shape = tuple(draw(st.sampled_from(DIMS)) for _ in range(nd))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    v = np.asarray(rng.standard_normal(shape) * scale).astype(dtype)
    v[v == 0] = 0.5
    layout = draw(st.sampled_from(LAYOUTS))
    if layout == "broadcast" and len(shape) >= 1:
        v = np.broadcast_to(v[:1], shape).copy()
    return v, layout


def _poison(shape, dtype, kind):
    nan = np.dtype(dtype).kind == "f" or np.dtype(dtype) == BF16
    return to_kind(np.full(shape, np.nan if nan else 77, dtype), kind)


# ----------------------------------------------------------- elementwise ops
EW = {"add_relu": 2, "mul_tanh": 2, "add_mul_exp": 2, "fma": 3}
EW_FLOATS = list(FLOATS) + ([BF16] if BF16 is not None else [])  # bfloat16 beside them


@fuzz
@given(data=st.data())
def test_fuzz_elementwise(data):
    """The four core ops: operands of mixed dtypes, broadcast shapes,
    layouts, Python scalars; out= none, fresh, the first operand itself, or
    (1-D) a view shifted by one element over it."""
    op = data.draw(st.sampled_from(sorted(EW)), "op")
    kind = data.draw(st.sampled_from(KINDS), "kind")
    full = tuple(data.draw(st.sampled_from(DIMS)) for _ in range(data.draw(st.integers(0, 3))))
    vals, args = [], []
    for k in range(EW[op]):
        if k > 0 and data.draw(st.booleans(), f"scalar {k}"):
            s = data.draw(st.floats(-2.0, 2.0, allow_nan=False).filter(lambda f: f != 0), f"value {k}")
            vals.append(s)
            args.append(s)
            continue
        dt = data.draw(st.sampled_from(EW_FLOATS), f"dtype {k}")
        sub = full[data.draw(st.integers(0, len(full)), f"trailing {k}"):]   # broadcasts against full
        v, lay = data.draw(arrays(dt, shape=sub, scale=scale_for(op)), f"array {k}")
        vals.append(v)
        args.append(view(v, kind, lay))
    if not any(isinstance(v, np.ndarray) for v in vals):
        v = np.random.default_rng(1).standard_normal(full).astype(np.float32)
        vals[0], args[0] = v, to_kind(v, kind)
    shape = np.broadcast_shapes(*[v.shape for v in vals if isinstance(v, np.ndarray)])
    arrs = [v for v in vals if isinstance(v, np.ndarray)]
    if kind == "torch_cuda":  # torch's rule: zero-dim tensors do not widen tensors with dimensions
        arrs = [v for v in arrs if v.ndim] or arrs
    dtype = promote([v.dtype for v in arrs])
    if kind == "torch_cuda":  # as torch: a wider zero-dim operand is rounded to the result type first
        vals = [v.astype(dtype) if isinstance(v, np.ndarray) and v.ndim == 0 else v for v in vals]
    ref = reference(op, vals, dtype)
    ref = np.broadcast_to(ref, shape)
    how = data.draw(st.sampled_from(["none", "fresh", "inplace", "shifted"]), "out")
    out = None
    if how == "fresh":
        out = _poison(shape, dtype, kind)
    elif how == "inplace" and isinstance(vals[0], np.ndarray) and vals[0].shape == shape and vals[0].dtype == dtype:
        out = args[0] = to_kind(vals[0], kind)
    elif how == "shifted" and len(shape) == 1 and shape[0] > 0 and isinstance(vals[0], np.ndarray) \
            and vals[0].shape == shape and vals[0].dtype == dtype:
        buf = to_kind(np.concatenate([vals[0], vals[0][-1:]]), kind)
        args[0], out = buf[1:], buf[:-1]
        vals[0] = np.concatenate([vals[0], vals[0][-1:]])[1:]
        ref = np.broadcast_to(reference(op, vals, dtype), shape)
    got = getattr(cufuse, op)(*args, out=out)
    if out is not None:
        assert got is out
    ew_close(to_numpy(got), np.asarray(ref), dtype)
    if kind != "numpy" and out is None:  # the GPU agrees with cufuse's own NumPy path (torch CPU: torch's rules)
        cpu = [a if isinstance(a, float) else (a.cpu() if kind == "torch_cuda" else to_numpy(a)) for a in args]
        ew_close(to_numpy(got), to_numpy(getattr(cufuse, op)(*cpu)).astype(np.float64), dtype)


# ------------------------------------------------------------------- norms
@fuzz
@given(data=st.data())
def test_fuzz_norms(data):
    """layer_norm / layer_norm_relu / rms_norm over 1 or 2 trailing dims,
    weight and bias optional (any layout), out= none, fresh, x itself, or
    overlapping the weight."""
    op = data.draw(st.sampled_from(sorted(NORM_REF)), "op")
    kind = data.draw(st.sampled_from(KINDS), "kind")
    dt = data.draw(st.sampled_from(FLOATS), "dtype")
    lead = tuple(data.draw(st.sampled_from([0, 1, 2, 3, 7])) for _ in range(data.draw(st.integers(0, 2))))
    norm = tuple(data.draw(st.sampled_from([1, 2, 3, 8, 17, 33, 64, 255])) for _ in range(data.draw(st.integers(1, 2))))
    x, xl = data.draw(arrays(dt, shape=lead + norm), "x")
    w = b = None
    wv = bv = None
    if data.draw(st.booleans(), "weight"):
        wv, wl = data.draw(arrays(dt, shape=norm), "w")
        w = view(wv, kind, wl)
    if op != "rms_norm" and data.draw(st.booleans(), "bias"):
        bv, bl = data.draw(arrays(dt, shape=norm), "b")
        b = view(bv, kind, bl)
    eps = data.draw(st.sampled_from([1e-5, 1e-6, 0.1]), "eps")
    xa = view(x, kind, xl)
    how = data.draw(st.sampled_from(["none", "fresh", "x", "weight"]), "out")
    out = None
    if how == "fresh":
        out = _poison(x.shape, dt, kind)
    elif how == "x" and xl in ("C", "offset"):
        out = xa
    elif how == "weight" and w is not None and lead == () and wl == "C":
        out = w  # the result written over the weight: computed into a temporary first
    args = (xa, norm, w) + ((b,) if op != "rms_norm" else ())
    got = getattr(cufuse, op)(*args, eps=eps, out=out)
    ref_args = (x, norm, wv) + ((bv,) if op != "rms_norm" else ())
    ref = NORM_REF[op](*ref_args, eps=eps)
    rtol, atol = tol(op, dt, int(np.prod(norm)))
    if op != "rms_norm" and x.size:
        # The kernels' mean is rounded in the compute type (u = 2**-24 in float32)
        # and (x - mean) / sqrt(var + eps) magnifies that: a constant row gives
        # about u * |mean| / sqrt(eps) (2e-5 at eps=1e-5), not exactly 0 (known,
        # docs/ops.md). The bound, times the weight, joins the tolerance.
        u = 2.0 ** -24 if dt != np.float64 else 2.0 ** -53
        axes = tuple(range(x.ndim - len(norm), x.ndim))
        x64 = x.astype(np.float64)
        bound = 8 * u * np.abs(x64.mean(axis=axes, keepdims=True)) / np.sqrt(x64.var(axis=axes, keepdims=True) + eps)
        atol = atol + float(np.max(bound * (1.0 if wv is None else np.max(np.abs(wv)))))
    check(op, to_numpy(got), ref, dt, int(np.prod(norm)), (rtol, atol))


# ----------------------------------------------------------- softmax / reductions
@fuzz
@given(data=st.data())
def test_fuzz_softmax_and_reductions(data):
    """softmax / log_softmax along any axis; sum_squared / mean_abs over an
    axis, a tuple of axes or all, keepdims; out= none or fresh."""
    kind = data.draw(st.sampled_from(KINDS), "kind")
    dt = data.draw(st.sampled_from(FLOATS), "dtype")
    x, xl = data.draw(arrays(dt, min_dims=1), "x")
    xa = view(x, kind, xl)
    nd = x.ndim
    op = data.draw(st.sampled_from(sorted(SOFTMAX_REF) + sorted(REDUCE_REF)), "op")
    fresh = data.draw(st.booleans(), "out")
    if op in SOFTMAX_REF:
        axis = data.draw(st.integers(-nd, nd - 1), "axis")
        out = _poison(x.shape, dt, kind) if fresh else None
        got = getattr(cufuse, op)(xa, axis=axis, out=out)
        check(op, to_numpy(got), SOFTMAX_REF[op](x, axis=axis), dt, x.shape[axis])
        return
    axis = data.draw(st.one_of(st.none(), st.integers(-nd, nd - 1),
                               st.lists(st.integers(0, nd - 1), min_size=1, max_size=nd, unique=True).map(tuple)),
                     "axis")
    keep = data.draw(st.booleans(), "keepdims")
    rshape = reduce_shape(x.shape, axis, keep)
    out = _poison(rshape, dt, kind) if fresh else None
    got = getattr(cufuse, op)(xa, axis=axis, keepdims=keep, out=out)
    ref = REDUCE_REF[op](x, axis=axis, keepdims=keep)
    check(op, to_numpy(got), np.asarray(ref), dt, reduced_length(x.shape, axis))


# ---------------------------------------------------------------- quantize
@fuzz
@given(data=st.data())
def test_fuzz_quantize_round_trip(data):
    """quantize_int8 then dequantize_int8, per tensor or per channel (NumPy or
    device parameters), any layout: codes equal NumPy's formula in the data's
    compute precision, values within half a step."""
    kind = data.draw(st.sampled_from(KINDS), "kind")
    dt = data.draw(st.sampled_from(FLOATS), "dtype")
    x, xl = data.draw(arrays(dt, min_dims=1, scale=3.0), "x")
    xa = view(x, kind, xl)
    real = np.float64 if dt == np.float64 else np.float32
    axis = data.draw(st.one_of(st.none(), st.integers(0, x.ndim - 1)), "axis")
    if axis is None:
        s = data.draw(st.floats(0.01, 0.2), "scale")
        z = data.draw(st.sampled_from([0.0, 3.0, -2.5]), "zero point")
        sc, zc = real(s), real(z)
        args_s, args_z = s, z
    else:
        n = x.shape[axis]
        rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
        sc = rng.uniform(0.01, 0.2, n).astype(real)
        zc = np.round(rng.uniform(-4, 4, n)).astype(real)
        on_device = data.draw(st.booleans(), "device parameters")
        args_s = to_kind(sc, kind) if on_device else sc
        args_z = to_kind(zc, kind) if on_device else zc
        bshape = (n,) + (1,) * (x.ndim - axis - 1)
        sc, zc = sc.reshape(bshape), zc.reshape(bshape)
    q = cufuse.quantize_int8(xa, args_s, args_z, axis=axis)
    with np.errstate(all="ignore"):
        want = np.clip(np.rint(x.astype(real) / sc + zc), -128, 127).astype(np.int8)
    np.testing.assert_array_equal(to_numpy(q), want)
    back = cufuse.dequantize_int8(q, args_s, args_z, axis=axis, dtype=dt)
    ref = (want.astype(np.float64) - zc) * sc
    ew_close(to_numpy(back), ref, dt, TOL[np.dtype(dt)])
    fake = to_numpy(cufuse.fake_quantize_int8(xa, args_s, args_z, axis=axis))  # the round trip in one pass
    np.testing.assert_array_equal(np.ascontiguousarray(fake).view(np.uint8),
                                  np.ascontiguousarray(to_numpy(back)).view(np.uint8))


# ------------------------------------------------------ cross entropy, rope
@fuzz
@given(data=st.data())
def test_fuzz_cross_entropy(data):
    """cross_entropy of random rows x classes in any layout, targets with some
    ignored, label smoothing, z-loss, each reduction: against a float64
    reference (log-sum-exp by a max shift)."""
    kind = data.draw(st.sampled_from(KINDS), "kind")
    dt = data.draw(st.sampled_from(EW_FLOATS), "dtype")
    rows = data.draw(st.sampled_from(DIMS), "rows")
    cols = data.draw(st.sampled_from([d for d in DIMS if d] + [1000, 4099]), "classes")
    x, xl = data.draw(arrays(dt, shape=(rows, cols), scale=3.0), "logits")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    t = rng.integers(0, cols, rows).astype(np.int64)
    t[rng.random(rows) < 0.2] = -100
    eps = data.draw(st.sampled_from([0.0, 0.1]), "label smoothing")
    z = data.draw(st.sampled_from([0.0, 1e-3]), "z loss")
    red = data.draw(st.sampled_from(["none", "sum", "mean"]), "reduction")
    got = to_numpy(cufuse.cross_entropy(view(x, kind, xl), to_kind(t, kind), label_smoothing=eps, z_loss=z,
                                        reduction=red))
    xv = x.astype(np.float64)
    with np.errstate(all="ignore"):
        m = xv.max(axis=1, keepdims=True) if rows else np.zeros((0, 1))
        lse = np.log(np.exp(xv - m).sum(axis=1)) + m[:, 0]
        xt = xv[np.arange(rows), np.clip(t, 0, cols - 1)]
        per = (1 - eps) * (lse - xt) + (eps * (lse - xv.mean(axis=1)) if eps else 0) + (z * lse ** 2 if z else 0)
        per = np.where(t != -100, per, 0.0)
        ref = per if red == "none" else per.sum() if red == "sum" else per.sum() / np.count_nonzero(t != -100)
    rtol, atol = TOL[np.dtype(dt)]
    np.testing.assert_allclose(got.astype(np.float64), ref, rtol=max(rtol, 1e-5),
                               atol=max(atol, 1e-5) * (max(rows, 1) if red == "sum" else 1))


@fuzz
@given(data=st.data())
def test_fuzz_rope(data):
    """rope of q in any layout with random (batch, heads, tokens, dim) and a
    partial rotary width, both pair layouts: against a float64 reference."""
    kind = data.draw(st.sampled_from(KINDS), "kind")
    dt = data.draw(st.sampled_from(EW_FLOATS), "dtype")
    b, h, t = (data.draw(st.sampled_from([1, 2, 3, 5]), n) for n in ("batch", "heads", "tokens"))
    d = data.draw(st.sampled_from([2, 4, 6, 8, 16, 34]), "head dim")
    r = data.draw(st.sampled_from([k for k in range(2, d + 1, 2)]), "rotary dims")
    inter = data.draw(st.booleans(), "interleaved")
    q, ql = data.draw(arrays(dt, shape=(b, h, t, d)), "q")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    cos, sin = (rng.uniform(-1, 1, (b, t, r)).astype(dt) for _ in range(2))
    got, _ = cufuse.rope(view(q, kind, ql), None, to_kind(cos, kind), to_kind(sin, kind), interleaved=inter)
    qv, c, s_ = q.astype(np.float64), cos.astype(np.float64)[:, None], sin.astype(np.float64)[:, None]
    x = qv[..., :r]
    if inter:
        rot = np.empty_like(x)
        rot[..., 0::2], rot[..., 1::2] = -x[..., 1::2], x[..., 0::2]
    else:
        rot = np.concatenate([-x[..., r // 2:], x[..., : r // 2]], -1)
    ref = qv.copy()
    ref[..., :r] = x * c + rot * s_
    ew_close(to_numpy(got), ref, dt, TOL[np.dtype(dt)])


# ----------------------------------------------------------- fused programs
@fuzz
@given(seed=st.integers(0, 2**31), dtype=st.sampled_from(FLOATS), kind=st.sampled_from(KINDS))
def test_fuzz_fused_programs(seed, dtype, kind):
    """Random expression trees (tests/_reference_fuse.TreeCase: broadcasting,
    layouts, scalars, several outputs) through cufuse.fuse."""
    from _reference import Backend
    case = TreeCase(seed=seed, dtype=dtype)
    vals, layouts = case.np_args()
    from _reference_fuse import backend_view
    backend = Backend({"numpy": "numpy", "cupy": "cupy", "torch_cuda": "torch_cuda"}[kind])
    args = [v if lay is None else backend_view(backend, v, lay) for v, lay in zip(vals, layouts)]
    refs = case.reference(vals)
    res = cufuse.fuse(case.traced())(*args)
    res = res if isinstance(res, tuple) else (res,)
    for r, got in zip(refs, res):
        fuse_close(to_numpy(got), r, dtype, TREE_TOL[np.dtype(dtype)], err_msg=case.text)
