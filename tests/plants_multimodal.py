"""Planted multimodal position bugs on tiny Qwen2-VL / Qwen2.5-VL / Qwen3-VL, each invisible on text alone. Plants
change one instance only (instance attributes), never a transformers module or class."""

from __future__ import annotations

import torch
from torch import nn

from posdiag.testing.multimodal import tiny_multimodal


def healthy(model_type: str, tokens_per_second: int | None = 2) -> nn.Module:
    """Image and video placeholder ids inside the small vocabulary, so a prompt with images can be built. Qwen2.5-VL
    takes the released checkpoints' tokens_per_second of 2 (its config class defaults to 4: `video_overlap`)."""
    model = tiny_multimodal(model_type, image_tokens_in_vocab=True)
    if tokens_per_second is not None and hasattr(model.config.vision_config, "tokens_per_second"):
        model.config.vision_config.tokens_per_second = tokens_per_second
    return model


def video_overlap() -> nn.Module:
    """Stock Qwen2.5-VL at its config class's default tokens_per_second (4): the 4-frame video's temporal positions
    reach past max(h, w), where transformers 5.25 resumes the text after it."""
    return healthy("qwen2_5_vl", tokens_per_second=None)


def _numbering(model: nn.Module, change) -> nn.Module:
    """The model's get_rope_index with its positions changed by change(positions, input_ids, kwargs)."""
    inner = model.model
    original = inner.get_rope_index

    def get_rope_index(input_ids, *args, **kwargs):
        positions, deltas = original(input_ids, *args, **kwargs)
        return change(positions.clone(), input_ids, kwargs), deltas

    inner.get_rope_index = get_rope_index
    return model


def _runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """(start, stop) of each run of True in a 1-D bool tensor."""
    out, start = [], None
    for i, v in enumerate(mask.tolist() + [False]):
        if v and start is None:
            start = i
        elif not v and start is not None:
            out.append((start, i))
            start = None
    return out


def second_image_as_first(model_type: str) -> nn.Module:
    """The second image is numbered from the first image's start (its grid offsets kept): the start position is not
    advanced past the text between them."""
    model = healthy(model_type)
    image = model.config.image_token_id

    def change(pos, ids, kwargs):
        for row in range(ids.shape[0]):
            runs = _runs(ids[row] == image)
            if len(runs) > 1:
                (a, _), (b, e) = runs[0], runs[1]
                pos[:, row, b:e] += pos[0, row, a] - pos[0, row, b]
        return pos
    return _numbering(model, change)


def one_dimensional_rotary(model_type: str) -> nn.Module:
    """The language model's rotary reads the t stream for every pair: images rotate as text, h and w are dropped."""
    model = healthy(model_type)
    rotary = model.model.language_model.rotary_emb
    original = rotary.forward

    def forward(x, position_ids):
        if position_ids.ndim == 3:
            position_ids = position_ids[:1].expand(position_ids.shape[0], -1, -1)
        return original(x, position_ids)

    rotary.forward = forward
    return model


def seconds_truncated(model_type: str = "qwen2_5_vl") -> nn.Module:
    """second_per_grid_ts truncated to an integer before the temporal step (transformers #48669): 0.5 s becomes 0,
    every temporal patch of the video takes the same t."""
    model = healthy(model_type)
    inner = model.model
    original = inner.get_rope_index

    def get_rope_index(input_ids, *args, second_per_grid_ts=None, **kwargs):
        if second_per_grid_ts is not None:
            second_per_grid_ts = second_per_grid_ts.long()
        return original(input_ids, *args, second_per_grid_ts=second_per_grid_ts, **kwargs)

    inner.get_rope_index = get_rope_index
    return model


def images_take_video_seconds(model_type: str = "qwen2_5_vl") -> nn.Module:
    """Still images given video temporal scaling (transformers #45325): each image consumes an entry of
    second_per_grid_ts, so the video after two images takes the default of 1 s per temporal patch, not its own."""
    model = healthy(model_type)
    inner = model.model
    original = inner.get_rope_index

    def get_rope_index(input_ids, *args, second_per_grid_ts=None, image_grid_thw=None, **kwargs):
        if second_per_grid_ts is not None and image_grid_thw is not None:
            taken = image_grid_thw.shape[0]
            rest = second_per_grid_ts[taken:]
            second_per_grid_ts = rest if rest.numel() else None  # the video's own entry went to an image
        return original(input_ids, *args, second_per_grid_ts=second_per_grid_ts, image_grid_thw=image_grid_thw,
                        **kwargs)

    inner.get_rope_index = get_rope_index
    return model


