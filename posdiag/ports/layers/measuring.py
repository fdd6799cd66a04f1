"""Layers compared, measuring: a layer's profile, the logits statistics, and the position pattern of an error."""

from __future__ import annotations

import math
from typing import Any

import torch

from posdiag.ports.profile import UNIFORM_START_FRACTION, LayerProfile, per_position_error, rel_error
from posdiag.verdict import FAIL_RATIO, MACHINE_EPSILON, noise_floor

ABSOLUTE = ("learned", "sinusoidal")  # position kinds whose table reaches position 0


def estimated_floor(index: int, dtype: str) -> float:
    return MACHINE_EPSILON.get(dtype, 1.2e-7) * max(1, index)


def layer_profile(name: str, ri: int | None, ci: int | None, a: torch.Tensor, b: torch.Tensor, floor: float,
             floor_pos: torch.Tensor | None, dtype: str, kind: str, stack: str, absolute: bool = False) -> LayerProfile:
    """ABSOLUTE: the model adds a position table (learned or sinusoidal), which reaches position 0 too."""
    error = rel_error(a, b)
    per_pos = per_position_error(a, b)
    floor = noise_floor(floor, dtype)
    tolerance = FAIL_RATIO * floor
    ratio = error / floor
    pattern = _pattern(per_pos, tolerance, causal=(stack == "decoder" and kind != "encoder"), absolute=absolute)
    return LayerProfile(name, ri, ci, error, floor, tolerance, ratio, tuple(per_pos.tolist()), pattern)


def logits_profile(ref: torch.Tensor, cand: torch.Tensor, floor_pair: tuple[torch.Tensor, torch.Tensor] | None,
            dtype: str, kind: str, stack: str, absolute: bool = False) -> tuple[LayerProfile, dict[str, Any]]:
    ref, cand = ref.double().cpu(), cand.double().cpu()
    floor_rel = rel_error(*floor_pair) if floor_pair is not None else estimated_floor(1, dtype)
    prof = layer_profile("logits", None, None, ref, cand, floor_rel, None, dtype, kind, stack, absolute)
    log_p = torch.log_softmax(ref, dim=-1)
    log_q = torch.log_softmax(cand, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0.0)
    top2 = ref.topk(2, dim=-1).values
    agree = ref.argmax(-1) == cand.argmax(-1)
    # A top-1 flip counts only where the reference's top two are further apart than the logits'
    # own tolerance (random tiny models have near-ties that rounding alone can flip).
    margin = prof.tolerance * ref.pow(2).mean().sqrt()
    decided = (top2[:, 0] - top2[:, 1]) > margin
    stats = {
        "logits_error": prof.error,
        "top1_agreement": agree.double().mean().item(),
        "top1_agreement_decided": agree[decided].double().mean().item() if bool(decided.any()) else 1.0,
        "top1_decided_positions": int(decided.sum()),
        "kl_mean": kl.mean().item(),
        "kl_max": kl.max().item(),
        "kl_first_position": int(kl.argmax()),
    }
    if floor_pair is not None:
        fp = torch.log_softmax(floor_pair[0].double().cpu(), -1)
        fq = torch.log_softmax(floor_pair[1].double().cpu(), -1)
        stats["kl_floor"] = (fp.exp() * (fp - fq)).sum(-1).clamp_min(0.0).mean().item()
    return prof, stats


def _pattern(e: torch.Tensor, tolerance: float, causal: bool, absolute: bool = False) -> dict[str, Any]:
    """How the error depends on position (only meaningful where the layer differs)."""
    n = e.numel()
    if n < 4 or not bool(torch.isfinite(e).all()):
        return {}
    rest = e[1:]
    q = max(1, (n - 1) // 4)
    early, late = rest[:q].mean().item(), rest[-q:].mean().item()
    above = (e > tolerance).nonzero()
    onset = int(above[0]) if above.numel() else None
    level = late
    half = (e >= 0.5 * level).nonzero() if level > 0 else torch.empty(0)
    median_rest = rest.median().item()
    start = e[0].item()
    out = {
        "position0_error": start,
        "median_error_after_0": median_rest,
        "start_ratio": start / median_rest if median_rest > 0 else (0.0 if start == 0 else math.inf),
        "late_over_early": late / early if early > 0 else (math.inf if late > 0 else 1.0),
        "spearman": _spearman(rest),
        "onset_position": onset,
        "half_level_position": int(half[0]) if half.numel() else None,
    }
    if onset is None:
        out["pattern"] = "none"
    elif start <= tolerance and causal:
        out["pattern"] = "grows with position"
        out["why"] = (f"zero at position 0 (a token that sees only itself), reaching half its late level by "
                      f"position {out['half_level_position']}: the signature of a position or attention-score bug")
    elif start <= tolerance:
        out["pattern"] = "position-dependent"
        out["why"] = f"at the floor at position 0, error from position {onset} on"
    elif out["start_ratio"] >= UNIFORM_START_FRACTION and absolute:
        out["pattern"] = "position-uniform"
        out["why"] = (f"already at position 0 ({start:.2g}, {out['start_ratio']:.2g}x the median elsewhere): the "
                      "absolute position table (its row 0 reaches the first token too), weights, norms or another "
                      "per-token computation")
    elif out["start_ratio"] >= UNIFORM_START_FRACTION:
        out["pattern"] = "position-uniform"
        out["why"] = (f"already at position 0 ({start:.2g}, {out['start_ratio']:.2g}x the median elsewhere): "
                      "weights, norms or another per-token computation, not positions")
    else:
        out["pattern"] = "grows with position"
        out["why"] = f"present at position 0 but {1 / out['start_ratio']:.3g}x smaller than elsewhere"
    return out


def _spearman(values: torch.Tensor) -> float:
    n = values.numel()
    if n < 3:
        return 0.0
    ranks = values.argsort().argsort().double()
    pos = torch.arange(n, dtype=torch.float64)
    ranks, pos = ranks - ranks.mean(), pos - pos.mean()
    denom = (ranks.norm() * pos.norm()).item()
    return (ranks @ pos).item() / denom if denom > 0 else 0.0
