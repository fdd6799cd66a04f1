"""The noise floor of a quantised port: the quantisation's own error, measured, never assumed.

A quantised candidate (Q8_0, Q4_0...) legitimately differs from its float reference by the rounding of
its weights, and that size depends on the model and the tokens. posdiag measures it: it writes a
healthy conversion of the *reference* (posdiag/ports/gguf_writer.py) with every tensor in the type the
candidate stores it in, to a temporary file, runs it through the same engine with the same settings on
the same ids, and takes its error against the reference at every position. That profile is the floor
of the candidate, position by position.

When that cannot be done (an engine that cannot load another file, a family posdiag has no converter
for, a type the gguf package cannot quantise), the reason is returned instead, and the verdict on a
quantised candidate stays inconclusive with that reason.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from posdiag.errors import PosdiagError
from posdiag.model.subject import Subject
from posdiag.ports.engines.logits_only import Engine
from posdiag.ports.profile import per_position_error, rel_error


@dataclass(frozen=True)
class QuantFloor:
    per_position: torch.Tensor   # float64 [T]: the healthy quantised conversion's error at each position
    error: float                 # its error over all positions (relative L2)
    kind: str                    # e.g. "Q8_0"

    def describe(self) -> str:
        p = self.per_position
        return (f"the quantisation's own error, measured on posdiag's {self.kind} conversion of the reference: "
                f"{float(p.max()):.2g} / {float(p.median()):.2g} (per position max/median)")


def measure(reference: Subject, engine: Engine, ids: list[int], ref_logits: torch.Tensor,
            workdir: str) -> QuantFloor | str:
    """The quantisation floor of ENGINE on IDS, or why it cannot be measured (one line). The
    conversion is written under WORKDIR (a temporary directory the caller removes)."""
    if engine.twin is None or not engine.tensor_types:
        return (f"{engine.quantization} weights, and this engine cannot run another file (only a .gguf candidate "
                "can), so posdiag cannot measure the quantisation's own error")
    from posdiag.ports import gguf_writer

    model = reference.model
    reason = gguf_writer.can_convert(model)
    if reason:
        return f"{engine.quantization} weights, and {reason}: the quantisation's own error cannot be measured"
    try:
        conv = gguf_writer.convert(model)
        missing = sorted(set(engine.tensor_types) - set(conv.tensors))
        if missing:
            return (f"{engine.quantization} weights, and the candidate has tensors posdiag's conversion of the "
                    f"reference does not ({', '.join(missing[:3])}): the quantisation's own error cannot be measured")
        path = gguf_writer.write(conv, Path(workdir) / "posdiag-quantised-reference.gguf", dict(engine.tensor_types))
    except gguf_writer.ConversionError as exc:
        return f"{engine.quantization} weights, and posdiag cannot write that conversion: {exc}"
    twin = engine.twin(str(path))
    logits = twin.run(ids)[:, : ref_logits.shape[1]]
    ref_logits = ref_logits[: len(ids)]
    return QuantFloor(per_position_error(ref_logits, logits), rel_error(ref_logits, logits), engine.quantization or "?")


def workdir() -> tempfile.TemporaryDirectory:
    """A temporary directory for the conversion (never next to the candidate)."""
    try:
        return tempfile.TemporaryDirectory(prefix="posdiag-quant-")
    except OSError as exc:
        raise PosdiagError(f"cannot create a temporary directory for the quantised conversion: {exc}") from None
