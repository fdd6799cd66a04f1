"""Two checkpoints' stored tensors side by side: which differ, which one side lacks.

Where both sides are safetensors checkpoints, the tensors themselves name what a port changed, which the shape of
an output error can only suggest: a GPT-2 whose position table was zeroed differs at position 0 as much as anywhere
(an absolute table adds its row to the first token too), exactly like a wrong norm weight would. Tensors are read one
pair at a time (memory: the largest pair), matched by name (or by the name without the base model's prefix, for a
port saved from another head class), compared in float64 up to the rounding of the coarser stored dtype, so a port
that only changed the storage dtype differs in nothing. Position parameters are listed first.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from posdiag.model.checkpoint import is_position_key
from posdiag.model.subject import Subject
from posdiag.model.tensors import dtype_name
from posdiag.verdict import MACHINE_EPSILON

RELATIVE = ("relative", "alibi", "rotary")  # position parameters that are not a table of rows per position


@dataclass(frozen=True)
class CheckpointDiff:
    """differ: tensors in both whose values (or shapes) differ; missing: the reference's tensors the candidate's
    checkpoint lacks (transformers re-initialises them at load); extra: the candidate's the reference lacks."""

    compared: int
    differ: tuple[str, ...]
    missing: tuple[str, ...]
    extra: tuple[str, ...]

    @property
    def position_only(self) -> bool:
        """Every tensor that changed is a position parameter (and one did)."""
        changed = self.differ + self.missing
        return bool(changed) and all(is_position_key(k) for k in changed) and not self.extra

    def sentence(self) -> str:
        """What the tensors say, position parameters first."""
        equal = self.compared - len(self.differ)
        if not (self.differ or self.missing or self.extra):
            return (f"the checkpoints' {self.compared} stored tensors are identical: the difference is in the "
                    "configuration or the code, not the weights")
        parts = []
        if self.differ:
            parts.append(f"{_named(self.differ)} {'differs' if len(self.differ) == 1 else 'differ'}")
        if self.missing:
            parts.append(f"{_named(self.missing)} missing from the candidate's checkpoint (re-initialised at load)")
        if self.extra:
            parts.append(f"{_named(self.extra)} only in the candidate's checkpoint")
        changed = self.differ + self.missing
        what = ("the position table" if all(_position_word(n) == "position table" for n in changed)
                else "position parameters")
        lead = f"the weights differ only in {what}" if self.position_only else "the weights differ"
        rest = (f"all {self.compared} shared tensors are equal" if equal == self.compared
                else f"the other {equal} of {self.compared} shared tensors are equal")
        return f"{lead}: {'; '.join(parts)} ({rest})"

    def to_dict(self) -> dict[str, object]:
        return {"compared": self.compared, "differ": list(self.differ), "missing": list(self.missing),
                "extra": list(self.extra), "position_only": self.position_only}


def checkpoint_diff(reference: Subject, candidate: Subject) -> CheckpointDiff | None:
    """The stored tensors of two safetensors checkpoints compared; None where either side has none to read (an
    in-memory model, pickle or GGUF weights)."""
    from safetensors import safe_open

    sides = [_tensor_files(s) for s in (reference, candidate)]
    if not all(sides):
        return None
    ref_files, cand_files = sides
    cand_by_name = dict(cand_files)
    matched, missing = _matched(list(ref_files), list(cand_by_name))
    differ = []
    for ref_name, cand_name in matched:
        with safe_open(ref_files[ref_name], framework="pt") as a:
            stored = a.get_tensor(ref_name)
        with safe_open(cand_by_name[cand_name], framework="pt") as b:
            if _differs(stored, b.get_tensor(cand_name)):
                differ.append(ref_name)
    extra = sorted(set(cand_by_name) - {c for _, c in matched})
    return CheckpointDiff(len(matched), _positions_first(differ), _positions_first(missing), _positions_first(extra))


def _tensor_files(subject: Subject) -> dict[str, str] | None:
    """Every stored tensor name -> its safetensors file."""
    from safetensors import safe_open

    info = subject.load_info
    files = [f for f in info.files if f.endswith(".safetensors") and Path(f).is_file()]
    if info.source != "safetensors" or not files:
        return None
    out: dict[str, str] = {}
    for f in files:
        with safe_open(f, framework="pt") as handle:
            out.update(dict.fromkeys(handle.keys(), f))
    return out


def _matched(ref: list[str], cand: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """Pairs by exact name, then by suffix where exactly one name matches (a port saved from another head class:
    `transformer.wpe.weight` against `wpe.weight`); the reference's names left over are missing."""
    cand_set = set(cand)
    pairs = [(name, name) for name in ref if name in cand_set]
    rest = cand_set - {c for _, c in pairs}
    missing = []
    for name in (n for n in ref if n not in cand_set):
        hits = [c for c in rest if c.endswith("." + name) or name.endswith("." + c)]
        if len(hits) == 1:
            pairs.append((name, hits[0]))
            rest.discard(hits[0])
        else:
            missing.append(name)
    return pairs, missing


def _differs(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return True
    if not (a.is_floating_point() and b.is_floating_point()):
        return not torch.equal(a, b)
    if a.dtype == b.dtype and torch.equal(a, b):
        return False
    x, y = a.double(), b.double()
    scale = float(x.abs().max()) if x.numel() else 0.0
    rounding = max(MACHINE_EPSILON.get(dtype_name(a.dtype), 1.2e-7), MACHINE_EPSILON.get(dtype_name(b.dtype), 1.2e-7))
    return not bool(((x - y).abs() <= rounding * scale).all())


def _positions_first(names: list[str]) -> tuple[str, ...]:
    return tuple(sorted(names, key=lambda n: (not is_position_key(n), n)))


def _named(names: tuple[str, ...], shown: int = 6) -> str:
    listed = [f"{n} ({_position_word(n)})" if is_position_key(n) else n for n in names[:shown]]
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(listed) + more


def _position_word(name: str) -> str:
    return "position parameter" if any(r in name.lower() for r in RELATIVE) else "position table"
