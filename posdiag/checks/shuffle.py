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
positions reach its attention layers (`positions`, `shift` and `rope` judge those). The same holds for a family
whose tokens are mixed by something other than attention (`Family.token_mixing`: FNet's Fourier transform).

A FAIL needs outputs that could carry positions: where tokens never interact (NeoMME's zero-initialised output
projections) or every attention score is equal (Zaya's zero-initialised key scale), `posdiag.model.inert` says so
and the check SKIPs with that reason instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from posdiag.checks import CheckSpec
from posdiag.model.casts import float64_throughout
from posdiag.model.inert import inert_reason
from posdiag.model.introspect import attention_free, recurrent_mixers, recurrent_reason
from posdiag.model.jitter import FLOOR_SOURCE, jittered
from posdiag.model.precision import run_finer
from posdiag.model.probe import (
    Row,
    fidelity_rows,
    judge_fidelity,
    moving_permutations,
    run_rows,
)
from posdiag.model.subject import Subject
from posdiag.model.tensors import dtype_name, layer_name, relative_l2, release_freed_memory
from posdiag.options import RunOptions, probe_ids
from posdiag.results import CheckResult, Status, Table, combine_stacks
from posdiag.verdict import PASS_RATIO, SHRINK_RATIO, FloorVerdict, judge_position_signal, noise_floor, stack_result

SPEC = CheckSpec(
    name="shuffle",
    title="Permutation equivariance",
    proves="position enters the model: permuting the tokens changes more than the order of the outputs",
    # --baseline watches the ratio: a collapsing one means position is fading out of the model.
    baseline={"ratio": "higher"},
)


def run(subject: Subject, options: RunOptions) -> CheckResult:
    return combine_stacks("shuffle", [stack_result("shuffle", stack, lambda s=stack: _run_stack(subject, options, s))
                                      for stack in subject.stacks])


def _run_stack(subject: Subject, options: RunOptions, stack: str) -> CheckResult:
    causal = stack == "decoder" and subject.kind != "encoder"
    dtype = subject.dtype_name
    if causal:
        ok, why = subject.explicit_mask_supported
        if not ok:
            return CheckResult("shuffle", Status.SKIP, f"cannot permute the causal mask: {why}",
                               details={"stack": stack})

    if attention_free(subject.language_model):
        return CheckResult("shuffle", Status.NA,
                           f"{recurrent_reason(subject)}; and no layer is attention, so there is no mask to permute: "
                           f"order enters through the recurrence by construction", details={"stack": stack})
    ids = probe_ids(subject, options)[0]
    length = ids.shape[0]
    perms = [p.to(subject.device) for p in moving_permutations(length, options.permutations, options.seed + 7919)]
    recurrent = recurrent_mixers(subject.language_model)
    mixing = subject.family.token_mixing  # not attention: it reads the storage order, like a recurrence
    # No consistent permutation where order enters otherwise, or where the ids are not taken: the floor is then the
    # jittered row, a measurement of how this stack amplifies one ulp (never the ulp itself: a deep stack's rounding
    # is 1e2-1e3 of them).
    floor_by_jitter = bool(recurrent or mixing) or not subject.family.takes_position_ids
    consistent = not floor_by_jitter

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
    jitter_row = len(rows) if floor_by_jitter else None
    if floor_by_jitter:
        rows.append(Row(ids))
    # Encoder-decoders: the decoder is tested against one fixed encoder input for every row.
    encoder_ids = ids[None].expand(len(rows), -1) if subject.kind == "seq2seq" and stack == "decoder" else None

    def measure(jitter_at: int | None = jitter_row):
        """The rows' outputs (a jittered copy of the baseline appended when `jitter_at` is past them)."""
        batch = rows if jitter_at is None or jitter_at < len(rows) else [*rows, Row(ids)]
        enc = None if encoder_ids is None else ids[None].expand(len(batch), -1)
        with jittered(subject, stack, jitter_at, len(batch), options.seed) if jitter_at is not None else _nothing() \
                as jitter_found:
            return run_rows(subject, batch, stack=stack, encoder_ids=enc), jitter_found

    def final_figures(measured) -> tuple[float, float, str]:
        """(residual, floor, floor source) at the last layer of a float64 re-run: the consistent permutation where
        it restores P f(x) better than keeping the ids, else the jittered row."""
        hidden, jitter_found = measured[0].final, measured[1]
        res = min(relative_l2(hidden[first_perm + i], hidden[0][p]) for i, p in enumerate(perms))
        if consistent:
            con = max(relative_l2(hidden[first_consistent + i], hidden[0][p]) for i, p in enumerate(perms))
            if con < 0.5 * res or not jitter_found:
                return res, con, "consistent permutation"
        return res, relative_l2(hidden[-1], hidden[0]) if jitter_found else 0.0, "baseline row jittered by ~1 ulp"

    out, has_jitter = measure()
    base = [h[0] for h in out.hidden]

    if not all(torch.isfinite(h).all() for h in out.hidden):
        bad = next(i for i, h in enumerate(out.hidden) if not torch.isfinite(h).all())
        return CheckResult("shuffle", Status.FAIL, f"non-finite hidden states at {layer_name(bad)}",
                           details={"stack": stack, "first_non_finite_layer": layer_name(bad)})

    layers = len(base)
    residual = [[relative_l2(out.hidden[l][first_perm + i], base[l][p]) for i, p in enumerate(perms)]
                for l in range(layers)]
    floor = [[relative_l2(out.hidden[l][first_consistent + i], base[l][p]) for i, p in enumerate(perms)]
             if consistent else [relative_l2(out.hidden[l][jitter_row], base[l]) if has_jitter else 0.0]
             for l in range(layers)]

    final_residual = min(residual[-1])
    final_floor = max(floor[-1])
    floor_source = "consistent permutation (tokens, mask and position ids permuted together)"
    if floor_by_jitter:
        why = ("recurrent sequence mixers" if recurrent else f"token mixing by {mixing}" if mixing
               else "positions derived inside, not from position ids")
        floor_source = (f"{FLOOR_SOURCE if has_jitter else f'{dtype} machine epsilon'} ({subject.family.name} has "
                        f"{why}: no consistent permutation)")
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
    # The consistent run restoring P f(x) no better than the shuffled one means either that the ids are not what the
    # model positions by (a stack deriving them inside: both residuals are signal) or that nothing positions it
    # (one function: both residuals are rounding, 1e2-1e3 ulps in a deep stack). Only a finer run tells which.
    honoured = not (consistent and final_residual > 0 and final_floor >= 0.5 * final_residual)
    verdict = judge_position_signal(final_residual, final_floor, dtype)
    if not honoured:
        details["floor_source"] = "float64 re-run (position ids passed, but permuting them with the tokens " \
                                  "restored nothing)"
        verdict = FloorVerdict(Status.WARN, verdict.residual, verdict.noise_floor, verdict.ratio,
                               "the consistent permutation is no floor (position ids passed but not honoured)")
    if verdict.status is Status.WARN:
        verdict = _decided_finer(subject, verdict, lambda: measure(jitter_row if floor_by_jitter else len(rows)),
                                 final_figures, dtype)
        details["decided_in"] = verdict.reason
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
    inert = inert_reason(subject, stack, ids) if verdict.status is Status.FAIL else ""
    if inert:  # outputs that cannot carry positions at all (zero-initialised branches): not a lost position
        details["inert"] = inert
        return CheckResult("shuffle", Status.SKIP, f"no verdict: {inert} (residual {verdict.residual:.3g} = "
                           f"{verdict.ratio:.3g}x noise floor)", metrics, details)
    where = f"; enters at {enters}" if enters and verdict.status is Status.PASS else ""
    summary = (f"{verdict.reason}: residual {verdict.residual:.3g} = {verdict.ratio:.3g}x noise floor "
               f"{verdict.noise_floor:.2g} ({len(perms)} permutations, {length} tokens{where})")
    if recurrent:
        summary += (f"; {subject.family.name} has recurrent sequence mixers ({', '.join(recurrent)}): order enters "
                    f"through the recurrence, so this shows order reaches the outputs, not that positions reach "
                    f"the attention layers (see positions, shift, rope)")
    elif mixing:
        summary += (f"; {subject.family.name} mixes tokens by {mixing}, not by attention alone: order enters through "
                    "the mixing itself, so this shows order reaches the outputs, not that positions do (see positions)")
    table = Table(f"shuffle residual by layer ({stack})" if subject.kind == "seq2seq" else "shuffle residual by layer",
                  ("layer", "residual", "noise floor", "ratio"), tuple(table_rows))
    return CheckResult("shuffle", verdict.status, summary, metrics, details, (table,))


def _decided_finer(subject: Subject, verdict: FloorVerdict, measure, figures, dtype: str) -> FloorVerdict:
    """A ratio between the bands, or no usable floor: re-run the same rows with the model in float64 (module by
    module, its float32 casts kept in float64: posdiag.model.casts) and decide there. Measured on Llamas without
    positions (8 and 64 layers x 256 hidden, 256 tokens): the residual falls from 4.6e-6 / 4.2e-5 in float32 to
    ~1e-14, at its float64 floor; a position signal stays. When no finer run is possible the WARN stays, saying so."""
    def compute():
        with float64_throughout():
            return measure()

    finer = run_finer(subject, compute)
    release_freed_memory()
    if finer.value is None:
        return FloorVerdict(verdict.status, verdict.residual, verdict.noise_floor, verdict.ratio,
                            f"{verdict.reason}; the float64 re-run that decides could not run: {finer.reason}")
    residual, floor, source = figures(finer.value)
    name = dtype_name(finer.dtype)
    decided = judge_position_signal(residual, floor, name)
    if not floor > 0 and verdict.residual >= SHRINK_RATIO * residual:  # no floor measured: the residual itself fell
        decided = FloorVerdict(Status.FAIL, residual, decided.noise_floor, decided.ratio,
                               f"outputs merely permute: the residual is rounding ({verdict.residual:.3g} in {dtype}, "
                               f"{residual:.3g} in {name})")
    return FloorVerdict(decided.status, residual, decided.noise_floor, decided.ratio,
                        f"{decided.reason} in {name} (inconclusive in {dtype}: {verdict.ratio:.3g}x its floor; "
                        f"{name} floor: {source})")


@contextlib.contextmanager
def _nothing() -> Iterator[bool]:
    yield False


