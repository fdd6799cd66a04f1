"""The checkpoint's own tokenizer, when it has one: checks that score natural text need it.

Loaded from where the model came from (a local directory, a .gguf file's metadata (read with the weights), or the
hub id it was downloaded by), with the same revision and remote-code permission as the model. In-memory and factory
models have none; a directory without tokenizer files is not searched further (no hub fallback, no network), so a
tokenizer-less checkpoint costs nothing here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model")


def load_tokenizer(subject: Any) -> tuple[Any | None, str]:
    """(tokenizer, "") or (None, why there is none). Loaded once per Subject, like its weights: `fit` and every
    comparison with a server read it (0.14-0.35 s a load for SmolLM2's)."""
    if subject.tokenizer is not None:  # loaded with the weights, or before
        return subject.tokenizer
    if not subject.is_hf or subject.load_info.checkpoint_keys is None:
        return None, "an in-memory or factory model has no tokenizer"
    spec = subject.spec
    if Path(spec).is_dir() and not any((Path(spec) / name).is_file() for name in TOKENIZER_FILES):
        return None, f"{spec} has no tokenizer files"
    subject.tokenizer = _loaded({"pretrained_model_name_or_path": spec}, subject.options)
    return subject.tokenizer


def gguf_tokenizer(path: Path, options: Any) -> tuple[Any | None, str]:
    """A .gguf file's tokenizer, from its metadata: read by the loader while it parses the file for the weights
    (posdiag.model.gguf_file.parsed_once), where it costs the conversion alone."""
    return _loaded({"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}, options)


def _loaded(where: dict[str, str], options: Any) -> tuple[Any | None, str]:
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(**where, revision=options.revision,
                                             trust_remote_code=options.trust_remote_code), ""
    except Exception as exc:  # any loader failure means: score without text
        return None, f"its tokenizer does not load ({type(exc).__name__})"
