"""The stable, versioned JSON report (schema in DESIGN.md), and the JSON of `posdiag rope` and
`posdiag kernels --synthetic`, which carry data beyond the checks."""

from __future__ import annotations

import json
from typing import Any

from posdiag.results import Report, jsonable


def format_json(report: Report) -> str:
    return json.dumps(report.to_dict(), indent=2, allow_nan=False) + "\n"


def format_rope_json(model: str, static: list, report: Report | None) -> str:
    """The report (or an empty one after a static-only analysis) plus a `rope` list: one entry per rotary spec."""
    if report is not None:
        data = report.to_dict()
    else:
        data = {"schema": 1, "model": {"id": model}, "checks": [], "exit_code": 0}
    data["rope"] = [_rope_spec(r) for r in static]
    return json.dumps(jsonable(data), indent=2) + "\n"


def _rope_spec(r) -> dict[str, Any]:
    return {"layer_type": r.spec.layer_type, "rope_type": r.spec.rope_type, "theta": r.spec.theta,
            "head_dim": r.spec.head_dim, "rotary_dim": r.spec.rotary_dim, "params": r.spec.params,
            "attention_scaling": r.attention_scaling, "before": r.before.summary(), "after": r.after.summary(),
            "pairs": [{"pair": i, "freq": float(r.after.freqs[i]), "wavelength": float(r.after.wavelengths[i]),
                       "turns_training": float(r.after.turns_training[i]),
                       "turns_target": float(r.after.turns_target[i]),
                       "unseen_at_target": bool(r.after.unseen[i])} for i in range(r.after.pairs)],
            "warnings": list(r.warnings), "notes": list(r.notes),
            "mrope_sections": [x.to_dict() for x in r.sections]}


def format_synthetic_json(records: list[dict[str, Any]]) -> str:
    """`kernels --synthetic`: one record per shape, {"shape": ..., "results": [...]}."""
    return json.dumps({"schema": 1, "synthetic": records}, indent=2, default=str) + "\n"
