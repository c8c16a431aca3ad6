"""Rotary position embedding of q and k, forward + backward, against Hugging
Face's apply_rotary_pos_emb in torch eager, torch.compile and Liger-Kernel,
same run (python3 bench/rope_probe.py [dtype]).

Each step rotates q [batch, heads, tokens, dim] and k [batch, kv heads,
tokens, dim] with cos / sin [batch, tokens, dim] and back-propagates a
gradient; µs per step (CUDA events, median), and the bytes a fused forward
+ backward must move at least (read q and k, write them; read their
gradients, write those) as % of the same run's copy bandwidth.
"""
from __future__ import annotations

import sys

import torch

import cufuse
from _common import event_median

SHAPES = [(4, 32, 2048, 128, 8), (8, 32, 1024, 64, 32)]  # batch, heads, tokens, dim, kv heads


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), -1)


def hf(q, k, cos, sin):
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def main():
    dt = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, dt)
    impls = {"cufuse": lambda q, k, c, s: cufuse.rope(q, k, c, s), "eager": hf}
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
        impls["liger"] = lambda q, k, c, s: LigerRopeFunction.apply(q, k, c, s)
    except Exception as e:
        print("Liger-Kernel not importable:", e)
    print(f"{'shape':28} {'impl':14} {'us/step':>9} {'% copy':>7}")
    for b, h, t, d, kh in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(t + d)
        q = torch.randn(b, h, t, d, device="cuda", generator=g).to(dt).requires_grad_(True)
        k = torch.randn(b, kh, t, d, device="cuda", generator=g).to(dt).requires_grad_(True)
        ang = torch.rand(b, t, d // 2, device="cuda", generator=g) * 6
        emb = torch.cat((ang, ang), -1)
        cos, sin = emb.cos().to(dt), emb.sin().to(dt)
        gq, gk = torch.randn_like(q), torch.randn_like(k)
        nbytes = (q.numel() + k.numel()) * q.element_size()
        copy_gbs = 2 * nbytes / event_median(lambda: (q.detach().clone(), k.detach().clone()), 20) / 1e3
        torch._dynamo.reset()
        runs = dict(impls)
        runs["compile"] = torch.compile(hf)
        runs["cufuse+compile"] = torch.compile(lambda q, k, c, s: cufuse.rope(q, k, c, s))
        for name, fn in runs.items():
            def step():
                q.grad = k.grad = None
                oq, ok = fn(q, k, cos, sin)
                torch.autograd.backward((oq, ok), (gq, gk))
            us = event_median(step, 20)
            pct = 100 * 4 * nbytes / us / 1e3 / copy_gbs
            print(f"{b}x{h}x{t}x{d} kv{kh:<10} {name:14} {us:9.1f} {pct:7.1f}")


if __name__ == "__main__":
    main()
