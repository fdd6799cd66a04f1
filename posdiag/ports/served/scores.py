"""A served model compared, measuring: top-k log-probs from an OpenAI-compatible server, judged position by position.

A server answers with the top-k log-probs of each token, never logits, so the metrics are per position t:

    d(t) = |log p_served(x_t) - log p_ref(x_t)|    (x_t: the actual next token)
    top-1 agreement, and top-k overlap (|S ∩ R| / k, by token text)

with the reference's answer computed from its full logits the same way (log-softmax, its top-k by text).
Noise floor, measured in the same run, per position: the reference's own rounding (its float32 run against its
float64 run, and against itself with its token embeddings ~1 ulp off, at the compared tokens), the reference at the
precision the server serves in (a dtype, or ggml tensor types run in llama.cpp: posdiag/ports/served/precision.py),
and the spread of the same request sent twice; never below float32's rounding of a log-prob of that size. The floor
of a position is at least the median floor (one scalar per position is noisy). A server in float32 is one more
float32 evaluation, its rounding one more draw: with the float64 run alone, a single draw at a position, a healthy
vLLM stood up to 5.66x its floor (the concurrent path, 2.4-5.7x over the serving paths, 1.6-4.5x on the routes);
with the jittered run as a second draw, at most 3.98x over the same 22 routes and paths (AVX512 kernels; 5.35x with
the reference on AVX2's: docs/verdicts.md).
The profile of d / floor is judged by the shape `compare` gives every port (posdiag/ports/logits/shapes.py): flat,
growing with position from its onset, or a step at a length.

Two routes (posdiag/ports/engines/http_server.py): the prompt route (echo + logprobs) is checked for alignment
first: the server's top_logprobs[i] must be the distribution *over* token i (given tokens < i). A server whose
numbers fit another alignment better (llama-cpp-python 0.3.36: the distribution *after* token i) is a FAIL naming
the shift and the evidence, never realigned. The generation route has the server decode greedily with top-k
log-probs per token; the reference teacher-forces the same tokens. It starts from a one-token prompt, so its profile
starts at position 0, where a token sees only itself and no relative position can act.
"""

from __future__ import annotations

import math
import statistics
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from posdiag.errors import PosdiagError
from posdiag.model.jitter import jittered
from posdiag.model.subject import Subject
from posdiag.model.tokenizer import load_tokenizer
from posdiag.ports.engines.http_server import Reply, ServedEngine
from posdiag.ports.logits.shapes import classify
from posdiag.ports.profile import LayerProfile
from posdiag.ports.reference import finer_run, run_stack
from posdiag.ports.served.precision import ServedFloor
from posdiag.verdict import FAIL_RATIO, MACHINE_EPSILON

_DECODED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (sizes, pieces, ids by piece)

OFFSETS = (0, 1, -1)
"""Alignments tried for the prompt route: top_logprobs[i] against the reference's distribution over token
i + offset (0 is the API's meaning)."""


@dataclass
class Vocabulary:
    """The reference tokenizer's pieces: each id's text as a server prints it, and back."""

    tokenizer: Any
    pieces: list[str]
    ids_of: dict[str, list[int]]

    @classmethod
    def of(cls, reference: Subject) -> Vocabulary:
        """Decoded once per tokenizer and vocabulary size (every comparison with a server needs it: 0.35 s for
        SmolLM2's 49k ids), kept only as long as the tokenizer lives."""
        tokenizer, why = load_tokenizer(reference)
        if tokenizer is None:
            raise PosdiagError(f"comparing with a server needs the reference's tokenizer (servers take text): {why}")
        key = (reference.vocab_size, len(tokenizer))  # an added token changes the decoding: decoded again
        known = _DECODED.get(tokenizer)
        if known is None or known[0] != key:
            pieces = tokenizer.batch_decode([[i] for i in range(reference.vocab_size)])
            ids_of: dict[str, list[int]] = {}
            for i, piece in enumerate(pieces):
                ids_of.setdefault(piece, []).append(i)
            known = _DECODED[tokenizer] = (key, pieces, ids_of)  # no reference back to the tokenizer: it can go
        return cls(tokenizer, known[1], known[2])

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def text(self, ids: list[int], special: bool = True) -> str:
        """IDS decoded piece by piece, as a server prints each; SPECIAL False leaves the special tokens out."""
        dropped = set() if special else set(getattr(self.tokenizer, "all_special_ids", ()))
        return "".join(self.pieces[i] for i in ids if i not in dropped)

    def ids(self, reply: Reply, what: str) -> list[int]:
        """The ids of the tokens a server returned as text: each must be one piece of the reference's vocabulary."""
        out = []
        for i, s in enumerate(reply.scored):
            found = self.ids_of.get(s.token, [])
            if len(found) != 1:
                how = "is no token" if not found else f"is {len(found)} tokens ({found[:3]})"
                raise PosdiagError(f"tokenisation mismatch {what}: token {i} {s.token!r} {how} of the reference's "
                                   "tokenizer: the server runs another tokenizer")
            out.append(found[0])
        return out


