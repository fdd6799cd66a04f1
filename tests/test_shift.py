"""shift: position_ids + k must leave a relative model's outputs unchanged, up to fp angle rounding.

Healthy zoo families PASS (relative kinds) or SKIP with a reason (absolute tables: outputs change,
as expected). Planted bugs (tests/plants_shift.py) FAIL at the first rung on four RoPE layouts;
positions rounded to bfloat16 break only once positions pass 256, and the check says where.
"""

import pytest
import torch
from plants_shift import (
    absolute_leak,
    bf16_angles,
    bf16_positions,
    identity_rotation,
    keys_never_rotated,
    layout_mismatch,
    rotary_ignores_position_ids,
)
from sweep_rows import exhaustive
from sweep_support import pinned

from posdiag.api import run_checks
from posdiag.model.loading import from_module
from posdiag.results import Status
from posdiag.testing import zoo


def shift(model):
    return run_checks(from_module(model), ["shift"]).check("shift")


@pytest.mark.parametrize("family", exhaustive(zoo.FAMILIES))
def test_every_family_passes_or_skips_with_a_reason(family):
    result = shift(zoo.tiny_model(family))
    kind = zoo.position_kind(family)
    if kind in ("learned", "sinusoidal"):
        assert result.status is Status.NA, result.summary
        assert "absolute positions" in result.summary and "as expected" in result.summary
    else:  # rope, alibi, T5 buckets: relative, so invariant
        assert result.status is Status.PASS, result.summary
        assert result.metrics["ratio"] <= 10
    assert result.forward_passes <= 4  # one batched ladder + one default-mask row, per stack


# Declared context 4096 so the ladder reaches past 256 (where bfloat16 stops holding integers exactly).
CONTEXT = {"llama": {"max_position_embeddings": 4096}, "gpt_neox": {"max_position_embeddings": 4096},
           "gptj": {"n_positions": 4096}, "qwen2": {"max_position_embeddings": 4096}}
PLANTS = {"keys_never_rotated": keys_never_rotated, "layout_mismatch": layout_mismatch,
          "absolute_leak": absolute_leak, "bf16_angles": bf16_angles}


@pytest.mark.parametrize("family", CONTEXT)
def test_healthy_twin_passes_with_long_context(family):
    result = shift(zoo.tiny_model(family, **CONTEXT[family]))
    assert result.status is Status.PASS, result.summary
    assert result.metrics["max_shift"] == 4096 - 64


@pytest.mark.parametrize("plant", PLANTS)
@pytest.mark.parametrize("family", CONTEXT)
def test_planted_bug_breaks_at_the_first_rung(family, plant):
    result = shift(PLANTS[plant](zoo.tiny_model(family, **CONTEXT[family])))
    assert result.status is Status.FAIL, result.summary
    assert result.metrics["breaks_at"] == 1
    assert result.metrics["ratio"] > 10
    where = result.details["first_layer"]
    assert where == ("embeddings" if plant == "absolute_leak" else "block 1")  # the rotation lives in attention


def test_bf16_positions_break_past_256_and_say_where():
    """Integers are exact in bfloat16 up to 256: positions 0..255 rotate correctly, 257 rounds to 256."""
    result = shift(bf16_positions(zoo.tiny_model("llama", **CONTEXT["llama"])))
    assert result.status is Status.FAIL
    held, broke = result.details["holds_up_to"], result.details["breaks_at"]
    assert 128 <= held < broke <= 256
    assert held + 64 - 1 <= 256 < broke + 64 - 1  # the last good max position is <= 256, the first bad one past it
    assert result.forward_passes == 3  # ladder, default-mask row, one refinement between the two rungs
    # Within a 128-token context the same rounding never happens: invariant, honestly.
    assert shift(bf16_positions(zoo.tiny_model("llama"))).status is Status.PASS


def test_tolerance_grows_with_position_as_fp32_angles_predict():
    """Up to 2^20 the healthy error grows ~linearly with the largest position and stays under the
    predicted rounding term Δ1·eps·P (strong init: large Δ1, so the angle term dominates the floor)."""
    result = shift(zoo.tiny_model("llama", init="strong", max_position_embeddings=1 << 20))
    assert result.status is Status.PASS, result.summary
    errors = result.details["errors"]
    assert errors[-1] > 100 * errors[0]  # real growth, not a flat floor
    assert result.metrics["ratio"] < 1


def test_alibi_is_shifted_through_an_invisible_prefix():
    healthy = shift(zoo.tiny_model("bloom", init="strong"))
    assert healthy.status is Status.PASS and healthy.details["route"].startswith("prefix")
    leaked = shift(absolute_leak(zoo.tiny_model("bloom", init="strong")))
    assert leaked.status is Status.FAIL and leaked.metrics["breaks_at"] == 1


def test_falcon_alibi_bias_is_computed_in_bfloat16():
    """A real finding in transformers (its source on 5.17 to 5.25; judged on 5.24 and 5.25): Falcon builds ALiBi as
    slopes.bfloat16() * positions, so in a float32 model key positions past 256 round and relative invariance breaks
    there."""
    result = shift(zoo.tiny_model("falcon_alibi", max_position_embeddings=1024))
    if pinned(result, "zoo:falcon_alibi", "shift"):
        assert 128 <= result.details["holds_up_to"] < result.details["breaks_at"] <= 256


