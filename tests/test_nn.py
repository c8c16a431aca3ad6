"""cufuse.nn: the modules take the replaced modules' constructor arguments
and state_dict keys, load their state, and give their outputs and
gradients (against the torch modules themselves, in float64 on the CPU, and
float32 / bfloat16 on the GPU with tests/test_autograd.py's TOL)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cufuse  # noqa: E402
import cufuse.nn as cnn  # noqa: E402
from cufuse import _arrays as A  # noqa: E402

from test_autograd import TOL  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
nn = torch.nn


class _TorchSwiGLU(nn.Module):  # Hugging Face's LlamaMLP, written out
    def __init__(self, hidden, inter, act=nn.functional.silu):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act = act

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


# name -> (cufuse module, torch module): the same constructor arguments
PAIRS = {
    "LayerNorm": (lambda: cnn.LayerNorm(48), lambda: nn.LayerNorm(48)),
    "LayerNorm_2d_nobias": (lambda: cnn.LayerNorm((6, 8), eps=1e-6, bias=False),
                            lambda: nn.LayerNorm((6, 8), eps=1e-6, bias=False)),
    "LayerNorm_noaffine": (lambda: cnn.LayerNorm(48, elementwise_affine=False),
                           lambda: nn.LayerNorm(48, elementwise_affine=False)),
    "RMSNorm": (lambda: cnn.RMSNorm(48, eps=1e-6), lambda: nn.RMSNorm(48, eps=1e-6)),
    "RMSNorm_eps_none": (lambda: cnn.RMSNorm([48]), lambda: nn.RMSNorm([48])),
    "GELU": (lambda: cnn.GELU(), lambda: nn.GELU()),
    "GELU_tanh": (lambda: cnn.GELU("tanh"), lambda: nn.GELU("tanh")),
    "SwiGLU": (lambda: cnn.SwiGLU(48, 96), lambda: _TorchSwiGLU(48, 96)),
    "GeGLU": (lambda: cnn.GeGLU(48, 96), lambda: _TorchSwiGLU(48, 96, nn.functional.gelu)),
    "GeGLU_tanh": (lambda: cnn.GeGLU(48, 96, activation="gelu_tanh"),
                   lambda: _TorchSwiGLU(48, 96, lambda v: nn.functional.gelu(v, approximate="tanh"))),
}


def _randomize(m, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * 0.5 + 0.5)


@pytest.mark.parametrize("name", list(PAIRS))
def test_state_dict_is_torch_s(name):
    ours, theirs = (f() for f in PAIRS[name])
    _randomize(theirs, 1)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())  # strict
    theirs.load_state_dict(ours.state_dict())
    for (k, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items()):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(PAIRS))
def test_forward_and_gradients_match_torch(name, device):
    dtypes = [torch.float64] if device == "cpu" else [torch.float32] + ([torch.bfloat16] if A.BF16 else [])
    for dtype in dtypes:
        ours, theirs = (f().to(device=device, dtype=dtype) for f in PAIRS[name])
        _randomize(theirs, 2)
        ours.load_state_dict(theirs.state_dict())
        shape = (4, 5, 6, 8) if "2d" in name else (4, 5, 48)
        g = torch.Generator().manual_seed(3)
        x = (torch.randn(shape, generator=g, dtype=torch.float64) * 2).to(dtype).to(device)
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ya, yb = ours(xa), theirs(xb)
        tol = TOL[dtype] if dtype != torch.float64 else (1e-10, 1e-10)
        scale = max(1.0, float(yb.detach().abs().max()))
        torch.testing.assert_close(ya, yb, rtol=tol[0] * 4, atol=tol[1] * 4 * scale)
        dy = torch.randn(ya.shape, generator=g, dtype=torch.float64).to(dtype).to(device)
        ya.backward(dy)
        yb.backward(dy)
        pairs = [("x", xa.grad, xb.grad)] + [(k, p.grad, q.grad) for (k, p), (_, q)
                                            in zip(ours.named_parameters(), theirs.named_parameters())]
        for k, a, b in pairs:
            assert a is not None and a.dtype == b.dtype, (name, k)
            s = max(1.0, float(b.abs().max()))
            torch.testing.assert_close(a, b, rtol=tol[0] * 8, atol=tol[1] * 8 * s, msg=f"{name} {dtype}: {k}")


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_default_eps_of_16bit_input(device):
    """eps=None with a 16-bit input is float32's epsilon, as torch's: with the input's own
    (1e-3 for float16, 8e-3 for bfloat16) activations of 0.01 came out a third of torch's."""
    for dtype in [torch.float16] + ([torch.bfloat16] if A.BF16 is not None else []):
        g = torch.Generator().manual_seed(4)
        x = (torch.randn(6, 32, generator=g, dtype=torch.float64) * 0.01).to(dtype).to(device)
        ours, theirs = cnn.RMSNorm(32).to(device, dtype), nn.RMSNorm(32).to(device, dtype)
        want = theirs(x).double()
        torch.testing.assert_close(ours(x).double(), want, rtol=2e-2, atol=2e-2)
        y, h = ours.add_and_norm(x, x)
        torch.testing.assert_close(y.double(), theirs(x + x).double(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_float32_weights_under_16bit_input(device):
    """Parameters kept in float32 (master weights) with a 16-bit input: cast
    in the forward, gradients in float32."""
    dt = torch.bfloat16 if A.BF16 is not None else torch.float16
    if device == "cpu" and dt == torch.float16:
        pytest.skip("float16 is checked on the GPU")
    m = cnn.RMSNorm(32, eps=1e-6).to(device)
    x = torch.randn(3, 32, device=device).to(dt).requires_grad_(True)
    y = m(x)
    assert y.dtype == dt
    y.float().sum().backward()
    assert m.weight.grad.dtype == torch.float32 and x.grad.dtype == dt


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["LayerNorm", "LayerNorm_2d_nobias", "RMSNorm", "RMSNorm_eps_none"])
def test_add_and_norm(name, device):
    """norm.add_and_norm(x, residual) is (the torch module of x + residual,
    x + residual), values and gradients of x, residual and the parameters,
    with both outputs in the loss."""
    ours, theirs = (f().to(device=device, dtype=torch.float64) for f in PAIRS[name])
    _randomize(ours, 3)
    theirs.load_state_dict(ours.state_dict())
    g = torch.Generator().manual_seed(4)
    shape = (5,) + tuple(ours.normalized_shape)
    a = [torch.randn(shape, generator=g, dtype=torch.float64).to(device).requires_grad_(True) for _ in range(2)]
    b = [t.detach().clone().requires_grad_(True) for t in a]
    y, h = ours.add_and_norm(*a)
    hr = b[0] + b[1]
    yr = theirs(hr)
    torch.testing.assert_close(h, hr, rtol=0, atol=0)
    torch.testing.assert_close(y, yr, rtol=1e-10, atol=1e-10)
    (y.square().sum() + h.sum()).backward()
    (yr.square().sum() + hr.sum()).backward()
    for p, q in [*zip(a, b), *zip(ours.parameters(), theirs.parameters())]:
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("device", DEVICES)
def test_gelu_dropout_module(device):
    m = cnn.GELUDropout(0.25).to(device)
    x = torch.randn(64, 128, device=device, requires_grad=True)
    cufuse.manual_seed(5)
    y = m(x)
    kept = y != 0
    assert 0.6 < kept.float().mean().item() < 0.9
    y.backward(torch.ones_like(y))
    assert torch.equal(x.grad != 0, kept)  # the gradient goes through exactly the kept elements
    m.eval()
    torch.testing.assert_close(m(x), nn.functional.gelu(x), rtol=1e-5, atol=1e-6)
    for p in (1.0, "0.1", True):
        with pytest.raises(ValueError, match="p must be a number in"):
            cnn.GELUDropout(p)
    with pytest.raises(ValueError, match=r"GELUDropout: p = 0.9999999 is closer to 1 than the mask resolves"):
        cnn.GELUDropout(0.9999999)  # (at construction, not at the first forward)
    assert cnn.GELUDropout(np.float32(0.25)).p == 0.25 and cnn.GELUDropout(np.int64(0)).p == 0


@pytest.mark.parametrize("device", DEVICES)
def test_gelu_dropout_module_under_checkpoint(device):
    """The module's masks follow torch's generator (torch.manual_seed repeats
    them), so torch.utils.checkpoint's recompute, reentrant or not, draws the
    forward's mask: the gradient goes through exactly the kept elements."""
    from torch.utils.checkpoint import checkpoint
    m = cnn.GELUDropout(0.5).to(device)
    x = (torch.rand(1000, dtype=torch.float64, device=device) + 0.5).requires_grad_(True)  # gelu(x) > 0
    torch.manual_seed(3)
    a = m(x)
    torch.manual_seed(3)
    assert torch.equal(m(x), a)
    for reentrant in (True, False):
        x.grad = None
        y = checkpoint(m, x, use_reentrant=reentrant)
        y.sum().backward()
        assert 300 < int((y != 0).sum()) < 700
        assert torch.equal(x.grad != 0, y != 0), f"use_reentrant={reentrant}"


@pytest.mark.parametrize("device", DEVICES)
def test_cross_entropy_loss_module(device):
    """cufuse.nn.CrossEntropyLoss against torch.nn.CrossEntropyLoss (the same
    arguments), loss and the gradient of logits that are an intermediate."""
    g = torch.Generator().manual_seed(21)
    h0 = torch.randn(10, 32, generator=g, dtype=torch.float64)
    proj = torch.randn(32, 77, generator=g, dtype=torch.float64).to(device)
    t = torch.randint(0, 77, (10,), generator=g).to(device)
    t[2] = -1
    for red in ("mean", "sum", "none"):
        ours, ref = cnn.CrossEntropyLoss(ignore_index=-1, reduction=red, label_smoothing=0.05), \
            nn.CrossEntropyLoss(ignore_index=-1, reduction=red, label_smoothing=0.05)
        a, b = (h0.clone().to(device).requires_grad_(True) for _ in range(2))
        la, lb = ours(a @ proj, t), ref(b @ proj, t)
        torch.testing.assert_close(la, lb, rtol=1e-10, atol=1e-12)
        la.sum().backward()
        lb.sum().backward()
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)
    assert "ignore_index=-1" in repr(ours)
    with pytest.raises(NotImplementedError, match="class weights"):
        cnn.CrossEntropyLoss(weight=torch.ones(77))
    # torch's positional order: the third argument is ignore_index (it had been reduction's place)
    assert cnn.CrossEntropyLoss(None, None, 7).ignore_index == 7
    with pytest.raises(NotImplementedError, match="size_average and reduce"):
        cnn.CrossEntropyLoss(None, False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
def test_gated_from_one_projection(device, activation):
    """cufuse.nn.gated: act(gate) * up of the two halves of one tensor (a
    fused gate_up projection), values and gradient against torch's chunk."""
    acts = {"silu": nn.functional.silu, "gelu": nn.functional.gelu,
            "gelu_tanh": lambda v: nn.functional.gelu(v, approximate="tanh")}
    g = torch.Generator().manual_seed(31)
    x0 = torch.randn(5, 3, 2 * 24, generator=g, dtype=torch.float64).to(device)
    a, b = x0.clone().requires_grad_(True), x0.clone().requires_grad_(True)
    ya = cnn.gated(a, activation)
    gate, up = b.chunk(2, dim=-1)
    yb = acts[activation](gate) * up
    torch.testing.assert_close(ya, yb, rtol=1e-12, atol=1e-12)
    (ya * ya).sum().backward()
    (yb * yb).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="must be even"):
        cnn.gated(x0[..., :5])
    with pytest.raises(ValueError, match="activation"):
        cnn.gated(x0, "relu")