@dataclass
class Scores:
    """The reference's log-probs over a sequence: float32 (as run), its finer run, and the served-dtype run."""

    ids: list[int]
    lp: torch.Tensor  # [T, V] float64, log-softmax of the reference's logits as run
    rounding: torch.Tensor  # [T, V] |lp - lp of the finer run| (zeros when no finer run)
    served: torch.Tensor | None  # [T, V] lp at the served precision - lp (signed: its spread is a noise scale)
    floor_source: str


def reference_scores(reference: Subject, ids: list[int], served: ServedFloor | None,
                     decoded_from: int | None = None) -> Scores:
    stack = reference.stacks[-1]
    t = torch.tensor(ids, dtype=torch.long)
    out = run_stack(reference, t, stack, "reference").logits
    if out is None:
        raise PosdiagError("the reference gives no logits (a language-model head is needed to compare with a server)")
    lp = out[0].double().cpu().log_softmax(-1)
    fine, source = finer_run(reference, t, stack)
    rounding = (fine.logits[0].double().cpu().log_softmax(-1) - lp).abs() if fine is not None else torch.zeros_like(lp)
    rounding, drawn = second_draw(reference, stack, lp, rounding,
                                  lambda: run_stack(reference, t, stack, "reference").logits[0].double().cpu()
                                  .log_softmax(-1))
    source += drawn
    at_served = None
    if served is not None:
        at_served = served.log_probs(t, decoded_from) - lp
        source += f"; {served.source}"
    return Scores(ids, lp, rounding, at_served, source)


def second_draw(reference: Subject, stack: str, lp: torch.Tensor, rounding: torch.Tensor,
                log_probs: Callable[[], torch.Tensor], settle_masks: bool = True) -> tuple[torch.Tensor, str]:
    """ROUNDING (the reference's |Δ| to its finer run, [T, V]) with a second draw of float32's rounding: LOG_PROBS()
    again with the token embeddings ~1 ulp off, the larger of the two at each entry; and the floor source's words
    ('' where no embedding could be jittered). A server in float32 is one more draw (module docstring)."""
    with jittered(reference, stack, 0, 1, seed=0, settle_masks=settle_masks) as hooked:
        shaken = log_probs()
    if not hooked:
        return rounding, ""
    return torch.maximum(rounding, (shaken - lp).abs()), "; the same run with its token embeddings ~1 ulp off " \
                                                         "(its conditioning)"


def position_metrics(scores: Scores, scored: list[Any], targets: list[int], rows: list[int], vocab: Vocabulary,
                     k: int, spread: list[float]) -> dict[str, list[float]]:
    """Per compared position j: the reference's row rows[j] against the server's scores scored[j] of targets[j]."""
    d, floor, top1, overlap = [], [], [], []
    eps = MACHINE_EPSILON["float32"]
    for j, (s, target, row) in enumerate(zip(scored, targets, rows, strict=True)):
        ref = scores.lp[row]
        served_lp = s.logprob if s.logprob is not None else s.top.get(vocab.pieces[target])
        if served_lp is None:
            raise PosdiagError(f"the server gave no log-prob for the token at position {row + 1}")
        d.append(abs(float(served_lp) - float(ref[target])))
        ref_top = ref.topk(k).indices.tolist()
        entries = [*ref_top, target]
        f = float(scores.rounding[row, entries].max())
        if scores.served is not None:
            f = max(f, served_noise(scores.served[row], ref, target))
        f = max(f, spread[j] if j < len(spread) else 0.0, eps * (1.0 + abs(float(ref[target]))))
        floor.append(f)
        served_top = sorted(s.top, key=s.top.get, reverse=True)[:k]
        top1.append(float(bool(served_top) and served_top[0] == vocab.pieces[ref_top[0]]))
        overlap.append(len(set(served_top) & {vocab.pieces[i] for i in ref_top}) / k)
    median = statistics.median(floor) if floor else 0.0
    return {"d": d, "floor": [max(f, median) for f in floor], "top1": top1, "overlap": overlap}


