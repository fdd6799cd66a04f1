"""Support-sweep rows of NeoMME and Zaya: default-init models whose outputs cannot carry positions at all.

NeoMME zero-initialises every attention output projection and MLP down projection (each block adds nothing: a
token's output depends on that token alone); Zaya zero-initialises the key scale of its q/k norm (every key is 0,
every attention score equal). `shuffle`, `positions` and `shift` FAILed them as models that lost their positions
("residual 0"); both pass their position ids to RoPE (measured on the twins below: with the branches set, gaps in the
ids move the outputs and a constant shift does not). They now SKIP naming the reason (`posdiag.model.inert`), the
twins with those branches set PASS, and the same twins with the rotation removed still FAIL.

Models are built as the sweep builds them (posdiag.testing.multimodal.small_model, transformers' default init,
float32, CPU).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers

from posdiag.api import run_checks
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing.multimodal import small_model

OPTIONS = RunOptions(seq_len=12)
CHECKS = ["shuffle", "positions", "shift"]


def build(model_type: str) -> torch.nn.Module:
    warnings.filterwarnings("ignore")
    transformers.utils.logging.set_verbosity_error()
    return small_model(model_type)


def statuses(model: torch.nn.Module, name: str, checks: list[str]) -> dict:
    report = run_checks(from_module(model, name=name), checks, OPTIONS)
    return {c.name: c for c in report.checks}


def trained_neomme() -> torch.nn.Module:
    """NeoMME with its zero-initialised output projections and MLP down projections drawn like any other weight."""
    model = build("neomme")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "mlp.down_proj.weight")):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    return model


def trained_zaya() -> torch.nn.Module:
    """Zaya with the key scale of its q/k norm at 1 instead of its zero init."""
    model = build("zaya")
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == "ZayaQKNorm":
                module.temp.fill_(1.0)
    return model


def without_rotation(model: torch.nn.Module) -> torch.nn.Module:
    """Every rotary frequency zeroed: cos 1, sin 0, the identity rotation (a position lost, not an init)."""
    with torch.no_grad():
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                if name.endswith("inv_freq"):
                    buf.zero_()
    return model


def test_default_init_neomme_skips_because_its_tokens_never_interact():
    # Was: shuffle/positions/shift FAIL "position never entered: residual 0 = 0x noise floor".
    results = statuses(build("neomme"), "neomme", CHECKS)
    for name in CHECKS:
        assert results[name].status is Status.SKIP, (name, results[name].summary)
        assert "tokens never interact" in results[name].summary
        assert "tokens never interact" in results[name].details["inert"]


def test_neomme_with_its_branches_set_passes_and_without_rotation_fails():
    results = statuses(trained_neomme(), "neomme", CHECKS)
    assert {n: r.status for n, r in results.items()} == dict.fromkeys(CHECKS, Status.PASS), \
        {n: r.summary for n, r in results.items()}
    broken = statuses(without_rotation(trained_neomme()), "neomme", CHECKS)
    assert {n: r.status for n, r in broken.items()} == dict.fromkeys(CHECKS, Status.FAIL), \
        {n: r.summary for n, r in broken.items()}
    assert not any("inert" in r.details for r in broken.values())


def test_default_init_zaya_skips_because_its_attention_scores_are_constant():
    # Was: positions/shift FAIL "position_ids ignored" / "positions move nothing"; shuffle PASSes through the
    # CCA convolution either way.
    results = statuses(build("zaya"), "zaya", ["positions", "shift"])
    for name in ("positions", "shift"):
        assert results[name].status is Status.SKIP, (name, results[name].summary)
        assert "attention scores are constant" in results[name].summary


@pytest.mark.parametrize("rotation", [True, False])
def test_zaya_with_a_key_scale_reads_its_position_ids_and_fails_without_rotation(rotation):
    model = trained_zaya() if rotation else without_rotation(trained_zaya())
    results = statuses(model, "zaya", ["positions", "shift"])
    expected = Status.PASS if rotation else Status.FAIL
    assert {n: r.status for n, r in results.items()} == {"positions": expected, "shift": expected}, \
        {n: r.summary for n, r in results.items()}


def test_zaya_honours_position_ids_in_plain_transformers():
    # The upstream question, without posdiag: with the key scale set, gapped ids change the logits and a constant
    # shift by 7 does not (RoPE is relative); at default init neither does, since every score is equal.
    ids = torch.arange(10, 22)[None]
    pos = torch.arange(12)[None]
    gaps = pos * 3
    with torch.no_grad():
        for model, moves in ((build("zaya"), False), (trained_zaya(), True)):
            base = model(input_ids=ids, position_ids=pos).logits
            shifted = model(input_ids=ids, position_ids=pos + 7).logits
            gapped = model(input_ids=ids, position_ids=gaps).logits
            assert (shifted - base).abs().max() <= 1e-5
            assert bool((gapped - base).abs().max() > 1e-3) is moves


def test_equal_scores_from_a_rotation_that_zeroes_q_and_k_still_fail():
    # Equal scores excuse no signal only beside a sound rotation: here the rotary module itself returns cos = sin = 0
    # (q and k zeroed by the position mechanism: a position bug), so default-init Zaya FAILs again.
    model = build("zaya")
    rotary = model.model.rotary_emb
    plain = rotary.forward
    rotary.forward = lambda *a, **k: tuple(t * 0 for t in plain(*a, **k))
    results = statuses(model, "zaya", ["positions", "shift"])
    assert {n: r.status for n, r in results.items()} == {"positions": Status.FAIL, "shift": Status.FAIL}, \
        {n: r.summary for n, r in results.items()}
