"""Why a torch.compile'd patched Llama trains slower than the compiled plain
one (issue 33's compiled-block target; issue 35's training vs compile):
python3 scripts/compile_profile.py [--dtype bfloat16] [--variants compile,cufuse+compile] [--small]

For each variant of bench/model_probe.py (the benchmark's Llama 8 x 2048,
4 x 1024 tokens, AdamW), after warm-up steps:
- the host time to issue one step (no synchronization) against the whole
  step (synchronized): a step whose issue time is near its whole time is
  host-bound;
- the synchronizations one step makes (torch's sync debug mode, counted);
- the GPU kernels of two steps grouped by name (the most total time first)
  and the sum of all kernels' time, from the torch profiler;
- the host ops with the most self time (cufuse's custom ops among them);
- at the end, the GPU time per step of each kernel family (GEMM, attention,
  the optimizer, Inductor's Triton kernels, torch's own elementwise / reduce /
  copy kernels, the rest: cufuse's) by variant, and the kernels whose time
  differs most from the first variant's.
--small: the tiny config on the CPU (a check that the script runs).
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import model_probe as MP  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--variants", default="compile,cufuse+compile")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    import transformers as T
    cuda = torch.cuda.is_available() and not a.small
    dev = "cuda" if cuda else "cpu"
    dt = getattr(torch, a.dtype) if cuda else torch.float32
    torch.manual_seed(0)
    base = T.LlamaForCausalLM(MP.config(not cuda)).to(dev, dt)
    vocab = base.config.vocab_size
    ids = torch.randint(0, vocab, (4, 1024) if cuda else (2, 32), device=dev)
    makers = MP.variants(base)
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = max(64, torch._dynamo.config.recompile_limit)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    per_variant = {}  # label -> {kernel: ms per step}
    module = sys.modules[type(base).__module__]
    rope = getattr(module, "apply_rotary_pos_emb", None)  # cufuse.patch swaps it for every model of the module
    for label in a.variants.split(","):
        if rope is not None:
            module.apply_rotary_pos_emb = rope
        model = makers[label]().train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step(model=model, opt=opt):
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        for _ in range(3):
            step()
        sync()
        issue, whole = [], []
        for _ in range(5):
            sync()
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            sync()
            issue.append(1e3 * (t1 - t0))
            whole.append(1e3 * (time.perf_counter() - t0))
        print(f"== {label} ({a.dtype if cuda else 'float32, cpu'}): issue {statistics.median(issue):.2f} ms of a "
              f"{statistics.median(whole):.2f} ms step")
        if cuda:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs = collections.Counter(str(w.message).splitlines()[0][:100] for w in caught
                                        if "synchroniz" in str(w.message))
            print(f"   synchronizations in one step: {sum(syncs.values())}", dict(syncs.most_common(3)))
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(2):
                step()
            sync()
        events = prof.key_averages()
        if cuda:
            kern = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                          key=lambda e: -e.self_device_time_total)
            total = sum(e.self_device_time_total for e in kern)
            print(f"   GPU kernels, two steps: {total / 1e3:.2f} ms in all")
            for e in kern[:a.top]:
                print(f"   {e.self_device_time_total / 1e3:8.2f} ms {e.count:5d}x  {e.key[:100]}")
            per_variant[label] = {e.key: e.self_device_time_total / 2e3 for e in kern if "#" not in e.key}
        host = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
                      key=lambda e: -e.self_cpu_time_total)
        print("   host ops by self time, two steps:")
        for e in host[:a.top]:
            print(f"   {e.self_cpu_time_total / 1e3:8.2f} ms {e.count:5d}x  {e.key[:100]}")
        del model, opt, step
    if per_variant:
        compare(per_variant)


FAMILIES = (("attention", r"sdpa|fmha|flash|cudnn"), ("GEMM", r"nvjet|gemm|cutlass|cublas|splitKreduce"),
            ("optimizer", r"multi_tensor_apply"), ("Triton (Inductor)", r"^triton_"),
            ("torch elementwise/reduce/copy", r"at::native|at_cuda_detail|Memset|Memcpy"))


def family(name):
    import re
    return next((f for f, rx in FAMILIES if re.search(rx, name)), "other (cufuse's)")


def compare(per_variant, top=12):
    """GPU ms per step by kernel family and variant; the kernels whose time differs most from the first
    variant's."""
    labels = list(per_variant)
    fams = [f for f, _ in FAMILIES] + ["other (cufuse's)"]
    sums = {lb: collections.Counter() for lb in labels}
    for lb, ks in per_variant.items():
        for k, ms in ks.items():
            sums[lb][family(k)] += ms
    print("== GPU ms per step by kernel family: " + " | ".join(labels))
    for f in fams + ["all"]:
        vals = [sum(sums[lb].values()) if f == "all" else sums[lb][f] for lb in labels]
        print(f"   {f:32s}" + "".join(f"{v:9.2f}" for v in vals))
    names = set().union(*per_variant.values())
    first = per_variant[labels[0]]
    diff = sorted(names, key=lambda k: -max(abs(per_variant[lb].get(k, 0.0) - first.get(k, 0.0)) for lb in labels))
    print(f"== kernels differing most from {labels[0]}'s, ms per step: " + " | ".join(labels))
    for k in diff[:top]:
        print("   " + "".join(f"{per_variant[lb].get(k, 0.0):7.3f}" for lb in labels) + f"  {k[:90]}")


if __name__ == "__main__":
    main()
