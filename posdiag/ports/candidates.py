"""Which port a CANDIDATE names, opened: the one function the command line asks for a candidate.

A spec is claimed by a runtime (RUNTIMES: a .gguf file, a .onnx graph, a server's base URL), else it is a
`module.path:factory` (what the factory returns decides: a torch.nn.Module is a PyTorch model, any other object
with a callable `logits` an engine), else a checkpoint loaded into PyTorch. Every answer follows the protocol of
posdiag/ports/protocol.py.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from posdiag.errors import PosdiagError
from posdiag.options import LoadOptions
from posdiag.ports.protocol import Port


def is_gguf(spec: str) -> bool:
    return spec.lower().endswith(".gguf")


@dataclass(frozen=True)
class PortOptions:
    """What the command line says about a port, for any runtime (each reads the fields it knows)."""

    served_model: str | None = None  # an HTTP server: the model to ask for
    api_key: str | None = None  # an HTTP server: its key (else POSDIAG_API_KEY)


@dataclass(frozen=True)
class Runtime:
    """One runtime a CANDIDATE can name: which specs it claims, the module that opens them (lazily imported: its
    `open_port(spec, PortOptions)` returns a port), the extra that installs what it needs."""

    name: str
    claims: Callable[[str], bool]
    module: str
    extra: str


RUNTIMES = (
    Runtime("llama.cpp", is_gguf, "posdiag.ports.engines.llama_cpp", "gguf"),
    Runtime("ONNX Runtime", lambda spec: spec.lower().endswith(".onnx"), "posdiag.ports.engines.onnx_runtime", "onnx"),
    Runtime("OpenAI-compatible server", lambda spec: spec.lower().startswith(("http://", "https://")),
            "posdiag.ports.engines.http_server", "server"),
)
"""Every runtime a port can run in, besides PyTorch and a user's factory. The next one (MLX, ExecuTorch,
TensorRT-LLM) is one module with `open_port` and one row here (docs/DEVELOPING.md)."""


def runtime_for(spec: str) -> Runtime | None:
    return next((r for r in RUNTIMES if r.claims(spec)), None)


def open_port(spec: str, options: PortOptions) -> Port:
    """SPEC opened by the runtime that claims it (PosdiagError when none does)."""
    runtime = runtime_for(spec)
    if runtime is None:
        raise PosdiagError(f"no runtime claims '{spec}' (.gguf, .onnx, http://HOST:PORT/v1)")
    return importlib.import_module(runtime.module).open_port(spec, options)


def open_candidate(spec: str, load: LoadOptions, port: PortOptions | None = None) -> Port:
    """The candidate SPEC names, opened: a runtime's port, a factory's engine or model, or a checkpoint in PyTorch
    (LOAD: how to load a PyTorch candidate; PORT: what a runtime reads)."""
    import torch

    from posdiag.model.loading import call_factory, from_factory_model, load_subject, looks_like_factory
    from posdiag.ports.engines.in_process import ModelPort
    from posdiag.ports.engines.logits_only import as_engine, is_engine

    if runtime_for(spec):
        return open_port(spec, port or PortOptions())
    if looks_like_factory(spec) and not load.device_map:
        obj = call_factory(spec)
        if is_engine(obj):
            return as_engine(obj, spec)
        if isinstance(obj, torch.nn.Module):  # the factory syntax's rule: the object returned decides
            return ModelPort(from_factory_model(obj, spec, load))
        return as_engine(obj, f"factory '{spec}'")  # neither: the one-line protocol error
    return ModelPort(load_subject(spec, load))
