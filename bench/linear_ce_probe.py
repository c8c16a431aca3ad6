"""A language model's head and loss, forward + backward: cufuse.linear_cross_entropy
at several chunk sizes against torch eager (F.linear then F.cross_entropy) and
Liger-Kernel's fused linear cross entropy, same run
(python3 bench/linear_ce_probe.py [dtype]).

Each step: the loss (mean, 10% of the targets ignored) of hidden [rows, feats]
and an lm_head weight [vocab, feats], both requiring grad, then backward. Prints
µs per step (CUDA events), the host µs of one step (wall time with the GPU
idle before it: how long the Python takes to queue it) and the peak memory a
step allocates beyond its inputs.
"""
from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

import cufuse
from _common import event_median, optional_liger

SHAPES = [(8184, 768, 50257), (4092, 2048, 32000), (4096, 4096, 128256)]  # GPT-2, the Llama, Llama-3


def main():
    dt = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, dt)
    liger = optional_liger("fused_linear_cross_entropy", "LigerFusedLinearCrossEntropyLoss", ignore_index=-100)
    print(f"{'shape':20} {'impl':12} {'us/step':>9} {'host us':>8} {'peak MiB':>9} {'loss':>10}")
    for rows, feats, vocab in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(rows + vocab)
        h = torch.randn(rows, feats, device="cuda", generator=g).to(dt).requires_grad_(True)
        w = (torch.randn(vocab, feats, device="cuda", generator=g) / feats ** 0.5).to(dt).requires_grad_(True)
        t = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
        t[torch.rand(rows, device="cuda", generator=g) < 0.1] = -100
        runs = {"eager": lambda: F.cross_entropy(F.linear(h, w).float(), t)}
        for c in (None, 128, 256, 512, 1024, 2048):
            runs[f"cufuse {c or 'dflt'}"] = (lambda c=c: cufuse.linear_cross_entropy(h, w, t, chunk_rows=c))
        if liger is not None:
            runs["liger"] = lambda: liger(w, h, t)
        for name, fn in runs.items():
            out = {}

            def step():
                h.grad = w.grad = None
                loss = fn()
                loss.backward()
                out["loss"] = loss
            try:
                us = event_median(step, 10)
            except Exception as e:
                print(f"{rows}x{feats}x{vocab:<8} {name:12} failed: {type(e).__name__}: {e}")
                continue
            hosts = []
            for _ in range(5):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                step()
                hosts.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
            h.grad = w.grad = None
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - before) / 2 ** 20
            print(f"{rows}x{feats}x{vocab:<8} {name:12} {us:9.1f} {sorted(hosts)[2]:8.0f} {peak:9.0f} "
                  f"{out['loss'].item():10.5f}")


if __name__ == "__main__":
    main()
