"""`rope` on hybrids with recurrent mixers: the applied rotation judged without the same-token premise.

A recurrent mixer ahead of an attention layer hands it a different input at every position, so q(p) = R_p q(0)
does not hold there even when the rotation is right. The check judges each attention call's rotated q/k against the
un-rotated q/k of the same apply_rotary_pos_emb call instead: rotated(p) = R_p unrotated(p) pair by pair. Healthy
hybrids PASS (they WARNed before); each planted twin, a bug the rotary tables cannot show, FAILs. Tiny models from the
support sweep's small configs, no network.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from posdiag.api import run_checks
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing.multimodal import small_model

OPTIONS = RunOptions(seq_len=12)
# model type -> the modelling module whose attention calls apply_rotary_pos_emb
FAMILIES = {
    "qwen3_next": "transformers.models.qwen3_next.modeling_qwen3_next",  # partial rotary (a quarter of the head)
    "falcon_h1": "transformers.models.falcon_h1.modeling_falcon_h1",  # attention and Mamba2 side by side per layer
    "lfm3": "transformers.models.lfm3.modeling_lfm3",  # conv layer first; full (partial, θ 1e6) and sliding layers
    "olmo_hybrid": "transformers.models.olmo_hybrid.modeling_olmo_hybrid",
    "bamba": "transformers.models.bamba.modeling_bamba",  # Mamba2 layer, then attention rotating half the head
}


def rope_of(model_type: str):
    return run_checks(from_module(small_model(model_type)), ["rope"], OPTIONS).check("rope")


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_healthy_hybrid_passes_with_the_rotation_observed(model_type):
    rope = rope_of(model_type)
    assert rope.status is Status.PASS, rope.summary
    assert rope.metrics["applied_probed"] is True
    assert not rope.details.get("failures")
    rows = rope.details["error_by_position"]
    assert rows and max(r for _, _, r in rows) <= 1.0, rows  # the pairwise judgement, position by position


# ------------------------------------------------------------------ planted twins
def _interleaved(original):
    """q rotated with interleaved pairs (x0, x1), (x2, x3)... at the same frequencies, k left rotate-half: the
    tables are right, q and k are paired differently."""
    def apply(q, k, cos, sin, *args, **kwargs):
        rot = cos.shape[-1]
        half = torch.arange(rot // 2)
        to_half = torch.cat([2 * half, 2 * half + 1])  # the rotate-half slot j holds interleaved dim to_half[j]
        inner = q.clone()
        inner[..., :rot] = q[..., to_half]
        q_half, k_out = original(inner, k, cos, sin, *args, **kwargs)
        q_out = q_half.clone()
        q_out[..., to_half] = q_half[..., :rot]
        return q_out, k_out
    return apply


def _skipped_last(original, per_forward: int):
    """The last attention layer's rotation skipped in every forward (q/k handed back un-rotated); the others
    rotate."""
    calls: list[int] = []

    def apply(q, k, cos, sin, *args, **kwargs):
        calls.append(1)
        if len(calls) % per_forward == 0:
            return q, k
        return original(q, k, cos, sin, *args, **kwargs)
    return apply


def _q_reversed(original):
    """q rotated by -p·θ (sin negated), k by +p·θ: <R_-m q, R_n k> depends on m + n, not n - m."""
    def apply(q, k, cos, sin, *args, **kwargs):
        q_out, _ = original(q, k, cos, -sin, *args, **kwargs)
        _, k_out = original(q, k, cos, sin, *args, **kwargs)
        return q_out, k_out
    return apply


def _angles_doubled(original):
    """Each pair turned by 2p·θ_i (cos 2x = 2cos²x - 1, sin 2x = 2 sin x cos x from the model's own cos/sin): the
    rotary tables match the config, the rotation applied does not."""
    def apply(q, k, cos, sin, *args, **kwargs):
        return original(q, k, 2 * cos * cos - 1, 2 * sin * cos, *args, **kwargs)
    return apply


def _attention_calls(model_type: str) -> int:
    module = importlib.import_module(FAMILIES[model_type])
    calls: list[int] = []
    original = module.apply_rotary_pos_emb

    def count(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)
    module.apply_rotary_pos_emb = count
    try:
        model = small_model(model_type)
        with torch.no_grad():
            model(torch.zeros(1, 4, dtype=torch.long))
    finally:
        module.apply_rotary_pos_emb = original
    return len(calls)


@pytest.mark.parametrize("model_type", ["qwen3_next", "falcon_h1", "lfm3"])
def test_q_and_k_paired_differently_fails(model_type, monkeypatch):
    module = importlib.import_module(FAMILIES[model_type])
    monkeypatch.setattr(module, "apply_rotary_pos_emb", _interleaved(module.apply_rotary_pos_emb))
    rope = rope_of(model_type)
    assert rope.status is Status.FAIL, rope.summary
    assert "paired differently" in rope.summary and "q interleaved, k half" in rope.summary, rope.summary


@pytest.mark.parametrize("model_type", ["qwen3_next", "falcon_h1", "lfm3"])
def test_a_layer_whose_rotation_is_skipped_fails(model_type, monkeypatch):
    per_forward = _attention_calls(model_type)
    module = importlib.import_module(FAMILIES[model_type])
    monkeypatch.setattr(module, "apply_rotary_pos_emb", _skipped_last(module.apply_rotary_pos_emb, per_forward))
    rope = rope_of(model_type)
    assert rope.status is Status.FAIL, rope.summary
    assert "applied rotation disagrees with the config" in rope.summary, rope.summary


@pytest.mark.parametrize("model_type", ["qwen3_next", "bamba"])
def test_rotation_at_twice_the_angle_fails_while_the_tables_match(model_type, monkeypatch):
    module = importlib.import_module(FAMILIES[model_type])
    monkeypatch.setattr(module, "apply_rotary_pos_emb", _angles_doubled(module.apply_rotary_pos_emb))
    rope = rope_of(model_type)
    assert rope.status is Status.FAIL, rope.summary
    assert "applied rotation disagrees with the config" in rope.summary, rope.summary
    assert rope.details["failures"][0]["kind"] == "applied rotation"
    assert all(f["kind"] != "table" for f in rope.details["failures"])


@pytest.mark.parametrize("model_type", ["qwen3_next", "olmo_hybrid"])
def test_q_rotated_the_other_way_fails(model_type, monkeypatch):
    module = importlib.import_module(FAMILIES[model_type])
    monkeypatch.setattr(module, "apply_rotary_pos_emb", _q_reversed(module.apply_rotary_pos_emb))
    rope = rope_of(model_type)
    assert rope.status is Status.FAIL, rope.summary
    assert "rotated in opposite directions" in rope.summary, rope.summary


def test_no_hookable_rotation_keeps_the_warn_with_its_reason():
    """Bailing-hybrid's MLA rotates through apply_rotary_pos_emb_interleave: no un-rotated q/k lines up, so the
    rotation is not observed and the check says why (a WARN, not a PASS)."""
    rope = rope_of("bailing_hybrid")
    assert rope.status is Status.WARN, rope.summary
    assert "recurrent sequence mixers" in rope.summary and "no un-rotated q/k lined up" in rope.summary
