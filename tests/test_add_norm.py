"""cufuse.add_rms_norm / add_layer_norm: h = x + residual and the norm of h,
against the float64 references of tests/_reference_norm.py applied to h
rounded to the data's dtype (as a framework's add rounds it), every dtype
and array kind; rows the one-pass kernel takes (whole packs, up to 2 packs
a thread) and rows it does not (odd lengths, long rows), views, a 2-D
normalized shape; gradients by gradcheck and against torch's autograd of
the unfused chain, through both outputs; torch.compile; errors."""
from __future__ import annotations

import importlib

import numpy as np
import pytest

import cufuse
from _reference import BF16, DTYPES, TOL, compiled_matches_eager, rand
from _reference_norm import F16, NORM_TOL, layer_norm_ref, rms_norm_ref

DTYPES_ALL = DTYPES + ([BF16] if BF16 is not None else [])
# the normalized output: the norms' table, bfloat16 one rounding of a float32 result (2**-7) plus the weight's
Y_TOL = {**NORM_TOL, **({BF16: (1.6e-2, 1e-2)} if BF16 is not None else {})}
OPS = {"add_rms_norm": lambda h, ns, w, b: rms_norm_ref(h, ns, w),
       "add_layer_norm": lambda h, ns, w, b: layer_norm_ref(h, ns, w, b)}

SHAPES = {  # name: (x shape, normalized_shape, how x and residual are viewed)
    "one_row": ((1, 8), 8, "plain"),
    "rows_kernel": ((5, 256), 256, "plain"),
    "hidden_4096": ((3, 4096), 4096, "plain"),
    "two_packs_16bit": ((2, 8192), 8192, "plain"),     # 2 packs a thread for 16-bit data; long for float32
    "odd": ((4, 7), 7, "plain"),                        # partial packs: the unfused path
    "norm_2d": ((2, 3, 64), (3, 64), "plain"),
    "transposed": ((6, 32), 32, "transposed"),
    "offset": ((3, 64), 64, "offset"),
    "broadcast_residual": ((4, 64), 64, "broadcast"),
    "empty": ((0, 16), 16, "plain"),
}


def _view(backend, a, how, which):
    if how == "transposed":  # a (rows, n) view of an (n, rows) array
        t = backend.asarray(np.ascontiguousarray(a.T))
        return t.T
    if how == "offset":  # data at element 1 of a wider buffer: not 16-byte aligned
        wide = np.zeros(a.shape[:-1] + (a.shape[-1] + 1,), a.dtype)
        wide[..., 1:] = a
        return backend.asarray(wide)[..., 1:]
    if how == "broadcast" and which == "residual":  # one row seen by every row (a stride 0)
        row = backend.asarray(a[:1])
        if backend.is_torch:
            return row.expand(a.shape)
        return (backend.cp if backend.gpu else np).broadcast_to(row, a.shape)
    return backend.asarray(a)


@pytest.mark.parametrize("dtype", DTYPES_ALL, ids=str)
@pytest.mark.parametrize("case", list(SHAPES))
@pytest.mark.parametrize("op", list(OPS))
def test_against_reference(backend, op, case, dtype):
    shape, ns, how = SHAPES[case]
    x = rand(shape, dtype, 1)
    r = rand(shape, dtype, 2)
    if how == "broadcast":
        r = np.broadcast_to(r[:1], shape).copy()
    nshape = (ns,) if isinstance(ns, int) else ns
    w = rand(nshape, dtype, 3)
    b = rand(nshape, dtype, 4) if op == "add_layer_norm" else None
    args = [backend.asarray(w)] + ([backend.asarray(b)] if b is not None else [])
    y, h = getattr(cufuse, op)(_view(backend, x, how, "x"), _view(backend, r, how, "residual"), ns, *args)
    hn, yn = backend.to_numpy(h), backend.to_numpy(y)
    assert hn.dtype == dtype and yn.dtype == dtype and hn.shape == shape and yn.shape == shape
    want_h = (x.astype(np.float64) + r.astype(np.float64)).astype(dtype)  # the framework's add: one rounding
    np.testing.assert_allclose(hn.astype(np.float64), want_h.astype(np.float64), rtol=TOL[dtype][0], atol=0)
    want_y = OPS[op](want_h, ns, w, b).astype(dtype).astype(np.float64)
    rtol, atol = Y_TOL[dtype] if dtype in Y_TOL else Y_TOL[F16]
    np.testing.assert_allclose(yn.astype(np.float64), want_y, rtol=rtol, atol=atol)


