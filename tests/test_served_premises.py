"""What confirms each serving path (posdiag/ports/served/premises.py), read from replies and counters as servers give
them, without a server: a premise shown is True, one shown not to hold False (with the numbers), one the server
does not report None (never read as confirmed). The servers themselves: tests/test_served_serving.py (a proxy that
reports as vLLM does) and tests/test_served_vllm.py (vLLM, opt-in)."""

from __future__ import annotations

from posdiag.ports.engines.http_server import Reply, Scored, cached_tokens, prometheus_sums
from posdiag.ports.served import premises
from posdiag.ports.served.serving_paths import PathRun, Prompts, Sent

TEXTS = Prompts("cold", "hit", "long", ("a", "b"), prefix_words=200, long_tokens=90, prefix_tokens=256)


def _run(name: str, cached: int | None = None, prompt: int = 270, generated: int = 8, **evidence) -> PathRun:
    reply = Reply(tuple(Scored(" x", -1.0, {" x": -1.0}) for _ in range(generated)), "", prompt, "length",
                  cached_tokens=cached)
    return PathRun(name, "story", [Sent("p", reply)], evidence=evidence)


def test_the_cached_token_count_is_read_where_servers_put_it():
    assert cached_tokens({"usage": {"prompt_tokens_details": {"cached_tokens": 256}}}) == 256  # vLLM, OpenAI
    assert cached_tokens({"usage": {"prompt_tokens_details": None}, "timings": {"cache_n": 31}}) == 31  # llama.cpp
    assert cached_tokens({"usage": {"prompt_tokens": 9}}) is None  # llama-cpp-python: nothing
    sums = prometheus_sums('# HELP h\nvllm:prefix_cache_hits_total{engine="0",model_name="a b"} 128.0\n'
                           'vllm:prefix_cache_hits_total{engine="1"} 2\nup 1 1700000000\nbroken\n')
    assert sums == {"vllm:prefix_cache_hits_total": 130.0, "up": 1.0}


def test_a_hit_is_confirmed_by_cached_tokens_or_the_counters_and_zero_is_did_not_hit():
    hit = premises.read(_run("prefix hit", cached=256), TEXTS)
    assert hit.confirmed is True and "reported 256 cached tokens of 270" in hit.evidence
    missed = premises.read(_run("prefix hit", cached=0), TEXTS)
    assert missed.confirmed is False and missed.evidence.startswith("did not hit: the server reported 0 cached")
    assert "a prefix of 256 tokens is shorter than the server's cache block?" in missed.evidence
    counted = premises.read(_run("prefix hit", metrics={premises.HITS: 128.0, premises.QUERIES: 270.0}), TEXTS)
    assert counted.confirmed is True and "rose by 128 over the request (270 tokens queried" in counted.evidence
    unreported = premises.read(_run("prefix hit", metrics=None), TEXTS)
    assert unreported.confirmed is None and "--enable-prompt-tokens-details" in unreported.evidence
    cold = premises.read(_run("cold", cached=128), TEXTS)
    assert cold.confirmed is False and cold.evidence.startswith("not cold: the server served 128 of its 270")


def test_a_long_prompt_is_several_batches_only_past_the_batch_the_server_reports():
    config = {"scheduler_config": {"max_num_batched_tokens": 64}}
    assert premises.read(_run("long prompt", cached=0, prompt=90, config=config), TEXTS).confirmed is True
    cached = premises.read(_run("long prompt", cached=64, prompt=90, config=config), TEXTS)
    assert cached.confirmed is False and "26 of its 90 prompt tokens computed (64 from the cache)" in cached.evidence
    assert premises.read(_run("long prompt", prompt=90, config=None), TEXTS).confirmed is None


def test_concurrent_requests_must_overlap():
    run = _run("concurrent", times=[(0.0, 2.0), (0.1, 2.1), (0.2, 2.2)], metrics={premises.STEPS: 10.0})
    run.sent.extend(run.sent * 2)
    together = premises.read(run, TEXTS)
    assert together.confirmed is True and "in flight together for 1.8 s (batched: 10 engine steps" in together.evidence
    apart = premises.read(_run("concurrent", times=[(0.0, 1.0), (1.5, 2.0)]), TEXTS)
    assert apart.confirmed is False and "came back 0.5 s before the last request was sent" in apart.evidence
    # one short reply back before the last request went out; the cold request (the first) was in flight with each
    early = premises.read(_run("concurrent", times=[(0.0, 3.0), (0.1, 0.4), (0.5, 2.5)]), TEXTS)
    assert early.confirmed is True, early.evidence
    assert "the cold request in flight with each of the 2 others for 0.3 s" in early.evidence
    alone = premises.read(_run("concurrent", times=[(0.0, 0.3), (0.1, 0.4), (0.5, 2.5)]), TEXTS)
    assert alone.confirmed is False, alone.evidence
