"""serving — the paths a serving stack takes must compute what one full forward computes, position by position.

Servers and hand-written inference loops rarely run one request through one forward: they feed the prompt in chunks,
reuse a cached prefix, batch a request with others of other lengths, verify speculative drafts, and keep decoding
from a cache with or without position_ids. Each is the same function as the full forward in exact arithmetic
(causality: f(x)[t] depends on tokens 0..t only, and on nothing else in the batch), and each is where the bugs of
2025-26 were (a prefix-cache hit one slot off, chunks numbered from 0, positions that depend on the batch, drafts
numbered wrongly, a position offset kept from another batch). Paths (serving/paths.py), each against one full
forward of the tokens it fed, positions passed as the path passed them:
  chunks of K                      the prompt fed K tokens a forward into one cache (several K)
  generate prefill_chunk_size=K    transformers' own chunked prefill, judged on every generated step
  shared prefix                    a prefix computed once, its cache copied and continued by two suffixes
  padded batch                     the request as row 1 of a left-padded batch of other lengths (position_ids
                                   from the mask), prefill and decode steps, against the request alone
  decode loop after another prompt / after a padded batch   the loop users write (forward with the cache, with and
                                   without position_ids) after the same loop on another request
  assisted decoding, prompt lookup generate() verifying drafts (a draft that disagrees, so drafts are rejected and
                                   the cache rolled back: counted, a path with no rollback is not confirmed; n-grams
                                   of the prompt)
error_t = ||path_t − full_t|| / ||full_t|| over the logits; the noise floor is measured in the same run (the full
forward with its token embeddings jittered by ~1 ulp, max per position); a path over its tolerance is re-run in float64
and decided there (bfloat16 weights are decided held in float32: half_precision). A FAIL names the path and the
first position (or step) that departs. Each path's power is measured in the same run: the path again with every forward
that continues a cache numbered one position early (posdiag.model.slip), against the same reference and floor; a PASS
whose slip the band would pass in the dtype that decided is inconclusive (verdict.powered). A path the model cannot take
(no cache, transformers refuses the option, a cache that cannot be copied) is named as not run.
`cache` judges one prompt decoded through dynamic and static caches; `generate` greedy generate() of a prompt and a
padded batch; `state` a call after a history against the same call on a fresh state (one request or an unpadded
batch decoded after `model(**tokenizer(batch, padding=True))`, where a kept padding offset shows): `serving` owns the
other paths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posdiag.checks import CheckSpec, Option
from posdiag.checks._cache_plan import original_context
from posdiag.checks.serving.calls import Calls, ShortOutput
from posdiag.checks.serving.paths import LOOKUP, LOOPS, NotCopyable, Path, Settings, plan
from posdiag.errors import PosdiagError, describe_error, raised_in_posdiag
from posdiag.model.arbitration import arbitrate
from posdiag.model.caches import cache_support, keeps_kv_cache
from posdiag.model.greedy import Refused
from posdiag.model.jitter import FLOOR_SOURCE, jittered
from posdiag.model.module_state import ModelState, restored, snapshot
from posdiag.model.slip import one_early
from posdiag.model.subject import Subject
from posdiag.model.tensors import per_token_change
from posdiag.options import RunOptions, probe_ids, probe_length
from posdiag.results import CheckResult, Status, Table
from posdiag.verdict import (
    LOW_PRECISION,
    Arbitration,
    FloorVerdict,
    agreement_tolerance,
    judge_agreement,
    noise_floor,
    powered,
    worst_error,
)

KINDS = ("chunks", "generate prefill_chunk_size", "shared prefix", "padded batch", *LOOPS, "assisted decoding",
         "prompt lookup")

SPEC = CheckSpec(
    name="serving",
    title="Serving paths vs full forward",
    proves="chunked prefill, a shared prefix's cache, a request inside a padded batch, assisted and prompt-lookup "
           "decoding and hand-written decode loops after another request each reproduce one full forward",
    applies_to=("causal",),
    options={
        "chunk_sizes": Option([3, 16], "a chunk smaller than most prompts' n-grams and one that straddles the tiny "
                                       "models' sliding window: positions restarted or offset per chunk show at "
                                       "every chunk boundary"),
        "decode_steps": Option(4, "single-token forwards after each hand-written prefill: enough for an offset kept "
                                  "by the model to show, cheap on every path"),
        "new_tokens": Option(6, "tokens each generate() path adds: assisted decoding (2 drafts a step) verifies at "
                                "least twice on one cache"),
        "paths": Option(list(KINDS), "every kind of path; name fewer to run fewer (each a handful of forwards)"),
    },
)


@dataclass
class Outcome:
    """One path run: (where, error) per position compared, or why it crashed or did not run."""

    path: Path
    found: list[tuple[str, float]] = field(default_factory=list)
    crashed: str = ""
    not_run: str = ""
    short: str = ""  # a forward returned fewer positions than fed: nothing to compare there
    held: bool = True  # the path's premise, as its run showed it (assisted decoding: drafts rolled back)
    premise: str = ""
    slip: float | None = None  # the same path with every continued forward one position early: its error
    slip_note: str = ""  # what the slip reached, or why none was planted
    power: str = ""  # the slip's clause (verdict.powered)
    departing: tuple[str, float, str] | None = None  # where a path not passed first departs: (where, error, dtype)

    @property
    def broken(self) -> str:
        """Why the path gave nothing to compare (it crashed, or a forward returned too few positions): a FAIL."""
        return self.crashed or self.short

    @property
    def error(self) -> float:
        return float("inf") if self.broken else worst_error(e for _, e in self.found)


@dataclass
class Measurement:
    floor: float
    outcomes: list[Outcome]
    not_run: dict[str, str]


def run(subject: Subject, options: RunOptions) -> CheckResult:
    if subject.kind != "causal":
        return SPEC.result(Status.NA, f"{subject.kind}: the serving paths continue a decoder-only prompt (an "
                                      "encoder decodes nothing; an encoder-decoder's cached decoding is `cache`'s)")
    ok, why = cache_support(subject)
    if not ok:
        return SPEC.result(Status.SKIP, f"no serving path can run: {why}")
    chosen = [str(k) for k in SPEC.setting(options, "paths")]
    if unknown := sorted(set(chosen) - set(KINDS)):
        raise PosdiagError(f"[checks.serving] paths: unknown {', '.join(unknown)} (known: {', '.join(KINDS)})")
    settings, why = _settings(subject, options)
    if settings is None:
        return SPEC.result(Status.SKIP, why)
    fresh, dtype = snapshot(subject.model), subject.dtype_name
    try:
        first = measure(subject, settings, set(chosen), jitter=options.seed, slips=True)
        judged = [o for o in first.outcomes if not o.not_run]
        verdicts = {o.path.name: judge_agreement(o.error, first.floor, dtype) for o in judged if not o.broken}
        finer: list[Measurement] = []  # the float64 re-run, where one ran: where a path departs when only it shows
        arbitration = arbitrate(
            subject, lambda names: measure(subject, settings, set(chosen), names, jitter=options.seed),
            first.floor, verdicts, dtype, lambda m: finer.append(m) or (
                m.floor, {o.path.name: o.error for o in m.outcomes if not (o.not_run or o.broken)}), subset=True)
    finally:
        restored(fresh)  # the model is left as it was before the check
    verdicts.update(arbitration.verdicts)
    decided64 = arbitration.details.get("arbitration", {}).get("decided", {})
    for o in judged:
        if o.path.name in verdicts:
            verdicts[o.path.name] = _confirmed(o, verdicts[o.path.name], first.floor, dtype, o.path.name in decided64)
            if verdicts[o.path.name].status is not Status.PASS:
                o.departing = _departing(o, finer[0] if finer else None, first.floor, dtype)
    return _report(subject, first, verdicts, arbitration, settings)


def _departing(o: Outcome, finer: Measurement | None, floor: float, dtype: str) -> tuple[str, float, str] | None:
    """Where the path first departs: in the run dtype past its tolerance, else (a disagreement only the float64
    re-run resolved: half precision) in that re-run, past the most float32 rounding allows."""
    found = _first_departing(o, agreement_tolerance(floor, dtype))
    if found is not None or finer is None:
        return found and (*found, dtype)
    again = next((x for x in finer.outcomes if x.path.name == o.path.name and not x.not_run), None)
    bound = agreement_tolerance(0.0, "float32") if dtype in LOW_PRECISION else agreement_tolerance(floor, dtype)
    found = None if again is None else _first_departing(again, bound)
    return found and (*found, "float64")


def _confirmed(o: Outcome, v: FloorVerdict, floor: float, dtype: str, decided64: bool) -> FloorVerdict:
    """A PASS that could have failed and whose premise ran: the slip's power applied in the dtype that decided
    (verdict.powered), then the premise (a path that ran without what it claims to exercise is not confirmed)."""
    one, o.power = powered({o.path.name: v}, o.slip, floor, dtype, decided64, o.path.name)
    v = one[o.path.name]
    if o.held or v.status is not Status.PASS:
        return v
    return FloorVerdict(Status.WARN, v.residual, v.noise_floor, v.ratio, f"not confirmed: {o.premise} (the path "
                        f"agrees, {v.ratio:.3g}x the floor, without the part it is there to exercise)")


def _settings(subject: Subject, options: RunOptions) -> tuple[Settings | None, str]:
    """The request and the paths' sizes, within the declared context and a LongRoPE block's original context (past
    it the full forward rotates every position with the long factors, so it is no reference)."""
    steps, new = int(SPEC.setting(options, "decode_steps")), int(SPEC.setting(options, "new_tokens"))
    limits = [x for x in (subject.max_positions, original_context(subject)) if x is not None]
    room = max(steps, new) + LOOKUP + 1
    n = probe_length(subject, options)
    if limits:
        n = min(n, min(limits) - room)
    if n < 8:
        return None, f"the context of {min(limits)} leaves no room for an 8-token prompt and {room} more tokens"
    ids = probe_ids(subject, options)[0][:n] if options.token_ids is not None else subject.sample_ids(
        1, n, options.seed)[0]
    can = getattr(subject.model, "can_generate", None)
    sizes = tuple(sorted({int(k) for k in SPEC.setting(options, "chunk_sizes") if int(k) > 0}))
    return Settings(ids=ids, chunk_sizes=sizes, steps=steps, new_tokens=new, seed=options.seed,
                    explicit=subject.family.takes_position_ids, cached=keeps_kv_cache(subject),
                    generates=callable(can) and bool(can())), ""


def measure(subject: Subject, settings: Settings, kinds: set[str], names: set[str] | None = None,
            jitter: int = 0, slips: bool = False) -> Measurement:
    """The floor, then every chosen path (only `names` in the float64 re-run), each from the model as this run found
    it: as loaded, in the dtype the run computes in (a float64 re-run's conversion is part of that state: its
    converted buffers and the forwards it installs stay while it runs); with `slips`, each path that ran again with
    posdiag's one-position slip (its power). The model is left as found."""
    start = snapshot(subject.model)
    try:
        return _measured(subject, start, settings, kinds, names, jitter, slips)
    finally:
        restored(start)


