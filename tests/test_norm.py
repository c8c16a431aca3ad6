"""cufuse.layer_norm, layer_norm_relu, rms_norm, softmax and log_softmax on
every backend, against float64 references written from the spec
(tests/_reference_norm.py) and, where torch is installed, against
torch.nn.functional on CPU.

Tolerances are stated once in tests/_reference_norm.py: NORM_TOL (float16
5e-3 / 2e-3, float32 1e-5, float64 1e-12; long rows looser), NORM_TOL_OFFSET
for x = 1000 + randn rows (float32 5e-4 on the normalized output, which a
one-pass E[x^2] - E[x]^2 variance misses by >40x: asserted below),
SOFTMAX_TOL (relative: float32 2e-5, atol only for subnormals) and
LOG_SOFTMAX_TOL.
"""
from __future__ import annotations

import math
import time

import numpy as np
import pytest

import cufuse
from cufuse import _driver as D

from _reference import DTYPES, Backend, check_kind, cpu_runs_one, gpu_count, rand
from _reference_norm import (F16, F32, F64, NORM_REF, NORM_TOL_OFFSET, OFFSET, SOFTMAX_REF, assert_close, check,
                             layer_norm_ref, one_pass_layer_norm, raises_each, tol)

NORM_OPS = ["layer_norm", "layer_norm_relu", "rms_norm"]
SOFTMAX_OPS = ["softmax", "log_softmax"]
DEFAULT_EPS = {"layer_norm": 1e-5, "layer_norm_relu": 1e-5, "rms_norm": 1e-6}
ROW_LENGTHS = [1, 2, 3, 7, 31, 32, 33, 127, 129, 768, 1000, 1023, 1024, 4097, 12289]
OTHER_KIND = {"numpy": "torch_cpu", "torch_cpu": "numpy", "cupy": "numpy", "torch_cuda": "cupy"}

norm_param = pytest.mark.parametrize("op", NORM_OPS)
softmax_param = pytest.mark.parametrize("op", SOFTMAX_OPS)
dtype_param = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
_UNSET = object()


def fn(op):
    return getattr(cufuse, op)


def has_bias(op):
    return op != "rms_norm"


def ns_tuple(ns):
    return (ns,) if isinstance(ns, (int, np.integer)) else tuple(ns)


def permute(backend, a, axes):
    return a.permute(*axes) if backend.is_torch else a.transpose(*axes)


def broadcast_to(backend, a, shape):
    if backend.is_torch:
        return a.expand(*shape)
    if backend.name == "cupy":
        return backend.cp.broadcast_to(a, shape)
    return np.broadcast_to(a, shape)


# ============================================================ normalizations
def normalize(backend, op, x, nx, ns, w=None, b=None, nw=None, nb=None, eps=_UNSET, out=None, tolerance=None):
    """Run ``op`` (``x``, ``w``, ``b`` in the backend's kind; ``nx``, ``nw``,
    ``nb`` their NumPy values), check kind / shape / dtype / values against the
    float64 reference; return the NumPy result."""
    kw = {}
    if w is not None:
        kw["weight"] = w
    if b is not None:
        kw["bias"] = b
    if eps is not _UNSET:
        kw["eps"] = eps
    if out is not None:
        kw["out"] = out
    res = fn(op)(x, ns, **kw)
    if out is not None:
        assert res is out
    check_kind(backend, res, nx.shape, nx.dtype, like=x)
    got = backend.to_numpy(res)
    e = DEFAULT_EPS[op] if eps is _UNSET else eps
    if has_bias(op):
        ref = NORM_REF[op](nx, ns, nw, nb, e)
    else:
        ref = NORM_REF[op](nx, ns, nw, e)
    check(op, got, ref, nx.dtype, math.prod(ns_tuple(ns)), tolerance)
    return got


AFFINE = {"layer_norm": ["none", "w", "b", "wb"], "layer_norm_relu": ["none", "w", "b", "wb"],
          "rms_norm": ["none", "w"]}
OP_AFFINE = [(op, a) for op in NORM_OPS for a in AFFINE[op]]


def affine(backend, op, which, shape, dtype, seed):
    """(w, b, nw, nb) for ``which`` in none / w / b / wb (rms_norm: no bias)."""
    nw = rand(shape, dtype, seed, 1.0) if "w" in which else None
    nb = rand(shape, dtype, seed + 1, 0.5) if "b" in which and has_bias(op) else None
    return (None if nw is None else backend.asarray(nw), None if nb is None else backend.asarray(nb), nw, nb)


def full_affine(op):
    return "wb" if has_bias(op) else "w"


# ---------------------------------------------------------------------- rows
@norm_param
@dtype_param
@pytest.mark.parametrize("n", ROW_LENGTHS)
def test_norm_rows(backend, op, dtype, n):
    x = rand((3, 5, n), dtype, 1000 + n, 2.0)
    w, b, nw, nb = affine(backend, op, full_affine(op), (n,), dtype, 1100 + n)
    normalize(backend, op, backend.asarray(x), x, n, w, b, nw, nb)


@pytest.mark.parametrize("op, which", OP_AFFINE, ids=lambda v: str(v))
@dtype_param
def test_norm_affine(backend, op, which, dtype):
    """weight / bias None or given, each combination (passed by keyword)."""
    for n in (1, 7, 1024):
        _norm_affine_case(backend, op, which, dtype, n)


def _norm_affine_case(backend, op, which, dtype, n):
    x = rand((6, n), dtype, 1200 + n)
    w, b, nw, nb = affine(backend, op, which, (n,), dtype, 1210 + n)
    got = normalize(backend, op, backend.asarray(x), x, (n,), w, b, nw, nb)
    if n == 1 and op != "rms_norm":
        # a row of length 1 normalizes to 0: the result is the bias (or 0), relu'd
        want = np.zeros((6, 1)) if nb is None else np.broadcast_to(nb.astype(np.float64), (6, 1))
        if op == "layer_norm_relu":
            want = np.maximum(want, 0.0)
        np.testing.assert_array_equal(got.astype(np.float64), want)


@norm_param
def test_norm_positional(backend, op):
    n = 65
    x = rand((4, n), F32, 1220)
    nw, nb = rand((n,), F32, 1221), rand((n,), F32, 1222, 0.5)
    w, b = backend.asarray(nw), backend.asarray(nb)
    if has_bias(op):
        res = fn(op)(backend.asarray(x), (n,), w, b, 0.01)
        ref = NORM_REF[op](x, (n,), nw, nb, 0.01)
    else:
        res = fn(op)(backend.asarray(x), (n,), w, 0.01)
        ref = NORM_REF[op](x, (n,), nw, 0.01)
    check_kind(backend, res, x.shape, F32)
    check(op, backend.to_numpy(res), ref, F32, n)


@norm_param
@pytest.mark.parametrize("lead", [(), (0,), (1,), (3, 5), (2, 3, 4)], ids=str)
@pytest.mark.parametrize("n", [33, 1024])
def test_norm_leading_shapes(backend, op, lead, n):
    x = rand(lead + (n,), F32, 1300 + n)
    w, b, nw, nb = affine(backend, op, full_affine(op), (n,), F32, 1310)
    got = normalize(backend, op, backend.asarray(x), x, n, w, b, nw, nb)
    assert got.shape == lead + (n,)


# float32 rows of 20000 to 262144 are persistent parts (norm_rows_pipe) for
# layer_norm, clusters of 4 blocks on sm_90 up to 32768 and persistent parts
# beyond for rms_norm, 300000 split rows (cufuse/ops/norm.py plan); float16
# rows of 65536 and 131072 clusters of 4 and 8 (test_long_row_kernel_taken).
@norm_param
@pytest.mark.parametrize("n", [20000, 32768, 65536, 262144, 300000])
def test_norm_long_rows(backend, op, n):
    x = rand((2, n), F32, 1400 + n)
    w, b, nw, nb = affine(backend, op, full_affine(op), (n,), F32, 1410)
    normalize(backend, op, backend.asarray(x), x, n, w, b, nw, nb)


FUNCTOR = {"layer_norm": "LayerNorm<false>", "layer_norm_relu": "LayerNorm<true>", "rms_norm": "RmsNorm",
           "softmax": "Softmax<false>", "log_softmax": "Softmax<true>"}


