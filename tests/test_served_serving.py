"""compare --route serving against llama-cpp-python's server on 127.0.0.1 (the real SmolLM2's F32 twin, prompt cache
on, a 64-token batch: the cold prompt fits one, the long prompt does not): the request cold, a prefix-cache hit, a
prompt longer than the batch and the request among concurrent ones, each judged against the reference, and each
path's premise read from what the server reports (posdiag/ports/served/premises.py). This server reports no cached
tokens and no batch size: its paths agree but only the concurrent one is confirmed (WARN). Proxies in front of it
report as vLLM does (cached tokens in whole blocks, its batch at /server_info: every path confirmed, PASS) and plant
one bug a path: a prefix hit one position on only when a whole block is served from the cache (FAIL on the hit; a
prefix under one block never reaches it: tests/test_served_vllm.py), a prefix hit served one slot off, a prompt longer
than the batch losing the token at the boundary, a request run one slot on while another is in flight (FAIL on that
path only); one refuses concurrent requests (named, not failed). The proxies pass the requests they do not plant as
they are, and those paths do not fail: the proxy itself is shown healthy on every path."""

from __future__ import annotations

import json
import re
import threading
import urllib.request
from pathlib import Path

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
BLOCK = 32  # the cache block the vLLM-like proxies report hits in (vLLM's smallest on CPU; 128 by default)
PREFIX = 40  # the shared prefix here: past one BLOCK, and the cold prompt within one BATCH (the default 256 tokens,
# two of vLLM's 128-token CPU blocks, is held by test_the_default_prefix_spans_two_of_vllms_cpu_blocks)


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
          shift_concurrent: bool = False, cached: str | None = None, shift_on_hit: bool = False,
          batch: int | None = None):
    """A server in front of BASE; every planted request has its token count reported as asked.
    `cached`: report usage.prompt_tokens_details.cached_tokens as vLLM does: "blocks" the tokens the prompt shares
    with the previous prompt, in whole BLOCK-token blocks (vLLM's smallest CPU block), "zero" always 0.
    `shift_on_hit`: a prompt that hits at least one whole block is run with one token more before it (a prefix hit's
    suffix one position on): only a real hit reaches it.
    `batch`: report that batch size as vLLM's /server_info does (the server's real --n_batch).
    `slot_off`: a prompt sharing its first ten words with the previous prompt (a prefix-cache hit) is run with one
    token more before it (a stale slot kept).
    `drop_at`: a prompt of more than DROP_AT tokens (longer than a batch of that size) loses token DROP_AT, the first
    of its second batch (chunked prefill dropping the token at the boundary); shorter prompts run as they are.
    `shift_concurrent`: a request arriving while another is in flight is run with one token more before it (its
    positions one on, as a batch row numbered from the wrong start); a request alone runs as it is.
    `refuse_concurrent`: a request arriving while another runs is answered HTTP 429."""
    state = {"previous": None, "running": 0, "salted": {}}
    lock = threading.Lock()
    root = base[:-len("/v1")]

    def tokens(text: str) -> list[int]:
        return _post(root + "/extras/tokenize", {"input": text})["tokens"]

    def planted(prompt: str, busy: bool, salt: str | None) -> tuple[str, int | None, int]:
        """The prompt run instead of PROMPT (itself when nothing is planted on it), the count to report, and the
        tokens a vLLM would have served from its cache (the previous prompt sent with the same cache salt)."""
        previous, state["previous"] = state["previous"], prompt
        hit = previous is not None and previous != prompt and previous.split()[:10] == prompt.split()[:10]
        salted, state["salted"][salt] = state["salted"].get(salt), prompt
        blocks = _blocks(tokens(salted) if salted else [], tokens(prompt)) if cached or shift_on_hit else 0
        if (slot_off and hit) or (shift_concurrent and busy) or (shift_on_hit and blocks):
            return "\n" + prompt, None, blocks
        if drop_at is not None:
            ids = tokens(prompt)
            if len(ids) > drop_at:
                kept = ids[:drop_at] + ids[drop_at + 1:]
                return _post(root + "/extras/detokenize", {"tokens": kept})["text"], len(ids), blocks
        return prompt, None, blocks

    def answer(method, path, body, headers):
        if method == "GET" and batch and path.startswith("/server_info"):
            return 200, {"vllm_config": {"scheduler_config": {"max_num_batched_tokens": batch}}}, {}
        if method == "GET" and not path.startswith("/v1"):
            return 404, {"error": {"message": "not served"}}, {}
        if method == "GET":
            with urllib.request.urlopen(base + path[len("/v1"):]) as r:
                return 200, json.load(r), {}
        with lock:
            busy = state["running"] > 0
            state["running"] += 1
        try:
            if refuse_concurrent and busy:
                return 429, {"error": {"message": "one request at a time"}}, {}
            run, count, blocks = planted(body["prompt"], busy, body.get("cache_salt"))
            reply = _post(base + path[len("/v1"):], {**body, "prompt": run})
            if run != body["prompt"]:
                reply["usage"]["prompt_tokens"] = count if count is not None else reply["usage"]["prompt_tokens"] - 1
            if cached:
                reply["usage"]["prompt_tokens_details"] = {"cached_tokens": blocks if cached == "blocks" else 0}
            return 200, reply, {}
        finally:
            with lock:
                state["running"] -= 1

    return canned_server(answer)


