"""generate — greedy generate() must agree with the forward pass, row by row, step by step.

generate() numbers positions itself (position_ids from the attention-mask cumsum, a cache offset per step) while a
plain forward numbers them its own way (arange, family offsets). Where the two disagree, generation drifts although
every forward test passes. With teacher forcing the forward gives the logits generation should have produced: for a
generated sequence s = prompt ‖ g, step k's logits must equal f(s)[len(prompt) − 1 + k] (step 0 is the last logit of
model(prompt)). We generate greedily (a) the full prompt alone (past the sliding window, where the probe stays
within one) and (b) a padded batch of prompts of the probe length and shorter (left-padded for decoder-only models,
the encoder input right-padded for encoder-decoders, each one's convention), with the default cache and with a
static cache (transformers runs one on any model that uses Cache objects, whatever the class declares: judged on
every one, a crash being a FAIL that names it; a ValueError from transformers' generation code before the model's
forward ran is a refusal of the request, not judged), and compare each row against the forward of that row *alone*
(no padding). Error per step = ||gen − fwd|| / ||fwd||; noise floor from the same run: cache-free forwards of short
prompt prefixes (decoder-only) or of the padded encoder batch (encoder-decoders) against the teacher-forced forward
at the same positions, max per position. A token mismatch is a failure only when the forward's top-2 candidates are
not within noise (tiny random models have near-ties); after the first mismatch a row is no longer compared. Verdict:
posdiag.verdict.judge_agreement(max step error, floor, dtype); a run above its tolerance is generated again in
float64 with its reference and decided there (model/arbitration.arbitrate).
"""

from __future__ import annotations

from posdiag.checks import CheckSpec, Option
from posdiag.checks._image_decode import generate_after_image, with_image_decode
from posdiag.checks.generate import inputs, runs, wording
from posdiag.checks.generate.inputs import ROWS
from posdiag.checks.generate.runs import Measurement, Run
from posdiag.model.arbitration import arbitrate
from posdiag.model.caches import cache_support
from posdiag.model.slip import one_early
from posdiag.model.subject import Subject
from posdiag.options import RunOptions
from posdiag.results import CheckResult, Status
from posdiag.verdict import FloorVerdict, judge_agreement, noise_floor, powered

__all__ = ["ROWS", "SPEC", "Measurement", "Run", "run"]

SPEC = CheckSpec("generate", "generate() vs forward pass",
                 "greedy generate() agrees step by step with the teacher-forced forward, alone and in a padded batch",
                 applies_to=("causal", "seq2seq"),
                 options={"new_tokens": Option(6, "tokens per row: a position bug shows in the first few steps")})


def _slip(subject: Subject, prompts: list, batch_rows: list[int], new_tokens: int,
          compiled: bool) -> tuple[float | None, str]:
    """The run's power: the prompt alone generated again (default cache) with every step that continues the cache
    numbered one early (posdiag.model.slip), against the same teacher-forced reference (cache-free: never slipped).
    None where the slip reached no step (an encoder-decoder's decoder, a model numbering its steps from its mask)."""
    if subject.kind != "causal" or not subject.family.takes_position_ids:
        return None, "not planted: the model takes no position_ids for its decode steps"
    if subject.as_stored_pass:
        return None, "not planted in the stored-dtype pass (the float32 run measured it)"
    with one_early(subject) as reached:
        slipped = runs.measure(subject, prompts, batch_rows, new_tokens, only={"dynamic/single"}, compiled=compiled)
    done = slipped.done
    if not reached.forwards or not done:
        return None, "not planted: " + ("no decode step took it" if done else "the slipped generate() did not run")
    return done[0].max_error, f"dynamic/single generated with its {reached.forwards} decode steps one position early"


def _support(subject: Subject) -> tuple[Status | None, str]:
    ok, why = cache_support(subject)
    if not ok:
        return Status.NA if subject.kind == "encoder" else Status.SKIP, why
    can = getattr(subject.model, "can_generate", None)
    if not callable(can) or not can():
        return Status.NA, f"{type(subject.model).__name__} has no generation head (can_generate() is False)"
    return None, ""


def run(subject: Subject, options: RunOptions) -> CheckResult:
    status, why = _support(subject)
    if status is not None:  # n/a: an encoder, or a class without a generation head; skip: what cannot be driven
        return SPEC.result(status, why)
    new_tokens = int(SPEC.setting(options, "new_tokens"))
    prompts, batch_rows = inputs.prompts(subject, options, new_tokens)
    dtype = subject.dtype_name

    def measure(names: set[str]) -> Measurement:  # float64: only the runs that differ
        return runs.measure(subject, prompts, batch_rows, new_tokens, only=names, compiled=options.compile)

    first = runs.measure(subject, prompts, batch_rows, new_tokens, jitter=options.seed, compiled=options.compile)
    if first.runs and all(r.refused for r in first.runs):  # transformers' own configuration error: nothing ran
        return SPEC.result(Status.SKIP, f"transformers refuses generate() for this model before running "
                           f"it: {first.runs[0].refused}", details={"refused": {r.name: r.refused for r in first.runs}})
    verdicts = {r.name: (FloorVerdict(Status.FAIL, r.max_error, noise_floor(first.floor, dtype), float("inf"),
                                      "a token differs beyond a near-tie") if r.token_failure else
                         judge_agreement(r.max_error, first.floor, dtype)) for r in first.done}
    compiled = {r.name: r.compiled_calls for r in first.done if r.compiled_calls[0]}  # float64 must compile them too
    arbitration = arbitrate(subject, measure, first.floor, verdicts, dtype, lambda m: (
        m.floor, {r.name: r.max_error for r in m.done}), subset=True, prefer="whole" if compiled else None,
        reached=lambda m, _: all(r.compiled_calls == compiled[r.name] for r in m.done if r.name in compiled))
    verdicts.update(arbitration.verdicts)
    slip, slip_note = _slip(subject, prompts, batch_rows, new_tokens, options.compile)
    decided64 = bool(arbitration.details.get("arbitration", {}).get("ran"))
    verdicts, power = powered(verdicts, slip, first.floor, dtype, decided64, "generate()'s decode steps")
    lengths = (len(prompts[0]), [len(prompts[r]) for r in batch_rows])
    status, summary, metrics, details, tables = wording.report(subject, first, verdicts, arbitration, lengths,
                                                               new_tokens)
    details["slip"] = {"error": slip, "dtype": dtype, "how": slip_note} | (
        {"ratio": slip / noise_floor(first.floor, dtype)} if slip is not None else {})
    result = SPEC.result(status, summary + (f"; {power}" if power and status is not Status.FAIL else ""), metrics,
                         details, tables)
    return with_image_decode(result, subject, options.seed,  # multimodal RoPE: generate() after an image
                             lambda prompt: generate_after_image(subject, prompt, new_tokens,
                                                                 inputs.pad_id(subject)[0], options.seed))
