"""Greedy generate() as posdiag calls it, and the model as its own assistant: one request, logits of every step.

`state` and `serving` both judge generate()'s paths (assisted and prompt-lookup decoding, chunked prefill) against
other computations; the request they send, what counts as transformers refusing it, and the assistant's draft count
set for one call are the same for both, so they live here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from posdiag.errors import describe_error, raised_in_generation
from posdiag.model.quiet import transformers_quiet
from posdiag.model.subject import Subject


class Refused(Exception):
    """transformers' generation code refused a generate() request (an option or mode it does not support for this
    model)."""


def greedy(subject: Subject, ids: torch.Tensor, new_tokens: int, pad: int | None, exact: bool = False,
           **extra: Any) -> Any:
    """generate() of `ids` (one unpadded request), greedy, returning the logits of every step; `exact`: exactly
    `new_tokens` steps (no end token stops it early). An exception of transformers' generation code is a Refused."""
    kwargs = dict(do_sample=False, num_beams=1, max_new_tokens=new_tokens, output_logits=True,
                  return_dict_in_generate=True, pad_token_id=pad, eos_token_id=None, forced_eos_token_id=None,
                  forced_bos_token_id=None, attention_mask=torch.ones_like(ids))
    if exact:
        kwargs["min_new_tokens"] = new_tokens
    try:
        with torch.inference_mode(), transformers_quiet():
            out = subject.model.generate(ids, **kwargs, **extra)
    except Exception as exc:
        if raised_in_generation(exc):
            raise Refused(describe_error(exc)) from exc
        raise
    subject.forward_count += len(out.logits)
    return out


@contextlib.contextmanager
def own_drafts(model: Any, candidates: int) -> Iterator[None]:
    """The model's generation config set to draft `candidates` tokens a step as its own assistant (transformers'
    default schedule grows the drafts until one step drafts every token), put back after."""
    config = model.generation_config
    saved = (config.num_assistant_tokens, config.num_assistant_tokens_schedule)
    config.num_assistant_tokens, config.num_assistant_tokens_schedule = candidates, "constant"
    try:
        yield
    finally:
        config.num_assistant_tokens, config.num_assistant_tokens_schedule = saved
