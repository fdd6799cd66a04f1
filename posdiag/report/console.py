"""Rich console rendering: header, one line per check, the tables behind each verdict, a verdict panel."""

from __future__ import annotations

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table as RichTable
from rich.text import Text

from posdiag.report.fit import print_line, print_table
from posdiag.results import CheckResult, Report, Status

STYLE = {
    Status.PASS: "bold green",
    Status.FAIL: "bold red",
    Status.WARN: "bold yellow",
    Status.SKIP: "dim",
    Status.NA: "dim",
    Status.ERROR: "bold magenta",
}


def status_text(status: Status) -> Text:
    return Text(status.value.upper(), style=STYLE[status])


def render(report: Report, console: Console, *, quiet: bool = False, verbose_tables: bool = True) -> None:
    if quiet:
        if report.model.tested:  # what was fed (a VLM's images and video) is part of every verdict's claim
            print_line(console, Text(f"tested: {report.model.tested}"))
        for check in report.checks:
            line = Text.assemble(status_text(check.status), f" {check.name}: {check.summary}")
            print_line(console, line)
        extra = _gate_lines(report, findings=False)  # what fails the gate beyond the FAIL lines above
        for line in extra:
            console.print(line)
        if extra:
            tail = [part for part in (report.policy.describe(), f"exit code {report.exit_code}") if part]
            console.print(Text(" · ".join(tail), style="dim"))
        return
    m = report.model
    header = Text.assemble(
        ("posdiag ", "bold"), (m.id, "bold cyan"),
        f"  family {m.family} · {m.kind} · positions: {m.position_kind} · "
        f"{m.dtype}{'→' + m.check_dtype if m.check_dtype and m.check_dtype != m.dtype else ''} on {m.device}",
    )
    print_line(console, header)
    if m.tested:
        console.print(Text(f"  tested: {m.tested}"))
    if m.untested_code:
        console.print(Text(f"  not tested: {m.untested_code}", style="yellow"))
    for note in m.notes:
        console.print(Text(f"  note: {note}", style="dim"))

    overview = RichTable(show_header=True, header_style="bold", box=None, pad_edge=False)
    overview.add_column("check")
    overview.add_column("status")
    overview.add_column("summary", overflow="fold")
    for check in report.checks:
        overview.add_row(check.name, status_text(check.status), Text(check.summary))  # text, never markup
    print_table(console, overview, prose=True)

    if verbose_tables:
        for check in report.checks:
            for table in check.tables:
                print_table(console, _table(check, table))
    console.print(_verdict_panel(report))


def _table(check: CheckResult, table) -> RichTable:
    out = RichTable(title=f"{check.name}: {table.title}", title_justify="left", show_header=True, header_style="bold")
    for col in table.columns:
        out.add_column(col, justify="right" if col not in ("layer", "parameter", "state", "step", "where") else "left")
    for row in table.rows:
        out.add_row(*[Text(str(v)) for v in row])  # "sdpa[flash]" is a name, not markup
    return out


def _verdict_panel(report: Report) -> Panel:
    """What the run judged, in one look: OK only when every check that applies passed (n/a counted apart); a run
    with skips or warnings is not a full bill of health; findings, refusals of the gate policy and internal errors
    each say so."""
    counts = " · ".join(f"{n} {s.value}" for s in Status if (n := sum(c.status is s for c in report.checks)))
    counts = counts or "no checks ran"
    footer = [part for part in (report.policy.describe(), f"exit code {report.exit_code}") if part]
    if report.incomplete:
        lines = [Text("INCOMPLETE — interrupted, not every check ran", style="bold magenta")]
        footer.insert(0, counts)
    elif report.gate:
        lines = list(_gate_lines(report, findings=True))
        footer.insert(0, counts)
    elif any(c.status is Status.PASS for c in report.checks) and all(c.status in (Status.PASS, Status.NA)
                                                                      for c in report.checks):
        lines = [Text("OK — no position bug found", style="bold green")]
        footer.insert(0, counts)
    else:
        blind = all(c.status in (Status.SKIP, Status.NA) for c in report.checks)  # no check ran on this model
        verdict = "nothing was judged" if blind else "not a full bill of health"
        lines = [Text(f"{counts} — {verdict}", style="bold yellow")]
        short = [f"{c.name} ({c.status.value})" for c in report.checks if c.status not in (Status.PASS, Status.NA)]
        if short:
            footer.insert(0, f"not passed: {', '.join(short)}")
    return Panel(Group(*lines, Text(" · ".join(footer), style="dim")), expand=False)


def _gate_lines(report: Report, *, findings: bool) -> list[Text]:
    """One line per way the gate failed: the position bugs found, what the policy refused, and each check
    posdiag could not run (its own bug, not a finding about the model)."""
    lines = []
    found = [r.check for r in report.gate if r.kind == "finding"]
    if findings and found:
        lines.append(Text(f"FAILED — position bug found by {', '.join(found)}", style="bold red"))
    refused = [f"{r.check} {r.why}" for r in report.gate if r.kind == "policy"]
    if refused:
        lines.append(Text(f"GATE FAILED — {'; '.join(refused)}", style="bold red"))
    for r in report.gate:
        if r.kind == "internal":
            lines.append(Text(f"posdiag could not run {r.check}: {r.summary}; please report", style="bold magenta"))
    return lines
