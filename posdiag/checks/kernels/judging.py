"""Judging the `kernels` check: FlashAttention's rule per implementation, input and layer.

    err(impl) <= FACTOR · err(eager in the run dtype) + atol,   err = ||h − h_ref|| / ||h_ref||

over valid (non-padding) positions, against the finer-dtype eager reference. NaN/Inf at valid
positions fails; what a kernel writes at padding queries is reported as information. An input
on which eager itself is SAME_FUNCTION or more off the reference is not judged (the reference
computed something else there). Every layer over tolerance is decided by the implementation re-run in the
reference dtype, where its own rounding is gone: FlashAttention's 2x is a rule of thumb, and rounding alone
exceeds it on ill-conditioned inputs (SmolLM2-135M with rope_theta 1e4 where it was trained at 1e5: sdpa at
1.33x its tolerance in float32). Rounding falls back within the same tolerance there, a bug stays over it. Where
eager's error is a degenerate floor (0, or below one unit of the run dtype: one ulp measures no rounding), the
tolerance measures nothing, and verdict.judge_arbitrated decides (rounding shrinks, a bug stays); undecided
(WARN) if the implementation cannot run there. What the finer run calls rounding must also have been rounding as
run: a layer FAIL_RATIO times its tolerance or more in the run dtype is a bug of that dtype only. A layer over a
measured tolerance whose implementation cannot run finer stays a FAIL.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from posdiag.checks.kernels.scenarios import Run, Scenario
from posdiag.checks.kernels.spec import SPEC
from posdiag.model.subject import Subject
from posdiag.model.tensors import dtype_name
from posdiag.results import CheckResult, Status, Table
from posdiag.verdict import (
    MACHINE_EPSILON,
    FloorVerdict,
    beyond_rounding_as_run,
    degenerate_floor,
    judge_arbitrated,
)

FACTOR = 2.0  # FlashAttention's rule: at most 2x the error of plain attention in the same dtype
# Rounding keeps a forward pass in any inference dtype far closer than this to a more precise run of
# the same function (bf16's unit roundoff is 0.4%): eager farther from the reference means the
# reference computed something else there (measured: Zamba2's recurrence carries the float64 run's
# zeroed padding rows into valid tokens, 1.1-1.4 off), and that input is not judged.
SAME_FUNCTION = 0.1


@dataclass
class Evidence:
    """Everything the verdict is built from."""

    subject: Subject
    scenarios: list[Scenario]
    eager: list[Run]  # eager in the run dtype: the baseline
    reference: list[Run]  # eager in ref_dtype
    ref_dtype: torch.dtype
    built: str  # how the reference was converted
    runs: dict[str, list[Run] | str]  # every implementation (eager first): its runs, or why it did not run
    notes: dict[str, str]  # implementation -> note ("crash": it crashed on these inputs)
    skipped: dict[str, str]  # implementations not run by default, and why
    # implementation -> its runs in ref_dtype (None: it cannot run there), for layers whose floor is degenerate
    finer: dict[str, list[Run | None] | None] = field(default_factory=dict)
    # implementation -> {input: why it does not apply}: a pinned SDPA backend that refuses an input (its run is None)
    not_applicable: dict[str, dict[str, str]] = field(default_factory=dict)


@dataclass
class _Rows:
    summary: list[tuple] = field(default_factory=list)
    layers: list[tuple] = field(default_factory=list)

    def tables(self) -> tuple[Table, Table]:
        return (Table("error vs reference (worst layer per input)",
                      ("implementation", "input", "error", "eager error", "ratio", "worst layer", "top-1 / KL",
                       "verdict", "where"), tuple(self.summary)),
                Table("per-layer error", ("implementation", "input", "layer", "error", "eager error", "tolerance", ""),
                      tuple(self.layers)))


def judge(ev: Evidence) -> CheckResult:
    """The check's result from the evidence."""
    dname, ref_name = ev.subject.dtype_name, dtype_name(ev.ref_dtype)
    untrusted = untrusted_inputs(ev)
    if len(untrusted) == len(ev.scenarios):
        return SPEC.result(Status.SKIP,
                           "the higher-precision reference is not the same function as eager here "
                           f"(eager is {max(untrusted.values()):.3g} off it): nothing to judge against",
                           {"reference_dtype": ref_name}, {"untrusted_inputs": untrusted})
    atol = MACHINE_EPSILON.get(dname, 1.2e-7) / 2  # unit roundoff of the run dtype (relative)
    rows = _Rows()
    results: dict[str, dict[str, Any]] = {}
    statuses = []
    for name, got in ev.runs.items():
        results[name], status = _judge_implementation(ev, name, got, untrusted, atol, rows)
        statuses.append(status)
    compared = [n for n in ev.runs if n != "eager" and results[n].get("scenarios")]
    status = Status.worst(statuses)
    metrics, decided = _deciding_metrics(results, compared, ref_name, atol)
    floor_note = f"reference eager in {ref_name} (converted {ev.built})"
    details = {"implementations": results, "scenarios": [s.name for s in ev.scenarios], "reference": floor_note,
               "not_run": ev.skipped,
               "rule": f"error <= {FACTOR:g} x eager {dname} error + {atol:.1e} (relative L2, valid positions)"}
    if not compared:
        reasons = "; ".join(f"{n}: {r}" for n, r in ev.runs.items() if isinstance(r, str))
        if status is Status.FAIL:
            summary = f"an attention implementation crashed: {reasons}"
        else:
            status = Status.SKIP
            summary = f"nothing to compare with eager here ({reasons})"
        return SPEC.result(status, summary, metrics, details, rows.tables())
    summary = _summary(ev, results, compared, decided)
    if untrusted:
        details["untrusted_inputs"] = untrusted
        summary += (f"; not judged: {', '.join(untrusted)} (eager is {max(untrusted.values()):.3g} off the "
                    f"{ref_name} reference there: not the same function)")
        if status is Status.PASS:
            status = Status.WARN  # part of the inputs could not be judged: inconclusive, not a pass
    return SPEC.result(status, summary, metrics, details, rows.tables())