@pytest.mark.cuda
def test_swiglu_backward_into_the_projections_outputs():
    """SwiGLU(inplace_backward=True) (the default) writes the gradients of
    gate_proj's and up_proj's outputs into those outputs (as gate_proj's
    backward hook sees: the same address), with gradients bit-for-bit those
    of inplace_backward=False, a lower peak, and not where the graph is
    kept (retain_graph: a second backward gives the same gradients again)."""
    dt, dev = torch.float16, "cuda"
    g = torch.Generator().manual_seed(41)
    ours = cnn.SwiGLU(256, 4096, device=dev, dtype=dt)
    plain = cnn.SwiGLU(256, 4096, device=dev, dtype=dt, inplace_backward=False)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn(p.shape, generator=g).to(dt) * 0.05)
    plain.load_state_dict(ours.state_dict())
    assert "inplace_backward=False" in repr(plain) and "inplace_backward" not in repr(ours)
    x0 = torch.randn(2048, 256, generator=g).to(dev, dt)
    dy = torch.randn(2048, 256, generator=g).to(dev, dt)

    def step(m, retain=False):
        seen = {}
        hooks = [m.gate_proj.register_forward_hook(lambda mod, i, o: seen.update(out=o.data_ptr(), t=o, v=o._version)),
                 m.gate_proj.register_full_backward_hook(lambda mod, gi, go: seen.setdefault("grad", []).append(
                     go[0].data_ptr()))]
        for p in m.parameters():
            p.grad = None
        x = x0.clone().requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        y = m(x)
        y.backward(dy, retain_graph=retain)
        if retain:
            y.backward(dy)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        for h in hooks:
            h.remove()
        # the version of gate_proj's output moves where it now holds its gradient: torch's saved-tensor check
        assert (seen["t"]._version > seen["v"]) == (seen["grad"][-1] == seen["out"])
        return x.grad, [p.grad.clone() for p in m.parameters()], [q == seen["out"] for q in seen["grad"]], peak

    gx, gp, into, peak = step(ours)
    hx, hp, into_plain, peak_plain = step(plain)
    assert into == [True] and into_plain == [False]
    assert torch.equal(gx, hx) and all(torch.equal(a, b) for a, b in zip(gp, hp))
    inter = 2048 * 4096 * 2  # bytes of gate_proj's output
    assert peak_plain - peak >= inter // 2, (peak, peak_plain)
    kx, kp, into_kept, _ = step(ours, retain=True)
    assert into_kept == [False, True]  # the kept graph's backward, then the last one
    torch.testing.assert_close(kx, 2 * gx, rtol=1e-3, atol=1e-3)
    for a, b in zip(kp, gp):
        torch.testing.assert_close(a, 2 * b, rtol=1e-2, atol=1e-2)


