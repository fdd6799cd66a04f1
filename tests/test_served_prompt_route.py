"""The prompt route (echo + logprobs) shown both ways: a canned OpenAI-compatible server on 127.0.0.1 that scores the
prompt with the reference's own log-probs, aligned as the API defines them (PASS), shifted by +1 (llama-cpp-python
#1983's class) and by -1 (FAIL naming the shift), shifted with the model's numbers blurred (FAIL that claims no clean
shift) and garbled (FAIL that names neither a shift nor a position, never PASS).

The reference is fixtures/window-text (a trained character-level Mistral with its tokenizer: ~265 prompt tokens of
posdiag's prose). The server computes its answers with its own copy of the model in float32, the way a server runs
it; each request costs ~0.5 s."""

import gc
import weakref
from pathlib import Path

import pytest
import torch
from canned_server import canned_server

from posdiag.model.loading import load_subject
from posdiag.ports.engines.http_server import open_served
from posdiag.ports.served import compare_served
from posdiag.results import Status

MODEL = Path(__file__).resolve().parent.parent / "fixtures" / "window-text"


@pytest.fixture(scope="module")
def reference():
    return load_subject(str(MODEL))


@pytest.fixture(scope="module")
def scorer():
    """The server's side: its own tokenizer and model, (prompt) -> (token texts, [T, V] float32 log-probs)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL).eval()
    pieces = tokenizer.batch_decode([[i] for i in range(model.config.vocab_size)])

    def score(text):
        ids = tokenizer(text)["input_ids"]
        with torch.no_grad():
            lp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        return ids, pieces, lp

    return score


def served_as(score, mode):
    """An /completions answer whose top_logprobs[i] is the distribution of row ROW(i) of the model's log-probs:
    i - 1 as the API defines it (the distribution over token i given tokens < i), i (+1: the one after token i),
    i - 2 (-1), i with N(0, 1) noise on every log-prob ("blurred"), or a fixed random row ("garbled")."""
    def answer(method, path, body, headers):
        if path.endswith("/models"):
            return 200, {"data": [{"id": "canned"}]}, {}
        if not (body.get("echo") and body.get("logprobs")):
            return 400, {"error": {"message": "this server only scores prompts (echo + logprobs)"}}, {}
        ids, pieces, lp = score(body["prompt"])
        n, k = len(ids), int(body["logprobs"])
        if mode == "blurred":
            lp = lp + torch.randn(lp.shape, generator=torch.Generator().manual_seed(1))
        garbled = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
        row = {"aligned": lambda i: i - 1, "+1": lambda i: i, "-1": lambda i: i - 2, "blurred": lambda i: i,
               "garbled": lambda i: garbled[i]}[mode]
        tokens, token_lp, top = [pieces[i] for i in ids], [None], [None]  # the first token: nothing before it
        for i in range(1, n):
            r = row(i)
            ok = 0 <= r < n
            values, which = lp[r].topk(k) if ok else (torch.empty(0), torch.empty(0, dtype=torch.long))
            token_lp.append(float(lp[r, ids[i]]) if ok else None)
            top.append({pieces[j]: float(v) for v, j in zip(values, which.tolist(), strict=True)} if ok else None)
        after = int(lp[-1].argmax())  # max_tokens 1: the one generated token (dropped by posdiag)
        tokens.append(pieces[after])
        token_lp.append(float(lp[-1, after]))
        top.append({pieces[after]: float(lp[-1, after])})
        offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        logprobs = {"tokens": tokens, "token_logprobs": token_lp, "top_logprobs": top, "text_offset": offsets}
        choice = {"text": body["prompt"] + pieces[after], "finish_reason": "length", "logprobs": logprobs}
        return 200, {"choices": [choice], "usage": {"prompt_tokens": n}}, {}

    return answer


def prompt_route(reference, scorer, mode):
    with canned_server(served_as(scorer, mode)) as base:
        result = compare_served(reference, open_served(base), route="prompt").result
    return result, result.details["routes"]["prompt"]


def test_an_aligned_server_passes_the_prompt_route(reference, scorer):
    # fails against a route that always reports a shift (or judges top_logprobs[i] against token i+1's row)
    result, route = prompt_route(reference, scorer, "aligned")
    assert result.status is Status.PASS, result.summary
    assert route["alignment"]["best_offset"] == 0 and route["pattern"] == "none"
    assert route["first_position"] == 0 and route["positions"] == route["tokens"] - 1 > 200
    assert route["worst_ratio"] <= 10 and route["top1_agreement"] == 1.0  # float32 rounding of the same model
    assert result.summary.startswith("prompt route: same function within its floor at every position 0-")


@pytest.mark.parametrize("mode, offset, which", [("+1", 1, "next"), ("-1", -1, "previous")])
def test_a_shifted_server_fails_naming_the_shift(reference, scorer, mode, offset, which):
    # fails against a route that only looks for +1 (the shift llama-cpp-python has), or realigns and passes
    result, route = prompt_route(reference, scorer, mode)
    assert result.status is Status.FAIL, result.summary
    assert route["pattern"] == "misaligned" and route["offset"] == offset and route["clear"]
    assert result.summary.startswith(f"prompt route: log-probs shifted by {offset:+d} position (never realigned): "
                                     f"top_logprobs[i] is the reference's distribution for token i{offset:+d} "
                                     f"(the {which} token's)")
    fits = route["alignment"]["fits"]
    assert fits[str(offset)]["top1_agreement"] == 1.0 and fits["0"]["top1_agreement"] < 0.5


def test_an_unclear_server_is_never_a_pass_nor_a_clean_shift(reference, scorer):
    """Shifted by +1 with the model's numbers blurred: +1 fits best, but not by 10x, so the summary says so."""
    result, route = prompt_route(reference, scorer, "blurred")
    assert result.status is Status.FAIL, result.summary
    assert route["offset"] == 1 and not route["clear"]
    assert "misaligned, best fit at +1" in result.summary and "though not by 10x" in result.summary
    assert "shifted by" not in result.summary


