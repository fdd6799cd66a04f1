"""compare — a port against its reference, layer by layer and position by position.

Self-consistency checks cannot see a converted checkpoint whose q/k rows were permuted with
the wrong pairing layout: it is still a perfectly relative RoPE model, only a different function.
A trusted reference finds it. Both models get the same token ids (sampled from the reference),
hidden states are aligned by index (embeddings, then each block; `layer_map` overrides), and
for every aligned layer we measure

    error_l = ||h_cand - h_ref|| / ||h_ref||             (relative L2 over every position)
    e_l(t)  = ||h_cand[t] - h_ref[t]|| / ||h_ref[t]||    (the same, position by position)

plus, on the logits, relative error, top-1 agreement and KL(ref || cand) per position.

Noise floor, measured in the same run: the model in the coarser dtype (the reference when
both agree) is run again in a finer dtype (float32 -> float64, bf16/fp16 -> float32) through
posdiag.model.precision (module by module; the model is restored bit for bit). That is the reference compared
with itself under a trivially different computation: its own rounding error, layer by layer.
Measured figures (tiny Llama/Qwen2/GPT-2, 128 tokens, fp32): eager vs SDPA 1.3e-7..6.4e-7 at the
last layer, fp32 vs fp64 1.3e-7..8.2e-7 — the same size, so a different attention kernel is
judged against the right yardstick. The error is judged as a ratio to that floor
(`verdict.judge_agreement`, at least one machine epsilon of the coarser dtype); in bf16/fp16 a
ratio below PASS_RATIO is inconclusive (WARN), never a verdict.

Position pattern (tools/profiles.py): an error that is zero at position 0 and grows with position
is the signature of a position bug; one already there at position 0 is a weight or norm bug.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from posdiag.errors import PosdiagError
from posdiag.model.precision import memory_allows, run_finer, weight_bytes
from posdiag.model.probe import Row, run_rows
from posdiag.model.subject import Outputs, Subject
from posdiag.options import RunOptions
from posdiag.results import CheckResult, Status, Table
from posdiag.tools.profiles import (LayerProfile, estimated_floor, layer_profile, logits_profile, per_position,
                                    rel)
from posdiag.verdict import FAIL_RATIO, LOW_PRECISION, MACHINE_EPSILON, PASS_RATIO

TITLE = "Comparison with a reference, position-resolved"

DEFAULT_SEQ_LEN = 512
"""Several hundred tokens: long enough that low-frequency RoPE pairs turn visibly, short enough for CPU."""

_FINER = {torch.float32: torch.float64, torch.bfloat16: torch.float32, torch.float16: torch.float32}
_BUCKETS = 24


@dataclass(frozen=True)
class Comparison:
    """The result (a CheckResult named "compare") and the per-position profiles behind it.

    profiles: one LayerProfile per aligned layer per stack (logits last, named "logits").
    """

    result: CheckResult
    profiles: tuple[LayerProfile, ...]
    seq_len: int


def original_context(subject: Subject) -> int | None:
    """The training context before any scaling: rope_parameters' original_max_position_embeddings
    (per layer type too), else the declared context."""
    values: list[int] = []
    for obj in (getattr(subject.config, "rope_parameters", None), getattr(subject.config, "rope_scaling", None)):
        blocks = [obj] if isinstance(obj, dict) else []
        if isinstance(obj, dict) and any(isinstance(v, dict) for v in obj.values()):
            blocks = [v for v in obj.values() if isinstance(v, dict)]
        for block in blocks:
            value = block.get("original_max_position_embeddings")
            if isinstance(value, int) and value > 0:
                values.append(value)
    value = getattr(subject.config, "original_max_position_embeddings", None)
    if isinstance(value, int) and value > 0:
        values.append(value)
    return min(values) if values else subject.max_positions


def choose_length(reference: Subject, candidate: Subject, options: RunOptions, long: bool) -> tuple[int, dict[str, Any]]:
    """The probe length and why: within both declared contexts (and the original one) by
    default; past the original context with `long`."""
    # Usable positions: a table read with an offset (RoBERTa's pad+1) has that many fewer.
    declared = [d for s in (reference, candidate) if (d := s.max_positions)]
    cap = min(declared) if declared else None
    original = min([o for o in (original_context(reference), original_context(candidate)) if o], default=None)
    info = {"declared_context": cap, "original_context": original, "long": long}
    if options.token_ids is not None:
        length = len(options.token_ids)
    elif long:
        if original is None:
            raise PosdiagError("--long needs an original context length (max_position_embeddings or "
                               "rope_parameters.original_max_position_embeddings) and neither model declares one")
        length = options.seq_len or 2 * original
    elif options.seq_len is not None:
        length = options.seq_len
    else:
        length = min([DEFAULT_SEQ_LEN] + [c for c in (cap, original) if c])
    if length < 4:
        raise PosdiagError(f"--seq-len {length} is too short: the comparison needs at least 4 tokens")
    if long and original is not None and length <= original:
        raise PosdiagError(f"--long runs past the original context of {original} tokens; --seq-len {length} does not")
    if not long and cap is not None and length > cap:
        raise PosdiagError(f"--seq-len {length} exceeds the declared context of {cap} tokens (add --long to run past it)")
    return length, info


def compare_subjects(reference: Subject, candidate: Subject, options: RunOptions | None = None, *,
                     long: bool | None = None, layer_map: dict[int, int] | None = None) -> Comparison:
    """Compare CANDIDATE with REFERENCE on the same ids. Never prints; raises PosdiagError on
    inputs that cannot be compared (different kinds, vocabularies, a too-long --seq-len)."""
    options = options or RunOptions()
    extra = options.for_check("compare")
    long = bool(extra.get("long", False)) if long is None else long
    layer_map = layer_map if layer_map is not None else extra.get("layer_map")
    if reference.kind != candidate.kind:
        raise PosdiagError(f"cannot compare a {reference.kind} reference with a {candidate.kind} candidate")
    length, info = choose_length(reference, candidate, options, long)
    if options.token_ids is not None:
        ids = torch.tensor(options.token_ids, dtype=torch.long)
    else:
        ids = reference.sample_ids(1, length, options.seed)[0].cpu()
    if int(ids.max()) >= candidate.vocab_size:
        raise PosdiagError(f"probe ids reach {int(ids.max())}; the candidate's vocabulary has only {candidate.vocab_size} ids")

    passes_before = reference.forward_count + (candidate.forward_count if candidate is not reference else 0)
    cmp_dtype = _coarser(reference.dtype, candidate.dtype)
    dtype_name = _name(cmp_dtype)
    floor_subject = candidate if _eps(candidate.dtype) > _eps(reference.dtype) else reference

    profiles: list[LayerProfile] = []
    notes: list[str] = []
    logits_stats: dict[str, Any] = {}
    floor_sources: set[str] = set()
    for stack in reference.stacks:
        out_r = _run(reference, ids, stack, "reference")
        out_c = _run(candidate, ids, stack, "candidate")
        base = out_c if floor_subject is candidate else out_r
        out_f, source = _finer_run(floor_subject, ids, stack)
        floor_sources.add(source)
        for bad_name, out in (("reference", out_r), ("candidate", out_c)):
            bad = _first_non_finite(out)
            if bad is not None:
                status = Status.ERROR if bad_name == "reference" else Status.FAIL
                return _early(status, f"non-finite {bad_name} output at {_layer_name(bad, len(out.hidden), stack, reference.kind)}",
                              length, info, reference, candidate, passes_before)
        pairs, note = _pairs(len(out_r.hidden), len(out_c.hidden), layer_map)
        if note:
            notes.append(note)
        for ri, ci in pairs:
            a, b = out_r.hidden[ri][0], out_c.hidden[ci][0]
            name = _layer_name(ri, len(out_r.hidden), stack, reference.kind)
            if a.shape != b.shape:
                notes.append(f"{name}: shapes differ ({tuple(a.shape)} vs {tuple(b.shape)}), not compared")
                continue
            fi = ci if floor_subject is candidate else ri
            floor_pos = per_position(base.hidden[fi][0], out_f.hidden[fi][0]) if out_f is not None else None
            floor = rel(base.hidden[fi][0], out_f.hidden[fi][0]) if out_f is not None else estimated_floor(ri, dtype_name)
            profiles.append(layer_profile(name, ri, ci, a, b, floor, floor_pos, dtype_name, reference.kind, stack))
        if out_r.logits is not None and out_c.logits is not None and stack == reference.stacks[-1]:
            if out_r.logits.shape != out_c.logits.shape:
                notes.append(f"logits: shapes differ ({tuple(out_r.logits.shape)} vs {tuple(out_c.logits.shape)}), not compared")
            else:
                flog = None if out_f is None else (base.logits[0], out_f.logits[0])
                prof, logits_stats = logits_profile(out_r.logits[0], out_c.logits[0], flog, dtype_name, reference.kind, stack)
                profiles.append(prof)
    passes = reference.forward_count + (candidate.forward_count if candidate is not reference else 0) - passes_before
    return _finish(profiles, logits_stats, length, info, dtype_name, floor_sources, notes, reference, candidate, passes)


# ------------------------------------------------------------------------------ running
def _run(subject: Subject, ids: torch.Tensor, stack: str, role: str) -> Outputs:
    try:
        return run_rows(subject, [Row(ids.to(subject.device))], stack=stack, explicit_mask=False, want_logits=True)
    except PosdiagError:
        raise
    except Exception as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        declared = subject.max_positions
        hint = (f" (past its declared context of {declared}: a position table has no rows there)"
                if declared and ids.numel() > declared else "")
        raise PosdiagError(f"the {role} failed on {ids.numel()} tokens: {type(exc).__name__}: {text[:200]}{hint}") from None


def _finer_run(subject: Subject, ids: torch.Tensor, stack: str) -> tuple[Outputs | None, str]:
    """Run `subject` once more in a finer dtype (precision.run_finer; restored exactly afterwards)."""
    dtype = next(iter(subject.model.parameters())).dtype
    finer = _FINER.get(dtype)
    reason = None
    if finer is None:
        reason = f"{_name(dtype)} has no finer dtype to compare with"
    elif subject.options.device_map:
        reason = "a --device-map model is not re-cast"
    elif not memory_allows(subject, weight_bytes(subject, finer), 0.8):
        reason = f"not enough free memory for a {_name(finer)} copy of the weights"
    if reason is None:
        row = [Row(ids.to(subject.device))]
        try:
            got = run_finer(subject, lambda: run_rows(subject, row, stack=stack, explicit_mask=False, want_logits=True),
                            finer, what="run")
        except Exception as exc:  # some families refuse float64: fall back to the dtype minimum
            reason = f"{_name(finer)} run failed ({type(exc).__name__})"
        else:
            if got.ran:
                return got.value, f"{subject.spec} run in {_name(got.dtype)} vs {_name(dtype)} (its own rounding)"
            reason = got.reason
    return None, f"estimated: {_name(dtype)} machine epsilon x layer index ({reason})"


# ------------------------------------------------------------------------------ verdict
def _finish(profiles: list[LayerProfile], logits_stats: dict[str, Any], length: int, info: dict[str, Any],
            dtype: str, floor_sources: set[str], notes: list[str], reference: Subject, candidate: Subject,
            passes: int) -> Comparison:
    details: dict[str, Any] = {**info, "seq_len": length, "compared_dtype": dtype,
                               "reference": reference.info.to_dict(), "candidate": candidate.info.to_dict(),
                               "floor_source": "; ".join(sorted(floor_sources)), "notes": notes}
    if not profiles:
        result = CheckResult("compare", Status.SKIP, "no layer could be compared: " + "; ".join(notes), details=details)
        return Comparison(result, (), length)
    # Ties (e.g. every ratio 0 for identical copies) name the last layer: the output.
    worst = max(reversed(profiles), key=lambda p: p.ratio if p.ratio == p.ratio else math.inf)
    first = next((p for p in profiles if p.differs), None)
    final_hidden = [p for p in profiles if p.name != "logits"]
    final = final_hidden[-1] if final_hidden else worst
    metrics: dict[str, Any] = {"error": final.error, "noise_floor": final.floor, "tolerance": final.tolerance,
                               "ratio": worst.ratio, "max_ratio_layer": worst.name, **logits_stats}
    where = f"{length} tokens" + (f", past the original context of {info['original_context']}" if info["long"] else "")
    rows = []
    for p in profiles:
        pat = p.pattern.get("pattern", "") if p.differs else ""
        rows.append((p.name, f"{p.error:.3e}", f"{p.floor:.2e}", f"{p.ratio:.3g}",
                     f"{p.per_position[0]:.2e}" if p.per_position else "", pat))
    table = Table("error by layer (relative L2; position 0 shown apart)",
                  ("layer", "error", "noise floor", "ratio", "at position 0", "pattern"), tuple(rows))
    details["layers"] = [{"name": p.name, "ref_index": p.ref_index, "cand_index": p.cand_index, "error": p.error,
                          "noise_floor": p.floor, "ratio": p.ratio, **p.pattern} for p in profiles]
    details["profile"] = _bucketed(profiles, length)
    logit_txt = ""
    if logits_stats:
        logit_txt = (f"; logits: top-1 agree {100 * logits_stats['top1_agreement']:.1f}%, "
                     f"mean KL {logits_stats['kl_mean']:.2g}")
    if first is None:
        status = Status.PASS
        summary = (f"same model within rounding: worst error {worst.error:.3g} = {worst.ratio:.3g}x noise floor "
                   f"at {worst.name} (tolerance {FAIL_RATIO:g}x){logit_txt} ({where})")
    else:
        pattern = first.pattern
        details.update({"first_layer": first.name, "pattern": pattern.get("pattern"), "pattern_why": pattern.get("why"),
                        "onset_position": pattern.get("onset_position")})
        metrics.update({"first_layer": first.name, "first_layer_error": first.error, "first_layer_ratio": first.ratio,
                        "position0_error": pattern.get("position0_error"), "start_ratio": pattern.get("start_ratio"),
                        "late_over_early": pattern.get("late_over_early"), "spearman": pattern.get("spearman")})
        low = dtype in LOW_PRECISION and worst.ratio <= PASS_RATIO and worst.ratio == worst.ratio
        status = Status.WARN if low else Status.FAIL
        lead = (f"inconclusive in {dtype}: within {PASS_RATIO:g}x of rounding; compare in float32" if low
                else "differs")
        summary = (f"{lead} from {first.name} on (error {first.error:.3g} = {first.ratio:.3g}x noise floor); "
                   f"{pattern.get('pattern', 'pattern unknown')}: {pattern.get('why', '')}{logit_txt} ({where})")
    if notes:
        details["notes"] = notes
    result = CheckResult("compare", status, summary, metrics, details, (table,), forward_passes=passes)
    return Comparison(result, tuple(profiles), length)


def _early(status: Status, summary: str, length: int, info: dict[str, Any], reference: Subject,
           candidate: Subject, passes_before: int) -> Comparison:
    passes = reference.forward_count + (candidate.forward_count if candidate is not reference else 0) - passes_before
    details = {**info, "seq_len": length, "reference": reference.info.to_dict(), "candidate": candidate.info.to_dict()}
    return Comparison(CheckResult("compare", status, summary, details=details, forward_passes=passes), (), length)


def bucket_edges(length: int, buckets: int = _BUCKETS) -> list[int]:
    """Position 0 alone, then geometrically growing buckets: early positions (where a position
    bug rises) are resolved one by one, late ones coarsely. Edges are bucket starts, then `length`."""
    edges = {0, 1}
    if length > 1:
        for k in range(buckets):
            edges.add(int(round(length ** (k / (buckets - 1)))))
    return sorted(e for e in edges if e < length) + [length]


def _bucketed(profiles: list[LayerProfile], length: int) -> dict[str, Any]:
    edges = bucket_edges(length)
    layers = {}
    for p in profiles:
        values = torch.tensor(p.per_position, dtype=torch.float64)
        layers[p.name] = [values[s:e].mean().item() for s, e in zip(edges[:-1], edges[1:])]
    return {"bucket_starts": edges[:-1], "length": length, "mean_error": layers,
            "tolerance": {p.name: p.tolerance for p in profiles}}


# ------------------------------------------------------------------------------ helpers
def parse_layer_map(text: str) -> dict[int, int]:
    """'0:0,1:2,2:4' -> {0: 0, 1: 2, 2: 4} (hidden-state indices: 0 = embeddings, i = block i)."""
    mapping: dict[int, int] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        left, sep, right = part.partition(":")
        if not sep or not left.strip().lstrip("-").isdigit() or not right.strip().lstrip("-").isdigit():
            raise PosdiagError(f"--layer-map entry '{part}' is not REF:CAND (hidden-state indices, 0 = embeddings)")
        mapping[int(left)] = int(right)
    if not mapping:
        raise PosdiagError("--layer-map is empty")
    return mapping


def _pairs(n_ref: int, n_cand: int, layer_map: dict[int, int] | None) -> tuple[list[tuple[int, int]], str]:
    if layer_map:
        pairs = []
        for r, c in layer_map.items():
            rr, cc = r % n_ref if -n_ref <= r < n_ref else None, c % n_cand if -n_cand <= c < n_cand else None
            if rr is None or cc is None:
                raise PosdiagError(f"--layer-map {r}:{c} is out of range ({n_ref} reference and {n_cand} candidate hidden states)")
            pairs.append((rr, cc))
        return sorted(pairs), ""
    if n_ref == n_cand:
        return [(i, i) for i in range(n_ref)], ""
    return [(0, 0), (n_ref - 1, n_cand - 1)], (f"layer counts differ ({n_ref - 1} vs {n_cand - 1} blocks): comparing "
                                               "embeddings and the final output only (map the rest with --layer-map)")


def _layer_name(index: int, total: int, stack: str, kind: str) -> str:
    base = "embeddings" if index == 0 and total > 1 else f"block {index}"
    return f"{stack} {base}" if kind == "seq2seq" else base


def _first_non_finite(out: Outputs) -> int | None:
    for i, h in enumerate(out.hidden):
        if not bool(torch.isfinite(h).all()):
            return i
    return None


def _eps(dtype: torch.dtype) -> float:
    return MACHINE_EPSILON.get(_name(dtype), 1.2e-7)


def _coarser(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return a if _eps(a) >= _eps(b) else b


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
