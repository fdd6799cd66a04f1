"""The model adapter: load once, then forward with explicit tokens, attention pattern and positions.

Checks talk to a `Subject` only. They describe an attention pattern by the *order* of the
tokens (the logical index of each token in the sequence: arange normally, the permutation
for a shuffled input) and validity (padding); the subject turns that into whatever form the
family honours (an additive 4D mask, a dict per layer type, a window written in) using the
quirk row in `posdiag.families`.

Forward protocol for `module.path:factory` models (bring-up of models not in transformers):
the factory takes no arguments and returns an `nn.Module` whose forward accepts
`input_ids` [B, T] (long), `attention_mask` (an additive float mask [B, 1, T, T]: 0 where a
query may see a key, a large negative number where not; or None for the default pattern)
and `position_ids` [B, T] (long) as keyword arguments, and returns either a tensor
[B, T, D] or an object with `hidden_states` (a tuple of [B, T, D], embeddings first) and/or
`last_hidden_state` / `logits`. Set `model.posdiag_kind = "encoder"` for a bidirectional model
(default "causal") and `model.posdiag_position_kind` to say what it uses.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import shutil
import sys
import tempfile
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from posdiag.errors import PosdiagError
from posdiag.families import Family, family_for
from posdiag.results import ModelInfo
from posdiag.tensors import additive_mask

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class LoadOptions:
    """How to load MODEL. Mirrors the command-line options one to one."""

    revision: str | None = None
    trust_remote_code: bool = False
    dtype: str = "auto"  # auto = the checkpoint's dtype
    device: str = "auto"
    device_map: str | None = None
    max_memory: str | None = None  # accelerate's budget per device, "0=70GiB,cpu=200GiB" (with device_map)
    offload_folder: str | None = None  # disk-offloaded weights (with device_map); None = a temporary folder
    attn_implementation: str = "eager"  # custom masks need eager; kernels compares the rest
    upcast: bool = True  # run equivariance checks in float32 when the model is half precision
    allow_pickle: bool = False  # never unpickle .bin checkpoints unless asked
    max_batch: int | None = None  # rows per forward; None = all rows a check needs in one call


@dataclass(frozen=True)
class LoadInfo:
    """What the checkpoint provided, for the `load` check."""

    checkpoint_keys: tuple[str, ...] | None  # None: no checkpoint files (factory / in-memory)
    missing_keys: tuple[str, ...] = ()
    unexpected_keys: tuple[str, ...] = ()
    mismatched_keys: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    source: str = ""


@dataclass
class Outputs:
    """hidden: embeddings output then each block's output, each [B, T, D]; logits may be None."""

    hidden: list[torch.Tensor]
    logits: torch.Tensor | None = None

    @property
    def final(self) -> torch.Tensor:
        return self.hidden[-1]


