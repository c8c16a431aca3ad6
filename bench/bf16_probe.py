"""bfloat16 against float16 and torch eager, same run (python3 bench/bf16_probe.py).

Per op at 16384 x 4096 (128 MiB per 16-bit operand, several times the L2):
median of CUDA-event timings after a warm-up, GB/s over the bytes the op must
move, % of the device copy bandwidth measured in the same run (a clone of the
same bytes), and torch eager's time for the same op in the same dtype.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F

import cufuse
from _common import event_median

ROWS, COLS = 16384, 4096
REPS = 30


def timed(fn):
    return event_median(fn, REPS)


def main():
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for dt in (torch.float16, torch.bfloat16):
        x = torch.randn(ROWS, COLS, device="cuda", generator=g).to(dt)
        y = torch.randn(ROWS, COLS, device="cuda", generator=g).to(dt)
        b = torch.randn(COLS, device="cuda", generator=g).to(dt)
        w = torch.randn(COLS, device="cuda", generator=g).to(dt)
        nbytes = x.numel() * x.element_size()
        copy_us = timed(lambda: x.clone())
        copy_gbs = 2 * nbytes / copy_us / 1e3
        cases = {  # name: (cufuse call, torch eager call, bytes moved)
            "add_relu": (lambda: cufuse.add_relu(x, y), lambda: torch.relu(x + y), 3 * nbytes),
            "bias_gelu": (lambda: cufuse.bias_gelu(x, b), lambda: F.gelu(x + b), 2 * nbytes),
            "layer_norm": (lambda: cufuse.layer_norm(x, COLS, w, b), lambda: F.layer_norm(x, (COLS,), w, b),
                           2 * nbytes),
            "rms_norm": (lambda: cufuse.rms_norm(x, COLS, w), lambda: F.rms_norm(x, (COLS,), w), 2 * nbytes),
            "softmax": (lambda: cufuse.softmax(x), lambda: torch.softmax(x, -1), 2 * nbytes),
            "sum_squared": (lambda: cufuse.sum_squared(x), lambda: (x.float() * x.float()).sum(-1).to(dt), nbytes),
        }
        with torch.no_grad():
            for name, (ours, theirs, moved) in cases.items():
                t_ours, t_torch = timed(ours), timed(theirs)
                gbs = moved / t_ours / 1e3
                rows.append((name, str(dt).split(".")[1], t_ours, gbs, 100 * gbs / copy_gbs, t_torch,
                             t_torch / t_ours, copy_gbs))
    print(f"{'op':12} {'dtype':9} {'cufuse us':>10} {'GB/s':>7} {'% copy':>7} {'torch us':>9} {'speedup':>8} "
          f"{'copy GB/s':>9}")
    for r in rows:
        print(f"{r[0]:12} {r[1]:9} {r[2]:10.1f} {r[3]:7.0f} {r[4]:7.1f} {r[5]:9.1f} {r[6]:8.2f} {r[7]:9.0f}")


if __name__ == "__main__":
    main()
