"""Console rendering of `posdiag compare`: both models, the verdict line, the per-layer table with
an error-vs-position sparkline, a bucketed bar plot for the layer where the error appears, and a
verdict panel. Also the optional PNG (matplotlib). Data only comes from the CheckResult and the
Comparison profiles; nothing is computed here that decides anything."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table as RichTable
from rich.text import Text

from posdiag.report.console import status_text
from posdiag.report.fit import print_line, print_table
from posdiag.results import CheckResult, Report, Status
from posdiag.verdict import FAIL_RATIO

BLOCKS = "▁▂▃▄▅▆▇█"
AT_FLOOR, RAISED = "·", "∘"
"""A bucket within its row's tolerance: at the noise floor (within FAIL_RATIO x the row's floor, the floor column of
its table), or above it where the row's tolerance was raised past that (a quantised file judged within what its
quantisation adds): never drawn as noise."""


def render_compare(report: Report, console: Console, *, quiet: bool = False) -> None:
    check = report.check("compare")
    if quiet:
        print_line(console, Text.assemble(status_text(check.status), f" compare: {check.summary}"))
        refused = [f"{r.check} {r.why}" for r in report.gate if r.kind == "policy"]
        if refused:
            console.print(Text(f"GATE FAILED — {'; '.join(refused)}", style="bold red"))
        return
    details = check.details
    for role in ("reference", "candidate"):
        m = details.get(role)
        if not m:
            continue
        console.print(Text.assemble(
            (f"{role:<9} ", "bold"), (str(m["id"]), "bold cyan"),
            f"  family {m['family']} · {m['kind']} · positions: {m['position_kind']} · "
            f"{m['dtype']}{'→' + m['check_dtype'] if m.get('check_dtype') and m['check_dtype'] != m['dtype'] else ''}"
            f" on {m['device']}",
        ))
        for note in m.get("notes", ()):
            console.print(Text(f"  note: {note}", style="dim"))
    if "seq_len" in details:
        ctx = details.get("original_context")
        console.print(Text(
            f"{details['seq_len']} tokens · original context {ctx if ctx else 'unknown'} · "
            f"compared in {details.get('compared_dtype', '?')} · floor: {details.get('floor_source', '?')}",
            style="dim"))
    if details.get("engine"):
        settings = " · ".join(f"{k} {v}" for k, v in details["engine"].items() if k != "name")
        console.print(Text(f"engine: {settings or 'no settings reported'}", style="dim"))
    if "boundaries" in details:
        crossed, bounds = details.get("boundaries_crossed", {}), details["boundaries"]
        parts = [f"{k} {v} ({'crossed' if k in crossed else 'not crossed'})" for k, v in bounds.items()]
        console.print(Text("boundaries: " + ("; ".join(parts) or "none declared"), style="dim"))
    for note in details.get("notes", ()) or ():
        console.print(Text(f"note: {note}", style="yellow"))
    print_line(console, Text.assemble(status_text(check.status), f" compare: {check.summary}"))

    profile = details.get("profile")
    if profile and check.tables:
        print_table(console, _layer_table(check, profile))
        focus = details.get("first_layer")  # the bar plot only where something differs
        if focus in profile["mean_error"]:
            print_table(console, _bar_plot(focus, profile))
    for table in check.tables[1:]:  # the comparison's own extra tables (a quantised file's split by position)
        out = RichTable(title=f"compare: {table.title}", title_justify="left", header_style="bold")
        for col in table.columns:
            out.add_column(col, justify="left" if col == table.columns[0] else "right")
        for row in table.rows:
            out.add_row(*[str(v) for v in row])
        print_table(console, out)
    console.print(_panel(report))


def scale(values: list[float], tolerance: float):
    """v -> bar fraction in (0, 1] for the values above the tolerance: linear when they span
    less than 100x (the shape of a rise stays visible), log otherwise. Returns (fn, "lin"|"log")."""
    above = [v for v in values if v == v and v > tolerance]
    if not above:
        return (lambda v: 0.0), "lin"
    lo, hi = min(above), max(above)
    if hi <= 0:
        return (lambda v: 0.0), "lin"
    if hi / lo <= 100:
        return (lambda v: max(0.0, min(1.0, v / hi))), "lin"
    base = lo / 2
    span = math.log10(hi / base)
    return (lambda v: max(0.0, min(1.0, math.log10(max(v, base) / base) / span))), "log"


def within(v: float, tolerance: float, floor: float | None) -> Text:
    """The mark of a bucket within its tolerance: AT_FLOOR, or RAISED above FAIL_RATIO x the row's floor."""
    if floor is not None and v > FAIL_RATIO * floor:
        return Text(RAISED, style="yellow")
    return Text(AT_FLOOR, style="dim green")