def untrusted_inputs(ev: Evidence) -> dict[str, float]:
    """{input: eager's error} where eager is SAME_FUNCTION or more off the reference."""
    untrusted: dict[str, float] = {}
    for si, sc in enumerate(ev.scenarios):
        eager, last = ev.eager[si], len(ev.eager[si].hidden) - 1
        off = rel(eager.hidden[last], ev.reference[si].hidden[last], valid_for(eager, sc, last))
        if not off < SAME_FUNCTION:
            untrusted[sc.name] = off
    return untrusted


def _judge_implementation(ev: Evidence, name: str, got: list[Run] | str, untrusted: dict[str, float],
                          atol: float, rows: _Rows) -> tuple[dict[str, Any], Status]:
    if isinstance(got, str):
        crashed = ev.notes.get(name) == "crash"
        rows.summary.append((name, "all", "-", "-", "-", "-", "-", "CRASH" if crashed else "SKIP", got[:80]))
        return {"status": "fail" if crashed else "skip", "reason": got}, Status.FAIL if crashed else Status.SKIP
    result: dict[str, Any] = {"status": "pass", "scenarios": {}}
    status = Status.PASS
    refused = ev.not_applicable.get(name, {})
    for si, sc in enumerate(ev.scenarios):
        if sc.name in untrusted:
            continue
        if got[si] is None:  # a pinned backend that cannot run this input: listed, never a pass
            why = refused.get(sc.name, "no kernel for this input")
            result.setdefault("not_applicable", {})[sc.name] = why
            rows.summary.append((name, sc.name, "-", "-", "-", "-", "-", "n/a", why[:80]))
            continue
        result["scenarios"][sc.name], sc_status = _judge_input(ev, name, si, got[si], atol, rows)
        status = Status.worst([status, sc_status])
    if not result["scenarios"]:
        result["status"] = "n/a"
        return result, Status.NA
    result["status"] = status.value
    if name in ev.notes:
        result["note"] = ev.notes[name]
    return result, status


