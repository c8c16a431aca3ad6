"""The one host launch path (cufuse/_driver.py): the recipe of a call's
signature kept by the general path and replayed by the fast path, errors on
a call that matches a kept signature in all but the bad argument, stream
binding, CUDA graph capture of every op family, and the recipe mechanism
itself (CPU)."""
from __future__ import annotations

import gc

import numpy as np
import pytest

import cufuse
from cufuse import _driver as D

from _reference import rand

SHAPE = (64, 96)
DT = [np.dtype(np.float16), np.dtype(np.float32)]


def _fused():
    return cufuse.fuse(lambda a, b: a * b + 1.0)


def _fused_rows():
    return cufuse.fuse(lambda a, b: (a * b).sum(axis=-1))


# family -> (input spec, the call). Inputs: "x" (SHAPE), "b"/"w" (one row), "q" (int8 codes).
FAMILIES = {
    "add_relu": ("xx", lambda a, b, out=None: cufuse.add_relu(a, b, out=out)),
    "fma_scalar": ("xx", lambda a, b, out=None: cufuse.fma(a, 0.5, b, out=out)),
    "bias_gelu": ("xb", lambda x, b, out=None: cufuse.bias_gelu(x, b, out=out)),
    "gelu_dropout": ("x", lambda x, out=None: cufuse.gelu_dropout(x, 0.1, seed=7, out=out)),
    "quantize_int8": ("x", lambda x, out=None: cufuse.quantize_int8(x, 0.05, out=out)),
    "quantize_int8_axis": ("xw", lambda x, s, out=None: cufuse.quantize_int8(x, abs(s) + 0.01, axis=-1, out=out)),
    "dequantize_int8": ("q", lambda q, out=None: cufuse.dequantize_int8(q, 0.05, out=out)),
    "layer_norm": ("xwb", lambda x, w, b, out=None: cufuse.layer_norm(x, x.shape[-1], w, b, out=out)),
    "rms_norm": ("xw", lambda x, w, out=None: cufuse.rms_norm(x, (x.shape[-1],), w, out=out)),
    "softmax": ("x", lambda x, out=None: cufuse.softmax(x, out=out)),
    "sum_squared": ("x", lambda x, out=None: cufuse.sum_squared(x, out=out)),
    "mean_abs_axis0": ("x", lambda x, out=None: cufuse.mean_abs(x, axis=0, out=out)),
    "fuse": ("xx", lambda a, b, out=None: _FUSED["ew"](a, b, out=out)),
    "fuse_rows": ("xx", lambda a, b, out=None: _FUSED["rows"](a, b, out=out)),
}
_FUSED = {}


@pytest.fixture(autouse=True)
def _fresh():
    """New fused functions and no kept recipes for each test."""
    _FUSED["ew"], _FUSED["rows"] = _fused(), _fused_rows()
    D.clear_fast_paths()
    yield
    D.clear_fast_paths()


def _np_inputs(spec, dtype, seed):
    out = []
    for k, c in enumerate(spec):
        if c == "q":
            out.append(np.random.default_rng(seed + k).integers(-128, 128, SHAPE).astype(np.int8))
        else:
            out.append(rand(SHAPE[-1:] if c in "wb" else SHAPE, dtype, seed + k))
    return out


def _hits():
    gc.collect()  # fast paths of functions made by earlier tests, left in cycles, drop out of the sum now, not between
    return sum(fp.hits for fp in D.fast_paths())


def _kinds():
    import cupy as cp
    kinds = [("cupy", cp.asarray, cp.asnumpy)]
    torch = pytest.importorskip("torch")
    kinds.append(("torch", lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda(),
                  lambda t: t.cpu().numpy()))
    return kinds


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DT, ids=lambda d: d.name)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_second_call_takes_the_fast_path(family, dtype):
    """The first call keeps its recipe; the second (same signature, new data)
    finds it, counted, and gives bit for bit what the general path gives on
    that data; so does a third with out= (its first out= call is general)."""
    spec, call = FAMILIES[family]
    for _, to_dev, to_np in _kinds():
        D.clear_fast_paths()
        a = [to_dev(v) for v in _np_inputs(spec, dtype, 1)]
        b = [to_dev(v) for v in _np_inputs(spec, dtype, 11)]
        call(*a)
        h = _hits()
        fast = to_np(call(*b))
        assert _hits() == h + 1, family
        D.clear_fast_paths()
        general = to_np(call(*b))
        assert _hits() == h + 1
        np.testing.assert_array_equal(fast, general)
        out = call(*a) * 0 + 3  # poisoned (and not a view of anything)
        call(*a, out=out)
        h = _hits()
        got = to_np(call(*b, out=out))
        assert _hits() == h + 1, family
        np.testing.assert_array_equal(got, general)


@pytest.mark.cuda
def test_fast_path_in_place_and_overlap():
    """out= the input itself (element for element) stays on the fast path; an
    out= that overlaps an input any other way goes to the general path, which
    computes into a temporary: the result is right either way."""
    import cupy as cp
    x = cp.asarray(rand((256,), np.float32, 3))
    y = cp.asarray(rand((256,), np.float32, 4))
    ref = np.maximum(cp.asnumpy(x) + cp.asnumpy(y), 0)
    buf = cp.empty(512, np.float32)
    buf[:256] = x
    cufuse.add_relu(buf[:256], y, out=buf[:256])       # general: keeps the in-place recipe
    np.testing.assert_array_equal(cp.asnumpy(buf[:256]), ref)
    buf[:256] = x
    h = _hits()
    cufuse.add_relu(buf[:256], y, out=buf[:256])
    assert _hits() == h + 1
    np.testing.assert_array_equal(cp.asnumpy(buf[:256]), ref)
    buf[:256] = x
    h = _hits()
    buf2 = cp.empty(512, np.float32)
    buf2[:256] = x
    cufuse.add_relu(buf2[:256], y, out=buf2[1:257])     # same signature but for alignment: general
    np.testing.assert_array_equal(cp.asnumpy(buf2[1:257]), ref)
    cufuse.add_relu(buf[:256], y, out=buf[256:])         # apart: fast
    assert _hits() == h + 1
    np.testing.assert_array_equal(cp.asnumpy(buf[256:]), ref)
    # layer_norm: out overlapping the weight is not the fast path's (nor silently wrong)
    x2 = cp.asarray(rand((8, 64), np.float32, 5))
    w = cp.asarray(rand((128,), np.float32, 6))
    b = cp.asarray(rand((64,), np.float32, 7))
    ref2 = cp.asnumpy(cufuse.layer_norm(x2, 64, w[:64].copy(), b))
    o = cp.empty((8, 64), np.float32)
    cufuse.layer_norm(x2, 64, w[:64], b, out=o)
    np.testing.assert_allclose(cp.asnumpy(o), ref2, rtol=1e-6, atol=1e-6)
    wo = cp.empty(64 * 9, np.float32)
    wo[:64] = w[:64]
    cufuse.layer_norm(x2, 64, wo[:64], b, out=wo[:512].reshape(8, 64))  # out overlaps the weight
    np.testing.assert_allclose(cp.asnumpy(wo[:512].reshape(8, 64)), ref2, rtol=1e-6, atol=1e-6)


