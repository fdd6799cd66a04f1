"""generate, in words: the table of runs, the details, and the summary of the worst run (or why all agree)."""

from __future__ import annotations

from typing import Any

from posdiag.checks.generate.inputs import window_refusal
from posdiag.checks.generate.runs import Measurement, Run
from posdiag.model.caches import compiled_path
from posdiag.model.subject import Subject
from posdiag.results import Status, Table
from posdiag.verdict import FAIL_RATIO, FloorVerdict, noise_floor


def report(subject: Subject, m: Measurement, verdicts: dict[str, FloorVerdict], arbitration: Any,
           lengths: tuple[int, list[int]], new_tokens: int) -> tuple[Status, str, dict, dict, tuple[Table, ...]]:
    """The result's parts (status, summary, metrics, details, tables): every run's row, the worst run's words."""
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
        where = first_bad(r, tolerance) if status_of[r.name] is Status.FAIL else None
        rows.append((r.name, len(r.rows), f"{r.max_error:.3e}", f"{floor:.2e}", f"{r.max_error / floor:.3g}",
                     where or "-"))
        details["runs"][r.name] = {"status": status_of[r.name], "step_errors": {str(k): e for k, e in r.errors.items()},
                                   "first_difference": where, "notes": r.notes, "reason": verdicts[r.name].reason}
    table = Table("generate() vs teacher-forced forward", ("run", "rows", "max step error", "noise floor", "ratio",
                                                           "first row/step that differs"), tuple(rows))
    refused = [f"{r.name} refused by transformers ({r.refused})" for r in m.runs if r.refused]
    window = window_refusal(subject, lens[0], new_tokens) if alone == lens[0] else ""
    for key, note in (("pad_note", m.pad_note), ("cache_note", m.cache_note), ("static_not_run", m.static_note),
                      ("refused_note", "; ".join(refused)), ("window_not_reached", window and f"decoding past "
                                                                 f"the window not judged: {window}")):
        if note:
            details[key] = note
            tail += f"; static cache not run: {note}" if key == "static_not_run" else f"; note: {note}"
    if failing and failing[0].crashed:
        worst = failing[0]
        summary = f"{worst.name} crashed: {worst.crashed} (a generate() call transformers accepts for this model){tail}"
        return Status.FAIL, summary, {"runs_judged": len(done)}, details, (table,)
    worst = failing[0] if failing else max(done, key=lambda r: r.max_error)
    v = verdicts[worst.name]
    metrics = {"error": v.residual, "noise_floor": v.noise_floor, "ratio": v.residual / floor, "tolerance": tolerance,
               "first_step_error": m.first_step_error, "runs_judged": len(done), **arbitration.metrics}
    if status is Status.FAIL:
        where = first_bad(worst, tolerance) or "?"
        details["first_difference"] = {"run": worst.name, "where": where}
        summary = (f"{worst.name}: {where}{arbitration.clause(worst.name)} (noise floor {floor:.2g}; failing: "
                   f"{', '.join(r.name for r in failing)}){tail}")
    elif status is Status.WARN:
        summary = f"{worst.name}: {v.reason}{tail}"
    else:
        summary = (f"generate() matches the forward pass: max step error {v.residual:.3g} = {v.residual / floor:.3g}x "
                   f"noise floor {floor:.2g}{arbitration.clause(worst.name)} ({len(done)} runs, "
                   f"{prompt_words(alone, lens)}, {new_tokens} new){tail}")
    details["reason"] = v.reason
    return status, summary, metrics, details, (table,)


def prompt_words(alone: int, lens: list[int]) -> str:
    """The prompt lengths as the summary says them (the prompt alone apart where it is not the batch's first)."""
    batch = "/".join(map(str, lens))
    return f"prompts {batch} tokens" if alone == lens[0] else f"prompt {alone} tokens alone, batch {batch}"


def first_bad(r: Run, tolerance: float) -> str | None:
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
