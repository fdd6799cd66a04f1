"""state — the same input gives the same output whatever ran before it.

Every other check starts from the model as loaded (posdiag.api restores every module's state before each check);
here history is the subject. Sequences of calls a user makes (state/sequences.py): a short input, a long one past
every declared boundary, the short one again; generate() on one prompt, then on another; a multi-turn conversation
continued from the cache generate() returned; assisted decoding (a draft that disagrees, so the cache is rolled
back) and prompt-lookup decoding against greedy; a padded batch after another; one prompt, or an unpadded batch of
the same size, decoded in a hand-written loop after a padded batch (what users send after
`model(**tokenizer(batch, padding=True))`); on models with multimodal RoPE, an image prompt (or a padded batch
holding one) then a text prompt decoded in a hand-written loop (state/images.py). Each call under test is compared
with the same call on a fresh state (every module's buffers and attributes snapshotted before the first call; nothing
is restored between the calls of a sequence):
error = ||y_after − y_fresh|| / ||y_fresh||, judged as agreement against the floor measured in the same run (the
fresh call with row 0's token embeddings jittered by ~1 ulp), a disagreement decided in float64. A FAIL names the
sequence, the call whose output changed and, where a module's buffer or attribute changed between the fresh state
and that call, which (transformers #46624: dynamic RoPE kept its long-input frequencies; #36013: rope_deltas of a
previous call reused; #30068: assisted decoding's positions not advanced by the accepted candidates).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from posdiag.checks import CheckSpec, Option
from posdiag.checks.state.images import IMAGE_SEQUENCES, image_plan
from posdiag.checks.state.sequences import SEQUENCES, Sequence, plan
from posdiag.errors import PosdiagError, describe_error
from posdiag.model.arbitration import arbitrate
from posdiag.model.greedy import Refused
from posdiag.model.jitter import FLOOR_SOURCE, jittered
from posdiag.model.module_state import ModelState, changes, restored, snapshot
from posdiag.model.slip import one_early
from posdiag.model.subject import Subject
from posdiag.model.tensors import relative_l2
from posdiag.options import RunOptions, probe_ids
from posdiag.results import CheckResult, Status, Table
from posdiag.verdict import (
    LOW_PRECISION,
    FloorVerdict,
    agreement_tolerance,
    judge_agreement,
    noise_floor,
    powered,
    within_band,
)

SPEC = CheckSpec(
    name="state",
    title="State across calls",
    proves="the same input gives the same output whatever ran before it: a long input, another prompt, a kept "
           "cache, assisted decoding, another padded batch, an unpadded request after a padded batch",
    applies_to=("causal", "seq2seq"),
    options={
        "new_tokens": Option(6, "generated tokens per generate() call: assisted decoding (2 candidates a step) "
                                "verifies at least twice on one cache, so a position not advanced by the accepted "
                                "candidates shows; few enough to keep the sequences cheap"),
        "long_cap": Option(1024, "the longest input the long-input sequence runs: past it a boundary is named, "
                                 "not crossed (an eager forward's cost grows with the square of the length)"),
        "sequences": Option(list(SEQUENCES + IMAGE_SEQUENCES), "every sequence a user's calls make (those with images "
                            "on models with multimodal RoPE); name fewer to run fewer (each costs a handful of "
                            "forwards or generate() calls)"),
    },
)


def run(subject: Subject, options: RunOptions) -> CheckResult:
    if subject.kind == "encoder":
        return SPEC.result(Status.NA, "an encoder: called once per input, it keeps no cache and generates nothing, "
                                      "so no call of a user's sequence continues another")
    chosen = [str(name) for name in SPEC.setting(options, "sequences")]
    known = SEQUENCES + IMAGE_SEQUENCES
    if unknown := sorted(set(chosen) - set(known)):
        raise PosdiagError(f"[checks.state] sequences: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    short = probe_ids(subject, options)[0]
    fresh = snapshot(subject.model)
    try:
        seqs, not_run, reached = plan(subject, short, int(SPEC.setting(options, "long_cap")),
                                      int(SPEC.setting(options, "new_tokens")), options.seed, set(chosen))
        images, no_images, tested = image_plan(subject, options.seed, set(chosen),
                                               "sequences" in options.for_check("state"))
        seqs, not_run = seqs + images, {**not_run, **no_images}
        if tested:  # the report's header names the inputs fed
            reached["multimodal"] = {"tested": tested}
        slips: dict[str, float | None] = {}  # the power of each distinct fresh call, measured once
        floors: dict[str, float] = {}  # and its floor
        outcomes = [_judged(subject, fresh, seq, options.seed, slips, floors) for seq in seqs]
    finally:
        restored(fresh)  # the model is left as it was before the check
    return _report(subject, [o for o in outcomes if not o.not_run], {
        **not_run, **{o.sequence.name: o.not_run for o in outcomes if o.not_run}}, reached)


@dataclass
class Outcome:
    """One sequence measured: the call under test against the same call on a fresh state."""

    sequence: Sequence
    error: float = float("nan")
    floor: float = 0.0
    changed: list[str] = field(default_factory=list)  # module state that differs from the fresh state afterwards
    crashed: str = ""  # the call under test (or the history) raised after the fresh call ran
    not_run: str = ""  # why the fresh call itself did not run (judged elsewhere)
    verdict: FloorVerdict | None = None
    clause: str = ""  # the float64 arbitration's words
    slip: float | None = None  # the fresh call with every forward continuing a cache one position early (its power)


def measure(subject: Subject, fresh: ModelState, seq: Sequence, seed: int,
            slips: dict[str, float | None] | None = None, floors: dict[str, float] | None = None) -> Outcome:
    """The fresh call and its jittered twin (the floor), each from the fresh state, then from the fresh state again
    the history and the call under test, nothing restored between them. With `slips`, the fresh call once more with
    every forward that continues a cache one position early (posdiag.model.slip), once per distinct fresh output
    (a sequence with and without position_ids, generate() after another prompt and assisted: the same call). The
    floor too is measured once per distinct fresh output (`floors`): the same output bit for bit, the same rounding."""
    floors = {} if floors is None else floors
    try:
        restored(fresh)
        reference = seq.reference()
        slip, key = None, _digest(reference)
        if key not in floors:  # an output met before bit for bit (with and without position_ids) has its floor
            restored(fresh)  # the floor's call too starts fresh: it is the same call, shaken by rounding only
            with jittered(subject, "decoder", 0, seq.rows, seed, settle_masks=False) as has_jitter:
                shaken = seq.reference()
            floors[key] = _difference(shaken, reference) if has_jitter else 0.0
    except Refused as exc:
        return Outcome(seq, not_run=f"transformers refuses it for this model: {exc}")
    except Exception as exc:  # a crash on a fresh state is the fresh path's finding (generate, cache)
        return Outcome(seq, not_run=f"it crashed on a fresh state ({describe_error(exc)}): judged by the check "
                                    "of that path, not as state")
    if slips is not None and seq.name not in IMAGE_SEQUENCES and not subject.as_stored_pass:  # an image call's
        # positions are its layout's; the stored-dtype pass plants none (float32 measured the power)
        if key not in slips:
            restored(fresh)
            with one_early(subject) as reached:
                slipped = seq.reference()
            slips[key] = _difference(slipped, reference) if reached.forwards else None
        slip = slips[key]
    restored(fresh)
    try:
        after = seq.under_test(seq.history())
    except Exception as exc:  # the fresh call ran: a crash after the history is the history's doing
        if isinstance(exc, Refused) and not seq.same_call:  # another way of making the call, refused by transformers
            return Outcome(seq, not_run=f"transformers does not run it for this model: {exc}")
        return Outcome(seq, crashed=describe_error(exc), changed=changes(fresh), slip=slip)
    return Outcome(seq, _difference(after, reference), floors[key], changes(fresh), slip=slip)


def _digest(output) -> str:
    """A fresh call's output, identified bit for bit."""
    data = output.detach().double().cpu().contiguous().numpy().tobytes()
    return f"{tuple(output.shape)} {hashlib.sha1(data).hexdigest()}"


