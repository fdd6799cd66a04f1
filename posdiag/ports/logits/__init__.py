"""Logits compared: a port that returns only logits, judged position by position.

The reference (PyTorch) and the engine get the same token ids. With no hidden states from the
engine, the comparison is on the logits, at every position t:

    e(t) = ||logits_eng[t] - logits_ref[t]|| / ||logits_ref[t]||

Noise floor, measured in the same run: the reference again in a finer dtype (float32 -> float64).
That is the size of float32 rounding for this model on these tokens; a different engine computing
the same function in float32 (other kernels, other summation order) lands within a few of it —
as long as the engine itself keeps float32 (its KV cache too: llama.cpp's default f16 cache alone
costs ~1e-4). The error is judged as a ratio to that floor (FAIL above FAIL_RATIO x). A quantised
candidate's floor is the quantisation's own error, measured per position (posdiag/ports/logits/quant_floor.py).
An engine with `logits_continued` is also run as a prefill of the first half plus a continuation, and
that run is judged the same way, as its own profile.

Shape of the error, which names the cause:
- grows with position from 1: zero at position 0 (a token that sees only itself cannot feel a
  relative position encoding) and there from the first token that sees another: RoPE base, rotary
  pairing layout, scaling.
- starts at a length N > 1: exact up to N, then wrong: a window, context or scaling boundary; N is
  matched against the boundaries both sides declare (sliding_window, original context, context).
- uniform from position 0: already wrong for a token that sees only itself: weights, norm,
  activation, embedding scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from posdiag.errors import PosdiagError
from posdiag.model.subject import Subject
from posdiag.options import RunOptions
from posdiag.ports.engines.logits_only import Engine
from posdiag.ports.lengths import DEFAULT_SEQ_LEN, original_context
from posdiag.ports.logits import quant_floor, quant_twin
from posdiag.ports.logits.shapes import judge_profile
from posdiag.ports.logits.verdict import engine_info, verdict
from posdiag.ports.profile import Comparison, LayerProfile, bucketed, per_position_error, rel_error
from posdiag.ports.protocol import CompareRequest, Stage, no_stage
from posdiag.ports.reference import finer_run, name_of, run_stack
from posdiag.verdict import FAIL_RATIO, noise_floor


@dataclass
class _Run:
    """One engine comparison as its phases fill it in: the ids, the reference's logits, the floor per
    position (raised by a quantised engine's own error) and the profiles judged against it."""

    ids: torch.Tensor
    length: int
    covered: int  # positions the engine runs (its context may be shorter)
    info: dict[str, Any]
    boundaries: dict[str, int]
    ref: torch.Tensor  # the reference's logits [T, V], float64
    dtype: str
    floor: float
    floor_source: str
    floors: torch.Tensor  # [length] float64
    split: Any = None  # quant_twin's split of a quantised file's error, when it was measured
    inconclusive: str | None = None
    coarse_file: str | None = None  # why the quantised file's own line can show nothing beyond its twin's
    profiles: list[LayerProfile] = field(default_factory=list)


def judge(reference: Subject, engine: Engine, request: CompareRequest) -> Comparison:
    """The judge of a port with logits (posdiag/ports/comparison.JUDGES)."""
    options = request.run_options(reference, engine)
    if request.layer_map:
        raise PosdiagError("--layer-map aligns hidden states; an engine candidate gives only logits")
    return compare_engine(reference, engine, options, long=request.long, stage=request.stage)


def compare_engine(reference: Subject, engine: Engine, options: RunOptions | None = None, *,
                   long: bool = False, stage: Stage = no_stage) -> Comparison:
    """Compare a logits-only ENGINE with REFERENCE on the same ids. Never prints; raises
    PosdiagError on inputs that cannot be compared. STAGE is told each phase as it starts."""
    options = options or RunOptions()
    if reference.kind != "causal":
        raise PosdiagError(f"an engine is compared with a causal (decoder-only) reference, not a {reference.kind} one")
    before = reference.forward_count
    stage("reference and its float64 floor")
    run = _reference_run(reference, engine, options, long)
    run_ids = run.ids[:run.covered].tolist()
    notes: list[str] = []
    stage(f"candidate on {len(run_ids)} tokens")
    cand = _vocab(engine.run(run_ids), run.ref, notes)
    if engine.quantization:
        stage(f"what {engine.quantization} adds (F32 twin)")
        _quantisation_floors(run, reference, engine, run_ids, cand)
    tolerances = FAIL_RATIO * run.floors
    tolerance = float(tolerances[:run.covered].median())
    if engine.can_continue and run.covered >= 4:
        stage(f"candidate continued from position {run.covered // 2}")
    _logit_profiles(run, engine, run_ids, cand, tolerances)
    details = _details(run, reference, engine, cand, notes)
    result = verdict(run.profiles, engine, run.length, details, reference.forward_count - before, run.inconclusive,
                      tolerance)
    return Comparison(result, tuple(reversed(run.profiles)), run.length)


def _reference_run(reference: Subject, engine: Engine, options: RunOptions, long: bool) -> _Run:
    """The ids, the reference's logits on them, and its rounding floor (float32 against float64, raised by
    the approximations the engine declares)."""
    boundaries = declared_boundaries(reference, engine)
    length, info = probe_length(reference, options, long, boundaries)
    if options.token_ids is not None:
        ids = torch.tensor(options.token_ids, dtype=torch.long)
    else:
        ids = reference.sample_ids(1, length, options.seed)[0].cpu()
    stack = reference.stacks[-1]
    ref = run_stack(reference, ids, stack, "reference").logits
    if ref is None:
        raise PosdiagError("the reference gives no logits (a language-model head is needed to compare with an engine)")
    ref = ref[0].double().cpu()
    fine, floor_source = finer_run(reference, ids, stack)
    dtype = name_of(reference.dtype)
    floor = noise_floor(rel_error(ref, fine.logits[0]) if fine is not None else 0.0, dtype)
    approx = approximation_floor(reference, ids, stack, engine, ref)
    if approx is not None and approx[0] > floor:
        floor, floor_source = approx[0], f"{floor_source}; raised to {approx[0]:.2g} by {approx[1]}"
    covered = min(length, engine.context_length) if engine.context_length else length
    return _Run(ids, length, covered, info, boundaries, ref, dtype, floor, floor_source,
                own_rounding(ref, fine, floor, length))


def _quantisation_floors(run: _Run, reference: Subject, engine: Engine, run_ids: list[int],
                         cand: torch.Tensor) -> None:
    """A quantised engine's floor per position: the F32 twin's split (the weights' rounding plus the
    quantisation), else the quantisation's error measured on posdiag's own conversion of the reference."""
    covered, floor = run.covered, run.floor
    with quant_floor.workdir() as tmp:
        split = quant_twin.measure(reference, engine, run_ids, run.ref, cand, tmp)
        measured = quant_floor.measure(reference, engine, run_ids, run.ref, tmp) if isinstance(split, str) else None
    if measured is not None:
        split = None
        run.inconclusive = measured if isinstance(measured, str) else None
    run.split = split
    if split is not None:  # the F32 twin's line: position handling at float32 noise, against the same weights
        twin_floors = run.floors.clone()
        run.floors[:covered] = torch.maximum(split.weights + split.quantisation, run.floors[:covered])
        run.floor_source = f"{run.floor_source}; {split.weights_source}"
        run.profiles.append(_profile("logits, F32 twin", split.twin_reference(run.ref), split.twin, covered,
                                     run.length, floor, FAIL_RATIO * twin_floors, run.boundaries))
        run.inconclusive = _too_coarse(twin_floors[:covered], "the reference's own rounding")
        run.coarse_file = _too_coarse(run.floors[:covered], f"what the {split.kind} file adds")
    elif not isinstance(measured, str):
        run.floors[:covered] = torch.maximum(measured.per_position, run.floors[:covered])
        run.floor, run.floor_source = measured.error, measured.describe()
        run.inconclusive = _too_coarse(run.floors[:covered], f"{measured.kind} weights whose own error, measured "
                                       f"on posdiag's {measured.kind} conversion of the reference")


def _logit_profiles(run: _Run, engine: Engine, run_ids: list[int], cand: torch.Tensor,
                    tolerances: torch.Tensor) -> None:
    """The engine's logits by position, and, where it can continue a cache, its continuation from the middle."""
    run.profiles.append(_profile("logits", run.ref, cand, run.covered, run.length, run.floor, tolerances,
                                 run.boundaries))
    if engine.can_continue and run.covered >= 4:
        split_at = run.covered // 2
        continued = _vocab(engine.run_continued(run_ids, split_at), run.ref, [])
        run.profiles.append(_profile(f"logits, continued from position {split_at}", run.ref, continued, run.covered,
                                     run.length, run.floor, tolerances, {**run.boundaries, "continuation": split_at}))


def _details(run: _Run, reference: Subject, engine: Engine, cand: torch.Tensor, notes: list[str]) -> dict[str, Any]:
    covered, length = run.covered, run.length
    details: dict[str, Any] = {
        **run.info, "seq_len": length, "compared_dtype": run.dtype, "floor_source": run.floor_source,
        "reference": reference.info.to_dict(), "candidate": engine_info(engine, run.dtype),
        "engine": {"name": engine.name, **engine.settings}, "boundaries": run.boundaries,
        "boundaries_crossed": {k: v for k, v in run.boundaries.items() if v < length}, "covered_positions": covered,
        "notes": notes, "profile": bucketed(run.profiles, length),
        "layers": [{"name": p.name, "error": p.error, "noise_floor": p.floor, "ratio": p.ratio, **p.pattern}
                   for p in run.profiles],
    }
    if engine.can_continue and covered >= 4:
        details["continued_from"] = covered // 2
    if run.split is not None:
        details["quantisation_split"] = quant_twin.describe(run.split, run.ref, cand, covered)
        if run.coarse_file:
            details["quantisation_split"]["file_too_coarse"] = run.coarse_file
    if engine.quantization and run.inconclusive is None:
        floors = run.floors[:covered]
        details["quantisation_floor"] = {"kind": engine.quantization, "per_position": floors.tolist(),
                                         "max": float(floors.max()), "median": float(floors.median())}
    return details


def own_rounding(ref: torch.Tensor, fine: Any, floor: float, length: int) -> torch.Tensor:
    """The reference's own rounding at each position (its run dtype against its finer run), at least FLOOR.

    One scalar floor is not enough: a position where the logits are ill-conditioned (a near-tie in attention, one
    large activation) rounds far above the sequence's median in the reference itself. SmolLM2 with linear scaling
    x2 rounds 9.6e-6 at position 1 against its float64 run and ~5e-7 elsewhere; an engine at 2.9e-5 there is
    twice the reference's own rounding, not a position bug."""
    floors = torch.full((length,), floor, dtype=torch.float64)
    if fine is not None:
        floors = torch.maximum(floors, per_position_error(fine.logits[0], ref))
    return floors


def _too_coarse(floors: torch.Tensor, what: str) -> str | None:
    """Why no bug could be seen above FLOORS (their median times FAIL_RATIO reaches the logits' size), or None."""
    median = float(floors.median())
    if median * FAIL_RATIO < 1.0:
        return None
    return (f"{what} (median {median:.2g} per position), times {FAIL_RATIO:g} reaches the size of the logits: no "
            "bug could stand above it")


def _vocab(cand: torch.Tensor, ref: torch.Tensor, notes: list[str]) -> torch.Tensor:
    if cand.shape[1] != ref.shape[1]:
        if cand.shape[1] < ref.shape[1]:
            raise PosdiagError(f"the engine returns {cand.shape[1]} logits per position; the reference {ref.shape[1]}")
        notes.append(f"engine vocabulary {cand.shape[1]} > reference {ref.shape[1]}: the first {ref.shape[1]} compared")
        cand = cand[:, : ref.shape[1]]
    return cand


def _profile(name: str, ref: torch.Tensor, cand: torch.Tensor, covered: int, length: int, floor: float,
             tolerances: torch.Tensor, boundaries: dict[str, int]) -> LayerProfile:
    per = torch.full((length,), math.nan, dtype=torch.float64)
    per[:covered] = per_position_error(ref[:covered], cand)
    error = rel_error(ref[:covered], cand)
    shape = judge_profile(per, tolerances, boundaries)
    shape["worst_position_ratio"] = float((per[:covered] / (tolerances[:covered] / FAIL_RATIO)).max())
    return LayerProfile(name, None, None, error, floor, float(tolerances[:covered].median()), error / floor,
                        tuple(per.tolist()), shape)


def approximation_floor(reference: Subject, ids: torch.Tensor, stack: str, engine: Engine,
                        ref: torch.Tensor) -> tuple[float, str] | None:
    """The size of an engine's documented approximation, measured on the reference: the reference
    run again with that approximation applied, against itself. None when none applies."""
    if "gelu_f16" not in engine.approximations:
        return None
    gelus = [m for m in reference.model.modules() if "gelu" in type(m).__name__.lower()]
    if not gelus:
        return None

    def to_f16(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(torch.float16).to(tensor.dtype)

    handles = [m.register_forward_pre_hook(lambda _m, args: (to_f16(args[0]), *args[1:])) for m in gelus]
    handles += [m.register_forward_hook(lambda _m, _args, out: to_f16(out)) for m in gelus]
    try:
        approx = run_stack(reference, ids, stack, "reference").logits[0].double().cpu()
    finally:
        for handle in handles:
            handle.remove()
    return rel_error(ref, approx), f"the engine's float16 GELU table, measured on the reference ({len(gelus)} GELUs)"


def declared_boundaries(reference: Subject, engine: Engine) -> dict[str, int]:
    """Every length either side declares, by name: where a port's behaviour may change."""
    out: dict[str, int] = {}
    if reference.sliding_window:
        out["sliding_window"] = int(reference.sliding_window)
    original, declared = original_context(reference), reference.max_positions
    if original and declared and original < declared:
        out["original_context"] = int(original)
    if declared:
        out["context"] = int(declared)
    for name, value in engine.boundaries.items():
        if out.get(name) != value:
            out[f"engine {name}"] = int(value)
    if engine.context_length and engine.context_length != declared:
        out["engine context"] = int(engine.context_length)
    return out


def probe_length(reference: Subject, options: RunOptions, long: bool,
                 boundaries: dict[str, int]) -> tuple[int, dict[str, Any]]:
    """Past the sliding window by default; past the original context with `long`; never past
    the reference's declared context unless asked with `long`."""
    declared = reference.max_positions
    original = original_context(reference)
    info = {"declared_context": declared, "original_context": original, "long": long}
    windows = [v for k, v in boundaries.items() if "sliding_window" in k]
    if options.token_ids is not None:
        length = len(options.token_ids)
    elif options.seq_len is not None:
        length = options.seq_len
    elif long:
        if original is None:
            raise PosdiagError("--long needs an original context length and the reference declares none")
        length = 2 * original if not declared or declared <= original else max(declared, original + 1)
    else:
        length = min([DEFAULT_SEQ_LEN] + ([declared] if declared else []))
        if windows and max(windows) >= length:  # past the window when the context allows it
            length = min([2 * max(windows)] + ([declared] if declared else []))
    if length < 4:
        raise PosdiagError(f"--seq-len {length} is too short: the comparison needs at least 4 tokens")
    if not long and declared and length > declared:
        raise PosdiagError(f"--seq-len {length} exceeds the reference's declared context of {declared} tokens "
                           "(add --long to run past it)")
    return length, info
