"""Dask arrays (cufuse/_dask.py): each op family on Dask arrays of NumPy
chunks (and CuPy chunks on a GPU; chunks on two GPUs where there are two)
gives what the same call on the whole array gives; rows split over chunks,
out=, dropout and mixed kinds are clear errors."""
from __future__ import annotations

import numpy as np
import pytest

da = pytest.importorskip("dask.array")

import cufuse  # noqa: E402

from _reference import gpu_count, rand  # noqa: E402

F16, F32, F64 = (np.dtype(t) for t in (np.float16, np.float32, np.float64))
LIBS = ["numpy", pytest.param("cupy", marks=pytest.mark.cuda)]
TOL = {F16: (2e-3, 2e-3), F32: (1e-5, 1e-6), F64: (1e-12, 1e-14)}


def _lib(name):
    if name == "numpy":
        return np.asarray, np.asarray
    import cupy as cp
    return cp.asarray, cp.asnumpy


def _same(got, want, dt):
    """A Dask result against the whole-array result."""
    assert isinstance(got, da.Array), type(got)
    g = got.compute()
    assert g.dtype == want.dtype and g.shape == want.shape, (g.dtype, g.shape, want.dtype, want.shape)
    rtol, atol = TOL[np.dtype(dt)]
    np.testing.assert_allclose(np.asarray(_host(g), np.float64), np.asarray(_host(want), np.float64), rtol=rtol,
                               atol=atol)


def _host(a):
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("dt", [F16, F32, F64], ids=lambda d: d.name)
def test_every_family_chunk_by_chunk(lib, dt):
    conv, _ = _lib(lib)
    x = conv(rand((10, 12), dt, 1))
    y = conv(rand((12,), dt, 2))
    dx = da.from_array(x, chunks=(3, 12), asarray=False)          # uneven chunks: 3, 3, 3, 1
    dy = da.from_array(y, chunks=(5,), asarray=False)
    dcols = da.from_array(x, chunks=(4, 5), asarray=False)
    cases = [
        (lambda v, w: cufuse.add_relu(v, w), (dx, dy), (x, y)),
        (lambda v, w: cufuse.fma(v, 0.5, w), (dx, dy), (x, y)),
        (lambda v, w: cufuse.bias_gelu(v, w), (dx, dy), (x, y)),
        (lambda v: cufuse.mul_tanh(v, 2.0), (dcols,), (x,)),
        (lambda v: cufuse.layer_norm(v, 12, y, y), (dx,), (x,)),
        (lambda v: cufuse.rms_norm(v, (12,)), (dx,), (x,)),
        (lambda v: cufuse.softmax(v, axis=0), (da.from_array(x, chunks=(10, 5), asarray=False),), (x,)),
        (lambda v: cufuse.log_softmax(v), (dx,), (x,)),
        (lambda v: cufuse.sum_squared(v, axis=None), (dcols,), (x,)),
        (lambda v: cufuse.sum_squared(v, axis=0, keepdims=True), (dcols,), (x,)),
        (lambda v: cufuse.mean_abs(v, axis=(0, 1)), (dcols,), (x,)),
        (lambda v: cufuse.mean_abs(v, axis=-1, dtype=np.float64), (dcols,), (x,)),
        (lambda v: cufuse.quantize_int8(v, 0.05, 1.0), (dcols,), (x,)),
        (lambda v: cufuse.quantize_int8(v, np.linspace(0.02, 0.1, 12), axis=1), (dcols,), (x,)),
        (lambda v: cufuse.dequantize_int8(cufuse.quantize_int8(v, 0.05), 0.05, dtype=dt), (dcols,), (x,)),
        (lambda v, w: cufuse.fuse(lambda a, b: cufuse.exp(a) * b - 1.0)(v, w), (dcols, dy), (x, y)),
        (lambda v: cufuse.fuse(lambda a: ((a * a).sum(axis=-1), a.max(axis=-1, keepdims=True)))(v), (dx,), (x,)),
    ]
    for k, (call, dargs, args) in enumerate(cases):
        want = call(*args)
        got = call(*dargs)
        if isinstance(want, tuple):
            for g, w in zip(got, want):
                _same(g, w, dt)
        else:
            _same(got, want, want.dtype if want.dtype.kind == "f" else F64)