def test_healthy_alibi_holds_past_256_with_the_falcon_probe():
    """The healthy counterpart of the Falcon finding: MPT builds ALiBi in float32, and the same prefix-route
    ladder (shifts up to 256, 64 tokens, max position 319) holds at every rung, so Falcon's break is Falcon's
    bfloat16 slopes, not ALiBi's and not the probe's."""
    healthy = shift(zoo.tiny_model("mpt", max_seq_len=1024))
    falcon = shift(zoo.tiny_model("falcon_alibi", max_position_embeddings=1024))
    assert healthy.details["route"] == falcon.details["route"] == "prefix of invisible padding"
    assert healthy.details["ladder"] == falcon.details["ladder"] and healthy.details["ladder"][-1] == 256
    assert healthy.details["seq_len"] == falcon.details["seq_len"] == 64
    assert healthy.status is Status.PASS, healthy.summary
    assert healthy.metrics["ratio"] <= 10 and healthy.metrics["unit_shift_ratio"] > 100
    pinned(falcon, "zoo:falcon_alibi", "shift")


def test_encoder_decoder_with_relative_buckets_passes_both_stacks():
    result = shift(zoo.tiny_model("t5", init="strong"))
    assert result.status is Status.PASS
    assert set(result.details["stacks"]) == {"encoder", "decoder"}


MOVE_NOTHING = {"identity_rotation": identity_rotation, "rotary_ignores_position_ids": rotary_ignores_position_ids}


@pytest.mark.parametrize("plant", MOVE_NOTHING)
@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt_neox", "phi"])
def test_declared_rope_whose_positions_move_nothing_fails(family, plant):
    """Invariance holds trivially when positions move nothing: for a model that declares RoPE that is the
    bug, not a reason to skip. The healthy twin of each family PASSes (test_every_family_...)."""
    result = shift(MOVE_NOTHING[plant](zoo.tiny_model(family)))
    assert result.status is Status.FAIL, result.summary
    assert result.summary.startswith("positions move nothing: the model declares rope positions")
    assert result.metrics["unit_shift_ratio"] < 10
    assert shift(zoo.tiny_model(family)).status is Status.PASS  # the healthy twin, same seed


@pytest.mark.parametrize("family", ["llama", "bloom", "t5"])
def test_relative_positions_removed_fail(family):
    """RoPE zeroed, ALiBi zeroed (prefix route), T5 buckets zeroed: each declares relative positions."""
    model = zoo.tiny_model(family, init="strong")
    zoo.remove_positions(model, family)
    result = shift(model)
    assert result.status is Status.FAIL and "positions move nothing" in result.summary, result.summary


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_absolute_positions_removed_keep_their_skip(family):
    model = zoo.tiny_model(family, init="strong")
    zoo.remove_positions(model, family)
    result = shift(model)
    assert result.status is Status.SKIP and "no measurable effect" in result.summary, result.summary


def test_declared_rope_without_effect_in_bfloat16_is_decided_in_float64():
    """In bfloat16 a weak signal and none cannot be told apart: the ladder runs again in float64 and decides."""
    from posdiag.options import LoadOptions

    model = identity_rotation(zoo.tiny_model("llama").to(torch.bfloat16))
    result = run_checks(from_module(model, options=LoadOptions(upcast=False)), ["shift"]).check("shift")
    assert result.status is Status.FAIL, result.summary
    assert result.summary.startswith("positions move nothing") and "decided in float64" in result.summary


def test_absolute_leak_in_bfloat16_without_upcast_fails():
    """The bf16 angle-rounding bound is larger than a unit shift of an absolute leak: judged in bf16 the leak
    passed; decided in float64 it FAILs at shift 1, and the healthy twin PASSes."""
    from posdiag.options import LoadOptions

    def judged(model):
        return run_checks(from_module(model, options=LoadOptions(upcast=False)), ["shift"]).check("shift")

    leak = judged(absolute_leak(zoo.tiny_model("llama")).to(torch.bfloat16))
    assert leak.status is Status.FAIL and "shift 1" in leak.summary, leak.summary
    assert leak.details["decided_in"] == "float64"
    assert judged(zoo.tiny_model("llama").to(torch.bfloat16)).status is Status.PASS


def test_bfloat16_model_is_judged_as_run_and_passes():
    assert shift(zoo.tiny_model("qwen2", dtype=torch.bfloat16)).status is Status.PASS


@pytest.mark.parametrize("family", ["gpt2", "opt", "bert"])
def test_absolute_positions_in_bfloat16_are_reported_as_used(family):
    """In bfloat16 the rounding term for RoPE angles exceeds a whole unit shift of an absolute model:
    whether positions are used is judged against the noise floor instead."""
    from posdiag.options import LoadOptions

    model = zoo.tiny_model(family).to(torch.bfloat16)
    result = run_checks(from_module(model, options=LoadOptions(upcast=False)), ["shift"]).check("shift")
    assert result.status is Status.NA
    assert "as expected" in result.summary and "noise floor" in result.summary


def test_offset_families_probe_up_to_the_last_usable_position():
    """RoBERTa counts padding_idx+1 offset rows in max_position_embeddings: Subject.max_positions already
    subtracts them, so the ladder's last rung is max_positions - length (it used to stop 2 short)."""
    model = zoo.tiny_model("roberta")
    subject = from_module(model)
    assert subject.family.explicit_position_offset == 2
    result = run_checks(subject, ["shift"]).check("shift")
    assert result.details["ladder"][-1] + result.details["seq_len"] == subject.max_positions, result.details
