"""cufuse.attention against a float64 reference written here (an explicit
softmax of q k^T per batch and head), every dtype and array kind, causal and
not, grouped-query heads, odd and zero sequence lengths, head dims 16 to
128, strided and misaligned views, the 3-D form; gradients against torch's
autograd of the reference and by gradcheck; determinism; errors."""
from __future__ import annotations

import importlib
import math

import numpy as np
import pytest

import cufuse
from _reference import BF16, DTYPES, rand

DTYPES_ALL = DTYPES + ([BF16] if BF16 is not None else [])
# (rtol, atol) of the output per dtype: the 16-bit kernels round the
# probabilities to the input dtype before P V (as FlashAttention does)
TOL = {np.dtype(np.float16): 3e-3, np.dtype(np.float32): 2e-5, np.dtype(np.float64): 1e-10}
if BF16 is not None:
    TOL[BF16] = 2e-2
# gradients: |got - want| <= GTOL * max |want| (they sum over a sequence)
GTOL = {np.dtype(np.float16): 1e-2, np.dtype(np.float32): 1e-4, np.dtype(np.float64): 1e-10}
if BF16 is not None:
    GTOL[BF16] = 5e-2

CASES = {  # name: (batch, heads, kv heads, seq_q, seq_k, head dim)
    "one": (1, 1, 1, 1, 1, 64),
    "odd": (2, 3, 3, 17, 17, 64),
    "gqa": (2, 8, 2, 65, 65, 32),
    "long_k": (1, 2, 1, 127, 1000, 128),
    "short_q": (2, 2, 2, 5, 300, 96),
    "long_q": (1, 1, 1, 4097, 130, 16),
    "d48": (1, 2, 2, 33, 70, 48),
    "d112": (1, 1, 1, 20, 21, 112),
    "few_keys": (1, 2, 1, 40, 9, 32),  # causal: the first rows see no key
}


def _reference(q, k, v, scale, causal):
    """(o, lse) in float64: per batch and head, s = q k^T scale, keys j > i +
    seq_k - seq_q masked when causal, o = softmax(s) v; a row with no key: 0, -inf."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, h, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    o = np.zeros((b, h, sq, v.shape[-1]))
    lse = np.full((b, h, sq), -np.inf)
    allowed = np.ones((sq, sk), bool)
    if causal:
        allowed = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)
    for bi in range(b):
        for hi in range(h):
            kv = hi // (h // hk)
            s = q[bi, hi] @ k[bi, kv].T * scale
            for i in range(sq):
                row = s[i][allowed[i]]
                if row.size == 0:
                    continue
                m = row.max()
                e = np.exp(row - m)
                o[bi, hi, i] = e @ v[bi, kv][allowed[i]] / e.sum()
                lse[bi, hi, i] = m + math.log(e.sum())
    return o, lse


def _inputs(case, dt, seed):
    b, h, hk, sq, sk, d = CASES[case] if isinstance(case, str) else case
    return rand((b, h, sq, d), dt, seed), rand((b, hk, sk, d), dt, seed + 1), rand((b, hk, sk, d), dt, seed + 2)


def _poison(backend, nbytes):
    """Fill and free GPU memory with NaN so that outputs the kernels fail to write show."""
    if backend.name == "torch_cuda":
        backend.torch.full((nbytes // 4 + 1,), float("nan"), device="cuda")
    elif backend.name == "cupy":
        backend.cp.full((nbytes // 4 + 1,), np.nan, np.float32)


def _check(got, want, dt, what):
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=f"{what}: -inf positions")
    fin = np.isfinite(want)
    assert np.isfinite(got[fin]).all(), f"{what}: non-finite values"
    t = TOL[np.dtype(dt)]
    np.testing.assert_allclose(got[fin], want[fin], rtol=t, atol=t, err_msg=what)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dt", DTYPES_ALL, ids=lambda d: d.name)
def test_forward(backend, dt, case, causal):
    q, k, v = _inputs(case, dt, 3)
    _poison(backend, q.size * 8)
    o, lse = cufuse.attention(backend.asarray(q), backend.asarray(k), backend.asarray(v), causal=causal,
                              return_lse=True)
    assert backend.is_kind(o) and backend.is_kind(lse)
    got = backend.to_numpy(o)
    assert got.dtype == dt
    want_o, want_lse = _reference(q, k, v, 1 / math.sqrt(q.shape[-1]), causal)
    _check(got, want_o, dt, "o")
    assert backend.to_numpy(lse).dtype == (np.float64 if dt == np.float64 else np.float32)
    _check(backend.to_numpy(lse), want_lse, np.float32 if dt != np.float64 else dt, "lse")


SM90_CASES = {  # head dims the Hopper forward has; tails of its 128-row blocks and 128-key tiles
    "d64": (2, 4, 2, 129, 300, 64),
    "d128": (1, 3, 3, 200, 257, 128),
    "d128_one": (1, 1, 1, 1, 1, 128),
    "d64_short_q": (1, 2, 1, 7, 1000, 64),
}


@pytest.mark.cuda
@pytest.mark.parametrize("path", ["auto", "sm80"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", list(SM90_CASES))
@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_forward_paths(monkeypatch, dt, case, causal, path):
    """Both tensor-core forwards (on a compute capability 9.0 GPU "auto" is the wgmma one, and the mma.sync one
    is forced) against the float64 reference, on torch tensors, the output poisoned first."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    AT = importlib.import_module("cufuse.ops.attention")  # (cufuse.ops.attention is also the function's name)
    if path == "sm80":
        monkeypatch.setattr(AT, "_PATH", "sm80")
    d = SM90_CASES[case][-1]
    assert AT._uses_sm90(0, d) == (path == "auto" and torch.cuda.get_device_capability() == (9, 0))
    ndt = BF16 if dt == "bfloat16" else np.dtype(dt)
    q, k, v = _inputs(SM90_CASES[case], np.dtype(np.float32), 11)
    tq, tk, tv = (torch.from_numpy(x).to("cuda", getattr(torch, dt)) for x in (q, k, v))
    torch.full((q.size * 4,), float("nan"), device="cuda")
    o, lse = cufuse.attention(tq, tk, tv, causal=causal, return_lse=True)
    rq, rk, rv = (x.double().cpu().numpy() for x in (tq, tk, tv))  # the rounded inputs
    want_o, want_lse = _reference(rq, rk, rv, 1 / math.sqrt(d), causal)
    _check(o.double().cpu().numpy(), want_o, ndt, "o")
    _check(lse.double().cpu().numpy(), want_lse, np.float32, "lse")


