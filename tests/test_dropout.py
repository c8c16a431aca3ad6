"""cufuse.gelu_dropout(x, p=0.1, training=True, seed=None, approximate="none", *, out=None)
= dropout(gelu(x)), with the Philox4x32-10 mask of the spec.

The mask reference is tests/_reference_fused.py (NumPy Philox4x32-10, checked
here against Random123's known-answer vectors): element i (C-order logical
index) uses lane i % L of philox(counter=(i//L lo, i//L hi, 0, 0),
key=(seed lo, seed hi)) and is kept iff lane >= floor(p * 2**B): B-bit lanes,
B = 16 and L = 8 (low half of each word, then high half) for float16
results with 1/32 <= p <= 31/32, B = 32 and L = 4 (the four words) otherwise. Kept values
are gelu(x) * (1 / (1 - p)) within ``TOL``; dropped values are exactly 0.
Inputs never make gelu exactly 0 (|x| in [0.05, 3]), so ``result != 0`` is
the mask.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import cufuse

from _reference import DTYPES, TOL, Backend, check_kind
from _reference_fused import (F16, F32, F64, assert_close_tol, assert_within_one_ulp, dropout_keep_mask,
                              finite_float16, gelu64, keep_threshold, mask_bits, philox4x32_10, philox_words)

dtype_param = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
approx_param = pytest.mark.parametrize("approximate", ["none", "tanh"])


def dropout_input(shape, dtype, seed):
    """|x| uniform in [0.05, 3], random sign: gelu(x) is never 0, even in float16."""
    rng = np.random.default_rng(seed)
    mag = rng.uniform(0.05, 3.0, shape)
    sign = np.where(rng.random(shape) < 0.5, -1.0, 1.0)
    return (mag * sign).astype(dtype)


def check_result(got, x, seed, p, approximate, dtype, mask=None):
    """``got`` (NumPy) is dropout(gelu(x)) with the Philox mask of ``seed``."""
    dtype = np.dtype(dtype)
    assert got.dtype == dtype and got.shape == x.shape
    if mask is None:
        mask = dropout_keep_mask(x.shape, seed, p, dtype)
    kept = got != 0
    if not np.array_equal(kept, mask):
        bad = np.flatnonzero(kept.ravel() != mask.ravel())
        raise AssertionError(f"mask differs from the Philox reference at {bad.size} of {mask.size} "
                             f"elements; first C-order indices {bad[:8].tolist()}")
    assert np.isfinite(got).all()
    factor = 1.0 / (1.0 - p)
    ref = gelu64(x[mask].astype(np.float64), approximate) * factor
    rtol, atol = TOL[dtype]
    # the absolute part of the tolerance is gelu's (erf / tanh cancelling near 0), scaled by the factor
    assert_close_tol(got[mask], ref, dtype, tol=(rtol, atol * factor))
    assert (got[~mask] == 0).all()
    return mask


def run(backend, x_np, launches=None, x=None, **kw):
    x = backend.asarray(x_np) if x is None else x
    res = cufuse.gelu_dropout(x, **kw)
    check_kind(backend, res, x_np.shape, x_np.dtype)
    if launches is not None and x_np.size == 0:
        assert launches == []
    return backend.to_numpy(res)


# ---------------------------------------------------------- the reference
KAT = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
       ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
       ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]


@pytest.mark.parametrize("ctr, key, expected", KAT, ids=["zeros", "ones", "pi"])
def test_philox_reference_known_answers(ctr, key, expected):
    """The NumPy Philox4x32-10 of the tests matches Random123's kat_vectors."""
    got = philox4x32_10(*ctr, *key)
    assert tuple(int(w) for w in got) == expected
    # vectorised: the same counter at several positions of an array
    got = philox4x32_10(*[np.full(5, c, np.uint64) for c in ctr], *key)
    for w, e in zip(got, expected):
        assert (w == e).all()


