"""Model-level training and inference steps of a Hugging Face Llama (or
GPT-2) from a random config: torch eager, cufuse.patch, torch.compile of
each, and Liger-Kernel's patch, same run (python3 bench/model_probe.py
[--model gpt2] [--dtype bfloat16] [--small] [--decode]); ``run`` is what
bench/test_bench_models.py calls.

Per variant: ms per training step (forward with labels and
``use_cache=False``, backward, AdamW step: transformers otherwise makes a KV
cache in training too, a copy of every layer's keys and values; the median
over --rounds interleaved rounds of each round's median of --reps CUDA-event
timings after warm-up; every variant is built first, so the
rounds alternate between them and a drift of the host or the GPU touches all
alike), tokens/s, the peak memory a step allocates (first round), the first
loss (all variants start from the same weights and batch, so the losses agree
to the dtype's precision), ms per forward-only step, and the rounds' range of
the training step (the same code moved by 40% between calls on an H200 host:
bench/NOTES.md, session 49).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import cufuse


def config(small, family="llama"):
    """The issue's models from a config (random weights): Llama 8 x 2048 and GPT-2 12 x 768, or tiny ones."""
    import transformers as T
    if family == "gpt2":
        if small:
            return T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=64)
        return T.GPT2Config(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024)
    if small:
        return T.LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=512)
    return T.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
                         num_key_value_heads=8, vocab_size=32000)


def build(family, small, device, dtype):
    """The unpatched model of ``family`` on ``device`` in ``dtype`` (seeded)."""
    import transformers as T
    torch.manual_seed(0)
    cls = T.GPT2LMHeadModel if family == "gpt2" else T.LlamaForCausalLM
    return cls(config(small, family)).to(device=device, dtype=dtype)


def cuda_llama(dtype):
    """(the benchmark's Llama in ``dtype`` on CUDA, a 4 x 1024 batch of ids,
    its ``variants``, its modeling module, that module's own
    apply_rotary_pos_emb): what the scripts that time its step start from
    (a patch replaces the rope function for the whole module, so each variant
    puts it back first)."""
    import sys
    base = build("llama", False, "cuda", dtype)
    ids = torch.randint(0, base.config.vocab_size, (4, 1024), device="cuda")
    module = sys.modules[type(base).__module__]
    return base, ids, variants(base), module, getattr(module, "apply_rotary_pos_emb", None)


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


def issue_time(fn, device):
    """ms the host takes to queue one call of ``fn`` (the GPU idle before it,
    no synchronization inside): near the whole step's time, the step is
    host-bound (the GPU waits for Python); well below it, GPU-bound."""
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    ms = 1e3 * (time.perf_counter() - t0)
    if device == "cuda":
        torch.cuda.synchronize()
    return ms


def variants(base):
    out = {"eager": lambda: copy.deepcopy(base)}

    def patched(linear_loss=True):
        m = copy.deepcopy(base)
        cufuse.patch(m, linear_loss=linear_loss)
        return m
    out["cufuse"] = patched
    out["cufuse-logits"] = lambda: patched(False)  # the head and loss apart: logits made
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


