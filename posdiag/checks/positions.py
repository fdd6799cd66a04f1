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
that are all equal (zero-initialised branches, `posdiag.model.inert`) SKIP with that reason.

The jitter noise floor it uses lives in model/jitter.py (batch, causal, shift and shuffle use it too).
"""

from __future__ import annotations

import torch

from posdiag.checks import CheckSpec
from posdiag.model.arbitration import arbitrate
from posdiag.model.inert import inert_reason
from posdiag.model.introspect import mixing_reason, recurrent_mixers, recurrent_reason
from posdiag.model.jitter import FLOOR_SOURCE, jittered
from posdiag.model.probe import (
    Row,
    fidelity_rows,
    judge_fidelity,
    moving_permutations,
    position_limit,
    restart_positions,
    run_rows,
)
from posdiag.model.subject import Subject
from posdiag.model.tensors import layer_name, relative_l2
from posdiag.options import RunOptions, probe_ids
from posdiag.results import CheckResult, Status, Table
from posdiag.verdict import (
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


# ------------------------------------------------------------------ the check
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


def run(subject: Subject, options: RunOptions) -> CheckResult:
    fam = subject.family
    recurrent = recurrent_mixers(subject.language_model)
    if recurrent and subject.position_kind not in ("rope", "learned", "sinusoidal", "alibi", "relative_bias"):
        return CheckResult(
            "positions", Status.NA,
            f"{recurrent_reason(subject)}; and no position mechanism was found ({subject.position_kind}), so there "
            f"are no position ids to honour", details={"recurrent_mixers": recurrent})
    if not fam.takes_position_ids:
        inside = ("no position mechanism was found" if subject.position_kind == "none found"
                  else f"{subject.position_kind} positions are derived inside the model")
        return CheckResult(
            "positions", Status.NA,
            f"{fam.name} takes no position_ids (dropped or not in its forward; {inside}), so there are none to honour",
            details={"position_ids": fam.position_ids, "position_kind": subject.position_kind})
    if subject.kind == "seq2seq":
        return CheckResult("positions", Status.SKIP,
                           "position_ids are not passed to encoder-decoder stacks by posdiag "
                           "(positions derived inside)")
    stack = subject.stacks[0]
    causal = stack == "decoder"
    dtype = subject.dtype_name
    if causal:
        ok, why = subject.explicit_mask_supported
        if not ok:
            return CheckResult("positions", Status.SKIP, f"cannot permute the causal mask: {why}")

    ids = probe_ids(subject, options)[0]
    length = ids.shape[0]
    perms = [p.to(subject.device) for p in moving_permutations(length, options.permutations, options.seed + 6151)]
    gaps = gapped_positions(length, position_limit(subject), options.seed)
    variants: list[tuple[str, torch.Tensor]] = [("restart", restart_positions(length))]
    if gaps is not None:
        variants.insert(0, ("gaps", gaps))
    variants = [(n, p.to(subject.device)) for n, p in variants]

    # One forward: [baseline (+ fidelity rows) | jittered baseline | consistent perms | non-contiguous]
    rows: list[Row] = []
    where = None
    if causal:
        fid, where = fidelity_rows(ids)
        rows += fid
    else:
        rows.append(Row(ids))
    jitter_row = len(rows)
    rows.append(Row(ids))
    first_perm = len(rows)
    mixing = subject.family.token_mixing
    if recurrent or mixing:
        perms = []  # no consistent permutation through a recurrence, nor through a mixer that is not attention
    rows += [Row(ids[p], order=p, positions=p) for p in perms]
    first_variant = len(rows)
    rows += [Row(ids, positions=pos) for _, pos in variants]
    def measure():
        with jittered(subject, stack, jitter_row, len(rows), options.seed) as jitter_found:
            return run_rows(subject, rows, stack=stack), jitter_found

    def consistent_figures(measured) -> tuple[float, dict[str, float]]:
        """(floor, {"consistent": error}) at the last layer, for the float64 arbitration."""
        hidden = measured[0].final
        error = max(relative_l2(hidden[first_perm + i], hidden[0][p]) for i, p in enumerate(perms))
        return (relative_l2(hidden[jitter_row], hidden[0]) if measured[1] else 0.0), {"consistent": error}

    out, has_jitter = measure()

    for i, h in enumerate(out.hidden):
        if not torch.isfinite(h).all():
            bad_row = int((~torch.isfinite(h)).flatten(1).any(1).nonzero()[0])
            return CheckResult("positions", Status.FAIL, f"non-finite hidden states at layer {i}, probe row {bad_row}",
                               details={"layer": i, "row": bad_row})

    layers = len(out.hidden)
    base = [h[0] for h in out.hidden]
    floors = [relative_l2(out.hidden[l][jitter_row], base[l]) for l in range(layers)]
    consistent = [[relative_l2(out.hidden[l][first_perm + i], base[l][p]) for i, p in enumerate(perms)]
                  for l in range(layers)]
    moved = [[relative_l2(out.hidden[l][first_variant + i], base[l]) for i in range(len(variants))]
             for l in range(layers)]
    floor = floors[-1] if has_jitter else 0.0
    details: dict = {
        "seq_len": length, "permutations": len(perms),
        **({"recurrent_mixers": recurrent, "consistent_permutation": f"not run: {recurrent_reason(subject)}"}
           if recurrent else {}),
        **({"token_mixing": mixing, "consistent_permutation": f"not run: {mixing_reason(subject)}"}
           if mixing and not recurrent else {}),
        "floor_source": FLOOR_SOURCE if has_jitter else f"{dtype} machine epsilon (no token embedding found to jitter)",
        "consistent_error_per_permutation": consistent[-1],
        "variants": {n: [int(v) for v in p.tolist()] for n, p in variants},
        "residual_per_variant": dict(zip([n for n, _ in variants], moved[-1], strict=True)),
    }
    metrics: dict = {}

    if causal:
        default = run_rows(subject, [Row(ids)], stack=stack, explicit_mask=False).final[0]
        fid_result = judge_fidelity(default, out.final[0], out.final[1], out.final[2], where, floor, dtype)
        metrics.update(fid_result.metrics())
        if not fid_result.ok:
            return CheckResult("positions", Status.SKIP, f"mask not faithful, no verdict: {fid_result.reason}",
                               metrics, details)

    # Recurrent mixers: no consistent permutation was run; its error is reported as 0 nowhere (not judged).
    agree = judge_agreement(max(consistent[-1]) if perms else 0.0, floor, dtype)
    arbitration = arbitrate(subject, measure, floor, {"consistent": agree}, dtype, consistent_figures)
    agree = arbitration.verdicts.get("consistent", agree)
    details.update(arbitration.details)
    # Judged on the strongest variant: any non-affine change that moves the outputs proves the ids
    # are read (an ignoring model gives exactly 0 for every variant); ModernBERT at default init
    # moves only 1.8e-5 under the restart (126x floor at 64 tokens), 3.6e-5 under the gaps.
    signal = judge_position_signal(max(moved[-1]), floor, dtype)
    tol = agreement_tolerance(floor, dtype)
    first_bad = next((l for l in range(layers)
                      if perms and max(consistent[l]) > agreement_tolerance(floors[l] if has_jitter else 0.0, dtype)),
                     None)
    strongest = max(range(len(variants)), key=lambda i: moved[-1][i])
    metrics.update({"residual": signal.residual, "noise_floor": agree.noise_floor, "ratio": signal.ratio,
                    "tolerance": tol, **arbitration.metrics})
    if perms:
        metrics.update({"consistent_error": agree.residual, "consistent_ratio": agree.ratio})
    details["consistent_breaks_at"] = None if first_bad is None else layer_name(first_bad, layers)
    details["strongest_variant"] = variants[strongest][0]

    status = Status.worst([agree.status, signal.status]) if perms else signal.status
    parts = []
    if not perms and recurrent:
        parts.append(f"consistent permutation not run ({subject.family.name} has recurrent sequence mixers: "
                     f"{', '.join(recurrent)}; order enters through the recurrence)")
    elif not perms:
        parts.append(f"consistent permutation not run ({mixing_reason(subject)})")
    elif agree.status is Status.PASS:
        parts.append(f"consistent permutation reproduces P f(x) (error {agree.residual:.2g} <= {tol:.2g}"
                     f"{arbitration.clause('consistent')})")
    else:
        at = f", from {details['consistent_breaks_at']}" if first_bad is not None else ""
        parts.append(f"consistent permutation breaks P f(x): error {agree.residual:.3g} = {agree.ratio:.3g}x "
                     f"floor{at}{arbitration.clause('consistent')} (positions not read from each row's position_ids)")
    name = variants[strongest][0] if signal.status is not Status.FAIL else " and ".join(n for n, _ in variants)
    if signal.status is Status.PASS:
        parts.append(f"non-contiguous ids move outputs ({name}: {signal.residual:.3g} = {signal.ratio:.3g}x floor)")
    elif signal.status is Status.FAIL:
        parts.append(f"non-contiguous ids ({name}) change nothing: residual {signal.residual:.3g} = "
                     f"{signal.ratio:.3g}x floor (position_ids ignored)")
    else:
        parts.append(f"non-contiguous ids ({name}): {signal.reason}")
    if status is Status.FAIL and perms and agree.status is Status.FAIL and signal.status is Status.FAIL:
        parts.insert(0, "position_ids ignored")
    summary = "; ".join(parts) + f" [noise floor {agree.noise_floor:.2g}, {length} tokens]"
    inert = inert_reason(subject, stack, ids) if signal.status is Status.FAIL and agree.status is Status.PASS else ""
    if inert:  # outputs that cannot carry positions at all (zero-initialised branches): not ignored ids
        details["inert"] = inert
        status, summary = Status.SKIP, f"no verdict: {inert} ({summary})"

    table_rows = tuple(
        (layer_name(l, layers), f"{max(consistent[l]):.3e}" if perms else "not run", *[f"{m:.3e}" for m in moved[l]],
         f"{noise_floor(floors[l] if has_jitter else 0.0, dtype):.2e}")
        for l in range(layers))
    table = Table("position ids by layer", ("layer", "consistent error", *[f"{n} residual" for n, _ in variants],
                                            "noise floor"), table_rows)
    return CheckResult("positions", status, summary, metrics, details, (table,))
