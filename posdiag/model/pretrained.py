"""A checkpoint directory or hub id read with transformers' from_pretrained: the MODEL argument checked, the config
read (its failures explained in one line), the call planned (dtype, device map, safetensors) and made.

posdiag.model.loading turns what comes back into a Subject.
"""

from __future__ import annotations

import json
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posdiag.errors import PosdiagError, one_line
from posdiag.model.checkpoint import checkpoint_dtype
from posdiag.model.classes import shipped_code
from posdiag.model.placement import device_map_kwargs, kept_in_memory, unreadable_offloaded
from posdiag.model.subject import LoadInfo
from posdiag.model.tensors import DTYPES
from posdiag.options import LoadOptions


def check_spec(spec: str, local: Path) -> bool:
    """Whether MODEL is a local checkpoint directory (else a hub id); a path that cannot be one is refused."""
    is_local = local.exists()
    if is_local:
        if not local.is_dir():
            raise PosdiagError(f"'{spec}' is a file, not a .gguf file; MODEL is a checkpoint directory, a .gguf "
                               "file, a hub id, or module:factory")
        if not (local / "config.json").is_file():
            raise PosdiagError(f"'{spec}' has no config.json: not a transformers checkpoint directory")
    elif spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise PosdiagError(f"'{spec}' does not exist")
    return is_local


def read_config(spec: str, options: LoadOptions, is_local: bool) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(spec, revision=options.revision, trust_remote_code=options.trust_remote_code)
    except Exception as exc:
        raise PosdiagError(explain_config_error(spec, exc, options, is_local)) from None


@dataclass
class LoadPlan:
    """How from_pretrained is called: its keyword arguments, the dtype the weights are stored in, whether they are
    upcast as they load, and the folders posdiag created for this run (removed with the subject)."""

    kwargs: dict[str, Any]
    stored: torch.dtype
    upcast_at_load: bool
    temporary: list[str] = field(default_factory=list)


def plan_load(spec: str, options: LoadOptions, config: Any, weights: dict[str, Any]) -> LoadPlan:
    dtype: Any = "auto" if options.dtype == "auto" else DTYPES[options.dtype]
    stored = DTYPES[options.dtype] if options.dtype != "auto" else checkpoint_dtype(config, weights)
    upcast_at_load = bool(options.device_map) and options.upcast and stored in (torch.float16, torch.bfloat16)
    if upcast_at_load:
        # A dispatched model cannot be re-cast in place (its offloaded weights are re-read from
        # disk in the stored dtype), so ask for float32 up front: accelerate then plans the map
        # for the float32 size and converts each offloaded tensor as it reads it.
        dtype = torch.float32
    kwargs: dict[str, Any] = dict(
        revision=options.revision, trust_remote_code=options.trust_remote_code,
        dtype=dtype, attn_implementation=options.attn_implementation,
        output_loading_info=True,
        use_safetensors=weights["source"] != "pickle",
    )
    plan = LoadPlan(kwargs, stored, upcast_at_load)
    if options.device_map:
        kwargs.update(device_map_kwargs(spec, options, weights, plan.temporary))
    return plan


def from_pretrained(auto_cls: Any, spec: str, options: LoadOptions, plan: LoadPlan) -> tuple[Any, dict, list[str]]:
    """(model, loading info, notes). A failure removes the folders created for the run and is one line."""
    # Parameters missing from the checkpoint are re-initialised randomly: seed it so the same
    # checkpoint gives the same report every time (the `load` check names what was missing).
    torch.manual_seed(0)
    notes: list[str] = []
    try:
        with warnings.catch_warnings():
            # transformers' own maps name single tensors (BART's final_logits_bias); accelerate warns, harmlessly.
            warnings.filterwarnings("ignore", message="The following device_map keys do not match any submodules")
            model, loading_info = auto_cls.from_pretrained(spec, **plan.kwargs)
            lost = unreadable_offloaded(model) if options.device_map else []
            if lost:
                # transformers reads disk-offloaded weights from the checkpoint files in place, so a
                # weight the checkpoint lacks (Marian's sinusoid table, built at init) has no values
                # there: KeyError at the first forward. Load again with its module kept in memory.
                plan.kwargs["device_map"] = kept_in_memory(model.hf_device_map, model, lost)
                del model
                torch.manual_seed(0)
                model, loading_info = auto_cls.from_pretrained(spec, **plan.kwargs)
                notes.append(f"kept in memory, not on disk: {', '.join(lost[:3])}{' …' if len(lost) > 3 else ''} "
                             "(not in the checkpoint, so transformers has nothing to read from disk)")
    except Exception as exc:
        for folder in plan.temporary:
            shutil.rmtree(folder, ignore_errors=True)
        raise PosdiagError(f"cannot load weights of '{spec}': {one_line(exc)}") from None
    return model, loading_info, notes


def load_info(weights: dict[str, Any], loading_info: dict, config: Any, model: Any, options: LoadOptions) -> LoadInfo:
    return LoadInfo(
        checkpoint_keys=weights["keys"],
        missing_keys=tuple(loading_info.get("missing_keys", ()) or ()),
        unexpected_keys=tuple(loading_info.get("unexpected_keys", ()) or ()),
        mismatched_keys=tuple(str(k[0]) if isinstance(k, tuple) else str(k)
                              for k in (loading_info.get("mismatched_keys", ()) or ())),
        files=tuple(weights["files"]),
        source=weights["source"],
        **shipped_code(config, model, options.trust_remote_code),
    )


def explain_config_error(spec: str, exc: Exception, options: LoadOptions, is_local: bool) -> str:
    text = one_line(exc)
    if "trust_remote_code" in text or "custom code" in text:
        return f"'{spec}' needs its own Python code to load; rerun with --trust-remote-code if you trust it"
    unknown = "Unrecognized model" in text or "does not recognize this architecture" in text
    if isinstance(exc, (json.JSONDecodeError, ValueError)) and is_local and not unknown:
        return f"'{spec}/config.json' is not a valid config: {text}"
    if unknown or "model_type" in text:
        return f"'{spec}': unknown model type for this transformers version ({text[:160]})"
    if not is_local:
        return f"cannot fetch '{spec}' from the hub: {text[:200]} (check the id, the network, or HF_TOKEN)"
    return f"cannot read the config of '{spec}': {text[:200]}"