def served_noise(delta: torch.Tensor, ref: torch.Tensor, target: int) -> float:
    """The floor a served precision puts under |Δ log p(target)| at one position, from the reference run at that
    precision (DELTA: its log-probs minus the reference's, REF: the reference's log-probs): the larger of its own
    error at the target and its noise over the vocabulary carried to the target's log-prob. Log-probs move by
    Δz_t - Σ p_j Δz_j under logit noise Δz of spread σ, so by σ·sqrt((1 - p_t)² + Σ_{j≠t} p_j²): a sure token
    barely moves, an unsure one by σ. Its own error alone is one draw of the noise, and a healthy server's is
    another (SmolLM2 Q4_1 on four prompts: up to 30x each other at a position); with the spread, the healthy
    server stood at most 3.4x its floor and a planted rope base at least 14.5x (64 tokens each)."""
    p = ref.exp()
    p_t = float(p[target])
    sensitivity = max(0.0, (1.0 - p_t) ** 2 + float((p * p).sum()) - p_t ** 2) ** 0.5
    return max(abs(float(delta[target])), float(delta.std()) * sensitivity)


def alignment(scores: Scores, reply: Reply, vocab: Vocabulary, k: int) -> dict[str, Any]:
    """Which distribution the prompt route's top_logprobs[i] is: for each offset, the median over positions of
    the largest |Δ log-prob| over the server's top-k entries and the top-1 agreement; the best fit, and an
    example of the token scored."""
    n = len(scores.ids)
    fits = {}
    for off in OFFSETS:
        errors, agree = [], []
        for i in range(1, n):
            row = i - 1 + off
            top = reply.scored[i].top
            if not (0 <= row < n) or not top:
                continue
            ref = scores.lp[row]
            diffs = [abs(v - _lp_of(ref, vocab, piece)) for piece, v in top.items()]
            errors.append(max(diffs))
            agree.append(max(top, key=top.get) == vocab.pieces[int(ref.argmax())])
        if errors:
            fits[off] = {"median_max_dlogprob": statistics.median(errors), "top1_agreement": sum(agree) / len(agree),
                         "positions": len(errors)}
    best = min(fits, key=lambda o: fits[o]["median_max_dlogprob"])
    out: dict[str, Any] = {"fits": {str(o): f for o, f in fits.items()}, "best_offset": best}
    i = 1 if n > 1 else 0
    example = reply.scored[i]
    if example.logprob is not None and n > 2:
        tok = scores.ids[i]
        out["example"] = {"position": i, "token": vocab.pieces[tok], "after": vocab.pieces[scores.ids[i - 1]],
                          "served": float(example.logprob), "reference": float(scores.lp[i - 1, tok]),
                          "reference_one_later": float(scores.lp[i, tok])}
    return out


def _lp_of(ref: torch.Tensor, vocab: Vocabulary, piece: str) -> float:
    ids = vocab.ids_of.get(piece)
    if not ids:
        return float("-inf")
    return float(torch.logsumexp(ref[ids], 0)) if len(ids) > 1 else float(ref[ids[0]])


