"""cufuse.cross_entropy (kernels/cross_entropy.cu): the loss against a
float64 reference written here (log-sum-exp by a max shift, torch's label
smoothing, the z-loss), for every dtype and array kind, odd class counts
around the 16-byte pack, misaligned, strided and broadcast rows, ignored and
out-of-range targets and infinities; the gradient against torch's autograd
of the same loss and gradcheck, reductions, the in-place backward; errors."""
from __future__ import annotations

import numpy as np
import pytest

import cufuse
from _reference import BF16, DTYPES, TOL, compiled_matches_eager, rand

DTYPES_ALL = DTYPES + ([BF16] if BF16 is not None else [])
SHAPES = [(1, 1), (5, 7), (3, 8), (17, 33), (9, 1000), (4, 4096 + 3), (2, 32768)]
IGNORE = -100


def _reference(x, t, ignore=IGNORE, eps=0.0, z=0.0, reduction="mean"):
    """float64: loss per row, then the reduction (a mean over rows not ignored)."""
    x = np.asarray(x, dtype=np.float64)
    rows, cols = x.shape
    m = x.max(axis=1, keepdims=True) if cols else np.zeros((rows, 1))
    with np.errstate(all="ignore"):
        shift = np.where(m == -np.inf, 0.0, m)
        lse = np.log(np.exp(x - shift).sum(axis=1)) + shift[:, 0]
        loss = np.zeros(rows)
        for r in range(rows):
            if t[r] == ignore:
                continue
            xt = x[r, t[r]] if 0 <= t[r] < cols else np.nan
            loss[r] = (1 - eps) * (lse[r] - xt)  # (as torch: no smoothing term without smoothing)
            loss[r] += eps * (lse[r] - x[r].mean()) if eps else 0.0
            loss[r] += z * lse[r] ** 2 if z else 0.0
        if reduction == "none":
            return loss
        if reduction == "sum":
            return loss.sum()
        return loss.sum() / np.count_nonzero(t != ignore)


def _targets(rows, cols, seed, ignored=True):
    t = np.random.default_rng(seed).integers(0, cols, rows).astype(np.int64)
    if ignored and rows > 2:
        t[1] = IGNORE
    return t


def _tol(dt, cols):
    rtol, atol = TOL[dt]
    # the loss is lse - x_t: float32 sums of `cols` exponentials, then one rounding to dt
    return max(rtol, 4e-6 * np.sqrt(cols)), max(atol, 1e-5)


