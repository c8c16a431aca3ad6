"""Every op family captured in a CUDA graph once, then replayed many times
on fresh inputs, each replay checked against an eager call; cufuse's caches
(recipes, uploads, per-stream buffers) are emptied between the capture and
the replays. As torch documents it: warm up on a side stream, capture with
torch.cuda.graph on its own stream. Usage (a GPU):

    PYTHONPATH=. python scripts/graph_stress.py [replays=1000]

Prints one line per family and exits 1 on any mismatch."""
from __future__ import annotations

import sys

import numpy as np
import torch

import cufuse
from cufuse import _driver as D

SHAPE = (64, 96)
SCALE = np.linspace(0.02, 0.09, SHAPE[-1]).astype(np.float32)
FUSED = cufuse.fuse(lambda a, b: a * b + 1.0)
ROWS = cufuse.fuse(lambda a, b: (a * b).sum(axis=-1))
FOREACH = cufuse.fuse(lambda p, q, s: p * s + q)


def _foreach(a, b, out=None):
    h = SHAPE[0] // 2
    if out is None:
        return torch.cat(FOREACH.foreach([a[:h], a[h:]], [b[:h], b[h:]], 0.75))
    FOREACH.foreach([a[:h], a[h:]], [b[:h], b[h:]], 0.75, out=[out[:h], out[h:]])
    return out


FAMILIES = {  # name -> (inputs: x full / w one row / q int8 codes, the call)
    "add_relu": ("xx", lambda a, b, out=None: cufuse.add_relu(a, b, out=out)),
    "fma": ("xx", lambda a, b, out=None: cufuse.fma(a, 0.5, b, out=out)),
    "bias_gelu": ("xw", lambda x, b, out=None: cufuse.bias_gelu(x, b, out=out)),
    "gelu_dropout": ("x", lambda x, out=None: cufuse.gelu_dropout(x, 0.1, seed=7, out=out)),
    "quantize": ("x", lambda x, out=None: cufuse.quantize_int8(x, 0.05, out=out)),
    "quantize_axis_numpy": ("x", lambda x, out=None: cufuse.quantize_int8(x, SCALE, 1.0, axis=-1, out=out)),
    "dequantize": ("q", lambda q, out=None: cufuse.dequantize_int8(q, 0.05, out=out)),
    "layer_norm": ("xww", lambda x, w, b, out=None: cufuse.layer_norm(x, SHAPE[-1], w, b, out=out)),
    "rms_norm": ("xw", lambda x, w, out=None: cufuse.rms_norm(x, SHAPE[-1], w, out=out)),
    "softmax": ("x", lambda x, out=None: cufuse.softmax(x, out=out)),
    "sum_squared_axis0": ("x", lambda x, out=None: cufuse.sum_squared(x, axis=0, out=out)),
    "mean_abs": ("x", lambda x, out=None: cufuse.mean_abs(x, out=out)),
    "fuse": ("xx", lambda a, b, out=None: FUSED(a, b, out=out)),
    "fuse_rows": ("xx", lambda a, b, out=None: ROWS(a, b, out=out)),
    "foreach": ("xx", _foreach),
}


def inputs(spec, rng):
    out = []
    for c in spec:
        if c == "q":
            out.append(torch.from_numpy(rng.integers(-128, 128, SHAPE).astype(np.int8)).cuda())
        else:
            shape = SHAPE[-1:] if c == "w" else SHAPE
            out.append(torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).cuda())
    return out


def main(replays):
    bad = 0
    for name, (spec, call) in FAMILIES.items():
        rng = np.random.default_rng(1)
        a = inputs(spec, rng)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            out = call(*a) * 0
            for _ in range(2):
                call(*a, out=out)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            call(*a, out=out)
        D.clear_fast_paths()
        D._UPLOADS.clear()
        D._stream_buffers.clear()
        wrong = 0
        for _ in range(replays):
            fresh = inputs(spec, rng)
            for dst, src in zip(a, fresh):
                dst.copy_(src)
            out.fill_(7)
            g.replay()
            want = call(*fresh)
            torch.cuda.synchronize()
            wrong += not torch.equal(out, want)
        bad += wrong
        print(f"{name:22s} {replays} replays, {wrong} wrong", flush=True)
    print("graph stress:", "every replay right" if not bad else f"{bad} wrong replays")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 1000))
