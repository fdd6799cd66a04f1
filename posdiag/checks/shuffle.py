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

A FAIL needs outputs that could carry positions: where tokens never interact because of zero-initialised branches
(NeoMME's output projections, as built) or every attention score is equal (Zaya's zero-initialised key scale),
`posdiag.model.inert` says so and the check SKIPs with that reason instead. Tokens that never interact through the
model's own default mask because of what the checkpoint stores or what the code does FAIL: "tokens never interact:
position cannot enter", also where the explicit mask is not faithful (the mask-fidelity SKIP is for a mask ignored
while tokens do interact).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from posdiag.checks import CheckSpec
from posdiag.model.arbitration import decide_signal
from posdiag.model.inert import inert, unfaithful_mask_verdict
from posdiag.model.introspect import attention_free, recurrent_mixers, recurrent_reason
from posdiag.model.jitter import FLOOR_SOURCE, jittered
from posdiag.model.probe import (
    Row,
    fidelity_rows,
    judge_fidelity,
    moving_permutations,
    run_rows,
)
from posdiag.model.subject import Outputs, Subject
from posdiag.model.tensors import layer_name, relative_l2
from posdiag.options import RunOptions, probe_ids
from posdiag.results import CheckResult, Status, Table, combine_stacks
from posdiag.verdict import (
    FloorVerdict,
    clear_signal,
    judge_position_signal,
    noise_floor,
    stack_result,
)

SPEC = CheckSpec(
    name="shuffle",
    title="Permutation equivariance",
    proves="position enters the model: permuting the tokens changes more than the order of the outputs",
    # --baseline watches the ratio: a collapsing one means position is fading out of the model.
    baseline={"ratio": "higher"},
)


def run(subject: Subject, options: RunOptions) -> CheckResult:
    return combine_stacks(SPEC.name, [stack_result(SPEC.name, stack, lambda s=stack: _run_stack(subject, options, s))
                                      for stack in subject.stacks])


def _run_stack(subject: Subject, options: RunOptions, stack: str) -> CheckResult:
    """One stack: plan the rows, measure them in one forward, check the mask, judge the residual, report."""
    refused = _not_judged(subject, stack)
    if refused is not None:
        return refused
    probe = _plan(subject, options, stack)
    out, has_jitter = probe.measure(probe.jitter_row)
    if bad := _non_finite(out, stack):
        return bad
    layers = _per_layer(probe, out, has_jitter)
    details = _details(subject, probe, layers, has_jitter)
    metrics: dict[str, Any] = {}
    unfaithful = _mask_unfaithful(subject, probe, out, layers.final_floor, metrics)
    if unfaithful:
        # Tokens that never interact through the model's own mask are the finding the unfaithful mask hides.
        status, summary, found = unfaithful_mask_verdict(subject, stack, probe.ids, unfaithful,
                                                         "tokens never interact: position cannot enter")
        return SPEC.result(status, summary, metrics, {**details, **found})
    verdict = _judge(subject, probe, layers, details)
    table, enters = _table(subject, stack, layers)
    metrics.update({"residual": verdict.residual, "noise_floor": verdict.noise_floor, "ratio": verdict.ratio})
    details["position_enters_at"] = enters
    details["reason"] = verdict.reason
    why = inert(subject, stack, probe.ids) if verdict.status is Status.FAIL else None
    if why is not None and why.skip:  # outputs that cannot carry positions (zero-initialised branches): no verdict
        details["inert"] = why.skip
        return SPEC.result(Status.SKIP, f"no verdict: {why.skip} (residual {verdict.residual:.3g} = "
                           f"{verdict.ratio:.3g}x noise floor)", metrics, details)
    if why is not None and why.finding:
        details["never_interact"] = why.finding
        return SPEC.result(Status.FAIL, f"tokens never interact: position cannot enter ({why.finding}; residual "
                           f"{verdict.residual:.3g} = {verdict.ratio:.3g}x noise floor)", metrics, details, (table,))
    return SPEC.result(verdict.status, _summary(subject, probe, verdict, enters), metrics, details, (table,))


def _not_judged(subject: Subject, stack: str) -> CheckResult | None:
    """SKIP where the causal mask cannot be permuted; n/a where no layer is attention."""
    if stack == "decoder" and subject.kind != "encoder":
        ok, why = subject.explicit_mask_supported
        if not ok:
            return SPEC.result(Status.SKIP, f"cannot permute the causal mask: {why}", details={"stack": stack})
    if attention_free(subject.language_model):
        return SPEC.result(Status.NA, f"{recurrent_reason(subject)}; and no layer is attention, so there is no mask "
                           f"to permute: order enters through the recurrence by construction", details={"stack": stack})
    return None


