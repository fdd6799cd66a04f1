"""The `kernels` check never judges against a degenerate floor.

FlashAttention's rule, err(impl) <= 2 · err(eager) + atol, collapses to one unit roundoff where eager's
error is 0 or below one unit of the run dtype: that measures no rounding. Two ways it happened: the
reference was eager itself (VibeVoice-ASR: the float64 budget counted 690M parameters of tokenizer towers
its language-model forward never runs, so float32 was "the reference" and sdpa FAILed at 1.5e-7 against
6e-8), and a layer where float32 eager is within one unit of float64. The first is now budgeted by what a
streamed conversion holds (or a SKIP); the second is decided by the implementation re-run in float64.
"""

import sys
from pathlib import Path

import torch

import posdiag.checks.kernels.judging as judging
import posdiag.model.memory as memory
import posdiag.model.precision as precision
from posdiag.api import run_checks
from posdiag.checks.kernels.judging import Evidence, judge
from posdiag.checks.kernels.scenarios import Run, Scenario
from posdiag.model.loading import from_module
from posdiag.options import LoadOptions, RunOptions
from posdiag.results import Status
from posdiag.testing import zoo

sys.path.insert(0, str(Path(__file__).parent))
import plants_kernels as plants


def _kernels(model, implementations=None):
    subject = from_module(model, options=LoadOptions(upcast=False))
    options = RunOptions(check_options={"kernels": {"implementations": implementations}} if implementations else {})
    return run_checks(subject, ["kernels"], options).check("kernels")


def _with_unused_tower(model: torch.nn.Module) -> torch.nn.Module:
    """A tower of many small modules the text forward never calls, 40x the language model's weights."""
    model.tower = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(64))
    return model


def test_towers_never_run_do_not_deny_the_float64_reference(monkeypatch):
    model = _with_unused_tower(zoo.tiny_model("llama"))
    whole = precision.weight_bytes(from_module(model), torch.float64)
    monkeypatch.setattr(memory, "free_memory", lambda device: whole)  # a whole float64 copy does not fit
    result = _kernels(model)
    assert result.metrics["reference_dtype"] == "float64", result.summary
    assert result.status is Status.PASS, result.summary


def test_no_finer_reference_fitting_is_a_skip_not_eager_against_itself(monkeypatch):
    monkeypatch.setattr(memory, "free_memory", lambda device: 1024)
    result = _kernels(zoo.tiny_model("llama"))
    assert result.status is Status.SKIP, result.summary
    assert "no reference more precise than float32 fits" in result.summary


def _evidence(impl: torch.Tensor, impl64: torch.Tensor | None) -> Evidence:
    """One input, one layer past the embeddings: eager is the float64 reference rounded to float32 (its error
    ~3e-8, below float32's unit: a degenerate floor); `impl` in float32 and (re-run) `impl64` in float64."""
    subject = from_module(zoo.tiny_model("llama"))
    ref = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    emb = ref.float()
    names = ["embeddings", "block 1"]
    sc = Scenario("unpadded", torch.zeros(2, 6, dtype=torch.long), None, None, torch.ones(2, 6, dtype=torch.bool))
    ev = Evidence(subject, [sc], [Run([emb, ref.float()], None, names)], [Run([ref, ref], None, names)],
                  torch.float64, "one module at a time", {"eager": [Run([emb, ref.float()], None, names)],
                                                          "sdpa": [Run([emb, impl], None, names)]}, {}, {})
    ev.finer = {"sdpa": None if impl64 is None else [Run([ref, impl64], None, names)]}
    return ev


def _noise(ref: torch.Tensor, size: float) -> torch.Tensor:
    return ref * (1 + size * torch.randn(ref.shape, generator=torch.Generator().manual_seed(2), dtype=ref.dtype))


def test_rounding_over_a_degenerate_floor_is_decided_in_float64():
    ref = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    result = judge(_evidence(_noise(ref, 4e-7).float(), _noise(ref, 1e-15)))
    entry = result.details["implementations"]["sdpa"]["scenarios"]["unpadded"]
    assert entry["eager_error"] < 1.2e-7 < entry["error"]  # over FACTOR x eager + atol: a one-ulp floor
    assert result.status is Status.PASS, result.summary
    assert "rounding" in entry["arbitrated"]["block 1"]


