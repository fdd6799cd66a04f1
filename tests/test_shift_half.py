"""shift decided in float64 for half-precision models: the float64 re-run computes rotary angles in float64.

transformers' rotary modules cast integer position ids with an explicit `.float()`, so a float64 re-run used to keep
the float32 angle error m·θ·eps: a healthy bfloat16 Llama with a 131072-token context FAILed "decided in float64"
at 140x its bound. posdiag.model.casts.float64_angles turns those casts into float64 within rotary modules; a table
it cannot recompute (GPT-J's sin/cos) is bounded by the precision the table holds. Planted bugs still FAIL.
"""

import pytest
import torch
from plants_shift import absolute_leak, bf16_positions, keys_never_rotated, layout_mismatch
from transformers import AutoModelForCausalLM, LlamaConfig

from posdiag.api import run_checks
from posdiag.model.casts import float64_angles, rotary_modules
from posdiag.model.loading import from_module
from posdiag.options import LoadOptions
from posdiag.results import Status
from posdiag.testing import zoo

CONTEXT = {"llama": {"max_position_embeddings": 4096}, "gpt_neox": {"max_position_embeddings": 4096},
           "gptj": {"n_positions": 4096}, "qwen2": {"max_position_embeddings": 4096}}
PLANTS = {"keys_never_rotated": keys_never_rotated, "layout_mismatch": layout_mismatch, "absolute_leak": absolute_leak}


def shift_bf16(model):
    subject = from_module(model.to(torch.bfloat16), options=LoadOptions(upcast=False))
    return run_checks(subject, ["shift"]).check("shift")


def long_context_llama():
    """The shape of the false FAIL: default init, θ 5e5, a 131072-token context (positions where float32 angles
    are off by ~1e-2 rad)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=131072, rope_theta=5e5)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


def test_long_context_llama_in_bfloat16_passes_decided_in_float64():
    result = shift_bf16(long_context_llama())
    assert result.status is Status.PASS, result.summary
    assert result.details["decided_in"] == "float64"
    assert result.metrics["max_shift"] == 131072 - 64
    assert result.details["errors"][-1] < 1e-12  # float32 angles left 1.07e-5 at the last rung
    assert "rotary_tables_kept" not in result.details


def test_float64_angles_match_a_float64_computation():
    """Inside float64_angles the rotary module's cos/sin at positions near 131072 equal float64 math; outside they
    carry float32's angle error."""
    model = long_context_llama().double()
    (name, rotary), = rotary_modules(model).items()
    pos = torch.arange(131008, 131072)[None]
    x = torch.zeros(1, dtype=torch.float64)
    exact = (pos[..., None].double() * rotary.inv_freq.double()).cos()
    with float64_angles(model) as angles:
        cos, _ = rotary(x, pos)
    assert angles.computed == {name} and not angles.kept
    assert (cos[..., : exact.shape[-1]] - exact).abs().max() < 1e-12
    assert (rotary(x, pos)[0][..., : exact.shape[-1]] - exact).abs().max() > 1e-4


@pytest.mark.parametrize("family", CONTEXT)
def test_healthy_twin_passes_in_bfloat16(family):
    result = shift_bf16(zoo.tiny_model(family, **CONTEXT[family]))
    assert result.status is Status.PASS, result.summary
    assert result.details["decided_in"] == "float64"
    if family == "gptj":  # its sin/cos table, cast to bfloat16 with the model, cannot be recomputed
        assert result.details["rotary_tables_kept"] == {"transformer.rotary_emb": "bfloat16"}


@pytest.mark.parametrize("plant", PLANTS)
@pytest.mark.parametrize("family", CONTEXT)
def test_planted_bug_fails_in_bfloat16(family, plant):
    result = shift_bf16(PLANTS[plant](zoo.tiny_model(family, **CONTEXT[family])))
    assert result.status is Status.FAIL, result.summary
    assert result.metrics["breaks_at"] == 1 and result.metrics["ratio"] > 10
    assert "decided in float64" in result.summary


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_positions_rounded_to_bfloat16_still_break_past_256(family):
    """The plant rounds positions before its own angle math: float64 angles do not hide it."""
    result = shift_bf16(bf16_positions(zoo.tiny_model(family, **CONTEXT[family])))
    assert result.status is Status.FAIL, result.summary
    assert 128 <= result.details["holds_up_to"] < result.details["breaks_at"] <= 256


def test_the_matmul_form_of_older_transformers_gets_float64_angles_too(monkeypatch):
    """transformers 5.17 (the GPU image's) builds the angles as inv_freq.to(dtype=float) @ position_ids.float()
    under autocast off: float64 @ float64 inside float64_angles (a float32 operand would make the matmul raise)."""
    from transformers.models.llama import modeling_llama

    def older_forward(self, x, position_ids):
        inv = self.inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1).to(dtype=torch.float, device=x.device)
        freqs = (inv @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)

    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", older_forward)
    model = long_context_llama().double()
    (name, rotary), = rotary_modules(model).items()
    pos = torch.arange(131008, 131072)[None]
    exact = (pos[..., None].double() * rotary.inv_freq.double()).cos()
    with float64_angles(model) as angles:
        cos, _ = rotary(torch.zeros(1, dtype=torch.float64), pos)
    assert angles.computed == {name}
    assert (cos[..., : exact.shape[-1]] - exact).abs().max() < 1e-12
