"""The `table` check: capacity (clamp / wrap / too few rows), the edge of the context, offsets,
sinusoid formula and rotation property, health warnings. Planted bugs FAIL (or WARN where the
evidence is a heuristic), their healthy twins PASS, every zoo family PASSes or SKIPs."""

from __future__ import annotations

import math
from dataclasses import replace

import plants_table as P
import pytest
import torch
from sweep_rows import exhaustive

from posdiag.api import run_checks
from posdiag.checks import table as table_check
from posdiag.checks.table import sinusoid_report
from posdiag.model.loading import from_module, load_subject
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing import zoo

OFFSET = {"opt": 2, "bart": 2, "roberta": 2}


def table(model):
    """Run the check module directly; the forward count is recorded the way api.run_checks does."""
    subject = from_module(model)
    result = table_check.run(subject, RunOptions())
    return replace(result, forward_passes=subject.forward_count)


def parts(result, name):
    return result.details["parts"].get(name, [])


# ------------------------------------------------------------------ every family
@pytest.mark.parametrize("family", exhaustive(zoo.FAMILIES))
def test_zoo_family_passes_or_skips_with_reason(family):
    r = table(zoo.tiny_model(family))
    if zoo.position_kind(family) in ("learned", "sinusoidal"):
        assert r.status is Status.PASS, r.summary
        assert r.forward_passes <= 8
    else:
        assert r.status is Status.NA and r.summary, r.summary  # no table by design


# ------------------------------------------------------------------ capacity
@pytest.mark.parametrize("family", ["gpt2", "roberta", "bart"])
def test_clamped_table_fails_naming_first_bad_position_and_twin(family):
    r = table(P.clamp_rows(zoo.tiny_model(family), 100, OFFSET.get(family, 0)))
    assert r.status is Status.FAIL, r.summary
    cap = [p for p in parts(r, "capacity") if p["status"] == "fail"][0]
    assert (cap["first_bad_position"], cap["twin"], cap["pattern"]) == (100, 99, "clamp")
    assert "clamp" in r.summary and "100" in r.summary


def test_clamp_in_the_decoder_table_only_is_found_in_the_decoder_stack():
    r = table(P.clamp_rows(zoo.tiny_model("bart"), 90, 2, only="decoder"))
    assert r.status is Status.FAIL
    assert r.summary.startswith("decoder:") and "from 90 on" in r.summary
    enc = [p for p in parts(r, "capacity") if p["where"] == "encoder_"]
    assert enc and enc[0]["status"] == "pass"


@pytest.mark.parametrize("family", ["bert", "marian", "opt"])
def test_wrapping_table_fails(family):
    r = table(P.wrap_rows(zoo.tiny_model(family), 50, OFFSET.get(family, 0)))
    assert r.status is Status.FAIL, r.summary
    cap = [p for p in parts(r, "capacity") if p["status"] == "fail"][0]
    assert (cap["first_bad_position"], cap["twin"], cap["pattern"]) == (50, 0, "wrap")
    assert "modulo 50" in r.summary


def long_gpt2(rows: int = 4096):
    """Tiny GPT-2 declaring `rows` positions (a fresh N(0, 0.02) table; building the config with
    n_positions=4096 costs seconds of causal-buffer setup for nothing)."""
    model = zoo.tiny_model("gpt2")
    gen = torch.Generator().manual_seed(0)
    model.transformer.wpe = torch.nn.Embedding(rows, model.config.n_embd)
    with torch.no_grad():
        model.transformer.wpe.weight.copy_(torch.randn(rows, model.config.n_embd, generator=gen) * 0.02)
    model.config.n_positions = rows
    return model


def test_capacity_probe_over_a_long_context_is_one_forward():
    """4096 declared positions: rows of 64 position ids, one batched forward for all of them."""
    healthy = table(long_gpt2())
    assert healthy.status is Status.PASS, healthy.summary
    assert healthy.metrics["positions_probed"] == 4096
    assert healthy.metrics["capacity_forwards"] == 1
    assert healthy.forward_passes <= 5
    bad = table(P.clamp_rows(long_gpt2(), 3000))
    assert bad.status is Status.FAIL
    assert (bad.metrics["first_bad_position"], bad.metrics["twin"]) == (3000, 2999)


