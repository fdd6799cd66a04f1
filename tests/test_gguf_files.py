"""GGUF files posdiag must survive: engines that crash, abort or hang in their child process (planted with
tests/crashing_engine.py: the portable llama.cpp wheel in CI does not crash by itself), and files that are
truncated, corrupted, inconsistent or of an architecture transformers cannot map — each one line with its
exit code, never a traceback or a core dump. Also `compare --fail-on/--require`, the gate `check` has."""

import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from posdiag.cli import app
from posdiag.errors import EngineCrash, PosdiagError
from posdiag.ports.engines.child_process import EngineProcess

gguf = pytest.importorskip("gguf", reason="GGUF files need the gguf package: pip install -e '.[gguf]'")

from gguf_convert import write_gguf  # noqa: E402

from posdiag.model.gguf_file import inspect_file, rewrite  # noqa: E402

CHILD = str(Path(__file__).with_name("crashing_engine.py"))


def planted(mode: str, timeout: float = 60) -> EngineProcess:
    process = EngineProcess([sys.executable, CHILD, mode], "model.gguf", timeout=timeout)
    return process


@pytest.mark.parametrize("mode,words", [
    ("segv", "llama.cpp crashed with SIGSEGV (signal 11) on 'model.gguf' while running 4 tokens"),
    ("abort", "llama.cpp crashed with SIGABRT (signal 6) on 'model.gguf' while running 4 tokens (last words: "
              "GGML_ASSERT(planted) failed)"),
])
def test_a_native_crash_in_the_child_is_one_line_naming_the_signal_and_the_file(mode, words):
    process = planted(mode)
    process.request({"open": {}}, "loading it")
    with pytest.raises(EngineCrash) as caught:
        process.logits([1, 2, 3, 4])
    assert str(caught.value) == words and caught.value.exit_code == 3
    assert not Path(process.workdir).exists()  # the child's files are gone with it


def test_a_hang_is_stopped_at_the_timeout():
    """Killed at the timeout: a hung child never reads the quit message a healthy one gets 5 s to obey."""
    process = planted("hang")
    process.request({"open": {}}, "loading it")  # starting Python may take seconds on a busy machine
    process.timeout = 0.5  # the child is up and hung: no start-up time to allow for
    started = time.monotonic()
    with pytest.raises(EngineCrash, match=r"did not answer within 0.5 s on 'model.gguf' while running 4 tokens"):
        process.logits([1, 2, 3, 4])
    assert time.monotonic() - started < 0.5 + 4  # not the timeout and then the 5 s grace period
    assert process.proc.poll() is not None  # killed, not left behind


def test_a_crash_while_loading_and_the_healthy_twin():
    with pytest.raises(EngineCrash, match=r"crashed with SIGSEGV .* while loading it"):
        planted("load-segv").request({"open": {}}, "loading it")
    healthy = planted("healthy")
    assert healthy.request({"open": {}}, "loading it") == {"ready": {"engine": "planted healthy"}}
    assert healthy.logits([1, 2, 3]).shape == (3, 8) and healthy.logits([1, 2]).shape == (2, 8)
    healthy.close()
    assert healthy.proc.poll() == 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, ):
    """The committed tiny Llama checkpoint and its healthy GGUF conversion."""
    from transformers import AutoModelForCausalLM

    root = Path(__file__).resolve().parent.parent / "fixtures" / "llama-tiny"
    path = write_gguf(AutoModelForCausalLM.from_pretrained(root), tmp_path_factory.mktemp("gguf") / "llama.gguf")
    return root, path


