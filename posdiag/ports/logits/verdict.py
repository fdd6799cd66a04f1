"""Logits compared, the verdict: the CheckResult from an engine's profiles (logits, a continued cache, a quantised
file's F32 twin), its summary in words and its tables."""

from __future__ import annotations

from typing import Any

from posdiag.ports.engines.logits_only import Engine
from posdiag.ports.profile import LayerProfile
from posdiag.results import CheckResult, Status, Table
from posdiag.verdict import FAIL_RATIO


def engine_info(engine: Engine, dtype: str) -> dict[str, Any]:
    """The candidate line of the report, in the shape ModelInfo.to_dict gives the reference."""
    settings = engine.settings
    weights = settings.get("weights") or settings.get("dtype") or engine.quantization or "dtype not reported"
    return {"id": engine.name, "family": settings.get("architecture", "engine"), "kind": "causal",
            "position_kind": "logits only", "dtype": str(weights), "device": settings.get("device", "its own device"),
            "notes": []}


def verdict(profiles: list[LayerProfile], engine: Engine, length: int, details: dict[str, Any], passes: int,
             inconclusive: str | None, tolerance: float) -> CheckResult:
    main = next(p for p in profiles if p.name == "logits")
    kv = engine.settings.get("kv_cache")
    where = f"{length} tokens" + (f", KV cache {kv}" if kv else "")
    crossed = details["boundaries_crossed"]
    if crossed:
        where += ", past " + ", ".join(f"{k} {v}" for k, v in crossed.items())
    quantised = "quantisation_floor" in details
    metrics: dict[str, Any] = {"error": main.error, "noise_floor": main.floor, "tolerance": tolerance,
                               "ratio": main.ratio, "onset_position": main.pattern.get("onset_position"),
                               "position0_error": main.per_position[0],
                               "worst_position_ratio": main.pattern["worst_position_ratio"]}
    tables = [_error_table(profiles, quantised)]
    if "quantisation_split" in details:
        tables.append(_bands_table(details["quantisation_split"]))
    failing = [p for p in profiles if p.pattern.get("pattern") != "none"]
    if not failing and inconclusive:
        status, summary = Status.WARN, f"inconclusive: {inconclusive} ({where})"
    elif not failing:
        status, summary = Status.PASS, _pass_summary(profiles, main, details, quantised) + f" ({where})"
    else:
        first = failing[0]
        shape = first.pattern
        details.update({"first_layer": first.name, "pattern": shape["pattern"], "pattern_why": shape.get("why"),
                        "onset_position": shape.get("onset_position"), "boundary": shape.get("boundary")})
        metrics["onset_position"] = shape.get("onset_position")
        lead = {"grows with position": f"error grows with position from {shape['onset_position']}",
                "step at a length": f"error starts at position {shape['onset_position']}",
                "uniform from position 0": "error uniform from position 0"}[shape["pattern"]]
        if first.name.startswith("logits, continued"):
            lead = f"continued from position {details['continued_from']}: {lead}"
        elif first is not main:
            lead = f"{first.name.removeprefix('logits, ')} (the file dequantised, position handling alone): {lead}"
        status = Status.FAIL
        if inconclusive:
            status, lead = Status.WARN, f"inconclusive: {inconclusive}; {lead}"
        summary = (f"{lead}: {shape.get('why', '')}; logits error {first.error:.3g} = {first.ratio:.3g}x noise "
                   f"floor ({where})")
        others = [p for p in profiles if p is not first]
        if others and first.name == "logits" and all(p.name.startswith("logits, continued") for p in others):
            rest = others[0].pattern.get("pattern")
            summary += (f"; continued from position {details['continued_from']}: "
                        f"{'within tolerance' if rest == 'none' else rest}")
    return CheckResult("compare", status, summary, metrics, details, tuple(tables), forward_passes=passes)


def _pass_summary(profiles: list[LayerProfile], main: LayerProfile, details: dict[str, Any], quantised: bool) -> str:
    twin = next((p for p in profiles if p.name == "logits, F32 twin"), None)
    continued = "continued_from" in details and any(p.name.startswith("logits, continued") for p in profiles)
    also = f", also continued from position {details['continued_from']}" if continued else ""
    if twin is not None:
        split = details["quantisation_split"]
        rounding = split["weights_part_median"]
        against = "" if rounding == 0 else (f" against PyTorch on the same dequantised weights (which move the "
                                            f"reference's logits by median {rounding:.2g} per position)")
        return (f"position handling at float32 rounding: the file dequantised to F32 gives logits error "
                f"{twin.error:.3g} = {twin.ratio:.3g}x noise floor (tolerance {FAIL_RATIO:g}x per position) "
                f"{_where(profiles)}{against}; the {split['kind']} file within "
                f"{FAIL_RATIO:g}x what its quantisation adds (median {split['quantisation_alone']['median']:.2g} per "
                f"position){also}" + (f"; the file's own line can show nothing beyond its twin's: "
                                      f"{split['file_too_coarse']}" if split.get("file_too_coarse") else ""))
    within = "the quantisation's own error" if quantised else "float32 rounding"
    return (f"same function within {within}: logits error {main.error:.3g} = {main.ratio:.3g}x noise "
            f"floor (tolerance {FAIL_RATIO:g}x{' per position' if quantised else ''}) {_where(profiles)}{also}")


def _where(profiles: list[LayerProfile]) -> str:
    """"at every position", or, where some positions stand over their own tolerance in profiles within the band,
    which ones (rounding at ill-conditioned positions: the band judges a profile as a whole)."""
    over = [p for p in profiles if p.pattern.get("positions_over")]
    if not over:
        return "at every position"
    return "as a whole (" + "; ".join(f"{p.name}: {p.pattern['why']}" for p in over) + ")"


def _error_table(profiles: list[LayerProfile], quantised: bool) -> Table:
    rows = tuple((p.name, f"{p.error:.3e}", f"{p.floor:.2e}", f"{p.ratio:.3g}", f"{p.per_position[0]:.2e}",
                  p.pattern.get("pattern", "") if p.pattern.get("pattern") != "none" else "") for p in profiles)
    title = "error at the logits (relative L2; position 0 shown apart" + \
        ("; tolerance per position: 10x the quantisation's own error there)" if quantised else ")")
    return Table(title, ("layer", "error", "noise floor", "ratio", "at position 0", "pattern"), rows)


def _bands_table(split: dict[str, Any]) -> Table:
    starts, length = split["band_starts"], split["length"]
    ends = [*starts[1:], length]
    names = {"twin_vs_reference": "F32 twin vs reference (position handling)",
             "file_vs_twin": f"{split['kind']} file vs F32 twin (quantisation alone)",
             "file_vs_reference": f"{split['kind']} file vs reference"}
    rows = tuple((names[k], *(f"{v:.3g}" for v in split["max_abs_dlogprob"][k])) for k in names)
    return Table("max |Δ log-prob| by position", ("pair", *(f"{s}-{e}" for s, e in zip(starts, ends, strict=True))),
                 rows)
