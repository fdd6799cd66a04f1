"""The `kernels` check: every attention implementation agrees with eager by FlashAttention's rule.

Healthy families PASS (or SKIP when the family refuses sdpa) in float32 and bfloat16; planted
kernels (tests/plants_kernels.py) FAIL: an sdpa path that drops the padding mask, a fused path with
a wrong scale, NaN in fully masked rows leaking into valid tokens. Falcon with alibi=True FAILs at
default init up to transformers 5.24: a real bug (eager adds ALiBi twice, see test_falcon_alibi_*), fixed in 5.25,
where it PASSes.
"""

import sys
from pathlib import Path

import pytest
import torch
from sweep_rows import CORE_FAMILIES, exhaustive
from sweep_support import pinned

from posdiag.api import run_checks
from posdiag.model.loading import from_module
from posdiag.options import LoadOptions, RunOptions
from posdiag.results import Status
from posdiag.testing import zoo

sys.path.insert(0, str(Path(__file__).parent))
import plants_kernels as plants

EAGER_ONLY = {"gemma2", "gpt_neo", "bloom", "mpt"}


def kernels(model, implementations=None, **load):
    subject = from_module(model, options=LoadOptions(upcast=False, **load))
    options = RunOptions(check_options={"kernels": {"implementations": implementations}} if implementations else {})
    return run_checks(subject, ["kernels"], options).check("kernels")


@pytest.mark.parametrize("family", exhaustive(zoo.FAMILIES, CORE_FAMILIES | EAGER_ONLY | {"falcon_alibi"}))
def test_every_family_passes_or_says_why(family):
    result = kernels(zoo.tiny_model(family))
    if family in EAGER_ONLY:
        assert result.status is Status.SKIP and "eager only" in result.summary
    elif family == "falcon_alibi" and pinned(result, "zoo:falcon_alibi", "kernels"):
        pass  # real bug, see test_falcon_alibi_eager_adds_alibi_twice
    else:
        assert result.status is Status.PASS, result.summary
        assert result.metrics["ratio"] <= 1.0
        assert result.forward_passes <= 19  # 18 + the two-token probe asking whether the model keeps a KV cache


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "gemma3", "bert", "t5"])
def test_healthy_bfloat16_passes_without_upcast(family):
    result = kernels(zoo.tiny_model(family, dtype=torch.bfloat16))
    assert result.status is Status.PASS, result.summary
    assert result.metrics["reference_dtype"] == "float64"
    assert 1e-3 < result.metrics["eager_error"] < 3e-2  # bf16 rounding, measured in the same run


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2", "falcon_rope", "bert"])
def test_sdpa_without_padding_mask_fails(family):
    model = zoo.tiny_model(family)
    plants.drop_padding_mask(model)
    result = kernels(model)
    assert result.status is Status.FAIL, result.summary
    # the first input it fails on, whatever rounding makes the largest ratio (qwen2: the dropped mask also carried
    # the sliding window, so the unpadded input fails too)
    first = "unpadded" if family == "qwen2" else "left-padded"
    assert result.metrics["scenario"] == first and f"on the {first} input" in result.summary, result.summary
    assert result.metrics["ratio"] > 100
    # the unpadded input alone would not have caught it
    if family != "qwen2":
        for backend in ("sdpa[flash]", "sdpa[math]"):  # each pinned SDPA backend, judged on its own
            assert result.details["implementations"][backend]["scenarios"]["unpadded"][
                "first_layer_over_tolerance"] is None


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_sdpa_without_padding_mask_fails_in_bfloat16(family):
    model = zoo.tiny_model(family, dtype=torch.bfloat16)
    plants.drop_padding_mask(model)
    assert kernels(model).status is Status.FAIL


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert", "t5"])
def test_wrong_scale_fails_and_registered_copy_passes(family):
    bad = kernels(zoo.tiny_model(family), [plants.register_bad_scale()])
    assert bad.status is Status.FAIL, bad.summary
    assert bad.metrics["implementation"] == plants.BAD_SCALE and bad.metrics["ratio"] > 100
    good = kernels(zoo.tiny_model(family), [plants.register_sdpa_copy()])
    assert good.status is Status.PASS, good.summary


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_a_kernel_bug_in_bfloat16_only_fails_naming_the_dtype(family):
    """The padding mask dropped on half-precision inputs only: far past the tolerance as bfloat16 runs, gone in the
    float64 re-run, which alone would call it rounding. Rounding stays within the agreement band as run (healthy, below;
    32 units of float32 noise, test_kernels_floor); this does not. The same plant in float32 is no bug: PASS."""
    plant = plants.register_half_only_mask_drop()
    bad = kernels(zoo.tiny_model(family, dtype=torch.bfloat16), [plant])
    assert bad.status is Status.FAIL, bad.summary
    assert bad.metrics["implementation"] == plant and "a bug in bfloat16 only" in bad.summary, bad.summary
    assert kernels(zoo.tiny_model(family), [plant]).status is Status.PASS
    assert kernels(zoo.tiny_model(family, dtype=torch.bfloat16), [plants.register_sdpa_copy()]).status is Status.PASS


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_nan_in_fully_masked_rows_that_leaks_fails(family):
    result = kernels(zoo.tiny_model(family), [plants.register_nan_rows()])
    assert result.status is Status.FAIL
    assert "NaN/Inf at valid positions" in result.summary and "block 2" in result.summary


