"""The serving paths of a server, asked from outside: which requests each path sends, in which order.

A server computes one request in one of several ways, and each must give what the reference gives on the same
tokens: the first request on a prompt (nothing cached for it), a prompt sharing a prefix with the request before it
(the prefix served from the server's cache: a prefix-cache hit), a prompt longer than the server's batch (evaluated
in several batches: chunked prefill), and the same request sent among others at once (batched or queued with them).
Every path is greedy generation with top-k log-probs (posdiag/ports/engines/http_server.ServedEngine.generate);
each reply is judged by the generation route's rule (posdiag/ports/served). A path the server refuses (an HTTP
error) is named as not offered, never failed. Requests go to the server's address only, at most CONCURRENT at once.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from posdiag.errors import PosdiagError
from posdiag.ports.engines.http_server import Reply, ServedEngine

PATHS = ("cold", "prefix hit", "long prompt", "concurrent")
CONCURRENT = 3  # requests in flight at once on the concurrent path (loopback servers share the machine's cores)
LONG_TOKENS = 90  # the long prompt's default length: past a small server batch (the tests' 64 tokens), not a big one
NEW_TOKENS = 16  # generated tokens a request


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


@dataclass(frozen=True)
class Prompts:
    """The texts the paths send: a cold prompt, the same prefix with another suffix, a long prompt, two others."""

    cold: str
    hit: str
    long: str
    others: tuple[str, str]
    prefix_words: int
    long_tokens: int  # the long prompt has at least these (the option the user sets), by the reference's tokenizer


def prompts(words: list[str], long_tokens: int, count: Callable[[str], int]) -> Prompts:
    """Texts from natural prose: a 20-word prefix shared by the cold prompt and the prefix hit, each with its own
    10-word suffix; the fewest words from the start (the prose repeated past its end) that COUNT, the reference's
    tokenizer, makes at least `long_tokens` tokens; two prompts of their own for the concurrent path."""
    if len(words) < 110:
        raise PosdiagError("the serving paths need at least 110 words of prose")
    prefix = words[:20]
    return Prompts(" ".join(prefix + words[20:30]), " ".join(prefix + words[40:50]),
                   _long(words, long_tokens, count), (" ".join(words[60:80]), " ".join(words[90:110])), len(prefix),
                   long_tokens)


def _long(words: list[str], tokens: int, count: Callable[[str], int]) -> str:
    """Every word is at least one token, so `tokens` words are enough; the fewest found by bisection (a handful of
    tokenizations, not one a word)."""
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
    prefix hit right after it)."""
    runs: list[PathRun] = []

    def ask(run: PathRun, text: str) -> Reply | None:
        try:
            reply = engine.generate(text, n, k)
        except PosdiagError as exc:  # an HTTP error: the server does not offer this path
            run.not_offered = str(exc)
            return None
        run.sent.append(Sent(text, reply))
        return reply

    cold = PathRun("cold", "the first request on its prompt, then the same request again (its spread)")
    first = ask(cold, texts.cold)
    if first is not None:
        again = engine.generate(texts.cold, n, k)  # a whole-prompt hit: measures the server's run-to-run spread
        cold.spread = spread(first, again) if spread is not None else []
    runs.append(cold)
    if "prefix hit" in chosen:
        hit = PathRun("prefix hit", f"right after it, a prompt sharing its first {texts.prefix_words} words (the "
                                    "prefix the server keeps) with another suffix")
        ask(hit, texts.hit)
        runs.append(hit)
    if "long prompt" in chosen:
        long = PathRun("long prompt", f"a prompt of {texts.long_tokens}+ tokens "
                                      f"({len(texts.long.split())} words): evaluated in several batches by a server "
                                      "whose batch or prefill chunk is shorter")
        ask(long, texts.long)
        runs.append(long)
    if "concurrent" in chosen:
        runs.append(_concurrent(engine, texts, n, k))
    return [r for r in runs if r.name in chosen]


def _concurrent(engine: ServedEngine, texts: Prompts, n: int, k: int) -> PathRun:
    run = PathRun("concurrent", f"the cold prompt sent at once with {CONCURRENT - 1} other requests")
    batch = [texts.cold, *texts.others][:CONCURRENT]
    with ThreadPoolExecutor(max_workers=CONCURRENT) as pool:
        futures = [pool.submit(engine.generate, text, n, k) for text in batch]
        replies = []
        for future in futures:
            try:
                replies.append(future.result())
            except PosdiagError as exc:
                run.not_offered = str(exc)
    if not run.not_offered:
        run.sent = [Sent(text, reply) for text, reply in zip(batch, replies, strict=True)]
    return run
