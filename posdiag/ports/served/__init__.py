"""A served model compared: the two routes run, each judged by position, and the one verdict.

The measuring is posdiag/ports/served/scores.py; the HTTP is posdiag/ports/engines/http_server.py. A route's profile
is the |Δ log-prob| of the actual next token at each position against FAIL_RATIO x that position's floor, classified
as every port's error is (posdiag/ports/logits/shapes.classify): none, grows with position (from its onset), a step at
a length, or uniform from position 0 (weights or quantisation, not positions).
"""

from __future__ import annotations

import math
from importlib import resources
from typing import Any

from posdiag.errors import PosdiagError
from posdiag.model.subject import Subject
from posdiag.ports.engines.http_server import ServedEngine
from posdiag.ports.profile import Comparison, LayerProfile
from posdiag.ports.protocol import CompareRequest, Stage, no_stage
from posdiag.ports.served import images, premises, serving_paths
from posdiag.ports.served import precision as served_precision
from posdiag.ports.served.precision import ServedFloor
from posdiag.ports.served.scores import (
    Scores,
    Vocabulary,
    alignment,
    check_prompt_tokens,
    generation_spread,
    judged,
    position_metrics,
    reference_scores,
    served_engine_settings,
)
from posdiag.results import CheckResult, Status, Table
from posdiag.verdict import FAIL_RATIO

ROUTES = ("both", "prompt", "generation", "serving", "images")
DEFAULT_NEW_TOKENS = 64
PROMPT_WORDS = 48
"""The prompt route's default text: the first words of posdiag's prose (about 60 tokens)."""

NOT_SHOWN = ("logits beyond the top-k: the actual token's log-prob and the top-k by text are compared, not whole "
             "distributions", "hidden states: no layer is located, only the output", "token ids: tokens come back "
             "as text, matched to the reference's tokenizer piece by piece (the image route reads the ids vLLM "
             "returns)",
             "the server's cache reuse: each request is scored as the server ran it (prefix caching may serve a "
             "prefix from an earlier request; --route serving reads what the server reports of it)")


def judge(reference: Subject, engine: ServedEngine, request: CompareRequest) -> Comparison:
    """The judge of a port answering top-k log-probs (posdiag/ports/comparison.JUDGES): the text as it is, the
    routes asked for."""
    return compare_served(reference, engine, route=request.route, top_k=request.top_k, new_tokens=request.seq_len,
                          prompt=request.text, served_dtype=request.served_dtype, long_prompt=request.long_prompt,
                          prefix_tokens=request.prefix_tokens,
                          stage=request.stage)


def compare_served(reference: Subject, engine: ServedEngine, *, route: str = "both", top_k: int = 5,
                   new_tokens: int | None = None, prompt: str | None = None,
                   served_dtype: str | None = None, long_prompt: int | None = None, prefix_tokens: int | None = None,
                   stage: Stage = no_stage) -> Comparison:
    """Judge the server ENGINE against REFERENCE on the ROUTE(s). SERVED_DTYPE: the precision it serves in
    (posdiag/ports/served/precision.parse), measured into the floor. LONG_PROMPT, PREFIX_TOKENS: the serving
    route's long prompt and shared prefix, in tokens (default serving_paths.LONG_TOKENS, PREFIX_TOKENS).
    Never prints; PosdiagError (one line) on inputs
    that cannot be compared, EngineCrash when the server fails."""
    if reference.kind != "causal":
        raise PosdiagError(f"a server is compared with a causal (decoder-only) reference, not a {reference.kind} one")
    if route not in ROUTES:
        raise PosdiagError(f"--route {route!r}: one of {', '.join(ROUTES)}")
    precision = served_precision.parse(served_dtype)
    if route == "images":
        _, why = images.image_prompt(reference.model)
        if why:
            raise PosdiagError(f"--route images: the reference takes no images ({why})")
    before = reference.forward_count
    vocab = Vocabulary.of(reference)
    if precision:
        stage(f"the reference at {precision.name} (the served precision's floor)")
    floor = served_precision.open_floor(reference, precision, reference.stacks[-1]) if precision else None
    profiles: list[LayerProfile] = []
    sources: set[str] = set()
    try:
        routes = _routes(reference, engine, vocab, route, top_k, new_tokens, prompt, floor, profiles, sources,
                         (long_prompt or serving_paths.LONG_TOKENS, prefix_tokens or serving_paths.PREFIX_TOKENS),
                         stage)
    finally:
        if floor is not None:
            floor.close()
    details: dict[str, Any] = {
        "reference": reference.info.to_dict(), "candidate": _candidate(engine), "routes": routes,
        "engine": {"name": engine.name, **served_engine_settings(engine, top_k, route)},
        "served_precision": precision.name if precision else "not given (float32 assumed: --served-dtype)",
        "floor_source": "; ".join(sorted(sources)) or "none measured", "requests": engine.requests,
        "not_shown": list(NOT_SHOWN), "notes": [f"not shown by the API: {x}" for x in NOT_SHOWN],
    }
    result = _verdict(routes, details, top_k, reference.forward_count - before)
    length = max((len(p.per_position) for p in profiles), default=0)
    return Comparison(result, tuple(profiles), length)


