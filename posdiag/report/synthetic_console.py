"""Console rendering of `posdiag kernels --synthetic`: one table per shape (error against the float64
reference, time, peak memory, verdict), and with --sweep the memory growth by sequence length."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.table import Table

from posdiag.report.fit import print_table

RULE = "rule: error <= 2 x posdiag naive's error in the same dtype + eps (FlashAttention's test rule)"


def render_synthetic(out: Console, shape, results: list, verdicts: dict[str, str], *, quiet: bool = False) -> None:
    """One shape: a line per implementation when quiet, else the table. `shape` is tools.attention.Shape."""
    tq, tk = shape.q_len, shape.k_len
    if quiet:
        for r in results:
            out.print(f"T={tq}/{tk} {r.name}: {r.status} err {r.error:.2e} {verdicts.get(r.name, '')}")
        return
    device_type = str(shape.device).split(":")[0]
    title = (f"{device_type} {shape.dtype}  B={shape.batch} H={shape.heads}/{shape.kv_heads} q={tq} k={tk} "
             f"d={shape.head_dim}{' causal ' + shape.alignment if shape.causal else ''}"
             f"{f' pad={shape.padding}' if shape.padding else ''}{f' window={shape.window}' if shape.window else ''}")
    table = Table(title=title, title_justify="left")
    for col in ("implementation", "error vs fp64", "max |Δ|", "time ms", "peak MiB", "empty rows", "verdict", "note"):
        table.add_column(col, justify="left" if col in ("implementation", "note", "verdict", "empty rows") else "right")
    for r in results:
        ok = r.status == "ok"
        table.add_row(r.name, f"{r.error:.2e}" if ok else "-", f"{r.max_abs:.1e}" if ok else "-",
                      f"{r.seconds * 1e3:.2f}" if ok else "-",
                      f"{r.peak_bytes / 2**20:.2f}" if ok and r.peak_bytes is not None else "-",
                      r.empty_rows or "-", verdicts.get(r.name, ""), r.note)
    print_table(out, table)


def render_growth(out: Console, records: list[dict[str, Any]]) -> None:
    """Peak memory per implementation by length, and the growth exponent between the ends."""
    names = [r["name"] for r in records[0]["results"]]
    table = Table(title="peak memory (MiB) by sequence length; exponent p in memory ~ T^p", title_justify="left")
    table.add_column("implementation")
    for rec in records:
        table.add_column(str(rec["shape"]["q_len"]), justify="right")
    table.add_column("p", justify="right")
    for name in names:
        peaks = []
        for rec in records:
            r = next((x for x in rec["results"] if x["name"] == name), None)
            peaks.append(r["peak_bytes"] if r and r["status"] == "ok" else None)
        known = [(rec["shape"]["q_len"], p) for rec, p in zip(records, peaks, strict=True) if p]
        slope = "-"
        if len(known) >= 2 and known[0][1] > 0:
            slope = f"{math.log(known[-1][1] / known[0][1]) / math.log(known[-1][0] / known[0][0]):.2f}"
        table.add_row(name, *[f"{p / 2**20:.2f}" if p else "-" for p in peaks], slope)
    print_table(out, table)
