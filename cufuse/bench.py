"""Time your own implementations the way cufuse's benchmarks do, and read the suite's results.

    >>> from cufuse.bench import compare
    >>> t = compare({"cufuse": cufuse.add_mul_exp, "cupy": lambda x, y: cp.exp((x + y) * 2)},
    ...             x, y, nbytes=3 * x.nbytes)
    >>> print(t)            # median, spread, GB/s, speedup, error against the first
    >>> t.plot("cmp.png")   # needs matplotlib (the bench extra: pip install -e ".[bench]" in a clone)

``python -m cufuse.bench`` runs the benchmark suite (or reads saved results)
and prints the report; ``--quick`` runs a small comparison in under a minute,
with or without a GPU. See docs/performance.md.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import _arrays as A
from . import _runtime as R
from . import _timing

__all__ = ["compare", "Comparison", "profile_model", "ModelProfile", "main"]


# ------------------------------------------------------------------ compare
@dataclass
class Comparison:
    """The result of ``compare``: one row per implementation (dicts with
    name, median_us, q1_us, q3_us, GBps, speedup, max_abs_err, max_rel_err),
    the device it ran on, and how it was timed."""

    rows: list
    device: str
    method: str
    nbytes: int | None = None
    notes: list = field(default_factory=list)

    def __getitem__(self, name):
        for r in self.rows:
            if r["name"] == name:
                return r
        raise KeyError(name)

    def table(self) -> list[list[str]]:
        head = ["impl", "median µs", "IQR µs", "GB/s", "speedup", "max abs err", "max rel err"]
        body = []
        for r in self.rows:
            body.append([r["name"], f"{r['median_us']:.2f}", f"{r['q1_us']:.2f}-{r['q3_us']:.2f}",
                         "-" if r["GBps"] is None else f"{r['GBps']:.0f}", f"{r['speedup']:.2f}x",
                         _err(r["max_abs_err"]), _err(r["max_rel_err"])])
        return [head] + body

    def __str__(self):
        first = self.rows[0]['name']
        lines = [f"{self.device}; {self.method}. speedup of {first}: impl µs / {first} µs "
                 f"(> 1: {first} is faster); errors against {first}."]
        lines += _format(self.table())
        lines += self.notes
        return "\n".join(lines)

    __repr__ = __str__

    def to_markdown(self) -> str:
        t = self.table()
        out = ["| " + " | ".join(t[0]) + " |", "|" + "---|" * len(t[0])]
        out += ["| " + " | ".join(r) + " |" for r in t[1:]]
        return "\n".join(out)

    def plot(self, path=None, title=None):
        """A bar chart of the medians (IQR as error bars; GB/s on the bars when
        known). Saved to ``path`` when given; returns the matplotlib Figure."""
        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(6, 0.6 + 0.45 * len(self.rows)))
        names = [r["name"] for r in self.rows][::-1]
        med = [r["median_us"] for r in self.rows][::-1]
        err = [[r["median_us"] - r["q1_us"] for r in self.rows][::-1], [r["q3_us"] - r["median_us"] for r in self.rows][::-1]]
        ax.barh(names, med, xerr=err, color="#4c72b0")
        for i, r in enumerate(self.rows[::-1]):
            label = f" {r['median_us']:.1f} µs" + (f", {r['GBps']:.0f} GB/s" if r["GBps"] else "")
            ax.text(r["median_us"], i, label, va="center", fontsize=8)
        ax.set_xlabel("µs per call (median; bars: IQR)")
        ax.set_title(title or self.device, fontsize=9)
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=100)
        return fig


def _err(v):
    return "-" if v is None else f"{v:.2e}"


def _format(rows):
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    out = []
    for k, r in enumerate(rows):
        out.append("  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plots need matplotlib: pip install matplotlib (or the bench extra of "
                          "cufuse-nvrtc: pip install -e '.[bench]' in a clone)") from e
    return plt


def _leaves(res):
    """The arrays of a result: itself, a tuple's or list's items, a dict's values (in key order)."""
    if isinstance(res, dict):
        return [v for k in sorted(res, key=str) for v in _leaves(res[k])]
    return [v for r in res for v in _leaves(r)] if isinstance(res, (tuple, list)) else [res]


