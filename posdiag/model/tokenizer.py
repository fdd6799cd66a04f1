"""The checkpoint's own tokenizer, when it has one: checks that score natural text need it.

Loaded from where the model came from (a local directory, a .gguf file's metadata, or the hub id it was downloaded
by), with the same revision and remote-code permission as the model. In-memory and factory models have none; a
directory without tokenizer files is not searched further (no hub fallback, no network), so a tokenizer-less
checkpoint costs nothing here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model")


def load_tokenizer(subject: Any) -> tuple[Any | None, str]:
    """(tokenizer, "") or (None, why there is none)."""
    if not subject.is_hf or subject.load_info.checkpoint_keys is None:
        return None, "an in-memory or factory model has no tokenizer"
    spec = subject.spec
    if Path(spec).is_dir() and not any((Path(spec) / name).is_file() for name in TOKENIZER_FILES):
        return None, f"{spec} has no tokenizer files"
    where = {"pretrained_model_name_or_path": spec}
    if Path(spec).is_file() and spec.lower().endswith(".gguf"):  # the tokenizer is in the file's metadata
        where = {"pretrained_model_name_or_path": str(Path(spec).parent), "gguf_file": Path(spec).name}
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(**where, revision=subject.options.revision,
                                             trust_remote_code=subject.options.trust_remote_code), ""
    except Exception as exc:  # any loader failure means: score without text
        return None, f"its tokenizer does not load ({type(exc).__name__})"
