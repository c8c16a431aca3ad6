"""Host time of one cufuse.image call on its fast path (64 crops of a 1080p
uint8 frame -> 224 bilinear -> normalize -> NCHW float16 into out=, torch
tensors, the same rectangles each call), whole and by phase: wall time of
back-to-back calls between synchronizes, median of 5 rounds of 2000, then a
cProfile of 2000 calls. Usage (a GPU): PYTHONPATH=. python3 bench/image_host_probe.py"""
from __future__ import annotations

import cProfile
import pstats

import numpy as np
import torch

import cufuse.image as I
from conftest import GpuBench  # (bench/: the script's own folder)
from cufuse import _arrays as A
from cufuse import _driver as D

MEAN, STD, OUT, N = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), 224, 64


def wall(fn):
    """Back-to-back calls between synchronizes (bounded by the GPU where its kernels are longer)."""
    return GpuBench.host_loop_us({"f": fn}, torch.cuda.synchronize, calls=2000, rounds=5)["f"]


def enqueue(fn):
    """The host's time alone: the clock stopped before the synchronize."""
    return GpuBench.host_enqueue_us(fn, torch.cuda.synchronize)


def main():
    rng = np.random.default_rng(36)
    frame = torch.from_numpy(rng.integers(0, 256, (1080, 1920, 3), dtype=np.uint8)).cuda()
    w, h = rng.integers(OUT, 601, N), rng.integers(OUT, 601, N)
    rects = np.column_stack([rng.integers(0, 1920 - w + 1), rng.integers(0, 1080 - h + 1), w, h]).astype(np.int64)
    pipe = I.Pipeline().resize(OUT).normalize(MEAN, STD, scale=1 / 255).cast("float16").write("NCHW")
    out = torch.empty((N, 3, OUT, OUT), dtype=torch.float16, device="cuda")
    call = lambda: pipe(frame, rects, out=out)  # noqa: E731
    call()
    (key, e), = pipe._fast.items()  # the call's signature and its launcher
    first, optr, stream = frame.data_ptr(), out.data_ptr(), D.stream_for(A.TORCH_CUDA, 0)
    bare = torch.cuda.current_stream()
    k = torch.empty(1, device="cuda")
    print(f"call                 {wall(call):6.1f} us (bounded by the GPU's time)")
    print(f"call, enqueue        {enqueue(call):6.1f} us")
    print(f"launch, enqueue      {enqueue(lambda: e.launch(first, optr, stream)):6.1f} us")
    print(f"torch add_, enqueue  {enqueue(lambda: k.add_(1)):6.1f} us")
    print(f"_fast_key            {wall(lambda: I._fast_key(frame, rects, None, pipe.hflip, pipe.vflip, out)):6.1f} us")
    print(f"launcher.launch      {wall(lambda: e.launch(first, optr, stream)):6.1f} us")
    print(f"stream_for           {wall(lambda: D.stream_for(A.TORCH_CUDA, 0)):6.1f} us")
    print(f"torch add_ (a launch){wall(lambda: k.add_(1)):6.1f} us  ({bare})")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(2000):
        call()
    pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