def _kind_of(x):
    try:
        return A.kind_of(x)
    except TypeError:
        return None


def _to_numpy(x):
    k = _kind_of(x)
    if k == A.CUPY:
        return x.get()
    if k in (A.TORCH_CPU, A.TORCH_CUDA):
        t = x.detach().cpu()
        return (t.float() if t.dtype == A.torch().bfloat16 else t).numpy()  # (bfloat16 exactly in float32)
    return np.asarray(x)


def _errors(got, ref):
    """Max abs and max relative error of ``got`` against ``ref`` (float64; NaN
    where both are NaN counts as equal; infinities must match)."""
    abs_e = rel_e = 0.0
    gl, rl = _leaves(got), _leaves(ref)
    if len(gl) != len(rl):  # (another number of outputs: nothing to compare them by)
        return float("inf"), float("inf")
    for g, r in zip(gl, rl):
        g, r = _to_numpy(g), _to_numpy(r)
        if g.shape != r.shape:
            return float("inf"), float("inf")
        if np.iscomplexobj(g) or np.iscomplexobj(r):  # real and imaginary parts side by side
            g, r = (np.stack([v.real, v.imag]) if np.iscomplexobj(v) else np.stack([v, np.zeros_like(v)])
                    for v in (g, r))
        g, r = g.astype(np.float64), r.astype(np.float64)
        both_nan = np.isnan(g) & np.isnan(r)
        same_inf = np.isinf(g) & (g == r)
        d = np.where(both_nan | same_inf, 0.0, np.abs(g - r))
        if d.size:
            abs_e = max(abs_e, float(np.nanmax(np.where(np.isnan(d), np.inf, d))))
            rel = d / np.maximum(np.abs(np.where(same_inf | both_nan, 1.0, r)), np.finfo(np.float64).tiny)
            rel_e = max(rel_e, float(np.max(np.where(np.isnan(rel), np.inf, rel))))
    return abs_e, rel_e


def compare(impls, *args, nbytes=None, repeats=50, warmup=10, flush=True, check=True, **kwargs):
    """Time implementations of one computation the way cufuse's benchmarks do.

    ``impls``: a dict name -> callable, or a list of callables (named by
    ``__name__``); each is called as ``fn(*args, **kwargs)``. The first
    (yours, say cufuse) is the one the speedups are of and the errors against.

    On the GPU (when a result is a CuPy array or a CUDA tensor): CUDA events
    on the stream the work goes to (torch's current stream for tensors),
    ``warmup`` calls first, then ``repeats`` timed calls, each after a read-only
    sweep of 512 MiB that evicts L2 (leaving it clean) and keeps the GPU busy
    while the host queues the call (``flush=False``: back-to-back, L2 warm).
    On the CPU: the host clock over ``repeats`` calls. Reported: median and interquartile range in µs;
    GB/s when you give ``nbytes`` (bytes one call must move: inputs read once
    plus outputs written once); speedup = median / the first's median (as in
    every cufuse table: peer time / cufuse time, > 1 means the first is
    faster); with
    ``check``, the max abs and relative difference of each result from the
    baseline's (computed on the same inputs before timing).

    Pass inputs with random data, never zeros, and sizes well beyond L2 for
    bandwidth figures. Returns a ``Comparison`` (prints as a table; ``.rows``,
    ``.to_markdown()``, ``.plot(path)``).
    """
    if isinstance(impls, dict):
        items = list(impls.items())
    else:
        items = [(getattr(f, "__name__", repr(f)), f) for f in impls]
    if not items:
        raise ValueError("cufuse.bench.compare: no implementations given")
    for name, f in items:
        if not callable(f):
            raise TypeError(f"cufuse.bench.compare: {name!r} is not callable")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"cufuse.bench.compare: repeats must be a positive int, got {repeats!r}")
    first = {name: f(*args, **kwargs) for name, f in items}  # correctness run (and compiles)
    kinds = {_kind_of(x) for r in first.values() for x in _leaves(r)}
    on_gpu = bool(kinds & set(A.GPU_KINDS))
    base_name = items[0][0]
    rows = []
    for name, f in items:
        call = (lambda f=f: f(*args, **kwargs))
        if on_gpu:
            stream = _stream_of(first[name])
            t = _timing.gpu_times(call, stream, reps=repeats, warmup=warmup, flush=flush)
            samples = t["samples_us"]
        else:
            for _ in range(warmup):
                call()
            samples = [ms * 1e3 for ms in _timing.time_host(call, warmup=0, repeat=repeats)]
        q = statistics.quantiles(samples, n=4) if len(samples) > 1 else [samples[0]] * 3
        med = statistics.median(samples)
        abs_e, rel_e = _errors(first[name], first[base_name]) if check else (None, None)
        rows.append({"name": name, "median_us": med, "q1_us": q[0], "q3_us": q[2], "min_us": min(samples),
                     "GBps": None if not nbytes else nbytes / (med * 1e-6) / 1e9,
                     "max_abs_err": abs_e, "max_rel_err": rel_e, "samples_us": samples})
    base = rows[0]["median_us"]
    for r in rows:
        r["speedup"] = r["median_us"] / base if base else float("inf")
    if on_gpu:
        props = R._cp.cuda.runtime.getDeviceProperties(R._cp.cuda.runtime.getDevice())
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        method = (f"CUDA events, median of {repeats} after {warmup} warm-up calls, "
                  + ("L2 flushed before each call" if flush else "back to back (L2 warm)"))
    else:
        import platform
        name = f"CPU ({platform.processor() or platform.machine()})"
        method = f"host clock, median of {repeats} after {warmup} warm-up calls"
    return Comparison(rows, name, method, nbytes)


