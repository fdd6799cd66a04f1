"""The paths `serving` judges, each a way a serving stack (or a user's own loop) computes what one full forward of
the same tokens computes, and each compared with that forward position by position.

A path is a name, a story (what ran, in words) and `compare()`, which runs it and returns (where, error) for every
position compared, in the order the path produced them: error = ||path_t − full_t|| / ||full_t|| over the logits;
a path whose premise only its run can show (assisted decoding's rollbacks) says after compare() whether it held.
The reference is always one full forward, no cache, of the tokens the path fed (a generated token is fed as the path
chose it: teacher forcing, so near-ties between candidates never matter), with the positions passed as the path
passed them. Histories (another prompt, another padded batch) run inside the path: every path starts from the model
as loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from posdiag.checks.serving.calls import Calls, Decoded
from posdiag.model.caches import copied_cache
from posdiag.model.drafts import Rollbacks
from posdiag.model.tensors import per_token_change

LOOKUP = 3  # prompt_lookup_num_tokens: candidates copied from the prompt a step
# A request after a padded batch (one request, or an unpadded batch of the same size) is `state`'s: the same calls
# against the same calls on a fresh state ("one request after a padded batch"...), which also proves them here.
LOOPS = ("decode loop after another prompt", "decode loop after a padded batch")
CANDIDATES = 2  # drafts the assistant makes a step, constant: verification continues a cache it verified before


@dataclass(frozen=True)
class Path:
    name: str
    story: str
    compare: Callable[[], list[tuple[str, float]]]
    premise: Callable[[], tuple[bool, str]] | None = None  # after compare(): (held, what the run showed)
    # What posdiag's one-position slip runs (its power): the path cut down to just past its first boundaries (the
    # second and third chunk, the first suffix and decode step, no history), all a slip there needs. At those
    # positions it computes what the whole path computes, so the slip's figure is never larger than the whole path's
    # would be (a chunked generate() on the prompt's first 2 chunks + 1 tokens: a shorter prompt). None: compare.
    slip: Callable[[], list[tuple[str, float]]] | None = None


@dataclass(frozen=True)
class Settings:
    """What the plan reads: the request (ids, [n]), the chunk sizes, the decode steps of a hand-written loop, the
    tokens generate() adds, the seed of the other requests' ids, and whether position_ids are the family's to take."""

    ids: torch.Tensor
    chunk_sizes: tuple[int, ...]
    steps: int
    new_tokens: int
    seed: int
    explicit: bool
    cached: bool  # the model keeps a KV cache a forward can be handed
    generates: bool  # generate() runs (can_generate)


def where(t: int, prompt: int, generated: bool = False) -> str:
    """A position's name: a prompt position, a hand-written loop's decode step, or generate()'s step."""
    if t < prompt - (1 if generated else 0):
        return f"position {t}"
    step = t - prompt + 1
    return f"{'generated' if generated else 'decode'} step {step} (position {t})"


def errors(out: torch.Tensor, ref: torch.Tensor, labels: list[str]) -> list[tuple[str, float]]:
    """Per position ([T, V] each) error, paired with its name."""
    return list(zip(labels, per_token_change(out, ref).tolist(), strict=True))


