"""A served model as a candidate: an OpenAI-compatible completions endpoint (`http://HOST:PORT/v1`).

llama.cpp's server, llama-cpp-python's server, vLLM and SGLang all serve `POST {base}/completions`. What comes
back is top-k log-probs per token, never logits, and tokens as text. Two routes (posdiag/ports/served/scores.py
judges both):

- prompt: `echo` with `logprobs=k` and `max_tokens=1`: the log-probs of the prompt's own tokens, teacher-forced
  (vLLM: its `prompt_logprobs=k`, read when the reply carries it). Where the server offers them at all.
- generation: a greedy continuation (`temperature 0`, penalties off) with `logprobs=k` per generated token.

Requests go to the base URL the user named and nowhere else: redirects are refused and proxy settings from the
environment are not used (a proxy is another host). The API key comes from `--api-key` or POSDIAG_API_KEY (not
OPENAI_API_KEY: a key meant for one service is never sent to a server the user only named). Every failure is one
line: an address that cannot be reached on the first request is the user's input (PosdiagError, exit 2, as a missing
file); a timeout, or a server that answered before and then cannot be reached or drops the connection, is the server
failing (EngineCrash, exit 3), and so is an HTTP 5xx status other than 501 (the server failed at what it offers);
any other HTTP error status (a refusal: 4xx, 429, 501) or a reply without what was asked is a PosdiagError naming it
(exit 2).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from posdiag.errors import EngineCrash, PosdiagError

API_KEY_ENV = "POSDIAG_API_KEY"
DEFAULT_TIMEOUT = float(os.environ.get("POSDIAG_SERVER_TIMEOUT", "300"))
"""Seconds one request may take before the server is called unresponsive."""

GREEDY = {"temperature": 0.0, "top_p": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "seed": 0,
          "repeat_penalty": 1.0}
"""Greedy decoding with every penalty off. `repeat_penalty` is llama.cpp's name (its default 1.1 changes which
token is chosen, measured: '-' after '\\n' where '\\n' had the top log-prob); servers that do not know a field
ignore it (llama-cpp-python, vLLM). The log-probs a server reports are before any penalty either way."""


def is_url(spec: str) -> bool:
    return spec.lower().startswith(("http://", "https://"))


@dataclass(frozen=True)
class Scored:
    """One token as a server scored it: its text, its log-prob, and the top-k log-probs by token text."""

    token: str
    logprob: float | None
    top: dict[str, float]


@dataclass(frozen=True)
class Reply:
    """The tokens of one completion request, as scored: the prompt's (echo) or the generated ones."""

    scored: tuple[Scored, ...]
    text: str
    prompt_tokens: int | None
    finish_reason: str | None
    prompt_logprobs: bool = False
    """True when the scores came from vLLM's `prompt_logprobs` (token ids known), not from echo."""
    cached_tokens: int | None = None
    """Prompt tokens the server says it served from its cache (usage.prompt_tokens_details.cached_tokens: vLLM with
    --enable-prompt-tokens-details, recent llama.cpp; llama.cpp's timings.cache_n); None: it does not say."""


@dataclass(frozen=True)
class ChatReply:
    """A chat request as the server ran it: the token ids it made of the messages (images expanded into their
    placeholder tokens) and, per prompt position, the log-probs it reported by token id (position 0: none); then
    the tokens it generated greedily after them, by id, each scored as the completions API scores one."""

    ids: tuple[int, ...]
    logprobs: tuple[dict[int, float], ...]
    generated: tuple[int, ...] = ()
    scored: tuple[Scored, ...] = ()