def _judge_input(ev: Evidence, name: str, si: int, g: Run, atol: float, rows: _Rows) -> tuple[dict[str, Any], Status]:
    sc, r, e = ev.scenarios[si], ev.reference[si], ev.eager[si]
    where_bad = first_non_finite(g, sc)
    errs = [rel(g.hidden[i], r.hidden[i], valid_for(g, sc, i)) for i in range(len(g.hidden))]
    base = [rel(e.hidden[i], r.hidden[i], valid_for(g, sc, i)) for i in range(len(g.hidden))]
    tols = [FACTOR * b + atol for b in base]
    ratios = [x / t for x, t in zip(errs, tols, strict=True)]
    worst = max(range(len(errs)), key=lambda i: ratios[i])
    over = [i for i in range(len(errs)) if errs[i] > tols[i]]
    decided = {} if where_bad else _arbitrate(ev, name, si, over, errs, base, tols)
    standing = [i for i in over if not (decided.get(i) and decided[i].status is Status.PASS)]
    crossing = next((g.layer_names[i] for i in standing), None)
    failing = [i for i in standing if i not in decided or decided[i] is not None]
    nt = next_token(r.logits, g.logits) if ev.subject.kind != "encoder" else None
    status = Status.FAIL if (where_bad or failing) else Status.WARN if standing else Status.PASS
    entry = {
        "error": errs[worst], "eager_error": base[worst], "tolerance": tols[worst], "ratio": ratios[worst],
        "worst_layer": g.layer_names[worst], "first_layer_over_tolerance": crossing,
        "final_error": errs[-1], "final_eager_error": base[-1],
        "non_finite_at": where_bad, "padding_rows": padding_content(g, sc),
        "top1_agreement": None if nt is None else nt[0], "kl": None if nt is None else nt[1],
        "status": status.value,
        "arbitrate": not where_bad and any(i not in decided for i in over),
        "arbitrated": {g.layer_names[i]: (v.reason if v else f"undecided: {name} does not run in "
                                          f"{dtype_name(ev.ref_dtype)}") for i, v in decided.items()},
    }
    verdict = {Status.FAIL: "FAIL", Status.WARN: "undecided"}.get(status, "ok")
    why = f"NaN/Inf at {where_bad}" if where_bad else (f"over tolerance from {crossing}" if crossing else "")
    rows.summary.append((name, sc.name, f"{errs[worst]:.2e}", f"{base[worst]:.2e}", f"{ratios[worst]:.3g}",
                         g.layer_names[worst], "-" if nt is None else f"{nt[0]:.0%} / {nt[1]:.1e}",
                         verdict, why or entry["padding_rows"]))
    if name != "eager":
        for i in range(len(errs)):
            rows.layers.append((name, sc.name, g.layer_names[i], f"{errs[i]:.2e}", f"{base[i]:.2e}",
                                f"{tols[i]:.2e}", "over" if errs[i] > tols[i] else ""))
    return entry, status


def _arbitrate(ev: Evidence, name: str, si: int, over: list[int], errs: list[float], base: list[float],
               tols: list[float]) -> dict[int, FloorVerdict | None]:
    """{layer: verdict} for layers over tolerance, decided with `name` re-run in the reference dtype (empty until
    ev.finer has it). Against a measured tolerance: rounding where the finer run is back within it, a bug where it
    stays over; an implementation that cannot run finer leaves the run-dtype FAIL standing. Against a degenerate
    floor (eager within one unit of the run dtype: the tolerance measures no rounding): judge_arbitrated, and None
    (undecided) where it cannot run finer. Either way, what the finer run calls rounding is read again as run
    (as_run): far past the tolerance in the run dtype, it is a bug of that dtype only."""
    dname, finer, ref_name = ev.subject.dtype_name, ev.finer, dtype_name(ev.ref_dtype)
    if name not in finer:
        return {}
    g, sc, r = finer[name], ev.scenarios[si], ev.reference[si]
    decided: dict[int, FloorVerdict | None] = {}
    for i in over:
        ran = g is not None and g[si] is not None
        error64 = rel(g[si].hidden[i], r.hidden[i], valid_for(g[si], sc, i)) if ran else None
        if error64 is None:
            if degenerate_floor(base[i], dname):
                decided[i] = None
            continue
        finer_verdict = (judge_arbitrated(errs[i], base[i], dname, error64, 0.0, ref_name)
                         if degenerate_floor(base[i], dname) else within_finer(errs[i], error64, tols[i], dname,
                                                                               ref_name))
        decided[i] = as_run(finer_verdict, errs[i], error64, tols[i], dname, ref_name)
    return decided


def within_finer(error: float, error64: float, tolerance: float, dtype: str, finer: str) -> FloorVerdict:
    """The implementation re-run in `finer` against the same tolerance: its own rounding is gone there (the
    reference keeps what eager rounds in float32 inside, its softmax), so rounding falls back within it; a bug
    does not shrink."""
    both = f"{error:.3g} in {dtype}, {error64:.3g} in {finer}, tolerance {tolerance:.3g}"
    if error64 <= tolerance:
        return FloorVerdict(Status.PASS, error, tolerance / FACTOR, error / tolerance,
                            f"{both}: rounding (within the tolerance once the implementation runs in {finer})")
    return FloorVerdict(Status.FAIL, error, tolerance / FACTOR, error / tolerance,
                        f"{both}: a bug (it stays over the tolerance in {finer})")


