"""compare REF model.onnx: tiny models exported with torch.onnx (tests/onnx_export.py), run with ONNX Runtime on the
CPU, judged on their logits by position like any engine.

- exported with a dynamic sequence axis: the same function at float32 rounding (PASS), cached decode too;
- traced at one length (16, positions computed inside the graph as constants): its fixed length is read from the
  graph and named; positions past it are not covered (FAIL: a step at 16), and a shorter run is one line naming it;
- a KV-cache graph whose positions ignore the past length: FAIL on the cached decode, from the continuation.
Across two families (Llama; Qwen2, with a bias on q/k/v).
"""

import pytest

from posdiag.errors import PosdiagError
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing import zoo

pytest.importorskip("onnxruntime", reason="ONNX Runtime is not installed (pip install -e '.[onnx]')")
pytest.importorskip("onnx", reason="torch.onnx needs the onnx package (pip install -e '.[onnx]')")

from posdiag.ports.engines.onnx_runtime import load_onnx
from posdiag.ports.logits import compare_engine
from tests.onnx_export import EXPORTS, TRACED_LENGTH, export

FAMILIES = ("llama", "qwen2")
N = 48


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """Every export of every family, written once: {(family, kind): path}."""
    out = tmp_path_factory.mktemp("onnx")
    return {(family, kind): export(zoo.tiny_model(family, init="strong"), out / f"{family}-{kind}.onnx", kind)
            for family in FAMILIES for kind in EXPORTS}


def judge(family: str, path) -> object:
    reference = from_module(zoo.tiny_model(family, init="strong"))
    return compare_engine(reference, load_onnx(str(path)), RunOptions(seq_len=N)).result


@pytest.mark.parametrize("family", FAMILIES)
def test_a_dynamic_export_passes_and_its_cache_too(graphs, family):
    plain = judge(family, graphs[family, "dynamic"])
    assert plain.status is Status.PASS and plain.metrics["ratio"] <= 10, plain.summary
    assert plain.details["engine"]["inputs"] == "input_ids, attention_mask, position_ids"
    cached = judge(family, graphs[family, "kv"])
    assert cached.status is Status.PASS, cached.summary
    assert "also continued from position 24" in cached.summary
    assert cached.details["engine"]["inputs"].endswith("past key/values")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_graph_traced_at_one_length_fails_past_it(graphs, family):
    result = judge(family, graphs[family, "static"])
    assert result.status is Status.FAIL, result.summary
    assert result.details["pattern"] == "step at a length" and result.details["onset_position"] == TRACED_LENGTH
    assert result.details["engine"]["fixed sequence length"] == TRACED_LENGTH
    assert f"positions {TRACED_LENGTH}-{N - 1} not covered" in result.summary
    with pytest.raises(PosdiagError, match=rf"exported at a fixed sequence length of {TRACED_LENGTH} \(input "
                                           r"'input_ids' has shape \[1, 16\]\): it cannot run 8 tokens"):
        load_onnx(str(graphs[family, "static"])).run(list(range(8)))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_cache_graph_that_ignores_the_past_length_fails_on_cached_decode(graphs, family):
    result = judge(family, graphs[family, "kv_ignores_past"])
    assert result.status is Status.FAIL, result.summary
    assert result.details["first_layer"] == "logits, continued from position 24"
    assert result.details["onset_position"] == 24 and result.details["boundary"] == "continuation 24"
    assert result.summary.startswith("continued from position 24: error starts at position 24")
    plain = next(x for x in result.details["layers"] if x["name"] == "logits")
    assert plain["pattern"] == "none"  # the same graph without a past is healthy


def test_the_command_line_runs_a_graph_and_refuses_a_broken_file(graphs, tmp_path):
    from typer.testing import CliRunner

    from posdiag.cli import app

    out = CliRunner().invoke(app, ["compare", "tests.engines_demo:reference", str(graphs["llama", "dynamic"]),
                                   "--seq-len", "32", "-q"])
    assert out.exit_code == 0, out.output
    assert out.stdout.startswith("PASS compare: same function within float32 rounding")
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not a graph")
    out = CliRunner().invoke(app, ["compare", "tests.engines_demo:reference", str(broken)])
    assert out.exit_code == 2, out.output
    assert out.stderr.splitlines()[-1].startswith("posdiag: error: ONNX Runtime cannot load"), out.output
    assert "Traceback" not in out.output


def test_the_session_runs_posdiag_s_thread_count_and_never_spins(graphs, monkeypatch):
    """ONNX Runtime's default spins idle pool threads; a session here takes POSDIAG_THREADS (the suite's 1) and lets
    them sleep."""
    monkeypatch.setenv("POSDIAG_THREADS", "1")
    engine = load_onnx(str(graphs["llama", "dynamic"]))
    options = engine.impl.session.get_session_options()
    assert options.intra_op_num_threads == options.inter_op_num_threads == 1
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert engine.settings["threads"] == 1 and engine.settings["spinning"] == "off"
