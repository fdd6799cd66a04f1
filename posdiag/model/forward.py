"""How a Subject's forward runs: in chunks of rows that fall back to smaller ones on running out of memory, one
chunk through the family's own call (encoder, decoder, or a factory model's forward protocol), and the outputs
gathered as hidden states (embeddings first) and logits.

The Subject (posdiag.model.subject) decides what to run; this module only runs it. Its functions take the subject
and read the fields a forward needs (model, kind, device, options, batch_limit, notes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from posdiag.errors import PosdiagError
from posdiag.model.tensors import token_states


@dataclass
class Outputs:
    """hidden: embeddings output then each block's output, each [B, T, D]; logits may be None."""

    hidden: list[torch.Tensor]
    logits: torch.Tensor | None = None

    @property
    def final(self) -> torch.Tensor:
        return self.hidden[-1]


def in_chunks(subject: Any, once: Callable[..., Outputs], input_ids: torch.Tensor, *, mask: Any,
              position_ids: torch.Tensor | None, stack: str, encoder_ids: torch.Tensor | None,
              want_logits: bool) -> Outputs:
    """ONCE on chunks of at most `max_batch` rows, halved after an out-of-memory error (and remembered in
    subject.batch_limit for later checks, with a note); the chunks' outputs joined."""
    rows = input_ids.shape[0]
    step = min(subject.options.max_batch or rows, subject.batch_limit or rows)
    parts = []
    start = 0
    while start < rows:
        sl = slice(start, start + step)
        try:
            parts.append(once(
                input_ids[sl],
                mask=_slice_mask(mask, sl),
                position_ids=None if position_ids is None else position_ids[sl],
                stack=stack,
                encoder_ids=None if encoder_ids is None else encoder_ids[sl],
                want_logits=want_logits,
            ))
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if step == 1 or not _is_oom(exc):
                raise
            step = max(1, step // 2)  # fall back to smaller batches, and remember it for later checks
            subject.batch_limit = step
            note = f"out of memory: forward passes fall back to batches of {step}"
            if note not in subject.notes:
                subject.notes.append(note)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            continue
        start += step
    if len(parts) == 1:
        return parts[0]
    hidden = [torch.cat([p.hidden[i] for p in parts]) for i in range(len(parts[0].hidden))]
    logits = None if parts[0].logits is None else torch.cat([p.logits for p in parts])
    return Outputs(hidden, logits)


def takes_logits_to_keep(model: torch.nn.Module) -> bool:
    import inspect

    return "logits_to_keep" in inspect.signature(model.forward).parameters


def forward_once(subject: Any, input_ids: torch.Tensor, *, mask: Any, position_ids: torch.Tensor | None,
                 stack: str, encoder_ids: torch.Tensor | None, want_logits: bool) -> Outputs:
    """One chunk through the model, counted in subject.forward_count."""
    subject.forward_count += 1
    kwargs: dict[str, Any] = {}
    if position_ids is not None:
        kwargs["position_ids"] = position_ids.to(subject.device)
    with torch.inference_mode():
        if not subject.is_hf:
            out = subject.model(input_ids=input_ids, attention_mask=mask, **kwargs)
            return _outputs_from_custom(out)
        # Without logits, ask for the last position's only: the LM head's [B, T, vocab] output
        # is often the largest activation of a batched probe (147 MB for 9 x 128 tokens of a
        # 32k vocab). The full model still runs (a bug can live in the head class's forward).

        if not want_logits and subject.takes_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        if subject.kind == "seq2seq":
            if stack == "encoder":
                out = subject.model.get_encoder()(input_ids=input_ids, attention_mask=mask,
                                                  output_hidden_states=True, return_dict=True)
                return _gathered(subject, out.hidden_states or (out.last_hidden_state,), None, input_ids.shape)
            enc = input_ids if encoder_ids is None else encoder_ids
            out = subject.model(input_ids=enc, decoder_input_ids=input_ids, decoder_attention_mask=mask,
                                output_hidden_states=True, use_cache=False, return_dict=True,
                                **{k: v for k, v in kwargs.items() if k == "logits_to_keep"})
            logits = getattr(out, "logits", None) if want_logits else None
            return _gathered(subject, out.decoder_hidden_states, logits, input_ids.shape)
        out = subject.model(input_ids=input_ids, attention_mask=mask, output_hidden_states=True,
                            use_cache=False, return_dict=True, **kwargs)
        hidden = out.hidden_states if out.hidden_states is not None else (out.last_hidden_state,)
        return _gathered(subject, hidden, getattr(out, "logits", None) if want_logits else None, input_ids.shape)


def _gathered(subject: Any, hidden: Any, logits: torch.Tensor | None, length: tuple[int, ...]) -> Outputs:
    """The tokens' states (`token_states`) on the input device (a --device-map returns blocks on their GPUs)."""
    on_device = None if logits is None else logits.to(subject.device)
    return Outputs([h.to(subject.device) for h in token_states(hidden, length)], on_device)


def _is_oom(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text or "not enough memory" in text


def _slice_mask(mask: Any, sl: slice) -> Any:
    if mask is None:
        return None
    if isinstance(mask, dict):
        return {k: v[sl] for k, v in mask.items()}
    return mask[sl]


def _outputs_from_custom(out: Any) -> Outputs:
    if isinstance(out, torch.Tensor):
        return Outputs([out])
    hidden = getattr(out, "hidden_states", None)
    if hidden:
        return Outputs(list(hidden), getattr(out, "logits", None))
    for attr in ("last_hidden_state", "logits"):
        value = getattr(out, attr, None)
        if value is not None:
            return Outputs([value], getattr(out, "logits", None))
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return Outputs([out[0]])
    raise PosdiagError("the factory model returned neither a tensor nor hidden_states/last_hidden_state/logits")
