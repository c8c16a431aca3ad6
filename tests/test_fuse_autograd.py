"""Autograd of cufuse.fuse functions (cufuse/_fuse/grad.py): the traced graph
differentiated in reverse mode into ONE generated backward kernel per
signature. torch.autograd.gradcheck in float64 for every differentiable
operation (CPU: the NumPy evaluator; CUDA: the generated kernels), and
gradients against torch's autograd of the same function written with torch
ops, in float32 / float16 / bfloat16 on the GPU (tolerances of
tests/test_autograd.py's TOL, stated there once)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cufuse  # noqa: E402
from cufuse import _arrays as A  # noqa: E402

from _reference import compiled_matches_eager  # noqa: E402
from test_autograd import TOL  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
BF16 = [torch.bfloat16] if A.BF16 is not None else []


def _fx():
    from cufuse._fuse import functions as fx
    return fx


# name -> (cufuse.fuse body, the same in torch, operand shapes, positive operands)
CASES = {
    "arith": (lambda a, b: (a + b) * a - b / (a * a + 1.0), lambda a, b: (a + b) * a - b / (a * a + 1.0),
              [(5, 9), (9,)], False),
    "pow": (lambda a, b: a ** b + a ** 2.5, lambda a, b: a ** b + a ** 2.5, [(5, 9), (5, 9)], True),
    "minmax_where": (lambda a, b: np.maximum(a, b) - np.minimum(a, 0.3 * b) + np.where(a > b, a * b, -a),
                     lambda a, b: torch.maximum(a, b) - torch.minimum(a, 0.3 * b) + torch.where(a > b, a * b, -a),
                     [(4, 8), (4, 8)], False),
    "unary": (lambda a: np.exp(a) + np.exp2(a) + np.expm1(a) + np.sin(a) * np.cos(a) + np.tanh(a) - abs(a) - (-a),
              lambda a: torch.exp(a) + torch.exp2(a) + torch.expm1(a) + torch.sin(a) * torch.cos(a) + torch.tanh(a)
              - torch.abs(a) - (-a), [(6, 7)], False),
    "positive": (lambda a: np.log(a) + np.log1p(a) + np.sqrt(a) + 1.0 / np.sqrt(a),
                 lambda a: torch.log(a) + torch.log1p(a) + torch.sqrt(a) + torch.rsqrt(a), [(6, 7)], True),
    "activations": (lambda a: _fx().sigmoid(a) + _fx().erf(a) + _fx().gelu(a) + _fx().gelu(a, "tanh")
                    + _fx().silu(a) + _fx().softplus(a) + _fx().relu(a),
                    lambda a: torch.sigmoid(a) + torch.erf(a) + torch.nn.functional.gelu(a)
                    + torch.nn.functional.gelu(a, approximate="tanh") + torch.nn.functional.silu(a)
                    + torch.nn.functional.softplus(a) + torch.relu(a), [(6, 7)], False),
    "sum": (lambda a, b: ((a - b) * (a - b) + a * b).sum(axis=-1),
            lambda a, b: ((a - b) * (a - b) + a * b).sum(-1), [(5, 9), (9,)], False),
    "mean": (lambda a, b: (np.exp(a) * b).mean(axis=-1), lambda a, b: (torch.exp(a) * b).mean(-1),
             [(5, 9), (5, 1)], False),
    "keepdims": (lambda a: (a * a).mean(axis=-1, keepdims=True), lambda a: (a * a).mean(-1, keepdim=True),
                 [(3, 4, 6)], False),
    "mod": (lambda a, b: a % 1.7 + a % b, lambda a, b: torch.remainder(a, 1.7) + torch.remainder(a, b),
            [(5, 9), (5, 9)], True),
    "tuple": (lambda a, b: (a * b, np.exp(a) - b), lambda a, b: (a * b, torch.exp(a) - b), [(4, 5), (4, 5)], False),
    "scalar_arg": (lambda a, s: a * s + s, lambda a, s: a * s + s, [(4, 5), None], False),
}


def _inputs(shapes, dtype, device, seed, positive):
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in shapes:
        if s is None:
            out.append(0.75)  # a Python float argument: no gradient
            continue
        t = torch.randn(s, generator=g, dtype=torch.float64)
        t = t.abs() + 0.5 if positive else t + 0.1 * torch.sign(t)  # away from 0 (abs, relu, where)
        out.append(t.to(dtype).to(device).requires_grad_(True))
    return out


def _sum_outputs(y):
    return sum(t.sum() for t in y) if isinstance(y, tuple) else y.sum()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_gradcheck(name, device):
    body, _, shapes, positive = CASES[name]
    f = cufuse.fuse(body)
    args = _inputs(shapes, torch.float64, device, 1, positive)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]

    def call(*ts):
        it = iter(ts)
        return f(*[next(it) if isinstance(a, torch.Tensor) else a for a in args])
    assert torch.autograd.gradcheck(call, tensors, eps=1e-6, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + BF16, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_against_torch(name, dtype):
    body, ref, shapes, positive = CASES[name]
    if name == "pow" and dtype != torch.float32:
        pytest.skip("a ** b of 16-bit data: its log(a) b term is checked in float32")
    f = cufuse.fuse(body)
    ours = _inputs(shapes, dtype, "cuda", 2, positive)
    theirs = [a.detach().float().requires_grad_(True) if isinstance(a, torch.Tensor) else a for a in ours]
    y, y_ref = f(*ours), ref(*theirs)
    _sum_outputs(y).backward()
    _sum_outputs(y_ref).backward()
    rtol, atol = TOL[dtype]
    for k, (a, t) in enumerate(zip(ours, theirs)):
        if not isinstance(a, torch.Tensor):
            continue
        assert a.grad is not None and a.grad.dtype == dtype and a.grad.shape == a.shape, k
        scale = max(1.0, float(t.grad.abs().max()))
        torch.testing.assert_close(a.grad.float(), t.grad, rtol=rtol * 8, atol=atol * 8 * scale,
                                   msg=f"{name} {dtype}: gradient of argument {k}")


@pytest.mark.parametrize("device", DEVICES)
def test_partial_and_integer_arguments(device):
    """Only the arguments that require grad get one; integer arrays none; an
    argument no output depends on differentiably gets zeros from torch."""
    f = cufuse.fuse(lambda a, b, i, c: a * b + i + (c > 0))
    a = torch.randn(4, 5, device=device, requires_grad=True)
    b = torch.randn(4, 5, device=device)
    i = torch.arange(5, device=device, dtype=torch.int32)
    c = torch.randn(4, 5, device=device, requires_grad=True)
    f(a, b, i, c).sum().backward()
    torch.testing.assert_close(a.grad, b)
    assert c.grad is None  # reached only through a comparison (as torch: c > 0 is not in the graph)
    # through rounding: zeros, as torch's floor gives (None had made an optimizer skip the argument)
    a.grad = None
    cufuse.fuse(lambda a, b: np.floor(a) * b + np.round(a))(a, b).sum().backward()
    ar = a.detach().clone().requires_grad_(True)
    (torch.floor(ar) * b + torch.round(ar)).sum().backward()
    torch.testing.assert_close(a.grad, ar.grad, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_where_torch_masks(device):
    """Against torch autograd at the points its rules single out: a ** b at a
    base of 0 (no NaN: torch's 0 where b == 0, and for the exponent where
    a == 0 <= b), 0 ** x, x ** 0; minimum / maximum at ties (half to each
    side, as torch.minimum / torch.maximum; all to both at a NaN); clip at
    and beyond its bounds (all to x on a bound, as torch.clamp; the bounds'
    own gradients where x passed them; bounds crossed); a % b where a / b
    rounds up to a whole number."""
    nan = float("nan")
    cases = [
        (lambda a, b: a ** b, lambda a, b: a ** b, [[0., 0., 3., -2., 0., 2.], [0., 2., 0., 3., 1., 0.5]]),
        (lambda a: a ** 0.0, lambda a: a ** 0.0, [[0., 1., -2.]]),
        (lambda a: 0.0 ** a, lambda a: torch.zeros((), dtype=a.dtype, device=a.device) ** a, [[0., 1., 2.]]),
        (lambda a, b: cufuse.maximum(a, b), torch.maximum, [[1., 2., 0., nan, 1.], [1., 1., 3., 1., nan]]),
        (lambda a, b: cufuse.minimum(a, b), torch.minimum, [[1., 2., 0., nan, 1.], [1., 1., 3., 1., nan]]),
        (lambda a: cufuse.maximum(a, 0.0), lambda a: torch.maximum(a, torch.zeros_like(a)), [[0., 1., -1.]]),
        (lambda a: cufuse.relu(a), torch.relu, [[nan, 1., -1., 0.]]),  # a NaN passes its gradient
        (lambda a: np.clip(a, 0.0, 6.0), lambda a: torch.clamp(a, 0.0, 6.0), [[-1., 0., 3., 6., 7.]]),
        (lambda a, lo, hi: cufuse.clip(a, lo, hi), torch.clamp,
         [[-1., 0., 3., 6., 7., 2.], [0., 0., 1., 1., 1., 5.], [6., 6., 6., 6., 6., 1.]]),
        # a % b's divisor gradient is -(a // b), the forward's quotient: 1 / 0.1 rounds to 10, 1 // 0.1 is 9
        (lambda a, b: a % b, torch.remainder, [[1.0, 0.7, -1.0, 5.0, 3.0], [0.1, 0.1, 0.1, -2.0, 0.0]]),
    ]
    for fn, ref, vals in cases:
        ours = [torch.tensor(v, dtype=torch.float64, device=device, requires_grad=True) for v in vals]
        theirs = [torch.tensor(v, dtype=torch.float64, device=device, requires_grad=True) for v in vals]
        cufuse.fuse(fn)(*ours).sum().backward()
        ref(*theirs).sum().backward()
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
def test_errors(device):
    a = torch.randn(3, 4, device=device, requires_grad=True)
    with pytest.raises(NotImplementedError, match="max / min"):
        cufuse.fuse(lambda x: (x * 2).max(axis=-1))(a)
    # a max / min of what depends on no input (a comparison's, constants') needs no gradient: computed
    s, m = cufuse.fuse(lambda x: ((x * x).sum(axis=-1), cufuse.where(x > 0, 1.0, 0.0).max(axis=-1)))(a)
    torch.testing.assert_close(m, (a > 0).any(-1).to(a.dtype))
    s.sum().backward()
    torch.testing.assert_close(a.grad, 2 * a.detach())
    a.grad = None
    assert torch.equal(cufuse.fuse(lambda x: (x > 0).max(axis=-1))(a), (a > 0).any(-1))
    with pytest.raises(RuntimeError, match="out="):
        cufuse.fuse(lambda x: x * 2)(a, out=torch.empty(3, 4, device=device))
    with torch.no_grad():  # grad mode off: the plain path
        assert cufuse.fuse(lambda x: x * 2)(a).grad_fn is None
    f = cufuse.fuse(lambda x, y: x * y + 1.0)
    b = torch.ones(3, 4, device=device)
    for lists in (([a], [b]), ([b, a], [b, b])):  # any item: foreach records no gradient
        with pytest.raises(NotImplementedError, match="foreach records no gradient"):
            f.foreach(*lists)
    assert len(f.source(a, b)) > 0  # (the source needs no gradient)


@pytest.mark.cuda
def test_one_backward_kernel(launches):
    """The backward of a signature is one generated kernel (the bias's sum
    over rows is torch's sum_to_size), and no other cufuse kernel runs."""
    f = cufuse.fuse(lambda x, b, w: np.tanh(x + b) * w)
    x = torch.randn(64, 32, device="cuda", requires_grad=True)
    b = torch.randn(32, device="cuda", requires_grad=True)
    w = torch.randn(64, 32, device="cuda", requires_grad=True)
    y = f(x, b, w)
    del launches[:]
    y.backward(torch.ones_like(y))
    backwards = [bw for sig in f._sigs.values() for bw in sig.backwards.values()]
    assert len(backwards) == 1 and backwards[0].stats["launches"] == 1, [bw.stats for bw in backwards]
    assert launches == []  # (generated kernels are not counted there; hand-written ones are)
    ref = [t.detach().clone().requires_grad_(True) for t in (x, b, w)]
    (torch.tanh(ref[0] + ref[1]) * ref[2]).backward(torch.ones_like(y))
    for t, r in zip((x, b, w), ref):
        torch.testing.assert_close(t.grad, r.grad, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------ torch.compile
@pytest.mark.parametrize("device", DEVICES)
def test_fused_functions_under_compile(device):
    """torch.compile(fullgraph=True) traces fused functions (torch.ops.cufuse.fused)
    with one output and with a tuple of trailing reductions, int / float / bool
    scalars, a broadcast operand and an operand that needs no gradient: values
    and gradients equal eager ones."""
    torch._dynamo.reset()
    swish = cufuse.fuse(lambda a, b: a * cufuse.sigmoid(a) * b)
    stats = cufuse.fuse(lambda a, s, k, on: ((a * s + k).sum(axis=-1), np.where(on, a, 0.0).mean(axis=-1,
                                                                                                   keepdims=True)))

    def f(x, w, c):
        m, v = stats(x, 0.5, 3, True)
        return (swish(x, w) * c).sum() + m.sum() + (v * v).sum()

    g = torch.Generator().manual_seed(5)
    x0, w0, c0 = (torch.randn(s, generator=g, dtype=torch.float64).float().to(device) for s in ((6, 10), (10,), (6, 1)))
    ran = compiled_matches_eager(f, [x0.requires_grad_(True), w0.requires_grad_(True), c0], 1e-6, 1e-6)
    assert all(a.grad is not None and a.grad.abs().max() > 0 for a in ran[:2])
    # an operand used only as a condition gets no gradient, None as in eager calls (not zeros)
    pick = cufuse.fuse(lambda a, b: cufuse.where(b > 0, a * 2.0, a))
    for fn in (pick, torch.compile(lambda a, b: pick(a, b), fullgraph=True, backend="aot_eager")):
        a, b = x0.detach().clone().requires_grad_(True), x0.detach().clone().requires_grad_(True)
        fn(a, b).sum().backward()
        assert b.grad is None and torch.equal(a.grad, torch.where(b > 0, 2.0, 1.0).to(a.dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_fused_operator_opcheck_and_errors(device):
    from cufuse import _torch_ops
    _torch_ops.register()
    torch._dynamo.reset()
    f = cufuse.fuse(lambda a, b: a * b + 1.0)
    x = torch.randn(3, 5, device=device)
    y = torch.randn(5, device=device)
    xt = torch.randn(5, 3, device=device).t()  # a transposed input: results are contiguous all the same
    for args in ((x, y), (x.clone().requires_grad_(True), y.clone().requires_grad_(True)),
                 (xt.clone().t().t().requires_grad_(True), y.clone().requires_grad_(True))):
        torch.library.opcheck(torch.ops.cufuse.fused, (f._op_key, "tt", list(args), [], [], []))
    with pytest.raises(Exception, match="Python int, float and bool"):  # a NumPy scalar: told, not guessed
        torch.compile(lambda t: f(t, np.float32(2.0)), fullgraph=True)(x)
    with pytest.raises(Exception, match="out= does not support"):
        torch.compile(lambda t: f(t, 2.0, out=torch.empty_like(t)), fullgraph=True)(x)
    top = cufuse.fuse(lambda a: a.max(axis=-1))
    with pytest.raises(Exception, match="max / min reduction is not supported"):
        torch.compile(lambda t: top(t).sum(), fullgraph=True)(x.clone().requires_grad_(True))


@pytest.mark.parametrize("device", DEVICES)
def test_swiglu_module_under_compile(device):
    """cufuse.nn.SwiGLU (its gate a fused function) compiles with fullgraph=True."""
    import cufuse.nn as cnn
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = cnn.SwiGLU(16, 24).to(device)
    x = torch.randn(4, 16, device=device, requires_grad=True)
    y_c = torch.compile(m, fullgraph=True)(x)
    x2 = x.detach().clone().requires_grad_(True)
    y_e = m(x2)
    torch.testing.assert_close(y_c, y_e, rtol=1e-5, atol=1e-6)
    y_c.sum().backward()
    y_e.sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
def test_backward_plan_kept_per_signature():
    """The backward's classification is kept per call signature: a second
    call with another scalar value reuses it and uses that value; a
    broadcast argument of another shape gets a plan of its own, its gradient
    summed down to its shape."""
    f = cufuse.fuse(lambda x, y, c: x * c + y * y)
    x, y = (torch.randn(5, 7, device="cuda", dtype=torch.float64, requires_grad=True) for _ in range(2))
    for c in (2.0, 3.0):
        x.grad = y.grad = None
        f(x, y, c).backward(torch.ones(5, 7, device="cuda", dtype=torch.float64))
        torch.testing.assert_close(x.grad, torch.full_like(x, c))
        torch.testing.assert_close(y.grad, 2 * y.detach())
    assert len(f._bwd_plans) == 1
    y1 = torch.randn(7, device="cuda", dtype=torch.float64, requires_grad=True)
    f(x, y1, 1.0).backward(torch.ones(5, 7, device="cuda", dtype=torch.float64))
    torch.testing.assert_close(y1.grad, 2 * 5 * y1.detach())
    assert len(f._bwd_plans) == 2
