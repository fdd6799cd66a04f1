"""What an HTTP error status from a server means: a 5xx (500, 502, 503...) is the server failing at what it offers, an
error of the candidate; a 4xx (400, 404, 422, 429) or a 501 is a refusal, an option the server does not offer.

On the serving paths a 5xx on one path FAILs that path naming the status and the server's message (as a crash on a
path does in process), a refusal leaves it not run (SKIP naming the status); on the prompt and generation routes, which
every comparison needs, a 5xx ends the run as a server failing does (EngineCrash, exit 3), a refusal as a usage
error (exit 2). A canned OpenAI-compatible server on 127.0.0.1 generates greedily with its own copy of
fixtures/window-text (a trained character-level Mistral with its tokenizer), the way a server runs it, and answers
one chosen prompt with an error status; its healthy replies PASS."""

import pytest
import torch
from canned_server import canned_server
from test_served_prompt_route import MODEL

from posdiag.errors import EngineCrash, PosdiagError
from posdiag.model.loading import load_subject
from posdiag.ports.engines.http_server import open_served
from posdiag.ports.served import compare_served
from posdiag.results import Status

N = 8  # generated tokens a request
MESSAGE = "out of memory in the KV cache"


@pytest.fixture(scope="module")
def reference():
    return load_subject(str(MODEL))


@pytest.fixture(scope="module")
def generate():
    """The server's side: (prompt, n, k) -> (prompt tokens, generated pieces, their log-probs, their top-k)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL).eval()
    pieces = tokenizer.batch_decode([[i] for i in range(model.config.vocab_size)])

    def run(text, n, k, stop=False):
        """STOP: the last token is the end-of-sequence one, as a server that stopped there."""
        ids = tokenizer(text)["input_ids"]
        out, lps, tops = [], [], []
        with torch.no_grad():
            for step in range(n):
                lp = model(torch.tensor([ids + out])).logits[0, -1].float().log_softmax(-1)
                values, which = lp.topk(k)
                out.append(tokenizer.eos_token_id if stop and step == n - 1 else int(which[0]))
                lps.append(float(lp[out[-1]]))
                tops.append({pieces[j]: float(v) for v, j in zip(values, which.tolist(), strict=True)})
        return len(ids), [pieces[i] for i in out], lps, tops

    return run


def server(generate, status=None, on=2, stop=False):
    """A canned server generating as the model does; STATUS (with MESSAGE) answers the ON-th distinct prompt it is sent
    (the serving paths send the cold prompt first, then the prefix hit)."""
    seen = []

    def answer(method, path, body, headers):
        if path.endswith("/models"):
            return 200, {"data": [{"id": "canned"}]}, {}
        if method != "POST":
            return 404, {"error": {"message": "not served"}}, {}
        if body["prompt"] not in seen:
            seen.append(body["prompt"])
        if status is not None and seen.index(body["prompt"]) == on - 1:
            return status, {"error": {"message": MESSAGE, "code": status}}, {}
        count, tokens, lps, tops = generate(body["prompt"], int(body["max_tokens"]), int(body["logprobs"]), stop)
        logprobs = {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops}
        text = "".join(tokens[:-1] if stop else tokens)  # vLLM leaves the token it stopped at out of the text
        choice = {"text": text, "finish_reason": "stop" if stop else "length", "logprobs": logprobs}
        return 200, {"choices": [choice], "usage": {"prompt_tokens": count}}, {}

    return canned_server(answer)


def serving(reference, generate, status=None):
    with server(generate, status) as base:
        result = compare_served(reference, open_served(base), route="serving", new_tokens=N).result
    return result, result.details["routes"]


def test_the_healthy_canned_server_passes(reference, generate):
    # the twin of every planted status below: the same server answering every request
    with server(generate) as base:
        result = compare_served(reference, open_served(base), route="generation", new_tokens=N).result
    assert result.status is Status.PASS, result.summary
    assert result.details["routes"]["generation"]["worst_ratio"] <= 10
    result, routes = serving(reference, generate)
    assert result.status is not Status.FAIL, result.summary
    for name in ("serving/cold", "serving/prefix hit"):  # judged on its replies (a premise this server does not
        route = routes[name]  # report is not confirmed: WARN)
        assert route["status"] in ("pass", "warn") and route["worst_ratio"] <= 10, result.summary
        assert route["top1_agreement"] == 1.0


def test_a_reply_that_stops_at_the_end_of_sequence_token_is_judged(reference, generate):
    """A server leaves the special token it stopped at out of its text (vLLM 0.32 on SmolLM2's chat replies): the
    tokens still decode to the text, and the stop token's log-prob is judged with the rest."""
    with server(generate, stop=True) as base:
        result = compare_served(reference, open_served(base), route="generation", new_tokens=N).result
    route = result.details["routes"]["generation"]
    assert result.status is Status.PASS and route["finish_reason"] == "stop", result.summary
    assert route["generated"] == N


@pytest.mark.parametrize("status", [500, 503])
def test_a_server_error_on_one_path_fails_that_path_naming_the_status(reference, generate, status):
    result, routes = serving(reference, generate, status)
    assert result.status is Status.FAIL, result.summary
    hit = routes["serving/prefix hit"]
    assert hit["status"] == "fail" and hit["pattern"] == "server error", hit
    assert [n for n, r in routes.items() if r["status"] == "fail"] == ["serving/prefix hit"], result.summary
    assert result.summary.startswith("serving/prefix hit route: the server failed on it (the server at "), (
        result.summary)
    assert f"answered HTTP {status} while generating {N} tokens: {MESSAGE})" in result.summary
    assert routes["serving/cold"]["status"] in ("pass", "warn"), result.summary  # the same server, judged


@pytest.mark.parametrize("status", [429, 501])
def test_a_refusal_on_one_path_is_not_run_naming_the_status(reference, generate, status):
    result, routes = serving(reference, generate, status)
    assert result.status is not Status.FAIL, result.summary
    assert routes["serving/prefix hit"]["status"] == "skip", routes["serving/prefix hit"]
    assert ("serving/prefix hit route: not run, the server does not offer it (the server at " in result.summary
            and f"answered HTTP {status} while generating {N} tokens: {MESSAGE})" in result.summary), result.summary
    assert routes["serving/cold"]["status"] in ("pass", "warn"), result.summary


def test_a_server_error_on_the_generation_route_is_the_server_failing(reference, generate):
    """The route every comparison needs: a 5xx ends the run as a server that died does (exit 3); a refusal is the
    user's to change (exit 2), never a failure of the server."""
    from typer.testing import CliRunner

    from posdiag.cli import app

    for status, raised, code in ((502, EngineCrash, 3), (501, PosdiagError, 2)):
        with server(generate, status, on=1) as base:
            with pytest.raises(raised, match=rf"answered HTTP {status} while generating {N} tokens: {MESSAGE}$") as exc:
                compare_served(reference, open_served(base), route="generation", new_tokens=N)
            assert isinstance(exc.value, EngineCrash) is (status != 501)
            out = CliRunner().invoke(app, ["compare", str(MODEL), base, "--route", "generation", "--seq-len", str(N)])
        assert out.exit_code == code, out.output
        assert f"answered HTTP {status}" in out.stderr and "Traceback" not in out.output