def tower_that_cannot_run(model_type: str = "qwen2_vl") -> nn.Module:
    """The vision tower raises (a kernel this machine lacks): the text path still runs."""
    model = healthy(model_type)

    def forward(*args, **kwargs):
        raise RuntimeError("planted: the vision tower cannot run on this device")

    model.model.visual.forward = forward
    return model


def _prefill_hook(model_type: str, keep) -> nn.Module:
    """The model's compute_3d_position_ids with rope_deltas set before a call on an empty cache by
    keep(kept, batch) -> the deltas that call starts from (kept: the last image prompt's, held on the module as
    `kept_deltas`, where a fresh state resets it; batch: the call's rows)."""
    model = healthy(model_type)
    inner = model.model
    original = inner.compute_3d_position_ids
    inner.kept_deltas = None

    def compute_3d_position_ids(*args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is None or cache.get_seq_length() == 0:
            inner.rope_deltas = keep(inner.kept_deltas, kwargs["inputs_embeds"].shape[0])
        out = original(*args, **kwargs)
        if kwargs.get("image_grid_thw") is not None or kwargs.get("video_grid_thw") is not None:
            inner.kept_deltas = inner.rope_deltas
        return out

    inner.compute_3d_position_ids = compute_3d_position_ids
    return model


def rope_deltas_reset(model_type: str) -> nn.Module:
    """Healthy twin: rope_deltas forgotten at every prompt (a call on an empty cache numbers its own)."""
    return _prefill_hook(model_type, lambda kept, batch: None)


def rope_deltas_kept(model_type: str) -> nn.Module:
    """The last image prompt's rope_deltas kept for every later prompt (transformers #36013)."""
    return _prefill_hook(model_type, lambda kept, batch: kept)


def rope_deltas_reset_on_batch_size(model_type: str) -> nn.Module:
    """rope_deltas forgotten only when a prompt comes with another batch size (TensorRT-LLM #15661): a one-row text
    prompt after a one-row image prompt takes the image prompt's offset."""
    return _prefill_hook(model_type, lambda kept, batch: kept if kept is not None and kept.shape[0] == batch else None)


def chunks_numbered_as_text(model_type: str) -> nn.Module:
    """A prefill chunk after the first (several tokens on a non-empty cache) drops the 3-D position ids it is handed
    and is numbered as text from the cache length (mlx-vlm #1741's class): an image the chunk holds part of takes text
    positions. Decode steps (one token) keep theirs."""
    model = healthy(model_type)

    def hook(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        ids = kwargs.get("input_ids")
        if cache is not None and cache.get_seq_length() > 0 and ids is not None and ids.shape[1] > 1:
            kwargs["position_ids"] = None
            module.rope_deltas = None
        return args, kwargs

    model.model.register_forward_pre_hook(hook, with_kwargs=True)
    return model


def padding_counted(model_type: str) -> nn.Module:
    """get_rope_index called without the attention mask: a left-padded row's padding takes positions, and the row's
    tokens run that many positions later than alone."""
    return _numbering(_without_mask(healthy(model_type)), lambda pos, ids, kwargs: pos)


def _without_mask(model: nn.Module) -> nn.Module:
    inner = model.model
    original = inner.get_rope_index

    def get_rope_index(input_ids, *args, attention_mask=None, **kwargs):
        return original(input_ids, *args, **kwargs)

    inner.get_rope_index = get_rope_index
    return model


def video_tower_crashes(model_type: str) -> nn.Module:
    """The video path raises (an IndexError in the video features, as a frame-count mismatch does); images run."""
    model = healthy(model_type)

    def get_video_features(*args, **kwargs):
        raise IndexError("planted: index 2 is out of bounds for dimension 0 with size 2")

    model.model.get_video_features = get_video_features
    return model


def frames_by_index(model_type: str = "qwen2_5_vl") -> nn.Module:
    """The video's temporal patches numbered by index: the time scaling (tokens_per_second x second_per_grid_ts)
    dropped where the vision positions are built."""
    model = healthy(model_type)
    inner = model.model
    original = inner.get_vision_position_ids

    def get_vision_position_ids(start, grid, temp_merge_size=1, spatial_merge_size=1, time_interval=1.0, **kwargs):
        return original(start, grid, temp_merge_size, spatial_merge_size, 1.0, **kwargs)

    inner.get_vision_position_ids = get_vision_position_ids
    return model


def forward_drops_seconds(model_type: str = "qwen2_5_vl") -> nn.Module:
    """The forward's own numbering (compute_3d_position_ids) calls get_rope_index without second_per_grid_ts, so the
    video takes the default of 1 s per temporal patch; get_rope_index called directly is right."""
    model = healthy(model_type)
    inner = model.model
    original = inner.compute_3d_position_ids

    def compute_3d_position_ids(*args, second_per_grid_ts=None, **kwargs):
        return original(*args, **kwargs)

    inner.compute_3d_position_ids = compute_3d_position_ids
    return model


def forward_second_image_as_first(model_type: str) -> nn.Module:
    """The forward's own numbering (compute_3d_position_ids) numbers the second image from the first image's start;
    get_rope_index called directly is right."""
    model = healthy(model_type)
    inner = model.model
    original = inner.compute_3d_position_ids
    image = model.config.image_token_id

    def compute_3d_position_ids(*args, **kwargs):
        pos = original(*args, **kwargs)
        ids = kwargs.get("input_ids")
        if pos is None or ids is None or kwargs.get("image_grid_thw") is None:
            return pos
        pos = pos.clone()
        for row in range(ids.shape[0]):
            runs = _runs((ids[row] == image) & (kwargs["mm_token_type_ids"][row] == 1))
            if len(runs) > 1:
                (a, _), (b, e) = runs[0], runs[1]
                pos[:, row, b:e] += pos[0, row, a] - pos[0, row, b]
        return pos

    inner.compute_3d_position_ids = compute_3d_position_ids
    return model


def padding_attended_with_images(model_type: str) -> nn.Module:
    """A padded batch holding images loses its padding mask on the way to the language model (positions are computed
    from the mask first, so they stay right): the image row attends its left padding. Text batches keep their mask."""
    model = healthy(model_type)
    inner = model.model
    inner.images_padded = False

    def outer(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        module.images_padded = kwargs.get("pixel_values") is not None and mask is not None and bool((mask == 0).any())
        return args, kwargs

    def language(module, args, kwargs):
        if inner.images_padded:
            kwargs["attention_mask"] = None
        return args, kwargs

    inner.register_forward_pre_hook(outer, with_kwargs=True)
    inner.language_model.register_forward_pre_hook(language, with_kwargs=True)
    return model


def _rotated_beneath(model_type: str, change) -> nn.Module:
    """The language model's rotary computes its angles at change(position_ids, inner) while the ids it is handed (what
    posdiag observes at the rotary module) stay right: a bug in how the positions are applied, which only the logits
    show."""
    model = healthy(model_type)
    inner = model.model
    inner.cached_tokens = 0
    rotary = inner.language_model.rotary_emb
    original = rotary.forward

    def cached(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        module.cached_tokens = 0 if cache is None else cache.get_seq_length()
        return args, kwargs

    def forward(x, position_ids):
        return original(x, change(position_ids, inner))

    inner.register_forward_pre_hook(cached, with_kwargs=True)
    rotary.forward = forward  # an instance attribute, called after the observing pre-hooks
    return model


def _after_images(inner: nn.Module) -> bool:
    deltas = getattr(inner, "rope_deltas", None)
    return isinstance(deltas, torch.Tensor) and bool((deltas != 0).any())


def decode_deltas_dropped_beneath(model_type: str) -> nn.Module:
    """Each token decoded one at a time after an image prompt is rotated at its text position (the token count: the
    cache offset taken for the position, rope_deltas dropped: mlx-vlm #1983 / TensorRT-LLM #15661's class) while the
    rotary module is handed the right ids. Text decoding (rope_deltas 0) is unchanged."""
    def change(pos, inner):
        if pos.shape[-1] == 1 and _after_images(inner):
            return pos - inner.rope_deltas.reshape(1, -1, 1).to(pos.dtype)
        return pos
    return _rotated_beneath(model_type, change)


def chunks_at_leading_positions_beneath(model_type: str) -> nn.Module:
    """A chunked prefill of an image prompt rotates every chunk after the first at the prompt's leading positions (the
    whole prompt's position ids sliced from 0, not from the chunk's start: mlx-vlm #1741's class) while the rotary
    module is handed the right ids. Text prompts (rope_deltas 0) and one-token decode steps are unchanged."""
    first: dict[str, torch.Tensor] = {}

    def change(pos, inner):
        if pos.shape[-1] > 1 and inner.cached_tokens == 0:
            first["pos"] = pos
        elif pos.shape[-1] > 1 and _after_images(inner) and "pos" in first and \
                first["pos"].shape[-1] >= pos.shape[-1]:
            return first["pos"][..., :pos.shape[-1]]
        return pos
    return _rotated_beneath(model_type, change)