def check_prompt_tokens(reply: Reply, ids: list[int], vocab: Vocabulary, what: str, echoed: bool = True) -> None:
    """The server's count (and ECHOED texts) of the prompt's tokens against the reference tokenizer's."""
    if isinstance(reply.prompt_tokens, int) and reply.prompt_tokens != len(ids):
        raise PosdiagError(f"tokenisation mismatch {what}: the server counts {reply.prompt_tokens} prompt tokens, the "
                           f"reference's tokenizer {len(ids)}: the server runs another tokenizer (or adds BOS)")
    if not echoed or reply.prompt_logprobs or not reply.scored:
        return
    texts = [s.token for s in reply.scored]
    mine = [vocab.pieces[i] for i in ids]
    if texts != mine:
        at = next((i for i, (a, b) in enumerate(zip(texts, mine, strict=False)) if a != b), min(len(texts), len(mine)))
        raise PosdiagError(f"tokenisation mismatch {what}: the server's token {at} is "
                           f"{texts[at] if at < len(texts) else 'missing'!r}, the reference's "
                           f"{mine[at] if at < len(mine) else 'missing'!r}")


def generation_spread(first: Reply, again: Reply) -> tuple[list[float], int | None]:
    """|Δ log-prob| between two identical requests, per position where both chose the same tokens so far; the
    first position where the tokens differ (None when they never do)."""
    spread, diverged = [], None
    for j, (a, b) in enumerate(zip(first.scored, again.scored, strict=False)):
        if a.token != b.token:
            diverged = j
            break
        spread.append(abs(float(a.logprob) - float(b.logprob)))
    return spread, diverged


def served_engine_settings(engine: ServedEngine, k: int, route: str) -> dict[str, Any]:
    return {"server": engine.base, **({"served model": engine.model} if engine.model else {}),
            **engine.settings, "top-k": k, "routes": route, "decoding": "greedy (temperature 0, penalties off)"}


def judged(name: str, m: dict[str, list[float]], start: int, profiles: list[LayerProfile],
            coarse: bool) -> dict[str, Any]:
    """The route's profile classified: positions start, start+1, ... (a profile from position 0 when start is 0).
    COARSE: the floor holds a served precision's error."""
    d = torch.tensor(m["d"], dtype=torch.float64)
    floor = torch.tensor(m["floor"], dtype=torch.float64)
    # Judged position by position (classify), not as a profile (port_shapes.judge_profile): one log-prob per position
    # against a quantised floor, where a planted rope base stands out at single positions (Q4_1 SmolLM2, 64 tokens,
    # four prompts: worst 10.6-21.5x, the profile 3.4-7.7x; the healthy server worst <= 3.1x, the profile <= 0.9x).
    shape = classify(d, FAIL_RATIO * floor, {})
    if shape.get("onset_position") is not None:
        shape["onset_position"] += start
    if start and shape["pattern"] != "none":  # classify reads index 0 as position 0; here it is position START
        late = float(d[-max(1, d.numel() // 4):].mean())
        shape["pattern"] = "from the first compared position" if shape["onset_position"] == start else \
            "step at a length"
        shape["why"] = (f"{float(d[0]):.2g} at position {start} (the first compared: the prompt before it is not), "
                        f"{late:.2g} late; above the floor from position {shape['onset_position']}: compare from a "
                        "one-token prompt (no --text) to see whether it starts at position 1")
    if coarse and shape["pattern"] == "step at a length" and not shape.get("boundary"):
        shape["why"] += (" (or an error growing with position that clears the served precision's floor only here: "
                         "an unquantised file shows where it starts)")
    if not coarse and shape["pattern"] == "uniform from position 0":
        shape["why"] += ("; a server of quantised weights differs so: name them with --served-dtype (its .gguf "
                         "file, or its type) and their own error joins the floor")
    ratio = d / floor
    per = [math.nan] * start + d.tolist()
    profiles.append(LayerProfile(f"{name} route |Δ log-prob|", None, None, float(d.max()), float(floor.median()),
                                 FAIL_RATIO * float(floor.median()), float(ratio.max()), tuple(per), shape))
    return {"status": "pass" if shape["pattern"] == "none" else "fail", "pattern": shape["pattern"],
            "why": shape.get("why"), "onset_position": shape.get("onset_position"), "first_position": start,
            "positions": len(m["d"]), "max_dlogprob": float(d.max()), "median_dlogprob": float(d.median()),
            "noise_floor_median": float(floor.median()), "worst_ratio": float(ratio.max()),
            "worst_position": start + int(ratio.argmax()), "top1_agreement": sum(m["top1"]) / len(m["top1"]),
            "topk_overlap": sum(m["overlap"]) / len(m["overlap"]), "dlogprob": m["d"], "floor": m["floor"]}
