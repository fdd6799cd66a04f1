"""Rows of probe inputs, run in one batched forward, and the mask-fidelity probe.

A `Row` says which tokens, in which logical order (for the attention pattern), at which
position ids, with which padding. `run_rows` stacks any number of rows into one forward
call (split only by --max-batch), so a check pays for one pass, not one per variant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from posdiag.subject import Outputs, Subject
from posdiag.tensors import relative_l2
from posdiag.verdict import PASS_RATIO, FAIL_RATIO, noise_floor


@dataclass
class Row:
    """One sequence of a batched probe.

    ids:       token ids [T].
    order:     logical index of each token [T]; the causal pattern is order[k] <= order[q].
    positions: position ids to pass [T]; None = arange (passed only where the family takes them).
    valid:     bool [T], False at padding; None = all valid.
    edit:      optional bool[B,T,T] -> bool[B,T,T] applied to this row's attention pattern.
    """

    ids: torch.Tensor
    order: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    edit: Callable[[torch.Tensor], torch.Tensor] | None = None


def arange_like(ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(ids.shape[-1], device=ids.device)


def run_rows(subject: Subject, rows: list[Row], *, stack: str = "decoder", explicit_mask: bool = True,
             encoder_ids: torch.Tensor | None = None) -> Outputs:
    """Run every row in one forward (per --max-batch chunk). Masks are explicit unless told otherwise."""
    ids = torch.stack([r.ids for r in rows]).to(subject.device)
    mask: Any = None
    if explicit_mask:
        per_row = [
            subject.mask_argument(
                (r.order if r.order is not None else arange_like(r.ids))[None],
                None if r.valid is None else r.valid[None],
                stack=stack,
                edit=r.edit,
            )
            for r in rows
        ]
        mask = _cat_masks(per_row)
    position_ids = None
    if subject.family.takes_position_ids:
        position_ids = torch.stack([r.positions if r.positions is not None else arange_like(r.ids) for r in rows])
    with subject.explicit_pattern() if explicit_mask else _null():
        return subject.forward(ids, mask=mask, position_ids=position_ids, stack=stack, encoder_ids=encoder_ids)


def _cat_masks(masks: list[Any]) -> Any:
    if isinstance(masks[0], dict):
        return {k: torch.cat([m[k] for m in masks]) for k in masks[0]}
    return torch.cat(masks)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# ------------------------------------------------------------------------ mask fidelity
@dataclass(frozen=True)
class Fidelity:
    """Is an explicit attention pattern honoured? Measured, never assumed from a signature.

    reproduces: explicit causal mask vs the model's own default (relative L2).
    block_effect: change at later queries when one past key is blocked.
    open_effect: change at one query when a future key is opened (a hard-coded causal buffer
    ANDed into the scores shows as no effect).
    """

    ok: bool
    reason: str
    reproduces: float
    block_effect: float
    open_effect: float
    tolerance: float

    def metrics(self) -> dict[str, float]:
        return {"mask_reproduces_default": self.reproduces, "mask_block_effect": self.block_effect,
                "mask_open_effect": self.open_effect, "mask_tolerance": self.tolerance}


def fidelity_rows(ids: torch.Tensor) -> tuple[list[Row], tuple[int, int, int]]:
    """Rows: explicit causal, one past key blocked for later queries, one future key opened."""
    t = ids.shape[-1]
    blocked_key, open_query, open_key = t // 3, t // 4, t // 2

    def block(a: torch.Tensor) -> torch.Tensor:
        a = a.clone()
        a[:, blocked_key + 1:, blocked_key] = False
        return a

    def open_(a: torch.Tensor) -> torch.Tensor:
        a = a.clone()
        a[:, open_query, open_key] = True
        return a

    return [Row(ids), Row(ids, edit=block), Row(ids, edit=open_)], (blocked_key, open_query, open_key)


def judge_fidelity(default: torch.Tensor, explicit: torch.Tensor, blocked: torch.Tensor, opened: torch.Tensor,
                   where: tuple[int, int, int], measured_floor: float, dtype: str) -> Fidelity:
    """Each input is a final hidden state [T, D] of the matching fidelity row."""
    blocked_key, open_query, _ = where
    floor = noise_floor(measured_floor, dtype)
    reproduces = relative_l2(explicit, default)
    block_effect = relative_l2(blocked[blocked_key + 1:], explicit[blocked_key + 1:])
    open_effect = relative_l2(opened[open_query:open_query + 1], explicit[open_query:open_query + 1])
    tolerance = FAIL_RATIO * floor
    if reproduces > tolerance:
        reason = f"explicit causal mask does not reproduce the model's default output (rel. error {reproduces:.2e} > {tolerance:.1e})"
        return Fidelity(False, reason, reproduces, block_effect, open_effect, tolerance)
    if block_effect < PASS_RATIO * floor:
        reason = f"blocking a key in the explicit mask changes nothing (effect {block_effect:.1e}): the mask is ignored"
        return Fidelity(False, reason, reproduces, block_effect, open_effect, tolerance)
    if open_effect < PASS_RATIO * floor:
        reason = f"opening a future key changes nothing (effect {open_effect:.1e}): a causal pattern is hard-coded"
        return Fidelity(False, reason, reproduces, block_effect, open_effect, tolerance)
    return Fidelity(True, "explicit mask honoured", reproduces, block_effect, open_effect, tolerance)
