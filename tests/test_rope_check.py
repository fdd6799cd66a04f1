"""The rope check: planted RoPE bugs FAIL, healthy twins PASS, every zoo family PASSes or SKIPs."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from sweep_rows import exhaustive

from posdiag import api
from posdiag.model.loading import from_module
from posdiag.options import LoadOptions, RunOptions
from posdiag.results import Status
from posdiag.testing import zoo

sys.path.insert(0, str(Path(__file__).parent))
import plants_rope as P


def rope(model, **check_options):
    subject = from_module(model, options=LoadOptions(upcast=False))
    report = api.run_checks(subject, ["rope"],
                            RunOptions(check_options={"rope": check_options} if check_options else {}))
    return report.check("rope")


@pytest.mark.parametrize("family", exhaustive(zoo.FAMILIES))
def test_every_zoo_family_passes_or_skips(family):
    result = rope(zoo.tiny_model(family))
    if zoo.position_kind(family) == "rope":
        assert result.status is Status.PASS, result.summary
        assert result.metrics["applied_probed"] and result.metrics["worst_ratio"] < 2
        assert result.metrics["attention_factor_probed"] and result.metrics["attention_factor_ratio"] < 1
        assert result.forward_passes == 1
        assert result.details["not_probed"] == [] and "not probed" not in result.summary
    else:
        assert result.status is Status.NA and "not a RoPE model" in result.summary


@pytest.mark.parametrize("name", sorted(P.TWINS))
def test_healthy_twins_pass(name):
    result = rope(P.TWINS[name]())
    assert result.status is Status.PASS, result.summary
    assert result.metrics["worst_ratio"] < 2


# plant -> a kind of finding that must be among the failures (the applied path must see it unless noted)
EXPECTED = {
    "theta_ignored": "applied rotation",
    "linear_ignored": "applied rotation",
    "yarn_ignored": {"applied rotation", "attention factor"},
    "yarn_mscale_ignored": {"table", "attention factor"},  # the tables carry the drop into attention
    "llama3_wrong_factor": "applied rotation",
    "dynamic_static": "applied rotation",
    "longrope_no_switch": "applied rotation",
    "gemma3_local_uses_global_base": "applied rotation",
    "bf16_angles": "applied rotation",
    "keys_not_rotated": "applied rotation",
    "q_half_k_interleaved": "layout",
    "uninitialised_bits": "non-finite",
    "uninitialised_zeros": "applied rotation",
    "partial_dropped_phi": "pass-through dims",
    "partial_dropped_neox": "pass-through dims",
    # tables right, the port's own cos/sin wrong: only the scale against the un-rotated q/k shows it
    "yarn_port_drops_factor_llama": "attention factor",
    "yarn_port_drops_factor_qwen2": "attention factor",
    "yarn_port_drops_factor_mistral": "attention factor",
    "yarn_port_doubles_factor_llama": "attention factor",
    "yarn_port_doubles_factor_qwen2": "attention factor",
}


@pytest.mark.parametrize("name", sorted(P.PLANTED))
def test_planted_bugs_fail_with_location(name):
    result = rope(P.PLANTED[name]())
    assert result.status is Status.FAIL, result.summary
    kinds = {f["kind"] for f in result.details["failures"]}
    expected = {EXPECTED[name]} if isinstance(EXPECTED[name], str) else EXPECTED[name]
    assert expected <= kinds, (kinds, result.summary)
    worst = result.details["worst"]
    assert "position" in worst or "layer" in worst
    if worst["kind"] in ("table", "applied rotation", "pass-through dims"):
        assert {"expected", "actual", "dim", "ratio"} <= set(worst) and worst["ratio"] > 1e3


def test_bf16_angles_caught_with_the_model_in_fp32():
    model = P.PLANTED["bf16_angles"]()
    assert next(model.parameters()).dtype is torch.float32
    result = rope(model)
    applied = [f for f in result.details["failures"] if f["kind"] == "applied rotation"]
    assert applied and applied[0]["position"] > 16  # bf16 positions round above 256/16 steps


def test_stateful_types_probed_on_both_sides_and_restored():
    model = P.TWINS["dynamic"]()
    rot = model.model.rotary_emb
    before = rot.inv_freq.clone()
    result = rope(model)
    assert result.status is Status.PASS and result.forward_passes == 2
    labels = {row[0] for row in result.details["error_by_position"]}
    assert labels == {"below switch 128", "beyond switch 128"}
    assert result.metrics["max_position"] >= 2 * 128 - 1
    assert torch.equal(rot.inv_freq, before) and rot.max_seq_len_cached == 128


def test_target_beyond_claims_warns_and_probes_there():
    result = rope(zoo.tiny_model("llama"), target_length=4096)
    assert result.status is Status.WARN and "beyond the 128 tokens" in result.summary
    assert result.metrics["max_position"] == 4095 and result.metrics["unseen_pairs_at_target"] > 0


def test_bf16_model_without_upcast_passes():
    result = rope(zoo.tiny_model("qwen3", dtype=torch.bfloat16))
    assert result.status is Status.PASS, result.summary


def test_static_figures_in_metrics():
    result = rope(zoo.tiny_model("gemma3"))
    assert result.metrics["full_attention_rope_theta"] == 1e6 and result.metrics["sliding_attention_rope_theta"] == 1e4
    assert "sliding_attention_critical_pair" in result.metrics
    assert result.tables[0].rows and "decay 1st zero" in result.tables[0].columns


def _yarn_factor() -> float:
    """The expected factor straight from transformers' yarn init function (0.1 ln 4 + 1)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    return float(ROPE_INIT_FUNCTIONS["yarn"](zoo.tiny_config("llama", rope_parameters=dict(P.YARN)), "cpu")[1])