@pytest.mark.parametrize("shape", [(1, 2, 2, 0, 5, 64), (1, 2, 2, 5, 0, 64), (0, 2, 1, 5, 5, 32),
                                   (2, 0, 2, 5, 5, 64)])
def test_empty_sequences(backend, shape):
    """No query rows: empty results; no keys: zeros and lse -inf (a row that sees nothing); no query
    heads against two key heads: empty results, and empty scores."""
    q, k, v = _inputs(shape, np.float16, 5)
    o, lse = cufuse.attention(backend.asarray(q), backend.asarray(k), backend.asarray(v), return_lse=True)
    assert tuple(o.shape) == q.shape and tuple(lse.shape) == q.shape[:3]
    s = cufuse.attention_score(backend.asarray(q), backend.asarray(k))
    assert tuple(s.shape) == (*q.shape[:3], k.shape[2])
    want_o, want_lse = _reference(q, k, v, 0.125, False)
    _check(backend.to_numpy(o), want_o, np.float16, "o")
    np.testing.assert_array_equal(backend.to_numpy(lse), want_lse.astype(np.float32))


@pytest.mark.parametrize("shape", [(2, 0, 0, 5, 5, 64), (1, 2, 2, 5, 7, 0), (1, 4, 2, 3, 3, 0)])
@pytest.mark.parametrize("causal", [False, True])
def test_no_heads_and_head_dim_zero(backend, shape, causal):
    """No heads in q, k and v (they were refused as "not a whole multiple"), and a head dim of 0 (refused;
    torch's SDPA gives an empty result): empty outputs, and for a head dim of 0 each row's lse is the log
    of the keys it sees (every score is 0). Scores alike; the gradients are empty for torch."""
    q, k, v = _inputs(shape, np.float16, 7)
    o, lse = cufuse.attention(backend.asarray(q), backend.asarray(k), backend.asarray(v), causal=causal,
                              return_lse=True)
    want_o, want_lse = _reference(q, k, v, 1.0, causal)
    assert tuple(o.shape) == q.shape and tuple(lse.shape) == q.shape[:3]
    np.testing.assert_allclose(backend.to_numpy(lse), want_lse, rtol=2e-7)  # (the GPU's log in float32)
    s = cufuse.attention_score(backend.asarray(q), backend.asarray(k))
    assert tuple(s.shape) == (*q.shape[:3], k.shape[2])
    np.testing.assert_array_equal(backend.to_numpy(s), np.zeros(s.shape, np.float16))
    if backend.is_torch:
        ts = [backend.asarray(x).requires_grad_(True) for x in (q, k, v)]
        o, lse = cufuse.attention(*ts, causal=causal, return_lse=True)
        (o.float().sum() + lse.sum()).backward()
        assert [tuple(t.grad.shape) for t in ts] == [q.shape, k.shape, v.shape]


