"""What a forward's output gives a comparison: its logits (or final hidden state), or the final hidden state of
the last positions only."""

from __future__ import annotations

from typing import Any

import torch


def final_state(out: Any, new: int) -> torch.Tensor | None:
    """The final hidden state of the last `new` positions of a forward ([B, new, ...]); None when the output carries
    none per token. Everything after it (a final norm, the LM head, logit softcapping) is the same function at every
    position, so two paths that agree here agree in their logits, and a difference here shows there too; comparing it
    spares a [T, vocab] head output per forward. Streams stacked per token ([streams, B, T, D]: Gemma 3n's AltUp)
    become [B, T, streams * D]."""
    hidden = getattr(out, "decoder_hidden_states", None) or getattr(out, "hidden_states", None)
    if not hidden:
        return None
    rows, h = output_of(out).shape[0], hidden[-1]
    while isinstance(h, (tuple, list)):
        h = h[0]
    if not isinstance(h, torch.Tensor):
        return None
    if h.ndim == 4 and h.shape[1] == rows:
        h = h.permute(1, 2, 0, 3).reshape(rows, h.shape[2], -1)
    return h[:, -new:] if h.ndim >= 3 and h.shape[0] == rows and h.shape[1] >= new else None


def output_of(out: Any) -> torch.Tensor:
    """Logits where the model has a head, else the final hidden state: [B, T, *]."""
    logits = getattr(out, "logits", None)
    if logits is not None:
        return logits
    return out.last_hidden_state
