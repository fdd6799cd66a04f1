"""Where the `cache` check's probe runs and how each path feeds it: the probe reaches every boundary the cache
applies (a sliding window, a chunked-attention size), and the paths that share their first forwards feed them once
(a later path continues a copy of an earlier one's cache).

A boundary changes what a cached step sees: the cache crops a window or a chunk. Feeding positions far beyond it
proves nothing more and costs every path those tokens, so the probe ends a few tokens past the largest boundary,
the decode prefill is longer than it and the last multi-token forwards are placed across it. A LongRoPE block's
original context is not straddled: a forward longer than original_max_position_embeddings rotates every position
with the long factors (transformers picks them by the forward's largest position), so the output at t depends on
more than tokens 0..t, the identity this check rests on (a 64-token probe of a tiny LongRoPE model with an original
context of 40: a cache-free prefix shorter than 40 differs from the full forward by 1.1e-2, by design, and the floor
it set hid everything). The probe stays within it and the report names it. (Dynamic NTK switches past the declared
context, which no probe passes; YaRN's frequencies do not depend on the length.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posdiag.model.caches import text_config
from posdiag.model.memory import forward_refusal
from posdiag.model.subject import Subject
from posdiag.options import RunOptions, probe_length

PAST_WINDOW = 64  # a window of up to this many tokens: the probe runs 2 x window + 4 tokens, as for any short window
PAST_BOUNDARY = 12  # tokens a probe runs past a longer boundary: a decode prefill past it, then the decode steps
CHUNKS = 5  # multi-token chunks continuing the chunked prefill (q_len > 1 against a cache), at least 2 tokens each
SWITCHING = ("longrope",)  # scaling blocks whose frequencies switch with a forward's length inside the context


@dataclass
class Plan:
    """The probe length, the boundaries it reaches (name -> position) and those it does not (name -> why)."""

    length: int
    reached: dict[str, int] = field(default_factory=dict)
    missed: dict[str, str] = field(default_factory=dict)

    @property
    def boundary(self) -> int | None:
        """The largest boundary inside the probe: the last multi-token forwards are placed across it."""
        inside = [b for b in self.reached.values() if b < self.length]
        return max(inside) if inside else None


def declared_boundaries(subject: Subject) -> dict[str, int]:
    """The positions past which a cached step sees something else: the sliding window (the cache keeps only it)
    and Llama 4-style chunked attention (DynamicCache(config) keeps the chunk, like a window)."""
    found: dict[str, int] = {}
    if subject.sliding_window:
        found["sliding window"] = subject.sliding_window
    chunk = getattr(text_config(subject), "attention_chunk_size", None)
    if isinstance(chunk, int) and chunk > 0:
        found["attention chunk"] = chunk
    return found


def original_context(subject: Subject) -> int | None:
    """The shortest original_max_position_embeddings of a LongRoPE block (rope_parameters / rope_scaling, one block
    or one per layer type), None without one."""
    cfg = text_config(subject)
    values = []
    for obj in (getattr(cfg, "rope_parameters", None), getattr(cfg, "rope_scaling", None)):
        if not isinstance(obj, dict):
            continue
        blocks = [v for v in obj.values() if isinstance(v, dict)] or [obj]
        for block in blocks:
            kind, value = str(block.get("rope_type") or block.get("type") or ""), block.get(
                "original_max_position_embeddings") or getattr(cfg, "original_max_position_embeddings", None)
            if any(name in kind for name in SWITCHING) and isinstance(value, int) and value > 0:
                values.append(value)
    return min(values) if values else None


def plan_probe(subject: Subject, options: RunOptions) -> Plan:
    """The probe length: the requested one, extended to reach each declared boundary (one of up to PAST_WINDOW:
    2 x it + 4 tokens, as for every short window; a longer one: PAST_BOUNDARY past it), up to the declared context.
    A LongRoPE block's original context caps the probe (see the module doc). A boundary the probe does not pass (past
    the declared context, the tokens given or that cap) is named in `missed`, never claimed; so is the cap."""
    plan = Plan(probe_length(subject, options))
    declared = subject.max_positions
    boundaries = declared_boundaries(subject)
    if options.token_ids is None:  # the user's tokens keep their own length
        wants = {name: probe_past(at) if declared is None else min(probe_past(at), declared)
                 for name, at in boundaries.items()}
        for name, want in list(wants.items()):  # planned before it runs: a probe memory cannot hold is not run
            refusal = "" if want <= plan.length else forward_refusal(
                subject, f"{boundaries[name]}: the probe past it", 1, want, logits_rows=1, cache=True)
            if refusal:
                plan.missed[name] = refusal
                del wants[name], boundaries[name]
        plan.length = max([plan.length, *wants.values()])
    original = original_context(subject)
    limit = "the declared context" if options.token_ids is None else "the tokens given"
    if original is not None:
        plan.missed["original context"] = (f"{original} (LongRoPE: a longer forward rotates every position with its "
                                           "long factors, so the full forward is no reference past it; the probe stays "
                                           "within it)")
        if original < plan.length:
            plan.length, limit = max(4, original), f"LongRoPE's original context of {original}"
    for name, at in boundaries.items():
        if at < plan.length:
            plan.reached[name] = at
        else:
            plan.missed[name] = f"{at} needs a {probe_past(at)}-token probe: past {limit} ({plan.length} tokens)"
    return plan


def probe_past(boundary: int) -> int:
    """The probe a boundary needs: 2 x it + 4 tokens up to PAST_WINDOW, PAST_BOUNDARY tokens past a longer one."""
    return 2 * boundary + 4 if boundary <= PAST_WINDOW else boundary + PAST_BOUNDARY


@dataclass(frozen=True)
class Schedule:
    """One path's token ranges, one forward each; `parent`/`shared`: its first `shared` ranges are the parent
    schedule's own, fed once (the path continues a copy of the parent's cache after them)."""

    steps: list[tuple[int, int]]
    parent: str = ""
    shared: int = 0


def schedules(length: int, decode_steps: int, boundary: int | None = None) -> dict[str, Schedule]:
    """decode: a prefill, then single-token steps; chunked_prefill: three forwards from an empty cache, the last
    placed across the largest boundary; chunks: the chunked prefill's first forwards, then CHUNKS smaller chunks
    (after its second forward where that leaves room for them, so they cross the boundary too)."""
    steps = max(1, min(decode_steps, length // 2))
    prefill = length - steps
    decode = [(0, prefill)] + [(t, t + 1) for t in range(prefill, length)]
    size = -(-length // 3)
    cut = 2 * size if boundary is None else max(2 * size, 2 * boundary - length)
    cut = min(cut, length - 1)
    chunked = [(0, size), (size, cut), (cut, length)] if size < cut < length else \
        [(t, min(t + size, length)) for t in range(0, length, size)]
    shared = 2 if len(chunked) == 3 and length - chunked[1][1] >= 2 * CHUNKS else 1
    start = chunked[shared - 1][1]
    chunk = max(2, -(-(length - start) // CHUNKS))
    tail = [(t, min(t + chunk, length)) for t in range(start, length, chunk)]
    if len(tail) > 1 and tail[-1][1] - tail[-1][0] == 1:  # a 1-token tail would be a decode step: merge it
        tail[-2:] = [(tail[-2][0], length)]
    return {"decode": Schedule(decode), "chunks": Schedule(chunked[:shared] + tail, "chunked_prefill", shared),
            "chunked_prefill": Schedule(chunked)}
