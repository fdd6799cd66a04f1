"""Health (WARN only): an all-zero table, duplicate rows, a table that looks freshly initialised
(adjacent-row cosine at chance, std = initializer_range) while the token embeddings do not, a table
the checkpoint did not provide (the `load` check FAILs on that; here is the evidence)."""

from __future__ import annotations

import math

import torch

from posdiag.checks.table.discovery import PositionTable
from posdiag.checks.table.helpers import Part
from posdiag.model.checkpoint import in_checkpoint
from posdiag.model.subject import Subject
from posdiag.results import Status
from posdiag.verdict import MACHINE_EPSILON, within_tolerance


def health_parts(subject: Subject, t: PositionTable, declared: int | None, offset: int | None) -> list[Part]:
    where = f"{t.stack}_" if len(subject.stacks) > 1 else ""
    offset = subject.family.position_offset if offset is None else offset
    n = declared if declared is not None else t.rows - offset
    used = t.tensor.detach()[offset: offset + n].double().cpu()
    parts: list[Part] = []
    missing = _missing_from_checkpoint(subject, t.name)
    if missing:
        parts.append(Part("health", Status.WARN, f"{t.name} is not in the checkpoint: its values are the init's "
                          "(`load` fails on this)", details={"where": where}))
    if used.numel() == 0:
        return parts
    if float(used.abs().max()) == 0.0:
        parts.append(Part("health", Status.WARN, f"{t.name}: all {len(used)} rows are zero: the table adds nothing, "
                          "so positions cannot enter through it", {"zero_rows": len(used)}, {"where": where}))
        return parts
    dups = _duplicate_rows(used, MACHINE_EPSILON.get(str(t.tensor.dtype).removeprefix("torch."), 1.2e-7))
    if dups:
        r, q = dups[0]
        parts.append(Part("health", Status.WARN, f"{t.name}: {len(dups)} row(s) duplicate other rows (position {r} "
                          f"== position {q}): those positions cannot be told apart",
                          {"duplicate_rows": len(dups)}, {"where": where}))
    if subject.position_kind == "learned":
        fresh = _fresh_init_evidence(subject, used)
        if fresh:
            parts.append(Part("health", Status.WARN, f"{t.name}: {fresh}", details={"where": where}))
    if not parts:
        parts.append(Part("health", Status.PASS, f"{t.name}: no zero or duplicate rows", details={"where": where}))
    return parts


def _duplicate_rows(rows: torch.Tensor, eps: float) -> list[tuple[int, int]]:
    """(later, earlier) pairs of rows equal within rounding. Rows are sorted by a random
    projection: equal rows project equally, so they end up next to each other."""
    scale = float(rows.norm(dim=-1).median()) or 1.0
    proj = rows @ torch.randn(rows.shape[1], generator=torch.Generator().manual_seed(0), dtype=rows.dtype)
    order = torch.argsort(proj, stable=True)
    close = within_tolerance((rows[order[1:]] - rows[order[:-1]]).norm(dim=-1) / scale, eps)
    pairs = {}
    for i in torch.nonzero(close).flatten().tolist():
        a, b = int(order[i]), int(order[i + 1])
        pairs[max(a, b)] = min(pairs.get(max(a, b), min(a, b)), min(a, b))
    return sorted(pairs.items())


def _missing_from_checkpoint(subject: Subject, name: str) -> bool:
    info = subject.load_info
    if info.checkpoint_keys is None or name not in subject.model.state_dict():
        return False
    return name in info.missing_keys or not in_checkpoint(name, set(info.checkpoint_keys))


def _adjacent_cosine(rows: torch.Tensor, gap: int = 1) -> tuple[float, float]:
    """Mean cosine between rows r and r+gap, and its standard error for independent isotropic rows."""
    a, b = rows[:-gap], rows[gap:]
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    return float(cos.mean()), 1.0 / math.sqrt(rows.shape[1] * max(1, len(cos)))


def _fresh_init_evidence(subject: Subject, used: torch.Tensor) -> str:
    """A table that looks like N(0, initializer_range) noise while the token embeddings do not.

    Trained tables are smooth (adjacent rows correlate); a fresh init has adjacent-row cosine at
    chance (|mean| within 4 standard errors of 0) and the init's std (within 15% of
    initializer_range, where the config gives one). 'The rest is trained' needs evidence too: the
    token embedding rows correlate (mean cosine beyond 8 standard errors) or their std is not the
    init's. Both must hold, or nothing is said (a default-init model is random everywhere)."""
    if len(used) < 8:
        return ""
    c_adj, se = _adjacent_cosine(used)
    c_far, se_far = _adjacent_cosine(used, gap=max(1, len(used) // 2))
    if abs(c_adj) > 4 * se or abs(c_far) > 4 * se_far:
        return ""
    emb = subject.model.get_input_embeddings() if hasattr(subject.model, "get_input_embeddings") else None
    if emb is None or getattr(emb, "weight", None) is None:
        return ""
    emb_name = next((n for n, m in subject.model.named_modules() if m is emb), None)
    if emb_name is None:
        return ""
    with subject.stored_weight(f"{emb_name}.weight") as weight:  # offloaded embeddings: read from accelerate's map
        tok = weight.detach()[: 4096].double().cpu()
    c_tok, se_tok = _adjacent_cosine(tok)
    init = getattr(subject.config, "initializer_range", None) or getattr(subject.config, "init_std", None)
    std_tok, std_pos = float(tok.std()), float(used.std())
    if init is not None and abs(std_pos / init - 1) > 0.15:
        return ""  # noise, but not the init's noise: not evidence of a fresh initialisation
    tok_trained = abs(c_tok) > 8 * se_tok or (init is not None and abs(std_tok / init - 1) > 0.25)
    if not tok_trained:
        return ""
    init_text = f", std {std_pos:.3g} vs initializer_range {init}" if init else f", std {std_pos:.3g}"
    return (f"looks freshly initialised (adjacent-row cosine {c_adj:.3f} ± {se:.3f}, chance level{init_text}) "
            f"while the token embeddings look trained (row cosine {c_tok:.3f}, std {std_tok:.3g}): trained tables are "
            "smooth in position; was the table re-initialised or never trained?")
