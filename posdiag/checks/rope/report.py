"""Report pieces: the static frequency analysis as metrics and tables, the probes' tables."""

from __future__ import annotations

from typing import Any

import numpy as np

from posdiag.checks.rope.findings import Finding
from posdiag.results import Table
from posdiag.tools import rope_math


def static_metrics(static: list[rope_math.SpecReport]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in static:
        prefix = f"{r.spec.layer_type}_" if r.spec.layer_type and len(static) > 1 else ""
        a = r.after
        out.update({
            f"{prefix}rope_type": r.spec.rope_type, f"{prefix}rope_theta": r.spec.theta,
            f"{prefix}rotary_dim": r.spec.rotary_dim, f"{prefix}training_length": a.training_length,
            f"{prefix}critical_pair": a.critical_pair, f"{prefix}longest_wavelength": a.longest_wavelength,
            f"{prefix}unseen_pairs_at_target": a.unseen_pairs, f"{prefix}alias_offset": a.alias_offset,
            f"{prefix}decay_first_zero": a.decay_first_zero, f"{prefix}attention_scaling": r.attention_scaling,
        })
    return out


def spec_dict(r: rope_math.SpecReport) -> dict[str, Any]:
    return {"layer_type": r.spec.layer_type, "rope_type": r.spec.rope_type, "theta": r.spec.theta,
            "head_dim": r.spec.head_dim, "rotary_dim": r.spec.rotary_dim, "params": r.spec.params,
            "attention_scaling": r.attention_scaling, "before": r.before.summary(), "after": r.after.summary()}


def static_table(static: list[rope_math.SpecReport]) -> Table:
    rows = []
    for r in static:
        for label, a in (("before scaling", r.before), ("after scaling", r.after)):
            rows.append((f"{r.spec.label}: {label}", _fmt(a.critical_pair), _fmt(a.longest_wavelength),
                         _fmt(a.unseen_pairs),
                         _fmt(a.alias_offset) if a.alias_offset else f"none ≤ {a.alias_scanned}",
                         _fmt(a.decay_first_zero)))
    return Table("frequencies vs training length (information)",
                 ("where", "critical pair", "longest λ", "unseen pairs @N", "alias", "decay 1st zero"), tuple(rows))


def _fmt(v: Any) -> str:
    if v is None:
        return "none"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def factor_table(factors: list[Finding]) -> Table:
    return Table("attention factor on the applied path (||rotated|| / ||un-rotated|| of the rotary dims)",
                 ("where", "layer", "q/k", "expected", "measured", "worst x bound"),
                 tuple((f.probe, f.layer, f.tensor, f"{f.expected:.6g}", f"{f.extra['measured_factor']:.6g}",
                        f"{f.ratio:.3g}")
                       for f in factors))


def position_table(rows: list[tuple]) -> Table:
    picked = rows if len(rows) <= 12 else [rows[i] for i in np.unique(np.linspace(0, len(rows) - 1, 12).astype(int))]
    return Table("applied-rotation error by position (x tolerance)", ("where", "position", "error ratio"),
                 tuple((label, p, f"{r:.3g}") for label, p, r in picked))
