"""Multimodal prompts built in code: two still images and a short video between text, for vision-language models
whose language model numbers vision tokens with multimodal RoPE (`get_rope_index`: Qwen2-VL, Qwen2.5-VL, Qwen3-VL).

Why built here: a position bug of a vision-language model lives where image and video tokens are numbered (the second
image, the text after a video, the temporal index), and random text never holds a placeholder. The images are
deterministic plane waves (one per image, a bar moving across the video's frames), so every run sees the same pixels.
They are patchified by the family's own image processor where it can be built offline; where it cannot (it needs
torchvision or PIL), by posdiag's minimal patchifier, which lays patches out as Qwen2-VL's processor does for an image
already at a patch multiple (rescale, CLIP normalisation, merge-window order, frames stacked by temporal patch).

The prompt is text, image 1 (2 x 2 merged tokens), text, image 2 (2 x 3: not square, so an h/w exchange shows), text,
a 4-frame video, text. Its spans (which tokens are which image, and the grid each covers) are what a report names.
Families that split a video into frames with timestamps between them (Qwen3-VL) get that layout.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

TEXT = 3  # text tokens between the vision blocks
IMAGES = ((2, 2), (2, 3))  # merged (h, w) tokens of each still image
FRAMES, FPS = 4, 4.0  # the video: 4 frames sampled at 4 fps, so 0.5 s per temporal patch of 2 frames
VIDEO = (2, 2)  # merged (h, w) tokens per frame of the video
STAMP = 2  # text tokens of the timestamp before each frame, where the family numbers frames apart


@dataclass(frozen=True)
class Span:
    """One run of the prompt's tokens: text, or one image / video (frame) and the grid it covers."""

    kind: str  # "text" | "image" | "video"
    number: int  # 1-based among its kind ("image 2"); the video's number for its frames
    start: int
    stop: int
    grid: tuple[int, int, int] = (1, 1, 1)  # (t, h, w) in merged tokens
    interval: float = 1.0  # temporal positions per temporal grid step
    frame: int = 0  # 1-based frame group of a video split into frames (0: the whole video)
    after: str = ""  # text: the vision block it follows ("video 1"), "" at the start

    def name(self) -> str:
        if self.kind == "text":
            what = f"text after {self.after}" if self.after else "text"
        else:
            what = f"{self.kind} {self.number}" + (f" frame group {self.frame}" if self.frame else "")
        return f"{what} (tokens {self.start}-{self.stop - 1})"