_SCALED_GATE = cufuse.fuse(lambda a, s, b: a * cufuse.sigmoid(a) * b * s)


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["same tensor twice", "overlapping views", "apart",
                                  "overlapping, a number between", "apart, a number between"])
def test_gradients_into_arguments_that_share_memory(case):
    """The backward that may write each gradient into its argument
    (SwiGLU's) does so only where no other argument shares a byte with it:
    the same intermediate given twice, or two contiguous views of one
    buffer that overlap, get gradients of their own (right values); two
    apart still get theirs in place. With a number among the arguments, an
    argument's position is not its place among the tensors."""
    scaled = "number" in case
    g = torch.Generator().manual_seed(43)
    x0 = torch.randn(3 * 512, generator=g, dtype=torch.float64)
    a = x0.to("cuda", torch.float32).requires_grad_(True)
    ref = x0.clone().requires_grad_(True)

    def split(t):
        base = t * 1.0  # an intermediate: its memory is autograd's own
        if case == "same tensor twice":
            v = base[:1024]
            return v, v, base
        if case.startswith("overlapping"):
            return base[:1024], base[512:1536], base
        return base[:512], base[1024:1536], base
    gate, up, base = split(a)
    rg, ru, _ = split(ref)
    dy = torch.randn(gate.shape, generator=g, dtype=torch.float64)
    seen = []
    base.register_hook(lambda grad: seen.append(grad))
    if scaled:
        y = _SCALED_GATE._recorded((gate, 0.5, up), into_inputs=True)
        expect = torch.nn.functional.silu(rg) * ru * 0.5
    else:
        y = cnn._GATES["silu"]._recorded((gate, up), into_inputs=True)
        expect = torch.nn.functional.silu(rg) * ru
    y.backward(dy.to("cuda", torch.float32))
    expect.backward(dy)
    torch.testing.assert_close(a.grad.double().cpu(), ref.grad, rtol=1e-5, atol=1e-5)
    if case.startswith("apart"):  # in place: gate's view of base now holds gate's gradient
        assert torch.equal(base.detach()[:512], seen[0][:512])
    else:  # base's memory untouched
        assert torch.equal(base.detach(), a.detach() * 1.0)