def _errors_after_cached(xp, dev_array):
    """Each bad call matches a kept signature but for its bad argument."""
    x = dev_array(rand(SHAPE, np.float32, 1))
    w = dev_array(rand(SHAPE[-1:], np.float32, 2))
    cufuse.layer_norm(x, SHAPE[-1], w, w, eps=1e-5)
    cufuse.layer_norm(x, SHAPE[-1], w, w, eps=1e-5)
    with pytest.raises(ValueError, match="eps must be finite and >= 0"):
        cufuse.layer_norm(x, SHAPE[-1], w, w, eps=-1.0)
    with pytest.raises(ValueError, match="eps must be finite and >= 0"):
        cufuse.layer_norm(x, SHAPE[-1], w, w, eps=float("nan"))
    with pytest.raises(TypeError, match="normalized_shape must be an int or a tuple of ints"):
        cufuse.layer_norm(x, (True,), w, w)
    with pytest.raises(ValueError, match="must be the trailing dims"):
        cufuse.layer_norm(x, SHAPE[-1] + 1, w, w)
    with pytest.raises(TypeError, match="weight has dtype"):
        cufuse.layer_norm(x, SHAPE[-1], dev_array(rand(SHAPE[-1:], np.float64, 2)), w)
    cufuse.softmax(x, axis=-1)
    cufuse.softmax(x, axis=1)
    with pytest.raises(TypeError, match="axis must be an int"):
        cufuse.softmax(x, axis=True)
    cufuse.sum_squared(x, axis=1, keepdims=True)
    cufuse.sum_squared(x, axis=1, keepdims=True)
    with pytest.raises(TypeError, match="keepdims must be a bool"):
        cufuse.sum_squared(x, axis=1, keepdims=1)
    with pytest.raises(TypeError, match="axis must be an int"):
        cufuse.sum_squared(x, axis=True, keepdims=True)
    with pytest.raises(ValueError, match="out of range"):
        cufuse.sum_squared(x, axis=2, keepdims=True)
    cufuse.gelu_dropout(x, 0.1)
    cufuse.gelu_dropout(x, 0.1)
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\)"):
        cufuse.gelu_dropout(x, 1.5)
    with pytest.raises(ValueError, match=r"at most 1 - 2\*\*-21"):  # the keep rate's steps: a biased scale
        cufuse.gelu_dropout(x, 1 - 1e-8)
    with pytest.raises(TypeError, match="training must be a bool"):
        cufuse.gelu_dropout(x, 0.5, training="no")  # (a truthy string: dropout applied)
    with pytest.raises(TypeError, match="seed must be"):
        cufuse.gelu_dropout(x, 0.5, training=False, seed="junk")  # checked though no mask is drawn
    cufuse.quantize_int8(x, 0.5)
    cufuse.quantize_int8(x, 0.5)
    with pytest.raises(ValueError, match="scale must be finite and > 0"):
        cufuse.quantize_int8(x, -0.5)
    with pytest.raises(ValueError, match="scale must be finite and > 0"):
        cufuse.quantize_int8(x, float("inf"))
    o = cufuse.add_relu(x, x)
    cufuse.add_relu(x, x, out=o)
    cufuse.add_relu(x, x, out=o)
    with pytest.raises(ValueError, match="out has shape"):
        cufuse.add_relu(x, x, out=o[:1])
    with pytest.raises(TypeError, match="out has dtype"):
        cufuse.add_relu(x, x, out=dev_array(np.zeros(SHAPE, np.float64)))
    with pytest.raises(TypeError, match="mixed array kinds"):
        cufuse.add_relu(x, rand(SHAPE, np.float32, 3))
    cufuse.add_relu(x, 2.0)
    cufuse.add_relu(x, 2.0)
    with pytest.raises(TypeError):
        cufuse.add_relu(x, True)
    f = cufuse.fuse(lambda a, b: a * b)
    f(x, 2.0)
    f(x, 2.0)
    with pytest.raises(ValueError, match="do not broadcast"):
        f(x, dev_array(rand((3,), np.float32, 4)))


@pytest.mark.cuda
def test_errors_on_a_kept_signature_cupy():
    import cupy as cp
    _errors_after_cached(cp, cp.asarray)


@pytest.mark.cuda
def test_errors_on_a_kept_signature_torch():
    torch = pytest.importorskip("torch")
    _errors_after_cached(torch, lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda())
    x = torch.from_numpy(rand(SHAPE, np.float32, 1)).cuda()
    with torch.no_grad():
        xg = x.clone().requires_grad_(True)
        cufuse.add_relu(xg, xg)
        cufuse.add_relu(xg, xg)
        cufuse.layer_norm(xg, SHAPE[-1])
        cufuse.layer_norm(xg, SHAPE[-1])
    assert cufuse.add_relu(xg, xg).grad_fn is not None       # differentiable: recorded, not the kept recipe
    assert cufuse.layer_norm(xg, SHAPE[-1]).grad_fn is not None    # recorded too (torch.ops.cufuse)
    assert cufuse.sum_squared(xg).grad_fn is not None
    with pytest.raises(NotImplementedError, match="requires grad"):     # quantize has no autograd
        cufuse.quantize_int8(xg, 0.1)


@pytest.mark.cuda
@pytest.mark.parametrize("family", list(FAMILIES))
def test_fast_path_on_torch_side_stream(family, launches):
    """Under torch.cuda.stream(s), the general and the fast path both launch on s."""
    torch = pytest.importorskip("torch")
    spec, call = FAMILIES[family]
    s = torch.cuda.Stream()
    a = [torch.from_numpy(v).cuda() for v in _np_inputs(spec, np.dtype(np.float32), 1)]
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        r1 = call(*a)
        h = _hits()
        r2 = call(*a)
        assert _hits() == h + 1
    s.synchronize()
    # (a fused function's kernels are generated, not the registry's, so the fixture does not see them)
    assert launches or family.startswith("fuse")
    assert all(ln.stream is not None and ln.stream.ptr == s.cuda_stream for ln in launches)
    np.testing.assert_array_equal(r1.cpu().numpy(), r2.cpu().numpy())


