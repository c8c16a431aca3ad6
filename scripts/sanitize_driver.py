"""Every kernel family once, on small inputs, for compute-sanitizer
(scripts/sanitize.sh): elementwise (contiguous, strided, tiled), activations,
dropout, quantize (per tensor, per channel), norms (one block per row, rows
split over blocks, persistent pipelines), softmax, reductions (rows, columns
with tickets, all), cufuse.fuse (elementwise, rows, foreach). Prints one line
per family; the sanitizer reports the errors."""
from __future__ import annotations

import sys

import cupy as cp
import numpy as np

import cufuse


def rnd(shape, dt=np.float32, seed=0):
    """Random values inside a larger initialized buffer: the row kernels read
    each row on its 16-byte aligned window (kernels/rows.cuh: the lanes
    outside the row are masked, never used), which at the end of an
    allocation is memory no one wrote; initcheck would report those reads."""
    n = int(np.prod(shape))
    buf = cp.asarray(np.random.default_rng(seed).standard_normal(n + 64).astype(dt))
    return buf[32:32 + n].reshape(shape)


def main(which):
    runs = {
        "elementwise": lambda: [cufuse.add_relu(rnd(1000, dt), rnd(1000, dt, 1)) for dt in (np.float16, np.float32)]
        + [cufuse.fma(rnd((33, 65))[:, ::2], 0.5, rnd((33, 33), seed=2)), cufuse.mul_tanh(rnd((64, 64)).T, rnd(64)),
           cufuse.add_mul_exp(rnd(4097) * 0.1, rnd(4097, seed=3) * 0.1)],
        "activations": lambda: [cufuse.bias_gelu(rnd((64, 96)), rnd(96)), cufuse.bias_gelu(rnd((7, 33), np.float16),
                                                                                            rnd(33, np.float16), "tanh")],
        "dropout": lambda: [cufuse.gelu_dropout(rnd((64, 96)), 0.1, seed=1),
                            cufuse.gelu_dropout(rnd(1001, np.float16), 0.3, seed=2)],
        "quantize": lambda: [cufuse.dequantize_int8(cufuse.quantize_int8(rnd((32, 96)), 0.05), 0.05),
                             cufuse.quantize_int8(rnd((32, 96)), np.full(96, 0.05, np.float32), axis=-1),
                             cufuse.quantize_int8(rnd((32, 96), np.float16), np.full(32, 0.05, np.float32), axis=0)],
        "norms": lambda: [cufuse.layer_norm(rnd((64, 768)), 768, rnd(768), rnd(768)),
                          cufuse.rms_norm(rnd((64, 4096), np.float16), 4096, rnd(4096, np.float16)),
                          cufuse.layer_norm(rnd((4, 200003)), 200003),       # rows split over blocks
                          cufuse.layer_norm_relu(rnd((512, 8192)), 8192),
                          cufuse.rms_norm(rnd((2, 1 << 20)), 1 << 20)],
        "softmax": lambda: [cufuse.softmax(rnd((64, 1000))), cufuse.log_softmax(rnd((64, 1000), np.float16)),
                            cufuse.softmax(rnd((300, 40)), axis=0), cufuse.softmax(rnd((2, 300001)))],
        "reductions": lambda: [cufuse.sum_squared(rnd((64, 1000))), cufuse.mean_abs(rnd((1000, 64)), axis=0),
                               cufuse.sum_squared(rnd((33, 1001), np.float16), axis=None),
                               cufuse.sum_squared(rnd((4, 300001)))],
        "fuse": lambda: [cufuse.fuse(lambda a, b: cufuse.exp(a) * b + 1.0)(rnd((33, 65)), rnd(65)),
                         cufuse.fuse(lambda a, b: ((a - b) ** 2).sum(axis=-1))(rnd((64, 100)), rnd((64, 100), seed=4)),
                         cufuse.fuse(lambda p, g, lr: p - lr * g).foreach([rnd(1000), rnd(33)], [rnd(1000), rnd(33)],
                                                                           0.1)],
    }
    for name in (runs if which == "all" else which.split(",")):
        runs[name]()
        cp.cuda.Device().synchronize()
        print(f"ran {name}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "all")
