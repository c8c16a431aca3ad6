"""What the examples share: a step timed the same way in each."""
from __future__ import annotations

import time

import torch


def timed(fn, steps, device):
    """(the last result, seconds per step) over ``steps`` calls after one warm-up call."""
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return out, (time.perf_counter() - t0) / max(steps, 1)
