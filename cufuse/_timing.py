"""Timing the way the project's rules say: warm up, events (or a synchronize)
around the timed region, the median of many repeats."""
from __future__ import annotations

import statistics
import time

from . import _runtime as R


def time_gpu(fn, *, warmup=5, repeat=50, stream=None, inner=1):
    """Per-call milliseconds of ``fn`` (which queues GPU work on CuPy's current
    stream, or ``stream``): CUDA events around ``inner`` back-to-back calls,
    divided by ``inner``, ``repeat`` times. Returns the list. With inner > 1 a
    small kernel is timed as a stream of calls, launch gaps included."""
    cp = R._cp
    for _ in range(warmup):
        fn()
    cp.cuda.get_current_stream().synchronize() if stream is None else stream.synchronize()
    times = []
    start, end = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(repeat):
        start.record(stream)
        for _ in range(inner):
            fn()
        end.record(stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / inner)
    return times


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
