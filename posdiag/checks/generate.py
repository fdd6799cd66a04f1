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

from dataclasses import dataclass, field
from typing import Any

import torch

from posdiag.checks import CheckSpec, Option
from posdiag.checks._image_decode import generate_after_image, with_image_decode
from posdiag.checks._reference import JITTER_SOURCE, jitter_floor, reference, right_padded
from posdiag.model.arbitration import arbitrate
from posdiag.model.caches import (
    cache_layer_note,
    cache_support,
    compile_kwargs,
    compiled_forwards,
    compiled_path,
    generate_guarded,
    new_cache,
    static_cache_refusal,
)
from posdiag.model.memory import forward_refusal
from posdiag.model.subject import Subject
from posdiag.model.tensors import relative_l2
from posdiag.options import RunOptions, probe_length
from posdiag.results import CheckResult, Status, Table
from posdiag.verdict import FAIL_RATIO, FloorVerdict, degenerate_floor, judge_agreement, noise_floor, worst_error

SPEC = CheckSpec("generate", "generate() vs forward pass",
                 "greedy generate() agrees step by step with the teacher-forced forward, alone and in a padded batch",
                 applies_to=("causal", "seq2seq"),
                 options={"new_tokens": Option(6, "tokens per row: a position bug shows in the first few steps")})
ROWS = 3  # prompts in the padded batch


@dataclass
class Run:
    """One generate() call: which cache, single prompt or padded batch."""

    cache: str
    variant: str  # "single" | "batch"
    rows: list[int]  # prompt index of each generated row
    logits: torch.Tensor | None = None  # [R, N, V] raw logits per step
    tokens: torch.Tensor | None = None  # [R, N]
    errors: dict[int, list[float]] = field(default_factory=dict)  # row of the run -> per-step errors (compared)
    notes: list[str] = field(default_factory=list)
    token_failure: tuple[int, int, float, float] | None = None  # (row, step, gap, tie tolerance)
    crashed: str = ""  # the exception a generate() call transformers accepts raised
    refused: str = ""  # transformers' generation code refused the call before the model ran (a config error)
    compiled_calls: tuple[int, int] = (0, 0)  # (model, module) calls that ran compiled: read, not assumed

    @property
    def name(self) -> str:
        return f"{self.cache}/{self.variant}"

    @property
    def max_error(self) -> float:
        """The largest step error; NaN when any step was non-finite (a NaN never hides behind max())."""
        return worst_error(e for errs in self.errors.values() for e in errs)


def _support(subject: Subject) -> tuple[Status | None, str]:
    ok, why = cache_support(subject)
    if not ok:
        return Status.NA if subject.kind == "encoder" else Status.SKIP, why
    can = getattr(subject.model, "can_generate", None)
    if not callable(can) or not can():
        return Status.NA, f"{type(subject.model).__name__} has no generation head (can_generate() is False)"
    return None, ""


def _pad_id(subject: Subject) -> tuple[int, str]:
    """The padding id: the config's pad (else eos, bos; config, then generation_config) when it is a
    row of the embedding table. Tiny or resized configs keep ids of the full vocabulary (measured:
    starcoder2/gpt_bigcode with vocab_size=256 keep bos/eos 50256 / 0 -> "index out of range in self"
    on the padded batch): posdiag never feeds an id >= vocab_size, and says which id it used."""
    vocab = subject.vocab_size
    invalid: list[str] = []
    sources = [subject.config, getattr(subject.model, "generation_config", None)]
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        for src in sources:
            value = getattr(src, name, None) if src is not None else None
            if isinstance(value, (list, tuple)):
                value = value[0] if value else None
            if isinstance(value, int) and not isinstance(value, bool):
                if 0 <= value < vocab:
                    return value, (f"padding with {name} {value} ({'; '.join(invalid)})" if invalid else "")
                text = f"{name} {value} is outside the vocabulary of {vocab}"
                if text not in invalid:
                    invalid.append(text)
    ordinary = sorted(set(range(min(vocab, 8))) - subject.special_ids())
    pad = ordinary[0] if ordinary else 0
    return pad, f"padding with id {pad} ({'; '.join(invalid)})" if invalid else ""