@pytest.mark.parametrize("dt", DTYPES_ALL, ids=lambda d: d.name)
def test_causal_rows_without_keys(backend, dt):
    """seq_q > seq_k with the bottom-right causal mask: the first rows see no key (0, lse -inf)."""
    q, k, v = _inputs((1, 2, 1, 40, 9, 32), dt, 6)
    o, lse = cufuse.attention(backend.asarray(q), backend.asarray(k), backend.asarray(v), causal=True,
                              return_lse=True)
    want_o, want_lse = _reference(q, k, v, 1 / math.sqrt(32), True)
    assert np.isneginf(want_lse[..., :31]).all() and np.isfinite(want_lse[..., 31:]).all()
    _check(backend.to_numpy(o), want_o, dt, "o")
    _check(backend.to_numpy(lse), want_lse, np.float32 if dt != np.float64 else dt, "lse")


@pytest.mark.parametrize("dt", DTYPES_ALL, ids=lambda d: d.name)
def test_layouts(backend, dt):
    """(batch, seq, heads, dim) storage seen as (batch, heads, seq, dim) (Hugging
    Face's layout before its transpose), a misaligned view, the 3-D form and a scale."""
    b, s, h, d = 2, 37, 4, 64
    base = rand((b, s, h, d), dt, 8)
    qt = backend.asarray(base)
    qt = qt.transpose(1, 2) if backend.is_torch else qt.transpose(0, 2, 1, 3)
    flat = backend.asarray(rand((b * h * s * d + 1,), dt, 9))
    k_mis = flat[1:].reshape(b, h, s, d)  # one element off: not 16-byte aligned
    v = rand((b, h, s, d), dt, 10)
    o = cufuse.attention(qt, k_mis, backend.asarray(v), scale=0.3)
    want, _ = _reference(base.transpose(0, 2, 1, 3), backend.to_numpy(k_mis), v, 0.3, False)
    _check(backend.to_numpy(o), want, dt, "strided and misaligned")
    o = cufuse.attention(qt, k_mis, backend.asarray(v), scale=-0.2, causal=True)  # (the kernels take scale > 0)
    want, _ = _reference(base.transpose(0, 2, 1, 3), backend.to_numpy(k_mis), v, -0.2, True)
    _check(backend.to_numpy(o), want, dt, "negative scale")
    q3, k3, v3 = (rand((3, 50, 32), dt, 11 + i) for i in range(3))
    o3 = cufuse.attention(*(backend.asarray(x) for x in (q3, k3, v3)), causal=True)
    assert tuple(o3.shape) == (3, 50, 32)
    want3, _ = _reference(q3[:, None], k3[:, None], v3[:, None], 1 / math.sqrt(32), True)
    _check(backend.to_numpy(o3), want3[:, 0], dt, "3-D")


# ------------------------------------------------------------------ gradients
def _torch_reference(q, k, v, scale, causal):
    """The attention in torch ops (float64 on the CPU), for autograd."""
    import torch
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        sq, sk = s.shape[-2:]
        mask = torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + (sk - sq)
        seen = (~mask).any(-1, keepdim=True)  # rows that see no key give 0 (and no gradient)
        s = torch.where(seen, s.masked_fill(mask, -math.inf), 0.0)
        return (torch.softmax(s, -1) * seen) @ v
    return torch.softmax(s, -1) @ v


