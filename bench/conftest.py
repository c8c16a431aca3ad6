"""Fixtures and the end-of-run summary table for the cufuse benchmarks.

Everything heavy (CuPy import, the copy-bandwidth measurement, input arrays)
happens lazily, inside the first benchmark that runs: with ``--benchmark-skip``
(the default addopts) or without a GPU nothing here touches the device.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np
import pytest

import cufuse
from summary_format import DT_SHORT, markdown_table as _table, size_label, target_lines

# Filled by the tests, read by pytest_terminal_summary.
BANDWIDTH: list[dict] = []   # one dict per bandwidth benchmark that ran
LATENCY: list[dict] = []     # one dict per latency benchmark that ran
SKIPPED: dict[str, str] = {}  # peer -> reason it was skipped
TARGETS: list[dict] = []     # issue targets on bandwidth rows, judged in the summary (_target_lines)
_BENCH: dict = {}            # the one GpuBench of the session, once created

COPY_BYTES = 1 << 30         # 1 GiB source + 1 GiB destination for the copy reference


class GpuBench:
    """Device helpers shared by every benchmark of the session."""

    def __init__(self):
        import cupy as cp
        self.cp = cp
        self.device = cp.cuda.runtime.getDevice()
        self.bandwidth = BANDWIDTH   # the tests append their rows here
        self.latency = LATENCY
        self.targets = TARGETS       # and their targets here (see _target_lines)
        self._inputs_key = None
        self._inputs = None
        self._copy = None
        self._info = None
        self._streams = {}

    # ------------------------------------------------------------ basics
    def sync(self):
        """Wait for all work on the device (every stream: CuPy's and torch's)."""
        self.cp.cuda.runtime.deviceSynchronize()

    def info(self) -> dict:
        if self._info is None:
            cp = self.cp
            props = cp.cuda.runtime.getDeviceProperties(self.device)
            name = props["name"]
            name = name.decode() if isinstance(name, bytes) else str(name)
            rt = cp.cuda.runtime.runtimeGetVersion()
            drv = cp.cuda.runtime.driverGetVersion()
            self._info = {
                "gpu": name,
                "sms": int(props["multiProcessorCount"]),
                "mem_gib": round(props["totalGlobalMem"] / 2**30, 1),
                "cupy": cp.__version__,
                "cuda_runtime": f"{rt // 1000}.{rt % 1000 // 10}",
                "driver_cuda": f"{drv // 1000}.{drv % 1000 // 10}",
                "cufuse": cufuse.__version__,
            }
            import sys
            torch = sys.modules.get("torch")
            if torch is not None:
                self._info["torch"] = torch.__version__
        return self._info

    # ------------------------------------------------------------ inputs
    def inputs(self, n: int, dtype) -> tuple:
        """Three random-normal CuPy arrays of ``n`` elements (generated on the
        GPU, fixed seeds). Only the latest (n, dtype) is kept, to bound memory."""
        dtype = np.dtype(dtype)
        key = (n, dtype)
        if self._inputs_key != key:
            cp = self.cp
            self._inputs = None
            cp.get_default_memory_pool().free_all_blocks()
            arrs = []
            for k in range(3):
                rng = cp.random.default_rng(1234 + k)
                a = rng.standard_normal(n, dtype=np.float32)
                arrs.append(a if dtype == np.float32 else a.astype(dtype))
            self._inputs = tuple(arrs)
            self._inputs_key = key
            self.sync()
        return self._inputs

    # ------------------------------------------------------------ timing
    def gpu_time_us(self, fn, stream, reps: int, warmup: int = 10, batch: int = 1) -> dict:
        """GPU microseconds per ``fn()`` on ``stream``: cufuse._timing.gpu_times
        (CUDA events, a backlog of 512 MiB read-only sweeps before each
        repetition that flushes L2 and outlasts the host's enqueue time;
        median of ``reps``)."""
        from cufuse import _timing
        return _timing.gpu_times(fn, stream, reps=reps, warmup=warmup, batch=batch)

    def flush_us(self) -> float:
        """GPU microseconds of one 512 MiB L2 flush (measured once)."""
        from cufuse import _timing
        return _timing.flush_us(self.device)

    def external_stream(self, ptr: int):
        """A CuPy stream object for a raw stream handle (torch's): cufuse's own cache."""
        from cufuse import _runtime
        return _runtime.external_stream(ptr, self.device)

    def copy_bandwidth(self) -> dict:
        """Device-to-device copy bandwidth, measured once per session: 1 GiB by
        cudaMemcpyAsync and by ``dst[...] = src``, timed as the ops are
        (gpu_time_us: CUDA events, L2 flushed, median of 20), bytes = read +
        written. The reference is the faster of the two."""
        if self._copy is None:
            from cufuse import _timing
            cp = self.cp
            s = cp.cuda.get_current_stream()
            src = cp.random.default_rng(7).standard_normal(COPY_BYTES // 4, dtype=np.float32)
            dst = cp.empty_like(src)

            def median_ms(fn):  # timed as every op is: cufuse._timing.gpu_times, L2 flushed
                return self.gpu_time_us(fn, s, reps=20, warmup=3)["gpu_us"] / 1e3

            def memcpy():
                cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, COPY_BYTES,
                                            cp.cuda.runtime.memcpyDeviceToDevice, s.ptr)

            def assign():
                dst[...] = src

            t_memcpy = median_ms(memcpy)
            t_assign = median_ms(assign)
            ok = bool(cp.array_equal(dst, src))
            del src, dst
            self.sync()
            cp.get_default_memory_pool().free_all_blocks()
            g_memcpy = 2 * COPY_BYTES / (t_memcpy * 1e-3) / 1e9
            g_assign = 2 * COPY_BYTES / (t_assign * 1e-3) / 1e9
            if not ok:
                raise AssertionError("device-to-device copy reference produced wrong data")
            self._copy = {"memcpy_GBps": g_memcpy, "assign_GBps": g_assign,
                          "GBps": max(g_memcpy, g_assign), "flush_us": self.flush_us(),
                          "flush": _timing.FLUSH_MODE}
        return self._copy

    @staticmethod
    def rounds_for(n):
        """(pytest-benchmark host rounds, CUDA-event repetitions) for ``n`` elements."""
        if n <= 1_000_000:
            return 100, 50
        if n <= 20_000_000:
            return 30, 30
        return 20, 20

    def measure(self, benchmark, *, op, dtype, n, impl, call, stream, nbytes, out_dtype, extra=None):
        """Event timing + pytest-benchmark host timing of ``call`` (already
        checked for correctness): one row for the summary, returned."""
        copy = self.copy_bandwidth()
        host_rounds, reps = self.rounds_for(n)
        timing = self.gpu_time_us(call, stream, reps=reps)
        gpu_us = timing["gpu_us"]

        def target():
            call()
            self.sync()

        benchmark.pedantic(target, rounds=host_rounds, warmup_rounds=3, iterations=1)
        host_us = benchmark.stats.stats.median * 1e6 if benchmark.stats else None
        gbps = nbytes / (gpu_us * 1e-6) / 1e9
        q1, _, q3 = statistics.quantiles(timing["samples_us"], n=4)
        row = {"op": op, "n": n, "dtype": dtype, "impl": impl, "bytes": nbytes, "gpu_us": gpu_us,
               "gpu_q1_us": q1, "gpu_q3_us": q3, "regime": self.regime(nbytes),
               "GBps": gbps, "pct_of_copy": 100.0 * gbps / copy["GBps"], "copy_GBps": copy["GBps"],
               "host_us": host_us, "enqueue_us": timing["enqueue_us"], "backlog_ok": timing["backlog_ok"],
               "event_reps": reps, "out_dtype": out_dtype, "allocates": impl != "cufuse", **(extra or {})}
        benchmark.extra_info.update(row)
        self.bandwidth.append(row)
        return row

    def measure_host(self, benchmark, *, op, dtype, n, impl, call, nbytes, out_dtype, extra=None):
        """A CPU peer (NumPy): pytest-benchmark's host-clock median of ``call``;
        the row's gpu_us holds that time (timer "host") so that the report can
        set it beside the GPU implementations."""
        copy = self.copy_bandwidth()
        benchmark.pedantic(call, rounds=20, warmup_rounds=2, iterations=1)
        st = benchmark.stats.stats
        us = st.median * 1e6
        gbps = nbytes / (us * 1e-6) / 1e9
        row = {"op": op, "n": n, "dtype": dtype, "impl": impl, "bytes": nbytes, "gpu_us": us,
               "gpu_q1_us": st.q1 * 1e6, "gpu_q3_us": st.q3 * 1e6, "regime": self.regime(nbytes),
               "GBps": gbps, "pct_of_copy": 100.0 * gbps / copy["GBps"], "copy_GBps": copy["GBps"],
               "host_us": us, "timer": "host", "out_dtype": out_dtype, "allocates": True, **(extra or {})}
        benchmark.extra_info.update(row)
        self.bandwidth.append(row)
        return row

    def l2_size(self) -> int:
        """The device's L2 cache in bytes, read once (also ``self.l2`` after)."""
        if "l2" not in self.__dict__:
            self.l2 = int(self.cp.cuda.runtime.getDeviceProperties(self.device)["l2CacheSize"])
        return self.l2

    def regime(self, nbytes: int) -> str:
        """"L2" when the bytes a call moves fit in the device's L2 cache (read at
        run time), else "DRAM": the two regimes the report labels."""
        return "L2" if nbytes <= self.l2_size() else "DRAM"

    def l2_elements(self, bytes_per_element, multiple: int = 1024, fixed_bytes: int = 0) -> int:
        """The element count of the size id "L2": the largest multiple of
        ``multiple`` whose bytes fit in half of this device's L2.
        ``bytes_per_element``: every operand read once plus the output written
        once, per element (a float where an operand is per row: a per-channel
        scale, a reduction's output); ``fixed_bytes``: the small operands (a
        bias row). Half, not all: the working set stays clear of the cache's
        capacity (and of the regime label's limit) on any device."""
        n = int((self.l2_size() // 2 - fixed_bytes) // bytes_per_element) // multiple * multiple
        if n <= 0:
            raise ValueError(f"L2 of {self.l2_size()} bytes holds no {multiple} elements of {bytes_per_element} bytes")
        return n

    @staticmethod
    def host_loop_us(fns: dict, sync, calls: int = 2000, rounds: int = 7) -> dict:
        """Host wall microseconds per call of each fn: ``calls`` calls between
        two synchronizes, divided; the variants are interleaved round by
        round; median of ``rounds``."""
        for f in fns.values():  # warm-up: compile, fill memory pools
            for _ in range(200):
                f()
        sync()
        samples = {k: [] for k in fns}
        for _ in range(rounds):
            for k, f in fns.items():
                sync()
                t0 = time.perf_counter()
                for _ in range(calls):
                    f()
                sync()
                samples[k].append((time.perf_counter() - t0) / calls * 1e6)
        return {k: statistics.median(v) for k, v in samples.items()}

    @staticmethod
    def host_enqueue_us(fn, sync, calls: int = 100, rounds: int = 15) -> float:
        """Host wall microseconds per call of ``calls`` back-to-back calls,
        the clock stopped before the synchronize that follows them; median of
        ``rounds``. For calls whose kernels take longer than the host's work:
        there ``host_loop_us`` measures the GPU. ``calls`` stays far below
        what the launch queue holds, so that no call waits for room in it."""
        for _ in range(200):
            fn()
        sync()
        samples = []
        for _ in range(rounds):
            sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter() - t0) / calls * 1e6)
        sync()
        return statistics.median(samples)

    # ------------------------------------------------------------ skips
    @staticmethod
    def skip(peer: str, reason: str):
        SKIPPED.setdefault(peer, reason)
        pytest.skip(f"{peer}: {reason}")


@pytest.fixture(scope="session")
def gpu():
    """The session's GpuBench (skips when cufuse has no usable GPU)."""
    if not cufuse.CUDA_AVAILABLE:
        pytest.skip("cufuse.CUDA_AVAILABLE is False: no usable CUDA GPU")
    if "gpu" not in _BENCH:
        _BENCH["gpu"] = GpuBench()
    return _BENCH["gpu"]


# ---------------------------------------------------------------- summary
PEERS = ("cupy-chain", "cupy.fuse", "torch-eager", "torch.compile")


def _us(x):
    return "-" if x is None else (f"{x:.1f}" if x < 1000 else f"{x:.0f}")


def _target_lines() -> list[str]:
    """The TARGETS table, judged against the rows that ran (summary_format.target_lines)."""
    return target_lines(TARGETS, BANDWIDTH)


def summary_lines(full=False) -> list[str]:
    out = []
    g = _BENCH.get("gpu")
    if g is not None:
        info = g.info()
        out.append(" ".join(f"{k}={v}" for k, v in info.items()))
        if g._copy is not None:
            c = g._copy
            out.append(f"D2D copy reference (1 GiB, read+written): {c['GBps']:.0f} GB/s "
                       f"(cudaMemcpyAsync {c['memcpy_GBps']:.0f}, dst[...]=src {c['assign_GBps']:.0f}; "
                       f"L2 flush: {c.get('flush', 'memset')})")
    if BANDWIDTH:
        out.append("")
        out += ["Bandwidth. µs: CUDA-event median of one call, on the GPU (a read-only sweep of 512 MiB before each",
                "call flushes L2 and keeps the GPU busy while the host queues the call). GB/s: (inputs read once +",
                "output written once) / µs. % copy: of the D2D copy GB/s above. Peer cells: peer µs (peer µs /",
                "cufuse µs; >1 = cufuse faster). cufuse writes into a preallocated out=; peers allocate."]
        by_key = {}
        for r in BANDWIDTH:
            by_key.setdefault((r["op"], r["dtype"], r["n"]), {})[r["impl"]] = r
        rows = []
        for (op, dt, n), impls in by_key.items():
            cf = impls.get("cufuse")
            row = [op, size_label(n), DT_SHORT.get(dt, dt)]
            if cf is not None:
                row += [_us(cf["gpu_us"]), f"{cf['GBps']:.0f}", f"{cf['pct_of_copy']:.1f}%"]
            else:
                row += ["-", "-", "-"]
            for p in PEERS:
                r = impls.get(p)
                if r is None:
                    row.append("-")
                elif cf is None:
                    row.append(_us(r["gpu_us"]))
                else:
                    row.append(f"{_us(r['gpu_us'])} ({r['gpu_us'] / cf['gpu_us']:.2f}x)")
            rows.append(row)
        out += _table(["op", "n", "dtype", "cufuse µs", "GB/s", "% copy", *PEERS], rows,
                      "lllrrr" + "r" * len(PEERS))
        if full:
            out.append("")
            out.append("Every implementation (host µs = pytest-benchmark median of call + device synchronize):")
            rows = [[r["op"], size_label(r["n"]), DT_SHORT.get(r["dtype"], r["dtype"]), r["impl"],
                     _us(r["gpu_us"]), _us(r.get("host_us")), f"{r['GBps']:.0f}", f"{r['pct_of_copy']:.1f}%",
                     _us(r.get("enqueue_us")), "yes" if r.get("backlog_ok", True) else "NO",
                     r.get("out_dtype", r["dtype"])]
                    for r in BANDWIDTH]
            out += _table(["op", "n", "dtype", "impl", "GPU µs", "host µs", "GB/s", "% copy", "enqueue µs",
                           "backlog ok", "out dtype"], rows, "llllrrrrrll")
    out += _target_lines()
    for lat in LATENCY:
        out.append("")
        out += [f"Launch latency, add_mul_exp, {size_label(lat['n'])} {lat['dtype']}. µs/call: host wall time of "
                f"{lat['calls']}-call loops between",
                f"synchronizes, /{lat['calls']}, median of {lat['rounds']}, variants interleaved. GPU µs/call: CUDA "
                "events over 20 back-to-back calls",
                "(a loop whose µs/call is close to its GPU µs/call is GPU-bound, not launch-bound)."]
        bare = lat["us"]["bare RawKernel"]
        rows = []
        for k, v in lat["us"].items():
            g = lat.get("gpu_us", {}).get(k)
            rows.append([k, f"{v:.2f}", f"{v / bare:.2f}x", "-" if g is None else f"{g:.2f}",
                         lat["targets"].get(k, "")])
        out += _table(["variant", "µs/call", "vs bare", "GPU µs/call", "target"], rows, "lrrrl")
    bad = [f"{r['op']}-{r['dtype']}-{size_label(r['n'])}-{r['impl']}" for r in BANDWIDTH if not r.get("backlog_ok", True)]
    if bad:
        out.append("")
        out.append("host enqueue outlasted the flush backlog (GPU µs include host time) for: " + ", ".join(bad))
    if SKIPPED:
        out.append("")
        out += [f"skipped peer {k}: {v}" for k, v in SKIPPED.items()]
    return out


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not (BANDWIDTH or LATENCY):
        return
    terminalreporter.section("cufuse benchmark summary")
    for line in summary_lines():
        terminalreporter.write_line(line)
    try:  # the long form, and the raw rows, beside pytest-benchmark's own files
        d = Path(config.rootpath) / ".benchmarks"
        d.mkdir(exist_ok=True)
        (d / "cufuse-summary.md").write_text("\n".join(summary_lines(full=True)) + "\n")
        (d / "cufuse-summary.json").write_text(json.dumps(
            {"info": _BENCH["gpu"].info() if "gpu" in _BENCH else {},
             "copy": _BENCH["gpu"]._copy if "gpu" in _BENCH else None,
             "bandwidth": BANDWIDTH, "latency": LATENCY, "targets": TARGETS, "skipped": SKIPPED}, indent=1, default=str))
        terminalreporter.write_line(f"(full table: {d / 'cufuse-summary.md'}; raw rows: {d / 'cufuse-summary.json'})")
    except OSError as e:
        terminalreporter.write_line(f"(could not write the full summary: {e})")
