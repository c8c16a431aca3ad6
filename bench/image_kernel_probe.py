"""cufuse.image kernel variants against each other and a copy of the same bytes (issue 36's
4K -> 1080p target), CUDA events behind an L2 flush (the conftest's timer), median of 30, % of the
bench's 1 GiB copy reference and of a copy of the same bytes (half read, half written), one device
call. Usage (a GPU):
    PYTHONPATH=$PWD python3 bench/image_kernel_probe.py [variant ...]
A variant is `name=DEFINES` where DEFINES (`A=1,B=2`) are #defines put before the generated source
(`LB=n`: n blocks per SM in the launch bounds of a kernel that has none: interleaved sources).
To compare trees, run it once per tree (PYTHONPATH) in the same device call.
Every variant's output is compared with the first one's (max abs difference)."""
from __future__ import annotations

import sys
from dataclasses import replace

import cupy as cp
import numpy as np

import cufuse.image as I
from cufuse import _timing

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def timed(f, reps=30):
    """GPU µs per call: CUDA events around GPU work queued behind an L2 flush (the conftest's timer)."""
    return _timing.gpu_times(f, reps=reps, warmup=5)["gpu_us"]


def copy_gbps(n=1 << 30):
    """Device-to-device cudaMemcpyAsync of n bytes (1 GiB: the bench's copy reference), GB/s read + written."""
    a = cp.random.default_rng(7).standard_normal(n // 4, dtype=np.float32)
    b = cp.empty_like(a)
    s = cp.cuda.get_current_stream()
    t = timed(lambda: cp.cuda.runtime.memcpyAsync(b.data.ptr, a.data.ptr, n, cp.cuda.runtime.memcpyDeviceToDevice,
                                                  s.ptr), reps=20)
    return 2 * n / t / 1e3


def cases():
    rng = np.random.default_rng(36)
    k4 = cp.asarray(rng.integers(0, 256, (2160, 3840, 3), dtype=np.uint8))
    norm = I.Pipeline().resize((1080, 1920)).normalize(MEAN, STD, scale=1 / 255)
    yield "4K u8 HWC -> 1080p f32 bilinear", norm, k4, None, k4.nbytes + 1080 * 1920 * 3 * 4
    yield ("4K u8 HWC -> 1080p f32 nearest", I.Pipeline().resize((1080, 1920), "nearest").normalize(MEAN, STD),
           k4, None, k4.nbytes // 4 + 1080 * 1920 * 3 * 4)
    k4h = k4.astype(cp.float16)
    yield "4K f16 HWC -> 1080p f32 bilinear", norm, k4h, None, k4h.nbytes + 1080 * 1920 * 3 * 4
    k4c = cp.ascontiguousarray(k4.transpose(2, 0, 1))
    yield ("4K u8 CHW -> 1080p f32 bilinear", I.Pipeline().read("CHW").resize((1080, 1920)).normalize(MEAN, STD),
           k4c, None, k4c.nbytes + 1080 * 1920 * 3 * 4)
    f = cp.asarray(rng.integers(0, 256, (1080, 1920, 3), dtype=np.uint8))
    w, h = rng.integers(224, 601, 64), rng.integers(224, 601, 64)
    rects = np.column_stack([rng.integers(0, 1920 - w + 1), rng.integers(0, 1080 - h + 1), w, h]).astype(np.int64)
    yield ("64 crops 1080p u8 -> 224 f16", I.Pipeline().resize(224).normalize(MEAN, STD, scale=1 / 255)
           .cast("float16"), f, rects, None)
    nv = cp.asarray(rng.integers(16, 236, (1620, 1920), dtype=np.uint8))
    yield ("NV12 1080p -> 640 letterbox f16", I.Pipeline().read(yuv="nv12").letterbox_to(640, fill=114)
           .normalize(scale=1 / 255).cast("float16"), nv, None, None)


def main(variants):
    original = I._source
    gbps = copy_gbps()
    print(f"D2D copy reference: {gbps:.0f} GB/s")
    same = {}
    for name, pipe, x, rects, nbytes in cases():
        if nbytes and nbytes not in same:  # a copy of the same bytes: nbytes / 2 read and written
            same[nbytes] = copy_gbps(nbytes // 2 // 256 * 256)
            print(f"D2D copy of {nbytes // 2 / 1e6:.1f} MB: {same[nbytes]:.0f} GB/s")
        first = None
        for v in variants:
            label, _, defs = v.partition("=")

            def source(plan, *args, defs=defs):
                s = original(plan, *args)
                pre = ""
                for d in filter(None, defs.split(",")):
                    k, _, n = d.partition("=")
                    if k == "LB":  # minimum blocks per SM in the launch bounds
                        s = s.replace("__launch_bounds__(256)", f"__launch_bounds__(256, {n})")
                        continue
                    pre += f"#define {k} {n}\n"
                return pre + s
            I._source = source
            I._fns.clear()
            p = replace(pipe)  # a fresh fast-path cache
            out = p(x, rects)
            out[...] = cp.nan  # poisoned, then written
            p(x, rects, out=out)
            cp.cuda.Device().synchronize()
            diff = 0.0 if first is None else float(cp.abs(out.astype(cp.float64) - first).max())
            if first is None:
                first = out.astype(cp.float64)
            t = timed(lambda: p(x, rects, out=out))
            gb = nbytes / t / 1e3 if nbytes else 0.0
            pct = f"{100 * gb / gbps:5.1f}% of copy, {100 * gb / same[nbytes]:5.1f}% of same-size copy" if nbytes else ""
            print(f"{name:34} {label:10} {t:8.1f} us {pct:16} max diff vs first {diff:.3g}", flush=True)
        I._source = original


if __name__ == "__main__":
    main(sys.argv[1:] or ["new="])
