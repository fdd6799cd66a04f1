"""The sequences of calls `state` runs, each a history a user makes and the call it must not change.

A sequence is three things: `reference()`, the call under test on a fresh state; `history()`, the calls a user made
before it (what it returns is what the call under test continues from: a cache); `under_test(kept)`, the call after
that history. Every call is the path users take: the model's own default mask and positions (nothing passed but the
ids, and the 2D attention mask of a padded batch), generate() as users call it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from posdiag.checks._cache_plan import declared_boundaries, original_context
from posdiag.model.caches import (
    cache_keyword,
    cache_layer_note,
    cache_support,
    new_cache,
    takes_cache,
    text_config,
)
from posdiag.model.drafts import disagreeing_draft
from posdiag.model.greedy import greedy
from posdiag.model.outputs import output_of
from posdiag.model.subject import Subject

PAST_BOUNDARY = 12  # tokens the long input runs past the largest boundary it must cross
TURN = 8  # tokens of the user turn appended in the multi-turn sequence
LOOKUP = 3  # prompt_lookup_num_tokens: candidates copied from the prompt per step
# Candidates the draft proposes per step, constant: transformers' default (20, growing) drafts every new token in one
# step, so no verification continues another and a position not advanced by the accepted candidates never shows.
ASSISTED = 2
STEPS = 4  # tokens the hand-written loop after a padded batch feeds one a call after its prefill
AFTER_PADDING = ("one request after a padded batch", "one request after a padded batch with position_ids",
                 "unpadded batch after a padded batch", "unpadded batch after a padded batch with position_ids")
SEQUENCES = ("long input", "batch after batch", *AFTER_PADDING, "another prompt", "multi-turn", "assisted decoding",
             "prompt lookup")


@dataclass(frozen=True)
class Sequence:
    name: str
    story: str  # what ran before the call under test, in words: "after a 140-token input, the same 64 tokens"
    reference: Callable[[], torch.Tensor]
    history: Callable[[], Any]
    under_test: Callable[[Any], torch.Tensor]
    rows: int = 1  # batch rows of the call (the jitter floor shakes row 0)
    # Another way of computing the same call, with no history (assisted, lookup): transformers refusing it for this
    # model (MPT: "Assisted decoding requires a cache") is a path not run, not a call changed by what ran before.
    same_call: bool = True


def long_length(subject: Subject, short: int, cap: int) -> tuple[int, dict[str, int], dict[str, str]]:
    """The long input: past every boundary the config declares (sliding window, attention chunk, a rope block's
    original context, the dynamic-NTK threshold) by PAST_BOUNDARY, at least 2 x the short input, within the declared
    context (dynamic NTK's threshold is that context: passing it is its use) and `cap`.
    -> (length, boundaries crossed, boundaries not crossed and why)."""
    boundaries = dict(declared_boundaries(subject))
    declared = subject.max_positions
    dynamic = None
    cfg = text_config(subject)
    for obj in (getattr(cfg, "rope_parameters", None), getattr(cfg, "rope_scaling", None)):
        if not isinstance(obj, dict):
            continue
        for block in [v for v in obj.values() if isinstance(v, dict)] or [obj]:
            kind = str(block.get("rope_type") or block.get("type") or "")
            original = block.get("original_max_position_embeddings") or getattr(
                cfg, "original_max_position_embeddings", None)
            if isinstance(original, int) and original > 0:
                boundaries[f"{kind or 'rope'} original context"] = original
            if kind == "dynamic":
                dynamic = original if isinstance(original, int) and original > 0 else declared
                if dynamic:
                    boundaries["dynamic-NTK threshold"] = dynamic
    ceiling = cap if declared is None else min(cap, max(declared, (dynamic or 0) + PAST_BOUNDARY))
    length = min(ceiling, max([2 * short, *(at + PAST_BOUNDARY for at in boundaries.values())]))
    crossed = {name: at for name, at in boundaries.items() if at < length}
    missed = {name: f"{at}: past the {cap}-token cap of the long input" if at + PAST_BOUNDARY > cap else
              f"{at}: past the declared context of {declared}" for name, at in boundaries.items() if at >= length}
    return length, crossed, missed


def plan(subject: Subject, short: torch.Tensor, cap: int, new_tokens: int, seed: int,
         chosen: set[str]) -> tuple[list[Sequence], dict[str, str], dict]:
    """The `chosen` sequences this model can run, those it cannot (name -> why) and what the plan reached."""
    seqs, not_run, reached = _planned(subject, short, cap, new_tokens, seed, chosen)
    return [q for q in seqs if q.name in chosen], {k: v for k, v in not_run.items() if k in chosen}, reached


def _planned(subject: Subject, short: torch.Tensor, cap: int, new_tokens: int, seed: int,
             chosen: set[str]) -> tuple[list[Sequence], dict[str, str], dict]:
    calls = _Calls(subject, new_tokens)
    n, declared = short.shape[0], subject.max_positions
    length, crossed, missed = long_length(subject, n, cap)
    reached = {"long_input": length, "boundaries_crossed": crossed, "boundaries_not_crossed": missed}
    seqs: list[Sequence] = []
    not_run: dict[str, str] = {}
    if length > n:
        long_ids = subject.sample_ids(1, length, seed + 7919)[0]
        seqs.append(Sequence("long input", f"after a {length}-token input, the same {n} tokens",
                             lambda: calls.forward(short[None]), lambda: calls.forward(long_ids[None]),
                             lambda _: calls.forward(short[None])))
    else:
        not_run["long input"] = (f"the probe's {n} tokens already reach the longest input allowed ({length}: the "
                                 "declared context, or long_cap)")
    lens = [n, max(2, n - 5), max(2, n - n // 2)]
    later = [max(2, n - 3), n, max(2, n - n // 3)]
    first, second = calls.padded(subject.sample_ids(3, n, seed + 31), lens), calls.padded(
        subject.sample_ids(3, n, seed + 37), later)
    seqs.append(Sequence("batch after batch", f"after a padded batch of lengths {lens}, a batch of lengths {later}",
                         lambda: calls.forward(*second), lambda: calls.forward(*first),
                         lambda _: calls.forward(*second), rows=3))
    if chosen & set(AFTER_PADDING):
        loops, skipped = _after_padding(calls, short, seed)
        seqs.extend(loops)
        not_run.update(skipped)
    names = ("another prompt", "multi-turn", "assisted decoding", "prompt lookup")
    # The prompt and what generate() adds to it (a reply, a user turn, the next reply) stay within the context, and
    # within a LongRoPE block's original context: past it the full forward rotates every position with the long
    # factors, so a conversation continued from keys rotated with the short ones is no reference (as in `cache`).
    limit = min(x for x in (declared, original_context(subject)) if x is not None) \
        if declared is not None or original_context(subject) is not None else None
    room = n if limit is None else min(n, limit - 2 * new_tokens - TURN)
    why = calls.generate_refusal() or ("" if room >= 4 else f"the context of {limit} leaves no room "
                                                             f"for a prompt and {new_tokens} new tokens twice")
    if why:
        not_run.update(dict.fromkeys(names, why))
        return seqs, not_run, reached
    prompt = short[:room]
    other = subject.sample_ids(1, max(4, room - room // 4), seed + 104723)[0]
    seqs.append(Sequence("another prompt", f"after generate() on a {room}-token prompt, generate() on another "
                         f"{other.shape[0]}-token prompt", lambda: calls.generate(other[None]),
                         lambda: calls.generate(prompt[None]), lambda _: calls.generate(other[None])))
    if subject.kind == "seq2seq":
        not_run.update(dict.fromkeys(names[1:], "an encoder-decoder: the conversation and the candidates continue "
                                                "the decoder, not the prompt"))
    elif chosen & set(names[1:]):  # the conversation's reply is generated while planning: only when asked for
        try:
            causal, skipped = _causal_only(calls, prompt, seed)
            seqs.extend(causal)
            not_run.update(skipped)
        except Exception as exc:  # judged by `generate`: here nothing ran before it
            not_run.update(dict.fromkeys(names[1:], f"generate() on a fresh state did not run: {exc}"))
    return seqs, not_run, reached


def _after_padding(calls: _Calls, short: torch.Tensor, seed: int) -> tuple[list[Sequence], dict[str, str]]:
    """What users send after `model(**tokenizer(batch, padding=True))`: one prompt, or an unpadded batch of the same
    size, decoded in the loop they write (prefill, then one token a call with the cache), with and without
    position_ids. A model that works out a per-row offset from the padding (Qwen2-VL's rope_deltas, #36013) and keeps
    it for a request with none decodes that request at shifted positions; a padded batch after a padded batch works
    it out again and reads OK."""
    subject, n = calls.subject, short.shape[0]
    ok, why = cache_support(subject)
    why = why if not ok else "" if subject.kind == "causal" and takes_cache(subject.model) else (
        "an encoder-decoder: its decoder's cache is `cache`'s" if subject.kind == "seq2seq" else
        f"{type(subject.model).__name__} takes no cache: no decode loop to continue")
    if why:
        return [], dict.fromkeys(AFTER_PADDING, why)
    lens = [max(2, n - 5), n, max(2, n // 2)]  # row 0 padded too: a kept offset of row 0 reaches one request
    batch = calls.padded(subject.sample_ids(3, n, seed + 43).to(short.device), lens)
    text = subject.sample_ids(3, n + STEPS, seed + 47).to(short.device)
    seqs, skipped = [], {}
    for rows, what in ((1, f"one {n}-token prompt"), (3, f"an unpadded batch of 3 {n}-token prompts")):
        for with_ids in (False, True):
            name = AFTER_PADDING[(rows > 1) * 2 + with_ids]
            if with_ids and not subject.family.takes_position_ids:
                skipped[name] = "the family's forward takes no position_ids"
                continue
            seqs.append(Sequence(
                name, f"after a plain forward of a left-padded batch of lengths {lens}, {what} decoded {STEPS} tokens "
                f"in a hand-written loop (cache passed, {'position_ids passed' if with_ids else 'no position_ids'})",
                lambda r=rows, w=with_ids: calls.decoded(text[:r], n, w), lambda: calls.forward(*batch),
                lambda _, r=rows, w=with_ids: calls.decoded(text[:r], n, w), rows=rows))
    return seqs, skipped


def _causal_only(calls: _Calls, short: torch.Tensor, seed: int) -> tuple[list[Sequence], dict[str, str]]:
    """Multi-turn over the returned cache, assisted decoding by the model itself, prompt-lookup decoding; and the
    sequences that cannot run, with why."""
    subject, n = calls.subject, short.shape[0]
    turn = subject.sample_ids(1, TURN, seed + 61)[0]
    # The conversation: the prompt, the reply generate() gives on a fresh state, the user's next turn. The history
    # generates that reply again (the state is fresh again when it starts) and keeps its cache.
    reply = calls.generate(short[None], full=True)
    conversation = torch.cat([reply.sequences[0], turn])[None]
    repeated = torch.cat([short, short[: max(LOOKUP + 1, n // 2)]])  # a prompt whose n-grams recur: lookup proposes
    declared = subject.max_positions
    if declared is not None:  # within the context with its new tokens (the conversation is shorter than it)
        repeated = repeated[: max(n, declared - calls.new_tokens - LOOKUP - 1)]  # candidates reach past the end
    seqs = [
        Sequence("multi-turn", f"after generate() on a {n}-token prompt, a {TURN}-token user turn appended and "
                 f"generate() continued from the returned cache", lambda: calls.generate(conversation),
                 lambda: _cache_of(calls.generate(short[None], full=True)),
                 lambda kept: calls.generate(conversation, **{cache_keyword(subject.model): kept})),
        Sequence("assisted decoding", f"generate() on a {n}-token prompt assisted by a draft that disagrees "
                 f"(the model proposing its runner-up at every odd position, {ASSISTED} candidates a step)",
                 lambda: calls.generate(short[None]),
                 lambda: None, lambda _: calls.assisted(short[None]), same_call=False),
        Sequence("prompt lookup", f"prompt-lookup decoding ({LOOKUP} candidates a step) on a {repeated.shape[0]}-"
                 "token prompt whose n-grams recur", lambda: calls.generate(repeated[None]), lambda: None,
                 lambda _: calls.generate(repeated[None], prompt_lookup_num_tokens=LOOKUP), same_call=False),
    ]
    if _cache_of(reply) is None or not takes_cache(subject.model):  # nothing to continue from
        return seqs[1:], {"multi-turn": f"generate() returns no cache to continue from ({type(subject.model).__name__} "
                                        "keeps none)"}
    return seqs, {}


class _Calls:
    """The model's calls as users make them, counted in subject.forward_count."""

    def __init__(self, subject: Subject, new_tokens: int):
        self.subject, self.new_tokens = subject, new_tokens
        pad = getattr(subject.config, "pad_token_id", None)
        self.pad = pad if isinstance(pad, int) and 0 <= pad < subject.vocab_size else 0

    def padded(self, ids: torch.Tensor, lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the given lengths, left-padded (as for generation) with the config's padding id."""
        mask = torch.zeros_like(ids)
        for r, n in enumerate(lens):
            mask[r, ids.shape[1] - n:] = 1
        return torch.where(mask.bool(), ids, torch.full_like(ids, self.pad)), mask

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The model's output (logits, else the final hidden state) at the real tokens, float64, flattened."""
        kwargs: dict[str, Any] = {} if mask is None else {"attention_mask": mask}
        if self.subject.kind == "seq2seq":
            kwargs = {"decoder_input_ids": ids, **({} if mask is None else {"decoder_attention_mask": mask}), **kwargs}
        self.subject.forward_count += 1
        with torch.inference_mode():
            out = output_of(self.subject.model(input_ids=ids, **kwargs))
        out = out.to(torch.float64)
        return out.flatten() if mask is None else out[mask.bool()].flatten()

    def decoded(self, ids: torch.Tensor, prompt: int, positions: bool) -> torch.Tensor:
        """`ids`' first `prompt` tokens prefilled into a new cache, then the others fed one a call with the cache and
        the mask (all ones, as a tokenizer gives it) grown by one; `positions`: position_ids passed. Every logit,
        float64, flat."""
        model, b = self.subject.model, ids.shape[0]
        cache = {cache_keyword(model): new_cache(self.subject, "dynamic", ids.shape[1])}
        outs = []
        for start, stop in [(0, prompt), *((t, t + 1) for t in range(prompt, ids.shape[1]))]:
            numbered = torch.arange(start, stop, device=ids.device)[None].expand(b, -1)
            extra = {"position_ids": self.subject.position_ids_for(numbered)} if positions else {}
            self.subject.forward_count += 1
            with torch.inference_mode():
                out = model(input_ids=ids[:, start:stop], attention_mask=torch.ones_like(ids[:, :stop]),
                            use_cache=True, return_dict=True, **cache, **extra)
            outs.append(output_of(out))
        return torch.cat(outs, 1).to(torch.float64).flatten()

    def generate_refusal(self) -> str:
        """Why the generate() sequences cannot run ("" when they can)."""
        ok, why = cache_support(self.subject)
        if not ok:
            return why
        can = getattr(self.subject.model, "can_generate", None)
        if not callable(can) or not can():
            return f"{type(self.subject.model).__name__} has no generation head (can_generate() is False)"
        note = cache_layer_note(self.subject)
        return f"generate() sizes its cache wrongly here ({note}): judged by `generate`" if note else ""

    def assisted(self, ids: torch.Tensor) -> Any:
        """generate() assisted by a draft that disagrees (the model proposing its runner-up at every odd position,
        ASSISTED candidates a step: posdiag.model.drafts), so verification rejects drafts and rolls the cache back."""
        with disagreeing_draft(self.subject.model, ASSISTED) as (draft, _):
            return self.generate(ids, assistant_model=draft)

    def generate(self, ids: torch.Tensor, full: bool = False, **extra: Any) -> Any:
        """Greedy generate(): the logits of every generated step (float64, flattened); `full`: the whole output."""
        out = greedy(self.subject, ids, self.new_tokens, self.pad, **extra)
        return out if full else torch.stack(out.logits, 1).to(torch.float64).flatten()


def _cache_of(out: Any) -> Any:
    """The cache generate() returned (`cache` in transformers 5, `past_key_values` before)."""
    cache = out.get("cache")
    return cache if cache is not None else out.past_key_values