def pipe_kernel(op, dtype):
    return f"norm_rows_pipe<{FUNCTOR[op]}, {'__half' if dtype == F16 else 'float'}, 4, 3>"


def row_kernels(launches, kernel=None):
    """The row kernels of ``launches`` (``Launch``); with ``kernel``, what a
    call taking it launches: it, and after a kernel whose blocks wait for one
    another (split, pipe) the launch that stores the parts of blocks that
    gave up (kernels/norm.cu norm_rows_rescue<Op, T, Whole, Pipe>)."""
    if kernel is None:
        return [ln.kernel for ln in launches if ln.kernel.startswith("norm_rows")]
    args = kernel[kernel.index("<") + 1:-1].rsplit(", ", 2)  # (Op, T), then two more
    if kernel.startswith("norm_rows_split"):
        return [kernel, f"norm_rows_rescue<{args[0]}, {args[2]}, false>"]
    if kernel.startswith("norm_rows_pipe"):
        return [kernel, f"norm_rows_rescue<{args[0]}, true, true>"]
    return [kernel]


@pytest.mark.parametrize("op, dtype, n, kernel", [
    ("layer_norm", F32, 20000, pipe_kernel("layer_norm", F32)),
    ("layer_norm", F32, 32768, pipe_kernel("layer_norm", F32)),
    ("layer_norm", F32, 65536, pipe_kernel("layer_norm", F32)),
    ("layer_norm", F32, 65540, pipe_kernel("layer_norm", F32)),
    ("layer_norm", F32, 65537, "norm_rows_split<LayerNorm<false>, float, 8, false>"),
    ("layer_norm", F16, 65536, "norm_rows_cluster<LayerNorm<false>, __half, 8, 4, true>"),
    ("layer_norm", F16, 131072, "norm_rows_cluster<LayerNorm<false>, __half, 8, 8, true>"),
    ("layer_norm", F16, 262144, "norm_rows_split<LayerNorm<false>, __half, 8, true>"),
    ("rms_norm", F32, 20000, "norm_rows_cluster<RmsNorm, float, 8, 4, true>"),
    ("rms_norm", F32, 32768, "norm_rows_cluster<RmsNorm, float, 8, 4, true>"),
    ("rms_norm", F32, 32772, pipe_kernel("rms_norm", F32)),
    ("rms_norm", F16, 65536, "norm_rows_cluster<RmsNorm, __half, 8, 4, true>"),
    ("rms_norm", F16, 65544, pipe_kernel("rms_norm", F16)),
    ("rms_norm", F16, 262144, pipe_kernel("rms_norm", F16)),
    ("rms_norm", F32, 262145, "norm_rows_split<RmsNorm, float, 8, false>"),
    ("softmax", F32, 65536, "norm_rows_split<Softmax<false>, float, 8, true>"),
    ("softmax", F32, 65540, pipe_kernel("softmax", F32)),
    ("softmax", F16, 131072, "norm_rows_cluster<Softmax<false>, __half, 8, 8, true>"),
    ("softmax", F16, 131080, pipe_kernel("softmax", F16)),
    ("log_softmax", F32, 262144, pipe_kernel("log_softmax", F32))], ids=str)
def test_long_row_kernel_taken(backend, op, dtype, n, kernel, launches):
    """The plan's kernel (and cluster size) is the one that runs, so that the
    long-row tests cover clusters of 4 and 8, persistent parts and split
    rows: on sm_90 rows of whole packs longer than one group take persistent
    parts (norm_rows_pipe) for float32 layer_norm, longer than a cluster of 4
    for rms_norm, than a cluster of 8 (float16) or 65536 columns (float32)
    for softmax; the rest clusters up to 32768 float32 / 131072 float16
    columns, then split rows. (The float32 layer_norm kernels at 8 packs per
    thread are the general ones, float16's the whole ones: norm.py.)"""
    if not backend.gpu:
        pytest.skip("GPU backends only")
    import cupy as cp
    if "cluster" in kernel and int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("clusters need sm_90")
    if "pipe" in kernel and int(cp.cuda.Device().compute_capability) < 80:
        pytest.skip("norm_rows_pipe needs sm_80 (cp.async)")
    x = rand((2, n), dtype, 1425, 3.0 if op.endswith("softmax") else 1.0)
    if op.endswith("softmax"):
        soft(backend, op, backend.asarray(x), x)
    else:
        normalize(backend, op, backend.asarray(x), x, n)
    assert row_kernels(launches) == row_kernels(None, kernel), launches


@norm_param
@pytest.mark.parametrize("dtype, n", [(F16, 65536), (F16, 131072), (F64, 65536)], ids=str)
def test_norm_long_rows_other_dtypes(backend, op, dtype, n):
    x = rand((2, n), dtype, 1420)
    w, b, nw, nb = affine(backend, op, full_affine(op), (n,), dtype, 1421)
    normalize(backend, op, backend.asarray(x), x, n, w, b, nw, nb)


@norm_param
@pytest.mark.parametrize("n", [8192, 16384])
@pytest.mark.parametrize("dtype", [F16, F32], ids=lambda d: d.name)
def test_norm_wide_rows(backend, op, dtype, n):
    """Rows of 1024 to 4096 aligned packs: one group per row at 8 packs per
    thread, the "whole" kernels for float16 (and the general ones for float32
    layer_norm; cufuse/ops/norm.py: _RowOp.launch)."""
    x = rand((3, n), dtype, 1440 + n)
    w, b, nw, nb = affine(backend, op, full_affine(op), (n,), dtype, 1441)
    normalize(backend, op, backend.asarray(x), x, n, w, b, nw, nb)


# Persistent parts (norm_rows_pipe: rows of whole, aligned packs, see
# test_long_row_kernel_taken): on an H200, 40 rows of 262144 float32 are 32
# parts in 8 groups, so that each block walks 5 rows through its 3
# shared-memory slots; 70000 float32 / 140000 float16 columns are 9 parts,
# the last shorter than the others; one row of 65536 float32 is one group of
# 8; 20000 float32 is 3 parts (layer_norm only). Without weight, bias or
# both (no held columns), outputs poisoned first; the kernel taken is checked.
@pytest.mark.parametrize("op", ["layer_norm", "layer_norm_relu"])
@pytest.mark.parametrize("rows, n", [(40, 262144), (7, 70000), (1, 65536), (5, 20000)], ids=str)
@pytest.mark.parametrize("which", ["none", "w", "b", "wb"])
def test_norm_pipe_rows(backend, op, rows, n, which, launches):
    cpu_runs_one(backend, (op, rows, n, which) == ("layer_norm", 5, 20000, "wb"))
    x = rand((rows, n), F32, 1470 + n, 2.0) + np.float32(3)
    w, b, nw, nb = affine(backend, op, which, (n,), F32, 1471)
    out = backend.asarray(np.full((rows, n), np.nan, F32))
    normalize(backend, op, backend.asarray(x), x, n, w, b, nw, nb, out=out)
    check_pipe_taken(backend, launches, op, F32)


def check_pipe_taken(backend, launches, op, dtype):
    if backend.gpu:
        import cupy as cp
        if int(cp.cuda.Device().compute_capability) >= 80:
            taken = row_kernels(launches)
            assert taken == row_kernels(None, pipe_kernel(op, dtype)), taken


@pytest.mark.parametrize("op", ["rms_norm", "softmax", "log_softmax"])
@pytest.mark.parametrize("dtype, rows, n", [(F32, 40, 262144), (F32, 7, 70000), (F16, 20, 262144),
                                            (F16, 7, 140000)], ids=str)
def test_pipe_rows_other_ops(backend, op, dtype, rows, n, launches):
    cpu_runs_one(backend, (op, dtype, rows, n) == ("softmax", F32, 7, 70000))
    if op == "rms_norm":
        x = rand((rows, n), dtype, 1480 + n, 2.0) + dtype.type(3)
        w = rand((n,), dtype, 1481)
        out = backend.asarray(np.full((rows, n), np.nan, dtype))
        normalize(backend, op, backend.asarray(x), x, n, backend.asarray(w), nw=w, out=out)
    else:
        x = rand((rows, n), dtype, 1482 + n, 3.0)
        out = backend.asarray(np.full((rows, n), np.nan, dtype))
        soft(backend, op, backend.asarray(x), x, out=out)
    check_pipe_taken(backend, launches, op, dtype)


