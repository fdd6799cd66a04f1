"""posdiag compare: planted ports against a stock reference, on tiny CPU models, in memory.

Each planted candidate must FAIL with the right position pattern and first layer; identical
copies, another attention kernel and a bf16 twin must not FAIL; every zoo family compares
clean against its own copy.
"""

import json

import pytest
import torch
from plants_compare import copy_of, ignore_rope_scaling, interleave_qk, wrong_norm_eps
from sweep_rows import exhaustive
from typer.testing import CliRunner

from posdiag.errors import PosdiagError
from posdiag.model.loading import from_module
from posdiag.options import LoadOptions, RunOptions
from posdiag.results import Status
from posdiag.testing import zoo
from posdiag.tools.compare import bucket_edges, compare_subjects, original_context, parse_layer_map

DYNAMIC = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}


def compare(ref, cand, cand_options=None, **kw):
    return compare_subjects(from_module(ref, name="reference"),
                            from_module(cand, name="candidate", options=cand_options),
                            RunOptions(), **kw)


@pytest.mark.parametrize("family", exhaustive(zoo.FAMILIES))
def test_identical_copy_passes_every_family(family):
    ref = zoo.tiny_model(family)
    # 64 tokens: inside every tiny family's context (the default length is tested below)
    result = compare_subjects(from_module(ref), from_module(copy_of(ref)), RunOptions(seq_len=64)).result
    assert result.status is Status.PASS, result.summary  # measured: every zoo family compares (none skips)
    assert result.metrics["ratio"] <= 10 and "same model" in result.summary
    stacks = 2 if zoo.model_kind(family) == "seq2seq" else 1
    assert result.forward_passes == 3 * stacks  # reference, candidate, finer-dtype floor


@pytest.mark.parametrize("family,init", [("llama", "default"), ("qwen2", "strong"), ("mistral", "default"),
                                         ("olmo2", "strong")])
def test_interleaved_qk_fails_growing_with_position(family, init):
    ref = zoo.tiny_model(family, init=init)
    comparison = compare(ref, interleave_qk(ref))
    result = comparison.result
    assert result.status is Status.FAIL, result.summary
    assert result.details["first_layer"] == "block 1"
    assert result.details["pattern"] == "grows with position"
    first = next(p for p in comparison.profiles if p.name == "block 1")
    assert first.per_position[0] <= first.tolerance < max(first.per_position)  # zero at position 0
    assert "block 1" in result.summary and "grows with position" in result.summary


@pytest.mark.parametrize("family,init", [("llama", "default"), ("qwen2", "strong"), ("gpt2", "default"),
                                         ("bert", "strong")])
def test_wrong_norm_eps_fails_position_uniform(family, init):
    ref = zoo.tiny_model(family, init=init)
    result = compare(ref, wrong_norm_eps(ref, 1e-1)).result
    assert result.status is Status.FAIL, result.summary
    assert result.details["pattern"] == "position-uniform", result.summary
    assert result.metrics["position0_error"] > result.metrics["first_layer_error"] * 1e-3


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_ignored_rope_scaling_fails_only_past_the_original_context(family):
    ref = zoo.tiny_model(family, init="strong", rope_parameters=DYNAMIC)
    cand = ignore_rope_scaling(ref)
    short = compare(ref, cand).result
    assert short.status is Status.PASS, short.summary
    assert short.details["seq_len"] == original_context(from_module(ref)) == 128
    long = compare(ref, cand, long=True).result
    assert long.status is Status.FAIL, long.summary
    assert long.details["seq_len"] == 256 and "past the original context of 128" in long.summary
    assert long.details["pattern"] == "grows with position"
    # and the healthy twin stays clean past the original context too
    assert compare(ref, copy_of(ref), long=True).result.status is Status.PASS


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_other_attention_kernel_passes(family):
    ref = zoo.tiny_model(family, init="strong")
    cand = copy_of(ref)
    cand.set_attn_implementation("sdpa")
    comparison = compare(ref, cand, LoadOptions(attn_implementation="sdpa"))
    result = comparison.result
    assert result.status is Status.PASS, result.summary
    assert result.metrics["error"] > 0  # really another kernel: rounding differs, within the floor


