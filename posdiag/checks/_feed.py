"""Feeding the `cache` check's probe to the model: token ranges with a cache or without, as generate() feeds them,
each reduced to the final hidden state of the tokens fed as it comes out (no [tokens, vocab] logits kept)."""

from __future__ import annotations

from typing import Any

import torch

from posdiag.model.caches import cache_keyword, new_cache
from posdiag.model.outputs import final_state, output_of
from posdiag.model.subject import Subject


class Feed:
    """Feeds token ranges of the probe to the model, with a cache or without, as generate() feeds them, and returns
    the final hidden state of the tokens fed ([n, ...]). Where the model takes logits_to_keep the LM head computes no
    row at all (an empty index: its forward still runs; one row where it refuses none): a single-token step of a
    262k-vocabulary model read its whole head for one row it never compared (~0.1 s of a 0.14 s step, Gemma-3-270M
    shape). Logits where no hidden state per token comes back."""

    def __init__(self, subject: Subject, ids: torch.Tensor):
        self.subject, self.ids, self.seq2seq = subject, ids, subject.kind == "seq2seq"
        self.encoder_outputs = None
        if self.seq2seq:  # the decoder is what caches; one fixed encoder input (the same ids)
            with torch.inference_mode():
                self.encoder_outputs = subject.model.get_encoder()(input_ids=ids, return_dict=True)
            subject.forward_count += 1
        self.whole = not self.seq2seq and feeds_whole_sequence(subject.model)
        no_rows = torch.zeros(0, dtype=torch.long, device=ids.device)
        self.extra = {"logits_to_keep": no_rows} if subject.takes_logits_to_keep else {}
        self.hidden: bool | None = None  # compared by the final hidden state (else by the logits)
        self.keyword = cache_keyword(subject.model)  # `cache`, or `past_key_values` before transformers 5.24

    def cache(self, kind: str, room: int = 0) -> Any:
        """A fresh cache; a static one holds the probe and `room` more tokens. The decode paths leave room, as the
        cache generate() builds is sized for tokens still to come (GPT-Neo's position buffer is cut by the cache
        length: one longer than the buffer crashes with every position in range); the chunked paths' holds exactly
        the probe, so their last step writes its last slot."""
        length = self.ids.shape[1]
        return new_cache(self.subject, kind, max_len=length + room, encoder_len=length if self.seq2seq else 0)

    def __call__(self, start: int, end: int, cache: Any = None, with_ids: bool = False, slip: int = 0) -> torch.Tensor:
        """The final state of tokens start..end-1 fed in one forward; `with_ids`: position_ids passed, numbered `slip`
        positions early (posdiag's own one-position slip: the power of a comparison)."""
        subject, ids = self.subject, self.ids
        subject.forward_count += 1
        first = 0 if self.whole and cache is not None else start  # CPM-Ant slices the cached prefix off itself
        kwargs: dict[str, Any] = {self.keyword: cache, "use_cache": cache is not None, "return_dict": True,
                                  "output_hidden_states": True, **self.extra}
        if with_ids:
            positions = torch.arange(start - slip, end - slip, device=ids.device)[None]
            kwargs["position_ids"] = subject.position_ids_for(positions)
        try:
            out = self._forward(ids[:, first:end] if not self.seq2seq else ids[:, start:end], kwargs)
        except Exception:
            if self.hidden is not None or not torch.is_tensor(self.extra.get("logits_to_keep")):
                raise
            self.extra = {"logits_to_keep": 1}  # the first (cache-free) forward refused an empty head: one row
            return self(start, end, cache, with_ids, slip)
        state = final_state(out, end - start)
        if self.hidden is None:  # the first forward (the full one) settles what every later one is compared by
            self.hidden = state is not None
            if not self.hidden and self.extra:  # no state per token: logits, then at every position
                self.extra = {}
                return self(start, end, cache, with_ids, slip)
        if self.hidden and state is None:
            raise StateMissing(f"{type(subject.model).__name__} returned no final hidden state for a cached step "
                               "although its full forward did: posdiag cannot compare the two")
        return state[0] if self.hidden else output_of(out)[0][-(end - start):]

    def _forward(self, tokens: torch.Tensor, kwargs: dict[str, Any]) -> Any:
        with torch.inference_mode():
            if self.seq2seq:
                return self.subject.model(encoder_outputs=self.encoder_outputs, decoder_input_ids=tokens, **kwargs)
            return self.subject.model(input_ids=tokens, **kwargs)


class StateMissing(Exception):
    """posdiag's own failure to compare (not the model's answer): raised, reported as an internal error."""


def feeds_whole_sequence(model: torch.nn.Module) -> bool:
    """Whether generate() hands this model the whole sequence at every cached step (its prepare_inputs_for_generation
    keeps every id: CPM-Ant's forward slices the cached prefix off itself, and fed the new tokens alone it raises)."""
    try:
        step = model.prepare_inputs_for_generation(torch.tensor([[4, 5, 6]]), next_sequence_length=1)
        return step["input_ids"].shape[1] > 1
    except Exception:  # a signature of its own: steps are fed as generate() feeds most models
        return False


def prefill_layers(cache: Any) -> list[Any]:
    """Cache layers that keep the tokens of the first forward (the prefill) apart from those continued after it:
    reference sliding-window attention (transformers' ``reference_sliding_attention`` layers) lets every later token
    see all prefill tokens and only the last ``sliding_window`` of the rest, while a forward without a cache treats
    every token as prefill. A continuation is compared with the full forward with the same prefill declared
    (``set_prefill_length``, as generate() declares it); against the plain forward, chunks past the window differed
    by design (Unlimited-OCR: 0.06, the same in float64; 1.6e-7 with the prefill declared)."""
    cache = getattr(cache, "self_attention_cache", cache)
    return [layer for layer in getattr(cache, "layers", ()) if callable(getattr(layer, "set_prefill_length", None))]
