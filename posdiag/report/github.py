"""GitHub Actions annotations: `::error` for failed checks, `::warning` for warnings."""

from __future__ import annotations

from posdiag.results import Report, Status


def _escape(text: str) -> str:
    # Workflow-command data escaping: %, CR and LF; properties also escape ':' and ','.
    return str(text).replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_prop(text: str) -> str:
    return _escape(text).replace(":", "%3A").replace(",", "%2C")


def format_github(report: Report) -> str:
    lines = []
    for check in report.checks:
        level = {Status.FAIL: "error", Status.ERROR: "error", Status.WARN: "warning"}.get(check.status)
        if level:
            title = _escape_prop(f"posdiag {check.name} ({report.model.id})")
            lines.append(f"::{level} title={title}::{_escape(check.summary)}")
    if report.incomplete:
        lines.append("::error title=posdiag::run interrupted, not every check ran")
    return "".join(line + "\n" for line in lines)
