"""Hybrid / recurrent sequence mixers: every order check stays honest.

Recurrent, linear-attention and convolutional mixers read order through the recurrence, so the
consistent permutation the checks used as a floor does not exist (a healthy tiny MiniMax gave a
'consistent' error 3e5x the floor, and `positions` FAILed). Healthy hybrids must PASS or SKIP with the
mixers named; planted bugs must FAIL where a check can still judge them. Tiny models built here
(transformers' own hybrid classes, default init); no network.
"""

from __future__ import annotations

import pytest
import torch
from sweep_support import pinned
from transformers import AutoConfig, AutoModelForCausalLM

from posdiag.api import run_checks
from posdiag.model.introspect import recurrent_mixers
from posdiag.model.jitter import FLOOR_SOURCE
from posdiag.model.loading import from_module
from posdiag.results import Status
from posdiag.testing import zoo

OWNED = ["shuffle", "positions", "batch", "shift", "causal"]
MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
              mamba_chunk_size=16)
# family -> (extra config, expected mixer class, has RoPE)
HYBRIDS = {
    "minimax": ({}, "MiniMaxLightningAttention", True),
    "qwen3_next": (dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=2,
                        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32),
                   "Qwen3NextGatedDeltaNet", True),
    "jamba": (dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                   num_experts=2, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4),
              "JambaMambaMixer", False),
    "lfm2": (dict(layer_types=["conv", "full_attention"], block_dim=32, block_ff_dim=64, conv_L_cache=3),
             "Lfm2ShortConv", True),
    "falcon_h1": (dict(MAMBA2, mamba_d_ssm=64), "FalconH1Mixer", True),
    "granitemoehybrid": (dict(MAMBA2, layer_types=["mamba", "attention"], num_local_experts=0,
                              position_embedding_type="rope"), "GraniteMoeHybridMambaLayer", True),
}
ROPE_HYBRIDS = [f for f, (_, _, rope) in HYBRIDS.items() if rope]


def tiny(family: str) -> torch.nn.Module:
    return zoo.tiny_model_of_type(family, **HYBRIDS[family][0])


def checks(model, names=OWNED) -> dict:
    return {c.name: c for c in run_checks(from_module(model), names).checks}


def attention_modules(model) -> list[torch.nn.Module]:
    """The softmax-attention modules of a hybrid (not its recurrent mixers)."""
    recurrent = set(recurrent_mixers(model))
    return [m for n, m in model.named_modules()
            if n.endswith(("self_attn", "attention")) and type(m).__name__ not in recurrent]


def mixer_modules(model) -> list[torch.nn.Module]:
    names = set(recurrent_mixers(model))
    return [m for m in model.modules() if type(m).__name__ in names]


# ------------------------------------------------------------------ detection
@pytest.mark.parametrize("family", list(HYBRIDS))
def test_mixers_named_structurally(family):
    assert recurrent_mixers(tiny(family)) == [HYBRIDS[family][1]]


def test_plain_attention_families_have_none():
    for family in zoo.FAMILIES:
        assert recurrent_mixers(zoo.tiny_model(family)) == [], family


# ------------------------------------------------------------------ healthy hybrids
@pytest.mark.parametrize("family", list(HYBRIDS))
def test_healthy_hybrid_passes_or_skips_with_the_mixers_named(family):
    found = checks(tiny(family))
    mixer = HYBRIDS[family][1]
    # Measured: Jamba (NoPE attention) skips positions and shift, naming its mixers; every other check passes.
    skipped = {"positions", "shift"} if family == "jamba" else set()
    for name, c in found.items():
        assert c.status is (Status.NA if name in skipped else Status.PASS), (family, name, c.status, c.summary)
        if c.status is Status.NA:
            assert "recurrent sequence mixers" in c.summary and mixer in c.summary, (family, name, c.summary)
    # Order enters through the recurrence: shuffle passes, and says why.
    assert found["shuffle"].status is Status.PASS and mixer in found["shuffle"].summary
    assert found["shuffle"].details["floor_source"].startswith(FLOOR_SOURCE)
    assert found["causal"].status is Status.PASS and found["batch"].status is Status.PASS
    if HYBRIDS[family][2]:  # RoPE attention layers: ids are read and the shift is invariant
        assert found["positions"].status is Status.PASS, found["positions"].summary
        assert "consistent permutation not run" in found["positions"].summary
        assert "consistent_error" not in found["positions"].metrics
        assert found["shift"].status is Status.PASS, found["shift"].summary
    else:  # Jamba: NoPE attention + Mamba, nothing positional to honour
        assert found["positions"].status is Status.NA and "no position mechanism" in found["positions"].summary