def plan(calls: Calls, s: Settings) -> tuple[list[Path], dict[str, str]]:
    """Every path this model can take (in report order), and those it cannot (name -> why)."""
    n, paths, not_run = s.ids.shape[0], [], {}
    memo: dict[tuple[int, ...], torch.Tensor] = {}

    def full(ids: torch.Tensor) -> torch.Tensor:  # one full forward of one unpadded row, shared by the paths
        key = tuple(ids.tolist())
        if key not in memo:
            memo[key] = calls.full(ids[None]).states[0]
        return memo[key]

    def chunked(k: int, m: int) -> list[tuple[str, float]]:  # the prompt's first m tokens fed k a forward
        m = min(m, n)
        return errors(calls.chunked(s.ids[None, :m], k)[0], full(s.ids)[:m], [where(t, n) for t in range(m)])

    def generated(k: int, m: int, tokens: int) -> list[tuple[str, float]]:  # generate(prefill_chunk_size=k)
        m = min(m, n)
        return _generated(calls, m, *calls.generate(s.ids[None, :m], tokens, prefill_chunk_size=k))

    no_cache = "the model keeps no KV cache a forward can be handed (see `cache`)"
    for size in s.chunk_sizes:
        name = f"chunks of {size}"
        if size >= n:
            not_run[name] = f"a chunk of {size} holds the whole {n}-token prompt"
        elif not s.cached:
            not_run[name] = no_cache
        else:
            paths.append(Path(name, f"the {n}-token prompt fed {size} tokens a forward into one cache",
                              lambda k=size: chunked(k, n), slip=lambda k=size: chunked(k, 2 * k + 1)))
    for size in s.chunk_sizes:
        name = f"generate prefill_chunk_size={size}"
        if size >= n or not s.generates:
            not_run[name] = f"a chunk of {size} holds the whole prompt" if size < n else "generate() does not run"
            continue
        paths.append(Path(name, f"generate(prefill_chunk_size={size}) on the {n}-token prompt, {s.new_tokens} "
                                "tokens", lambda k=size: generated(k, n, s.new_tokens),
                          slip=lambda k=size: generated(k, 2 * k + 1, 2)))
    if s.cached:
        paths.extend(_cached_paths(calls, s, full))
        if not s.explicit:
            not_run.update(dict.fromkeys((f"{loop} with position_ids" for loop in LOOPS),
                                         "the family's forward takes no position_ids"))
    else:
        not_run.update(dict.fromkeys(("shared prefix", "padded batch", *LOOPS), no_cache))
    if s.generates:
        paths += _drafted_paths(calls, s)
    else:
        not_run.update(dict.fromkeys(("assisted decoding", "prompt lookup"), "generate() does not run"))
    return paths, not_run


