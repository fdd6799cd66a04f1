"""Models that refuse posdiag's explicit 4D mask, a quantisation buffer taken for a table, and token mixing that is
not attention: found by the support sweep, each an error or a false FAIL on a healthy default-init model.

- Flaubert and FSMT assert a 2D mask; DeBERTa (v1, v2) multiplies its embeddings by the mask. Their plain forward
  runs, so a pattern a 2D padding mask expresses (a shuffled bidirectional stack, an unpermuted causal one) runs in
  that form and is judged; a permuted causal pattern SKIPs, saying the model refuses the 4D mask.
- I-BERT's QuantEmbedding keeps `weight_integer`, a quantised copy of `weight` read only in quant_mode: not a table.
- FNet mixes tokens by a Fourier transform and takes no attention mask: no consistent permutation, no padded rows.
Each healthy model passes or skips with the reason; each planted twin still fails.
"""

from __future__ import annotations

import warnings

import plants_table as P
import pytest
import torch

from posdiag.api import run_checks
from posdiag.checks.table import find_tables
from posdiag.model.classes import auto_class
from posdiag.model.families import family_for
from posdiag.model.loading import from_module
from posdiag.model.probe import Row, mask_refusal, padding_mask
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing import zoo
from posdiag.testing.multimodal import small_config

SHORT = RunOptions(seq_len=16)


# Flaubert names its sizes its own way (the sweep's small config leaves it 2048 wide, 12 layers deep).
_SIZES = {"flaubert": {"emb_dim": 64, "n_layers": 2, "n_heads": 4}}


def _model(model_type: str, **overrides):
    """The sweep's tiny model of `model_type` (transformers' default init), with a short context."""
    warnings.filterwarnings("ignore")
    config = small_config(model_type, max_position_embeddings=64, **_SIZES.get(model_type, {}), **overrides)
    torch.manual_seed(0)
    return auto_class(config, family_for(config)).from_config(config, attn_implementation="eager").eval()


def _run(model, names: list[str]):
    return {c.name: c for c in run_checks(from_module(model), names, SHORT).checks}


def _zero_positions(model):
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "position_embeddings" in name:
                param.zero_()
    return model


# ------------------------------------------------------------------ models refusing a 4D mask
@pytest.mark.parametrize("model_type", ["flaubert", "deberta", "deberta-v2"])
def test_encoder_refusing_4d_masks_is_judged_through_a_2d_mask(model_type):
    found = _run(_model(model_type), ["shuffle", "positions", "table"])
    for name, result in found.items():
        assert result.status is Status.PASS, f"{name}: {result.summary}"
    assert "jittered" in found["positions"].details["floor_source"]  # the refusal did not disturb the floor's hook


@pytest.mark.parametrize("model_type", ["flaubert", "deberta"])
def test_encoder_refusing_4d_masks_with_zeroed_positions_fails(model_type):
    """The 2D route is no cannot-fail path: without positions the shuffle residual is rounding."""
    found = _run(_zero_positions(_model(model_type)), ["shuffle"])
    assert found["shuffle"].status is Status.FAIL, found["shuffle"].summary


def test_refusal_is_measured_and_remembered():
    subject = from_module(_model("flaubert"))
    count = subject.forward_count
    why = mask_refusal(subject, "encoder")
    assert why.startswith("FlaubertModel refuses an explicit 4D attention mask: AssertionError in get_masks")
    assert subject.mask_refusals == {"encoder": why} and subject.forward_count == count  # not a check's pass
    healthy = from_module(zoo.tiny_model("bert"))
    assert mask_refusal(healthy, "encoder") == ""


