"""Host time of one Llama layer's modules, transformers' against cufuse.patch's
(python3 scripts/module_host.py [tokens] [--dtype bfloat16]): the RMSNorm, the
MLP, the attention and the whole decoder layer of bench/model_probe.py's
Llama, on one sequence of ``tokens`` (few: the GPU's work stays small), as
wall time per call of back-to-back calls: forward with grad (the graph made,
no backward), and forward + backward of the output's sum. The two versions
alternate in 7 rounds (the median shown): these hosts drift by tens of
percent within a minute.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

import cufuse

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import model_probe  # noqa: E402


def per_call(fn, n, backward):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        y = fn()
        if backward:
            (y[0] if isinstance(y, tuple) else y).sum().backward()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1e6 * t / n


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tokens", nargs="?", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    dt = getattr(torch, a.dtype)
    base = model_probe.build("llama", False, "cuda", dt)
    module = sys.modules[type(base).__module__]
    plain_rope = module.apply_rotary_pos_emb
    patched = copy.deepcopy(base)
    cufuse.patch(patched, linear_loss=False)
    cufuse_rope = module.apply_rotary_pos_emb
    layers = {"torch": (base.model.layers[0], plain_rope), "cufuse": (patched.model.layers[0], cufuse_rope)}
    x = torch.randn(1, a.tokens, base.config.hidden_size, device="cuda", dtype=dt, requires_grad=True)
    pe = base.model.rotary_emb(x, torch.arange(a.tokens, device="cuda")[None])

    def case(name, layer, rope):
        def f():
            module.apply_rotary_pos_emb = rope  # looked up by the attention at each call
            if name == "rmsnorm":
                return layer.input_layernorm(x)
            if name == "mlp":
                return layer.mlp(x)
            if name == "attention":
                return layer.self_attn(x, position_embeddings=pe, attention_mask=None)[0]
            return layer(x, position_embeddings=pe, attention_mask=None)
        return f

    print(f"us per call, {a.tokens} tokens, {a.dtype}: forward with grad | forward + backward")
    try:
        for name in ("rmsnorm", "mlp", "attention", "layer"):
            fns = {k: case(name, *v) for k, v in layers.items()}
            for f in fns.values():  # warm-up: kernels compiled, recipes kept
                per_call(f, 10, False)
                per_call(f, 5, True)
            got = {(k, b): [] for k in fns for b in (False, True)}
            for _ in range(7):
                for (k, b), v in got.items():
                    v.append(per_call(fns[k], 50 if b else 100, b))
            m = {kb: statistics.median(v) for kb, v in got.items()}
            print(f"   {name:10} torch {m['torch', False]:8.1f} cufuse {m['cufuse', False]:8.1f}"
                  f" | torch {m['torch', True]:8.1f} cufuse {m['cufuse', True]:8.1f}")
    finally:
        module.apply_rotary_pos_emb = plain_rope


if __name__ == "__main__":
    main()
