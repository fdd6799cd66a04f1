"""posdiag compare against engines (logits-only candidates), through the protocol and the factory adapter.

No llama.cpp needed: the engines wrap PyTorch models behind `logits(ids) -> [T, V]`. Planted bugs
must FAIL with the right shape, their healthy twins PASS; bad engines are one-line errors (exit 2).
"""

import numpy as np
import pytest
import torch
from engines_demo import TorchEngine
from plants_compare import copy_of, interleave_qk, wrong_norm_eps
from typer.testing import CliRunner

from posdiag.cli import app
from posdiag.errors import PosdiagError
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.ports.engines.logits_only import as_engine, is_engine
from posdiag.ports.logits import compare_engine
from posdiag.ports.logits.shapes import classify
from posdiag.results import Status
from posdiag.testing import zoo


def run(ref, engine, **kw):
    return compare_engine(from_module(ref, name="reference"), as_engine(engine, "engine"), RunOptions(**kw))


@pytest.fixture(scope="module")
def llama():
    return zoo.tiny_model("llama", init="strong")


def test_healthy_engine_passes(llama):
    result = run(llama, TorchEngine(copy_of(llama), "copy")).result
    assert result.status is Status.PASS, result.summary
    assert "within float32 rounding" in result.summary


def test_position_bug_grows_from_position_1(llama):
    comparison = run(llama, TorchEngine(interleave_qk(llama), "interleaved"))
    result, profile = comparison.result, comparison.profiles[0]
    assert result.status is Status.FAIL
    assert result.details["pattern"] == "grows with position" and result.details["onset_position"] == 1
    assert profile.per_position[0] <= profile.tolerance < profile.per_position[1]
    assert "error grows with position from 1" in result.summary


def test_weight_bug_is_uniform_from_position_0(llama):
    result = run(llama, TorchEngine(wrong_norm_eps(llama, 1e-2), "eps")).result
    assert result.status is Status.FAIL
    assert result.details["pattern"] == "uniform from position 0"
    assert result.metrics["position0_error"] > result.metrics["tolerance"]


def test_dropped_sliding_window_is_a_step_at_the_window():
    ref = zoo.tiny_model("qwen2", init="strong")
    no_window = zoo.tiny_model("qwen2", init="strong", use_sliding_window=False)
    no_window.load_state_dict(ref.state_dict())
    comparison = run(ref, TorchEngine(no_window, "no window"))
    result = comparison.result
    assert result.status is Status.FAIL
    assert result.details["pattern"] == "step at a length"
    assert result.details["onset_position"] == zoo.SLIDING_WINDOW
    assert result.details["boundary"] == f"sliding_window {zoo.SLIDING_WINDOW}"
    assert result.details["boundaries_crossed"]["sliding_window"] == zoo.SLIDING_WINDOW
    # the healthy twin: the same model with its window
    assert run(ref, TorchEngine(copy_of(ref), "copy")).result.status is Status.PASS


class ShortContext(TorchEngine):
    context_length = 64


def test_engine_context_shorter_than_the_reference_is_a_step(llama):
    result = run(llama, ShortContext(copy_of(llama), "short")).result
    assert result.status is Status.FAIL
    assert result.details["onset_position"] == 64 and result.details["covered_positions"] == 64
    assert "engine context 64" in result.details["boundary"]


def test_default_length_runs_past_the_window():
    ref = zoo.tiny_model("qwen2", init="strong", max_position_embeddings=4096, sliding_window=600)
    engine = TorchEngine(copy_of(ref), "copy")
    comparison = compare_engine(from_module(ref), as_engine(engine, "e"), RunOptions())
    assert comparison.seq_len > 600 and "sliding_window" in comparison.result.details["boundaries_crossed"]


def test_classify_shapes_on_synthetic_profiles():
    tol = 1e-6
    grows = torch.tensor([0.0] + [1e-3 * t for t in range(1, 64)], dtype=torch.float64)
    assert classify(grows, tol, {})["pattern"] == "grows with position"
    step = torch.tensor([1e-8] * 32 + [1e-2] * 32, dtype=torch.float64)
    out = classify(step, tol, {"original_context": 32})
    assert out["pattern"] == "step at a length" and out["boundary"] == "original_context 32"
    assert classify(torch.full((64,), 1e-2, dtype=torch.float64), tol, {})["pattern"] == "uniform from position 0"
    assert classify(torch.full((64,), 1e-8, dtype=torch.float64), tol, {})["pattern"] == "none"


def test_protocol_accepts_torch_and_numpy_and_rejects_others(llama):
    class Torchy:
        def logits(self, ids):
            return torch.zeros(1, len(ids), 256)

    assert as_engine(Torchy(), "t").run([1, 2, 3]).shape == (3, 256)
    assert is_engine(Torchy()) and not is_engine(llama) and not is_engine(object())
    with pytest.raises(PosdiagError, match="protocol"):
        as_engine(type("Flat", (), {"logits": lambda self, ids: np.zeros(len(ids))})(), "f").run([1, 2])
    with pytest.raises(PosdiagError, match="an engine is"):
        as_engine(llama, "module")


def test_cli_engine_factories(monkeypatch):
    runner = CliRunner()
    healthy = runner.invoke(app, ["compare", "engines_demo:reference", "engines_demo:healthy", "-q"])
    assert healthy.exit_code == 0, healthy.output
    bug = runner.invoke(app, ["compare", "engines_demo:reference", "engines_demo:rotary_layout", "-q"])
    assert bug.exit_code == 1 and "error grows with position from 1" in bug.output
    for bad in ("engines_demo:wrong_shape", "engines_demo:not_an_engine"):
        out = runner.invoke(app, ["compare", "engines_demo:reference", bad])
        assert out.exit_code == 2 and "Traceback" not in out.output
    help_text = runner.invoke(app, ["compare", "--help"], env={"COLUMNS": "200"}).output
    assert "logits(ids" in help_text and ".gguf" in help_text


