"""Tiny models exported with torch.onnx (the TorchScript exporter: ~1 s a graph), for tests and docs:

- "dynamic": input_ids, attention_mask and position_ids with a dynamic sequence axis (the healthy export);
- "static": traced at one length (no dynamic axes), the positions computed inside the graph, constants there;
- "kv": with past key/values in and present key/values out, positions continuing from the past length;
- "kv_ignores_past": the same graph whose positions restart at 0 whatever the past length (a decode bug).

`python tests/onnx_export.py [OUT_DIR]` writes the four graphs of the tiny Llama of tests/engines_demo.py.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

EXPORTS = ("dynamic", "static", "kv", "kv_ignores_past")
TRACED_LENGTH = 16


class _Logits(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, positions_inside: bool = False):
        super().__init__()
        self.model, self.positions_inside = model, positions_inside

    def forward(self, input_ids, attention_mask, position_ids=None):
        if self.positions_inside:
            position_ids = torch.arange(input_ids.shape[1])[None]
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False).logits


class _Cached(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, ignore_past: bool):
        super().__init__()
        self.model, self.ignore_past = model, ignore_past
        self.layers = model.config.num_hidden_layers

    def forward(self, input_ids, *past):
        from transformers import DynamicCache

        start = 0 if self.ignore_past else past[0].shape[2]
        positions = (torch.arange(input_ids.shape[1]) + start)[None]
        cache = DynamicCache()
        for i in range(self.layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.model(input_ids=input_ids, position_ids=positions, past_key_values=cache, use_cache=True)
        return (out.logits, *[t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)])


def export(model: torch.nn.Module, path: str | Path, kind: str) -> Path:
    """MODEL (a tiny causal LM, eval mode) exported as KIND (one of EXPORTS) to PATH."""
    model = model.eval()
    ids = torch.randint(0, 32, (1, TRACED_LENGTH))
    mask = torch.ones_like(ids)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if kind == "dynamic":
            seq = {1: "seq"}
            torch.onnx.export(_Logits(model), (ids, mask, torch.arange(TRACED_LENGTH)[None]), str(path),
                              input_names=["input_ids", "attention_mask", "position_ids"], output_names=["logits"],
                              dynamic_axes={"input_ids": seq, "attention_mask": seq, "position_ids": seq,
                                            "logits": seq}, dynamo=False)
        elif kind == "static":
            torch.onnx.export(_Logits(model, positions_inside=True), (ids, mask), str(path),
                              input_names=["input_ids", "attention_mask"], output_names=["logits"], dynamo=False)
        elif kind in ("kv", "kv_ignores_past"):
            cfg = model.config
            heads = cfg.num_key_value_heads
            dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            past = [torch.randn(1, heads, 3, dim) for _ in range(2 * cfg.num_hidden_layers)]
            names = [f"past_key_values.{i}.{kv}" for i in range(cfg.num_hidden_layers) for kv in ("key", "value")]
            presents = [n.replace("past_key_values", "present") for n in names]
            axes = {"input_ids": {1: "seq"}, "logits": {1: "seq"}, **{n: {2: "past"} for n in names},
                    **{n: {2: "total"} for n in presents}}
            torch.onnx.export(_Cached(model, kind == "kv_ignores_past"), (ids[:, :5], *past), str(path),
                              input_names=["input_ids", *names], output_names=["logits", *presents],
                              dynamic_axes=axes, dynamo=False)
        else:
            raise ValueError(kind)
    return Path(path)


def main(out_dir: str) -> None:
    from tests.engines_demo import reference

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for kind in EXPORTS:
        print(export(reference(), out / f"llama-tiny-{kind}.onnx", kind))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "onnx-demo")