def test_a_bug_over_a_degenerate_floor_stays_a_fail_in_float64():
    ref = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    result = judge(_evidence(_noise(ref, 1e-3).float(), _noise(ref, 1e-3)))
    assert result.status is Status.FAIL and "differs from eager" in result.summary
    assert "a bug" in result.details["implementations"]["sdpa"]["scenarios"]["unpadded"]["arbitrated"]["block 1"]


def test_a_degenerate_floor_that_cannot_be_decided_is_a_warn():
    ref = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    result = judge(_evidence(_noise(ref, 4e-7).float(), None))
    assert result.status is Status.WARN and result.summary.startswith("undecided: sdpa")


def test_arbitration_reruns_the_implementation_in_float64(monkeypatch):
    """Every floor taken as degenerate: sdpa off by 32 units of float32 passes (1.3e-6 in float32, 1.8e-8 in
    float64, where the reference's own float32 softmax is what is left), a wrong scale still fails."""
    monkeypatch.setattr(judging, "degenerate_floor", lambda floor, dtype: True)
    good = _kernels(zoo.tiny_model("llama"), [plants.register_rounding()])  # FAILs the 2x rule in float32 alone
    assert good.status is Status.PASS, good.summary
    decided = [s["arbitrated"] for s in good.details["implementations"][plants.ROUNDING]["scenarios"].values()]
    assert any(decided) and all("rounding" in reason for a in decided for reason in a.values())
    bad = _kernels(zoo.tiny_model("llama"), [plants.register_bad_scale()])
    assert bad.status is Status.FAIL and bad.metrics["implementation"] == plants.BAD_SCALE, bad.summary
    arbitrated = [s["arbitrated"] for s in bad.details["implementations"][plants.BAD_SCALE]["scenarios"].values()]
    assert any("a bug" in reason for a in arbitrated for reason in a.values())


def _measured(impl: torch.Tensor, impl64: torch.Tensor | None) -> Evidence:
    """As _evidence, with eager 1e-6 off the reference (a measured floor: tolerance 2e-6 + atol)."""
    ev = _evidence(impl, impl64)
    ref = ev.reference[0].hidden[1]
    eager = _noise(ref, 1e-6).float()
    ev.eager = [Run([ev.eager[0].hidden[0], eager], None, ev.eager[0].layer_names)]
    ev.runs["eager"] = ev.eager
    return ev


def test_rounding_over_a_measured_tolerance_is_decided_in_float64():
    """3x eager's error in float32 (1.5x the 2x rule) that falls back within the tolerance in float64: rounding."""
    ref = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    result = judge(_measured(_noise(ref, 3e-6).float(), _noise(ref, 1e-15)))
    entry = result.details["implementations"]["sdpa"]["scenarios"]["unpadded"]
    assert entry["ratio"] > 1 and entry["eager_error"] > 1.2e-7  # over a tolerance that measures rounding
    assert result.status is Status.PASS, result.summary
    assert "within the tolerance once the implementation runs in float64" in entry["arbitrated"]["block 1"]
    assert "decided in float64: sdpa, unpadded, block 1" in result.summary


def test_a_bug_over_a_measured_tolerance_stays_a_fail_in_float64_or_where_it_cannot_run():
    ref = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    bug = judge(_measured(_noise(ref, 1e-5).float(), _noise(ref, 1e-5)))  # 5x eager's error, in both dtypes
    assert bug.status is Status.FAIL, bug.summary
    assert "a bug (it stays over the tolerance in float64)" in bug.summary
    alone = judge(_measured(_noise(ref, 1e-5).float(), None))  # no float64 run: the measured FAIL stands
    assert alone.status is Status.FAIL, alone.summary


def test_a_rounding_plant_over_the_2x_rule_passes_and_a_wrong_scale_fails():
    """sdpa off by 32 units of float32 exceeds FlashAttention's 2x in float32 and falls back within it in float64
    (was a FAIL: only a degenerate floor was re-run); a wrong softmax scale stays over it there."""
    good = _kernels(zoo.tiny_model("llama"), [plants.register_rounding()])
    assert good.status is Status.PASS, good.summary
    decided = [s["arbitrated"] for s in good.details["implementations"][plants.ROUNDING]["scenarios"].values()]
    assert any(decided) and all("rounding" in reason for a in decided for reason in a.values())
    bad = _kernels(zoo.tiny_model("llama"), [plants.register_bad_scale()])
    assert bad.status is Status.FAIL and bad.metrics["implementation"] == plants.BAD_SCALE, bad.summary
    assert "in float64" in bad.summary and "a bug" in bad.summary