GRAD_CASES = ["odd", "gqa", "long_k", "short_q", "d48", "few_keys"]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", GRAD_CASES)
@pytest.mark.parametrize("dt", DTYPES_ALL, ids=lambda d: d.name)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_gradients(device, dt, case, causal):
    torch = pytest.importorskip("torch")
    from _reference import Backend
    bk = Backend("torch_cuda" if device == "cuda" else "torch_cpu")
    q, k, v = _inputs(case, dt, 20)
    go = rand(q.shape, dt, 23)
    ins = [bk.asarray(x).requires_grad_(True) for x in (q, k, v)]
    o = cufuse.attention(*ins, causal=causal)
    o.backward(bk.asarray(go))
    ref = [torch.from_numpy(np.asarray(x, np.float64)).requires_grad_(True) for x in (q, k, v)]
    scale = 1 / math.sqrt(q.shape[-1])
    _torch_reference(*ref, scale, causal).backward(torch.from_numpy(go.astype(np.float64)))
    for what, a, r in zip("qkv", ins, ref):
        got = bk.to_numpy(a.grad).astype(np.float64)
        want = r.grad.numpy()
        assert got.shape == want.shape and np.isfinite(got).all(), what
        err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
        assert err <= GTOL[np.dtype(dt)], f"d{what}: max error {err:.3g} of max |want| {np.abs(want).max():.3g}"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_gradcheck(device):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(30)
    q = torch.randn(1, 4, 6, 8, generator=g, dtype=torch.float64).to(device).requires_grad_(True)
    k = torch.randn(1, 2, 7, 8, generator=g, dtype=torch.float64).to(device).requires_grad_(True)
    v = torch.randn(1, 2, 7, 8, generator=g, dtype=torch.float64).to(device).requires_grad_(True)
    for causal in (False, True):
        assert torch.autograd.gradcheck(lambda a, b, c: cufuse.attention(a, b, c, causal=causal, scale=0.7),
                                        (q, k, v))


@pytest.mark.parametrize("case", ["gqa", "short_q"])
@pytest.mark.parametrize("dt", DTYPES_ALL, ids=lambda d: d.name)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_lse_gradient(device, dt, case):
    """The returned log-sum-exp is differentiable (code that merges partial
    attentions by their lse back-propagates through it): with the output's
    gradient, with the lse's alone, causal or not, against torch autograd
    of the float64 math (lse = logsumexp of the scaled scores)."""
    torch = pytest.importorskip("torch")
    from _reference import Backend
    bk = Backend("torch_cuda" if device == "cuda" else "torch_cpu")
    q, k, v = _inputs(case, dt, 40)
    go, gl = rand(q.shape, dt, 43), rand(q.shape[:3], np.float32, 44)
    scale = 1 / math.sqrt(q.shape[-1])
    for causal in (False, True):
        for with_o in (True, False):
            ins = [bk.asarray(x).requires_grad_(True) for x in (q, k, v)]
            o, lse = cufuse.attention(*ins, causal=causal, return_lse=True)
            loss = (lse.double() * bk.asarray(gl).double()).sum()
            if with_o:
                loss = loss + (o.double() * bk.asarray(go).double()).sum()
            loss.backward()
            ref = [torch.from_numpy(np.asarray(x, np.float64)).requires_grad_(True) for x in (q, k, v)]
            group = q.shape[1] // k.shape[1]
            kr, vr = (x.repeat_interleave(group, 1) for x in ref[1:])
            sc = ref[0] @ kr.transpose(-1, -2) * scale
            if causal:
                sq, sk = sc.shape[-2:]
                sc = sc.masked_fill(torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + (sk - sq), -math.inf)
            rl = (sc.logsumexp(-1) * torch.from_numpy(gl.astype(np.float64))).sum()
            if with_o:
                rl = rl + ((torch.softmax(sc, -1) @ vr) * torch.from_numpy(go.astype(np.float64))).sum()
            rl.backward()
            for what, a, r in zip("qkv", ins, ref):
                got = np.zeros(r.shape) if a.grad is None else bk.to_numpy(a.grad).astype(np.float64)
                want = np.zeros(r.shape) if r.grad is None else r.grad.numpy()  # (v: no part in the lse)
                err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
                assert err <= GTOL[np.dtype(dt)], (f"causal={causal} with_o={with_o} d{what}: max error {err:.3g} "
                                                   f"of max |want| {np.abs(want).max():.3g}")


