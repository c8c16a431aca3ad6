"""Where a training step's GPU waits for the host (python3 scripts/step_phases.py
[--dtype bfloat16] [--variants eager,cufuse,compile]): the Llama of
bench/model_probe.py, one step split into forward (with the loss), backward
and optimizer (AdamW step + zero_grad). Per phase: the host's time to queue it
(perf_counter, no synchronization) and the GPU's span over it (CUDA events at
the phase boundaries). A phase whose GPU span is near its host time is
host-bound. For the variants that are not compiled, the host time of each
cufuse autograd Function's backward, and the forward's host time by module
class (forward hooks; the hooks' own cost included), eager against each
patched variant.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import model_probe  # noqa: E402


def phases(model, opt, ids, reps):
    """Median (host ms, GPU ms) per phase over ``reps`` steps, and the whole step's."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    rows = collections.defaultdict(list)
    for i in range(reps + 3):
        torch.cuda.synchronize()
        t = [time.perf_counter()]
        ev[0].record()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        ev[1].record()
        t.append(time.perf_counter())
        loss.backward()
        ev[2].record()
        t.append(time.perf_counter())
        opt.step()
        opt.zero_grad(set_to_none=True)
        ev[3].record()
        t.append(time.perf_counter())
        ev[3].synchronize()
        t.append(time.perf_counter())
        if i < 3:
            continue
        for k, name in enumerate(("forward", "backward", "optimizer")):
            rows[name].append((1e3 * (t[k + 1] - t[k]), ev[k].elapsed_time(ev[k + 1])))
        rows["step"].append((1e3 * (t[3] - t[0]), 1e3 * (t[4] - t[0])))
    return {k: (statistics.median(h for h, _ in v), statistics.median(g for _, g in v)) for k, v in rows.items()}


def forward_by_module(model, ids, reps):
    """Host ms per forward by module class (outermost hooked modules' own time excludes their children)."""
    spent = collections.Counter()
    stack = []
    hooks = []

    def pre(mod, args):
        stack.append([mod, time.perf_counter(), 0.0])

    def post(mod, args, out):
        m, t0, child = stack.pop()
        dt = time.perf_counter() - t0
        spent[type(m).__name__] += dt - child
        if stack:
            stack[-1][2] += dt
    for m in model.modules():
        hooks.append(m.register_forward_pre_hook(pre))
        hooks.append(m.register_forward_hook(post))
    try:
        for i in range(reps + 2):
            if i == 2:
                spent.clear()
            torch.cuda.synchronize()
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            model.zero_grad(set_to_none=True)
    finally:
        for h in hooks:
            h.remove()
    torch.cuda.synchronize()
    return {k: 1e3 * v / reps for k, v in spent.items()}


def backward_nodes(model, ids, reps):
    """µs per call and calls per step of each cufuse autograd Function's
    backward in the training step (torch runs them on its device thread,
    between its own ops), by the Function (and the registered operator of an
    EagerOp)."""
    from cufuse import _autograd as AG
    spent = collections.defaultdict(lambda: [0.0, 0])
    kept = {}
    for key, cls in list(AG._CLASSES.items()):
        kept[cls] = cls.__dict__["backward"]

        def timed(ctx, *grads, f=cls.backward, key=key):
            t0 = time.perf_counter()
            r = f(ctx, *grads)
            op = getattr(getattr(ctx, "opdef", None), "_name", None)
            e = spent[f"{key}:{op}" if op else key]
            e[0] += time.perf_counter() - t0
            e[1] += 1
            return r
        cls.backward = staticmethod(timed)
    try:
        for i in range(reps + 2):
            if i == 2:
                spent.clear()
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
    finally:
        for cls, f in kept.items():
            cls.backward = f
    return {k: (1e6 * t / n, n / reps) for k, (t, n) in spent.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--variants", default="eager,cufuse,compile")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    dt = getattr(torch, a.dtype)
    base, ids, makers, module, rope = model_probe.cuda_llama(dt)
    mods = {}
    for label in a.variants.split(","):
        if rope is not None:
            module.apply_rotary_pos_emb = rope
        model = makers[label]().train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        r = phases(model, opt, ids, a.reps)
        print(f"== {label} ({a.dtype}): ms host / GPU span")
        for k, (h, g) in r.items():
            print(f"   {k:10} {h:8.2f} {g:8.2f}" + ("   (step: issue / synchronized)" if k == "step" else ""))
        if "compile" not in label:
            for k, (us, n) in sorted(backward_nodes(model, ids, a.reps).items(), key=lambda kv: -kv[1][0] * kv[1][1]):
                print(f"   backward of {k:28} {us:8.1f} us/call {n:5.1f}/step")
            mods[label] = forward_by_module(model, ids, a.reps)
        del model, opt
        torch.cuda.empty_cache()
    if mods:
        names = sorted(set().union(*mods.values()), key=lambda n: -max(m.get(n, 0) for m in mods.values()))
        print("== forward host ms by module class (own time): " + " | ".join(mods))
        for n in names:
            print(f"   {n:34}" + "".join(f"{m.get(n, 0.0):9.3f}" for m in mods.values()))
        print(f"   {'all':34}" + "".join(f"{sum(m.values()):9.3f}" for m in mods.values()))


if __name__ == "__main__":
    main()