def _drafted_paths(calls: Calls, s: Settings) -> list[Path]:
    """generate() verifying drafts: a draft that disagrees (its rollbacks counted: the path's premise), and
    candidates copied from a prompt whose n-grams recur."""
    n = s.ids.shape[0]
    lookup = torch.cat([s.ids[:n - n // 2], s.ids[:n // 2]])  # its n-grams recur: lookup proposes candidates
    seen: dict[str, Rollbacks] = {}

    def assisted() -> list[tuple[str, float]]:
        seq, logits, seen["rollbacks"] = calls.assisted(s.ids[None], s.new_tokens, CANDIDATES)
        return _generated(calls, n, seq, logits)

    return [
        Path("assisted decoding", f"generate() on the {n}-token prompt assisted by a draft that disagrees (the "
             f"model proposing its runner-up at every odd position, {CANDIDATES} drafts a step)", assisted,
             lambda: _rolled_back(seen.get("rollbacks"))),
        Path("prompt lookup", f"prompt-lookup decoding ({LOOKUP} candidates a step) on a {n}-token prompt whose "
             "n-grams recur", lambda: _generated(calls, n, *calls.generate(
                 lookup[None], s.new_tokens, prompt_lookup_num_tokens=LOOKUP))),
    ]


def _rolled_back(rollbacks: Rollbacks | None) -> tuple[bool, str]:
    """Assisted decoding's premise: verification rejected drafts and cropped the cache (else no rollback ran)."""
    if rollbacks is None or not rollbacks.rejected:
        return False, (f"rollback not exercised: verification accepted every draft ({rollbacks})" if rollbacks else
                       "rollback not exercised: no verification was counted")
    return True, str(rollbacks)


def _generated(calls: Calls, n: int, seq: torch.Tensor, logits: torch.Tensor) -> list:
    """generate()'s logits of each step against the full forward's at the same positions (the last `steps + 1` rows
    of the LM head, the last one predicting past the sequence)."""
    steps = logits.shape[1]
    ref = calls.full(seq, keep=steps + 1).logits[0, :steps]
    return errors(logits[0], ref, [where(t, n, generated=True) for t in range(n - 1, n - 1 + steps)])


def _cached_paths(calls: Calls, s: Settings, full: Callable) -> list[Path]:
    ids, n, steps = s.ids, s.ids.shape[0], s.steps
    p = n // 2
    other = calls.subject.sample_ids(1, n - p, s.seed + 1009)[0]
    m = max(4, n - 8)
    neighbours = calls.subject.sample_ids(2, n, s.seed + 2003)
    in_batch = [neighbours[0], ids[:m], neighbours[1][:max(2, m // 2)]]
    paths = [
        Path("shared prefix", f"a {p}-token prefix computed once, its cache copied and continued by two different "
             f"{n - p}-token suffixes, {steps} decode steps each",
             lambda: _shared_prefix(calls, ids[:p], [ids[p:], other], steps, full),
             slip=lambda: _shared_prefix(calls, ids[:p], [ids[p:]], 1, full)),
        Path("padded batch", f"the {m}-token request as row 1 of a left-padded batch of lengths "
             f"[{n}, {m}, {max(2, m // 2)}], position_ids from the mask, {steps} decode steps",
             lambda: _in_batch(calls, in_batch, 1, steps, full), slip=lambda: _in_batch(calls, in_batch, 1, 1, full)),
    ]
    first, second = calls.subject.sample_ids(3, n, s.seed + 31), calls.subject.sample_ids(3, n, s.seed + 37)
    before = [first[0], first[1][:max(2, n - 5)], first[2][:max(2, n // 2)]]
    batch = [row[:k] for row, k in zip(second, [max(2, n - 3), n, max(2, n - n // 3)], strict=True)]
    variants = [False, True] if s.explicit else [False]
    for with_ids in variants:
        tail, passed = (" with position_ids", ", position_ids passed") if with_ids else ("", ", no position_ids")
        paths.append(Path(f"decode loop after another prompt{tail}", f"a hand-written decode loop ({steps} steps"
                          f"{passed}) on the {n}-token prompt after the same loop on another prompt",
                          lambda w=with_ids: _loop(calls, [ids], steps, w, [other], w),
                          slip=lambda w=with_ids: _loop(calls, [ids], 1, w)))
    for with_ids in variants:
        tail = " with position_ids" if with_ids else ""
        paths.append(Path(f"decode loop after a padded batch{tail}", f"a hand-written decode loop ({steps} steps"
                          f"{', position_ids from the mask' if with_ids else ', no position_ids'}) on a left-padded "
                          "batch of 3 after the same loop on another batch of 3 (other lengths)",
                          lambda w=with_ids: _loop(calls, batch, steps, w, before, w),
                          slip=lambda w=with_ids: _loop(calls, batch, 1, w)))
    return paths


def _shared_prefix(calls: Calls, prefix: torch.Tensor, suffixes: list[torch.Tensor], steps: int,
                   full: Callable) -> list:
    cache = calls.cache()
    calls.forward(prefix[None], cache=cache)
    found, p = [], prefix.shape[0]
    for name, suffix in zip("AB", suffixes, strict=False):
        copy = copied_cache(cache)
        if copy is None:
            raise NotCopyable(f"{type(cache).__name__} of this model cannot be copied (deepcopy)")
        run = calls.continued(suffix[None], copy, steps)
        ref = full(torch.cat([prefix, run.ids[0]]))[p:]
        found += [(f"suffix {name} {label}", e) for label, e in errors(
            run.outputs[0], ref, [where(t, p + suffix.shape[0]) for t in range(p, p + run.ids.shape[1])])]
    return found


def _in_batch(calls: Calls, rows: list[torch.Tensor], row: int, steps: int, full: Callable) -> list:
    ids, mask = calls.padded(rows)
    run = calls.decode(ids, mask, steps, with_ids=True)
    valid = run.mask[row].bool()
    mine = run.ids[row][valid]
    prompt = rows[row].shape[0]
    return errors(run.outputs[row][valid], full(mine), [where(t, prompt) for t in range(mine.shape[0])])


def _loop(calls: Calls, rows: list[torch.Tensor], steps: int, with_ids: bool, before: list[torch.Tensor] | None = None,
          before_ids: bool | None = None) -> list:
    """The greedy loop users write on `rows` (left-padded where their lengths differ), after the same loop on the
    rows `before` (`before_ids`: with position_ids or not), against the full forward of the same rows with the same
    arguments. `before_ids` None: the history users make before one request, `model(**tokenizer(batch,
    padding=True))`, one forward without position_ids (the model works out any offset from the padding itself)."""
    if before is not None:
        calls.decode(*calls.padded(before), 0 if before_ids is None else steps, bool(before_ids))
    run: Decoded = calls.decode(*calls.padded(rows), steps, with_ids)
    ref = calls.full(run.ids, run.mask, with_ids).states
    found = []
    for r, row in enumerate(rows):
        valid = run.mask[r].bool()
        found += [(f"row {r} {label}" if len(rows) > 1 else label, e) for label, e in errors(
            run.outputs[r][valid], ref[r][valid], [where(t, row.shape[0]) for t in range(int(valid.sum()))])]
    return found


class NotCopyable(Exception):
    """The path needs a copy of a cache and this model's cache cannot be copied: not run, never judged."""