def as_run(decided: FloorVerdict, error: float, error64: float, tolerance: float, dtype: str,
           finer: str) -> FloorVerdict:
    """A layer the finer re-run calls rounding, read again as the run dtype runs it: rounding stays within the
    agreement band of the tolerance as run (healthy implementations at most 1.26x on SmolLM2 and Gemma 3 in
    float32 and bfloat16, benchmarks/constants.py; 32 units of float32 noise 8.5x), while a defect that exists
    only in the run dtype (a half-precision path that drops the padding mask) goes far past it there and vanishes
    finer, where alone it would read as rounding."""
    ratio = error / tolerance
    if decided.status is not Status.PASS or not beyond_rounding_as_run(error, tolerance / FACTOR):
        return decided
    return FloorVerdict(Status.FAIL, error, decided.noise_floor, decided.ratio,
                        f"{error:.3g} in {dtype}, {error64:.3g} in {finer}: a bug in {dtype} only ({ratio:.3g}x "
                        f"the tolerance as run, beyond what rounding reaches; gone in {finer})")


def needs_arbitration(result: CheckResult) -> list[str]:
    """Implementations with a finite layer over tolerance, not yet decided in the reference dtype."""
    return [n for n, res in result.details.get("implementations", {}).items()
            if any(s.get("arbitrate") for s in res.get("scenarios", {}).values())]


def _deciding_metrics(results: dict[str, dict[str, Any]], compared: list[str], ref_name: str,
                      atol: float) -> tuple[dict[str, Any], tuple | None]:
    """The metrics, led by the deciding numbers: those of the (implementation, input) the verdict names."""
    metrics: dict[str, Any] = {"reference_dtype": ref_name, "factor": FACTOR, "atol": atol}
    decided = deciding(results, compared or ["eager"])
    if decided:
        name, sc_name, s = decided
        metrics.update({"implementation": name, "scenario": sc_name, "error": s["error"],
                        "eager_error": s["eager_error"],
                        "tolerance": s["tolerance"], "ratio": s["ratio"], "worst_layer": s["worst_layer"]})
    for name in compared:
        metrics[f"{name}_ratio"] = max(s["ratio"] for s in results[name]["scenarios"].values())
    return metrics, decided


def deciding(results: dict[str, dict[str, Any]], names: list[str]) -> tuple | None:
    """(implementation, input, entry) a verdict names: a NaN/Inf first, else the first input to fail in the order run
    (implementations as listed; unpadded, left-padded, decode, ...), else the largest ratio. Not the largest failing
    ratio: that is a bug's error over eager's rounding, so between two failing inputs it is rounding that orders them
    (Qwen2 without its padding mask: decode 2.663e6x, decode left-padded 2.667e6x; under AVX2 the other way)."""
    rows = [(n, sn, s) for n in names for sn, s in results[n].get("scenarios", {}).items()]
    failed = [r for r in rows if r[2]["status"] == "fail"]
    if failed:
        return next((r for r in failed if r[2]["non_finite_at"]), failed[0])
    return max(rows, key=lambda r: r[2]["ratio"], default=None)