@dataclass
class ServedEngine:
    """An OpenAI-compatible server at BASE (`http://HOST:PORT/v1`)."""

    base: str
    model: str | None = None
    api_key: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    requests: int = 0
    settings: dict[str, Any] = field(default_factory=dict)
    cache_salt: str | None = None
    """Sent with every completion while set (vLLM's `cache_salt`: its prefix cache keyed on it, so a request is
    cold to an earlier run's; other servers ignore the field): the serving paths set one per comparison."""

    @property
    def name(self) -> str:
        return self.base + (f" ({self.model})" if self.model else "")

    @property
    def paths(self) -> frozenset[str]:
        """What it can be asked (posdiag/ports/protocol.PATHS): text in, top-k log-probs out, on both routes."""
        return frozenset({"top_logprobs", "prompt_route", "generation_route"})

    @property
    def vocab_size(self) -> int | None:
        return None  # tokens come back as text

    def prompt_logprobs(self, text: str, k: int) -> Reply:
        """The prompt's own tokens, teacher-forced: echo + logprobs (max_tokens 1: 0 means 'no limit' to some
        servers); the one generated token is dropped."""
        reply = self.complete({"prompt": text, "max_tokens": 1, "echo": True, "logprobs": k,
                               "prompt_logprobs": k, **GREEDY}, "scoring the prompt")
        return prompt_part(reply, text, k)

    def generate(self, text: str, n: int, k: int) -> Reply:
        """N tokens greedily after TEXT, each with its top-K log-probs."""
        reply = self.complete({"prompt": text, "max_tokens": n, "logprobs": k, **GREEDY},
                              f"generating {n} tokens")
        return _generated_part(reply, k)

    def chat(self, content: list[dict[str, Any]], k: int, n: int) -> ChatReply:
        """One user message of CONTENT (text and image parts, OpenAI's format) through the chat API: its prompt
        scored teacher-forced (vLLM's `prompt_logprobs=k`), then N tokens generated greedily with their top-K, all by
        token id (vLLM's `return_token_ids`: the ids are the only way to know where the images sit). PosdiagError
        naming what is missing where the server returns none of it."""
        payload = {"messages": [{"role": "user", "content": content}], "max_tokens": n, "prompt_logprobs": k,
                   "logprobs": True, "top_logprobs": k, "return_token_ids": True, **GREEDY}
        reply = self.post("/chat/completions", self._addressed(payload), f"generating {n} tokens after images")
        ids, entries = reply.get("prompt_token_ids"), reply.get("prompt_logprobs")
        if not isinstance(ids, list) or not isinstance(entries, list) or len(ids) != len(entries) or not ids:
            raise PosdiagError("the server's chat API returned no prompt token ids with their log-probs (vLLM returns "
                               "them for `prompt_logprobs` and `return_token_ids`)")
        choice = _choice(reply, "generating after images")
        generated = choice.get("token_ids") or []
        content_scores = (choice.get("logprobs") or {}).get("content") or []
        try:
            prompt = tuple({int(tid): float(v["logprob"]) for tid, v in (entry or {}).items()} for entry in entries)
            scored = tuple(Scored(str(c["token"]), float(c["logprob"]),
                                  {str(t["token"]): float(t["logprob"]) for t in c.get("top_logprobs") or []})
                           for c in content_scores)
        except (TypeError, ValueError, KeyError, AttributeError):
            raise PosdiagError("the server's log-probs are not {token id: {logprob}} per prompt position and "
                               "{token, logprob, top_logprobs} per generated token") from None
        if len(scored) != len(generated):
            raise PosdiagError(f"the server's chat API returned {len(generated)} generated token ids and "
                               f"{len(scored)} scored tokens (vLLM returns both for `logprobs` and `return_token_ids`)")
        return ChatReply(tuple(int(i) for i in ids), prompt, tuple(int(i) for i in generated), scored)

    def complete(self, payload: dict[str, Any], doing: str) -> dict[str, Any]:
        return self.post("/completions", self._addressed(payload), doing)

    def _addressed(self, payload: dict[str, Any]) -> dict[str, Any]:
        """PAYLOAD with the served model named and the run's cache salt, where set."""
        if self.model:
            payload = {"model": self.model, **payload}
        if self.cache_salt:
            payload = {**payload, "cache_salt": self.cache_salt}
        return payload

    def discover(self) -> None:
        """GET /models: the server is there, and the model it serves (named in the report; the one to ask for
        when it serves several and none was named)."""
        answer = self.call("GET", "/models", None, "listing its models")
        names = [str(m.get("id")) for m in answer.get("data", []) if isinstance(m, dict)]
        self.settings["served models"] = ", ".join(names) or "none listed"
        if self.model is None and len(names) > 1:
            raise PosdiagError(f"the server at {self.base} serves {len(names)} models ({', '.join(names[:4])}): "
                               "name one with --served-model")

    def metrics(self) -> dict[str, float] | None:
        """The server's Prometheus counters (GET /metrics beside /v1: vLLM, SGLang, llama.cpp with --metrics), each
        name summed over its labels; None where it serves none (any error: the counters are evidence, not needed)."""
        text = self._beside("/metrics")
        return (prometheus_sums(text) or None) if text is not None else None

    def server_config(self) -> dict[str, Any] | None:
        """The configuration the server reports of itself (vLLM's GET /server_info, served when it runs with
        VLLM_SERVER_DEV_MODE=1), or None."""
        text = self._beside("/server_info?config_format=json")
        try:
            config = json.loads(text).get("vllm_config") if text else None
        except (ValueError, AttributeError):
            return None
        return config if isinstance(config, dict) else None

    def _beside(self, path: str) -> str | None:
        """GET PATH from the server's root (beside /v1); None on any error (what it reports is evidence, not
        needed)."""
        root = self.base[:-len("/v1")] if self.base.endswith("/v1") else self.base
        request = urllib.request.Request(root + path, method="GET")
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with _OPENER.open(request, timeout=self.timeout) as response:
                return response.read().decode(errors="replace")
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def post(self, path: str, payload: dict[str, Any], doing: str) -> dict[str, Any]:
        return self.call("POST", path, payload, doing)

    def call(self, method: str, path: str, payload: dict[str, Any] | None, doing: str) -> dict[str, Any]:
        url = self.base.rstrip("/") + path
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(payload).encode() if payload is not None else None
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        self.requests += 1
        where = f"the server at {self.base}"
        try:
            with _OPENER.open(request, timeout=self.timeout) as response:
                body = response.read()
        except urllib.error.HTTPError as exc:
            said = f"{where} answered HTTP {exc.code} while {doing}: {_error_text(exc)}"
            raise (EngineCrash if server_failed(exc.code) else PosdiagError)(said) from None
        except TimeoutError:
            raise EngineCrash(f"{where} did not answer within {self.timeout:g} s while {doing} "
                              "(POSDIAG_SERVER_TIMEOUT sets the limit)") from None
        except urllib.error.URLError as exc:
            if self.requests == 1:  # never answered: the address given is wrong or nothing runs there
                raise PosdiagError(f"{where} could not be reached ({_reason(exc.reason)}): is it running, and is "
                                   "this its address?") from None
            raise EngineCrash(f"{where} could not be reached while {doing}: {_reason(exc.reason)}") from None
        except (ConnectionError, OSError) as exc:  # reset or closed mid-answer: the server died
            raise EngineCrash(f"{where} dropped the connection while {doing}: {_reason(exc)}") from None
        try:
            answer = json.loads(body)
        except ValueError:
            raise PosdiagError(f"{where} answered something other than JSON while {doing}: {body[:120]!r}") from None
        if not isinstance(answer, dict):
            raise PosdiagError(f"{where} answered {type(answer).__name__} JSON while {doing}, not an object")
        return answer


