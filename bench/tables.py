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
The formatting is bench/summary_format.py's, which bench/conftest.py prints with at the end of a run.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from summary_format import DT_SHORT, by_impl, size_label, target_lines  # bench/, the script's folder

ROOT = Path(__file__).resolve().parent.parent
SUMMARY = ROOT / "bench/results/cufuse-summary.json"
FUSE_SUMMARY = ROOT / "bench/results/cufuse-fuse-summary.json"
PEERS = {"cupy chain": "cupy-chain", "cupy.fuse": "cupy.fuse", "torch eager": "torch-eager",
         "torch.compile": "torch.compile"}      # RESULTS.md column -> row impl
LARGEST_SHAPE = "8192x4096"                     # the norms' and softmax's row of RESULTS.md


def shown(path: Path) -> str:
    """A path as the artifacts name it: relative to the repository root when inside it."""
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


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