# Rows split over blocks (cufuse/ops/norm.py plan: rows longer than one
# cluster, or than one block without clusters): 262144 float32 is 32 blocks of
# 256 threads, 300001 is 19 blocks of 512 threads with a partial last pack;
# nine rows of 32 blocks outnumber an H200's 132 multiprocessors. Offset views
# move every part's window off the 16-byte grid. Outputs poisoned first.
SPLIT_CASES = [(F32, 9, 262144, 0), (F32, 3, 300001, 0), (F32, 2, 262144, 3), (F16, 2, 262144, 0),
               (F16, 3, 262150, 5), (F64, 2, 262144, 1)]


def split_case(backend, dtype, rows, n, offset, seed, scale=1.0):
    """(x in the backend, its NumPy values, a poisoned out): x is the columns
    offset.. of a wider array when offset > 0."""
    base = rand((rows, n + offset), dtype, seed, scale)
    nx = np.ascontiguousarray(base[:, offset:])
    x = backend.asarray(base)[:, offset:] if offset else backend.asarray(base)
    out = backend.asarray(np.full((rows, n), 7.0, dtype))
    return x, nx, out


@norm_param
@pytest.mark.parametrize("dtype, rows, n, offset", SPLIT_CASES, ids=str)
def test_norm_split_rows(backend, op, dtype, rows, n, offset):
    cpu_runs_one(backend, (dtype, rows, n, offset) == SPLIT_CASES[2])
    x, nx, out = split_case(backend, dtype, rows, n, offset, 1450 + n)
    w, b, nw, nb = affine(backend, op, full_affine(op), (n,), dtype, 1451)
    normalize(backend, op, x, nx, n, w, b, nw, nb, out=out)


# Parts of cluster rows (32768 float32, 65536 float16: clusters of 4) and
# split rows (65536 float32, 262144) load a pack of the weight and bias whole
# where it is whole and aligned in them, else element by element
# (kernels/norm.cu: RowView::columns): weight and bias as views at x's offset
# (whole packs on a shifted window) or at another one (per element), each
# alone or both.
@norm_param
@pytest.mark.parametrize("dtype", [F16, F32], ids=lambda d: d.name)
@pytest.mark.parametrize("n", [32768, 65536, 262144])
@pytest.mark.parametrize("x_offset, p_offset", [(0, 0), (3, 3), (0, 1)], ids=str)
@pytest.mark.parametrize("which", ["w", "b", "wb"])
def test_norm_split_rows_affine_views(backend, op, dtype, n, x_offset, p_offset, which):
    cpu_runs_one(backend, dtype == F32 and n == 32768)  # (every view of x and the parameters)
    if "w" not in which and not has_bias(op):
        pytest.skip("rms_norm has no bias")
    x, nx, out = split_case(backend, dtype, 2, n, x_offset, 1460 + n)

    def view(seed, scale):
        base = rand((n + p_offset,), dtype, seed, scale)
        return backend.asarray(base)[p_offset:], base[p_offset:]
    w, nw = view(1461, 1.0) if "w" in which else (None, None)
    b, nb = view(1462, 0.5) if "b" in which and has_bias(op) else (None, None)
    normalize(backend, op, x, nx, n, w, b, nw, nb, out=out)


# A kernel that holds every multiprocessor but two until `flag` is set (or
# `limit_ns` has passed: then `timed_out` is set): two 1024-thread blocks on
# each (all of its 2048 thread slots: no other block fits there), as a
# persistent kernel beside cufuse would (NCCL's), or an MPS / green-context
# limit. Blocks that land on the two spared SMs leave at once.
_HOG = r"""
extern "C" __global__ void hog(const volatile int* flag, int* started, int* timed_out, unsigned long long limit_ns) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    if (sm < 2) return;  // the two SMs left free
    if (threadIdx.x == 0) {
        unsigned long long t0, t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        atomicAdd(started, 1);
        while (*flag == 0) {
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
            if (t - t0 > limit_ns) { atomicExch(timed_out, 1); break; }
            __nanosleep(1000);
        }
    }
    __syncthreads();  // every warp stays until the flag: the SM's 2048 thread slots held
}
"""


@pytest.mark.cuda
@pytest.mark.parametrize("op, dtype, rows, n, kernel", [
    ("layer_norm", F32, 64, 4096, "norm_rows<"),  # a control: no block waits for another
    ("layer_norm", F32, 6, 500001, "norm_rows_split"),
    ("softmax", F16, 4, 1000000, "norm_rows_split"),
    ("layer_norm", F32, 48, 65536, "norm_rows_pipe"),
    ("rms_norm", F16, 40, 262144, "norm_rows_pipe"),
], ids=str)
def test_split_rows_beside_a_kernel_holding_the_gpu(op, dtype, rows, n, kernel, launches):
    """Rows whose blocks wait for one another are done, and right, while
    another kernel holds all multiprocessors but two until they are: the
    blocks give up waiting and the launch after the kernel stores their
    parts (kernels/rows.cuh SplitGroup, norm.cu norm_rows_rescue). Before, the split and pipe kernels
    waited for the other kernel to end (bench/NOTES.md, sessions 45-46)."""
    import cupy as cp
    from cufuse import _runtime as R
    dev = cp.cuda.Device().id
    sms = R.sm_count(dev)
    x = rand((rows, n), dtype, 3950 + n, 2.0) + dtype.type(1)
    w = rand((n,), dtype, 3951)
    args = () if op in SOFTMAX_OPS else ((n, cp.asarray(w)) if op == "rms_norm" else (n,))
    xd = cp.asarray(x)
    want = cp.asnumpy(fn(op)(xd, *args))  # the kernel built and its recipe kept, uncontended
    taken = row_kernels(launches)
    assert taken and taken == row_kernels(None, taken[0]) and taken[0].startswith(kernel), taken
    hog = cp.RawKernel(_HOG, "hog")
    flag, started, timed_out = (cp.zeros(1, cp.int32) for _ in range(3))
    out = cp.full((rows, n), np.nan, dtype)
    cp.cuda.Device().synchronize()
    side, own, copies = (cp.cuda.Stream(non_blocking=True) for _ in range(3))
    holders = 2 * (sms - 2)
    with side:
        hog((4 * sms,), (1024,), (flag, started, timed_out, np.uint64(5 * 10**9)))
    for _ in range(2000):  # until the holders run
        if int(started.get(stream=copies)[0]) >= holders:
            break
    assert int(started.get(stream=copies)[0]) >= holders
    time.sleep(0.01)  # the other blocks of it, on the spared SMs, gone
    t0 = time.perf_counter()
    with own:
        fn(op)(xd, *args, out=out)
    while not own.done and time.perf_counter() - t0 < 3:
        time.sleep(1e-4)
    done, elapsed = own.done, time.perf_counter() - t0
    flag.set(np.ones(1, np.int32), stream=copies)  # a copy: needs no multiprocessor
    side.synchronize()
    own.synchronize()
    assert done, f"the op was not done {elapsed:.2f} s after its launch beside the kernel holding the GPU"
    assert int(timed_out.get()[0]) == 0
    got = cp.asnumpy(out)
    ref = SOFTMAX_REF[op](x) if op in SOFTMAX_OPS else NORM_REF[op](x, (n,), *((w,) if op == "rms_norm" else ()))
    check(op, got, ref, dtype, n)
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-6, atol=1e-6)


