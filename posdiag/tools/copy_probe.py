"""copy probe — can the model still copy at lengths past the one it was trained at?

Repeated random tokens, [BOS] x_1 .. x_n x_1 .. x_n (x distinct ordinary ids): a model that copies
predicts x_(i+1) at the second occurrence of x_i, by attending back exactly n tokens (the induction
pattern). RoPE makes that attention depend on the offset n only, so whether it survives past the
training length L is the question the rotary phases answer: pairs whose wavelength exceeds L never
saw offsets beyond L in training (`posdiag rope` explains which). Accuracy is measured by sequence
length and by position (teacher-forced argmax, one batched forward: rows padded on the right, which a
causal model never sees). The declared context (max_position_embeddings) is the reference length.

Verdict: SKIP when the model does not copy even within its context (accuracy not significantly above
chance: a random model says nothing about extrapolation); WARN when accuracy past the declared context
is significantly lower than within it (two-proportion z-test, z > 3: evidence, not a threshold);
PASS otherwise. Never FAIL: losing the copy past the trained length is a property of the model, not a
position-injection bug.
"""

from __future__ import annotations

import math

import torch

from posdiag.model.logits import score_targets
from posdiag.model.subject import Subject
from posdiag.results import CheckResult, Status, Table

ROWS_PER_LENGTH = 16
Z_SIGNIFICANT = 3.0


def run(subject: Subject, lengths: list[int], seed: int = 0) -> CheckResult:
    """Plan the lengths, measure the copy at each, judge within the declared context against beyond it."""
    if subject.kind != "causal":
        return CheckResult("copy", Status.SKIP, f"the copy probe needs a causal language model ({subject.kind} given)")
    bos = getattr(subject.config, "bos_token_id", None)
    prefix = [bos] if isinstance(bos, int) and 0 <= bos < subject.vocab_size else []
    plan = _plan(lengths, prefix)
    if isinstance(plan, CheckResult):
        return plan
    measured = _measure(subject, prefix, plan, seed)
    if isinstance(measured, CheckResult):
        return measured
    per_length, by_position = measured
    return _judge(subject, prefix, per_length, by_position)


def _plan(lengths: list[int], prefix: list[int]) -> list[tuple[int, int]] | CheckResult:
    """(length asked, copy distance n) per length; SKIP when one is too short to copy."""
    plan = []
    for length in sorted({int(x) for x in lengths}):
        n = (length - len(prefix)) // 2
        if n < 2:
            return CheckResult("copy", Status.SKIP,
                               f"length {length} is too short to copy (needs at least {len(prefix) + 4})")
        plan.append((length, n))
    return plan


def _measure(subject: Subject, prefix: list[int], plan: list[tuple[int, int]],
             seed: int) -> tuple[list[dict], dict[int, list[int]]] | CheckResult:
    """The hits per length, and pooled by target position ([correct, total]); SKIP without logits, FAIL on
    non-finite ones."""
    per_length = []
    by_position: dict[int, list[int]] = {}
    for i, (length, n) in enumerate(plan):
        hit = _copy_hits(subject, prefix, n, seed + 101 * i)
        if hit is None:
            return CheckResult("copy", Status.SKIP, "the model returns no logits: nothing to read a copied token from")
        if isinstance(hit, str):
            return CheckResult("copy", Status.FAIL, hit)
        start = len(prefix) + n  # position of the second x_1; it predicts x_2 at start + 1
        for j in range(n - 1):
            cell = by_position.setdefault(start + 1 + j, [0, 0])
            cell[0] += int(hit[:, j].sum())
            cell[1] += hit.shape[0]
        per_length.append({"length": len(prefix) + 2 * n, "asked": length, "distance": n,
                           "correct": int(hit.sum()), "total": hit.numel(), "accuracy": float(hit.float().mean())})
    return per_length, by_position


def _judge(subject: Subject, prefix: list[int], per_length: list[dict],
           by_position: dict[int, list[int]]) -> CheckResult:
    """Accuracy within the declared context against chance (does it copy at all?), then beyond it against
    within (does the copy survive?)."""
    ordinary = subject.vocab_size - len(subject.special_ids() | set(range(min(4, subject.vocab_size))))
    chance = 1.0 / max(1, ordinary)
    declared = subject.max_positions
    reference = declared if declared is not None else max(p["length"] for p in per_length)
    inside = [p for p in per_length if p["length"] <= reference]
    outside = [p for p in per_length if p["length"] > reference]
    acc_in, n_in = _pool(inside)
    metrics = {"reference_length": reference, "accuracy_within": acc_in, "accuracy_beyond": _pool(outside)[0],
               "chance": chance, "rows_per_length": ROWS_PER_LENGTH}
    details = {"lengths": per_length, "reference": "declared context (max_position_embeddings)" if declared else
               "no declared context: the longest length probed", "bos_prefix": bool(prefix),
               "accuracy_by_position": {str(k): v[0] / v[1] for k, v in sorted(by_position.items())}}
    tables = (_length_table(per_length, reference), _position_table(by_position, reference))

    def verdict(status: Status, summary: str) -> CheckResult:
        return CheckResult("copy", status, summary, metrics, details, tables)

    if not inside:
        return verdict(Status.SKIP, f"no probed length fits the declared context ({reference} tokens): "
                       f"nothing to compare against")
    z_copy = _z(acc_in, n_in, chance)
    metrics["z_above_chance"] = z_copy
    if z_copy < Z_SIGNIFICANT:
        return verdict(Status.SKIP, f"the model does not copy within {reference} tokens (accuracy {acc_in:.3f}, "
                       f"chance {chance:.3f}): the probe cannot speak to longer lengths")
    if not outside:
        return verdict(Status.PASS, f"copy accuracy {acc_in:.3f} up to {reference} tokens; no length beyond the "
                       f"declared context was probed")
    return _judge_beyond(verdict, metrics, inside, outside, reference)


