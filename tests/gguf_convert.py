"""A small HF -> GGUF converter for tiny test models (Llama, Qwen2, Gemma2, GPT-2), written with the
`gguf` package from llama.cpp's conventions, and the port bugs tests plant in it.

Conventions (llama.cpp's names; numpy arrays are written as HF stores them, [out, in], which GGUF
records as ne = [in, out]):
- `llama` uses llama.cpp's "normal" RoPE, which rotates adjacent pairs (x0, x1), (x2, x3)...; HF's
  Llama rotates halves (x_i, x_{i+d/2}). So q/k rows are permuted per head from the half split into
  adjacent pairs. `qwen2` and `gemma2` use llama.cpp's NeoX RoPE (halves, like HF): no permutation.
- Gemma's RMSNorm multiplies by (1 + w): llama.cpp's by w, so every norm weight is written + 1.
  llama.cpp scales Gemma's embeddings by sqrt(hidden) itself and ties the output to token_embd.
- GPT-2's Conv1D stores [in, out]: transposed to [out, in].
- No tokenizer: `tokenizer.ggml.model = "none"` and `<arch>.vocab_size`; the ids are the reference's.

Plants (`plant=`), each one real bring-up mistake:
- "qk_hf_layout": llama q/k rows left in HF's half-split layout (the permutation skipped).
- "freq_base": `rope.freq_base` 500000 instead of the config's value.
- "no_rope_scaling": the `rope.scaling.*` keys dropped (a linear or YaRN model runs unscaled).
- "short_context": `context_length` half the config's.
- "no_sliding_window": `attention.sliding_window` dropped (llama.cpp's Gemma2 default is 4096).
- "norm_eps": the RMS norm epsilon written as 1e-2 (a weight/norm bug, not a position bug).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

PLANTS = ("qk_hf_layout", "freq_base", "no_rope_scaling", "short_context", "no_sliding_window", "norm_eps")


def write_gguf(model: torch.nn.Module, path: str | Path, plant: str | None = None) -> Path:
    """Write MODEL (a tiny HF causal LM) to PATH as an F32 GGUF; PLANT one of PLANTS."""
    import gguf

    if plant is not None and plant not in PLANTS:
        raise ValueError(f"unknown plant {plant!r}")
    cfg = model.config
    arch = {"llama": "llama", "qwen2": "qwen2", "gemma2": "gemma2", "gpt2": "gpt2"}[cfg.model_type]
    sd = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    writer = gguf.GGUFWriter(str(path), arch)
    kv = _Keys(writer, arch)
    context = cfg.max_position_embeddings if arch != "gpt2" else cfg.n_positions
    kv.u32("context_length", context // 2 if plant == "short_context" else context)
    kv.u32("vocab_size", cfg.vocab_size)
    writer.add_string("tokenizer.ggml.model", "none")
    tensors = _gpt2(sd, cfg, kv) if arch == "gpt2" else _rope_family(sd, cfg, kv, arch, plant)
    for name, value in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


class _Keys:
    def __init__(self, writer, arch: str):
        self.writer, self.arch = writer, arch

    def u32(self, key: str, value: int) -> None:
        self.writer.add_uint32(f"{self.arch}.{key}", int(value))

    def f32(self, key: str, value: float) -> None:
        self.writer.add_float32(f"{self.arch}.{key}", float(value))

    def s(self, key: str, value: str) -> None:
        self.writer.add_string(f"{self.arch}.{key}", value)


def _to_adjacent_pairs(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of each head from HF's [x_0..x_{d/2-1}, y_0..y_{d/2-1}] to llama.cpp's [x_0, y_0, x_1, y_1...]."""
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(heads, 2, rows // heads // 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def _rope_family(sd: dict, cfg, kv: _Keys, arch: str, plant: str | None) -> dict[str, np.ndarray]:
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rope = dict(cfg.rope_parameters or {})
    kv.u32("embedding_length", cfg.hidden_size)
    kv.u32("block_count", cfg.num_hidden_layers)
    kv.u32("feed_forward_length", cfg.intermediate_size)
    kv.u32("attention.head_count", heads)
    kv.u32("attention.head_count_kv", kv_heads)
    kv.u32("attention.key_length", head_dim)
    kv.u32("attention.value_length", head_dim)
    kv.f32("attention.layer_norm_rms_epsilon", 1e-2 if plant == "norm_eps" else cfg.rms_norm_eps)
    kv.u32("rope.dimension_count", head_dim)
    kv.f32("rope.freq_base", 500000.0 if plant == "freq_base" else rope.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", "default")
    if kind in ("linear", "yarn") and plant != "no_rope_scaling":
        kv.s("rope.scaling.type", kind)
        kv.f32("rope.scaling.factor", rope["factor"])
        if rope.get("original_max_position_embeddings"):
            kv.u32("rope.scaling.original_context_length", rope["original_max_position_embeddings"])
    elif kind not in ("default", "linear", "yarn"):
        raise ValueError(f"rope_type {kind} is not converted here")
    window = getattr(cfg, "sliding_window", None)
    if arch == "gemma2":
        if plant != "no_sliding_window":
            kv.u32("attention.sliding_window", window)
        kv.f32("attn_logit_softcapping", cfg.attn_logit_softcapping)
        kv.f32("final_logit_softcapping", cfg.final_logit_softcapping)
    plus = 1.0 if arch == "gemma2" else 0.0  # Gemma norms: (1 + w)
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"] + plus}
    if arch != "gemma2":
        out["output.weight"] = sd["lm_head.weight"]
    permute = arch == "llama" and plant != "qk_hf_layout"
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for hf, name, n in (("q_proj", "attn_q", heads), ("k_proj", "attn_k", kv_heads), ("v_proj", "attn_v", 0)):
            for suffix in ("weight", "bias"):
                w = sd.get(f"{p}self_attn.{hf}.{suffix}")
                if w is not None:
                    out[f"{b}{name}.{suffix}"] = _to_adjacent_pairs(w, n) if permute and n else w
        out[f"{b}attn_output.weight"] = sd[f"{p}self_attn.o_proj.weight"]
        out[f"{b}attn_norm.weight"] = sd[f"{p}input_layernorm.weight"] + plus
        for hf, name in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
            out[f"{b}{name}.weight"] = sd[f"{p}mlp.{hf}.weight"]
        if arch == "gemma2":
            out[f"{b}post_attention_norm.weight"] = sd[f"{p}post_attention_layernorm.weight"] + plus
            out[f"{b}ffn_norm.weight"] = sd[f"{p}pre_feedforward_layernorm.weight"] + plus
            out[f"{b}post_ffw_norm.weight"] = sd[f"{p}post_feedforward_layernorm.weight"] + plus
        else:
            out[f"{b}ffn_norm.weight"] = sd[f"{p}post_attention_layernorm.weight"]
    return out


def _gpt2(sd: dict, cfg, kv: _Keys) -> dict[str, np.ndarray]:
    kv.u32("embedding_length", cfg.n_embd)
    kv.u32("block_count", cfg.n_layer)
    kv.u32("feed_forward_length", cfg.n_inner or 4 * cfg.n_embd)
    kv.u32("attention.head_count", cfg.n_head)
    kv.f32("attention.layer_norm_epsilon", cfg.layer_norm_epsilon)
    out = {"token_embd.weight": sd["transformer.wte.weight"], "position_embd.weight": sd["transformer.wpe.weight"],
           "output_norm.weight": sd["transformer.ln_f.weight"], "output_norm.bias": sd["transformer.ln_f.bias"],
           "output.weight": sd["lm_head.weight"]}
    for i in range(cfg.n_layer):
        p, b = f"transformer.h.{i}.", f"blk.{i}."
        for hf, name in (("ln_1", "attn_norm"), ("ln_2", "ffn_norm")):
            out[f"{b}{name}.weight"], out[f"{b}{name}.bias"] = sd[f"{p}{hf}.weight"], sd[f"{p}{hf}.bias"]
        for hf, name in (("attn.c_attn", "attn_qkv"), ("attn.c_proj", "attn_output"), ("mlp.c_fc", "ffn_up"),
                         ("mlp.c_proj", "ffn_down")):
            out[f"{b}{name}.weight"] = sd[f"{p}{hf}.weight"].T  # Conv1D [in, out] -> [out, in]
            out[f"{b}{name}.bias"] = sd[f"{p}{hf}.bias"]
    return out


def main(out_dir: str) -> None:
    """Write the demo files the docs use: tiny Llama (strong init) healthy, and with two plants."""
    from posdiag.testing import zoo

    model = zoo.tiny_model("llama", init="strong")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for plant in (None, "qk_hf_layout", "norm_eps"):
        print(write_gguf(model, out / f"llama-tiny-{plant or 'healthy'}.gguf", plant=plant))


if __name__ == "__main__":
    import sys

    main(sys.argv[1] if len(sys.argv) > 1 else "gguf-demo")