@pytest.mark.cuda
@pytest.mark.parametrize("family", list(FAMILIES))
def test_cupy_stream_graph_capture(family):
    """Under a CuPy stream, calls launch on it: a capture of the fast path
    (out=) on that stream replays on new data (a launch elsewhere would be
    missing from the graph, or fail the capture)."""
    import cupy as cp
    spec, call = FAMILIES[family]
    a = [cp.asarray(v) for v in _np_inputs(spec, np.dtype(np.float32), 1)]
    b = _np_inputs(spec, np.dtype(np.float32), 21)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        out = call(*a) * 0
        call(*a, out=out)
        call(*a, out=out)  # warm: the fast path, its memory pools and column tickets
        s.synchronize()
        s.begin_capture()
        h = _hits()
        call(*a, out=out)
        assert _hits() == h + 1
        g = s.end_capture()
        for dst, src in zip(a, b):
            dst.set(src, stream=s)
        out.fill(7)
        g.launch(stream=s)
        s.synchronize()
    D.clear_fast_paths()
    np.testing.assert_array_equal(cp.asnumpy(out), cp.asnumpy(call(*[cp.asarray(v) for v in b])))


@pytest.mark.cuda
def test_cupy_capture_keeps_the_workspace():
    """A layer_norm whose rows need a workspace (split rows), captured on a
    CuPy stream: the graph keeps the workspace's address, so the memory must
    not go back to the pool. Arrays allocated after the capture stay intact
    through replays, and the replay's result is right."""
    import cupy as cp
    shape = (8, 500001)
    x = cp.asarray(rand(shape, np.float32, 51))
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        out = cufuse.layer_norm(x, shape[-1])
        cufuse.layer_norm(x, shape[-1], out=out)
        cufuse.layer_norm(x, shape[-1], out=out)
        s.synchronize()
        s.begin_capture()
        cufuse.layer_norm(x, shape[-1], out=out)
        g = s.end_capture()
        others = [cp.full(n, 7, np.uint8) for n in (8192, 7984, 4096, 16384) for _ in range(16)]
        x2 = rand(shape, np.float32, 52)
        x.set(x2, stream=s)
        out.fill(0)
        for _ in range(3):
            g.launch(stream=s)
        s.synchronize()
    assert all(bool((o == 7).all()) for o in others)
    np.testing.assert_array_equal(cp.asnumpy(out), cp.asnumpy(cufuse.layer_norm(cp.asarray(x2), shape[-1])))