def _stream_of(res):
    """The stream a result's work went to: torch's current stream for CUDA tensors, else CuPy's."""
    for x in _leaves(res):
        if _kind_of(x) == A.TORCH_CUDA:
            dev = x.get_device()
            return R.external_stream(A.torch().cuda.current_stream(dev).cuda_stream, dev)
    return R._cp.cuda.get_current_stream()


# ------------------------------------------------------------------ the report
# Full-size kernels launched and passes over memory (a full-size array read
# or written once) of an unfused chain, against cufuse's one kernel, per op:
# (the chain, its kernels, its passes, cufuse's passes). Small row statistics
# and per-channel parameters are not counted.
TRAFFIC = {
    "add_relu": ("torch eager relu(a + b)", 2, 5, 3),
    "mul_tanh": ("torch eager tanh(a * b)", 2, 5, 3),
    "add_mul_exp": ("torch eager exp((x + y) * 2)", 3, 7, 3),
    "fuse(add_mul_exp)": ("torch eager exp((x + y) * 2)", 3, 7, 3),
    "fma": ("torch eager q * k + v", 2, 6, 4),
    "bias_gelu": ("torch eager gelu(x + bias)", 2, 4, 2),
    "quantize_int8": ("CuPy clip(rint(x / s + z)).astype(int8)", 5, 10, 2),
    "fuse(quantize_int8)": ("CuPy clip(rint(x / s + z)).astype(int8)", 5, 10, 2),
    "dequantize_int8": ("CuPy (q.astype(f) - z) * s", 3, 6, 2),
    "sum_squared": ("CuPy (x * x).sum(axis)", 2, 3, 1),
    "mean_abs": ("CuPy abs(x).mean(axis)", 2, 3, 1),
    "layer_norm": ("CuPy mean, x - m, xc * xc, mean, * rstd, * w, + b", 7, 12, 2),
    "layer_norm_relu": ("CuPy layer norm chain, then maximum(., 0)", 8, 14, 2),
    "rms_norm": ("CuPy x * x, mean, * r, * w", 4, 7, 2),
    "softmax": ("CuPy max, x - m, exp, sum, divide", 5, 8, 2),
    "log_softmax": ("CuPy max, x - m, exp, sum, log (per row), subtract", 5, 8, 2),
}