@pytest.mark.cuda
@pytest.mark.parametrize("op", list(OPS))
def test_one_pass_kernel_where_rows_fit(launches, op):
    """Rows of whole packs that a block holds run the one-pass kernel (one
    launch); a row of partial packs takes the add (a fused function) and the
    norm's own kernel."""
    cp = pytest.importorskip("cupy")
    x, r = (cp.asarray(rand((4, 1024), np.float32, s)) for s in (5, 6))
    getattr(cufuse, op)(x, r, 1024)
    assert [c.kernel.split("<")[0] for c in launches] == ["add_norm_forward"]
    launches.clear()
    x, r = (cp.asarray(rand((4, 1023), np.float32, s)) for s in (5, 6))
    getattr(cufuse, op)(x, r, 1023)
    names = [c.kernel.split("<")[0] for c in launches]
    assert "add_norm_forward" not in names and "norm_rows" in names


@pytest.mark.parametrize("case", ["rows_kernel", "offset", "odd"])
def test_repeat_calls_take_the_fast_path(backend, case):
    """A second call of a signature seen before runs its kept launch on the
    new call's data (no validation again); calls that needed copies
    (misaligned rows) or the unfused path are right either way."""
    if not backend.gpu:
        pytest.skip("the fast path is the GPU kinds'")
    fast = importlib.import_module("cufuse.ops.norm")._ADD_FAST
    shape, ns, how = SHAPES[case]
    for seed in (40, 41, 42):
        x, r, w = rand(shape, np.float32, seed), rand(shape, np.float32, seed + 1), rand((ns,), np.float32, seed + 2)
        hits = fast.hits
        y, h = cufuse.add_rms_norm(_view(backend, x, how, "x"), _view(backend, r, how, "residual"), ns,
                                   backend.asarray(w), 1e-6)
        if seed == 42 and case == "rows_kernel":
            assert fast.hits == hits + 1
        want_h = x.astype(np.float64) + r
        np.testing.assert_allclose(backend.to_numpy(h), want_h, rtol=1e-6, atol=0)
        np.testing.assert_allclose(backend.to_numpy(y), rms_norm_ref(want_h.astype(np.float32), ns, w),
                                   rtol=1e-5, atol=1e-5)


def test_errors():
    x = np.ones((2, 8), np.float32)
    with pytest.raises(TypeError, match="residual has dtype float64"):
        cufuse.add_rms_norm(x, x.astype(np.float64), 8)
    with pytest.raises(ValueError, match=r"residual has shape \(2, 4\)"):
        cufuse.add_rms_norm(x, x[:, :4], 8)
    with pytest.raises(ValueError, match="normalized_shape"):
        cufuse.add_layer_norm(x, x, 4 * 3)
    with pytest.raises(ValueError, match="weight has shape"):
        cufuse.add_layer_norm(x, x, 8, np.ones(4, np.float32))
    with pytest.raises(TypeError, match="residual must be an array"):
        cufuse.add_rms_norm(x, [[1.0] * 8] * 2, 8)
    with pytest.raises(ValueError, match="eps"):
        cufuse.add_rms_norm(x, x, 8, eps=-1.0)
    with pytest.raises(TypeError, match="accepted dtypes"):
        cufuse.add_rms_norm(x.astype(np.int32), x.astype(np.int32), 8)


