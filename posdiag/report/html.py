"""The HTML report: one self-contained page (inline CSS and SVG; no script, no font, no image fetched) a CI run can
keep. The terminal's view first (header, one line per check, the verdict, exported by rich as it prints), then a
section per check: its status and summary, the figures that decided it, its error plotted against position where
its results hold one (report/curves.py, drawn by report/svg.py), its tables, the paths it ran with what each
confirmed, and every detail it kept. Only consumes a finished Report; every text is escaped."""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from html import escape
from typing import TYPE_CHECKING, Any

from posdiag.report.curves import plots_of
from posdiag.report.svg import render_svg
from posdiag.results import CheckResult, Report, Status, Table

if TYPE_CHECKING:
    from rich.console import Console

TERMINAL_WIDTH = 120
LIST_SHOWN = 24  # items of a long list (or mapping) shown in the details; the count of the rest is said
WORDS = ("story", "reason", "why", "first_departing", "first_diverging_step", "first_difference", "decided",
         "crashed", "short", "not_probed")  # what a path's entry says about it, in this order

CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:0 auto;max-width:1100px;padding:16px;
color:#1b1b1b;background:#fafafa}
h1{font-size:20px;margin:8px 0}h2{font-size:17px;margin:0 0 6px}h3{font-size:14px;margin:12px 0 4px}
pre.terminal{background:#111;color:#ddd;padding:10px;overflow-x:auto;font:12px/1.3 'DejaVu Sans Mono',Menlo,
Consolas,monospace;border-radius:4px}
section.check{background:#fff;border:1px solid #ddd;border-left:6px solid #999;border-radius:4px;padding:10px 14px;
margin:14px 0}
section.check.pass{border-left-color:#2e7d32}section.check.fail{border-left-color:#c62828}
section.check.warn{border-left-color:#f9a825}section.check.error{border-left-color:#8e24aa}
.status{font-weight:700;padding:1px 6px;border-radius:3px;color:#fff;background:#888;font-size:12px}
.status.pass{background:#2e7d32}.status.fail{background:#c62828}.status.warn{background:#f9a825;color:#000}
.status.error{background:#8e24aa}.status.skip,.status.na{background:#9e9e9e}
table{border-collapse:collapse;margin:4px 0 8px;font-size:12.5px}td,th{border:1px solid #ddd;padding:2px 6px;
text-align:left;vertical-align:top}th{background:#f0f0f0}td.num{text-align:right;font-variant-numeric:tabular-nums}
figure{margin:8px 0}svg.plot{font:11px sans-serif;background:#fff;max-width:100%;height:auto}svg .title{font-size:13px;
font-weight:600}dl{margin:2px 0 2px 12px}dt{font-weight:600;display:inline}dd{display:inline;margin:0 0 0 6px}
dl>div{margin:1px 0}details{margin:6px 0}summary{cursor:pointer;color:#444}nav a{margin-right:10px}
.verdict{font-weight:700;font-size:15px}.verdict.ok{color:#2e7d32}.verdict.bad{color:#c62828}
.muted{color:#666}
"""


def format_html(report: Report | None, *, before: Callable[[Console], None] | None = None, title: str = "") -> str:
    """The page for REPORT (None: a run that made no report, e.g. `kernels --synthetic`: the terminal view alone).
    BEFORE: what the command printed ahead of the report's view (`rope`'s analysis of the config), drawn again
    into the page's terminal view."""
    name = title or (f"posdiag · {report.model.id}" if report is not None else "posdiag")
    body = [f"<header><h1>{escape(name)}</h1>{_meta(report)}</header>"]
    if report is not None:
        body.append(_verdict(report))
        body.append(_nav(report))
    body.append(f'<section class="terminal"><h2>As in the terminal</h2><pre class="terminal">'
                f"{_terminal(report, before)}</pre></section>")
    if report is not None:
        body += [_check_section(c) for c in report.checks]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width\"><title>{escape(name)}</title>"
            f"<style>{CSS}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n")


def _meta(report: Report | None) -> str:
    from posdiag._version import __version__

    versions = dict(report.versions) if report is not None else {}
    versions.setdefault("posdiag", __version__)
    return f'<p class="muted versions">{escape(" · ".join(f"{k} {v}" for k, v in versions.items()))}</p>'


def _verdict(report: Report) -> str:
    """The gate in one line, as the terminal's panel judges it (findings, refusals, internal errors), then the
    exit code."""
    lines = [f'<a href="#check-{escape(r.check)}">{escape(r.check)}</a>: {escape(r.why)}' for r in report.gate]
    if report.incomplete:
        head, cls = "INCOMPLETE — interrupted, not every check ran", "bad"
    elif lines:
        head, cls = "GATE FAILED", "bad"
    else:
        head, cls = "gate passed", "ok"
    counts = " · ".join(f"{n} {s.value}" for s in Status if (n := sum(c.status is s for c in report.checks)))
    items = "".join(f"<li>{line}</li>" for line in lines)  # escaped above
    policy = report.policy.describe() or "default gate"
    return (f'<section id="verdict"><p class="verdict {cls}">{escape(head)}</p>{f"<ul>{items}</ul>" if items else ""}'
            f'<p class="muted">{escape(counts or "no checks ran")} · {escape(policy)}'
            f' · <span class="exit-code">exit code {report.exit_code}</span></p></section>')


def _nav(report: Report) -> str:
    links = " ".join(f'<a href="#check-{escape(c.name)}">{escape(c.name)} {_badge(c.status)}</a>'
                     for c in report.checks)
    return f"<nav>{links}</nav>"


def _badge(status: Status) -> str:
    cls = "na" if status is Status.NA else status.value
    return f'<span class="status {cls}">{escape(status.value.upper())}</span>'


def _terminal(report: Report | None, before: Callable[[Console], None] | None) -> str:
    """The console view recorded and exported by rich (its spans carry inline colours; rich escapes the text)."""
    from rich.console import Console

    from posdiag.report.console import render

    console = Console(record=True, file=io.StringIO(), width=TERMINAL_WIDTH, force_terminal=True,
                      color_system="truecolor", legacy_windows=False)
    if before is not None:
        before(console)
    if report is not None:
        if [c.name for c in report.checks] == ["compare"]:
            from posdiag.report.compare_console import render_compare

            render_compare(report, console)
        else:
            render(report, console, verbose_tables=False)
    return console.export_html(inline_styles=True, code_format="{code}")


def _check_section(check: CheckResult) -> str:
    cls = "na" if check.status is Status.NA else check.status.value
    parts = [f'<section class="check {cls}" id="check-{escape(check.name)}" data-check="{escape(check.name)}" '
             f'data-status="{escape(check.status.value)}">',
             f'<h2>{escape(check.name)} {_badge(check.status)}</h2><p class="summary">{escape(check.summary)}</p>']
    if check.metrics:
        parts.append(_metrics(check.metrics))
    for plot in plots_of(check):
        parts.append(f"<figure>{render_svg(plot)}</figure>")
    for table in check.tables:
        parts.append(_table(table))
    parts += _paths(check.details)
    details = {k: v for k, v in check.details.items() if k != "tables"}
    if details:
        parts.append(f"<details><summary>every detail it kept</summary>{_value(details, 0)}</details>")
    parts.append(f'<p class="muted">{check.seconds:.1f} s · {check.forward_passes} forward passes</p></section>')
    return "\n".join(parts)


def _metrics(metrics: dict[str, Any]) -> str:
    cells = "".join(f"<tr><th>{escape(str(k))}</th><td class=\"num\">{escape(_scalar(v))}</td></tr>"
                    for k, v in metrics.items())
    return f'<details><summary>the figures behind the verdict</summary><table class="metrics">{cells}</table></details>'


def _table(table: Table) -> str:
    head = "".join(f"<th>{escape(str(c))}</th>" for c in table.columns)
    rows = "".join("<tr>" + "".join(f"<td>{escape(_scalar(v))}</td>" for v in row) + "</tr>" for row in table.rows)
    return f'<h3>{escape(table.title)}</h3><table class="check-table"><tr>{head}</tr>{rows}</table>'


def _paths(details: dict[str, Any], where: str = "", depth: int = 0) -> list[str]:
    """Every mapping of named paths (routes, runs, sequences, implementations...) whose entries carry a status, as
    a table: the path, its status and what confirmed it (its story, reason, first departing position...)."""
    out = []
    for key, value in details.items():
        if not isinstance(value, dict) or depth > 2:
            continue
        label = f"{where}{key}"
        entries = {n: v for n, v in value.items() if isinstance(v, dict) and "status" in v}
        if entries:
            rows = "".join(f"<tr><td>{escape(str(n))}</td><td>{escape(_scalar(v['status']))}</td>"
                           f"<td>{escape(_words(v))}</td></tr>" for n, v in entries.items())
            out.append(f'<h3>{escape(label)}: what each path confirmed</h3><table class="paths"><tr><th>path</th>'
                       f"<th>status</th><th>what it says</th></tr>{rows}</table>")
        else:
            out += _paths(value, f"{label} · ", depth + 1)
    return out


def _words(entry: dict[str, Any]) -> str:
    said = [f"{k.replace('_', ' ')}: {_scalar(entry[k])}" for k in WORDS if entry.get(k) not in (None, "", "-", [])]
    return "; ".join(said)


def _value(value: Any, depth: int) -> str:
    """Details of any shape: mappings as definition lists, lists of figures on one line (long ones cut)."""
    if isinstance(value, dict):
        items = list(value.items())
        rows = "".join(f"<div><dt>{escape(str(k))}</dt><dd>{_value(v, depth + 1)}</dd></div>"
                       for k, v in items[:LIST_SHOWN])
        more = f'<div class="muted">… {len(items) - LIST_SHOWN} more</div>' if len(items) > LIST_SHOWN else ""
        return f"<dl>{rows}{more}</dl>"
    if isinstance(value, (list, tuple)):
        if any(isinstance(v, (dict, list, tuple)) for v in value) and depth < 6:
            shown = "".join(f"<div>{_value(v, depth + 1)}</div>" for v in value[:LIST_SHOWN])
        else:
            shown = escape(", ".join(_scalar(v) for v in value[:LIST_SHOWN]))
        more = f" … ({len(value)} in all)" if len(value) > LIST_SHOWN else ""
        return f"[{shown}{escape(more)}]"
    return escape(_scalar(value))


def _scalar(value: Any) -> str:
    if isinstance(value, Status):
        return value.value
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(getattr(value, "value", value)) if not isinstance(value, str) else value