@pytest.mark.cuda
@pytest.mark.parametrize("family", list(FAMILIES))
def test_torch_graph_capture_on_side_stream(family):
    """torch.cuda.graph on a side stream captures each family's call with
    out=; a replay on new data gives what an eager call gives."""
    torch = pytest.importorskip("torch")
    spec, call = FAMILIES[family]
    a = [torch.from_numpy(v).cuda() for v in _np_inputs(spec, np.dtype(np.float16), 1)]
    b = [torch.from_numpy(v).cuda() for v in _np_inputs(spec, np.dtype(np.float16), 31)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = call(*a) * 0
        call(*a, out=out)
        call(*a, out=out)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        call(*a, out=out)
    for dst, src in zip(a, b):
        dst.copy_(src)
    out.fill_(7)
    g.replay()
    torch.cuda.synchronize()
    D.clear_fast_paths()
    np.testing.assert_array_equal(out.cpu().numpy(), call(*b).cpu().numpy())


# Calls whose capture needs host data on the device or per-stream buffers:
# per-channel parameters given as NumPy arrays, column tickets, foreach tables.
_NP_SCALE = np.linspace(0.02, 0.09, SHAPE[-1]).astype(np.float32)
_FOREACH = {}
CAPTURE_EXTRA = {
    "quantize_np_scale": ("x", lambda x, out=None: cufuse.quantize_int8(x, _NP_SCALE, 1.0, axis=-1, out=out)),
    "sum_squared_axis0": ("x", lambda x, out=None: cufuse.sum_squared(x, axis=0, out=out)),
    "foreach": ("xx", lambda a, b, out=None: _foreach_call(a, b, out)),
}


def _foreach_call(a, b, out):
    f = _FOREACH.setdefault("f", cufuse.fuse(lambda p, q, s: p * s + q))
    halves = [a[: SHAPE[0] // 2], a[SHAPE[0] // 2:]], [b[: SHAPE[0] // 2], b[SHAPE[0] // 2:]]
    if out is None:
        return _cat(f.foreach(*halves, 0.75))
    f.foreach(*halves, 0.75, out=[out[: SHAPE[0] // 2], out[SHAPE[0] // 2:]])
    return out


def _cat(parts):
    import sys
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    import cupy as cp
    return cp.concatenate(parts)


@pytest.mark.cuda
@pytest.mark.parametrize("family", list(FAMILIES) + list(CAPTURE_EXTRA))
def test_torch_graph_warm_up_elsewhere_then_capture(family):
    """As torch's documentation does it: warm up on a side stream, then
    capture with torch.cuda.graph on its own capture stream (never used
    before). cufuse's caches are emptied between capture and replay; every
    replay on fresh inputs gives what an eager call gives, and eager calls on
    the capture stream afterwards are right too."""
    torch = pytest.importorskip("torch")
    spec, call = {**FAMILIES, **CAPTURE_EXTRA}[family]
    _FOREACH.clear()
    a = [torch.from_numpy(v).cuda() for v in _np_inputs(spec, np.dtype(np.float32), 1)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = call(*a) * 0
        for _ in range(2):
            call(*a, out=out)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    ctx = torch.cuda.graph(g)                             # its own capture stream
    with ctx:
        call(*a, out=out)
    D.clear_fast_paths()
    D._UPLOADS.clear()
    D._stream_buffers.clear()
    for seed in range(31, 36):
        b = _np_inputs(spec, np.dtype(np.float32), seed)
        for dst, src in zip(a, b):
            dst.copy_(torch.from_numpy(src))
        out.fill_(7)
        g.replay()
        torch.cuda.synchronize()
        want = call(*[torch.from_numpy(v).cuda() for v in b]).cpu().numpy()
        np.testing.assert_array_equal(out.cpu().numpy(), want, err_msg=f"replay {seed}")
    with torch.cuda.stream(ctx.capture_stream):
        again = call(*a).cpu().numpy()                   # eager on the capture stream, after the capture
    np.testing.assert_array_equal(again, out.cpu().numpy())


@pytest.mark.cuda
def test_capture_without_warm_up_says_so():
    """A call that needs host data copied to the GPU, made for the first time
    inside a capture, raises a clear RuntimeError (before it queues anything)."""
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(rand(SHAPE, np.float32, 3)).cuda()
    out = torch.empty(SHAPE, dtype=torch.int8, device="cuda")
    fresh = np.linspace(0.03, 0.05, SHAPE[-1]).astype(np.float32) + np.float32(np.random.default_rng().random())
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="cannot happen while a CUDA graph is being captured.*warm-up"):
        with torch.cuda.graph(g):
            cufuse.quantize_int8(x, fresh, axis=-1, out=out)
    torch.cuda.synchronize()
    q = cufuse.quantize_int8(x, fresh, axis=-1)           # and eager afterwards works
    ref = cufuse.quantize_int8(x.cpu(), fresh, axis=-1)    # the NumPy path: the same codes, bit for bit
    np.testing.assert_array_equal(q.cpu().numpy(), ref.numpy())


@pytest.mark.cuda
@pytest.mark.parametrize("family", list(FAMILIES))
def test_arrays_on_another_gpu_than_the_current(family):
    """Arrays on GPU 1 while GPU 0 is current: the general and the fast path
    both launch on GPU 1 (and leave GPU 0 current), giving what a call made
    with GPU 1 current gives."""
    from _reference import gpu_count
    if gpu_count() < 2:
        pytest.skip("needs 2 GPUs")
    import cupy as cp
    torch = pytest.importorskip("torch")
    spec, call = FAMILIES[family]
    # (the per-channel case computes its scale with CuPy, which takes arrays of the current GPU only)
    for lib in ("torch",) if family == "quantize_int8_axis" else ("cupy", "torch"):
        def on1(a):
            if lib == "torch":
                return torch.from_numpy(np.ascontiguousarray(a)).to("cuda:1")
            with cp.cuda.Device(1):
                return cp.asarray(a)

        def host(r):
            return r.cpu().numpy() if lib == "torch" else cp.asnumpy(r)

        a = [on1(v) for v in _np_inputs(spec, np.dtype(np.float32), 1)]
        b = [on1(v) for v in _np_inputs(spec, np.dtype(np.float32), 41)]
        D.clear_fast_paths()
        with cp.cuda.Device(1):
            want = host(call(*b))
        D.clear_fast_paths()
        assert cp.cuda.runtime.getDevice() == 0
        call(*a)
        h = _hits()
        got = call(*b)
        assert _hits() == h + 1 and cp.cuda.runtime.getDevice() == 0
        assert (got.get_device() if lib == "torch" else got.data.device_id) == 1
        np.testing.assert_array_equal(host(got), want)


# ops without out= (rope, the residual-add norms, scatter_add): name -> (inputs (NumPy) by seed, call)
def _rope_inputs(seed):
    ang = np.random.default_rng(seed).uniform(0, 6, (2, 9, 8)).astype(np.float32)
    return [rand((2, 4, 9, 16), np.float32, seed), rand((2, 2, 9, 16), np.float32, seed + 1),
            np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))]


NO_OUT = {
    "rope": (_rope_inputs, lambda q, k, c, s: cufuse.rope(q, k, c, s)),
    "add_rms_norm": (lambda seed: [rand(SHAPE, np.float32, seed), rand(SHAPE, np.float32, seed + 1),
                                   rand(SHAPE[-1:], np.float32, seed + 2)],
                     lambda x, r, w: cufuse.add_rms_norm(x, r, x.shape[-1], w)),
    "scatter_add": (lambda seed: [rand(SHAPE, np.float32, seed),
                                  np.random.default_rng(seed).integers(0, 10, SHAPE[0]).astype(np.int64)],
                    lambda v, i: cufuse.scatter_add(v, i, 10, activation="silu")),
    "attention": (lambda seed: [rand((2, 4, 40, 64), np.float16, seed), rand((2, 2, 40, 64), np.float16, seed + 1),
                                rand((2, 2, 40, 64), np.float16, seed + 2)],
                  lambda q, k, v: cufuse.attention(q, k, v, causal=True)),
    "attention_score": (lambda seed: [rand((2, 4, 40, 64), np.float16, seed), rand((2, 2, 50, 64), np.float16, seed + 1)],
                        lambda q, k: cufuse.attention_score(q, k)),
    # the dense path (float32) and a mask cast to q's dtype, on the arrays' GPU
    "attention_dense": (lambda seed: [rand((2, 4, 40, 64), np.float32, seed), rand((2, 2, 40, 64), np.float32, seed + 1),
                                      rand((2, 2, 40, 64), np.float32, seed + 2)],
                        lambda q, k, v: cufuse.attention(q, k, v, causal=True)),
    "attention_score_mask": (lambda seed: [rand((2, 4, 40, 64), np.float16, seed), rand((40, 50), np.float32, seed + 1),
                                           rand((2, 2, 50, 64), np.float16, seed + 2)],
                             lambda q, m, k: cufuse.attention_score(q, k, mask=m)),
}


@pytest.mark.cuda
@pytest.mark.parametrize("op", list(NO_OUT))
@pytest.mark.parametrize("lib", ["cupy", "torch"])
def test_ops_without_out_on_another_gpu_than_the_current(op, lib):
    """As test_arrays_on_another_gpu_than_the_current for the ops without
    out=: arrays on GPU 1 while GPU 0 is current give results on GPU 1 equal
    to a call made with GPU 1 current, and leave GPU 0 current."""
    from _reference import gpu_count
    if gpu_count() < 2:
        pytest.skip("needs 2 GPUs")
    import cupy as cp
    torch = pytest.importorskip("torch")
    make, call = NO_OUT[op]

    def on1(a):
        if lib == "torch":
            return torch.from_numpy(np.ascontiguousarray(a)).to("cuda:1")
        with cp.cuda.Device(1):
            return cp.asarray(a)

    def results(r):
        return [v for v in (r if isinstance(r, tuple) else (r,)) if v is not None]
    a, b = [on1(v) for v in make(1)], [on1(v) for v in make(41)]
    with cp.cuda.Device(1):
        want = [cp.asnumpy(v) if lib == "cupy" else v.cpu().numpy() for v in results(call(*b))]
    assert cp.cuda.runtime.getDevice() == 0
    call(*a)
    got = results(call(*b))
    assert cp.cuda.runtime.getDevice() == 0
    for g, w in zip(got, want):
        assert (g.get_device() if lib == "torch" else g.data.device_id) == 1
        np.testing.assert_allclose(g.cpu().numpy() if lib == "torch" else cp.asnumpy(g), w, rtol=1e-6, atol=1e-6)


@pytest.mark.cuda
def test_rope_tables_on_another_gpu_are_refused():
    from _reference import gpu_count
    if gpu_count() < 2:
        pytest.skip("needs 2 GPUs")
    torch = pytest.importorskip("torch")
    q, k, c, s = (torch.from_numpy(v) for v in _rope_inputs(3))
    with pytest.raises(ValueError, match="cos is on GPU 1, q on GPU 0"):
        cufuse.rope(q.cuda(0), k.cuda(0), c.cuda(1), s.cuda(0))


# ---------------------------------------------------------------- CPU only
def test_recipe_arguments_from_slots_and_constants():
    """A recipe's launch takes its constants and this call's slot values in
    the order written, whatever the number of values given."""
    calls = []

    class Fn:
        ptr = 0

        def __call__(self, grid, block, args, shared=0, stream=None):
            calls.append((grid, block, args, shared))

    b = D.RecipeBuilder("cupy.ndarray", 0, 1, 2)
    t = b.temp(64, zeroed=0)
    b.launch(Fn(), (3,), (256,), (D.out_(0), 5, D.in_(1), D.val(1), 7.5, t, D.in_(0), D.val(0)))
    rec = b.build([D.Output((4,), np.dtype(np.float32))], [(0, 16)], [(0, 16), (0, 16)])
    step = rec.steps[0]
    vals = (100, 200, 300, 400, 0.25, 0.5)  # out, in 0, in 1, temp 0, value 0, value 1
    assert step.get(step.consts + vals) == (100, 5, 300, 0.5, 7.5, 400, 200, 0.25)
    b2 = D.RecipeBuilder("cupy.ndarray", 0, 1, 1)
    b2.launch(Fn(), (1,), (32,), (D.out_(0),))
    s2 = b2.build([D.Output((4,), np.dtype(np.float32))], [(0, 16)], [(0, 16)]).steps[0]
    assert s2.get(s2.consts + (9, 8)) == (9,)


def test_temps_are_whole_16_byte_packs():
    """A temporary is allocated rounded up to 16 bytes (row kernels read whole
    packs); a memset of all its bytes covers the rounding too, a partial one
    only what it asked for."""
    b = D.RecipeBuilder("cupy.ndarray", 0, 1, 1)
    b.temp(44)
    b.temp(40, zeroed=40)
    b.temp(72, zeroed=16)
    b.temp(32, zeroed=32)
    assert b.temps == [48, 48, 80, 32]
    assert [st[2] for st in b.steps] == [48, 16, 32]


def test_packed_arguments_as_cupy_passes_them():
    """The driver-level launch packs each argument as CuPy would: Python int
    as int64, float as double, NumPy scalars as their dtype, records as their
    bytes; each at its own 16-byte aligned address in kernelParams."""
    class Fn:
        ptr = 1234

    lay = D.layout(4, [5, 7], [[1, 5], None, [0, 1]], 1)[()]
    b = D.RecipeBuilder("cupy.ndarray", 0, 1, 1)
    b.launch(Fn(), (3, 2), (128,), (D.out_(0), D.in_(0), -7, 2.5, np.int32(-3), np.float32(0.25), lay, D.val(0),
                                     np.uint64(2**63 + 5)))
    st = b.build([D.Output((4,), np.dtype(np.float32))], [(0, 16)], [(0, 16)]).steps[0]
    vals = (0x7F0000001000, 0x7F0000002000, 2**62 + 1)
    args = st.get(st.consts + vals)
    p = D.Packed(st, args)
    p.struct.pack_into(p.buf, 0, *st.get(p.consts + vals))
    base = p.buf.ctypes.data
    offs = [int(a) - base for a in p.params]
    assert all(o % 16 == 0 for o in offs) and len(offs) == len(args)
    raw = p.buf.tobytes()

    def at(k, fmt):
        import struct
        return struct.unpack_from("<" + fmt, raw, offs[k])[0]

    assert at(0, "q") == vals[0] and at(1, "q") == vals[1] and at(2, "q") == -7 and at(3, "d") == 2.5
    assert at(4, "i") == -3 and at(5, "f") == 0.25 and at(7, "q") == 2**62 + 1 and at(8, "Q") == 2**63 + 5
    assert raw[offs[6]:offs[6] + lay.dtype.itemsize] == lay.tobytes()
    assert p.dims == (3, 2, 1, 128, 1, 1, 0) and p.fptr == 1234


def test_apart_rule():
    """An output may be an allowed input's very view (same address) or share
    no byte with any input; anything else is refused."""
    rec = D.Recipe("cupy.ndarray", 0, (), (), (), 1, 2, ((0, 64),), ((0, 64), (0, 16)), ((0,),))
    assert D.apart(rec, [1000], [1000, 5000])          # in place on input 0
    assert not D.apart(rec, [1000], [1004, 5000])      # shifted by one element
    assert not D.apart(rec, [1000], [5000, 1000])      # input 1 may not be the output's view
    assert not D.apart(rec, [1000], [5000, 1060])      # overlaps input 1's last bytes
    assert D.apart(rec, [1000], [5000, 1064])
    two = D.Recipe("cupy.ndarray", 0, (), (), (), 2, 1, ((0, 64), (0, 64)), ((0, 64),), ((), ()))
    assert D.apart(two, [1000, 2000], [3000])
    assert not D.apart(two, [1000, 1032], [3000])     # the outputs overlap each other


def test_signature_takes_scalars_and_rejects_others():
    """NumPy arrays and unknown objects have no fast path; scalars' types are part of the key."""
    assert D.signature((np.zeros(3), 1.0)) is None
    assert D.signature((object(),)) is None
    assert D.signature(([1, 2],)) is None
    k1, p1 = D.signature((1.0, None, np.float32(2)))
    k2, _ = D.signature((1, None, np.float32(2)))
    assert p1 == [] and k1 != k2


def test_fallback_relu_speed_path_keeps_nan():
    """The NumPy fallback's relu (np.maximum) keeps NaN, as the kernels do."""
    x = np.array([np.nan, -1.0, 2.0], np.float32)
    got = cufuse.add_relu(x, np.float32(0))
    assert np.isnan(got[0]) and got[1] == 0 and got[2] == 2


@pytest.mark.parametrize("lib", ["numpy", pytest.param("cupy", marks=pytest.mark.cuda),
                                 pytest.param("torch", marks=pytest.mark.cuda)])
def test_eight_threads_every_family(lib):
    """8 threads at once call every family (fast and general paths, out=
    included) and each traces fused functions of its own: every result equals
    the one-thread result, and no call fails."""
    if lib == "numpy":
        conv, back = np.asarray, np.asarray
    elif lib == "cupy":
        import cupy as cp
        conv, back = cp.asarray, cp.asnumpy
    else:
        torch = pytest.importorskip("torch")
        conv, back = (lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()), (lambda t: t.cpu().numpy())
    names = list(FAMILIES) + list(CAPTURE_EXTRA)
    calls = {**FAMILIES, **CAPTURE_EXTRA}
    inputs = {n: [conv(v) for v in _np_inputs(calls[n][0], np.dtype(np.float32), 3)] for n in names}
    want = {n: back(calls[n][1](*inputs[n])) for n in names}

    def work(t):
        own = cufuse.fuse(lambda a, b: a * b + float(t))      # traced in this thread
        x = inputs["add_relu"][0]
        for rep in range(4):
            for n in names:
                got = calls[n][1](*inputs[n])
                np.testing.assert_array_equal(back(got), want[n], err_msg=f"thread {t}, {n}, round {rep}")
                out = got * 0 if lib != "numpy" else np.zeros_like(got)
                calls[n][1](*inputs[n], out=out)
                np.testing.assert_array_equal(back(out), want[n], err_msg=f"thread {t}, {n} out=, round {rep}")
            r = back(own(x, x))
            np.testing.assert_allclose(r, back(x).astype(np.float64) ** 2 + t, rtol=1e-6)

    _in_threads(8, work)


def _in_threads(n, work):
    """work(t) in n threads at once (started together at a barrier); no thread may raise."""
    import threading
    errors, barrier = [], threading.Barrier(n)

    def run(t):
        try:
            barrier.wait()
            work(t)
        except Exception as e:  # noqa: BLE001 - reported below with its thread
            errors.append(f"thread {t}: {type(e).__name__}: {str(e)[:400]}")

    threads = [threading.Thread(target=run, args=(t,)) for t in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(300)
    assert not errors, "\n".join(errors[:5])


@pytest.mark.cuda
def test_threads_share_a_streams_buffer():
    """Two threads on one stream (CuPy's default) queue, round after round, the launches that use the
    stream's zeroed buffer: split and pipe norm rows (their workspace, re-zeroed by the rescue launch)
    against column sums (their tickets). Each recipe is queued whole under the lock, so every result
    equals the one-thread result."""
    import cupy as cp
    rng = np.random.default_rng(47)
    split = cp.asarray(rng.standard_normal((8, 300001)).astype(np.float32))  # odd rows: norm_rows_split
    pipe = cp.asarray(rng.standard_normal((8, 262144)).astype(np.float16))   # whole packs: norm_rows_pipe
    cols = cp.asarray(rng.standard_normal((256, 2048)).astype(np.float32))   # a few chunks: the tickets
    calls = [lambda: cufuse.layer_norm(split, 300001), lambda: cufuse.rms_norm(pipe, 262144),
             lambda: cufuse.softmax(split), lambda: cufuse.sum_squared(cols, axis=0),
             lambda: cufuse.mean_abs(cols, axis=0)]
    want = []
    for k, c in enumerate(calls):  # each call uses the stream's buffer (else the test would test nothing)
        D._stream_buffers.clear()
        want.append(cp.asnumpy(c()))
        assert list(D._stream_buffers) == [(0, cp.cuda.get_current_stream().ptr)], f"call {k}"

    def work(t):
        order = range(len(calls)) if t == 0 else range(len(calls) - 1, -1, -1)  # the other order in thread 1
        for rep in range(30):
            got = [(k, calls[k]()) for k in order]
            for k, g in got:
                np.testing.assert_array_equal(cp.asnumpy(g), want[k], err_msg=f"thread {t}, call {k}, round {rep}")

    _in_threads(2, work)


# ------------------------------------------- uploads kept by content (issue 37)
class _FakeStream:
    """A stream whose queued work is a count; ``finish`` completes it."""

    def __init__(self, ptr):
        self.ptr, self.queued, self.finished, self.capturing = ptr, 0, 0, False

    def is_capturing(self):
        return self.capturing

    def synchronize(self):
        self.finished = self.queued

    def finish(self):
        self.finished = self.queued

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _FakeEvent:
    def __init__(self, block=False, disable_timing=False):
        self.stream, self.mark = None, 0

    def record(self, stream):
        self.stream, self.mark = stream, stream.queued

    @property
    def done(self):
        return self.stream.finished >= self.mark


@pytest.fixture
def fake_uploads(monkeypatch):
    """``uploaded`` on a fake CuPy (NumPy copies, fake streams and events) and
    an empty cache of 4 entries."""
    import contextlib
    import types
    cuda = types.SimpleNamespace(Device=lambda dev: contextlib.nullcontext(), Event=_FakeEvent,
                                 Stream=lambda non_blocking=False: _FakeStream(-1),
                                 runtime=types.SimpleNamespace(CUDARuntimeError=RuntimeError))
    monkeypatch.setattr(D, "_cp", types.SimpleNamespace(cuda=cuda, asarray=lambda h: h.copy()))
    for name, v in (("_UPLOADS", {}), ("_RETIRING", []), ("_upload_streams", {}), ("_CAPTURED_TEMPS", []),
                    ("_UPLOADS_MAX", 4)):
        monkeypatch.setattr(D, name, v)


def _up(k, s):
    return D.uploaded(np.full(3, k, np.int64), "cupy", 0, "test data", stream=s)


def test_uploads_evict_least_recently_used(fake_uploads):
    """A full cache evicts its least recently used entries, not every entry;
    a hit returns the same array and counts as a use."""
    s = _FakeStream(1)
    first = [_up(k, s) for k in range(4)]
    assert _up(0, s) is first[0]                      # a hit: 1 is now the least recently used
    _up(4, s)
    assert sorted(int(np.frombuffer(k[3], np.int64)[0]) for k in D._UPLOADS) == [0, 2, 3, 4]
    assert _up(0, s) is first[0] and _up(3, s) is first[3]
    assert [a for a, _ in D._RETIRING] == [first[1]]


def test_evicted_upload_held_until_its_streams_are_done(fake_uploads):
    """An evicted copy stays referenced (not back to the pool) until the work
    queued, up to its eviction, on every stream it was returned for is done;
    only then is it dropped, on a later copy, without waiting."""
    import weakref
    s1, s2, s3 = _FakeStream(1), _FakeStream(2), _FakeStream(3)
    a = weakref.ref(_up(0, s1))
    s1.queued += 1                                    # a kernel reading it, queued on s1
    assert _up(0, s2) is a()                          # a hit on s2, which queues a kernel too
    s2.queued += 1
    for k in range(1, 5):                             # on another stream: evicts 0 at k == 4
        _up(k, s3)
    s1.queued += 1                                    # queued after the eviction: not waited for
    assert len(D._RETIRING) == 1 and D._RETIRING[0][0] is a()
    assert sorted(ev.stream.ptr for ev in D._RETIRING[0][1]) == [1, 2]
    s2.finish()
    _up(5, s3)                                        # s1 still busy: kept
    assert a() is not None
    s1.finished = 1                                   # done up to the eviction (its later kernel is not)
    s3.finish()
    _up(6, s3)
    assert a() is None                                # dropped: its block may go back to the pool
    assert all(arr is not None for arr, _ in D._RETIRING)


def test_held_copy_waits_for_its_holders_launches(fake_uploads):
    """A copy that an object keeps and launches later (a foreach plan, an
    image launcher: D.Held), once the holder is dropped, stays referenced
    until the work queued by then on every stream it launched on is done,
    also when the cache evicted and dropped its own reference before."""
    import gc
    import weakref
    s1, s2, s3 = _FakeStream(1), _FakeStream(2), _FakeStream(3)
    held = D.Held(0, _up(0, s1))
    a = weakref.ref(held.arrs[0])
    held.on(s2)                                       # the holder's launch on s2, queued
    s2.queued += 1
    for k in range(1, 6):                             # 0 evicted at k == 4 (s1 idle), dropped at 5
        _up(k, s3)
    assert all(arr is not a() for arr, _ in D._RETIRING)
    del held
    gc.collect()
    assert a() is not None                            # s2's launch may still read it
    s2.finish()
    s3.finish()
    _up(6, s3)
    assert a() is None
    c = _FakeStream(4)                                # a launch captured into a graph: kept for good
    c.capturing = True
    held = D.Held(0, _up(7, s3))
    held.on(c)
    assert D._CAPTURED_TEMPS == [held.arrs[0]]
    streams = [_FakeStream(10 + k) for k in range(D._UPLOAD_USERS_MAX + 1)]  # a stream per launch
    held = D.Held(0, _up(8, s3))
    for st in streams:
        held.on(st)
        st.queued += 1
    assert len(held.streams) == 1                     # the first 8 swapped for events
    del held
    gc.collect()
    assert sorted(ev.stream.ptr for ev in D._RETIRING[-1][1]) == [st.ptr for st in streams]


def test_upload_default_stream_and_capture(fake_uploads, monkeypatch):
    """No stream given: the call's stream (current_stream) is the one noted.
    Inside a capture a hit is kept for good and a miss raises before copying;
    an entry evicted while a stream it was returned for is being captured is
    kept for good (no event can tell when that stream's earlier work is done)."""
    s, c = _FakeStream(7), _FakeStream(8)
    monkeypatch.setattr(D, "current_stream", lambda kind, dev: s)
    first = D.uploaded(np.full(3, 9, np.int64), "cupy", 0, "test data")
    assert _streams(list(D._UPLOADS.values())[0]) == {7: s}
    c.capturing = True
    assert _up(9, c) is first and D._CAPTURED_TEMPS == [first]
    with pytest.raises(RuntimeError, match="test data must be copied"):
        _up(10, c)
    assert len(D._UPLOADS) == 1
    c.capturing = False
    _up(9, c)                                         # c notes the entry, then captures again
    c.capturing = True
    for k in range(4):
        _up(k, s)
    assert all(e.arr is not first for e in D._UPLOADS.values())
    assert not D._RETIRING and D._CAPTURED_TEMPS[-1] is first


def _streams(e):
    """{handle: stream} an upload entry notes."""
    return {p: st for p, (st, _) in e.users.items()}


def test_upload_entry_streams_bounded(fake_uploads, monkeypatch):
    """Streams made per call (one entry, many streams) do not pile up: past
    _UPLOAD_USERS_MAX, those not noted in the last _UPLOAD_STALE calls give
    way to events recorded on them (a stream used all along stays noted), and
    events done are dropped."""
    monkeypatch.setattr(D, "_UPLOAD_STALE", 4)
    held = _FakeStream(99)
    held.queued = 1
    n = 3 * D._UPLOAD_USERS_MAX
    for k in range(n):
        _up(0, held)
        st = _FakeStream(100 + k)
        st.queued = 1                                 # its caller's kernel, queued after the call
        _up(0, st)
        del st
    e = next(iter(D._UPLOADS.values()))
    assert held in _streams(e).values() and len(e.users) <= D._UPLOAD_USERS_MAX
    assert {ev.stream.ptr for ev in e.events} | set(e.users) == {99, *range(100, 100 + n)}  # each covered
    assert not any(ev.done for ev in e.events)
    for ev in e.events:
        ev.stream.finish()
    for k in range(D._UPLOAD_USERS_MAX + 8):
        _up(0, _FakeStream(200 + k))
    assert len(e.events) <= D._UPLOAD_USERS_MAX + 8   # the next prunings dropped the events done
    for st in [ev.stream for ev in e.events] + list(_streams(e).values()):
        st.finish()
    for k in range(1, 6):
        _up(k, held)                                  # evicts 0, then drops it: all its work is done
    assert all(arr is not e.arr for arr, _ in D._RETIRING)


def test_upload_evicted_under_a_hit_is_cached_again(fake_uploads):
    """A hit in another thread that looked an entry up just before its
    eviction (and so may launch after the eviction's events) sees it evicted
    and caches it again, its stream noted for the next eviction."""
    s, t = _FakeStream(1), _FakeStream(2)
    _up(0, s)
    key, e = next(iter(D._UPLOADS.items()))
    for k in range(1, 4):
        _up(k, s)
    with D._uploads_lock:
        D._evict()                                    # 0, the least recently used
    assert e.evicted and key not in D._UPLOADS and D._RETIRING[0][0] is e.arr
    with D._uploads_lock:
        assert D._use(key, e, t, 99) is e             # what the hit does on seeing ``evicted``
    assert D._UPLOADS[key] is e and _streams(e) == {2: t} and not e.evicted


_WAIT_FLAG = r"""
extern "C" __global__ void wait_flag(const volatile int* flag, long long max_cycles, int* timed_out) {
    long long t0 = clock64();
    while (*flag == 0) {
        if (clock64() - t0 > max_cycles) { *timed_out = 1; return; }
    }
}
"""


@pytest.mark.cuda
def test_evicted_upload_outlives_queued_kernel():
    """Issue 37: a per-channel quantize_int8 (NumPy scale, so its scale comes
    from the upload cache) queued on a stream behind a kernel that waits for
    the host, then 300 uploads of other contents: the cache evicts that scale
    while the queued kernel has not read it yet. The result must still be the
    one of that scale. The uploads take their memory from a LIFO allocator (a
    freed block is the next one handed out), so memory released too early is
    overwritten for sure: before the fix, the cache cleared itself at 128
    entries and the scale's block held another upload's numbers by the time
    the kernel ran."""
    import ctypes
    import cupy as cp
    from cufuse import _arrays as A
    dev = cp.cuda.Device().id
    C = 256
    x = cp.asarray(rand((64, C), np.float32, 61)) * 4
    scale0 = np.linspace(0.04, 0.06, C, dtype=np.float32)
    others = [np.full(C, 1000 + k, np.float32) for k in range(300)]
    cufuse.quantize_int8(x, scale0 * 2, axis=-1)      # warm: kernel compiled, zero point and upload stream
    cp.cuda.Device().synchronize()
    D._UPLOADS.clear()                                 # (nothing queued: safe)

    slab, free = cp.empty(4 << 20, np.uint8), []       # the LIFO allocator's memory, made before the wait
    bump = [slab.data.ptr]

    class _Block:
        def __init__(self, ptr):
            self.ptr, self.slab = ptr, slab           # the slab lives as long as its blocks

        def __del__(self):
            free.append(self.ptr)

    def lifo_malloc(size):
        assert size <= 4096, size
        if free:
            ptr = free.pop()
        else:
            ptr, bump[0] = bump[0], bump[0] + 4096
            assert bump[0] <= slab.data.ptr + slab.nbytes, "LIFO allocator exhausted"
        return cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(ptr, size, _Block(ptr), dev), 0)

    with cp.cuda.using_allocator(lifo_malloc):
        D.uploaded(scale0, A.CUPY, dev, "the test's scale")
    wait = cp.RawKernel(_WAIT_FLAG, "wait_flag")
    timed_out = cp.zeros(1, np.int32)
    flag = cp.cuda.runtime.hostAlloc(4, cp.cuda.runtime.hostAllocMapped)  # mapped: the kernel reads it
    ctypes.c_int.from_address(flag).value = 0
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        cp.empty(x.shape, np.int8)                     # the result's block, kept for s: no cudaMalloc below
    cp.cuda.Device().synchronize()                     # timed_out zeroed, everything above done
    try:
        with s:
            wait((1,), (1,), (np.uint64(flag), np.int64(20 * 2_000_000_000), timed_out))  # at most ~20 s
            got = cufuse.quantize_int8(x, scale0, axis=-1)                      # queued behind it
        with cp.cuda.using_allocator(lifo_malloc):
            for o in others:
                D.uploaded(o, A.CUPY, dev, "the test's other data")
        assert not s.done, "the waiting kernel ended before the uploads"
    finally:
        ctypes.c_int.from_address(flag).value = 1
        s.synchronize()
        cp.cuda.runtime.freeHost(flag)
    assert int(timed_out[0]) == 0, "the waiting kernel timed out (something waited for it)"
    cp.cuda.Device().synchronize()
    D._UPLOADS.clear()                                 # (nothing queued: safe)
    want = cufuse.quantize_int8(x, scale0, axis=-1)
    np.testing.assert_array_equal(cp.asnumpy(got), cp.asnumpy(want))
    assert int(cp.count_nonzero(want)) > want.size // 2


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "int8", "uint8"])
def test_torch_outputs_from_templates_are_new_c_order_tensors(dtype):
    """torch_empty's template (one element of the device's base viewed as the
    shape): empty_like of it is a new tensor with torch.empty's shape,
    strides, dtype and device, never the template's memory; a shape whose
    layout could differ (zero-size ones) has none and takes torch.empty."""
    torch = pytest.importorskip("torch")
    T, cpu, dt = D.torch_api(), torch.device("cpu"), getattr(torch, dtype)
    for shape in [(), (1,), (5,), (1, 5), (7, 1), (4, 1, 768), (1, 1, 3), (2, 3, 4, 5), (1, 1), (0,), (3, 0, 2),
                  (2, 1, 1, 5), (8, 4, 1, 1)]:
        t = D._template(T, shape, dt, cpu)
        ref = torch.empty(shape, dtype=dt)
        if t is False:
            assert ref.numel() == 0, shape
            continue
        a, b = T.empty_like(t), T.empty_like(t)
        assert (a.shape, a.stride(), a.dtype, a.device) == (ref.shape, ref.stride(), dt, cpu), shape
        if ref.numel():
            assert len({a.data_ptr(), b.data_ptr(), t.data_ptr()}) == 3, shape
    assert D._template(T, (-1,), dt, cpu) is False


def test_no_template_is_made_during_a_graph_capture(monkeypatch):
    """A GPU's templates view a base of CuPy memory (outside torch's pools),
    made when torch's stream there is not capturing a CUDA graph: while it
    is, _template makes nothing (None: asked again later) and keeps nothing."""
    torch = pytest.importorskip("torch")

    class CudaDevice:  # what _base reads of a device: its type
        type = "cuda"
    dev = CudaDevice()
    monkeypatch.setattr(D, "_torch_capturing", lambda tdev: True)
    assert D._template(D.torch_api(), (3, 4), torch.float32, dev) is None
    assert dev not in D._BASES


@pytest.mark.cuda
def test_reduce_overhead_compile_matches_eager_on_new_data():
    """torch.compile(mode="reduce-overhead") over cufuse ops: CUDA graph trees
    warm up and capture with their own memory pool and check it for tensors
    they do not know of (a cached template or buffer made from it would trip
    that). Results made like the input (layer_norm, add_relu, softmax) and
    not (sum_squared's rows); each call on new data gives eager's results."""
    torch = pytest.importorskip("torch")

    def f(x, w, b):
        y = cufuse.layer_norm(x, 64, w, b)
        return cufuse.add_relu(y, x), cufuse.sum_squared(y), cufuse.softmax(y)

    gen = torch.Generator(device="cuda").manual_seed(3)
    w = torch.randn(64, device="cuda", generator=gen)
    b = torch.randn(64, device="cuda", generator=gen)
    compiled = torch.compile(f, mode="reduce-overhead", fullgraph=True)
    for _ in range(4):  # warm-up, recording, then replays
        x = torch.randn(24, 64, device="cuda", generator=gen)
        got = [t.clone() for t in compiled(x, w, b)]  # (a replay's outputs are overwritten by the next)
        for g, e in zip(got, f(x, w, b)):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