def _traffic_line(op):
    t = TRAFFIC.get(op.split("[")[0])
    if t is None:
        return None
    chain, k, passes, fused = t
    return (f"memory traffic: {chain}: {k} kernels and {passes} passes over memory; "
            f"cufuse 1 kernel and {fused}")


def report(data: dict) -> list[str]:
    """The report lines for a saved suite result (bench/conftest.py's
    .benchmarks/cufuse-summary.json)."""
    out = []
    info = data.get("info") or {}
    if info:
        out.append(" ".join(f"{k}={v}" for k, v in info.items()))
    copy = data.get("copy") or {}
    if copy:
        out.append(f"device-to-device copy: {copy.get('GBps', 0):.0f} GB/s (the ceiling: % of copy below)")
    by_op: dict = {}
    for r in data.get("bandwidth", []):
        by_op.setdefault(_group(r["op"])[0], []).append(r)
    for op, rows in by_op.items():
        out += ["", f"== {op}"]
        line = _traffic_line(op)
        if line:
            out.append(line)
        keys = sorted({(r["dtype"], r["n"], _group(r["op"])[1] or "") for r in rows})
        impls = list(dict.fromkeys(r["impl"] for r in rows))
        table = [["dtype", "size", "regime", "impl", "GPU µs", "IQR µs", "host µs", "GB/s", "% copy",
                  "cufuse speedup", "max abs err", "max rel err"]]
        for dt, n, shape in keys:
            cell = {r["impl"]: r for r in rows if (r["dtype"], r["n"], _group(r["op"])[1] or "") == (dt, n, shape)}
            cf = cell.get("cufuse")
            for impl in impls:
                r = cell.get(impl)
                if r is None:
                    continue
                ratio = "-" if cf is None else f"{r['gpu_us'] / cf['gpu_us']:.2f}x"
                host = r.get("host_us")
                iqr = (f"{r['gpu_q1_us']:.1f}-{r['gpu_q3_us']:.1f}" if r.get("gpu_q1_us") is not None else "-")
                table.append([dt, shape or _size(n), r.get("regime", "-"), impl, f"{r['gpu_us']:.1f}", iqr,
                              "-" if host is None else f"{host:.1f}", f"{r['GBps']:.0f}",
                              f"{r['pct_of_copy']:.1f}%", ratio, _err(r.get("max_abs_err")),
                              _err(r.get("max_rel_err"))])
        out += _format(table)
    if by_op:
        out += ["", "GPU µs: CUDA-event median of one call with L2 flushed (IQR: its interquartile range; for",
                "\"numpy (CPU)\" the host clock's median of a call on host copies of the same inputs);",
                "regime: L2 when the bytes a call moves fit in the device's L2 cache, else DRAM; host µs: wall",
                "time of a call and a synchronize; GB/s: bytes the op must move (inputs once, outputs once) /",
                "GPU µs; % copy: of the device copy bandwidth measured in the same run; cufuse speedup: impl µs /",
                "cufuse µs; errors: max abs / relative difference from a float64 reference on the same inputs",
                "(quantize: in int8 codes)."]
    for lat in data.get("latency", []):
        out += ["", f"== one call at {_size(lat['n'])} {lat['dtype']} (host µs per call)"]
        bare = lat["us"].get("bare RawKernel")
        t = [["variant", "µs/call", "vs bare"]]
        for k, v in lat["us"].items():
            t.append([k, f"{v:.2f}", "-" if not bare else f"{v / bare:.2f}x"])
        out += _format(t)
    for k, v in (data.get("skipped") or {}).items():
        out.append(f"skipped peer {k}: {v}")
    return out


def _group(op):
    """(op, shape): "layer_norm[4096x768]" -> ("layer_norm", "4096x768"); other ops unchanged."""
    m = re.fullmatch(r"(.+)\[(\d+x\d+)\]", op)
    return (m.group(1), m.group(2)) if m else (op, None)


def _size(n):
    return f"{n // 1_000_000}M" if n % 1_000_000 == 0 else (f"{n // 1000}K" if n % 1000 == 0 else str(n))