def _measured(subject: Subject, start: ModelState, settings: Settings, kinds: set[str], names: set[str] | None,
              jitter: int, slips: bool) -> Measurement:
    calls = Calls(subject)
    paths, not_run = plan(calls, settings)
    paths = [p for p in paths if any(p.name.startswith(k) for k in kinds) and (names is None or p.name in names)]
    not_run = {k: v for k, v in not_run.items() if any(k.startswith(kind) for kind in kinds)}
    ids = settings.ids[None]
    full = calls.full(ids, keep=ids.shape[1])
    with jittered(subject, "decoder", 0, 1, jitter, settle_masks=False) as found:
        shaken = calls.full(ids, keep=ids.shape[1]) if found else None
    # the larger of two rounding sensitivities: the paths compare final hidden states, generate()'s its logits
    floor = 0.0 if shaken is None else max(float(per_token_change(shaken.states[0], full.states[0]).max()),
                                           float(per_token_change(shaken.logits[0], full.logits[0]).max()))
    outcomes = []
    for path in paths:
        restored(start)
        outcomes.append(_ran(path))
        if slips and not (outcomes[-1].not_run or outcomes[-1].broken):
            restored(start)
            outcomes[-1].slip, outcomes[-1].slip_note = _slipped(subject, path, settings.explicit)
    return Measurement(floor, outcomes, not_run)


