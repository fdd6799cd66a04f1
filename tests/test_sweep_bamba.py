"""Bamba's cached forward without position_ids: an upstream finding pinned next to its healthy twin."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from sweep_support import SMALL_MAMBA2, pinned

from posdiag.api import run_checks
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing.multimodal import small_model


@pytest.fixture(autouse=True)
def _quiet():
    warnings.filterwarnings("ignore")
    transformers.utils.logging.set_verbosity_error()


def _numbered_from_the_cache(forward):
    """BambaModel.forward with the missing offset: default positions continue from the cached length."""
    def patched(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                **kwargs):
        if position_ids is None:
            new = (input_ids if input_ids is not None else inputs_embeds).shape[1]
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(past, past + new).unsqueeze(0)
        return forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       cache=cache, inputs_embeds=inputs_embeds, **kwargs)
    return patched


@pytest.mark.parametrize("offset_fixed", [False, True])
def test_bamba_cached_forward_without_ids_restarts_positions_at_zero(offset_fixed, monkeypatch):
    """BambaModel.forward numbers positions `arange(new tokens)` whatever the cache holds, so a cached step without
    position_ids is rotated as position 0 (1.7e-3 off the full forward, the same in float64); every path that passes
    explicit ids agrees. The twin whose default positions continue from the cache length passes every path."""
    from transformers.models.bamba import modeling_bamba

    if offset_fixed:
        monkeypatch.setattr(modeling_bamba.BambaModel, "forward",
                            _numbered_from_the_cache(modeling_bamba.BambaModel.forward))
    subject = from_module(small_model("bamba", **SMALL_MAMBA2), name="bamba")
    options = RunOptions(seq_len=8, check_options={"cache": {"decode_steps": 2}})
    result = run_checks(subject, ["cache"], options).check("cache")
    if offset_fixed:
        assert result.status is Status.PASS, result.summary
        return
    if not pinned(result, "bamba", "cache"):  # the findings table, keyed by transformers' version
        return
    paths = result.details["paths"]
    failing = {name for name, path in paths.items() if path["status"] == "fail"}
    assert failing and all("position_ids" not in name for name in failing), failing
    assert all(path["status"] == "pass" for name, path in paths.items() if "position_ids" in name), paths
