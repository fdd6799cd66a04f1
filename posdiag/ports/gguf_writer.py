"""A small HF -> GGUF converter for the families posdiag can write (Llama, Qwen2, Gemma2, GPT-2), with
the `gguf` package and llama.cpp's conventions. posdiag uses it to measure a quantisation's own error:
a healthy conversion of the reference, quantised like the candidate, run through the same engine.

Conventions (llama.cpp's names; numpy arrays are written as HF stores them, [out, in], which GGUF
records as ne = [in, out]):
- `llama` uses llama.cpp's "normal" RoPE, which rotates adjacent pairs (x0, x1), (x2, x3)...; HF's
  Llama rotates halves (x_i, x_{i+d/2}). So q/k rows are permuted per head from the half split into
  adjacent pairs. `qwen2` and `gemma2` use llama.cpp's NeoX RoPE (halves, like HF): no permutation.
- Gemma's RMSNorm multiplies by (1 + w): llama.cpp's by w, so every norm weight is written + 1.
  llama.cpp scales Gemma's embeddings by sqrt(hidden) itself and ties the output to token_embd.
- GPT-2's Conv1D stores [in, out]: transposed to [out, in].
- No tokenizer: `tokenizer.ggml.model = "none"` and `<arch>.vocab_size`; the ids are the reference's.
- Quantisation (`gguf.quants.quantize`, the same block formats llama.cpp reads): 2-D weights whose rows
  are a whole number of blocks; 1-D tensors (norms, biases) stay F32, as llama.cpp's converter keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "gemma2": "gemma2", "gpt2": "gpt2"}
"""HF model_type -> llama.cpp architecture, for the families this converter writes."""


class ConversionError(ValueError):
    """This model, or this tensor type, cannot be written here; the message says which and why."""


@dataclass
class Conversion:
    """A GGUF file before writing: metadata (full key -> int, float or str) and F32 tensors by name."""

    arch: str
    keys: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    sources: dict[str, tuple[str, str]] = field(default_factory=dict)
    """GGUF tensor name -> (the state-dict key it was written from, its transform: see `apply_transform`)."""

    def key(self, name: str) -> str:
        return f"{self.arch}.{name}"


def can_convert(model: torch.nn.Module) -> str | None:
    """None when `convert` can write MODEL; otherwise the reason, one line."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in ARCHITECTURES:
        return (f"posdiag has no GGUF converter for model_type {model_type!r} "
                f"(it writes {', '.join(ARCHITECTURES)})")
    return None


def convert(model: torch.nn.Module) -> Conversion:
    """MODEL (an HF causal LM of a family in ARCHITECTURES) as a healthy, unquantised Conversion."""
    reason = can_convert(model)
    if reason:
        raise ConversionError(reason)
    cfg = model.config
    arch = ARCHITECTURES[cfg.model_type]
    sd = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    conv = Conversion(arch)
    conv.keys[conv.key("context_length")] = int(cfg.max_position_embeddings if arch != "gpt2" else cfg.n_positions)
    conv.keys[conv.key("vocab_size")] = int(cfg.vocab_size)
    conv.keys["tokenizer.ggml.model"] = "none"
    conv.tensors = _gpt2(sd, cfg, conv) if arch == "gpt2" else _rope_family(sd, cfg, conv)
    return conv


