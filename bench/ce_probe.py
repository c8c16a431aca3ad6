"""Cross entropy over a vocabulary, forward + backward, against torch eager,
torch.compile and Liger-Kernel, same run (python3 bench/ce_probe.py [dtype]).

Each step: logits = base.clone() (a non-leaf, as an lm_head's output: the
case where cufuse and Liger write the gradient in place of the logits), the
loss (mean, 10% of the targets ignored), backward; the clone's own time,
measured alone, is subtracted. Also the peak memory a step allocates beyond
its inputs, and the bytes a fused forward + backward must move at least
(read the logits twice, write the gradient once) as % of the copy bandwidth
of the same run.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import cufuse
from _common import event_median, optional_liger

SHAPES = [(4096, 32000), (8192, 32000), (4096, 128256)]


def main():
    dt = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, dt)
    liger = optional_liger("cross_entropy", "LigerCrossEntropyLoss", ignore_index=-100)
    impls = {"cufuse": lambda x, t: cufuse.cross_entropy(x, t),
             "eager": lambda x, t: F.cross_entropy(x, t)}
    print(f"{'shape':14} {'impl':8} {'us/step':>9} {'% copy':>7} {'peak MiB':>9} {'loss':>10}")
    for rows, vocab in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(rows + vocab)
        base = (torch.randn(rows, vocab, device="cuda", generator=g) * 2).to(dt).requires_grad_(True)
        t = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
        t[torch.rand(rows, device="cuda", generator=g) < 0.1] = -100
        nbytes = base.numel() * base.element_size()
        clone_us = event_median(lambda: base.detach().clone(), 20)
        copy_gbs = 2 * nbytes / clone_us / 1e3
        torch._dynamo.reset()
        runs = dict(impls)
        runs["compile"] = torch.compile(lambda x, tt: F.cross_entropy(x, tt))
        if liger is not None:
            runs["liger"] = lambda x, tt: liger(x, tt)
        for name, fn in runs.items():
            out = {}

            def step():
                base.grad = None
                loss = fn(base.clone(), t)
                loss.backward()
                out["loss"] = loss
            us = event_median(step, 10) - clone_us
            step()
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - before) / 2 ** 20
            pct = 100 * 3 * nbytes / us / 1e3 / copy_gbs
            print(f"{rows}x{vocab:<8} {name:8} {us:9.1f} {pct:7.1f} {peak:9.0f} {out['loss'].item():10.5f}")


if __name__ == "__main__":
    main()
