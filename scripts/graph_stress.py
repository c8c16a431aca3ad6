"""Every op family captured in a CUDA graph once, then replayed many times
on fresh inputs, each replay checked against an eager call; cufuse's caches
(recipes, uploads, per-stream buffers, image pipelines' launchers) are
emptied between the capture and the replays. As torch documents it: warm up
on a side stream, capture with torch.cuda.graph on its own stream. Ops that
take ``out=`` are captured writing into it; the others (two outputs, a loss,
attention) are captured allocating, from the graph's private pool, and the
tensors they returned at capture are compared after each replay. Results
must match bit for bit, 16-bit ones within TOL of their largest magnitude
(those right only within it are counted apart). scatter_add checks its index
range on the host, so its capture must be refused (RuntimeError) rather than
recorded. Usage (a GPU):

    PYTHONPATH=. python scripts/graph_stress.py [replays=1000] [--families a,b]

Prints one line per family and exits 1 on any mismatch."""
from __future__ import annotations

import argparse
import sys
from typing import Callable, NamedTuple

import numpy as np
import torch

import cufuse
import cufuse.image
import cufuse.nn
from cufuse import _driver as D

SHAPE = (64, 96)
ROW, COL = SHAPE[-1:], SHAPE[:1]
SCALE = np.linspace(0.02, 0.09, SHAPE[-1]).astype(np.float32)
FUSED = cufuse.fuse(lambda a, b: a * b + 1.0)
ROWS = cufuse.fuse(lambda a, b: (a * b).sum(axis=-1))
FOREACH = cufuse.fuse(lambda p, q, s: p * s + q)
RECTS = np.array([[0, 0, 50, 40], [3, 4, 20, 30]])  # the same content at capture and at every replay
PIPE = cufuse.image.Pipeline().resize(16).color("bgr2rgb").normalize(100, 50)
LETTERBOX = cufuse.image.Pipeline().letterbox_to((12, 20), fill=0.5).flip(horizontal=True).cast("float16").write("NHWC")
I8, I64, U8, F16, BF16 = torch.int8, torch.int64, torch.uint8, torch.float16, torch.bfloat16
TOL = {F16: 1e-3, BF16: 8e-3}  # 16-bit results: relative to the largest magnitude (others: bit for bit)
ATT, KV = (2, 4, 128, 64), (2, 2, 128, 64)  # attention: 4 query heads over 2 key/value heads


def arg(shape=SHAPE, dtype=torch.float32, lo=None, hi=None):
    """An input: standard normal floats (uniform in [lo, hi) if given), integers in [lo, hi) (the dtype's range)."""
    return shape, dtype, lo, hi


X, W, Q, SCALES = arg(), arg(ROW), arg(dtype=I8), arg(ROW, lo=0.01, hi=0.1)  # SCALES: positive, per channel


class Family(NamedTuple):
    args: tuple  # arg(...) per input
    call: Callable  # call(*inputs[, out=]) -> a tensor or a tuple of tensors
    mode: str = "out"  # "out": writes out=; "new": allocates its results; "refused": its capture raises


def _foreach(a, b, out=None):
    h = SHAPE[0] // 2
    if out is None:
        return torch.cat(FOREACH.foreach([a[:h], a[h:]], [b[:h], b[h:]], 0.75))
    FOREACH.foreach([a[:h], a[h:]], [b[:h], b[h:]], 0.75, out=[out[:h], out[h:]])
    return out


