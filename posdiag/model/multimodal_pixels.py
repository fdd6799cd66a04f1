"""The pixels of posdiag's multimodal prompts (posdiag.model.multimodal_inputs), patchified as the family does.

The images are deterministic (a plane wave per still image, a bar moving across a video's frames), so every run sees
the same pixels. They are patchified by the family's own image processor where it can be built offline; where it
cannot (it needs torchvision or PIL), by posdiag's minimal patchifier, which lays patches out as Qwen2-VL's processor
does for an image already at a patch multiple (rescale, CLIP normalisation, merge-window order, frames stacked by
temporal patch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Sizes:
    """The vision tower's patching: patch side, frames per temporal patch, merge window, channels."""

    patch: int
    temporal: int
    merge: int
    channels: int

    def pixels(self, merged: int) -> int:
        """Pixels along a side that covers `merged` merged tokens."""
        return merged * self.merge * self.patch


def patching(vision: Any) -> Sizes | None:
    patch = getattr(vision, "patch_size", None)
    if not patch:
        return None
    return Sizes(int(patch), int(getattr(vision, "temporal_patch_size", 1) or 1),
                 int(getattr(vision, "spatial_merge_size", 1) or 1),
                 int(getattr(vision, "in_channels", None) or getattr(vision, "in_chans", None) or 3))


def still_image(height: int, width: int, n: int) -> torch.Tensor:
    """[H, W, 3] in 0..255: a plane wave, its direction and phase per image and channel."""
    y, x = torch.meshgrid(torch.arange(height, dtype=torch.float64), torch.arange(width, dtype=torch.float64),
                          indexing="ij")
    waves = [torch.sin(2 * torch.pi * ((n + 1) * y / height + (c + 1) * x / width) + n + c) for c in range(3)]
    return (127.5 + 127.5 * torch.stack(waves, dim=-1)).round()


def video_frame(height: int, width: int, f: int, frames: int) -> torch.Tensor:
    """[H, W, 3]: a bright vertical bar that moves right by 1/frames of the width each frame."""
    out = torch.full((height, width, 3), 40.0)
    left = (f * width) // frames
    out[:, left: left + max(1, width // frames)] = 220.0
    return out


def patchified(images: list[torch.Tensor], sizes: Sizes, model_type: str) -> tuple[torch.Tensor, torch.Tensor, str]:
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


def _own_processor(model_type: str, sizes: Sizes) -> tuple[Any, str]:
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


def _patches(images: torch.Tensor, sizes: Sizes) -> torch.Tensor:
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


def video_patches(frames: list[torch.Tensor], sizes: Sizes) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values_videos, video_grid_thw) of the frames, [H, W, 3] each."""
    stacked = torch.stack([f.permute(2, 0, 1) for f in frames])
    grid = torch.tensor([[len(frames) // sizes.temporal, stacked.shape[2] // sizes.patch,
                          stacked.shape[3] // sizes.patch]])
    return _patches(stacked, sizes), grid
