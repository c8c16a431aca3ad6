"""Where a training step of examples/transformer_integration.py's models
spends its time, eager against cufuse.patch (python3 scripts/model_profile.py
[--dtype bfloat16] [--model llama]): per step, the host time to issue the
forward and backward (no synchronization) against the whole step
(synchronized), so host-bound steps show; then the torch profiler's ops with
the most host time and the most GPU time, for the patched model (its last
variant: with the fused head and loss).
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

import cufuse

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from transformer_integration import models  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model", default="llama", choices=["llama", "gpt2"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    a = ap.parse_args()
    dt = getattr(torch, a.dtype)
    torch.manual_seed(0)
    base = models(False)[a.model]().to(device="cuda", dtype=dt)
    patched, logits = copy.deepcopy(base), copy.deepcopy(base)
    cufuse.patch(patched)
    cufuse.patch(logits, linear_loss=False)
    ids = torch.randint(0, base.config.vocab_size, (a.batch, a.seq), device="cuda")
    for label, model in (("eager", base), ("cufuse-logits", logits), ("cufuse", patched)):
        def step():
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        issue, total = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            issue.append(t1 - t0)
            total.append(time.perf_counter() - t0)
        print(f"{label:13} host issue {1e3 * sorted(issue)[2]:7.2f} ms   step {1e3 * sorted(total)[2]:7.2f} ms")
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        step()
        torch.cuda.synchronize()
    for key in ("self_cpu_time_total", "self_device_time_total"):
        print(p.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=50))


if __name__ == "__main__":
    main()
