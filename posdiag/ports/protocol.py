"""The protocol every candidate of `posdiag compare` follows, whatever runs it.

A port is the model running somewhere other than the reference: PyTorch in this process, llama.cpp in a child
process, ONNX Runtime, a server over HTTP. What can be asked of one differs (a server answers top-k log-probs by
text, never logits; only PyTorch shows hidden states), so a port names the *paths* it offers, and the comparison
(posdiag/ports/comparison.py) chooses its judge by them, never by the port's class. Every port has

    name: str                  what the report calls it
    paths: frozenset[str]      what it can be asked: names from PATHS, each bringing the members PATHS lists
    vocab_size: int | None     the ids it accepts, where it knows (None: the reference's vocabulary is assumed)

A new ability of a runtime is a new path: a name (and its members) here, the name in that port's `paths`, and a
judge (or a route of one) that asks `"name" in port.paths`. Nothing asks what class a port is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from posdiag.errors import PosdiagError
from posdiag.options import RunOptions

PATHS = {
    "hidden_states": "subject: the model in this process (posdiag.model.subject.Subject), every layer's hidden states "
                     "and the logits",
    "logits": "run(ids) -> float64 [T, V] on the CPU: the logits of every position for the reference's token ids; "
              "context_length, boundaries, settings, quantization, approximations describe how it ran",
    "logits_continued": "run_continued(ids, split) -> [T, V]: ids[:split] prefilled, the cache continued with the rest",
    "logits_stepped": "impl.logits_stepped(ids, split) -> [T, V]: a prefill, then one token per call, as a server "
                      "decodes",
    "other_file": "twin(path) -> port, tensor_types: the same engine and settings on another file (a quantised "
                  "file's floors are measured so)",
    "top_logprobs": "text in, top-k log-probs out, tokens as text (requests counted in `requests`); its routes:",
    "prompt_route": "prompt_logprobs(text, k) -> Reply: the prompt's own tokens scored (echo + logprobs)",
    "generation_route": "generate(text, n, k) -> Reply: greedy tokens, each with its top-k log-probs",
}
"""Every path a port may offer, and what offering it promises. A path posdiag does not judge yet may be offered."""


class Port(Protocol):
    """A candidate of `posdiag compare` (the members every port has; PATHS lists the rest, by path)."""

    name: str

    @property
    def paths(self) -> frozenset[str]: ...

    @property
    def vocab_size(self) -> int | None: ...


Stage = Callable[[str], None]
"""Told what a comparison starts next ("reference in float32 and float64", "candidate, 256 tokens"): the command
line's status line says where a run of minutes is."""


def no_stage(_: str) -> None:
    """Where nobody watches (the Python API, the tests)."""


@dataclass(frozen=True)
class CompareRequest:
    """What one comparison is asked to do. Each judge reads the fields it knows and refuses in one line those it
    cannot honour (--layer-map for a port without hidden states).

    text: the probe text (--text); judges of token ids take it through `tokenize` (the reference's tokenizer, as
    the command line loads it), judges of text send it as it is."""

    seq_len: int | None = None
    seed: int = 0
    text: str | None = None
    tokenize: Callable[[str], Sequence[int]] | None = None
    long: bool = False
    layer_map: dict[int, int] | None = None
    route: str = "both"
    top_k: int = 5
    served_dtype: str | None = None
    long_prompt: int | None = None  # --route serving: the long-prompt path's tokens (None: the judge's default)
    prefix_tokens: int | None = None  # --route serving: the shared prefix's tokens (None: the judge's default)
    stage: Stage = no_stage  # told each stage as it starts

    def run_options(self, reference: Any, candidate: Port) -> RunOptions:
        """The probe for a judge of token ids: --text tokenized (ids both vocabularies hold), else random ids."""
        token_ids = None
        if self.text:
            if self.tokenize is None:
                raise PosdiagError("a probe text needs a tokenizer (CompareRequest.tokenize)")
            token_ids = tuple(self.tokenize(self.text))
            if max(token_ids) >= min(reference.vocab_size, candidate.vocab_size or reference.vocab_size):
                raise PosdiagError("the tokenizer produced ids outside a model's vocabulary")
        return RunOptions(seq_len=self.seq_len, seed=self.seed, token_ids=token_ids)
