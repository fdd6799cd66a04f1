"""kernels judges each SDPA backend on its own (pinned with torch.nn.attention.sdpa_kernel): on CPU the flash kernel
and math. A planted backend bug (one backend wrong on one input, the others right) FAILs naming that backend; a
backend that refuses an input is listed as not applicable with its reason, never as a pass."""

import plants_kernels as plants
import pytest
import torch

from posdiag.api import run_checks
from posdiag.checks.kernels.running import forward_each, implementation
from posdiag.checks.kernels.scenarios import build_scenarios
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing import zoo


def kernels(model):
    return run_checks(from_module(model), ["kernels"]).check("kernels")


def test_each_cpu_backend_is_judged():
    result = kernels(zoo.tiny_model("qwen2"))  # GQA and a sliding window; llama runs in the planted tests below
    assert result.status is Status.PASS, result.summary
    judged = result.details["implementations"]
    assert judged["sdpa[flash]"]["status"] == judged["sdpa[math]"]["status"] == "pass"
    assert set(judged["sdpa[math]"]["scenarios"]) == set(result.details["scenarios"])
    assert result.details["not_run"]["sdpa[cudnn]"] == result.details["not_run"]["sdpa[efficient]"] == "a CUDA kernel"
    assert "sdpa[flash], sdpa[math] agree with eager" in result.summary


@pytest.mark.parametrize("backend", ["math", "flash"])
def test_one_backend_wrong_on_padded_inputs_fails_naming_it(backend):
    other = {"math": "flash", "flash": "math"}[backend]
    with plants.perturb_one_backend(backend):
        result = kernels(zoo.tiny_model("llama"))
    assert result.status is Status.FAIL, result.summary
    assert result.summary.startswith(f"sdpa[{backend}] differs from eager on the left-padded input"), result.summary
    judged = result.details["implementations"]
    assert judged[f"sdpa[{backend}]"]["scenarios"]["left-padded"]["status"] == "fail"
    assert judged[f"sdpa[{backend}]"]["scenarios"]["unpadded"]["status"] == "pass"
    assert judged[f"sdpa[{other}]"]["status"] == "pass"


def test_a_backend_that_refuses_an_input_is_not_applicable_never_a_pass(monkeypatch):
    """Flash on CUDA refuses an explicit mask: here the CPU flash kernel is made to refuse the padded inputs the way
    torch does (RuntimeError 'No available kernel', the reason in a UserWarning)."""
    import warnings

    real = torch.nn.functional.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, *args, **kwargs):
        if attn_mask is not None and not torch.backends.cuda.math_sdp_enabled():
            warnings.warn("Flash attention does not support non-null attn_mask.", UserWarning, stacklevel=2)
            raise RuntimeError("No available kernel. Aborting execution.")
        return real(query, key, value, attn_mask, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    result = kernels(zoo.tiny_model("llama"))
    flash = result.details["implementations"]["sdpa[flash]"]
    # the decode chunks are handed a mask too (q_len != k_len): only the unpadded prefill runs on flash
    assert set(flash["not_applicable"]) == {"left-padded", "decode", "decode left-padded"}
    assert "does not support non-null attn_mask" in flash["not_applicable"]["left-padded"]
    assert set(flash["scenarios"]) == {"unpadded"}
    assert result.status is Status.PASS, result.summary  # what ran passed; the refusals are listed, not passed
    assert "not applicable: sdpa[flash] on left-padded, decode, decode left-padded" in result.summary


def test_forward_each_runs_every_input_when_nothing_refuses():
    subject = from_module(zoo.tiny_model("llama"))
    scenarios = build_scenarios(subject, RunOptions())
    with implementation(subject, "sdpa[math]"):
        runs, refused = forward_each(subject, scenarios, pinned=True)
    assert not refused and all(r is not None for r in runs) and len(runs) == len(scenarios)


def test_a_default_flex_run_this_machine_cannot_compile_is_not_run_never_a_skip(monkeypatch):
    """On CUDA flex_attention is in the default set; when its compiler fails there it is listed as not run, and the
    check keeps the verdict of what ran (asked for with --impl, the same failure is a skip)."""
    import posdiag.checks.kernels as kernels_check
    from posdiag.checks.kernels.running import Outcome

    monkeypatch.setattr(kernels_check, "run_isolated", lambda *a: Outcome(kind="unavailable", reason="no compiler"))
    subject = from_module(zoo.tiny_model("llama"))
    scenarios = build_scenarios(subject, RunOptions())
    not_run: dict[str, str] = {}
    runs, _, _ = kernels_check._run_implementations(subject, ["sdpa[math]", "flex_attention"], scenarios, not_run)
    assert not_run == {"flex_attention": "no compiler"} and set(runs) == {"sdpa[math]"}
    runs, _, _ = kernels_check._run_implementations(subject, ["flex_attention"], scenarios, None)
    assert runs == {"flex_attention": "no compiler"}  # asked for: judged as not run (a skip)