def open_port(spec: str, options: Any) -> ServedEngine:
    """The runtime entry (posdiag/ports/candidates.RUNTIMES): an OpenAI-compatible server at SPEC."""
    return open_served(spec, model=options.served_model, api_key=options.api_key)


def address_problem(url: str) -> str | None:
    """Why URL is no base address to send requests to (http(s), a host, a port that parses, no credentials, query
    or fragment); None when it is one. Read before anything loads (posdiag/cli/validate.py)."""
    parts = urllib.parse.urlsplit(url)
    try:
        parts.port  # noqa: B018  (raises on a port that is not a number in range)
    except ValueError:
        return f"'{url}' is not a server address (its port): use http://HOST:PORT/v1"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"'{url}' is not a server address: use http://HOST:PORT/v1"
    if parts.username or parts.password or parts.query or parts.fragment:
        return f"'{url}': give the base URL only (http://HOST:PORT/v1); the key goes in --api-key or {API_KEY_ENV}"
    return None


def open_served(url: str, *, model: str | None = None, api_key: str | None = None,
                timeout: float = DEFAULT_TIMEOUT) -> ServedEngine:
    """A ServedEngine for URL, checked: http(s), a host, no credentials or query in it; the server answers."""
    problem = address_problem(url)
    if problem:
        raise PosdiagError(problem)
    engine = ServedEngine(url.rstrip("/"), model=model, api_key=api_key or os.environ.get(API_KEY_ENV) or None,
                          timeout=timeout)
    engine.discover()
    return engine


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise urllib.error.HTTPError(req.full_url, code, f"redirect to {newurl} refused (posdiag asks only the "
                                                         "address it was given)", headers, fp)


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


def server_failed(code: int) -> bool:
    """Whether HTTP status CODE is the server failing at what it offers (500, 502, 503, 504...: the candidate's error),
    not a refusal (4xx: a request it does not take, 429 one too many; 501: not implemented)."""
    return code >= 500 and code != 501