def _routes(reference: Subject, engine: ServedEngine, vocab: Vocabulary, route: str, k: int, new_tokens: int | None,
            prompt: str | None, floor: ServedFloor | None, profiles: list[LayerProfile], sources: set[str],
            lengths: tuple[int, int], stage: Stage) -> dict[str, dict[str, Any]]:
    text = prompt or " ".join(_prose().split()[:PROMPT_WORDS])
    routes: dict[str, dict[str, Any]] = {}
    if route in ("both", "prompt"):
        stage("prompt route")
        routes["prompt"] = _prompt_route(reference, engine, vocab, text, k, floor, profiles, sources)
    if route in ("both", "generation"):
        n = new_tokens or DEFAULT_NEW_TOKENS
        start_from = prompt if prompt else text.split()[0]  # --text: from the end of a long prompt
        stage(f"generation route, {n} tokens")
        routes["generation"] = _generation_route(reference, engine, vocab, start_from, n, k, floor, profiles, sources)
    if route == "serving":
        stage("serving paths")
        routes.update(_serving_routes(reference, engine, vocab, new_tokens, k, floor, profiles, sources, *lengths))
    prompt, _ = images.image_prompt(reference.model) if route in ("both", "images") else (None, "")
    if prompt is not None:  # `both` includes it wherever the reference takes images
        stage("image route")
        routes["images"] = images.image_route(reference, engine, vocab, prompt, k, floor, profiles, sources)
    return routes


def _prompt_route(reference: Subject, engine: ServedEngine, vocab: Vocabulary, text: str, k: int,
                  floor: ServedFloor | None, profiles: list[LayerProfile], sources: set[str]) -> dict[str, Any]:
    ids = vocab.encode(text)
    reply = engine.prompt_logprobs(text, k)
    if len(reply.scored) < 2 or not any(s.top for s in reply.scored[1:]):
        return {"status": "skip", "why": "the server returns no prompt log-probs (llama.cpp's own server: none; vLLM: "
                                         "prompt_logprobs)"}
    check_prompt_tokens(reply, ids, vocab, "on the prompt route")
    scores = reference_scores(reference, ids, floor)
    sources.add(scores.floor_source)
    fit = alignment(scores, reply, vocab, k)
    best, fits = fit["best_offset"], fit["fits"]
    aligned = fits.get("0", {}).get("median_max_dlogprob", math.inf)
    if best != 0:  # never realigned: a shifted route is a finding about the server, and cannot be judged by position
        clear = fits[str(best)]["median_max_dlogprob"] * FAIL_RATIO < aligned
        return {"status": "fail", "pattern": "misaligned", "offset": best, "clear": clear, "alignment": fit,
                "tokens": len(ids), "why": _shift_words(best, fit, clear)}
    rows = list(range(len(ids) - 1))
    metrics = position_metrics(scores, list(reply.scored[1:]), ids[1:], rows, vocab, k, [])
    out = {"alignment": fit, "tokens": len(ids), **judged("prompt", metrics, 0, profiles, floor is not None)}
    others = min((f["median_max_dlogprob"] for o, f in fits.items() if o != "0"), default=math.inf)
    if out["status"] == "fail" and aligned * FAIL_RATIO >= others:  # the API's alignment fits no better than a shift:
        out.update(pattern="no alignment", onset_position=None, why=_no_fit_words(fit))  # a profile would misname it
    return out


