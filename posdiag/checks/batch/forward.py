"""The path a user takes: a 2D padding mask and explicit position_ids through the model's own forward (transformers
models), posdiag's 4D mask for `module:factory` models; and the model's defaults (no position_ids)."""

from __future__ import annotations

from typing import Any

import torch

from posdiag.model.probe import Row, run_rows
from posdiag.model.subject import Subject
from posdiag.model.tensors import token_states

DEFAULTS = "no position_ids (the model's defaults)"
LEFT_DEFAULTS = f"a left-padded, {DEFAULTS}"


def default_path(subject: Subject, a: torch.Tensor, pads: int, pad: int,
                  stack: str) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Row a padded on either side with a 2D mask and no position_ids (left-padded scoring, nnsight #672,
    transformers #3021), against row a alone without position_ids: the path users take without ids."""
    dev, n = subject.device, a.numel()
    fill = torch.full((pads,), pad, dtype=a.dtype, device=dev)
    ones, zeros = torch.ones(n, dtype=torch.long, device=dev), torch.zeros(pads, dtype=torch.long, device=dev)
    ids = torch.stack([torch.cat([a, fill]), torch.cat([fill, a])])
    mask = torch.stack([torch.cat([ones, zeros]), torch.cat([zeros, ones])])
    out = forward(subject, ids, mask, None, stack, None)
    alone = forward(subject, a[None], ones[None], None, stack, None)[0]
    return [(f"a right-padded, {DEFAULTS}", out[0, :n], alone), (LEFT_DEFAULTS, out[1, pads:], alone)]


def forward(subject: Subject, ids: torch.Tensor, mask2d: torch.Tensor, positions: torch.Tensor | None,
             stack: str, encoder_ids: torch.Tensor | None) -> torch.Tensor:
    """Final hidden states [B, T, D] of the rows, on the path a user takes (one forward per chunk)."""
    if not subject.is_hf:
        rows = [Row(ids[i], positions=None if positions is None else positions[i], valid=mask2d[i].bool())
                for i in range(ids.shape[0])]
        return run_rows(subject, rows, stack=stack).final
    step = subject.options.max_batch or ids.shape[0]
    parts = []
    for start in range(0, ids.shape[0], step):
        sl = slice(start, start + step)
        parts.append(_forward_hf(subject, ids[sl], mask2d[sl], None if positions is None else positions[sl],
                                 stack, encoder_ids))
    return torch.cat(parts)


def _forward_hf(subject: Subject, ids: torch.Tensor, mask2d: torch.Tensor, positions: torch.Tensor | None,
                stack: str, encoder_ids: torch.Tensor | None) -> torch.Tensor:
    subject.forward_count += 1
    model = subject.model
    ids, mask2d = ids.to(subject.device), mask2d.to(subject.device)
    with torch.inference_mode():
        if subject.kind == "seq2seq":
            if stack == "encoder":
                out = model.get_encoder()(input_ids=ids, attention_mask=mask2d, output_hidden_states=True,
                                          return_dict=True)
                return token_states(out.hidden_states or (out.last_hidden_state,), ids.shape)[-1]
            enc = encoder_ids[None].expand(ids.shape[0], -1).to(subject.device)
            out = model(input_ids=enc, attention_mask=torch.ones_like(enc), decoder_input_ids=ids,
                        decoder_attention_mask=mask2d, output_hidden_states=True, use_cache=False, return_dict=True)
            return token_states(out.decoder_hidden_states[-1:], ids.shape)[-1]
        kwargs: dict[str, Any] = {}
        if positions is not None:
            kwargs["position_ids"] = subject.position_ids_for(positions.to(subject.device))
        if subject.kind != "encoder":
            kwargs["use_cache"] = False
        if subject.takes_logits_to_keep:  # only hidden states are compared: no [B, T, vocab] logits
            kwargs["logits_to_keep"] = 1
        out = model(input_ids=ids, attention_mask=mask2d, output_hidden_states=True, return_dict=True, **kwargs)
        hidden = out.hidden_states if out.hidden_states is not None else (out.last_hidden_state,)
        return token_states(hidden[-1:], ids.shape)[-1]
