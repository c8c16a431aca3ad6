"""One launch of the attention forward for Nsight Compute (ncu --kernel-name
regex:attention_forward -c 1 python3 bench/attention_ncu.py [dim] [sm80])."""
import importlib
import sys

import torch

import cufuse

d = int(sys.argv[1]) if len(sys.argv) > 1 else 128
if "sm80" in sys.argv:
    importlib.import_module("cufuse.ops.attention")._PATH = "sm80"
q, k, v = (torch.randn(4, 16, 4096, d, device="cuda", dtype=torch.float16) for _ in range(3))
cufuse.attention(q, k, v)
torch.cuda.synchronize()
