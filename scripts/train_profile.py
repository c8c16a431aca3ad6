"""Host profile of a forward + backward of cufuse ops on CUDA tensors
(python3 scripts/train_profile.py): wall time per step of back-to-back steps
(synchronized at the end), then cProfile of the same steps."""
from __future__ import annotations

import cProfile
import pstats
import time

import torch
import torch.nn.functional as F

import cufuse


def main():
    dt = torch.bfloat16
    for rows, cols in ((256, 768), (4096, 4096)):
        x = torch.randn(rows, cols, device="cuda", dtype=dt, requires_grad=True)
        w = torch.randn(cols, device="cuda", dtype=dt, requires_grad=True)
        b = torch.randn(cols, device="cuda", dtype=dt, requires_grad=True)
        y = torch.randn(rows, cols, device="cuda", dtype=dt, requires_grad=True)
        g = torch.randn(rows, cols, device="cuda", dtype=dt)
        cases = {"add_relu": lambda: cufuse.add_relu(x, b), "torch add_relu": lambda: torch.relu(x + b),
                 "add_relu xy": lambda: cufuse.add_relu(x, y), "torch add_relu xy": lambda: torch.relu(x + y),
                 "bias_gelu": lambda: cufuse.bias_gelu(x, b), "torch bias_gelu": lambda: F.gelu(x + b),
                 "layer_norm": lambda: cufuse.layer_norm(x, cols, w, b),
                 "torch layer_norm": lambda: F.layer_norm(x, (cols,), w, b),
                 "softmax": lambda: cufuse.softmax(x), "torch softmax": lambda: torch.softmax(x, -1)}

        def step(fn):
            for t in (x, w, b, y):
                t.grad = None
            fn().backward(g)
        for name, fn in cases.items():
            for _ in range(5):
                step(fn)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(50):
                step(fn)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            print(f"{rows}x{cols} {name:18} host {1e6 * (t1 - t0) / 50:8.1f} us/step, with sync {1e6 * (t2 - t0) / 50:8.1f}")
        if rows == 4096:
            from torch.profiler import ProfilerActivity, profile
            for name in ("add_relu xy", "torch add_relu xy", "bias_gelu", "layer_norm"):
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        step(cases[name])
                    torch.cuda.synchronize()
                print(f"==== CUDA kernels {name} {rows}x{cols}, 10 steps")
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=70))
        if rows == 256:
            for name in ("add_relu", "layer_norm"):
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(50):
                    step(cases[name])
                torch.cuda.synchronize()
                pr.disable()
                print(f"==== cProfile {name} {rows}x{cols}, 50 steps")
                pstats.Stats(pr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
