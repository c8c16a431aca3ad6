"""Host cost per phase of a recorded cufuse call on CUDA tensors
(python3 scripts/host_phases.py): wall time of back-to-back calls,
synchronized at the end, at a size where the GPU is never the bound."""
from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch

import cufuse
from cufuse import _autograd as AG
from cufuse import _driver as D


def misses():
    return {fp.name: fp.misses for fp in D.fast_paths()}


def wall(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t0) / n


class Ident(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g


def main():
    dt = torch.bfloat16
    x = torch.randn(256, 768, device="cuda", dtype=dt, requires_grad=True)
    y = torch.randn(256, 768, device="cuda", dtype=dt, requires_grad=True)
    g = torch.randn(256, 768, device="cuda", dtype=dt)
    xd, yd = x.detach(), y.detach()
    out = cufuse.add_relu(xd, yd)
    relu_b = AG._grads()["add_relu"][1]

    def bwd(fn):
        def run():
            x.grad = y.grad = None
            fn().backward(g)
        return run

    cases = {
        "torch clone (1 kernel)": lambda: xd.clone(),
        "cufuse add_relu no grad": lambda: cufuse.add_relu(xd, yd),
        "torch relu(x+y) no grad": lambda: torch.relu(xd + yd),
        "cufuse add_relu_backward fused fn": lambda: relu_b(g, None, out),
        "cufuse add_relu recorded fwd": lambda: cufuse.add_relu(x, y),
        "torch relu(x+y) recorded fwd": lambda: torch.relu(x + y),
        "Ident Function fwd": lambda: Ident.apply(x),
        "Ident Function fwd+bwd": bwd(lambda: Ident.apply(x)),
        "cufuse add_relu fwd+bwd": bwd(lambda: cufuse.add_relu(x, y)),
        "torch relu(x+y) fwd+bwd": bwd(lambda: torch.relu(x + y)),
        "cufuse softmax fwd+bwd": bwd(lambda: cufuse.softmax(x)),
        "torch softmax fwd+bwd": bwd(lambda: torch.softmax(x, -1)),
        "cufuse layer_norm recorded fwd": lambda: cufuse.layer_norm(x, 768),
        "torch layer_norm recorded fwd": lambda: torch.nn.functional.layer_norm(x, (768,)),
        "cufuse layer_norm no grad": lambda: cufuse.layer_norm(xd, 768),
        "cufuse norm backward direct": lambda: AG.norm_backward("layer", g, xd, 768, None, None, 1e-5),
        "cufuse layer_norm fwd+bwd": bwd(lambda: cufuse.layer_norm(x, 768)),
        "torch layer_norm fwd+bwd": bwd(lambda: torch.nn.functional.layer_norm(x, (768,))),
    }
    print(torch.cuda.get_device_name(), torch.__version__)
    for threads in (True, False):
        torch.autograd.set_multithreading_enabled(threads)
        print("autograd multithreading", threads)
        for name, fn in cases.items():
            m0 = misses()
            us = wall(fn)
            m1 = misses()
            missed = {k: v - m0.get(k, 0) for k, v in m1.items() if v != m0.get(k, 0)}
            print(f"{name:36} {us:8.1f} us/call", f"fast-path misses {missed}" if missed else "")
    for name in sys.argv[1:]:  # cProfile (in this thread: multithreading off)
        pr = cProfile.Profile()
        pr.enable()
        wall(cases[name], 100)
        pr.disable()
        print(f"==== cProfile {name}, 120 calls")
        pstats.Stats(pr).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
