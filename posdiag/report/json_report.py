"""The stable, versioned JSON report (schema in DESIGN.md)."""

from __future__ import annotations

import json

from posdiag.results import Report


def format_json(report: Report) -> str:
    return json.dumps(report.to_dict(), indent=2, allow_nan=False) + "\n"
