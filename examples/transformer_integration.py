"""Train a few steps of a small Llama-style and GPT-2-style model from a
random config, eager against cufuse (``cufuse.patch``), and print loss,
tokens/s and peak memory side by side.

    python examples/transformer_integration.py            # GPU if there is one, else CPU (tiny sizes)
    python examples/transformer_integration.py --steps 20 --dtype bfloat16

Needs torch and transformers. Both runs start from the same weights and
batches, so their losses agree to the precision of the dtype.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

import cufuse



def _adam_eps(model):
    """AdamW's eps for the model's parameters: 1e-8 rounds to 0 in float16 (pure float16 training then
    divides 0 by 0: NaN losses), so 1e-4 there."""
    return 1e-4 if next(model.parameters()).dtype == torch.float16 else 1e-8

def models(small):
    import transformers as T
    if small:  # CPU: the NumPy fallback, tiny sizes
        llama = dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=512)
        gpt2 = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=128)
    else:
        llama = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                     num_key_value_heads=4, vocab_size=32000)
        gpt2 = dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024)
    return {"llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**llama)),
            "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(bos_token_id=0, eos_token_id=0, **gpt2))}


def run(model, batches, device):
    """Losses per step, tokens/s over the steps after the first (which
    compiles and warms caches), peak MiB (GPU)."""
    torch.manual_seed(2)  # the same dropout masks in both runs (cufuse's ops draw none from torch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, eps=_adam_eps(model))
    losses = []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = None
    for ids in batches:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().item())  # (a synchronize on the GPU)
        if t0 is None:
            t0 = time.perf_counter()
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2 ** 20 if device == "cuda" else float("nan")
    timed = sum(b.numel() for b in batches[1:])
    return losses, (timed / dt if timed else float("nan")), peak


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--small", action="store_true", help="the CPU's tiny sizes on the GPU too")
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and cufuse.CUDA_AVAILABLE else "cpu"
    small = device == "cpu" or a.small
    dtype = getattr(torch, a.dtype)
    batch, seq = a.batch or (2 if small else 8), a.seq or (32 if small else 1024)
    print(f"device {device}, dtype {a.dtype}, {a.steps} steps of {batch} x {seq} tokens")
    print(f"{'model':7} {'run':7} {'first loss':>11} {'last loss':>10} {'tokens/s':>10} {'peak MiB':>9}")
    for name, make in models(small).items():
        torch.manual_seed(0)
        base = make().to(device=device, dtype=dtype)
        vocab = base.config.vocab_size
        g = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, vocab, (batch, seq), generator=g).to(device) for _ in range(a.steps)]
        patched = copy.deepcopy(base)
        report = cufuse.patch(patched)
        for label, model in (("eager", base), ("cufuse", patched)):
            losses, tps, peak = run(model.train(), batches, device)
            print(f"{name:7} {label:7} {losses[0]:11.4f} {losses[-1]:10.4f} {tps:10.0f} {peak:9.0f}")
        print(f"        ({sum(report.counts().values())} modules replaced: "
              f"{', '.join(f'{n} {k}' for k, n in report.counts().items())})")


if __name__ == "__main__":
    main()