def _generation_route(reference: Subject, engine: ServedEngine, vocab: Vocabulary, text: str, n: int, k: int,
                      floor: ServedFloor | None, profiles: list[LayerProfile], sources: set[str]) -> dict[str, Any]:
    counters = getattr(engine, "metrics", lambda: None)
    before = counters()
    reply = engine.generate(text, n, k)
    drafts = accepted_drafts(before, counters())
    again = engine.generate(text, n, k)
    spread, diverged = generation_spread(reply, again)
    out = _reply_judged(reference, vocab, text, reply, k, floor, profiles, sources, "generation", spread)
    start = out["prompt_tokens"] - 1
    if drafts and out["status"] == "fail":  # the cause a boundary's shape suggests is not the likeliest one here
        out["why"] = (f"{out['why']}; the server accepted {drafts:g} speculative draft tokens on this reply: drafts "
                      "verified at the wrong positions fail the generation route alone (the prompt route is a prefill "
                      "without drafts); run the server without speculative decoding to tell")
    return {**out, "repeat_diverged_at": None if diverged is None else start + diverged,
            "repeat_max_spread": max(spread, default=0.0), "drafts_accepted": drafts}


def accepted_drafts(before: dict[str, float] | None, after: dict[str, float] | None) -> float | None:
    """Speculative draft tokens the server accepted between two readings of its counters (vLLM's
    `vllm:spec_decode_num_accepted_tokens_total`, or any counter named for accepted drafts); None where it reports
    none."""
    if before is None or after is None:
        return None
    names = [name for name in after if "accepted" in name and ("spec" in name or "draft" in name)]
    return sum(after[name] - before.get(name, 0.0) for name in names) if names else None


def _reply_judged(reference: Subject, vocab: Vocabulary, text: str, reply: Any, k: int, floor: ServedFloor | None,
                  profiles: list[LayerProfile], sources: set[str], name: str, spread: list[float],
                  scored: dict[tuple, Scores] | None = None) -> dict[str, Any]:
    """One greedy reply judged position by position against the reference on the prompt and the tokens it chose.
    SCORED: the reference's scores already made in this comparison, by (ids, decoded_from): the serving paths send
    the same prompts, and a server that answers them alike asks the same three reference runs of each."""
    prompt_ids = vocab.encode(text)
    check_prompt_tokens(reply, prompt_ids, vocab, f"on the {name} route", echoed=False)
    gen = vocab.ids(reply, f"on the {name} route")
    # a server may leave special tokens out of its text (vLLM: the end-of-turn token it stopped at)
    if reply.text and reply.text not in (vocab.text(gen), vocab.text(gen, special=False)):
        raise PosdiagError(f"tokenisation mismatch on the {name} route: the generated tokens, decoded one by one "
                           "with the reference's tokenizer, do not give the text the server returned")
    if len(gen) < 4:
        raise PosdiagError(f"the server generated {len(gen)} tokens ({reply.finish_reason}); at least 4 are needed")
    ids = prompt_ids + gen
    key = (tuple(ids[:-1]), len(prompt_ids))
    scores = scored.get(key) if scored is not None else None
    if scores is None:
        scores = reference_scores(reference, ids[:-1], floor, decoded_from=len(prompt_ids))
        if scored is not None:
            scored[key] = scores
    sources.add(scores.floor_source)
    sources.add("the spread of the same request sent twice")
    start = len(prompt_ids) - 1
    rows = list(range(start, start + len(gen)))
    metrics = position_metrics(scores, list(reply.scored), gen, rows, vocab, k, spread)
    out = {"prompt": text, "prompt_tokens": len(prompt_ids), "generated": len(gen),
           "finish_reason": reply.finish_reason}
    return {**out, **judged(name, metrics, start, profiles, floor is not None)}


