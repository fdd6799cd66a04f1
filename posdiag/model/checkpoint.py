"""Checkpoint files: which weight files there are, their tensor names and stored dtype.

Reading the safetensors keys ourselves is the only way to know a position table was really
in the checkpoint: transformers re-initialises a missing one and only logs a warning.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from posdiag.errors import PosdiagError, one_line
from posdiag.model.tensors import DTYPES
from posdiag.options import LoadOptions


def weight_files(spec: str, options: LoadOptions, is_local: bool) -> dict[str, Any]:
    """Which weight files the checkpoint has, and the tensor names in its safetensors.

    Reading the keys ourselves is the only way to know a position table was really in the
    checkpoint: transformers re-initialises a missing one and only logs a warning.
    """
    from safetensors import safe_open

    if is_local:
        root = Path(spec)
        files = sorted(root.glob("*.safetensors"))
        pickles = sorted(list(root.glob("*.bin")) + list(root.glob("*.pt")))
    else:
        files, pickles = _hub_weight_files(spec, options)
    if files:
        keys: list[str] = []
        counts: dict[str, int] = {}
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as handle:
                    for key in handle.keys():  # noqa: SIM118 - safetensors handles have keys(), not iteration
                        keys.append(key)
                        stored = handle.get_slice(key).get_dtype()
                        counts[stored] = counts.get(stored, 0) + 1
            except Exception as exc:
                raise PosdiagError(f"unreadable safetensors file {f.name}: {one_line(exc)} "
                                   "(re-download or re-save it)") from None
        floating = {k: n for k, n in counts.items() if k in _SAFETENSORS_FLOATS}
        dtype = _SAFETENSORS_FLOATS[max(floating, key=floating.get)] if floating else None
        return {"keys": tuple(keys), "files": [str(f) for f in files], "source": "safetensors", "dtype": dtype}
    if pickles:
        return {"keys": None, "files": [str(f) for f in pickles], "source": "pickle"}
    raise PosdiagError(f"'{spec}' has no weight files (*.safetensors or *.bin)")


_SAFETENSORS_FLOATS = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


def _hub_weight_files(spec: str, options: LoadOptions) -> tuple[list[Path], list[Path]]:
    from huggingface_hub import snapshot_download

    try:
        root = Path(snapshot_download(spec, revision=options.revision,
                                      allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as exc:
        raise PosdiagError(f"cannot fetch '{spec}' from the hub: {one_line(exc)} (check the id, the network, or "
                           "HF_TOKEN)") from None
    files = sorted(root.glob("*.safetensors"))
    pickles: list[Path] = []
    if not files:
        pickles = [Path("pytorch_model.bin")]  # not downloaded: refused unless --allow-pickle
    return files, pickles


def checkpoint_dtype(config: Any, weights: dict[str, Any]) -> torch.dtype | None:
    """The floating dtype most of the stored tensors have (safetensors headers; else the config's)."""
    if weights.get("dtype") is not None:
        return weights["dtype"]
    declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(declared, str):
        declared = DTYPES.get(declared)
    return declared if isinstance(declared, torch.dtype) else None


# Substrings that name position parameters across families (learned tables, sinusoidal
# tables, relative position biases, ALiBi slopes saved as weights).
POSITION_PATTERNS = ("position", "wpe", "embed_positions", "relative_attention_bias", "pos_emb", "alibi", "rotary")


def is_position_key(name: str) -> bool:
    """A tensor name that holds position parameters (`load` checks them; a checkpoint diff names them first)."""
    lowered = name.lower()
    return any(p in lowered for p in POSITION_PATTERNS) and "token_type" not in lowered


def in_checkpoint(name: str, keys: set[str]) -> bool:
    """Checkpoints name tensors with or without the base-model prefix: match on suffixes."""
    if name in keys:
        return True
    parts = name.split(".")
    for i in range(1, len(parts)):
        if ".".join(parts[i:]) in keys:
            return True
    return any(k.endswith("." + name) for k in keys)
