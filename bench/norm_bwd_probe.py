"""The one-pass backward kernels of the norms and softmax (kernels/norm_backward.cu) timed alone,
through cufuse.ops.norm.backward_rows / softmax_backward_rows on torch CUDA tensors: CUDA events
behind an L2 flush (cufuse._timing), median of 30; % of the copy bandwidth of the same run (a clone
of a 1 GiB tensor) counting x and g read and dx written once (dw and db partial sums: small; rms+add,
the residual-add norm's backward, also reads the residual's gradient). To
compare trees, run it once per tree (PYTHONPATH) in the same device call:
    PYTHONPATH=<tree> python3 bench/norm_bwd_probe.py [dtype ...]
Variants of the norm backward's plan, for this process: stages=K (rows in flight through shared
memory, cufuse/ops/norm.py: _BWD_STAGES), onepack (16-bit rows of 512-4096 elements as one pack a
thread, not two), threads=T (blocks of at most T threads, up to 8 packs a thread)."""
import sys

import torch

from cufuse import _arrays as A
from cufuse import _driver as D
from cufuse import _timing
from cufuse.ops import norm as N

args = sys.argv[1:]
for a in [a for a in args if a.startswith("stages=")]:
    N._BWD_STAGES = int(a[7:])
if "onepack" in args:
    N._BWD_TWO_PACKS = ()
for a in [a for a in args if a.startswith("threads=")]:  # blocks of fewer threads, up to 8 packs each
    from cufuse import _runtime as R
    N._BWD_THREADS = int(a[8:])
    N._BWD_TWO_PACKS = ()
    for kind in ("layer", "layer_relu", "rms"):
        kernel, flags, _ = N._BWD_KINDS[kind]
        N._BWD_KINDS[kind] = (kernel, flags, (1, 2, 4, 8))
        for dt, ct in R.FLOAT_CTYPES.items():
            for np_ in (4, 8):
                N._BWD_EXPRS[(dt, kind, np_)] = R.register(f"{N._BWD_FAMILY}:{dt.name}", R.name_expression(
                    kernel, ct, str(np_), *flags), f"{kind} backward", dt.name)
variant = " ".join(a for a in args if a.startswith(("stages=", "threads=")) or a == "onepack")
DTYPES = [getattr(torch, d) for d in args if hasattr(torch, d)] or [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [(16384, 4096), (4096, 8192), (16384, 1024), (4096, 4096), (32768, 2048)]
for a in [a for a in args if a.startswith("shapes=")]:  # shapes=ROWSxCOLS,...: these alone
    SHAPES = [tuple(int(v) for v in s.split("x")) for s in a[7:].split(",")]


def gpu_us(f):
    """f queues on torch's current stream: the events go there too."""
    return _timing.gpu_times(f, D.stream_for(A.TORCH_CUDA, 0), reps=30, warmup=5)["gpu_us"]


big = torch.randn(1 << 28, device="cuda")
copy = 2 * big.numel() * 4 / gpu_us(lambda: big.clone()) / 1e3  # GB/s read + written
del big
tree = (N.__file__.split("/cufuse/")[0][-14:] + " " + variant).strip()
for dt in DTYPES:
    for rows, n in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(5)
        x = torch.randn(rows, n, device="cuda", dtype=dt, generator=g)
        gr = torch.randn(rows, n, device="cuda", dtype=dt, generator=g)
        w = torch.randn(n, device="cuda", dtype=dt, generator=g)
        b = torch.randn(n, device="cuda", dtype=dt, generator=g)
        ga = torch.randn(rows, n, device="cuda", dtype=dt, generator=g)
        nbytes = 3 * x.numel() * x.element_size()
        for kind, call in (("layer", lambda: N.backward_rows("layer", gr, x, n, w, b, 1e-5)),
                           ("rms+add", lambda: N.backward_rows("rms", gr, x, n, w, None, 1e-5, ga)),
                           ("rms", lambda: N.backward_rows("rms", gr, x, n, w, None, 1e-5)),
                           ("softmax", lambda: N.softmax_backward_rows(gr, x, False))):
            if call() is None:  # rows the one-pass kernel does not take (the generated kernels' path)
                print(f"{tree:>24} {str(dt)[6:]:9} {rows:6}x{n:<5} {kind:8} not taken by the one-pass kernel")
                continue
            us = gpu_us(call)
            moved = nbytes * (4 / 3 if kind == "rms+add" else 1)
            print(f"{tree:>24} {str(dt)[6:]:9} {rows:6}x{n:<5} {kind:8} {us:8.1f} us "
                  f"{100 * moved / us / 1e3 / copy:5.1f}% of copy", flush=True)