def _serving_routes(reference: Subject, engine: ServedEngine, vocab: Vocabulary, n: int | None, k: int,
                    floor: ServedFloor | None, profiles: list[LayerProfile], sources: set[str],
                    long_tokens: int, prefix_tokens: int) -> dict[str, dict[str, Any]]:
    """The serving paths (posdiag/ports/served/serving_paths.py), each request's reply judged as the generation
    route's; a path's worst request stands for it (a failing one first), and a path whose premise the server's
    report does not confirm (posdiag/ports/served/premises.py) is a WARN, not a PASS. The long prompt of
    LONG_TOKENS tokens and the shared prefix of PREFIX_TOKENS (with its suffix) must fit the reference's context
    with the tokens generated after them."""
    n = n or serving_paths.NEW_TOKENS
    context = reference.max_positions
    for option, tokens, more in (("--long-prompt-tokens", long_tokens, 0), ("--prefix-tokens", prefix_tokens, 32)):
        if context is not None and tokens + more + n > context:
            raise PosdiagError(f"{option} {tokens} and {n} generated tokens exceed the reference's declared "
                               f"context of {context} tokens")
    texts = serving_paths.prompts(_prose().split(), long_tokens, vocab.encode, prefix_tokens)
    runs = serving_paths.run_paths(engine, texts, n, k, spread=lambda a, b: generation_spread(a, b)[0])
    spread = runs[0].spread if runs and runs[0].name == "cold" else []
    routes: dict[str, dict[str, Any]] = {}
    scored: dict[tuple, Scores] = {}
    for run in runs:
        name = f"serving/{run.name}"
        if run.failed:  # the candidate's error on this path, as a crash is in process
            routes[name] = {"status": "fail", "pattern": "server error",
                            "why": f"the server failed on it ({run.failed})"}
            continue
        if run.not_offered or not run.sent:
            routes[name] = {"status": "skip", "why": f"the server does not offer it ({run.not_offered or 'no reply'})"}
            continue
        replies = [_reply_judged(reference, vocab, sent.prompt, sent.reply, k, floor, profiles, sources, name, spread,
                                 scored) for sent in run.sent]
        worst = max(replies, key=lambda r: (r["status"] == "fail", r["worst_ratio"]))
        premise = premises.read(run, texts)
        routes[name] = {**worst, "story": run.story, "requests": len(replies),
                        "premise": {"confirmed": premise.confirmed, "evidence": premise.evidence}}
        if worst["status"] == "pass" and premise.confirmed is not True:  # judged right, but not on the path named
            routes[name].update(status="warn", why=premise.evidence)
        if worst["status"] == "fail":  # the path's story, not the generation route's advice about its prompt
            first = worst["first_position"]
            routes[name]["why"] = (f"{run.story}: |Δ log-prob| {worst['dlogprob'][0]:.2g} at its first generated "
                                   f"position {first}, {max(worst['dlogprob']):.2g} at worst, above the floor from "
                                   f"position {worst['onset_position']}")
    return routes


def _shift_words(offset: int, fit: dict[str, Any], clear: bool) -> str:
    fits, aligned = fit["fits"], fit["fits"].get("0", {})
    shifted = fits[str(offset)]
    which = "next" if offset > 0 else "previous"
    lead = (f"top_logprobs[i] is the reference's distribution for token i{offset:+d} (the {which} token's), not "
            "token i's" if clear else f"top_logprobs[i] fits the reference's distribution for token i{offset:+d} "
            f"better than token i's, though not by {FAIL_RATIO:g}x (shifted, and the model differs too?)")
    words = (f"{lead}: median largest |Δ log-prob| over the top-k {shifted['median_max_dlogprob']:.2g} shifted "
             f"vs {aligned.get('median_max_dlogprob', math.nan):.2g} as the API defines it, top-1 agreement "
             f"{100 * shifted['top1_agreement']:.0f}% vs {100 * aligned.get('top1_agreement', math.nan):.0f}%")
    ex = fit.get("example")
    if ex:
        words += (f"; token_logprobs[{ex['position']}] scores {ex['token']!r} after {ex['after']!r} at "
                  f"{ex['served']:.2f}, the reference {ex['reference']:.2f} ({ex['reference_one_later']:.2f} one "
                  "token later)")
    return words


def _no_fit_words(fit: dict[str, Any]) -> str:
    """Why a prompt route that fits the reference at no offset names neither a shift nor a position."""
    fits = fit["fits"]
    errors = ", ".join(f"{f['median_max_dlogprob']:.2g} at {int(o):+d}" for o, f in fits.items())
    agree = ", ".join(f"{100 * f['top1_agreement']:.0f}%" for f in fits.values())
    return (f"no alignment fits: top_logprobs[i] is no closer to the reference's distribution for token i than for "
            f"its neighbours' (median largest |Δ log-prob| over the top-k {errors}; top-1 agreement {agree}): the "
            "served scores are not the reference's at any offset (another model or tokenizer, or scores garbled), "
            "so neither a shift nor a position is named")


