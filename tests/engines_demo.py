"""Engines for `posdiag compare` tests and docs: a tiny Llama reference (module:factory returning a
torch.nn.Module) and candidates that follow the engine protocol (objects with logits(ids) -> [T, V]),
wrapping a copy of the same model: healthy, with q/k rows in the other rotary layout (a position
bug), with a wrong norm epsilon (a weight/norm bug), whose prefill + continuation restarts positions
at 0, and with a wrong return shape."""

from __future__ import annotations

import torch

from posdiag.testing import zoo

try:  # under pytest, tests/ is on the path; from the repository root, tests is a package path
    from plants_compare import copy_of, interleave_qk, wrong_norm_eps
except ImportError:
    from tests.plants_compare import copy_of, interleave_qk, wrong_norm_eps


class TorchEngine:
    """The protocol over a PyTorch model: numpy logits [T, V] for a list of ids."""

    def __init__(self, model: torch.nn.Module, name: str):
        self.model = model
        self.name = name
        self.settings = {"engine": "transformers (wrapped as an engine)", "dtype": "float32"}

    def logits(self, ids: list[int]):
        with torch.no_grad():
            return self.model(torch.tensor([ids])).logits[0].numpy()

    def logits_continued(self, ids: list[int], split: int):
        """Prefill ids[:split] into a transformers cache, then continue it with ids[split:]."""
        with torch.no_grad():
            first = self.model(torch.tensor([ids[:split]]), use_cache=True)
            rest = self.model(torch.tensor([ids[split:]]), cache=first.cache,
                              position_ids=self.continued_positions(split, len(ids)), use_cache=True)
        return torch.cat([first.logits[0], rest.logits[0]]).numpy()

    def continued_positions(self, split: int, total: int) -> torch.Tensor:
        return torch.arange(split, total)[None]


class RestartingEngine(TorchEngine):
    """A port whose continuation restarts positions at 0 (the cache kept): a decode-position bug."""

    def continued_positions(self, split: int, total: int) -> torch.Tensor:
        return torch.arange(0, total - split)[None]


def reference() -> torch.nn.Module:
    return zoo.tiny_model("llama", init="strong")


def healthy() -> TorchEngine:
    return TorchEngine(copy_of(reference()), "healthy engine")


def rotary_layout() -> TorchEngine:
    return TorchEngine(interleave_qk(reference()), "engine with q/k in the interleaved layout")


def norm_eps() -> TorchEngine:
    return TorchEngine(wrong_norm_eps(reference(), 1e-2), "engine with norm epsilon 1e-2")


def restarts_positions() -> RestartingEngine:
    return RestartingEngine(copy_of(reference()), "engine whose continuation restarts positions at 0")


class QuantisedEngine(TorchEngine):
    """A port that says its weights are quantised but has no file posdiag could split into its F32 twin: what
    quantisation adds cannot be measured, so a position bug it shows is inconclusive (WARN), never a PASS."""

    quantization = "Q8_0"


def quantised_rotary_layout() -> QuantisedEngine:
    return QuantisedEngine(interleave_qk(reference()), "quantised engine with q/k in the interleaved layout")


class _Flat:
    def logits(self, ids):
        return [0.0] * len(ids)


def wrong_shape() -> _Flat:
    return _Flat()


def not_an_engine() -> dict:
    return {}