F = Family
FAMILIES = {
    "add_relu": F((X, X), lambda a, b, out=None: cufuse.add_relu(a, b, out=out)),
    "mul_tanh": F((X, X), lambda a, b, out=None: cufuse.mul_tanh(a, b, out=out)),
    "add_mul_exp": F((X, X), lambda a, b, out=None: cufuse.add_mul_exp(a, b, out=out)),
    "fma": F((X, X), lambda a, b, out=None: cufuse.fma(a, 0.5, b, out=out)),
    "bias_gelu": F((X, W), lambda x, b, out=None: cufuse.bias_gelu(x, b, out=out)),
    "gelu_dropout": F((X,), lambda x, out=None: cufuse.gelu_dropout(x, 0.1, seed=7, out=out)),
    "quantize": F((X,), lambda x, out=None: cufuse.quantize_int8(x, 0.05, out=out)),
    "quantize_axis_numpy": F((X,), lambda x, out=None: cufuse.quantize_int8(x, SCALE, 1.0, axis=-1, out=out)),
    "quantize_axis_tensor": F((X, SCALES), lambda x, s, out=None: cufuse.quantize_int8(x, s, axis=-1, out=out)),
    "dequantize": F((Q,), lambda q, out=None: cufuse.dequantize_int8(q, 0.05, out=out)),
    "dequantize_f16": F((Q,), lambda q, out=None: cufuse.dequantize_int8(q, 0.05, 3.0, dtype=F16, out=out)),
    "dequantize_axis_numpy": F((Q,), lambda q, out=None: cufuse.dequantize_int8(q, SCALE, axis=-1, out=out)),
    "dequantize_axis0_bf16": F((Q, arg(COL, lo=0.01, hi=0.1), arg(COL)),
                               lambda q, s, z, out=None: cufuse.dequantize_int8(q, s, z, axis=0, dtype=BF16, out=out)),
    "fake_quantize": F((X,), lambda x: cufuse.fake_quantize_int8(x, 0.05, 2.0), "new"),
    "fake_quantize_axis": F((X,), lambda x: cufuse.fake_quantize_int8(x, SCALE, axis=-1), "new"),
    "layer_norm": F((X, W, W), lambda x, w, b, out=None: cufuse.layer_norm(x, SHAPE[-1], w, b, out=out)),
    "layer_norm_relu": F((X, W, W), lambda x, w, b, out=None: cufuse.layer_norm_relu(x, SHAPE[-1], w, b, out=out)),
    "rms_norm": F((X, W), lambda x, w, out=None: cufuse.rms_norm(x, SHAPE[-1], w, out=out)),
    "add_rms_norm": F((X, X, W), lambda x, r, w: cufuse.add_rms_norm(x, r, SHAPE[-1], w), "new"),
    "add_layer_norm_bf16": F((arg(dtype=BF16), arg(dtype=BF16), arg(ROW, BF16), arg(ROW, BF16)),
                             lambda x, r, w, b: cufuse.add_layer_norm(x, r, SHAPE[-1], w, b), "new"),
    "softmax": F((X,), lambda x, out=None: cufuse.softmax(x, out=out)),
    "log_softmax": F((X,), lambda x, out=None: cufuse.log_softmax(x, out=out)),
    "sum_squared": F((X,), lambda x, out=None: cufuse.sum_squared(x, out=out)),
    "sum_squared_axis0": F((X,), lambda x, out=None: cufuse.sum_squared(x, axis=0, out=out)),
    "sum_squared_all": F((X,), lambda x, out=None: cufuse.sum_squared(x, axis=None, out=out)),
    "mean_abs": F((X,), lambda x, out=None: cufuse.mean_abs(x, out=out)),
    "cross_entropy": F((X, arg(COL, I64, 0, SHAPE[-1])),  # a target of 0 is ignored
                       lambda x, t: cufuse.cross_entropy(x, t, ignore_index=0, label_smoothing=0.1, z_loss=1e-4),
                       "new"),
    "cross_entropy_bf16_none": F((arg(dtype=BF16), arg(COL, I64, 0, SHAPE[-1])),
                                 lambda x, t: cufuse.cross_entropy(x, t, reduction="none"), "new"),
    "rope": F((arg((2, 4, 16, 32)), arg((2, 2, 16, 32)), arg((2, 16, 16)), arg((2, 16, 16))),  # 16 of 32 dims
              lambda q, k, c, s: cufuse.rope(q, k, c, s), "new"),
    "rope_positions_bf16": F((arg((2, 16, 4, 32), BF16), arg((64, 32)), arg((64, 32)), arg((2, 16), I64, 0, 64)),
                             lambda q, c, s, p: cufuse.rope(q, None, c, s, position_ids=p, unsqueeze_dim=2,
                                                            interleaved=True)[0], "new"),
    "attention_f16": F((arg(ATT, F16), arg(KV, F16), arg(KV, F16)),
                       lambda q, k, v: cufuse.attention(q, k, v, causal=True, return_lse=True), "new"),
    "attention_bf16": F((arg(ATT, BF16), arg(KV, BF16), arg(KV, BF16)),
                        lambda q, k, v: cufuse.attention(q, k, v), "new"),
    "attention_score_f16": F((arg(ATT, F16), arg(KV, F16), arg((ATT[2], KV[2]))),  # a float32 mask, cast to q's dtype
                             lambda q, k, m: cufuse.attention_score(q, k, mask=m), "new"),
    "fuse": F((X, X), lambda a, b, out=None: FUSED(a, b, out=out)),
    "fuse_rows": F((X, X), lambda a, b, out=None: ROWS(a, b, out=out)),
    "foreach": F((X, X), _foreach),
    "swiglu": F((X, X), lambda g, u, out=None: cufuse.nn.swiglu(g, u, out=out)),
    "geglu": F((X, X), lambda g, u, out=None: cufuse.nn.geglu(g, u, out=out)),
    "gated_gelu_tanh": F((X,), lambda x: cufuse.nn.gated(x, "gelu_tanh"), "new"),  # strided halves of x
    "image": F((arg((40, 50, 3), U8, 0, 256),), lambda im, out=None: PIPE(im, RECTS, out=out)),
    "image_letterbox_f16": F((arg((40, 50, 3), U8, 0, 256),), lambda im, out=None: LETTERBOX(im, RECTS, out=out)),
    "scatter_add": F((X, arg(COL, I64, 0, 16)), lambda v, i: cufuse.scatter_add(v, i, 16, activation="silu"),
                     "refused"),
}