def plot_report(data: dict, folder) -> list[str]:
    """PNGs of a saved suite result: per op and dtype, GB/s against size per
    implementation, and the speedup of cufuse over each peer. Returns the paths."""
    plt = _pyplot()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    by: dict = {}
    for r in data.get("bandwidth", []):
        by.setdefault((_group(r["op"])[0], r["dtype"]), []).append(r)
    for (op, dt), rows in by.items():
        # x: the sizes (or row shapes), in order of elements
        label = {(r["n"], r["op"]): _group(r["op"])[1] or _size(r["n"]) for r in rows}
        xs = sorted(label)
        ix = {k: i for i, k in enumerate(xs)}
        impls = list(dict.fromkeys(r["impl"] for r in rows))
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.4))
        for impl in impls:
            pts = sorted((ix[(r["n"], r["op"])], r["GBps"]) for r in rows if r["impl"] == impl)
            a1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        cf = {(r["n"], r["op"]): r["gpu_us"] for r in rows if r["impl"] == "cufuse"}
        peers = [i for i in impls if i != "cufuse"]
        width = 0.8 / max(1, len(peers))
        for k, impl in enumerate(peers):
            sp = {(r["n"], r["op"]): r["gpu_us"] / cf[(r["n"], r["op"])] for r in rows
                  if r["impl"] == impl and (r["n"], r["op"]) in cf}
            a2.bar([i - 0.4 + width * (k + 0.5) for i in range(len(xs))], [sp.get(x, 0) for x in xs], width,
                   label=impl)
        a2.axhline(1.0, color="k", lw=0.6)
        for a in (a1, a2):
            a.set_xticks(range(len(xs)), [label[x] for x in xs], rotation=30, ha="right", fontsize=7)
            a.legend(fontsize=7)
        a1.set_ylabel("GB/s")
        a1.set_ylim(bottom=0)
        a2.set_ylabel("cufuse speedup (peer µs / cufuse µs)", fontsize=8)
        fig.suptitle(f"{op} {dt}", fontsize=9)
        fig.tight_layout()
        p = folder / (re.sub(r"[^A-Za-z0-9]+", "_", f"{op}-{dt}").strip("_") + ".png")
        fig.savefig(p, dpi=80)
        plt.close(fig)
        paths.append(str(p))
    return paths


# ------------------------------------------------------------------ quick run
def quick(sizes=None, out=sys.stdout, plot_dir=None) -> list:
    """A small comparison in under a minute: on a GPU cufuse against the CuPy
    chain (and torch eager when torch is installed); without one, cufuse's
    NumPy fallback against the unfused NumPy chain."""
    import cufuse
    results = []
    gpu = cufuse.CUDA_AVAILABLE
    sizes = sizes or ((1 << 20, 1 << 25) if gpu else (1 << 16, 1 << 20))
    xp = R._cp if gpu else np
    rng = np.random.default_rng(0)
    cases = [("add_mul_exp", lambda x, y: xp.exp((x + y) * 2), 3),
             ("add_relu", lambda x, y: xp.maximum(x + y, 0), 3)]
    total = len(cases) * len(sizes)
    done = 0
    for name, chain, passes in cases:
        for n in sizes:
            x = xp.asarray(rng.standard_normal(n, dtype=np.float32))
            y = xp.asarray(rng.standard_normal(n, dtype=np.float32))
            impls = {"cufuse": getattr(cufuse, name), ("cupy chain" if gpu else "numpy chain"): chain}
            torch = _torch() if gpu else None
            if torch is not None and torch.cuda.is_available():
                tx, ty = torch.from_dlpack(x), torch.from_dlpack(y)
                tchain = {"add_mul_exp": lambda: torch.exp((tx + ty) * 2),
                          "add_relu": lambda: torch.relu(tx + ty)}[name]
                impls["torch eager"] = lambda x_, y_, f=tchain: f()
            res = compare(impls, x, y, nbytes=passes * x.nbytes, repeats=30 if gpu else 10, warmup=5)
            done += 1
            print(f"\r[{'#' * (20 * done // total):20s}] {done}/{total}", end="", file=sys.stderr, flush=True)
            results.append((f"{name} {_size(n)} float32", res))
    print(file=sys.stderr)
    for title, res in results:
        print(f"\n== {title}", file=out)
        print(res, file=out)
    if plot_dir:
        d = Path(plot_dir)
        d.mkdir(parents=True, exist_ok=True)
        for title, res in results:
            res.plot(d / (title.replace(" ", "_") + ".png"), title=title)
        print(f"\nplots in {d}", file=out)
    return results


