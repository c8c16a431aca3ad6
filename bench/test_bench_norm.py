"""Benchmarks of cufuse's row normalizations, softmax and reductions (issue 4).

* test_norm: layer_norm (weight, bias), layer_norm_relu (weight, bias),
  rms_norm (weight), softmax and log_softmax (axis -1) on (rows, cols)
  C-contiguous arrays, shapes 4096x768, 16384x1000, 16384x1024, 8192x4096,
  4096x16384, 1024x65536, 256x262144, float32 and float16.
* test_reduction: sum_squared and mean_abs over axis -1 and axis 0 of a
  6250x8000 array (exactly 50M elements) and of an "L2" array (8000 columns,
  as many rows as fit in half of the device's L2, read at run time), float32
  and float16.

cufuse (out=) against the CuPy chain, torch eager and torch.compile, each peer
skipped on its own when unavailable, and NumPy on the CPU ("numpy (CPU)": the
CuPy chain's steps on host copies) at 4096x768 and at the reductions' "L2"
size (see NUMPY_MAX). The reductions also against cupy.fuse (one sum over the
axis with elementwise steps around it); the norms and softmaxes have no
cupy.fuse peer (a row statistic broadcast back over its row: after its one
reduction, cupy.fuse's steps see the reduced values only, never x again).
Same method as test_bench_elementwise.py
and test_bench_fused.py (CUDA-event medians, L2 flushed, % of the same run's
copy bandwidth; see bench/README.md). Every result is checked on every element,
on the same inputs, against a float64 CuPy reference before it is timed. The
issue's targets go to the summary's Targets table as met/MISSED and never fail
a test.

Run from the repository root:  PYTHONPATH=$PWD python3 -m pytest bench/test_bench_norm.py --benchmark-only -q
Environment: CUFUSE_BENCH_NORM_COMPILE=all times torch.compile at every shape for
layer_norm, softmax and log_softmax too (default: only at COMPILE_SHAPES, see below);
CUFUSE_BENCH_READ_BASIS=half-copy uses the "read bandwidth = copy GB/s / 2"
reading of the reductions' target (default: a measured read ceiling, see read_ceiling).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import cufuse

import _common
from _common import as_cupy, cp, F, first_call, L2, measure, need_torch, torch, TORCH_REASON, torch_stream  # noqa: F401

pytestmark = _common.pytestmark

# Sorted by row length; the three 67M shapes share one input array (reshaped).
SHAPES = ((4096, 768), (16384, 1000), (16384, 1024), (8192, 4096), (4096, 16384), (1024, 65536), (256, 262144))
RED_SHAPE = (6250, 8000)   # 50,000,000 elements exactly
RED_SHAPES = (RED_SHAPE, L2)   # "L2": RED_SHAPE's 8000 columns, rows from the device (red_shape)
DTYPES = ("float32", "float16")
IMPLS = ("cufuse", "cupy-chain", "torch-eager", "torch.compile")
RED_IMPLS = ("cufuse", "cupy-chain", "cupy.fuse", "torch-eager", "torch.compile")   # the reductions'
# The CPU peer (NumPy, the CuPy chain's steps on host copies) where its time stays
# reasonable (a float16 NumPy chain runs ~10 ns per element and step): the norms at
# shapes up to 4M elements (only 4096x768, 3.1M) and the reductions at "L2" (~6.5M
# float32 / 13M float16 elements on a 50 MiB L2; one pass each, ~0.1 s a call at worst).
NUMPY_MAX = 4_000_000
DT_SHORT = {"float32": "f32", "float16": "f16"}
EPS_LN, EPS_RMS = 1e-5, 1e-6   # passed explicitly everywhere (F.rms_norm's default eps is finfo.eps)

# (rtol, atol) against the float64 reference: |got - ref| <= atol + rtol |ref| on every element.
TOL = {"float32": (1e-4, 1e-4), "float16": (1e-2, 2e-2)}
# softmax values are ~1/cols (down to ~1e-8 at 262144 columns): a tiny atol, so the
# check stays relative; in float16 most of them are subnormal (spacing 2^-24).
TOL_SOFTMAX = {"float32": (1e-4, 1e-10), "float16": (1e-2, 2.0 ** -23)}
# (log_softmax's values, about -2 to -20 here, are checked with TOL.)
# Sums of ~8000 squares / means of ~6250 |x|: relative checks (float16: the output's rounding).
TOL_RED = {"float32": (1e-4, 1e-6), "float16": (2e-3, 1e-3)}

# torch.compile(dynamic=False) recompiles for every (function, dtype, shape): ~1-2 s of
# Inductor/Triton work each, the bulk of this file's run time. It is run at every shape
# for the ops with a torch.compile target (layer_norm_relu, rms_norm) and for the
# reductions; layer_norm, softmax and log_softmax (no torch.compile target) get it
# at these three shapes only (short, long, very long rows), or everywhere with
# CUFUSE_BENCH_NORM_COMPILE=all.
COMPILE_SHAPES = ((16384, 1024), (4096, 16384), (256, 262144))
COMPILE_ALL = os.environ.get("CUFUSE_BENCH_NORM_COMPILE", "").lower() == "all"
NORMS = ("layer_norm", "layer_norm_relu", "rms_norm", "softmax", "log_softmax")
COMPILE_TARGETED = ("layer_norm_relu", "rms_norm")

# ---- the targets (judged in the summary, never enforced); log_softmax
# (not an op of issue 4) has none: not in NORM_RATIOS, no entry in the Targets table.
PCT_F32, PCT_F16, PCT_HUGE = 80.0, 75.0, 65.0   # % of copy: 1024 <= cols <= 65536; cols = 262144
NORM_RATIOS = {  # op: (min vs torch.compile, min vs torch eager for float32, for float16)
    "layer_norm": (None, None, None),
    "layer_norm_relu": (1.2, 1.5, 1.5),
    "rms_norm": (1.2, None, None),
    "softmax": (None, 1.0, 1.3),
}
RED_READ_FRACTION = 0.85   # reductions: >= 85% of the read bandwidth
RED_VS_EAGER = 1.5
READ_BASIS = os.environ.get("CUFUSE_BENCH_READ_BASIS", "measured")   # or "half-copy"


def shape_label(shape):
    return shape if shape == L2 else "x".join(str(d) for d in shape)


def norm_cases():
    """Grouped by op, then dtype, then shape (the order of the summary table)."""
    out = []
    for op in NORMS:
        for dt in DTYPES:
            for rows, cols in SHAPES:
                for impl in IMPLS + (("numpy",) if rows * cols <= NUMPY_MAX else ()):
                    if (impl == "torch.compile" and op not in COMPILE_TARGETED and not COMPILE_ALL
                            and (rows, cols) not in COMPILE_SHAPES):
                        continue
                    out.append(pytest.param(op, dt, rows, cols, impl,
                                            id=f"{op}-{DT_SHORT[dt]}-{rows}x{cols}-{impl}",
                                            marks=[pytest.mark.slow] if rows * cols >= 20_000_000 else []))
    return out


def reduction_cases():
    """The 50M shape (slow), then "L2" (with the NumPy peer)."""
    return [pytest.param(op, dt, shape, axis, impl,
                         id=f"{op}-{DT_SHORT[dt]}-{shape_label(shape)}-axis{axis}-{impl}",
                         marks=[pytest.mark.slow] if shape != L2 else [])
            for op in ("sum_squared", "mean_abs") for dt in DTYPES for shape in RED_SHAPES for axis in (-1, 0)
            for impl in RED_IMPLS + (("numpy",) if shape == L2 else ())]


# ----------------------------------------------------------------- helpers
def check(what, got, ref, rtol, atol):
    """Every element of ``got`` (CuPy, any float dtype) against the float64
    reference, on the device: |got - ref| <= atol + rtol |ref|, NaN fails.
    Returns (max abs error, max relative error), the relative error taken
    against max(|ref|, atol / rtol) (where the absolute tolerance takes over)."""
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    err = cp.abs(got.astype(cp.float64) - ref)
    bad = ~(err <= atol + rtol * cp.abs(ref))
    max_abs = float(err.max())
    max_rel = float((err / cp.maximum(cp.abs(ref), atol / rtol)).max())
    nbad = int(cp.count_nonzero(bad))
    if nbad:
        i = int(cp.flatnonzero(bad.ravel())[0])
        g, r = float(got.ravel()[i]), float(ref.ravel()[i])
        raise AssertionError(f"{what}: {nbad} of {got.size} elements differ from the float64 reference "
                             f"(rtol {rtol:g}, atol {atol:g}); first at flat index {i}: got {g!r}, "
                             f"expected {r!r}; max abs error {max_abs:.3g}, max rel error {max_rel:.3g}")
    return max_abs, max_rel


def add_target(gpu, op, dtype, n, min_pct=None, min_vs_compile=None, min_vs_eager=None):
    """One entry of the summary's Targets table (test_bench_fused.py's mechanism)."""
    if min_pct is None and min_vs_compile is None and min_vs_eager is None:
        return
    if any((t["op"], t["dtype"], t["n"]) == (op, dtype, n) for t in gpu.targets):
        return
    gpu.targets.append({"op": op, "dtype": dtype, "n": n, "min_pct": min_pct,
                        "min_vs_compile": min_vs_compile, "min_vs_eager": min_vs_eager})


_COMPILED: dict = {}


def compiled(fn):
    """torch.compile(fn, dynamic=False): a static kernel for each shape, the
    strongest form of the peer (compiled by the untimed correctness call).

    Each norm function meets 7 shapes x 2 dtypes = 14 guard sets, over
    Dynamo's default per-function recompile limit (8), beyond which it would
    silently run eagerly: the limit is raised to 64 (it only ever goes up, so
    the other bench files are unaffected)."""
    if fn not in _COMPILED:
        cfg = torch._dynamo.config
        name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
        setattr(cfg, name, max(getattr(cfg, name), 64))
        _COMPILED[fn] = torch.compile(fn, dynamic=False)
    return _COMPILED[fn]


# ----------------------------------------------------------------- norms: peers
# One module-level function per op (distinct code objects for Dynamo).
def t_layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, EPS_LN)


def t_layer_norm_relu(x, w, b):
    return torch.relu(F.layer_norm(x, (x.shape[-1],), w, b, EPS_LN))


def t_rms_norm(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, EPS_RMS)


def t_softmax(x):
    return torch.softmax(x, -1)


def t_log_softmax(x):
    return torch.log_softmax(x, -1)


# The unfused chains, written once for CuPy (GPU peer) and NumPy (CPU peer):
# row statistics accumulated in float32 (explicit dtype=, then the small
# (rows, 1) result cast back), the full-size steps in x's dtype.
def _row_mean(xp, v):
    return v.mean(-1, keepdims=True, dtype=xp.float32).astype(v.dtype, copy=False)


def _layer_norm(xp, x, w, b):
    xc = x - _row_mean(xp, x)
    var = (xc * xc).mean(-1, keepdims=True, dtype=xp.float32)
    rstd = (1 / xp.sqrt(var + EPS_LN)).astype(x.dtype, copy=False)
    return xc * rstd * w + b


def _rms_norm(xp, x, w):
    ms = (x * x).mean(-1, keepdims=True, dtype=xp.float32)
    r = (1 / xp.sqrt(ms + EPS_RMS)).astype(x.dtype, copy=False)
    return x * r * w


def _softmax(xp, x):
    e = xp.exp(x - x.max(-1, keepdims=True))
    # a float16 row sum can pass 65504
    return (e / e.sum(-1, keepdims=True, dtype=xp.float32)).astype(x.dtype, copy=False)


def _log_softmax(xp, x):
    s = x - x.max(-1, keepdims=True)
    # the row's log-sum-exp from a float32 sum (a float16 one can pass 65504), cast back
    lse = xp.log(xp.exp(s).sum(-1, keepdims=True, dtype=xp.float32)).astype(x.dtype, copy=False)
    return s - lse


def _chains(xp):
    """layer_norm, layer_norm_relu, rms_norm, softmax, log_softmax on array module ``xp``."""
    return (lambda x, w, b: _layer_norm(xp, x, w, b),
            lambda x, w, b: xp.maximum(_layer_norm(xp, x, w, b), 0),
            lambda x, w: _rms_norm(xp, x, w),
            lambda x: _softmax(xp, x),
            lambda x: _log_softmax(xp, x))


# cp is None without a GPU: never called then
cp_layer_norm, cp_layer_norm_relu, cp_rms_norm, cp_softmax, cp_log_softmax = _chains(cp)
np_layer_norm, np_layer_norm_relu, np_rms_norm, np_softmax, np_log_softmax = _chains(np)



_REF: dict = {}


def norm_reference(op, x, w, b):
    """float64 CuPy reference for the same inputs (the latest one is kept: the
    four implementations of a case share it)."""
    key = (op, x.shape, x.dtype)
    if _REF.get("key") != key:
        _REF.clear()
        x64 = x.astype(cp.float64)
        if op in ("softmax", "log_softmax"):
            s = x64 - x64.max(-1, keepdims=True)
            e = cp.exp(s)
            ref = e / e.sum(-1, keepdims=True) if op == "softmax" else s - cp.log(e.sum(-1, keepdims=True))
        elif op == "rms_norm":
            ref = x64 / cp.sqrt((x64 * x64).mean(-1, keepdims=True) + EPS_RMS) * w.astype(cp.float64)
        else:
            xc = x64 - x64.mean(-1, keepdims=True)
            ref = xc / cp.sqrt((xc * xc).mean(-1, keepdims=True) + EPS_LN) * w.astype(cp.float64) \
                + b.astype(cp.float64)
            if op == "layer_norm_relu":
                ref = cp.maximum(ref, 0)
        _REF.update(key=key, ref=ref)
    return _REF["ref"]


def norm_targets(op, dtype, cols):
    """(min % of copy, min vs torch.compile, min vs torch eager) of the issue
    (none for an op outside NORM_RATIOS: log_softmax)."""
    if op not in NORM_RATIOS:
        return None, None, None
    if cols == 262144:
        pct = PCT_HUGE
    elif 1024 <= cols <= 65536:
        pct = PCT_F32 if dtype == "float32" else PCT_F16
    else:
        pct = None   # 768 and 1000 columns: no bandwidth target (still in the table if a ratio has one)
    vs_compile, eager32, eager16 = NORM_RATIOS[op]
    return pct, vs_compile, eager32 if dtype == "float32" else eager16


# ----------------------------------------------------------------- norms
@pytest.mark.parametrize("op,dtype,rows,cols,impl", norm_cases())
def test_norm(benchmark, gpu, op, dtype, rows, cols, impl):
    name = f"{op}[{rows}x{cols}]"   # the shape is in the op: three shapes have 2^26 elements
    n = rows * cols
    benchmark.group = f"{name} {dtype}"
    need_torch(gpu, impl)
    if op == "rms_norm" and impl.startswith("torch") and not TORCH_REASON and not hasattr(F, "rms_norm"):
        gpu.skip(f"{impl} (rms_norm)", f"torch {torch.__version__} has no torch.nn.functional.rms_norm")
    gpu.copy_bandwidth()
    a, wa, ba = gpu.inputs(n, dtype)   # random normal, fixed seeds
    x = a.reshape(rows, cols)
    w = (1 + 0.5 * wa[:cols]).astype(dtype)  # weight around 1, bias around 0 (fresh arrays)
    b = (0.5 * ba[:cols]).astype(dtype)
    params = {"layer_norm": (w, b), "layer_norm_relu": (w, b), "rms_norm": (w,), "softmax": (),
              "log_softmax": ()}[op]
    eps = EPS_RMS if op == "rms_norm" else EPS_LN

    stream = cp.cuda.get_current_stream()
    out = None
    if impl == "cufuse":
        f = getattr(cufuse, op)
        out = cp.empty_like(x)
        if op in ("softmax", "log_softmax"):
            call = lambda: f(x, axis=-1, out=out)  # noqa: E731
        else:
            call = lambda: f(x, cols, *params, eps=eps, out=out)  # noqa: E731
    elif impl == "cupy-chain":
        f = {"layer_norm": cp_layer_norm, "layer_norm_relu": cp_layer_norm_relu,
             "rms_norm": cp_rms_norm, "softmax": cp_softmax, "log_softmax": cp_log_softmax}[op]
        call = lambda: f(x, *params)  # noqa: E731
    elif impl == "numpy":   # on host copies of the same inputs
        f = {"layer_norm": np_layer_norm, "layer_norm_relu": np_layer_norm_relu,
             "rms_norm": np_rms_norm, "softmax": np_softmax, "log_softmax": np_log_softmax}[op]
        hargs = [v.get() for v in (x, *params)]
        call = lambda: f(*hargs)  # noqa: E731
    else:
        tx = torch.from_dlpack(x)
        targs = (tx, *(torch.from_dlpack(p) for p in params))
        f = {"layer_norm": t_layer_norm, "layer_norm_relu": t_layer_norm_relu,
             "rms_norm": t_rms_norm, "softmax": t_softmax, "log_softmax": t_log_softmax}[op]
        f = f if impl == "torch-eager" else compiled(f)
        call = lambda: f(*targs)  # noqa: E731
        stream = torch_stream(gpu)

    res = first_call(gpu, impl, call)
    res = out if out is not None else as_cupy(res)
    assert res.shape == x.shape and res.dtype == x.dtype, (res.shape, res.dtype)
    rtol, atol = (TOL_SOFTMAX if op == "softmax" else TOL)[dtype]
    max_abs, max_rel = check(f"{name} {dtype} {impl}", res, norm_reference(op, x, w, b), rtol, atol)
    del res

    wbytes = sum(p.nbytes for p in params)
    nbytes = 2 * x.nbytes + wbytes   # x read once + y written once + weight (and bias)
    measure(gpu, benchmark, op=name, dtype=dtype, n=n, impl=impl, call=call, stream=stream,
            nbytes=nbytes, out_dtype=dtype,
            extra={"shape": [rows, cols], "elements": n, "weight_bytes": wbytes,
                   "max_abs_err": max_abs, "max_rel_err": max_rel})
    if impl == "cufuse":
        pct, vs_compile, vs_eager = norm_targets(op, dtype, cols)
        add_target(gpu, name, dtype, n, pct, vs_compile, vs_eager)


# ----------------------------------------------------------------- reductions
# The reductions read x and write a few KB, so their bytes are x.nbytes +
# out.nbytes and "% copy" compares read bytes with the copy's read + written
# bytes. The target is ">= 85% of the read bandwidth". HBM's bandwidth is
# shared by reads and writes: a pure read stream is not capped at half of the
# copy figure, it reaches about the copy figure itself (or more). So the read
# bandwidth is measured in the same run (read_ceiling: a 1 GiB read-only
# kernel and CuPy's sum, the faster) and the target, in the table's "% copy"
# units, is 85% x read GB/s / copy GB/s (e.g. ~90% of copy when reads
# stream 6% faster than a copy). CUFUSE_BENCH_READ_BASIS=half-copy takes the
# read bandwidth as copy / 2 instead: a fixed target of 42.5% of copy (loose:
# a reduction at that figure runs at half the speed the memory allows).
READ_BYTES = 1 << 30
_READ: dict = {}


def read_ceiling(gpu) -> dict:
    """Device read bandwidth, measured once (like copy_bandwidth: 1 GiB, timed
    as the ops are, median of 20): a read-only kernel and ``src.sum()``, the
    faster."""
    if not _READ:
        copy = gpu.copy_bandwidth()
        s = cp.cuda.get_current_stream()
        src = cp.random.default_rng(11).standard_normal(READ_BYTES // 4, dtype=np.float32)
        sink = cp.zeros(1, np.float32)
        res = {}
        try:
            from cufuse import _timing  # its read-only kernel: the L2 flush's
            t = gpu.gpu_time_us(lambda: _timing.read_pass(src, sink, s), s, 20, 3)["gpu_us"] / 1e3
            res["kernel_GBps"] = READ_BYTES / (t * 1e-3) / 1e9
        except Exception as e:  # never expected; the CuPy sum still gives a figure
            res["kernel_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        t = gpu.gpu_time_us(lambda: src.sum(), s, 20, 3)["gpu_us"] / 1e3
        res["cupy_sum_GBps"] = READ_BYTES / (t * 1e-3) / 1e9
        del src, sink
        gpu.sync()
        cp.get_default_memory_pool().free_all_blocks()
        res["GBps"] = max(res.get("kernel_GBps", 0.0), res["cupy_sum_GBps"])
        res["pct_of_copy"] = 100.0 * res["GBps"] / copy["GBps"]
        _READ.update(res)
    return _READ


def red_target_pct(gpu):
    """The reductions' ">= 85% of read bandwidth", in % of copy (see above)."""
    if READ_BASIS == "half-copy":
        return 100.0 * RED_READ_FRACTION / 2
    return round(RED_READ_FRACTION * read_ceiling(gpu)["pct_of_copy"], 1)


