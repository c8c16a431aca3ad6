"""cufuse.rope: rotary position embedding of q and k against a float64
reference written here (Hugging Face's rotate_half, GPT-J's interleaved
pairs, partial rotary dims), every dtype and array kind, transposed views,
grouped-query k, both head layouts, (tokens, r) tables and position ids;
gradients by gradcheck and against torch's autograd of the reference;
torch.compile; errors."""
from __future__ import annotations

import importlib

import numpy as np
import pytest

import cufuse
from _reference import BF16, DTYPES, TOL, compiled_matches_eager, rand

DTYPES_ALL = DTYPES + ([BF16] if BF16 is not None else [])


def _rotate(x, r, interleaved):
    """rotate_half (or the interleaved form) of the first r dims, float64."""
    x = x[..., :r]
    if interleaved:
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = -x[..., 1::2], x[..., 0::2]
        return out
    return np.concatenate([-x[..., r // 2:], x[..., : r // 2]], -1)


def _reference(x, cos, sin, interleaved):
    """x * cos + rotate(x) * sin on the first r = cos.shape[-1] dims (cos and
    sin already broadcastable against x's rotary dims), the rest unchanged."""
    x = np.asarray(x, np.float64)
    r = cos.shape[-1]
    out = x.copy()
    out[..., :r] = x[..., :r] * cos + _rotate(x, r, interleaved) * sin
    return out


def _tables(b, t, r, dt, seed, interleaved=False):
    """HF-style cos / sin (batch, tokens, r): each frequency twice (halves, or pairs when interleaved)."""
    ang = np.random.default_rng(seed).uniform(0, 6.3, (b, t, r // 2))
    emb = np.repeat(ang, 2, axis=-1) if interleaved else np.concatenate([ang, ang], -1)
    return np.cos(emb).astype(dt), np.sin(emb).astype(dt)


CASES = {  # name: (q shape, k heads, r, unsqueeze_dim, interleaved)
    "bhtd": ((2, 4, 7, 16), 2, 16, 1, False),
    "bthd": ((2, 7, 4, 16), 1, 16, 2, False),
    "partial": ((1, 3, 5, 24), 3, 8, 1, False),
    "interleaved": ((2, 2, 3, 8), 1, 8, 1, True),
    "head64": ((1, 2, 33, 64), 2, 64, 1, False),
    "odd_half": ((1, 2, 3, 6), 1, 6, 1, False),
}


def _k_shape(q_shape, heads, unsqueeze_dim):
    s = list(q_shape)
    s[unsqueeze_dim] = heads
    return tuple(s)


@pytest.mark.parametrize("dtype", DTYPES_ALL, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_against_reference(backend, case, dtype):
    shape, kh, r, ud, inter = CASES[case]
    q = rand(shape, dtype, 1)
    k = rand(_k_shape(shape, kh, ud), dtype, 2)
    b, t = shape[0], shape[3 - ud]
    cos, sin = _tables(b, t, r, dtype, 3, inter)
    qo, ko = cufuse.rope(backend.asarray(q), backend.asarray(k), backend.asarray(cos), backend.asarray(sin),
                         unsqueeze_dim=ud, interleaved=inter)
    c, s = (np.expand_dims(v.astype(np.float64), ud) for v in (cos, sin))
    for got, x in ((qo, q), (ko, k)):
        g = backend.to_numpy(got)
        assert g.dtype == dtype and g.shape == x.shape
        want = _reference(x, c, s, inter).astype(dtype).astype(np.float64)
        np.testing.assert_allclose(g.astype(np.float64), want, rtol=TOL[dtype][0], atol=TOL[dtype][1] * 4)


def test_views_tables_positions_and_no_k(backend):
    """q as a transposed view ((batch, tokens, heads, dim) -> heads first, as
    attention code makes it), float32 tables cast to q's dtype, (tokens, r)
    tables, position ids into a (positions, r) table, k None."""
    b, t, h, d = 2, 5, 3, 16
    q_bthd = rand((b, t, h, d), np.float32, 4)
    cos, sin = _tables(1, 40, d, np.float64, 5)
    cos, sin = cos[0], sin[0]                                    # (positions, r) tables
    pos = np.array([[3, 4, 5, 6, 7], [0, 1, 2, 30, 39]], dtype=np.int64)
    qa = backend.asarray(q_bthd)
    qv = qa.transpose(1, 2) if backend.is_torch else qa.transpose(0, 2, 1, 3)
    got, none = cufuse.rope(qv, None, backend.asarray(cos), backend.asarray(sin), position_ids=backend.asarray(pos))
    assert none is None
    want = _reference(q_bthd.transpose(0, 2, 1, 3), cos[pos][:, None], sin[pos][:, None], False)
    np.testing.assert_allclose(backend.to_numpy(got), want, rtol=1e-5, atol=1e-6)
    got2, _ = cufuse.rope(qv, None, backend.asarray(cos[:t]), backend.asarray(sin[:t]))  # (tokens, r)
    np.testing.assert_allclose(backend.to_numpy(got2), _reference(q_bthd.transpose(0, 2, 1, 3), cos[:t], sin[:t],
                                                                  False), rtol=1e-5, atol=1e-6)


def test_tokens_by_dim(backend):
    """q of (tokens, dim), no heads' dim: (tokens, r) tables apply as they
    are, whatever unsqueeze_dim (there is no dim to insert), against the
    reference on q seen as one batch and head."""
    rng = np.random.default_rng(24)
    q = rng.standard_normal((5, 8))
    f = rng.standard_normal((5, 3))
    cos, sin = np.cos(np.concatenate([f, f], -1)), np.sin(np.concatenate([f, f], -1))
    want = _reference(q, cos, sin, False)  # (a partial rotary: 6 of 8 dims)
    for ud in (0, 1):
        got, _ = cufuse.rope(backend.asarray(q), None, backend.asarray(cos), backend.asarray(sin), unsqueeze_dim=ud)
        np.testing.assert_allclose(backend.to_numpy(got), want, rtol=1e-12, atol=1e-12)


def test_errors():
    q = np.ones((1, 2, 3, 8), np.float32)
    cos = np.ones((1, 3, 8), np.float32)
    with pytest.raises(ValueError, match="must be even"):
        cufuse.rope(q, None, cos[..., :7], cos[..., :7])
    with pytest.raises(ValueError, match="at most q's head dim"):
        cufuse.rope(q, None, np.ones((1, 3, 10), np.float32), np.ones((1, 3, 10), np.float32))
    with pytest.raises(TypeError, match="same dtype"):
        cufuse.rope(q, q.astype(np.float64), cos, cos)
    with pytest.raises(ValueError, match="head dim"):
        cufuse.rope(q, np.ones((1, 2, 3, 6), np.float32), cos, cos)
    with pytest.raises(ValueError, match="unsqueeze_dim"):
        cufuse.rope(q, None, cos, cos, unsqueeze_dim=3)
    with pytest.raises(TypeError, match="interleaved must be a bool"):
        cufuse.rope(q, None, cos, cos, interleaved="False")  # (truthy: it was taken as True)
    with pytest.raises(ValueError, match="cos has shape"):
        cufuse.rope(q, None, cos, cos[:, :2])
    with pytest.raises(TypeError, match="accepted dtypes"):
        cufuse.rope(q.astype(np.int32), None, cos, cos)
    with pytest.raises(TypeError, match="integers"):
        cufuse.rope(q, None, cos[0], cos[0], position_ids=np.zeros((1, 3), np.float32))
    with pytest.raises(ValueError, match="tables"):
        cufuse.rope(q, None, cos, cos, position_ids=np.zeros((1, 3), np.int64))
    wrong = np.ones((1, 4, 8), np.float32)  # 4 tokens for q's 3
    with pytest.raises(ValueError, match="do not broadcast against q's rows"):
        cufuse.rope(q, None, wrong, wrong)
    with pytest.raises(ValueError, match="do not broadcast against k's rows"):
        cufuse.rope(q, np.ones((1, 2, 4, 8), np.float32), cos, cos)
    # a (batch, tokens, dim) q with a (tokens, r) table: the message says to pass unsqueeze_dim=0
    with pytest.raises(ValueError, match="for \\(batch, tokens, dim\\) pass unsqueeze_dim=0"):
        cufuse.rope(np.ones((2, 3, 8), np.float32), None, cos[0], cos[0])
    got, _ = cufuse.rope(np.ones((2, 3, 8), np.float32), None, cos[0], cos[0], unsqueeze_dim=0)
    assert got.shape == (2, 3, 8)
    with pytest.raises(TypeError, match="unsqueeze_dim must be an int, got float"):
        cufuse.rope(q, None, cos, cos, unsqueeze_dim=1.0)
    got, _ = cufuse.rope(q, None, cos, cos, unsqueeze_dim=np.int64(1))  # (a NumPy int was refused)
    np.testing.assert_array_equal(got, cufuse.rope(q, None, cos, cos)[0])
    # positions beyond the tables (an IndexError of NumPy's came through); -1 counts from the end
    with pytest.raises(ValueError, match=r"position_ids hold values in \[0, 5\]; the tables have 3 positions"):
        cufuse.rope(q, None, cos[0], cos[0], position_ids=np.array([[0, 5, 1]]))
    with pytest.raises(ValueError, match="position_ids hold values in"):
        cufuse.rope(q, None, cos[0], cos[0], position_ids=np.array([[0, -4, 1]]))
    tab = np.random.default_rng(5).standard_normal((3, 8)).astype(np.float32)
    back = cufuse.rope(q, None, tab, tab, position_ids=np.array([[0, -1, 1]]))[0]
    np.testing.assert_array_equal(back, cufuse.rope(q, None, tab, tab, position_ids=np.array([[0, 2, 1]]))[0])
    assert not np.array_equal(back, cufuse.rope(q, None, tab, tab, position_ids=np.array([[0, 1, 1]]))[0])


# ---------------------------------------------------------------- autograd
torch = pytest.importorskip("torch")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _torch_rope(x, cos, sin, r, ud, inter):
    """The reference in torch ops (its autograd is the reference gradient)."""
    c, s = cos.unsqueeze(ud), sin.unsqueeze(ud)
    xr = x[..., :r]
    if inter:
        rot = torch.stack((-xr[..., 1::2], xr[..., 0::2]), -1).flatten(-2)
    else:
        rot = torch.cat((-xr[..., r // 2:], xr[..., : r // 2]), -1)
    return torch.cat((xr * c + rot * s, x[..., r:]), -1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["bhtd", "partial", "interleaved", "bthd"])
def test_gradients(device, case):
    shape, kh, r, ud, inter = CASES[case]
    g = torch.Generator().manual_seed(6)
    cos, sin = (torch.from_numpy(v).to(device) for v in _tables(shape[0], shape[3 - ud], r, np.float64, 7, inter))
    q = torch.randn(shape, generator=g, dtype=torch.float64).to(device).requires_grad_(True)
    k = torch.randn(_k_shape(shape, kh, ud), generator=g, dtype=torch.float64).to(device).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: cufuse.rope(a, b, cos, sin, unsqueeze_dim=ud, interleaved=inter),
                                    (q, k))
    for dt in [torch.float32] + ([torch.bfloat16] if device == "cuda" else []):
        qa, ka = (v.detach().to(dt).requires_grad_(True) for v in (q, k))
        qb, kb = (v.detach().to(dt).requires_grad_(True) for v in (q, k))
        oq, ok = cufuse.rope(qa, ka, cos, sin, unsqueeze_dim=ud, interleaved=inter)
        rq, rk = (_torch_rope(v, cos.to(dt), sin.to(dt), r, ud, inter) for v in (qb, kb))
        tol = 1e-5 if dt == torch.float32 else 2e-2
        torch.testing.assert_close(oq, rq, rtol=tol, atol=tol)
        (oq.float().square().sum() + ok.float().sum()).backward()
        (rq.float().square().sum() + rk.float().sum()).backward()
        torch.testing.assert_close(qa.grad, qb.grad, rtol=tol, atol=tol)
        torch.testing.assert_close(ka.grad, kb.grad, rtol=tol, atol=tol)


def test_position_ids_of_any_integer_type():
    """uint8 / int32 position ids gather the same rows as int64 (torch reads a
    uint8 index as a mask: they are widened first), eager and compiled."""
    cos, sin = (torch.from_numpy(v[0]) for v in _tables(1, 20, 8, np.float32, 21))
    q = torch.randn(1, 2, 5, 8, generator=torch.Generator().manual_seed(22))
    pos = torch.tensor([[3, 1, 4, 1, 5]])
    want, _ = cufuse.rope(q, None, cos, sin, position_ids=pos)
    torch._dynamo.reset()
    for dt in (torch.uint8, torch.int32):
        got, _ = cufuse.rope(q, None, cos, sin, position_ids=pos.to(dt))
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        got, _ = torch.compile(lambda q, p: cufuse.rope(q, None, cos, sin, position_ids=p), fullgraph=True)(
            q, pos.to(dt))
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for name in ("uint16", "uint32", "uint64"):  # torch's newer unsigned types (eager)
        if isinstance(getattr(torch, name, None), torch.dtype):
            got, _ = cufuse.rope(q, None, cos, sin, position_ids=pos.to(getattr(torch, name)))
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_compile_checks_like_eager():
    """Under torch.compile: tables that require grad are refused as in eager
    mode (they get no gradient), and so is an unsqueeze_dim out of range."""
    shape, kh, r, ud, inter = CASES["bhtd"]
    cos, sin = (torch.from_numpy(v) for v in _tables(shape[0], shape[2], r, np.float32, 23))
    q = torch.randn(shape)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="no gradient"):
        torch.compile(lambda q, c: cufuse.rope(q, None, c, sin), fullgraph=True)(q, cos.clone().requires_grad_(True))
    with pytest.raises(Exception, match="unsqueeze_dim"):
        torch.compile(lambda q: cufuse.rope(q, None, cos, sin, unsqueeze_dim=-3), fullgraph=True)(q)
    # position_ids gather rows of (positions, r) tables; batched tables were gathered as if they were
    pos = torch.arange(shape[2]).expand(shape[0], shape[2])
    with pytest.raises(Exception, match="tables"):
        torch.compile(lambda q, p: cufuse.rope(q, None, cos, sin, position_ids=p), fullgraph=True)(q, pos)


def test_compile_with_a_dynamic_batch():
    """Tables of q's batch against q whose batch dim is dynamic under torch.compile (the table's
    size compared with a symbolic one by `in (1, m)` had read as a mismatch)."""
    shape, kh, r, ud, inter = CASES["bhtd"]
    cos, sin = (torch.from_numpy(v) for v in _tables(shape[0], shape[2], r, np.float32, 24))
    q = torch.randn(shape)
    torch._dynamo.reset()
    torch._dynamo.maybe_mark_dynamic(q, 0)
    f = lambda q: cufuse.rope(q, None, cos, sin)[0]  # noqa: E731
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(q), f(q), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_under_compile(device):
    shape, kh, r, ud, inter = CASES["partial"]
    torch._dynamo.reset()
    cos, sin = (torch.from_numpy(v).float().to(device) for v in _tables(shape[0], shape[2], r, np.float64, 8))
    g = torch.Generator().manual_seed(9)
    q0 = torch.randn(shape, generator=g).to(device)
    k0 = torch.randn(_k_shape(shape, kh, ud), generator=g).to(device)

    def f(q, k):
        a, b = cufuse.rope(q, k, cos, sin)
        return (a * a).sum() + b.sum()
    qa, _ = compiled_matches_eager(f, [q0.requires_grad_(True), k0.requires_grad_(True)], 1e-5, 1e-5)
    # q and k as a projection's output seen as heads (b, t, h, d) -> (b, h, t, d): the GPU result keeps
    # that layout, and the registered operator's fake says so (opcheck compares them)
    qt, kt = (v.detach().transpose(1, 2).contiguous().transpose(1, 2) for v in (q0, k0))
    compiled_matches_eager(f, [qt.requires_grad_(True), kt.requires_grad_(True)], 1e-5, 1e-5)
    c4, s4 = (t[:, None] for t in (cos, sin))
    torch.library.opcheck(torch.ops.cufuse.rope, ([qt.detach(), kt.detach()], c4, s4, False, False))
    with pytest.raises(NotImplementedError, match="no gradient"):
        cufuse.rope(qa, None, cos.clone().requires_grad_(True), sin)


# ------------------------------------------------ the kernel's layouts
def _random_tables(lead, r, dt, seed):
    """cos and sin with unrelated halves (not Hugging Face's repeated
    frequencies): every element of both tables matters, forward and backward."""
    rng = np.random.default_rng(seed)
    return rng.uniform(-1, 1, lead + (r,)).astype(dt), rng.uniform(-1, 1, lead + (r,)).astype(dt)


LAYOUTS = {  # name: (q shape, table lead dims, r, interleaved, how q is viewed)
    "gqa_heads_broadcast": ((2, 3, 5, 16), (2, 1, 5), 16, False, "plain"),
    "four_dims": ((2, 3, 2, 5, 8), (2, 1, 2, 1), 8, False, "plain"),        # more dims than the kernel takes
    "misaligned_rows": ((2, 3, 16), (1, 3), 16, False, "offset"),            # rows start off 16 bytes
    "transposed": ((2, 4, 3, 32), (1, 4, 1), 32, True, "transposed"),
    "partial_odd": ((3, 5, 20), (1, 5), 6, False, "plain"),
    "interleaved_partial": ((2, 7, 24), (1, 7), 16, True, "offset"),
    "one_row": ((1, 1, 2), (1, 1), 2, False, "plain"),
    "empty": ((0, 3, 8), (1, 3), 8, False, "plain"),
}


def _view(backend, x, how):
    if how == "offset":  # x lives at element 1 of a wider buffer
        wide = np.zeros(x.shape[:-1] + (x.shape[-1] + 1,), x.dtype)
        wide[..., 1:] = x
        return backend.asarray(wide)[..., 1:]
    if how == "transposed":  # x's first two dims swapped in memory
        a = backend.asarray(np.ascontiguousarray(np.swapaxes(x, 0, 1)))
        return a.transpose(0, 1) if backend.is_torch else a.transpose(1, 0, *range(2, x.ndim))
    return backend.asarray(x)


@pytest.mark.parametrize("dtype", DTYPES_ALL, ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_random_tables(backend, layout, dtype):
    """Broadcast tables (heads, middle dims), views whose rows are not
    16-byte aligned, transposed q, partial and odd rotary dims, one row and
    no rows, with unrelated cos and sin halves: against the reference."""
    shape, lead, r, inter, how = LAYOUTS[layout]
    x = rand(shape, dtype, 11)
    cos, sin = _random_tables(lead, r, dtype, 12)
    got, _ = cufuse.rope(_view(backend, x, how), None, backend.asarray(cos), backend.asarray(sin),
                         interleaved=inter)
    g = backend.to_numpy(got)
    assert g.shape == x.shape and g.dtype == dtype
    if backend.gpu and x.size:  # a dense view's layout is kept (transposed q stays so); others are C order
        view = _view(backend, x, how)
        strides = (lambda a: tuple(a.stride())) if backend.is_torch else (lambda a: a.strides)
        assert strides(got) == (strides(view) if how == "transposed" else
                                strides(backend.asarray(np.ascontiguousarray(x)))), (strides(got), strides(view))
    want = _reference(x, cos.astype(np.float64), sin.astype(np.float64), inter).astype(dtype).astype(np.float64)
    np.testing.assert_allclose(g.astype(np.float64), want, rtol=TOL[dtype][0], atol=TOL[dtype][1] * 4)


@pytest.mark.parametrize("layout", ["gqa_heads_broadcast", "misaligned_rows", "transposed"])
def test_repeat_calls_take_the_fast_path(backend, layout):
    """A second call of a signature seen before runs its kept recipe (no
    validation, no planning: the driver's fast path) on the new call's data;
    a call that needed copies (a misaligned view is fine, a transposed one is
    read through its strides) is right either way."""
    if not backend.gpu:
        pytest.skip("the fast path is the GPU kinds'")
    fast = importlib.import_module("cufuse.ops.rope")._FAST  # (cufuse.ops.rope is also the function's name)
    shape, lead, r, inter, how = LAYOUTS[layout]
    for seed in (20, 21, 22):
        x = rand(shape, np.float32, seed)
        cos, sin = _random_tables(lead, r, np.float32, seed + 10)
        hits = fast.hits
        got, _ = cufuse.rope(_view(backend, x, how), None, backend.asarray(cos), backend.asarray(sin),
                             interleaved=inter)
        if seed == 22:
            assert fast.hits == hits + 1
        np.testing.assert_allclose(backend.to_numpy(got), _reference(x, cos.astype(np.float64),
                                                                    sin.astype(np.float64), inter),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
def test_q_and_k_in_one_launch(launches):
    """q and k (grouped-query: fewer heads) rotate in one kernel launch, their
    gradients in one more."""
    tq = pytest.importorskip("torch")
    cos, sin = (tq.from_numpy(v).cuda() for v in _tables(2, 9, 16, np.float32, 13))
    q = tq.randn(2, 4, 9, 16, device="cuda", requires_grad=True)
    k = tq.randn(2, 2, 9, 16, device="cuda", requires_grad=True)
    cufuse.rope(q.detach(), k.detach(), cos, sin)  # (compiled before counting)
    launches.clear()
    oq, ok = cufuse.rope(q, k, cos, sin)
    assert [c.kernel for c in launches] == ["rope<float>"] and launches[0].grid[1] == 2
    (oq.sum() + ok.square().sum()).backward()
    assert [c.kernel for c in launches] == ["rope<float>"] * 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["gqa_heads_broadcast", "four_dims", "interleaved_partial"])
def test_gradients_random_tables(device, layout):
    """gradcheck with unrelated cos and sin halves (the backward's transposed
    rotation reads s_j for x_i and s_i for x_j), and a gradient that arrives
    as a transposed view."""
    shape, lead, r, inter, _ = LAYOUTS[layout]
    cos, sin = (torch.from_numpy(v).to(device) for v in _random_tables(lead, r, np.float64, 14))
    g = torch.Generator().manual_seed(15)
    q = torch.randn(shape, generator=g, dtype=torch.float64).to(device).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a: cufuse.rope(a, None, cos, sin, interleaved=inter)[0], (q,))
    out, _ = cufuse.rope(q, None, cos, sin, interleaved=inter)
    gout = torch.randn(tuple(reversed(shape)), generator=g, dtype=torch.float64).to(device).permute(
        *reversed(range(len(shape))))
    (dq,) = torch.autograd.grad(out, q, gout)
    qb = q.detach().clone().requires_grad_(True)
    xr = qb[..., :r]
    rot = (torch.stack((-xr[..., 1::2], xr[..., 0::2]), -1).flatten(-2) if inter
           else torch.cat((-xr[..., r // 2:], xr[..., : r // 2]), -1))
    (want,) = torch.autograd.grad(torch.cat((xr * cos + rot * sin, qb[..., r:]), -1), qb, gout)
    torch.testing.assert_close(dq, want, rtol=1e-12, atol=1e-12)


def test_result_layout_rule():
    """out_strides: a dense permuted layout of up to 3 leading dims is kept (what the kernel writes and the
    registered operator's fake says); C order, more dims, a gap or rows not contiguous give None."""
    from cufuse.ops.rope import out_strides
    assert out_strides((2, 4, 3, 8), (96, 8, 32, 1)) == (96, 8, 32, 1)   # (b, t, h, d) seen as (b, h, t, d)
    assert out_strides((2, 4, 3, 8), (96, 24, 8, 1)) is None              # C order
    assert out_strides((2, 5, 3, 4, 8), (480, 8, 32, 96, 1)) is None      # 4 leading dims
    assert out_strides((2, 4, 3, 8), (192, 8, 64, 1)) is None             # a slice: not dense
    assert out_strides((2, 4, 3, 8), (96, 1, 32, 4)) is None              # rows not contiguous
    assert out_strides((2, 4, 3, 8), (96, 8, 32, 1), aligned=False) is None