def test_gguf_converter_writes_what_the_reader_reads(tmp_path, llama):
    """Runs without llama.cpp: the converter's keys and the q/k row permutation, read back with gguf."""
    gguf = pytest.importorskip("gguf", reason="the GGUF converter needs the gguf package")
    from gguf_convert import write_gguf

    from posdiag.model.gguf_file import inspect_file

    healthy = write_gguf(llama, tmp_path / "h.gguf")
    planted = write_gguf(llama, tmp_path / "p.gguf", plant="freq_base")
    info = inspect_file(str(healthy))
    assert info.metadata["llama.context_length"] == 128 and info.metadata["llama.rope.freq_base"] == 10000.0
    assert info.type_counts == {"F32": 21}
    assert inspect_file(str(planted)).metadata["llama.rope.freq_base"] == 500000.0
    q = {t.name: t for t in gguf.GGUFReader(str(healthy)).tensors}["blk.0.attn_q.weight"]
    hf = llama.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    data = np.asarray(q.data).reshape(hf.shape)
    # head 0, rotary pair 1: HF rows 1 and 1 + d/2 become adjacent rows 2 and 3
    assert np.array_equal(data[2], hf[1]) and np.array_equal(data[3], hf[1 + 8])


def test_continuation_restarting_positions_fails_at_the_split(llama):
    from engines_demo import RestartingEngine

    result = run(llama, RestartingEngine(copy_of(llama), "restarts")).result
    assert result.status is Status.FAIL
    assert result.summary.startswith("continued from position 64: error starts at position 64")
    assert result.details["boundary"] == "continuation 64" and result.details["pattern"] == "step at a length"
    assert result.details["layers"][0]["pattern"] == "none"  # the all-at-once run is healthy
    # the healthy twin: the same continuation with positions carried on
    healthy = run(llama, TorchEngine(copy_of(llama), "copy")).result
    assert healthy.status is Status.PASS and healthy.details["continued_from"] == 64
    assert "also continued from position 64" in healthy.summary


class Quantised(TorchEngine):
    quantization = "Q8_0"


def test_quantised_engine_without_a_file_is_inconclusive_and_says_why(llama):
    result = run(llama, Quantised(interleave_qk(llama), "q")).result
    assert result.status is Status.WARN
    assert "this engine cannot run another file" in result.summary and "grows with position" in result.summary


def test_quantised_floor_needs_a_converter_for_the_family():
    from dataclasses import replace

    ref = zoo.tiny_model("phi3", init="strong")
    engine = replace(as_engine(Quantised(copy_of(ref), "q"), "q"), tensor_types={"token_embd.weight": "Q8_0"},
                     twin=lambda path: pytest.fail("no conversion can be written"))
    result = compare_engine(from_module(ref), engine, RunOptions()).result
    assert result.status is Status.WARN
    assert "posdiag has no GGUF converter for model_type 'phi3'" in result.summary


def test_classify_per_position_tolerance_and_a_rise_below_it():
    tol = torch.full((64,), 1e-2, dtype=torch.float64)
    rise = torch.tensor([1e-3, 5e-3] + [0.2] * 62, dtype=torch.float64)  # above 1/3 of the tolerance at 1
    out = classify(rise, tol, {})
    assert out["pattern"] == "grows with position" and out["onset_position"] == 2
    flat = torch.tensor([1e-3] * 8 + [0.2] * 56, dtype=torch.float64)   # at the floor, then a step
    assert classify(flat, tol, {})["pattern"] == "step at a length"


def test_quantised_writer_types_and_refusals(tmp_path, llama):
    pytest.importorskip("gguf", reason="the GGUF writer needs the gguf package")
    from posdiag.model.gguf_file import inspect_file
    from posdiag.ports.gguf_writer import ConversionError, convert, write

    info = inspect_file(str(write(convert(llama), tmp_path / "q.gguf", "Q8_0")))
    assert info.type_counts == {"Q8_0": 16, "F32": 5}  # 2-D weights quantised, the 5 norms kept
    assert info.tensor_types["blk.0.attn_norm.weight"] == "F32"
    with pytest.raises(ConversionError, match="Q4_K"):
        write(convert(llama), tmp_path / "k.gguf", {"token_embd.weight": "Q4_K"})
    with pytest.raises(ConversionError, match="no GGUF converter"):
        convert(zoo.tiny_model("phi3"))


def test_compare_fail_on_and_require_gate_a_warn():
    """An inconclusive comparison (a quantised engine with no file to split, showing a rise) is WARN, exit 0;
    `--fail-on warn` and `--require compare` fail the gate on it (exit 1), as they do for `check`; a name compare
    does not know is a usage error."""
    from typer.testing import CliRunner

    from posdiag.cli import app

    base = ["compare", "tests.engines_demo:reference", "tests.engines_demo:quantised_rotary_layout", "--seq-len", "32",
            "--quiet"]
    plain = CliRunner().invoke(app, base)
    assert plain.exit_code == 0 and plain.stdout.startswith("WARN compare: inconclusive"), plain.output
    for gate in (["--fail-on", "warn"], ["--require", "compare"]):
        out = CliRunner().invoke(app, base + gate)
        assert out.exit_code == 1, out.output
        assert "GATE FAILED — compare" in out.output
    out = CliRunner().invoke(app, base + ["--require", "shufle"])
    assert out.exit_code == 2 and "--require shufle: unknown check" in out.output