def test_bf16_twin_is_not_a_failure():
    ref = zoo.tiny_model("llama", init="strong")
    cand = copy_of(ref).to(torch.bfloat16)
    result = compare(ref, cand, LoadOptions(upcast=False)).result
    assert result.status is Status.PASS, result.summary  # measured 1.3x the bf16 floor
    assert result.details["compared_dtype"] == "bfloat16"
    assert result.metrics["noise_floor"] > 1e-3  # measured at bf16 scale, not fp32


def test_compare_leaves_the_reference_bitwise_unchanged():
    ref = zoo.tiny_model("llama", init="strong")
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    compare(ref, interleave_qk(ref))
    after = ref.state_dict()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)


def test_layer_map_and_mismatched_depth():
    ref = zoo.tiny_model("llama")
    deeper = zoo.tiny_model("llama", num_hidden_layers=3)
    result = compare(ref, deeper).result
    assert any("layer counts differ" in n for n in result.details["notes"])
    assert [row[0] for row in result.tables[0].rows] == ["embeddings", "block 2", "logits"]
    mapped = compare(ref, copy_of(ref), layer_map={0: 0, 2: 2}).result
    assert [row[0] for row in mapped.tables[0].rows] == ["embeddings", "block 2", "logits"]
    assert parse_layer_map("0:0, 1:2") == {0: 0, 1: 2}
    with pytest.raises(PosdiagError):
        parse_layer_map("0-1")


def test_usage_errors():
    ref = zoo.tiny_model("gpt2")
    with pytest.raises(PosdiagError, match="declared context"):
        compare_subjects(from_module(ref), from_module(copy_of(ref)), RunOptions(seq_len=1000))
    with pytest.raises(PosdiagError, match="cannot compare"):
        compare(ref, zoo.tiny_model("bert"))
    with pytest.raises(PosdiagError, match="--long"):
        compare_subjects(from_module(ref), from_module(copy_of(ref)), RunOptions(seq_len=64), long=True)


def test_bucket_edges_resolve_early_positions():
    edges = bucket_edges(512)
    assert edges[:5] == [0, 1, 2, 3, 4] and edges[-1] == 512 and edges == sorted(set(edges))


runner = CliRunner()


def test_cli_fixture_against_itself(fixtures_dir, tmp_path):
    from posdiag.cli import app

    out = tmp_path / "compare.json"
    path = fixtures_dir / "llama-tiny"
    result = runner.invoke(app, ["compare", str(path), str(path), "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "same model within rounding" in result.output
    data = json.loads(out.read_text())
    check = data["checks"][0]
    assert check["name"] == "compare" and check["status"] == "pass" and data["exit_code"] == 0
    assert set(check["metrics"]) >= {"error", "noise_floor", "ratio", "top1_agreement", "kl_mean"}
    assert check["details"]["seq_len"] == 128 and check["forward_passes"] == 3


def test_cli_usage_errors_exit_2(fixtures_dir, tmp_path):
    from posdiag.cli import app

    path = str(fixtures_dir / "llama-tiny")
    for args in (["compare", path, str(tmp_path / "nope")],
                 ["compare", path, path, "--seq-len", "4096"],
                 ["compare", path, path, "--layer-map", "x"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert "posdiag: error:" in result.output


def test_cli_plot_png_or_a_clear_usage_error(fixtures_dir, tmp_path):
    import importlib.util

    from posdiag.cli import app

    path, png = str(fixtures_dir / "llama-tiny"), tmp_path / "err.png"
    result = runner.invoke(app, ["compare", path, path, "--seq-len", "16", "--plot", str(png), "-q"])
    if importlib.util.find_spec("matplotlib") is None:
        assert result.exit_code == 2 and "matplotlib" in result.output
    else:
        assert result.exit_code == 0, result.output
        assert png.read_bytes()[:4] == b"\x89PNG"
