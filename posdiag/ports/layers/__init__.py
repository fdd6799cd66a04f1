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
both agree) is run again up-cast in place to a finer dtype (float32 -> float64, bf16/fp16 ->
float32; exact both ways, so the model is restored bit for bit). That is the reference compared
with itself under a trivially different computation: its own rounding error, layer by layer.
Measured figures (tiny Llama/Qwen2/GPT-2, 128 tokens, fp32): eager vs SDPA 1.3e-7..6.4e-7 at the
last layer, fp32 vs fp64 1.3e-7..8.2e-7 — the same size, so a different attention kernel is
judged against the right yardstick. The error is judged as a ratio to that floor
(`verdict.judge_agreement`, at least one machine epsilon of the coarser dtype); in bf16/fp16 a
ratio below PASS_RATIO is inconclusive (WARN), never a verdict.

Position pattern (computed at the first layer where the error appears, the layer nearest the
cause): a relative position encoding (RoPE, ALiBi, a relative bias) cannot change a token that
sees only itself, so a position bug in a causal stack leaves position 0 at the noise floor and
the error rises as tokens see more, and more distant, keys. A weight or norm bug acts on every
token: it is already there at position 0, at the level of the rest — and so does a bug in an
absolute position table (learned, sinusoidal), whose row 0 is added to the first token: for those
models a uniform error names the table among the causes, never "not positions". Where both sides
are safetensors checkpoints, a FAIL also names the stored tensors that differ, position
parameters first (posdiag.model.checkpoint_diff): the weights, not the error's shape, say which.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from posdiag.errors import PosdiagError
from posdiag.model.subject import Subject
from posdiag.options import Option, RunOptions
from posdiag.ports.layers.helpers import coarser, epsilon, first_non_finite, layer_name, layer_pairs, parse_layer_map
from posdiag.ports.layers.measuring import ABSOLUTE, estimated_floor, layer_profile, logits_profile
from posdiag.ports.layers.verdict import early_result, finish
from posdiag.ports.lengths import DEFAULT_SEQ_LEN, original_context
from posdiag.ports.profile import (
    UNIFORM_START_FRACTION,
    Comparison,
    LayerProfile,
    bucket_edges,
    per_position_error,
    rel_error,
)
from posdiag.ports.protocol import CompareRequest, Stage, no_stage
from posdiag.ports.reference import finer_run, name_of, run_stack
from posdiag.results import Status

__all__ = ["TITLE", "DEFAULT_SEQ_LEN", "OPTIONS", "UNIFORM_START_FRACTION", "Comparison", "LayerProfile",
           "bucket_edges", "choose_length", "compare_subjects", "judge", "original_context", "parse_layer_map"]

TITLE = "Comparison with a reference, position-resolved"

# The `[checks.compare]` config table (validated like a check's options; --long and --layer-map override it).
OPTIONS = {
    "long": Option(False, "off: a comparison past the declared context is asked for, never assumed"),
    "layer_map": Option(None, "None: layers are paired by index; a dict maps candidate layers to reference ones",
                        (dict,)),
}


def choose_length(reference: Subject, candidate: Subject, options: RunOptions,
                  long: bool) -> tuple[int, dict[str, Any]]:
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
        raise PosdiagError(f"--seq-len {length} exceeds the declared context of {cap} tokens (add --long to run past "
                           "it)")
    return length, info


def judge(reference: Subject, candidate: Any, request: CompareRequest) -> Comparison:
    """The judge of a port with hidden states (posdiag/ports/comparison.JUDGES): its model, layer by layer."""
    options = request.run_options(reference, candidate)
    return compare_subjects(reference, candidate.subject, options, long=request.long, layer_map=request.layer_map,
                            stage=request.stage)


def compare_subjects(reference: Subject, candidate: Subject, options: RunOptions | None = None, *,
                     long: bool | None = None, layer_map: dict[int, int] | None = None,
                     stage: Stage = no_stage) -> Comparison:
    """Compare CANDIDATE with REFERENCE on the same ids. Never prints; raises PosdiagError on
    inputs that cannot be compared (different kinds, vocabularies, a too-long --seq-len)."""
    options = options or RunOptions()
    extra = options.for_check("compare")
    long = bool(extra.get("long", False)) if long is None else long
    layer_map = layer_map if layer_map is not None else extra.get("layer_map")
    if reference.kind != candidate.kind:
        raise PosdiagError(f"cannot compare a {reference.kind} reference with a {candidate.kind} candidate")
    length, info = choose_length(reference, candidate, options, long)
    ids = _probe_ids(reference, candidate, options, length)
    passes_before = _passes(reference, candidate)
    cmp_dtype = coarser(reference.dtype, candidate.dtype)
    floor_subject = candidate if epsilon(candidate.dtype) > epsilon(reference.dtype) else reference
    absolute = any(str(s.position_kind) in ABSOLUTE for s in (reference, candidate))
    walk = _Walk(reference, candidate, ids, name_of(cmp_dtype), floor_subject, layer_map, absolute)
    for stack in reference.stacks:
        stage(f"both models layer by layer on {length} tokens, and the finer floor" + (
            f" ({stack})" if len(reference.stacks) > 1 else ""))
        broken = _compare_stack(walk, stack)
        if broken is not None:
            return early_result(*broken, length, info, reference, candidate, passes_before)
    passes = _passes(reference, candidate) - passes_before
    return finish(walk.profiles, walk.logits_stats, length, info, walk.dtype_name, walk.floor_sources, walk.notes,
                  reference, candidate, passes)


