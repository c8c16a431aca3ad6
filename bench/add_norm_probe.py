"""Residual add + RMSNorm, forward + backward, against the unfused chain in
torch eager, torch.compile and Liger-Kernel's fused add RMSNorm, same run
(python3 bench/add_norm_probe.py [dtype]).

Each step computes (y, h) = (rms_norm(x + r) * w, x + r) and back-propagates
gradients into both outputs (a transformer block's residual stream); µs per
step (CUDA events, median) and the bytes a fused forward + backward must
move at least (read x, r, write h, y; read the two gradients and h, write
one gradient) as % of the same run's copy bandwidth. Also the forward alone
under torch.no_grad().
"""
from __future__ import annotations

import sys

import torch

import cufuse
from _common import event_median

SHAPES = [(16384, 4096), (8192, 8192), (32768, 2048)]
EPS = 1e-6


def eager(x, r, w):
    h = x + r
    hf = h.float()
    return (hf * torch.rsqrt(hf.square().mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype), h


def main():
    dt = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, dt)
    impls = {"cufuse": lambda x, r, w: cufuse.add_rms_norm(x, r, x.shape[-1], w, EPS), "eager": eager}
    try:
        from liger_kernel.ops import LigerFusedAddRMSNormFunction
        impls["liger"] = lambda x, r, w: LigerFusedAddRMSNormFunction.apply(x, r, w, EPS, 0.0, "none", False)
    except Exception as e:
        print("Liger-Kernel not importable:", e)
    print(f"{'shape':14} {'impl':8} {'fwd+bwd us':>11} {'% copy':>7} {'fwd us':>8} {'% copy':>7}")
    for rows, n in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(rows + n)
        x = torch.randn(rows, n, device="cuda", generator=g).to(dt).requires_grad_(True)
        r = torch.randn(rows, n, device="cuda", generator=g).to(dt).requires_grad_(True)
        w = (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).to(dt).requires_grad_(True)
        gy, gh = torch.randn_like(x), torch.randn_like(x)
        nbytes = x.numel() * x.element_size()
        copy_gbs = 2 * nbytes / event_median(lambda: x.detach().clone(), 20) / 1e3
        torch._dynamo.reset()
        runs = dict(impls)
        runs["compile"] = torch.compile(eager)
        for name, fn in runs.items():
            def step():
                x.grad = r.grad = w.grad = None
                y, h = fn(x, r, w)
                torch.autograd.backward((y, h), (gy, gh))

            def fwd():
                with torch.no_grad():
                    fn(x, r, w)
            us, fus = event_median(step, 20), event_median(fwd, 20)
            print(f"{rows}x{n:<8} {name:8} {us:11.1f} {100 * 8 * nbytes / us / 1e3 / copy_gbs:7.1f} {fus:8.1f} "
                  f"{100 * 4 * nbytes / fus / 1e3 / copy_gbs:7.1f}")


if __name__ == "__main__":
    main()
