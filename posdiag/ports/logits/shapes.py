"""The shape of an engine's per-position error, which names the cause.

judge_profile decides whether a logits profile differs at all: only when its error as a whole stands above the
band, the root mean square of its per-position errors over that of its floors (profile_ratio) above FAIL_RATIO, or
a position was not computed (NaN). A shape describes that ratio, never creates a FAIL below it: positions over their
own tolerance inside a profile within the band are rounding at ill-conditioned positions (the healthy SmolLM2 Q4_1
file's F32 twin gave 1.7e-5 at position 1 against ~7e-7 elsewhere, a profile 1.82x its floor, and FAILed "grows
with position from 1"). The shapes (classify):

- grows with position: zero at position 0 (a token that sees only itself cannot feel a relative
  position encoding) and there from the first token that sees another: RoPE base, rotary pairing
  layout, scaling. Above the tolerance from position 1; or later, when the floor is coarse (a
  quantised port) and the positions before the onset already stand well above it (on average at
  least GROWS_FRACTION of the tolerance, where a healthy floor sits near 1/FAIL_RATIO of it).
- starts at a length N > 1: at the floor up to N, then wrong: a window, context or scaling boundary;
  N is matched against the boundaries both sides declare (sliding_window, original context, context,
  the split of a prefill + continuation).
- uniform from position 0: already wrong for a token that sees only itself: weights, norm,
  activation, embedding scale.
"""

from __future__ import annotations

from typing import Any

import torch

from posdiag.ports.profile import UNIFORM_START_FRACTION
from posdiag.verdict import FAIL_RATIO, within_band

BOUNDARY_SLACK = 2
"""An onset within this many positions after a declared boundary is that boundary."""

GROWS_FRACTION = 1 / 3
"""Positions before an unnamed onset averaging at least this share of their tolerance (3.3x the floor at
a 10x tolerance) are the rise of a growing error, not a floor: a healthy Q8_0 or Q4_0 conversion
rounded independently of posdiag's stays within 0.56-3.0x posdiag's per position (median 1.35x),
measured on the tiny Llama."""


def classify(e: torch.Tensor, tolerance: float | torch.Tensor, boundaries: dict[str, int]) -> dict[str, Any]:
    """The shape of a per-position error profile (NaN = a position the engine did not cover);
    TOLERANCE one number or one per position."""
    n = e.numel()
    tol = torch.as_tensor(tolerance, dtype=torch.float64).expand(n)
    finite = torch.isfinite(e)
    above = ~finite | (e > tol)
    if not bool(above.any()):
        return {"pattern": "none"}
    onset = int(above.nonzero()[0])
    covered = int(finite.sum())
    start = float(e[0])
    rest = e[1:covered]
    median = float(rest.median()) if rest.numel() else 0.0
    out: dict[str, Any] = {"onset_position": onset, "position0_error": start, "median_error_after_0": median,
                           "start_ratio": start / median if median > 0 else 0.0, "boundary": None}
    named = [k for k, v in boundaries.items() if v <= onset <= v + BOUNDARY_SLACK]
    if named:
        out["boundary"] = ", ".join(f"{k} {boundaries[k]}" for k in named)
    if onset >= covered:
        out["pattern"] = "step at a length"
        out["why"] = (f"within tolerance up to position {covered - 1}, where the engine's context ends; positions "
                      f"{covered}-{n - 1} not covered: a context boundary")
        return out
    late = rest[-max(1, rest.numel() // 4):].mean().item() if rest.numel() else 0.0
    out["late_error"] = late
    rising = onset > 1 and not named and float((e[1:onset] / tol[1:onset]).mean()) >= GROWS_FRACTION
    if onset == 0 and out["start_ratio"] >= UNIFORM_START_FRACTION:
        out["pattern"] = "uniform from position 0"
        out["why"] = (f"already {start:.2g} at position 0 (a token that sees only itself), {out['start_ratio']:.2g}x "
                      "the median elsewhere: weights, norm, activation or embedding, not positions")
    elif onset <= 1 or rising:
        out["pattern"] = "grows with position"
        first = float(e[1]) if n > 1 else start
        out["why"] = (f"{start:.2g} at position 0, {first:.2g} at position 1, {late:.2g} late: the error comes with "
                      "relative position (RoPE base, rotary pairing layout, scaling)")
    else:
        out["pattern"] = "step at a length"
        where = f" = {out['boundary']}" if out["boundary"] else " (no declared boundary there)"
        cause = "a window, context or scaling boundary"
        if "continuation" in named:
            cause = "the continued cache (positions restarted, or the prefill's cache lost)"
        out["why"] = (f"at the floor up to position {onset - 1}, then {float(e[onset]):.2g} at {onset}{where}, "
                      f"{late:.2g} late: {cause}")
    return out


def judge_profile(e: torch.Tensor, tolerance: float | torch.Tensor, boundaries: dict[str, int]) -> dict[str, Any]:
    """classify(), for a profile whose error as a whole clears the band (or has a position not computed); "none"
    for one within it, with the positions over their own tolerance, if any, said to be rounding. The profile's
    ratio ("profile_ratio") is in both."""
    n = e.numel()
    tol = torch.as_tensor(tolerance, dtype=torch.float64).expand(n)
    ratio = profile_ratio(e, tol)
    finite = torch.isfinite(e)
    if not (bool(finite.all()) and within_band(ratio)):
        return {**classify(e, tol, boundaries), "profile_ratio": ratio}
    over = int((e > tol).sum())
    if not over:
        return {"pattern": "none", "profile_ratio": ratio}
    worst = int((e / tol).argmax())
    return {"pattern": "none", "profile_ratio": ratio, "positions_over": over, "worst_position": worst,
            "why": (f"{over} of {n} positions over their own tolerance, worst "
                    f"{FAIL_RATIO * float(e[worst] / tol[worst]):.3g}x its floor at position {worst}, the profile "
                    f"{ratio:.3g}x its floor: rounding at ill-conditioned positions")}


def profile_ratio(e: torch.Tensor, tolerance: torch.Tensor) -> float:
    """The profile's error over its floor as a whole: the root mean square of the errors over that of the floors
    (tolerance / FAIL_RATIO), on the positions computed; NaN when none is finite. One scalar floor gives the mean
    error's ratio; per-position floors (a quantised file's) weigh each position by its own."""
    finite = torch.isfinite(e)
    if not bool(finite.any()):
        return float("nan")
    floors = tolerance[finite] / FAIL_RATIO
    denominator = float(floors.square().mean().sqrt())
    numerator = float(e[finite].square().mean().sqrt())
    return numerator / denominator if denominator > 0 else (0.0 if numerator == 0 else float("inf"))