# ------------------------------------------------------------------ planted bugs
def zero_rope(model) -> None:
    """RoPE removed: every inv_freq buffer zeroed (the rotation becomes the identity)."""
    for name, buf in model.named_buffers():
        if name.endswith("inv_freq"):
            buf.zero_()


@pytest.mark.parametrize("family", ["minimax", "qwen3_next", "lfm2"])
def test_rope_removed_fails_positions_but_order_still_enters(family):
    model = tiny(family)
    zero_rope(model)
    found = checks(model, ["shuffle", "positions", "shift"])
    assert found["positions"].status is Status.FAIL, found["positions"].summary
    assert "change nothing" in found["positions"].summary
    # The recurrence still carries order: outputs do not merely permute (correct, not a miss).
    assert found["shuffle"].status is Status.PASS
    # RoPE declared, yet positions move nothing: the bug itself, not a reason to skip.
    assert found["shift"].status is Status.FAIL and "positions move nothing" in found["shift"].summary


@pytest.mark.parametrize("family", ["minimax", "qwen3_next", "lfm2"])
def test_rope_on_hybrids_passes_healthy_and_fails_removed(family):
    """The same-token premise of the applied-rotation probe fails behind a recurrent mixer (healthy
    Qwen3-Next/LFM2 FAILed there, then WARNed): the rotation is judged against the un-rotated q/k of
    the same apply call instead (tests/test_rope_hybrid.py), so healthy PASSes with it observed."""
    model = tiny(family)
    healthy = checks(model, ["rope"])["rope"]
    assert healthy.status is Status.PASS and healthy.metrics["applied_probed"], healthy.summary
    zero_rope(model)
    assert checks(model, ["rope"])["rope"].status is Status.FAIL


