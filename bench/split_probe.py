"""Long-row norms and softmax (the split and pipe kernels, kernels/rows.cuh)
as % of a copy of the same bytes, CUDA events, median of 30 after warm-up,
inputs far beyond L2. Usage (a GPU): PYTHONPATH=<tree> python3 bench/split_probe.py [label]
Run it for two trees in one device call to compare them."""
from __future__ import annotations

import sys

import cupy as cp
import numpy as np

import cufuse

CASES = [("layer_norm", np.float32, (256, 262144)), ("layer_norm", np.float16, (256, 262144)),
         ("rms_norm", np.float16, (256, 262144)), ("softmax", np.float32, (256, 262144)),
         ("layer_norm", np.float32, (1024, 65536)), ("softmax", np.float16, (64, 1048576)),
         ("layer_norm", np.float32, (64, 500001))]


def timed(f, reps=30):
    start, end = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(3):
        f()
    times = []
    for _ in range(reps):
        start.record()
        f()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return float(np.median(times))


def main(label):
    rng = np.random.default_rng(5)
    for op, dt, shape in CASES:
        x = cp.asarray(rng.standard_normal(shape).astype(dt))
        y = cp.empty_like(x)
        args = () if op == "softmax" else (shape[-1],)
        f = getattr(cufuse, op)
        t = timed(lambda: f(x, *args, out=y))
        c = timed(lambda: cp.copyto(y, x))
        print(f"{label:6} {op:11} {np.dtype(dt).name:8} {str(shape):15} {t * 1e3:8.1f} us  {100 * c / t:5.1f}% of copy")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
