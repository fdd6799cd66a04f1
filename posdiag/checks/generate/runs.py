"""generate, measuring: every generate() run (prompt alone, padded batch; dynamic and static cache) against the
forward of each row alone, teacher-forced, step by step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from posdiag.checks._reference import JITTER_SOURCE, jitter_floor, reference
from posdiag.checks.generate.inputs import pad_id, padded_batch
from posdiag.model.caches import (
    cache_layer_note,
    compile_kwargs,
    compiled_forwards,
    generate_guarded,
    new_cache,
    static_cache_refusal,
)
from posdiag.model.subject import Subject
from posdiag.model.tensors import relative_l2
from posdiag.verdict import FAIL_RATIO, degenerate_floor, noise_floor, worst_error


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


def measure(subject: Subject, prompts: list[torch.Tensor], batch_rows: list[int], new_tokens: int,
             only: set[str] | None = None, jitter: int | None = None, compiled: bool = False) -> Measurement:
    """Every generate() run (those named in `only`: the float64 re-run) against the teacher-forced forward: prompt 0
    alone, the prompts `batch_rows` as a padded batch; `jitter` (the seed) re-measures a degenerate floor in the run
    dtype (_reference.jitter_floor)."""
    model, seq2seq = subject.model, subject.kind == "seq2seq"
    pad, pad_note = pad_id(subject)
    cache_note = cache_layer_note(subject)
    batch, mask = padded_batch([prompts[r] for r in batch_rows], pad, seq2seq, subject.device)
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
    runs = generated(model, generate, prompts[0], (batch, mask, batch_rows), refused, only)
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
            run_.errors[i] = compare_row(run_, i, refs[(run_.name, i)], tolerance)
        run_.logits = run_.tokens = None  # judged: only the figures are kept
    return Measurement(runs, floor_measured, first_step_error, pad_note, cache_note, refused, source, compiled)


def generated(model: Any, generate: Any, alone: torch.Tensor, padded: tuple[torch.Tensor, torch.Tensor, list[int]],
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


def compare_row(run_: Run, row: int, ref: torch.Tensor, tolerance: float) -> list[float]:
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