def _absolute_beyond(limit: int):
    """Positions past `limit` stretched by 3/2 (a scaling that switches on at a position: not relative)."""
    def hook(module, args, kwargs):
        p = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        p = torch.where(p >= limit, limit + (p - limit) * 3 // 2, p)
        if "position_ids" in kwargs:
            kwargs["position_ids"] = p
        else:
            args = (args[0], p, *args[2:])
        return args, kwargs
    return hook


@pytest.mark.parametrize("family", ["minimax", "qwen3_next"])
def test_absolute_position_use_fails_shift(family):
    model = tiny(family)
    model.model.rotary_emb.register_forward_pre_hook(_absolute_beyond(64), with_kwargs=True)
    c = checks(model, ["shift"])["shift"]
    assert c.status is Status.FAIL and "breaks" in c.summary, c.summary


def _open_next_key(module, args, kwargs):
    """Query i also sees key i + 1 (the attention layers' mask)."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    b, t = hidden.shape[:2]
    mask = kwargs.get("attention_mask")
    if mask is None:
        allowed = torch.ones(t, t, dtype=torch.bool, device=hidden.device).tril()
        mask = torch.zeros(b, 1, t, t, dtype=hidden.dtype, device=hidden.device)
        mask = mask.masked_fill(~allowed, torch.finfo(hidden.dtype).min)
    mask = mask.clone()
    q = torch.arange(t - 1, device=mask.device)
    mask[..., q, q + 1] = 0.0
    kwargs["attention_mask"] = mask
    return args, kwargs


@pytest.mark.parametrize("family", ["minimax", "jamba", "lfm2"])
def test_future_leak_in_attention_mask_fails_causal(family):
    model = tiny(family)
    for m in attention_modules(model):
        m.register_forward_pre_hook(_open_next_key, with_kwargs=True)
    c = checks(model, ["causal"])["causal"]
    assert c.status is Status.FAIL and "+1" in c.summary, c.summary


def _reversed_in_time(model) -> None:
    """The recurrent mixers scan right to left (input and output flipped in time): anti-causal."""
    def flip_in(module, args, kwargs):
        if args:
            return (args[0].flip(1), *args[1:]), kwargs
        kwargs["hidden_states"] = kwargs["hidden_states"].flip(1)
        return args, kwargs

    def flip_out(module, args, kwargs, out):
        return (out[0].flip(1), *out[1:]) if isinstance(out, tuple) else out.flip(1)

    for m in mixer_modules(model):
        m.register_forward_pre_hook(flip_in, with_kwargs=True)
        m.register_forward_hook(flip_out, with_kwargs=True)


@pytest.mark.parametrize("family", ["jamba", "lfm2"])
def test_recurrence_run_backwards_fails_causal(family):
    model = tiny(family)
    _reversed_in_time(model)
    c = checks(model, ["causal"])["causal"]
    assert c.status is Status.FAIL, c.summary


def test_padding_fed_to_the_recurrence_fails_batch():
    """The Mamba mixer ignores the padding mask: left pads enter the state.

    Default init hides it (the pad embedding is zero and so is the conv bias: a zero pad never moves the
    state), so both twins get a random conv bias, as trained weights have.
    """
    model = tiny("jamba")
    with torch.no_grad():
        for m in mixer_modules(model):
            m.conv1d.bias.normal_()
    healthy = checks(model, ["batch"])["batch"]
    assert healthy.status is Status.PASS, healthy.summary

    def drop(module, args, kwargs):
        kwargs["attention_mask"] = None
        return args, kwargs

    for m in mixer_modules(model):
        m.register_forward_pre_hook(drop, with_kwargs=True)
    c = checks(model, ["batch"])["batch"]
    assert c.status is Status.FAIL and "left-padded" in c.summary, c.summary


# ------------------------------------------------------------------ plain attention unchanged
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_plain_attention_unchanged(family):
    found = checks(zoo.tiny_model(family))
    for name, c in found.items():
        assert "recurrent" not in c.summary and "recurrent_mixers" not in c.details, (family, name)
    assert found["shuffle"].status is Status.PASS
    assert "consistent permutation" in found["shuffle"].details["floor_source"]
    assert found["positions"].status is Status.PASS and "consistent_error" in found["positions"].metrics


# ------------------------------------------------------------------ no attention at all
def test_pure_mamba_skips_what_needs_a_mask_and_still_judges_causality():
    """Mamba reads a 4D mask as padding and crashed shuffle and causal (ERROR); nothing there reads a mask."""
    cfg = AutoConfig.for_model("mamba", hidden_size=32, num_hidden_layers=2, vocab_size=256, state_size=4)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    found = checks(model)
    for name, c in found.items():
        expected = Status.NA if name in ("shuffle", "positions", "shift") else Status.PASS  # batch, causal judged
        assert c.status is expected, (name, c.summary)
        if c.status is Status.NA:
            assert "MambaMixer" in c.summary, (name, c.summary)
    assert found["shuffle"].status is Status.NA and "no layer is attention" in found["shuffle"].summary
    assert found["causal"].status is Status.PASS
    _reversed_in_time(model)
    assert checks(model, ["causal"])["causal"].status is Status.FAIL


@pytest.mark.parametrize("family", ["qwen3_next", "lfm2", "falcon_h1", "granitemoehybrid"])
def test_cache_on_healthy_hybrids_passes(family):
    """A cached recurrence and the chunked scan compute the same function: healthy hybrids agree to rounding."""
    result = checks(tiny(family), ["cache"])["cache"]
    assert result.status is Status.PASS, result.summary


def test_minimax_cache_is_skipped_with_the_reason():
    result = checks(tiny("minimax"), ["cache"])["cache"]
    assert result.status is Status.SKIP and "does not use transformers Cache objects" in result.summary


def test_jamba_multi_token_continuation_regression():
    """Upstream bug (transformers 5.24): Jamba continued by a multi-token chunk differs from the full forward by
    1.6e-5 relative (117x the floor) in float32 and by the same 1.6e-5 in float64: not rounding. Single-token
    decode agrees. (Recorded as 'healthy, 117x' before float64 arbitration decided it.)"""
    result = checks(tiny("jamba"), ["cache"])["cache"]
    if not pinned(result, "jamba", "cache"):
        return
    paths = result.details["paths"]
    assert paths["dynamic/decode"]["status"] is Status.PASS
    assert paths["dynamic/chunks"]["status"] is Status.FAIL
    decided = result.details["arbitration"]["decided"]["dynamic/chunks"]
    assert "a bug" in decided and result.metrics["error_float64"] > 1e-6

