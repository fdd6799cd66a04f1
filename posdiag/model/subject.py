"""The model adapter: load once, then forward with explicit tokens, attention pattern and positions.

Checks talk to a `Subject` only. They describe an attention pattern by the *order* of the
tokens (the logical index of each token in the sequence: arange normally, the permutation
for a shuffled input) and validity (padding); the subject turns that into whatever form the
family honours (an additive 4D mask, a dict per layer type, a window written in) using the
quirk row in `posdiag.model.families`.

Forward protocol for `module.path:factory` models (bring-up of models not in transformers):
the factory takes no arguments and returns an `nn.Module` whose forward accepts
`input_ids` [B, T] (long), `attention_mask` (an additive float mask [B, 1, T, T]: 0 where a
query may see a key, a large negative number where not; or None for the default pattern)
and `position_ids` [B, T] (long) as keyword arguments, and returns either a tensor
[B, T, D] or an object with `hidden_states` (a tuple of [B, T, D], embeddings first) and/or
`last_hidden_state` / `logits`. Set `model.posdiag_kind = "encoder"` for a bidirectional model
(default "causal") and `model.posdiag_position_kind` to say what it uses.

How a forward runs (chunks, the out-of-memory fallback, outputs gathered) is posdiag.model.forward; Outputs is
importable from here as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from posdiag.errors import PosdiagError
from posdiag.model.families import Family
from posdiag.model.forward import Outputs, forward_once, in_chunks, takes_logits_to_keep
from posdiag.model.kinds import Kind, PositionKind
from posdiag.model.placement import stored_weight
from posdiag.model.tensors import additive_mask, dtype_name
from posdiag.options import LoadOptions
from posdiag.results import ModelInfo

# layer type (config.layer_types) -> the pattern its layers attend by; any other type attends the full pattern
_LOCAL_PATTERN = {"sliding_attention": "sliding", "chunked_attention": "chunked"}


def _chunk_index(order: torch.Tensor, valid: torch.Tensor | None, size: int) -> torch.Tensor:
    """Each token's attention chunk [B, T]: its order counted from the row's first valid token, over `size`.
    transformers counts chunks from the end of the left padding (masking_utils.chunked_overlay); counted by order,
    a permuted row keeps every token in its chunk (the consistent permutation permutes the chunk pattern too)."""
    counted = order if valid is None else order.masked_fill(~valid.to(order.device).bool(), order.max() + 1)
    return torch.div(order - counted.min(dim=-1, keepdim=True).values, size, rounding_mode="floor")


@dataclass(frozen=True)
class LoadInfo:
    """What the checkpoint provided, for the `load` check."""

    checkpoint_keys: tuple[str, ...] | None  # None: no checkpoint files (factory / in-memory)
    missing_keys: tuple[str, ...] = ()
    unexpected_keys: tuple[str, ...] = ()
    mismatched_keys: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    source: str = ""
    shipped_code: dict[str, str] = field(default_factory=dict)  # config.auto_map: the checkpoint's own code
    untested_code: str = ""  # why the loaded class is not that code ('' when it is, or there is none)


@dataclass
class Subject:
    model: torch.nn.Module
    config: Any
    family: Family
    spec: str
    kind: Kind
    position_kind: PositionKind
    dtype: torch.dtype
    load_dtype: torch.dtype
    device: torch.device
    load_info: LoadInfo
    options: LoadOptions = field(default_factory=LoadOptions)
    forward_count: int = 0
    batch_limit: int | None = None  # lowered after an out-of-memory fallback
    is_hf: bool = True
    notes: list[str] = field(default_factory=list)
    tested: str = ""  # multimodal models: the tower the checks run on (towers.tested_tower)
    mask_refusals: dict[str, str] = field(default_factory=dict)  # stack -> why it refuses explicit masks ("": takes)
    cleanup: list[Any] = field(default_factory=list, repr=False)  # weakref.finalize: temporary offload folders
    held_absolute: str = ""  # the family's absolute-by-design term, as held now (absolute_term_held; "" when not)
    # The stored-dtype pass of a check decided in float32 (posdiag.half_precision): its path once as stored,
    # with no one-position slip planted and no float64 re-run (the float32 run has both, at full power).
    as_stored_pass: bool = False
    # (tokenizer, why none): a .gguf file's, read with its weights; a checkpoint's, once a check has loaded it
    tokenizer: tuple[Any, str] | None = field(default=None, repr=False)

    def close(self) -> None:
        """Release what loading created outside the model (the temporary offload folder).
        The model may read offloaded weights from there, so call this only when done with it."""
        for finalizer in self.cleanup:
            finalizer()

    # ---------------------------------------------------------------- description
    @property
    def info(self) -> ModelInfo:
        return ModelInfo(
            id=self.spec, family=self.family.name, kind=self.kind,
            position_kind=self.position_kind,
            dtype=dtype_name(self.load_dtype),
            device=str(self.device), check_dtype=dtype_name(self.dtype),
            source=self.load_info.source,
            notes=tuple(self.notes),
            model_class=type(self.model).__name__,
            shipped_code=dict(self.load_info.shipped_code),
            untested_code=self.load_info.untested_code,
            tested=self.tested,
        )

    @property
    def language_model(self) -> torch.nn.Module:
        """The module holding the language model's layers: what module-inspecting probes (rotary tables,
        attention capture) search. A multimodal model's vision tower has rotary modules and attention of
        its own (Qwen2-VL's 2D vision RoPE): searched, they were judged as text RoPE and failed."""
        if self.tested and self.is_hf and hasattr(self.model, "get_decoder"):
            decoder = self.model.get_decoder()
            if isinstance(decoder, torch.nn.Module):
                return decoder
        return self.model

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    @property
    def stacks(self) -> tuple[str, ...]:
        return {"seq2seq": ("encoder", "decoder"), "encoder": ("encoder",)}.get(self.kind, ("decoder",))

    @property
    def vocab_size(self) -> int:
        size = getattr(self.config, "vocab_size", None)
        if size is None:
            emb = self.model.get_input_embeddings() if hasattr(self.model, "get_input_embeddings") else None
            size = emb.num_embeddings if emb is not None else None
        if not size:
            raise PosdiagError("cannot tell the vocabulary size: set config.vocab_size "
                               "or expose get_input_embeddings()")
        return int(size)

    @property
    def max_positions(self) -> int | None:
        """The declared context in tokens, where the config states one. RoBERTa-style tables count their offset rows
        in max_position_embeddings (514 rows for 512 tokens, ids from padding_idx + 1): the usable context is rows -
        offset (measured: id 130 out of range in a 130-row table at 129 positions), unless they come on top."""
        # max_seq_len: MPT builds its ALiBi bias for exactly that many keys; a longer probe crashes
        # (measured: RuntimeError, size 320 vs 128, in the shift check's prefix rows). EncoderDecoderModel states
        # it per part: the shorter of its encoder's and decoder's (a 272-token probe of 256-row BERTs crashed).
        parts = [c for c in (getattr(self.config, "encoder", None), getattr(self.config, "decoder", None)) if c]
        for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "max_seq_len"):
            value = min((getattr(c, attr, 0) for c in parts), default=0) or getattr(self.config, attr, None)
            if isinstance(value, int) and value > 0:
                return value - self.family.explicit_position_offset * self.family.offset_rows_in_context
        return None

    @property
    def sliding_window(self) -> int | None:  # a per-layer window (heterogeneous configs): the widest one of any layer
        per_layer = getattr(self.config, "per_layer_config", None) if getattr(self.config, "is_heterogeneous", 0) else 0
        window = (max((getattr(c, "sliding_window", None) or 0 for c in per_layer), default=0) if per_layer else
                  getattr(self.config, "sliding_window", None) or getattr(self.config, "window_size", None))
        return int(window) if window and getattr(self.config, "use_sliding_window", True) is not False else None

    def layer_types(self) -> list[str]:
        types = getattr(self.config, "layer_types", None)
        return list(types) if types else ["full_attention"]

    # ---------------------------------------------------------------- inputs
    def special_ids(self) -> set[int]:
        ids: set[int] = set()
        # The model's own config too: a multimodal model's image/video token ids live there, not in the
        # language model's config (Subject.config), and an image token without pixels makes it raise.
        model_config = getattr(self.model, "config", None) if self.is_hf else None
        for obj in (o for o in (self.config, getattr(self.config, "text_config", None), model_config) if o is not None):
            for name in (n for n in dir(obj) if n.endswith("_token_id") and not n.startswith("_")):
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
        keep = torch.ones(vocab, dtype=torch.bool)
        keep[[i for i in self.special_ids() | set(range(min(4, vocab))) if 0 <= i < vocab]] = False
        allowed = keep.nonzero()[:, 0]
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

    @property
    def attention_chunk(self) -> int | None:
        """Llama 4's chunked local attention: the chunk size, where some layer attends within chunks."""
        size = getattr(self.config, "attention_chunk_size", None)
        return int(size) if size and "chunked_attention" in self.layer_types() else None

    def patterns(self, order: torch.Tensor, valid: torch.Tensor | None = None, stack: str = "decoder",
                 edit: Any = None) -> dict[str, torch.Tensor]:
        """Bool attention patterns [B, T, T] by logical token order: {"full": ..., "sliding": ..., "chunked": ...}.

        Causal stacks: key j visible to query i when order[j] <= order[i] ("sliding" adds
        order[i] - order[j] < window, transformers' convention; "chunked" adds the same chunk of
        attention_chunk_size, counted from the row's first valid token as transformers counts it
        from the end of the left padding). Bidirectional stacks: every
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
        if causal and self.attention_chunk:
            chunk = _chunk_index(order, valid, self.attention_chunk)
            out["chunked"] = full & (chunk[:, :, None] == chunk[:, None, :])
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
        local = {t for t, key in _LOCAL_PATTERN.items() if key in patterns}  # the layer types with their own pattern
        if form == "layer_dict" and local:
            return {t: additive_mask(patterns[_LOCAL_PATTERN.get(t, "full")][:, None], self.dtype)
                    for t in sorted(set(self.layer_types()) | {"full_attention"} | local)}
        # One mask for every layer: the window (or chunk) goes in only when every layer slides (Mistral);
        # per-layer windows are the injector's business (GPT-Neo's buffers).
        types = set(self.layer_types())
        uniform = "sliding" if "sliding" in patterns and self.windowed_layers() == "all" else \
            ("chunked" if "chunked" in patterns and types == {"chunked_attention"} else "full")
        return additive_mask(patterns[uniform][:, None], self.dtype)

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
    def absolute_term_held(self) -> Iterator[str]:
        """The family's absolute-by-design term held at its value at the first positions (Family.hold_absolute),
        undone on exit: what is relative can then be judged alone. Yields (and keeps in held_absolute) what was held,
        "" when nothing could be."""
        hold = self.family.hold_absolute
        held, undo = hold(self.model) if hold is not None else ("", lambda: None)
        self.held_absolute = held
        try:
            yield held
        finally:
            undo()
            self.held_absolute = ""

    def stored_weight(self, name: str):
        """Parameter or buffer `name` with its values, also when accelerate offloaded it (a context manager)."""
        return stored_weight(self.model, name)

    def position_ids_for(self, logical: torch.Tensor) -> torch.Tensor:
        """Logical positions (0-based) -> the ids the model expects (RoBERTa starts at pad+1)."""
        return logical + self.family.explicit_position_offset

    # ---------------------------------------------------------------- forward (posdiag.model.forward runs it)
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
        return in_chunks(self, self._forward_once, input_ids, mask=mask, position_ids=position_ids, stack=stack,
                         encoder_ids=encoder_ids, want_logits=want_logits)

    @property
    def takes_logits_to_keep(self) -> bool:
        return takes_logits_to_keep(self.model)

    def _forward_once(self, input_ids, *, mask, position_ids, stack, encoder_ids, want_logits) -> Outputs:
        return forward_once(self, input_ids, mask=mask, position_ids=position_ids, stack=stack,
                            encoder_ids=encoder_ids, want_logits=want_logits)