@pytest.mark.cuda
@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_backward_is_deterministic(dt):
    torch = pytest.importorskip("torch")
    g = torch.Generator(device="cuda").manual_seed(31)
    dtype = getattr(torch, dt)
    q = torch.randn(2, 8, 300, 64, device="cuda", generator=g).to(dtype).requires_grad_(True)
    k = torch.randn(2, 2, 300, 64, device="cuda", generator=g).to(dtype).requires_grad_(True)
    v = torch.randn(2, 2, 300, 64, device="cuda", generator=g).to(dtype).requires_grad_(True)
    go = torch.randn(2, 8, 300, 64, device="cuda", generator=g).to(dtype)
    grads = []
    for _ in range(2):
        grads.append(torch.autograd.grad(cufuse.attention(q, k, v, causal=True), (q, k, v), go))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.cuda
def test_matches_torch_sdpa():
    """Against torch's scaled_dot_product_attention (same causal convention when seq_q == seq_k)."""
    torch = pytest.importorskip("torch")
    g = torch.Generator(device="cuda").manual_seed(32)
    q, k, v = (torch.randn(2, 4, 257, 128, device="cuda", generator=g).half() for _ in range(3))
    for causal in (False, True):
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.testing.assert_close(cufuse.attention(q, k, v, causal=causal), want, rtol=3e-3, atol=3e-3)


# --------------------------------------------------------------------- errors
def test_errors(backend):
    q, k, v = (backend.asarray(x) for x in _inputs((1, 4, 2, 8, 8, 64), np.float16, 40))
    with pytest.raises(TypeError, match="k is numpy.ndarray"):
        if backend.name != "numpy":
            cufuse.attention(q, np.zeros((1, 2, 8, 64), np.float16), v)
        else:
            raise TypeError("k is numpy.ndarray")
    with pytest.raises(TypeError, match="dtype float32 and q float16"):
        cufuse.attention(q, backend.asarray(rand((1, 2, 8, 64), np.float32, 1)), v)
    with pytest.raises(TypeError, match="accepted dtypes"):
        cufuse.attention(backend.asarray(np.ones((1, 4, 8, 64), np.int32)), k, v)
    with pytest.raises(ValueError, match="must all be"):
        cufuse.attention(q[0], k, v)
    with pytest.raises(ValueError, match="whole multiple"):
        cufuse.attention(q, backend.asarray(rand((1, 3, 8, 64), np.float16, 2)),
                         backend.asarray(rand((1, 3, 8, 64), np.float16, 3)))
    with pytest.raises(ValueError, match="head dim is 64 and k's 32"):
        cufuse.attention(q, backend.asarray(rand((1, 2, 8, 32), np.float16, 2)), v)
    with pytest.raises(ValueError, match="v must have k's heads"):
        cufuse.attention(q, k, backend.asarray(rand((1, 2, 9, 64), np.float16, 2)))
    with pytest.raises(ValueError, match="batch sizes differ"):
        cufuse.attention(q, backend.asarray(rand((2, 2, 8, 64), np.float16, 2)), v)
    with pytest.raises(TypeError, match="causal must be a bool"):
        cufuse.attention(q, k, v, causal=1)
    with pytest.raises(ValueError, match="scale must be finite"):
        cufuse.attention(q, k, v, scale=float("nan"))
    with pytest.raises(TypeError, match="scale must be a float"):
        cufuse.attention(q, k, v, scale="0.1")
    with pytest.raises(ValueError, match="scale must be finite"):
        cufuse.attention(q, k, v, scale=10 ** 400)  # (a Python int beyond float's range)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        cufuse.attention(q, k, v, return_lse="no")