def test_table_with_fewer_rows_than_declared_fails():
    r = table(P.shrink_table(zoo.tiny_model("gpt2"), 100))
    assert r.status is Status.FAIL
    assert "100 rows" in r.summary and "100..127" in r.summary


# ------------------------------------------------------------------ zeroed and missing tables (files)
def test_zeroed_table_checkpoint_fails_and_warns_why(fixtures_dir):
    r = run_checks(load_subject(str(fixtures_dir / "gpt2-tiny-zeroed-wpe")), ["table"]).checks[0]
    assert r.status is Status.FAIL
    assert "no position signal" in r.summary
    assert any(h["status"] == "warn" and "zero" in h["message"] for h in parts(r, "health"))
    twin = run_checks(load_subject(str(fixtures_dir / "gpt2-tiny")), ["table"]).checks[0]
    assert twin.status is Status.PASS, twin.summary


def test_missing_table_fails_in_load_and_table_adds_evidence(fixtures_dir):
    report = run_checks(load_subject(str(fixtures_dir / "gpt2-tiny-missing-wpe")), ["load", "table"])
    load, tab = report.checks
    assert load.status is Status.FAIL
    assert tab.status is Status.WARN, tab.summary
    assert "not in the checkpoint" in tab.summary


@pytest.mark.parametrize("family", ["bert", "distilbert"])
def test_zeroed_table_in_memory_fails(family):
    r = table(P.zero_table(zoo.tiny_model(family)))
    assert r.status is Status.FAIL
    assert any("zero" in h["message"] for h in parts(r, "health"))


# ------------------------------------------------------------------ past the declared context
def test_healthy_table_raises_past_the_context():
    r = table(zoo.tiny_model("gpt2"))
    (b,) = parts(r, "beyond")
    assert b["status"] == "pass" and "IndexError" in b["message"]


def test_rows_past_the_declared_context_warn():
    model = zoo.tiny_model("gpt2")
    model.config.n_positions = 100  # the table keeps 128 rows
    r = table(model)
    assert r.status is Status.WARN, r.summary
    assert "128-row table" in r.summary


def test_clamp_at_the_declared_edge_warns_with_the_twin():
    r = table(P.clamp_rows(zoo.tiny_model("gpt2"), 128))  # in range it is healthy
    assert r.status is Status.WARN, r.summary
    assert "reused position 127" in r.summary


# ------------------------------------------------------------------ offsets
def test_roberta_port_ignoring_padding_offset_fails():
    r = table(P.roberta_ignoring_offset(zoo.tiny_model("roberta")))
    assert r.status is Status.FAIL
    offs = parts(r, "offsets")
    assert any(o.get("model_offset") == 0 for o in offs)
    assert any(o.get("matching_shift") == -2 for o in offs), offs


def test_opt_with_wrong_internal_offset_fails():
    r = table(P.opt_wrong_internal_offset(zoo.tiny_model("opt"), 1))
    assert r.status is Status.FAIL
    assert any(o.get("model_offset") == 1 for o in parts(r, "offsets"))


# ------------------------------------------------------------------ sinusoids
@pytest.mark.parametrize("build", ["marian", "distilbert_sin", "custom"])
def test_sinusoidal_table_overwritten_at_init_fails(build):
    from fixtures import custom_model

    if build == "custom":
        healthy, bad = custom_model.healthy(), P.randomize_custom_table(custom_model.healthy())
    else:
        kw = {"sinusoidal_pos_embds": True} if build == "distilbert_sin" else {}
        fam = "distilbert" if build == "distilbert_sin" else build
        healthy, bad = zoo.tiny_model(fam, **kw), P.randomize_table(zoo.tiny_model(fam, **kw))
    good = table(healthy)
    assert good.status is Status.PASS, good.summary
    layout = {"marian": "concatenated", "distilbert_sin": "interleaved", "custom": "interleaved"}[build]
    assert {p["layout"] for p in parts(good, "sinusoid")} == {layout}
    assert all(p["status"] == "pass" for p in parts(good, "sinusoid"))
    r = table(bad)
    assert r.status is Status.FAIL
    assert any(s["status"] == "fail" for s in parts(r, "sinusoid"))
    assert "not a sinusoid table" in r.summary


