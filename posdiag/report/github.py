"""GitHub Actions annotations: `::error` for what fails the gate (a failed check, a status the gate
policy refuses, a required check that did not pass, a check posdiag could not run), `::warning` for the
other warnings, `::notice` for the other skips (a check that could not run is said, never silent). A check
that does not apply (n/a) is not annotated."""

from __future__ import annotations

from posdiag.results import Report, Status


def _escape(text: str) -> str:
    # Workflow-command data escaping: %, CR and LF; properties also escape ':' and ','.
    return str(text).replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_prop(text: str) -> str:
    return _escape(text).replace(":", "%3A").replace(",", "%2C")


def format_github(report: Report) -> str:
    lines = []
    refused = {r.check: r for r in report.gate if r.kind == "policy"}
    for check in report.checks:
        level = {Status.FAIL: "error", Status.ERROR: "error", Status.WARN: "warning",
                 Status.SKIP: "notice"}.get(check.status)
        summary = check.summary
        if check.name in refused:
            level, summary = "error", f"{refused[check.name].why}: {summary}"
        if level:
            title = _escape_prop(f"posdiag {check.name} ({report.model.id})")
            lines.append(f"::{level} title={title}::{_escape(summary)}")
    for r in refused.values():
        if r.status == "missing":
            lines.append(f"::error title={_escape_prop(f'posdiag {r.check} ({report.model.id})')}::{_escape(r.why)}")
    if report.incomplete:
        lines.append("::error title=posdiag::run interrupted, not every check ran")
    return "".join(line + "\n" for line in lines)