@pytest.mark.cuda
def test_unsupported_head_dim_on_the_gpu():
    import cupy
    q = cupy.asarray(rand((1, 1, 8, 72), np.float16, 1))
    with pytest.raises(ValueError, match="head dim 72 is not supported"):
        cufuse.attention(q, q, q)
    # the dense path serves float32 at any head dim
    o = cufuse.attention(q.astype(np.float32), q.astype(np.float32), q.astype(np.float32))
    want, _ = _reference(*(cupy.asnumpy(q),) * 3, 1 / math.sqrt(72), False)
    _check(cupy.asnumpy(o), want, np.float32, "float32 d72")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_torch_compile(device):
    """fullgraph torch.compile of a function calling cufuse.attention: the same
    output and gradients as eager (the registered operator and its backward)."""
    torch = pytest.importorskip("torch")
    from _reference import compiled_matches_eager
    dt = torch.float16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(50)
    q = torch.randn(2, 4, 33, 64, generator=g).to(device, dt).requires_grad_(True)
    k = torch.randn(2, 2, 33, 64, generator=g).to(device, dt).requires_grad_(True)
    v = torch.randn(2, 2, 33, 64, generator=g).to(device, dt).requires_grad_(True)

    def f(q, k, v):
        o, lse = cufuse.attention(q * 1.5, k, v, causal=True, return_lse=True)
        return (o.float().square().sum() + lse.float().sum() * 0) / 100

    tol = 2e-3 if device == "cuda" else 1e-5
    compiled_matches_eager(f, [q, k, v], tol, tol)
    m = torch.rand(33, 33, generator=g).to(device) < 0.7

    def fs(q, k):
        return cufuse.attention_score(q, k, mask=m).float().clamp(min=-1e4).square().sum() / 1000

    compiled_matches_eager(fs, [q, k], tol, tol)
    # the registered operators: schema (no output aliases an input), fake kernel, autograd
    torch.library.opcheck(torch.ops.cufuse.attention, (q, k, v, 0.125, True))
    torch.library.opcheck(torch.ops.cufuse.attention_score, (q, k, 0.125, m))


# ------------------------------------------------------------------- scores
SCORE_CASES = {  # name: (batch, heads, k heads, seq_q, seq_k, head dim)
    "one": (1, 1, 1, 1, 1, 16),
    "odd": (2, 3, 3, 17, 131, 64),
    "gqa": (1, 4, 2, 65, 130, 128),
    "wide": (1, 1, 1, 70, 300, 256),
    "d48": (2, 2, 1, 33, 64, 48),
    "tiles": (1, 2, 2, 70, 200, 64),  # several key tiles, the last partial, rows of whole 16-byte chunks
}