@pytest.mark.parametrize("family,power,apply", [("llama", 0, False), ("qwen2", 0, True), ("llama", 2, True),
                                                ("qwen2", 2, False), ("llama", 1, False), ("qwen2", 1, True)])
def test_attention_factor_measured_on_the_applied_path(family, power, apply):
    """A port with right tables but its own cos/sin: measured = factor^power, expected = factor."""
    expected = _yarn_factor()
    result = rope(P.yarn_port(family, power, apply))
    m = result.metrics
    assert expected == pytest.approx(1.13863, abs=1e-5) and m["attention_factor_expected"] == pytest.approx(expected)
    assert m["attention_factor_measured"] == pytest.approx(expected ** power, rel=1e-6)
    assert m["attention_factor_source"] == ("apply_rotary_pos_emb inputs" if apply else "q_proj/k_proj outputs")
    rows = result.details["attention_factor"]
    assert {(r["layer"], r["tensor"]) for r in rows} == {(layer, t) for layer in (0, 1) for t in ("q", "k")}
    if power == 1:
        assert result.status is Status.PASS and m["attention_factor_ratio"] < 1, result.summary
        assert "attention factor 1.1386" in result.summary
    else:
        assert result.status is Status.FAIL and m["attention_factor_ratio"] > 1e4, result.summary
        assert result.summary.startswith("attention factor on the applied path")
        assert ("dropped" if power == 0 else "applied twice") in result.summary
        assert "table" not in {f["kind"] for f in result.details["failures"]}  # the tables alone pass


def test_attention_factor_in_bf16_is_inconclusive_not_pass():
    """In bf16 a dropped factor (12%) is ~5x the rounding bound of one rotation: WARN, not PASS; fp32 FAILs."""
    result = rope(P.yarn_port("llama", 0, False, dtype=torch.bfloat16))
    assert result.status is Status.WARN and "inconclusive in bfloat16" in result.summary, result.summary
    assert 1 < result.metrics["attention_factor_ratio"] <= 10
    assert rope(P.yarn_port("llama", 1, False, dtype=torch.bfloat16)).status is Status.PASS


def test_attention_factor_never_observed_is_not_a_pass(monkeypatch):
    """An inline port with no plain q_proj/k_proj to read: a factor != 1 left unmeasured WARNs; factor 1 is a note."""
    from posdiag.checks.rope import capture
    monkeypatch.setattr(capture, "plain_projections", lambda attention: {})
    result = rope(P.yarn_port("llama", 0, False))
    assert result.status is Status.WARN and "checked on the rotary tables only" in result.summary, result.summary
    assert result.metrics["attention_factor_probed"] is False
    result = rope(P.faithful_port())
    assert result.status is Status.PASS and any("not measured" in n for n in result.details["notes"])


def test_unrotated_capture_must_line_up_at_position_zero():
    """The un-rotated capture is used only when it is the rotated vector's multiple at position 0
    (identity rotation)."""
    from posdiag.checks.rope.factor import same_vectors
    rng = np.random.default_rng(0)
    u = rng.standard_normal((4, 3, 16))
    assert same_vectors(1.1386 * u, u, 16, 1.2e-7)
    assert not same_vectors(1.1386 * u, rng.standard_normal((4, 3, 16)), 16, 1.2e-7)  # another layer's q


def _hunyuan():
    """HunYuan normalises q/k after RoPE: attention receives no pure rotation."""
    model = zoo.tiny_model_of_type("hunyuan_v1_moe")
    with torch.no_grad():  # trained-like norm weights (at init they are 1 and the norm commutes with rotation)
        for name, p in model.named_parameters():
            if name.endswith(("query_layernorm.weight", "key_layernorm.weight")):
                p.uniform_(0.5, 1.5)
    return model


