"""Multimodal prompts built in code: two still images and a short video between text, for vision-language models
whose language model numbers vision tokens with multimodal RoPE (`get_rope_index`: Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
GLM-4V).

Why built here: a position bug of a vision-language model lives where image and video tokens are numbered (the second
image, the text after a video, the temporal index), and random text never holds a placeholder. The pixels are
deterministic (posdiag.model.multimodal_pixels).

The prompt is text, image 1 (2 x 2 merged tokens), text, image 2 (2 x 3: not square, so an h/w exchange shows), text,
a 4-frame video (2 temporal patches of 2 x 4 merged tokens), text. Its spans (which tokens are which image, and the
grid each covers) are what a report names. How a family lays a video out in its prompt and numbers its frames is a
table keyed on the model type (VIDEO_LAYOUTS), as the family's own processor writes it: one block of video tokens
(Qwen2-VL; Qwen2.5-VL scales its temporal index by tokens_per_second x second_per_grid_ts), a timestamp then a block per
temporal patch (Qwen3-VL), or a block of image tokens per temporal patch between frame delimiters, its timestamp after
and the whole between video delimiters (GLM-4V). A type the table does not hold gets no video, and says so.

The frames are 0.875 s apart, so a temporal patch of 2 frames spans 1.75 s: at Qwen2.5-VL's 2 temporal positions per
second that is 3.5 positions a patch, not an integer (a model that drops the time scaling numbers the patches 0, 1; one
that truncates the seconds 0, 2; the layout 0, 3).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from posdiag.model.multimodal_pixels import Sizes, patchified, patching, still_image, video_frame, video_patches

TEXT = 3  # text tokens between the vision blocks
IMAGES = ((2, 2), (2, 3))  # merged (h, w) tokens of each still image
FRAMES, SECONDS_PER_FRAME = 4, 0.875  # the video: 4 frames 0.875 s apart (an exact binary fraction)
VIDEO = (2, 4)  # merged (h, w) tokens per frame: wider than the temporal positions the video reaches
STAMP = 2  # text tokens of a timestamp beside each temporal patch, where the family numbers frames apart


@dataclass(frozen=True)
class VideoLayout:
    """How a family's processor writes a video into the prompt, and how its temporal index runs."""

    frames: str  # "block" | "stamped" (timestamp, then a video block per temporal patch) | "image frames" (GLM-4V)
    timed: bool = False  # temporal index = patch x tokens_per_second x second_per_grid_ts (Qwen2.5-VL)

    def words(self) -> str:
        return {"block": "one block of video tokens", "stamped": "a timestamp and a block per temporal patch",
                "image frames": "a block of image tokens per temporal patch between frame delimiters, its timestamp "
                                "after"}[self.frames] + (", temporal index scaled by seconds" if self.timed else "")


# model type -> its video layout, as its processor writes it (transformers 5.25). Image blocks are laid out and
# numbered alike in every family here; the video is what differs.
VIDEO_LAYOUTS = {
    "qwen2_vl": VideoLayout("block"),
    "qwen2_5_vl": VideoLayout("block", timed=True),
    **dict.fromkeys(("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"), VideoLayout("stamped")),
    **dict.fromkeys(("glm4v", "glm4v_moe", "glm46v", "glm_ocr"), VideoLayout("image frames")),
}


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
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None  # [images, 3] in patches
    pixels_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    seconds_per_grid: torch.Tensor | None = None  # second_per_grid_ts, for families that take it
    rope_owner: Any = None  # the module whose get_rope_index numbers a sequence
    processor: str = ""  # which processor patchified the pixels (and why, where posdiag's own)
    video_layout: VideoLayout | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def contents(self) -> str:
        images = sum(s.kind == "image" for s in self.spans)
        video = f"a {FRAMES}-frame video" if self.video_grid_thw is not None else ""
        return " and ".join(w for w in (f"{images} images" if images else "", video) if w)

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
        out = {"input_ids": ids, "mm_token_type_ids": kinds}
        if self.image_grid_thw is not None:
            out.update(pixel_values=self.pixel_values, image_grid_thw=self.image_grid_thw)
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


