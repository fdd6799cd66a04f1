"""cache — KV-cache decoding must reproduce one full forward, step by step.

A causal stack computes the output at position t from tokens 0..t only, so feeding the
sequence in pieces through a KV cache must give, at every position, the logits of one
full forward: f_cached(x)[t] = f(x)[t] in exact arithmetic. We run the same tokens as
(a) a prefill then single-token decode steps, (b) a prefill then multi-token chunks
(q_len > 1 against a cache: FlashAttention-style bottom-right causal alignment), and
(c) chunked prefill from an empty cache, each with the cache `generate()` would build by
default (DynamicCache from the config: sliding layers keep only the window) and with a
pre-allocated StaticCache (its key length is max_cache_len, not the tokens seen) where the
model declares static-cache support. Sliding-window models run past the window.
Per step error = ||cached − full|| / ||full|| over the step's positions; the noise floor is
measured in the same run: cache-free forwards of prefixes of the same tokens must equal the
full forward at those positions (they differ only by matmul shapes), max per position.
Verdict: posdiag.verdict.judge_agreement(max step error, floor, dtype).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from posdiag.checks._shared import (
    cache_layer_note,
    cache_support,
    new_cache,
    output_of,
    static_support,
)
from posdiag.errors import describe_error
from posdiag.model.introspect import recurrent_mixers
from posdiag.model.subject import Subject
from posdiag.model.tensors import relative_l2
from posdiag.options import RunOptions, probe_ids, probe_length
from posdiag.results import CheckResult, Status, Table
from posdiag.verdict import FAIL_RATIO, judge_agreement, noise_floor

TITLE = "KV-cache decoding vs full forward"

DECODE_STEPS = 8  # single-token steps (each is one forward); options: {"decode_steps": n}
CHUNKS = 5  # multi-token chunks after the prefill (q_len > 1 against a cache), at least 2 tokens each




# ----------------------------------------------------------------------------- the check
@dataclass
class PathResult:
    cache: str
    schedule: str
    steps: list[tuple[int, int]]  # (start, end) token ranges fed per forward
    errors: list[float] = field(default_factory=list)
    skipped: str = ""

    @property
    def name(self) -> str:
        return f"{self.cache}/{self.schedule}"

    @property
    def max_error(self) -> float:
        return max(self.errors) if self.errors else 0.0


def _schedules(length: int, decode_steps: int) -> dict[str, list[tuple[int, int]]]:
    steps = max(1, min(decode_steps, length // 2))
    prefill = length - steps
    decode = [(0, prefill)] + [(t, t + 1) for t in range(prefill, length)]
    start = max(1, length // 4)
    chunk = max(2, -(-(length - start) // CHUNKS))
    chunks = [(0, start)] + [(t, min(t + chunk, length)) for t in range(start, length, chunk)]
    if chunks[-1][1] - chunks[-1][0] == 1:  # a 1-token tail would be a decode step: merge it
        chunks[-2:] = [(chunks[-2][0], length)]
    size = -(-length // 3)
    chunked = [(t, min(t + size, length)) for t in range(0, length, size)]
    return {"decode": decode, "chunks": chunks, "chunked_prefill": chunked}


def _length(subject: Subject, options: RunOptions) -> int:
    """Probe length, extended past the sliding window (plus the decode steps) where there is one."""
    length = probe_length(subject, options)
    window = subject.sliding_window
    declared = subject.max_positions
    if window and options.token_ids is None:
        want = 2 * window + 4
        if length < want:
            length = want if declared is None else min(want, declared)
    return length


def run(subject: Subject, options: RunOptions) -> CheckResult:
    ok, why = cache_support(subject)
    if not ok:
        return CheckResult("cache", Status.SKIP, why)
    settings = options.for_check("cache")
    length = _length(subject, options)
    if options.token_ids is None:
        ids = subject.sample_ids(1, length, options.seed)
    else:
        ids = probe_ids(subject, options)[:1]
    dtype = subject.dtype_name
    model = subject.model
    seq2seq = subject.kind == "seq2seq"

    encoder_outputs = None
    if seq2seq:  # the decoder is what caches; one fixed encoder input (the same ids)
        with torch.inference_mode():
            encoder_outputs = model.get_encoder()(input_ids=ids, return_dict=True)
        subject.forward_count += 1

    def forward(chunk: torch.Tensor, cache: Any = None) -> torch.Tensor:
        subject.forward_count += 1
        kwargs: dict[str, Any] = {"cache": cache, "use_cache": cache is not None, "return_dict": True}
        with torch.inference_mode():
            if seq2seq:
                out = model(encoder_outputs=encoder_outputs, decoder_input_ids=chunk, **kwargs)
            else:
                out = model(input_ids=chunk, **kwargs)
        return output_of(out)[0].float()

    schedules = _schedules(length, int(settings.get("decode_steps", DECODE_STEPS)))
    full = forward(ids)

    # Noise floor: cache-free prefixes must reproduce the full forward at their positions.
    prefixes = sorted({end for sched in schedules.values() for _, end in sched[:1]} - {length})
    floor_measured = 0.0
    for end in prefixes:
        part = forward(ids[:, :end])
        floor_measured = max(floor_measured, max(relative_l2(part[t], full[t]) for t in range(end)))
    if not torch.isfinite(full).all():
        return CheckResult("cache", Status.FAIL, "non-finite outputs in the full forward",
                           details={"seq_len": length})
    floor = noise_floor(floor_measured, dtype)

    kinds = ["dynamic", "static"]
    static_ok, static_why = static_support(subject)
    paths: list[PathResult] = []
    for kind in kinds:
        for sched_name, sched in schedules.items():
            path = PathResult(kind, sched_name, sched)
            paths.append(path)
            if kind == "static" and not static_ok:
                path.skipped = static_why
                continue
            cache = new_cache(subject, kind, max_len=length + 7,
                              encoder_len=ids.shape[1] if seq2seq else 0)
            try:
                for start, end in sched:
                    out = forward(ids[:, start:end], cache)
                    path.errors.append(relative_l2(out, full[start:end]))
            except Exception as exc:
                if kind == "dynamic":
                    raise
                # The static path of a model that claims support crashed (measured: Falcon with
                # ALiBi builds its bias over the query length, not the static key length).
                static_ok, static_why = False, f"static cache not runnable: {describe_error(exc)}"
                path.skipped = static_why
                path.errors = []

    judged = [p for p in paths if not p.skipped]
    if not judged:
        return CheckResult("cache", Status.SKIP, "no cache path could be run",
                           details={"skipped": {p.name: p.skipped for p in paths}})
    verdicts = {p.name: judge_agreement(p.max_error, floor_measured, dtype) for p in judged}
    failing = [p for p in judged if verdicts[p.name].status is Status.FAIL]
    worst = failing[0] if failing else max(judged, key=lambda p: p.max_error)  # first failing path, in run order
    status = Status.worst([v.status for v in verdicts.values()])
    tolerance = FAIL_RATIO * floor

    def first_bad(p: PathResult) -> tuple[int, tuple[int, int]] | None:
        for i, err in enumerate(p.errors):
            if not (err <= tolerance):
                return i, p.steps[i]
        return None

    rows = []
    details: dict[str, Any] = {"seq_len": length, "sliding_window": subject.sliding_window,
                               "floor_source": "cache-free prefix forwards vs the full forward (max per position)",
                               "prefix_lengths": prefixes, "paths": {}}
    for p in paths:
        if p.skipped:
            rows.append((p.name, len(p.steps), "-", "-", "-", f"skipped: {p.skipped}"))
            details["paths"][p.name] = {"skipped": p.skipped}
            continue
        bad = first_bad(p)
        where = "-" if bad is None else _step_name(p, bad[0])
        rows.append((p.name, len(p.steps), f"{p.max_error:.3e}", f"{floor:.2e}", f"{p.max_error / floor:.3g}", where))
        details["paths"][p.name] = {"step_errors": p.errors, "steps": p.steps, "first_diverging_step": where,
                                    "status": verdicts[p.name].status}
    table = Table("cached decoding vs full forward", ("path", "forwards", "max step error", "noise floor", "ratio",
                                                      "first diverging step"), tuple(rows))
    v = verdicts[worst.name]
    metrics = {"error": v.residual, "noise_floor": v.noise_floor, "ratio": v.ratio, "tolerance": tolerance,
               "paths_judged": len(judged)}
    skipped = sorted({p.skipped for p in paths if p.skipped})
    tail = f"; skipped: {'; '.join(skipped)}" if skipped else ""
    note = cache_layer_note(subject)
    if note:
        details["cache_note"] = note
        tail += f"; note: {note}"
    recurrent = recurrent_mixers(subject.model)
    if status is Status.FAIL and recurrent:
        # A recurrent mixer's cached step and its full-sequence scan are different algorithms (a
        # recurrence vs a chunked parallel scan) whose rounding the floor, measured on cache-free
        # prefixes, does not bound: healthy Bamba differs 2.4e3x, Jamba's chunked path 117x.
        status = Status.WARN
        details["recurrent_mixers"] = recurrent
    if status in (Status.FAIL, Status.WARN) and failing:
        bad = first_bad(worst)
        step = _step_name(worst, bad[0]) if bad else "?"
        err = worst.errors[bad[0]] if bad else worst.max_error
        details["first_diverging"] = {"path": worst.name, "step": step, "error": err}
        summary = (f"{worst.name}: {step} differs from the full forward by {err:.3g} = {err / floor:.3g}x the noise "
                   f"floor {floor:.2g} (failing: {', '.join(p.name for p in failing)}){tail}")
        if status is Status.WARN:
            summary = (f"inconclusive: {summary}; the model has recurrent mixers ({', '.join(recurrent)}) whose cached "
                       f"step and full-sequence scan are different algorithms, not bounded by this floor")
    else:
        summary = (f"cached decoding matches the full forward: max step error {v.residual:.3g} = {v.ratio:.3g}x "
                   f"noise floor {v.noise_floor:.2g} ({len(judged)} paths, {length} tokens){tail}")
    details["reason"] = v.reason
    return CheckResult("cache", status, summary, metrics, details, (table,))


def _step_name(p: PathResult, index: int) -> str:
    start, end = p.steps[index]
    span = f"position {start}" if end - start == 1 else f"positions {start}-{end - 1}"
    return f"step {index} ({span})"
