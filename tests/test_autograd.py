"""Autograd of the elementwise ops (cufuse/_autograd.py) on torch tensors:
torch.autograd.gradcheck in float64 (CPU: the NumPy path; CUDA: the
generated backward kernels), and gradients against torch's own autograd of a
reference written with torch ops, in float32, float16 and bfloat16, with broadcast
operands, scalars and partial requires_grad."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cufuse  # noqa: E402
from cufuse import _arrays as A  # noqa: E402
from _reference import compiled_matches_eager  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
TF = torch.nn.functional

# op -> (the cufuse call, torch's reference, operand shapes); scalars are floats
CASES = {
    "add_relu": (lambda a, b: cufuse.add_relu(a, b), lambda a, b: torch.relu(a + b), [(7, 33), (33,)]),
    "mul_tanh": (lambda a, b: cufuse.mul_tanh(a, b), lambda a, b: torch.tanh(a * b), [(7, 33), (7, 1)]),
    "add_mul_exp": (lambda a, b: cufuse.add_mul_exp(a, b), lambda a, b: torch.exp((a + b) * 2), [(7, 33), (7, 33)]),
    "fma": (lambda q, k, v: cufuse.fma(q, k, v), lambda q, k, v: q * k + v, [(7, 33), (33,), (7, 1)]),
    "fma_scalar": (lambda q, v: cufuse.fma(q, 0.75, v), lambda q, v: q * 0.75 + v, [(7, 33), ()]),
    "bias_gelu": (lambda x, b: cufuse.bias_gelu(x, b), lambda x, b: TF.gelu(x + b), [(7, 33), (33,)]),
    "bias_gelu_tanh": (lambda x, b: cufuse.bias_gelu(x, b, "tanh"), lambda x, b: TF.gelu(x + b, approximate="tanh"),
                       [(7, 33), (33,)]),
}
# bfloat16: float16's entry scaled by 8 (7 significant bits against 10)
TOL = {torch.float64: (1e-10, 1e-12), torch.float32: (2e-5, 2e-6), torch.float16: (5e-3, 2e-3),
       torch.bfloat16: (4e-2, 1.6e-2)}
BF16 = [torch.bfloat16] if A.BF16 is not None else []  # (bfloat16 needs ml_dtypes)


def _inputs(shapes, dtype, device, seed, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g, dtype=torch.float64) * scale).to(dtype).to(device).requires_grad_(True)
            for s in shapes]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_gradcheck(name, device):
    call, _, shapes = CASES[name]
    args = _inputs(shapes, torch.float64, device, 1)
    assert torch.autograd.gradcheck(call, args, eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_ops_on_transposed_inputs(device):
    """Transposed operands and weights under torch.compile: the registered operators' fakes say C order,
    as the results are (the CPU path had kept a transposed input's layout, and gelu_dropout's and the norm
    weight gradient's fakes a transposed operand's: Inductor's stride checks failed)."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(21)
    x = torch.randn(4, 3, generator=g).to(device).t()
    b = torch.randn(4, generator=g).to(device)
    f = torch.compile(lambda x, b: cufuse.add_relu(x, b) * 2, fullgraph=True)
    torch.testing.assert_close(f(x, b), torch.relu(x + b) * 2)
    xg = x.detach().clone().t().contiguous().t().requires_grad_(True)
    torch.compile(lambda v: cufuse.gelu_dropout(v, 0.2, seed=5) * 2, fullgraph=True)(xg).sum().backward()
    assert xg.grad.shape == (3, 4)
    w = torch.randn(4, 3, generator=g).to(device).t().requires_grad_(True)
    bb = torch.randn(3, 4, generator=g).to(device).requires_grad_(True)
    h = torch.randn(2, 3, 4, generator=g).to(device).requires_grad_(True)
    torch.compile(lambda h, w, bb: cufuse.layer_norm(h, (3, 4), w, bb), fullgraph=True)(h, w, bb).sum().backward()
    wr = w.detach().clone().requires_grad_(True)
    TF.layer_norm(h.detach(), (3, 4), wr, bb.detach()).sum().backward()
    torch.testing.assert_close(w.grad, wr.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_add_relu_gradient_at_nan(device):
    """A NaN sum passes its gradient, as torch.relu's threshold_backward (g unless <= 0) does."""
    a = torch.tensor([float("nan"), 1.0, -1.0, 0.0], dtype=torch.float64, device=device, requires_grad=True)
    cufuse.add_relu(a, 0.5).sum().backward()
    ar = a.detach().clone().requires_grad_(True)
    torch.relu(ar + 0.5).sum().backward()
    torch.testing.assert_close(a.grad, ar.grad, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,ns", [((2, 0), 0), ((2, 3, 0), (3, 0)), ((0, 5), 5)], ids=str)
def test_norm_gradients_of_zero_size(device, shape, ns):
    """Normalized dims or rows of no element: zero gradients of the inputs' shapes, as torch's (the
    backward reshaped zero elements to (-1, 0) and raised)."""
    wshape = ns if isinstance(ns, tuple) else (ns,)
    x, r = (torch.randn(*shape, dtype=torch.float64, device=device, requires_grad=True) for _ in range(2))
    w, b = (torch.randn(wshape, dtype=torch.float64, device=device, requires_grad=True) for _ in range(2))
    cufuse.layer_norm(x, ns, w, b).sum().backward()
    y, h = cufuse.add_rms_norm(x, r, ns, w)
    (y.sum() + h.sum()).backward()
    xr = x.detach().clone().requires_grad_(True)
    wr, br = (t.detach().clone().requires_grad_(True) for t in (w, b))
    TF.layer_norm(xr, wshape, wr, br).sum().backward()
    for got, want in ((x.grad, 2 * xr.grad), (w.grad, 2 * wr.grad), (b.grad, br.grad), (r.grad, xr.grad)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [64, 30], ids=["one_pass", "generated"])
def test_layer_norm_relu_gradient_at_nan(device, n):
    """A row whose output is NaN passes its gradient through the relu, as torch.relu's
    threshold_backward does: the bias gradient adds it (it dropped it). Rows of 64 float32
    elements take the one-pass kernel on the GPU, 30 the generated kernels."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(5, n, generator=g, dtype=torch.float64).float()
    x[2, 3] = float("nan")                                   # row 2: all NaN out
    w, b = (torch.randn(n, generator=g, dtype=torch.float64).float() for _ in range(2))
    dy = torch.randn(5, n, generator=g, dtype=torch.float64).float()
    xs, ws, bs = (t.clone().to(device).requires_grad_(True) for t in (x, w, b))
    cufuse.layer_norm_relu(xs, n, ws, bs).backward(dy.to(device))
    xr, wr, br = (t.double().requires_grad_(True) for t in (x, w, b))
    torch.relu(TF.layer_norm(xr, (n,), wr, br)).backward(dy.double())
    assert torch.isfinite(br.grad).all()
    torch.testing.assert_close(bs.grad.double().cpu(), br.grad, rtol=1e-5, atol=1e-5)
    rows = [0, 1, 3, 4]                                      # the finite rows' dx
    torch.testing.assert_close(xs.grad.double().cpu()[rows], xr.grad[rows], rtol=1e-4, atol=1e-4)
    assert torch.isnan(xs.grad[2]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + BF16, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_gradients_match_torch(name, dtype, device):
    if dtype == torch.float16 and device == "cpu":
        pytest.skip("float16 is checked on the GPU (the CPU path computes float16 in float32 as well)")
    call, ref, shapes = CASES[name]
    ours = _inputs(shapes, dtype, device, 2)
    theirs = [a.detach().clone().requires_grad_(True) for a in ours]
    y = call(*ours)
    y_ref = ref(*[t.float() for t in theirs]).to(dtype)
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape and y.device == y_ref.device
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(dtype).to(device)
    y.backward(g)
    y_ref.backward(g)
    rtol, atol = TOL[dtype]
    for k, (a, t) in enumerate(zip(ours, theirs)):
        assert a.grad is not None and a.grad.dtype == a.dtype and a.grad.shape == a.shape, k
        # the reference's gradients in float32 from float32 math: compared at the operand's precision
        scale = max(1.0, float(t.grad.abs().max()))
        torch.testing.assert_close(a.grad.float(), t.grad.float(), rtol=rtol * 4, atol=atol * scale * 4,
                                   msg=f"{name}: gradient of operand {k}")


@pytest.mark.parametrize("device", DEVICES)
def test_partial_requires_grad_and_mixed_dtypes(device):
    """Only some operands require grad; a float16 operand beside a float32 one
    gets a float16 gradient; Python scalars get none."""
    x = torch.randn(5, 8, device=device, dtype=torch.float16).requires_grad_(True)
    b = torch.randn(8, device=device)                          # float32, no grad
    y = cufuse.mul_tanh(x, b)
    assert y.dtype == torch.float32
    y.sum().backward()
    assert b.grad is None and x.grad.dtype == torch.float16
    xr = x.detach().float().requires_grad_(True)
    torch.tanh(xr * b).sum().backward()
    torch.testing.assert_close(x.grad.float(), xr.grad, rtol=2e-3, atol=2e-3)
    z = torch.randn(5, 8, device=device, dtype=torch.float64).requires_grad_(True)
    cufuse.fma(2.0, z, 1.5).sum().backward()
    torch.testing.assert_close(z.grad, torch.full_like(z, 2.0))
    # NumPy scalars are numbers as Python's are (they went into the tensor slot: saved, cast, raised)
    for s in (np.float32(0.5), np.float16(-1.5), np.int32(2), np.uint8(3)):
        for op, ref in ((cufuse.add_relu, lambda t: torch.relu(t + float(s))),
                        (cufuse.mul_tanh, lambda t: torch.tanh(t * float(s))),
                        (cufuse.bias_gelu, lambda t: TF.gelu(t + float(s))),
                        (lambda t, v: cufuse.fma(v, t, v), lambda t: t * float(s) + float(s))):
            z.grad = None
            y = op(z, s)
            y.sum().backward()
            zr = z.detach().clone().requires_grad_(True)
            want = ref(zr)
            want.sum().backward()
            torch.testing.assert_close(y, want, msg=f"{s!r}")
            torch.testing.assert_close(z.grad, zr.grad, msg=f"{s!r}")


@pytest.mark.parametrize("device", DEVICES)
def test_training_step_and_no_grad(device):
    """A small MLP with cufuse.bias_gelu trains (the loss falls); under
    torch.no_grad() calls record nothing; out= with grad is refused."""
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(16, 32).to(device), torch.nn.Linear(32, 1).to(device)
    bias = torch.nn.Parameter(torch.zeros(32, device=device))
    opt = torch.optim.SGD([*lin1.parameters(), *lin2.parameters(), bias], lr=0.05)
    x = torch.randn(256, 16, device=device)
    target = (x[:, :1] * 2 - x[:, 1:2]).tanh()
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = ((lin2(cufuse.bias_gelu(lin1(x), bias)) - target) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses[::10]
    assert bias.grad is not None and float(bias.grad.abs().sum()) > 0
    with torch.no_grad():
        assert cufuse.bias_gelu(lin1(x), bias).grad_fn is None
    with pytest.raises(RuntimeError, match="out= does not support automatic differentiation"):
        cufuse.add_relu(lin1(x), 1.0, out=torch.empty(256, 32, device=device))


# ------------------------------------------------------- torch.ops.cufuse
OPCHECK_ARGS = {  # operator -> operands as (tensor, number) pairs
    "add_relu": lambda x, b: (x, None, b, None),
    "mul_tanh": lambda x, b: (x, None, None, 1.5),
    "add_mul_exp": lambda x, b: (x, None, b, None),
    "fma": lambda x, b: (x, None, b, None, x, None),
    "bias_gelu": lambda x, b: (x, None, b, None, "tanh"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(OPCHECK_ARGS))
def test_opcheck(name, device):
    """torch.library.opcheck: schema, fake (meta) implementation, autograd
    registration, with and without requires_grad."""
    from cufuse import _torch_ops
    _torch_ops.register()
    op = getattr(torch.ops.cufuse, name)
    x, b = torch.randn(4, 8, device=device) * 0.5, torch.randn(8, device=device) * 0.5
    torch.library.opcheck(op, OPCHECK_ARGS[name](x, b))
    torch.library.opcheck(op, OPCHECK_ARGS[name](x.clone().requires_grad_(True), b.clone().requires_grad_(True)))


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph_forward_and_backward(device):
    """torch.compile(fullgraph=True) traces every differentiable op without a
    graph break; forward values and gradients equal eager ones."""
    def f(x, b):
        h = cufuse.bias_gelu(x, b) + cufuse.add_relu(x, 1.0) + cufuse.fma(x, b, 0.5)
        return (cufuse.mul_tanh(h, 0.25) + cufuse.add_mul_exp(h * 0.01, b * 0.01)).sum()

    cf = torch.compile(f, fullgraph=True)
    x = (torch.randn(16, 32, device=device) * 0.5).requires_grad_(True)
    b = (torch.randn(32, device=device) * 0.5).requires_grad_(True)
    got = cf(x, b)
    got.backward()
    gx, gb = x.grad.clone(), b.grad.clone()
    x.grad = b.grad = None
    want = f(x, b)
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gb, b.grad, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------- norms and softmax
ROW_CASES = {
    "layer_norm": (lambda x, w, b: cufuse.layer_norm(x, x.shape[-1], w, b),
                   lambda x, w, b: TF.layer_norm(x, x.shape[-1:], w, b, 1e-5)),
    "layer_norm_relu": (lambda x, w, b: cufuse.layer_norm_relu(x, x.shape[-1], w, b),
                        lambda x, w, b: torch.relu(TF.layer_norm(x, x.shape[-1:], w, b, 1e-5))),
    "layer_norm_plain": (lambda x, w, b: cufuse.layer_norm(x, x.shape[-2:]),
                         lambda x, w, b: TF.layer_norm(x, x.shape[-2:], None, None, 1e-5)),
    "rms_norm": (lambda x, w, b: cufuse.rms_norm(x, x.shape[-1], w),
                 lambda x, w, b: TF.rms_norm(x, x.shape[-1:], w, 1e-6)),
    "softmax": (lambda x, w, b: cufuse.softmax(x), lambda x, w, b: torch.softmax(x, -1)),
    "softmax_axis0": (lambda x, w, b: cufuse.softmax(x, axis=0), lambda x, w, b: torch.softmax(x, 0)),
    "log_softmax": (lambda x, w, b: cufuse.log_softmax(x), lambda x, w, b: torch.log_softmax(x, -1)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(ROW_CASES))
def test_row_ops_gradcheck_and_against_torch(name, device):
    """gradcheck in float64; gradients of x, weight and bias against torch's
    own layer_norm / rms_norm / softmax in float32 (and float16 on the GPU)."""
    call, ref = ROW_CASES[name]
    x, w, b = _inputs([(3, 5, 24), (24,), (24,)], torch.float64, device, 11, scale=1.0)
    assert torch.autograd.gradcheck(call, (x, w, b), eps=1e-6, atol=1e-6)
    for dtype in [torch.float32] + BF16 + ([torch.float16] if device == "cuda" else []):
        ours = _inputs([(3, 5, 24), (24,), (24,)], dtype, device, 12, scale=1.0)
        theirs = [t.detach().float().requires_grad_(True) for t in ours]
        y = call(*ours)
        y_ref = ref(*theirs).to(dtype)
        torch.testing.assert_close(y.float(), y_ref.float(), rtol=TOL[dtype][0] * 4, atol=TOL[dtype][1] * 40)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(13)).to(dtype).to(device)
        y.backward(g)
        y_ref.backward(g.float())
        for k, (a, t) in enumerate(zip(ours, theirs)):
            if t.grad is None:
                assert a.grad is None, (name, k)
                continue
            scale = max(1.0, float(t.grad.abs().max()))
            torch.testing.assert_close(a.grad.float(), t.grad, rtol=TOL[dtype][0] * 8, atol=TOL[dtype][1] * 40 * scale,
                                       msg=f"{name} {dtype}: gradient of input {k}")


@pytest.mark.parametrize("device", DEVICES)
def test_row_ops_opcheck_and_compile(device):
    from cufuse import _torch_ops
    _torch_ops.register()
    x, w = torch.randn(6, 16, device=device), torch.randn(16, device=device)
    for op, args in [(torch.ops.cufuse.layer_norm, (x, [16], w, w, 1e-5, False)),
                     (torch.ops.cufuse.layer_norm, (x, [16], None, None, 1e-5, True)),
                     (torch.ops.cufuse.rms_norm, (x, [16], w, 1e-6)),
                     (torch.ops.cufuse.softmax, (x, 0, False)), (torch.ops.cufuse.softmax, (x, -1, True))]:
        torch.library.opcheck(op, args)
        torch.library.opcheck(op, tuple(a.clone().requires_grad_(True) if isinstance(a, torch.Tensor) else a
                                        for a in args))

    def block(x, w, b):  # a pre-norm MLP step with cufuse's row and elementwise ops
        h = cufuse.rms_norm(x, 16, w)
        return (cufuse.softmax(cufuse.bias_gelu(h, b)) * cufuse.layer_norm(x, 16, w, b)).sum()

    cf = torch.compile(block, fullgraph=True)
    ins = [t.clone().requires_grad_(True) for t in (x, w, w * 0.1)]
    cf(*ins).backward()
    got = [t.grad.clone() for t in ins]
    ins2 = [t.detach().clone().requires_grad_(True) for t in ins]
    block(*ins2).backward()
    for a, t in zip(got, ins2):
        torch.testing.assert_close(a, t.grad, rtol=1e-5, atol=1e-5)


# ------------------------------------- the one-pass norm backward kernel
NORM_BWD_SHAPES = [(5, 24), (1000, 768), (300, 4096), (7, 2600), (33, 8192), (2, 5, 256), (0, 64)]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64] + BF16, ids=str)
@pytest.mark.parametrize("kind", ["layer", "layer_relu", "rms"])
@pytest.mark.parametrize("shape", NORM_BWD_SHAPES, ids=str)
def test_norm_backward_kernel(kind, shape, dtype):
    """kernels/norm_backward.cu (one block per row, NP packs per thread,
    blocks looping over rows, partial column sums summed over blocks)
    against torch's autograd of its own layer_norm / rms_norm in float64,
    with and without weight and bias (without them, with a residual's
    gradient added to dx: its rows travel with x's and g's); rows it does
    not take (a partial pack, or longer than 2 packs per thread) return None."""
    from cufuse.ops.norm import backward_rows
    n = shape[-1]
    tol = TOL[dtype]
    fits = n * torch.empty((), dtype=dtype).element_size() <= 512 * 2 * 16
    for affine in (True, False):
        g = torch.Generator().manual_seed(n + len(shape))
        x = (torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 0.5).to(dtype).cuda()
        w = (torch.randn(n, generator=g, dtype=torch.float64)).to(dtype).cuda() if affine else None
        b = (torch.randn(n, generator=g, dtype=torch.float64)).to(dtype).cuda() if affine and kind != "rms" else None
        dy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).cuda()
        ga = None if affine else torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).cuda()
        res = backward_rows(kind, dy, x, n, w, b, 1e-5, ga)
        if not fits:
            assert res is None
            continue
        assert res is not None
        ref_in = [t.double().requires_grad_(True) if t is not None else None for t in (x, w, b)]
        xr, wr, br = ref_in
        if kind == "rms":
            y = TF.rms_norm(xr, (n,), wr, 1e-5)
        else:
            y = TF.layer_norm(xr, (n,), wr, br, 1e-5)
            if kind == "layer_relu":
                y = torch.relu(y)
        y.backward(dy.double())
        if ga is not None:
            xr.grad += ga.double()
        for got, want, what in zip(res, (xr.grad, wr.grad if wr is not None else None,
                                         br.grad if br is not None else None), ("dx", "dw", "db")):
            if want is None:
                assert got is None, what
                continue
            assert got.dtype == dtype and got.shape == want.shape, what
            scale = max(1.0, float(want.abs().max()) if want.numel() else 0.0)
            torch.testing.assert_close(got.double(), want, rtol=tol[0] * 4, atol=tol[1] * 4 * scale,
                                       msg=f"{kind} {shape} {dtype} affine={affine}: {what}")


@pytest.mark.cuda
@pytest.mark.parametrize("stages", [0, 2, 4])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_norm_backward_kernel_rows_in_flight(monkeypatch, kind, stages):
    """The kernel with 0 rows in flight (each loaded when its block starts it), 2 and 4 (through
    shared memory; the host chooses 1 on sm_80+), with and without a residual's gradient, over many
    more rows than blocks (the slots wrap around): dx has the bits of the chosen plan's, dw and db
    (summed over a grid that may differ) match torch's float64 autograd."""
    from cufuse import _driver as D
    from cufuse.ops import norm as N
    dtype = BF16[0] if BF16 else torch.float16
    for n, add in ((768, True), (4096, False)):
        g = torch.Generator().manual_seed(n)
        x, dy, ga = (torch.randn(3000, n, generator=g, dtype=torch.float64).to(dtype).cuda() for _ in range(3))
        w = torch.randn(n, generator=g, dtype=torch.float64).to(dtype).cuda()
        b = torch.randn(n, generator=g, dtype=torch.float64).to(dtype).cuda() if kind == "layer" else None
        ga = ga if add else None
        want = N.backward_rows(kind, dy, x, n, w, b, 1e-5, ga)
        with monkeypatch.context() as m:
            m.setattr(N, "_BWD_STAGES", stages)
            m.setattr(N, "_BWD_PLANS", {})
            m.setattr(N, "_BWD_FAST", D.FastPath("norm_backward stages test"))
            # (fewer where the slots would not fit the card's shared memory)
            assert 0 < N._bwd_plan(kind, dtype, n, x.get_device(), add)[4] <= stages or stages == 0
            got = N.backward_rows(kind, dy, x, n, w, b, 1e-5, ga)
        assert torch.equal(got[0], want[0]), f"{kind} n={n} stages={stages}: dx"
        xr, wr = x.double().requires_grad_(True), w.double().requires_grad_(True)
        br = b.double().requires_grad_(True) if b is not None else None
        y = TF.layer_norm(xr, (n,), wr, br, 1e-5) if kind == "layer" else TF.rms_norm(xr, (n,), wr, 1e-5)
        y.backward(dy.double())
        for a, r in ((got[1], wr.grad), (got[2], br.grad if br is not None else None)):
            if r is None:
                assert a is None
                continue
            tol = TOL[dtype]
            torch.testing.assert_close(a.double(), r, rtol=tol[0] * 4, atol=tol[1] * 4 * float(r.abs().max()))


@pytest.mark.cuda
def test_norm_backward_kernel_rows_far_from_zero():
    """Rows whose mean is 300 standard deviations from zero: the kernel's
    two-pass statistics keep the variance (E[x^2] - E[x]^2 in float32 is
    off by about 1% there). (Not layer_norm_relu: its mask flips where
    float32's xhat rounds across 0.)"""
    from cufuse.ops.norm import backward_rows
    n = 4096
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(64, n, generator=g, dtype=torch.float64) + 300.0).float().cuda()
    w = torch.randn(n, generator=g, dtype=torch.float64).float().cuda()
    b = torch.randn(n, generator=g, dtype=torch.float64).float().cuda()
    dy = torch.randn(64, n, generator=g, dtype=torch.float64).float().cuda()
    dx, dw, db = backward_rows("layer", dy, x, n, w, b, 1e-5)
    xr, wr, br = (t.double().requires_grad_(True) for t in (x, w, b))
    TF.layer_norm(xr, (n,), wr, br, 1e-5).backward(dy.double())
    for got, want in ((dx, xr.grad), (dw, wr.grad), (db, br.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=3e-4 * float(want.abs().max()))


@pytest.mark.parametrize("kind", ["layer", "layer_relu"])
def test_cpu_norm_gradient_of_offset_rows(kind):
    """The CPU backward shifts each row by its first element, as the NumPy forward does: rows of
    1e4 + randn keep the gradient's float32 accuracy (it was off by 3e-5 relative: the statistics of
    the unshifted row), and layer_norm_relu's mask agrees with the forward's zeros (it passed the
    gradient where the output was 0, and blocked it where the output was 7.8e-5)."""
    g = torch.Generator().manual_seed(12)
    x = (torch.randn(64, 1024, generator=g, dtype=torch.float64) + 1e4).float().requires_grad_(True)
    w, b, up = torch.randn(1024, generator=g), torch.randn(1024, generator=g), torch.randn(64, 1024, generator=g)
    fn = cufuse.layer_norm_relu if kind == "layer_relu" else cufuse.layer_norm
    y = fn(x, 1024, w, b)
    y.backward(up)
    xr = x.detach().double().requires_grad_(True)
    ref = TF.layer_norm(xr, (1024,), w.double(), b.double())
    if kind == "layer_relu":
        mask = y.detach() > 0  # the gradient passes exactly where the forward's output is positive
        ref = torch.where(mask, ref, torch.zeros_like(ref))
    ref.backward(up.double())
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=0, atol=2e-6 * float(xr.grad.abs().max()))


@pytest.mark.cuda
def test_norm_backward_kernel_declines(monkeypatch):
    """Rows of a partial pack or misaligned rows go to the generated kernels, and so do rows whose
    shared-memory slots exceed what a block may opt in to on the device (GPUs of less of it): there
    the gradients still match torch's float64 autograd."""
    from cufuse import _driver as D
    from cufuse import _runtime as R
    from cufuse.ops import norm as N
    from cufuse.ops.norm import backward_rows
    with monkeypatch.context() as m:
        m.setattr(R, "shared_optin", lambda dev: 16 << 10)
        m.setattr(N, "_BWD_PLANS", {})
        m.setattr(N, "_BWD_FAST", D.FastPath("norm_backward optin test"))
        g = torch.Generator().manual_seed(13)
        x, dy = (torch.randn(6, 4096, generator=g, dtype=torch.float64) for _ in range(2))
        w = torch.randn(4096, generator=g, dtype=torch.float64)
        xc, dyc, wc = (t.float().cuda() for t in (x, dy, w))
        assert backward_rows("rms", dyc, xc, 4096, wc, None, 1e-5) is None
        xg, wg = xc.clone().requires_grad_(True), wc.clone().requires_grad_(True)
        cufuse.rms_norm(xg, 4096, wg, eps=1e-5).backward(dyc)
    xr, wr = x.float().double().requires_grad_(True), w.float().double().requires_grad_(True)
    TF.rms_norm(xr, (4096,), wr, 1e-5).backward(dy.float().double())
    for got, want in ((xg.grad, xr.grad), (wg.grad, wr.grad)):
        torch.testing.assert_close(got.double().cpu(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    x = torch.randn(4, 30, device="cuda", dtype=torch.bfloat16 if BF16 else torch.float16)
    assert backward_rows("layer", x, x, 30, None, None, 1e-5) is None  # 30 is no whole number of 8-element packs
    y = torch.randn(4 * 64 + 8, device="cuda")[8:].view(4, 64)  # 32-byte offset: aligned; 4 bytes: not
    assert backward_rows("rms", y, y, 64, None, None, 1e-5) is not None
    z = torch.randn(4 * 64 + 1, device="cuda")[1:].view(4, 64)
    assert backward_rows("rms", z, z, 64, None, None, 1e-5) is None


@pytest.mark.cuda
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_norm_backward_fast_path(affine):
    """A repeated backward signature is one recipe (the kernel and the
    column sums' second stage): the second call takes the fast path, on new
    data (poisoned results of the first call reused by the allocator do not
    leak), and gives what the first path gives on that data; a row length
    the kernel does not take still declines."""
    from cufuse.ops import norm as N
    N._BWD_FAST.recipes.clear()
    gen = torch.Generator().manual_seed(7)
    n, dt = 256, torch.bfloat16 if BF16 else torch.float16

    def data():
        x, dy = (torch.randn(33, n, generator=gen, dtype=torch.float64).to(dt).cuda() for _ in range(2))
        w, b = ((torch.randn(n, generator=gen, dtype=torch.float64).to(dt).cuda() if affine else None)
                for _ in range(2))
        return dy, x, n, w, b

    first = N.backward_rows("layer", *data(), 1e-5)
    for t in first:
        if t is not None:
            t.fill_(float("nan"))
    del first, t  # their memory free for the next call's results
    hits = N._BWD_FAST.hits
    args = data()
    got = N.backward_rows("layer", *args, 1e-5)
    assert N._BWD_FAST.hits == hits + 1
    N._BWD_FAST.recipes.clear()
    want = N.backward_rows("layer", *args, 1e-5)  # the general path on the same data
    assert N._BWD_FAST.hits == hits + 1
    for a, b_ in zip(got, want):
        assert (a is None) == (b_ is None)
        if a is not None:
            assert torch.equal(a, b_)
    assert (got[1] is None) == (not affine) and got[0].shape == (33, n)
    hits = N._BWD_FAST.hits
    assert N.backward_rows("layer", args[0][:, :250], args[1][:, :250], 250, None, None, 1e-5) is None
    assert N._BWD_FAST.hits == hits


SOFTMAX_BWD_SHAPES = [(5, 24), (1000, 768), (64, 4096), (16, 32000), (3, 4, 256), (0, 64)]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64] + BF16, ids=str)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("shape", SOFTMAX_BWD_SHAPES, ids=str)
def test_softmax_backward_kernel(log, shape, dtype):
    """kernels/norm_backward.cu softmax_backward against torch's autograd of
    its own softmax / log_softmax in float64, from the rounded output."""
    from cufuse.ops.norm import softmax_backward_rows
    n = shape[-1]
    g = torch.Generator().manual_seed(n + len(shape))
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    dy = torch.randn(shape, generator=g, dtype=torch.float64)
    y = (torch.log_softmax if log else torch.softmax)(x, -1)
    y.backward(dy)
    got = softmax_backward_rows(dy.to(dtype).cuda(), y.detach().to(dtype).cuda(), log)
    fits = n * torch.empty((), dtype=dtype).element_size() <= 512 * 8 * 16
    if not fits:
        assert got is None
        return
    assert got is not None and got.dtype == dtype and got.shape == x.shape
    tol = TOL[dtype]
    scale = max(1.0, float(x.grad.abs().max()) if x.numel() else 0.0)
    torch.testing.assert_close(got.double().cpu(), x.grad, rtol=tol[0] * 4, atol=tol[1] * 4 * scale)


# --------------------------------------------------------------- gelu_dropout
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64] + BF16, ids=str)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_gelu_dropout_gradient(device, dtype, approximate, p):
    """The gradient uses exactly the forward's mask (the spec's Philox lanes,
    drawn again in backward) and gelu' in float64 by torch's autograd; the
    forward saves x alone (nothing mask-sized)."""
    from _reference_fused import dropout_keep_mask
    if dtype == torch.float16 and device == "cpu":
        pytest.skip("float16 is checked on the GPU (the CPU path computes float16 in float32 as well)")
    shape = (37, 129)
    gen = torch.Generator().manual_seed(int(p * 10))
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 2).to(dtype).to(device).requires_grad_(True)
    dy = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(device)
    y = cufuse.gelu_dropout(x, p, seed=4321, approximate=approximate)
    saved = y.grad_fn.saved_tensors
    assert len(saved) == 1 and saved[0].data_ptr() == x.data_ptr()
    y.backward(dy)
    result_dtype = A.BF16 if dtype == torch.bfloat16 else np.dtype(str(dtype).split(".")[1])  # fixes the lanes
    keep = torch.from_numpy(dropout_keep_mask(shape, 4321, p, result_dtype))
    x64 = x.detach().double().cpu().requires_grad_(True)
    ref = TF.gelu(x64, approximate=approximate) * keep / (1.0 - p)
    ref.backward(dy.double().cpu())
    assert x.grad.dtype == dtype
    got = x.grad.double().cpu()
    assert torch.equal(got[~keep], torch.zeros_like(got[~keep]))  # dropped: exactly 0
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got, x64.grad, rtol=rtol * 4, atol=atol * 4)