def test_padding_mask_only_where_it_says_the_same():
    subject = from_module(zoo.tiny_model("llama"))
    ids = subject.sample_ids(1, 8, 0)[0]
    valid = torch.tensor([True] * 6 + [False] * 2)

    def form(row: Row):
        pattern = subject.patterns((row.order if row.order is not None else torch.arange(8))[None],
                                   None if row.valid is None else row.valid[None], stack="decoder", edit=row.edit)
        return padding_mask(subject, [row], pattern, "decoder")

    assert form(Row(ids, valid=valid)).tolist() == [[1] * 6 + [0] * 2]  # causal, padded: a 2D mask says it
    assert form(Row(ids[torch.arange(7, -1, -1)], order=torch.arange(7, -1, -1))) is None  # permuted causal order
    assert form(Row(ids, edit=lambda a: a | True)) is None  # an edited pattern
    encoder = from_module(zoo.tiny_model("bert"))
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    pattern = encoder.patterns(perm[None], stack="encoder")
    assert padding_mask(encoder, [Row(ids[perm], order=perm)], pattern, "encoder") is not None  # all-visible


def test_seq2seq_decoder_refusing_4d_masks_skips_only_what_needs_one():
    found = _run(_model("fsmt"), ["shuffle", "causal", "table"])
    shuffle = found["shuffle"]
    stacks = shuffle.details["stacks"]
    assert shuffle.metrics["encoder_ratio"] > 1e3, shuffle.summary  # the encoder is judged (2D mask)
    assert "refuses an explicit 4D attention mask" in stacks["decoder"]["mask_refused"]
    assert "no 2D padding-mask form" in shuffle.summary
    causal = found["causal"]  # the default mask is judged; the explicit one cannot run, and says why
    assert causal.status is Status.PASS and "refuses an explicit 4D" in causal.details["explicit_mask"]
    assert found["table"].status is not Status.FAIL, found["table"].summary


# ------------------------------------------------------------------ I-BERT: a buffer derived from the table
def test_quantisation_buffer_is_not_a_position_table():
    model = _model("ibert")
    names = [t.name for t in find_tables(from_module(model))]
    assert names == ["embeddings.position_embeddings.weight"]
    result = _run(model, ["table"])["table"]
    assert result.status is Status.PASS, result.summary


def test_ibert_table_read_by_no_position_still_fails():
    """A module that never reads its table (I-BERT's own class, the same shape of buffer beside it) still FAILs."""
    model = _model("ibert")
    table = model.embeddings.position_embeddings
    table.forward = lambda ids: (torch.zeros(*ids.shape, table.weight.shape[1]), None)
    result = _run(model, ["table"])["table"]
    assert result.status is Status.FAIL
    assert "does not read this table" in result.summary


def test_a_table_buffer_with_no_parameter_beside_it_is_still_found():
    model = zoo.tiny_model("gpt2")
    weight = model.transformer.wpe.weight
    del model.transformer.wpe.weight
    model.transformer.wpe.register_buffer("weight", weight.detach().clone())
    assert [t.name for t in find_tables(from_module(model))] == ["transformer.wpe.weight"]
    clamped = P.clamp_rows(model, 40)
    assert _run(clamped, ["table"])["table"].status is Status.FAIL


# ------------------------------------------------------------------ FNet: token mixing that is not attention
def test_fnet_is_judged_without_a_consistent_permutation_and_skips_padding():
    found = _run(_model("fnet"), ["shuffle", "positions", "batch", "shift"])
    positions = found["positions"]
    assert positions.status is Status.PASS, positions.summary
    assert "consistent permutation not run (fnet mixes tokens by a Fourier transform" in positions.summary
    assert found["shuffle"].status is Status.PASS and "Fourier transform" in found["shuffle"].summary
    assert "jittered" in found["shuffle"].details["floor_source"]
    assert found["batch"].status is Status.NA  # by design: FNet reads no mask
    assert "takes no attention mask: padded rows cannot be compared" in found["batch"].summary
    assert found["shift"].status is Status.NA and "absolute positions" in found["shift"].summary


def test_fnet_ignoring_position_ids_fails():
    model = _model("fnet")
    embeddings = model.embeddings
    original = embeddings.forward
    embeddings.forward = lambda input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None: original(
        input_ids=input_ids, token_type_ids=token_type_ids, inputs_embeds=inputs_embeds)
    result = _run(model, ["positions"])["positions"]
    assert result.status is Status.FAIL, result.summary
    assert "change nothing" in result.summary