def _summary(ev: Evidence, results: dict[str, dict[str, Any]], compared: list[str], decided: tuple) -> str:
    dname = ev.subject.dtype_name
    failed = [(n, sn, s) for n in compared + ["eager"] for sn, s in results[n].get("scenarios", {}).items()
              if s["status"] == "fail"]
    undecided = [(n, sn, s) for n in compared for sn, s in results[n].get("scenarios", {}).items()
                 if s["status"] == "warn"]
    crashed = [n for n in ev.runs if isinstance(ev.runs[n], str) and ev.notes.get(n) == "crash"]
    if failed:
        n, sn, s = deciding(results, compared + ["eager"])
        if s["non_finite_at"]:
            return f"{n} gives NaN/Inf at valid positions on the {sn} input ({s['non_finite_at']})"
        decided = s["arbitrated"].get(s["first_layer_over_tolerance"])
        return (f"{n} differs from eager on the {sn} input: error {s['error']:.3g} vs eager's {s['eager_error']:.3g} "
                f"in {dname} = {s['ratio']:.3g}x the tolerance {s['tolerance']:.2g}, from "
                f"{s['first_layer_over_tolerance']} "
                f"(worst {s['worst_layer']})" + (f"; there {decided}" if decided else ""))
    if crashed:
        return f"{', '.join(crashed)} crashed: " + "; ".join(str(ev.runs[n]) for n in crashed)
    if undecided:
        n, sn, s = undecided[0]
        return (f"undecided: {n} is {s['error']:.3g} off the reference on the {sn} input from "
                f"{s['first_layer_over_tolerance']}, where eager's error {s['eager_error']:.3g} is below one unit of "
                f"{dname} (no measure of rounding), and {n} does not run in {dtype_name(ev.ref_dtype)} to decide it")
    name, sc_name, s = decided
    refused = [n for n in ev.runs if isinstance(ev.runs[n], str)]
    summary = (f"{', '.join(compared)} agree with eager: worst error {s['error']:.3g} vs eager's "
               f"{s['eager_error']:.3g} "
               f"in {dname} ({s['ratio']:.2g}x the tolerance, {name}, {sc_name}, {s['worst_layer']})")
    rounding = [(n, sn, layer, why) for n in compared for sn, x in results[n].get("scenarios", {}).items()
                for layer, why in x.get("arbitrated", {}).items()]
    if rounding:
        n, sn, layer, why = rounding[0]
        more = f" and {len(rounding) - 1} more" if len(rounding) > 1 else ""
        summary += f"; over the tolerance and decided in {dtype_name(ev.ref_dtype)}: {n}, {sn}, {layer}{more} ({why})"
    if refused:  # asked for and not run: the check as asked is not complete (skip, never pass)
        summary = "not compared: " + "; ".join(f"{n} ({ev.runs[n]})" for n in refused) + ". " + summary
    return summary + not_applicable_note(results)


def not_applicable_note(results: dict[str, dict[str, Any]]) -> str:
    """"; not applicable: sdpa[flash] on left-padded (why)" for the inputs a pinned SDPA backend refused."""
    parts = [f"{n} on {', '.join(na)} ({next(iter(na.values()))[:100]})"
             for n, res in results.items() if (na := res.get("not_applicable"))]
    return f"; not applicable: {'; '.join(parts)}" if parts else ""


# ------------------------------------------------------------------------------ measures
def rel(a: torch.Tensor, ref: torch.Tensor, valid: torch.Tensor) -> float:
    """||a − ref|| / ||ref|| over the valid positions, in float64."""
    a, r = a.double()[valid], ref.double()[valid]
    denom = r.norm().item()
    num = (a - r).norm().item()
    return num / denom if denom else (0.0 if num == 0 else float("inf"))


def valid_for(run: Run, sc: Scenario, layer: int) -> torch.Tensor:
    """The positions of `layer` that are compared (a decoder's positions are all valid)."""
    name = run.layer_names[layer]
    if name.startswith("decoder"):
        return torch.ones(run.hidden[layer].shape[:2], dtype=torch.bool, device=run.hidden[layer].device)
    return sc.valid.to(run.hidden[layer].device)


def padding_content(run: Run, sc: Scenario) -> str:
    """What the implementation wrote at padding queries: "", "NaN/Inf", "zeros" or "finite"."""
    if bool(sc.valid.all()):
        return ""
    h = run.hidden[-1 if not run.layer_names[-1].startswith("decoder") else 0]
    pad = h[~sc.valid.to(h.device)]
    if not bool(torch.isfinite(pad).all()):
        return "NaN/Inf"
    return "zeros" if bool((pad == 0).all()) else "finite"


def first_non_finite(run: Run, sc: Scenario) -> str | None:
    """Where the first NaN/Inf at a valid position is (layer, row, position), or None."""
    for layer, h in enumerate(run.hidden):
        valid = valid_for(run, sc, layer)
        bad = ~torch.isfinite(h[valid]).all(-1)
        if bool(bad.any()):
            rows, cols = torch.nonzero(valid, as_tuple=True)
            i = int(torch.nonzero(bad)[0])
            return f"{run.layer_names[layer]}, row {int(rows[i])}, position {int(cols[i])}"
    return None


def next_token(ref: torch.Tensor | None, got: torch.Tensor | None) -> tuple[float, float] | None:
    """(top-1 agreement, mean KL(ref || got)) of the last position's logits, or None."""
    if ref is None or got is None or not bool(torch.isfinite(got).all()):
        return None
    agree = (ref.argmax(-1) == got.argmax(-1)).double().mean().item()
    logp, logq = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kl = (logp.exp() * (logp - logq)).sum(-1).mean().item()
    return agree, max(kl, 0.0)
