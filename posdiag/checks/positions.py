"""positions — are position_ids honoured?

Two measurements in one batched forward (plus one default-mask pass for mask fidelity):

1. Consistent permutation. Permute the tokens, the attention pattern *and* the position ids
   together: in exact arithmetic f(P x, P M Pᵀ, P pos) = P f(x, M, pos), because the model
   sees the same (token, position, visible keys) triples, only stored in another order. A
   model that rebuilds positions internally (arange) instead of reading position_ids sees
   permuted tokens at unpermuted positions, so the agreement breaks by the whole position
   signal. error = ||f(P x, P M Pᵀ, P pos) − P f(x)|| / ||f(x)||, judged as *agreement*.
2. Non-contiguous positions. Gaps (random strides) and a restart halfway (as in packed
   sequences), with the ordinary causal/bidirectional pattern, must change the outputs of a
   position-aware model. Non-affine on purpose: RoPE (and any relative scheme) is invariant to
   a constant offset, so "shift everything by k" would prove nothing. residual =
   ||f(x, pos') − f(x)|| / ||f(x)||, judged as *position signal*.

Noise floor (same forward): the baseline row is repeated with its token embeddings jittered by
~1 ulp of the dtype (x·(1 + ε·n), n ~ N(0,1), via a forward hook on the input embedding). Its
output change is how far rounding-level noise at the input travels through this model — the
same size as the rounding of a reordered computation (measured on the tiny zoo: jitter 1.2e-7 to
4.6e-7, consistent permutation 2e-8 to 3.3e-7, fp32), and it is measured, not assumed: deeper
or badly conditioned models get a larger floor. The floor never goes below one machine epsilon.

Families whose positions are derived inside (position_ids accepted and dropped: ALiBi, T5
buckets, BART/Marian offsets — `Family.position_ids == "ignored"`) are skipped with that reason:
there is nothing to honour, and a pass would claim something never measured.

Models with recurrent / linear-attention / convolutional mixers (posdiag.model.introspect) read order through the
recurrence: no consistent permutation exists, so measurement 1 is not run (said in the report) and the
verdict rests on measurement 2 — tokens and pattern unchanged, only the ids move, so only layers that read
position ids can respond. Such a model with no position mechanism at all (Jamba: NoPE attention + Mamba)
has no ids to honour and is skipped. Likewise a family whose tokens are mixed by something other than
attention (`Family.token_mixing`: FNet's Fourier transform reads the storage order itself). Ids that change
nothing FAIL only where the outputs could carry positions at all: tokens that never interact or attention scores
that are all equal because of zero-initialised branches (`posdiag.model.inert`) SKIP with that reason; tokens that
never interact because of what the checkpoint stores or the code does FAIL "position_ids change nothing", also where
the explicit mask is not faithful.

The jitter noise floor it uses lives in model/jitter.py (batch, causal, shift and shuffle use it too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from posdiag.checks import CheckSpec
from posdiag.checks._image_positions import with_image_positions
from posdiag.model.arbitration import arbitrate, decide_signal
from posdiag.model.inert import inert, unfaithful_mask_verdict
from posdiag.model.introspect import mixing_reason, recurrent_mixers, recurrent_reason
from posdiag.model.jitter import FLOOR_SOURCE, jittered
from posdiag.model.kinds import PositionKind
from posdiag.model.probe import (
    Row,
    fidelity_rows,
    judge_fidelity,
    moving_permutations,
    position_limit,
    restart_positions,
    run_rows,
)
from posdiag.model.subject import Outputs, Subject
from posdiag.model.tensors import layer_name, relative_l2
from posdiag.options import RunOptions, probe_ids
from posdiag.results import CheckResult, Status, Table
from posdiag.verdict import (
    FloorVerdict,
    agreement_tolerance,
    judge_agreement,
    judge_position_signal,
    noise_floor,
)

SPEC = CheckSpec(
    name="positions",
    title="Position ids honoured",
    proves="the model reads the position_ids it is given: a permuted or non-contiguous numbering acts as one",
)


def run(subject: Subject, options: RunOptions) -> CheckResult:
    refused = _not_judged(subject)
    if refused is not None:
        return refused
    probe = _plan(subject, options)
    out, has_jitter = probe.measure()
    if bad := _non_finite(out):
        return bad
    layers = _per_layer(probe, out, has_jitter)
    details = _details(subject, probe, layers)
    metrics: dict[str, Any] = {}
    unfaithful = _mask_unfaithful(subject, probe, out, layers.floor, metrics)
    if unfaithful:
        # Tokens that never interact through the model's own mask are the finding the unfaithful mask hides.
        status, summary, found = unfaithful_mask_verdict(subject, probe.stack, probe.ids, unfaithful,
                                                         "position_ids change nothing: tokens never interact")
        return SPEC.result(status, summary, metrics, {**details, **found})
    judged = _judge(subject, probe, layers, details, metrics)
    status, summary = _verdict(subject, probe, judged, details)
    result = SPEC.result(status, summary, metrics, details, (_table(subject, probe, layers),))
    return with_image_positions(result, subject, options.seed)  # multimodal RoPE: images and a video


def _not_judged(subject: Subject) -> CheckResult | None:
    """n/a where there are no position ids to honour; SKIP where posdiag cannot hand them over faithfully."""
    fam = subject.family
    recurrent = recurrent_mixers(subject.language_model)
    if recurrent and subject.position_kind not in ("rope", "learned", "sinusoidal", "alibi", "relative_bias"):
        return SPEC.result(
            Status.NA,
            f"{recurrent_reason(subject)}; and no position mechanism was found ({subject.position_kind}), so there "
            f"are no position ids to honour", details={"recurrent_mixers": recurrent})
    if not fam.takes_position_ids:
        inside = ("no position mechanism was found" if subject.position_kind == PositionKind.NONE
                  else f"{subject.position_kind} positions are derived inside the model")
        return SPEC.result(
            Status.NA,
            f"{fam.name} takes no position_ids (dropped or not in its forward; {inside}), so there are none to honour",
            details={"position_ids": fam.position_ids, "position_kind": subject.position_kind})
    if subject.kind == "seq2seq":
        return SPEC.result(Status.SKIP, "position_ids are not passed to encoder-decoder stacks by posdiag "
                                        "(positions derived inside)")
    if subject.stacks[0] == "decoder":
        ok, why = subject.explicit_mask_supported
        if not ok:
            return SPEC.result(Status.SKIP, f"cannot permute the causal mask: {why}")
    return None


@dataclass(frozen=True)
class _Probe:
    """The rows of one forward: [baseline (+ fidelity rows) | jittered baseline | consistent perms | non-contiguous]."""

    subject: Subject
    seed: int
    ids: torch.Tensor
    stack: str
    rows: list[Row]
    where: tuple[int, int, int] | None  # the fidelity rows' edits (causal stacks only)
    jitter_row: int
    first_perm: int
    perms: list[torch.Tensor]  # consistent permutations (none through a recurrence or a non-attention mixer)
    first_variant: int
    variants: list[tuple[str, torch.Tensor]]  # (name, non-contiguous positions)
    recurrent: list[str]
    mixing: str

    @property
    def causal(self) -> bool:
        return self.stack == "decoder"

    def measure(self) -> tuple[Outputs, bool]:
        """The forward (the jittered row's hook on), and whether a token embedding was found to jitter."""
        with jittered(self.subject, self.stack, self.jitter_row, len(self.rows), self.seed) as jitter_found:
            return run_rows(self.subject, self.rows, stack=self.stack), jitter_found

    def signal_figures(self, measured: tuple[Outputs, bool]) -> tuple[float, float, str]:
        """(residual, floor, floor source) of the non-contiguous numberings at the last layer, for a float64 re-run."""
        hidden, jitter_found = measured[0].final, measured[1]
        moved = max(relative_l2(hidden[self.first_variant + i], hidden[0]) for i in range(len(self.variants)))
        return (moved, relative_l2(hidden[self.jitter_row], hidden[0]) if jitter_found else 0.0,
                FLOOR_SOURCE if jitter_found else "machine epsilon (no token embedding found to jitter)")

    def consistent_figures(self, measured: tuple[Outputs, bool]) -> tuple[float, dict[str, float]]:
        """(floor, {"consistent": error}) at the last layer, for the float64 arbitration."""
        hidden = measured[0].final
        error = max(relative_l2(hidden[self.first_perm + i], hidden[0][p]) for i, p in enumerate(self.perms))
        return (relative_l2(hidden[self.jitter_row], hidden[0]) if measured[1] else 0.0), {"consistent": error}


def _plan(subject: Subject, options: RunOptions) -> _Probe:
    ids = probe_ids(subject, options)[0]
    length = ids.shape[0]
    stack = subject.stacks[0]
    recurrent = recurrent_mixers(subject.language_model)
    mixing = subject.family.token_mixing
    perms = [p.to(subject.device) for p in moving_permutations(length, options.permutations, options.seed + 6151)]
    if recurrent or mixing:
        perms = []  # no consistent permutation through a recurrence, nor through a mixer that is not attention
    gaps = gapped_positions(length, position_limit(subject), options.seed)
    variants: list[tuple[str, torch.Tensor]] = [("restart", restart_positions(length))]
    if gaps is not None:
        variants.insert(0, ("gaps", gaps))
    variants = [(n, p.to(subject.device)) for n, p in variants]
    where = None
    if stack == "decoder":
        rows, where = fidelity_rows(ids)
        rows = list(rows)
    else:
        rows = [Row(ids)]
    jitter_row = len(rows)
    rows.append(Row(ids))
    first_perm = len(rows)
    rows += [Row(ids[p], order=p, positions=p) for p in perms]
    first_variant = len(rows)
    rows += [Row(ids, positions=pos) for _, pos in variants]
    return _Probe(subject=subject, seed=options.seed, ids=ids, stack=stack, rows=rows, where=where,
                  jitter_row=jitter_row, first_perm=first_perm, perms=perms, first_variant=first_variant,
                  variants=variants, recurrent=recurrent, mixing=mixing)


def _non_finite(out: Outputs) -> CheckResult | None:
    for i, h in enumerate(out.hidden):
        if not torch.isfinite(h).all():
            bad_row = int((~torch.isfinite(h)).flatten(1).any(1).nonzero()[0])
            return SPEC.result(Status.FAIL, f"non-finite hidden states at layer {i}, probe row {bad_row}",
                               details={"layer": i, "row": bad_row})
    return None


@dataclass(frozen=True)
class _Layers:
    """Each layer's figures: jitter floor, consistent-permutation errors, non-contiguous residuals."""

    floors: list[float]
    consistent: list[list[float]]  # [layer][permutation]
    moved: list[list[float]]  # [layer][variant]
    has_jitter: bool

    @property
    def floor(self) -> float:
        """The measured floor at the output (0.0 where no token embedding could be jittered)."""
        return self.floors[-1] if self.has_jitter else 0.0

    def floor_at(self, layer: int) -> float:
        return self.floors[layer] if self.has_jitter else 0.0


def _per_layer(probe: _Probe, out: Outputs, has_jitter: bool) -> _Layers:
    layers = len(out.hidden)
    base = [h[0] for h in out.hidden]
    return _Layers(
        floors=[relative_l2(out.hidden[l][probe.jitter_row], base[l]) for l in range(layers)],
        consistent=[[relative_l2(out.hidden[l][probe.first_perm + i], base[l][p]) for i, p in enumerate(probe.perms)]
                    for l in range(layers)],
        moved=[[relative_l2(out.hidden[l][probe.first_variant + i], base[l]) for i in range(len(probe.variants))]
               for l in range(layers)],
        has_jitter=has_jitter)


def _details(subject: Subject, probe: _Probe, layers: _Layers) -> dict[str, Any]:
    recurrent, mixing = probe.recurrent, probe.mixing
    return {
        "seq_len": probe.ids.shape[0], "permutations": len(probe.perms),
        **({"recurrent_mixers": recurrent, "consistent_permutation": f"not run: {recurrent_reason(subject)}"}
           if recurrent else {}),
        **({"token_mixing": mixing, "consistent_permutation": f"not run: {mixing_reason(subject)}"}
           if mixing and not recurrent else {}),
        "floor_source": FLOOR_SOURCE if layers.has_jitter else f"{subject.dtype_name} machine epsilon (no token "
                                                               "embedding found to jitter)",
        "consistent_error_per_permutation": layers.consistent[-1],
        "variants": {n: [int(v) for v in p.tolist()] for n, p in probe.variants},
        "residual_per_variant": dict(zip([n for n, _ in probe.variants], layers.moved[-1], strict=True)),
    }


def _mask_unfaithful(subject: Subject, probe: _Probe, out: Outputs, floor: float, metrics: dict[str, Any]) -> str:
    """Why the explicit causal mask cannot be trusted ('' when it can, or on a bidirectional stack)."""
    if not probe.causal:
        return ""
    default = run_rows(subject, [Row(probe.ids)], stack=probe.stack, explicit_mask=False).final[0]
    fid = judge_fidelity(default, out.final[0], out.final[1], out.final[2], probe.where, floor, subject.dtype_name)
    metrics.update(fid.metrics())
    return "" if fid.ok else fid.reason


@dataclass(frozen=True)
class _Judged:
    agree: FloorVerdict  # the consistent permutation (its error is 0.0, unjudged, where none was run)
    signal: FloorVerdict  # the strongest non-contiguous numbering
    tolerance: float
    first_bad: int | None  # first layer where the consistent permutation breaks
    strongest: int  # the variant that moved the outputs most
    clause: str  # the float64 arbitration's clause for the consistent permutation
    decided: str = ""  # how a float64 re-run decided the position signal ('' when the run dtype decided it)


def _judge(subject: Subject, probe: _Probe, layers: _Layers, details: dict[str, Any],
           metrics: dict[str, Any]) -> _Judged:
    """Agreement for the consistent permutation (decided in float64 when above tolerance), position signal for the
    non-contiguous ids."""
    dtype, floor, perms = subject.dtype_name, layers.floor, probe.perms
    # Recurrent mixers: no consistent permutation was run; its error is reported as 0 nowhere (not judged).
    agree = judge_agreement(max(layers.consistent[-1]) if perms else 0.0, floor, dtype)
    arbitration = arbitrate(subject, probe.measure, floor, {"consistent": agree}, dtype, probe.consistent_figures)
    agree = arbitration.verdicts.get("consistent", agree)
    details.update(arbitration.details)
    # Judged on the strongest variant: any non-affine change that moves the outputs proves the ids
    # are read (an ignoring model gives exactly 0 for every variant); ModernBERT at default init
    # moves only 1.8e-5 under the restart (126x floor at 64 tokens), 3.6e-5 under the gaps.
    signal = judge_position_signal(max(layers.moved[-1]), floor, dtype)
    if signal.status is Status.WARN:  # between the bands, or inconclusive in half precision: decided in float64
        signal = decide_signal(subject, signal, probe.measure, probe.signal_figures, dtype)
        details["decided_in"] = signal.reason
    tol = agreement_tolerance(floor, dtype)
    first_bad = next((l for l in range(len(layers.floors))
                      if perms and max(layers.consistent[l]) > agreement_tolerance(layers.floor_at(l), dtype)), None)
    strongest = max(range(len(probe.variants)), key=lambda i: layers.moved[-1][i])
    metrics.update({"residual": signal.residual, "noise_floor": agree.noise_floor, "ratio": signal.ratio,
                    "tolerance": tol, **arbitration.metrics})
    if perms:
        metrics.update({"consistent_error": agree.residual, "consistent_ratio": agree.ratio})
    details["consistent_breaks_at"] = None if first_bad is None else layer_name(first_bad, len(layers.floors))
    details["strongest_variant"] = probe.variants[strongest][0]
    return _Judged(agree=agree, signal=signal, tolerance=tol, first_bad=first_bad, strongest=strongest,
                   clause=arbitration.clause("consistent"), decided=details.get("decided_in", ""))


def _verdict(subject: Subject, probe: _Probe, judged: _Judged, details: dict[str, Any]) -> tuple[Status, str]:
    agree, signal, perms = judged.agree, judged.signal, probe.perms
    status = Status.worst([agree.status, signal.status]) if perms else signal.status
    parts = [_consistent_part(subject, probe, judged, details), _variants_part(probe, judged)]
    if status is Status.FAIL and perms and agree.status is Status.FAIL and signal.status is Status.FAIL:
        parts.insert(0, "position_ids ignored")
    summary = "; ".join(parts) + f" [noise floor {agree.noise_floor:.2g}, {probe.ids.shape[0]} tokens]"
    why = (inert(subject, probe.stack, probe.ids)
           if signal.status is Status.FAIL and agree.status is Status.PASS else None)
    if why is not None and why.skip:  # outputs that cannot carry positions (zero-initialised branches): no verdict
        details["inert"] = why.skip
        status, summary = Status.SKIP, f"no verdict: {why.skip} ({summary})"
    elif why is not None and why.finding:
        details["never_interact"] = why.finding
        summary = f"position_ids change nothing: tokens never interact ({why.finding}; {summary})"
    return status, summary


def _consistent_part(subject: Subject, probe: _Probe, judged: _Judged, details: dict[str, Any]) -> str:
    agree = judged.agree
    if not probe.perms and probe.recurrent:
        return (f"consistent permutation not run ({subject.family.name} has recurrent sequence mixers: "
                f"{', '.join(probe.recurrent)}; order enters through the recurrence)")
    if not probe.perms:
        return f"consistent permutation not run ({mixing_reason(subject)})"
    if agree.status is Status.PASS:
        return (f"consistent permutation reproduces P f(x) (error {agree.residual:.2g} <= {judged.tolerance:.2g}"
                f"{judged.clause})")
    at = f", from {details['consistent_breaks_at']}" if judged.first_bad is not None else ""
    return (f"consistent permutation breaks P f(x): error {agree.residual:.3g} = {agree.ratio:.3g}x "
            f"floor{at}{judged.clause} (positions not read from each row's position_ids)")


def _variants_part(probe: _Probe, judged: _Judged) -> str:
    signal = judged.signal
    name = (probe.variants[judged.strongest][0] if signal.status is not Status.FAIL
            else " and ".join(n for n, _ in probe.variants))
    if judged.decided and signal.status is not Status.PASS:
        return f"non-contiguous ids ({name}): {signal.reason}"
    if signal.status is Status.PASS:
        decided = f"; {signal.reason}" if judged.decided else ""
        return f"non-contiguous ids move outputs ({name}: {signal.residual:.3g} = {signal.ratio:.3g}x floor{decided})"
    if signal.status is Status.FAIL:
        return (f"non-contiguous ids ({name}) change nothing: residual {signal.residual:.3g} = "
                f"{signal.ratio:.3g}x floor (position_ids ignored)")
    return f"non-contiguous ids ({name}): {signal.reason}"


def _table(subject: Subject, probe: _Probe, layers: _Layers) -> Table:
    n = len(layers.floors)
    rows = tuple(
        (layer_name(l, n), f"{max(layers.consistent[l]):.3e}" if probe.perms else "not run",
         *[f"{m:.3e}" for m in layers.moved[l]], f"{noise_floor(layers.floor_at(l), subject.dtype_name):.2e}")
        for l in range(n))
    return Table("position ids by layer", ("layer", "consistent error", *[f"{name} residual" for name, _ in
                                                                           probe.variants], "noise floor"), rows)


def gapped_positions(length: int, limit: int | None, seed: int) -> torch.Tensor | None:
    """0, then strides of 1..4 drawn at random (at least one stride > 1); None when no room."""
    room = None if limit is None else limit - (length - 1)
    if room is not None and room < 1:
        return None
    gen = torch.Generator().manual_seed(seed + 2749)
    strides = torch.randint(1, 5, (length - 1,), generator=gen)
    if room is not None:
        extra = (strides - 1).cumsum(0)
        strides = torch.where(extra <= room, strides, torch.ones_like(strides))
    if bool((strides == 1).all()):
        strides[length // 2 - 1] = 2
    return torch.cat([torch.zeros(1, dtype=torch.long), strides.cumsum(0)])