def test_padding_rows_are_reported_as_information():
    result = kernels(zoo.tiny_model("llama"))
    padded = result.details["implementations"]["sdpa[flash]"]["scenarios"]["left-padded"]
    assert padded["padding_rows"] == "finite"  # measured: SDPA leaves finite values in Llama's padding rows
    assert padded["top1_agreement"] == 1.0 and padded["kl"] < 1e-9


def test_falcon_alibi_eager_adds_alibi_twice():
    """transformers <= 5.24: FalconModel folds alibi/sqrt(head_dim) into the mask, and FalconAttention's eager
    branch adds alibi again before scaling: eager sees 2·alibi/sqrt(d), sdpa alibi/sqrt(d). Removing the
    mask's copy from eager reproduces sdpa to rounding, so the kernels FAIL is a true finding. 5.25 moved Falcon to
    the shared attention functions (the mask alone carries ALiBi): there eager and sdpa agree and kernels PASSes."""
    model = zoo.tiny_model("falcon_alibi")
    result = kernels(model)
    if not pinned(result, "zoo:falcon_alibi", "kernels"):
        return
    assert result.metrics["ratio"] > 100
    sdpa = zoo.tiny_model("falcon_alibi")
    sdpa.config._attn_implementation_internal = "sdpa"
    ids = torch.randint(5, 250, (2, 24), generator=torch.Generator().manual_seed(0))

    def mask_without_alibi(module, args, kwargs):
        m = kwargs["attention_mask"]
        kwargs["attention_mask"] = torch.where(m < -1, torch.finfo(m.dtype).min, 0.0).to(m.dtype)
        return args, kwargs

    with torch.inference_mode():
        want = sdpa(input_ids=ids).logits
        for layer in model.transformer.h:
            layer.register_forward_pre_hook(mask_without_alibi, with_kwargs=True)
        once = model(input_ids=ids).logits
    assert ((once - want).norm() / want.norm()).item() < 1e-5


def test_config_is_restored_after_each_implementation():
    model = zoo.tiny_model("llama")
    kernels(model, [plants.register_bad_scale(), "sdpa"])
    assert model.config._attn_implementation == "eager"


def test_factory_models_skip():
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(32, 8)

        def forward(self, input_ids, attention_mask=None, position_ids=None):
            return self.emb(input_ids)

    result = run_checks(from_module(Tiny()), ["kernels"]).check("kernels")
    assert result.status is Status.NA  # one attention path by design: nothing to compare


