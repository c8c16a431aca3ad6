"""Flash attention, forward and forward + backward, against torch's
scaled_dot_product_attention with its flash backend (FlashAttention-2) and
its cuDNN backend, same run (python3 bench/attention_probe.py [dtype] [quick]
[fwd]). On a Hopper GPU "cufuse" is the wgmma forward (attention_sm90.cu) and
"cufuse80" the mma.sync one (attention.cu) forced; "fwd": forward only.

TFLOP/s counts 4 * batch * heads * seq_q * seq_k * dim for the forward
(two products), half of it under a causal mask, and 2.5 times the forward
for the backward (FlashAttention's convention); batch * heads = 16384 / seq
* 16 keeps the GPU covered. µs per call: CUDA events, median. Each result is
checked against the flash backend before it is timed. Also the registers
and spilled bytes of the kernels (cuFuncGetAttribute).
"""
from __future__ import annotations

import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import cufuse
from _common import event_median

SEQS = [1024, 4096, 16384]
DIMS = [64, 128]


def _regs(dt):
    from cupy.cuda import driver
    from cufuse import _arrays as A
    from cufuse import _runtime as R
    import importlib
    AT = importlib.import_module("cufuse.ops.attention")
    ndt = A.torch_to_numpy_dtype(dt)
    for d in DIMS:
        for kern in AT._KERNELS:
            fn = R.get_function(AT._part(d, ndt), AT._expr(kern, d, ndt), 0)
            print(f"  {kern:24} d{d}: {driver.funcGetAttribute(4, fn.ptr)} registers, "
                  f"{driver.funcGetAttribute(3, fn.ptr)} local bytes")
        if AT._uses_sm90(0, d):
            fn = R.get_function(AT._sm90_part(d, ndt), AT._sm90_expr(d, ndt), 0)
            print(f"  {'attention_forward_sm90':24} d{d}: {driver.funcGetAttribute(4, fn.ptr)} registers, "
                  f"{driver.funcGetAttribute(3, fn.ptr)} local bytes")


def sweep(dt):
    """The forward's (row tiles per warp, keys per tile) choices at seq 4096: µs, TFLOP/s, registers, spills."""
    import importlib
    from cupy.cuda import driver
    from cufuse import _arrays as A
    from cufuse import _runtime as R
    AT = importlib.import_module("cufuse.ops.attention")
    ndt = A.torch_to_numpy_dtype(dt)
    for d in DIMS:
        seq, b, h = 4096, 4, 16
        q, k, v = (torch.randn(b, h, seq, d, device="cuda").to(dt) for _ in range(3))
        want = cufuse.attention(q, k, v)
        for cfg in [(1, 64, 4), (2, 32, 4), (2, 64, 4), (2, 32, 8), (2, 64, 8)]:
            AT._FWD_CFG[d] = cfg
            fn = R.get_function(AT._part(d, ndt), AT._expr("attention_forward", d, ndt), 0)
            err = (cufuse.attention(q, k, v).float() - want.float()).abs().max().item()
            us = event_median(lambda: cufuse.attention(q, k, v), 10)
            print(f"  d{d} tiles/warp {cfg[0]} keys {cfg[1]:3} warps {cfg[2]}: {us:8.1f} us {4 * b * h * seq * seq * d / us / 1e6:6.1f} "
                  f"TFLOP/s, {driver.funcGetAttribute(4, fn.ptr)} registers, {driver.funcGetAttribute(3, fn.ptr)} "
                  f"local bytes, max diff {err:.2g}")


def sweep90(dt):
    """The Hopper forward's (keys per tile, warpgroups) choices at seq 4096, causal and not: µs, TFLOP/s,
    registers, spills, max difference from torch's flash backend."""
    import importlib
    from cupy.cuda import driver
    from cufuse import _arrays as A
    from cufuse import _runtime as R
    AT = importlib.import_module("cufuse.ops.attention")
    ndt = A.torch_to_numpy_dtype(dt)
    cfgs = {64: [(64, 2), (64, 3), (64, 4), (128, 1)], 128: [(128, 2), (64, 3), (64, 2)]}
    for d in DIMS:
        seq, b, h = 4096, 4, 16
        q, k, v = (torch.randn(b, h, seq, d, device="cuda").to(dt) for _ in range(3))
        for causal in (False, True):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
            for cfg in cfgs[d]:
                AT._SM90_CFG[d] = cfg
                fn = R.get_function(AT._sm90_part(d, ndt), AT._sm90_expr(d, ndt), 0)
                err = (cufuse.attention(q, k, v, causal=causal).float() - want.float()).abs().max().item()
                us = event_median(lambda: cufuse.attention(q, k, v, causal=causal), 10)
                flops = 4 * b * h * seq * seq * d * (0.5 if causal else 1.0)
                print(f"  d{d} causal {causal!s:5} keys {cfg[0]:3} warpgroups {cfg[1]}: {us:8.1f} us "
                      f"{flops / us / 1e6:6.1f} TFLOP/s, {driver.funcGetAttribute(4, fn.ptr)} registers, "
                      f"{driver.funcGetAttribute(3, fn.ptr)} local bytes, max diff {err:.2g}")


