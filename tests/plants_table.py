"""Planted position-table bugs for the `table` check (test support; not part of posdiag).

Each function mutates a tiny zoo model in place and returns it. They reproduce the
classes in ../shared/BUGS.md G: a table that silently clamps or wraps its row index
past N < declared, a zeroed table, a sinusoidal table overwritten at initialisation,
a table with fewer rows than the declared context, wrong offsets (a RoBERTa port that
ignores padding_idx+1, an OPT-style module with the wrong internal offset), and a
table that looks freshly initialised inside an otherwise trained-looking model.
"""

from __future__ import annotations

import torch
from torch import nn

TABLE_MODULES = ("wpe", "embed_positions", "position_embeddings")


def position_modules(model: nn.Module) -> list[tuple[str, nn.Embedding]]:
    return [(n, m) for n, m in model.named_modules() if n.split(".")[-1] in TABLE_MODULES]


class _IndexMap(nn.Embedding):
    """Inserted between an embedding class and nn.Embedding: remaps the row index before lookup.
    (BART/OPT/Marian position modules compute their rows, then call super().forward(rows).)"""

    def forward(self, input):  # nn.Embedding's own argument name
        return super().forward(self._posdiag_map(input))


def _remap(model: nn.Module, fn, first_row: int, only: str = "") -> nn.Module:
    mods = [(n, m) for n, m in position_modules(model) if only in n]
    assert mods, "no position table module"
    for _, module in mods:
        cls = type(module)
        new = _IndexMap if cls is nn.Embedding else type(f"Remapped{cls.__name__}", (cls, _IndexMap), {})
        module.__class__ = new
        module._posdiag_map = lambda rows, fn=fn: torch.where(rows >= first_row, fn(rows - first_row) + first_row, rows)
    return model


def clamp_rows(model: nn.Module, limit: int, first_row: int = 0, only: str = "") -> nn.Module:
    """Every position >= limit reads the row of position limit-1 (a silent clamp, no error).
    `only`: a substring of the module name (e.g. "decoder") to plant in one stack."""
    return _remap(model, lambda p: p.clamp(max=limit - 1), first_row, only)


def wrap_rows(model: nn.Module, modulo: int, first_row: int = 0) -> nn.Module:
    """Position p reads the row of position p mod `modulo`."""
    return _remap(model, lambda p: p % modulo, first_row)


def zero_table(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for _, m in position_modules(model):
            m.weight.zero_()
    return model


def randomize_table(model: nn.Module, seed: int = 0, std: float = 0.02) -> nn.Module:
    """A sinusoidal table overwritten by a normal init (transformers #29807: post_init on DistilBERT/XLM)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, m in position_modules(model):
            m.weight.copy_(torch.randn(m.weight.shape, generator=gen) * std)
    return model


def randomize_custom_table(model: nn.Module, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    model.position_table.copy_(torch.randn(model.position_table.shape, generator=gen))
    return model


def shrink_table(model: nn.Module, rows: int) -> nn.Module:
    """Keep only the first `rows` rows (the config still declares the full context)."""
    for _, m in position_modules(model):
        m.weight = nn.Parameter(m.weight.detach()[:rows].clone())
        m.num_embeddings = rows
    return model


def roberta_ignoring_offset(model: nn.Module) -> nn.Module:
    """A port that numbers positions from 0 instead of padding_idx+1 when ids are omitted."""
    emb = model.embeddings

    def arange_ids(input_ids, padding_idx, cache_length=0):
        return torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand_as(input_ids) + cache_length

    emb.create_position_ids_from_input_ids = arange_ids
    return model


def opt_wrong_internal_offset(model: nn.Module, offset: int = 1) -> nn.Module:
    for _, m in position_modules(model):
        m.offset = offset
    return model


def trained_looking_tokens(model: nn.Module, seed: int = 0) -> nn.Module:
    """Make the token embeddings look trained (a shared direction and a std far from the init's),
    leaving the position table as initialised: the 're-initialised table' health warning."""
    gen = torch.Generator().manual_seed(seed)
    emb = model.get_input_embeddings()
    with torch.no_grad():
        common = torch.randn(emb.weight.shape[1], generator=gen)
        emb.weight.mul_(3.0).add_(0.05 * common)
    return model


def smooth_table(model: nn.Module, seed: int = 0) -> nn.Module:
    """A trained-looking table: a slow random walk over positions (adjacent rows correlate)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, m in position_modules(model):
            steps = torch.randn(m.weight.shape, generator=gen) * 0.01
            m.weight.copy_(steps.cumsum(0) + torch.randn(m.weight.shape[1], generator=gen) * 0.05)
    return model


def demo_clamped_gpt2() -> nn.Module:
    """CLI demo factory: `posdiag check tests.plants_table:demo_clamped_gpt2 --only table`."""
    from posdiag.testing.zoo import tiny_model

    return clamp_rows(tiny_model("gpt2"), 100)
