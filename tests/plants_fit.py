"""Broken copies of a trained checkpoint for `fit`: each a one-line mistake a port or a config edit makes.

Written into a fresh directory (never into the source checkpoint): the weights and tokenizer files are symlinked
where they stay unchanged, config.json rewritten; the q/k layout copy writes its own permuted weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from posdiag.checks.fit.edits import deinterleave


def _copy(src: Path, dst: Path, *, link_weights: bool = True) -> dict:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name == "config.json" or f.is_dir() or f.suffix == ".lock":
            continue
        if f.name.endswith(".safetensors") and not link_weights:
            continue
        (dst / f.name).symlink_to(f.resolve())
    return json.loads((src / "config.json").read_text())


def _write_config(dst: Path, config: dict) -> Path:
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def theta_lost(src: Path, dst: Path, theta: float = 10000.0) -> Path:
    """rope_theta back at the default a port falls back to."""
    config = _copy(src, dst)
    config["rope_parameters"] = {**config["rope_parameters"], "rope_theta": theta}
    return _write_config(dst, config)


def spurious_scaling(src: Path, dst: Path, factor: float = 4.0) -> Path:
    """A linear scaling block that the weights were never trained with."""
    config = _copy(src, dst)
    config["rope_parameters"] = {**config["rope_parameters"], "rope_type": "linear", "factor": factor}
    return _write_config(dst, config)


def theta_lost_per_layer_type(src: Path, dst: Path, theta: float = 10000.0) -> Path:
    """Every layer type's rope_theta back at the default (Gemma 3's full-attention layers are trained at 1e6)."""
    config = _copy(src, dst)
    config["rope_parameters"] = {k: {**v, "rope_theta": theta} for k, v in config["rope_parameters"].items()}
    return _write_config(dst, config)


def window_declared(src: Path, dst: Path, window: int | None) -> Path:
    """The same checkpoint with `sliding_window` WINDOW in its config (None: dropped), as a converter writes it."""
    config = _copy(src, dst)
    config["sliding_window"] = window
    return _write_config(dst, config)


def interleaved_qk(src: Path, dst: Path, norms: bool = True) -> Path:
    """q_proj/k_proj rows written in the interleaved pairing order (the layout Meta's checkpoints use) while the
    code rotates halves: the inverse of the de-interleaving a converter must apply. With NORMS, q/k norm weights
    (one per head dim: Gemma 3, Qwen3, OLMo 2) follow the rows, as a converter that reorders head dims must; without,
    they stay put, a second mistake on top (the rows' dims then meet other dims' norm weights)."""
    from safetensors.torch import load_file, save_file

    config = _copy(src, dst, link_weights=False)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    order = torch.argsort(deinterleave(head_dim, head_dim))
    weights = load_file(str(src / "model.safetensors"))
    for name, t in weights.items():
        norm = norms and name.endswith(("q_norm.weight", "k_norm.weight")) and t.shape[0] == head_dim
        if norm or name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            shaped = t.view(t.shape[0] // head_dim, head_dim, *t.shape[1:])
            weights[name] = shaped.index_select(1, order).reshape(t.shape).contiguous()
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return _write_config(dst, config)


def converter_permuted(src: Path, dst: Path) -> Path:
    """q_proj/k_proj rows permuted by a converter that de-interleaves weights already in the half-split order (the
    un-permutation applied twice): the pairs mix dims of different frequencies, and no re-ordering among the
    alternatives (one interleave or de-interleave) puts them back."""
    from safetensors.torch import load_file, save_file

    config = _copy(src, dst, link_weights=False)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    order = deinterleave(head_dim, head_dim)
    weights = load_file(str(src / "model.safetensors"))
    for name, t in weights.items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            weights[name] = t.view(t.shape[0] // head_dim, head_dim, -1).index_select(1, order).reshape(t.shape)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return _write_config(dst, config)


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def demo_theta_lost():
    """CLI demo factory: fixtures/rope-copy (trained at rope_theta 10000) loaded with rope_theta 1000 in its config:
    `posdiag check tests.plants_fit:demo_theta_lost --only fit`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fixture = Path(__file__).resolve().parent.parent / "fixtures" / "rope-copy"
    config = AutoConfig.from_pretrained(fixture)
    config.rope_parameters = {**config.rope_parameters, "rope_theta": 1000.0}
    return AutoModelForCausalLM.from_pretrained(fixture, config=config, attn_implementation="eager").eval()


def as_mistral(src: Path, dst: Path, window: int | None) -> Path:
    """The Llama checkpoint as the same network in Mistral's class (identical weights and parameter names), with a
    sliding window of `window` tokens declared (None: none, the healthy twin). A Llama trained without a window
    given one by its config: every layer stops seeing keys older than the window."""
    config = _copy(src, dst)
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=window)
    return _write_config(dst, config)