@dataclass(frozen=True)
class _Probe:
    """One batched forward: [fidelity rows (causal only) | baseline | permuted... | consistent... | jittered]."""

    subject: Subject
    seed: int
    stack: str
    ids: torch.Tensor
    rows: list[Row]
    fidelity_where: tuple[int, int, int] | None  # the fidelity rows' edits (causal stacks only)
    perms: list[torch.Tensor]
    first_perm: int
    first_consistent: int
    jitter_row: int | None  # the jittered baseline, where it is the floor
    recurrent: list[str]
    mixing: str  # not attention: it reads the storage order, like a recurrence

    @property
    def causal(self) -> bool:
        return self.stack == "decoder" and self.subject.kind != "encoder"

    @property
    def floor_by_jitter(self) -> bool:
        return self.jitter_row is not None

    @property
    def consistent(self) -> bool:
        return self.jitter_row is None

    @property
    def encoder_ids(self) -> torch.Tensor | None:
        """Encoder-decoders: the decoder is tested against one fixed encoder input for every row."""
        if self.subject.kind == "seq2seq" and self.stack == "decoder":
            return self.ids[None].expand(len(self.rows), -1)
        return None

    def measure(self, jitter_at: int | None) -> tuple[Outputs, bool]:
        """The rows' outputs (a jittered copy of the baseline appended when `jitter_at` is past them)."""
        batch = self.rows if jitter_at is None or jitter_at < len(self.rows) else [*self.rows, Row(self.ids)]
        enc = None if self.encoder_ids is None else self.ids[None].expand(len(batch), -1)
        with (jittered(self.subject, self.stack, jitter_at, len(batch), self.seed) if jitter_at is not None
              else _nothing()) as jitter_found:
            return run_rows(self.subject, batch, stack=self.stack, encoder_ids=enc), jitter_found

    def final_figures(self, measured: tuple[Outputs, bool]) -> tuple[float, float, str]:
        """(residual, floor, floor source) at the last layer of a float64 re-run: the consistent permutation where
        it restores P f(x) better than keeping the ids, else the jittered row."""
        hidden, jitter_found = measured[0].final, measured[1]
        res = min(relative_l2(hidden[self.first_perm + i], hidden[0][p]) for i, p in enumerate(self.perms))
        if self.consistent:
            con = max(relative_l2(hidden[self.first_consistent + i], hidden[0][p]) for i, p in enumerate(self.perms))
            if con < 0.5 * res or not jitter_found:
                return res, con, "consistent permutation"
        return res, relative_l2(hidden[-1], hidden[0]) if jitter_found else 0.0, "baseline row jittered by ~1 ulp"


def _plan(subject: Subject, options: RunOptions, stack: str) -> _Probe:
    ids = probe_ids(subject, options)[0]
    length = ids.shape[0]
    perms = [p.to(subject.device) for p in moving_permutations(length, options.permutations, options.seed + 7919)]
    recurrent = recurrent_mixers(subject.language_model)
    mixing = subject.family.token_mixing
    # No consistent permutation where order enters otherwise, or where the ids are not taken: the floor is then the
    # jittered row, a measurement of how this stack amplifies one ulp (never the ulp itself: a deep stack's rounding
    # is 1e2-1e3 of them).
    floor_by_jitter = bool(recurrent or mixing) or not subject.family.takes_position_ids
    fidelity_where = None
    if stack == "decoder" and subject.kind != "encoder":
        rows, fidelity_where = fidelity_rows(ids)
        rows = list(rows)  # rows[0] is also the baseline
    else:
        rows = [Row(ids)]
    first_perm = len(rows)
    rows += [Row(ids[p], order=p) for p in perms]
    first_consistent = len(rows)
    if not floor_by_jitter:
        rows += [Row(ids[p], order=p, positions=p) for p in perms]
    jitter_row = len(rows) if floor_by_jitter else None
    if floor_by_jitter:
        rows.append(Row(ids))
    return _Probe(subject=subject, seed=options.seed, stack=stack, ids=ids, rows=rows, fidelity_where=fidelity_where,
                  perms=perms, first_perm=first_perm, first_consistent=first_consistent, jitter_row=jitter_row,
                  recurrent=recurrent, mixing=mixing)


def _non_finite(out: Outputs, stack: str) -> CheckResult | None:
    if all(torch.isfinite(h).all() for h in out.hidden):
        return None
    bad = next(i for i, h in enumerate(out.hidden) if not torch.isfinite(h).all())
    return SPEC.result(Status.FAIL, f"non-finite hidden states at {layer_name(bad)}",
                       details={"stack": stack, "first_non_finite_layer": layer_name(bad)})


@dataclass(frozen=True)
class _Layers:
    """Each layer's shuffled residual per permutation and its floor (per permutation, or the one jittered row)."""

    residual: list[list[float]]
    floor: list[list[float]]

    @property
    def final_residual(self) -> float:
        return min(self.residual[-1])

    @property
    def final_floor(self) -> float:
        return max(self.floor[-1])


def _per_layer(probe: _Probe, out: Outputs, has_jitter: bool) -> _Layers:
    base = [h[0] for h in out.hidden]
    layers, perms = range(len(base)), probe.perms
    residual = [[relative_l2(out.hidden[l][probe.first_perm + i], base[l][p]) for i, p in enumerate(perms)]
                for l in layers]
    floor = [[relative_l2(out.hidden[l][probe.first_consistent + i], base[l][p]) for i, p in enumerate(perms)]
             if probe.consistent else
             [relative_l2(out.hidden[l][probe.jitter_row], base[l]) if has_jitter else 0.0]
             for l in layers]
    return _Layers(residual=residual, floor=floor)