def _ran(path: Path) -> Outcome:
    try:
        found = path.compare()
        held, premise = path.premise() if path.premise else (True, "")
        return Outcome(path, found, held=held, premise=premise)
    except Refused as exc:
        return Outcome(path, not_run=f"transformers refuses it for this model: {exc}")
    except NotCopyable as exc:
        return Outcome(path, not_run=str(exc))
    except ShortOutput as exc:
        return Outcome(path, short=str(exc))
    except Exception as exc:  # a path transformers accepts that crashes: users hit it
        if raised_in_posdiag(exc):
            raise
        return Outcome(path, crashed=describe_error(exc))


def _slipped(subject: Subject, path: Path, explicit: bool) -> tuple[float | None, str]:
    """The path again (cut down to its first boundaries: Path.slip) with every forward that continues a cache one
    position early (posdiag.model.slip), against the same reference: its worst error and what the slip reached, or
    None and why no slip was planted."""
    if not explicit:
        return None, "the family's forward takes no position_ids: no slip posdiag can plant"
    if subject.as_stored_pass:
        return None, "not planted in the stored-dtype pass (the float32 run measured it)"
    with one_early(subject) as reached:
        try:
            found = (path.slip or path.compare)()
        except (Refused, NotCopyable, ShortOutput) as exc:
            return None, f"the slipped path did not run: {exc}"
        except Exception as exc:  # posdiag's positions may be what the model refuses: no power measured
            if raised_in_posdiag(exc):
                raise
            return None, f"the slipped path crashed ({describe_error(exc)}): no power measured"
    if not reached.forwards:
        return None, ("no forward of the path continues a cache posdiag can number one early" + (
            f" ({reached.left} continued forward{'s' if reached.left != 1 else ''} of a left-padded batch without "
            "position_ids, which the model numbers itself: posdiag does not guess how)" if reached.left else ""))
    return worst_error(e for _, e in found), f"{reached.forwards} continued forwards numbered one early"


