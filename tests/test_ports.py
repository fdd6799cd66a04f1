"""The ports' protocol: every candidate names the paths it offers, the comparison picks its judge by them (never by
the candidate's class), and the command line asks one function for the candidate and one for the comparison."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

from posdiag.errors import PosdiagError
from posdiag.ports import comparison
from posdiag.ports.candidates import PortOptions, open_candidate
from posdiag.ports.engines.http_server import ServedEngine
from posdiag.ports.engines.in_process import ModelPort
from posdiag.ports.engines.logits_only import as_engine
from posdiag.ports.protocol import PATHS, CompareRequest

ROOT = Path(__file__).resolve().parents[1] / "posdiag"


@dataclass
class Offering:
    """A port that offers PATHS and nothing else (no class posdiag knows)."""

    paths: frozenset[str]
    name: str = "a port"
    vocab_size: int | None = None


class LogitsOnly:
    def logits(self, ids):
        return [[0.0, 1.0]] * len(ids)


class Continuing(LogitsOnly):
    def logits_continued(self, ids, split):
        return self.logits(ids)


@pytest.mark.parametrize("paths, module", [
    ({"hidden_states"}, "posdiag.ports.layers"),
    ({"hidden_states", "logits"}, "posdiag.ports.layers"),  # the richest evidence first
    ({"logits", "logits_continued"}, "posdiag.ports.logits"),
    ({"top_logprobs", "prompt_route", "generation_route"}, "posdiag.ports.served"),
])
def test_the_judge_is_chosen_by_the_paths_offered(paths, module):
    assert comparison.judge_for(Offering(frozenset(paths))).module == module


def test_a_port_offering_nothing_posdiag_judges_is_one_line():
    with pytest.raises(PosdiagError) as err:
        comparison.judge_for(Offering(frozenset({"prefix_cache"}), name="http://127.0.0.1:1/v1"))
    text = str(err.value)
    assert "\n" not in text and text.startswith("http://127.0.0.1:1/v1 offers prefix_cache; posdiag compares ")
    assert all(j.path in text for j in comparison.JUDGES)


def test_every_judge_exists_and_every_port_offers_known_paths(tmp_path):
    import importlib

    for judge in comparison.JUDGES:
        assert judge.path in PATHS and callable(importlib.import_module(judge.module).judge)
    plain, continuing = as_engine(LogitsOnly(), "plain"), as_engine(Continuing(), "continuing")
    assert plain.paths == {"logits"} and plain.vocab_size is None
    assert continuing.paths == {"logits", "logits_continued"}
    served = ServedEngine("http://127.0.0.1:1/v1")
    assert {"top_logprobs", "prompt_route", "generation_route"} == served.paths
    for port in (plain, continuing, served):
        assert port.paths <= set(PATHS), port.paths - set(PATHS)


def test_open_candidate_follows_what_a_factory_returns(monkeypatch):
    """A torch.nn.Module is a PyTorch model (hidden states); an object with logits is an engine (logits)."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    from posdiag.options import LoadOptions

    model = open_candidate("engines_demo:reference", LoadOptions(), PortOptions())
    engine = open_candidate("engines_demo:healthy", LoadOptions())
    assert isinstance(model, ModelPort) and model.paths == {"hidden_states"}
    assert model.vocab_size == model.subject.vocab_size
    assert engine.paths == {"logits", "logits_continued"} and engine.name == "healthy engine"
    assert comparison.judge_for(model).module == "posdiag.ports.layers"
    assert comparison.judge_for(engine).module == "posdiag.ports.logits"


def test_a_probe_text_is_tokenized_for_judges_of_ids_only():
    @dataclass
    class Reference:
        vocab_size: int = 10

    port = Offering(frozenset({"logits"}), vocab_size=6)
    request = CompareRequest(text="some words", tokenize=lambda text: (1, 2, 3, 5))
    assert request.run_options(Reference(), port).token_ids == (1, 2, 3, 5)
    with pytest.raises(PosdiagError, match="outside a model's vocabulary"):  # the candidate's 6 ids, not the 10
        CompareRequest(text="x", tokenize=lambda text: (1, 2, 3, 6)).run_options(Reference(), port)
    assert CompareRequest(seq_len=16, seed=3).run_options(Reference(), port).token_ids is None
    with pytest.raises(PosdiagError, match="needs a tokenizer"):
        CompareRequest(text="x").run_options(Reference(), port)


@pytest.mark.parametrize("module", ["cli/compare.py", "ports/comparison.py"])
def test_no_isinstance_routes_a_candidate(module):
    """The command and the comparison ask the candidate's paths; what class it is decides nothing there."""
    tree = ast.parse((ROOT / module).read_text())
    calls = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "isinstance"]
    assert not calls, f"{module}: isinstance at lines {calls}"
