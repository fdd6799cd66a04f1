"""Greedy generate() as posdiag calls it: one request, the logits of every step.

`state` and `serving` both judge generate()'s paths (assisted and prompt-lookup decoding, chunked prefill) against
other computations; the request they send and what counts as transformers refusing it are the same for both, so they
live here (the draft assisted decoding verifies: posdiag.model.drafts).
"""

from __future__ import annotations

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
