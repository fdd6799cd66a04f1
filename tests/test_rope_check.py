"""The rope check: planted RoPE bugs FAIL, healthy twins PASS, every zoo family PASSes or SKIPs."""

import sys
from pathlib import Path

import pytest
import torch

from posdiag import api, zoo
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.subject import LoadOptions, from_module

sys.path.insert(0, str(Path(__file__).parent))
import plants_rope as P  # noqa: E402


def rope(model, **check_options):
    subject = from_module(model, options=LoadOptions(upcast=False))
    report = api.run_checks(subject, ["rope"], RunOptions(check_options={"rope": check_options} if check_options else {}))
    return report.check("rope")


@pytest.mark.parametrize("family", zoo.FAMILIES)
def test_every_zoo_family_passes_or_skips(family):
    result = rope(zoo.tiny_model(family))
    if zoo.position_kind(family) == "rope":
        assert result.status is Status.PASS, result.summary
        assert result.metrics["applied_probed"] and result.metrics["worst_ratio"] < 2
        assert result.forward_passes == 1
    else:
        assert result.status is Status.SKIP and "not a RoPE model" in result.summary


@pytest.mark.parametrize("name", sorted(P.TWINS))
def test_healthy_twins_pass(name):
    result = rope(P.TWINS[name]())
    assert result.status is Status.PASS, result.summary
    assert result.metrics["worst_ratio"] < 2


# plant -> a kind of finding that must be among the failures (the applied path must see it unless noted)
EXPECTED = {
    "theta_ignored": "applied rotation",
    "linear_ignored": "applied rotation",
    "yarn_ignored": "applied rotation",
    "yarn_mscale_ignored": "table",  # a common scale of q and k: only the cos/sin table shows it
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
}


@pytest.mark.parametrize("name", sorted(P.PLANTED))
def test_planted_bugs_fail_with_location(name):
    result = rope(P.PLANTED[name]())
    assert result.status is Status.FAIL, result.summary
    kinds = {f["kind"] for f in result.details["failures"]}
    assert EXPECTED[name] in kinds, (kinds, result.summary)
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
