"""Forward + backward of the differentiable ops against torch eager,
torch.compile and Liger-Kernel, same run
(python3 bench/train_probe.py [dtype [op ...]]).

Per op and shape: median of CUDA-event timings of 10 back-to-back steps
y = op(...); y.backward(g) after a warm-up (gradients set to None between
steps), per step, and the bytes a
fused forward + backward must move at least (forward: read x, write y;
backward: read g and x (or y), write dx; weight/bias reads and their
gradients are small), as % of the copy bandwidth measured in the same run.
Liger-Kernel is used where it has the op (layer_norm, rms_norm, softmax).
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import cufuse
from _common import event_median

REPS = 20
SHAPES = [(4096, 4096), (16384, 4096), (4096, 8192)]


def timed(fn):
    """µs per step of 10 back-to-back steps (the host queues ahead: device
    time where the GPU is the bound, host time where the host is)."""
    return event_median(fn, REPS, inner=10)


def peak_step(run):
    """MiB a step allocates at its peak beyond what was allocated before it."""
    run()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def step(fn, inputs, g):
    def run():
        for t in inputs:
            t.grad = None
        fn(*inputs).backward(g)
    return run


def liger():
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.softmax import LigerSoftmaxFunction
    except Exception as e:  # not installed
        print("Liger-Kernel not importable:", e)
        return {}
    return {"layer_norm": lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, 1e-5),
            "rms_norm": lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6),
            "softmax": lambda x: LigerSoftmaxFunction.apply(x)}


@cufuse.fuse
def _swiglu(gate, up):
    return gate * cufuse.sigmoid(gate) * up


def main():
    dt = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, dt)
    lig = liger()
    ops = {  # name: (cufuse, torch reference, needs weight, needs bias)
        "add_relu": (lambda x, y: cufuse.add_relu(x, y), lambda x, y: torch.relu(x + y), "xy"),
        "bias_gelu": (lambda x, b: cufuse.bias_gelu(x, b), lambda x, b: F.gelu(x + b), "xb"),
        "layer_norm": (lambda x, w, b: cufuse.layer_norm(x, x.shape[-1], w, b),
                       lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b), "xwb"),
        "rms_norm": (lambda x, w: cufuse.rms_norm(x, x.shape[-1], w),
                     lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6), "xw"),
        "softmax": (lambda x: cufuse.softmax(x), lambda x: torch.softmax(x, -1), "x"),
        "log_softmax": (lambda x: cufuse.log_softmax(x), lambda x: torch.log_softmax(x, -1), "x"),
        "gelu_dropout": (lambda x: cufuse.gelu_dropout(x, 0.1), lambda x: F.dropout(F.gelu(x), 0.1), "x"),
        "swiglu (fuse)": (lambda a, b: _swiglu(a, b), lambda a, b: F.silu(a) * b, "xy"),
    }
    if len(sys.argv) > 2:  # only the ops named after the dtype
        ops = {k: v for k, v in ops.items() if k.split()[0] in sys.argv[2:]}
    print(f"{'op':12} {'shape':12} {'cufuse':>8} {'eager':>8} {'compile':>8} {'liger':>8} {'vs best':>8} "
          f"{'% copy':>7} {'peak MiB cufuse/eager':>22}")
    for rows, cols in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(rows + cols)
        x0 = torch.randn(rows, cols, device="cuda", generator=gen).to(dt)
        nbytes = x0.numel() * x0.element_size()
        copy_gbs = 2 * nbytes / timed(lambda: x0.clone()) / 1e3
        for name, (ours, ref, args) in ops.items():
            def inputs():
                out = []
                for a in args:
                    shape = (rows, cols) if a in "xy" else (cols,)
                    out.append(torch.randn(shape, device="cuda", generator=gen).to(dt).requires_grad_(True))
                return out
            ins = inputs()
            g = torch.randn(rows, cols, device="cuda", generator=gen).to(dt)
            t = {"cufuse": timed(step(ours, ins, g)), "eager": timed(step(ref, ins, g))}
            torch._dynamo.reset()
            t["compile"] = timed(step(torch.compile(ref), ins, g))
            if name in lig:
                t["liger"] = timed(step(lig[name], ins, g))
            peaks = [peak_step(step(f, ins, g)) for f in (ours, ref)]
            best = min(v for k, v in t.items() if k in ("compile", "liger"))
            moved = (4 + (2 if "y" in args else 0)) * nbytes  # x, y read; out written; g read; dx (dy) written
            pct = 100 * moved / t["cufuse"] / 1e3 / copy_gbs
            print(f"{name:12} {rows}x{cols:<7} {t['cufuse']:8.1f} {t['eager']:8.1f} {t['compile']:8.1f} "
                  f"{t.get('liger', float('nan')):8.1f} {best / t['cufuse']:8.2f} {pct:7.1f} "
                  f"{peaks[0]:10.1f} / {peaks[1]:<10.1f}")


if __name__ == "__main__":
    main()