def inputs(args, rng, device="cuda"):
    out = []
    for shape, dtype, lo, hi in args:
        if dtype.is_floating_point:
            v = rng.standard_normal(shape) if lo is None else rng.uniform(lo, hi, shape)
            v = torch.from_numpy(v.astype(np.float32))
        else:
            info = torch.iinfo(dtype)
            lo, hi = (info.min, info.max + 1) if lo is None else (lo, hi)
            v = torch.from_numpy(rng.integers(lo, hi, shape))
        out.append(v.to(device=device, dtype=dtype))
    return out


def as_tuple(res):
    return res if isinstance(res, tuple) else (res,)


def same(got, want):
    """(right, bit for bit): bitwise, or within TOL of the largest finite magnitude for 16-bit results."""
    exact = torch.equal(got, want)
    tol = TOL.get(want.dtype)
    if exact or tol is None:
        return exact, exact
    g, w = got.float(), want.float()
    return torch.allclose(g, w, rtol=tol, atol=tol * w.nan_to_num(0, 0, 0).abs().max().item(), equal_nan=True), False


def evict():
    D.clear_fast_paths()
    D._UPLOADS.clear()
    D._stream_buffers.clear()
    for p in (PIPE, LETTERBOX):
        p._fast.clear()


def stress(fam, replays):
    """(wrong replays, the line to print)."""
    rng = np.random.default_rng(1)
    a = inputs(fam.args, rng)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # the warm-up: every table uploaded, every recipe built
        kw = {"out": torch.empty_like(fam.call(*a))} if fam.mode == "out" else {}
        for _ in range(2):
            fam.call(*a, **kw)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    if fam.mode == "refused":
        try:
            with torch.cuda.graph(g):
                fam.call(*a)
        except RuntimeError as e:
            return int("captur" not in str(e)), f"capture refused: {e}"[:100]
        return 1, "captured, though its capture must be refused"
    with torch.cuda.graph(g):
        outs = as_tuple(fam.call(*a, **kw))
    evict()
    wrong = inexact = 0
    for _ in range(replays):
        fresh = inputs(fam.args, rng)
        for dst, src in zip(a, fresh):
            dst.copy_(src)
        for o in outs:
            o.fill_(7)
        g.replay()
        want = as_tuple(fam.call(*fresh))
        torch.cuda.synchronize()
        checks = [same(o, w) for o, w in zip(outs, want, strict=True)]
        ok = all(c[0] for c in checks)
        wrong += not ok
        inexact += ok and not all(c[1] for c in checks)
    return wrong, f"{replays} replays, {wrong} wrong" + (f", {inexact} within tolerance only" if inexact else "")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("replays", nargs="?", type=int, default=1000)
    p.add_argument("--families", help=f"a comma-separated subset of: {', '.join(FAMILIES)}")
    opts = p.parse_args(argv)
    names = opts.families.split(",") if opts.families else list(FAMILIES)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        p.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    bad = 0
    for name in names:
        try:
            wrong, line = stress(FAMILIES[name], opts.replays)
        except Exception as e:  # one family's failure does not hide the others'
            wrong, line = 1, f"failed: {e!r}"[:200]
        bad += wrong
        print(f"{name:24s} {line}", flush=True)
    print("graph stress:", "every replay right" if not bad else f"{bad} wrong")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
