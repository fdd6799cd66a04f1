"""The shape of an engine's per-position error, which names the cause.

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

from posdiag.tools.compare.measuring import UNIFORM_START_FRACTION

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