@pytest.mark.parametrize("device", DEVICES)
def test_gelu_dropout_gradcheck(device):
    x = (torch.randn(6, 40, dtype=torch.float64, device=device)).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: cufuse.gelu_dropout(t, 0.3, seed=77), (x,), eps=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="out="):
        cufuse.gelu_dropout(x, 0.3, seed=1, out=torch.empty_like(x))


# ------------------------------------------------------------------ reductions
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["sum_squared", "mean_abs"])
@pytest.mark.parametrize("axis,keepdims", [(-1, False), (0, True), ((0, 2), False), (None, False)], ids=str)
def test_reduction_gradients(device, op, axis, keepdims):
    """gradcheck in float64; against torch's autograd of the same reduction
    (float32, and bfloat16 with a float32 result)."""
    fn = getattr(cufuse, op)
    x = (torch.randn(4, 5, 6, dtype=torch.float64, device=device) + 0.05).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: fn(t, axis=axis, keepdims=keepdims), (x,), eps=1e-6, atol=1e-6)
    dims = tuple(range(3)) if axis is None else axis

    def ref(t):
        if op == "sum_squared":
            return (t * t).sum(dim=dims, keepdim=keepdims)
        return t.abs().mean(dim=dims, keepdim=keepdims)
    for dtype, kw in [(torch.float32, {})] + [(d, {"dtype": torch.float32}) for d in BF16]:
        a = x.detach().to(dtype).requires_grad_(True)
        b = x.detach().to(dtype).float().requires_grad_(True)
        y = fn(a, axis=axis, keepdims=keepdims, **kw)
        y_ref = ref(b)
        g = torch.randn(y_ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9)).to(device)
        y.backward(g.to(y.dtype))
        y_ref.backward(g.float())
        assert a.grad.dtype == dtype
        rtol, atol = TOL[dtype]
        torch.testing.assert_close(a.grad.float(), b.grad, rtol=rtol * 4, atol=atol * 4)
    with pytest.raises(RuntimeError, match="out="):
        fn(x, axis=-1, out=torch.empty(4, 5, dtype=torch.float64, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_gelu_dropout_under_compile(device):
    """torch.compile(fullgraph=True) traces gelu_dropout as its operator: a
    given seed gives the eager mask bit for bit, forward and backward; seed=None
    a fresh mask per call; opcheck passes."""
    from cufuse import _torch_ops
    _torch_ops.register()
    torch._dynamo.reset()
    x = torch.randn(64, 96, device=device)
    f = torch.compile(lambda t: cufuse.gelu_dropout(t, 0.3, seed=1234), fullgraph=True)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = f(xa), cufuse.gelu_dropout(xb, 0.3, seed=1234)
    assert torch.equal(ya, yb)
    ya.backward(torch.ones_like(ya))
    yb.backward(torch.ones_like(yb))
    assert torch.equal(xa.grad, xb.grad) and torch.equal(xa.grad != 0, ya != 0)
    g = torch.compile(lambda t: cufuse.gelu_dropout(t, 0.3), fullgraph=True)
    assert not torch.equal(g(x) != 0, g(x) != 0)  # a fresh seed per call
    for seed in (5, 2 ** 64 - 3):  # (the largest seeds travel as negative int64)
        s = torch.tensor(seed - 2 ** 64 if seed >= 2 ** 63 else seed)
        torch.library.opcheck(torch.ops.cufuse.gelu_dropout, (x.clone().requires_grad_(True), 0.3, s, "tanh"))
        assert torch.equal(torch.ops.cufuse.gelu_dropout(x, 0.3, s, "tanh"),
                           cufuse.gelu_dropout(x, 0.3, seed=seed, approximate="tanh"))


@pytest.mark.parametrize("device", DEVICES)
def test_reductions_under_compile(device):
    """torch.compile(fullgraph=True) traces sum_squared / mean_abs as the
    operator cufuse::reduction: forward and backward equal eager; opcheck."""
    from cufuse import _torch_ops
    _torch_ops.register()
    torch._dynamo.reset()
    x = torch.randn(6, 5, 7, device=device)

    def f(t):
        return cufuse.sum_squared(t, axis=(0, 2)).sum() + cufuse.mean_abs(t, axis=-1, keepdims=True,
                                                                           dtype=torch.float64).sum()
    compiled_matches_eager(f, [x.requires_grad_(True)], 1e-6, 1e-6)
    x = x.detach()
    for args in [(x, [0, 2], False, None, False), (x, [2], True, torch.float64, True)]:
        torch.library.opcheck(torch.ops.cufuse.reduction, (x.clone().requires_grad_(True),) + args[1:])


@pytest.mark.cuda
def test_backward_takes_the_fast_path():
    """A repeated training step finds every kernel's recipe, forward and
    backward (the saved tensors require grad; the backward must not take the
    general path because of it): no fast-path miss on the third step."""
    from cufuse import _driver as D
    x = torch.randn(64, 96, device="cuda", requires_grad=True)
    y = torch.randn(64, 96, device="cuda", requires_grad=True)
    b = torch.randn(96, device="cuda", requires_grad=True)
    w = torch.randn(96, device="cuda", requires_grad=True)
    swiglu = cufuse.fuse(lambda a, c: a * cufuse.sigmoid(a) * c)
    steps = {
        "add_relu": lambda: cufuse.add_relu(x, y), "mul_tanh": lambda: cufuse.mul_tanh(x, b),
        "add_mul_exp": lambda: cufuse.add_mul_exp(x * 0.1, b), "fma": lambda: cufuse.fma(x, y, b),
        "bias_gelu": lambda: cufuse.bias_gelu(x, b), "layer_norm": lambda: cufuse.layer_norm(x, 96, w, b),
        "rms_norm": lambda: cufuse.rms_norm(x, 96, w), "softmax": lambda: cufuse.softmax(x),
        "log_softmax": lambda: cufuse.log_softmax(x), "gelu_dropout": lambda: cufuse.gelu_dropout(x, 0.1),
        "sum_squared": lambda: cufuse.sum_squared(x, axis=-1), "fuse": lambda: swiglu(x, y),
    }
    g = torch.randn(64, 96, device="cuda")
    for name, fn in steps.items():
        for i in range(3):
            if i == 2:
                misses = sum(fp.misses for fp in D.fast_paths())
            for t in (x, y, b, w):
                t.grad = None
            r = fn()
            r.backward(g if r.dim() == 2 else g[:, 0])
            assert x.grad is not None
        assert sum(fp.misses for fp in D.fast_paths()) == misses, name


@pytest.mark.parametrize("device", DEVICES)
def test_recorded_calls_check_their_arguments(device):
    """A call that records its gradient checks eps, normalized_shape and axis
    as the plain call does (they were cast with int() / float() and ran: a
    softmax over axis 1.7, eps '0.5'); a 0-d softmax's backward is 0."""
    x = torch.randn(4, 8, dtype=torch.float64, device=device, requires_grad=True)
    for call, err, match in ((lambda: cufuse.softmax(x, 1.7), TypeError, "axis must be an int"),
                             (lambda: cufuse.log_softmax(x, 2), ValueError, "out of range"),
                             (lambda: cufuse.layer_norm(x, 8, eps="0.5"), TypeError, "eps must be a real"),
                             (lambda: cufuse.rms_norm(x, 8, eps=True), TypeError, "eps must be a real"),
                             (lambda: cufuse.layer_norm(x, [8.0]), TypeError, "normalized_shape must be"),
                             (lambda: cufuse.rms_norm(x, 4), ValueError, "trailing dims")):
        with pytest.raises(err, match=match):
            call()
        with torch.no_grad(), pytest.raises(err, match=match):  # the same as the plain call's
            call()
    for fn in (cufuse.softmax, cufuse.log_softmax):
        t = torch.tensor(1.5, dtype=torch.float64, device=device, requires_grad=True)
        fn(t).backward()
        assert t.grad.item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["add_relu", "layer_norm", "softmax"])
def test_first_gradient_with_create_graph_and_no_second(name, device):
    """create_graph=True gives the same first gradient; differentiating it again
    raises (the backward kernels are not differentiable), never a silent zero."""
    calls = {"add_relu": CASES["add_relu"][0], "layer_norm": lambda x, w: cufuse.layer_norm(x, 33, w),
             "softmax": lambda x, w: cufuse.softmax(x * w)}
    x, w = _inputs([(7, 33), (33,)], torch.float32, device, 5)
    g = torch.randn(7, 33, generator=torch.Generator().manual_seed(6)).to(device).requires_grad_(True)
    plain = torch.autograd.grad(calls[name](x, w), (x, w), g)
    graph = torch.autograd.grad(calls[name](x, w), (x, w), g, create_graph=True)
    for p, q in zip(plain, graph):
        torch.testing.assert_close(q, p, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="twice"):
        graph[0].sum().backward()
    # the gradient of a loss such as y.sum() (an incoming gradient that does not require grad) too:
    # torch's once_differentiable leaves those unmarked, and a penalty on them added nothing
    gx, = torch.autograd.grad(calls[name](x, w).sum(), (x,), create_graph=True)
    assert gx.requires_grad
    with pytest.raises(RuntimeError, match="twice"):
        (gx ** 2).sum().backward()
    # and by autograd.grad towards the op's inputs (a penalty's gradient for the weights, a hessian): the
    # mark had been on fresh leaves off that path, and those calls silently left this op's terms out
    gx, = torch.autograd.grad(calls[name](x, w).sum(), (x,), create_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        torch.autograd.grad((gx ** 2).sum(), (w,))
    # a first-order create_graph backward through a non-reentrant checkpoint (which refuses a saved tensor
    # unpacked twice) gives the plain gradient
    xc = x.detach().clone().requires_grad_(True)
    gc, = torch.autograd.grad(torch.utils.checkpoint.checkpoint(lambda v: calls[name](v, w.detach()), xc,
                                                                use_reentrant=False).sum(), (xc,), create_graph=True)
    gp, = torch.autograd.grad(calls[name](xc, w.detach()).sum(), (xc,))
    torch.testing.assert_close(gc, gp, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="twice"):
        torch.autograd.functional.hessian(lambda v: (calls[name](v, w.detach()) ** 3).sum(), x.detach())
