"""llama.cpp as a candidate: a `.gguf` file run through llama-cpp-python (`pip install 'posdiag[gguf]'`).

The file is loaded with logits for every position (`logits_all=True`), on the CPU, with the KV cache
in float32 (`type_k`/`type_v`): llama.cpp's default f16 cache alone puts ~1e-4 relative error on the
logits, a thousand times float32 rounding, which would hide a real bug's size. Token ids go in as they
are (no tokenizer). The context is the one the file declares (`<arch>.context_length`), as llama.cpp
uses by default; positions past it are reported as not covered. Weight storage types are read with
the `gguf` package, so quantised files are named as such in the report.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import numpy as np

from posdiag.errors import PosdiagError
from posdiag.tools.engines import Engine

GGML_TYPE_F32 = 0
"""ggml's enum value for float32 (ggml.h), the KV cache type asked for."""

FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}


class LlamaCppRunner:
    """The protocol object: logits(ids) -> [T, V] float32 numpy, a fresh cache for every call."""

    def __init__(self, llm: Any, n_vocab: int):
        self.llm = llm
        self.n_vocab = n_vocab

    def logits(self, ids: list[int]) -> np.ndarray:
        self.llm.reset()
        self.llm.eval(ids)
        return np.array(self.llm.scores[: len(ids), : self.n_vocab], dtype=np.float32)

    def logits_continued(self, ids: list[int], split: int) -> np.ndarray:
        """Prefill ids[:split], then a second eval of ids[split:] into the same context (its KV cache
        continued at position split); the logits of every position of both."""
        self.llm.reset()
        self.llm.eval(ids[:split])
        self.llm.eval(ids[split:])
        return np.array(self.llm.scores[: len(ids), : self.n_vocab], dtype=np.float32)


def load_gguf(path: str, *, kv_cache: str = "f32", threads: int | None = None) -> Engine:
    """Open PATH with llama.cpp. PosdiagError (one line) when the file or the engine is missing."""
    if not os.path.isfile(path):
        raise PosdiagError(f"'{path}' is not a file (a .gguf candidate is a GGUF file)")
    try:
        import llama_cpp
    except ImportError:
        raise PosdiagError("a .gguf candidate needs llama-cpp-python: pip install 'posdiag[gguf]'") from None
    meta = read_metadata(path)
    arch = meta.get("general.architecture", "?")
    context = meta.get(f"{arch}.context_length")
    threads = threads or max(1, min(4, os.cpu_count() or 1))
    kwargs: dict[str, Any] = {"model_path": path, "n_ctx": int(context) if context else 0, "logits_all": True,
                              "n_gpu_layers": 0, "n_threads": threads, "verbose": False, "seed": 0}
    settings: dict[str, Any] = {"architecture": arch, "engine": f"llama.cpp (llama-cpp-python {llama_cpp.__version__})",
                                "device": "cpu", "n_threads": threads}
    llm, refused = None, None
    if kv_cache == "f32":
        try:
            llm = llama_cpp.Llama(**kwargs, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)
            settings["kv_cache"] = "f32"
        except Exception as exc:  # an engine build that refuses an f32 cache: say so, use its default
            refused = f"{type(exc).__name__}: {str(exc).strip()[:120]}"
    if llm is None:
        try:
            llm = llama_cpp.Llama(**kwargs)
        except Exception as exc:
            raise PosdiagError(f"llama.cpp could not load '{path}': "
                               f"{type(exc).__name__}: {str(exc).strip()[:200]}") from None
        settings["kv_cache"] = "f16 (engine default" + (f"; f32 refused: {refused})" if refused else ")")
    settings["n_ctx"] = llm.n_ctx()
    settings["n_batch"] = llm.n_batch
    settings["logits_all"] = True
    types = meta.get("tensor_types", {})
    by_name = meta.get("tensor_type_by_name", {})
    settings["weights"] = ", ".join(f"{t} x{n}" for t, n in sorted(types.items()))
    quantised = sorted(t for t in types if t not in FLOAT_TYPES)
    boundaries = {}
    window = meta.get(f"{arch}.attention.sliding_window")
    if isinstance(window, int) and window > 0:
        boundaries["sliding_window"] = window
    return Engine(impl=LlamaCppRunner(llm, llm.n_vocab()), name=path, settings=settings,
                  context_length=int(context) if context else None, boundaries=boundaries,
                  quantization="/".join(quantised) or None, tensor_types=by_name,
                  twin=lambda other: load_gguf(other, kv_cache=kv_cache, threads=threads),
                  approximations=("gelu_f16",))  # ggml-cpu/vec.h defines GGML_GELU_FP16: GELU by a float16 table


def read_metadata(path: str) -> dict[str, Any]:
    """Scalar metadata of a GGUF file, plus `tensor_types` (type name -> tensor count) and
    `tensor_type_by_name` (tensor name -> type name)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise PosdiagError("reading a .gguf file needs the gguf package: pip install 'posdiag[gguf]'") from None
    try:
        reader = GGUFReader(path)
    except Exception as exc:
        raise PosdiagError(f"'{path}' is not a readable GGUF file: {type(exc).__name__}: {str(exc)[:120]}") from None
    out: dict[str, Any] = {}
    for name, fld in reader.fields.items():
        if name.startswith("tokenizer.") or len(fld.types) != 1:
            continue
        try:
            value = fld.contents()
        except Exception:
            continue
        if isinstance(value, (int, float, str, bool)):
            out[name] = value
    out["tensor_types"] = dict(Counter(t.tensor_type.name for t in reader.tensors))
    out["tensor_type_by_name"] = {t.name: t.tensor_type.name for t in reader.tensors}
    return out
