"""compare --route serving against llama-cpp-python's server on 127.0.0.1 (the real SmolLM2's F32 twin, prompt cache
on, a 16-token batch): the request cold, a prefix-cache hit, a prompt longer than the batch and the request among
concurrent ones, each judged against the reference. A proxy in front of the same server plants a prefix hit served
one slot off (FAIL on the hit, the cold request right) and refuses concurrent requests (named, not failed)."""

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

from posdiag.model.gguf_file import rewrite
from posdiag.model.loading import load_subject
from posdiag.ports.engines.http_server import open_served
from posdiag.ports.served import compare_served
from tests.llama_server import llama_server

pytestmark = pytest.mark.xdist_group("smollm2-served")  # with test_served.py: the reference is made once
BATCH = 16  # the server's prompt batch: the long prompt (~90 tokens) is evaluated in six
N = 8  # generated tokens a request: a slot kept before a cached prefix shows from the first


@pytest.fixture(scope="module")
def served(smollm2_dir, smollm2_gguf, tmp_path_factory):
    """(reference, base URL) of a server of the F32 twin with its prompt cache on and a small batch."""
    twin = rewrite(str(smollm2_gguf), tmp_path_factory.mktemp("serving") / "twin.gguf", dequantise=True)
    options = ("--n_batch", str(BATCH), "--n_ubatch", str(BATCH), "--cache", "True")
    with llama_server(twin, n_ctx=512, extra=options) as (base, _):
        yield load_subject(str(smollm2_dir)), base


def proxy(base: str, *, slot_off: bool = False, refuse_concurrent: bool = False):
    """A server in front of BASE. `slot_off`: a prompt sharing its first ten words with the previous prompt (a
    prefix-cache hit) is run with one token more before it (a stale slot kept), its token count reported as asked.
    `refuse_concurrent`: a request arriving while another runs is answered HTTP 429."""
    state = {"previous": None, "running": 0}
    lock = threading.Lock()

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
            prompt = body["prompt"]
            previous, state["previous"] = state["previous"], prompt
            hit = previous is not None and previous != prompt and previous.split()[:10] == prompt.split()[:10]
            sent = {**body, "prompt": "\n" + prompt} if slot_off and hit else body
            request = urllib.request.Request(base + path[len("/v1"):], json.dumps(sent).encode(),
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request) as r:
                reply = json.load(r)
            if sent is not body:
                reply["usage"]["prompt_tokens"] -= 1
            return 200, reply, {}
        finally:
            with lock:
                state["running"] -= 1

    return canned_server(answer)


def test_every_serving_path_of_a_healthy_server_passes(served):
    """Measured: each path within 1.0-1.7x its floor, |Δ log-prob| at most 8e-6, top-1 100%."""
    reference, base = served
    result = compare_served(reference, open_served(base), route="serving", new_tokens=N).result
    assert result.status is Status.PASS, result.summary
    routes = result.details["routes"]
    assert list(routes) == ["serving/cold", "serving/prefix hit", "serving/long prompt", "serving/concurrent"]
    assert all(r["status"] == "pass" and r["top1_agreement"] == 1.0 for r in routes.values()), result.summary
    assert routes["serving/long prompt"]["first_position"] > 4 * BATCH  # its prompt ran in several batches
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
    with proxy(base) as twin:  # the same proxy passing requests as they are
        assert compare_served(reference, open_served(twin), route="serving", new_tokens=N).result.status is Status.PASS


def test_a_path_the_server_refuses_is_named_not_failed(served):
    reference, base = served
    with proxy(base, refuse_concurrent=True) as one_at_a_time:
        result = compare_served(reference, open_served(one_at_a_time), route="serving", new_tokens=N).result
    assert result.status is Status.PASS, result.summary
    assert result.details["routes"]["serving/concurrent"]["status"] == "skip"
    assert "serving/concurrent route: not run, the server does not offer it (the server at" in result.summary
    assert "answered HTTP 429" in result.summary
