"""Probe 3, the attention factor (YaRN/longrope "mscale"): a rotation keeps each pair's norm, so
||rotated dims|| / ||un-rotated dims|| = s at every position; s must equal attention_scaling."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from posdiag.checks.rope.capture import heads
from posdiag.checks.rope.findings import Finding, factor_sentence, severity
from posdiag.verdict import FAIL_RATIO, LOW_PRECISION, within_tolerance


def factor_finding(arr: np.ndarray, plain: list[tuple], name: str, freqs: np.ndarray, scaling: float, eps: float,
                   positions: np.ndarray, layer: int) -> Finding | None:
    """The factor judged against the first un-rotated capture that lines up with this q or k (None: none does)."""
    for q0, k0, source, q1, k1 in plain:
        rotated = (q1 if name == "q" else k1)
        after = arr if rotated is None else heads(rotated, len(positions))
        if after is None or not np.isfinite(after).all():
            continue
        rot = min(2 * freqs.shape[0], after.shape[-1])
        before = unrotated(q0 if name == "q" else k0, after.shape, rot, len(positions))
        if before is not None and positions[0] == 0 and same_vectors(after, before, rot, eps):
            return _judge_factor(after, before, rot, scaling, eps, positions, layer, name, source)
    return None


def unrotated(t: torch.Tensor, shape: tuple, rot: int, n: int) -> np.ndarray | None:
    """The un-rotated q/k as [H, T, D] like the rotated capture (or only its rotary dims, as partial-rotary
    attention hands them to the apply function), or None when it does not line up."""
    if t.ndim == 3 and t.shape[-1] % shape[-1] == 0:  # projection output [B, T, H*D]
        t = t.reshape(*t.shape[:2], -1, shape[-1])
    arr = heads(t, n)
    if arr is None or arr.shape[:-1] != shape[:-1] or arr.shape[-1] not in (shape[-1], rot):
        return None
    return arr if np.isfinite(arr).all() else None


def _rounding_bound(eps: float) -> float:
    """Relative error of one honest rotation: cos/sin from float32 angles scaled and rounded to the dtype
    (one unit each), products and sum rounded (two units): 3 units of the dtype + 2 of float32."""
    return 3 * eps + 2 * float(np.finfo(np.float32).eps)


def same_vectors(after: np.ndarray, before: np.ndarray, rot: int, eps: float) -> bool:
    """At position 0 the rotation is the identity, so the rotated vector is a multiple of the un-rotated one;
    a capture of another tensor (another layer's call, something applied between) is far from parallel."""
    a, b = after[:, 0, :rot], before[:, 0, :rot]
    c = (a * b).sum(-1, keepdims=True) / np.maximum((b * b).sum(-1, keepdims=True), 1e-300)
    off = np.linalg.norm(a - c * b, axis=-1) / np.maximum(np.linalg.norm(a, axis=-1), 1e-300)
    return bool(within_tolerance(off, _rounding_bound(eps)).all())


def _judge_factor(after: np.ndarray, before: np.ndarray, rot: int, expected: float, eps: float, positions: np.ndarray,
                  layer: int, name: str, source: str) -> Finding:
    """Scale of the rotary dims of each (head, position) vector: ||R_p u|| / ||u|| = s for a pure rotation,
    judged against s x the rounding bound of one honest rotation."""
    n_after = np.linalg.norm(after[..., :rot], axis=-1)  # [H, T]
    n_before = np.linalg.norm(before[..., :rot], axis=-1)
    live = n_before > 0
    measured = float(np.sqrt((n_after[live] ** 2).sum() / max((n_before[live] ** 2).sum(), 1e-300)))
    scale = np.where(live, n_after / np.where(live, n_before, 1.0), expected)
    tolerance = abs(expected) * _rounding_bound(eps) + 1e-30
    err = np.abs(scale - expected)
    h, t = np.unravel_index(int(np.argmax(err)), err.shape)
    return Finding("attention factor", float(err[h, t] / tolerance), error=float(err[h, t]), tolerance=tolerance,
                   layer=layer, tensor=name, head=int(h), position=int(positions[t]), expected=float(expected),
                   actual=float(scale[h, t]), extra={"measured_factor": measured, "source": source, "rotary_dims": rot})


@dataclass
class FactorSummary:
    metrics: dict[str, Any]
    rows: list[dict[str, Any]]
    warning: str = ""  # WARN reason (a deviation inside the FAIL level, or a factor != 1 never measured)
    note: str = ""
    clause: str = ""  # appended to the PASS summary


def factor_summary(factors: list[Finding], expected: list[float], dtype: str) -> FactorSummary:
    """Metrics, per-layer rows and the WARN band of the attention-factor probe (FAIL goes with the findings)."""
    rows = [{"probe": f.probe, "layer": f.layer, "tensor": f.tensor, "expected": f.expected,
             "measured": f.extra["measured_factor"], "worst_position": f.position, "worst_actual": f.actual,
             "ratio": f.ratio, "source": f.extra["source"]} for f in factors]
    trivial = all(e == 1.0 for e in expected)
    if not factors:
        text = "attention factor not measured on the applied path: no un-rotated q/k observed"
        if trivial:
            return FactorSummary({"attention_factor_probed": False}, rows, note=text + " (the config's factor is 1)")
        return FactorSummary({"attention_factor_probed": False}, rows,
                              warning=f"{text}; the factor {', '.join(f'{e:.6g}' for e in expected)} is checked on the "
                                      "rotary tables only")
    worst = max(factors, key=severity)
    metrics = {"attention_factor_probed": True, "attention_factor_expected": worst.expected,
               "attention_factor_measured": worst.extra["measured_factor"], "attention_factor_ratio": worst.ratio,
               "attention_factor_tolerance": worst.tolerance, "attention_factor_source": worst.extra["source"]}
    if worst.ratio > 1.0 and not worst.failed:
        why = f"inconclusive in {dtype} (rerun in float32)" if dtype in LOW_PRECISION else "inconclusive"
        return FactorSummary(metrics, rows, warning=f"{why}: {factor_sentence(worst)} (FAIL above {FAIL_RATIO:g}x)")
    clause = ("" if trivial else
              f"; attention factor {worst.extra['measured_factor']:.6g} (expected {worst.expected:.6g})")
    return FactorSummary(metrics, rows, clause=clause)