def run(base, ids, reps=10, rounds=3, only=None, decode=False, log=print):
    """Every variant of ``base`` (``variants``; ``only``: a subset) built
    first, then timed in ``rounds`` interleaved rounds on ``ids`` (the labels
    too). Returns {variant: {"train_ms", "tokens_s", "peak_mib", "issue_ms" (one
    step's ``issue_time`` a round, median), "first_loss", "forward_ms",
    "rounds_ms"[, "decode_ms"]}}; a variant that fails is
    reported through ``log`` and left out. ``decode``: also one token of batch
    1 after a 128-token prompt, with the KV cache (no grad)."""
    import sys
    device = ids.device.type
    module = sys.modules[type(base).__module__]
    original = getattr(module, "apply_rotary_pos_emb", None)  # a patch replaces it: each variant starts from it
    chosen = variants(base)
    if only:
        chosen = {k: v for k, v in chosen.items() if k in only}
    # a fresh start for torch.compile: what earlier calls compiled counts toward Dynamo's limit of
    # recompilations per function, past which it runs the function eagerly without saying so in the results
    # (a second dtype's compiled Llama ran as eager: the same peak, the same times)
    torch._dynamo.reset()
    # and room for every variant's graphs: two compiled models, training and no-grad forwards, a prompt and a
    # decode step recompile the same functions more than the default 8 times
    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, max(64, getattr(torch._dynamo.config, limit)))
            break
    built = {}
    clean = dict(vars(module))
    for label, make in chosen.items():  # every variant built first, then timed in interleaved rounds
        if original is not None:
            module.apply_rotary_pos_emb = original
        try:
            model = make().train()
        except Exception as e:  # a variant that fails says so and the others run
            log(f"{label:16} failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            continue
        finally:
            # Liger's patch also swaps the modeling module's classes (LlamaRMSNorm, LlamaMLP): every model
            # built after it in this process (the next dtype's) would be made of Liger's modules. Its
            # instance keeps what it swapped; the rope function, looked up at each call, goes with each
            # variant below.
            rope = getattr(module, "apply_rotary_pos_emb", None)
            vars(module).update(clean)
            if rope is not None:
                module.apply_rotary_pos_emb = rope
        built[label] = {"model": model, "opt": torch.optim.AdamW(model.parameters(), lr=1e-5),
                        "rope": getattr(module, "apply_rotary_pos_emb", None), "ms": [], "fwd": [], "dec": [], "issue": [],
                        "first": None, "peak": float("nan")}
    prompt = ids[:1, :128]
    for rnd in range(rounds):
        for label, v in list(built.items()):
            if original is not None:
                module.apply_rotary_pos_emb = v["rope"]  # the function this variant's patch installed

            def step(v=v):
                loss = v["model"](input_ids=ids, labels=ids, use_cache=False).loss  # training: no KV cache
                loss.backward()
                v["opt"].step()
                v["opt"].zero_grad(set_to_none=True)
                if v["first"] is None:
                    v["first"] = loss.item()
            try:
                if device == "cuda" and rnd == 0:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    before = torch.cuda.memory_allocated()
                v["ms"].append(timed(step, reps, device))
                if device == "cuda" and rnd == 0:
                    v["peak"] = (torch.cuda.max_memory_allocated() - before) / 2 ** 20
                v["issue"].append(issue_time(step, device))
                with torch.no_grad():
                    v["fwd"].append(timed(lambda v=v: v["model"](input_ids=ids), reps, device))
                    if decode:  # (transformers 5 names the KV cache ``cache``, 4 ``past_key_values``)
                        first = v["model"](input_ids=prompt, use_cache=True)
                        kw = {"cache": first.cache} if "cache" in first else {"past_key_values": first.past_key_values}
                        token = prompt[:, -1:]
                        v["dec"].append(timed(lambda v=v, kw=kw: v["model"](input_ids=token, use_cache=True, **kw),
                                              reps, device))
            except Exception as e:
                log(f"{label:16} failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                del built[label]
    if original is not None:
        module.apply_rotary_pos_emb = original
    out = {}
    for label, v in built.items():
        ms = statistics.median(v["ms"])
        out[label] = {"train_ms": ms, "tokens_s": ids.numel() / ms * 1e3, "peak_mib": v["peak"],
                      "issue_ms": statistics.median(v["issue"]),
                      "first_loss": v["first"], "forward_ms": statistics.median(v["fwd"]),
                      "rounds_ms": (min(v["ms"]), max(v["ms"]))}
        if decode:
            out[label]["decode_ms"] = statistics.median(v["dec"])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama", choices=["llama", "gpt2"])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--reps", type=int, default=10, help="steps per round (their median is the round's figure)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all variants, interleaved; the median is shown")
    ap.add_argument("--small", action="store_true", help="tiny sizes (the CPU's)")
    ap.add_argument("--variants", default=None, help="comma-separated variants to run (default: all)")
    ap.add_argument("--decode", action="store_true", help="also time a one-token decode step (batch 1)")
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and cufuse.CUDA_AVAILABLE else "cpu"
    small = a.small or device == "cpu"
    dtype = getattr(torch, a.dtype)
    batch, seq = a.batch or (2 if small else 4), a.seq or (32 if small else 1024)
    base = build(a.model, small, device, dtype)
    ids = torch.randint(0, base.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}, {a.dtype}, {a.model} {base.config.num_hidden_layers} x "
          f"{base.config.hidden_size}, {batch} x {seq} tokens")
    print(f"{'variant':16} {'train ms':>9} {'issue ms':>9} {'tokens/s':>10} {'peak MiB':>9} {'first loss':>11} {'forward ms':>11} "
          f"{'rounds ms':>14}" + (f" {'decode ms':>10}" if a.decode else ""))
    res = run(base, ids, a.reps, a.rounds, a.variants.split(",") if a.variants else None, a.decode)
    for label, r in res.items():
        lo, hi = r["rounds_ms"]
        print(f"{label:16} {r['train_ms']:9.2f} {r['issue_ms']:9.2f} {r['tokens_s']:10.0f} {r['peak_mib']:9.0f} {r['first_loss']:11.5f} "
              f"{r['forward_ms']:11.2f} {lo:8.2f}-{hi:.2f}" + (f" {r['decode_ms']:10.3f}" if a.decode else ""))


if __name__ == "__main__":
    main()