def test_llama_cpp_runs_posdiag_s_thread_count_in_every_phase(tiny, monkeypatch):
    """llama-cpp-python evaluates a prompt batch on n_threads_batch, every core by default, whatever n_threads says:
    both take POSDIAG_THREADS (the suite's 1), read back from the context llama.cpp made."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from posdiag.ports.engines.llama_cpp import load_gguf

    monkeypatch.setenv("POSDIAG_THREADS", "1")
    engine = load_gguf(str(tiny[1]))
    try:
        assert engine.settings["n_threads"] == engine.settings["n_threads_batch"] == 1, engine.settings
    finally:
        engine.impl.close()


def test_engine_threads_follow_posdiag_threads():
    from posdiag.ports.engines.logits_only import engine_threads

    assert engine_threads({"POSDIAG_THREADS": "3"}) == 3
    assert engine_threads({"POSDIAG_THREADS": "omp"}) == engine_threads({}) == max(1, min(4, os.cpu_count() or 1))


def test_compare_with_a_crashing_engine_exits_3_in_one_line(tiny, monkeypatch):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from posdiag.ports.engines import llama_cpp as gguf_engine

    monkeypatch.setattr(gguf_engine, "CHILD_COMMAND", [sys.executable, CHILD, "segv"])
    root, path = tiny
    out = CliRunner().invoke(app, ["compare", str(root), str(path), "--seq-len", "16"])
    assert out.exit_code == 3, out.output
    lines = [x for x in out.output.splitlines() if x.startswith("posdiag: error:")]
    assert lines == [f"posdiag: error: llama.cpp crashed with SIGSEGV (signal 11) on '{path}' while running 16 tokens"]
    assert "Traceback" not in out.output


def broken_files(path: Path, out: Path) -> dict[str, Path]:
    data = path.read_bytes()
    files = {"truncated": out / "truncated.gguf", "corrupted": out / "corrupted.gguf"}
    files["truncated"].write_bytes(data[: len(data) * 2 // 3])
    files["corrupted"].write_bytes(data[:24] + bytes(range(256)) * 8 + data[24 + 2048:])
    files["inconsistent"] = rewrite(str(path), out / "inconsistent.gguf", keys={"llama.embedding_length": 48})
    return files


@pytest.mark.parametrize("kind,words", [
    ("truncated", "truncated"),
    ("corrupted", "is not a readable GGUF file (truncated or corrupted?)"),
    ("inconsistent", "token_embd.weight has rows of 64, llama.embedding_length says 48"),
])
def test_unsound_files_are_one_line_exit_2_before_any_engine_runs(tiny, tmp_path, kind, words):
    root, path = tiny
    bad = broken_files(path, tmp_path)[kind]
    with pytest.raises(PosdiagError, match=words.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        inspect_file(str(bad))
    for command in (["compare", str(root), str(bad), "--seq-len", "16"], ["shuffle", str(bad)]):
        out = CliRunner().invoke(app, command)
        assert out.exit_code == 2, out.output
        errors = [x for x in out.output.splitlines() if x.startswith("posdiag: error:")]
        assert len(errors) == 1 and words in errors[0] and "Traceback" not in out.output


def test_an_architecture_transformers_cannot_map_is_named(tiny, tmp_path):
    _, path = tiny
    other = rewrite(str(path), tmp_path / "other.gguf", keys={"general.architecture": "posdiagnet"})
    out = CliRunner().invoke(app, ["shuffle", str(other)])
    assert out.exit_code == 2, out.output
    assert "transformers cannot map GGUF architecture 'posdiagnet'" in out.output and "Traceback" not in out.output


def test_compare_alone_takes_only_a_gguf_file():
    out = CliRunner().invoke(app, ["compare", "fixtures/llama-tiny"])
    assert out.exit_code == 2 and "only a .gguf file is compared alone" in out.output, out.output


def test_a_gguf_file_is_a_model_for_check(tiny):
    """The tiny conversion, dequantised by transformers: the header names it, the checks judge it."""
    _, path = tiny
    out = CliRunner().invoke(app, ["check", str(path), "--only", "load,shuffle,rope"], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert "note: dequantised from F32 GGUF by transformers (tensors: F32 x21)" in out.output
    assert "shuffle  PASS" in out.output and "load     N/A" in out.output and "rope     PASS" in out.output
    assert not list(path.parent.glob("*.json"))  # nothing written next to the file


def test_posdiag_s_reader_reads_what_the_library_s_reads(tiny, tmp_path):
    """posdiag parses with plain views of the memory map, each array in one pass (posdiag/model/gguf_file.
    _plain_views, 20x faster on a 49k-token vocabulary): every field, part, tensor and its data equal
    gguf.GGUFReader's, on an F32 file with a vocabulary (empty strings among them) and on a Q8_0 one, and the mapped
    data stays read-only. A gguf release that changes its private `_get` or `_get_field_parts` fails here, not in a
    verdict."""
    from transformers import AutoModelForCausalLM

    from posdiag.model.gguf_file import open_reader

    q8 = write_gguf(AutoModelForCausalLM.from_pretrained(tiny[0]), tmp_path / "q8.gguf", qtype="Q8_0")
    vocab = gguf.GGUFWriter(str(tmp_path / "vocab.gguf"), "llama")  # arrays of strings, floats and ints
    vocab.add_token_list([f"tok{i}\u00e9" * (i % 5) for i in range(300)])
    vocab.add_token_scores([float(-i) for i in range(300)])
    vocab.add_token_types([1 + i % 3 for i in range(300)])
    vocab.add_array("posdiag.nested", [[1, 2], [3]])  # arrays of arrays: read the library's way
    vocab.add_tensor("token_embd.weight", np.arange(300 * 8, dtype=np.float32).reshape(300, 8))
    vocab.write_header_to_file(), vocab.write_kv_data_to_file(), vocab.write_tensors_to_file(), vocab.close()
    for path in (tiny[1], q8, tmp_path / "vocab.gguf"):
        mine, theirs = open_reader(str(path)), gguf.GGUFReader(str(path))
        assert isinstance(mine, gguf.GGUFReader) and list(mine.fields) == list(theirs.fields)
        for name, field in theirs.fields.items():
            other = mine.fields[name]
            assert (other.offset, other.types, other.data) == (field.offset, field.types, field.data), name
            pairs = zip(other.parts, field.parts, strict=True)
            assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in pairs), name
        assert [t.name for t in mine.tensors] == [t.name for t in theirs.tensors]
        for a, b in zip(mine.tensors, theirs.tensors, strict=True):
            assert (a.tensor_type, a.data_offset, a.n_bytes) == (b.tensor_type, b.data_offset, b.n_bytes), a.name
            assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name
            assert not a.data.flags.writeable, a.name
    assert "tokenizer.ggml.tokens" in mine.fields and {t.tensor_type.name for t in open_reader(str(q8)).tensors} \
        >= {"Q8_0"}


@pytest.fixture
def parsed(monkeypatch):
    """The names of the files gguf.GGUFReader parses from here on (the class posdiag's loader meets is this one)."""
    names = []

    class Counting(gguf.GGUFReader):
        def __init__(self, path, mode="r"):
            names.append(Path(path).name)
            super().__init__(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    return names


def test_a_gguf_model_is_parsed_once_for_its_config_weights_and_tokenizer(tiny, parsed):
    """transformers opens the file for its config, again for the model's config and its tensors, and for its
    tokenizer: each of those reads the reader posdiag validated, so the file is parsed once (the real SmolLM2 file,
    3.4 s a parse: 31 s -> 10 s to load it with its tokenizer). The library's names are restored afterwards."""
    from posdiag.model.loading import load_subject

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    subject = load_subject(str(tiny[1]))
    assert parsed == ["llama.gguf"]
    assert gguf.GGUFReader is reader and gguf.get_tensor_name_map is name_map
    assert subject.tokenizer is not None  # read while the file was open (or why it has none)
    assert subject.model(input_ids=subject.sample_ids(1, 8, 0)).logits.isfinite().all()


def test_compare_alone_parses_the_file_once_for_reference_and_engine(tiny, parsed):
    """`compare model.gguf`: the engine is opened on the file the reference was loaded from, and reuses that
    validated parse (1.7-3.4 s, by CPU, for the real SmolLM2 file) instead of reading the file a second time."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    out = CliRunner().invoke(app, ["compare", str(tiny[1]), "--seq-len", "16"], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert parsed == ["llama.gguf"], parsed
