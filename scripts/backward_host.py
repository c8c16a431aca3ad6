"""Host cost of a cufuse norm under autograd, and where the backward's goes
(python3 scripts/backward_host.py): wall time of back-to-back calls of
layer_norm forward + backward (torch's and cufuse's, with torch's autograd
engine on its worker thread and on the calling thread), of the pieces alone,
the pieces of a cufuse call alone (allocation, stream, device, launch) on
each thread, and the time inside a few cufuse functions by thread: torch runs a CUDA
backward on its device thread, where the same Python was measured ~2x slower
(bench/NOTES.md, session 53)."""
from __future__ import annotations

import collections
import threading
import time

import torch
import torch.nn.functional as F

import cufuse
from cufuse import _autograd as AG
from cufuse import _driver as D
from cufuse.ops import norm as N

SPENT = collections.defaultdict(lambda: [0.0, 0])  # (function, on the main thread) -> [seconds, calls]
FAILED = collections.Counter()  # on the main thread -> packed launches that raised


def timed_fn(mod, name):
    """Wrap ``mod.name`` to add its time to SPENT (looked up at call time by its callers)."""
    f = getattr(mod, name)

    def g(*a, **k):
        t0 = time.perf_counter()
        r = f(*a, **k)
        e = SPENT[(name, threading.current_thread() is threading.main_thread())]
        e[0] += time.perf_counter() - t0
        e[1] += 1
        return r
    setattr(mod, name, g)


def wall(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    SPENT.clear()
    FAILED.clear()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t0) / n


def busy():
    """A fixed piece of pure Python, timed into SPENT by the thread that runs it."""
    t0 = time.perf_counter()
    sum(i * i for i in range(2000))
    e = SPENT[("pure Python", threading.current_thread() is threading.main_thread())]
    e[0] += time.perf_counter() - t0
    e[1] += 1


PRIMS: dict = {}  # name -> a call timed by ``prims`` on the thread that runs it


def make_prims():
    """The pieces of a cufuse call, each alone: which of them is slower on the autograd thread."""
    a = torch.randn(256, 768, device="cuda", dtype=torch.float16)
    bb = torch.randn_like(a)
    dev = torch.device("cuda", 0)
    cufuse.add_relu(a, bb)  # its recipe kept: the next calls are the fast path
    PRIMS.update({
        "data_ptr": a.data_ptr, "get_device": a.get_device, "shape": lambda: a.shape, "stride()": a.stride,
        "torch.empty_like": lambda: torch.empty_like(a),
        "torch.empty(s, dtype, device)": lambda: torch.empty((768,), dtype=a.dtype, device=dev),
        "cudaGetDevice (CuPy)": D.get_device, "raw stream": lambda: D.TORCH.raw_stream(0),
        "torch.cuda.current_stream": torch.cuda.current_stream,
        "signature (3 arrays)": lambda: D.signature((a, bb, None)),
        "cufuse.add_relu": lambda: cufuse.add_relu(a, bb), "torch.add": lambda: torch.add(a, bb),
    })


def prims(n=200):
    """Each of PRIMS ``n`` times, timed into SPENT by the thread that runs them."""
    main = threading.current_thread() is threading.main_thread()
    for name, f in PRIMS.items():
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        e = SPENT[(name, main)]
        e[0] += time.perf_counter() - t0
        e[1] += n


class Trivial(torch.autograd.Function):
    """A Python backward that does nothing (or ``work``: busy or prims): the engine's own cost of one."""
    work = None

    @staticmethod
    def forward(ctx, a):
        return a.view_as(a)

    @staticmethod
    def backward(ctx, g):
        if Trivial.work:
            Trivial.work()
        return g


def main():
    dt = torch.float16
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    w = torch.randn(768, device="cuda", dtype=dt, requires_grad=True)
    b = torch.randn(768, device="cuda", dtype=dt, requires_grad=True)
    for shape in ((64, 768), (4, 1024, 768)):
        x = torch.randn(*shape, device="cuda", dtype=dt, requires_grad=True)
        g = torch.randn_like(x)
        cases = {
            "torch layer_norm fwd+bwd": lambda: F.layer_norm(x, (768,), w, b).backward(g),
            "cufuse layer_norm fwd+bwd": lambda: cufuse.layer_norm(x, (768,), w, b).backward(g),
            "torch layer_norm fwd (grad)": lambda: F.layer_norm(x, (768,), w, b),
            "cufuse layer_norm fwd (grad)": lambda: cufuse.layer_norm(x, (768,), w, b),
            "cufuse norm_backward alone": lambda: AG.norm_backward("layer", g, x.detach(), 768, w.detach(),
                                                                   b.detach(), 1e-5),
            "Trivial fwd+bwd": lambda: Trivial.apply(x).backward(g),
        }
        for label, fn in cases.items():
            print(f"{str(shape):15} {label:30} {wall(fn):7.1f} us/call")
        torch.autograd.set_multithreading_enabled(False)
        for label in ("torch layer_norm fwd+bwd", "cufuse layer_norm fwd+bwd"):
            print(f"{str(shape):15} {label + ', one thread':30} {wall(cases[label]):7.1f} us/call")
        torch.autograd.set_multithreading_enabled(True)
    Trivial.work = busy
    x = torch.randn(64, 768, device="cuda", dtype=dt, requires_grad=True)
    for label, fn in (("pure Python on the autograd thread", lambda: Trivial.apply(x).backward(x)),
                      ("pure Python on the main thread", busy)):
        wall(fn)
        print(label, {("main" if k[1] else "autograd"): round(1e6 * t / n, 1) for k, (t, n) in SPENT.items()})
    make_prims()
    Trivial.work = prims
    spent = {}
    for fn in (lambda: Trivial.apply(x).backward(x), prims):
        wall(fn, n=20)
        spent.update(SPENT)
    print("the pieces alone, us per call, autograd thread / main thread:")
    for name in PRIMS:
        t = [1e6 * spent[(name, m)][0] / spent[(name, m)][1] for m in (False, True)]
        print(f"     {name:30} {t[0]:7.2f} {t[1]:7.2f}")
    Trivial.work = None
    for mod, name in ((AG, "norm_backward"), (N, "_bwd_run"), (D, "signature"), (D, "execute")):
        timed_fn(mod, name)
    # the packed launch (cuLaunchKernel) raises where the thread has no current CUDA context, and
    # the launch then goes through CuPy's slower call: count its failures by thread
    launch = D._launch_kernel

    def counted(*a):
        try:
            return launch(*a)
        except Exception:
            FAILED[threading.current_thread() is threading.main_thread()] += 1
            raise
    D._launch_kernel = counted
    print("time inside, us per call of the case (64 x 768):")
    x = torch.randn(64, 768, device="cuda", dtype=dt, requires_grad=True)
    g = torch.randn_like(x)
    for label, fn in (("fwd+bwd", lambda: cufuse.layer_norm(x, (768,), w, b).backward(g)),
                      ("backward alone", lambda: AG.norm_backward("layer", g, x.detach(), 768, w.detach(),
                                                                   b.detach(), 1e-5))):
        us = wall(fn)
        print(f"  {label}: {us:.1f} us/call")
        for (name, main), (t, n) in sorted(SPENT.items()):
            print(f"     {name:15} {'main thread' if main else 'autograd thread':16} {1e6 * t / n:7.1f} us x {n / 300:.0f}")
        print(f"     packed launches that raised in 300 calls: main thread {FAILED[True]}, "
              f"autograd thread {FAILED[False]}")


if __name__ == "__main__":
    main()
