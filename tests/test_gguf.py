"""posdiag compare against llama.cpp: tiny HF models converted to GGUF here (tests/gguf_convert.py), run
through llama-cpp-python with all-position logits and an f32 KV cache. Healthy conversions PASS; each
planted port bug FAILs with its shape and, for a boundary, the boundary's name. Needs the `gguf` package
(the converter) and llama-cpp-python (the engine); without them these tests skip with the reason.
"""

import pytest
from gguf_convert import write_gguf
from sweep_support import pinned

from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing import zoo

gguf = pytest.importorskip("gguf", reason="the GGUF converter needs the gguf package: pip install -e '.[gguf]'")
llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -e '.[gguf]' "
                                                    "builds it from source, several minutes)")

from posdiag.ports.engines.llama_cpp import load_gguf  # noqa: E402
from posdiag.ports.logits import compare_engine  # noqa: E402

LINEAR = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 32}


def compare(tmp_path, model, plant=None, **kw):
    path = write_gguf(model, tmp_path / f"{model.config.model_type}-{plant or 'healthy'}.gguf", plant=plant)
    return compare_engine(from_module(model, name="reference"), load_gguf(str(path)), RunOptions(**kw)).result


@pytest.fixture(scope="module")
def llama():
    return zoo.tiny_model("llama", init="strong")


@pytest.mark.parametrize("family,overrides", [
    ("llama", {}),
    ("qwen2", {"use_sliding_window": False}),  # window declared, not used: as released Qwen2 configs
    ("gemma2", {}),                              # sliding window 8 on layer 0, crossed by the probe
    ("gpt2", {}),                                # learned position table
    ("llama", {"rope_parameters": LINEAR}),      # linear RoPE scaling, past the original context
])
def test_healthy_conversion_passes(tmp_path, family, overrides):
    result = compare(tmp_path, zoo.tiny_model(family, init="strong", **overrides))
    assert result.status is Status.PASS, result.summary
    assert result.details["engine"]["kv_cache"] == "f32"
    assert result.metrics["ratio"] <= 10
    if family == "gemma2":
        assert "sliding_window" in result.details["boundaries_crossed"]


@pytest.mark.parametrize("plant", ["qk_hf_layout", "freq_base"])
def test_position_bugs_grow_from_position_1(tmp_path, llama, plant):
    result = compare(tmp_path, llama, plant)
    assert result.status is Status.FAIL, result.summary
    assert result.details["pattern"] == "grows with position" and result.details["onset_position"] == 1
    assert result.metrics["position0_error"] <= result.metrics["tolerance"]


def test_weight_bug_is_uniform_from_position_0(tmp_path, llama):
    result = compare(tmp_path, llama, "norm_eps")
    assert result.status is Status.FAIL
    assert result.details["pattern"] == "uniform from position 0"


def test_missing_rope_scaling_key_grows_from_position_1(tmp_path):
    result = compare(tmp_path, zoo.tiny_model("llama", init="strong", rope_parameters=LINEAR), "no_rope_scaling")
    assert result.status is Status.FAIL and result.details["pattern"] == "grows with position"
    assert "original_context" in result.details["boundaries_crossed"]


def test_short_context_is_a_step_at_the_declared_context(tmp_path, llama):
    result = compare(tmp_path, llama, "short_context")
    assert result.status is Status.FAIL and result.details["pattern"] == "step at a length"
    assert result.details["onset_position"] == 64 and "engine context 64" in result.details["boundary"]


def test_dropped_sliding_window_is_a_step_at_the_window(tmp_path):
    result = compare(tmp_path, zoo.tiny_model("gemma2", init="strong"), "no_sliding_window")
    assert result.status is Status.FAIL and result.details["pattern"] == "step at a length"
    assert result.details["onset_position"] == zoo.SLIDING_WINDOW
    assert result.details["boundary"] == f"sliding_window {zoo.SLIDING_WINDOW}"


def test_llama_cpp_qwen2_has_no_sliding_window(tmp_path):
    """A finding about the engine, not a plant (the findings table's llama.cpp:qwen2, keyed by llama-cpp-python's
    version): llama.cpp's qwen2 graph attends to every key, so a Qwen2 that uses its window (use_sliding_window=True)
    differs from the window on."""
    result = compare(tmp_path, zoo.tiny_model("qwen2", init="strong"))
    if pinned(result, "llama.cpp:qwen2", "compare"):
        assert result.details["pattern"] == "step at a length"
        assert result.details["boundary"] == f"sliding_window {zoo.SLIDING_WINDOW}"


def compare_quantised(tmp_path, model, plant=None, qtype="Q8_0"):
    path = write_gguf(model, tmp_path / f"{model.config.model_type}-{qtype}-{plant or 'healthy'}.gguf",
                      plant=plant, qtype=qtype)
    return compare_engine(from_module(model, name="reference"), load_gguf(str(path)), RunOptions()).result


