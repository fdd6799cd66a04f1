"""cache — KV-cache decoding must reproduce one full forward, step by step.

A causal stack computes the output at position t from tokens 0..t only, so feeding the
sequence in pieces through a KV cache must give, at every position, the logits of one
full forward: f_cached(x)[t] = f(x)[t] in exact arithmetic. We run the same tokens as
(a) a prefill then single-token decode steps, (b) a prefill then multi-token chunks
(q_len > 1 against a cache: FlashAttention-style bottom-right causal alignment), and
(c) chunked prefill from an empty cache, each with the cache `generate()` would build by
default (DynamicCache from the config: sliding layers keep only the window) and with a
pre-allocated StaticCache (its key length is max_cache_len, not the tokens seen): transformers
runs a static cache on any model that uses Cache objects, whatever the class declares, so it is
judged on every one, and a crash there is a FAIL that names the exception; a path the model asserts it does not
support (an AssertionError in its code: ProphetNet caches one decoder token at a time) is named and not judged on
posdiag's multi-token schedules; on the one-token decode (generate()'s path and a manual decode loop's) it is a FAIL.
Steps pass no position_ids (the model's defaults, as in a manual decode loop); families that take position ids
also run decode and chunks with explicit ids. The probe reaches every boundary the cache applies (a sliding window,
a chunked-attention size: _cache_plan; one it cannot reach is named in the summary, never claimed; a LongRoPE
block's original context caps it, named too), and paths that begin with the same
forwards into the same kind of cache feed them once: the later path continues a copy of the earlier one's cache
(chunks after the chunked prefill's first forwards, the explicit-ids paths after their default twin's prefill; a
prefill with explicit ids into a cache is generate()'s, judged by `generate`). Reference sliding-window
layers (every prefill token stays in reach, later tokens see a window of their own) are compared with the full
forward with the path's first forward declared the prefill, the semantics the cached run has by design.
Per step error = ||cached − full|| / ||full|| over the step's positions, in the final hidden state (which determines
the logits: no [T, vocab] output is kept); the noise floor is measured in the same run: a cache-free forward of the
longest first forward's prefix must equal the full forward at those positions (they differ only by matmul shapes),
max per position (shorter prefixes reproduced it bit for bit on every model measured: they add tokens, not
rounding); where it reproduces it bit for bit (a degenerate floor), the full forward with its embeddings jittered
by ~1 ulp measures the rounding sensitivity instead. Verdict: posdiag.verdict.judge_agreement(max step error, floor,
dtype); a path above its tolerance is re-run in float64, up to its last step over it, and decided there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from posdiag.checks import CheckSpec, Option
from posdiag.checks._cache_plan import Plan, Schedule, plan_probe, schedules
from posdiag.checks._feed import Feed, StateMissing, prefill_layers
from posdiag.checks._image_decode import decode_after_image, with_image_decode
from posdiag.checks._image_paths import with_chunked_prefill
from posdiag.errors import describe_error, raised_in_posdiag
from posdiag.model.arbitration import arbitrate
from posdiag.model.caches import (
    cache_layer_note,
    cache_refusal,
    cache_support,
    copied_cache,
    held_tensors,
    keeps_kv_cache,
    static_cache_refusal,
)
from posdiag.model.jitter import jittered
from posdiag.model.subject import Subject
from posdiag.model.tensors import per_token_change, relative_l2
from posdiag.options import RunOptions, probe_ids
from posdiag.results import CheckResult, Status, Table
from posdiag.verdict import (
    FAIL_RATIO,
    FloorVerdict,
    agreement_tolerance,
    degenerate_floor,
    judge_agreement,
    noise_floor,
    powered,
    worst_error,
)

DECODE_ROOM = 7  # tokens a decode path's static cache holds beyond the probe (generate()'s is sized for more to come)
FLOOR_SOURCE = "the cache-free forward of the longest first forward's tokens vs the full forward (max per position)"
JITTER_SOURCE = ("the full forward with its token embeddings jittered by ~1 ulp (rounding sensitivity, max per "
                 "position): the cache-free prefix reproduced the full forward bit for bit")

SPEC = CheckSpec(
    name="cache",
    title="KV-cache decoding vs full forward",
    proves="decoding through a KV cache (dynamic and static, token by token and in chunks) reproduces one full forward",
    applies_to=("causal", "seq2seq"),
    options={
        "decode_steps": Option(8, "single-token steps after the prefill, each one forward: past the sliding window of "
                                  "the tiny models, short enough for CI"),
    },
)


@dataclass
class PathResult:
    cache: str  # dynamic | static
    schedule: str  # decode | chunks | chunked_prefill
    steps: list[tuple[int, int]]  # (start, end) token ranges fed per forward
    explicit_ids: bool = False  # position_ids passed with each step (else the model's defaults)
    parent: str = ""  # the path whose first `shared` steps this one continues (a copy of its cache after them)
    shared: int = 0  # 0 where the path fed every step itself (no parent, or its cache could not be copied)
    errors: list[float] = field(default_factory=list)
    crashed: str = ""  # the exception a path transformers accepts raised
    refused: str = ""  # the model's own assertion that it does not support this path (not judged)

    @property
    def name(self) -> str:
        return f"{self.cache}/{self.schedule}" + ("+position_ids" if self.explicit_ids else "")

    @property
    def max_error(self) -> float:
        return worst_error(self.errors)

    @property
    def judged(self) -> bool:
        return not (self.crashed or self.refused)


@dataclass
class Measurement:
    """One run of every path (in the run dtype, or re-run in float64 for arbitration)."""

    floor: float  # measured, before the dtype minimum
    paths: list[PathResult]
    finite: bool = True
    prefill_declared: bool = False  # each path's reference declares its first forward the prefill (prefill_layers)
    floor_source: str = FLOOR_SOURCE
    slip_error: float | None = None  # the decode path's first step fed one position early (None: not planted)


def run(subject: Subject, options: RunOptions) -> CheckResult:
    ok, why = cache_support(subject)
    if not ok:  # an encoder decodes nothing by design; the other refusals are what posdiag cannot drive
        return SPEC.result(Status.NA if subject.kind == "encoder" else Status.SKIP, why)
    if not keeps_kv_cache(subject):
        return SPEC.result(Status.NA, f"{type(subject.model).__name__} keeps no KV cache (a forward with "
                           "use_cache=True returns none; a cache handed to it stays empty): there is no cached "
                           "decoding to compare, and generate() re-runs the whole prefix each step (see `generate`)")
    no_dynamic = cache_refusal(subject, "dynamic")
    if no_dynamic:
        return SPEC.result(Status.SKIP, f"{no_dynamic}: no cached decoding to compare (generate() builds "
                           "the same cache: see `generate`)")
    steps = int(SPEC.setting(options, "decode_steps"))
    plan = plan_probe(subject, options)
    length = plan.length
    ids = subject.sample_ids(1, length, options.seed) if options.token_ids is None else \
        probe_ids(subject, options)[:1, :length]  # the given tokens, cut where the probe stops (LongRoPE)
    explicit = subject.family.takes_position_ids and subject.kind != "seq2seq"
    dtype = subject.dtype_name
    refused = static_cache_refusal(subject)  # a static cache users cannot build: those paths are not run
    kinds = ("dynamic",) if refused else ("dynamic", "static")
    planned = schedules(length, steps, plan.boundary)
    paths = _paths(planned, explicit, kinds)

    first = _measure(subject, ids, paths, jitter=options.seed)
    if not first.finite:
        return SPEC.result(Status.FAIL, "non-finite outputs in the full forward", details={"seq_len": length})
    verdicts = {p.name: judge_agreement(p.max_error, first.floor, dtype) for p in first.paths if p.judged}
    if not verdicts and not any(p.crashed for p in first.paths):
        return SPEC.result(Status.SKIP, f"the model refuses every cache path: {first.paths[0].refused}")

    def measure(names: set[str]) -> Measurement:  # float64: only the paths that differ, up to their last bad step
        return _measure(subject, ids, _paths(planned, explicit, kinds), _steps_to_rerun(first, names, tolerance))

    tolerance = agreement_tolerance(first.floor, dtype)
    finer: list[Measurement] = []  # the float64 re-run, where one ran: it names the first step that departs
    arbitration = arbitrate(subject, measure, first.floor, verdicts, dtype, lambda m: finer.append(m) or (
        m.floor, {p.name: p.max_error for p in m.paths if p.judged}), subset=True)
    verdicts.update(arbitration.verdicts)
    verdicts, power = powered(verdicts, first.slip_error, first.floor, dtype, bool(finer), "the decode path")
    result = _report(subject, first, verdicts, arbitration, plan, dtype, refused, finer, power)
    result = with_image_decode(result, subject, options.seed,  # multimodal RoPE: a decode loop after images
                               lambda prompt: decode_after_image(subject, prompt, steps, options.seed))
    return with_chunked_prefill(result, subject, options.seed, steps)  # and its prompt fed in chunks


def _paths(planned: dict[str, Schedule], explicit: bool, kinds: tuple[str, ...]) -> list[PathResult]:
    """Every path of the run: each schedule in each kind of cache, and where the family takes position ids decode
    and chunks with explicit ids in the default cache, continuing their default twin's (or parent's) cache after
    its first forward(s) (the ids matter on the steps against a cache; a prefill with ids is generate()'s)."""
    paths = [PathResult(kind, name, list(s.steps), parent=f"{kind}/{s.parent}" if s.parent else "", shared=s.shared)
             for kind in kinds for name, s in planned.items()]
    if explicit:
        for name in ("decode", "chunks"):
            s = planned[name]
            paths.append(PathResult("dynamic", name, list(s.steps), explicit_ids=True,
                                    parent=f"dynamic/{s.parent or name}", shared=s.shared or 1))
    return paths


def _measure(subject: Subject, ids: torch.Tensor, paths: list[PathResult], only: dict[str, int] | None = None,
             jitter: int | None = None) -> Measurement:
    """The full forward, the floor from a cache-free prefix, then every cache path against the full forward.

    Each forward is reduced to the final hidden state as it comes out (it determines the logits: the head and any
    softcapping after it are position-free), so no full-vocabulary logits are kept. `only` (the float64 re-run)
    names the paths to run and how many of their steps: a path up to its last step over the tolerance, the full
    forward up to the last position those steps reach. `jitter` (the seed) re-measures a degenerate floor in the
    run dtype from the full forward with its token embeddings jittered by ~1 ulp."""
    feed, length = Feed(subject, ids), ids.shape[1]
    if only is not None:
        paths = [p for p in paths if p.name in only]
        for p in paths:
            p.steps = p.steps[:only[p.name]]
    reach = max((p.steps[-1][1] for p in paths), default=length)
    full = feed(0, reach)
    if not torch.isfinite(full).all():
        return Measurement(0.0, [], finite=False)
    floor, source = _floor(subject, feed, paths, full, jitter)
    references: dict[int, torch.Tensor] = {}  # first-forward length -> the full forward with that prefill declared
    trunks: dict[str, tuple[Any, list[float]]] = {}  # a parent -> its cache and errors after the steps shared
    for path in sorted(paths, key=lambda p: bool(p.parent)):  # parents first
        cache = feed.cache(path.cache, DECODE_ROOM if path.schedule == "decode" else 0)
        reference = _reference(feed, path, cache, full, references)
        first, trunk = 0, trunks.get(path.parent)
        continued = copied_cache(trunk[0]) if trunk is not None and len(path.steps) > path.shared else None
        if continued is not None:
            cache, first, path.errors = continued, path.shared, list(trunk[1])
        else:  # no parent, or its cache after the shared steps is not there to copy: the path feeds them itself
            path.shared = 0
        branch = max((p.shared for p in paths if p.parent == path.name), default=0)
        snapshot = _run_path(feed, path, cache, reference, first, branch)
        if snapshot is not None:
            trunks[path.name] = snapshot
    slip = _slip(feed, paths, trunks.get("dynamic/decode"), full, references)
    return Measurement(floor, paths, prefill_declared=bool(references), floor_source=source, slip_error=slip)


def _slip(feed: Feed, paths: list[PathResult], trunk: tuple[Any, list[float]] | None, full: torch.Tensor,
          references: dict[int, torch.Tensor]) -> float | None:
    """The run's power: the decode path's first step after the prefill fed with position_ids one early (a copy of its
    cache after the prefill, kept where the explicit-ids path continues it), against the same reference. None where
    the family takes no position_ids or that cache is not there."""
    path = next((p for p in paths if p.name == "dynamic/decode" and p.judged), None)
    cache = copied_cache(trunk[0]) if trunk is not None and path is not None \
        and not feed.subject.as_stored_pass else None  # the stored-dtype pass: float32 measured the power
    if cache is None:
        return None
    start = path.steps[0][1]
    reference = _reference(feed, path, cache, full, references)
    return relative_l2(feed(start, start + 1, cache, True, slip=1), reference[start:start + 1])


def _floor(subject: Subject, feed: Feed, paths: list[PathResult], full: torch.Tensor,
           jitter: int | None) -> tuple[float, str]:
    """The noise floor: the cache-free forward of the longest first forward's tokens against the full forward (the
    shorter prefixes reproduced it bit for bit on every model measured); a degenerate one re-measured jittered."""
    floor, source = 0.0, FLOOR_SOURCE
    ends = {p.steps[0][1] for p in paths} - {full.shape[0]}
    if ends:
        end = max(ends)
        floor = float(per_token_change(feed(0, end), full[:end]).max())
    if jitter is not None and degenerate_floor(floor, subject.dtype_name):
        with jittered(subject, "decoder", 0, 1, jitter, settle_masks=False) as found:
            shaken = feed(0, full.shape[0]) if found else None
        if shaken is not None:
            floor, source = float(per_token_change(shaken, full).max()), JITTER_SOURCE
    return floor, source


def _reference(feed: Feed, path: PathResult, cache: Any, full: torch.Tensor,
               references: dict[int, torch.Tensor]) -> torch.Tensor:
    """What the path is compared with: the full forward, or (reference sliding-window cache layers) the full forward
    with the path's first forward declared the prefill, computed once per prefill length."""
    if not prefill_layers(cache):
        return full
    prefill = path.steps[0][1]
    if prefill not in references:
        declared = feed.cache("dynamic")
        for layer in prefill_layers(declared):
            layer.set_prefill_length(prefill)
        references[prefill] = feed(0, full.shape[0], declared)
    return references[prefill]


def _run_path(feed: Feed, path: PathResult, cache: Any, reference: torch.Tensor, first: int = 0,
              branch: int = 0) -> tuple[Any, list[float]] | None:
    """Feed the path's steps from `first` on through its cache, each step's error against the reference taken as it
    comes out. Returns a copy of the cache after its first `branch` steps and their errors (for the paths continuing
    it), or None where it has none (no branch, a crash before it, a cache that cannot be copied)."""
    snapshot, held = None, held_tensors(feed.subject.model) if branch else {}
    try:
        for index, (start, end) in enumerate(path.steps[first:], first):
            path.errors.append(relative_l2(feed(start, end, cache, path.explicit_ids), reference[start:end]))
            if index + 1 == branch and held_tensors(feed.subject.model) == held:  # no state kept outside the cache
                copied = copied_cache(cache)
                snapshot = None if copied is None else (copied, list(path.errors))
    except StateMissing:
        raise
    except AssertionError as exc:  # a precondition the model states: a refusal of posdiag's multi-token
        if raised_in_posdiag(exc):    # schedules, but a crash of the one-token decode every user runs
            raise
        if path.schedule == "decode":
            path.crashed, path.errors = describe_error(exc), []
        else:
            path.refused, path.errors = describe_error(exc), []
    except Exception as exc:  # a path transformers accepts that crashes: users hit it
        path.crashed, path.errors = describe_error(exc), []
    return snapshot


def _steps_to_rerun(m: Measurement, names: set[str], tolerance: float) -> dict[str, int]:
    """How many steps of each named path the float64 re-run needs: up to the last one over the tolerance (later steps
    agreed in the run dtype; earlier ones build the cache it continues)."""
    steps = {}
    for p in m.paths:
        if p.name in names:
            bad = [i for i, err in enumerate(p.errors) if not (err <= tolerance)]
            steps[p.name] = bad[-1] + 1 if bad else len(p.steps)
    return steps


def _notes(subject: Subject, m: Measurement, plan: Plan, refused: str, refusals: list,
           details: dict[str, Any]) -> str:
    """The summary's tail (boundaries not reached, paths not run or not judged, the reference used, the cache note),
    each also in details."""
    tail = ""
    if plan.missed:
        details["boundaries_not_reached"] = plan.missed
        tail += "; not reached, not judged: " + ", ".join(f"{name} {why}" for name, why in plan.missed.items())
    if refused:
        details["static_not_run"] = refused
        tail += f"; static cache paths not run: {refused}"
    if refusals:
        tail += f"; not judged, the model refuses them: {', '.join(p.name for p in refusals)} ({refusals[0].refused})"
    if m.prefill_declared:
        details["reference"] = "the full forward with each path's first forward declared the prefill"
        tail += ("; reference sliding-window cache layers keep the first forward apart: each path is compared with "
                 "the full forward with that prefill declared")
    note = cache_layer_note(subject)
    if note:
        details["cache_note"] = note
        tail += f"; note: {note}"
    return tail


def _report(subject: Subject, m: Measurement, verdicts: dict[str, FloorVerdict], arbitration: Any,
            plan: Plan, dtype: str, refused: str = "", finer: list[Measurement] = (), power: str = "") -> CheckResult:
    length, floor = plan.length, noise_floor(m.floor, dtype)
    tolerance = FAIL_RATIO * floor
    judged = [p for p in m.paths if p.judged]
    refusals = [p for p in m.paths if p.refused]
    crashed = [p for p in m.paths if p.crashed]
    failing = crashed + [p for p in judged if verdicts[p.name].status is Status.FAIL]
    status = Status.worst([Status.FAIL] * bool(crashed) + [v.status for v in verdicts.values()])
    worst = failing[0] if failing else max(judged, key=lambda p: p.max_error)
    rows, details = [], {"seq_len": length, "sliding_window": subject.sliding_window, "floor_source": m.floor_source,
                         "boundaries": plan.reached, "paths": {}, **arbitration.details}
    for p in m.paths:
        if p.crashed or p.refused:
            rows.append((p.name, len(p.steps), "-", "-", "-", f"crashed: {p.crashed}" if p.crashed else
                         f"refused (not judged): {p.refused}"))
            details["paths"][p.name] = ({"crashed": p.crashed, "status": Status.FAIL} if p.crashed else
                                        {"refused": p.refused, "status": Status.SKIP})
            continue
        bad = _first_bad(p, tolerance)
        where = "-" if bad is None else _step_name(p, bad)
        rows.append((p.name, len(p.steps), f"{p.max_error:.3e}", f"{floor:.2e}", f"{p.max_error / floor:.3g}", where))
        details["paths"][p.name] = {"step_errors": p.errors, "steps": p.steps, "first_diverging_step": where,
                                    "status": verdicts[p.name].status, "reason": verdicts[p.name].reason}
        if p.shared:
            details["paths"][p.name]["continues"] = {"path": p.parent, "steps_shared": p.shared}
    table = Table("cached decoding vs full forward", ("path", "forwards", "max step error", "noise floor", "ratio",
                                                      "first diverging step"), tuple(rows))
    tail = _notes(subject, m, plan, refused, refusals, details) + (f"; {power}" if power and not failing else "")
    if m.slip_error is not None:
        details["slip"] = {"error": m.slip_error, "ratio": m.slip_error / floor, "dtype": dtype,
                           "how": "dynamic/decode's first step after the prefill, position_ids one early"}
    if worst.crashed:
        metrics = {"paths_judged": len(judged)}
        summary = f"{worst.name} crashed: {worst.crashed} (a cache transformers accepts for this model){tail}"
        return SPEC.result(Status.FAIL, summary, metrics, details, (table,))
    v = verdicts[worst.name]
    metrics = {"error": v.residual, "noise_floor": v.noise_floor, "ratio": v.ratio, "tolerance": tolerance,
               "paths_judged": len(judged), **arbitration.metrics}
    if status is Status.FAIL:
        worst_finer = next((p for f in finer for p in f.paths if p.name == worst.name), None)
        bad = _first_bad(worst, tolerance)
        if bad is None and worst_finer is not None:  # decided in float64: the first step over its tolerance there
            bad = _first_bad(worst_finer, agreement_tolerance(finer[0].floor, "float64"))
        step = _step_name(worst, bad) if bad is not None else "?"
        err = worst.errors[bad] if bad is not None and bad < len(worst.errors) else worst.max_error
        details["first_diverging"] = {"path": worst.name, "step": step, "error": err}
        size = f"by {err:.3g} = {err / floor:.3g}x the noise floor {floor:.2g}" if err > tolerance else \
            f"in float64 (within the {dtype} floor {floor:.2g} as run)"
        summary = (f"{worst.name}: {step} differs from the full forward {size}{arbitration.clause(worst.name)} "
                   f"(failing: {', '.join(p.name for p in failing)}){tail}")
    elif status is Status.WARN:
        summary = f"{worst.name}: {v.reason}{tail}"
    else:
        summary = (f"cached decoding matches the full forward: max step error {v.residual:.3g} = {v.ratio:.3g}x "
                   f"noise floor {v.noise_floor:.2g}{arbitration.clause(worst.name)} ({len(judged)} paths, "
                   f"{length} tokens){tail}")
    details["reason"] = v.reason
    return SPEC.result(status, summary, metrics, details, (table,))


def _first_bad(p: PathResult, tolerance: float) -> int | None:
    return next((i for i, err in enumerate(p.errors) if not (err <= tolerance)), None)


def _step_name(p: PathResult, index: int) -> str:
    start, end = p.steps[index]
    span = f"position {start}" if end - start == 1 else f"positions {start}-{end - 1}"
    return f"step {index} ({span})"