@dataclass
class Subject:
    model: torch.nn.Module
    config: Any
    family: Family
    spec: str
    kind: str
    position_kind: str
    dtype: torch.dtype
    load_dtype: torch.dtype
    device: torch.device
    load_info: LoadInfo
    options: LoadOptions = field(default_factory=LoadOptions)
    forward_count: int = 0
    batch_limit: int | None = None  # lowered after an out-of-memory fallback
    is_hf: bool = True
    notes: list[str] = field(default_factory=list)
    cleanup: list[Any] = field(default_factory=list, repr=False)  # weakref.finalize: temporary offload folders

    def close(self) -> None:
        """Release what loading created outside the model (the temporary offload folder).
        The model may read offloaded weights from there, so call this only when done with it."""
        for finalizer in self.cleanup:
            finalizer()

    # ---------------------------------------------------------------- description
    @property
    def info(self) -> ModelInfo:
        return ModelInfo(
            id=self.spec,
            family=self.family.name,
            kind=self.kind,
            position_kind=self.position_kind,
            dtype=_dtype_name(self.load_dtype),
            device=str(self.device),
            check_dtype=_dtype_name(self.dtype),
            source=self.load_info.source,
            notes=tuple(self.notes),
        )

    @property
    def dtype_name(self) -> str:
        return _dtype_name(self.dtype)

    @property
    def stacks(self) -> tuple[str, ...]:
        return ("encoder", "decoder") if self.kind == "seq2seq" else (("encoder",) if self.kind == "encoder" else ("decoder",))

    @property
    def vocab_size(self) -> int:
        size = getattr(self.config, "vocab_size", None)
        if size is None:
            emb = self.model.get_input_embeddings() if hasattr(self.model, "get_input_embeddings") else None
            size = emb.num_embeddings if emb is not None else None
        if not size:
            raise PosdiagError("cannot tell the vocabulary size: set config.vocab_size or expose get_input_embeddings()")
        return int(size)

    @property
    def max_positions(self) -> int | None:
        """The declared context in tokens, where the config states one.

        RoBERTa-style tables count their offset rows in max_position_embeddings (514 rows for
        512 tokens, ids starting at padding_idx + 1): the usable context is rows - offset
        (measured: id 130 out of range in a 130-row table at 129 logical positions).
        """
        # max_seq_len: MPT builds its ALiBi bias for exactly that many keys; a longer probe crashes
        # (measured: RuntimeError, size 320 vs 128, in the shift check's prefix rows).
        for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "max_seq_len"):
            value = getattr(self.config, attr, None)
            if isinstance(value, int) and value > 0:
                return value - self.family.explicit_position_offset
        return None

    @property
    def sliding_window(self) -> int | None:
        window = getattr(self.config, "sliding_window", None) or getattr(self.config, "window_size", None)
        if window and (getattr(self.config, "use_sliding_window", True) is not False):
            return int(window)
        return None

    def layer_types(self) -> list[str]:
        types = getattr(self.config, "layer_types", None)
        return list(types) if types else ["full_attention"]

    # ---------------------------------------------------------------- inputs
    def special_ids(self) -> set[int]:
        ids: set[int] = set()
        for obj in (self.config, getattr(self.config, "text_config", None)):
            if obj is None:
                continue
            for name in dir(obj):
                if name.endswith("_token_id") and not name.startswith("_"):
                    value = getattr(obj, name, None)
                    if isinstance(value, int):
                        ids.add(value)
                    elif isinstance(value, (list, tuple)):
                        ids.update(v for v in value if isinstance(v, int))
        return ids

    def sample_ids(self, batch: int, seq_len: int, seed: int) -> torch.Tensor:
        """Random token ids [batch, seq_len], distinct within a row where the vocabulary allows.

        Special and padding ids are excluded (and the first few ids, which tokenizers reserve):
        a padding id can be masked or position-shifted by the model itself (RoBERTa, OPT).
        """
        vocab = self.vocab_size
        reserved = self.special_ids() | set(range(min(4, vocab)))
        allowed = torch.tensor([i for i in range(vocab) if i not in reserved], dtype=torch.long)
        if allowed.numel() < 2:
            raise PosdiagError(f"vocabulary of {vocab} ids leaves no ordinary tokens to probe with")
        gen = torch.Generator().manual_seed(seed)
        rows = []
        for _ in range(batch):
            if allowed.numel() >= seq_len:
                pick = torch.randperm(allowed.numel(), generator=gen)[:seq_len]
            else:
                pick = torch.randint(0, allowed.numel(), (seq_len,), generator=gen)
            rows.append(allowed[pick])
        return torch.stack(rows).to(self.device)

    # ---------------------------------------------------------------- attention patterns
    @property
    def explicit_mask_supported(self) -> tuple[bool, str]:
        if self.family.mask_form == "none":
            return False, self.family.mask_note or f"{self.family.name} cannot take an explicit attention mask"
        return True, ""

    def windowed_layers(self) -> str:
        """Which layers attend through a sliding window: "none", "some" or "all"."""
        if self.sliding_window is None:
            return "none"
        types = getattr(self.config, "layer_types", None) or getattr(self.config, "attention_layers", None)
        if types:  # layer_types: full/sliding_attention; GPT-Neo attention_layers: global/local
            windowed = [t in ("sliding_attention", "local") for t in types]
            return "all" if all(windowed) else ("some" if any(windowed) else "none")
        return "all"  # Mistral-style: one window for every layer

    def patterns(self, order: torch.Tensor, valid: torch.Tensor | None = None, stack: str = "decoder",
                 edit: Any = None) -> dict[str, torch.Tensor]:
        """Bool attention patterns [B, T, T] by logical token order: {"full": ..., "sliding": ...}.

        Causal stacks: key j visible to query i when order[j] <= order[i] ("sliding" adds
        order[i] - order[j] < window, transformers' convention). Bidirectional stacks: every
        key ("sliding": |order[i] - order[j]| <= window, ModernBERT's local attention).
        Padding keys are never visible; a padded query keeps its own key so its softmax stays
        finite (its output is excluded from every comparison). `edit` (bool[B,T,T] -> same)
        is applied to every variant: the mask-fidelity probes block or open single keys with it.
        """
        order = order.to(self.device)
        oi, oj = order[:, :, None], order[:, None, :]
        causal = stack == "decoder" and self.kind != "encoder"
        full = (oj <= oi) if causal else torch.ones_like(oi == oj)
        out = {"full": full}
        if self.windowed_layers() != "none":
            w = self.sliding_window
            out["sliding"] = full & ((oi - oj) < w) if causal else (oi - oj).abs() <= w
        edit = edit or (lambda a: a)
        return {k: edit(self._with_padding(v, valid)) for k, v in out.items()}

    def _with_padding(self, allowed: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        if valid is None:
            return allowed
        valid = valid.to(self.device).bool()
        eye = torch.eye(allowed.shape[-1], dtype=torch.bool, device=self.device)[None]
        return (allowed & valid[:, None, :]) | (eye & ~valid[:, :, None])

    def mask_argument(self, patterns: dict[str, torch.Tensor]) -> Any:
        """The attention_mask argument for these patterns, in the family's form (None: injected per layer)."""
        form = self.family.mask_form
        if form == "layer_hook":
            return None
        if form == "layer_dict" and "sliding" in patterns:
            return {t: additive_mask(patterns["sliding" if t == "sliding_attention" else "full"][:, None], self.dtype)
                    for t in sorted(set(self.layer_types()) | {"full_attention", "sliding_attention"})}
        # One mask for every layer: the window goes in only when every layer slides (Mistral);
        # per-layer windows are the injector's business (GPT-Neo's buffers).
        uniform_window = "sliding" in patterns and self.windowed_layers() == "all"
        return additive_mask(patterns["sliding" if uniform_window else "full"][:, None], self.dtype)

    @contextlib.contextmanager
    def injected(self, patterns: dict[str, torch.Tensor] | None) -> Iterator[None]:
        """Hand the patterns to families that do not read them from attention_mask (families.py
        says which and why): per-layer hooks or per-row causal buffers, undone on exit."""
        injector = self.family.injector
        if patterns is None or injector is None:
            yield
            return
        undo = injector(self, patterns)
        try:
            yield
        finally:
            undo()

    @contextlib.contextmanager
    def stored_weight(self, name: str) -> Iterator[torch.Tensor]:
        """Parameter or buffer `name` with its values, also when accelerate offloaded it.

        An offloaded weight is a meta tensor in the model: accelerate reads the real one from
        its weights map (CPU copies, or the checkpoint's safetensors for disk) before each
        forward. This installs a private CPU copy in that map and yields it, so in-place edits
        inside the block reach the next forward and nothing is written to disk; the map is
        restored on exit. A weight that is not offloaded is yielded as it is.
        """
        module_name, _, attr = name.rpartition(".")
        module = self.model.get_submodule(module_name)
        tensor = getattr(module, attr)
        if tensor.device.type != "meta":
            yield tensor
            return
        weights = _offload_map(module)
        if weights is None:
            raise RuntimeError(f"{name} is on the meta device and no accelerate hook holds its values")
        base, key = getattr(weights, "dataset", weights), getattr(weights, "prefix", "") + attr
        store = getattr(base, "state_dict", base)  # OffloadedWeightsLoader: its in-memory dict wins over disk
        had, old = key in store, store.get(key)
        copy = weights[attr].detach().to("cpu", copy=True)
        store[key] = copy
        try:
            yield copy
        finally:
            if had:
                store[key] = old
            else:
                del store[key]

    def position_ids_for(self, logical: torch.Tensor) -> torch.Tensor:
        """Logical positions (0-based) -> the ids the model expects (RoBERTa starts at pad+1)."""
        return logical + self.family.explicit_position_offset

    # ---------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        mask: Any = None,
        position_ids: torch.Tensor | None = None,
        stack: str = "decoder",
        encoder_ids: torch.Tensor | None = None,
        want_logits: bool = False,
    ) -> Outputs:
        """One forward pass, split into chunks of at most `max_batch` rows.

        stack: for encoder-decoders, "encoder" runs the encoder alone on input_ids; "decoder"
        runs the whole model with `encoder_ids` fixed (default: the input ids themselves) and
        input_ids as decoder inputs, `mask` going to decoder_attention_mask.
        """
        rows = input_ids.shape[0]
        step = min(self.options.max_batch or rows, self.batch_limit or rows)
        parts = []
        start = 0
        while start < rows:
            sl = slice(start, start + step)
            try:
                parts.append(self._forward_once(
                    input_ids[sl],
                    mask=_slice_mask(mask, sl),
                    position_ids=None if position_ids is None else position_ids[sl],
                    stack=stack,
                    encoder_ids=None if encoder_ids is None else encoder_ids[sl],
                    want_logits=want_logits,
                ))
            except (torch.OutOfMemoryError, RuntimeError) as exc:
                if step == 1 or not _is_oom(exc):
                    raise
                step = max(1, step // 2)  # fall back to smaller batches, and remember it for later checks
                self.batch_limit = step
                note = f"out of memory: forward passes fall back to batches of {step}"
                if note not in self.notes:
                    self.notes.append(note)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                continue
            start += step
        if len(parts) == 1:
            return parts[0]
        hidden = [torch.cat([p.hidden[i] for p in parts]) for i in range(len(parts[0].hidden))]
        logits = None if parts[0].logits is None else torch.cat([p.logits for p in parts])
        return Outputs(hidden, logits)

    @property
    def _takes_logits_to_keep(self) -> bool:
        import inspect

        return "logits_to_keep" in inspect.signature(self.model.forward).parameters

    def _forward_once(self, input_ids, *, mask, position_ids, stack, encoder_ids, want_logits) -> Outputs:
        self.forward_count += 1
        kwargs: dict[str, Any] = {}
        if position_ids is not None:
            kwargs["position_ids"] = position_ids.to(self.device)
        with torch.inference_mode():
            if not self.is_hf:
                out = self.model(input_ids=input_ids, attention_mask=mask, **kwargs)
                return _outputs_from_custom(out)
            # Without logits, ask for the last position's only: the LM head's [B, T, vocab] output
            # is often the largest activation of a batched probe (147 MB for 9 x 128 tokens of a
            # 32k vocab). The full model still runs (a bug can live in the head class's forward).

            if not want_logits and self._takes_logits_to_keep:
                kwargs["logits_to_keep"] = 1
            if self.kind == "seq2seq":
                if stack == "encoder":
                    out = self.model.get_encoder()(input_ids=input_ids, attention_mask=mask,
                                                   output_hidden_states=True, return_dict=True)
                    return self._gathered(out.hidden_states or (out.last_hidden_state,), None)
                enc = input_ids if encoder_ids is None else encoder_ids
                out = self.model(input_ids=enc, decoder_input_ids=input_ids, decoder_attention_mask=mask,
                                 output_hidden_states=True, use_cache=False, return_dict=True,
                                 **{k: v for k, v in kwargs.items() if k == "logits_to_keep"})
                return self._gathered(out.decoder_hidden_states, getattr(out, "logits", None) if want_logits else None)
            out = self.model(input_ids=input_ids, attention_mask=mask, output_hidden_states=True,
                             use_cache=False, return_dict=True, **kwargs)
            hidden = out.hidden_states if out.hidden_states is not None else (out.last_hidden_state,)
            return self._gathered(hidden, getattr(out, "logits", None) if want_logits else None)

    def _gathered(self, hidden: Any, logits: torch.Tensor | None) -> Outputs:
        """Outputs on the input device: under a --device-map each block returns on its own GPU,
        and the checks compare blocks with each other (no-op when everything is on one device)."""
        return Outputs([h.to(self.device) for h in hidden], None if logits is None else logits.to(self.device))


def _is_oom(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text or "not enough memory" in text


def _slice_mask(mask: Any, sl: slice) -> Any:
    if mask is None:
        return None
    if isinstance(mask, dict):
        return {k: v[sl] for k, v in mask.items()}
    return mask[sl]


def _outputs_from_custom(out: Any) -> Outputs:
    if isinstance(out, torch.Tensor):
        return Outputs([out])
    hidden = getattr(out, "hidden_states", None)
    if hidden:
        return Outputs(list(hidden), getattr(out, "logits", None))
    for attr in ("last_hidden_state", "logits"):
        value = getattr(out, attr, None)
        if value is not None:
            return Outputs([value], getattr(out, "logits", None))
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return Outputs([out[0]])
    raise PosdiagError("the factory model returned neither a tensor nor hidden_states/last_hidden_state/logits")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# =====================================================================================
# Loading
# =====================================================================================

def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise PosdiagError(f"--device {name}: CUDA is not available on this machine (use --device cpu)")
    if name == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise PosdiagError("--device mps: MPS is not available on this machine (use --device cpu)")
    return torch.device(name)


def from_module(model: torch.nn.Module, *, name: str = "in-memory model", options: LoadOptions | None = None) -> Subject:
    """Wrap an already-built model (unit tests, the Python API): nothing is loaded or written."""
    options = options or LoadOptions()
    config = getattr(model, "config", None)
    is_hf = config is not None and hasattr(config, "model_type") and hasattr(model, "get_input_embeddings")
    param = next(iter(model.parameters()), None)
    load_dtype = param.dtype if param is not None else torch.float32
    device = input_device(model)
    if is_hf:
        family = family_for(config)
        _check_attn_implementation(model, options)
    else:
        config = _CustomConfig(model)
        family = Family(name="custom", kind=getattr(model, "posdiag_kind", "causal"),
                        position_kind=getattr(model, "posdiag_position_kind", "none found"))
    subject = Subject(
        model=model.eval(), config=config, family=family, spec=name, kind=family.kind,
        position_kind=family.position_kind if family.position_kind != "none found" else detect_position_kind(model),
        dtype=load_dtype, load_dtype=load_dtype, device=device,
        load_info=LoadInfo(checkpoint_keys=None, source="in-memory module"),
        options=options, is_hf=is_hf,
    )
    _maybe_upcast(subject)
    return subject


class _CustomConfig:
    """Stand-in config for factory models: reads what it can off the module."""

    model_type = "custom"

    def __init__(self, model: torch.nn.Module):
        cfg = getattr(model, "posdiag_config", None) or {}
        for k, v in dict(cfg).items():
            setattr(self, k, v)
        if not hasattr(self, "vocab_size"):
            emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
            if emb is None:
                emb = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
            if emb is not None:
                self.vocab_size = emb.num_embeddings


def _check_attn_implementation(model: torch.nn.Module, options: LoadOptions) -> None:
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in (None, "eager") and options.attn_implementation == "eager":
        # Explicit-mask checks are only faithful under eager attention (see DESIGN pitfalls).
        try:
            model.set_attn_implementation("eager")
        except Exception as exc:  # pragma: no cover - depends on the family
            raise PosdiagError(f"cannot switch the model to eager attention: {exc}") from None


def detect_position_kind(model: torch.nn.Module) -> str:
    """Best effort for families not in the table: look at module and parameter names."""
    names = [n for n, _ in model.named_modules()]
    buffers = [n for n, _ in model.named_buffers()]
    params = [n for n, _ in model.named_parameters()]
    if any("rotary" in n.lower() or n.endswith("inv_freq") for n in names + buffers):
        return "rope"
    if any("alibi" in n.lower() for n in names + buffers):
        return "alibi"
    if any("relative_attention_bias" in n for n in params):
        return "relative_bias"
    if any(k in n for n in params for k in ("position_embeddings", "wpe", "embed_positions", "pos_emb")):
        return "learned"
    return "none found"


def load_subject(spec: str, options: LoadOptions | None = None) -> Subject:
    """MODEL -> Subject. Every failure becomes a PosdiagError with one line of advice."""
    options = options or LoadOptions()
    if not options.device_map:
        for given, flag in ((options.max_memory, "--max-memory"), (options.offload_folder, "--offload-folder")):
            if given:
                raise PosdiagError(f"{flag} only applies with --device-map (e.g. --device-map auto)")
    elif options.max_memory:
        parse_max_memory(options.max_memory)  # a malformed budget fails before anything is read
    if _looks_like_factory(spec):
        return _load_factory(spec, options)
    return _load_pretrained(spec, options)


def _looks_like_factory(spec: str) -> bool:
    if ":" not in spec or os.path.exists(spec):
        return False
    module, _, attr = spec.rpartition(":")
    return bool(module) and attr.isidentifier() and all(p.isidentifier() for p in module.split("."))


def _load_factory(spec: str, options: LoadOptions) -> Subject:
    if options.device_map:
        raise PosdiagError("--device-map needs a checkpoint to place: a module:factory model is built in memory "
                           "(dispatch it with accelerate inside the factory instead)")
    module_name, _, attr = spec.rpartition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise PosdiagError(f"cannot import factory module '{module_name}': {_one_line(exc)}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise PosdiagError(f"'{attr}' in module '{module_name}' is not a callable factory")
    try:
        model = factory()
    except Exception as exc:
        raise PosdiagError(f"factory '{spec}' raised {type(exc).__name__}: {_one_line(exc)}") from None
    if not isinstance(model, torch.nn.Module):
        raise PosdiagError(f"factory '{spec}' returned {type(model).__name__}, not a torch.nn.Module")
    device = resolve_device(options.device)
    dtype = None if options.dtype == "auto" else DTYPES[options.dtype]
    model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    subject = from_module(model, name=spec, options=options)
    subject.load_info = LoadInfo(checkpoint_keys=None, source=f"factory {spec}")
    return subject


def _load_pretrained(spec: str, options: LoadOptions) -> Subject:
    from transformers import AutoConfig

    local = Path(spec)
    is_local = local.exists()
    if is_local:
        if not local.is_dir():
            raise PosdiagError(f"'{spec}' is a file; MODEL is a checkpoint directory, a hub id, or module:factory")
        if not (local / "config.json").is_file():
            raise PosdiagError(f"'{spec}' has no config.json: not a transformers checkpoint directory")
    elif spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise PosdiagError(f"'{spec}' does not exist")

    try:
        config = AutoConfig.from_pretrained(spec, revision=options.revision, trust_remote_code=options.trust_remote_code)
    except Exception as exc:
        raise PosdiagError(_explain_config_error(spec, exc, options, is_local)) from None

    family = family_for(config)
    auto_cls = _auto_class(config, family)
    weights = _weight_files(spec, options, is_local)
    if weights["source"] == "pickle" and not options.allow_pickle:
        raise PosdiagError(
            f"'{spec}' ships only pickle weights (.bin); unpickling can run code. Convert to safetensors or pass --allow-pickle"
        )

    device = resolve_device(options.device) if not options.device_map else None
    dtype: Any = "auto" if options.dtype == "auto" else DTYPES[options.dtype]
    stored = DTYPES[options.dtype] if options.dtype != "auto" else _checkpoint_dtype(config, weights)
    upcast_at_load = bool(options.device_map) and options.upcast and stored in (torch.float16, torch.bfloat16)
    if upcast_at_load:
        # A dispatched model cannot be re-cast in place (its offloaded weights are re-read from
        # disk in the stored dtype), so ask for float32 up front: accelerate then plans the map
        # for the float32 size and converts each offloaded tensor as it reads it.
        dtype = torch.float32
    kwargs: dict[str, Any] = dict(
        revision=options.revision,
        trust_remote_code=options.trust_remote_code,
        dtype=dtype,
        attn_implementation=options.attn_implementation,
        output_loading_info=True,
        use_safetensors=weights["source"] != "pickle",
    )
    temporary: list[str] = []  # folders posdiag created for this run
    if options.device_map:
        kwargs.update(_device_map_kwargs(spec, options, weights, temporary))
    # Parameters missing from the checkpoint are re-initialised randomly: seed it so the same
    # checkpoint gives the same report every time (the `load` check names what was missing).
    torch.manual_seed(0)
    notes: list[str] = []
    try:
        with warnings.catch_warnings():
            # transformers' own maps name single tensors (BART's final_logits_bias); accelerate warns, harmlessly.
            warnings.filterwarnings("ignore", message="The following device_map keys do not match any submodules")
            model, loading_info = auto_cls.from_pretrained(spec, **kwargs)
            lost = _unreadable_offloaded(model) if options.device_map else []
            if lost:
                # transformers reads disk-offloaded weights from the checkpoint files in place, so a
                # weight the checkpoint lacks (Marian's sinusoid table, built at init) has no values
                # there: KeyError at the first forward. Load again with its module kept in memory.
                kwargs["device_map"] = _kept_in_memory(model.hf_device_map, model, lost)
                del model
                torch.manual_seed(0)
                model, loading_info = auto_cls.from_pretrained(spec, **kwargs)
                notes.append(f"kept in memory, not on disk: {', '.join(lost[:3])}{' …' if len(lost) > 3 else ''} "
                             "(not in the checkpoint, so transformers has nothing to read from disk)")
    except Exception as exc:
        for folder in temporary:
            shutil.rmtree(folder, ignore_errors=True)
        raise PosdiagError(f"cannot load weights of '{spec}': {_one_line(exc)}") from None
    if device is not None:
        model = model.to(device)
    model.eval()

    param = next(iter(model.parameters()))  # its dtype; its device may be "meta" when offloaded
    info = LoadInfo(
        checkpoint_keys=weights["keys"],
        missing_keys=tuple(loading_info.get("missing_keys", ()) or ()),
        unexpected_keys=tuple(loading_info.get("unexpected_keys", ()) or ()),
        mismatched_keys=tuple(str(k[0]) if isinstance(k, tuple) else str(k) for k in (loading_info.get("mismatched_keys", ()) or ())),
        files=tuple(weights["files"]),
        source=weights["source"],
    )
    subject = Subject(
        model=model, config=model.config, family=family, spec=spec, kind=family.kind,
        position_kind=family.position_kind if family.position_kind != "none found" else detect_position_kind(model),
        dtype=param.dtype, load_dtype=stored if upcast_at_load else param.dtype, device=input_device(model),
        load_info=info, options=options,
    )
    # Removed by Subject.close(), else when the model is collected, else at interpreter exit.
    subject.cleanup = [weakref.finalize(model, shutil.rmtree, folder, True) for folder in temporary]
    if options.device_map:
        subject.notes += [_placement_note(model, options)] + notes
    if upcast_at_load:
        name = _dtype_name(stored)
        subject.notes.append(f"loaded in float32 from {name} weights (--device-map: the map was planned for the "
                             f"float32 size, twice {name}'s; --no-upcast keeps {name})")
    _maybe_upcast(subject)
    return subject


def _maybe_upcast(subject: Subject) -> None:
    """Equivariance is a property of the function: test it in float32 when memory allows."""
    if not subject.options.upcast or subject.dtype not in (torch.float16, torch.bfloat16):
        return
    if is_dispatched(subject.model):
        subject.notes.append("kept in half precision: a model dispatched by accelerate cannot be re-cast in place "
                             "(--dtype float32 loads it in float32)")
        return
    if subject.device.type == "cuda":
        need = sum(p.numel() for p in subject.model.parameters()) * 2  # the extra bytes of fp32
        free, _ = torch.cuda.mem_get_info(subject.device)
        if need > 0.8 * free:
            subject.notes.append("kept in half precision: not enough free GPU memory to upcast")
            return
    subject.model.to(torch.float32)
    subject.dtype = torch.float32
    subject.notes.append(f"upcast from {_dtype_name(subject.load_dtype)} to float32 for the checks (--no-upcast keeps it)")


def is_dispatched(model: torch.nn.Module) -> bool:
    """accelerate placed the model on several devices or on disk (hooks move weights and inputs)."""
    placement = set(map(str, (getattr(model, "hf_device_map", None) or {}).values()))
    return len(placement) > 1 or "disk" in placement


def input_device(model: torch.nn.Module) -> torch.device:
    """Where inputs go. A dispatched model runs offloaded (cpu/disk) blocks on its first
    accelerator (accelerate's main device), else on the CPU; otherwise: its first parameter's."""
    if is_dispatched(model):
        placed = [d for d in model.hf_device_map.values() if str(d) not in ("cpu", "disk")]
        if not placed:
            return torch.device("cpu")
        main = placed[0]
        return torch.device("cuda", main) if isinstance(main, int) else torch.device(main)
    param = next(iter(model.parameters()), None)
    return param.device if param is not None else torch.device("cpu")


_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*(b|kb|mb|gb|tb|kib|mib|gib|tib)?$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_max_memory(text: str) -> dict[int | str, int]:
    """'0=70GiB,cpu=200GiB' -> {0: 75161927680, 'cpu': 214748364800}: accelerate's max_memory
    (GPU index or cpu/mps/disk -> bytes). Sizes take B, KB/MB/GB/TB or KiB/MiB/GiB/TiB."""
    usage = f"--max-memory '{text}': expected DEVICE=SIZE pairs separated by commas, e.g. 0=70GiB,cpu=200GiB"
    budget: dict[int | str, int] = {}
    for item in text.split(","):
        key, sep, size = (part.strip() for part in item.partition("="))
        if not sep or not key or not size:
            raise PosdiagError(usage)
        key = key.lower().removeprefix("cuda:")
        if key.isdigit():
            device: int | str = int(key)
        elif key in ("cpu", "mps", "disk"):
            device = key
        else:
            raise PosdiagError(f"--max-memory: unknown device '{key}' (a GPU index such as 0, or cpu, mps, disk)")
        match = _SIZE.match(size)
        if match is None:
            raise PosdiagError(f"--max-memory: size '{size}' for {key} is not a size such as 2GiB, 500MB or 1048576")
        if device in budget:
            raise PosdiagError(f"--max-memory: {key} is given twice")
        budget[device] = int(float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()])
    return budget


def _device_map_kwargs(spec: str, options: LoadOptions, weights: dict[str, Any], temporary: list[str]) -> dict[str, Any]:
    """from_pretrained's device_map / max_memory / offload_folder. Always an offload folder:
    transformers re-saves there what it cannot read from the checkpoint's safetensors in place
    (pickle weights, converted MoE experts) and fails without one. It is never inside the
    checkpoint (posdiag never writes there); the default is temporary and removed after the run."""
    kwargs: dict[str, Any] = {"device_map": options.device_map}
    if options.max_memory:
        budget = parse_max_memory(options.max_memory)
        gpus = torch.cuda.device_count()
        for device in budget:
            if isinstance(device, int) and device >= gpus:
                raise PosdiagError(f"--max-memory: GPU {device} is not on this machine ({gpus} CUDA device(s))")
        kwargs["max_memory"] = budget
    if options.offload_folder:
        folder = Path(options.offload_folder).expanduser().resolve()
        for root in _checkpoint_dirs(spec, weights):
            if folder == root or root in folder.parents:
                raise PosdiagError(f"--offload-folder {options.offload_folder} is inside the checkpoint directory {root}: "
                                   "posdiag never writes into the checkpoint; choose a folder elsewhere")
        if folder.exists() and not folder.is_dir():
            raise PosdiagError(f"--offload-folder {options.offload_folder} is a file, not a folder")
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise PosdiagError(f"--offload-folder {options.offload_folder}: cannot create it ({exc.strerror})") from None
    else:
        folder = Path(tempfile.mkdtemp(prefix="posdiag-offload-"))
        temporary.append(str(folder))
    kwargs["offload_folder"] = str(folder)
    return kwargs


def _checkpoint_dirs(spec: str, weights: dict[str, Any]) -> set[Path]:
    """Every directory the checkpoint lives in: the local folder, the hub snapshot and its blobs."""
    roots = {Path(spec).resolve()} if Path(spec).is_dir() else set()
    for f in weights["files"]:
        roots |= {Path(f).parent.resolve(), Path(f).resolve().parent}
    return roots


def _offload_map(module: torch.nn.Module) -> Any:
    """accelerate's weights map for a module whose weights it offloaded (None: not offloaded)."""
    hook = getattr(module, "_hf_hook", None)
    maps = [getattr(h, "weights_map", None) for h in getattr(hook, "hooks", (hook,))]
    return next((m for m in maps if m is not None), None)


def _unreadable_offloaded(model: torch.nn.Module) -> list[str]:
    """Offloaded (meta) weights for which accelerate holds no values: neither in memory nor in its
    disk index. Checked by name only: nothing is read from disk."""
    lost = []
    for module_name, module in model.named_modules():
        weights = _offload_map(module)
        if weights is None:
            continue
        base, prefix = getattr(weights, "dataset", weights), getattr(weights, "prefix", "")
        known = set(getattr(base, "state_dict", {})) | set(getattr(base, "index", {})) if hasattr(base, "index") else set(base)
        own = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
        lost += [f"{module_name}.{attr}" if module_name else attr
                 for attr, tensor in own if tensor.device.type == "meta" and prefix + attr not in known]
    return lost


def _kept_in_memory(placement: dict[str, Any], model: torch.nn.Module, names: list[str]) -> dict[str, Any]:
    """`placement` with the modules owning `names` moved from disk to the CPU; coarser entries
    ("" = the whole model) are split into their children and own tensors down to those modules."""
    placement = dict(placement)
    for name in names:
        owner = name.rpartition(".")[0]
        while True:
            covering = [k for k in placement if k == "" or owner == k or owner.startswith(k + ".")]
            entry = max(covering, key=len, default=None)
            if entry is None or placement[entry] != "disk":
                break
            if entry == owner:
                placement[entry] = "cpu"
                break
            module, prefix, device = model.get_submodule(entry), f"{entry}." if entry else "", placement.pop(entry)
            own = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
            for part in [n for n, _ in module.named_children()] + [n for n, _ in own]:
                placement[prefix + part] = device
    return placement


def _placement_note(model: torch.nn.Module, options: LoadOptions) -> str:
    """Where accelerate put the model (hf_device_map: modules, or single tensors), per device."""
    parts: dict[str, list[str]] = {}
    for name, device in (getattr(model, "hf_device_map", None) or {}).items():
        parts.setdefault(f"cuda:{device}" if isinstance(device, int) else str(device), []).append(name or "(whole model)")
    where = "; ".join(f"{device}: {', '.join(names)}" if len(names) <= 4 else
                      f"{device}: {len(names)} parts ({names[0]}, …, {names[-1]})" for device, names in parts.items())
    text = f"--device-map {options.device_map}: {where}"
    if "disk" in parts:
        text += (" (disk parts are read at every forward: from the checkpoint's safetensors, or from the offload "
                 "folder where transformers had to re-save them)")
    return text


def _checkpoint_dtype(config: Any, weights: dict[str, Any]) -> torch.dtype | None:
    """The floating dtype most of the stored tensors have (safetensors headers; else the config's)."""
    if weights.get("dtype") is not None:
        return weights["dtype"]
    declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(declared, str):
        declared = DTYPES.get(declared)
    return declared if isinstance(declared, torch.dtype) else None


def _auto_class(config: Any, family: Family):
    import transformers

    if family.kind == "seq2seq" or getattr(config, "is_encoder_decoder", False):
        return transformers.AutoModelForSeq2SeqLM
    if family.kind == "encoder":
        return transformers.AutoModel
    return transformers.AutoModelForCausalLM


def _weight_files(spec: str, options: LoadOptions, is_local: bool) -> dict[str, Any]:
    """Which weight files the checkpoint has, and the tensor names in its safetensors.

    Reading the keys ourselves is the only way to know a position table was really in the
    checkpoint: transformers re-initialises a missing one and only logs a warning.
    """
    from safetensors import safe_open

    if is_local:
        root = Path(spec)
        files = sorted(root.glob("*.safetensors"))
        pickles = sorted(list(root.glob("*.bin")) + list(root.glob("*.pt")))
    else:
        files, pickles = _hub_weight_files(spec, options)
    if files:
        keys: list[str] = []
        counts: dict[str, int] = {}
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as handle:
                    for key in handle.keys():
                        keys.append(key)
                        stored = handle.get_slice(key).get_dtype()
                        counts[stored] = counts.get(stored, 0) + 1
            except Exception as exc:
                raise PosdiagError(f"unreadable safetensors file {f.name}: {_one_line(exc)} (re-download or re-save it)") from None
        floating = {k: n for k, n in counts.items() if k in _SAFETENSORS_FLOATS}
        dtype = _SAFETENSORS_FLOATS[max(floating, key=floating.get)] if floating else None
        return {"keys": tuple(keys), "files": [str(f) for f in files], "source": "safetensors", "dtype": dtype}
    if pickles:
        return {"keys": None, "files": [str(f) for f in pickles], "source": "pickle"}
    raise PosdiagError(f"'{spec}' has no weight files (*.safetensors or *.bin)")


_SAFETENSORS_FLOATS = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


def _hub_weight_files(spec: str, options: LoadOptions) -> tuple[list[Path], list[Path]]:
    from huggingface_hub import snapshot_download

    try:
        root = Path(snapshot_download(spec, revision=options.revision,
                                      allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as exc:
        raise PosdiagError(f"cannot fetch '{spec}' from the hub: {_one_line(exc)} (check the id, the network, or HF_TOKEN)") from None
    files = sorted(root.glob("*.safetensors"))
    pickles: list[Path] = []
    if not files:
        pickles = [Path("pytorch_model.bin")]  # not downloaded: refused unless --allow-pickle
    return files, pickles


def _explain_config_error(spec: str, exc: Exception, options: LoadOptions, is_local: bool) -> str:
    text = _one_line(exc)
    if "trust_remote_code" in text or "custom code" in text:
        return f"'{spec}' needs its own Python code to load; rerun with --trust-remote-code if you trust it"
    if isinstance(exc, (json.JSONDecodeError, ValueError)) and is_local and "Unrecognized model" not in text:
        return f"'{spec}/config.json' is not a valid config: {text}"
    if "Unrecognized model" in text or "does not recognize this architecture" in text or "model_type" in text:
        return f"'{spec}': unknown model type for this transformers version ({text[:160]})"
    if not is_local:
        return f"cannot fetch '{spec}' from the hub: {text[:200]} (check the id, the network, or HF_TOKEN)"
    return f"cannot read the config of '{spec}': {text[:200]}"


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]