def test_a_garbled_server_names_neither_a_shift_nor_a_position(reference, scorer):
    """Rows at random positions: no offset fits. Judged by position at the API's alignment it used to read 'error
    uniform from position 0: weights, norm, activation or embedding, not positions' (a diagnosis of nothing that was
    measured); a server whose scores fit no alignment is a FAIL that says only that."""
    result, route = prompt_route(reference, scorer, "garbled")
    assert result.status is Status.FAIL, result.summary
    assert route["pattern"] == "no alignment" and route["onset_position"] is None
    assert result.summary.startswith("prompt route: no alignment fits: top_logprobs[i] is no closer")
    assert "not positions" not in result.summary and "shifted" not in result.summary
    assert all(f["top1_agreement"] < 0.5 for f in route["alignment"]["fits"].values())


def test_the_reference_tokenizer_is_loaded_and_decoded_once_per_subject():
    """Every comparison with a server reads the reference's tokenizer and the text of each of its ids: loaded and
    decoded once (SmolLM2's: 0.14-0.35 s a load, 0.35 s a decoding), again only when the vocabulary changes."""
    from posdiag.model.tokenizer import load_tokenizer
    from posdiag.ports.served.scores import Vocabulary

    subject = load_subject(str(MODEL))
    first = Vocabulary.of(subject)
    second = Vocabulary.of(subject)
    assert second.pieces is first.pieces and second.tokenizer is first.tokenizer is load_tokenizer(subject)[0]
    assert first.pieces[first.encode("a")[-1]] == "a"
    first.tokenizer.add_tokens(["<posdiag-added>"])
    again = Vocabulary.of(subject)
    assert again.pieces is not first.pieces and again.tokenizer is first.tokenizer
    other = Vocabulary.of(load_subject(str(MODEL)))  # another Subject loads its own
    assert other.tokenizer is not first.tokenizer and other.pieces == first.pieces
    gone = weakref.ref(first.tokenizer)  # what is kept for a tokenizer does not keep it alive
    del subject, first, second, again
    gc.collect()
    assert gone() is None