def _verdict(routes: dict[str, dict[str, Any]], details: dict[str, Any], k: int, passes: int) -> CheckResult:
    failed = {n: r for n, r in routes.items() if r["status"] == "fail"}
    judged = {n: r for n, r in routes.items() if r["status"] != "skip"}
    parts = []
    for name, r in routes.items():
        if r["status"] == "skip":
            parts.append(f"{name} route: not run, {r['why']}")
        elif r.get("pattern") == "misaligned":
            how = "shifted by" if r["clear"] else "misaligned, best fit at"
            parts.append(f"prompt route: log-probs {how} {r['offset']:+d} position (never realigned): {r['why']}")
        elif r.get("pattern") in ("no alignment", "server error"):
            parts.append(f"{name} route: {r['why']}")
        elif r["status"] == "fail":
            lead = {"grows with position": f"error grows with position from {r['onset_position']}",
                    "step at a length": f"error starts at position {r['onset_position']}",
                    "from the first compared position": f"error from position {r['onset_position']} on",
                    "uniform from position 0": "error uniform from position 0"}[r["pattern"]]
            parts.append(f"{name} route: {lead}: {r['why']}; worst |Δ log-prob| {r['worst_ratio']:.3g}x its floor at "
                         f"position {r['worst_position']}")
        else:
            same = (f"same function within its floor at every position "
                    f"{r['first_position']}-{r['first_position'] + r['positions'] - 1} (worst "
                    f"{r['worst_ratio']:.3g}x, tolerance {FAIL_RATIO:g}x; |Δ log-prob| max {r['max_dlogprob']:.2g}, "
                    f"top-1 {100 * r['top1_agreement']:.0f}%, top-{k} overlap {100 * r['topk_overlap']:.0f}%)")
            premise = (r.get("premise") or {}).get("evidence")
            parts.append(f"{name} route: {r['why']}; its replies: {same}" if r["status"] == "warn" else
                         f"{name} route: {same}" + (f"; {premise}" if premise else ""))
    warned = any(r["status"] == "warn" for r in routes.values())
    status = Status.SKIP if not judged else Status.FAIL if failed else Status.WARN if warned else Status.PASS
    if failed or warned:  # the worst first
        rank = {"fail": 0, "warn": 1}
        parts.sort(key=lambda p: min((rank.get(r["status"], 2) for n, r in routes.items() if p.startswith(n)),
                                     default=2))
    main = next((r for r in routes.values() if "worst_ratio" in r), {})
    metrics = {"ratio": main.get("worst_ratio"), "error": main.get("max_dlogprob"),
               "noise_floor": main.get("noise_floor_median"), "onset_position": main.get("onset_position"),
               "top1_agreement": main.get("top1_agreement"), "topk_overlap": main.get("topk_overlap"),
               "misaligned_offset": routes.get("prompt", {}).get("offset")}
    if failed:
        first = next(iter(failed.values()))
        details.update({"pattern": first.get("pattern"), "onset_position": first.get("onset_position")})
    return CheckResult("compare", status, "; ".join(parts), metrics, details, (_table(routes, k),),
                       forward_passes=passes)


def _table(routes: dict[str, dict[str, Any]], k: int) -> Table:
    rows = []
    for name, r in routes.items():
        if "positions" not in r:
            rows.append((name, "", "", "", "", "", "", r.get("pattern") or r["status"]))
            continue
        first = r["first_position"]
        rows.append((name, f"{first}-{first + r['positions'] - 1}", f"{r['max_dlogprob']:.2e}",
                     f"{r['noise_floor_median']:.2e}", f"{r['worst_ratio']:.3g}", f"{100 * r['top1_agreement']:.0f}%",
                     f"{100 * r['topk_overlap']:.0f}%", "premise not confirmed" if r["status"] == "warn" else
                     "" if r["pattern"] == "none" else r["pattern"]))
    return Table("served log-probs against the reference's, by route (|Δ log-prob| of the actual next token)",
                 ("route", "positions", "max |Δ log-prob|", "floor (median)", "worst ratio", "top-1",
                  f"top-{k} overlap", "pattern"), tuple(rows))


def _candidate(engine: ServedEngine) -> dict[str, Any]:
    return {"id": engine.name, "family": "served", "kind": "causal", "position_kind": "top-k log-probs only",
            "dtype": "as served", "device": "the server's", "notes": []}


def _prose() -> str:
    return resources.files("posdiag.data").joinpath("prose.txt").read_text(encoding="utf-8")
