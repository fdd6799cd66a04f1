"""The quirk table: every quirk in its row (config-dependent ones through `refine`), kinds as enum members that
read, compare and serialise as their strings."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig

from posdiag.errors import PosdiagError
from posdiag.model.families import _ROWS, Family, family_for
from posdiag.model.kinds import Kind, PositionKind
from posdiag.model.loading import from_module


def test_members_are_their_strings():
    assert Kind.SEQ2SEQ == "seq2seq" and f"{PositionKind.NONE}" == str(PositionKind.NONE) == "none found"
    assert json.dumps({"kind": Kind.ENCODER, "position_kind": PositionKind.RELATIVE_BIAS}) == \
        '{"kind": "encoder", "position_kind": "relative_bias"}'


def test_rows_hold_members_whatever_they_were_built_from():
    row = Family("x", kind="encoder", position_kind="rope")
    assert row.kind is Kind.ENCODER and row.position_kind is PositionKind.ROPE
    with pytest.raises(ValueError):
        Family("x", position_kind="rotary")


@pytest.mark.parametrize("model_type", sorted(t for t, row in _ROWS.items() if row.refine is not None))
def test_refine_changes_only_family_fields(model_type):
    overrides = _ROWS[model_type].refine(AutoConfig.for_model(model_type))
    assert set(overrides) <= set(Family.__dataclass_fields__) - {"name", "refine"}


@pytest.mark.parametrize(("model_type", "fields", "expected"), [
    ("falcon", {"alibi": True}, {"position_kind": "alibi", "mask_form": "layer_hook", "position_ids": "ignored"}),
    ("falcon", {"alibi": False}, {"position_kind": "rope", "mask_form": "4d"}),
    ("roberta", {"pad_token_id": 4}, {"position_offset": 5, "explicit_position_offset": 5}),
    ("prophetnet", {"pad_token_id": 3}, {"position_offset": 4, "explicit_position_offset": 5}),
    ("xlnet", {"attn_type": "uni"}, {"not_causal": ""}),
    ("distilbert", {"sinusoidal_pos_embds": True}, {"position_kind": "sinusoidal"}),
    ("deberta-v2", {"relative_attention": True, "position_biased_input": False},
     {"kind": "encoder", "position_kind": "relative_bias", "position_ids": "ignored"}),
    ("deberta", {"relative_attention": False}, {"kind": "encoder", "position_kind": "none found", "token_mixing": ""}),
    ("xlm", {"causal": False}, {"kind": "encoder"}),
    ("xlm", {"causal": True}, {"kind": "causal"}),
    ("bert", {"is_decoder": True}, {"kind": "causal"}),
])
def test_config_dependent_quirks(model_type, fields, expected):
    row = family_for(AutoConfig.for_model(model_type, **fields))
    assert {name: getattr(row, name) for name in expected} == expected


def test_a_type_without_a_row_is_sniffed():
    row = family_for(AutoConfig.for_model("albert"))
    assert row.name == "albert" and row.kind is Kind.ENCODER and not row.offsets_known


def test_a_factory_model_declaring_an_unknown_kind_is_a_one_line_error():
    model = torch.nn.Linear(2, 2)
    model.posdiag_position_kind = "rotary"
    with pytest.raises(PosdiagError, match="posdiag_position_kind = 'rotary' is not one of"):
        from_module(model)
