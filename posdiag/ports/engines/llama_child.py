"""The child side of posdiag/ports/engines/child_process.py: llama.cpp (llama-cpp-python) on one GGUF file.

Run as `python -m posdiag.ports.engines.llama_child`; imports neither torch nor the rest of posdiag, so it starts
in a fraction of a second. Settings that shape the engine's rounding, and why:
- logits for every position (`logits_all`), on the CPU, token ids as they are (no tokenizer);
- KV cache in float32 (`type_k`/`type_v` = GGML_TYPE_F32): llama.cpp's default f16 cache alone puts ~1e-4
  relative error on the logits, a thousand times float32 rounding, which would hide a real bug's size;
- a context as long as the longest request so far (reopened when a longer one comes, up to the declared
  context): llama-cpp-python keeps n_ctx x n_vocab float32 scores with `logits_all` (1.6 GB at 8192 x 49152);
- weight repacking off (`llama_model_params.use_extra_bufts = False`): native AVX-512/AMX builds crash in
  the repacked Q4 kernels on real files (measured: SmolLM2 Q4_1, every call of 8 tokens or more); the
  plain kernels compute the same function.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

GGML_TYPE_F32 = 0
"""ggml's enum value for float32 (ggml.h), the KV cache type asked for."""


def open_llama(request: dict):
    import llama_cpp
    from llama_cpp import llama as llama_module

    defaults = llama_module.llama_cpp.llama_model_default_params
    repack = bool(request.get("repack", False))

    def model_params():
        params = defaults()
        if hasattr(params, "use_extra_bufts"):
            params.use_extra_bufts = repack
        return params

    llama_module.llama_cpp.llama_model_default_params = model_params
    threads = int(request["threads"])  # prompt batches too: llama-cpp-python's n_threads_batch is every core
    kwargs = {"model_path": request["path"], "n_ctx": int(request.get("n_ctx") or 0), "logits_all": True,
              "n_gpu_layers": 0, "n_threads": threads, "n_threads_batch": threads, "verbose": False, "seed": 0}
    settings = {"engine": f"llama.cpp (llama-cpp-python {llama_cpp.__version__})", "device": "cpu"}
    llm, refused = None, None
    if request.get("kv_cache", "f32") == "f32":
        try:
            llm = llama_cpp.Llama(**kwargs, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)
            settings["kv_cache"] = "f32"
        except Exception as exc:  # an engine build that refuses an f32 cache: say so, use its default
            refused = f"{type(exc).__name__}: {str(exc).strip()[:120]}"
    if llm is None:
        llm = llama_cpp.Llama(**kwargs)
        settings["kv_cache"] = "f16 (engine default" + (f"; f32 refused: {refused})" if refused else ")")
    used = getattr(llm.model_params, "use_extra_bufts", None)
    settings["weight_repacking"] = ("unknown to this llama.cpp" if used is None else
                                    "on (use_extra_bufts)" if used else "off (use_extra_bufts=False)")
    settings.update({"n_ctx": llm.n_ctx(), "n_batch": llm.n_batch, "logits_all": True,
                     "n_threads": llm.context_params.n_threads, "n_threads_batch": llm.context_params.n_threads_batch})
    return llm, settings


class Session:
    """The open model, reopened with a longer context when a request needs one."""

    def __init__(self, request: dict):
        self.request = dict(request)
        self.declared = int(request.get("n_ctx") or 0)
        self.request["n_ctx"] = min(self.declared or START_CONTEXT, START_CONTEXT)
        self.llm, self.settings = open_llama(self.request)

    def fit(self, tokens: int):
        if tokens > self.llm.n_ctx():
            size = max(tokens, 2 * self.llm.n_ctx())
            self.request["n_ctx"] = min(size, self.declared) if self.declared else size
            del self.llm
            self.llm, self.settings = open_llama(self.request)
        return self.llm


START_CONTEXT = 512


def logits(llm, ids: list[int], split: int | None, stepped: bool = False) -> np.ndarray:
    """A fresh cache per call; with SPLIT, ids[:split] prefilled, then a second eval continues that cache
    (STEPPED: one eval per token, as a server decodes)."""
    llm.reset()
    if split is None:
        llm.eval(ids)
    else:
        llm.eval(ids[:split])
        for part in [[i] for i in ids[split:]] if stepped else [ids[split:]]:
            llm.eval(part)
    return np.array(llm.scores[: len(ids), : llm.n_vocab()], dtype=np.float32)


def main() -> None:
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the library prints goes to stderr, never into the answers

    def send(message: dict) -> None:
        answers.write(json.dumps(message) + "\n")
        answers.flush()

    first = json.loads(sys.stdin.readline() or "{}")
    try:
        session = Session(first["open"])
    except Exception as exc:
        send({"error": f"{type(exc).__name__}: {str(exc).strip()[:200]}"})
        return
    settings = dict(session.settings)
    settings["n_ctx"] = f"as long as each request, up to {session.declared or 'the default'}"
    send({"ready": settings})
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("quit"):
            return
        try:
            out = logits(session.fit(len(request["ids"])), request["ids"], request.get("split"),
                         bool(request.get("stepped")))
            np.save(request["out"], out)
            send({"shape": list(out.shape)})
        except Exception as exc:
            send({"error": f"{type(exc).__name__}: {str(exc).strip()[:200]}"})


if __name__ == "__main__":
    main()
