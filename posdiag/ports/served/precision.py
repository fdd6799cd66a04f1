"""What a server computes in, reproduced on the reference, so its rounding joins the noise floor of `compare`.

A server's log-probs differ from a float32 reference by the precision it serves in, and for a quantised file
(llama.cpp's Q4_1, Q8_0...) that difference is large (|Δ log-prob| ~1e-2 on SmolLM2's Q4_1) and flat from
position 0: with no floor for it, a healthy quantised server reads "uniform from position 0". The floor is
measured, never assumed, the way posdiag/ports/logits/quant_floor.py measures an in-process port's:

- a torch dtype (`--served-dtype bfloat16`): the reference itself run with its weights and buffers at that dtype;
- ggml tensor types (`--served-dtype Q4_1`, one type for every 2-D weight; `--served-dtype FILE.gguf`, the types
  that file stores each tensor in; by default the reference's own .gguf file when it is quantised): posdiag's
  own conversion of the *reference* (posdiag/ports/gguf_writer.py) written with those types and run in llama.cpp
  on the same tokens. It is the reference's conversion, never the served file, so a bug in the served file cannot
  raise its own floor.

The spec is checked before anything loads (`parse`); the floor is opened once per comparison and closed after.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from posdiag.errors import PosdiagError
from posdiag.model.subject import Subject
from posdiag.ports.reference import run_stack

TORCH_DTYPES = ("float32", "float64", "bfloat16", "float16")
SERVER_KV_CACHE = "f16"
"""The KV cache type llama.cpp's server and llama-cpp-python's use by default, for the conversion too: its
rounding (~1e-4 in log-probs) is small beside any quantisation's, and a floor may err large, never small."""


@dataclass(frozen=True)
class ServedPrecision:
    """A parsed --served-dtype: a torch dtype, or ggml tensor types (one for every 2-D weight, or per tensor)."""

    name: str
    dtype: str | None = None
    types: str | dict[str, str] | None = None


def parse(spec: str | None) -> ServedPrecision | None:
    """SPEC as a precision; PosdiagError (one line) for one posdiag cannot reproduce. Nothing is loaded."""
    if not spec or spec == "auto":
        return None
    if spec.lower() in TORCH_DTYPES:
        return ServedPrecision(spec.lower(), dtype=spec.lower())
    if spec.lower().endswith(".gguf"):
        from posdiag.model.gguf_file import inspect_file

        if not Path(spec).is_file():
            raise PosdiagError(f"--served-dtype {spec}: no such file")
        info = inspect_file(spec)
        counts = ", ".join(f"{t} x{n}" for t, n in sorted(info.type_counts.items()))
        return ServedPrecision(f"the tensor types of {Path(spec).name} ({counts})", types=dict(info.tensor_types))
    try:
        import gguf
    except ImportError:
        raise PosdiagError(f"--served-dtype {spec}: a ggml type needs the gguf package: pip install "
                           "gguf") from None
    kind = spec.upper()
    if kind not in gguf.GGMLQuantizationType.__members__:
        raise PosdiagError(f"--served-dtype {spec}: not a dtype ({', '.join(TORCH_DTYPES)}), a ggml type (Q8_0, "
                           "Q4_1...) or a .gguf file")
    return ServedPrecision(kind, types=kind)


@dataclass
class ServedFloor:
    """The reference's log-probs at the served precision, per sequence of ids; close() frees what it opened."""

    source: str
    log_probs: Callable[[torch.Tensor, int | None], torch.Tensor]
    """(ids [T], decoded_from) -> [T, V] float64 log-softmax; DECODED_FROM: the tokens from there on were decoded
    one at a time after a prefill of those before (the generation route), None: one forward."""
    closers: list[Callable[[], None]] = field(default_factory=list)
    dtype: str | None = None
    """The torch dtype the reference is held in for it (`held_in`); None for ggml types (run in llama.cpp, which
    takes text only)."""

    def close(self) -> None:
        for close in self.closers:
            close()


def open_floor(reference: Subject, precision: ServedPrecision, stack: str) -> ServedFloor:
    """The floor's runner for PRECISION. PosdiagError (one line) when it cannot be reproduced: a floor that is
    asked for and missing would leave a quantised server's verdict meaningless."""
    if precision.dtype:
        return ServedFloor(f"the reference at {precision.name} (--served-dtype)",
                           lambda ids, _: _at_dtype(reference, ids, stack, precision.dtype), dtype=precision.dtype)
    return _quantised(reference, precision)


def _at_dtype(reference: Subject, ids: torch.Tensor, stack: str, dtype: str) -> torch.Tensor:
    """The reference's log-probs at DTYPE."""
    with held_in(reference, dtype):
        return run_stack(reference, ids, stack, "reference").logits[0].double().cpu().log_softmax(-1)


@contextmanager
def held_in(reference: Subject, dtype: str) -> Iterator[None]:
    """The reference's floating weights and buffers cast to DTYPE, restored exactly after."""
    from posdiag.model.tensors import DTYPES

    tensors = [*reference.model.parameters(), *reference.model.buffers()]
    saved = [(t, t.data) for t in tensors if t.is_floating_point()]
    try:
        for t, data in saved:
            t.data = data.to(DTYPES[dtype])
        yield
    finally:
        for t, data in saved:
            t.data = data


def _quantised(reference: Subject, precision: ServedPrecision) -> ServedFloor:
    from posdiag.ports import gguf_writer
    from posdiag.ports.engines.llama_cpp import load_gguf

    reason = gguf_writer.can_convert(reference.model)
    if reason:
        raise PosdiagError(f"a server at {precision.name}: {reason}, so the quantisation's own error cannot be "
                           "measured (--served-dtype float32 to compare without it)")
    conv = gguf_writer.convert(reference.model)
    types = precision.types
    if isinstance(types, dict):
        missing = sorted(set(types) - set(conv.tensors))
        if missing:
            raise PosdiagError(f"a server at {precision.name}: the file has tensors posdiag's conversion of the "
                               f"reference does not ({', '.join(missing[:3])}): not the reference's architecture")
    workdir = tempfile.TemporaryDirectory(prefix="posdiag-served-")
    try:
        path = gguf_writer.write(conv, Path(workdir.name) / "posdiag-quantised-reference.gguf", types)
        del conv
        engine = load_gguf(str(path), kv_cache=SERVER_KV_CACHE)
    except gguf_writer.ConversionError as exc:
        workdir.cleanup()
        raise PosdiagError(f"a server at {precision.name}: posdiag cannot write that conversion: {exc}") from None
    except BaseException:
        workdir.cleanup()
        raise
    vocab = reference.vocab_size

    def log_probs(ids: torch.Tensor, decoded_from: int | None) -> torch.Tensor:
        """Run as the server runs it: llama.cpp's kernels differ between a batch and a one-token step, and a
        floor from one forward stood 27x below a healthy Q4_1 server's error at its first generated token."""
        if decoded_from is None or decoded_from >= len(ids):
            logits = engine.run(ids.tolist())
        else:
            logits = torch.from_numpy(engine.impl.logits_stepped(ids.tolist(), decoded_from))
        return logits[:, :vocab].double().log_softmax(-1)

    return ServedFloor(f"posdiag's conversion of the reference at {precision.name}, run in llama.cpp "
                       "(--served-dtype)", log_probs, [engine.impl.close, workdir.cleanup])
