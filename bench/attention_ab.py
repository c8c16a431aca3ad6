"""The attention forward of this tree, timed alone (CUDA events, median of
10), for comparing two trees in one device call: PYTHONPATH=<tree> python3
bench/attention_ab.py [dims, e.g. 64,96,128]. Prints µs and TFLOP/s per case,
both paths on Hopper (a tree without the Hopper kernel runs its one path twice)."""
import importlib
import sys

import torch

import cufuse
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _common import event_median  # noqa: E402

AT = importlib.import_module("cufuse.ops.attention")
DIMS = [int(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else [64, 128]
for seq in (4096, 16384):
    for d in DIMS:
        b, h = max(1, 16384 * 16 // seq // 16), 16
        q, k, v = (torch.randn(b, h, seq, d, device="cuda", dtype=torch.float16) for _ in range(3))
        for path in (None, "sm80"):
            AT._PATH = path
            for causal in (False, True):
                us = event_median(lambda: cufuse.attention(q, k, v, causal=causal), 10)
                flops = 4 * b * h * seq * seq * d * (0.5 if causal else 1.0)
                print(f"{cufuse.__file__.split('/cufuse/')[0][-12:]:>12} seq {seq:5} d{d:3} {path or 'auto':4} "
                      f"causal {causal!s:5} {us:9.1f} us {flops / us / 1e6:6.1f} TFLOP/s", flush=True)
        AT._PATH = None