def t_sum_squared_last(x):
    return (x * x).sum(-1)


def t_sum_squared_first(x):
    return (x * x).sum(0)


def t_mean_abs_last(x):
    return x.abs().mean(-1)


def t_mean_abs_first(x):
    return x.abs().mean(0)


T_RED = {("sum_squared", -1): t_sum_squared_last, ("sum_squared", 0): t_sum_squared_first,
         ("mean_abs", -1): t_mean_abs_last, ("mean_abs", 0): t_mean_abs_first}


def cp_sum_squared(x, axis):
    return (x * x).sum(axis, dtype=cp.float32).astype(x.dtype, copy=False)


def cp_mean_abs(x, axis):
    return cp.abs(x).mean(axis, dtype=cp.float32).astype(x.dtype, copy=False)


def np_sum_squared(x, axis):   # the NumPy peers: the same chains
    return (x * x).sum(axis, dtype=np.float32).astype(x.dtype, copy=False)


def np_mean_abs(x, axis):
    return np.abs(x).mean(axis, dtype=np.float32).astype(x.dtype, copy=False)


# The cupy.fuse peers: the chains above as one reduction kernel. cupy.fuse takes
# one reduction (cp.sum over an axis) with elementwise steps before and after it;
# its tracer has no .sum/.mean array methods and no mean, and drops cp.sum's
# dtype= (a float16 sum with dtype=float32 comes back float16). So they are
# written here: the elementwise step in x's dtype, cast to float32 before the sum
# (the chains' float32 accumulation), the mean as sum / count in float32, the
# result cast back to x's dtype. axis and count are Python constants: one fused
# function per (op, axis, count).
_FUSED: dict = {}


