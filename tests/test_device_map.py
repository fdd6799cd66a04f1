"""--device-map with CPU and disk offload (accelerate): options, the checkpoint left untouched,
the same verdicts as a normal load, planted bugs still caught, half precision loaded in float32.

Disk offload is forced on a CPU-only machine with a tiny CPU budget (`--max-memory cpu=0`: the
whole model on disk; a few hundred KB: the embeddings in memory, the rest on disk).
"""

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from posdiag.api import run_checks
from posdiag.cli import app
from posdiag.errors import PosdiagError
from posdiag.model.loading import load_subject
from posdiag.model.placement import parse_max_memory
from posdiag.options import LoadOptions
from posdiag.testing import zoo

runner = CliRunner()
# Every check that runs a tiny Llama (table skips: RoPE has no table); kernels has its own tests.
CHECKS = "load,shuffle,positions,batch,cache,generate,causal,shift,rope,table"


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def digest(path: Path) -> str:
    """Names, modification times and bytes of every file under path."""
    h = hashlib.sha256()
    for f in sorted(path.rglob("*")):
        h.update(str(f.relative_to(path)).encode() + str(f.stat().st_mtime_ns).encode())
        if f.is_file():
            h.update(f.read_bytes())
    return h.hexdigest()


def one_line_error(result) -> str:
    lines = [line for line in result.output.splitlines() if line.strip() and not line.startswith("posdiag: loading ")]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("posdiag: error:"), result.output
    assert "Traceback" not in result.output, result.output
    return lines[0]


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """tempfile's directory for this test alone: the temporary offload folder is created there
    (torch may leave its own caches there too)."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bf16") / "llama-bf16"
    zoo.tiny_model("llama", init="strong", dtype=torch.bfloat16).save_pretrained(path)
    return path


# ----------------------------------------------------------------------------- options
def test_max_memory_takes_accelerate_forms():
    assert parse_max_memory("0=70GiB,cpu=200GiB") == {0: 70 * 2**30, "cpu": 200 * 2**30}
    assert parse_max_memory("cuda:1 = 1.5GB, disk=0") == {1: 1_500_000_000, "disk": 0}
    assert parse_max_memory("cpu=4096") == {"cpu": 4096}


@pytest.mark.parametrize("args, says", [
    (("--max-memory", "cpu=1GiB"), "only applies with --device-map"),
    (("--offload-folder", "somewhere"), "only applies with --device-map"),
    (("--device-map", "auto", "--max-memory", "cpu2GiB"), "DEVICE=SIZE"),
    (("--device-map", "auto", "--max-memory", "gpu=1GiB"), "unknown device 'gpu'"),
    (("--device-map", "auto", "--max-memory", "cpu=lots"), "not a size"),
    (("--device-map", "auto", "--max-memory", "cpu=1GiB,cpu=2GiB"), "given twice"),
])
def test_bad_offload_options_exit_2_with_one_line(fixtures_dir, args, says):
    line = one_line_error(invoke("shuffle", fixtures_dir / "llama-tiny", *args))
    assert says in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gpu_budget_without_a_gpu_exits_2(fixtures_dir):
    line = one_line_error(invoke("check", fixtures_dir / "llama-tiny", "--device-map", "auto",
                                 "--max-memory", "0=1GiB"))
    assert "GPU 0 is not on this machine" in line


def test_factory_model_refuses_device_map():
    line = one_line_error(invoke("shuffle", "fixtures.custom_model:healthy", "--device-map", "auto"))
    assert "needs a checkpoint" in line


@pytest.mark.parametrize("inside", [".", "offload", "sub/deeper"])
def test_offload_folder_inside_the_checkpoint_is_refused(fixtures_dir, tmp_path, inside):
    ckpt = tmp_path / "llama"
    shutil.copytree(fixtures_dir / "llama-tiny", ckpt)
    before = digest(ckpt)
    line = one_line_error(invoke("shuffle", ckpt, "--device-map", "auto", "--offload-folder", ckpt / inside))
    assert "inside the checkpoint directory" in line
    assert digest(ckpt) == before  # nothing created there


# ----------------------------------------------------------------------------- verdicts
def test_disk_offloaded_llama_gives_the_same_verdicts(fixtures_dir, tmp_path, private_tmp):
    ckpt = tmp_path / "llama"
    shutil.copytree(fixtures_dir / "llama-tiny", ckpt)
    before = digest(ckpt)
    common = ("check", ckpt, "--only", CHECKS, "--seq-len", 16, "-q")
    normal = invoke(*common, "--json", tmp_path / "normal.json")
    # 300 KB of the 428 KB: the token embeddings stay in memory, every block and the head go to disk.
    offloaded = invoke(*common, "--device-map", "auto", "--max-memory", "cpu=300KB", "--json", tmp_path / "off.json")
    assert normal.exit_code == offloaded.exit_code == 0, offloaded.output
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("normal.json", "off.json"))
    assert [(c["name"], c["status"]) for c in a["checks"]] == [(c["name"], c["status"]) for c in b["checks"]]
    assert {c["status"] for c in b["checks"]} == {"pass", "n/a"}
    assert {c["name"] for c in b["checks"] if c["status"] == "n/a"} == {"load", "table"}  # RoPE: nothing stored
    # The same arithmetic: the position signal agrees (errors at the noise floor vary with CPU threading).
    residual = [c["metrics"]["residual"] for r in (a, b) for c in r["checks"] if c["name"] == "shuffle"]
    assert residual[1] == pytest.approx(residual[0], rel=1e-4)
    placed = " ".join(b["model"]["notes"])
    assert "cpu: model.embed_tokens;" in placed and "disk: " in placed and "model.layers" in placed
    assert digest(ckpt) == before  # the checkpoint is read, never written
    assert not list(private_tmp.glob("posdiag-offload-*"))  # the temporary offload folder is gone


def test_planted_bug_still_fails_on_disk(fixtures_dir, tmp_path):
    for name, code, word in (("gpt2-tiny-zeroed-wpe", 1, "FAIL shuffle"), ("gpt2-tiny", 0, "PASS shuffle")):
        ckpt = tmp_path / name
        shutil.copytree(fixtures_dir / name, ckpt)
        before = digest(ckpt)
        result = invoke("shuffle", ckpt, "--device-map", "auto", "--max-memory", "cpu=0", "-q")
        assert result.exit_code == code and word in result.output, result.output
        assert digest(ckpt) == before


def test_offloaded_table_is_inspected_not_skipped(fixtures_dir):
    """The table check reads an offloaded (meta) table through accelerate's map, and its marker
    edit reaches the forward without touching the checkpoint; the model is unchanged afterwards."""
    parts = {}
    for name in ("gpt2-tiny", "gpt2-tiny-zeroed-wpe"):
        subject = load_subject(str(fixtures_dir / name), LoadOptions(device_map="auto", max_memory="cpu=0"))
        assert subject.model.transformer.wpe.weight.device.type == "meta"
        ids = subject.sample_ids(1, 8, 0)
        before = subject.forward(ids).final
        table = run_checks(subject, ["table"]).checks[0]
        parts[name] = {p: [e["status"] for e in entries] for p, entries in table.details["parts"].items()}
        assert torch.equal(subject.forward(ids).final, before)
        subject.close()
    assert parts["gpt2-tiny"]["health"] == ["pass"] and "pass" in parts["gpt2-tiny"]["offsets"]
    assert parts["gpt2-tiny-zeroed-wpe"]["health"] == ["warn"]  # all rows zero, seen through the offload
    assert "skip" not in parts["gpt2-tiny"]["offsets"]


def test_weight_missing_from_the_checkpoint_is_kept_in_memory(tmp_path):
    """Marian's sinusoid tables are built at init, not saved: transformers cannot read them from
    disk (KeyError at the first forward), so posdiag keeps their modules in memory."""
    ckpt = tmp_path / "marian"
    zoo.tiny_model("marian").save_pretrained(ckpt)
    subject = load_subject(str(ckpt), LoadOptions(device_map="auto", max_memory="cpu=0"))
    assert subject.model.hf_device_map["model.encoder.embed_positions"] == "cpu"
    assert any("kept in memory" in n for n in subject.notes)
    result = run_checks(subject, ["shuffle"]).checks[0]
    assert result.status.value == "pass", result.summary
    subject.close()


def test_user_offload_folder_is_kept(fixtures_dir, tmp_path):
    folder = tmp_path / "offload"
    result = invoke("shuffle", fixtures_dir / "llama-tiny", "--device-map", "auto", "--max-memory", "cpu=0",
                    "--offload-folder", folder, "--seq-len", 8, "-q")
    assert result.exit_code == 0, result.output
    assert folder.is_dir()


# ----------------------------------------------------------------------------- precision
def test_half_precision_checkpoint_is_loaded_in_float32_with_upcast(bf16_llama):
    subject = load_subject(str(bf16_llama), LoadOptions(device_map="auto", max_memory="cpu=0", upcast=True))
    assert subject.dtype == torch.float32 and subject.load_dtype == torch.bfloat16
    assert any("loaded in float32 from bfloat16" in n for n in subject.notes)
    with subject.stored_weight("model.layers.0.self_attn.q_proj.weight") as weight:  # offloaded, read as float32
        assert weight.dtype == torch.float32
    shuffle = run_checks(subject, ["shuffle"]).checks[0]
    assert shuffle.status.value == "pass", shuffle.summary  # a verdict, not bf16's inconclusive warning
    subject.close()


@pytest.mark.parametrize("flag", ["--no-upcast", None])
def test_half_precision_is_judged_as_run_by_default(bf16_llama, tmp_path, flag):
    result = invoke("shuffle", bf16_llama, "--device-map", "auto", "--max-memory", "cpu=0", *([flag] if flag else []),
                    "--seq-len", 16, "-q", "--json", tmp_path / "r.json")
    report = json.loads((tmp_path / "r.json").read_text())
    (shuffle,) = report["checks"]
    # Kept in bfloat16: measured 0.66 = 85x the bf16 floor, under PASS_RATIO (100x), which bf16 cannot decide; the
    # same rows re-run in float64 (module by module, offloaded modules included) decide: a PASS far above the floor.
    assert result.exit_code == 0 and shuffle["status"] == "pass", (result.exit_code, shuffle["summary"])
    assert "in float64 (inconclusive in bfloat16: 84.7x its floor;" in shuffle["summary"], shuffle["summary"]
    assert shuffle["metrics"]["ratio"] > 1e4
    model = report["model"]
    assert model["dtype"] == model["check_dtype"] == "bfloat16"
    assert not any("upcast from" in n or "loaded in float32" in n for n in model["notes"])
    assert any(n.startswith("judged as stored in bfloat16:") for n in model["notes"]), model["notes"]
    assert any("every check runs in bfloat16, float64 re-runs deciding: a model dispatched" in n
               for n in model["notes"]), model["notes"]


def test_device_map_options_also_come_from_the_api(fixtures_dir):
    with pytest.raises(PosdiagError, match="only applies with --device-map"):
        load_subject(str(fixtures_dir / "llama-tiny"), LoadOptions(max_memory="cpu=1GiB"))