def in_model_dtype(model: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """INPUTS with the pixels in the model's dtype as it runs now (a float64 re-run converts the model, and users
    cast a processor's output to the model's dtype)."""
    dtype = model.get_input_embeddings().weight.dtype
    return {k: v.to(dtype) if k.startswith("pixel_values") else v for k, v in inputs.items()}


def rope_owner(model: Any) -> Any:
    """The module whose get_rope_index numbers a sequence (the inner model first: it stores rope_deltas)."""
    return next((m for m in (getattr(model, "model", None), model) if callable(getattr(m, "get_rope_index", None))),
                None)


def image_refusal(model: Any) -> str:
    """Why posdiag builds no image prompt for `model` ('' when it does)."""
    import inspect

    config = getattr(model, "config", None)
    owner = rope_owner(model)
    image_token = getattr(config, "image_token_id", None)
    if owner is None or getattr(config, "vision_config", None) is None or image_token is None:
        return "no get_rope_index, vision config or image token to build an image prompt from"
    taken = inspect.signature(owner.get_rope_index).parameters
    if "mm_token_type_ids" not in taken and not any(p.kind is p.VAR_KEYWORD for p in taken.values()):  # Omni: audio
        return (f"{type(owner).__name__}.get_rope_index takes no mm_token_type_ids: another numbering than the "
                "image-and-video one posdiag builds prompts for")
    vocab = model.get_input_embeddings().weight.shape[0]
    if not 0 <= int(image_token) < vocab:
        return f"the image token {image_token} is outside the {vocab}-row embedding"
    if patching(config.vision_config) is None:
        return "the vision config gives no patch size"
    return ""


def video_refusal(model: Any) -> str:
    """Why `model` gets no video in its prompt ('' when it does): a type whose video layout posdiag does not know, or
    a video token it has not."""
    config = model.config
    kind = getattr(config, "model_type", "")
    if kind not in VIDEO_LAYOUTS:
        return f"posdiag knows no video layout for model type {kind!r} (it knows {', '.join(sorted(VIDEO_LAYOUTS))})"
    vocab = model.get_input_embeddings().weight.shape[0]
    needed = (("video_start_token_id", "video_end_token_id", "image_start_token_id", "image_end_token_id")
              if VIDEO_LAYOUTS[kind].frames == "image frames" else ("video_token_id",))
    missing = [k for k in needed if _inside(getattr(config, k, None), vocab) is None]
    return f"no {', '.join(missing)} inside the {vocab}-row embedding" if missing else ""


def build_prompt(model: Any, seed: int, *, video: bool = True,
                 images: bool = True) -> tuple[MultimodalPrompt | None, str]:
    """The prompt for `model` (its images, its video where the type's layout is known, or one of them), or why it gets
    none (the reason names what is missing)."""
    why = image_refusal(model) or (video_refusal(model) if video and not images else "")
    if why:
        return None, why
    config = model.config
    video = video and not video_refusal(model)
    sizes = patching(config.vision_config)
    vocab = model.get_input_embeddings().weight.shape[0]
    tokens = _Tokens(int(config.image_token_id), _inside(getattr(config, "video_token_id", None), vocab),
                     *(_inside(getattr(config, k, None), vocab) for k in ("vision_start_token_id",
                                                                           "vision_end_token_id")))
    layout = _Layout(tokens, sizes, vocab, torch.Generator().manual_seed(seed), config)
    for n, (h, w) in enumerate(IMAGES if images else (), start=1):
        layout.text(TEXT)
        layout.vision("image", n, (1, h, w))
    video_layout = VIDEO_LAYOUTS[config.model_type] if video else None
    if video_layout is not None:
        layout.text(TEXT)
        layout.video(video_layout, FRAMES // sizes.temporal, _interval(config, sizes, video_layout))
    layout.text(TEXT)
    dtype = next(model.parameters()).dtype
    device = model.get_input_embeddings().weight.device
    prompt = MultimodalPrompt(layout.ids().to(device), layout.kinds().to(device), tuple(layout.spans), None, None,
                              rope_owner=rope_owner(model), video_layout=video_layout)
    if images:
        pixels, grids, prompt.processor = patchified([still_image(sizes.pixels(h), sizes.pixels(w), n)
                                                      for n, (h, w) in enumerate(IMAGES)], sizes, config.model_type)
        prompt.pixel_values, prompt.image_grid_thw = pixels.to(device, dtype), grids.to(device)
    if video_layout is not None:
        frames = [video_frame(sizes.pixels(VIDEO[0]), sizes.pixels(VIDEO[1]), f, FRAMES) for f in range(FRAMES)]
        pixels, grid = video_patches(frames, sizes)
        prompt.pixels_videos, prompt.video_grid_thw = pixels.to(device, dtype), grid.to(device)
        prompt.processor = prompt.processor or "posdiag's patchifier (a video alone)"
        if video_layout.timed:
            prompt.seconds_per_grid = torch.tensor([sizes.temporal * SECONDS_PER_FRAME], device=device)
    return prompt, ""


def _interval(config: Any, sizes: Sizes, layout: VideoLayout) -> float:
    """Temporal positions per temporal patch of the video: tokens_per_second x seconds a patch where the family scales
    time, else 1."""
    if not layout.timed:
        return 1.0
    return float(getattr(config.vision_config, "tokens_per_second", 1) or 1) * sizes.temporal * SECONDS_PER_FRAME


@dataclass(frozen=True)
class _Tokens:
    image: int
    video: int | None
    start: int | None
    end: int | None


def _inside(token: Any, vocab: int) -> int | None:
    return int(token) if isinstance(token, int) and not isinstance(token, bool) and 0 <= token < vocab else None


class _Layout:
    """Token ids, modality kinds and spans, appended block by block."""

    def __init__(self, tokens: _Tokens, sizes: Sizes, vocab: int, gen: torch.Generator, config: Any):
        self.tokens, self.sizes, self.vocab, self.gen, self.config = tokens, sizes, vocab, gen, config
        self.parts: list[tuple[torch.Tensor, int]] = []
        self.spans: list[Span] = []
        self.length = 0
        special = {tokens.image, tokens.video, tokens.start, tokens.end} | {
            _inside(getattr(config, k, None), vocab) for k in ("video_start_token_id", "video_end_token_id",
                                                               "image_start_token_id", "image_end_token_id")}
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

    def vision(self, kind: str, number: int, grid: tuple[int, int, int], interval: float = 1.0, frame: int = 0,
               token: int | None = None, delimiters: tuple[int | None, int | None] | None = None) -> None:
        start_token, end_token = (self.tokens.start, self.tokens.end) if delimiters is None else delimiters
        self._delimiter(start_token)
        token = token if token is not None else self.tokens.image if kind == "image" else self.tokens.video
        n = grid[0] * grid[1] * grid[2]
        start = self.length
        self._add(torch.full((n,), token), 1 if kind == "image" else 2)
        self.spans.append(Span(kind, number, start, self.length, grid, interval, frame))
        self._delimiter(end_token)

    def video(self, layout: VideoLayout, steps: int, interval: float) -> None:
        """The video as the family's processor writes it (VIDEO_LAYOUTS)."""
        if layout.frames == "block":
            self.vision("video", 1, (steps, *VIDEO), interval=interval)
            return
        if layout.frames == "stamped":
            for f in range(steps):
                self.text(STAMP)
                self.vision("video", 1, (1, *VIDEO), frame=f + 1)
            return
        # GLM-4V: <begin_of_video> (<begin_of_image> image tokens <end_of_image> timestamp)... <end_of_video>
        config = self.config
        self._delimiter(int(config.video_start_token_id))
        for f in range(steps):
            self.vision("video", 1, (1, *VIDEO), frame=f + 1, token=self.tokens.image,
                        delimiters=(int(config.image_start_token_id), int(config.image_end_token_id)))
            self.text(STAMP)
        self._delimiter(int(config.video_end_token_id))

    def ids(self) -> torch.Tensor:
        return torch.cat([p for p, _ in self.parts])[None].long()

    def kinds(self) -> torch.Tensor:
        return torch.cat([torch.full((p.shape[0],), k, dtype=torch.int) for p, k in self.parts])[None]
