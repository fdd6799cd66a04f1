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


def section_table(static: list[rope_math.SpecReport]) -> Table | None:
    """Multimodal RoPE: each axis (t/h/w) with its pairs, the section boundaries, and what its pairs reach."""
    rows = []
    for r in static:
        for sec in r.sections:
            pairs = list(sec.pairs)
            named = (f"{pairs[0]}-{pairs[-1]}" if pairs == list(range(pairs[0], pairs[-1] + 1)) and len(pairs) > 1
                     else ",".join(map(str, pairs)))
            rows.append((f"{r.spec.label}", sec.stream, f"{named} ({len(pairs)} of {r.spec.rotary_dim // 2}, "
                         f"{sec.layout})", _fmt(sec.shortest_wavelength), _fmt(sec.longest_wavelength),
                         _fmt(sec.critical_pair), _fmt(sec.unseen_at_target)))
    if not rows:
        return None
    return Table("mRoPE sections per axis: pairs and wavelengths (information)",
                 ("where", "axis", "pairs", "shortest λ", "longest λ", "critical pair", "unseen pairs @N"), tuple(rows))


def section_words(static: list[rope_math.SpecReport]) -> str:
    """"t pairs 0-3 | h 4-5 | w 6-7 of 8, chunked" for the first spec with mRoPE sections ("" without)."""
    for r in static:
        if r.sections:
            parts = []
            for sec in r.sections:
                pairs = list(sec.pairs)
                named = (f"{pairs[0]}-{pairs[-1]}" if pairs == list(range(pairs[0], pairs[-1] + 1)) and len(pairs) > 1
                         else ",".join(map(str, pairs)))
                parts.append(("t pairs " if sec.stream == "t" else f"{sec.stream} ") + named)
            return f"{' | '.join(parts)} of {r.spec.rotary_dim // 2}, {r.sections[0].layout}"
    return ""
