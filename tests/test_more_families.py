"""Families outside the zoo that posdiag got wrong: BioGPT's table offset (a false FAIL), a table
probed on a family with no row (offset discovered, not assumed), mT5 with more decoder than
encoder layers (cache/generate crashed), and configs whose special ids lie outside a small
vocabulary (generate crashed). Each healthy model passes; each planted twin fails."""

from __future__ import annotations

import warnings
from dataclasses import replace

import plants_table as P
import pytest
import torch

from posdiag.api import run_checks
from posdiag.model.families import GENERIC
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing import zoo

SHORT = RunOptions(seq_len=16)


def _build(model_type: str, head: str = "causal", **extra):
    warnings.filterwarnings("ignore")
    return zoo.tiny_model_of_type(model_type, head=head, attn_implementation="eager",
                                  **{"max_position_embeddings": 128, **extra})


def _check(model, name: str, generic: bool = False, options: RunOptions | None = None):
    subject = from_module(model)
    if generic:  # as if posdiag had no row for the family: offsets must be discovered
        subject.family = replace(GENERIC, name=subject.family.name, kind=subject.kind)
    return run_checks(subject, [name], options).checks[0]


def _parts(result, name):
    return result.details["parts"].get(name, [])


@pytest.mark.parametrize("generic", [False, True], ids=["biogpt-row", "no-row"])
def test_biogpt_table_passes_with_offset_two(generic):
    result = _check(_build("biogpt"), "table", generic=generic)
    assert result.status is Status.PASS, result.summary
    if generic:
        assert any("position 0 reads row 2" in p["message"] for p in _parts(result, "offsets"))
        assert result.metrics["discovered_offset"] == 2


@pytest.mark.parametrize("generic", [False, True], ids=["biogpt-row", "no-row"])
def test_biogpt_table_clamped_fails(generic):
    model = P.clamp_rows(_build("biogpt"), 40, first_row=2)
    result = _check(model, "table", generic=generic)
    assert result.status is Status.FAIL, result.summary
    assert any(p["status"] == "fail" and "clamp" in p["message"] for p in _parts(result, "capacity"))


def test_biogpt_zeroed_table_fails_table_and_shuffle():
    model = P.zero_table(_build("biogpt"))
    assert _check(model, "table", generic=True).status is Status.FAIL
    assert _check(model, "shuffle", options=SHORT).status is Status.FAIL


def test_table_read_by_no_position_fails_whatever_the_offset():
    """A module that never reads its table: no offset explains it."""
    model = _build("biogpt")
    model.biogpt.embed_positions.forward = lambda mask, cache_length=0, position_ids=None: torch.zeros(
        *mask.shape, model.config.hidden_size)
    result = _check(model, "table", generic=True)
    assert result.status is Status.FAIL
    assert any("does not read this table" in p["message"] for p in _parts(result, "offsets"))


def test_known_family_still_judged_against_its_offset():
    """An OPT-style module reading the wrong row keeps failing: discovery is only for unknown families."""
    model = P.opt_wrong_internal_offset(_build("biogpt"), offset=1)
    result = _check(model, "table")
    assert result.status is Status.FAIL
    assert any("offset is 1" in p["message"] for p in _parts(result, "offsets"))


def test_xlm_roberta_gets_the_roberta_offset():
    subject = from_module(_build("xlm-roberta", head="base", max_position_embeddings=66))
    assert subject.family.position_offset == 2 and subject.family.explicit_position_offset == 2
    assert run_checks(subject, ["table"]).checks[0].status is Status.PASS


@pytest.fixture(scope="module")
def mt5_asymmetric():
    """num_layers (num_hidden_layers) 1 but num_decoder_layers 3: a cache sized from the config is too short."""
    return _build("mt5", head="seq2seq", num_hidden_layers=1, num_decoder_layers=3)


@pytest.mark.parametrize("name", ["cache", "generate"])
def test_mt5_more_decoder_layers_runs(mt5_asymmetric, name):
    result = _check(mt5_asymmetric, name, options=SHORT)
    assert result.status is Status.PASS, result.summary
    assert "decoder's 3 layers" in result.summary


@pytest.mark.parametrize("model_type", ["gpt_bigcode", "starcoder2"])
def test_generate_pads_inside_the_vocabulary(model_type):
    model = _build(model_type, max_position_embeddings=64)
    assert model.config.eos_token_id >= model.config.vocab_size  # the config's ids are the full vocabulary's
    result = _check(model, "generate", options=SHORT)
    assert result.status is Status.PASS, result.summary
    assert "padding with id" in result.details["pad_note"]
