"""Benchmarks of cufuse's fused elementwise ops.

* test_bandwidth: add_relu, mul_tanh, add_mul_exp, fma at 100K/1M/20M/50M
  elements and at "L2" (read from the device at run time: the inputs and the
  output fill at most half of its L2), float32 and float16, cufuse (out=)
  against the CuPy ufunc chain, cupy.fuse, torch eager and torch.compile, and
  up to 1M NumPy on the CPU.
* test_latency: launch overhead at 100K elements against a bare RawKernel.

Run from the repository root:  PYTHONPATH=$PWD python3 -m pytest bench --benchmark-only -q
"""
from __future__ import annotations

import numpy as np
import pytest

import cufuse

import _common
from _common import as_cupy, cp, first_call, L2, max_errors, need_torch, size_id, slow_if_large, torch, TORCH_REASON, torch_stream  # noqa: F401

pytestmark = _common.pytestmark

SIZES = (100_000, 1_000_000, 20_000_000, 50_000_000, L2)   # "L2": GpuBench.l2_elements, in the test
DTYPES = ("float32", "float16")
IMPLS = ("cufuse", "cupy-chain", "cupy.fuse", "torch-eager", "torch.compile")
TOL = {"float32": (1e-4, 1e-4), "float16": (1e-2, 2e-2)}  # (rtol, atol) vs float64 NumPy


# ----------------------------------------------------------------- the ops
def cp_add_relu(a, b):
    return cp.maximum(a + b, 0)


def cp_mul_tanh(a, b):
    return cp.tanh(a * b)


def cp_add_mul_exp(x, y):
    return cp.exp((x + y) * 2)


def cp_fma(q, k, v):
    return q * k + v


def t_add_relu(a, b):
    return torch.relu(a + b)


def t_mul_tanh(a, b):
    return torch.tanh(a * b)


def t_add_mul_exp(x, y):
    return torch.exp((x + y) * 2)


def t_fma(q, k, v):
    return q * k + v


OPS = {  # name: (arity, cufuse op, CuPy chain, torch eager, float64 NumPy reference)
    "add_relu": (2, cufuse.add_relu, cp_add_relu, t_add_relu, lambda a, b: np.maximum(a + b, 0.0)),
    "mul_tanh": (2, cufuse.mul_tanh, cp_mul_tanh, t_mul_tanh, lambda a, b: np.tanh(a * b)),
    "add_mul_exp": (2, cufuse.add_mul_exp, cp_add_mul_exp, t_add_mul_exp, lambda x, y: np.exp((x + y) * 2.0)),
    "fma": (3, cufuse.fma, cp_fma, t_fma, lambda q, k, v: q * k + v),
}

_FUSED: dict = {}
_COMPILED: dict = {}


def fused(op):
    if op not in _FUSED:
        _FUSED[op] = cp.fuse(OPS[op][2])
    return _FUSED[op]


def compiled(op):
    if op not in _COMPILED:
        _COMPILED[op] = torch.compile(OPS[op][3])
    return _COMPILED[op]


def torch_dtype(dtype):
    return {"float32": torch.float32, "float16": torch.float16}[dtype]