def _details(subject: Subject, probe: _Probe, layers: _Layers, has_jitter: bool) -> dict[str, Any]:
    floor_source = "consistent permutation (tokens, mask and position ids permuted together)"
    if probe.floor_by_jitter:
        why = ("recurrent sequence mixers" if probe.recurrent else f"token mixing by {probe.mixing}" if probe.mixing
               else "positions derived inside, not from position ids")
        floor_source = (f"{FLOOR_SOURCE if has_jitter else f'{subject.dtype_name} machine epsilon'} "
                        f"({subject.family.name} has {why}: no consistent permutation)")
    details: dict[str, Any] = {"stack": probe.stack, "seq_len": probe.ids.shape[0], "permutations": len(probe.perms),
                               "floor_source": floor_source, "residual_per_permutation": layers.residual[-1],
                               "floor_per_permutation": layers.floor[-1]}
    if probe.recurrent:
        details["recurrent_mixers"] = probe.recurrent
    return details


def _mask_unfaithful(subject: Subject, probe: _Probe, out: Outputs, floor: float, metrics: dict[str, Any]) -> str:
    """Why the explicit causal mask cannot be trusted ('' when it can, or on a bidirectional stack)."""
    if not probe.causal:
        return ""
    enc = probe.encoder_ids
    default = run_rows(subject, [Row(probe.ids)], stack=probe.stack, explicit_mask=False,
                       encoder_ids=None if enc is None else enc[:1]).final[0]
    fid = judge_fidelity(default, out.final[0], out.final[1], out.final[2], probe.fidelity_where, floor,
                         subject.dtype_name)
    metrics.update(fid.metrics())
    return "" if fid.ok else fid.reason


def _judge(subject: Subject, probe: _Probe, layers: _Layers, details: dict[str, Any]) -> FloorVerdict:
    """The final layer's residual as a position signal; between the bands, or with no usable floor, in float64."""
    dtype, residual, floor = subject.dtype_name, layers.final_residual, layers.final_floor
    # The consistent run restoring P f(x) no better than the shuffled one means either that the ids are not what the
    # model positions by (a stack deriving them inside: both residuals are signal) or that nothing positions it
    # (one function: both residuals are rounding, 1e2-1e3 ulps in a deep stack). Only a finer run tells which.
    honoured = not (probe.consistent and residual > 0 and floor >= 0.5 * residual)
    verdict = judge_position_signal(residual, floor, dtype)
    if not honoured:
        details["floor_source"] = "float64 re-run (position ids passed, but permuting them with the tokens " \
                                  "restored nothing)"
        verdict = FloorVerdict(Status.WARN, verdict.residual, verdict.noise_floor, verdict.ratio,
                               "the consistent permutation is no floor (position ids passed but not honoured)")
    if verdict.status is Status.WARN:
        jitter_at = probe.jitter_row if probe.floor_by_jitter else len(probe.rows)
        verdict = decide_signal(subject, verdict, lambda: probe.measure(jitter_at), probe.final_figures, dtype)
        details["decided_in"] = verdict.reason
    return verdict


def _table(subject: Subject, stack: str, layers: _Layers) -> tuple[Table, str | None]:
    """The residual by layer, and the first layer where position clearly enters."""
    rows, enters, n = [], None, len(layers.residual)
    for l in range(n):
        r, f = min(layers.residual[l]), noise_floor(max(layers.floor[l]), subject.dtype_name)
        if enters is None and clear_signal(r / f):
            enters = layer_name(l, n)
        rows.append((layer_name(l, n), f"{r:.3e}", f"{f:.2e}", f"{r / f:.3g}"))
    title = f"shuffle residual by layer ({stack})" if subject.kind == "seq2seq" else "shuffle residual by layer"
    return Table(title, ("layer", "residual", "noise floor", "ratio"), tuple(rows)), enters


def _summary(subject: Subject, probe: _Probe, verdict: FloorVerdict, enters: str | None) -> str:
    where = f"; enters at {enters}" if enters and verdict.status is Status.PASS else ""
    summary = (f"{verdict.reason}: residual {verdict.residual:.3g} = {verdict.ratio:.3g}x noise floor "
               f"{verdict.noise_floor:.2g} ({len(probe.perms)} permutations, {probe.ids.shape[0]} tokens{where})")
    name = subject.family.name
    if probe.recurrent:
        summary += (f"; {name} has recurrent sequence mixers ({', '.join(probe.recurrent)}): order enters "
                    f"through the recurrence, so this shows order reaches the outputs, not that positions reach "
                    f"the attention layers (see positions, shift, rope)")
    elif probe.mixing:
        summary += (f"; {name} mixes tokens by {probe.mixing}, not by attention alone: order enters through "
                    "the mixing itself, so this shows order reaches the outputs, not that positions do (see positions)")
    return summary


@contextlib.contextmanager
def _nothing() -> Iterator[bool]:
    yield False


