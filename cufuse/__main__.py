"""``python -m cufuse``: the demo. ``python -m cufuse build --arch sm_80,sm_90``: compile check."""
from __future__ import annotations

import argparse
import platform
import sys

import numpy as np

from . import _runtime as R


def _env_lines():
    import cufuse
    lines = [f"cufuse {cufuse.__version__}  (python {platform.python_version()}, numpy {np.__version__})"]
    if R._cp is None:
        lines.append("backend: NumPy fallback (CuPy not installed; install the cuda12 or cuda13 extra of "
                     "cufuse-nvrtc: pip install -e '.[cuda12]' in a clone)")
    elif not R.CUDA_AVAILABLE:
        lines.append(f"backend: NumPy fallback (CuPy {R._cp.__version__} installed, but no usable GPU)")
    else:
        dev = R._cp.cuda.runtime.getDevice()
        props = R._cp.cuda.runtime.getDeviceProperties(dev)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        lines.append(f"backend: CUDA  device {dev}: {name}, {props['multiProcessorCount']} SMs, "
                     f"{props['totalGlobalMem'] / 2**30:.0f} GiB, cc {props['major']}.{props['minor']}")
    if R._cp is not None:
        lines.append(f"CuPy {R._cp.__version__}, NVRTC {R.nvrtc_version()}")
    lines.append(f"kernel cache: {R.cache_dir()} (CuPy's: the op families)")
    lines.append(f"generated kernel cache: {R.generated_cache_dir()} (cufuse.fuse; $CUFUSE_CACHE_DIR)")
    lines.append(f"kernel sources: {R.kernel_dir()}")
    lines.append(f"GPU architectures: {GPU_ARCHS}")
    return lines


# What this version was checked on: `python -m cufuse build` (CI) compiles for
# sm_80 and sm_90; the test suite and benchmarks run on H100 and H200 (sm_90).
GPU_ARCHS = ("compute capability 8.0 or newer (every kernel compiles for sm_80 and sm_90; tested on sm_90: "
             "H100, H200); the pipelined row kernels need 8.0, thread-block clusters 9.0")


def demo(sizes=(100_000, 1_000_000, 20_000_000)) -> int:
    import cufuse
    from ._timing import median, time_gpu, time_host
    for line in _env_lines():
        print(line)
    gpu = R.CUDA_AVAILABLE
    xp = R._cp if gpu else np
    rng = np.random.default_rng(0)
    print()
    print("exp((x + y) * 2), float32" + ("" if gpu else "  [no GPU: NumPy fallback vs the NumPy chain]"))
    unfused_label = "cupy chain" if gpu else "numpy chain"
    print(f"speedup: {unfused_label} µs / cufuse µs (> 1: cufuse is faster)")
    print(f"{'elements':>12} {unfused_label + ' (us)':>18} {'cufuse (us)':>13} {'speedup':>8} {'cufuse GB/s':>12}")
    for n in sizes:
        x = xp.asarray(rng.standard_normal(n, dtype=np.float32))
        y = xp.asarray(rng.standard_normal(n, dtype=np.float32))
        out = xp.empty_like(x)
        ref = np.exp((np.asarray(x.get() if gpu else x, np.float64) + np.asarray(y.get() if gpu else y)) * 2)
        got = cufuse.add_mul_exp(x, y, out=out)
        got = got.get() if gpu else got
        err = float(np.max(np.abs(got - ref) / np.maximum(np.abs(ref), 1e-30)))
        if gpu:
            inner = 20 if n <= 1_000_000 else 1  # small sizes: a stream of calls, launch gaps included
            t_un = median(time_gpu(lambda: xp.exp((x + y) * 2), inner=inner))
            t_fu = median(time_gpu(lambda: cufuse.add_mul_exp(x, y, out=out), inner=inner))
        else:
            reps = 20 if n <= 1_000_000 else 3
            t_un = median(time_host(lambda: np.exp((x + y) * 2), repeat=reps))
            t_fu = median(time_host(lambda: cufuse.add_mul_exp(x, y, out=out), repeat=reps))
        gbs = 3 * 4 * n / (t_fu * 1e-3) / 1e9
        print(f"{n:>12,} {t_un * 1e3:>18.1f} {t_fu * 1e3:>13.1f} {t_un / t_fu:>7.2f}x {gbs:>12.1f}"
              f"   (max rel err {err:.1e})")
    if gpu:
        print("\nunfused: 3 kernels, 7 passes over memory; cufuse: 1 kernel, 3 passes.")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cufuse", description="cufuse demo and tools")
    sub = p.add_subparsers(dest="cmd")
    b = sub.add_parser("build", help="compile every kernel for every dtype (no GPU needed)")
    b.add_argument("--arch", default="sm_80,sm_90", help="comma-separated, e.g. sm_80,sm_90 (default)")
    b.add_argument("-v", "--verbose", action="store_true", help="also a line per kernel and dtype")
    b.add_argument("--family", default="", help="only the kernel families whose names start with this "
                   "(e.g. norm, reduction, elementwise); default: every family")
    sub.add_parser("info", help="print the backend, device, GPU architectures, versions, kernel sources and cache folders")
    args = p.parse_args(argv)
    if args.cmd == "build":
        from ._build import build, parse_archs
        return build(parse_archs(args.arch), family=args.family, verbose=args.verbose)
    if args.cmd == "info":
        print("\n".join(_env_lines()))
        return 0
    return demo()


if __name__ == "__main__":
    sys.exit(main())