def test_norm_after_rotation_is_judged_where_the_rotation_is_applied():
    """A false FAIL before (3.96e5x): the rotation is judged at apply_rotary_pos_emb's output, and the
    attention factor on that call's own input and output."""
    model = _hunyuan()
    result = api.run_checks(from_module(model), ["rope"]).check("rope")
    assert result.status is Status.PASS, result.summary
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("inv_freq"):
                buffer.mul_(1.5)  # wrong frequencies reach the rotation
    assert api.run_checks(from_module(model), ["rope"]).check("rope").status is Status.FAIL


# ------------------------------------------------------------------ no probe is dropped silently
def stacked_rotary(model):
    """A port whose rotary module returns one stacked tensor [2, ...]: `cos, sin = rotary(x, ids)` unpacks it in
    the model, but it is no (cos, sin) pair the table probe can read."""
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            module.register_forward_hook(lambda _m, _a, out: torch.stack(out))
    return model


def test_a_table_that_cannot_be_probed_is_named_not_dropped():
    result = rope(stacked_rotary(zoo.tiny_model("llama")))
    assert result.status is Status.PASS, result.summary  # the applied rotation was probed, and matches
    assert result.metrics["tables_probed"] is False
    (why,) = result.details["not_probed"]
    assert why.startswith("rotary table of LlamaRotaryEmbedding: it returned one tensor of shape (2,")
    assert result.summary.endswith("; not probed: " + why)


def test_nothing_probed_is_a_skip_naming_each_probe(monkeypatch):
    import contextlib

    from posdiag.checks.rope import applied

    monkeypatch.setattr(applied, "capturing", lambda subject, capture: contextlib.nullcontext(False))
    result = rope(stacked_rotary(zoo.tiny_model("llama")))
    assert result.status is Status.SKIP, result.summary
    assert "rotary table of LlamaRotaryEmbedding" in result.summary
    assert "applied rotation: no eager attention function or apply_rotary_pos_emb to observe" in result.summary


def test_a_rotary_module_that_cannot_be_called_alone_is_named():
    model = zoo.tiny_model("qwen2")
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            def refuse(_m, args):
                if args[0].shape[-1] == 1:  # posdiag's probe input, not the model's hidden states
                    raise RuntimeError("expects the hidden states")
            module.register_forward_pre_hook(refuse)
    result = rope(model)
    assert result.status is Status.PASS, result.summary
    assert result.details["not_probed"] == ["rotary table of Qwen2RotaryEmbedding: calling it with (x, position_ids) "
                                            "raised RuntimeError: expects the hidden states"]


def test_attention_factor_missing_at_one_layer_is_named(monkeypatch):
    from posdiag.checks.rope import applied

    real = applied.factor_finding
    monkeypatch.setattr(applied, "factor_finding", lambda *a: None if a[-1] == 1 else real(*a))
    result = rope(zoo.tiny_model("llama"))
    assert result.status is Status.PASS, result.summary
    assert result.details["not_probed"] == ["attention factor at layer 1 q, layer 1 k: no un-rotated q/k lined up "
                                            "with the rotated one"]
    assert "not probed: attention factor at layer 1 q, layer 1 k" in result.summary


def _llama31_shaped(dtype):
    """A Llama-3.1-shaped tiny model (head_dim 128, llama3 x8 from 8192, 131072 positions) built in `dtype`."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=131072,
                         rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager").eval()


def test_dtype_on_a_factory_keeps_the_frequencies_and_a_bfloat16_inv_freq_fails(monkeypatch):
    """`--dtype bfloat16` on a factory's model casts its weights but keeps its `inv_freq` in float32, as
    from_pretrained does (cast too, they round to 3 digits and rope FAILed a healthy model: cos 1 where 0.98 is due
    at position 62133). The same model whose frequencies a user cast to bfloat16 is that bug, and FAILs."""
    import types

    from posdiag.model.loading import load_subject

    module = types.ModuleType("posdiag_test_factory31")
    module.build = lambda: _llama31_shaped(torch.float32)
    monkeypatch.setitem(sys.modules, "posdiag_test_factory31", module)
    subject = load_subject("posdiag_test_factory31:build", LoadOptions(dtype="bfloat16", upcast=False))
    assert subject.model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert next(subject.model.parameters()).dtype == torch.bfloat16
    assert api.run_checks(subject, ["rope"]).check("rope").status is Status.PASS
    cast = _llama31_shaped(torch.bfloat16)
    cast.model.rotary_emb.inv_freq = cast.model.rotary_emb.inv_freq.to(torch.bfloat16)
    broken = api.run_checks(from_module(cast, options=LoadOptions(upcast=False)), ["rope"]).check("rope")
    assert broken.status is Status.FAIL and "table disagrees with the config" in broken.summary, broken.summary
