"""The calls a serving stack (or a user's own loop) makes, as `serving` makes them: a forward with or without a cache,
a greedy decode loop written by hand, generate() with its serving options. Every output comes back as the float64
final hidden state at the positions fed (what the logits are computed from; the logits where the model returns no
hidden state), so a path and its reference compare position by position; every call is counted in
subject.forward_count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from posdiag.model.caches import cache_keyword, new_cache
from posdiag.model.drafts import Rollbacks, disagreeing_draft
from posdiag.model.greedy import greedy
from posdiag.model.outputs import final_state, output_of
from posdiag.model.subject import Subject


class ShortOutput(Exception):
    """A forward returned fewer positions than it was fed (CPM-Ant continuing a cache returns none): the path has no
    output at positions users asked for, a FAIL of the path as a crash is."""


@dataclass
class Output:
    """A forward's final hidden state at every position fed ([B, n, D], float64: it determines the logits and spares
    a [n, vocab] head output; the logits where the model gives no hidden state) and the logits of its last `keep`
    positions ([B, keep, V]: the next token)."""

    states: torch.Tensor
    logits: torch.Tensor


@dataclass
class Decoded:
    """A decode loop's run: every id fed (prompt and the tokens it chose), the 2D mask that went with them, and the
    final hidden state at every position fed ([B, T, D], float64)."""

    ids: torch.Tensor
    mask: torch.Tensor
    outputs: torch.Tensor


def cumsum_positions(mask: torch.Tensor) -> torch.Tensor:
    """Logical positions of a left-padded batch as generate() numbers them: each row counts its real tokens from 0
    (padding gets 0; it is masked)."""
    return (mask.long().cumsum(-1) - 1).clamp_min(0)


class Calls:
    """The model's calls, counted. `pad`: the id padding is written with (the config's, else 0)."""

    def __init__(self, subject: Subject):
        self.subject = subject
        pad = getattr(subject.config, "pad_token_id", None)
        self.pad = pad if isinstance(pad, int) and 0 <= pad < subject.vocab_size else 0
        self.keyword = cache_keyword(subject.model)
        self.hidden: bool | None = None  # compared by the final hidden state (else by the logits), once known

    def cache(self, room: int = 0) -> Any:
        """The cache generate() builds by default (DynamicCache from the config)."""
        return new_cache(self.subject, "dynamic", max_len=room)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                cache: Any = None, keep: int = 1) -> Output:
        """One forward of `ids` ([B, n]); `mask` the 2D mask of every token so far (cache included), `positions` the
        logical positions of the ids fed (None: the model's defaults); the LM head computes the last `keep` rows."""
        kwargs: dict[str, Any] = {"use_cache": cache is not None, "return_dict": True, "output_hidden_states": True}
        if cache is not None:
            kwargs[self.keyword] = cache
        if mask is not None:
            kwargs["attention_mask"] = mask
        if positions is not None:
            kwargs["position_ids"] = self.subject.position_ids_for(positions)
        if self.hidden is not False and self.subject.takes_logits_to_keep:
            kwargs["logits_to_keep"] = keep
        self.subject.forward_count += 1
        with torch.inference_mode():
            out = self.subject.model(input_ids=ids, **kwargs)
        n, state = ids.shape[1], final_state(out, ids.shape[1])
        if self.hidden is None:  # the first call (a full forward, no cache) settles what every call is compared by
            self.hidden = state is not None
            if not self.hidden and "logits_to_keep" in kwargs:
                return self.forward(ids, mask, positions, cache, keep)
        logits = output_of(out)
        if (self.hidden and state is None) or logits.shape[1] < min(n, keep):
            hidden = getattr(out, "hidden_states", None)
            width = hidden[-1].shape[1] if hidden and isinstance(hidden[-1], torch.Tensor) else logits.shape[1]
            raise ShortOutput(f"a forward of {n} token{'s' if n != 1 else ''} "
                              f"{'continuing a cache ' if cache is not None else ''}returned {width} position"
                              f"{'s' if width != 1 else ''}")
        states = state if self.hidden else logits[:, -n:]
        return Output(states.to(torch.float64), logits[:, -keep:].to(torch.float64))

    def full(self, ids: torch.Tensor, mask: torch.Tensor | None = None, with_ids: bool = False,
             keep: int = 1) -> Output:
        """The reference: one full forward, no cache, the positions passed as the path passed them."""
        positions = cumsum_positions(mask) if with_ids and mask is not None else (
            torch.arange(ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1) if with_ids else None)
        return self.forward(ids, mask, positions, keep=keep)

    def chunked(self, ids: torch.Tensor, size: int, cache: Any = None, start: int = 0) -> torch.Tensor:
        """`ids` fed `size` tokens a forward into `cache` (a fresh one by default), the model's default positions,
        as a server's chunked prefill feeds them. -> the output at every position fed."""
        cache = self.cache() if cache is None else cache
        parts = [self.forward(ids[:, t:t + size], cache=cache).states for t in range(start, ids.shape[1], size)]
        return torch.cat(parts, 1)

    def decode(self, ids: torch.Tensor, mask: torch.Tensor | None, steps: int, with_ids: bool) -> Decoded:
        """The greedy loop users write: a prefill, then `steps` forwards of the argmax token with the cache, the mask
        extended by one each step; `with_ids`: position_ids passed (the mask's count, as generate() passes them),
        else the model's defaults."""
        mask = torch.ones_like(ids) if mask is None else mask
        cache = self.cache()
        positions = cumsum_positions(mask) if with_ids else None
        outputs = [self.forward(ids, mask, positions, cache)]
        fed, full_mask = ids, mask
        for _ in range(steps):
            token = outputs[-1].logits[:, -1].argmax(-1, keepdim=True)
            full_mask = torch.cat([full_mask, torch.ones_like(token)], 1)
            step_positions = cumsum_positions(full_mask)[:, -1:] if with_ids else None
            outputs.append(self.forward(token, full_mask, step_positions, cache))
            fed = torch.cat([fed, token], 1)
        return Decoded(fed, full_mask, torch.cat([o.states for o in outputs], 1))

    def padded(self, rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of their own lengths, left-padded (as for generation) with the padding id, and their 2D mask."""
        width = max(r.shape[0] for r in rows)
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long, device=rows[0].device)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, width - r.shape[0]:], mask[i, width - r.shape[0]:] = r, 1
        return ids, mask

    def generate(self, ids: torch.Tensor, new_tokens: int, **extra: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy generate() of one prompt with `extra` options -> (every id: prompt and generated, the logits of each
        generated step [1, steps, V] float64). A ValueError of transformers' generation code is a refusal."""
        out = greedy(self.subject, ids, new_tokens, self.pad, exact=True, **extra)
        return out.sequences, torch.stack(out.logits, 1).to(torch.float64)

    def assisted(self, ids: torch.Tensor, new_tokens: int,
                 candidates: int) -> tuple[torch.Tensor, torch.Tensor, Rollbacks]:
        """generate() assisted by a draft that disagrees (the model proposing its runner-up at every odd position,
        `candidates` drafts a step: posdiag.model.drafts), so verification rejects drafts and rolls the cache back ->
        (every id, the logits of each step, the rollbacks counted on the model's calls)."""
        with disagreeing_draft(self.subject.model, candidates) as (draft, rollbacks):
            seq, logits = self.generate(ids, new_tokens, assistant_model=draft)
        return seq, logits, rollbacks

    def continued(self, ids: torch.Tensor, cache: Any, steps: int) -> Decoded:
        """`ids` fed into a cache that already holds a prefix, then `steps` greedy tokens, the model's default
        positions and no mask (one unpadded request, as a server continues a cached prefix)."""
        outputs = [self.forward(ids, cache=cache)]
        fed = ids
        for _ in range(steps):
            token = outputs[-1].logits[:, -1].argmax(-1, keepdim=True)
            outputs.append(self.forward(token, cache=cache))
            fed = torch.cat([fed, token], 1)
        return Decoded(fed, torch.ones_like(fed), torch.cat([o.states for o in outputs], 1))
