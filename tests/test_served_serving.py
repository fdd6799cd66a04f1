"""compare --route serving against llama-cpp-python's server on 127.0.0.1 (the real SmolLM2's F32 twin, prompt cache
on, a 64-token batch: the cold prompt fits one, the long prompt does not): the request cold, a prefix-cache hit, a
prompt longer than the batch and the request among concurrent ones, each judged against the reference. Proxies in
front of the same server plant one bug a path: a prefix hit served one slot off (FAIL on the hit, the cold request
right), a prompt longer than the batch losing the token at the boundary (FAIL on the long prompt only), a request
run one slot on while another is in flight (FAIL on the concurrent path only); one refuses concurrent requests
(named, not failed). The proxies pass the requests they do not plant as they are, and those paths PASS (the cold
request, the prefix hit and the concurrent one through the long-prompt proxy; the long prompt through the concurrent
one): the proxy itself is shown healthy on every path."""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest
from canned_server import canned_server

from posdiag.results import Status

pytest.importorskip("gguf", reason="GGUF files need the gguf package: pip install 'posdiag[gguf]'")
pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'posdiag[gguf]')")
pytest.importorskip("fastapi", reason="llama-cpp-python's server extra is not installed (pip install 'posdiag[dev]')")

from posdiag.model.loading import load_subject
from posdiag.ports.engines.http_server import open_served
from posdiag.ports.protocol import CompareRequest
from posdiag.ports.served import compare_served, judge
from tests.llama_server import llama_server

pytestmark = pytest.mark.xdist_group("smollm2-served")  # with test_served.py: the reference is made once
BATCH = 64  # the server's prompt batch: the cold prompt (33 tokens) is evaluated in one, the long prompt in two
N = 8  # generated tokens a request: a slot kept before a cached prefix shows from the first


@pytest.fixture(scope="module")
def served(smollm2_dir, smollm2_twin):
    """(reference, base URL) of a server of the F32 twin with its prompt cache on and a small batch."""
    options = ("--n_batch", str(BATCH), "--n_ubatch", str(BATCH), "--cache", "True")
    with llama_server(smollm2_twin, n_ctx=512, extra=options) as (base, _):
        yield load_subject(str(smollm2_dir)), base


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as r:
        return json.load(r)


def proxy(base: str, *, slot_off: bool = False, refuse_concurrent: bool = False, drop_at: int | None = None,
          shift_concurrent: bool = False):
    """A server in front of BASE; every planted request has its token count reported as asked.
    `slot_off`: a prompt sharing its first ten words with the previous prompt (a prefix-cache hit) is run with one
    token more before it (a stale slot kept).
    `drop_at`: a prompt of more than DROP_AT tokens (longer than a batch of that size) loses token DROP_AT, the first
    of its second batch (chunked prefill dropping the token at the boundary); shorter prompts run as they are.
    `shift_concurrent`: a request arriving while another is in flight is run with one token more before it (its
    positions one on, as a batch row numbered from the wrong start); a request alone runs as it is.
    `refuse_concurrent`: a request arriving while another runs is answered HTTP 429."""
    state = {"previous": None, "running": 0}
    lock = threading.Lock()
    root = base[:-len("/v1")]

    def planted(prompt: str, busy: bool) -> tuple[str, int | None]:
        """The prompt run instead of PROMPT (itself when nothing is planted on it), and the count to report."""
        previous, state["previous"] = state["previous"], prompt
        hit = previous is not None and previous != prompt and previous.split()[:10] == prompt.split()[:10]
        if (slot_off and hit) or (shift_concurrent and busy):
            return "\n" + prompt, None
        if drop_at is not None:
            tokens = _post(root + "/extras/tokenize", {"input": prompt})["tokens"]
            if len(tokens) > drop_at:
                kept = tokens[:drop_at] + tokens[drop_at + 1:]
                return _post(root + "/extras/detokenize", {"tokens": kept})["text"], len(tokens)
        return prompt, None

    def answer(method, path, body, headers):
        if method == "GET":
            with urllib.request.urlopen(base + path[len("/v1"):]) as r:
                return 200, json.load(r), {}
        with lock:
            busy = state["running"] > 0
            state["running"] += 1
        try:
            if refuse_concurrent and busy:
                return 429, {"error": {"message": "one request at a time"}}, {}
            run, count = planted(body["prompt"], busy)
            reply = _post(base + path[len("/v1"):], {**body, "prompt": run})
            if run != body["prompt"]:
                reply["usage"]["prompt_tokens"] = count if count is not None else reply["usage"]["prompt_tokens"] - 1
            return 200, reply, {}
        finally:
            with lock:
                state["running"] -= 1

    return canned_server(answer)