def test_streamed_reference_restores_the_model_exactly():
    """The higher-precision reference converts one module at a time and back: weights bit-identical after."""
    from posdiag.model.precision import streamed_dtype

    model = zoo.tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(4, 200, (1, 12))
    with streamed_dtype(model, torch.float64), torch.inference_mode():
        out = model(ids, output_hidden_states=True)
    assert out.hidden_states[-1].dtype == torch.float64
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_streamed_reference_equals_whole_model_conversion(family, monkeypatch):
    """Embedding outputs converted instead of tables, and linear layers computed from row slices
    (forced here on every linear layer), give the same float64 function as converting the model."""
    import posdiag.model.precision as precision

    monkeypatch.setattr(precision, "SLICE_BYTES", 64 * 8 * 5)  # slices of a few rows, a ragged last one
    model = zoo.tiny_model(family)
    ids = torch.randint(4, 200, (2, 12))
    with precision.streamed_dtype(model, torch.float64), torch.inference_mode():
        streamed = model(ids, output_hidden_states=True).hidden_states
    sliced = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert sliced and all("forward" not in vars(m) for m in sliced)  # the swap is undone
    with precision.as_dtype(model, torch.float64, torch.float32), torch.inference_mode():
        whole = model(ids, output_hidden_states=True).hidden_states
    assert len(streamed) == len(whole)
    for s, w in zip(streamed, whole, strict=True):
        assert s.dtype == torch.float64
        torch.testing.assert_close(s, w, rtol=1e-13, atol=1e-13)


def test_scratch_buffer_behind_an_output_is_not_reused():
    """A module returning a view of its converted weight keeps that copy: a later module of the same
    shape must not overwrite it."""
    from posdiag.model.precision import streamed_dtype

    class Table(torch.nn.Module):
        def __init__(self, value: float):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.full((4, 3), value))

        def forward(self, x):
            return self.weight[: x.shape[0]]

    first, second = Table(1.0), Table(2.0)
    with streamed_dtype(torch.nn.Sequential(first, second), torch.float64), torch.inference_mode():
        a = first(torch.zeros(2))
        b = second(torch.zeros(2))
    assert a.dtype == torch.float64 and torch.all(a == 1.0) and torch.all(b == 2.0)
    assert first.weight.dtype == torch.float32


# ------------------------------------------------------------------ implementations in a child process
@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    zoo.tiny_model("llama").save_pretrained(path)
    return path


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_prefills_stand_for_the_unpadded_and_left_padded_inputs(family):
    """The decode inputs' prefills are the unpadded and left-padded inputs: fed once, they give the runs a forward of
    each alone gives (4 forwards per implementation, not 6)."""
    from posdiag.checks.kernels.running import forward, forward_all
    from posdiag.checks.kernels.scenarios import build_scenarios

    subject = from_module(zoo.tiny_model(family))
    scenarios = build_scenarios(subject, RunOptions(seq_len=16))
    assert [sc.prefill_as for sc in scenarios] == ["", "", "unpadded", "left-padded"]
    start = subject.forward_count
    shared = forward_all(subject, scenarios)
    assert subject.forward_count - start == 4
    for sc, got in zip(scenarios, shared, strict=True):
        alone = forward(subject, sc)
        assert got.layer_names == alone.layer_names
        for x, y in zip(got.hidden, alone.hidden, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-6)


def test_isolated_run_matches_the_same_implementation_in_process(saved_llama):
    """The child reloads the checkpoint with the same options: same weights, same numbers."""
    from posdiag.checks.kernels.isolated import run_isolated
    from posdiag.checks.kernels.running import run_here
    from posdiag.checks.kernels.scenarios import build_scenarios
    from posdiag.model.loading import load_subject

    subject = load_subject(str(saved_llama), LoadOptions())
    scenarios = build_scenarios(subject, RunOptions(seq_len=16))
    here, there = run_here(subject, "sdpa", scenarios), run_isolated(subject, "sdpa", scenarios)
    assert here.runs is not None and there.runs is not None, there.reason
    assert len(there.runs) == len(scenarios)
    for a, b in zip(here.runs, there.runs, strict=True):
        assert a.layer_names == b.layer_names
        for x, y in zip(a.hidden, b.hidden, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-6)