# Every part of split and pipe rows stored by the rescue launch after the
# kernel (patience 0: every block gives up, kernels/rows.cuh): x as a view at an offset (the
# kernels for any row) or aligned (whole packs), out poisoned or x itself
# (in place: a part's x is read only by its block and the rescue), checked
# against the float64 reference and against the same call with blocks
# that wait (the same statistics, merged in the same order).
@pytest.mark.cuda
@pytest.mark.parametrize("op, dtype, rows, n, offset, kernel", [
    ("layer_norm", F32, 3, 300001, 3, "norm_rows_split"),
    ("layer_norm", F16, 2, 262144, 0, "norm_rows_split"),
    ("rms_norm", F64, 2, 262144, 1, "norm_rows_split"),
    ("softmax", F32, 5, 65536, 0, "norm_rows_split"),
    ("layer_norm_relu", F32, 40, 262144, 0, "norm_rows_pipe"),
    ("rms_norm", F16, 20, 262144, 0, "norm_rows_pipe"),
    ("log_softmax", F32, 7, 70000, 0, "norm_rows_pipe"),
], ids=str)
@pytest.mark.parametrize("where", ["out", "in_place"])
def test_rows_stored_by_the_rescue(op, dtype, rows, n, offset, kernel, where, launches, monkeypatch):
    import cupy as cp
    from cufuse.ops import norm as N
    x, nx, out = split_case(Backend("cupy"), dtype, rows, n, offset, 3960 + n, 3.0 if "softmax" in op else 1.0)
    w = rand((n,), dtype, 3961) if op != "log_softmax" and "softmax" not in op else None
    args = () if "softmax" in op else (n,)
    kw = {} if w is None else {"weight": cp.asarray(w)}

    def call(target):
        res = fn(op)(target if where == "in_place" else x, *args, out=target, **kw)
        assert res is target
        return cp.asnumpy(res)
    waited = call(x.copy() if where == "in_place" else cp.full((rows, n), np.nan, dtype))
    monkeypatch.setattr(N, "PATIENCE_NS", 0)
    D.clear_fast_paths()
    del launches[:]
    got = call(x.copy() if where == "in_place" else cp.full((rows, n), np.nan, dtype))
    taken = row_kernels(launches)
    assert taken and taken == row_kernels(None, taken[0]) and taken[0].startswith(kernel), taken
    if "softmax" in op:
        ref = SOFTMAX_REF[op](nx, -1)
    else:
        ref = NORM_REF[op](nx, (n,), *((w,) if op == "rms_norm" else (w, None)), DEFAULT_EPS[op])
    check(op, got, ref, dtype, n)
    tol = {F16: 1e-3, F32: 1e-6, F64: 1e-14}[dtype]
    np.testing.assert_allclose(got.astype(np.float64), waited.astype(np.float64), rtol=tol, atol=tol)
    D.clear_fast_paths()


