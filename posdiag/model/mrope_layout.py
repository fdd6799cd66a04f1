"""The multimodal RoPE numbering a prompt's layout calls for, computed by posdiag itself, and where a model's own
numbering (`get_rope_index`) departs from it, named by span and axis.

The published rule (Qwen2-VL, arXiv 2409.12191 §2.1; Qwen2.5-VL's absolute time; vLLM's MRotaryEmbedding): text
tokens take one position on all three axes, counting on; a vision block starts at the next position s and numbers its
tokens (t, h, w) = (s + floor(i * interval), s + row, s + column) over its merged grid, where `interval` is 1 for
images and Qwen2-VL video, tokens_per_second * seconds per temporal patch for Qwen2.5-VL video; the text after the block
resumes at the block's largest position + 1. Families that split a video into frame groups with timestamps between
(Qwen3-VL) number each group as a still image. A model that numbers the second image as the first, truncates the
temporal step, or resumes text inside a video's temporal range departs from this, and the departure is an integer:
no tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posdiag.model.multimodal_inputs import Span

AXES = ("t", "h", "w")


def layout_positions(spans: tuple[Span, ...]) -> torch.Tensor:
    """[3, T] positions of the prompt as its layout calls for."""
    blocks, next_pos = [], 0
    for span in spans:
        if span.kind == "text":
            block = torch.arange(span.stop - span.start).expand(3, -1) + next_pos
        else:
            t, h, w = span.grid
            tt = (torch.arange(t, dtype=torch.float64) * span.interval).long()
            grid = torch.stack(torch.meshgrid(tt, torch.arange(h), torch.arange(w), indexing="ij")).reshape(3, -1)
            block = grid + next_pos
        blocks.append(block)
        next_pos = int(block.max()) + 1
    return torch.cat(blocks, dim=1)


@dataclass(frozen=True)
class Departure:
    """One span whose numbering is not the layout's."""

    span: Span
    axes: tuple[str, ...]  # the axes that differ somewhere in the span
    token: int  # the span's first token that differs
    got: tuple[int, int, int]
    expected: tuple[int, int, int]

    def words(self) -> str:
        return (f"{self.span.name()}: axis {', '.join(self.axes)} off the layout; token {self.token} numbered "
                f"(t, h, w) = {self.got}, the layout puts it at {self.expected}")

    def to_dict(self) -> dict:
        return {"span": self.span.name(), "axes": list(self.axes), "token": self.token, "got": list(self.got),
                "expected": list(self.expected)}


def departures(numbering: torch.Tensor, spans: tuple[Span, ...]) -> list[Departure]:
    """Every span where `numbering` [3, T] differs from the layout's, in prompt order."""
    expected = layout_positions(spans)
    if numbering.shape != expected.shape:
        raise ValueError(f"numbering of shape {tuple(numbering.shape)} for a {expected.shape[1]}-token prompt")
    out = []
    for span in spans:
        got, want = numbering[:, span.start:span.stop], expected[:, span.start:span.stop]
        differs = got != want
        if not bool(differs.any()):
            continue
        axes = tuple(a for a, row in zip(AXES, differs, strict=True) if bool(row.any()))
        first = int(differs.any(dim=0).nonzero()[0])
        out.append(Departure(span, axes, span.start + first, tuple(int(v) for v in got[:, first]),
                             tuple(int(v) for v in want[:, first])))
    return out
