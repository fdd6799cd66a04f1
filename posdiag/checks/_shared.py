"""What several checks measure the same way: the jitter noise floor, per-token change, layer names,
position helpers, and the KV-cache plumbing shared by `cache` and `generate`.

Checks import from here, never from each other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from posdiag.errors import MaskRefused, describe_error, refused_by_generation
from posdiag.model.precision import run_finer
from posdiag.model.probe import mask_refusal
from posdiag.model.subject import Subject
from posdiag.model.tensors import dtype_name, release_freed_memory
from posdiag.results import CheckResult, Status
from posdiag.verdict import FloorVerdict, degenerate_floor, judge_arbitrated, needs_arbitration, noise_floor

T = TypeVar("T")

FLOOR_SOURCE = "token embeddings of one row jittered by ~1 ulp, same forward (rounding sensitivity)"


# ------------------------------------------------------------------ the jitter floor
def embedding_module(subject: Subject, stack: str) -> torch.nn.Module | None:
    """The token-embedding module that feeds `stack` (None when none can be found)."""
    model = subject.model
    with contextlib.suppress(Exception):
        if subject.kind == "seq2seq":
            part = model.get_encoder() if stack == "encoder" else model.get_decoder()
            return part.get_input_embeddings()
        if hasattr(model, "get_input_embeddings"):
            emb = model.get_input_embeddings()
            if emb is not None:
                return emb
    return next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)


@contextlib.contextmanager
def jittered(subject: Subject, stack: str, row: int, total_rows: int, seed: int = 0,
             settle_masks: bool = True) -> Iterator[bool]:
    """Within the block, the token embeddings of batch row `row` are multiplied by (1 + ε·n).

    Works across --max-batch chunks: forward() splits rows in order into chunks of
    `max_batch`, and the hooked module is called once per chunk (twice when an encoder-decoder
    shares one embedding between its stacks and the decoder stack is run — then both calls of
    that row are jittered, still rounding-level noise). Yields False when no embedding module
    was found (the caller falls back to the machine epsilon and says so). `settle_masks=False` for a caller that
    calls the model itself, without the explicit masks whose refusal is settled first.
    """
    emb = embedding_module(subject, stack)
    if emb is None:
        yield False
        return
    if settle_masks:
        mask_refusal(subject, stack)  # settled now: finding out later, under the hook, would add calls it counts
    step = subject.options.max_batch or total_rows
    target_chunk, local = divmod(row, step)
    calls_per_chunk = 1
    if subject.kind == "seq2seq" and stack == "decoder":
        with contextlib.suppress(Exception):
            if subject.model.get_encoder().get_input_embeddings() is emb:
                calls_per_chunk = 2
    state = {"calls": 0}

    def hook(module, args, out):
        chunk = state["calls"] // calls_per_chunk
        state["calls"] += 1
        if chunk != target_chunk or not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return None
        gen = torch.Generator().manual_seed(seed + 104729)
        noise = torch.randn(out[local].shape, generator=gen).to(out.device, out.dtype)
        out = out.clone()
        out[local] = out[local] * (1 + torch.finfo(out.dtype).eps * noise)
        return out

    handle = emb.register_forward_hook(hook)
    try:
        yield True
    finally:
        handle.remove()


def per_token_change(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """||a_t − e_t|| / ||e_t|| per token [T] in float64 (0 where both vanish); everything after the token dim is
    the token's state (DeepSeek-V4's hyper-connections carry [T, streams, D])."""
    a, e = (t.detach().double().reshape(t.shape[0], -1) for t in (actual, expected))
    num = (a - e).norm(dim=-1)
    den = e.norm(dim=-1)
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.where(num > 0, torch.inf, 0.0))


# ------------------------------------------------------------------ positions and layers
def position_limit(subject: Subject) -> int | None:
    """Largest logical position id the probes may use (the declared context, less table offsets)."""
    declared = subject.max_positions
    if declared is None:
        return None
    return declared - 1 - max(0, subject.family.position_offset - subject.family.explicit_position_offset)


def restart_positions(length: int) -> torch.Tensor:
    """Two packed documents: 0..h-1, 0..T-h-1 (the pattern stays one causal/bidirectional block)."""
    half = length // 2
    return torch.cat([torch.arange(half), torch.arange(length - half)])


def layer_name(index: int, total: int | None = None) -> str:
    """Index 0 of a hidden-state list is the embeddings output (when there is more than one entry)."""
    return "embeddings" if index == 0 and (total is None or total > 1) else f"block {index}"


def encoder_inputs(subject: Subject, stack: str, ids: torch.Tensor, rows: int) -> torch.Tensor | None:
    """The encoder input that decoder probes of an encoder-decoder run with: the probe ids themselves,
    one copy per row (None for any other stack or kind)."""
    if not (subject.kind == "seq2seq" and stack == "decoder"):
        return None
    return ids[None].expand(rows, -1)


def stack_result(name: str, stack: str, judge: Callable[[], CheckResult]) -> CheckResult:
    """One stack's result. A stack whose model takes no form of the mask a probe needs is a SKIP that says
    so (MaskRefused), and the other stack of an encoder-decoder is still judged."""
    try:
        return judge()
    except MaskRefused as exc:
        return CheckResult(name, Status.SKIP, str(exc), details={"stack": stack, "mask_refused": str(exc)})


# ------------------------------------------------------------------ KV caches (cache, generate)
def cache_support(subject: Subject) -> tuple[bool, str]:
    """Can this subject decode with a transformers Cache at all?"""
    if subject.kind == "encoder":
        return False, "encoder (bidirectional): no KV cache, nothing is decoded"
    if not subject.is_hf:
        return False, "factory model: no transformers Cache interface to drive"
    model = subject.model
    supports = getattr(model, "_supports_default_dynamic_cache", None)
    if supports is None or not supports():
        return False, f"{type(model).__name__} does not use transformers Cache objects"
    return True, ""


def keeps_kv_cache(subject: Subject) -> bool:
    """Whether a forward asked for a cache returns one (measured on two tokens, not read off the class).

    OpenAI GPT swallows use_cache / past_key_values in **kwargs and returns none: a cache handed to it
    stays empty, each call sees only its own tokens, and generate() re-runs the whole prefix each step."""
    if subject.kind != "causal" or not subject.is_hf:
        return subject.kind == "seq2seq"
    ids = subject.sample_ids(1, 2, 0)
    subject.forward_count += 1
    try:
        with torch.inference_mode():
            out = subject.model(input_ids=ids, use_cache=True, return_dict=True)
    except Exception:  # the checks' own cached paths will meet (and report) whatever this was
        return True
    if any(getattr(out, name, None) is not None for name in ("past_key_values", "cache_params", "cache")):
        return True
    # A state kept inside the model and advanced by cache_position (RecurrentGemma) returns no cache object.
    return any(name in _forward_parameters(subject.model) for name in ("cache_position", "cache_params", "cache"))


def _forward_parameters(model: Any) -> set[str]:
    import inspect

    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):  # pragma: no cover - forward without a signature
        return set()


def text_config(subject: Subject) -> Any:
    """The config a decoder cache is sized from, with the layer count the decoder really has.

    T5/mT5 configs count encoder layers in num_hidden_layers (num_layers) and keep the decoder's in
    num_decoder_layers; a cache built from the top config (as generate() builds it) has too few
    layers when they differ (measured: mT5 with num_layers=2, num_decoder_layers=8: IndexError in
    cache.update). The model's own forward sizes its cache from the decoder stack's config."""
    import copy

    cfg = subject.config
    cfg = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    layers = decoder_layer_count(subject)
    if layers is not None and getattr(cfg, "num_hidden_layers", layers) != layers:
        cfg = copy.deepcopy(cfg)
        cfg.num_hidden_layers = layers
    return cfg


def decoder_layer_count(subject: Subject) -> int | None:
    """Blocks in the decoder stack of an encoder-decoder (None: not one, or not found)."""
    if subject.kind != "seq2seq" or not hasattr(subject.model, "get_decoder"):
        return None
    decoder = subject.model.get_decoder()
    for attr in ("layers", "block", "layer", "h"):
        blocks = getattr(decoder, attr, None)
        if isinstance(blocks, torch.nn.ModuleList):
            return len(blocks)
    return None


def cache_layer_note(subject: Subject) -> str:
    """Why posdiag sized the cache itself, where the config's layer count is not the decoder's."""
    cfg = subject.config
    top = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    layers = decoder_layer_count(subject)
    declared = getattr(top, "num_hidden_layers", None)
    if layers is None or declared is None or declared == layers:
        return ""
    return (f"the config's num_hidden_layers={declared} is not the decoder's {layers} layers: a cache sized from it "
            "(generate()'s default) crashes, so posdiag sizes the cache for the decoder")


def new_cache(subject: Subject, kind: str, max_len: int, encoder_len: int = 0) -> Any:
    """The cache generate() builds: DynamicCache(config) or StaticCache(config, max_cache_len);
    encoder-decoders wrap it with a cross-attention cache (EncoderDecoderCache)."""
    from transformers import DynamicCache, EncoderDecoderCache, StaticCache

    cfg = text_config(subject)
    if kind == "dynamic":
        cache = DynamicCache(config=cfg)
        cross = DynamicCache(config=cfg) if subject.kind == "seq2seq" else None
    else:
        cache = StaticCache(config=cfg, max_cache_len=max_len)
        cross = StaticCache(config=cfg, max_cache_len=encoder_len) if subject.kind == "seq2seq" else None
    return EncoderDecoderCache(cache, cross) if cross is not None else cache


def static_cache_refusal(subject: Subject) -> str:
    """Why transformers cannot build a StaticCache for this model ("" when it can). generate(cache_implementation=
    "static") builds the same StaticCache(config) first, so a config it refuses (DeepSeek-V4: no static layer for
    its compressed-attention layer types, KeyError) is a path users cannot run, not a crash to judge."""
    return cache_refusal(subject, "static")


def cache_refusal(subject: Subject, kind: str) -> str:
    """Why transformers cannot build this kind of cache ("dynamic", "static") from the config ("" when it can).
    BLT's config has no num_hidden_layers at its top level, so DynamicCache(config) raises AttributeError: its own
    forward builds that cache whenever use_cache is set, so generate() crashes too (judged by `generate`)."""
    try:
        new_cache(subject, kind, max_len=8, encoder_len=8)
    except Exception as exc:
        return f"transformers cannot build a {kind.capitalize()}Cache for this config ({describe_error(exc)})"
    return ""


def final_state(out: Any, new: int) -> torch.Tensor | None:
    """The final hidden state of the last `new` positions of a forward ([B, new, ...]); None when the output carries
    none per token. Everything after it (a final norm, the LM head, logit softcapping) is the same function at every
    position, so two paths that agree here agree in their logits, and a difference here shows there too; comparing it
    spares a [T, vocab] head output per forward. Streams stacked per token ([streams, B, T, D]: Gemma 3n's AltUp)
    become [B, T, streams * D]."""
    hidden = getattr(out, "decoder_hidden_states", None) or getattr(out, "hidden_states", None)
    if not hidden:
        return None
    rows, h = output_of(out).shape[0], hidden[-1]
    while isinstance(h, (tuple, list)):
        h = h[0]
    if not isinstance(h, torch.Tensor):
        return None
    if h.ndim == 4 and h.shape[1] == rows:
        h = h.permute(1, 2, 0, 3).reshape(rows, h.shape[2], -1)
    return h[:, -new:] if h.ndim >= 3 and h.shape[0] == rows and h.shape[1] >= new else None


def output_of(out: Any) -> torch.Tensor:
    """Logits where the model has a head, else the final hidden state: [B, T, *]."""
    logits = getattr(out, "logits", None)
    if logits is not None:
        return logits
    return out.last_hidden_state


# ------------------------------------------------------------------ float64 arbitration
@dataclass
class Arbitration:
    """What a float64 re-run decided: new verdicts for the comparisons it re-judged, their figures, and the
    clause each summary carries ("1.7e-06 in float32, 3e-16 in float64: rounding")."""

    verdicts: dict[str, FloorVerdict] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)

    def clause(self, name: str) -> str:
        verdict = self.verdicts.get(name)
        return f" ({verdict.reason})" if verdict is not None else ""


def arbitrate(subject: Subject, measure: Callable[..., T], measured_floor: float, verdicts: dict[str, FloorVerdict],
              dtype: str, figures: Callable[[T], tuple[float, dict[str, float]]], *,
              subset: bool = False) -> Arbitration:
    """Decide, don't shrug: comparisons that are above their tolerance, or judged against a degenerate floor,
    are measured again with `measure` re-run in float64 (the model converted module by module) and decided
    there: rounding shrinks by ~1e9, a bug does not. `figures(measurement) -> (floor, {name: error})`.
    With `subset`, `measure(names)` re-runs only the named comparisons (those that passed need no deciding).

    When no float64 run is possible the run-dtype verdict stands where its floor was a measurement; against a
    degenerate floor it becomes a WARN that names the float64 re-run that could not be made."""
    pending = {name: v for name, v in verdicts.items() if needs_arbitration(v, measured_floor, dtype)}
    if not pending:
        return Arbitration()
    # Padding rows fully masked in float64 turn NaN and spread through 0-weight attention; the guard zeroes them
    # (a NaN in the run dtype is decided before this: judge_arbitrated never calls it rounding).
    finer = run_finer(subject, (lambda: measure(set(pending))) if subset else measure, what="re-run")
    release_freed_memory()
    if finer.value is None:
        details = {"arbitration": {"ran": False, "reason": finer.reason}}
        if not degenerate_floor(measured_floor, dtype):
            return Arbitration(details=details)
        why = f"the float64 re-run that decides could not run: {finer.reason}"
        return Arbitration({name: FloorVerdict(Status.WARN, v.residual, v.noise_floor, v.ratio,
                                               f"inconclusive: {v.reason} against a degenerate floor; {why}")
                            for name, v in pending.items()}, details=details)
    floor64, errors64 = figures(finer.value)
    finer_name = dtype_name(finer.dtype)
    # A finer run that is non-finite where the run dtype was finite did not compute the same thing (fully masked
    # rows in float64): it cannot decide, and the run-dtype verdict stands.
    unfaithful = sorted(n for n, v in pending.items() if errors64.get(n, 0.0) != errors64.get(n, 0.0)
                        and v.residual == v.residual)
    decided = {name: judge_arbitrated(v.residual, measured_floor, dtype, errors64[name], floor64, finer_name)
               for name, v in pending.items() if name in errors64 and name not in unfaithful}
    worst = max(decided, key=lambda n: errors64[n]) if decided else None
    metrics = {} if worst is None else {f"error_{finer_name}": errors64[worst],
                                        f"noise_floor_{finer_name}": noise_floor(floor64, finer_name)}
    details = {"arbitration": {"ran": True, "dtype": finer_name, "how": finer.how, "floor": floor64,
                               "errors": {name: errors64[name] for name in decided},
                               "decided": {name: v.reason for name, v in decided.items()},
                               **({"non_finite_in_finer_run": unfaithful} if unfaithful else {})}}
    return Arbitration(decided, metrics, details)


def worst_error(errors: Iterable[float]) -> float:
    """The largest error, NaN if any is NaN (max() would skip it depending on order), 0.0 for none."""
    worst = 0.0
    for e in errors:
        if e != e:
            return float("nan")
        worst = max(worst, e)
    return worst


def generate_guarded(model: torch.nn.Module, call: Callable[..., Any], *args: Any) -> tuple[Any, str, str]:
    """``call(*args)`` (a generate() call) as (result, crashed, refused): an exception is a crash on a path
    transformers accepts, unless transformers' generation code refused the request with a ValueError before the
    model's own forward ran (a configuration error such as no decoder_start_token_id: not judged)."""
    ran: list[int] = []
    hook = model.register_forward_pre_hook(lambda *_: ran.append(1))
    try:
        return call(*args), "", ""
    except Exception as exc:  # a path transformers accepts that crashes: users hit it
        refused = refused_by_generation(exc) and not ran
        return None, "" if refused else describe_error(exc), describe_error(exc) if refused else ""
    finally:
        hook.remove()
