"""Model-level training and inference steps of a Hugging Face Llama from a
random config: torch eager, cufuse.patch, torch.compile of each, and
Liger-Kernel's patch, same run (python3 bench/model_probe.py [--dtype
bfloat16] [--small]).

Per variant: ms per training step (forward with labels, backward, AdamW
step; median of CUDA-event timings after warm-up), tokens/s, the peak memory
a step allocates, the first loss (all variants start from the same weights
and batch, so the losses agree to the dtype's precision), and ms per
forward-only step (one token appended: a 1 x seq decode-free forward).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import cufuse


def config(small):
    import transformers as T
    if small:
        return T.LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=512)
    return T.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
                         num_key_value_heads=8, vocab_size=32000)


def timed(fn, reps, device):
    for _ in range(2):
        fn()
    ts = []
    for _ in range(reps):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            ts.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(ts)


def variants(base):
    out = {"eager": lambda: copy.deepcopy(base)}

    def patched():
        m = copy.deepcopy(base)
        cufuse.patch(m)
        return m
    out["cufuse"] = patched
    out["compile"] = lambda: torch.compile(copy.deepcopy(base))
    out["cufuse+compile"] = lambda: torch.compile(patched())
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        def liger():
            m = copy.deepcopy(base)
            _apply_liger_kernel_to_instance(model=m)
            return m
        out["liger"] = liger
    except Exception as e:  # not installed
        print("Liger-Kernel not importable:", e)
    return out


def main():
    import transformers as T
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--small", action="store_true", help="tiny sizes (the CPU's)")
    ap.add_argument("--variants", default=None, help="comma-separated variants to run (default: all)")
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and cufuse.CUDA_AVAILABLE else "cpu"
    small = a.small or device == "cpu"
    dtype = getattr(torch, a.dtype)
    batch, seq = a.batch or (2 if small else 4), a.seq or (32 if small else 1024)
    torch.manual_seed(0)
    base = T.LlamaForCausalLM(config(small)).to(device=device, dtype=dtype)
    ids = torch.randint(0, base.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}, {a.dtype}, Llama {base.config.num_hidden_layers} x "
          f"{base.config.hidden_size}, {batch} x {seq} tokens")
    print(f"{'variant':16} {'train ms':>9} {'tokens/s':>10} {'peak MiB':>9} {'first loss':>11} {'forward ms':>11}")
    import sys
    module = sys.modules[type(base).__module__]
    original = module.apply_rotary_pos_emb  # a patch replaces this module function: each variant starts from it
    chosen = variants(base)
    if a.variants:
        chosen = {k: v for k, v in chosen.items() if k in a.variants.split(",")}
    for label, make in chosen.items():
        module.apply_rotary_pos_emb = original
        torch._dynamo.reset()
        model = make().train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        first = {}

        def step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            first.setdefault("loss", loss.detach())
        try:
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            ms = timed(step, a.reps, device)
            peak = (torch.cuda.max_memory_allocated() - before) / 2 ** 20 if device == "cuda" else float("nan")
            with torch.no_grad():
                fwd = timed(lambda: model(input_ids=ids), a.reps, device)
        except Exception as e:  # a variant that fails says so and the others run
            print(f"{label:16} failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            continue
        print(f"{label:16} {ms:9.2f} {batch * seq / ms * 1e3:10.0f} {peak:9.0f} {first['loss'].item():11.5f} "
              f"{fwd:11.2f}")
        del model, opt
        if device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
