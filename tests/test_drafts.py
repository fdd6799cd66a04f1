"""The rollback count behind assisted decoding's premise (posdiag.model.drafts): only a cache cut back counts, never
a new call's prefill, even when the new call's cache takes the id of one freed before it."""

from __future__ import annotations

import gc

import torch

from posdiag.model.drafts import disagreeing_draft
from posdiag.testing import zoo


def _generate(model, **extra):
    ids = torch.arange(3, 15)[None]
    with torch.inference_mode():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4,
                              do_sample=False, pad_token_id=0, **extra)


def test_plain_calls_after_one_another_roll_nothing_back():
    """Each call a prefill into a cache of its own, freed before the next (CPython hands a freed object's id to the
    next one made: measured, 5 ids for 6 caches): a prefill read against the last length of a dead cache with the same
    id was counted as a rollback, and would confirm a premise no draft was ever rejected for."""
    from posdiag.model.caches import cache_keyword, new_cache
    from posdiag.model.loading import from_module

    model = zoo.tiny_model("llama")
    subject, ids = from_module(model), torch.arange(3, 15)[None]
    with disagreeing_draft(model, 2) as (_, counted), torch.inference_mode():
        for _ in range(12):
            model(ids, **{cache_keyword(model): new_cache(subject, "dynamic", max_len=16)}, use_cache=True)
            gc.collect()
        _generate(model)
    assert counted.calls >= 12 and counted.crops == counted.rejected == 0, counted


def test_a_draft_that_disagrees_is_rolled_back_and_counted():
    model = zoo.tiny_model("llama")
    with disagreeing_draft(model, 2) as (draft, counted):
        _generate(model, assistant_model=draft)
    assert counted.crops > 0 and counted.rejected > 0, counted