def _blocks(previous: list[int], prompt: list[int]) -> int:
    """The tokens PROMPT shares with PREVIOUS, in whole BLOCK-token blocks (the last prompt token is always
    computed, as vLLM does)."""
    pairs = enumerate(zip(previous, prompt, strict=False))
    shared = next((i for i, (a, b) in pairs if a != b), min(len(previous), len(prompt)))
    return min(shared, len(prompt) - 1) // BLOCK * BLOCK


def test_every_serving_path_of_a_healthy_server_agrees_and_what_it_does_not_report_is_not_confirmed(served,
                                                                                                    monkeypatch):
    """llama-cpp-python's server reports no cached tokens, no batch size: every path's replies agree with the
    reference (measured: within 1.0-4.3x its floor, top-1 100%), but only the concurrent path's premise is confirmed
    (by the requests' own times), so the verdict is WARN, each path saying what it lacks. Replies the server gave
    alike are scored on the reference once."""
    import posdiag.ports.served as served_module

    reference, base = served
    scored, reference_scores = [], served_module.reference_scores
    monkeypatch.setattr(served_module, "reference_scores",
                        lambda ref, ids, *a, **k: scored.append(tuple(ids)) or reference_scores(ref, ids, *a, **k))
    result = compare_served(reference, open_served(base), route="serving", new_tokens=N, prefix_tokens=PREFIX).result
    assert len(scored) == len(set(scored)) < sum(r["requests"] for r in result.details["routes"].values())
    routes = result.details["routes"]
    assert list(routes) == ["serving/cold", "serving/prefix hit", "serving/long prompt", "serving/concurrent"]
    assert all(r["worst_ratio"] < 10 and r["top1_agreement"] == 1.0 for r in routes.values()), result.summary
    assert result.status is Status.WARN, result.summary
    assert {n: r["premise"]["confirmed"] for n, r in routes.items()} == {
        "serving/cold": None, "serving/prefix hit": None, "serving/long prompt": None, "serving/concurrent": True}
    assert [r["status"] for r in routes.values()] == ["warn", "warn", "warn", "pass"]
    assert "prefix hit not confirmed: the server reported no cached tokens (vLLM: start it with " \
           "--enable-prompt-tokens-details" in result.summary
    assert "several batches not confirmed: the server does not report its batch size" in result.summary
    assert "overlapped: all 3 requests in flight together for" in result.summary
    assert routes["serving/long prompt"]["first_position"] >= 89 > BATCH  # the default 90 tokens: two batches
    assert BATCH > routes["serving/prefix hit"]["first_position"] >= PREFIX
    assert routes["serving/concurrent"]["requests"] == 3