# ----------------------------------------------------------------- checking
def check_close(op, ins, res, dtype):
    """Compare ``res`` with a float64 NumPy reference computed from the same
    inputs, on about 65K strided samples plus the last 1024 elements."""
    n = res.size
    assert n == ins[0].size
    step = max(1, n // 65536)
    idx = cp.unique(cp.concatenate([cp.arange(0, n, step), cp.arange(max(0, n - 1024), n)]))
    got = res[idx].get().astype(np.float64)
    args = [x[idx].get().astype(np.float64) for x in ins]
    with np.errstate(all="ignore"):
        ref = OPS[op][4](*args)
    # exp overflows float16 near x + y > 5.5: compare only where the reference
    # fits the dtype with room; beyond it, the result must be huge or inf.
    fmax = float(np.finfo(dtype).max)
    fits = np.abs(ref) < 0.5 * fmax
    rtol, atol = TOL[dtype]
    np.testing.assert_allclose(got[fits], ref[fits], rtol=rtol, atol=atol,
                               err_msg=f"{op} {dtype} n={n}: result differs from the float64 reference")
    assert np.all(np.abs(got[~fits]) > 0.25 * fmax), f"{op} {dtype}: wrong values where the result overflows"
    return max_errors(got[fits], ref[fits], atol / rtol)


# ----------------------------------------------------------------- bandwidth
NUMPY_MAX = 1_000_000  # the CPU peer (NumPy, same chain, same dtype) up to this size (not at "L2")
CASES = [pytest.param(op, dt, n, impl, id=f"{op}-{dt}-{size_id(n)}-{impl}", marks=slow_if_large(n))
         for op in OPS for dt in DTYPES for n in SIZES
         for impl in IMPLS + (("numpy",) if n != L2 and n <= NUMPY_MAX else ())]


@pytest.mark.parametrize("op,dtype,n,impl", CASES)
def test_bandwidth(benchmark, gpu, op, dtype, n, impl):
    arity, cf_op, cp_op, _, _ = OPS[op]
    size = size_id(n)
    benchmark.group = f"{op} {size} {dtype}"
    if n == L2:  # the inputs and the output in half of this device's L2
        n = gpu.l2_elements((arity + 1) * np.dtype(dtype).itemsize)
    gpu.copy_bandwidth()  # the reference, measured once before the first op
    ins = gpu.inputs(n, dtype)[:arity]

    stream = cp.cuda.get_current_stream()
    if impl == "numpy":  # the CPU peer: the same chain on host copies, in the same dtype
        hins = [x.get() for x in ins]
        ref = OPS[op][4]   # written with Python scalars: NumPy keeps the arrays' dtype
        res = ref(*hins)
        assert res.dtype == np.dtype(dtype), res.dtype
        max_abs, max_rel = check_close(op, ins, cp.asarray(res), dtype)
        gpu.measure_host(benchmark, op=op, dtype=dtype, n=n, impl="numpy (CPU)", call=lambda: ref(*hins),
                         nbytes=sum(x.nbytes for x in hins) + res.nbytes, out_dtype=str(res.dtype),
                         extra={"size_id": size, "max_abs_err": max_abs, "max_rel_err": max_rel})
        return
    if impl == "cufuse":
        out = cp.empty(n, dtype)
        call = lambda: cf_op(*ins, out=out)  # noqa: E731
    elif impl == "cupy-chain":
        call = lambda: cp_op(*ins)  # noqa: E731
    elif impl == "cupy.fuse":
        if not hasattr(cp, "fuse"):
            gpu.skip(impl, "this CuPy has no cupy.fuse")
        f = fused(op)
        call = lambda: f(*ins)  # noqa: E731
    else:  # torch-eager, torch.compile: the same memory, shared through DLPack
        need_torch(gpu, impl)
        tins = [torch.from_dlpack(x) for x in ins]
        assert tins[0].dtype == torch_dtype(dtype)
        f = OPS[op][3] if impl == "torch-eager" else compiled(op)
        call = lambda: f(*tins)  # noqa: E731
        stream = torch_stream(gpu)

    # Correctness on the same inputs (for torch.compile this also compiles:
    # compilation stays out of the timings; a failure to compile skips).
    res = as_cupy(first_call(gpu, impl, call))
    max_abs, max_rel = check_close(op, ins, res, dtype)
    nbytes = sum(x.nbytes for x in ins) + res.nbytes  # inputs read once + output written once
    out_dtype = str(res.dtype)
    del res
    gpu.measure(benchmark, op=op, dtype=dtype, n=n, impl=impl, call=call, stream=stream,
                nbytes=nbytes, out_dtype=out_dtype, extra={"size_id": size, "max_abs_err": max_abs, "max_rel_err": max_rel})


# ----------------------------------------------------------------- latency
BARE_SRC = r"""
extern "C" __global__ void bare(const float* a, const float* b, float* o, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) o[i] = expf((a[i] + b[i]) * 2.0f);
}
"""

SLUG = {"bare RawKernel": "bare", "cufuse (cupy)": "cufuse", "cufuse (cupy, out=)": "cufuse_out",
        "cufuse (torch)": "cufuse_torch", "cufuse (torch, out=)": "cufuse_torch_out",
        "torch eager": "torch_eager", "cupy chain": "cupy_chain"}
CALLS = 2000    # calls between two synchronizes
ROUNDS = 7      # median over this many loops


def test_latency(benchmark, gpu):
    """Host wall time per call at 100K float32 elements (launch overhead):
    targets: cufuse <= 2x a bare RawKernel launch and >= 2x faster than the
    torch eager chain; with out= <= 1.3x the bare launch; on torch tensors
    <= 2.2x the bare launch."""
    n, dtype = 100_000, "float32"
    benchmark.group = "latency 100K float32"
    x, y, _ = gpu.inputs(n, dtype)
    o_bare, o_out = cp.empty(n, dtype), cp.empty(n, dtype)
    kern = cp.RawKernel(BARE_SRC, "bare")
    grid, n64 = (n + 255) // 256, np.int64(n)

    def bare():
        kern((grid,), (256,), (x, y, o_bare, n64))

    fns = {
        "bare RawKernel": bare,
        "cufuse (cupy)": lambda: cufuse.add_mul_exp(x, y),
        "cufuse (cupy, out=)": lambda: cufuse.add_mul_exp(x, y, out=o_out),
    }
    results = {"bare RawKernel": o_bare, "cufuse (cupy, out=)": o_out}
    if not TORCH_REASON:
        tx, ty = torch.from_dlpack(x), torch.from_dlpack(y)
        to = torch.empty_like(tx)
        fns["cufuse (torch)"] = lambda: cufuse.add_mul_exp(tx, ty)
        fns["cufuse (torch, out=)"] = lambda: cufuse.add_mul_exp(tx, ty, out=to)
        fns["torch eager"] = lambda: torch.exp((tx + ty) * 2)
        results["cufuse (torch, out=)"] = to
    fns["cupy chain"] = lambda: cp.exp((x + y) * 2)

    for name, f in fns.items():  # every variant computes the right thing
        r = f()
        gpu.sync()
        check_close("add_mul_exp", (x, y), as_cupy(results.get(name, r)), dtype)

    us = gpu.host_loop_us(fns, gpu.sync, calls=CALLS, rounds=ROUNDS)
    # GPU time per call of each variant, 20 calls back to back (is a loop host- or GPU-bound?)
    gpu_us = {}
    for name, f in fns.items():
        s = torch_stream(gpu) if "torch" in name else cp.cuda.get_current_stream()
        gpu_us[name] = gpu.gpu_time_us(f, s, reps=15, batch=20)["gpu_us"]

    cf = fns["cufuse (cupy)"]

    def loop():
        for _ in range(CALLS):
            cf()
        gpu.sync()

    benchmark.pedantic(loop, rounds=ROUNDS, warmup_rounds=1, iterations=1)

    b = us["bare RawKernel"]
    targets, ratios = {}, {}

    def target(key, ratio_name, ratio, ok, text):
        ratios[ratio_name] = ratio
        targets[key] = f"{text}: {ratio:.2f}x {'met' if ok else 'MISSED'}"

    r = us["cufuse (cupy)"] / b
    target("cufuse (cupy)", "cufuse_vs_bare", r, r <= 2.0, "<= 2x bare")
    r = us["cufuse (cupy, out=)"] / b
    target("cufuse (cupy, out=)", "cufuse_out_vs_bare", r, r <= 1.3, "<= 1.3x bare")
    if "cufuse (torch)" in us:
        r = us["cufuse (torch)"] / b
        target("cufuse (torch)", "cufuse_torch_vs_bare", r, r <= 2.2, "<= 2.2x bare")
        ratios["cufuse_torch_out_vs_bare"] = us["cufuse (torch, out=)"] / b
        r = us["torch eager"] / us["cufuse (cupy)"]
        target("torch eager", "torch_eager_vs_cufuse", r, r >= 2.0, "cufuse >= 2x faster")
    ratios["cupy_chain_vs_cufuse"] = us["cupy chain"] / us["cufuse (cupy)"]

    entry = {"n": n, "dtype": dtype, "calls": CALLS, "rounds": ROUNDS, "us": us, "gpu_us": gpu_us,
             "ratios": ratios, "targets": targets,
             "pytest_benchmark_cufuse_us": (benchmark.stats.stats.median / CALLS * 1e6) if benchmark.stats else None}
    benchmark.extra_info.update({
        "n": n, "dtype": dtype, "calls_per_round": CALLS,
        **{"us_" + SLUG[k]: v for k, v in us.items()},
        **{"gpu_us_" + SLUG[k]: v for k, v in gpu_us.items()},
        **ratios, "targets": "; ".join(f"{k} {v}" for k, v in targets.items())})
    gpu.latency.append(entry)
