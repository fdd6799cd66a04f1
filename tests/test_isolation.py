"""What the suite runs under, whatever ran before: a cached conversion is the one its source and converters make."""

from __future__ import annotations

from pathlib import Path


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