def _difference(a, b) -> float:
    return float("inf") if a.shape != b.shape else relative_l2(a, b)


def _judged(subject: Subject, fresh: ModelState, seq: Sequence, seed: int, slips: dict[str, float | None],
            floors: dict[str, float]) -> Outcome:
    """Measured and judged; a disagreement above tolerance measured again in float64 (a bug stays, rounding
    shrinks)."""
    outcome = measure(subject, fresh, seq, seed, slips, floors)
    if outcome.not_run:
        return outcome
    dtype = subject.dtype_name
    if outcome.crashed:
        outcome.verdict = FloorVerdict(Status.FAIL, float("inf"), outcome.floor, float("inf"), "crashed")
        return outcome
    outcome.verdict = judge_agreement(outcome.error, outcome.floor, dtype)
    if (outcome.verdict.status is Status.FAIL or dtype in LOW_PRECISION) and outcome.error == outcome.error:
        name = seq.name
        # a re-run that crashed or did not run where the run dtype ran did not compute the same path (a vision
        # tower converted module by module takes float32 pixels into float64 weights): the next way of converting
        arbitration = arbitrate(subject, lambda: measure(subject, fresh, seq, seed), outcome.floor,
                                {name: outcome.verdict}, dtype,
                                lambda o: (o.floor, {name: o.error if not o.crashed else float("inf")}),
                                reached=lambda o, _: not o.not_run and bool(o.crashed) == bool(outcome.crashed))
        outcome.verdict = arbitration.verdicts.get(name, outcome.verdict)
        outcome.clause = arbitration.clause(name)
        decided64 = bool(arbitration.details.get("arbitration", {}).get("ran"))
    else:
        decided64 = False
    verdicts, power = powered({seq.name: outcome.verdict}, outcome.slip, outcome.floor, dtype, decided64, seq.name)
    outcome.verdict, outcome.clause = verdicts[seq.name], outcome.clause + (f"; {power}" if power else "")
    return outcome