@dataclass
class _Walk:
    """One comparison going through the stacks: what both models run on, and what it has found so far."""

    reference: Subject
    candidate: Subject
    ids: torch.Tensor
    dtype_name: str  # the coarser of the two dtypes: the one compared in
    floor_subject: Subject  # the model in that dtype, run again finer for the floor
    layer_map: dict[int, int] | None
    absolute: bool  # either side adds an absolute position table (it reaches position 0)
    profiles: list[LayerProfile] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    logits_stats: dict[str, Any] = field(default_factory=dict)
    floor_sources: set[str] = field(default_factory=set)


def _probe_ids(reference: Subject, candidate: Subject, options: RunOptions, length: int) -> torch.Tensor:
    """The --text ids, or random ids from the reference's vocabulary; both vocabularies must hold them."""
    if options.token_ids is not None:
        ids = torch.tensor(options.token_ids, dtype=torch.long)
    else:
        ids = reference.sample_ids(1, length, options.seed)[0].cpu()
    if int(ids.max()) >= candidate.vocab_size:
        raise PosdiagError(f"probe ids reach {int(ids.max())}; the candidate's vocabulary has only "
                           f"{candidate.vocab_size} ids")
    return ids


def _passes(reference: Subject, candidate: Subject) -> int:
    return reference.forward_count + (candidate.forward_count if candidate is not reference else 0)


def _compare_stack(walk: _Walk, stack: str) -> tuple[Status, str] | None:
    """Both models and the finer floor run on one stack, every aligned layer (and the logits) profiled;
    -> (status, summary) when an output is not finite (the comparison ends there)."""
    reference, candidate = walk.reference, walk.candidate
    out_r = run_stack(reference, walk.ids, stack, "reference")
    out_c = run_stack(candidate, walk.ids, stack, "candidate")
    base = out_c if walk.floor_subject is candidate else out_r
    out_f, source = finer_run(walk.floor_subject, walk.ids, stack)
    walk.floor_sources.add(source)
    for bad_name, out in (("reference", out_r), ("candidate", out_c)):
        bad = first_non_finite(out)
        if bad is not None:
            status = Status.ERROR if bad_name == "reference" else Status.FAIL
            return status, f"non-finite {bad_name} output at {layer_name(bad, len(out.hidden), stack, reference.kind)}"
    _hidden_profiles(walk, stack, out_r, out_c, base, out_f)
    if out_r.logits is not None and out_c.logits is not None and stack == reference.stacks[-1]:
        if out_r.logits.shape != out_c.logits.shape:
            walk.notes.append(f"logits: shapes differ ({tuple(out_r.logits.shape)} vs {tuple(out_c.logits.shape)}), "
                              "not compared")
        else:
            flog = None if out_f is None else (base.logits[0], out_f.logits[0])
            prof, walk.logits_stats = logits_profile(out_r.logits[0], out_c.logits[0], flog, walk.dtype_name,
                                                     reference.kind, stack, walk.absolute)
            walk.profiles.append(prof)
    return None


def _hidden_profiles(walk: _Walk, stack: str, out_r, out_c, base, out_f) -> None:
    """A profile per aligned pair of hidden states, against the floor model's own rounding at that layer."""
    pairs, note = layer_pairs(len(out_r.hidden), len(out_c.hidden), walk.layer_map)
    if note:
        walk.notes.append(note)
    from_candidate = walk.floor_subject is walk.candidate
    for ri, ci in pairs:
        a, b = out_r.hidden[ri][0], out_c.hidden[ci][0]
        name = layer_name(ri, len(out_r.hidden), stack, walk.reference.kind)
        if a.shape != b.shape:
            walk.notes.append(f"{name}: shapes differ ({tuple(a.shape)} vs {tuple(b.shape)}), not compared")
            continue
        fi = ci if from_candidate else ri
        floor_pos = per_position_error(base.hidden[fi][0], out_f.hidden[fi][0]) if out_f is not None else None
        floor = (rel_error(base.hidden[fi][0], out_f.hidden[fi][0]) if out_f is not None
                 else estimated_floor(ri, walk.dtype_name))
        walk.profiles.append(layer_profile(name, ri, ci, a, b, floor, floor_pos, walk.dtype_name, walk.reference.kind,
                                           stack, walk.absolute))