def test_reductions_with_empty_chunks():
    x = rand((0, 6), F32, 3)
    d = da.from_array(x, chunks=(1, 3))
    assert cufuse.sum_squared(d, axis=0).compute().tolist() == [0.0] * 6
    assert np.isnan(cufuse.mean_abs(d, axis=0).compute()).all()       # a mean over nothing
    z = da.concatenate([da.from_array(rand((2, 6), F32, 4), chunks=2), da.from_array(x, chunks=1)])
    np.testing.assert_allclose(cufuse.mean_abs(z, axis=None).compute(), np.abs(rand((2, 6), F32, 4)).mean(),
                               rtol=1e-6)


def test_fused_reduction_of_differently_chunked_inputs():
    """A fused function ending in a reduction, its Dask inputs chunked otherwise (or broadcast): Dask's
    chunk alignment (blocks were paired by position: ten results for six rows, other rows' values)."""
    sq = cufuse.fuse(lambda x, y: ((x - y) ** 2).sum(axis=-1))
    x, y = rand((6, 2), np.float64, 21), rand((6, 2), np.float64, 22)
    want = ((x - y) ** 2).sum(-1)
    for cx, cy in ((((1, 5), 2), ((5, 1), 2)), (((2, 2, 2), 2), ((3, 3), 2))):
        got = sq(da.from_array(x, chunks=cx), da.from_array(y, chunks=cy))
        assert got.shape == (6,)
        np.testing.assert_allclose(got.compute(), want, rtol=1e-12)
    got = sq(da.from_array(x, chunks=((2, 2, 2), 2)), da.from_array(y[0], chunks=1))
    np.testing.assert_allclose(got.compute(), ((x - y[0]) ** 2).sum(-1), rtol=1e-12)


def test_mean_over_unknown_lengths_refused():
    """A mean over an axis of unknown length (a boolean mask's result) says to compute the chunk sizes (it
    gave NaN); once computed, the NumPy mean."""
    x = rand((9, 4), np.float64, 23)
    d = da.from_array(x, chunks=(3, 4))
    masked = d[d[:, 0] > 0]
    with pytest.raises(ValueError, match="compute_chunk_sizes"):
        cufuse.mean_abs(masked, axis=0)
    got = cufuse.mean_abs(masked.compute_chunk_sizes(), axis=0).compute()
    np.testing.assert_allclose(got, np.abs(x[x[:, 0] > 0]).mean(0), rtol=1e-12)


def test_row_ops_and_reductions_check_before_the_graph():
    """An int Dask array, or a weight of another shape: the error at the call (the lazy result had the int
    dtype, and compute raised naming one chunk); the lazy dtype is the computed one."""
    d = da.from_array(np.ones((4, 3), np.int32), chunks=(2, 3))
    for call in (lambda: cufuse.sum_squared(d, axis=1), lambda: cufuse.layer_norm(d, 3), lambda: cufuse.softmax(d)):
        with pytest.raises(TypeError, match=r"int32.*accepted dtypes.*the array: int32, shape \(4, 3\)"):
            call()
    x = da.from_array(rand((4, 6), np.float16, 24), chunks=(2, 6))
    with pytest.raises(ValueError, match="weight has shape"):
        cufuse.layer_norm(x, 6, np.ones(4, np.float16))
    for lazy in (cufuse.layer_norm(x, 6), cufuse.sum_squared(x, axis=1), cufuse.softmax(x)):
        assert lazy.dtype == lazy.compute().dtype