def _cause(o: Outcome) -> str:
    if o.changed:
        return f"state kept from the earlier calls: {', '.join(o.changed)}"
    return "no module's buffer or attribute changed (the state is held elsewhere: a cache, a closure, a global)"


def _report(subject: Subject, outcomes: list[Outcome], not_run: dict[str, str], reached: dict) -> CheckResult:
    details: dict = {**reached, "floor_source": FLOOR_SOURCE, "not_run": not_run,
                     "sequences": {o.sequence.name: {"story": o.sequence.story, "error": o.error, "floor": o.floor,
                                                     "state_changed": o.changed, "crashed": o.crashed,
                                                     "decided": o.clause, "slip": o.slip} for o in outcomes}}
    if not outcomes:
        return SPEC.result(Status.SKIP, "no sequence ran: " + "; ".join(f"{k}: {v}" for k, v in not_run.items()),
                           details=details)
    status = Status.worst([o.verdict.status for o in outcomes])
    worst = max(outcomes, key=lambda o: (o.verdict.status.rank, o.verdict.ratio))
    v = worst.verdict
    metrics = {"error": v.residual, "noise_floor": v.noise_floor, "ratio": v.ratio,
               "tolerance": agreement_tolerance(worst.floor, subject.dtype_name)}
    slips = [o.slip / noise_floor(o.floor, subject.dtype_name) for o in outcomes if o.slip is not None]
    if slips:
        metrics["slip_ratio_min"] = min(slips)
    skipped = f"; not run: {', '.join(not_run)}" if not_run else ""
    if status is Status.PASS:
        crossed = reached.get("boundaries_crossed") or {}
        past = f", past {', '.join(f'{k} {at}' for k, at in crossed.items())}" if crossed else ""
        names = ", ".join(o.sequence.name for o in outcomes)
        ran_long = any(o.sequence.name == "long input" for o in outcomes)
        long_input = f"; long input {reached['long_input']} tokens{past}" if ran_long else ""
        power = f"; a one-position slip at least {min(slips):.3g}x the floor" if slips else ""
        if slips and subject.dtype_name in LOW_PRECISION and within_band(min(slips)):  # a PASS: float64 ran
            power += f", which {subject.dtype_name} alone could not resolve: decided in float64"
        summary = (f"the same input gives the same output after every history ({names}; max error "
                   f"{v.residual:.2g} = {v.ratio:.2g}x floor {v.noise_floor:.2g}{long_input}{power}){skipped}")
    else:
        failing = [o for o in outcomes if o.verdict.status is not Status.PASS]
        summary = "; ".join(_failure(o) for o in failing) + skipped
    rows = tuple((o.sequence.name, o.verdict.status.value, "crashed" if o.crashed else f"{o.error:.3e}",
                  f"{o.verdict.noise_floor:.2e}", "-" if o.crashed else f"{o.verdict.ratio:.3g}",
                  "; ".join(o.changed) or "-") for o in outcomes)
    table = Table("the same call after a history vs on a fresh state",
                  ("sequence", "status", "error", "noise floor", "ratio", "state changed"), rows)
    return SPEC.result(status, summary, metrics, details, (table,))


def _failure(o: Outcome) -> str:
    seq, v = o.sequence, o.verdict
    if o.crashed:
        fresh = "on a fresh state" if seq.same_call else "greedily"
        return f"{seq.name}: {seq.story}: the call crashed ({o.crashed}), though it runs {fresh}; {_cause(o)}"
    return (f"{seq.name}: {seq.story}: the output differs from a fresh model's by {v.residual:.3g} "
            f"({v.ratio:.3g}x the floor {v.noise_floor:.2g}){o.clause}: {_cause(o)}")
