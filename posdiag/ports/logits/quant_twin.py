"""A quantised .gguf split into its parts: position handling, what quantisation adds, and the weights' rounding.

A quantised file differs from a float reference for three reasons, and only one is a position bug:
- the weights' rounding: the file's weights, dequantised, are not the reference's. Measured in PyTorch: the
  reference run again with the file's dequantised weights (mapped back through posdiag's converter,
  posdiag/ports/gguf_writer.py), against itself. Exactly zero when they are the reference's own weights
  (`posdiag compare model.gguf`, or a reference dequantised from that file): then nothing is run;
- what the engine's quantised kernels add (llama.cpp quantises activations to 8 bits for Q4/Q5/K-quant dot
  products): the file against its F32 twin (every tensor dequantised, the metadata kept:
  posdiag/model/gguf_file.rewrite) through the same engine, same settings, same ids. Flat in position
  when healthy (measured on SmolLM2 Q4_1: max |d log-prob| 0.7-1.4 in every band up to 1024 tokens);
- position handling: the F32 twin against PyTorch running the same dequantised weights (the reference itself
  when they are its own), judged at float32 noise. Any error that grows with position there is the engine's
  position code or the metadata as it reads it; the weights' part never widens that line's tolerance.
Nothing is re-quantised, so K-quants (which the gguf package cannot write) are measured like the rest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from posdiag.model.subject import Subject
from posdiag.ports.engines.logits_only import Engine
from posdiag.ports.profile import per_position_error
from posdiag.ports.reference import run_stack

NOT_A_ROUNDING = 1.0
"""A dequantised tensor whose error against the reference's is at least the tensor itself (relative 1: no
closer than zero) is not a rounding of it but other numbers (rows in another layout, another tensor)."""


@dataclass(frozen=True)
class TwinSplit:
    twin: torch.Tensor           # float64 [T, V]: the F32 twin's logits through the engine
    quantisation: torch.Tensor   # float64 [T]: the file against its twin, per position (the kernels' part)
    weights: torch.Tensor        # float64 [T]: the reference with the file's weights against itself
    weights_source: str          # how the weights' part was found
    kind: str                    # e.g. "Q4_1"
    foreign: tuple[str, ...] = ()  # tensors that are not a rounding of the reference's (left out of the floor)
    same_weights: torch.Tensor | None = None  # float64 [T, V]: PyTorch on the file's weights (None: the reference's)

    def twin_reference(self, ref_logits: torch.Tensor) -> torch.Tensor:
        """What the F32 twin must equal: PyTorch running the same weights, i.e. the reference when they are its
        own, else the reference with the file's dequantised weights swapped in."""
        return ref_logits if self.same_weights is None else self.same_weights


def measure(reference: Subject, engine: Engine, ids: list[int], ref_logits: torch.Tensor, cand: torch.Tensor,
            workdir: str) -> TwinSplit | str:
    """The split of ENGINE's quantised file on IDS, or why it cannot be made (one line)."""
    from posdiag.model.gguf_file import dequantised, open_reader, rewrite

    if engine.twin is None or not str(engine.name).lower().endswith(".gguf") or not os.path.isfile(engine.name):
        return "this engine cannot run another file"
    reader = engine.file if engine.file is not None else open_reader(engine.name)
    arrays = dequantised(reader)  # dequantised once: for the twin and for the weights' part
    twin_path = rewrite(engine.name, Path(workdir) / "posdiag-f32-twin.gguf", dequantise=True, reader=reader,
                        arrays=arrays)
    twin_engine = engine.twin(str(twin_path))
    try:
        twin = twin_engine.run(ids)[:, : ref_logits.shape[1]]
    finally:
        close = getattr(twin_engine.impl, "close", None)
        if callable(close):
            close()
    kind = engine.quantization or "?"
    weights, source, foreign, same = weights_part(reference, reader, ids, ref_logits, arrays)
    if weights is None:
        return source
    return TwinSplit(twin, per_position_error(twin, cand), weights, source, kind, foreign, same)