def fused_reduction(gpu, op, axis, count):
    """cupy.fuse of ``op`` over ``axis`` (>= 0) of a 2-D array, ``count``
    elements per output (mean_abs's divisor); cached."""
    if not hasattr(cp, "fuse"):
        gpu.skip("cupy.fuse", "this CuPy has no cupy.fuse")
    key = (op, axis, count)
    if key not in _FUSED:
        if op == "sum_squared":
            def fn(x):
                return cp.sum((x * x).astype(cp.float32, copy=False), axis=axis).astype(x.dtype, copy=False)
        else:
            def fn(x):
                s = cp.sum(cp.abs(x).astype(cp.float32, copy=False), axis=axis)
                return (s / float(count)).astype(x.dtype, copy=False)
        _FUSED[key] = cp.fuse(kernel_name=f"bench_{op}_axis{axis}")(fn)
    return _FUSED[key]


def red_shape(gpu, shape, dtype):
    """(rows, cols) of a case: RED_SHAPE, or for "L2" its 8000 columns and as
    many rows as fit in half of this device's L2 with both outputs (one
    element per row, axis -1; one per column, axis 0): the same shape for both
    axes (GpuBench.l2_elements)."""
    if shape != L2:
        return shape
    cols, isz = RED_SHAPE[1], np.dtype(dtype).itemsize
    n = gpu.l2_elements(isz * (1 + 1 / cols), multiple=cols, fixed_bytes=isz * cols)
    return n // cols, cols