def _first_departing(o: Outcome, tolerance: float) -> tuple[str, float] | None:
    return next(((label, e) for label, e in o.found if not e <= tolerance), None)


def _report(subject: Subject, m: Measurement, verdicts: dict[str, FloorVerdict], arbitration: Arbitration,
            s: Settings) -> CheckResult:
    dtype = subject.dtype_name
    floor, tolerance = noise_floor(m.floor, dtype), agreement_tolerance(m.floor, dtype)
    not_run = {**m.not_run, **{o.path.name: o.not_run for o in m.outcomes if o.not_run}}
    ran = [o for o in m.outcomes if not o.not_run]
    details: dict = {"prompt_tokens": s.ids.shape[0], "floor_source": FLOOR_SOURCE, "not_run": not_run,
                     **arbitration.details, "paths": {}}
    tail = f"; not run: {', '.join(f'{k} ({v})' for k, v in not_run.items())}" if not_run else ""
    if not ran:
        return SPEC.result(Status.SKIP, "no serving path ran: " + "; ".join(f"{k}: {v}" for k, v in not_run.items()),
                           details=details)
    rows = []
    for o in ran:
        v = verdicts.get(o.path.name)
        status = Status.FAIL if o.broken else v.status
        departing = None if o.broken or status is Status.PASS else o.departing
        rows.append((o.path.name, status.value, str(len(o.found)),
                     "crashed" if o.crashed else "too few positions" if o.short else f"{o.error:.3e}",
                     f"{floor:.2e}", "-" if o.broken else f"{v.ratio:.3g}",
                     "-" if o.slip is None else f"{o.slip / floor:.3g}",
                     o.broken or (_where(departing) if departing else "-")))
        details["paths"][o.path.name] = {
            "story": o.path.story, "status": status, "crashed": o.crashed, "short": o.short,
            "errors": dict(o.found), "first_departing": departing and _where(departing),
            "decided": arbitration.clause(o.path.name),
            "slip": {"error": o.slip, "ratio": None if o.slip is None else o.slip / floor, "dtype": dtype,
                     "how": o.slip_note, "power": o.power},
            **({"premise": {"held": o.held, "what": o.premise}} if o.path.premise else {})}
    table = Table("each serving path vs one full forward", ("path", "status", "positions", "max error",
                                                             "noise floor", "ratio", "slip ratio",
                                                             "first departing"), tuple(rows))
    failing = [o for o, row in zip(ran, rows, strict=True) if row[1] != Status.PASS.value]
    worst = failing[0] if failing else max(ran, key=lambda o: o.error)
    v = verdicts.get(worst.path.name) or FloorVerdict(Status.FAIL, float("inf"), floor, float("inf"), "")
    slipped = [o for o in ran if o.slip is not None]
    weakest = min(slipped, key=lambda o: o.slip) if slipped else None
    metrics = {"error": v.residual, "noise_floor": v.noise_floor, "ratio": v.ratio, "tolerance": tolerance,
               "paths_judged": len(ran), **arbitration.metrics,
               **({"slip_ratio_min": weakest.slip / floor} if weakest else {})}
    if not failing:
        paths = f"{len(ran)} path{'s' if len(ran) != 1 else ''}"
        power = (f"; weakest power: {weakest.power}{_unslipped(len(ran) - len(slipped))}" if weakest else
                 "; no one-position slip could be planted (no position_ids)")
        summary = (f"every serving path reproduces one full forward ({paths}, {s.ids.shape[0]}-token "
                   f"prompt; max error {v.residual:.3g} = {v.ratio:.3g}x floor {v.noise_floor:.2g}"
                   f"{arbitration.clause(worst.path.name)}{power}){tail}")
        return SPEC.result(Status.PASS, summary, metrics, details, (table,))
    summary = "; ".join(_failure(o, verdicts, arbitration) for o in failing[:3])
    more = f" (failing: {', '.join(o.path.name for o in failing)})" if len(failing) > 3 else ""
    status = Status.worst([Status.FAIL if o.broken else verdicts[o.path.name].status for o in failing])
    return SPEC.result(status, summary + more + tail, metrics, details, (table,))


def _unslipped(count: int) -> str:
    return f", {count} path{'s' if count != 1 else ''} with no slip planted" if count else ""


def _where(departing: tuple[str, float, str]) -> str:
    label, _, dtype = departing
    return label if dtype != "float64" else f"{label} (in float64)"


def _failure(o: Outcome, verdicts: dict[str, FloorVerdict], arbitration: Arbitration) -> str:
    name, story = o.path.name, o.path.story
    if o.crashed:
        return f"{name}: {story}: crashed ({o.crashed}), a path transformers accepts"
    if o.short:
        return f"{name}: {story}: {o.short}, nothing to compare at the others (a path transformers accepts)"
    v = verdicts[name]
    if o.departing is None:
        return f"{name}: {v.reason}"
    label, error, dtype = o.departing
    if dtype == "float64":
        return f"{name}: {story}: first departs at {label} in float64 by {error:.3g}{arbitration.clause(name)}"
    return (f"{name}: {story}: first departs at {label} by {error:.3g} = {error / v.noise_floor:.3g}x the noise "
            f"floor {v.noise_floor:.2g}{arbitration.clause(name)}")