def weights_part(reference: Subject, reader, ids: list[int], ref_logits: torch.Tensor, tensors: dict[str, np.ndarray]
                 ) -> tuple[torch.Tensor | None, str, tuple[str, ...], torch.Tensor | None]:
    """The reference with the file's dequantised weights (READER: the file, open; TENSORS: its tensors as float32)
    against itself, per position (zeros when they are its own), why, the tensors that are no rounding of the
    reference's, and the logits of that run (None when the weights are the reference's own)."""
    from posdiag.ports import gguf_writer

    zeros = torch.zeros(len(ids), dtype=torch.float64)
    if os.path.abspath(reference.spec) == os.path.abspath(str(reader.data.filename)):
        return zeros, "the reference runs the file's own dequantised weights", (), None
    reason = gguf_writer.can_convert(reference.model)
    if reason:
        return None, f"{reason}: the weights' rounding cannot be measured", (), None
    conv = gguf_writer.convert(reference.model)
    missing = sorted(set(tensors) - set(conv.sources))
    if missing:
        return None, (f"the file has tensors posdiag's conversion of the reference does not "
                      f"({', '.join(missing[:3])}): the weights' rounding cannot be measured"), (), None
    changed, foreign = {}, []
    for name, data in tensors.items():
        mine = conv.tensors[name]
        if data.shape != mine.shape:
            return None, f"{name} is {data.shape} in the file, {mine.shape} in the reference", (), None
        if np.array_equal(data, mine):
            continue
        error = float(np.linalg.norm(data - mine) / max(np.linalg.norm(mine), 1e-30))
        if error >= NOT_A_ROUNDING:
            foreign.append(f"{name} ({error:.2f})")
        else:
            changed[name] = data
    if not changed:
        note = "the file's weights are the reference's own (bitwise, after posdiag's conversion)"
        return zeros, note + (f"; not a rounding of the reference's: {', '.join(foreign[:3])}" if foreign else ""), \
            tuple(foreign), None
    state = reference.model.state_dict()
    saved = {}
    try:
        with torch.no_grad():
            for name, data in changed.items():  # swapped in place, restored below: no second copy of the model
                key, transform = conv.sources[name]
                saved[key] = state[key].detach().clone()
                state[key].copy_(torch.from_numpy(np.ascontiguousarray(gguf_writer.undo_transform(data, transform))))
        out = run_stack(reference, torch.tensor(ids), reference.stacks[-1], "reference")
        logits = out.logits[0].double().cpu()
    finally:
        with torch.no_grad():
            for key, value in saved.items():
                state[key].copy_(value)
    source = (f"the reference run with the file's dequantised weights ({len(changed)} of {len(tensors)} tensors "
              "differ)")
    if foreign:
        source += f"; not a rounding of the reference's, left out: {', '.join(foreign[:3])}"
    return per_position_error(ref_logits[: len(ids)], logits), source, tuple(foreign), logits


BAND_STARTS = (0, 8, 64, 256, 512, 1024, 2048, 4096)
"""Position bands for the report: early positions (where a position bug rises) apart, late ones coarsely."""


def log_prob_bands(a: torch.Tensor, b: torch.Tensor, chunk: int = 128) -> tuple[list[int], list[float]]:
    """max over the vocabulary of |log p_a - log p_b| per position, then its max per band (starts, values):
    the figure a user reads as 'how far apart are the next-token distributions'."""
    per = torch.empty(a.shape[0], dtype=torch.float64)
    for s in range(0, a.shape[0], chunk):  # row chunks: never two full [T, V] log-softmax copies at once
        la, lb = torch.log_softmax(a[s:s + chunk].double(), -1), torch.log_softmax(b[s:s + chunk].double(), -1)
        per[s:s + chunk] = (la - lb).abs().amax(-1)
    starts = [s for s in BAND_STARTS if s < a.shape[0]]
    ends = starts[1:] + [a.shape[0]]
    return starts, [float(per[s:e].max()) for s, e in zip(starts, ends, strict=True)]


def describe(split: TwinSplit, ref: torch.Tensor, cand: torch.Tensor, covered: int) -> dict:
    """The report's view of the split: per band, how far each pair's next-token distributions are apart."""
    ref = ref[:covered]
    starts, twin = log_prob_bands(split.twin, split.twin_reference(ref)[:covered])
    _, file = log_prob_bands(cand, ref)
    _, alone = log_prob_bands(cand, split.twin)
    return {"kind": split.kind, "weights_source": split.weights_source, "foreign_tensors": list(split.foreign),
            "band_starts": starts, "length": covered,
            "max_abs_dlogprob": {"twin_vs_reference": twin, "file_vs_reference": file, "file_vs_twin": alone},
            "quantisation_alone": {"per_position": split.quantisation.tolist(),
                                   "median": float(split.quantisation.median()),
                                   "max": float(split.quantisation.max())},
            "weights_part_median": float(split.weights.median())}