@pytest.mark.cuda
def test_functional_swiglu_leaves_its_arguments_alone():
    """cufuse.nn.swiglu called on a caller's tensors (intermediates too) never
    writes gradients into them: only the module, which made them, does."""
    g = torch.Generator().manual_seed(42)
    a = torch.randn(64, 96, generator=g).cuda().requires_grad_(True)
    b = torch.randn(64, 96, generator=g).cuda().requires_grad_(True)
    gate, up = a * 1.5, b * 0.5
    before = gate.detach().clone(), up.detach().clone()
    cnn.swiglu(gate, up).sum().backward()
    assert torch.equal(gate.detach(), before[0]) and torch.equal(up.detach(), before[1])
    ref = torch.nn.functional.silu(before[0]) * before[1]
    torch.testing.assert_close(cnn.swiglu(before[0], before[1]), ref, rtol=1e-5, atol=1e-5)


def test_swiglu_when_its_backward_may_write_in_place():
    """SwiGLU._into: asked for, and not where a forward hook on a projection (or a global one) could
    keep the outputs while saved-tensor hooks turn off torch's check of tensors changed in place; a
    module pickled before the option had it on (the class's default)."""
    m = cnn.SwiGLU(8, 16)
    saved_hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    assert m._into()
    with saved_hooks:
        assert m._into()  # nothing else sees the outputs: non-reentrant checkpointing keeps it
    for where in (m.gate_proj, m.up_proj, None):
        h = (where.register_forward_hook(lambda *a: None) if where is not None
             else torch.nn.modules.module.register_module_forward_hook(lambda *a: None))
        try:
            assert m._into()  # the version check stands: an in-place error, not a wrong gradient
            with saved_hooks:
                assert not m._into()
        finally:
            h.remove()
    assert not cnn.SwiGLU(8, 16, inplace_backward=False)._into()
    old = cnn.SwiGLU(8, 16)
    del old.__dict__["inplace_backward"]
    assert old._into() and "inplace_backward" not in repr(old)