def test_a_server_that_reports_its_hits_and_batch_confirms_every_path(served):
    """The same server behind a proxy reporting what vLLM reports: cached tokens in whole 32-token blocks (the cold
    request 0, the prefix hit 256) and its batch size (/server_info): every path confirmed, PASS."""
    reference, base = served
    with proxy(base, cached="blocks", batch=BATCH) as reporting:
        result = compare_served(reference, open_served(reporting), route="serving", new_tokens=N,
                                prefix_tokens=PREFIX).result
    routes = result.details["routes"]
    assert result.status is Status.PASS, result.summary
    assert all(r["premise"]["confirmed"] is True for r in routes.values()), result.summary
    assert "cold: the server reported 0 cached tokens of" in result.summary
    assert f"hit: the server reported {BLOCK} cached tokens of" in result.summary
    assert f"in chunks of at most {BATCH} (the server's max_num_batched_tokens" in result.summary


def test_a_bug_only_a_real_hit_reaches_fails_the_hit(served):
    """A vLLM-like proxy that runs a prompt one position on only when it serves at least one whole block from its
    cache: a prefix past a block reaches it, FAIL on the hit alone (the 20-word prefix before --prefix-tokens, under
    one block, never did and PASSed: the real vLLM shows it, tests/test_served_vllm.py; 'did not hit' read from
    0 cached tokens: tests/test_served_premises.py)."""
    reference, base = served
    with proxy(base, cached="blocks", shift_on_hit=True, batch=BATCH) as planted:
        result = compare_served(reference, open_served(planted), route="serving", new_tokens=N,
                                prefix_tokens=PREFIX).result
    routes = result.details["routes"]
    assert result.status is Status.FAIL, result.summary
    assert [n for n, r in routes.items() if r["status"] == "fail"] == ["serving/prefix hit"], result.summary
    assert routes["serving/prefix hit"]["premise"]["confirmed"] is True
    assert result.summary.startswith("serving/prefix hit route: error from position"), result.summary


def test_a_prefix_hit_served_one_slot_off_fails_the_hit_not_the_cold_request(served):
    reference, base = served
    with proxy(base, slot_off=True) as planted:
        result = compare_served(reference, open_served(planted), route="serving", new_tokens=N,
                                prefix_tokens=PREFIX).result
    routes = result.details["routes"]
    assert result.status is Status.FAIL, result.summary
    assert routes["serving/cold"]["status"] != "fail"
    assert routes["serving/prefix hit"]["status"] == "fail", result.summary
    assert routes["serving/prefix hit"]["onset_position"] == routes["serving/prefix hit"]["first_position"]
    assert result.summary.startswith("serving/prefix hit route: error from position"), result.summary
    assert int(re.search(r"right after it, a prompt sharing its first (\d+) tokens", result.summary)[1]) >= PREFIX


def test_a_path_the_server_refuses_is_named_not_failed(served):
    reference, base = served
    with proxy(base, refuse_concurrent=True) as one_at_a_time:
        result = compare_served(reference, open_served(one_at_a_time), route="serving", new_tokens=N,
                                prefix_tokens=PREFIX).result
    assert result.status is Status.WARN, result.summary  # the other paths: not confirmed by this server
    assert result.details["routes"]["serving/concurrent"]["status"] == "skip"
    assert "serving/concurrent route: not run, the server does not offer it (the server at" in result.summary
    assert "answered HTTP 429" in result.summary