def test_quantised_healthy_conversion_passes_against_the_quantisations_own_error(tmp_path, llama):
    """The split of a quantised file: its F32 twin at float32 noise against PyTorch running the same dequantised
    weights (the reference with the file's weights swapped in: its rounding never widens the twin's tolerance),
    the file within the weights' rounding plus what quantisation adds."""
    result = compare_quantised(tmp_path, llama)
    assert result.status is Status.PASS, result.summary
    assert "position handling at float32 rounding" in result.summary and "what its quantisation adds" in result.summary
    assert "against PyTorch on the same dequantised weights" in result.summary
    assert result.details["layers"][0]["ratio"] <= 10  # float32 noise, not the weights' rounding (~1e4x that)
    floor = result.details["quantisation_floor"]
    assert floor["kind"] == "Q8_0" and 1e-3 < floor["median"] <= floor["max"] < 1.0  # measured, not float rounding
    split = result.details["quantisation_split"]
    assert split["weights_source"].startswith("the reference run with the file's dequantised weights (16 of 21")
    assert 1e-4 < split["weights_part_median"] < floor["median"] and split["foreign_tensors"] == []
    assert result.details["layers"][0]["name"] == "logits, F32 twin" and result.details["layers"][0]["pattern"] == \
        "none"
    assert result.metrics["tolerance"] == pytest.approx(10 * floor["median"])


@pytest.mark.parametrize("plant", ["qk_hf_layout", "freq_base"])
def test_quantised_position_bug_fails_grows_with_position(tmp_path, llama, plant):
    result = compare_quantised(tmp_path, llama, plant)
    assert result.status is Status.FAIL, result.summary
    assert result.details["pattern"] == "grows with position" and "grows with position" in result.summary
    assert result.details["first_layer"] == "logits, F32 twin"  # the twin: position handling alone
    if plant == "qk_hf_layout":  # rows in another layout are not a rounding of the reference's: not in the floor
        assert "blk.0.attn_q.weight" in result.details["quantisation_split"]["foreign_tensors"][0]


def test_quantisation_too_coarse_for_the_model_still_judges_position_handling_on_its_twin(tmp_path, llama):
    """Q4_0 on a 64-wide model: its own error is ~0.4 of the logits per position, so 10x of it could never be
    exceeded by the file's own line; its F32 twin still judges position handling at float32 noise (against PyTorch
    on the same weights), and the summary says what the file's line cannot show."""
    result = compare_quantised(tmp_path, llama, qtype="Q4_0")
    assert result.status is Status.PASS, result.summary
    assert result.details["layers"][0]["name"] == "logits, F32 twin" and result.details["layers"][0]["ratio"] <= 10
    assert "the file's own line can show nothing beyond its twin's" in result.summary
    assert "no bug could stand above it" in result.summary


def test_quantisation_too_coarse_with_a_position_bug_fails_on_its_twin(tmp_path, llama):
    """The same coarse Q4_0 file with its base rewritten: the file's line is too coarse, the twin is not."""
    result = compare_quantised(tmp_path, llama, plant="freq_base", qtype="Q4_0")
    assert result.status is Status.FAIL, result.summary
    assert result.details["first_layer"] == "logits, F32 twin"


def test_continuation_in_llama_cpp_is_judged_by_position(tmp_path, llama):
    result = compare(tmp_path, llama)
    assert result.status is Status.PASS and result.details["continued_from"] == 64
    continued = result.details["layers"][1]
    assert continued["name"] == "logits, continued from position 64" and continued["pattern"] == "none"
    assert "also continued from position 64" in result.summary


class FreshContinuation:
    """llama.cpp with a broken continuation: the tokens after the prefill run as a fresh sequence
    (positions from 0, the prefill's cache dropped)."""

    def __init__(self, engine):
        self.runner, self.engine = engine.impl, engine

    def logits(self, ids):
        return self.runner.logits(ids)

    def logits_continued(self, ids, split):
        import numpy as np

        return np.concatenate([self.runner.logits(ids[:split]), self.runner.logits(ids[split:])])


def test_continuation_restarting_at_0_fails_at_the_split(tmp_path, llama):
    from dataclasses import replace

    engine = load_gguf(str(write_gguf(llama, tmp_path / "llama.gguf")))
    result = compare_engine(from_module(llama, name="reference"), replace(engine, impl=FreshContinuation(engine)),
                            RunOptions()).result
    assert result.status is Status.FAIL
    assert result.summary.startswith("continued from position 64: error starts at position 64")
    assert result.details["boundary"] == "continuation 64"