def write(conv: Conversion, path: str | Path, types: str | dict[str, str] | None = None) -> Path:
    """Write CONV to PATH. TYPES: None (all F32), one ggml type name for every 2-D weight (e.g. "Q8_0"),
    or a type name per tensor name (tensors not named stay F32). ConversionError when a type cannot be
    written (the gguf package has no quantiser for it, or a row is not a whole number of its blocks)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), conv.arch)
    for key, value in conv.keys.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, int(value))
    for name, value in conv.tensors.items():
        value = np.ascontiguousarray(value, dtype=np.float32)
        kind = types.get(name) if isinstance(types, dict) else (types if value.ndim == 2 else None)
        if kind in (None, "F32"):
            writer.add_tensor(name, value)
            continue
        qtype = _qtype(gguf, kind)
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        if value.shape[-1] % block:
            if not isinstance(types, dict):  # one type for all: rows that do not fit stay F32
                writer.add_tensor(name, value)
                continue
            raise ConversionError(f"{name}: rows of {value.shape[-1]} are not a whole number of {kind} blocks")
        try:
            data = gguf.quants.quantize(value, qtype)
        except NotImplementedError:
            raise ConversionError(f"the gguf package {gguf_version()} has no {kind} quantiser") from None
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def gguf_version() -> str:
    try:
        from importlib.metadata import version

        return version("gguf")
    except Exception:
        return "(version unknown)"


def _qtype(gguf, kind: str):
    try:
        return gguf.GGMLQuantizationType[kind]
    except KeyError:
        raise ConversionError(f"unknown ggml tensor type {kind!r}") from None


def to_adjacent_pairs(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of each head from HF's [x_0..x_{d/2-1}, y_0..y_{d/2-1}] to llama.cpp's [x_0, y_0, x_1, y_1...]."""
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(heads, 2, rows // heads // 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def to_half_split(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of `to_adjacent_pairs`: llama.cpp's adjacent pairs back to HF's halves."""
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(heads, rows // heads // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def _rope_family(sd: dict, cfg, conv: Conversion) -> dict[str, np.ndarray]:
    arch, k = conv.arch, conv.key
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rope = dict(cfg.rope_parameters or {})
    for name, value in (("embedding_length", cfg.hidden_size), ("block_count", cfg.num_hidden_layers),
                        ("feed_forward_length", cfg.intermediate_size), ("attention.head_count", heads),
                        ("attention.head_count_kv", kv_heads), ("attention.key_length", head_dim),
                        ("attention.value_length", head_dim)):
        conv.keys[k(name)] = int(value)
    conv.keys[k("attention.layer_norm_rms_epsilon")] = float(cfg.rms_norm_eps)
    conv.keys[k("rope.dimension_count")] = int(head_dim)
    conv.keys[k("rope.freq_base")] = float(rope.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", "default")
    if kind in ("linear", "yarn"):
        conv.keys[k("rope.scaling.type")] = kind
        conv.keys[k("rope.scaling.factor")] = float(rope["factor"])
        if rope.get("original_max_position_embeddings"):
            conv.keys[k("rope.scaling.original_context_length")] = int(rope["original_max_position_embeddings"])
    elif kind != "default":
        raise ConversionError(f"rope_type {kind} is not converted here")
    if arch == "gemma2":
        conv.keys[k("attention.sliding_window")] = int(cfg.sliding_window)
        conv.keys[k("attn_logit_softcapping")] = float(cfg.attn_logit_softcapping)
        conv.keys[k("final_logit_softcapping")] = float(cfg.final_logit_softcapping)
    plus = "plus1" if arch == "gemma2" else ""  # Gemma norms: (1 + w)
    put = _putter(sd, conv)
    put("token_embd.weight", "model.embed_tokens.weight")
    put("output_norm.weight", "model.norm.weight", plus)
    if arch != "gemma2":
        put("output.weight", "lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for hf, name, n in (("q_proj", "attn_q", heads), ("k_proj", "attn_k", kv_heads), ("v_proj", "attn_v", 0)):
            for suffix in ("weight", "bias"):
                if f"{p}self_attn.{hf}.{suffix}" in sd:
                    put(f"{b}{name}.{suffix}", f"{p}self_attn.{hf}.{suffix}",
                        f"pairs:{n}" if arch == "llama" and n else "")
        put(f"{b}attn_output.weight", f"{p}self_attn.o_proj.weight")
        put(f"{b}attn_norm.weight", f"{p}input_layernorm.weight", plus)
        for hf, name in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
            put(f"{b}{name}.weight", f"{p}mlp.{hf}.weight")
        if arch == "gemma2":
            put(f"{b}post_attention_norm.weight", f"{p}post_attention_layernorm.weight", plus)
            put(f"{b}ffn_norm.weight", f"{p}pre_feedforward_layernorm.weight", plus)
            put(f"{b}post_ffw_norm.weight", f"{p}post_feedforward_layernorm.weight", plus)
        else:
            put(f"{b}ffn_norm.weight", f"{p}post_attention_layernorm.weight")
    return conv.tensors


def _putter(sd: dict, conv: Conversion):
    """put(gguf_name, hf_key, transform): the tensor written, and where it came from (Conversion.sources)."""
    def put(name: str, key: str, transform: str = "") -> None:
        conv.tensors[name] = apply_transform(sd[key], transform)
        conv.sources[name] = (key, transform)
    return put


def apply_transform(w: np.ndarray, transform: str) -> np.ndarray:
    """HF layout -> GGUF layout: "pairs:H" (q/k rows to adjacent pairs, H heads), "plus1" (Gemma norms), "T"."""
    if transform.startswith("pairs:"):
        return to_adjacent_pairs(w, int(transform.split(":")[1]))
    return w + 1.0 if transform == "plus1" else w.T if transform == "T" else w


def undo_transform(w: np.ndarray, transform: str) -> np.ndarray:
    """GGUF layout -> HF layout: the inverse of `apply_transform`."""
    if transform.startswith("pairs:"):
        return to_half_split(w, int(transform.split(":")[1]))
    return w - 1.0 if transform == "plus1" else w.T if transform == "T" else w


def _gpt2(sd: dict, cfg, conv: Conversion) -> dict[str, np.ndarray]:
    for name, value in (("embedding_length", cfg.n_embd), ("block_count", cfg.n_layer),
                        ("feed_forward_length", cfg.n_inner or 4 * cfg.n_embd), ("attention.head_count", cfg.n_head)):
        conv.keys[conv.key(name)] = int(value)
    conv.keys[conv.key("attention.layer_norm_epsilon")] = float(cfg.layer_norm_epsilon)
    put = _putter(sd, conv)
    for name, key in (("token_embd.weight", "transformer.wte.weight"),
                      ("position_embd.weight", "transformer.wpe.weight"),
                      ("output_norm.weight", "transformer.ln_f.weight"), ("output_norm.bias", "transformer.ln_f.bias"),
                      ("output.weight", "lm_head.weight")):
        put(name, key)
    for i in range(cfg.n_layer):
        p, b = f"transformer.h.{i}.", f"blk.{i}."
        for hf, name in (("ln_1", "attn_norm"), ("ln_2", "ffn_norm")):
            put(f"{b}{name}.weight", f"{p}{hf}.weight")
            put(f"{b}{name}.bias", f"{p}{hf}.bias")
        for hf, name in (("attn.c_attn", "attn_qkv"), ("attn.c_proj", "attn_output"), ("mlp.c_fc", "ffn_up"),
                         ("mlp.c_proj", "ffn_down")):
            put(f"{b}{name}.weight", f"{p}{hf}.weight", "T")  # Conv1D [in, out] -> [out, in]
            put(f"{b}{name}.bias", f"{p}{hf}.bias")
    return conv.tensors
