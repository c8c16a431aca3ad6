"""Timing the way the project's rules say: warm up, events (or a synchronize)
around the timed region, the median of many repeats.

``gpu_times`` is the one event timer: the benchmark suite (bench/conftest.py)
and ``cufuse.bench.compare`` both use it.
"""
from __future__ import annotations

import math
import os
import statistics
import time

import numpy as np

from . import _runtime as R

FLUSH_BYTES = 512 << 20  # swept before each event-timed repetition (evicts L2: 50-60 MB on an H100/H200)
# How the flush evicts L2. "read" (the default): a read-only sweep of the
# buffer, which leaves L2 holding clean lines. "memset": writing the buffer
# (cudaMemsetAsync, as triton's do_bench zeroes its cache buffer), which
# leaves up to an L2's worth of dirty lines that the timed call then writes
# back to DRAM as it evicts them: the flush's own traffic charged to the call
# (bench/NOTES.md, "Figures from code comments"). CUFUSE_BENCH_FLUSH=memset
# gives the old figures back.
FLUSH_MODE = os.environ.get("CUFUSE_BENCH_FLUSH", "read")
if FLUSH_MODE not in ("read", "memset"):
    raise ValueError(f"CUFUSE_BENCH_FLUSH={FLUSH_MODE!r}: expected 'read' or 'memset'")
_scratch: dict = {}       # device -> (flush buffer, sink)
_flush_us: dict = {}      # device -> GPU µs of one flush
READ_SRC = r"""
extern "C" __global__ void cufuse_read_pass(const float4* __restrict__ a, long long n4, float* __restrict__ out) {
    // One pass: each block reads 4 * blockDim.x float4 in 4 coalesced sweeps, the 4 loads of a
    // thread issued back to back (64 bytes in flight per thread).
    const long long bd = blockDim.x;
    const long long base = (long long)blockIdx.x * bd * 4 + threadIdx.x;
    float acc = 0.0f;
    if (base + 3 * bd < n4) {
        const float4 v0 = __ldg(a + base), v1 = __ldg(a + base + bd);
        const float4 v2 = __ldg(a + base + 2 * bd), v3 = __ldg(a + base + 3 * bd);
        acc = ((v0.x + v0.y) + (v0.z + v0.w)) + ((v1.x + v1.y) + (v1.z + v1.w))
            + ((v2.x + v2.y) + (v2.z + v2.w)) + ((v3.x + v3.y) + (v3.z + v3.w));
    } else {
        for (long long i = base; i < n4; i += bd) {
            const float4 v = __ldg(a + i);
            acc += (v.x + v.y) + (v.z + v.w);
        }
    }
    if (acc == -1.0e30f) out[0] = acc;  // never true for finite inputs of normal size: keeps the loads
}
"""
_read_fn: dict = {}       # device -> compiled cufuse_read_pass


def read_pass(a, sink, stream=None):
    """Queue one read of every 16-byte group of the float32 CuPy array ``a``
    on ``stream`` (None: the current one); nothing is written (``sink``, a
    float32 array, only in theory). The L2 flush, and the benchmarks' read
    ceiling (bench/test_bench_norm.py)."""
    cp = R._cp
    device = a.device.id
    fn = _read_fn.get(device)
    if fn is None:
        with cp.cuda.Device(device):
            fn = _read_fn[device] = cp.RawKernel(READ_SRC, "cufuse_read_pass").kernel
    n4 = a.nbytes // 16
    R.launch_grid(fn, ((n4 + 1023) // 1024,), (256,), (a, np.int64(n4), sink), stream)


def _flush(stream, device):
    cp = R._cp
    got = _scratch.get(device)
    if got is None:
        with cp.cuda.Device(device):
            got = _scratch[device] = (cp.ones(FLUSH_BYTES // 4, dtype="float32"), cp.zeros(1, dtype="float32"))
    buf, sink = got
    if FLUSH_MODE == "memset":
        cp.cuda.runtime.memsetAsync(buf.data.ptr, 0, FLUSH_BYTES, stream.ptr)
    else:
        read_pass(buf, sink, stream)


def flush_us(device=None) -> float:
    """GPU microseconds of one 512 MiB flush on ``device`` (measured once)."""
    cp = R._cp
    device = cp.cuda.runtime.getDevice() if device is None else device
    us = _flush_us.get(device)
    if us is None:
        s = cp.cuda.get_current_stream()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        ts = []
        for _ in range(7):
            _flush(s, device)
            start.record(s)
            _flush(s, device)
            end.record(s)
            end.synchronize()
            ts.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
        us = _flush_us[device] = statistics.median(ts)
    return us


def gpu_times(fn, stream=None, *, reps=50, warmup=10, batch=1, flush=True) -> dict:
    """GPU microseconds per ``fn()`` by CUDA events on ``stream`` (the stream
    fn queues its work on; None: CuPy's current stream): ``reps`` samples of
    ``batch`` back-to-back calls between two events, divided by ``batch``.

    With ``flush``, sweeps of a 512 MiB buffer (FLUSH_MODE) are queued before
    each repetition: they evict L2 and keep the GPU busy while the host queues
    the calls, so that the events bracket GPU work and not the host's launch
    overhead. Enough sweeps are queued to outlast
    twice the host enqueue time seen in the warm-up; ``backlog_ok`` says
    whether the measured enqueue time stayed under the backlog. Returns
    {"gpu_us" (median), "samples_us", "enqueue_us", "backlog_us", "backlog_ok"}.
    """
    cp = R._cp
    stream = cp.cuda.get_current_stream() if stream is None else stream
    device = cp.cuda.runtime.getDevice()
    warm = []
    for _ in range(warmup):
        t0 = time.perf_counter()
        fn()
        warm.append(time.perf_counter() - t0)
    cp.cuda.runtime.deviceSynchronize()
    n_flush = 0
    if flush:
        need_us = 2 * (statistics.median(warm) if warm else 0.0) * 1e6 * batch
        n_flush = min(32, max(1, math.ceil(need_us / flush_us(device))))
    start, end = cp.cuda.Event(), cp.cuda.Event()
    gpu, enq = [], []
    for _ in range(reps):
        for _ in range(n_flush):
            _flush(stream, device)
        start.record(stream)
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        enq.append(time.perf_counter() - t0)
        end.record(stream)
        end.synchronize()
        gpu.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / batch)
    cp.cuda.runtime.deviceSynchronize()
    enq_us = statistics.median(enq) * 1e6
    backlog = n_flush * flush_us(device) if n_flush else 0.0
    return {"gpu_us": statistics.median(gpu), "samples_us": gpu, "enqueue_us": enq_us / batch,
            "backlog_us": backlog, "backlog_ok": (not flush) or enq_us < 0.9 * backlog}


def time_gpu(fn, *, warmup=5, repeat=50, stream=None, inner=1):
    """Per-call milliseconds of ``fn`` (which queues GPU work on CuPy's current
    stream, or ``stream``): CUDA events around ``inner`` back-to-back calls,
    divided by ``inner``, ``repeat`` times, no L2 flush. Returns the list."""
    res = gpu_times(fn, stream, reps=repeat, warmup=warmup, batch=inner, flush=False)
    return [t / 1e3 for t in res["samples_us"]]


def time_host(fn, *, warmup=3, repeat=20, sync=None):
    """Per-call milliseconds of ``fn`` by the host clock; ``sync()`` (if given)
    runs before each clock read so that queued device work is counted."""
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def median(xs):
    return statistics.median(xs)