def _torch():
    try:
        import torch
        return torch
    except Exception:  # not installed (an optional peer), or a broken install
        return None


# ------------------------------------------------------------------ the CLI
def _run_suite(args, json_path):
    root = Path(__file__).resolve().parent.parent
    if not (root / "bench" / "conftest.py").is_file():
        raise SystemExit("cufuse.bench: the benchmark suite (bench/) ships with the repository, not the wheel; "
                         "run this from a clone, or use --quick / --from FILE")
    json_path.parent.mkdir(parents=True, exist_ok=True)  # pytest-benchmark does not create it
    cmd = [sys.executable, "-m", "pytest", "bench", "--benchmark-only", "-q", "-p", "no:cacheprovider",
           f"--benchmark-json={json_path}"] + (["-k", args.k] if args.k else [])
    print("running:", " ".join(cmd), file=sys.stderr)
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail = []
    for line in proc.stdout:  # progress: pytest -q prints "[ NN%]" at the end of each line of dots
        tail.append(line)
        tail = tail[-200:]
        if line.rstrip().endswith("%]"):
            pct = line.rstrip()[-5:-2].strip()
            print(f"\rsuite {pct}% ({time.time() - t0:.0f} s)", end="", file=sys.stderr, flush=True)
    proc.wait()
    print(file=sys.stderr)
    if proc.returncode not in (0, 5):
        sys.stderr.write("".join(tail[-40:]))
        raise SystemExit(f"cufuse.bench: the suite failed (pytest exit {proc.returncode})")
    return root / ".benchmarks" / "cufuse-summary.json"


# ------------------------------------------------------------ profile_model
@dataclass
class ModelProfile:
    """The result of ``profile_model``: one row per module that ran (dicts
    with name, type, calls, forward_ms and peak_mib: per step, the module's
    forward with its children, and the most memory allocated during it
    beyond what was allocated when it started; NaN off the GPU), and the
    totals per step: forward_ms, backward_ms (a training step; else None),
    step_ms and peak_mib of the whole step."""

    rows: list
    totals: dict
    device: str
    steps: int

    def table(self) -> list[list[str]]:
        head = ["module", "type", "calls", "forward ms", "peak MiB"]
        body = [[r["name"] or "(model)", r["type"], str(r["calls"]), f"{r['forward_ms']:.3f}",
                 _mib(r["peak_mib"])] for r in self.rows]
        return [head] + body

    def __str__(self):
        t = self.totals
        back = "" if t["backward_ms"] is None else f", backward {t['backward_ms']:.3f} ms"
        lines = [f"{self.device}; per step, median of {self.steps} steps: forward {t['forward_ms']:.3f} ms{back}, "
                 f"step {t['step_ms']:.3f} ms, peak {_mib(t['peak_mib'])} MiB beyond the step's start"]
        return "\n".join(lines + _format(self.table()))

    __repr__ = __str__

    def plot(self, path=None, top=20):
        """A bar chart of the ``top`` modules by forward time (leaves and
        containers alike). Saved to ``path`` when given; returns the Figure."""
        plt = _pyplot()
        rows = [r for r in self.rows if r["name"]] or self.rows  # (a model without children: itself)
        rows = sorted(rows, key=lambda r: -r["forward_ms"])[:top][::-1]
        fig, ax = plt.subplots(figsize=(7, 0.6 + 0.3 * len(rows)))
        ax.barh([f"{r['name'] or 'the model'} ({r['type']})" for r in rows], [r["forward_ms"] for r in rows],
                color="#4c72b0")
        ax.set_xlabel("forward ms per step (with children)")
        ax.set_title(f"{self.device}: step {self.totals['step_ms']:.2f} ms", fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=100)
        return fig