@pytest.mark.parametrize("op", NORM_OPS + SOFTMAX_OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("n", [262144, 300000])
@pytest.mark.parametrize("peak", [False, True], ids=["spread", "peak"])
def test_split_rows_one_statistic_per_row(backend, op, dtype, n, peak):
    """Equal inputs anywhere in a split row give bit-identical outputs: every
    thread of every block of the row used the same merged statistics. The
    values come from a set of 8 placed at random, so the parts' statistics
    differ (a merge whose result depends on the order of its operands shows
    up as two outputs for one input); 300000 float32 has parts of 15792
    elements, whose products with a mean round (2**k-element parts do not).
    With ``peak`` one element per row (index 7) holds the row's maximum, so
    that all but one part of a softmax row have a lower local maximum.
    Whole packs only: an element of a partial pack is computed by other code
    (per element), which may round differently."""
    cpu_runs_one(backend, dtype == F32 and n == 300000 and peak)
    rng = np.random.default_rng(3900 + n)
    vals = rng.standard_normal(8).astype(dtype)
    idx = rng.integers(0, 8, (4, n))
    if peak:
        vals = np.append(vals, vals.max() + 1).astype(dtype)
        idx[:, 7] = 8
    got = backend.to_numpy(fn(op)(backend.asarray(vals[idx]), *(() if op in SOFTMAX_OPS else (n,))))
    for r in range(4):
        for k in range(8):
            y = got[r][idx[r] == k]
            assert np.isfinite(y).all() and (y == y[0]).all(), (r, k, np.unique(y))


@pytest.mark.slow
@norm_param
def test_norm_very_large(backend, op):
    cpu_runs_one(backend, op == NORM_OPS[0])
    x = rand((40, 300000), F32, 1430)        # 1.2e7 elements
    normalize(backend, op, backend.asarray(x), x, 300000)


# --------------------------------------------------------- normalized_shape
NS_FORMS = ["int", "tuple1", "list1", "tuple2", "list2", "tuple3", "whole"]


def ns_case(form):
    """(x shape, normalized_shape) for a form."""
    return {"int": ((4, 6, 33), 33), "tuple1": ((4, 6, 33), (33,)), "list1": ((4, 6, 33), [33]),
"tuple2": ((4, 6, 33), (6, 33)), "list2": ((5, 7, 129), [7, 129]),
            "tuple3": ((2, 3, 4, 5), (3, 4, 5)), "whole": ((6, 33), (6, 33))}[form]


@norm_param
@pytest.mark.parametrize("form", NS_FORMS)
def test_normalized_shape_forms(backend, op, form):
    shape, ns = ns_case(form)
    for dtype in DTYPES:
        x = rand(shape, dtype, 1500, 1.5)
        w, b, nw, nb = affine(backend, op, full_affine(op), ns_tuple(ns), dtype, 1510)
        normalize(backend, op, backend.asarray(x), x, ns, w, b, nw, nb)


@norm_param
def test_two_dim_normalized_shape_is_not_per_row(backend, op):
    """normalized_shape (6, 33) normalizes over both dims, not over each row
    of 33 (the two differ by far more than the tolerance)."""
    x = rand((4, 6, 33), F32, 1520)
    x += np.arange(6, dtype=F32)[None, :, None]            # row means differ
    got = normalize(backend, op, backend.asarray(x), x, (6, 33))
    per_row = NORM_REF[op](x, 33) if op == "rms_norm" else NORM_REF[op](x, 33, None, None)
    assert np.abs(got - per_row).max() > 0.1


# ----------------------------------------------------------------------- eps
EPS = [0, 0.0, 1e-5, 0.1, 1, np.float32(1e-3), np.float64(0.5), 2.5]


@norm_param
@pytest.mark.parametrize("eps", EPS, ids=repr)
def test_eps(backend, op, eps):
    for dtype in (F32, F64):
        x = rand((5, 129), dtype, 1600, 0.3)          # variance ~0.09: eps 1e-5 changes results by ~5e-5
        w, b, nw, nb = affine(backend, op, full_affine(op), (129,), dtype, 1610)
        got = normalize(backend, op, backend.asarray(x), x, 129, w, b, nw, nb, eps=eps)
        if float(eps) > 0:   # the tolerance tells eps from no eps (the check above used eps)
            r0 = NORM_REF[op](x, 129, nw, nb, 0.0) if has_bias(op) else NORM_REF[op](x, 129, nw, 0.0)
            with pytest.raises(AssertionError):
                check(op, got, r0, dtype, 129)


@norm_param
@pytest.mark.parametrize("dtype", [F32, F64], ids=lambda d: d.name)
def test_default_eps(backend, op, dtype):
    """layer_norm's default eps is 1e-5, rms_norm's 1e-6: x ~ 1e-3 (variance
    ~1e-6), where the default changes every value."""
    x = rand((5, 129), dtype, 1620, 1e-3)
    got = normalize(backend, op, backend.asarray(x), x, 129)
    other = 1e-6 if has_bias(op) else 1e-5
    r_other = NORM_REF[op](x, 129, None, None, other) if has_bias(op) else NORM_REF[op](x, 129, None, other)
    with pytest.raises(AssertionError):
        check(op, got, r_other, dtype, 129)


# ------------------------------------------------------ accuracy: x = 1000 + randn
@norm_param
@pytest.mark.parametrize("dtype", [F32, F64], ids=lambda d: d.name)
@pytest.mark.parametrize("n", [33, 129, 1024, 4097, 65536, 262144])
def test_offset_rows(backend, op, dtype, n):
    """Rows 1000 + randn: a two-pass (or Welford) variance is accurate, a
    one-pass E[x^2] - E[x]^2 is not, and the tolerance tells them apart."""
    for which in ("none", "affine"):
        _offset_case(backend, op, dtype, n, which)


def _offset_case(backend, op, dtype, n, which):
    rows = 8 if n <= 4097 else 2
    x = (OFFSET + np.random.default_rng(1700 + n).standard_normal((rows, n))).astype(dtype)
    w, b, nw, nb = affine(backend, op, "none" if which == "none" else full_affine(op), (n,), dtype, 1710)
    tolerance = NORM_TOL_OFFSET[dtype]
    if nw is not None:      # the normalized output's error, scaled by the weight
        scale = max(1.0, float(np.abs(nw.astype(np.float64)).max()))
        tolerance = (tolerance[0], tolerance[1] * scale)
    normalize(backend, op, backend.asarray(x), x, n, w, b, nw, nb, tolerance=tolerance)
    if op == "layer_norm" and which == "none":      # the check is sensitive
        naive = one_pass_layer_norm(x, n, dtype).astype(dtype)
        with pytest.raises(AssertionError):
            assert_close(naive, layer_norm_ref(x, n), dtype, NORM_TOL_OFFSET[dtype])


# ------------------------------------------------- float16: computed in float32
@norm_param
@pytest.mark.parametrize("n", [129, 1024])
@pytest.mark.parametrize("which", ["none", "affine"])
def test_float16_large_magnitudes(backend, op, n, which):
    """Values ~ +-30000: x*x overflows float16, not the float32 computation."""
    rng = np.random.default_rng(1800 + n)
    x = (rng.choice([-1.0, 1.0], (4, n)) * rng.uniform(5000, 60000, (4, n))).astype(F16)
    with np.errstate(over="ignore"):
        assert np.isinf(x * x).any()                                 # would overflow in float16
    w, b, nw, nb = affine(backend, op, "none" if which == "none" else full_affine(op), (n,), F16, 1810)
    got = normalize(backend, op, backend.asarray(x), x, n, w, b, nw, nb)
    assert np.isfinite(got).all()


# --------------------------------------------------------------- NaN rows
@norm_param
@dtype_param
@pytest.mark.parametrize("n", [1, 129, 4097, 262144])
def test_norm_nan_row(backend, op, dtype, n):
    """NaN in one row: that row is all NaN (relu keeps NaN, as torch.relu
    does), every other row is unaffected."""
    x = rand((6, n), dtype, 1900 + n)
    x[2, n // 2] = np.nan
    w, b, nw, nb = affine(backend, op, full_affine(op), (n,), dtype, 1910)
    got = normalize(backend, op, backend.asarray(x), x, n, w, b, nw, nb)
    assert np.isnan(got[2]).all()
    assert not np.isnan(np.delete(got, 2, axis=0)).any()


# ------------------------------------------------------------------ layouts
NORM_VIEWS = ["transposed", "step", "step_rows", "offset_flat", "sliced_cols", "broadcast_rows", "permuted_3d_ns2",
              "negative_step", "weight_strided", "weight_broadcast"]


def norm_view(backend, view, op, dtype, n, seed):
    """(x, ns, w, b) in the backend's kind, views made there."""
    def dev(shape, s=0, scale=1.0):
        return backend.asarray(rand(shape, dtype, seed + s, scale))

    ns = (n,)
    rows = 7
    w = dev((n,), 1)
    b = dev((n,), 2, 0.5) if has_bias(op) else None
    if view == "transposed":
        x = dev((n, rows)).T
    elif view == "step":
        x = dev((rows, 2 * n))[:, ::2]
    elif view == "step_rows":
        x = dev((2 * rows, n))[::2]
    elif view == "offset_flat":                      # contiguous rows, misaligned by one element
        x = dev((1 + rows * n,))[1:].reshape(rows, n)
    elif view == "sliced_cols":                      # each row misaligned by one element
        x = dev((rows, n + 1))[:, 1:]
    elif view == "broadcast_rows":                   # every row the same (stride 0)
        x = broadcast_to(backend, dev((n,)), (rows, n))
    elif view == "permuted_3d_ns2":                  # normalized dims (5, n) not contiguous
        x = permute(backend, dev((5, rows, n)), (1, 0, 2))
        ns = (5, n)
        w = dev((5, n), 1)
        b = dev((5, n), 2, 0.5) if has_bias(op) else None
    elif view == "negative_step":
        if not backend.negative_strides:
            pytest.skip("torch tensors have no negative strides")
        x = dev((rows, n))[:, ::-1]
    elif view == "weight_strided":
        x = dev((rows, n))
        w = dev((2 * n,), 1)[::2]
        b = dev((n + 1,), 2, 0.5)[1:] if has_bias(op) else None
    elif view == "weight_broadcast":
        x = dev((rows, n))
        w = broadcast_to(backend, dev((1,), 1), (n,))
        b = broadcast_to(backend, dev((1,), 2, 0.5), (n,)) if has_bias(op) else None
    else:
        raise AssertionError(view)
    return x, ns, w, b


@norm_param
@dtype_param
@pytest.mark.parametrize("view", NORM_VIEWS)
def test_norm_views(backend, op, dtype, view):
    for n in (129, 1024):
        x, ns, w, b = norm_view(backend, view, op, dtype, n, 2000 + n)
        nw = backend.to_numpy(w)
        nb = None if b is None else backend.to_numpy(b)
        normalize(backend, op, x, backend.to_numpy(x), ns, w, b, nw, nb)


def test_norm_inputs_unchanged(backend):
    x0, w0, b0 = rand((5, 300), F32, 2100), rand((300,), F32, 2101), rand((300,), F32, 2102)
    x, w, b = backend.asarray(x0), backend.asarray(w0), backend.asarray(b0)
    cufuse.layer_norm(x, 300, w, b)
    cufuse.layer_norm_relu(x, 300, w, b)
    cufuse.rms_norm(x, 300, w)
    cufuse.softmax(x)
    cufuse.log_softmax(x, axis=0)
    backend.synchronize()
    for a, a0 in [(x, x0), (w, w0), (b, b0)]:
        np.testing.assert_array_equal(backend.to_numpy(a), a0)


# ---------------------------------------------------------------------- out=
OUT_LAYOUTS = ["contiguous", "strided", "transposed", "offset"]


def poisoned_out(backend, layout, shape, dtype, value=np.nan):
    """(out, big, outside): ``out`` a view of shape ``shape`` (2-D) into
    ``big``, filled with ``value``; ``outside`` indexes big's cells not in out."""
    r, c = shape
    if layout == "contiguous":
        big = backend.full(shape, value, dtype)
        return big, big, None
    if layout == "strided":
        big = backend.full((r, 2 * c), value, dtype)
        return big[:, ::2], big, (slice(None), slice(1, None, 2))
    if layout == "transposed":
        big = backend.full((c, r), value, dtype)
        return big.T, big, None
    big = backend.full((r * c + 1,), value, dtype)
    return big[1:].reshape(r, c), big, (slice(0, 1),)


@norm_param
@dtype_param
@pytest.mark.parametrize("layout", OUT_LAYOUTS)
def test_norm_out(backend, op, dtype, layout):
    x = rand((37, 129), dtype, 2200)
    out, big, outside = poisoned_out(backend, layout, x.shape, dtype)
    w, b, nw, nb = affine(backend, op, full_affine(op), (129,), dtype, 2210)
    got = normalize(backend, op, backend.asarray(x), x, 129, w, b, nw, nb, out=out)
    assert not np.isnan(got).any()
    if outside is not None:
        assert np.isnan(backend.to_numpy(big)[outside]).all()


@norm_param
@pytest.mark.parametrize("n", [129, 4097])
def test_norm_out_is_x(backend, op, n):
    """In place: out=x gives the same values as out=None."""
    x = rand((9, n), F32, 2220 + n)
    dx = backend.asarray(x)
    w, b, nw, nb = affine(backend, op, full_affine(op), (n,), F32, 2230)
    normalize(backend, op, dx, x, n, w, b, nw, nb, out=dx)


# ------------------------------------------------------------------- errors
NS_BAD_SHAPE = [4, (4,), (5, 4), (3, 4, 5), (), [], 0, -5, (6,), (1, 5), (2, 5), (4, 5, 1)]


@norm_param
def test_normalized_shape_mismatch(backend, op, launches):
    """normalized_shape not x's trailing dims, longer than x.ndim, or empty."""
    x = backend.asarray(rand((4, 5), F32, 2300))
    raises_each(ValueError, NS_BAD_SHAPE, lambda ns: fn(op)(x, ns))
    assert launches == []


@norm_param
def test_normalized_shape_not_ints(backend, op, launches):
    x = backend.asarray(rand((4, 5), F32, 2301))
    raises_each(TypeError, [5.0, (5.0,), "5", None, (4, 5.0), np.float64(5)], lambda ns: fn(op)(x, ns))
    assert launches == []


@norm_param
@pytest.mark.parametrize("param", ["weight", "bias"])
def test_affine_wrong_shape(backend, op, param, launches):
    if param == "bias" and not has_bias(op):
        pytest.skip("rms_norm has no bias")
    x = backend.asarray(rand((4, 5), F32, 2310))
    shapes = [(6,), (4,), (1, 5), (), (4, 5), (5, 1)]
    raises_each(ValueError, shapes, lambda shape: fn(op)(x, 5, **{param: backend.asarray(rand(shape, F32, 2311))}))
    x3 = backend.asarray(rand((3, 4, 5), F32, 2312))       # two normalized dims: (4, 5) only
    raises_each(ValueError, [(5,), (5, 4), (1, 4, 5), (4, 1)],
                lambda shape: fn(op)(x3, (4, 5), **{param: backend.asarray(rand(shape, F32, 2313))}))
    assert launches == []


@norm_param
@pytest.mark.parametrize("param", ["weight", "bias"])
def test_affine_wrong_dtype(backend, op, param, launches):
    if param == "bias" and not has_bias(op):
        pytest.skip("rms_norm has no bias")
    pairs = [(F32, F64), (F32, F16), (F16, F32), (F64, F32), (F32, np.dtype(np.int32)), (F32, np.dtype(np.bool_))]

    def call(pair):
        xdt, pdt = pair
        x = backend.asarray(rand((4, 5), xdt, 2320))
        fn(op)(x, 5, **{param: backend.asarray(np.ones((5,), pdt))})

    raises_each(TypeError, pairs, call)
    assert launches == []


@norm_param
@pytest.mark.parametrize("param", ["weight", "bias"])
def test_affine_wrong_kind(backend, op, param, launches):
    """weight / bias of another array kind, or not an array at all."""
    if param == "bias" and not has_bias(op):
        pytest.skip("rms_norm has no bias")
    x = backend.asarray(rand((4, 5), F32, 2330))
    other = Backend(OTHER_KIND[backend.name]).asarray(rand((5,), F32, 2331))
    raises_each(TypeError, [other, [1.0] * 5, 1.5, "ones"], lambda p: fn(op)(x, 5, **{param: p}))
    assert launches == []


@pytest.mark.cuda
@norm_param
def test_affine_on_another_gpu(op, launches):
    if gpu_count() < 2:
        pytest.skip("needs two GPUs")
    import cupy as cp
    with cp.cuda.Device(0):
        x = cp.asarray(rand((4, 5), F32, 2340))
    with cp.cuda.Device(1):
        w = cp.asarray(rand((5,), F32, 2341))
    with pytest.raises(ValueError):
        fn(op)(x, 5, weight=w)
    assert launches == []


@norm_param
def test_eps_not_a_number(backend, op, launches):
    x = backend.asarray(rand((4, 5), F32, 2350))
    raises_each(TypeError, ["1e-5", None, 1j, [1e-5], (1e-5,)], lambda eps: fn(op)(x, 5, eps=eps))
    assert launches == []


@norm_param
def test_eps_bad_value(backend, op, launches):
    x = backend.asarray(rand((4, 5), F32, 2351))
    raises_each(ValueError, [-1e-5, -1, np.nan, np.inf, -np.inf, np.float32(-0.5), np.float64(np.nan)],
                lambda eps: fn(op)(x, 5, eps=eps))
    assert launches == []


ALL_OPS = NORM_OPS + SOFTMAX_OPS
all_ops_param = pytest.mark.parametrize("op", ALL_OPS)


def call_op(op, x, **kw):
    return fn(op)(x, **kw) if op in SOFTMAX_OPS else fn(op)(x, x.shape[-1], **kw)


@all_ops_param
def test_x_bad_dtype(backend, op, launches):
    bad = [np.int32, np.int64, np.uint8, np.bool_, np.complex64]
    raises_each(TypeError, bad, lambda t: call_op(op, backend.asarray(np.ones((4, 5), dtype=t))))
    assert launches == []


@all_ops_param
def test_x_not_an_array(op):
    raises_each(TypeError, [[[1.0, 2.0]], 3.0, np.float32(2.0), None, "abc"],
                lambda x: fn(op)(x) if op in SOFTMAX_OPS else fn(op)(x, 2))


@all_ops_param
def test_out_wrong_shape(backend, op, launches):
    x = backend.asarray(rand((4, 5), F32, 2370))

    def call(shape):
        out = backend.full(shape, 7.0, F32)
        try:
            call_op(op, x, out=out)
        finally:
            assert (backend.to_numpy(out) == 7.0).all()

    raises_each(ValueError, [(5, 4), (4, 5, 1), (20,), (), (4, 6), (1, 4, 5)], call)
    assert launches == []


@all_ops_param
def test_out_wrong_dtype(backend, op, launches):
    def call(pair):
        xdt, odt = pair
        out = backend.full((4, 5), 7, odt)
        try:
            call_op(op, backend.asarray(rand((4, 5), xdt, 2371)), out=out)
        finally:
            assert (backend.to_numpy(out) == 7).all()

    raises_each(TypeError, [(F32, F64), (F32, F16), (F16, F32), (F64, F32), (F32, np.dtype(np.int32))], call)
    assert launches == []


@all_ops_param
def test_out_wrong_kind(backend, op, launches):
    other = Backend(OTHER_KIND[backend.name])
    x = backend.asarray(rand((4, 5), F32, 2372))
    out = other.full((4, 5), 7.0, F32)
    with pytest.raises(TypeError):
        call_op(op, x, out=out)
    assert (other.to_numpy(out) == 7.0).all()
    with pytest.raises(TypeError):
        call_op(op, x, out=[[0.0] * 5] * 4)
    assert launches == []


@pytest.mark.cuda
@all_ops_param
def test_out_on_another_gpu(op, launches):
    if gpu_count() < 2:
        pytest.skip("needs two GPUs")
    import cupy as cp
    with cp.cuda.Device(0):
        x = cp.asarray(rand((4, 5), F32, 2373))
    with cp.cuda.Device(1):
        out = cp.full((4, 5), 7.0, F32)
    with pytest.raises(ValueError):
        call_op(op, x, out=out)
    assert launches == []


# ================================================================== softmax
def soft(backend, op, x, nx, axis=_UNSET, out=None, tolerance=None):
    kw = {}
    if axis is not _UNSET:
        kw["axis"] = axis
    if out is not None:
        kw["out"] = out
    res = fn(op)(x, **kw)
    if out is not None:
        assert res is out
    check_kind(backend, res, nx.shape, nx.dtype, like=x)
    got = backend.to_numpy(res)
    axis = -1 if axis is _UNSET else axis
    ref = SOFTMAX_REF[op](nx, axis)
    n = nx.shape[axis] if nx.ndim else 1
    check(op, got, ref, nx.dtype, n, tolerance)
    return got


@softmax_param
@dtype_param
@pytest.mark.parametrize("n", ROW_LENGTHS)
def test_softmax_rows(backend, op, dtype, n):
    x = rand((3, 5, n), dtype, 3000 + n, 3.0)
    got = soft(backend, op, backend.asarray(x), x)
    if op == "softmax":     # rows sum to 1
        s = got.astype(np.float64).sum(axis=-1)
        np.testing.assert_allclose(s, 1.0, rtol=0, atol=tol(op, dtype, n)[0])


@softmax_param
@dtype_param
@pytest.mark.parametrize("axis", [-1, 0, 1, 2, -2, -3])
def test_softmax_axes(backend, op, dtype, axis):
    x = rand((6, 7, 33), dtype, 3100, 3.0)
    got = soft(backend, op, backend.asarray(x), x, axis=axis)
    if op == "softmax":
        np.testing.assert_allclose(got.astype(np.float64).sum(axis=axis), 1.0, rtol=0, atol=tol(op, dtype, 33)[0])


def test_softmax_default_axis_is_last(backend):
    x = rand((8, 9), F32, 3110)
    soft(backend, "softmax", backend.asarray(x), x)
    soft(backend, "log_softmax", backend.asarray(x), x)


@softmax_param
@pytest.mark.parametrize("lead", [(), (0,), (1,), (2, 3, 4)], ids=str)
@pytest.mark.parametrize("n", [1, 33, 1024])
def test_softmax_leading_shapes(backend, op, lead, n):
    x = rand(lead + (n,), F32, 3120 + n, 2.0)
    got = soft(backend, op, backend.asarray(x), x)
    assert got.shape == lead + (n,)


@softmax_param
@pytest.mark.parametrize("shape, axis", [((3, 0), -1), ((0, 5), -1), ((0, 5), 0), ((2, 0, 3), 1)], ids=str)
def test_softmax_empty(backend, op, shape, axis):
    x = np.empty(shape, F32)
    got = soft(backend, op, backend.asarray(x), x, axis=axis)
    assert got.shape == shape


@softmax_param
@pytest.mark.parametrize("n", [20000, 32768, 65536, 262144, 300000])
def test_softmax_long_rows(backend, op, n):
    x = rand((2, n), F32, 3200 + n, 3.0)
    got = soft(backend, op, backend.asarray(x), x)
    if op == "softmax":
        np.testing.assert_allclose(got.astype(np.float64).sum(axis=-1), 1.0, rtol=0, atol=1e-4)


@softmax_param
@pytest.mark.parametrize("dtype, n", [(F16, 65536), (F16, 131072), (F64, 65536)], ids=str)
def test_softmax_long_rows_other_dtypes(backend, op, dtype, n):
    x = rand((2, n), dtype, 3210, 3.0)
    soft(backend, op, backend.asarray(x), x)


@softmax_param
@pytest.mark.parametrize("dtype, rows, n, offset", SPLIT_CASES, ids=str)
def test_softmax_split_rows(backend, op, dtype, rows, n, offset):
    cpu_runs_one(backend, (dtype, rows, n, offset) == SPLIT_CASES[2])
    x, nx, out = split_case(backend, dtype, rows, n, offset, 3240 + n, 3.0)
    soft(backend, op, x, nx, out=out)


@softmax_param
@dtype_param
def test_softmax_split_rows_special(backend, op, dtype):
    """Rows split over blocks, where some blocks hold only -inf: row 0 is -inf
    but for its last 1000 elements (0 / -inf there, the rest as usual), row 1
    all -inf (NaN), row 2 one NaN in its last part, row 3 one +inf (NaN rows),
    row 4 ordinary."""
    n = 262144
    x = rand((5, n), dtype, 3250, 3.0)
    x[0, :-1000] = -np.inf
    x[1] = -np.inf
    x[2, n - 5] = np.nan
    x[3, n // 2] = np.inf
    got = soft(backend, op, backend.asarray(x), x)
    assert (got[0, :-1000] == (0.0 if op == "softmax" else -np.inf)).all()
    assert np.isfinite(got[0, -1000:]).all() and np.isfinite(got[4]).all()
    assert np.isnan(got[1:4]).all()


@softmax_param
@pytest.mark.parametrize("n", [4097, 65536])
def test_softmax_long_first_axis(backend, op, n):
    x = rand((n, 3), F32, 3220 + n, 3.0)
    soft(backend, op, backend.asarray(x), x, axis=0)


@pytest.mark.slow
@softmax_param
def test_softmax_very_large(backend, op):
    cpu_runs_one(backend, op == SOFTMAX_OPS[0])
    x = rand((40, 300000), F32, 3230, 3.0)
    soft(backend, op, backend.asarray(x), x)


# ----------------------------------------------------------- special values
@softmax_param
@dtype_param
@pytest.mark.parametrize("n", [1, 33, 4097])
def test_softmax_all_neg_inf_row(backend, op, dtype, n):
    """A row that is all -inf gives NaN for every element of that row (as PyTorch)."""
    x = rand((5, n), dtype, 3300 + n)
    x[1] = -np.inf
    got = soft(backend, op, backend.asarray(x), x)
    assert np.isnan(got[1]).all()
    assert not np.isnan(np.delete(got, 1, axis=0)).any()


@softmax_param
@dtype_param
@pytest.mark.parametrize("n", [1, 33, 4097])
def test_softmax_pos_inf(backend, op, dtype, n):
    """+inf in a row: NaN (inf - inf) for that row, as the float64 reference."""
    x = rand((5, n), dtype, 3310 + n)
    x[3, n // 3] = np.inf
    got = soft(backend, op, backend.asarray(x), x)
    assert np.isnan(got[3]).all()
    assert not np.isnan(np.delete(got, 3, axis=0)).any()


@softmax_param
@dtype_param
@pytest.mark.parametrize("n", [1, 33, 4097])
@pytest.mark.parametrize("axis", [-1, 0])
def test_softmax_nan_row(backend, op, dtype, n, axis):
    x = rand((5, n), dtype, 3320 + n)
    x[2, n // 2] = np.nan
    if axis == 0:
        x = np.ascontiguousarray(x.T)
    got = soft(backend, op, backend.asarray(x), x, axis=axis)
    g = got if axis == -1 else got.T
    assert np.isnan(g[2]).all()
    assert not np.isnan(np.delete(g, 2, axis=0)).any()


@softmax_param
@dtype_param
@pytest.mark.parametrize("n", [2, 33, 4097])
def test_softmax_masked(backend, op, dtype, n):
    """-inf entries (an attention mask) give 0 / -inf there, the rest as usual."""
    x = rand((6, n), dtype, 3330 + n, 2.0)
    mask = np.random.default_rng(3331).random((6, n)) < 0.4
    mask[:, 0] = False                       # no row fully masked
    x[mask] = -np.inf
    got = soft(backend, op, backend.asarray(x), x)
    want = 0.0 if op == "softmax" else -np.inf
    assert (got[mask] == want).all()
    assert np.isfinite(got[~mask]).all()


@softmax_param
@dtype_param
@pytest.mark.parametrize("n", [7, 1024, 4097])
def test_softmax_large_magnitudes(backend, op, dtype, n):
    """x = 1000 * randn: stable (row max subtracted), no inf / NaN."""
    x = rand((6, n), dtype, 3340 + n, 1000.0)
    got = soft(backend, op, backend.asarray(x), x)
    assert not np.isnan(got).any()
    if op == "softmax":
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got.astype(np.float64).sum(axis=-1), 1.0, rtol=0, atol=tol(op, dtype, n)[0])
    else:
        assert np.isfinite(got).all()


@softmax_param
@pytest.mark.parametrize("dtype", [F32, F64], ids=lambda d: d.name)
@pytest.mark.parametrize("scale", [1e4, 1e30])
def test_softmax_huge_magnitudes(backend, op, dtype, scale):
    x = rand((4, 257), dtype, 3350, scale)
    got = soft(backend, op, backend.asarray(x), x)
    assert not np.isnan(got).any()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("n", [33, 4097])
def test_log_softmax_very_negative(backend, dtype, n):
    """log_softmax is accurate where softmax underflows (log(softmax) would be -inf)."""
    scale = 8.0 if dtype == F16 else 3000.0
    x = rand((4, n), dtype, 3360 + n, scale)
    got = soft(backend, "log_softmax", backend.asarray(x), x)
    assert np.isfinite(got).all()
    assert got.min() < (-30 if dtype == F16 else -5000)
    with np.errstate(divide="ignore"):
        naive = np.log(SOFTMAX_REF["softmax"](x).astype(dtype))
    assert np.isneginf(naive).any()           # the check is sensitive


@softmax_param
@dtype_param
@pytest.mark.parametrize("scale", [1.0, 1e4])
def test_softmax_length_one_rows(backend, op, dtype, scale):
    """Rows of length 1: softmax exactly 1, log_softmax exactly 0."""
    x = rand((9, 1), dtype, 3370, scale)
    got = soft(backend, op, backend.asarray(x), x)
    np.testing.assert_array_equal(got, np.full((9, 1), 1.0 if op == "softmax" else 0.0, dtype))
    x = rand((4, 1, 6), dtype, 3371, scale)
    got = soft(backend, op, backend.asarray(x), x, axis=1)
    np.testing.assert_array_equal(got, np.full((4, 1, 6), 1.0 if op == "softmax" else 0.0, dtype))


# ------------------------------------------------------------------ layouts
SOFTMAX_VIEWS = ["transposed", "step", "offset_flat", "sliced_cols", "broadcast_rows", "broadcast_axis",
                 "permuted_3d", "negative_step"]


def softmax_view(backend, view, dtype, seed):
    def dev(shape):
        return backend.asarray(rand(shape, dtype, seed, 3.0))

    if view == "transposed":
        return dev((129, 9)).T
    if view == "step":
        return dev((9, 2 * 129))[:, ::2]
    if view == "offset_flat":
        return dev((1 + 9 * 129,))[1:].reshape(9, 129)
    if view == "sliced_cols":
        return dev((9, 130))[:, 1:]
    if view == "broadcast_rows":
        return broadcast_to(backend, dev((129,)), (9, 129))
    if view == "broadcast_axis":                   # stride 0 along the last axis: uniform rows
        return broadcast_to(backend, dev((9, 1)), (9, 129))
    if view == "permuted_3d":
        return permute(backend, dev((5, 9, 129)), (1, 2, 0))[:, :, 1:]
    if view == "negative_step":
        if not backend.negative_strides:
            pytest.skip("torch tensors have no negative strides")
        return dev((9, 129))[:, ::-1]
    raise AssertionError(view)


@softmax_param
@dtype_param
@pytest.mark.parametrize("view", SOFTMAX_VIEWS)
def test_softmax_views(backend, op, dtype, view):
    x = softmax_view(backend, view, dtype, 3400)
    nx = backend.to_numpy(x)
    for axis in (-1, 0):
        soft(backend, op, x, nx, axis=axis)


# ---------------------------------------------------------------------- out=
@softmax_param
@dtype_param
@pytest.mark.parametrize("layout", OUT_LAYOUTS)
def test_softmax_out(backend, op, dtype, layout):
    x = rand((37, 129), dtype, 3500, 3.0)
    for axis in (-1, 0):
        out, big, outside = poisoned_out(backend, layout, x.shape, dtype, 7.0)
        got = soft(backend, op, backend.asarray(x), x, axis=axis, out=out)
        assert not (got == 7.0).any()
        if outside is not None:
            assert (backend.to_numpy(big)[outside] == 7.0).all()


@softmax_param
@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("n", [129, 4097])
def test_softmax_out_is_x(backend, op, axis, n):
    x = rand((9, n), F32, 3510 + n, 3.0)
    dx = backend.asarray(x)
    soft(backend, op, dx, x, axis=axis, out=dx)


# ------------------------------------------------------------------- errors
@softmax_param
def test_softmax_axis_out_of_range(backend, op, launches):
    cases = [((4, 5), 2), ((4, 5), -3), ((7,), 1), ((2, 3, 4), 3), ((2, 3, 4), -4)]

    def call(case):
        shape, axis = case
        fn(op)(backend.asarray(rand(shape, F32, 3600)), axis=axis)

    raises_each(ValueError, cases, call)
    assert launches == []


@softmax_param
def test_softmax_axis_not_int(backend, op, launches):
    x = backend.asarray(rand((4, 5), F32, 3601))
    raises_each(TypeError, [1.0, None, (0,), (0, 1), "1", np.float64(1.0)], lambda axis: fn(op)(x, axis=axis))
    assert launches == []


# =========================================================== against torch
def _torch_f():
    torch = pytest.importorskip("torch")
    return torch, torch.nn.functional


@pytest.mark.parametrize("op, which", OP_AFFINE, ids=lambda v: str(v))
@pytest.mark.parametrize("shape, ns", [((8, 1024), (1024,)), ((3, 5, 129), (5, 129)), ((4, 4097), (4097,))], ids=str)
def test_norm_matches_torch(backend, op, which, shape, ns):
    torch, F = _torch_f()
    if op == "rms_norm" and not hasattr(F, "rms_norm"):
        pytest.skip("torch.nn.functional.rms_norm needs torch >= 2.4")
    x = rand(shape, F32, 3700, 2.0)
    w, b, nw, nb = affine(backend, op, which, ns, F32, 3710)
    tw = None if nw is None else torch.from_numpy(nw)
    tb = None if nb is None else torch.from_numpy(nb)
    tx = torch.from_numpy(x)
    kw = {k: v for k, v in (("weight", w), ("bias", b)) if v is not None}
    if op == "rms_norm":
        want = F.rms_norm(tx, ns, tw, eps=1e-6)
    else:
        want = F.layer_norm(tx, ns, tw, tb, eps=1e-5)
        if op == "layer_norm_relu":
            want = F.relu(want)
    got = backend.to_numpy(fn(op)(backend.asarray(x), ns, **kw))
    rtol, atol = tol(op, F32, math.prod(ns))
    np.testing.assert_allclose(got, want.numpy(), rtol=rtol, atol=atol)


@softmax_param
@pytest.mark.parametrize("shape, axis", [((8, 1024), -1), ((6, 7, 33), 1), ((129, 5), 0), ((2, 65536), -1)], ids=str)
def test_softmax_matches_torch(backend, op, shape, axis):
    torch, F = _torch_f()
    x = rand(shape, F32, 3720, 3.0)
    want = getattr(F, op)(torch.from_numpy(x), dim=axis).numpy()
    got = backend.to_numpy(fn(op)(backend.asarray(x), axis=axis))
    rtol, atol = tol(op, F32, shape[axis])
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def test_torch_special_rows_agree(backend):
    """All -inf / +inf / NaN rows: NaN where torch gives NaN; relu keeps NaN as torch.relu."""
    torch, F = _torch_f()
    x = rand((4, 33), F32, 3730)
    x[0] = -np.inf
    x[1, 5] = np.inf
    x[2, 7] = np.nan
    tx = torch.from_numpy(x)
    for op in SOFTMAX_OPS:
        want = getattr(F, op)(tx, dim=-1).numpy()
        got = backend.to_numpy(fn(op)(backend.asarray(x)))
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    y = rand((3, 33), F32, 3731)
    y[1, 3] = np.nan
    want = F.relu(F.layer_norm(torch.from_numpy(y), (33,))).numpy()
    got = backend.to_numpy(cufuse.layer_norm_relu(backend.asarray(y), 33))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))


# ============================================================ GPU specifics
@pytest.mark.parametrize("op", ALL_OPS)
def test_gpu_launches_are_seen(backend, op, launches):
    """The launch recorder sees these ops' kernels (so ``launches == []``
    above means something on the GPU backends)."""
    if not backend.gpu:
        pytest.skip("GPU backends only")
    x = rand((8, 100), F32, 3800)
    call_op(op, backend.asarray(x))
    assert len(launches) >= 1


@pytest.mark.cuda
@pytest.mark.parametrize("op", ALL_OPS)
@pytest.mark.parametrize("shape", [(2048, 4096), (8, 262144)], ids=str)
def test_torch_cuda_uses_current_stream(op, shape, launches):
    """Input produced by a long torch op on a side stream is read correctly when
    the op is called in that stream's context; every kernel is queued on it
    (262144 columns: rows split over blocks, with a workspace zeroed there)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    base = torch.from_numpy(rand(shape, F32, 3810, 0.5)).cuda()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        a = base.clone()
        for _ in range(20):
            a.add_(0.125)
        y = call_op(op, a)
    s.synchronize()
    assert isinstance(y, torch.Tensor) and y.device == a.device
    assert launches and all(ln.stream is not None and ln.stream.ptr == s.cuda_stream for ln in launches)
    nx = a.cpu().numpy()
    n = shape[-1]
    ref = SOFTMAX_REF[op](nx) if op in SOFTMAX_OPS else NORM_REF[op](nx, n)
    check(op, y.cpu().numpy(), ref, F32, n)


@pytest.mark.cuda
@pytest.mark.parametrize("op", ALL_OPS)
@dtype_param
@pytest.mark.parametrize("n", [33, 1024, 4097])
def test_gpu_matches_fallback(op, dtype, n):
    import cupy as cp
    x = rand((17, n), dtype, 3820 + n, 2.0)
    cpu = call_op(op, x)
    gpu = cp.asnumpy(call_op(op, cp.asarray(x)))
    assert gpu.dtype == cpu.dtype and gpu.shape == cpu.shape
    rtol, atol = tol(op, dtype, n)
    np.testing.assert_allclose(gpu.astype(np.float64), cpu.astype(np.float64), rtol=2 * rtol, atol=2 * atol)
