"""Formatting of the benchmark summary, shared by bench/conftest.py (at the end
of a run) and bench/tables.py (from saved summaries): the standard library only,
so that tables.py runs without numpy, pytest or cufuse."""
from __future__ import annotations

DT_SHORT = {"float32": "f32", "float16": "f16"}


def size_label(n: int) -> str:
    """50M, 100K or the count."""
    if n % 1_000_000 == 0:
        return f"{n // 1_000_000}M"
    if n % 1_000 == 0:
        return f"{n // 1_000}K"
    return str(n)


def markdown_table(header, rows, align) -> list[str]:
    """A Markdown table with padded columns (readable in a terminal too); align: "l"/"r" per column."""
    cells = [list(header)] + [[str(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(r):
        return "| " + " | ".join(c.rjust(w[i]) if align[i] == "r" else c.ljust(w[i])
                                 for i, c in enumerate(r)) + " |"

    sep = "|" + "|".join(("-" * (w[i] + 1) + ":") if align[i] == "r" else ("-" * (w[i] + 2))
                         for i in range(len(header))) + "|"
    return [line(cells[0]), sep] + [line(r) for r in cells[1:]]


def by_impl(bandwidth, op, dtype, n) -> dict:
    """The bandwidth rows of one (op, dtype, n), keyed by impl."""
    return {r["impl"]: r for r in bandwidth if (r["op"], r["dtype"], r["n"]) == (op, dtype, n)}


def target_lines(targets, bandwidth) -> list[str]:
    """The Targets table: each entry of ``targets`` names a bandwidth row (op,
    dtype, n) and its minimums (``min_pct`` of copy, ``min_vs_compile`` /
    ``min_vs_eager``: peer µs / cufuse µs; None: shown for information),
    judged against the rows of ``bandwidth`` that ran."""
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
    return out + markdown_table(["op", "n", "dtype", "% copy", "vs torch.compile", "vs torch eager"], rows, "lllrrr")
