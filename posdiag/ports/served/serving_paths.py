"""The serving paths of a server, asked from outside: which requests each path sends, in which order.

A server computes one request in one of several ways, and each must give what the reference gives on the same
tokens: the first request on a prompt (nothing cached for it), a prompt sharing a prefix with the request before it
(the prefix served from the server's cache: a prefix-cache hit), a prompt longer than the server's batch (evaluated
in several batches: chunked prefill), and the same request sent among others at once (batched or queued with them).
Every path is greedy generation with top-k log-probs (posdiag/ports/engines/http_server.ServedEngine.generate);
each reply is judged by the generation route's rule (posdiag/ports/served). A path the server refuses (an HTTP
4xx or 501) is named as not offered, never failed; one it fails at (an HTTP 5xx, a dropped connection) is failed.
Requests go to the server's address only, at most CONCURRENT at once.

What each path's premise needs is kept beside its replies (`PathRun.evidence`): the server's counters before and
after it (GET /metrics, where served) and each request's send and receive times; posdiag/ports/served/premises.py
reads them. The shared prefix is PREFIX_TOKENS long because a server caches whole blocks only (vLLM: 16 tokens on
GPU, 128 by default on CPU): a prefix shorter than a block is never a hit, whatever the report says.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from posdiag.errors import EngineCrash, PosdiagError
from posdiag.ports.engines.http_server import Reply, ServedEngine

PATHS = ("cold", "prefix hit", "long prompt", "concurrent")
CONCURRENT = 3  # requests in flight at once on the concurrent path (loopback servers share the machine's cores)
LONG_TOKENS = 90  # the long prompt's default length: past a small server batch (the tests' 64 tokens), not a big one
NEW_TOKENS = 16  # generated tokens a request
PREFIX_TOKENS = 256  # the shared prefix's default: two of vLLM's 128-token CPU cache blocks (16 of its GPU blocks)


@dataclass(frozen=True)
class Sent:
    """One request of a path: its prompt text and the server's reply."""

    prompt: str
    reply: Reply


@dataclass
class PathRun:
    name: str
    story: str
    sent: list[Sent] = field(default_factory=list)
    spread: list[float] = field(default_factory=list)  # the same request twice: the server's own run-to-run spread
    not_offered: str = ""
    failed: str = ""  # the server failed at it (EngineCrash: an HTTP 5xx, a dropped connection): the path FAILs
    evidence: dict[str, Any] = field(default_factory=dict)
    """What the premise is read from: "metrics" (the server's counters' change over the path, None where it serves
    none), "times" (each request's send and receive, monotonic seconds), "config" (the configuration the server
    reports of itself, None where it reports none)."""


@dataclass(frozen=True)
class Prompts:
    """The texts the paths send: a cold prompt, the same prefix with another suffix, a long prompt, two others."""

    cold: str
    hit: str
    long: str
    others: tuple[str, str]
    prefix_words: int
    long_tokens: int  # the long prompt has at least these (the option the user sets), by the reference's tokenizer
    prefix_tokens: int = 0  # the cold prompt and the hit share their first this many tokens (the reference's)


