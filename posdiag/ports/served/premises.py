"""Whether each serving path ran as its name says, read from what the server reports: a PASS on a path claims that
path, so a premise the run cannot confirm makes the path "not confirmed" (WARN), never a PASS.

- cold: the server served none of the prompt from its cache (its cached-token count: 0).
- prefix hit: it served some of the shared prefix from its cache (the reply's cached-token count, else vLLM's
  /metrics `vllm:prefix_cache_hits_total` over the request).
- long prompt: the tokens it computed exceed the server's batch (vLLM's max_num_batched_tokens, reported at
  /server_info when it runs with VLLM_SERVER_DEV_MODE=1; its /metrics count a chunked prefill as one step).
- concurrent: the requests were in flight together (each one's send and receive times, measured here); where the
  server counts its steps, whether it batched them or ran them one after another is said too.

Where the server reports nothing a premise needs, the path is not confirmed and the report says what to turn on.
The counters are the whole server's: another client's requests at the same time would count too (named).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from posdiag.ports.served.serving_paths import PathRun, Prompts

HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
STEPS = "vllm:iteration_tokens_total_count"
REPORT_CACHED = ("the server reported no cached tokens (vLLM: start it with --enable-prompt-tokens-details, or "
                 "serve /metrics; llama.cpp's server reports timings.cache_n)")


@dataclass(frozen=True)
class Premise:
    """confirmed: True (the server's report shows it), False (the report shows it did not happen), None (the server
    reports nothing that shows either). evidence: the numbers, in words."""

    confirmed: bool | None
    evidence: str


def read(run: PathRun, texts: Prompts) -> Premise:
    """The premise of RUN, a path that ran and was answered."""
    return {"cold": _cold, "prefix hit": _hit, "long prompt": _long,
            "concurrent": _concurrent}[run.name](run, texts)


def _cold(run: PathRun, texts: Prompts) -> Premise:
    reply = run.sent[0].reply
    cached, total = reply.cached_tokens, reply.prompt_tokens
    if cached is None:
        return Premise(None, f"cold not confirmed: {REPORT_CACHED}")
    if cached > 0:
        return Premise(False, f"not cold: the server served {cached} of its {total} prompt tokens from its cache (an "
                              "earlier request on the same prompt: restart the server, or clear its prefix cache)")
    return Premise(True, f"cold: the server reported 0 cached tokens of {total}")


def _hit(run: PathRun, texts: Prompts) -> Premise:
    reply, shared = run.sent[0].reply, texts.prefix_tokens
    cached, total = reply.cached_tokens, reply.prompt_tokens
    short = (f"; a prefix of {shared} tokens is shorter than the server's cache block? (--prefix-tokens; vLLM on CPU "
             "caches 128-token blocks by default)")
    if cached is not None:
        if cached == 0:
            return Premise(False, f"did not hit: the server reported 0 cached tokens of {total}, {shared} shared with "
                                  f"the request before{short}")
        return Premise(True, f"hit: the server reported {cached} cached tokens of {total} ({shared} shared)")
    metrics = run.evidence.get("metrics") or {}
    if HITS in metrics:
        hits, queries = int(metrics[HITS]), int(metrics.get(QUERIES, 0))
        if hits <= 0:
            return Premise(False, f"did not hit: the server's {HITS} rose by 0 over the request ({queries} tokens "
                                  f"queried, {shared} shared with the request before){short}")
        return Premise(True, f"hit: the server's {HITS} rose by {hits} over the request ({queries} tokens queried, "
                             f"{shared} shared; the counter is the whole server's)")
    return Premise(None, f"prefix hit not confirmed: {REPORT_CACHED}")


def _long(run: PathRun, texts: Prompts) -> Premise:
    reply = run.sent[0].reply
    total, cached = reply.prompt_tokens or 0, reply.cached_tokens or 0
    scheduler = (run.evidence.get("config") or {}).get("scheduler_config") or {}
    batch = scheduler.get("max_num_batched_tokens")
    if not isinstance(batch, int) or batch <= 0:
        return Premise(None, "several batches not confirmed: the server does not report its batch size (vLLM: "
                             "VLLM_SERVER_DEV_MODE=1 serves it at /server_info); make --long-prompt-tokens, now "
                             f"{texts.long_tokens}, exceed llama.cpp's --batch-size or vLLM's "
                             "--max-num-batched-tokens")
    computed = total - cached
    if computed <= batch:
        return Premise(False, f"one batch: {computed} of its {total} prompt tokens computed ({cached} from the "
                              f"cache), within the server's max_num_batched_tokens {batch}: raise "
                              "--long-prompt-tokens past it")
    return Premise(True, f"several batches: {computed} of its {total} prompt tokens computed ({cached} from the "
                         f"cache) in chunks of at most {batch} (the server's max_num_batched_tokens, /server_info)")


def _concurrent(run: PathRun, texts: Prompts) -> Premise:
    times: list[tuple[float, float]] = run.evidence.get("times") or []
    if len(times) < 2:
        return Premise(None, "overlap not confirmed: fewer than two requests answered")
    overlap = min(r for _, r in times) - max(s for s, _ in times)
    if overlap > 0:
        return Premise(True, f"overlapped: all {len(times)} requests in flight together for {overlap:.3g} s"
                       + _batched(run))
    # A reply that ends early (a request that stops at its end-of-text) can come back before the last request is
    # sent; the path's request (the first) still shares the server with each other one while both are in flight.
    (sent, back), others = times[0], times[1:]
    shared = min(min(back, b) - max(sent, s) for s, b in others)
    if shared > 0:
        return Premise(True, f"overlapped: the cold request in flight with each of the {len(others)} others for "
                             f"{shared:.3g} s at least" + _batched(run))
    return Premise(False, f"not concurrent: the first reply came back {-overlap:.3g} s before the last request was "
                          "sent, and the cold request was not in flight with each of the others")


def _batched(run: PathRun) -> str:
    metrics: dict[str, Any] = run.evidence.get("metrics") or {}
    if STEPS not in metrics:
        return " (batched or queued: the server does not count its steps)"
    steps, serial = int(metrics[STEPS]), sum(len(s.reply.scored) for s in run.sent)
    how = "batched" if steps < serial else "queued, one at a time"
    return f" ({how}: {steps} engine steps for {serial} generated tokens)"