def test_a_long_prompt_losing_the_token_at_the_batch_boundary_fails_that_path_only(served):
    """The long prompt's length is the user's (--long-prompt-tokens, here 120 through the request)."""
    reference, base = served
    request = CompareRequest(route="serving", seq_len=N, long_prompt=120, prefix_tokens=PREFIX)
    with proxy(base, drop_at=BATCH) as planted:
        result = judge(reference, open_served(planted), request).result
    routes = result.details["routes"]
    assert result.status is Status.FAIL, result.summary
    assert routes["serving/long prompt"]["status"] == "fail", result.summary
    assert routes["serving/long prompt"]["first_position"] >= 119
    assert [n for n, r in routes.items() if r["status"] == "fail"] == ["serving/long prompt"], result.summary
    assert result.summary.startswith("serving/long prompt route: error from position 1"), result.summary
    assert "a prompt of 120+ tokens" in result.summary


def test_a_request_run_one_slot_on_while_another_is_in_flight_fails_the_concurrent_path_only(served):
    reference, base = served
    with proxy(base, shift_concurrent=True) as planted:
        result = compare_served(reference, open_served(planted), route="serving", new_tokens=N,
                                prefix_tokens=PREFIX).result
    routes = result.details["routes"]
    assert result.status is Status.FAIL, result.summary
    assert routes["serving/concurrent"]["status"] == "fail", result.summary
    assert [n for n, r in routes.items() if r["status"] == "fail"] == ["serving/concurrent"], result.summary
    assert result.summary.startswith("serving/concurrent route: error from position"), result.summary
    assert "the cold prompt sent at once with 2 other requests" in result.summary


def test_the_long_prompt_option_is_refused_where_it_is_not_read(served):
    from typer.testing import CliRunner

    from posdiag.cli import app
    from posdiag.errors import PosdiagError

    reference, base = served
    out = CliRunner().invoke(app, ["compare", "fixtures/llama-tiny", base, "--long-prompt-tokens", "120"])
    assert out.exit_code == 2 and "--long-prompt-tokens: for --route serving" in out.output, out.output
    out = CliRunner().invoke(app, ["compare", "fixtures/llama-tiny", base, "--prefix-tokens", "64"])
    assert out.exit_code == 2 and "--prefix-tokens: for --route serving (its prefix-hit path)" in out.output
    out = CliRunner().invoke(app, ["compare", "fixtures/llama-tiny", "fixtures/llama-tiny", "--long-prompt-tokens",
                                   "120"])
    assert out.exit_code == 2 and "for a server candidate" in out.output, out.output
    with pytest.raises(PosdiagError, match="exceed the reference's declared context of 8192 tokens"):
        compare_served(reference, open_served(base), route="serving", new_tokens=N, long_prompt=8190)
    with pytest.raises(PosdiagError, match="--prefix-tokens 8180 and 8 generated tokens exceed the reference's"):
        compare_served(reference, open_served(base), route="serving", new_tokens=N, prefix_tokens=8180)


def test_the_default_prefix_spans_two_of_vllms_cpu_blocks(served):
    """The default shared prefix: at least 256 tokens of the reference's tokenizer shared by the cold prompt and the
    hit (two 128-token blocks, vLLM's CPU default), then other suffixes; the long prompt and the concurrent ones
    start elsewhere (no hit on it)."""
    from posdiag.ports.served import serving_paths
    from posdiag.ports.served.scores import Vocabulary

    reference, _ = served
    vocab = Vocabulary.of(reference)
    words = (Path(serving_paths.__file__).parent.parent.parent / "data" / "prose.txt").read_text().split()
    texts = serving_paths.prompts(words, serving_paths.LONG_TOKENS, vocab.encode)
    cold, hit = vocab.encode(texts.cold), vocab.encode(texts.hit)
    assert texts.prefix_tokens >= serving_paths.PREFIX_TOKENS == 256 and cold[:256] == hit[:256]
    assert cold[texts.prefix_tokens] != hit[texts.prefix_tokens]
    assert all(vocab.encode(t)[:8] != cold[:8] for t in (texts.long, *texts.others))