def red_reference(op, x, axis):
    key = (op, x.shape, x.dtype, axis)
    if _REF.get("key") != key:
        _REF.clear()
        x64 = x.astype(cp.float64)
        ref = (x64 * x64).sum(axis) if op == "sum_squared" else cp.abs(x64).mean(axis)
        _REF.update(key=key, ref=ref)
    return _REF["ref"]


@pytest.mark.parametrize("op,dtype,shape,axis,impl", reduction_cases())
def test_reduction(benchmark, gpu, op, dtype, shape, axis, impl):
    name = f"{op}[axis{axis}]"
    benchmark.group = f"{name} {shape_label(shape)} {dtype}"
    need_torch(gpu, impl)
    rows, cols = red_shape(gpu, shape, dtype)
    n = rows * cols
    gpu.copy_bandwidth()
    x = gpu.inputs(n, dtype)[0].reshape(rows, cols)
    out_shape = (rows,) if axis == -1 else (cols,)

    stream = cp.cuda.get_current_stream()
    out = None
    if impl == "cufuse":
        f = getattr(cufuse, op)
        out = cp.empty(out_shape, dtype)
        call = lambda: f(x, axis=axis, out=out)  # noqa: E731
    elif impl == "cupy-chain":
        f = cp_sum_squared if op == "sum_squared" else cp_mean_abs
        call = lambda: f(x, axis)  # noqa: E731
    elif impl == "cupy.fuse":
        f = fused_reduction(gpu, op, axis % x.ndim, x.shape[axis])
        call = lambda: f(x)  # noqa: E731
    elif impl == "numpy":   # on a host copy of the same input
        f, hx = (np_sum_squared if op == "sum_squared" else np_mean_abs), x.get()
        call = lambda: f(hx, axis)  # noqa: E731
    else:
        tx = torch.from_dlpack(x)
        f = T_RED[(op, axis)]
        f = f if impl == "torch-eager" else compiled(f)
        call = lambda: f(tx)  # noqa: E731
        stream = torch_stream(gpu)

    res = first_call(gpu, impl, call, name)
    res = out if out is not None else as_cupy(res)
    assert res.shape == out_shape and res.dtype == x.dtype, (res.shape, res.dtype)
    rtol, atol = TOL_RED[dtype]
    max_abs, max_rel = check(f"{name} {dtype} {impl}", res, red_reference(op, x, axis), rtol, atol)
    out_nbytes = res.nbytes
    del res

    ceiling = read_ceiling(gpu) if READ_BASIS != "half-copy" else {}
    nbytes = x.nbytes + out_nbytes   # x read once + the small output written once
    row = measure(gpu, benchmark, op=name, dtype=dtype, n=n, impl=impl, call=call, stream=stream,
                  nbytes=nbytes, out_dtype=dtype,
                  extra={"shape": [rows, cols], "axis": axis, "elements": n, "size_id": shape_label(shape),
                         "max_abs_err": max_abs, "max_rel_err": max_rel,
                         "read_ceiling_GBps": ceiling.get("GBps"), "read_basis": READ_BASIS})
    if ceiling and impl != "numpy":   # a device figure: not for the CPU peer
        row["pct_of_read_ceiling"] = 100.0 * row["GBps"] / ceiling["GBps"]
        benchmark.extra_info["pct_of_read_ceiling"] = row["pct_of_read_ceiling"]
        benchmark.extra_info["read_ceiling"] = dict(ceiling)
    if impl == "cufuse" and shape != L2:   # the targets are for the 50M shape
        add_target(gpu, name, dtype, n, red_target_pct(gpu), None, RED_VS_EAGER)