def test_philox_words_layout():
    """32-bit lanes: element i uses word i % 4 of the block at counter i // 4;
    16-bit lanes: the low (i even) or high half of word (i // 2) % 4 of the
    block at counter i // 8. The seed's low / high 32 bits are key words 0 / 1."""
    seed = 0x0123456789ABCDEF
    w = philox_words(10, seed)
    h = philox_words(20, seed, 16)
    for i in range(20):
        block = philox4x32_10(i // 8, 0, 0, 0, 0x89ABCDEF, 0x01234567)
        word = int(block[(i // 2) % 4])
        assert h[i] == (word & 0xFFFF if i % 2 == 0 else word >> 16)
        if i < 10:
            assert w[i] == philox4x32_10(i // 4, 0, 0, 0, 0x89ABCDEF, 0x01234567)[i % 4]
    assert keep_threshold(0.5) == 2 ** 31 and keep_threshold(0.0) == 0
    assert keep_threshold(0.1) == 429496729
    assert keep_threshold(0.1, 16) == 6553
    assert mask_bits(F16, 0.1) == 16 and mask_bits(F32, 0.1) == 32 and mask_bits(F64, 0.1) == 32
    assert mask_bits(F16, 1 / 32) == mask_bits(F16, 31 / 32) == 16
    assert mask_bits(F16, 0.031) == mask_bits(F16, 0.97) == mask_bits(F16, 1e-5) == 32


# ---------------------------------------------------------------- the mask
SEED_P = [(0, 0.1), (12345, 0.5), (2 ** 32 + 7, 1 / 3), (2 ** 64 - 1, 0.9), (0xDEADBEEF, 0.25),
          (0x0123456789ABCDEF, 0.999), (987654321, 1e-9),
          # float16's 16-bit lanes apply for 1/32 <= p <= 31/32 only
          (77, 1 / 32), (78, 31 / 32), (79, 0.031), (80, 0.97), (81, 0.01)]


@dtype_param
@approx_param
@pytest.mark.parametrize("seed, p", SEED_P, ids=lambda v: hex(v) if isinstance(v, int) else repr(v))
def test_mask_matches_philox(backend, dtype, approximate, seed, p, launches):
    x = dropout_input((317, 331), dtype, 1)        # 104927 elements, not a multiple of 4
    got = run(backend, x, launches, p=p, seed=seed, approximate=approximate)
    check_result(got, x, seed, p, approximate, dtype)


@pytest.mark.parametrize("dtype", [F32, F16], ids=lambda d: d.name)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 4097])
def test_mask_small_sizes(backend, dtype, n, launches):
    x = dropout_input((n,), dtype, n)
    got = run(backend, x, launches, p=0.5, seed=99)
    check_result(got, x, 99, 0.5, "none", dtype)


@pytest.mark.parametrize("dtype, bits, parity", [(F64, 32, 1), (F16, 16, 0), (F16, 16, 1)],
                         ids=["float64", "float16-low-half", "float16-high-half"])
@pytest.mark.parametrize("offset", [0, 1, 2])
def test_threshold_boundary(backend, dtype, bits, parity, offset):
    """p chosen so that floor(p * 2**B) equals, or is one above, the lane of
    element k: kept iff lane >= threshold (the boundary is inclusive). For
    float16, k is the first element of the given parity (low / high half of
    a word) whose lane puts p where 16-bit lanes apply."""
    seed = 4242
    x = dropout_input((64,), dtype, 2)
    lanes = philox_words(64, seed, bits)
    k = next(i for i in range(parity, 64, 2) if bits == 32 or 0.04 < lanes[i] / 2 ** bits < 0.96)
    w = int(lanes[k])
    # offset 0: threshold == w (kept); 1: p * 2**B = w + 0.5, threshold still w (kept);
    # 2: threshold == w + 1 (dropped)
    p = {0: w / 2 ** bits, 1: (w + 0.5) / 2 ** bits, 2: (w + 1) / 2 ** bits}[offset]
    assert p < 1 and keep_threshold(p, bits) == w + (offset == 2) and mask_bits(dtype, p) == bits
    got = run(backend, x, p=p, seed=seed)
    check_result(got, x, seed, p, "none", dtype)
    assert (got[k] != 0) == (offset < 2)


VIEWS = ["transposed", "permuted_3d", "step", "step_2d", "offset", "sliced_2d", "negative_step"]


def make_view(backend, view, dtype, seed):
    def dev(shape):
        return backend.asarray(dropout_input(shape, dtype, seed))

    if view == "transposed":
        return dev((257, 129)).T
    if view == "permuted_3d":
        x = dev((8, 9, 10))
        return x.permute(2, 0, 1) if backend.is_torch else x.transpose(2, 0, 1)
    if view == "step":
        return dev((2 * 4097,))[::2]
    if view == "step_2d":
        return dev((60, 50))[::3, ::2]
    if view == "offset":
        return dev((4098,))[1:]
    if view == "sliced_2d":
        return dev((40, 70))[:, 3:67]
    if view == "negative_step":
        if not backend.negative_strides:
            pytest.skip("torch tensors have no negative strides")
        return dev((4097,))[::-1]
    raise AssertionError(view)


@dtype_param
@pytest.mark.parametrize("view", VIEWS)
def test_mask_non_contiguous(backend, dtype, view, launches):
    """The Philox index is the element's logical C-order index, whatever the strides."""
    x = make_view(backend, view, dtype, 3)
    nx = backend.to_numpy(x)
    got = run(backend, nx, launches, x=x, p=0.3, seed=777)
    check_result(got, nx, 777, 0.3, "none", dtype)


# -------------------------------------------------------------- statistics
@pytest.mark.parametrize("dtype", [F32, F16], ids=lambda d: d.name)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_statistics(backend, dtype, p):
    """10M elements on the GPU, 1M on the fallbacks: kept fraction within 5
    sigma of 1 - p (of floor(p * 2**B) / 2**B, p as the B-bit lanes see it),
    masks of adjacent elements (and lags up to 16: both halves of a word,
    the next block) uncorrelated, and the mask is the Philox one."""
    n = 10_000_000 if backend.gpu else 1_000_000
    seed = 31337 + int(p * 10)
    x = dropout_input((n,), dtype, 4)
    got = run(backend, x, p=p, seed=seed)
    mask = check_result(got, x, seed, p, "none", dtype)
    bits = mask_bits(dtype, p)
    p = keep_threshold(p, bits) / 2 ** bits
    frac = mask.mean()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(frac - (1 - p)) < 5 * sigma, (frac, 1 - p, sigma)
    m = mask.astype(np.float64)
    for lag in range(1, 17):
        r = np.corrcoef(m[:-lag], m[lag:])[0, 1]
        assert abs(r) < 0.01, (lag, r)


def test_seeds_give_different_masks(backend):
    x = dropout_input((10000,), F32, 5)
    masks = [run(backend, x, p=0.5, seed=s) != 0 for s in (1, 2, 2 ** 32 + 1, 2 ** 63 + 1)]
    for i in range(len(masks)):
        for j in range(i):
            assert (masks[i] != masks[j]).mean() > 0.4, (i, j)


def test_same_seed_same_result(backend):
    x = dropout_input((10000,), F16, 6)
    a = run(backend, x, p=0.2, seed=5)
    b = run(backend, x, p=0.2, seed=5)
    np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------- manual_seed
def _manual_seed(backend, seed):
    """The generator seed=None draws from: torch's for torch tensors (as torch's dropout), else cufuse's."""
    if backend.is_torch:
        import torch
        torch.manual_seed(seed)
    else:
        cufuse.manual_seed(seed)


def test_manual_seed_reproduces(backend):
    x = dropout_input((20000,), F32, 7)
    _manual_seed(backend, 1234)
    a1 = run(backend, x, p=0.5)
    a2 = run(backend, x, p=0.5)
    _manual_seed(backend, 1234)
    b1 = run(backend, x, p=0.5)
    b2 = run(backend, x, p=0.5)
    np.testing.assert_array_equal(a1, b1)
    np.testing.assert_array_equal(a2, b2)
    assert ((a1 != 0) != (a2 != 0)).mean() > 0.4       # consecutive calls: different masks
    _manual_seed(backend, 4321)
    c1 = run(backend, x, p=0.5)
    assert ((a1 != 0) != (c1 != 0)).mean() > 0.4       # another manual seed: another sequence


def test_refused_calls_draw_no_seed(backend):
    """A call that raises (a wrong dtype, a wrong out=, out= under autograd) leaves the generator its
    seed would come from as it was: the next masks are those of a run without it."""
    x = dropout_input((4096,), F32, 33)
    bads = [lambda: cufuse.gelu_dropout(backend.asarray(np.arange(8, dtype=np.int32)), 0.5),
            lambda: cufuse.gelu_dropout(backend.asarray(x), 0.5, out=backend.asarray(np.zeros(5, F32)))]
    if backend.is_torch:
        bads.append(lambda: cufuse.gelu_dropout(backend.asarray(x).requires_grad_(True), 0.5,
                                                out=backend.asarray(np.zeros(4096, F32))))
    run(backend, x, p=0.5)  # (a first call keeps the signature's recipe: later ones take the fast path)
    _manual_seed(backend, 99)
    want = run(backend, x, p=0.5)
    _manual_seed(backend, 99)
    for bad in bads:
        with pytest.raises((TypeError, ValueError, RuntimeError)):
            bad()
    np.testing.assert_array_equal(run(backend, x, p=0.5), want)


def test_torch_draws_from_torch_and_checkpoint_recomputes_the_mask():
    """seed=None on torch tensors draws from torch's generator: torch.utils.checkpoint, whose
    recompute restores it (reentrant: the first forward ran without grad), gives the gradient of
    the forward's very mask; cufuse.manual_seed does not reach torch tensors' masks."""
    torch = pytest.importorskip("torch")
    from torch.utils.checkpoint import checkpoint
    x = torch.from_numpy(dropout_input((4096,), F32, 31)).requires_grad_(True)
    for reentrant in (True, False):
        x.grad = None
        y = checkpoint(lambda t: cufuse.gelu_dropout(t * 1.0, 0.5), x, use_reentrant=reentrant)
        y.backward(torch.ones_like(y))
        assert torch.equal(x.grad != 0, y != 0), f"use_reentrant={reentrant}"
    with torch.no_grad():
        torch.manual_seed(7)
        a = cufuse.gelu_dropout(x, 0.5)
        cufuse.manual_seed(8)
        torch.manual_seed(7)
        assert torch.equal(a, cufuse.gelu_dropout(x, 0.5))


def test_forked_processes_draw_their_own_seeds():
    """A forked process (a DataLoader worker) draws seeds of its own from cufuse's generator,
    unless cufuse.manual_seed set the parent's (then it repeats the parent's sequence)."""
    import multiprocessing as mp
    if "fork" not in mp.get_all_start_methods():
        pytest.skip("no fork on this platform")
    from cufuse import _random
    saved = _random._manual[0], _random._state[0]
    _random._manual[0] = False  # (as at import: other tests set a manual seed)
    ctx = mp.get_context("fork")
    x = dropout_input((256,), F32, 32)

    def masks():
        q = ctx.Queue()
        procs = [ctx.Process(target=_child_mask, args=(q, x)) for _ in range(2)]
        for pr in procs:
            pr.start()
        got = [q.get(timeout=60) for _ in procs]
        for pr in procs:
            pr.join()
        return got

    try:
        a, b = masks()
        assert a != b
        cufuse.manual_seed(5)
        a, b = masks()
        assert a == b
    finally:
        _random._manual[0], _random._state[0] = saved


def _child_mask(q, x):
    q.put((cufuse.gelu_dropout(x, p=0.5) != 0).tobytes())


def test_no_seed_calls_differ(backend):
    x = dropout_input((20000,), F32, 8)
    masks = [run(backend, x, p=0.5) != 0 for _ in range(3)]
    assert (masks[0] != masks[1]).mean() > 0.4
    assert (masks[1] != masks[2]).mean() > 0.4
    assert (masks[0] != masks[2]).mean() > 0.4


def test_no_seed_result_is_a_philox_mask(backend):
    """Whatever seed the generator hands out, the result is consistent:
    kept values are gelu(x) / (1 - p), dropped are 0, fraction plausible."""
    x = dropout_input((100000,), F32, 9)
    cufuse.manual_seed(1)
    got = run(backend, x, p=0.3)
    mask = got != 0
    ref = gelu64(x[mask].astype(np.float64)) / 0.7
    assert_close_tol(got[mask], ref, F32, tol=(TOL[F32][0], TOL[F32][1] / 0.7))
    assert abs(mask.mean() - 0.7) < 5 * math.sqrt(0.21 / x.size)


# -------------------------------------------------------- plain-gelu modes
@dtype_param
@approx_param
@pytest.mark.parametrize("mode", ["eval", "p0", "p0_no_seed", "eval_no_seed"])
def test_plain_gelu(backend, dtype, approximate, mode, launches):
    x = dropout_input((3, 4097), dtype, 10)
    kw = {"eval": dict(p=0.5, training=False, seed=3), "p0": dict(p=0.0, seed=3),
          "p0_no_seed": dict(p=0.0), "eval_no_seed": dict(p=0.9, training=False)}[mode]
    got = run(backend, x, launches, approximate=approximate, **kw)
    assert_close_tol(got, gelu64(x.astype(np.float64), approximate), dtype)


def test_p0_int_and_default_p(backend):
    x = dropout_input((1000,), F32, 11)
    got = run(backend, x, p=0, seed=1)
    assert_close_tol(got, gelu64(x.astype(np.float64)), F32)
    got = run(backend, x, seed=1)                 # default p = 0.1
    check_result(got, x, 1, 0.1, "none", F32)


@pytest.mark.parametrize("kw", [dict(training=False), dict(p=0.0)], ids=["eval", "p0"])
def test_plain_gelu_errors_name_gelu_dropout(backend, kw):
    """Plain GELU (eval mode, p = 0) runs bias_gelu's kernel; its errors name gelu_dropout."""
    with pytest.raises(TypeError, match=r"^cufuse\.gelu_dropout: operand 1 .*int32"):
        cufuse.gelu_dropout(backend.asarray(np.arange(6, dtype=np.int32)), **kw)
    x = backend.asarray(dropout_input((6,), F32, 14))
    with pytest.raises(ValueError, match=r"^cufuse\.gelu_dropout: out has shape"):
        cufuse.gelu_dropout(x, out=backend.asarray(np.zeros(5, F32)), **kw)


def test_positional_arguments(backend):
    x = dropout_input((1000,), F64, 12)
    got = backend.to_numpy(cufuse.gelu_dropout(backend.asarray(x), 0.25, True, 17, "tanh"))
    check_result(got, x, 17, 0.25, "tanh", F64)


# ------------------------------------------------------------------- out=
@pytest.mark.parametrize("layout", ["contiguous", "strided", "transposed", "offset"])
def test_out(backend, layout, launches):
    outside = None
    shape = (37, 41)
    if layout == "offset":
        shape = (4097,)
        big = backend.full((4098,), np.nan, F32)
        out, outside = big[1:], (slice(0, 1),)
    elif layout == "strided":
        big = backend.full((37, 82), np.nan, F32)
        out, outside = big[:, ::2], (slice(None), slice(1, None, 2))
    elif layout == "transposed":
        big = backend.full((41, 37), np.nan, F32)
        out = big.T
    else:
        big = out = backend.full(shape, np.nan, F32)
    x = dropout_input(shape, F32, 13)
    res = cufuse.gelu_dropout(backend.asarray(x), p=0.4, seed=2024, out=out)
    assert res is out
    check_result(backend.to_numpy(res), x, 2024, 0.4, "none", F32)
    if outside is not None:
        assert np.isnan(backend.to_numpy(big)[outside]).all()


def test_out_is_x(backend):
    x = dropout_input((5000,), F32, 14)
    dx = backend.asarray(x)
    res = cufuse.gelu_dropout(dx, p=0.4, seed=5, out=dx)
    assert res is dx
    check_result(backend.to_numpy(dx), x, 5, 0.4, "none", F32)


@pytest.mark.parametrize("shape", [(0,), (0, 3), (3, 0, 2)], ids=str)
@pytest.mark.parametrize("with_out", [False, True])
def test_empty(backend, shape, with_out, launches):
    x = np.zeros(shape, F32)
    out = backend.full(shape, 0, F32) if with_out else None
    res = cufuse.gelu_dropout(backend.asarray(x), p=0.5, seed=1, out=out)
    if with_out:
        assert res is out
    check_kind(backend, res, shape, F32)
    assert launches == []


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, -1e-12, float("nan"), float("inf")], ids=repr)
def test_bad_p(backend, p, launches):
    x = backend.asarray(dropout_input((16,), F32, 15))
    with pytest.raises(ValueError):
        cufuse.gelu_dropout(x, p=p, seed=1)
    assert launches == []


@pytest.mark.parametrize("bad", ["exact", "Tanh", "", None], ids=repr)
def test_bad_approximate(backend, bad, launches):
    x = backend.asarray(dropout_input((16,), F32, 16))
    with pytest.raises(ValueError) as exc:
        cufuse.gelu_dropout(x, p=0.1, seed=1, approximate=bad)
    assert "none" in str(exc.value) and "tanh" in str(exc.value)
    assert launches == []


@pytest.mark.parametrize("seed", [-1, 2 ** 64, -(2 ** 70)], ids=repr)
def test_seed_out_of_range(backend, seed, launches):
    x = backend.asarray(dropout_input((16,), F32, 17))
    with pytest.raises((ValueError, OverflowError)):
        cufuse.gelu_dropout(x, p=0.1, seed=seed)
    assert launches == []


@pytest.mark.parametrize("seed", [1.5, "7"], ids=repr)
def test_seed_not_an_int(backend, seed, launches):
    x = backend.asarray(dropout_input((16,), F32, 18))
    with pytest.raises((TypeError, ValueError)):
        cufuse.gelu_dropout(x, p=0.1, seed=seed)
    assert launches == []


@pytest.mark.parametrize("bad", [np.int32, np.int8, np.bool_, np.complex64], ids=lambda t: np.dtype(t).name)
def test_bad_dtype(backend, bad, launches):
    x = backend.asarray(np.ones((16,), dtype=bad))
    with pytest.raises(TypeError):
        cufuse.gelu_dropout(x, p=0.1, seed=1)
    assert launches == []


@pytest.mark.parametrize("shape", [(5, 4), (4, 5, 1), (20,), ()], ids=str)
def test_out_wrong_shape(backend, shape, launches):
    x = backend.asarray(dropout_input((4, 5), F32, 19))
    out = backend.full(shape, np.nan, F32)
    with pytest.raises(ValueError):
        cufuse.gelu_dropout(x, p=0.1, seed=1, out=out)
    assert np.isnan(backend.to_numpy(out)).all()
    assert launches == []


@pytest.mark.parametrize("out_dtype", [F16, F64, np.dtype(np.int32)], ids=lambda d: d.name)
def test_out_wrong_dtype(backend, out_dtype, launches):
    x = backend.asarray(dropout_input((4, 5), F32, 20))
    out = backend.asarray(np.zeros((4, 5), out_dtype))
    with pytest.raises(TypeError):
        cufuse.gelu_dropout(x, p=0.1, seed=1, out=out)
    assert launches == []


def test_out_wrong_kind(backend, launches):
    other = Backend({"numpy": "torch_cpu", "torch_cpu": "numpy", "cupy": "numpy", "torch_cuda": "cupy"}[backend.name])
    x = backend.asarray(dropout_input((4, 5), F32, 21))
    out = other.full((4, 5), np.nan, F32)
    with pytest.raises(TypeError):
        cufuse.gelu_dropout(x, p=0.1, seed=1, out=out)
    assert launches == []


# ------------------------------------------------- GPU and fallback agree
GPU_KINDS = [pytest.param("cupy", marks=pytest.mark.cuda, id="cupy"),
             pytest.param("torch_cuda", marks=pytest.mark.cuda, id="torch_cuda")]


@pytest.mark.parametrize("kind", GPU_KINDS)
@dtype_param
@pytest.mark.parametrize("view", ["contiguous", "transposed", "step_2d", "permuted_3d"])
def test_gpu_mask_equals_fallback(kind, dtype, view):
    gpu = Backend(kind)
    cpu = Backend("numpy")
    seed = 2 ** 40 + 3
    if view == "contiguous":
        xg = gpu.asarray(dropout_input((1001, 1003), dtype, 22))
    else:
        xg = make_view(gpu, view, dtype, 22)
    nx = gpu.to_numpy(xg)
    xc = make_view(cpu, view, dtype, 22) if view != "contiguous" else nx
    np.testing.assert_array_equal(cpu.to_numpy(xc), nx)
    g = gpu.to_numpy(cufuse.gelu_dropout(xg, p=0.35, seed=seed))
    c = cpu.to_numpy(cufuse.gelu_dropout(xc, p=0.35, seed=seed))
    np.testing.assert_array_equal(g != 0, c != 0)
    mask = check_result(g, nx, seed, 0.35, "none", dtype)
    check_result(c, nx, seed, 0.35, "none", dtype, mask=mask)


@pytest.mark.cuda
def test_manual_seed_shared_by_gpu_and_fallback():
    """cufuse has one generator: after the same manual_seed, the GPU and the
    fallback draw the same seeds, so give the same masks."""
    import cupy as cp
    x = dropout_input((50000,), F32, 23)
    cufuse.manual_seed(99)
    g1 = cp.asnumpy(cufuse.gelu_dropout(cp.asarray(x), p=0.5))
    g2 = cp.asnumpy(cufuse.gelu_dropout(cp.asarray(x), p=0.5))
    cufuse.manual_seed(99)
    c1 = cufuse.gelu_dropout(x, p=0.5)
    c2 = cufuse.gelu_dropout(x, p=0.5)
    np.testing.assert_array_equal(g1 != 0, c1 != 0)
    np.testing.assert_array_equal(g2 != 0, c2 != 0)


@pytest.mark.cuda
@pytest.mark.parametrize("p", [0.1, 0.5, 0.97, 0.999])
def test_float16_every_value_within_one_ulp(p):
    """Every finite float16 input: kept results are within one float16 ulp of
    gelu(x) / (1 - p) (float64, rounded to float16; those that overflow are
    inf). The kernel folds 1 / (1 - p) into the erf tail's exponent
    (common.cuh: gelu_normal), so the scale is checked here at every input,
    16-bit lanes (0.1, 0.5) and 32-bit ones (0.97, 0.999: factors up to 1000)."""
    import cupy as cp
    x = finite_float16()
    seed = 1234567
    got = cp.asnumpy(cufuse.gelu_dropout(cp.asarray(x), p=p, seed=seed))
    mask = dropout_keep_mask(x.shape, seed, p, F16)
    assert (got[~mask] == 0).all()
    with np.errstate(over="ignore"):
        expected = (gelu64(x[mask].astype(np.float64)) * (1.0 / (1.0 - p))).astype(F16)
    got = got[mask]
    big = np.isinf(expected)
    np.testing.assert_array_equal(got[big], expected[big])
    assert_within_one_ulp(got[~big], expected[~big], x[mask][~big], f"p={p}")