def _score_reference(q, k, scale, mask):
    """float64 q k^T scale per batch and head (k's head h // group), then the mask."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    g = q.shape[1] // k.shape[1]
    s = np.einsum("bhid,bhjd->bhij", q, np.repeat(k, g, axis=1)) * scale
    if mask is not None:
        s = np.where(mask, s, -np.inf) if mask.dtype == np.bool_ else s + mask.astype(np.float64)
    return s


@pytest.mark.parametrize("mask", [None, "additive", "boolean", "broadcast"])
@pytest.mark.parametrize("case", list(SCORE_CASES))
@pytest.mark.parametrize("dt", DTYPES_ALL, ids=lambda d: d.name)
def test_attention_score(backend, dt, case, mask):
    b, h, hk, sq, sk, d = SCORE_CASES[case]
    q, k = rand((b, h, sq, d), dt, 60), rand((b, hk, sk, d), dt, 61)
    rng = np.random.default_rng(62)
    m = None
    if mask == "additive":
        m = rand((b, h, sq, sk), dt, 63)
    elif mask == "boolean":
        m = rng.random((b, 1, sq, sk)) < 0.7
    elif mask == "broadcast":
        m = rand((sq, sk), dt, 64)
    _poison(backend, b * h * sq * sk * 8)
    got = cufuse.attention_score(backend.asarray(q), backend.asarray(k), scale=0.37,
                                 mask=None if m is None else backend.asarray(m))
    assert backend.is_kind(got)
    got = backend.to_numpy(got)
    assert got.dtype == dt and got.shape == (b, h, sq, sk)
    # the additive mask is added in the scores' dtype: the reference adds the same rounded values
    want = _score_reference(q, k, 0.37, m)
    _check(got, want, dt, "scores")


def test_attention_score_three_dims_and_default_scale(backend):
    q, k = rand((3, 20, 32), np.float16, 70), rand((3, 45, 32), np.float16, 71)
    m = np.random.default_rng(72).random((20, 45)) < 0.5
    got = backend.to_numpy(cufuse.attention_score(backend.asarray(q), backend.asarray(k), mask=backend.asarray(m)))
    want = _score_reference(q[:, None], k[:, None], 1 / math.sqrt(32), m)[:, 0]
    _check(got, want, np.float16, "3-D")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_attention_score_gradients(device):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(73)
    q = torch.randn(2, 4, 9, 16, generator=g, dtype=torch.float64).to(device).requires_grad_(True)
    k = torch.randn(2, 2, 11, 16, generator=g, dtype=torch.float64).to(device).requires_grad_(True)
    m = (torch.rand(9, 11, generator=g) < 0.6).to(device)
    assert torch.autograd.gradcheck(lambda a, b: cufuse.attention_score(a, b, scale=0.3, mask=m).clamp(min=-1e9),
                                    (q, k))
    if device == "cuda":  # the kernel's forward with the same backward
        qh, kh = (x.detach().half().requires_grad_(True) for x in (q, k))
        go = torch.randn(2, 4, 9, 11, generator=g).to(device).half()
        torch.autograd.backward(cufuse.attention_score(qh, kh, scale=0.3), go)
        qr, kr = (x.detach().half().double().requires_grad_(True) for x in (q, k))
        (qr @ kr.repeat_interleave(2, 1).transpose(-1, -2) * 0.3).backward(go.double())
        torch.testing.assert_close(qh.grad.double(), qr.grad, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(kh.grad.double(), kr.grad, rtol=1e-2, atol=1e-2)


def test_attention_score_errors(backend):
    q, k = (backend.asarray(rand((1, 4, 8, 32), np.float16, i)) for i in (1, 2))
    with pytest.raises(ValueError, match="does not broadcast"):
        cufuse.attention_score(q, k, mask=backend.asarray(np.ones((3, 8), bool)))
    with pytest.raises(ValueError, match="would grow"):
        cufuse.attention_score(q, k, mask=backend.asarray(np.ones((2, 4, 8, 8), bool)))
    with pytest.raises(TypeError, match="boolean .* or a float additive mask"):
        cufuse.attention_score(q, k, mask=backend.asarray(np.ones((8, 8), np.int32)))
    with pytest.raises(ValueError, match="whole multiple"):
        cufuse.attention_score(q, backend.asarray(rand((1, 3, 8, 32), np.float16, 3)))
    with pytest.raises(ValueError, match="must agree"):
        cufuse.attention_score(q, backend.asarray(rand((1, 4, 8, 16), np.float16, 3)))
    with pytest.raises(TypeError, match="scale must be a float"):
        cufuse.attention_score(q, k, scale=[1.0])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_gradients_of_views(device):
    """Gradients through the views the kernels copy or read in place: q as a
    transposed (batch, seq, heads, dim) storage, k misaligned by one element,
    v of the 3-D form's head dim inserted; a tiny positive scale (the dense path on the GPU)."""
    torch = pytest.importorskip("torch")
    dt = torch.float16 if device == "cuda" else torch.float64
    g = torch.Generator().manual_seed(80)
    b, s, h, d = 2, 37, 2, 64
    qs = torch.randn(b, s, h, d, generator=g).to(device, dt).requires_grad_(True)
    flat = torch.randn(b * h * s * d + 1, generator=g).to(device, dt).requires_grad_(True)
    v = torch.randn(b, h, s, d, generator=g).to(device, dt).requires_grad_(True)
    go = torch.randn(b, h, s, d, generator=g).to(device, dt)
    for scale in (0.2, 1e-30):
        ins = (qs, flat, v)
        o = cufuse.attention(qs.transpose(1, 2), flat[1:].view(b, h, s, d), v, causal=True, scale=scale)
        got = torch.autograd.grad(o, ins, go)
        ref = [x.detach().cpu().double().requires_grad_(True) for x in ins]
        want = torch.autograd.grad(_torch_reference(ref[0].transpose(1, 2), ref[1][1:].view(b, h, s, d), ref[2],
                                                    scale, True), ref, go.cpu().double())
        # at scale 1e-30 the gradients of q and k are ~1e-30: 0 in float16
        # (relative to float16's smallest normal number, then)
        floor = torch.finfo(dt).tiny
        for name, a, w in zip("qkv", got, want):
            err = (a.cpu().double() - w).abs().max().item() / max(w.abs().max().item(), floor)
            assert err <= (1e-2 if device == "cuda" else 1e-10), (scale, name, err)


