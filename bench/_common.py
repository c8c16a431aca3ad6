"""What every benchmark file shares: the skip without a GPU, the optional
CuPy and torch imports, and a few helpers. Every benchmark is skipped without
a GPU; the modules still import without CuPy or torch (new ops are looked up
inside the tests), so that collection never errors.

    import _common
    from _common import NO_GPU, TORCH_REASON, cp, torch, ...
    pytestmark = _common.pytestmark   # an assignment: pyflakes counts a bare import as unused

The ops' benchmarks (not test_bench_fuse.py's) have a NumPy peer on the CPU
(impl "numpy" in the test ids, "numpy (CPU)" in the rows, see ``measure``)
and the size id "L2", an element count computed from the device's L2 in the
test body (conftest's GpuBench.l2_elements), so that test ids stay static
strings when collected without a GPU.
"""
from __future__ import annotations

import numpy as np
import pytest

import cufuse

NO_GPU = "cufuse.CUDA_AVAILABLE is False (CuPy missing, no driver or no GPU): nothing to benchmark"
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not cufuse.CUDA_AVAILABLE, reason=NO_GPU)]

cp = torch = F = None
TORCH_REASON = "no GPU"
if cufuse.CUDA_AVAILABLE:
    import cupy as cp
    try:
        import torch
        import torch.nn.functional as F
        TORCH_REASON = None if torch.cuda.is_available() else "torch has no CUDA device"
    except Exception as e:  # not installed, or a broken install
        torch = F = None
        TORCH_REASON = f"torch not importable ({type(e).__name__}: {e})"


def torch_stream(gpu):
    """torch's current stream as a CuPy stream object, for the events."""
    return gpu.external_stream(torch.cuda.current_stream().cuda_stream)


NUMPY = "numpy (CPU)"   # the CPU peer's impl in the rows (its test ids say "numpy")
L2 = "L2"               # the size id resolved in the test body: GpuBench.l2_elements


def size_id(n) -> str:
    """A size for test ids and benchmark groups: "L2", or 50M / 100K / the count."""
    if isinstance(n, str):
        return n
    return f"{n // 1_000_000}M" if n % 1_000_000 == 0 else (f"{n // 1_000}K" if n % 1_000 == 0 else str(n))


def slow_if_large(n):
    """pytest marks of a size: the fixed sizes of 20M elements and more are slow
    ("L2" is at most half the L2 cache: a few million elements)."""
    return [pytest.mark.slow] if not isinstance(n, str) and n >= 20_000_000 else []


def as_cupy(res):
    """A result as a CuPy array: torch's through DLPack (no copy), the NumPy
    peer's copied to the device (so that every implementation is checked by
    the same device code)."""
    if isinstance(res, cp.ndarray):
        return res
    return cp.asarray(res) if isinstance(res, np.ndarray) else cp.from_dlpack(res)


def measure(gpu, benchmark, *, impl, stream, **kw):
    """gpu.measure (CUDA events on ``stream``), or for the NumPy peer
    gpu.measure_host: the host clock, the row's impl "numpy (CPU)"."""
    if impl == "numpy":
        return gpu.measure_host(benchmark, impl=NUMPY, **kw)
    return gpu.measure(benchmark, impl=impl, stream=stream, **kw)


def need_torch(gpu, impl):
    if impl.startswith("torch") and TORCH_REASON:
        gpu.skip(impl, TORCH_REASON)


# Peers whose first call traces and compiles: a failure there (a construct
# the compiler does not take) skips that peer with the reason.
COMPILED_PEERS = ("torch.compile", "cupy.fuse")


def first_call(gpu, impl, call, what=None):
    """The correctness call (for the COMPILED_PEERS it also compiles, untimed;
    a failure to compile skips that peer, labelled "impl (what)" in the
    summary); a wrong result still fails the checks that follow."""
    try:
        res = call()
        gpu.sync()
    except Exception as e:
        if impl not in COMPILED_PEERS:
            raise
        msg = str(e).splitlines()[0][:160] if str(e) else ""
        gpu.skip(impl if what is None else f"{impl} ({what})", f"{impl} failed: {type(e).__name__}: {msg}")
    return res


def max_errors(got, ref, floor=0.0):
    """(max abs error, max relative error) of NumPy ``got`` against the float64
    ``ref`` where both are finite: the accuracy columns of the report. The
    relative error divides by max(|ref|, floor) (pass atol / rtol: near 0 an
    absolute tolerance governs, as in the checks)."""
    g = np.asarray(got, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    ok = np.isfinite(g) & np.isfinite(r)
    if not ok.any():
        return 0.0, 0.0
    d = np.abs(g[ok] - r[ok])
    return float(d.max()), float((d / np.maximum(np.abs(r[ok]), max(floor, 1e-300))).max())


def optional_liger(module, cls, **kw):
    """Liger-Kernel's ``liger_kernel.transformers.<module>.<cls>(**kw)``, or
    None (printed why) where it does not import: the standalone probes' peer."""
    import importlib
    try:
        return getattr(importlib.import_module(f"liger_kernel.transformers.{module}"), cls)(**kw)
    except Exception as e:
        print("Liger-Kernel not importable:", e)
        return None


def event_median(fn, reps=30, inner=1, warmup=3):
    """Median over ``reps`` of the µs per call of ``inner`` back-to-back calls
    of ``fn`` between two CUDA events on torch's current stream, after
    ``warmup`` calls (the standalone probes: bf16_probe.py, train_probe.py)."""
    import statistics
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / inner)
    return statistics.median(ts)


class FileSummary:
    """A benchmark file's own summary: ``lines()`` printed after conftest's
    (trylast; registered by ``register_summary`` once a benchmark runs on a
    GPU) under ``title``, and ``files(lines)`` ({name: text}) saved in
    .benchmarks beside pytest-benchmark's own files."""

    def __init__(self, title, lines, files):
        self.title, self.lines, self.files = title, lines, files

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter, exitstatus, config):
        from pathlib import Path
        lines = self.lines()
        if not lines:
            return
        terminalreporter.section(self.title)
        for line in lines:
            terminalreporter.write_line(line)
        try:
            d = Path(config.rootpath) / ".benchmarks"
            d.mkdir(exist_ok=True)
            files = self.files(lines)
            for name, text in files.items():
                (d / name).write_text(text)
            terminalreporter.write_line("(saved: " + ", ".join(str(d / n) for n in files) + ")")
        except OSError as e:
            terminalreporter.write_line(f"(could not write the {self.title}: {e})")


def register_summary(pytestconfig, name, title, lines, files):
    """Registers a ``FileSummary`` under the plugin ``name``, once per session."""
    pm = pytestconfig.pluginmanager
    if pm.get_plugin(name) is None:
        pm.register(FileSummary(title, lines, files), name)
