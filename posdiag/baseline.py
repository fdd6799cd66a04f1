"""Baselines: fail when a metric regresses against a stored report, even if the verdict still passes.

A check's spec may declare `baseline={"ratio": "higher"}` (CheckSpec.baseline): the metrics that must not
move the wrong way by more than the margin (a factor, default 10). Status regressions
(pass -> warn/fail, anything -> skip that used to run) are always watched. The result is
one extra check named "baseline" in the report, so exit codes and renderers need nothing new.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from posdiag.errors import PosdiagError
from posdiag.results import CheckResult, Report, Status, Table

# A lower-is-better metric at or below this stays a pass whatever the old value: errors at
# float32 rounding (1e-7 → 5e-7) are noise, not regressions.
NEGLIGIBLE = 1e-6


def read_baseline(path: str | Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise PosdiagError(f"baseline '{path}' does not exist (create it with --save-baseline)") from None
    except Exception as exc:
        raise PosdiagError(f"baseline '{path}' is not a posdiag JSON report: {exc}") from None
    if not isinstance(data, dict) or data.get("schema") != 1 or "checks" not in data:
        raise PosdiagError(f"baseline '{path}' is not a posdiag JSON report (schema 1)")
    return data


def watched_metrics(name: str) -> dict[str, str]:
    from posdiag import checks

    spec = checks.spec(name)
    return {} if spec is None else dict(spec.baseline)


def compare(report: Report, baseline: dict[str, Any], margin: float = 10.0) -> CheckResult:
    old_checks = {c["name"]: c for c in baseline["checks"]}
    rows, regressions = [], []
    rank = {s.value: s.rank for s in Status}
    for check in report.checks:
        old = old_checks.get(check.name)
        if old is None:
            continue
        if rank[check.status.value] > rank.get(old["status"], 0) and check.status is not Status.PASS:
            regressions.append(f"{check.name}: {old['status']} → {check.status.value}")
            rows.append((check.name, "status", old["status"], check.status.value, "REGRESSED"))
        for metric, direction in watched_metrics(check.name).items():
            new_value, old_value = check.metrics.get(metric), old.get("metrics", {}).get(metric)
            if not isinstance(new_value, (int, float)) or not isinstance(old_value, (int, float)):
                continue
            if direction == "higher":
                bad = new_value < old_value / margin
            else:
                bad = new_value > max(old_value, NEGLIGIBLE / margin) * margin and new_value > NEGLIGIBLE
            rows.append((check.name, metric, f"{old_value:.4g}", f"{new_value:.4g}", "REGRESSED" if bad else "ok"))
            if bad:
                regressions.append(f"{check.name}.{metric} {old_value:.3g} → {new_value:.3g}")
    table = Table(f"baseline (margin x{margin:g})", ("check", "metric", "baseline", "now", "state"), tuple(rows))
    metrics = {"regressions": len(regressions), "margin": margin, "compared": len(rows)}
    if regressions:
        return CheckResult("baseline", Status.FAIL, f"{len(regressions)} regression(s) against the baseline: "
                           + "; ".join(regressions[:4]), metrics, {"regressions": regressions}, (table,))
    return CheckResult("baseline", Status.PASS, f"no regression against the baseline ({len(rows)} values compared, "
                       f"margin x{margin:g})", metrics, {}, (table,))


def first_run(path: str | Path, *, written: bool) -> CheckResult:
    """The `baseline` check of a run that had no baseline to compare with: a SKIP that says whether this
    run's report became the baseline (only a passing run's does)."""
    if written:
        summary = f"no baseline yet: this run's report was written to '{path}' (commit it; later runs compare with it)"
    else:
        summary = f"no baseline yet, and none written to '{path}': this run did not pass"
    return CheckResult("baseline", Status.SKIP, summary, {"compared": 0}, {"path": str(path), "written": written})
