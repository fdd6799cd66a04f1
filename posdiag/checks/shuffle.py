"""shuffle — permute the tokens; if the outputs merely permute, position never entered.

Attention without positions is permutation-equivariant: (P X) W = P (X W) and a row-wise
softmax commutes with row permutation, so f(P x, P M Pᵀ) = P f(x, M) for any mask M
permuted with the tokens. We keep position_ids = arange while permuting tokens and mask,
and measure residual = ||f(P x, P M Pᵀ) − P f(x)|| / ||f(x)||. The noise floor comes from
the same run: the *consistent* permutation (tokens, mask and position ids permuted
together) must reproduce P f(x) exactly in exact arithmetic, so its residual is rounding.
Causal stacks need an explicit mask, so its fidelity is measured first (probe.Fidelity).

Models with recurrent / linear-attention / convolutional mixers (posdiag.model.introspect) read order through the
recurrence, so no consistent permutation exists: the floor is then the baseline row with its token
embeddings jittered by ~1 ulp (see `positions`), and a PASS says that order enters the model, not that
positions reach its attention layers (`positions`, `shift` and `rope` judge those).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from posdiag.checks._shared import FLOOR_SOURCE, jittered, layer_name
from posdiag.model.introspect import attention_free, recurrent_mixers, recurrent_reason
from posdiag.model.probe import (
    Row,
    fidelity_rows,
    judge_fidelity,
    moving_permutations,
    run_rows,
)
from posdiag.model.subject import Subject
from posdiag.model.tensors import relative_l2
from posdiag.options import RunOptions, probe_ids
from posdiag.results import CheckResult, Status, Table, combine_stacks
from posdiag.verdict import PASS_RATIO, judge_position_signal, noise_floor

TITLE = "Permutation equivariance"

# --baseline watches these: a collapsing ratio means position is fading out of the model.
BASELINE_METRICS = {"ratio": "higher"}


def run(subject: Subject, options: RunOptions) -> CheckResult:
    return combine_stacks("shuffle", [_run_stack(subject, options, stack) for stack in subject.stacks])


def _run_stack(subject: Subject, options: RunOptions, stack: str) -> CheckResult:
    causal = stack == "decoder" and subject.kind != "encoder"
    dtype = subject.dtype_name
    if causal:
        ok, why = subject.explicit_mask_supported
        if not ok:
            return CheckResult("shuffle", Status.SKIP, f"cannot permute the causal mask: {why}", details={"stack": stack})

    if attention_free(subject.model):
        return CheckResult("shuffle", Status.SKIP,
                           f"{recurrent_reason(subject)}; and no layer is attention, so there is no mask to permute: "
                           f"order enters through the recurrence by construction", details={"stack": stack})
    ids = probe_ids(subject, options)[0]
    length = ids.shape[0]
    perms = [p.to(subject.device) for p in moving_permutations(length, options.permutations, options.seed + 7919)]
    recurrent = recurrent_mixers(subject.model)
    consistent = subject.family.takes_position_ids and not recurrent

    # One batched forward: [fidelity rows (causal only) | baseline | permuted... | consistent... | jittered]
    rows: list[Row] = []
    fidelity_where = None
    if causal:
        fid_rows, fidelity_where = fidelity_rows(ids)
        rows += fid_rows  # rows[0] is also the baseline
    else:
        rows.append(Row(ids))
    first_perm = len(rows)
    rows += [Row(ids[p], order=p) for p in perms]
    first_consistent = len(rows)
    if consistent:
        rows += [Row(ids[p], order=p, positions=p) for p in perms]
    jitter_row = len(rows) if recurrent else None
    if recurrent:
        rows.append(Row(ids))
    # Encoder-decoders: the decoder is tested against one fixed encoder input for every row.
    encoder_ids = ids[None].expand(len(rows), -1) if subject.kind == "seq2seq" and stack == "decoder" else None
    with jittered(subject, stack, jitter_row, len(rows), options.seed) if recurrent else _nothing() as has_jitter:
        out = run_rows(subject, rows, stack=stack, encoder_ids=encoder_ids)
    base = [h[0] for h in out.hidden]

    if not all(torch.isfinite(h).all() for h in out.hidden):
        bad = next(i for i, h in enumerate(out.hidden) if not torch.isfinite(h).all())
        return CheckResult("shuffle", Status.FAIL, f"non-finite hidden states at {layer_name(bad)}",
                           details={"stack": stack, "first_non_finite_layer": layer_name(bad)})

    layers = len(base)
    residual = [[relative_l2(out.hidden[l][first_perm + i], base[l][p]) for i, p in enumerate(perms)] for l in range(layers)]
    floor = [[relative_l2(out.hidden[l][first_consistent + i], base[l][p]) for i, p in enumerate(perms)]
             if consistent else [relative_l2(out.hidden[l][jitter_row], base[l]) if has_jitter else 0.0]
             for l in range(layers)]

    final_residual = min(residual[-1])
    final_floor = max(floor[-1])
    floor_source = "consistent permutation (tokens, mask and position ids permuted together)" if consistent else \
        f"{dtype} machine epsilon ({subject.family.name} derives positions inside: no consistent permutation)"
    if recurrent:
        floor_source = (f"{FLOOR_SOURCE if has_jitter else f'{dtype} machine epsilon'} ({subject.family.name} has "
                        f"recurrent sequence mixers: no consistent permutation)")
    details: dict = {"stack": stack, "seq_len": length, "permutations": len(perms), "floor_source": floor_source,
                     "residual_per_permutation": residual[-1], "floor_per_permutation": floor[-1]}
    if recurrent:
        details["recurrent_mixers"] = recurrent
    metrics: dict = {}

    if causal:
        default = run_rows(subject, [Row(ids)], stack=stack, explicit_mask=False,
                           encoder_ids=None if encoder_ids is None else encoder_ids[:1]).final[0]
        fid = judge_fidelity(default, out.final[0], out.final[1], out.final[2], fidelity_where, final_floor, dtype)
        metrics.update(fid.metrics())
        if not fid.ok:
            return CheckResult("shuffle", Status.SKIP, f"mask not faithful, no verdict: {fid.reason}",
                               metrics, details)
    if consistent and final_floor > 0 and final_residual > 0 and max(floor[-1]) >= 0.5 * final_residual:
        # Permuting position ids with the tokens did not restore P f(x): the ids are not what
        # the model positions by (an unknown family's stack deriving them inside). The consistent
        # run is then no floor; say so, don't guess.
        details["floor_source"] = f"{dtype} machine epsilon (position ids passed but not honoured)"
        floor = [[0.0] for _ in range(layers)]
        final_floor = 0.0

    verdict = judge_position_signal(final_residual, final_floor, dtype)
    table_rows = []
    enters = None
    for l in range(layers):
        r, f = min(residual[l]), noise_floor(max(floor[l]), dtype)
        if enters is None and r / f >= PASS_RATIO:
            enters = layer_name(l, layers)
        table_rows.append((layer_name(l, layers), f"{r:.3e}", f"{f:.2e}", f"{r / f:.3g}"))
    metrics.update({"residual": verdict.residual, "noise_floor": verdict.noise_floor, "ratio": verdict.ratio})
    details["position_enters_at"] = enters
    details["reason"] = verdict.reason
    where = f"; enters at {enters}" if enters and verdict.status is Status.PASS else ""
    summary = (f"{verdict.reason}: residual {verdict.residual:.3g} = {verdict.ratio:.3g}x noise floor "
               f"{verdict.noise_floor:.2g} ({len(perms)} permutations, {length} tokens{where})")
    if recurrent:
        summary += (f"; {subject.family.name} has recurrent sequence mixers ({', '.join(recurrent)}): order enters "
                    f"through the recurrence, so this shows order reaches the outputs, not that positions reach "
                    f"the attention layers (see positions, shift, rope)")
    table = Table(f"shuffle residual by layer ({stack})" if subject.kind == "seq2seq" else "shuffle residual by layer",
                  ("layer", "residual", "noise floor", "ratio"), tuple(table_rows))
    return CheckResult("shuffle", verdict.status, summary, metrics, details, (table,))


@contextlib.contextmanager
def _nothing() -> Iterator[bool]:
    yield False


