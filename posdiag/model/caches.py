"""KV caches as generate() builds them, whether a model keeps one, and generate() guarded.

`cache` and `generate` drive the model through transformers' Cache objects the way users do: these helpers say
whether that path exists for a subject, build the cache generate() would build (sized for the decoder stack),
and tell a crash on a path transformers accepts from a request transformers refuses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from posdiag.errors import describe_error, refused_by_generation
from posdiag.model.quiet import transformers_quiet
from posdiag.model.subject import Subject


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
    # `cache` (transformers 5.x) first: the old names are properties that log a deprecation warning when read
    if any(getattr(out, name, None) is not None for name in ("cache", "past_key_values", "cache_params")):
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


def copied_cache(cache: Any) -> Any | None:
    """A deep copy of a cache that shares no tensor storage with it (None where it cannot be copied so: deepcopy
    refuses it, it holds a module deepcopy would duplicate, or a function of its own, which deepcopy keeps as it is
    and which may read the original): a path continuing it never reads or writes the original."""
    import copy
    import types

    held = (torch.nn.Module, types.FunctionType, types.MethodType)
    if any(isinstance(obj, held) for obj in _reachable(cache)):
        return None
    try:
        with torch.inference_mode():
            copied = copy.deepcopy(cache)
    except Exception:  # a cache of its own kind that cannot be copied: the caller runs the shared steps again
        return None
    kept = {obj.untyped_storage().data_ptr() for obj in _reachable(cache) if isinstance(obj, torch.Tensor)}
    if any(isinstance(obj, torch.Tensor) and obj.numel() and obj.untyped_storage().data_ptr() in kept
           for obj in _reachable(copied)):
        return None
    return copied


def held_tensors(model: Any) -> dict[str, tuple[int, tuple[int, ...], float]]:
    """Tensors modules hold as plain attributes (not parameters, not buffers), by name: (storage, shape, sum; inference
    tensors keep no version counter, so an in-place write shows in the sum). A forward
    that changes them keeps call state outside its cache object, so a copy of the cache is not a snapshot of the
    model (RecurrentGemma from transformers 5.25 keeps its convolution state on the modules: a path continuing a
    copied cache read another path's state, 0.03 off)."""
    return {f"{name}.{key}": (value.untyped_storage().data_ptr(), tuple(value.shape), float(value.double().sum()))
            for name, module in model.named_modules() for key, value in vars(module).items()
            if isinstance(value, torch.Tensor) and not key.startswith("_")}


def _reachable(obj: Any, seen: set[int] | None = None, depth: int = 0) -> list[Any]:
    """obj and what it holds through attributes, lists, tuples and dicts (a cache's own state), modules not entered."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 8:
        return []
    seen.add(id(obj))
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module, torch.Tensor)):
        items = list(vars(obj).values())
    else:
        items = []
    return [obj] + [held for item in items for held in _reachable(item, seen, depth + 1)]


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


def generate_guarded(model: torch.nn.Module, call: Callable[..., Any], *args: Any) -> tuple[Any, str, str]:
    """``call(*args)`` (a generate() call) as (result, crashed, refused): an exception is a crash on a path
    transformers accepts, unless transformers' generation code refused the request with a ValueError before the
    model's own forward ran (a configuration error such as no decoder_start_token_id: not judged)."""
    ran: list[int] = []
    hook = model.register_forward_pre_hook(lambda *_: ran.append(1))
    try:
        with transformers_quiet():  # its notices about posdiag's call are not the caller's (model/quiet.py)
            return call(*args), "", ""
    except Exception as exc:  # a path transformers accepts that crashes: users hit it
        refused = refused_by_generation(exc) and not ran
        return None, "" if refused else describe_error(exc), describe_error(exc) if refused else ""
    finally:
        hook.remove()


def compiled_path(subject: Subject, asked: bool, calls: dict[str, int]) -> tuple[str, dict[str, Any]]:
    """Which path was judged, as the summary's note (where it is not the plain one of a CPU run) and details: read
    from the run (`calls`: per run, the model's forward calls that ran compiled, counted by compiled_forwards), not
    from the option, since transformers may keep the forward eager (a model it will not compile, a cache that is not
    compileable) and torch falls back to eager past its recompile limit."""
    ran = {name: n for name, n in calls.items() if n}
    details = {"compiled": bool(ran), "compile_asked": asked, "compiled_calls": ran}
    if ran:
        return (f"; the compiled path judged (torch.compile of the static-cache forward: {sum(ran.values())} "
                "forward calls ran compiled)"), details
    if asked:
        return ("; --compile asked, but no forward call ran compiled (transformers kept it eager): the eager path "
                "judged"), details
    return ("; run without torch.compile (transformers compiles the static-cache forward here by default; --compile "
            "judges that path)" if subject.device.type != "cpu" else ""), details


class CompiledCalls(list):
    """(the model's own call, ran compiled) per forward call of a model and of its modules (compiled_forwards)."""

    @property
    def counts(self) -> tuple[int, int]:
        """(the model's calls, all module calls) that ran compiled."""
        return sum(top and ran for top, ran in self), sum(ran for _, ran in self)


@contextmanager
def compiled_forwards(model: torch.nn.Module) -> Iterator[CompiledCalls]:
    """Each forward call of `model` and of its modules inside the block, and whether it ran compiled. The hooks'
    is_compiling() is traced into the compiled graph as True and their appends replayed on every compiled call,
    while an eager call appends False: what ran, whatever was asked. Modules count too: a compiled forward can still
    run a part eagerly (a graph break whose frame hit torch's recompile limit)."""
    calls = CompiledCalls()
    hooks = [m.register_forward_pre_hook(lambda *_, top=m is model: calls.append((top, torch.compiler.is_compiling())))
             for m in model.modules()]
    try:
        yield calls
    finally:
        for hook in hooks:
            hook.remove()


def compile_kwargs(compiled: bool) -> dict[str, Any]:
    """generate() keywords that fix whether the static-cache forward is compiled, instead of transformers deciding
    (it compiles on CUDA and other accelerators whenever the cache is compileable: 94 s of a 1B model's generate on
    an H200, 22 s without). compiled=False: disable_compile. compiled=True: a CompileConfig that compiles on every
    device, CPU included (torch.compile then needs a C compiler); torch compiles once per shape (the single prompt's
    and the padded batch's caches), not once per prompt."""
    if not compiled:
        return {"disable_compile": True}
    from transformers import CompileConfig

    config = CompileConfig()
    config._compile_all_devices = True  # transformers' own switch for compiling off-accelerator (its docstring)
    return {"compile_config": config}


def takes_cache(model: Any) -> bool:
    """Whether the model's forward names a cache parameter (GPT-1's does not, and generate() refuses a cache passed to
    it even through **kwargs)."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name in ("cache", "past_key_values") for p in params)


def cache_keyword(model: Any) -> str:
    """The keyword the model's forward takes its cache by, read from its signature: `cache` in transformers 5.24+,
    `past_key_values` before (5.17 drops `cache` into **kwargs, so every cached step ran without its past: false
    `cache` FAILs); a class with neither takes `cache` (Dory in 5.25 lost the old name's shim)."""
    import inspect

    try:
        names = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a forward without a readable signature
        return "cache"
    return "past_key_values" if "cache" not in names and "past_key_values" in names else "cache"