def test_dask_errors():
    x = rand((6, 8), F32, 5)
    d = da.from_array(x, chunks=(3, 4))
    with pytest.raises(ValueError, match=r"axis 1 of the Dask array is split into 2 chunks.*rechunk"):
        cufuse.layer_norm(d, 8)
    with pytest.raises(ValueError, match="split into 2 chunks"):
        cufuse.softmax(d)
    with pytest.raises(ValueError, match="split into 2 chunks"):
        cufuse.fuse(lambda a: a.sum(axis=-1))(d)
    with pytest.raises(TypeError, match="out= is not supported for Dask arrays"):
        cufuse.add_relu(d, 1.0, out=np.empty((6, 8), np.float32))
    with pytest.raises(TypeError, match="gelu_dropout is not supported for Dask arrays"):
        cufuse.gelu_dropout(d, 0.1, seed=3)
    with pytest.raises(TypeError, match="weight is a Dask array"):
        cufuse.layer_norm(da.from_array(x, chunks=(3, 8)), 8, d[0])
    # checked when the call is made, as for NumPy (not at compute(), with a chunk's shape)
    rows = da.from_array(x, chunks=(3, 8))
    for call, exc, match in ((lambda: cufuse.sum_squared(rows, -1, "false"), TypeError, "keepdims must be a bool"),
                             (lambda: cufuse.softmax(rows, 5), ValueError, "axis 5 is out of range"),
                             (lambda: cufuse.softmax(rows, None), TypeError, "axis must be an int"),
                             (lambda: cufuse.layer_norm(rows, 4.0), TypeError, "normalized_shape must be"),
                             (lambda: cufuse.layer_norm(rows, (2, 6, 8)), ValueError, r"whose shape is \(6, 8\)"),
                             (lambda: cufuse.layer_norm(da.from_array(np.float32(1.0)), 1), ValueError,
                              "trailing dims"),
                             (lambda: cufuse.rms_norm(rows, 8, eps=-1.0), ValueError, "eps must be finite")):
        with pytest.raises(exc, match=match):
            call()
    with pytest.raises(TypeError, match="mixed with other arrays"):
        cufuse.fuse(lambda a, b: a + b)(d, x)
    # the elementwise ops' checks (Dask's own probe had turned them into a result of NotImplemented)
    for call, match in ((lambda: cufuse.add_relu(d, True), "bool scalars"),
                        (lambda: cufuse.fma(d, d, 1 + 2j), "complex scalars"),
                        (lambda: cufuse.mul_tanh(d.astype(np.int8), 2.0), "accepted dtypes"),
                        (lambda: cufuse.add_relu(d, x), "mixed with another array")):
        with pytest.raises(TypeError, match=match):
            call()
    for n in (10, 3):  # a per-channel scale of the wrong length: refused before any chunk runs
        with pytest.raises(ValueError, match=r"\(8,\) is needed"):
            cufuse.quantize_int8(d, np.full(n, 0.5, np.float32), axis=1)
    # a sum of values that do not span the last axis: as for NumPy arrays (the Dask path broadcasts later)
    u, v = da.from_array(rand((6, 1), F32, 6), chunks=(3, 1)), da.from_array(x, chunks=(3, 8))
    with pytest.raises(ValueError, match="count 8 times"):
        cufuse.fuse(lambda a, b: ((a * 2.0).sum(axis=-1), b.sum(axis=-1)))(u, v)


def test_per_channel_lists_as_for_numpy():
    """Per-channel parameters given as lists of ints read as numbers, as for a NumPy array (the Dask path
    had made them int64 arrays and refused them)."""
    x = rand((3, 4), F32, 7) * 4
    want = cufuse.quantize_int8(x, [0.5] * 4, [1, 2, 3, 4], axis=1)
    got = cufuse.quantize_int8(da.from_array(x, chunks=2), [0.5] * 4, [1, 2, 3, 4], axis=1).compute()
    np.testing.assert_array_equal(got, want)


def _devices(d):
    """The GPU of each row's chunk. (Not with drop_axis: map_blocks then
    concatenates each chunk along the dropped axis, a CuPy copy on the
    current GPU, and every chunk reads GPU 0: seen on 2 H200s.)"""
    return d.map_blocks(lambda b: np.full(b.shape, b.data.device_id), dtype=np.int64).compute()[:, 0].tolist()


@pytest.mark.cuda
def test_chunks_on_two_gpus():
    """A Dask array of 4 CuPy chunks, two on each GPU: each chunk runs on its
    own GPU and the result equals the one-array result."""
    if gpu_count() < 2:
        pytest.skip("needs 2 GPUs")
    import cupy as cp
    x = rand((8, 16), F32, 6)

    def block(b, block_info=None):  # chunk i made on GPU i // 2 when the graph runs
        i = block_info[None]["chunk-location"][0]
        with cp.cuda.Device(i // 2):
            return cp.asarray(x[2 * i:2 * i + 2])
    d = da.zeros((8, 16), chunks=(2, 16), dtype=np.float32).map_blocks(block, dtype=np.float32,
                                                                         meta=cp.empty((0, 0), np.float32))
    assert _devices(d) == [0] * 4 + [1] * 4  # (the test's own precondition)
    f = cufuse.fuse(lambda a: cufuse.tanh(a) * 2.0 + 1.0)
    for call in (lambda v: cufuse.add_relu(v, 0.5), lambda v: cufuse.layer_norm(v, 16), f):
        assert _devices(call(d)) == [0] * 4 + [1] * 4
        got = call(d).map_blocks(cp.asnumpy, dtype=np.float32).compute()
        np.testing.assert_allclose(got, cp.asnumpy(call(cp.asarray(x))), rtol=1e-6, atol=1e-7)
