"""Tiny GGUF files for tests and docs: posdiag's converter (posdiag/ports/gguf_writer.py: Llama, Qwen2,
Gemma2, GPT-2, llama.cpp's conventions) and the port bugs tests plant in its output.

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

import torch

from posdiag.ports.gguf_writer import convert, to_half_split, write

PLANTS = ("qk_hf_layout", "freq_base", "no_rope_scaling", "short_context", "no_sliding_window", "norm_eps")


def write_gguf(model: torch.nn.Module, path: str | Path, plant: str | None = None,
               qtype: str | None = None) -> Path:
    """Write MODEL (a tiny HF causal LM) to PATH as a GGUF, F32 or every 2-D weight in QTYPE (e.g.
    "Q8_0"); PLANT one of PLANTS."""
    if plant is not None and plant not in PLANTS:
        raise ValueError(f"unknown plant {plant!r}")
    conv = convert(model)
    k, keys = conv.key, conv.keys
    if plant == "short_context":
        keys[k("context_length")] //= 2
    elif plant == "norm_eps":
        keys[k("attention.layer_norm_rms_epsilon")] = 1e-2
    elif plant == "freq_base":
        keys[k("rope.freq_base")] = 500000.0
    elif plant == "no_rope_scaling":
        for key in [key for key in keys if key.startswith(k("rope.scaling."))]:
            del keys[key]
    elif plant == "no_sliding_window":
        keys.pop(k("attention.sliding_window"), None)
    elif plant == "qk_hf_layout" and conv.arch == "llama":  # undo the permutation: q/k rows stay in HF's halves
        heads = {"attn_q": keys[k("attention.head_count")], "attn_k": keys[k("attention.head_count_kv")]}
        for name in list(conv.tensors):
            kind = name.split(".")[2] if name.startswith("blk.") else ""
            if kind in heads:
                conv.tensors[name] = to_half_split(conv.tensors[name], heads[kind])
    return write(conv, path, qtype)


def main(out_dir: str) -> None:
    """Write the demo files the docs use: tiny Llama (strong init) healthy, and with two plants, in F32;
    and healthy and q/k-planted in Q8_0."""
    from posdiag.testing import zoo

    model = zoo.tiny_model("llama", init="strong")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for plant in (None, "qk_hf_layout", "norm_eps"):
        print(write_gguf(model, out / f"llama-tiny-{plant or 'healthy'}.gguf", plant=plant))
    for plant in (None, "qk_hf_layout"):
        print(write_gguf(model, out / f"llama-tiny-q8_0-{plant or 'healthy'}.gguf", plant=plant, qtype="Q8_0"))


if __name__ == "__main__":
    import sys

    main(sys.argv[1] if len(sys.argv) > 1 else "gguf-demo")