def test_implementation_killing_its_process_fails_and_report_is_written(saved_llama, monkeypatch):
    """A segfault in a kernel is a finding, reported: the parent survives it."""
    import posdiag.checks.kernels as kernels
    import posdiag.checks.kernels.isolated as isolated
    from posdiag.model.loading import load_subject

    monkeypatch.setattr(isolated, "CHILD_COMMAND",
                        (sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"))
    monkeypatch.setattr(isolated, "ISOLATED", frozenset({"sdpa[math]"}))
    monkeypatch.setattr(kernels, "ISOLATED", frozenset({"sdpa[math]"}))
    subject = load_subject(str(saved_llama), LoadOptions())
    result = run_checks(subject, ["kernels"], RunOptions(seq_len=16)).check("kernels")
    assert result.status is Status.FAIL
    assert "SIGSEGV" in result.summary and "sdpa[math]" in result.summary


def test_toolchain_failure_is_a_skip_and_other_exceptions_fail(monkeypatch):
    """A compiler error of this machine says nothing about the model; any other exception does."""
    import posdiag.checks.kernels.running as running

    class InductorError(RuntimeError):
        pass

    subject = from_module(zoo.tiny_model("llama"))
    original = running.forward_all

    def failing(error):
        def forward_all(subject, scenarios):
            if subject.model.config._attn_implementation == "sdpa":
                raise error
            return original(subject, scenarios)
        return forward_all

    monkeypatch.setattr(running, "forward_all", failing(InductorError("CppCompileError: C++ compile error")))
    skipped = run_checks(subject, ["kernels"], RunOptions(seq_len=16)).check("kernels")
    assert skipped.status is Status.SKIP and "could not be compiled" in skipped.summary
    monkeypatch.setattr(running, "forward_all", failing(IndexError("index 17 is out of bounds")))
    failed = run_checks(subject, ["kernels"], RunOptions(seq_len=16)).check("kernels")
    assert failed.status is Status.FAIL and "IndexError" in failed.summary


def test_isolated_implementation_on_an_in_memory_model_says_why():
    subject = from_module(zoo.tiny_model("llama"))
    result = run_checks(subject, ["kernels"],
                        RunOptions(seq_len=16,
                                   check_options={"kernels": {"implementations": ["flex_attention"]}})).check("kernels")
    assert result.status is Status.SKIP and "in-memory model" in result.summary


# ------------------------------------------------------------------ offloaded models (--device-map)
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.mark.parametrize("max_memory", ["cpu=0", "cpu=250KB"])  # all on disk; embeddings in memory, rest on disk
def test_offloaded_model_gets_the_same_float64_reference(max_memory):
    """accelerate loads offloaded weights inside the module's forward: the reference converts them
    after that load (and restores before they are dropped), giving the same numbers as in memory."""
    from posdiag.model.loading import load_subject

    plain = run_checks(load_subject(str(FIXTURES / "llama-tiny"), LoadOptions()), ["kernels"]).check("kernels")
    subject = load_subject(str(FIXTURES / "llama-tiny"), LoadOptions(device_map="auto", max_memory=max_memory))
    offloaded = run_checks(subject, ["kernels"]).check("kernels")
    assert offloaded.status is Status.PASS == plain.status
    assert offloaded.metrics["reference_dtype"] == "float64"
    assert offloaded.metrics["ratio"] == pytest.approx(plain.metrics["ratio"], rel=1e-9)
    assert all(p.device.type == "meta" for n, p in subject.model.named_parameters() if n.startswith("model.layers"))


def test_offloaded_model_with_planted_kernel_bug_fails():
    from posdiag.model.loading import load_subject

    subject = load_subject(str(FIXTURES / "llama-tiny"), LoadOptions(device_map="auto", max_memory="cpu=0"))
    plants.drop_padding_mask(subject.model)
    result = run_checks(subject, ["kernels"]).check("kernels")
    assert result.status is Status.FAIL and "left-padded" in result.summary


def test_offloaded_model_without_a_module_by_module_reference_skips():
    """T5's feed-forward reads its child's weight dtype: only a whole-block conversion works, which
    a dispatched model cannot get. No reference, no verdict."""
    from posdiag.model.loading import load_subject

    in_memory = run_checks(load_subject(str(FIXTURES / "t5-tiny"), LoadOptions()), ["kernels"]).check("kernels")
    assert in_memory.status is Status.PASS and "one block at a time" in in_memory.details["reference"]
    subject = load_subject(str(FIXTURES / "t5-tiny"), LoadOptions(device_map="auto", max_memory="cpu=0"))
    result = run_checks(subject, ["kernels"]).check("kernels")
    assert result.status is Status.SKIP and "offloaded" in result.summary


# ------------------------------------------------------------------ when float64 cannot run
def tiny_mixtral() -> torch.nn.Module:
    return zoo.tiny_model_of_type("mixtral")


def test_moe_reference_runs_its_experts_in_the_eager_loop():
    """grouped_mm (MoE experts) has no float64 kernel: the reference switches the experts to
    transformers' eager loop instead of crashing the check; the model is restored afterwards."""
    model = tiny_mixtral()
    before = model.get_experts_implementation()
    result = run_checks(from_module(model), ["kernels"]).check("kernels")
    assert result.status is Status.PASS, result.summary
    assert result.metrics["reference_dtype"] == "float64" and "eager loop" in result.details["reference"]
    assert model.get_experts_implementation() == before


def test_moe_with_planted_kernel_bug_fails():
    model = tiny_mixtral()
    plants.drop_padding_mask(model)
    assert run_checks(from_module(model), ["kernels"]).check("kernels").status is Status.FAIL


def _refuses_float64(model: torch.nn.Module) -> torch.nn.Module:
    def hook(module, args):
        if args and isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float64:
            raise RuntimeError("no float64 kernel for this op")
    model.model.norm.register_forward_pre_hook(hook)
    return model


def test_no_reference_more_precise_than_the_run_is_a_skip():
    result = run_checks(from_module(_refuses_float64(zoo.tiny_model("llama"))), ["kernels"]).check("kernels")
    assert result.status is Status.SKIP and "no reference more precise than float32" in result.summary


def test_bfloat16_model_falls_back_to_a_float32_reference():
    model = _refuses_float64(zoo.tiny_model("llama").to(torch.bfloat16))
    result = run_checks(from_module(model, options=LoadOptions(upcast=False)), ["kernels"]).check("kernels")
    assert result.status is Status.PASS and result.metrics["reference_dtype"] == "float32"


def _reference_differs(model: torch.nn.Module, when) -> torch.nn.Module:
    """The float64 run computes something else (as Zamba2's did on padded inputs) where `when(output)`."""
    def hook(module, args, output):
        if output.dtype == torch.float64 and when(output):
            return output + 1.0
    model.model.norm.register_forward_hook(hook)
    return model


def test_reference_that_is_not_the_same_function_is_not_judged():
    """Both eager and sdpa 1.4 off the reference used to pass the 2x rule; now those inputs are not
    judged (WARN), and with none left the check skips."""
    partly = _reference_differs(zoo.tiny_model("llama"), lambda out: out.shape[1] > 20)  # full-length inputs only
    result = run_checks(from_module(partly), ["kernels"], RunOptions(seq_len=32)).check("kernels")
    assert result.status is Status.WARN and "not judged: unpadded, left-padded" in result.summary
    wholly = _reference_differs(zoo.tiny_model("llama"), lambda out: True)
    result = run_checks(from_module(wholly), ["kernels"], RunOptions(seq_len=32)).check("kernels")
    assert result.status is Status.SKIP and "not the same function" in result.summary