@pytest.mark.parametrize("dtype", DTYPES_ALL, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_loss_against_reference(backend, shape, dtype):
    rows, cols = shape
    x = rand(shape, dtype, 3, scale=3.0)
    t = _targets(rows, cols, 4)
    xa, ta = backend.asarray(x), backend.asarray(t)
    for eps, z in ((0.0, 0.0), (0.1, 1e-3)):
        for reduction in ("mean", "sum", "none"):
            got = cufuse.cross_entropy(xa, ta, label_smoothing=eps, z_loss=z, reduction=reduction)
            want = _reference(x, t, eps=eps, z=z, reduction=reduction)
            g = backend.to_numpy(got)
            assert g.dtype == dtype and g.shape == np.shape(want), (g.dtype, g.shape)
            rtol, atol = _tol(dtype, cols)
            np.testing.assert_allclose(g.astype(np.float64), want, rtol=rtol, atol=atol * (rows if reduction == "sum"
                                                                                             else 1),
                                       err_msg=f"eps {eps} z {z} {reduction}")


def test_views_misaligned_strided_broadcast(backend):
    rows, cols = 6, 67
    base = rand((rows, cols + 5), np.float32, 5, scale=2.0)
    src = backend.asarray(base)
    cases = {  # name: (the view on the backend, the same values in NumPy)
        "offset": (src[:, 1:cols + 1], base[:, 1:cols + 1]),
        "rows on packs, a tail": (src[:, :cols], base[:, :cols]),  # row stride 72: 16 packs and 3 more
        "columns strided": (src[:, : 2 * (cols // 2): 2], base[:, : 2 * (cols // 2): 2]),
        "column-major": (backend.asarray(np.ascontiguousarray(base[:, :cols].T)).T, base[:, :cols]),
    }
    row = rand((1, cols), np.float32, 7)
    b = backend.asarray(row)
    cases["broadcast row"] = (b.expand(rows, cols) if backend.is_torch else (
        backend.cp.broadcast_to(b, (rows, cols)) if backend.name == "cupy" else np.broadcast_to(b, (rows, cols))),
        np.broadcast_to(row, (rows, cols)))
    for name, (view, values) in cases.items():
        t = _targets(rows, values.shape[1], 6, ignored=False)
        got = backend.to_numpy(cufuse.cross_entropy(view, backend.asarray(t), reduction="none"))
        np.testing.assert_allclose(got, _reference(values, t, reduction="none"), rtol=1e-5, atol=1e-5, err_msg=name)


def test_edge_values(backend):
    """-inf logits other than the target's, large logits, an out-of-range
    target (NaN for its row), a NaN logit (NaN), every row ignored (a mean of
    nothing: NaN, as torch), no rows."""
    x = rand((5, 40), np.float32, 8, scale=1.0)
    x[0, :] = -np.inf
    x[0, 3] = 2.0
    x[1] *= 1e4
    x[3, 7] = np.nan
    t = np.array([3, 5, 41, 2, 0], dtype=np.int64)
    got = backend.to_numpy(cufuse.cross_entropy(backend.asarray(x), backend.asarray(t), reduction="none"))
    want = _reference(x, t, reduction="none")
    assert np.isnan(got[2]) and np.isnan(got[3]) and np.isnan(want[2]) and np.isnan(want[3])
    np.testing.assert_allclose(got[[0, 1, 4]], want[[0, 1, 4]], rtol=1e-5, atol=1e-4)
    assert got[0] == pytest.approx(0.0, abs=1e-6)
    allign = backend.asarray(np.full(5, IGNORE, dtype=np.int64))
    assert np.isnan(backend.to_numpy(cufuse.cross_entropy(backend.asarray(x), allign)))
    none = cufuse.cross_entropy(backend.asarray(x[:0]), backend.asarray(t[:0]), reduction="none")
    assert backend.to_numpy(none).shape == (0,)
    assert backend.to_numpy(cufuse.cross_entropy(backend.asarray(x[:0]), backend.asarray(t[:0]),
                                                 reduction="sum")) == 0


@pytest.mark.parametrize("far", [-1e4, -1e9, -1e30])
def test_target_far_below_the_other_logits(backend, far):
    """A target whose logit is far below the row's others (a masked token): the loss and the
    probabilities as accurate as elsewhere. (Shifting by the target's logit, to keep a large offset
    common to the whole row out of the log-sum-exp's rounding, broke exactly these rows: p_j of
    [0, 1, 2, -1e9] came out as 1; that offset case is documented instead.)"""
    x = np.tile(np.array([[0.0, 1.0, 2.0, far]], np.float32), (3, 1))
    t = np.array([3, 3, 0], np.int64)
    got = backend.to_numpy(cufuse.cross_entropy(backend.asarray(x), backend.asarray(t), reduction="none"))
    np.testing.assert_allclose(got, _reference(x, t, reduction="none"), rtol=1e-6, atol=1e-6)


def test_int32_targets(backend):
    x = rand((6, 9), np.float32, 9)
    t = _targets(6, 9, 10)
    got = cufuse.cross_entropy(backend.asarray(x), backend.asarray(t.astype(np.int32)))
    assert backend.to_numpy(got) == pytest.approx(_reference(x, t), rel=1e-5)


# ---------------------------------------------------------------- autograd
torch = pytest.importorskip("torch")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _torch_loss(x, t, eps, z, reduction):
    """The same loss from torch's own ops (its autograd: the reference gradient)."""
    per = torch.nn.functional.cross_entropy(x, t, ignore_index=IGNORE, label_smoothing=eps, reduction="none")
    lse = torch.logsumexp(x, dim=1)
    per = per + torch.where(t != IGNORE, z * lse * lse, torch.zeros_like(lse))
    if reduction == "none":
        return per
    return per.sum() if reduction == "sum" else per.sum() / (t != IGNORE).sum()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "rows-on-packs"])
def test_gradient_against_torch(device, reduction, padded):
    """The logits an intermediate [13, 513]: dense (rows of 513, element by
    element on the GPU), or the first 513 columns of a [13, 520] one (rows
    on 16-byte packs: whole packs, then a tail, written in place)."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(24, 16, generator=g, dtype=torch.float64)
    h0 = torch.randn(13, 24, generator=g, dtype=torch.float64)
    t = torch.randint(0, 513, (13,), generator=g)
    t[4] = IGNORE
    up = torch.randn(13, dtype=torch.float64, generator=g) if reduction == "none" else torch.tensor(0.7,
                                                                                                    dtype=torch.float64)
    proj = torch.randn(16, 520 if padded else 513, generator=g, dtype=torch.float64)
    for dt in ([torch.float32, torch.float64] + ([torch.float16, torch.bfloat16] if device == "cuda" else [])):
        for eps, z in ((0.0, 0.0), (0.1, 1e-2)):
            ours, ref = [h0.clone().to(device, dt).requires_grad_(True) for _ in range(2)]
            # logits as an intermediate (an lm_head's output): the gradient in place. The reference
            # takes the same logits (the same matmuls in dt) into float64: only the losses differ
            lo = ((ours @ w.to(device, dt)) @ proj.to(device, dt))[:, :513]
            lr = ((ref @ w.to(device, dt)) @ proj.to(device, dt))[:, :513].double()
            seen = {}
            lo.register_hook(lambda gr: seen.update(ptr=gr.data_ptr()))
            loss = cufuse.cross_entropy(lo, t.to(device), label_smoothing=eps, z_loss=z, reduction=reduction)
            want = _torch_loss(lr, t.to(device), eps, z, reduction)
            tol = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}[dt]
            torch.testing.assert_close(loss.double(), want, rtol=tol, atol=tol * 10)
            (loss.double() * up.to(device)).sum().backward()
            (want * up.to(device)).sum().backward()
            torch.testing.assert_close(ours.grad.double(), ref.grad.double(), rtol=tol * 4, atol=tol * 4)
            if device == "cuda":  # the gradient went into the logits' own memory
                assert seen["ptr"] == lo.data_ptr()


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck_and_leaf_logits_kept(device):
    g = torch.Generator().manual_seed(12)
    x = torch.randn(6, 19, generator=g, dtype=torch.float64).to(device).requires_grad_(True)
    t = torch.tensor([0, 18, IGNORE, 5, 7, 2]).to(device)
    for red in ("mean", "none"):
        assert torch.autograd.gradcheck(
            lambda v: cufuse.cross_entropy(v, t, label_smoothing=0.2, z_loss=0.05, reduction=red), (x,))
    keep = x.detach().clone()
    cufuse.cross_entropy(x, t).backward()  # a leaf: never overwritten
    assert torch.equal(x.detach(), keep) and x.grad is not None
    x2 = x.detach().clone().requires_grad_(True)
    mid = x2 * 1.0
    cufuse.cross_entropy(mid, t, inplace_backward=False).backward()
    assert torch.equal(mid.detach(), keep)  # asked to keep them


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_of_a_target_far_below(device):
    """The float32 gradient of rows whose target's logit is far below the others, in place on the GPU
    (an intermediate): torch's float64 gradient to float32's accuracy."""
    x = torch.tensor([[0.0, 1.0, 2.0, -1e9], [0.5, -1e4, 2.0, 1.0], [0.0, 1.0, 2.0, 3.0]])
    t = torch.tensor([3, 1, 0])
    ours = x.clone().to(device).requires_grad_(True)
    cufuse.cross_entropy(ours * 1.0, t.to(device), reduction="sum").backward()
    ref = x.double().requires_grad_(True)
    _torch_loss(ref, t, 0.0, 0.0, "sum").backward()
    torch.testing.assert_close(ours.grad.cpu().double(), ref.grad, rtol=1e-5, atol=1e-6)


def test_flags_and_module_attributes():
    """inplace_backward must be a bool ("no" was true: the gradient went into the logits); the module has
    torch's weight attribute (None)."""
    import cufuse.nn
    x = torch.randn(4, 5, requires_grad=True)
    t = torch.tensor([0, 1, 2, IGNORE])
    with pytest.raises(TypeError, match="inplace_backward must be a bool, got str"):
        cufuse.cross_entropy(x * 1.0, t, inplace_backward="no")
    with pytest.raises(TypeError, match="inplace_backward must be a bool"):
        cufuse.nn.CrossEntropyLoss(inplace_backward="False")
    loss = cufuse.nn.CrossEntropyLoss()
    assert loss.weight is None and list(loss.state_dict()) == []


def test_errors():
    x = np.zeros((4, 5), np.float32) + 0.5
    t = np.arange(4, dtype=np.int64)
    with pytest.raises(ValueError, match="must be 2-D"):
        cufuse.cross_entropy(x[None], t)
    with pytest.raises(TypeError, match="accepted dtypes"):
        cufuse.cross_entropy(x.astype(np.int32), t)
    with pytest.raises(TypeError, match="int64"):
        cufuse.cross_entropy(x, t.astype(np.float32))
    with pytest.raises(ValueError, match="need \\(4,\\)"):
        cufuse.cross_entropy(x, t[:3])
    with pytest.raises(TypeError, match="array kind"):
        cufuse.cross_entropy(x, torch.from_numpy(t))
    with pytest.raises(TypeError, match="array kind"):
        cufuse.cross_entropy(x, 3)
    with pytest.raises(ValueError, match="reduction"):
        cufuse.cross_entropy(x, t, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing"):
        cufuse.cross_entropy(x, t, label_smoothing=1.5)
    with pytest.raises(ValueError, match="z_loss"):
        cufuse.cross_entropy(x, t, z_loss=-1.0)
    with pytest.raises(ValueError, match="z_loss must be finite"):
        cufuse.cross_entropy(x, t, z_loss=float("inf"))
    with pytest.raises(TypeError, match="ignore_index"):
        cufuse.cross_entropy(x, t, ignore_index=1.5)
    with pytest.raises(ValueError, match="no classes"):
        cufuse.cross_entropy(x[:, :0], t)
    with pytest.raises(TypeError, match="array kind"):  # requires grad: the same checks
        cufuse.cross_entropy(torch.from_numpy(x).requires_grad_(True), t)


@pytest.mark.parametrize("device", DEVICES)
def test_under_compile(device):
    """torch.compile(fullgraph=True) traces it (torch.ops.cufuse.cross_entropy):
    loss and gradient equal eager's; opcheck passes; bad input still says so."""
    from cufuse import _torch_ops
    _torch_ops.register()
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(13)
    x0 = torch.randn(9, 70, generator=g).to(device)
    t = torch.randint(0, 70, (9,), generator=g).to(device)
    t[3] = IGNORE
    for red in ("mean", "none"):
        def f(x, tt):
            return cufuse.cross_entropy(x * 2.0, tt, label_smoothing=0.1, z_loss=1e-3, reduction=red).sum()
        compiled_matches_eager(f, [x0.clone().requires_grad_(True), t], 1e-6, 1e-6, grad_atol=1e-7)
    for args in ((x0, t, IGNORE, 0.1, 0.01, "mean", None),
                 (x0.clone().requires_grad_(True), t, IGNORE, 0.0, 0.0, "none", torch.float64)):
        torch.library.opcheck(torch.ops.cufuse.cross_entropy, args)
    with pytest.raises(Exception, match="must be \\(rows, classes\\)"):
        torch.compile(lambda x: cufuse.cross_entropy(x, t), fullgraph=True)(x0[None])
    with pytest.raises(Exception, match="ignore_index must be an int"):  # (int() truncated it: a row ignored)
        torch.compile(lambda x: cufuse.cross_entropy(x, t, ignore_index=2.7), fullgraph=True)(x0)
    # a NumPy int ignore_index, taken in eager mode, was refused compiled
    ii = np.int64(IGNORE)
    got = torch.compile(lambda x: cufuse.cross_entropy(x, t, ignore_index=ii), backend="aot_eager")(x0)
    torch.testing.assert_close(got, cufuse.cross_entropy(x0, t))


def test_dtype_of_the_loss(backend):
    """dtype=float32 of 16-bit logits: the float32 sum rounded once to float32
    (not to the logits' dtype); a bad dtype says so."""
    x = rand((12, 300), np.float16, 14, scale=3.0)
    t = _targets(12, 300, 15)
    got = backend.to_numpy(cufuse.cross_entropy(backend.asarray(x), backend.asarray(t), dtype=np.float32))
    assert got.dtype == np.float32
    assert float(got) == pytest.approx(_reference(x, t), rel=2e-6)
    with pytest.raises(TypeError, match="dtype"):
        cufuse.cross_entropy(backend.asarray(x), backend.asarray(t), dtype=np.int32)


@pytest.mark.parametrize("device", DEVICES)
def test_in_place_never_into_a_leaf(device):
    """A view of a leaf (a slice of a Parameter) is not a leaf itself, but its
    memory is the leaf's: the gradient goes into a new tensor there. A view of
    an intermediate (the reshape a language model's loss makes) keeps the
    in-place backward (GPU)."""
    g = torch.Generator().manual_seed(17)
    w = torch.randn(12, 30, generator=g).to(device).requires_grad_(True)
    keep = w.detach().clone()
    t = torch.randint(0, 30, (8,), generator=g).to(device)
    cufuse.cross_entropy(w[2:10], t).backward()
    assert torch.equal(w.detach(), keep)
    want = torch.zeros_like(keep)
    ref = keep.clone().requires_grad_(True)
    torch.nn.functional.cross_entropy(ref[2:10], t).backward()
    torch.testing.assert_close(w.grad, ref.grad, rtol=1e-5, atol=1e-6)
    assert torch.equal(w.grad[:2], want[:2])
    h = torch.randn(2, 4, 5, generator=g).to(device).requires_grad_(True)
    logits = (h @ torch.randn(5, 30, generator=g).to(device)).reshape(-1, 30)  # a view of an intermediate
    seen = {}
    logits.register_hook(lambda gr: seen.update(ptr=gr.data_ptr()))
    cufuse.cross_entropy(logits, t).backward()
    if device == "cuda":
        assert seen["ptr"] == logits.data_ptr()


@pytest.mark.parametrize("device", DEVICES)
def test_chunks_of_one_logits_tensor(device):
    """The loss of each chunk of one logits tensor (z.split()): with
    inplace_backward=False the same gradients as torch's; on the GPU the
    default writes each chunk's gradient in place, and the chunks share one
    version counter, so the next chunk's backward raises torch's in-place
    error (docs/ops.md) rather than reading a changed tensor."""
    g = torch.Generator().manual_seed(18)
    h0 = torch.randn(12, 6, generator=g).to(device)
    w = torch.randn(20, 6, generator=g).to(device)
    t = torch.randint(0, 20, (12,), generator=g).to(device)
    ref = h0.clone().requires_grad_(True)
    torch.nn.functional.cross_entropy(ref @ w.T, t, reduction="sum").backward()

    def run(inplace):
        h = h0.clone().requires_grad_(True)
        z = h @ w.T
        sum(cufuse.cross_entropy(a, b, reduction="sum", inplace_backward=inplace)
            for a, b in zip(z.split(4), t.split(4))).backward()
        return h.grad
    torch.testing.assert_close(run(False), ref.grad, rtol=1e-5, atol=1e-5)
    if device == "cuda":
        with pytest.raises(RuntimeError, match="modified inplace|inplace operation"):
            run(True)
    else:  # (CPU logits are never written in place)
        torch.testing.assert_close(run(True), ref.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_target_changed_in_place_after_the_loss(device):
    """A target changed in place between the loss and its backward: the backward raises, as
    F.cross_entropy's does (the target was kept unsaved, and the gradient used the new classes)."""
    g = torch.Generator().manual_seed(12)
    for loss in (lambda x, h, w, t: cufuse.cross_entropy(x, t),
                 lambda x, h, w, t: cufuse.linear_cross_entropy(h, w, t, reduction="none").sum()):
        x = torch.randn(4, 5, generator=g, dtype=torch.float64).to(device).requires_grad_(True)
        h = torch.randn(4, 3, generator=g, dtype=torch.float64).to(device).requires_grad_(True)
        w = torch.randn(5, 3, generator=g, dtype=torch.float64).to(device).requires_grad_(True)
        t = torch.tensor([0, 1, 2, 3], device=device)
        out = loss(x, h, w, t)
        t.fill_(4)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.backward()


@pytest.mark.parametrize("device", DEVICES)
def test_target_out_of_range_gives_nan_rows(device):
    """A target outside [0, classes) that is not ignore_index: its row's loss
    is NaN and so is every element of its gradient (the GPU gave a finite,
    wrong gradient; the CPU NaN in one column), for cross_entropy and
    linear_cross_entropy; the other rows' gradients stay finite."""
    g = torch.Generator().manual_seed(19)
    t = torch.tensor([0, 5, -1, 2]).to(device)
    x = torch.randn(4, 5, generator=g, dtype=torch.float64).to(device).requires_grad_(True)
    cufuse.cross_entropy(x, t, reduction="none").sum().backward()
    assert torch.isnan(x.grad[1:3]).all() and torch.isfinite(x.grad[[0, 3]]).all()
    h = torch.randn(4, 3, generator=g, dtype=torch.float64).to(device).requires_grad_(True)
    w = torch.randn(5, 3, generator=g, dtype=torch.float64).to(device).requires_grad_(True)
    loss = cufuse.linear_cross_entropy(h, w, t, reduction="none")
    assert torch.isnan(loss[1:3]).all()
    loss.sum().backward()
    assert torch.isnan(h.grad[1:3]).all() and torch.isfinite(h.grad[[0, 3]]).all()
    assert torch.isnan(w.grad).any()


# ------------------------------------------------- linear_cross_entropy
def _linear_reference(h, w, b, t, eps, z, reduction):
    """float64: the logits h @ w.T + b in float64, then ``_reference``; per row as h's leading shape."""
    h64 = np.asarray(h, np.float64).reshape(-1, h.shape[-1])
    logits = h64 @ np.asarray(w, np.float64).T + (0.0 if b is None else np.asarray(b, np.float64))
    got = _reference(logits, np.asarray(t).reshape(-1), eps=eps, z=z, reduction=reduction)
    return got.reshape(h.shape[:-1]) if reduction == "none" else got


def _linear_tol(dt, feats, scale):
    """The logits are made in dt (a product's float32 sum rounded once): their
    rounding, about ``scale`` times dt's rtol, is what the loss differs by."""
    rtol, atol = _tol(dt, feats)
    return rtol, atol + (TOL[dt][0] * scale if np.dtype(dt).itemsize == 2 else 1e-5 if dt == np.float32 else 0)


@pytest.mark.parametrize("dtype", DTYPES_ALL, ids=str)
@pytest.mark.parametrize("chunk_rows", [None, 1, 5, 64], ids=str)
def test_linear_loss_against_reference(backend, dtype, chunk_rows):
    """Odd sizes (2 x 7 rows of 24 features, 37 classes), with and without a
    bias, ignored rows; chunks of 1, 5 (a tail) and more rows than there are."""
    h = rand((2, 7, 24), dtype, 21)
    w = rand((37, 24), dtype, 22, scale=0.4)
    b = rand((37,), dtype, 23)
    t = _targets(14, 37, 24).reshape(2, 7)
    t[1, 2] = IGNORE
    ha, wa, ba, ta = (backend.asarray(a) for a in (h, w, b, t))
    for bias in (None, ba):
        for eps, z in ((0.0, 0.0), (0.1, 1e-3)):
            for reduction in ("mean", "sum", "none"):
                got = backend.to_numpy(cufuse.linear_cross_entropy(ha, wa, ta, bias=bias, label_smoothing=eps, z_loss=z,
                                                                   reduction=reduction, chunk_rows=chunk_rows))
                want = _linear_reference(h, w, None if bias is None else b, t, eps, z, reduction)
                assert got.dtype == dtype and got.shape == np.shape(want), (got.dtype, got.shape)
                rtol, atol = _linear_tol(dtype, 24, 6.0)
                np.testing.assert_allclose(got.astype(np.float64), want, rtol=rtol,
                                           atol=atol * (14 if reduction == "sum" else 1),
                                           err_msg=f"bias {bias is not None} eps {eps} z {z} {reduction}")


def test_linear_loss_empty_and_errors(backend):
    w = backend.asarray(rand((11, 8), np.float32, 25))
    h0, t0 = backend.asarray(np.zeros((0, 8), np.float32)), backend.asarray(np.zeros((0,), np.int64))
    assert backend.to_numpy(cufuse.linear_cross_entropy(h0, w, t0, reduction="none")).shape == (0,)
    assert np.isnan(backend.to_numpy(cufuse.linear_cross_entropy(h0, w, t0)))  # a mean of no rows, as torch
    # no features: every logit is the bias (0 without one), as torch's linear then cross_entropy
    hf, wf = backend.asarray(np.zeros((3, 0), np.float32)), backend.asarray(np.zeros((5, 0), np.float32))
    bias = rand((5,), np.float32, 24)
    tf = np.array([1, 2, 4], np.int64)
    got = backend.to_numpy(cufuse.linear_cross_entropy(hf, wf, backend.asarray(tf), bias=backend.asarray(bias),
                                                       reduction="none"))
    b64 = bias.astype(np.float64)
    np.testing.assert_allclose(got, np.log(np.exp(b64).sum()) - b64[tf], rtol=1e-6)
    h = backend.asarray(rand((4, 8), np.float32, 26))
    t = backend.asarray(np.arange(4, dtype=np.int64))
    with pytest.raises(ValueError, match="8 features"):
        cufuse.linear_cross_entropy(backend.asarray(rand((4, 9), np.float32, 27)), w, t)
    with pytest.raises(TypeError, match="weight has dtype float64"):
        cufuse.linear_cross_entropy(h, backend.asarray(rand((11, 8), np.float64, 28)), t)
    with pytest.raises(ValueError, match="weight must be 2-D"):
        cufuse.linear_cross_entropy(h, backend.asarray(rand((11, 8, 1), np.float32, 28)), t)
    with pytest.raises(ValueError, match="bias has shape"):
        cufuse.linear_cross_entropy(h, w, t, bias=backend.asarray(rand((10,), np.float32, 29)))
    with pytest.raises(ValueError, match="need \\(4,\\)"):
        cufuse.linear_cross_entropy(h, w, backend.asarray(np.arange(3, dtype=np.int64)))
    with pytest.raises(TypeError, match="weight must be an array"):
        cufuse.linear_cross_entropy(h, [[1.0] * 8] * 11, t)
    other = np.ones((11, 8), np.float32) if backend.name != "numpy" else torch.ones(11, 8)
    with pytest.raises(TypeError, match="weight must be the hidden states' array kind"):
        cufuse.linear_cross_entropy(h, other, t)
    with pytest.raises(TypeError, match="accepted dtypes"):
        cufuse.linear_cross_entropy(backend.asarray(np.ones((4, 8), np.int32)), w, t)
    with pytest.raises(ValueError, match="no classes"):
        cufuse.linear_cross_entropy(h, backend.asarray(np.ones((0, 8), np.float32)), t)
    with pytest.raises(ValueError, match="chunk_rows must be >= 1"):
        cufuse.linear_cross_entropy(h, w, t, chunk_rows=0)
    with pytest.raises(TypeError, match="chunk_rows"):
        cufuse.linear_cross_entropy(h, w, t, chunk_rows=2.0)
    with pytest.raises(ValueError, match="reduction"):
        cufuse.linear_cross_entropy(h, w, t, reduction="avg")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("classes", [97, 16, 3], ids=str)
def test_linear_gradient_against_torch(device, reduction, classes):
    """Gradients of hidden, weight and bias against torch's autograd of the
    float64 logits and loss, in chunks of 4 rows (a tail of 1); only the
    inputs that require grad get one; every row ignored gives zero gradients.
    The classes: whole 16-byte packs and a tail (97: the GPU's logits rows
    padded to 104), packs only (16), a tail only (3)."""
    g = torch.Generator().manual_seed(31)
    h0 = torch.randn(3, 5, 40, generator=g, dtype=torch.float64)
    w0 = torch.randn(classes, 40, generator=g, dtype=torch.float64) * 0.3
    b0 = torch.randn(classes, generator=g, dtype=torch.float64)
    t = torch.randint(0, classes, (3, 5), generator=g)
    t[0, 1] = t[2, 4] = IGNORE
    up = torch.randn(3, 5, generator=g, dtype=torch.float64) if reduction == "none" else torch.tensor(
        0.7, dtype=torch.float64)
    dts = [torch.float32, torch.float64] + ([torch.float16, torch.bfloat16] if device == "cuda" else [])
    for dt in dts:
        for grads in ("hwb", "w", "h"):
            ours = [v.to(device, dt, copy=True).requires_grad_(k in grads) for k, v in zip("hwb", (h0, w0, b0))]
            ref = [v.clone().requires_grad_(True) for v in (h0, w0, b0)]
            rnd = [v.detach().to(dt).double() for v in ours]  # the inputs as dt holds them
            loss = cufuse.linear_cross_entropy(ours[0], ours[1], t.to(device), bias=ours[2], label_smoothing=0.1,
                                               z_loss=1e-2, reduction=reduction, chunk_rows=4)
            lr = torch.nn.functional.linear(*(r.cpu() + (v - v.detach()) for r, v in zip(rnd, ref)))
            want = _torch_loss(lr.reshape(-1, classes), t.reshape(-1), 0.1, 1e-2, reduction)
            want = want.reshape(3, 5) if reduction == "none" else want
            tol = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}[dt]
            torch.testing.assert_close(loss.double().cpu(), want, rtol=tol, atol=tol * 10)
            (loss.double() * up.to(device)).sum().backward()
            (want * up).sum().backward()
            for k, o, r in zip("hwb", ours, ref):
                if k not in grads:
                    assert o.grad is None, k
                    continue
                s = float(r.grad.abs().max())
                torch.testing.assert_close(o.grad.double().cpu(), r.grad, rtol=tol * 4, atol=tol * 4 * s,
                                           msg=f"{dt} {grads}: d{k}")
    hidden = h0.to(device).requires_grad_(True)
    cufuse.linear_cross_entropy(hidden, w0.to(device), torch.full((3, 5), IGNORE, device=device),
                                reduction="sum").backward()
    assert torch.equal(hidden.grad, torch.zeros_like(hidden))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("classes", [97, 96], ids=str)
def test_linear_no_rows_gives_zero_gradients(device, classes):
    """No hidden rows: the loss of nothing, and zero weight and bias
    gradients (not whatever memory the allocator handed back: NaN is freed
    just before), for every reduction."""
    for reduction in ("mean", "sum", "none"):
        dirty = torch.full((classes + 8, 24), float("nan"), device=device)
        del dirty
        h = torch.zeros(0, 24, device=device, requires_grad=True)
        w = torch.randn(classes, 24, device=device, requires_grad=True)
        b = torch.randn(classes, device=device, requires_grad=True)
        loss = cufuse.linear_cross_entropy(h, w, torch.zeros(0, dtype=torch.int64, device=device), bias=b,
                                           reduction=reduction)
        (loss.sum() if reduction == "none" else loss.nan_to_num()).backward()
        for name, p in (("weight", w), ("bias", b)):
            assert p.grad is not None and p.grad.shape == p.shape, name
            assert torch.equal(p.grad, torch.zeros_like(p)), (reduction, name)


@pytest.mark.parametrize("device", DEVICES)
def test_linear_under_compile_makes_no_logits(device):
    """Under torch.compile(fullgraph=True) linear_cross_entropy is the
    registered operator cufuse::linear_cross_entropy (no [rows, classes]
    product in the traced graph), with loss and gradients equal to eager's
    for every reduction, the gradients of the operands that require grad only
    (made in the forward for a mean or sum, else in the backward), a kept
    graph backpropagated twice, opcheck of both operators, and bad input
    said before anything runs."""
    from torch._dynamo.testing import EagerAndRecordGraphs

    from cufuse import _torch_ops
    _torch_ops.register()
    g = torch.Generator().manual_seed(33)
    h0 = torch.randn(3, 7, 24, generator=g)
    w0 = torch.randn(37, 24, generator=g) * 0.3
    b0 = torch.randn(37, generator=g)
    t = torch.randint(0, 37, (3, 7), generator=g)
    t[1, 2] = IGNORE
    t, up = t.to(device), torch.randn(3, 7, generator=g).to(device)
    cases = [(torch.float32, red, grads) for red in ("mean", "sum", "none") for grads in ("hwb", "w")]
    cases += [(torch.float64, "mean", "hwb"), (torch.float64, "none", "w")]
    if device == "cuda":  # (float16's mean: gradients made in the backward)
        cases += [(torch.bfloat16, "mean", "hwb"), (torch.bfloat16, "none", "hwb"), (torch.float16, "mean", "hwb"),
                  (torch.float16, "sum", "w")]
    for dt, reduction, grads in cases:
        tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dt]
        def f(x, weight, bias):
            loss = cufuse.linear_cross_entropy(x * 1.5, weight, t, bias=bias, label_smoothing=0.1,
                                               z_loss=1e-3, reduction=reduction, chunk_rows=8,
                                               dtype=None if dt == torch.float64 else torch.float32)
            return (loss * up).sum() if reduction == "none" else loss
        torch._dynamo.reset()
        args = [v.to(device, dt, copy=True).requires_grad_(k in grads) for k, v in zip("hwb", (h0, w0, b0))]
        got = compiled_matches_eager(f, args, tol, tol, grad_rtol=tol * 4, grad_atol=tol * 4)
        assert [a.grad is not None for a in got] == [k in grads for k in "hwb"], (dt, reduction, grads)
    rec = EagerAndRecordGraphs()
    torch._dynamo.reset()
    hw = [v.to(device, copy=True).requires_grad_(True) for v in (h0, w0)]
    loss = torch.compile(lambda x, w: cufuse.linear_cross_entropy(x, w, t, chunk_rows=8), backend=rec,
                         fullgraph=True)(*hw)
    code = "\n".join(gm.code for gm in rec.graphs)
    assert "cufuse.linear_cross_entropy" in code and "linear(" not in code and "matmul" not in code, code
    loss.backward(retain_graph=True)  # the forward's gradients, scaled out of place: a second backward adds them
    first = [a.grad.clone() for a in hw]
    loss.backward()
    for a, once in zip(hw, first):
        torch.testing.assert_close(a.grad, 2 * once)
    h, w, b, tt = h0[0].to(device), w0.to(device), b0.to(device), t[0]
    for need, red in (([True, True, True], "mean"), ([False, True, False], "sum"), ([True, True, True], "none")):
        args = (h.clone().requires_grad_(need[0]), w.clone().requires_grad_(need[1]), b.clone().requires_grad_(need[2]),
                tt, IGNORE, 0.1, 0.0, red, None, 4, need)
        torch.library.opcheck(torch.ops.cufuse.linear_cross_entropy, args)
    torch.library.opcheck(torch.ops.cufuse.linear_cross_entropy_backward,
                          (torch.randn(7, device=device), h, w, None, tt, (tt != IGNORE).sum(), IGNORE, 0.0, 0.0,
                           "none", 0, [True, True, False]))
    with pytest.raises(RuntimeError, match="leaves out an operand that requires grad"):  # (a direct call)
        torch.ops.cufuse.linear_cross_entropy(h.clone().requires_grad_(True), w, None, tt, IGNORE, 0.0, 0.0, "mean",
                                              None, 0, [False, False, False])
    torch._dynamo.reset()  # a NumPy integer for chunk_rows, as eager mode takes
    x, three = h.clone().requires_grad_(True), np.int64(3)
    torch.testing.assert_close(
        torch.compile(lambda a: cufuse.linear_cross_entropy(a, w, tt, chunk_rows=three), fullgraph=True)(x),
        cufuse.linear_cross_entropy(x, w, tt, chunk_rows=3))
    for bad in ("3", 2.5, True, 0):  # what eager mode refuses is refused while tracing too
        torch._dynamo.reset()
        with pytest.raises(Exception, match="chunk_rows must be an int >= 1"):
            torch.compile(lambda a, bad=bad: cufuse.linear_cross_entropy(a, w, tt, chunk_rows=bad), fullgraph=True)(x)
    with pytest.raises(Exception, match="weight \\[classes, features\\]"):
        torch.compile(lambda x: cufuse.linear_cross_entropy(x, w, tt), fullgraph=True)(h[:, :5])
    with pytest.raises(Exception, match="share a float dtype"):
        torch.compile(lambda x: cufuse.linear_cross_entropy(x, w, tt), fullgraph=True)(h.double())


@pytest.mark.parametrize("device", DEVICES)
def test_linear_gradcheck_and_compile(device):
    """gradcheck (float64, chunks of 2); under torch.compile(fullgraph=True)
    the loss and gradients equal eager's."""
    g = torch.Generator().manual_seed(32)
    h = torch.randn(5, 6, generator=g, dtype=torch.float64).to(device).requires_grad_(True)
    w = torch.randn(9, 6, generator=g, dtype=torch.float64).to(device).requires_grad_(True)
    b = torch.randn(9, generator=g, dtype=torch.float64).to(device).requires_grad_(True)
    t = torch.tensor([0, 8, IGNORE, 5, 7]).to(device)
    # reduction "none" makes its gradients in the backward (gradcheck's backwards are many); the mean's
    # (made in the forward) are checked against torch's autograd above, and go to one backward only
    assert torch.autograd.gradcheck(lambda *a: cufuse.linear_cross_entropy(
        a[0], a[1], t, bias=a[2], label_smoothing=0.2, z_loss=0.05, reduction="none", chunk_rows=2), (h, w, b))
    loss = cufuse.linear_cross_entropy(h, w, t, bias=b, reduction="mean", chunk_rows=2)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()
    torch._dynamo.reset()

    def f(x, weight, bias):
        return cufuse.linear_cross_entropy(x * 2.0, weight, t, bias=bias, z_loss=1e-3)
    compiled_matches_eager(f, [h.float(), w.float(), b.float()], 1e-5, 1e-5, grad_atol=1e-5)
