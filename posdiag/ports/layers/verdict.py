"""compare, verdict: the CheckResult from the layer profiles, and the bucketed profile the reports draw."""

from __future__ import annotations

import math
from typing import Any

from posdiag.model.checkpoint_diff import checkpoint_diff
from posdiag.model.subject import Subject
from posdiag.ports.profile import Comparison, LayerProfile, bucketed
from posdiag.results import CheckResult, Status, Table
from posdiag.verdict import FAIL_RATIO, LOW_PRECISION, PASS_RATIO


def finish(profiles: list[LayerProfile], logits_stats: dict[str, Any], length: int, info: dict[str, Any],
            dtype: str, floor_sources: set[str], notes: list[str], reference: Subject, candidate: Subject,
            passes: int) -> Comparison:
    details: dict[str, Any] = {**info, "seq_len": length, "compared_dtype": dtype,
                               "reference": reference.info.to_dict(), "candidate": candidate.info.to_dict(),
                               "floor_source": "; ".join(sorted(floor_sources)), "notes": notes}
    if not profiles:
        result = CheckResult("compare", Status.SKIP, "no layer could be compared: " + "; ".join(notes), details=details)
        return Comparison(result, (), length)
    # Ties (e.g. every ratio 0 for identical copies) name the last layer: the output.
    worst = max(reversed(profiles), key=lambda p: p.ratio if p.ratio == p.ratio else math.inf)
    first = next((p for p in profiles if p.differs), None)
    final_hidden = [p for p in profiles if p.name != "logits"]
    final = final_hidden[-1] if final_hidden else worst
    metrics: dict[str, Any] = {"error": final.error, "noise_floor": final.floor, "tolerance": final.tolerance,
                               "ratio": worst.ratio, "max_ratio_layer": worst.name, **logits_stats}
    where = f"{length} tokens" + (f", past the original context of {info['original_context']}" if info["long"] else "")
    rows = []
    for p in profiles:
        pat = p.pattern.get("pattern", "") if p.differs else ""
        rows.append((p.name, f"{p.error:.3e}", f"{p.floor:.2e}", f"{p.ratio:.3g}",
                     f"{p.per_position[0]:.2e}" if p.per_position else "", pat))
    table = Table("error by layer (relative L2; position 0 shown apart)",
                  ("layer", "error", "noise floor", "ratio", "at position 0", "pattern"), tuple(rows))
    details["layers"] = [{"name": p.name, "ref_index": p.ref_index, "cand_index": p.cand_index, "error": p.error,
                          "noise_floor": p.floor, "ratio": p.ratio, **p.pattern} for p in profiles]
    details["profile"] = bucketed(profiles, length)
    logit_txt = ""
    if logits_stats:
        logit_txt = (f"; logits: top-1 agree {100 * logits_stats['top1_agreement']:.1f}%, "
                     f"mean KL {logits_stats['kl_mean']:.2g}")
    if first is None:
        status = Status.PASS
        summary = (f"same model within rounding: worst error {worst.error:.3g} = {worst.ratio:.3g}x noise floor "
                   f"at {worst.name} (tolerance {FAIL_RATIO:g}x){logit_txt} ({where})")
    else:
        pattern = first.pattern
        details.update({"first_layer": first.name, "pattern": pattern.get("pattern"), "pattern_why": pattern.get("why"),
                        "onset_position": pattern.get("onset_position")})
        metrics.update({"first_layer": first.name, "first_layer_error": first.error, "first_layer_ratio": first.ratio,
                        "position0_error": pattern.get("position0_error"), "start_ratio": pattern.get("start_ratio"),
                        "late_over_early": pattern.get("late_over_early"), "spearman": pattern.get("spearman")})
        low = dtype in LOW_PRECISION and worst.ratio <= PASS_RATIO and worst.ratio == worst.ratio
        status = Status.WARN if low else Status.FAIL
        lead = (f"inconclusive in {dtype}: within {PASS_RATIO:g}x of rounding; compare in float32" if low
                else "differs")
        weights = _weights_clause(reference, candidate, details, notes)
        summary = (f"{lead} from {first.name} on (error {first.error:.3g} = {first.ratio:.3g}x noise floor); "
                   f"{weights}{pattern.get('pattern', 'pattern unknown')}: {pattern.get('why', '')}{logit_txt} "
                   f"({where})")
    if notes:
        details["notes"] = notes
    result = CheckResult("compare", status, summary, metrics, details, (table,), forward_passes=passes)
    return Comparison(result, tuple(profiles), length)


def _weights_clause(reference: Subject, candidate: Subject, details: dict[str, Any], notes: list[str]) -> str:
    """What the stored tensors say, ahead of the error's shape ("" where either side has no safetensors): read only
    on a difference, so a passing comparison never reads both checkpoints again."""
    try:
        diff = checkpoint_diff(reference, candidate)
    except Exception as exc:  # an unreadable file was already refused at load; this is only the diagnosis
        notes.append(f"the checkpoints' tensors could not be compared ({type(exc).__name__}: {str(exc)[:120]})")
        return ""
    if diff is None:
        return ""
    details["weights"] = diff.to_dict()
    return diff.sentence() + "; "


def early_result(status: Status, summary: str, length: int, info: dict[str, Any], reference: Subject,
           candidate: Subject, passes_before: int) -> Comparison:
    passes = reference.forward_count + (candidate.forward_count if candidate is not reference else 0) - passes_before
    details = {**info, "seq_len": length, "reference": reference.info.to_dict(), "candidate": candidate.info.to_dict()}
    return Comparison(CheckResult("compare", status, summary, details=details, forward_passes=passes), (), length)