def _prompts(subject: Subject, options: RunOptions, new_tokens: int) -> tuple[list[torch.Tensor], list[int]]:
    """The prompts and which of them make the padded batch; prompt 0 is generated alone.

    Where the probe stays within a sliding window, the prompt generated alone is stretched past it (window + 4
    tokens): decoding past the window is where window bugs live (Inkling's static cache, a cache that evicts what
    the forward attends). The padded batch keeps the probe length, rows [P, P - P/4, P - P/2]: its job is padding,
    and its shorter rows never reach the window however long its first row is. Without a stretch the prompt
    alone is the batch's first row."""
    base = probe_length(subject, options)
    window, declared = subject.sliding_window, subject.max_positions

    def fitted(length: int) -> int:  # prompt + generated tokens within the declared context
        return max(4, declared - new_tokens) if declared is not None and length + new_tokens > declared else length

    alone = fitted(window + 4 if window and base + new_tokens <= window + 2 and not _window_refusal(
        subject, base, new_tokens) else base)
    base = fitted(base)
    lens = [base, max(2, base - max(1, base // 4)), max(2, base - max(2, base // 2))][:ROWS]
    sampled = subject.sample_ids(len(lens), max(alone, base), options.seed)
    if options.token_ids is not None:  # the text's tokens: no longer than the text, whatever was asked
        sampled = torch.tensor(options.token_ids, device=subject.device)[None].expand(len(lens), -1).clone()
    batch = [sampled[r, :n] for r, n in enumerate(lens)]
    if len(sampled[0, :alone]) == len(batch[0]):  # nothing stretched: the prompt alone is the batch's first row
        return batch, list(range(len(batch)))
    return [sampled[0, :alone], *batch], list(range(1, len(batch) + 1))


def _window_refusal(subject: Subject, base: int, new_tokens: int) -> str:
    """Why the prompt alone is not stretched past the sliding window (memory cannot hold it, planned before it
    runs: decoding past the window is then not judged), or ""."""
    window = subject.sliding_window
    if not window or base + new_tokens > window + 2:
        return ""
    return forward_refusal(subject, f"the prompt past the {window}-token sliding window", 1, window + 4 + new_tokens,
                           logits_rows=new_tokens, cache=True)


def run(subject: Subject, options: RunOptions) -> CheckResult:
    status, why = _support(subject)
    if status is not None:  # n/a: an encoder, or a class without a generation head; skip: what cannot be driven
        return SPEC.result(status, why)
    new_tokens = int(SPEC.setting(options, "new_tokens"))
    prompts, batch_rows = _prompts(subject, options, new_tokens)
    dtype = subject.dtype_name

    def measure(names: set[str]) -> Measurement:  # float64: only the runs that differ
        return _measure(subject, prompts, batch_rows, new_tokens, only=names, compiled=options.compile)

    first = _measure(subject, prompts, batch_rows, new_tokens, jitter=options.seed, compiled=options.compile)
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
    lengths = (len(prompts[0]), [len(prompts[r]) for r in batch_rows])
    result = _report(subject, first, verdicts, arbitration, lengths, new_tokens)
    return with_image_decode(result, subject, options.seed,  # multimodal RoPE: generate() after an image
                             lambda prompt: generate_after_image(subject, prompt, new_tokens, _pad_id(subject)[0]))


@dataclass
class Measurement:
    """Every generate() run judged against the teacher-forced forward (run dtype, or float64 to arbitrate)."""

    runs: list[Run]
    floor: float
    first_step_error: float
    pad_note: str
    cache_note: str
    static_note: str = ""  # why no static-cache run (transformers cannot build the cache)
    floor_source: str = ""  # what measured the floor, where not the default of the model's kind
    compiled: bool = False  # --compile asked for transformers' compile of the static-cache forward (see Run)

    @property
    def done(self) -> list[Run]:
        return [r for r in self.runs if not r.crashed and not r.refused]


def _measure(subject: Subject, prompts: list[torch.Tensor], batch_rows: list[int], new_tokens: int,
             only: set[str] | None = None, jitter: int | None = None, compiled: bool = False) -> Measurement:
    """Every generate() run (those named in `only`: the float64 re-run) against the teacher-forced forward: prompt 0
    alone, the prompts `batch_rows` as a padded batch; `jitter` (the seed) re-measures a degenerate floor in the run
    dtype (_reference.jitter_floor)."""
    model, seq2seq = subject.model, subject.kind == "seq2seq"
    pad, pad_note = _pad_id(subject)
    cache_note = cache_layer_note(subject)
    batch, mask = _padded_batch([prompts[r] for r in batch_rows], pad, seq2seq, subject.device)
    gen_kwargs = dict(do_sample=False, num_beams=1, max_new_tokens=new_tokens, output_logits=True,
                      return_dict_in_generate=True, pad_token_id=pad, eos_token_id=None, forced_eos_token_id=None,
                      forced_bos_token_id=None)
    decoder_start: list[int] = []  # what generate() put before the first decoder step (seq2seq)

    def generate(ids: torch.Tensor, attn: torch.Tensor, impl: str | None) -> tuple[torch.Tensor, ...]:
        # only a static cache is compiled (transformers compiles no dynamic-cache generate)
        extra: dict[str, Any] = {"cache_implementation": impl, **compile_kwargs(compiled and impl == "static")}
        if cache_note:  # generate() would size its cache from the wrong layer count: hand it ours
            extra = {"cache": new_cache(subject, impl or "dynamic", max_len=ids.shape[1] + new_tokens + 1,
                                        encoder_len=ids.shape[1])}
        with torch.inference_mode(), compiled_forwards(model) as calls:
            out = model.generate(ids, attention_mask=attn, **extra, **gen_kwargs)
        subject.forward_count += len(out.logits)
        logits = torch.stack(out.logits, 1)
        if seq2seq:
            decoder_start.append(int(out.sequences[0, 0]))
        return logits, out.sequences[:, -logits.shape[1]:], calls.counts

    refused = static_cache_refusal(subject)  # a static cache users cannot build: no static run
    runs = _generated(model, generate, prompts[0], (batch, mask, batch_rows), refused, only)
    done = [r for r in runs if not r.crashed and not r.refused]
    if not done:
        return Measurement(runs, 0.0, 0.0, pad_note, cache_note, refused, compiled=compiled)
    # Teacher-forced forward of every generated row *alone* (unpadded prompt + its tokens), with the
    # decoder start generate() used (the config may not say: T5Gemma keeps it in generation_config).
    start_id = decoder_start[0] if decoder_start else None
    items = [(r.name, i, row, r.tokens[i]) for r in done for i, row in enumerate(r.rows)]
    refs, prompt_logits, floor_measured = reference(subject, prompts, items, pad, seq2seq, start_id)
    source = ""
    if jitter is not None and not seq2seq and degenerate_floor(floor_measured, subject.dtype_name):
        # on a row of the padded batch's first prompt (the probe length; prompt 0 alone where nothing was
        # stretched): a prompt stretched past the window would double the cost of the whole reference
        row = next((item for item in items if item[2] == batch_rows[0]), items[0])
        shaken = jitter_floor(subject, prompts[row[2]], row[3], jitter)
        if shaken is not None:
            floor_measured, source = shaken, JITTER_SOURCE
    tolerance = FAIL_RATIO * noise_floor(floor_measured, subject.dtype_name)
    first_step_error = 0.0
    for run_ in done:
        for i, row in enumerate(run_.rows):
            first_step_error = max(first_step_error, relative_l2(run_.logits[i, 0], prompt_logits[row]))
            run_.errors[i] = _compare_row(run_, i, refs[(run_.name, i)], tolerance)
        run_.logits = run_.tokens = None  # judged: only the figures are kept
    return Measurement(runs, floor_measured, first_step_error, pad_note, cache_note, refused, source, compiled)


def _padded_batch(prompts: list[torch.Tensor], pad: int, seq2seq: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts as one batch and its mask: left-padded (decoder-only generation needs it), or right-padded
    (encoder inputs, by convention: _reference.right_padded)."""
    if seq2seq:
        return right_padded(prompts, pad, device)
    width = max(len(p) for p in prompts)
    batch = torch.full((len(prompts), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros_like(batch)
    for r, p in enumerate(prompts):
        batch[r, width - len(p):], mask[r, width - len(p):] = p, 1
    return batch, mask


def _generated(model: Any, generate: Any, alone: torch.Tensor, padded: tuple[torch.Tensor, torch.Tensor, list[int]],
               refused: str, only: set[str] | None) -> list[Run]:
    """Every generate() run (prompt 0 alone and the padded batch (ids, mask, prompt of each row), per cache kind;
    those in `only` where given), each with its logits and tokens, or the crash or refusal it met."""
    runs: list[Run] = []
    batch, mask, batch_rows = padded
    for kind in ("dynamic",) if refused else ("dynamic", "static"):  # else run on any model using Cache objects
        for variant, ids, attn, rows in (("single", alone[None], torch.ones_like(alone)[None], [0]),
                                         ("batch", batch, mask, list(batch_rows))):
            run_ = Run(kind, variant, rows)
            if only is not None and run_.name not in only:
                continue
            runs.append(run_)
            result, run_.crashed, run_.refused = generate_guarded(model, generate, ids, attn,
                                                                  None if kind == "dynamic" else "static")
            if result is not None:
                run_.logits, run_.tokens, run_.compiled_calls = result
    return runs


def _compare_row(run_: Run, row: int, ref: torch.Tensor, tolerance: float) -> list[float]:
    """Per-step errors of one generated row (`row` of the run) against its teacher-forced logits at the generated
    positions ([N, V]), up to the first token that differs (later steps see other prefixes); a mismatch beyond a
    near-tie of the forward's top two is a token failure."""
    errs: list[float] = []
    for k in range(run_.logits.shape[1]):
        want, got = ref[k], run_.logits[row, k]
        errs.append(relative_l2(got, want))
        token = int(run_.tokens[row, k])
        if token != int(got.argmax()):
            run_.notes.append(f"row {row} step {k}: a logits processor chose the token; stopped comparing")
            break
        if token != int(want.argmax()):
            top2 = want.topk(2).values
            gap = float(top2[0] - top2[1])
            tie = 2 * tolerance * float(want.double().norm())
            if gap <= tie:
                run_.notes.append(f"row {row} step {k}: near-tie token mismatch (gap {gap:.2e} <= {tie:.2e}); "
                                  "stopped comparing the row")
            elif run_.token_failure is None:
                run_.token_failure = (row, k, gap, tie)
            else:
                run_.notes.append(f"row {row} step {k}: token differs too (gap {gap:.2e} > {tie:.2e})")
            break
    return errs


def _report(subject: Subject, m: Measurement, verdicts: dict[str, FloorVerdict], arbitration: Any,
            lengths: tuple[int, list[int]], new_tokens: int) -> CheckResult:
    seq2seq, dtype = subject.kind == "seq2seq", subject.dtype_name
    floor = noise_floor(m.floor, dtype)
    tolerance = FAIL_RATIO * floor
    done, crashed = m.done, [r for r in m.runs if r.crashed]
    status_of = {r.name: verdicts[r.name].status for r in done} | {r.name: Status.FAIL for r in crashed}
    failing = [r for r in m.runs if status_of[r.name] is Status.FAIL]
    status = Status.worst(list(status_of.values()))
    rows, (alone, lens) = [], lengths
    tail, compiled = compiled_path(subject, m.compiled, {r.name: r.compiled_calls[0] for r in m.runs})
    details: dict[str, Any] = {**compiled, "prompt_lengths": lens, "alone_prompt_length": alone,
                               "new_tokens": new_tokens, "padding": "right (encoder input)" if seq2seq else "left",
                               "floor_source": m.floor_source or (
                                   ("padded encoder batch vs each encoder alone" if seq2seq else
                                    "short prompt prefixes vs the teacher-forced forward") + " (max per position)"),
                               "runs": {}, **arbitration.details}
    for r in m.runs:
        if r.crashed or r.refused:  # a crash FAILs the run; a refusal by transformers is not judged
            key, why, st = ("crashed", r.crashed, Status.FAIL) if r.crashed else ("refused", r.refused, Status.SKIP)
            rows.append((r.name, "-", "-", "-", "-", f"{key}: {why}"))
            details["runs"][r.name] = {key: why, "status": st}
            continue
        where = _first_bad(r, tolerance) if status_of[r.name] is Status.FAIL else None
        rows.append((r.name, len(r.rows), f"{r.max_error:.3e}", f"{floor:.2e}", f"{r.max_error / floor:.3g}",
                     where or "-"))
        details["runs"][r.name] = {"status": status_of[r.name], "step_errors": {str(k): e for k, e in r.errors.items()},
                                   "first_difference": where, "notes": r.notes, "reason": verdicts[r.name].reason}
    table = Table("generate() vs teacher-forced forward", ("run", "rows", "max step error", "noise floor", "ratio",
                                                           "first row/step that differs"), tuple(rows))
    refused = [f"{r.name} refused by transformers ({r.refused})" for r in m.runs if r.refused]
    window = _window_refusal(subject, lens[0], new_tokens) if alone == lens[0] else ""
    for key, note in (("pad_note", m.pad_note), ("cache_note", m.cache_note), ("static_not_run", m.static_note),
                      ("refused_note", "; ".join(refused)), ("window_not_reached", window and f"decoding past "
                                                                 f"the window not judged: {window}")):
        if note:
            details[key] = note
            tail += f"; static cache not run: {note}" if key == "static_not_run" else f"; note: {note}"
    if failing and failing[0].crashed:
        worst = failing[0]
        summary = f"{worst.name} crashed: {worst.crashed} (a generate() call transformers accepts for this model){tail}"
        return SPEC.result(Status.FAIL, summary, {"runs_judged": len(done)}, details, (table,))
    worst = failing[0] if failing else max(done, key=lambda r: r.max_error)
    v = verdicts[worst.name]
    metrics = {"error": v.residual, "noise_floor": v.noise_floor, "ratio": v.residual / floor, "tolerance": tolerance,
               "first_step_error": m.first_step_error, "runs_judged": len(done), **arbitration.metrics}
    if status is Status.FAIL:
        where = _first_bad(worst, tolerance) or "?"
        details["first_difference"] = {"run": worst.name, "where": where}
        summary = (f"{worst.name}: {where}{arbitration.clause(worst.name)} (noise floor {floor:.2g}; failing: "
                   f"{', '.join(r.name for r in failing)}){tail}")
    elif status is Status.WARN:
        summary = f"{worst.name}: {v.reason}{tail}"
    else:
        summary = (f"generate() matches the forward pass: max step error {v.residual:.3g} = {v.residual / floor:.3g}x "
                   f"noise floor {floor:.2g}{arbitration.clause(worst.name)} ({len(done)} runs, "
                   f"{_prompt_words(alone, lens)}, {new_tokens} new){tail}")
    details["reason"] = v.reason
    return SPEC.result(status, summary, metrics, details, (table,))


def _prompt_words(alone: int, lens: list[int]) -> str:
    """The prompt lengths as the summary says them (the prompt alone apart where it is not the batch's first)."""
    batch = "/".join(map(str, lens))
    return f"prompts {batch} tokens" if alone == lens[0] else f"prompt {alone} tokens alone, batch {batch}"


def _first_bad(r: Run, tolerance: float) -> str | None:
    """The first (step, row) whose logits leave the tolerance, or the token failure if earlier."""
    best: tuple[int, int, str] | None = None
    for row, errs in r.errors.items():
        for k, err in enumerate(errs):
            if not (err <= tolerance):
                text = (f"row {row} step {k} logits differ by {err:.3g} = "
                        f"{err / (tolerance / FAIL_RATIO):.3g}x the floor")
                if best is None or (k, row) < best[:2]:
                    best = (k, row, text)
                break
    if r.token_failure is not None:
        row, k, gap, tie = r.token_failure
        if best is None or (k, row) < best[:2]:
            best = (k, row, f"row {row} step {k} token differs (forward top-2 gap {gap:.3g} > tie tolerance {tie:.2g})")
    return None if best is None else best[2]
