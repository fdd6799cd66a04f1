"""Engines: candidates outside PyTorch that only return logits.

The protocol is one method. An engine is any object with

    logits(ids: list[int]) -> array [T, V]     # numpy, torch, or anything numpy.asarray takes

returning the logits of every position for the token ids it is given (no tokenizer: the ids are
the reference's). It may also carry, all optional:

    logits_continued(ids: list[int], split: int) -> array [T, V]
                            prefill ids[:split] into the engine's cache, then continue that cache
                            with ids[split:]; the logits of every position of both parts. Judged
                            by position like `logits`, as its own line ("continued from position N")

    name: str               what the report calls it (default: the spec)
    settings: dict          the engine settings that shape its rounding (KV cache type, batch,
                            threads...), printed in the report
    context_length: int     the context the port declares; positions past it are reported as not
                            covered instead of being asked for
    boundaries: dict        other declared lengths, e.g. {"sliding_window": 4096}
    quantization: str       the weights' storage type when it is coarser than float32 (e.g. "Q8_0")
    approximations: tuple   documented approximations the engine makes on purpose; known:
                            "gelu_f16" (GELU through a float16 table, as llama.cpp's CPU backend):
                            its size is measured on the reference and added to the floor

Two adapters produce one: `posdiag.ports.engines.llama_cpp` (llama.cpp through llama-cpp-python, for a
`.gguf` file) and `load_factory_engine` (a user's `module.path:factory`). The rule that keeps the
factory syntax unambiguous: the object the factory returns decides. A `torch.nn.Module` is a
PyTorch model and is compared layer by layer; any other object with a callable `logits` is an
engine and is compared on its logits, position by position.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from posdiag.errors import PosdiagError

PROTOCOL = "an object with logits(ids: list[int]) -> array [T, V] (numpy or torch)"


def engine_threads(env: dict[str, str] = os.environ) -> int:  # type: ignore[assignment]
    """The threads a native engine (llama.cpp, ONNX Runtime) runs on: POSDIAG_THREADS=N where N is a count (the
    count the command line gives torch), else up to 4 of the machine's cores. Every phase of the engine uses this
    count (llama.cpp's batch threads too). ONNX Runtime's idle threads are told to sleep; llama.cpp's poll for work
    between graph nodes, so on a busy machine POSDIAG_THREADS=1 (no second thread to poll) is the quiet setting."""
    chosen = env.get("POSDIAG_THREADS", "").strip()
    return int(chosen) if chosen.isdigit() and int(chosen) > 0 else max(1, min(4, os.cpu_count() or 1))


@dataclass
class Engine:
    """A logits-only candidate, normalised: `run(ids)` always returns float64 [T, V] on the CPU."""

    impl: Any
    name: str
    settings: dict[str, Any] = field(default_factory=dict)
    context_length: int | None = None
    boundaries: dict[str, int] = field(default_factory=dict)
    quantization: str | None = None
    approximations: tuple[str, ...] = ()
    tensor_types: dict[str, str] = field(default_factory=dict)
    """Storage type by tensor name (GGUF), for a quantised candidate's measured floor."""
    twin: Callable[[str], Engine] | None = None
    """Load another file with the same engine and settings (GGUF), for the same measurement."""
    file: Any = field(default=None, repr=False)
    """The file the engine runs, as parsed when it was validated (a gguf.GGUFReader): its F32 twin is written from
    it without parsing the file again (seconds for a 49k-token vocabulary)."""

    @property
    def can_continue(self) -> bool:
        return callable(getattr(self.impl, "logits_continued", None))

    @property
    def paths(self) -> frozenset[str]:
        """What it can be asked (posdiag/ports/protocol.PATHS): logits always; the rest where its object has them."""
        offered = {"logits"}
        if self.can_continue:
            offered.add("logits_continued")
        if callable(getattr(self.impl, "logits_stepped", None)):
            offered.add("logits_stepped")
        if self.twin is not None:
            offered.add("other_file")
        return frozenset(offered)

    @property
    def vocab_size(self) -> int | None:
        return None  # known only from the logits it returns

    def run(self, ids: list[int]) -> torch.Tensor:
        return self._call(lambda: self.impl.logits(list(ids)), ids, "")

    def run_continued(self, ids: list[int], split: int) -> torch.Tensor:
        return self._call(lambda: self.impl.logits_continued(list(ids), split), ids,
                          f" continued from position {split}")

    def _call(self, call: Callable[[], Any], ids: list[int], how: str) -> torch.Tensor:
        try:
            raw = call()
        except PosdiagError:
            raise
        except Exception as exc:
            text = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            raise PosdiagError(f"the engine {self.name} failed on {len(ids)} tokens{how}: "
                               f"{type(exc).__name__}: {text}") from None
        out = raw.detach().to("cpu", torch.float64) if isinstance(raw, torch.Tensor) else \
            torch.from_numpy(np.asarray(raw, dtype=np.float64))
        if out.ndim == 3 and out.shape[0] == 1:
            out = out[0]
        if out.ndim != 2 or out.shape[0] != len(ids):
            raise PosdiagError(f"the engine {self.name} returned logits of shape {tuple(out.shape)} for {len(ids)} "
                               f"tokens{how}; the protocol is {PROTOCOL}")
        return out


def as_engine(obj: Any, name: str) -> Engine:
    """Wrap an object that follows the protocol; PosdiagError (one line) when it does not."""
    if isinstance(obj, Engine):
        return obj
    if isinstance(obj, torch.nn.Module) or not callable(getattr(obj, "logits", None)):
        raise PosdiagError(f"{name} returned {type(obj).__name__}: an engine is {PROTOCOL}")
    context = getattr(obj, "context_length", None)
    return Engine(impl=obj, name=str(getattr(obj, "name", None) or name),
                  settings=dict(getattr(obj, "settings", None) or {}),
                  context_length=int(context) if isinstance(context, int) and context > 0 else None,
                  boundaries={k: int(v) for k, v in (getattr(obj, "boundaries", None) or {}).items() if v},
                  quantization=getattr(obj, "quantization", None),
                  approximations=tuple(getattr(obj, "approximations", None) or ()))


def is_engine(obj: Any) -> bool:
    """The rule: not a torch.nn.Module, and has a callable `logits`."""
    return not isinstance(obj, torch.nn.Module) and callable(getattr(obj, "logits", None))