def sparkline(values: list[float], tolerance: float, floor: float | None = None) -> Text:
    """One character per position bucket, scaled per row; within the tolerance a dim dot (the noise floor) or,
    above FAIL_RATIO x the row's floor, RAISED; above the tolerance a red bar."""
    out = Text()
    frac, _ = scale(values, tolerance)
    for v in values:
        if v != v:  # NaN
            out.append("!", style="bold magenta")
        elif v <= tolerance:
            out.append(within(v, tolerance, floor))
        else:
            out.append(BLOCKS[min(len(BLOCKS) - 1, max(0, math.ceil(frac(v) * len(BLOCKS)) - 1))], style="red")
    return out


def _layer_table(check: CheckResult, profile: dict[str, Any]) -> RichTable:
    table = check.tables[0]
    starts = profile["bucket_starts"]
    out = RichTable(title=f"compare: {table.title}", title_justify="left", header_style="bold")
    for col in table.columns:
        out.add_column(col, justify="left" if col in ("layer", "pattern") else "right")
    out.add_column(f"error vs position 0 → {profile['length'] - 1}", no_wrap=True)
    floors = profile.get("floor", {})
    marks = Text()
    for row in table.rows:
        name = row[0]
        values = profile["mean_error"].get(name, [])
        line = sparkline(values, profile["tolerance"].get(name, 0.0), floors.get(name))
        marks.append(line)
        out.add_row(*[str(v) for v in row], line)
    raised = f"; {RAISED} = above {FAIL_RATIO:g}x the row's floor, within its raised tolerance" \
        if RAISED in marks.plain else ""
    out.caption = (f"one character per position bucket starting at {', '.join(str(s) for s in starts)}; "
                   f"{AT_FLOOR} = at the noise floor (within {FAIL_RATIO:g}x the row's floor){raised}; bars scaled "
                   "per row")
    return out


def _bar_plot(name: str, profile: dict[str, Any], width: int = 40) -> RichTable:
    starts, length = profile["bucket_starts"], profile["length"]
    values = profile["mean_error"][name]
    tol, floor = profile["tolerance"].get(name, 0.0), profile.get("floor", {}).get(name)
    frac, kind = scale(values, tol)
    out = RichTable(title=f"compare: error vs position at {name} ({'linear' if kind == 'lin' else 'log'} bars; "
                          f"{AT_FLOOR} = at the noise floor, {RAISED} = above it, within tolerance {tol:.1e})",
                    title_justify="left", box=None, header_style="bold", show_header=True)
    out.add_column("positions", justify="right")
    out.add_column("mean error", justify="right")
    out.add_column("", no_wrap=True)
    ends = list(starts[1:]) + [length]
    for s, e, v in zip(starts, ends, values, strict=True):
        label = f"{s}" if e - s == 1 else f"{s}–{e - 1}"
        above = v == v and v > tol
        bar = Text("█" * max(1, round(frac(v) * width)), style="red") if above else within(v, tol, floor)
        out.add_row(label, f"{v:.2e}", bar)
    return out


def _panel(report: Report) -> Panel:
    check = report.check("compare")
    if report.exit_code == 0:
        title, style = ("SAME MODEL — within rounding", "bold green") if check.status is Status.PASS else \
            (f"NO DIFFERENCE FOUND — {check.status.value}", "bold yellow")
    elif check.status is not Status.FAIL:  # the gate policy refused a WARN (or a required check did not pass)
        title = "GATE FAILED — " + "; ".join(f"{r.check} {r.why}" for r in report.gate if r.kind == "policy")
        style = "bold red"
    else:
        title, style = "DIFFERENT — " + str(check.details.get("pattern") or check.status.value), "bold red"
    body = Group(Text(title, style=style), Text(f"exit code {report.exit_code}", style="dim"))
    return Panel(body, expand=False)


def write_png(path: str, comparison: Any, title: str = "") -> None:
    """Per-position error of every compared layer (log y), tolerances dashed. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    positions = list(range(comparison.seq_len))
    # Exact zeros (position 0 under a relative-position bug) drawn at the bottom edge:
    # two decades under the smallest tolerance.
    tiny = min((p.tolerance for p in comparison.profiles if p.tolerance > 0), default=1e-7) / 100
    for p in comparison.profiles:
        line, = ax.plot(positions[:len(p.per_position)], [max(v, tiny) for v in p.per_position], label=p.name, lw=1)
        ax.axhline(max(p.tolerance, tiny), color=line.get_color(), ls="--", lw=0.6)
    if comparison.profiles:  # one legend entry for every dashed line: each is its layer's tolerance, in its colour
        ax.plot([], [], color="gray", ls="--", lw=0.6, label="dashed: each layer's tolerance (its colour)")
    ax.set_yscale("log")
    ax.set_ylim(bottom=tiny / 2)
    ax.set_xlabel("token position")
    ax.set_ylabel("relative error ||Δh[t]|| / ||h_ref[t]||  (0 drawn at the bottom)")
    ax.set_title(title or "posdiag compare: error vs position (dashed: tolerance)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