def test_compiled_checks_mask_and_scale():
    """Under torch.compile the mask's shape and the scale are checked as in eager mode."""
    torch = pytest.importorskip("torch")
    q = torch.randn(1, 4, 33, 16)
    with pytest.raises(Exception, match="does not broadcast"):
        torch.compile(lambda a: cufuse.attention_score(a, a, mask=torch.ones(32, 33, dtype=torch.bool)),
                      fullgraph=True)(q)
    with pytest.raises(Exception, match="scale must be finite"):
        torch.compile(lambda a: cufuse.attention(a, a, a, scale=float("inf")), fullgraph=True)(q)
    # a NumPy number and a NumPy bool are taken as in eager mode (they were refused)
    for kw in ({"scale": np.float32(0.5)}, {"causal": np.bool_(True)}):
        torch._dynamo.reset()
        f = lambda a: cufuse.attention(a, a, a, **kw)  # noqa: E731
        torch.testing.assert_close(torch.compile(f)(q), f(q), rtol=1e-5, atol=1e-5)
    # a float mask that requires grad: eager refuses it (it gets no gradient); compiled, it was detached
    bias = torch.randn(33, 33, requires_grad=True)
    qg = q.clone().requires_grad_(True)
    with pytest.raises(Exception, match="the mask gets no gradient"):
        cufuse.attention_score(qg, qg, mask=bias)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="the mask gets no gradient"):
        torch.compile(lambda a, m: cufuse.attention_score(a, a, mask=m), backend="aot_eager")(qg, bias)
    # a mask of q's batch against a dynamic batch (its size compared with a symbolic one by `in (1, w)`
    # read as a mismatch)
    q2 = torch.randn(2, 4, 33, 16)
    m = torch.randn(2, 1, 33, 33)
    torch._dynamo.reset()
    torch._dynamo.maybe_mark_dynamic(q2, 0)
    f = lambda a: cufuse.attention_score(a, a, mask=m)  # noqa: E731
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(q2), f(q2), rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_torch_current_stream_is_the_calls_stream(dtype):
    """Under torch.cuda.stream(s), q produced on s behind a long kernel is read
    after it, whatever CuPy's current stream is (here a non-blocking one, as
    in a program that mixes CuPy and torch): the kernels are queued on s, and
    the dense path (float32: CuPy's math) runs on s too (D.on_device). Before
    that change the dense path ran on CuPy's current stream and was still
    right: the DLPack import of q makes that stream wait for torch's (this
    test passed on the old code too; it guards the ordering, not a fix)."""
    torch = pytest.importorskip("torch")
    import cupy as cp
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(81)
    b, h, s, d = 1, 2, 200, 64
    base, k, v = (torch.randn(b, h, s, d, generator=g).to("cuda", dt) for _ in range(3))
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with cp.cuda.Stream(non_blocking=True), torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # tens of milliseconds on the side stream
        q = base * 2
        o = cufuse.attention(q, k, v, causal=True)
        sc = cufuse.attention_score(q, k)
    side.synchronize()
    torch.cuda.synchronize()
    ref = [x.detach().cpu().double() for x in (base * 2, k, v)]
    want = _torch_reference(*ref, 1 / math.sqrt(d), True)
    tol = 1e-4 if dtype == "float32" else 1e-2
    assert (o.cpu().double() - want).abs().max().item() <= tol * want.abs().max().item()
    want_s = ref[0] @ ref[1].transpose(-1, -2) / math.sqrt(d)
    assert (sc.cpu().double() - want_s).abs().max().item() <= tol * want_s.abs().max().item()


@pytest.mark.cuda
def test_dense_path_refuses_capture():
    """float32 attention and scores (CuPy math, whose temporaries a graph
    cannot keep) raise inside a CUDA graph capture, before anything is
    queued; float16 ones (the kernels) are captured and replay right."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(82)
    q, k, v = (torch.randn(1, 2, 40, 64, generator=g).cuda() for _ in range(3))
    qh, kh, vh = (x.half() for x in (q, k, v))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        cufuse.attention(qh, kh, vh)  # the warm-up
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for call in (lambda: cufuse.attention(q, k, v), lambda: cufuse.attention_score(q, k)):
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="dense path"):
            with torch.cuda.graph(graph):
                call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = cufuse.attention(qh, kh, vh)
    qh.mul_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    want = cufuse.attention(qh, kh, vh)
    assert torch.equal(o, want)
