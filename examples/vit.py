"""A Vision Transformer (Hugging Face ``ViTForImageClassification`` from a
random config): inference and a few training steps, eager against cufuse
(``cufuse.patch``: its LayerNorms and GELUs), printed side by side.

    python examples/vit.py                    # GPU if there is one, else CPU (tiny sizes)
    python examples/vit.py --dtype bfloat16 --steps 10

Needs torch and transformers. Both models start from the same weights and
see the same images, so their logits and losses agree to the precision of
the dtype; the table gives the largest logit difference.
"""
from __future__ import annotations

import argparse
import copy

import torch

import cufuse
from _timing import timed  # examples/_timing.py, beside this script



def _adam_eps(model):
    """AdamW's eps for the model's parameters: 1e-8 rounds to 0 in float16 (pure float16 training then
    divides 0 by 0: NaN losses), so 1e-4 there."""
    return 1e-4 if next(model.parameters()).dtype == torch.float16 else 1e-8

def config(small):
    import transformers as T
    if small:  # CPU: the NumPy fallback, tiny sizes
        return T.ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=128, num_labels=10)
    return T.ViTConfig(num_labels=1000)  # ViT-Base/16 at 224 x 224


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--small", action="store_true", help="the CPU's tiny sizes on the GPU too")
    a = ap.parse_args()
    import transformers as T
    device = "cuda" if torch.cuda.is_available() and cufuse.CUDA_AVAILABLE else "cpu"
    small = device == "cpu" or a.small
    dtype = getattr(torch, a.dtype)
    cfg = config(small)
    batch = a.batch or (4 if small else 32)
    torch.manual_seed(0)
    base = T.ViTForImageClassification(cfg).to(device=device, dtype=dtype)
    patched = copy.deepcopy(base)
    report = cufuse.patch(patched)
    g = torch.Generator().manual_seed(1)
    images = torch.randn(batch, 3, cfg.image_size, cfg.image_size, generator=g).to(device=device, dtype=dtype)
    labels = torch.randint(0, cfg.num_labels, (batch,), generator=g).to(device)
    print(f"device {device}, dtype {a.dtype}, ViT {cfg.num_hidden_layers} layers x {cfg.hidden_size}, "
          f"{batch} images of {cfg.image_size} x {cfg.image_size}, {a.steps} steps")
    print(f"{'run':7} {'infer img/s':>12} {'train img/s':>12} {'first loss':>11} {'last loss':>10} "
          f"{'peak MiB':>9} {'max |logit diff|':>17}")
    logits = {}
    for label, model in (("eager", base), ("cufuse", patched)):
        model.eval()
        with torch.no_grad():
            logits[label], t_inf = timed(lambda: model(pixel_values=images).logits, a.steps, device)
        model.train()
        torch.manual_seed(2)  # the same dropout masks in both runs (a ViT config has none by default)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, eps=_adam_eps(model))
        losses = []

        def step():
            loss = model(pixel_values=images, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        _, t_train = timed(step, a.steps, device)
        peak = torch.cuda.max_memory_allocated() / 2 ** 20 if device == "cuda" else float("nan")
        diff = (logits[label].float() - logits["eager"].float()).abs().max().item()
        print(f"{label:7} {batch / t_inf:12.1f} {batch / t_train:12.1f} {losses[0].item():11.4f} "
              f"{losses[-1].item():10.4f} {peak:9.0f} {diff:17.3g}")
    print(f"({sum(report.counts().values())} modules replaced: "
          f"{', '.join(f'{n} {k}' for k, n in report.counts().items())})")


if __name__ == "__main__":
    main()
