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
from posdiag.ports.layers import bucket_edges, compare_subjects, original_context, parse_layer_map
from posdiag.results import Status
from posdiag.testing import zoo

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


def _checkpoints(fixtures_dir, *names):
    from posdiag.model.loading import load_subject

    return [load_subject(str(fixtures_dir / n)) for n in names]


@pytest.mark.parametrize("broken, how", [("gpt2-tiny-zeroed-wpe", "differs"),
                                         ("gpt2-tiny-missing-wpe", "missing from the candidate's checkpoint")])
def test_a_broken_position_table_is_named_not_excused(fixtures_dir, broken, how):
    """GPT-2's table is absolute: its row 0 reaches the first token, so a zeroed or missing table is as wrong at
    position 0 as elsewhere (1.1x the median), which once read "weights, norms or another per-token computation,
    not positions". The stored tensors say which: only transformer.wpe.weight changed."""
    ref, cand = _checkpoints(fixtures_dir, "gpt2-tiny", broken)
    result = compare_subjects(ref, cand, RunOptions()).result
    assert result.status is Status.FAIL, result.summary
    assert "not positions" not in result.summary
    assert f"the weights differ only in the position table: transformer.wpe.weight (position table) {how}" in \
        result.summary, result.summary
    assert result.details["weights"]["position_only"] is True
    assert "the absolute position table (its row 0 reaches the first token too)" in result.summary


def test_a_relative_position_model_with_a_changed_norm_names_the_weights(fixtures_dir, tmp_path):
    """llama-tiny (RoPE) with one norm weight changed in its safetensors: uniform from position 0 still rules
    positions out, and the diff names the norm; the identical pair PASSes without reading the tensors again."""
    import shutil

    from safetensors.torch import load_file, save_file

    twin = tmp_path / "llama-norm"
    shutil.copytree(fixtures_dir / "llama-tiny", twin)
    tensors = load_file(twin / "model.safetensors")
    tensors["model.layers.0.input_layernorm.weight"] = tensors["model.layers.0.input_layernorm.weight"] * 1.5
    save_file(tensors, twin / "model.safetensors", metadata={"format": "pt"})
    (ref,) = _checkpoints(fixtures_dir, "llama-tiny")
    (cand,) = _checkpoints(tmp_path, "llama-norm")
    result = compare_subjects(ref, cand, RunOptions()).result
    assert result.status is Status.FAIL and result.details["pattern"] == "position-uniform", result.summary
    assert "weights, norms or another per-token computation, not positions" in result.summary
    assert "the weights differ: model.layers.0.input_layernorm.weight differs" in result.summary, result.summary
    assert result.details["weights"]["position_only"] is False
    same = compare_subjects(ref, _checkpoints(fixtures_dir, "llama-tiny")[0], RunOptions()).result
    assert same.status is Status.PASS and "weights" not in same.details, same.summary


def test_checkpoints_with_identical_tensors_say_the_difference_is_not_in_the_weights(fixtures_dir, tmp_path):
    """The same tensors under another config (a lower rms_norm_eps... here GPT-2's layer_norm_epsilon): the diff
    finds nothing, and says the difference is in the configuration or the code."""
    import json as json_module
    import shutil

    twin = tmp_path / "gpt2-eps"
    shutil.copytree(fixtures_dir / "gpt2-tiny", twin)
    config = json_module.loads((twin / "config.json").read_text())
    config["layer_norm_epsilon"] = 0.1
    (twin / "config.json").write_text(json_module.dumps(config))
    (ref,) = _checkpoints(fixtures_dir, "gpt2-tiny")
    (cand,) = _checkpoints(tmp_path, "gpt2-eps")
    result = compare_subjects(ref, cand, RunOptions()).result
    assert result.status is Status.FAIL, result.summary
    assert "stored tensors are identical: the difference is in the configuration or the code" in result.summary
