"""Llama 4: the masks posdiag builds carry its chunked local attention (layer_types "chunked_attention"), so the
headline checks run on it, and its attention temperature tuning (absolute by design) is named by `shift`, never a
FAIL, while a real relative-position bug still FAILs there.

The tiny Llama 4 (zoo.tiny_llama4): layer 0 RoPE attending within chunks of 8, layer 1 NoPE attending the whole
past; probes of 64 tokens cross every chunk boundary. Controls: Llama (one 4D mask) and Qwen2 (a dict by layer type).
"""

from __future__ import annotations

import pytest
import torch
from plants_shift import keys_never_rotated, temperature_by_position_ids
from transformers.masking_utils import chunked_overlay

from posdiag.api import run_checks
from posdiag.model import families
from posdiag.model.families import family_for
from posdiag.model.loading import from_module
from posdiag.results import Status
from posdiag.testing import zoo

HEADLINE = ["shuffle", "positions", "shift"]
DTYPES = [torch.float32, torch.bfloat16]


def _run(model, checks, dtype=torch.float32):
    report = run_checks(from_module(model.to(dtype)), checks)
    return {name: report.check(name) for name in checks}


def _healthy(family: str):
    return zoo.tiny_llama4() if family == "llama4" else zoo.tiny_model(family)


def test_chunked_pattern_is_transformers_own_and_permutes_with_the_tokens():
    subject = from_module(zoo.tiny_llama4())
    t, chunk = 30, zoo.LLAMA4_CHUNK
    valid = torch.ones(2, t, dtype=torch.bool)
    valid[1, :5] = False  # row 1 left-padded by 5: transformers counts its chunks from the first token
    order = torch.arange(t).expand(2, t)
    got = subject.patterns(order, valid)["chunked"]
    overlay = chunked_overlay(chunk, torch.tensor([0, 5]))
    q, k = torch.arange(t)[:, None], torch.arange(t)[None, :]
    for b in range(2):
        expected = overlay(b, 0, q, k) & (k <= q) & valid[b][None, :]
        rows = valid[b]  # padded queries keep only their own key (excluded from every comparison)
        assert torch.equal(got[b][rows], expected[rows])
    perm = torch.randperm(t, generator=torch.Generator().manual_seed(0))
    permuted = subject.patterns(perm[None])["chunked"][0]
    plain = subject.patterns(torch.arange(t)[None])["chunked"][0]
    assert torch.equal(permuted, plain[perm][:, perm])


def test_mask_argument_is_a_dict_by_layer_type():
    subject = from_module(zoo.tiny_llama4())
    patterns = subject.patterns(torch.arange(20)[None])
    mask = subject.mask_argument(patterns)
    assert set(mask) == {"chunked_attention", "full_attention"}
    assert not torch.equal(mask["chunked_attention"], mask["full_attention"])


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["llama4", "qwen2"])
def test_headline_checks_run_and_pass_on_the_healthy_model(family, dtype):
    results = _run(_healthy(family), HEADLINE, dtype)
    for name, result in results.items():
        assert result.status is Status.PASS, f"{name}: {result.summary}"
    assert results["shuffle"].metrics["ratio"] >= 100
    assert dtype is torch.float32 or "bfloat16" in results["shuffle"].summary  # judged as stored, saying so


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["llama4", "qwen2"])
def test_positions_removed_fail_the_headline_checks(family, dtype):
    model = _healthy(family)
    zoo.remove_positions(model, "llama" if family == "llama4" else family)  # Llama 4's inv_freq zeroed: no rotation
    results = _run(model, HEADLINE, dtype)
    for name, result in results.items():
        assert result.status is Status.FAIL, f"{name}: {result.summary}"


def test_a_model_whose_every_layer_is_chunked_is_judged():
    # No global layer: the mask-fidelity block reaches into the chunk of the first query after it, and shift's
    # one-position gap sits inside a chunk (on a boundary it changes no offset any query sees).
    healthy = _run(zoo.tiny_llama4(no_rope_layers=[1, 1]), HEADLINE)
    for name, result in healthy.items():
        assert result.status is Status.PASS, f"{name}: {result.summary}"
    broken = zoo.tiny_llama4(no_rope_layers=[1, 1])
    zoo.remove_positions(broken, "llama")
    for name, result in _run(broken, HEADLINE).items():
        assert result.status is Status.FAIL, f"{name}: {result.summary}"


def test_temperature_tuning_is_named_in_the_row():
    term = family_for(zoo.tiny_llama4(floor_scale=16).config).absolute_by_design
    assert "temperature tuning" in term and "(1)" in term and "/ 16" in term
    assert family_for(zoo.tiny_llama4(attn_temperature_tuning=False).config).absolute_by_design == ""
    assert family_for(zoo.tiny_llama4(no_rope_layers=[1, 1]).config).absolute_by_design == ""  # no NoPE layer


def _positions_move_the_temperature(model) -> float:
    """Outputs under position_ids + 64 against plain ones, directly: the term itself, not posdiag's reading of it."""
    ids = torch.randint(10, 200, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(ids).logits
        shifted = model(ids, position_ids=torch.arange(24)[None] + 64).logits
    return float((shifted - plain).norm() / plain.norm())


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_shift_names_the_temperature_term_and_passes(dtype):
    # The term read from the position ids (vLLM's numbering): a healthy model that a shift moves, by design.
    model = temperature_by_position_ids(zoo.tiny_llama4(floor_scale=16))
    assert _positions_move_the_temperature(model) > 1e-6
    result = _run(model, ["shift"], dtype)["shift"]
    assert result.status is Status.PASS, result.summary
    assert "llama4 attention temperature tuning" in result.summary and "absolute by design" in result.summary
    assert result.details["absolute_held"].startswith("held at 1")
    assert model.model.layers[1].self_attn.attn_scale == 0.1  # given back as it was


def test_without_a_hold_the_term_is_named_never_failed(monkeypatch):
    monkeypatch.setattr(families, "temperature_tuning", lambda model: ("", lambda: None))
    result = _run(temperature_by_position_ids(zoo.tiny_llama4(floor_scale=16)), ["shift"])["shift"]
    assert result.status is Status.NA, result.summary
    assert "relative invariance does not apply: llama4 attention temperature tuning" in result.summary


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["llama4", "llama"])
def test_keys_never_rotated_still_fails_shift(family, dtype):
    model = temperature_by_position_ids(zoo.tiny_llama4(floor_scale=16)) if family == "llama4" else \
        zoo.tiny_model(family)
    result = _run(keys_never_rotated(model), ["shift"], dtype)["shift"]
    assert result.status is Status.FAIL, result.summary
    assert result.metrics["breaks_at"] == 1
