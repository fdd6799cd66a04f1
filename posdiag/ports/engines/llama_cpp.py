"""llama.cpp as a candidate: a `.gguf` file run through llama-cpp-python (`pip install llama-cpp-python gguf`, or
`pip install -e '.[gguf]'` in the clone).

The file is first read and validated here (posdiag/model/gguf_file.py: a truncated or inconsistent file is
one line, exit 2), then opened by llama.cpp in a child process (posdiag/ports/engines/child_process.py: a native
crash or a hang is one line, exit 3). The child's settings and why are in posdiag/ports/engines/llama_child.py:
all-position logits, float32 KV cache, weight repacking off, token ids as they are. The context is the
one the file declares (`<arch>.context_length`), as llama.cpp uses by default; positions past it are
reported as not covered. Weight storage types come from the file, so quantised files are named as such.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from posdiag.errors import PosdiagError
from posdiag.model.gguf_file import inspect_file
from posdiag.ports.engines.child_process import DEFAULT_TIMEOUT, EngineProcess
from posdiag.ports.engines.logits_only import Engine, engine_threads

CHILD_COMMAND = [sys.executable, "-m", "posdiag.ports.engines.llama_child"]
"""The child that runs llama.cpp (its protocol: posdiag/ports/engines/child_process.py)."""


class LlamaCppRunner:
    """The protocol object: logits(ids) -> [T, V] float32 numpy, a fresh cache for every call."""

    def __init__(self, process: EngineProcess):
        self.process = process

    def logits(self, ids: list[int]) -> np.ndarray:
        return self.process.logits(ids)

    def logits_continued(self, ids: list[int], split: int) -> np.ndarray:
        """Prefill ids[:split], then a second eval of ids[split:] into the same context (its KV cache
        continued at position split); the logits of every position of both."""
        return self.process.logits(ids, split)

    def logits_stepped(self, ids: list[int], split: int) -> np.ndarray:
        """Prefill ids[:split], then decode the rest one token per eval, as a server generates."""
        return self.process.logits(ids, split, stepped=True)

    def close(self) -> None:
        self.process.close()


def open_port(spec: str, options: Any) -> Engine:
    """The runtime entry (posdiag/ports/candidates.RUNTIMES): a .gguf file in llama.cpp."""
    return load_gguf(spec)


def load_gguf(path: str, *, kv_cache: str = "f32", threads: int | None = None, repack: bool = False,
              timeout: float = DEFAULT_TIMEOUT) -> Engine:
    """Open PATH with llama.cpp in a child process. PosdiagError (one line) when the file is unsound or the
    engine missing; EngineCrash when llama.cpp dies or hangs loading it. PATH is validated first (parsed once
    per command: posdiag/model/gguf_file.one_parse_per_file)."""
    info = inspect_file(path)
    try:
        import llama_cpp  # noqa: F401  (only whether it is there: the child imports it)
    except ImportError:
        raise PosdiagError("a .gguf candidate needs llama-cpp-python: pip install llama-cpp-python") from None
    context = info.key("context_length")
    threads = threads or engine_threads()
    process = EngineProcess(list(CHILD_COMMAND), path, timeout=timeout)
    ready = process.request({"open": {"path": path, "n_ctx": int(context) if context else 0, "threads": threads,
                                      "kv_cache": kv_cache, "repack": repack}}, "loading it")["ready"]
    settings: dict[str, Any] = {"architecture": info.arch, **ready}
    settings["weights"] = ", ".join(f"{t} x{n}" for t, n in sorted(info.type_counts.items()))
    boundaries = {}
    window = info.key("attention.sliding_window")
    if isinstance(window, int) and window > 0:
        boundaries["sliding_window"] = window
    return Engine(impl=LlamaCppRunner(process), name=path, settings=settings,
                  context_length=int(context) if context else None, boundaries=boundaries,
                  quantization="/".join(info.quantised_types) or None, tensor_types=dict(info.tensor_types),
                  file=info.reader,
                  twin=lambda other: load_gguf(other, kv_cache=kv_cache, threads=threads, repack=repack,
                                               timeout=timeout),
                  approximations=("gelu_f16",))  # ggml-cpu/vec.h defines GGML_GELU_FP16: GELU by a float16 table
