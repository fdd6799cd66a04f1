"""What the suite runs under, whatever the shell and the tests before: the hub off, engines on one sleeping thread,
torch's thread count put back by every test, and nothing left in temporary directories by a passing test or a
`compare` run."""

from __future__ import annotations

import os
from pathlib import Path

import conftest
import huggingface_hub
import tomllib

ROOT = Path(__file__).resolve().parent.parent


def test_a_preset_0_cannot_turn_the_hub_on(monkeypatch):
    """HF_HUB_OFFLINE=0 in the caller's shell: the suite forces 1 (setdefault kept the 0), and switches a
    huggingface_hub already imported, which read the variable at its import."""
    env = {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0"}
    conftest.isolate(env)
    assert env == {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "POSDIAG_THREADS": "1"}
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    assert not huggingface_hub.is_offline_mode()
    conftest.isolate()
    assert huggingface_hub.is_offline_mode() and os.environ["HF_HUB_OFFLINE"] == "1"


INNER = '''
import os

import huggingface_hub
import torch


def test_leaves_the_thread_count_changed():
    torch.set_num_threads(torch.get_num_threads() + 1)


def test_changes_it_and_puts_it_back():
    before = torch.get_num_threads()
    torch.set_num_threads(before + 1)
    try:
        pass
    finally:
        torch.set_num_threads(before)


def test_sees_the_hub_off():
    assert os.environ["HF_HUB_OFFLINE"] == os.environ["TRANSFORMERS_OFFLINE"] == "1"
    assert huggingface_hub.is_offline_mode()


def test_writes_a_temporary_file(tmp_path):
    (tmp_path / "twin.gguf").write_bytes(bytes(1 << 20))
'''


def test_the_suite_s_own_rules_hold_in_a_run_of_it(pytester, monkeypatch):
    """A run under this suite's conftest and pytest settings, from a shell with the hub turned on: the test that
    leaves torch's thread count changed fails (its twin, which restores it, passes), the hub is off, and the
    passing test's temporary file is gone when it ends."""
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    retention = {k: options[k] for k in ("tmp_path_retention_policy", "tmp_path_retention_count")}
    pytester.makeini("[pytest]\n" + "".join(f"{k} = {v}\n" for k, v in retention.items()))
    pytester.makepyfile(test_inner=INNER)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:randomly")
    result.assert_outcomes(passed=4, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_leaves_the_thread_count_changed*",
                                 "*the test left torch's thread count at*"])
    kept = [p for p in pytester.path.rglob("*") if p.is_file() and p.name == "twin.gguf"]
    assert kept == []



def test_a_cached_conversion_is_keyed_by_content_and_the_converters_versions(tmp_path, monkeypatch):
    """Two GGUF files of one size are two conversions (the cache was keyed by size: the second read the first's
    checkpoint); the same file again reuses its own; a transformers release converts again."""
    from posdiag.testing import pretrained

    first, second = tmp_path / "first.gguf", tmp_path / "second.gguf"
    first.write_bytes(b"GGUF" + bytes(4096))
    second.write_bytes(b"GGUF" + bytes(4095) + b"\x01")
    assert first.stat().st_size == second.stat().st_size
    converted = []

    def dequantise(gguf: Path, out: Path) -> None:
        converted.append(gguf.name)
        (out / "model.safetensors").write_bytes(gguf.read_bytes())

    monkeypatch.setattr(pretrained, "_dequantise", dequantise)
    root = tmp_path / "cache"

    def checkpoint(source: Path) -> Path:
        monkeypatch.setattr(pretrained, "smollm2_gguf", lambda: source)
        return pretrained.smollm2_checkpoint(root)

    made = [checkpoint(first), checkpoint(second), checkpoint(first)]
    assert made[0] != made[1] and made[2] == made[0], made
    assert (made[1] / "model.safetensors").read_bytes() == second.read_bytes()
    assert converted == ["first.gguf", "second.gguf"]
    installed = pretrained.version
    monkeypatch.setattr(pretrained, "version", lambda name: "99.0" if name == "transformers" else installed(name))
    assert checkpoint(first) not in made and converted[-1] == "first.gguf"