def test_every_serving_path_of_a_healthy_server_passes(served, monkeypatch):
    """Measured: each path within 1.0-1.7x its floor, |Δ log-prob| at most 8e-6, top-1 100%. Replies the server
    gave alike (a prompt cold and as a prefix hit) are scored on the reference once."""
    import posdiag.ports.served as served_module

    reference, base = served
    scored, reference_scores = [], served_module.reference_scores
    monkeypatch.setattr(served_module, "reference_scores",
                        lambda ref, ids, *a, **k: scored.append(tuple(ids)) or reference_scores(ref, ids, *a, **k))
    result = compare_served(reference, open_served(base), route="serving", new_tokens=N).result
    assert len(scored) == len(set(scored)) < sum(r["requests"] for r in result.details["routes"].values())
    assert result.status is Status.PASS, result.summary
    routes = result.details["routes"]
    assert list(routes) == ["serving/cold", "serving/prefix hit", "serving/long prompt", "serving/concurrent"]
    assert all(r["status"] == "pass" and r["top1_agreement"] == 1.0 for r in routes.values()), result.summary
    assert routes["serving/long prompt"]["first_position"] >= 89 > BATCH  # the default 90 tokens: two batches
    assert routes["serving/cold"]["first_position"] < BATCH  # one batch
    assert routes["serving/concurrent"]["requests"] == 3
    assert result.summary.startswith("serving/cold route: same function within its floor at every position")


def test_a_prefix_hit_served_one_slot_off_fails_the_hit_not_the_cold_request(served):
    reference, base = served
    with proxy(base, slot_off=True) as planted:
        result = compare_served(reference, open_served(planted), route="serving", new_tokens=N).result
    routes = result.details["routes"]
    assert result.status is Status.FAIL, result.summary
    assert routes["serving/cold"]["status"] == "pass"
    assert routes["serving/prefix hit"]["status"] == "fail", result.summary
    assert routes["serving/prefix hit"]["onset_position"] == routes["serving/prefix hit"]["first_position"]
    assert result.summary.startswith("serving/prefix hit route: error from position 34 on"), result.summary
    assert "right after it, a prompt sharing its first 20 words" in result.summary


def test_a_path_the_server_refuses_is_named_not_failed(served):
    reference, base = served
    with proxy(base, refuse_concurrent=True) as one_at_a_time:
        result = compare_served(reference, open_served(one_at_a_time), route="serving", new_tokens=N).result
    assert result.status is Status.PASS, result.summary
    assert result.details["routes"]["serving/concurrent"]["status"] == "skip"
    assert "serving/concurrent route: not run, the server does not offer it (the server at" in result.summary
    assert "answered HTTP 429" in result.summary


def test_a_long_prompt_losing_the_token_at_the_batch_boundary_fails_that_path_only(served):
    """The long prompt's length is the user's (--long-prompt-tokens, here 120 through the request)."""
    reference, base = served
    request = CompareRequest(route="serving", seq_len=N, long_prompt=120)
    with proxy(base, drop_at=BATCH) as planted:
        result = judge(reference, open_served(planted), request).result
    routes = result.details["routes"]
    assert result.status is Status.FAIL, result.summary
    assert routes["serving/long prompt"]["status"] == "fail", result.summary
    assert routes["serving/long prompt"]["first_position"] >= 119
    assert [r["status"] for n, r in routes.items() if n != "serving/long prompt"] == ["pass"] * 3, result.summary
    assert result.summary.startswith("serving/long prompt route: error from position 1"), result.summary
    assert "a prompt of 120+ tokens" in result.summary


def test_a_request_run_one_slot_on_while_another_is_in_flight_fails_the_concurrent_path_only(served):
    reference, base = served
    with proxy(base, shift_concurrent=True) as planted:
        result = compare_served(reference, open_served(planted), route="serving", new_tokens=N).result
    routes = result.details["routes"]
    assert result.status is Status.FAIL, result.summary
    assert routes["serving/concurrent"]["status"] == "fail", result.summary
    assert [r["status"] for n, r in routes.items() if n != "serving/concurrent"] == ["pass"] * 3, result.summary
    assert result.summary.startswith("serving/concurrent route: error from position"), result.summary
    assert "the cold prompt sent at once with 2 other requests" in result.summary


def test_the_long_prompt_option_is_refused_where_it_is_not_read(served):
    from typer.testing import CliRunner

    from posdiag.cli import app
    from posdiag.errors import PosdiagError

    reference, base = served
    out = CliRunner().invoke(app, ["compare", "fixtures/llama-tiny", base, "--long-prompt-tokens", "120"])
    assert out.exit_code == 2 and "--long-prompt-tokens: for --route serving" in out.output, out.output
    out = CliRunner().invoke(app, ["compare", "fixtures/llama-tiny", "fixtures/llama-tiny", "--long-prompt-tokens",
                                   "120"])
    assert out.exit_code == 2 and "for a server candidate" in out.output, out.output
    with pytest.raises(PosdiagError, match="exceed the reference's declared context of 8192 tokens"):
        compare_served(reference, open_served(base), route="serving", new_tokens=N, long_prompt=8190)
