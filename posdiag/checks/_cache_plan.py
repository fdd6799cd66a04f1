"""Where the `cache` check's probe runs and how each path feeds it: the probe reaches every boundary the model
declares (a sliding window, a chunked-attention size, the original context of a scaling block), and the paths that
share their first forwards feed them once (a later path continues a copy of an earlier one's cache).

A boundary changes what a cached step sees: the cache crops a window or a chunk, a scaling block switches its
frequencies past its original context. Feeding positions far beyond it proves nothing more and costs every path
those tokens, so the probe ends a few tokens past the largest boundary, the decode prefill is longer than any window
and the last multi-token forwards are placed across it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posdiag.model.caches import text_config
from posdiag.model.subject import Subject
from posdiag.options import RunOptions, probe_length

PAST_WINDOW = 64  # a window of up to this many tokens: the probe runs 2 x window + 4 tokens, as for any short window
PAST_BOUNDARY = 12  # tokens a probe runs past a longer boundary: a decode prefill past it, then the decode steps
CHUNKS = 5  # multi-token chunks continuing the chunked prefill (q_len > 1 against a cache), at least 2 tokens each
SCALING_REACH = 1024  # the longest probe a scaling block's original context extends it to (beyond: named, not run)
SWITCHING = ("dynamic", "longrope", "yarn")  # scaling blocks whose frequencies depend on the length seen


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
    """The positions past which a cached step sees something else: the sliding window (the cache keeps only it),
    Llama 4-style chunked attention (the cache keeps the chunk, like a window), and the original context of a
    scaling block whose frequencies switch with the length (dynamic NTK, LongRoPE, YaRN)."""
    found: dict[str, int] = {}
    if subject.sliding_window:
        found["sliding window"] = subject.sliding_window
    chunk = getattr(text_config(subject), "attention_chunk_size", None)
    if isinstance(chunk, int) and chunk > 0:
        found["attention chunk"] = chunk
    original = original_context(subject)
    if original:
        found["original context"] = original
    return found


def original_context(subject: Subject) -> int | None:
    """The shortest original_max_position_embeddings of a switching scaling block (rope_parameters / rope_scaling,
    one block or one per layer type), None without one."""
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


def plan_probe(subject: Subject, options: RunOptions, decode_steps: int) -> Plan:
    """The probe length: the requested one, extended to reach each declared boundary (a window or chunk of up to
    PAST_WINDOW: 2 x it + 4 tokens, as for every short window; a longer one: PAST_BOUNDARY past it; an original
    context: the decode steps straddle it). A boundary past the declared context, or an original context needing a
    probe over SCALING_REACH, is named in `missed`, never run short and claimed."""
    plan = Plan(probe_length(subject, options))
    if options.token_ids is not None:  # the user's tokens: their own length, the boundaries inside it
        plan.reached = {k: v for k, v in declared_boundaries(subject).items() if v < plan.length}
        plan.missed = {k: f"{v} is past the {plan.length} tokens given" for k, v in declared_boundaries(subject).items()
                       if v >= plan.length}
        return plan
    declared = subject.max_positions
    for name, at in declared_boundaries(subject).items():
        want = _needs(name, at, decode_steps)
        if declared is not None and want > declared:
            plan.missed[name] = f"{at} needs a {want}-token probe, past the declared context of {declared}"
        elif name == "original context" and want > max(SCALING_REACH, plan.length):
            plan.missed[name] = f"{at} needs a {want}-token probe, over the {SCALING_REACH} tokens this check runs"
        else:
            plan.reached[name] = at
    wants = [_needs(name, at, decode_steps) for name, at in plan.reached.items()]
    plan.length = max([plan.length, *wants])
    return plan


def _needs(name: str, at: int, decode_steps: int) -> int:
    if name == "original context":  # the decode steps (the last decode_steps tokens) straddle it
        return at + max(1, decode_steps // 2)
    return at + min(at, PAST_WINDOW) + 4 if at <= PAST_WINDOW else at + PAST_BOUNDARY


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
    return {"decode": Schedule(decode), "chunked_prefill": Schedule(chunked),
            "chunks": Schedule(chunked[:shared] + tail, "chunked_prefill", shared)}