def _mib(v):
    return "-" if v != v else f"{v:.1f}"  # NaN: not measured


def profile_model(model, inputs, *, train=False, loss_fn=None, steps=3, warmup=1) -> ModelProfile:
    """Time and peak memory of each module of a torch ``model`` and of the
    whole step, for a forward (``train=False``, under ``torch.no_grad()``)
    or a training step (forward, then backward of ``loss_fn(output)``:
    default the output's ``.loss`` or ``["loss"]`` where it has one, else
    the sum of the output, or of its first item for a tuple or list; after
    each step the parameters' ``.grad`` are set to None, so gradients
    accumulated before the call are dropped).

    ``inputs``: a dict of keyword arguments, a tuple of positional ones, or
    one tensor. Forward times come from hooks around every module's forward
    (CUDA events on the GPU, the clock on the CPU; a module's time includes
    its children's); backward is reported for the whole model. Peak memory
    (GPU only): the most allocated during the module beyond its start.
    Medians over ``steps`` steps after ``warmup``. The model runs in its
    current mode (``model.train()`` / ``eval()``: batch norms update their
    statistics in train mode). Modules run again by activation checkpointing
    in the backward are not counted as forward calls. The hooks cost host time
    of their own: compare totals of two models profiled the same way."""
    import torch
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"cufuse.bench.profile_model: model must be a torch.nn.Module, got {type(model).__name__}")
    for what, v, lo in (("steps", steps, 1), ("warmup", warmup, 0)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"cufuse.bench.profile_model: {what} must be an int, got {type(v).__name__}")
        if v < lo:
            raise ValueError(f"cufuse.bench.profile_model: {what} must be >= {lo}, got {v}")
    params = list(model.parameters())
    cuda = bool(params) and params[0].is_cuda
    if isinstance(inputs, dict):
        args, kwargs = (), inputs
    else:
        args, kwargs = (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)), {}
    cuda = cuda or any(isinstance(a, torch.Tensor) and a.is_cuda for a in (*args, *kwargs.values()))
    if loss_fn is None:
        def loss_fn(out):
            loss = getattr(out, "loss", None)
            if loss is None and isinstance(out, dict):
                loss = out.get("loss")
                if loss is None:
                    raise TypeError("cufuse.bench.profile_model: the model returns a dict without a 'loss'; pass "
                                    "loss_fn= (what to call backward on)")
            if loss is None:
                loss = (out[0] if isinstance(out, (tuple, list)) else out)
                loss = loss.float().sum()
            return loss
    names = {m: n for n, m in model.named_modules()}
    marks: dict = {m: [] for m in names}  # module -> per call: (start, end) marks
    peaks: dict = {m: [] for m in names}  # module -> per call: peak bytes beyond its start
    stack: list = []  # [module, start bytes, highest bytes seen] of the modules running
    clock = (lambda: torch.cuda.Event(enable_timing=True)) if cuda else None
    forward = [False]  # the hooks count calls of the step's forward only (not a checkpoint's recompute)

    def mark():
        if cuda:
            e = clock()
            e.record()
            return e
        return time.perf_counter()

    def pre(mod, _args):
        if not forward[0]:
            return
        if cuda:
            if stack:  # what the parent reached so far, then count afresh for the child
                stack[-1][2] = max(stack[-1][2], torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
            now = torch.cuda.memory_allocated()
            stack.append([mod, now, now])
        marks[mod].append([mark(), None])

    def post(mod, _args, _out):
        if not forward[0]:
            return
        marks[mod][-1][1] = mark()
        if cuda:
            top = stack.pop()
            top[2] = max(top[2], torch.cuda.max_memory_allocated())
            peaks[mod].append(top[2] - top[1])
            if stack:
                stack[-1][2] = max(stack[-1][2], top[2])
            torch.cuda.reset_peak_memory_stats()

    def run():
        if train:
            with torch.enable_grad():  # (called under no_grad, say)
                forward[0] = True
                try:
                    out = model(*args, **kwargs)
                finally:
                    forward[0] = False
                t = mark()
                loss_fn(out).backward()
            model.zero_grad(set_to_none=True)
            return t
        with torch.no_grad():
            forward[0] = True
            try:
                model(*args, **kwargs)
            finally:
                forward[0] = False
        return None

    for _ in range(warmup):
        run()
    handles = [h for m in names for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    per_step, totals = [], []
    try:
        for _ in range(steps):
            for m in names:
                marks[m].clear()
                peaks[m].clear()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                stack[:] = [[None, base, base]]  # the step's own frame: the modules' peaks reach it
            t0 = mark()
            t_fwd_end = run()
            t1 = mark()
            if cuda:
                torch.cuda.synchronize()
                peak = (max(stack[0][2], torch.cuda.max_memory_allocated()) - base) / 2 ** 20

                def ms(a, b):
                    return a.elapsed_time(b)
            else:
                peak = float("nan")

                def ms(a, b):
                    return (b - a) * 1e3
            per_step.append({m: (sum(ms(a, b) for a, b in marks[m]), len(marks[m]),
                                 max(peaks[m]) / 2 ** 20 if peaks[m] else float("nan")) for m in names if marks[m]})
            root = marks[model][0][1] if marks[model] else t1
            totals.append((ms(t0, root), None if t_fwd_end is None else ms(t_fwd_end, t1), ms(t0, t1), peak))
    finally:
        for h in handles:
            h.remove()

    def med(v):
        return statistics.median(v)
    rows = []
    for m, n in names.items():
        seen = [s[m] for s in per_step if m in s]
        if not seen:
            continue
        rows.append({"name": n, "type": type(m).__name__, "calls": seen[0][1],
                     "forward_ms": med([v[0] for v in seen]), "peak_mib": med([v[2] for v in seen])})
    tot = {"forward_ms": med([t[0] for t in totals]),
           "backward_ms": None if not train else med([t[1] for t in totals]),
           "step_ms": med([t[2] for t in totals]), "peak_mib": med([t[3] for t in totals])}
    device = torch.cuda.get_device_name() if cuda else "CPU"
    return ModelProfile(rows, tot, device, steps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cufuse.bench", description=(
        "Run cufuse's benchmark suite (pytest-benchmark; needs a GPU) and print the report: per op, time per "
        "implementation and size, GB/s and % of the device copy bandwidth, speedups, memory traffic."))
    p.add_argument("--from", dest="src", metavar="FILE",
                   help="report from a saved result (.benchmarks/cufuse-summary.json) instead of running")
    p.add_argument("--quick", action="store_true", help="a small comparison in under a minute (no GPU: NumPy fallback)")
    p.add_argument("--plot", metavar="DIR", help="write PNG plots there (needs matplotlib)")
    p.add_argument("--json", metavar="FILE", default=".benchmarks/cufuse-bench.json",
                   help="where the suite saves pytest-benchmark's JSON (default %(default)s)")
    p.add_argument("-k", metavar="EXPR", help="run only the benchmarks pytest -k selects")
    args = p.parse_args(argv)
    if args.quick:
        quick(plot_dir=args.plot)
        return 0
    if not args.src and not R.CUDA_AVAILABLE:
        saved = Path(__file__).resolve().parent.parent / "bench" / "results" / "cufuse-summary.json"
        hint = f" or --from {saved} (the saved device results)" if saved.is_file() else " or --from FILE"
        raise SystemExit("cufuse.bench: the suite needs a CUDA GPU (cufuse.CUDA_AVAILABLE is False: CuPy "
                         f"missing, no driver or no device); try --quick (the NumPy fallback){hint}")
    src = Path(args.src) if args.src else _run_suite(args, Path(args.json).resolve())
    try:
        data = json.loads(Path(src).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"cufuse.bench: cannot read {src}: {e}")
    if not isinstance(data, dict) or "bandwidth" not in data:
        raise SystemExit(f"cufuse.bench: {src} is not a cufuse suite summary (bench/conftest.py writes "
                         ".benchmarks/cufuse-summary.json)")
    print("\n".join(report(data)))
    if args.plot:
        paths = plot_report(data, args.plot)
        print(f"\n{len(paths)} plots in {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
