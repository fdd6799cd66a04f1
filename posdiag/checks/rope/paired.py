"""Probe 2 without the same-token premise, for models whose attention input differs per position (recurrent mixers
before the attention layers: Qwen3-Next, Falcon-H1, Bamba, LFM2...): the un-rotated q/k of the same call stand in for
q(0). A rotation acts pair by pair, so rotated(p) = s·R_p unrotated(p) on the rotary dims (s the attention factor,
judged apart by factor.py) and unrotated(p) elsewhere, at every position on its own; applied.judge_applied does the
arithmetic and the tolerance (float32 angles and output rounding, no input spread to allow for)."""

from __future__ import annotations

import numpy as np

from posdiag.checks.rope.capture import APPLY_SOURCE, heads
from posdiag.checks.rope.factor import same_vectors, unrotated


def lined_up(arr: np.ndarray, plain: list[tuple], name: str, rot: int, positions: np.ndarray,
             eps: float) -> tuple[np.ndarray, np.ndarray, str] | None:
    """(rotated [H, T, D], un-rotated [H, T, D], where they were seen) for q or k, or None when no un-rotated capture
    lines up with a rotated one. The apply function's own input and output belong to one call by construction;
    q_proj/k_proj outputs must first be parallel to what attention received at position 0 (the identity rotation),
    which rules out another layer's projection or anything applied in between."""
    n = len(positions)
    for q0, k0, source, q1, k1 in plain:
        rotated = q1 if name == "q" else k1
        after = arr if rotated is None else heads(rotated, n)
        if after is None or not np.isfinite(after).all():
            continue
        before = unrotated(q0 if name == "q" else k0, after.shape, rot, n)
        if before is None or before.shape != after.shape:
            continue
        if source == APPLY_SOURCE or (positions[0] == 0 and same_vectors(after, before, rot, eps)):
            where = f"{source} and outputs" if source == APPLY_SOURCE else f"{source} vs attention input"
            return after, before, where
    return None
