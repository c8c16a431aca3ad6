"""Rebuild two text artifacts of a benchmark run from its saved summaries (stdlib only).

    python bench/tables.py targets [SUMMARY] [FUSE_SUMMARY] --label "H200, 2026-11-22 (session 24)"
        prints bench/results/targets.txt: the Targets table that ``pytest bench --benchmark-only``
        prints at its end (bench/conftest.py's _target_lines), then the cufuse.fuse targets
        (bench/test_bench_fuse.py's _judged, saved in FUSE_SUMMARY).
    python bench/tables.py results [SUMMARY]
        prints the table of bench/RESULTS.md: every op at its largest size (50M elements; the
        norms and softmax at 8192x4096), peer columns as peer µs / cufuse µs.

SUMMARY defaults to bench/results/cufuse-summary.json, FUSE_SUMMARY to
bench/results/cufuse-fuse-summary.json (the files ``python -m cufuse.bench`` saves under .benchmarks/).
The formatting helpers mirror bench/conftest.py's (which needs numpy, pytest and cufuse to import).
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUMMARY = ROOT / "bench/results/cufuse-summary.json"
FUSE_SUMMARY = ROOT / "bench/results/cufuse-fuse-summary.json"
DT_SHORT = {"float32": "f32", "float16": "f16"}   # conftest.DT_SHORT; dequantize rows say "i8->f32"
PEERS = {"cupy chain": "cupy-chain", "cupy.fuse": "cupy.fuse", "torch eager": "torch-eager",
         "torch.compile": "torch.compile"}      # RESULTS.md column -> row impl
LARGEST_SHAPE = "8192x4096"                     # the norms' and softmax's row of RESULTS.md


def size_label(n: int) -> str:
    """conftest.size_label: 50M, 100K or the count."""
    if n % 1_000_000 == 0:
        return f"{n // 1_000_000}M"
    if n % 1_000 == 0:
        return f"{n // 1_000}K"
    return str(n)


def padded_table(header, rows, align):
    """conftest._table: a Markdown table with padded columns ("r": right-aligned)."""
    cells = [list(header)] + [[str(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(r):
        return "| " + " | ".join(c.rjust(w[i]) if align[i] == "r" else c.ljust(w[i])
                                 for i, c in enumerate(r)) + " |"

    sep = "|" + "|".join(("-" * (w[i] + 1) + ":") if align[i] == "r" else ("-" * (w[i] + 2))
                         for i in range(len(header))) + "|"
    return [line(cells[0]), sep] + [line(r) for r in cells[1:]]


def shown(path: Path) -> str:
    """A path as the artifacts name it: relative to the repository root when inside it."""
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def by_impl(bandwidth, op, dtype, n) -> dict:
    """The rows of one (op, dtype, n), keyed by impl."""
    return {r["impl"]: r for r in bandwidth if (r["op"], r["dtype"], r["n"]) == (op, dtype, n)}


def target_lines(targets, bandwidth) -> list[str]:
    """conftest._target_lines on saved rows: each target's minimums (min_pct of copy, min_vs_compile /
    min_vs_eager: peer µs / cufuse µs; None: shown for information) judged against its rows."""
    if not targets:
        return []
    rows, tally = [], {"met": 0, "MISSED": 0, "not run": 0}

    def judge(value, minimum, unit):
        text = "" if minimum is None else f">= {minimum:g}{unit}"
        if value is None:
            if minimum is None:
                return "-"
            tally["not run"] += 1
            return f"{text}: not run"
        value_text = f"{value:.1f}%" if unit == "%" else f"{value:.2f}x"
        if minimum is None:
            return value_text
        verdict = "met" if value >= minimum else "MISSED"
        tally[verdict] += 1
        return f"{text}: {value_text} {verdict}"

    for t in targets:
        impls = by_impl(bandwidth, t["op"], t["dtype"], t["n"])
        cf = impls.get("cufuse")
        ratio = {p: impls[p]["gpu_us"] / cf["gpu_us"] if cf and p in impls else None
                 for p in ("torch.compile", "torch-eager")}
        rows.append([t["op"], size_label(t["n"]), DT_SHORT.get(t["dtype"], t["dtype"]),
                     judge(cf["pct_of_copy"] if cf else None, t.get("min_pct"), "%"),
                     judge(ratio["torch.compile"], t.get("min_vs_compile"), "x"),
                     judge(ratio["torch-eager"], t.get("min_vs_eager"), "x")])
    out = ["", "Targets of the issue (reported, not enforced). Ratios: peer µs / cufuse µs (>1 = cufuse faster);",
           "a cell without a minimum is shown for information. "
           + ", ".join(f"{v} {k}" for k, v in tally.items() if v) + "."]
    return out + padded_table(["op", "n", "dtype", "% copy", "vs torch.compile", "vs torch eager"], rows, "lllrrr")


def fuse_target_line(t: dict) -> str:
    """One judged target of bench/test_bench_fuse.py (its _judged entries)."""
    value = "-" if t["value"] is None else f"{t['value']:.3g}"
    return f"{t['verdict']:<7} | {t['bench']} | {t['measure']} | {value} {t['cmp']} {t['limit']:g} {t['unit']}"


def targets_text(summary: Path, fuse_summary: Path, label: str) -> list[str]:
    data = json.loads(summary.read_text())
    fuse = json.loads(fuse_summary.read_text())
    out = [f"Targets of the issues in the run of {shown(summary)} ({label})", ""]
    out += target_lines(data.get("targets", []), data.get("bandwidth", []))
    out += ["", f"cufuse.fuse (bench/test_bench_fuse.py), {shown(fuse_summary)}:"]
    return out + [fuse_target_line(t) for t in fuse.get("targets", [])]


def error_cell(r: dict) -> str:
    """max rel err; quantize rows: the largest difference in int8 codes ("codes_off")."""
    if r.get("codes_off") is not None:
        return f"{r['codes_off']:g} code"
    return "-" if r.get("max_rel_err") is None else f"{r['max_rel_err']:.1e}"


def results_lines(summary: Path) -> list[str]:
    """RESULTS.md's table: the cufuse row of each op at its largest size, grouped by op (first seen first)."""
    bandwidth = json.loads(summary.read_text())["bandwidth"]
    groups: dict[str, list] = {}
    for r in bandwidth:
        m = re.fullmatch(r"(.+)\[(\d+x\d+)\]", r["op"])
        if r["impl"] != "cufuse" or (m.group(2) != LARGEST_SHAPE if m else r["n"] != 50_000_000):
            continue
        op, size = (m.group(1), m.group(2)) if m else (r["op"], size_label(r["n"]))
        groups.setdefault(op, []).append((op, size, r))
    header = ["op", "dtype", "size", "cufuse µs", "GB/s", "% copy", "max rel err", *PEERS]
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * 3 + ["---:"] * (len(header) - 3)) + "|"]
    for op, size, cf in (row for rows in groups.values() for row in rows):
        impls = by_impl(bandwidth, cf["op"], cf["dtype"], cf["n"])
        peers = [f"{impls[p]['gpu_us'] / cf['gpu_us']:.2f}x" if p in impls else "-" for p in PEERS.values()]
        cells = [op, DT_SHORT.get(cf["dtype"], cf["dtype"]), size, f"{cf['gpu_us']:.1f}", f"{cf['GBps']:.0f}",
                 f"{cf['pct_of_copy']:.1f}%", error_cell(cf), *peers]
        out.append("| " + " | ".join(cells) + " |")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="table", required=True)
    t = sub.add_parser("targets", help="bench/results/targets.txt")
    t.add_argument("summary", nargs="?", type=Path, default=SUMMARY)
    t.add_argument("fuse_summary", nargs="?", type=Path, default=FUSE_SUMMARY)
    t.add_argument("--label", required=True, help='device, date and session, e.g. "H200, 2026-11-22 (session 23)"')
    r = sub.add_parser("results", help="the table of bench/RESULTS.md")
    r.add_argument("summary", nargs="?", type=Path, default=SUMMARY)
    args = parser.parse_args(argv)
    if args.table == "targets":
        lines = targets_text(args.summary, args.fuse_summary, args.label)
    else:
        lines = results_lines(args.summary)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
