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
    Status.ERROR: "bold magenta",
}


def status_text(status: Status) -> Text:
    return Text(status.value.upper(), style=STYLE[status])


def render(report: Report, console: Console, *, quiet: bool = False, verbose_tables: bool = True) -> None:
    if quiet:
        for check in report.checks:
            line = Text.assemble(status_text(check.status), f" {check.name}: {check.summary}")
            print_line(console, line)
        return
    m = report.model
    header = Text.assemble(
        ("posdiag ", "bold"), (m.id, "bold cyan"),
        f"  family {m.family} · {m.kind} · positions: {m.position_kind} · "
        f"{m.dtype}{'→' + m.check_dtype if m.check_dtype and m.check_dtype != m.dtype else ''} on {m.device}",
    )
    print_line(console, header)
    for note in m.notes:
        console.print(Text(f"  note: {note}", style="dim"))

    overview = RichTable(show_header=True, header_style="bold", box=None, pad_edge=False)
    overview.add_column("check")
    overview.add_column("status")
    overview.add_column("summary", overflow="fold")
    for check in report.checks:
        overview.add_row(check.name, status_text(check.status), check.summary)
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
        out.add_row(*[str(v) for v in row])
    return out


def _verdict_panel(report: Report) -> Panel:
    counts = {s: sum(1 for c in report.checks if c.status is s) for s in Status}
    parts = [f"{n} {s.value}" for s, n in counts.items() if n]
    if report.incomplete:
        title, style = "INCOMPLETE — interrupted, not every check ran", "bold magenta"
    elif report.exit_code == 0:
        title, style = "OK — no position bug found", "bold green"
    else:
        failed = [c.name for c in report.checks if c.status in (Status.FAIL, Status.ERROR)]
        title, style = f"FAILED — {', '.join(failed)}", "bold red"
    body = Group(Text(title, style=style), Text(f"{', '.join(parts)} · exit code {report.exit_code}", style="dim"))
    return Panel(body, expand=False)
