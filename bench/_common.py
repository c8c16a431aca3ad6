"""What every benchmark file shares: the skip without a GPU, the optional
CuPy and torch imports, and a few helpers. Every benchmark is skipped without
a GPU; the modules still import without CuPy or torch (new ops are looked up
inside the tests), so that collection never errors.

    from _common import NO_GPU, TORCH_REASON, cp, torch, pytestmark, ...
"""
from __future__ import annotations

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


def as_cupy(res):
    return res if isinstance(res, cp.ndarray) else cp.from_dlpack(res)


def need_torch(gpu, impl):
    if impl.startswith("torch") and TORCH_REASON:
        gpu.skip(impl, TORCH_REASON)


def first_call(gpu, impl, call):
    """The correctness call (for torch.compile it also compiles, untimed; a
    compile failure skips that peer)."""
    try:
        res = call()
        gpu.sync()
    except Exception as e:
        if impl != "torch.compile":
            raise
        msg = str(e).splitlines()[0][:160] if str(e) else ""
        gpu.skip(impl, f"torch.compile failed: {type(e).__name__}: {msg}")
    return res


def max_errors(got, ref, floor=0.0):
    """(max abs error, max relative error) of NumPy ``got`` against the float64
    ``ref`` where both are finite: the accuracy columns of the report. The
    relative error divides by max(|ref|, floor) (pass atol / rtol: near 0 an
    absolute tolerance governs, as in the checks)."""
    import numpy as np
    g = np.asarray(got, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    ok = np.isfinite(g) & np.isfinite(r)
    if not ok.any():
        return 0.0, 0.0
    d = np.abs(g[ok] - r[ok])
    return float(d.max()), float((d / np.maximum(np.abs(r[ok]), max(floor, 1e-300))).max())