@dataclass
class MultimodalPrompt:
    """The prompt's ids, what the processor made of the pixels, and its spans."""

    ids: torch.Tensor  # [1, T]
    kinds: torch.Tensor  # [1, T] mm_token_type_ids: 0 text, 1 image, 2 video
    spans: tuple[Span, ...]
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor  # [images, 3] in patches
    pixels_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    seconds_per_grid: torch.Tensor | None = None  # second_per_grid_ts, for families that take it
    rope_owner: Any = None  # the module whose get_rope_index numbers a sequence
    processor: str = ""  # which processor patchified the pixels (and why, where posdiag's own)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def contents(self) -> str:
        images = sum(s.kind == "image" for s in self.spans)
        video = f" and a {FRAMES}-frame video" if self.video_grid_thw is not None else ""
        return f"{images} images{video}"

    @property
    def tested(self) -> str:
        """The report header's words."""
        return f"language model with {self.contents}"

    def vision(self) -> torch.Tensor:
        """[T] bool: the image and video tokens."""
        return self.kinds[0] != 0

    def inputs(self, ids: torch.Tensor | None = None) -> dict[str, Any]:
        """Model inputs for `ids` (default: the prompt) that start with the prompt; later tokens are text."""
        ids = self.ids if ids is None else ids
        kinds = torch.zeros_like(ids, dtype=self.kinds.dtype)
        kinds[:, : self.kinds.shape[1]] = self.kinds
        out = {"input_ids": ids, "mm_token_type_ids": kinds, "pixel_values": self.pixel_values,
               "image_grid_thw": self.image_grid_thw}
        if self.video_grid_thw is not None:
            out.update(pixel_values_videos=self.pixels_videos, video_grid_thw=self.video_grid_thw)
        if self.seconds_per_grid is not None:
            out["second_per_grid_ts"] = self.seconds_per_grid
        return out

    def numbering(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """[3, T] positions of `ids` (default: the prompt) as the model's own get_rope_index numbers them."""
        inputs = self.inputs(ids)
        grids = {k: inputs[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if k in inputs}
        with torch.inference_mode():
            pos, _ = self.rope_owner.get_rope_index(inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"],
                                                    **grids)
        return pos[:, 0].cpu()


def rope_owner(model: Any) -> Any:
    """The module whose get_rope_index numbers a sequence (the inner model first: it stores rope_deltas)."""
    return next((m for m in (getattr(model, "model", None), model) if callable(getattr(m, "get_rope_index", None))),
                None)


def build_prompt(model: Any, seed: int, *, video: bool = True) -> tuple[MultimodalPrompt | None, str]:
    """The prompt for `model`, or why it gets none (the reason names what is missing)."""
    config = getattr(model, "config", None)
    owner = rope_owner(model)
    vision = getattr(config, "vision_config", None)
    image_token = getattr(config, "image_token_id", None)
    if owner is None or vision is None or image_token is None:
        return None, "no get_rope_index, vision config or image token to build an image prompt from"
    taken = inspect.signature(owner.get_rope_index).parameters
    if "mm_token_type_ids" not in taken and not any(p.kind is p.VAR_KEYWORD for p in taken.values()):  # Omni: audio
        return None, (f"{type(owner).__name__}.get_rope_index takes no mm_token_type_ids: another numbering than the "
                      "image-and-video one posdiag builds prompts for")
    vocab = model.get_input_embeddings().weight.shape[0]
    if not 0 <= int(image_token) < vocab:
        return None, f"the image token {image_token} is outside the {vocab}-row embedding"
    sizes = _patching(vision)
    if sizes is None:
        return None, "the vision config gives no patch size"
    video_token = getattr(config, "video_token_id", None)
    takes_video = video and video_token is not None and 0 <= int(video_token) < vocab
    tokens = _Tokens(int(image_token), int(video_token) if takes_video else None,
                     *(_inside(getattr(config, k, None), vocab) for k in ("vision_start_token_id",
                                                                           "vision_end_token_id")))
    source = _rope_source(owner)
    per_frame = "repeat_interleave(video_grid_thw" in source
    seconds = "second_per_grid_ts" in inspect.signature(owner.get_rope_index).parameters
    per_second = float(getattr(vision, "tokens_per_second", 1) or 1) if seconds else 1.0
    gen = torch.Generator().manual_seed(seed)
    layout = _Layout(tokens, sizes, vocab, gen)
    for n, (h, w) in enumerate(IMAGES, start=1):
        layout.text(TEXT)
        layout.vision("image", n, (1, h, w))
    if takes_video:
        t = FRAMES // sizes.temporal
        interval = per_second * sizes.temporal / FPS if seconds else 1.0
        layout.text(TEXT)
        if per_frame:  # timestamps between frame groups, each group numbered as a still frame
            for f in range(t):
                layout.text(STAMP)
                layout.vision("video", 1, (1, *VIDEO), frame=f + 1)
        else:
            layout.vision("video", 1, (t, *VIDEO), interval=interval)
    layout.text(TEXT)
    dtype = next(model.parameters()).dtype
    device = model.get_input_embeddings().weight.device
    pixels, grids, how = patchified([_image(h * sizes.merge * sizes.patch, w * sizes.merge * sizes.patch, n)
                                     for n, (h, w) in enumerate(IMAGES)], sizes, getattr(config, "model_type", ""))
    prompt = MultimodalPrompt(layout.ids().to(device), layout.kinds().to(device), tuple(layout.spans),
                              pixels.to(device, dtype), grids.to(device), rope_owner=owner, processor=how)
    if takes_video:
        frames = [_frame(VIDEO[0] * sizes.merge * sizes.patch, VIDEO[1] * sizes.merge * sizes.patch, f)
                  for f in range(FRAMES)]
        pixels, grid = _video_patches(frames, sizes)
        prompt.pixels_videos, prompt.video_grid_thw = pixels.to(device, dtype), grid.to(device)
        if seconds:
            prompt.seconds_per_grid = torch.tensor([sizes.temporal / FPS], device=device)
    return prompt, ""


@dataclass(frozen=True)
class _Sizes:
    patch: int
    temporal: int
    merge: int
    channels: int


@dataclass(frozen=True)
class _Tokens:
    image: int
    video: int | None
    start: int | None
    end: int | None


def _patching(vision: Any) -> _Sizes | None:
    patch = getattr(vision, "patch_size", None)
    if not patch:
        return None
    return _Sizes(int(patch), int(getattr(vision, "temporal_patch_size", 1) or 1),
                  int(getattr(vision, "spatial_merge_size", 1) or 1),
                  int(getattr(vision, "in_channels", None) or getattr(vision, "in_chans", None) or 3))


def _inside(token: Any, vocab: int) -> int | None:
    return int(token) if isinstance(token, int) and 0 <= token < vocab else None


def _rope_source(owner: Any) -> str:
    try:
        return inspect.getsource(type(owner).get_rope_index)
    except (OSError, TypeError):  # defined where no source can be read
        return ""


class _Layout:
    """Token ids, modality kinds and spans, appended block by block."""

    def __init__(self, tokens: _Tokens, sizes: _Sizes, vocab: int, gen: torch.Generator):
        self.tokens, self.sizes, self.vocab, self.gen = tokens, sizes, vocab, gen
        self.parts: list[tuple[torch.Tensor, int]] = []
        self.spans: list[Span] = []
        self.length = 0
        special = {tokens.image, tokens.video, tokens.start, tokens.end}
        self.ordinary = torch.tensor([i for i in range(vocab) if i not in special])

    def _add(self, ids: torch.Tensor, kind: int) -> None:
        self.parts.append((ids, kind))
        self.length += ids.shape[0]

    def text(self, n: int) -> None:
        start = self.length
        self._add(self.ordinary[torch.randint(0, self.ordinary.shape[0], (n,), generator=self.gen)], 0)
        if self.spans and self.spans[-1].kind == "text":  # a delimiter between two text runs: one text span
            last = self.spans.pop()
            start = last.start
        self.spans.append(Span("text", 0, start, self.length, after=self._last_block()))

    def _last_block(self) -> str:
        block = next((s for s in reversed(self.spans) if s.kind != "text"), None)
        return "" if block is None else f"{block.kind} {block.number}"

    def _delimiter(self, token: int | None) -> None:
        if token is not None:
            start = self.spans[-1].start if self.spans and self.spans[-1].kind == "text" else self.length
            self._add(torch.tensor([token]), 0)
            if self.spans and self.spans[-1].kind == "text":
                self.spans.pop()
            self.spans.append(Span("text", 0, start, self.length, after=self._last_block()))

    def vision(self, kind: str, number: int, grid: tuple[int, int, int], interval: float = 1.0,
               frame: int = 0) -> None:
        self._delimiter(self.tokens.start)
        token = self.tokens.image if kind == "image" else self.tokens.video
        n = grid[0] * grid[1] * grid[2]
        start = self.length
        self._add(torch.full((n,), token), 1 if kind == "image" else 2)
        self.spans.append(Span(kind, number, start, self.length, grid, interval, frame))
        self._delimiter(self.tokens.end)

    def ids(self) -> torch.Tensor:
        return torch.cat([p for p, _ in self.parts])[None].long()

    def kinds(self) -> torch.Tensor:
        return torch.cat([torch.full((p.shape[0],), k, dtype=torch.int) for p, k in self.parts])[None]


def _image(height: int, width: int, n: int) -> torch.Tensor:
    """[H, W, 3] in 0..255: a plane wave, its direction and phase per image and channel."""
    y, x = torch.meshgrid(torch.arange(height, dtype=torch.float64), torch.arange(width, dtype=torch.float64),
                          indexing="ij")
    waves = [torch.sin(2 * torch.pi * ((n + 1) * y / height + (c + 1) * x / width) + n + c) for c in range(3)]
    return (127.5 + 127.5 * torch.stack(waves, dim=-1)).round()


def _frame(height: int, width: int, f: int) -> torch.Tensor:
    """[H, W, 3]: a bright vertical bar that moves right by a quarter of the width each frame."""
    out = torch.full((height, width, 3), 40.0)
    left = (f * width) // FRAMES
    out[:, left: left + max(1, width // FRAMES)] = 220.0
    return out


def patchified(images: list[torch.Tensor], sizes: _Sizes, model_type: str) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(pixel_values, image_grid_thw, which processor): the family's own where it builds offline, else posdiag's."""
    own, why = _own_processor(model_type, sizes)
    if own is not None:
        try:
            out = own(images=[i.to(torch.uint8).numpy() for i in images], return_tensors="pt")
            return out["pixel_values"], out["image_grid_thw"], type(own).__name__
        except Exception as exc:  # the processor refuses posdiag's image: one line, posdiag's patchifier instead
            why = f"{type(own).__name__} refused the image ({type(exc).__name__}: {str(exc).splitlines()[0][:80]})"
    patches = [_patches(i.permute(2, 0, 1)[None], sizes) for i in images]
    grids = torch.tensor([[1, i.shape[0] // sizes.patch, i.shape[1] // sizes.patch] for i in images])
    return torch.cat(patches), grids, f"posdiag's patchifier ({why})"


def _own_processor(model_type: str, sizes: _Sizes) -> tuple[Any, str]:
    """The family's image processor built offline from the vision config's sizes, or why not."""
    try:
        import transformers
        from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
    except ImportError as exc:  # pragma: no cover - a transformers without the auto mapping
        return None, f"no image processor mapping ({exc})"
    names = IMAGE_PROCESSOR_MAPPING_NAMES.get(model_type)
    if not names:
        return None, f"transformers maps no image processor to {model_type!r}"
    name = next(iter(names.values())) if isinstance(names, dict) else names
    try:
        processor = getattr(transformers, name)(patch_size=sizes.patch, temporal_patch_size=sizes.temporal,
                                                merge_size=sizes.merge, do_resize=False)
    except ImportError as exc:
        needs = "torchvision" if "orchvision" in str(exc) else "PIL" if "PIL" in str(exc) else "a library"
        return None, f"{name} needs {needs}, not installed"
    except Exception as exc:  # a processor that takes other arguments
        return None, f"{name} could not be built offline ({type(exc).__name__})"
    return processor, ""


def _patches(images: torch.Tensor, sizes: _Sizes) -> torch.Tensor:
    """[frames, C, H, W] in 0..255 -> [grid_t * gh * gw, C * temporal * patch * patch], Qwen2-VL's layout."""
    from transformers.utils.constants import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    x = images.to(torch.float64) / 255.0
    x = (x - torch.tensor(OPENAI_CLIP_MEAN)[:, None, None]) / torch.tensor(OPENAI_CLIP_STD)[:, None, None]
    if x.shape[0] % sizes.temporal:  # a still image: repeated to fill the temporal patch
        x = x.repeat(sizes.temporal, 1, 1, 1)
    t, c, h, w = x.shape
    p, m, tp = sizes.patch, sizes.merge, sizes.temporal
    gh, gw = h // p, w // p
    x = x.reshape(t // tp, tp, c, gh // m, m, p, gw // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape((t // tp) * gh * gw, c * tp * p * p).float()


def _video_patches(frames: list[torch.Tensor], sizes: _Sizes) -> tuple[torch.Tensor, torch.Tensor]:
    stacked = torch.stack([f.permute(2, 0, 1) for f in frames])
    grid = torch.tensor([[len(frames) // sizes.temporal, stacked.shape[2] // sizes.patch,
                          stacked.shape[3] // sizes.patch]])
    return _patches(stacked, sizes), grid