def prompts(words: list[str], long_tokens: int, encode: Callable[[str], list[int]],
            prefix_tokens: int = PREFIX_TOKENS) -> Prompts:
    """Texts from natural prose (repeated past its end where a length asks more): a prefix of at least
    PREFIX_TOKENS tokens by ENCODE, the reference's tokenizer, shared by the cold prompt and the prefix hit, each
    with its own 10-word suffix; a long prompt of at least LONG_TOKENS tokens and two others for the concurrent path,
    each starting elsewhere in the prose (none of them a hit on the shared prefix)."""
    if len(words) < 110:
        raise PosdiagError("the serving paths need at least 110 words of prose")
    def count(text: str) -> int:
        return len(encode(text))

    prefix = _fewest(words, prefix_tokens, count).split()
    rest = (words * ((len(prefix) + 110) // len(words) + 2))[len(prefix):]
    cold, hit = " ".join(prefix + rest[:10]), " ".join(prefix + rest[20:30])
    a, b = encode(cold), encode(hit)
    shared = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return Prompts(cold, hit, _fewest(rest[40:], long_tokens, count), (" ".join(rest[60:80]), " ".join(rest[90:110])),
                   len(prefix), long_tokens, shared)


def _fewest(words: list[str], tokens: int, count: Callable[[str], int]) -> str:
    """The fewest words from the start of WORDS (repeated past its end) that COUNT makes at least TOKENS tokens.
    Every word is at least one token, so `tokens` words are enough; found by bisection (a handful of tokenizations,
    not one a word)."""
    pool = words * (tokens // len(words) + 1)
    low, high = 1, tokens
    while low < high:
        mid = (low + high) // 2
        if count(" ".join(pool[:mid])) >= tokens:
            high = mid
        else:
            low = mid + 1
    return " ".join(pool[:low])


def run_paths(engine: ServedEngine, texts: Prompts, n: int, k: int, chosen: tuple[str, ...] = PATHS,
              spread: Callable[[Reply, Reply], list[float]] | None = None) -> list[PathRun]:
    """Every chosen path's requests, in the order that makes each path what it is (the cold prompt first, then the
    prefix hit right after it), each path's requests between two readings of the server's counters. The requests
    carry a cache salt of this run's own (vLLM keys its prefix cache on it: the cold prompt is cold though an earlier
    run sent it)."""
    engine.cache_salt = secrets.token_hex(8)
    try:
        return _run_paths(engine, texts, n, k, chosen, spread)
    finally:
        engine.cache_salt = None


def _run_paths(engine: ServedEngine, texts: Prompts, n: int, k: int, chosen: tuple[str, ...],
               spread: Callable[[Reply, Reply], list[float]] | None) -> list[PathRun]:
    runs: list[PathRun] = []

    def ask(run: PathRun, text: str) -> Reply | None:
        try:
            sent = time.monotonic()
            reply = engine.generate(text, n, k)
        except EngineCrash as exc:  # an HTTP 5xx or a dropped connection: the server failed on this path
            run.failed = str(exc)
            return None
        except PosdiagError as exc:  # a refusal (HTTP 4xx, 501): the server does not offer this path
            run.not_offered = str(exc)
            return None
        run.evidence.setdefault("times", []).append((sent, time.monotonic()))
        run.sent.append(Sent(text, reply))
        return reply

    def counted(run: PathRun, text: str) -> Reply | None:
        before = engine.metrics()
        reply = ask(run, text)
        run.evidence["metrics"] = _change(before, engine.metrics())
        return reply

    cold = PathRun("cold", "the first request on its prompt, then the same request again (its spread)")
    first = counted(cold, texts.cold)
    if first is not None:  # the same request again: the server's run-to-run spread
        salt, engine.cache_salt = engine.cache_salt, secrets.token_hex(8)  # cold again where the salt is read: a
        try:  # hit here would take the hit's path, and a bug there would widen the floor that judges the hit
            again = engine.generate(texts.cold, n, k)
        finally:
            engine.cache_salt = salt
        cold.spread = spread(first, again) if spread is not None else []
    runs.append(cold)
    if "prefix hit" in chosen:
        hit = PathRun("prefix hit", f"right after it, a prompt sharing its first {texts.prefix_tokens} tokens "
                                    f"({texts.prefix_words} words: the prefix the server keeps) with another suffix")
        counted(hit, texts.hit)
        runs.append(hit)
    if "long prompt" in chosen:
        long = PathRun("long prompt", f"a prompt of {texts.long_tokens}+ tokens "
                                      f"({len(texts.long.split())} words): evaluated in several batches by a server "
                                      "whose batch or prefill chunk is shorter")
        counted(long, texts.long)
        long.evidence["config"] = engine.server_config()
        runs.append(long)
    if "concurrent" in chosen:
        runs.append(_concurrent(engine, texts, n, k))
    return [r for r in runs if r.name in chosen]


def _change(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    """Each counter's change; None where the server serves none."""
    if before is None or after is None:
        return None
    return {name: value - before.get(name, 0.0) for name, value in after.items()}


def _concurrent(engine: ServedEngine, texts: Prompts, n: int, k: int) -> PathRun:
    run = PathRun("concurrent", f"the cold prompt sent at once with {CONCURRENT - 1} other requests")
    batch = [texts.cold, *texts.others][:CONCURRENT]

    # Every request waits until all are ready, then all go at once: on a busy machine a thread started late sent its
    # request after the cold prompt's reply was back (0.49 s measured under a 2-core test run), and nothing overlapped.
    ready = threading.Barrier(len(batch))

    def timed(text: str) -> tuple[Reply, tuple[float, float]]:
        with contextlib.suppress(threading.BrokenBarrierError):  # one never started: the times say what overlapped
            ready.wait(timeout=30.0)
        sent = time.monotonic()
        reply = engine.generate(text, n, k)
        return reply, (sent, time.monotonic())

    before = engine.metrics()
    with ThreadPoolExecutor(max_workers=CONCURRENT) as pool:
        futures = [pool.submit(timed, text) for text in batch]
        replies = []
        for future in futures:
            try:
                replies.append(future.result())
            except EngineCrash as exc:
                run.failed = str(exc)
            except PosdiagError as exc:
                run.not_offered = str(exc)
    run.evidence["metrics"] = _change(before, engine.metrics())
    if not run.not_offered and not run.failed:
        run.sent = [Sent(text, reply) for text, (reply, _) in zip(batch, replies, strict=True)]
        run.evidence["times"] = [times for _, times in replies]
    return run