def _judge_beyond(verdict, metrics: dict, inside: list[dict], outside: list[dict], reference: int) -> CheckResult:
    """WARN when accuracy past the declared context is significantly lower than within it (z > 3)."""
    acc_in, n_in = _pool(inside)
    acc_out, n_out = _pool(outside)
    z_drop = _two_proportion_z(acc_in, n_in, acc_out, n_out)
    metrics["z_drop"] = z_drop
    first_bad = next((p for p in outside if _two_proportion_z(acc_in, n_in, p["accuracy"], p["total"]) > Z_SIGNIFICANT),
                     None)
    if z_drop > Z_SIGNIFICANT and first_bad is not None:
        worst = min(outside, key=lambda p: p["accuracy"])
        metrics["degrades_from_length"] = first_bad["length"]
        return verdict(
            Status.WARN,
            f"copy accuracy falls past the declared context of {reference} tokens: {acc_in:.3f} within, "
            f"{first_bad['accuracy']:.3f} at length {first_bad['length']} (copy distance {first_bad['distance']}), "
            f"{worst['accuracy']:.3f} at length {worst['length']} (z = {z_drop:.1f})")
    return verdict(Status.PASS, f"copy accuracy holds past the declared context of {reference} tokens: "
                   f"{acc_in:.3f} within, {acc_out:.3f} beyond (z = {z_drop:.1f})")


def _copy_hits(subject: Subject, prefix: list[int], n: int, seed: int) -> torch.Tensor | str | None:
    """[ROWS_PER_LENGTH, n - 1] argmax hits on the second copy's x_2 .. x_n; a string when the logits are not finite;
    None when the model returns no logits. Rows of one length run together, without padding, and each chunk of rows
    is reduced to its hits as it comes out (posdiag.model.logits): full-vocabulary logits never exist for more rows
    than one chunk (all rows of all lengths at once were 23 GB at length 1024 on a 49k vocabulary)."""
    x = subject.sample_ids(ROWS_PER_LENGTH, n, seed).cpu()
    ids = torch.cat([torch.tensor([prefix] * ROWS_PER_LENGTH, dtype=torch.long).reshape(ROWS_PER_LENGTH, -1), x, x],
                    dim=1)
    targets = torch.full_like(ids, -1)
    start = len(prefix) + n
    targets[:, start:start + n - 1] = ids[:, start + 1:start + n]
    try:
        scores = score_targets(subject, ids, targets)
    except ValueError:
        return None
    scored = targets >= 0
    if not torch.isfinite(scores.logprob[scored]).all():
        return "non-finite logits on the copy probe"
    return scores.hit[:, start:start + n - 1]


def _pool(entries: list[dict]) -> tuple[float, int]:
    total = sum(p["total"] for p in entries)
    return (sum(p["correct"] for p in entries) / total if total else float("nan")), total


def _z(p: float, n: int, p0: float) -> float:
    return (p - p0) / math.sqrt(max(p0 * (1 - p0), 1e-12) / n)


def _two_proportion_z(p1: float, n1: int, p2: float, n2: int) -> float:
    pooled = (p1 * n1 + p2 * n2) / (n1 + n2)
    se = math.sqrt(max(pooled * (1 - pooled), 1e-12) * (1 / n1 + 1 / n2))
    return (p1 - p2) / se


def _length_table(per_length: list[dict], reference: int) -> Table:
    rows = tuple((p["length"], p["distance"], f"{p['accuracy']:.3f}", _bar(p["accuracy"]),
                  "" if p["length"] <= reference else "beyond context") for p in per_length)
    return Table("copy accuracy by sequence length", ("length", "copy distance", "accuracy", "", ""), rows)


def _position_table(by_position: dict[int, list[int]], reference: int, buckets: int = 8) -> Table:
    """Accuracy by target position, in buckets of reference/2 tokens (so the declared context is a boundary)."""
    width = max(1, reference // 2)
    pooled: dict[int, list[int]] = {}
    for pos, (hit, total) in by_position.items():
        cell = pooled.setdefault(pos // width, [0, 0])
        cell[0] += hit
        cell[1] += total
    rows = tuple((f"{b * width}-{(b + 1) * width - 1}", f"{hit / total:.3f}", _bar(hit / total),
                  "" if (b + 1) * width <= reference else "beyond context")
                 for b, (hit, total) in sorted(pooled.items()))
    return Table("copy accuracy by position (all lengths)", ("positions", "accuracy", "", ""), rows)


def _bar(fraction: float, width: int = 20) -> str:
    filled = int(round(max(0.0, min(1.0, fraction)) * width))
    return "#" * filled + "." * (width - filled)