def sweep_backward(dt):
    """The backward's warps per block (dK/dV kernel, dQ kernel) at seq 4096: forward + backward µs."""
    import importlib
    AT = importlib.import_module("cufuse.ops.attention")
    for d in DIMS:
        seq, b, h = 4096, 4, 16
        q, k, v = (torch.randn(b, h, seq, d, device="cuda").to(dt).requires_grad_(True) for _ in range(3))
        go = torch.randn(b, h, seq, d, device="cuda").to(dt)
        want = torch.autograd.grad(cufuse.attention(q, k, v), (q, k, v), go)
        for cfg in [((4, 1, 64 if d <= 64 else 32), (4, 1, 64 if d <= 64 else 32)),
                    ((4, 1, 64 if d <= 64 else 32), (4, 2, 32)), ((4, 2, 32), (4, 2, 32)),
                    ((4, 1, 64 if d <= 64 else 32), (4, 2, 16)), ((8, 1, 32), (4, 2, 32))]:
            AT._BWD_CFG[d] = cfg
            got = torch.autograd.grad(cufuse.attention(q, k, v), (q, k, v), go)
            err = max((a.float() - w.float()).abs().max().item() for a, w in zip(got, want))
            us = event_median(lambda: torch.autograd.grad(cufuse.attention(q, k, v), (q, k, v), go), 10)
            print(f"  d{d} backward (warps, tiles/warp, tile) kv {cfg[0]} q {cfg[1]}: f+b {us:8.1f} us {3.5 * 4 * b * h * seq * seq * d / us / 1e6:6.1f} "
                  f"TFLOP/s, max diff {err:.2g}")


def score(dt):
    """attention_score against torch's matmul(q, k^T) * scale (and with an additive mask), µs and the
    bytes the scores' one write needs as % of the same run's copy bandwidth."""
    print(f"{'shape':22} {'impl':14} {'us':>9} {'% copy':>7}")
    for shape in [(8, 16, 2048, 128), (16, 4096, 64), (32, 1024, 64), (4, 32, 1024, 128)]:
        g = torch.Generator(device="cuda").manual_seed(sum(shape))
        q, k = (torch.randn(shape, device="cuda", generator=g).to(dt) for _ in range(2))
        sc = shape[-1] ** -0.5
        out_bytes = q.numel() // shape[-1] * shape[-2] * q.element_size()
        big = torch.empty(out_bytes // 4, device="cuda")
        copy_gbs = 2 * out_bytes / event_median(lambda: big.clone(), 10) / 1e3
        mask = torch.randn(shape[-2], shape[-2], device="cuda", generator=g).to(dt)
        runs = {"cufuse": lambda: cufuse.attention_score(q, k, scale=sc),
                "torch": lambda: torch.matmul(q, k.transpose(-1, -2)) * sc,
                "cufuse+mask": lambda: cufuse.attention_score(q, k, scale=sc, mask=mask),
                "torch+mask": lambda: torch.matmul(q, k.transpose(-1, -2)) * sc + mask}
        want = runs["torch"]().float()
        err = (runs["cufuse"]().float() - want).abs().max().item() / want.abs().max().item()
        for name, fn in runs.items():
            us = event_median(fn, 20)
            print(f"{str(shape):22} {name:14} {us:9.1f} {100 * out_bytes / us / 1e3 / copy_gbs:7.1f}"
                  + (f"   (max rel. diff {err:.1e})" if name == "cufuse" else ""))


def main():
    dt = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "float16")
    quick = "quick" in sys.argv
    print(torch.cuda.get_device_name(), "torch", torch.__version__, dt)
    if "sweep" in sys.argv:
        return sweep(dt)
    if "sweep90" in sys.argv:
        return sweep90(dt)
    if "sweep_backward" in sys.argv:
        return sweep_backward(dt)
    if "score" in sys.argv:
        return score(dt)
    _regs(dt)
    print(f"{'seq':>6} {'d':>4} {'causal':>6} {'impl':8} {'fwd us':>9} {'TFLOP/s':>8} {'f+b us':>9} {'TFLOP/s':>8}")
    import importlib
    AT = importlib.import_module("cufuse.ops.attention")

    def sm80(q, k, v, c):
        AT._PATH = "sm80"
        try:
            return cufuse.attention(q, k, v, causal=c)
        finally:
            AT._PATH = None

    impls = {"cufuse": lambda q, k, v, c: cufuse.attention(q, k, v, causal=c), "cufuse80": sm80}
    fwd_only = "fwd" in sys.argv
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        def run(q, k, v, c, be=be):
            with sdpa_kernel(be):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=c)
        impls[name] = run
    for seq in SEQS[:2] if quick else SEQS:
        for d in DIMS:
            bh = max(1, 16384 * 16 // seq)
            b, h = max(1, bh // 16), min(16, bh)
            g = torch.Generator(device="cuda").manual_seed(seq + d)
            q, k, v = (torch.randn(b, h, seq, d, device="cuda", generator=g).to(dt).requires_grad_(True)
                       for _ in range(3))
            go = torch.randn(b, h, seq, d, device="cuda", generator=g).to(dt)
            for causal in (False, True):
                flops = 4 * b * h * seq * seq * d * (0.5 if causal else 1.0)
                want = impls["flash"](q, k, v, causal)
                for name, fn in impls.items():
                    try:
                        got = fn(q, k, v, causal)
                    except Exception as e:  # a backend that does not take this case
                        print(f"{seq:6} {d:4} {causal!s:>6} {name:8} unavailable: {type(e).__name__}")
                        continue
                    err = (got.float() - want.float()).abs().max().item()
                    if err > 2e-2:
                        print(f"{seq:6} {d:4} {causal!s:>6} {name:8} WRONG: max error {err:.3g}")
                        continue

                    def fwd():
                        with torch.no_grad():
                            fn(q, k, v, causal)

                    def step():
                        torch.autograd.grad(fn(q, k, v, causal), (q, k, v), go)

                    fus, sus = event_median(fwd, 10), (float("nan") if fwd_only else event_median(step, 10))
                    print(f"{seq:6} {d:4} {causal!s:>6} {name:8} {fus:9.1f} {flops / fus / 1e6:8.1f} {sus:9.1f} "
                          f"{3.5 * flops / sus / 1e6:8.1f}")


if __name__ == "__main__":
    main()