# ---------------------------------------------------------------- autograd
torch = pytest.importorskip("torch")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _torch_chain(op, x, r, n, w, b):
    h = x + r
    if op == "add_rms_norm":
        y = h.double() * torch.rsqrt(h.double().square().mean(-1, keepdim=True) + 1e-6) * w.double()
    else:
        y = torch.nn.functional.layer_norm(h.double(), (n,), w.double(), b.double(), 1e-5)
    return y.to(x.dtype), h


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("n", [64, 7, 8192])
def test_gradients(device, op, n):
    """gradcheck in float64 (rows the kernel takes, partial packs), then
    float32 / bfloat16 against the unfused chain's autograd with a loss on
    both outputs (the residual's gradient adds to the norm's), also at 8192
    columns (two packs a thread for 16-bit data, the unfused path for
    float32)."""
    g = torch.Generator().manual_seed(n)
    rows = 3 if n == 8192 else 5

    def mk(*shape, dt=torch.float64):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(device=device, dtype=dt)
    x, r, w, b = mk(rows, n), mk(rows, n), mk(n), mk(n)
    ws = (w, b) if op == "add_layer_norm" else (w,)
    f = getattr(cufuse, op)
    if n != 8192:  # (gradcheck builds the whole Jacobian: 8192 columns would take minutes and gigabytes)
        leaves = [t.clone().requires_grad_(True) for t in (x, r, *ws)]
        assert torch.autograd.gradcheck(lambda *a: f(a[0], a[1], n, *a[2:]), leaves)
    for dt in [torch.float32] + ([torch.bfloat16] if device == "cuda" else []):
        a = [t.to(dt).requires_grad_(True) for t in (x, r, *ws)]
        c = [t.to(dt).requires_grad_(True) for t in (x, r, *ws)]
        gy, gh = mk(rows, n, dt=dt), mk(rows, n, dt=dt)
        y, h = f(a[0], a[1], n, *a[2:])
        yr, hr = _torch_chain(op, c[0], c[1], n, c[2], c[3] if len(c) > 3 else None)
        tol = 1e-4 if dt == torch.float32 else 5e-2
        torch.testing.assert_close(y, yr, rtol=tol, atol=tol)
        torch.testing.assert_close(h, hr, rtol=0, atol=0)
        torch.autograd.backward((y, h), (gy, gh))
        torch.autograd.backward((yr, hr), (gy, gh))
        for p, q in zip(a, c):
            torch.testing.assert_close(p.grad, q.grad, rtol=tol, atol=tol * (4 if p.dim() == 1 else 1))


def test_compile_checks_the_residual():
    """Under torch.compile the residual is checked as in eager mode (x + r
    would broadcast or promote)."""
    x, w = torch.randn(4, 8), torch.ones(8)
    torch._dynamo.reset()
    for r in (torch.randn(8), torch.randn(4, 8, dtype=torch.float64)):
        with pytest.raises(Exception, match="must have x's dtype, shape and device"):
            torch.compile(lambda x, r: cufuse.add_rms_norm(x, r, 8, w), fullgraph=True)(x, r)


@pytest.mark.parametrize("device", DEVICES)
def test_under_compile(device):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(31)
    x, r, w = (torch.randn(*s, generator=g).to(device) for s in ((4, 64), (4, 64), (64,)))

    def f(x, r, w):
        y, h = cufuse.add_rms_norm(x, r, 64, w)
        return (y * y).sum() + h.sum()
    compiled_matches_eager(f, [x.requires_grad_(True), r.requires_grad_(True), w.requires_grad_(True)], 1e-5, 1e-5)


def test_kinds_must_match():
    x = np.ones((2, 8), np.float32)
    with pytest.raises(TypeError, match="residual is torch.Tensor.*but x is a numpy"):
        cufuse.add_rms_norm(x, torch.ones(2, 8), 8)