def _sinusoid(p, d, base=10000.0, layout="interleaved", dtype=torch.float64):
    pos = torch.arange(p, dtype=torch.float64)[:, None]
    theta = base ** (-2 * torch.arange(d // 2, dtype=torch.float64) / d)
    s, c = torch.sin(pos * theta), torch.cos(pos * theta)
    if layout == "interleaved":
        return torch.stack([s, c], -1).reshape(p, d).to(dtype)
    return torch.cat([s, c], -1).to(dtype)


@pytest.mark.parametrize("layout", ["interleaved", "concatenated"])
@pytest.mark.parametrize("base", [10000.0, 500.0])
def test_sinusoid_report_detects_layout_and_base(layout, base):
    rep = sinusoid_report(_sinusoid(512, 64, base, layout, torch.float32))
    assert rep["status"] is Status.PASS, rep["reason"]
    assert rep["layout"] == layout
    assert rep["base"] == pytest.approx(base, rel=1e-3)


def test_sinusoid_report_fails_when_rows_are_out_of_order_or_layout_mixed():
    good = _sinusoid(256, 32, dtype=torch.float32)
    perm = good.clone()
    perm[1:] = good[1:][torch.randperm(255, generator=torch.Generator().manual_seed(0))]
    assert sinusoid_report(perm)["status"] is Status.FAIL
    swapped = good.clone()
    swapped[:, 0::2], swapped[:, 1::2] = good[:, 1::2], good[:, 0::2]  # a legitimate cos-first layout
    rep = sinusoid_report(swapped)
    assert rep["status"] is Status.PASS and rep["layout"] == "interleaved (cos first)"
    mixed = good.clone()
    mixed[:, 1::2] = torch.sin(torch.arange(256.0)[:, None] * 0.37).expand(-1, 16)  # cos columns replaced
    assert sinusoid_report(mixed)["status"] is Status.FAIL


def test_rotation_property_residual_is_rounding_for_a_true_table():
    rep = sinusoid_report(_sinusoid(1024, 128, dtype=torch.float32))
    assert rep["rotation_residual"] <= 10 * rep["rotation_floor"]
    assert rep["formula_error"] < 1e-5 * math.sqrt(1024)


# ------------------------------------------------------------------ health heuristics (WARN only)
def test_fresh_looking_table_in_trained_looking_model_warns_not_fails():
    r = table(P.trained_looking_tokens(zoo.tiny_model("gpt2")))
    assert r.status is Status.WARN, r.summary
    assert "freshly initialised" in r.summary
    twin = table(P.smooth_table(P.trained_looking_tokens(zoo.tiny_model("gpt2"))))
    assert twin.status is Status.PASS, twin.summary


@pytest.mark.parametrize("family,init", [("bert", "default"), ("gpt2", "strong"), ("bart", "strong")])
def test_random_everywhere_models_do_not_trigger_the_fresh_init_warning(family, init):
    r = table(zoo.tiny_model(family, init=init))
    assert r.status is Status.PASS, r.summary
    assert not any(h["status"] == "warn" for h in parts(r, "health"))


def test_half_precision_run_is_never_a_false_verdict():
    """Kept in bf16 (no upcast): a healthy table is PASS or an inconclusive WARN, never FAIL;
    a clamp is reported (WARN, inconclusive in bf16) with its position, never PASS."""
    from posdiag.options import LoadOptions

    def run(model):
        subject = from_module(model, options=LoadOptions(upcast=False))
        return table_check.run(subject, RunOptions())

    good = run(zoo.tiny_model("gpt2", dtype=torch.bfloat16))
    # Measured: the closest healthy pair sits at ~93x the bfloat16 floor, inside the inconclusive band.
    assert good.status is Status.WARN, good.summary
    assert "inconclusive in bfloat16" in good.summary and "rerun in float32" in good.summary
    bad = run(P.clamp_rows(zoo.tiny_model("gpt2", dtype=torch.bfloat16), 100))
    assert bad.status is Status.WARN, bad.summary
    assert "indices clamp at 99" in bad.summary and "inconclusive in bfloat16" in bad.summary
    (cap,) = parts(bad, "capacity")
    assert (cap["first_bad_position"], cap["twin"], cap["pattern"]) == (100, 99, "clamp")


# ------------------------------------------------------------------ nothing reads as probed unless it was
def test_position_past_the_context_not_probed_on_a_device_is_a_skip_not_a_pass():
    """On CUDA an out-of-range lookup is a device-side assert: the part is a SKIP with the reason."""
    from types import SimpleNamespace

    from posdiag.checks.table.beyond import beyond
    from posdiag.checks.table.discovery import PositionTable

    cuda = SimpleNamespace(device=torch.device("cuda"))
    wpe = PositionTable("transformer.wpe.weight", "decoder", torch.zeros(128, 8), True)
    part = beyond(cuda, "decoder", 128, 0, True, [wpe], {}, "", "", 0)
    assert part.status is Status.SKIP and "not probed on cuda" in part.message


def test_a_skipped_part_is_named_in_the_pass_summary_never_counted_ok(monkeypatch):
    """Capacity passes, `beyond` was not probed: the check passes on what it probed and says what it did not."""
    from types import SimpleNamespace

    from posdiag.checks.table import beyond as beyond_module
    from posdiag.checks.table import stack

    real = beyond_module.beyond
    monkeypatch.setattr(stack, "beyond", lambda subject, *a: real(SimpleNamespace(device=torch.device("cuda")), *a))
    r = table(zoo.tiny_model("gpt2"))
    assert r.status is Status.PASS, r.summary
    assert "beyond" not in r.summary.split("; not probed")[0]
    assert "; not probed: position 128 not probed on cuda" in r.summary
    (b,) = parts(r, "beyond")
    assert b["status"] == "skip"


def test_a_check_whose_every_probe_was_skipped_is_a_skip(monkeypatch):
    """Only the health inspection passed (no zero or duplicate rows): nothing was probed, so no PASS."""
    from posdiag.checks.table.helpers import Part

    monkeypatch.setattr(table_check, "stack_parts", lambda *a, **k: [
        Part("offsets", Status.SKIP, "offsets not probed"), Part("capacity", Status.SKIP, "capacity not probed")])
    r = table(zoo.tiny_model("gpt2"))
    assert r.status is Status.SKIP, r.summary
    assert r.summary.startswith("offsets not probed")


def test_posdiag_bug_inside_a_probe_is_an_error_never_a_pass(monkeypatch):
    """An exception raised by posdiag's own code (here: a bad call of run_rows) is not the model refusing a
    position: the check raises, and the run reports an error."""
    import functools

    from posdiag.checks.table import beyond as beyond_module

    monkeypatch.setattr(beyond_module, "run_rows", functools.partial(beyond_module.run_rows, no_such_option=1))
    report = run_checks(from_module(zoo.tiny_model("gpt2")), ["table"])
    r = report.check("table")
    assert r.status is Status.ERROR, r.summary
    assert "TypeError" in r.summary


def test_the_model_refusing_a_position_inside_the_context_fails_naming_the_exception():
    """A model that raises at a position it declares fails capacity, naming the exception; past the context
    the same exception is then no evidence of a refusal (beyond is a SKIP, not a PASS)."""
    model = zoo.tiny_model("gpt2")

    def refuse(_module, args):
        if int(args[0].max()) >= 100:
            raise IndexError("position table lookup out of range")

    model.transformer.wpe.register_forward_pre_hook(refuse)
    r = table(model)
    assert r.status is Status.FAIL, r.summary
    (cap,) = parts(r, "capacity")
    assert cap["status"] == "fail" and "IndexError" in cap["message"]
    (b,) = parts(r, "beyond")
    assert b["status"] == "skip" and "as it did inside the declared context" in b["message"]