def _error_text(exc: urllib.error.HTTPError) -> str:
    if 300 <= exc.code < 400:
        return str(exc.reason)
    try:
        body = exc.read().decode(errors="replace")
        message = json.loads(body).get("error", body)
        if isinstance(message, dict):
            message = message.get("message", message)
    except Exception:
        message = exc.reason
    return " ".join(str(message).split())[:200]


def _reason(reason: Any) -> str:
    return " ".join(str(reason).split())[:160] or type(reason).__name__


def prometheus_sums(text: str) -> dict[str, float]:
    """Prometheus text format: each sample's value summed by metric name (its labels dropped)."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        labelled = "{" in line and "}" in line
        name = line[:line.index("{")] if labelled else line.split()[0]
        rest = (line[line.rindex("}") + 1:] if labelled else line[len(name):]).split()  # value [timestamp]
        try:
            sums[name] = sums.get(name, 0.0) + float(rest[0])
        except (IndexError, ValueError):
            continue
    return sums


def cached_tokens(reply: dict[str, Any]) -> int | None:
    """The prompt tokens a reply says were served from the server's cache, where it says."""
    details = (reply.get("usage") or {}).get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        return details["cached_tokens"]
    timings = reply.get("timings")
    if isinstance(timings, dict) and isinstance(timings.get("cache_n"), int):
        return timings["cache_n"]
    return None


def _choice(reply: dict[str, Any], what: str) -> dict[str, Any]:
    choices = reply.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise PosdiagError(f"the server's reply has no choices while {what}")
    return choices[0]


def _scored(choice: dict[str, Any], what: str) -> list[Scored]:
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict) or not isinstance(logprobs.get("tokens"), list):
        raise PosdiagError(f"the server returned no log-probs while {what} (it may not support `logprobs`)")
    tokens, lps = logprobs["tokens"], logprobs.get("token_logprobs") or []
    tops = logprobs.get("top_logprobs") or []
    return [Scored(str(t), lps[i] if i < len(lps) else None,
                   {str(s): float(v) for s, v in (tops[i] or {}).items()} if i < len(tops) and tops[i] else {})
            for i, t in enumerate(tokens)]


def prompt_part(reply: dict[str, Any], text: str, k: int) -> Reply:
    what = "scoring the prompt"
    choice = _choice(reply, what)
    usage = reply.get("usage") or {}
    prompt_tokens = usage.get("prompt_tokens")
    vllm = choice.get("prompt_logprobs") or reply.get("prompt_logprobs")
    if isinstance(vllm, list):
        return Reply(tuple(_from_prompt_logprobs(vllm)), text, prompt_tokens, choice.get("finish_reason"), True)
    scored = _scored(choice, what)
    offsets = (choice.get("logprobs") or {}).get("text_offset") or []
    if len(offsets) == len(scored):  # the echoed prompt: the tokens that start inside it
        scored = [s for s, o in zip(scored, offsets, strict=True) if o < len(text)]
    elif isinstance(prompt_tokens, int):
        scored = scored[:prompt_tokens]
    return Reply(tuple(scored), text, prompt_tokens, choice.get("finish_reason"))


def _from_prompt_logprobs(entries: list[Any]) -> list[Scored]:
    """vLLM's prompt_logprobs: per prompt token (the first None) {token_id: {logprob, rank, decoded_token}}, the
    top-k and the prompt's own token; which entry is the prompt's own is known only by its text (logprob None:
    looked up in `top` by the reference's token)."""
    return [Scored("", None, {str(v.get("decoded_token", tid)): float(v["logprob"]) for tid, v in entry.items()})
            if entry else Scored("", None, {}) for entry in entries]


def _generated_part(reply: dict[str, Any], k: int) -> Reply:
    what = "generating"
    choice = _choice(reply, what)
    scored = _scored(choice, what)
    short = [i for i, s in enumerate(scored) if len(s.top) < min(k, 1) or s.logprob is None]
    if short:
        raise PosdiagError(f"the server returned no log-probs for generated token {short[0]} (asked for {k})")
    few = [i for i, s in enumerate(scored) if len(s.top) < k]
    if few and all(len(s.top) < k for s in scored):
        raise PosdiagError(f"the server returned {len(scored[few[0]].top)} log-probs per token, fewer than the {k} "
                           "asked (its limit on `logprobs`?): ask fewer with --top-k")
    usage = reply.get("usage") or {}
    return Reply(tuple(scored), str(choice.get("text", "")), usage.get("prompt_tokens"), choice.get("finish_reason"),
                 cached_tokens=cached_tokens(reply))
