"""The image route of a served comparison, measuring: a prompt with two images sent through the chat API, scored at
every prompt position (across and after the image tokens) and at the tokens the server decodes after it, and the
reference run on the same pixels.

The images are posdiag's own (posdiag/model/multimodal_pixels.still_image), sent as PNG data URLs, each a whole
number of merged patches (2x3 and 3x2 merged tokens: two shapes, so the second image's height and width positions
are not the first's) and small enough that a processor at its defaults resizes neither (Qwen2-VL's 56x84 pixels:
its minimum is 56x56). The sequence judged is the one the server ran, by its token ids (vLLM's `return_token_ids`):
the chat template and the placeholder expansion are the server's, and the reference runs exactly those ids with
the pixels patchified as its family's processor does. The premise is the layout: each image must come back as the
run of placeholder tokens the reference's processor makes of it; a server that laid one out otherwise saw other
pixels (resized: another processor config), and the route is not judged.
"""

from __future__ import annotations

import base64
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from posdiag.errors import EngineCrash, PosdiagError
from posdiag.model.multimodal_inputs import image_refusal, in_model_dtype
from posdiag.model.multimodal_pixels import patchified, patching, still_image
from posdiag.model.subject import Subject
from posdiag.ports.engines.http_server import Scored, ServedEngine
from posdiag.ports.profile import LayerProfile
from posdiag.ports.reference import finer_of
from posdiag.ports.served.precision import ServedFloor, held_in
from posdiag.ports.served.scores import Scores, Vocabulary, judged, position_metrics, second_draw

IMAGES = ((2, 3), (3, 2))
"""Merged tokens (rows, columns) of each image."""
NEW_TOKENS = 8
"""Tokens the server generates after the prompt: each decoded alone, at positions a server continues from the
prompt's multimodal numbering (Qwen2-VL's rope delta), not from the sequence index."""
TEXTS = ("Compare the first picture ", " with the second one ", " and say how they differ.")


@dataclass(frozen=True)
class ImagePrompt:
    """One user message of text and two images, and what the reference makes of its pixels."""

    content: list[dict[str, Any]]  # the chat API's content parts
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    processor: str
    image_token: int
    tokens_each: tuple[int, ...]  # placeholder tokens per image, as the reference's processor lays them out


def image_prompt(model: Any) -> tuple[ImagePrompt | None, str]:
    """The prompt for MODEL, or None and why it takes no images."""
    why = image_refusal(model)
    if why:
        return None, why
    config = model.config
    sizes = patching(config.vision_config)
    images = [still_image(sizes.pixels(h), sizes.pixels(w), n) for n, (h, w) in enumerate(IMAGES)]
    pixels, grids, processor = patchified(images, sizes, config.model_type)
    content: list[dict[str, Any]] = [{"type": "text", "text": TEXTS[0]}]
    for image, text in zip(images, TEXTS[1:], strict=True):
        url = "data:image/png;base64," + base64.b64encode(png(image)).decode()
        content += [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    tokens = tuple(int(g.prod()) // sizes.merge ** 2 for g in grids)
    return ImagePrompt(content, pixels, grids, processor, int(config.image_token_id), tokens), ""


def png(image: torch.Tensor) -> bytes:
    """[H, W, 3] values 0..255 as an 8-bit RGB PNG (lossless: the server decodes the very pixels)."""
    height, width, _ = image.shape
    rows = image.round().clamp(0, 255).to(torch.uint8).reshape(height, width * 3)
    raw = torch.cat([torch.zeros(height, 1, dtype=torch.uint8), rows], dim=1).numpy().tobytes()  # filter 0 a row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, truecolour, no interlace
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def spans(ids: tuple[int, ...] | list[int], token: int) -> list[tuple[int, int]]:
    """(first, last) positions of each run of TOKEN in IDS."""
    out: list[tuple[int, int]] = []
    for i, tid in enumerate(ids):
        if tid != token:
            continue
        if out and out[-1][1] == i - 1:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return out


def layout_words(prompt: ImagePrompt, ids: tuple[int, ...]) -> tuple[bool, str]:
    """Whether the server laid the images out as the reference's processor does, and the evidence."""
    runs = spans(ids, prompt.image_token)
    counts = tuple(last - first + 1 for first, last in runs)
    where = " and ".join(f"{first}-{last}" for first, last in runs) or "nowhere"
    if counts == prompt.tokens_each:
        return True, (f"the server laid out {len(runs)} images as {' and '.join(map(str, counts))} placeholder "
                      f"tokens at positions {where}, as the reference's processor does")
    return False, (f"the server laid out the images as {len(runs)} runs of placeholder token {prompt.image_token} "
                   f"({', '.join(map(str, counts)) or 'none'} tokens at positions {where}), the reference's processor "
                   f"as {len(prompt.tokens_each)} of {', '.join(map(str, prompt.tokens_each))}: it saw other pixels "
                   "(resized by another processor config?), so nothing is compared")


def onset_words(route: dict[str, Any], runs: list[tuple[int, int]], decoded_from: int) -> str:
    """Where a failing route's error starts, told by the images and the prompt's end: inside image n, right after
    it, or at the first position decoded after the prompt ('' where it starts elsewhere: the profile's own words)."""
    onset = route.get("onset_position")
    if onset is None:
        return ""
    before = f"at the floor up to position {onset - 1}, then " if onset else ""
    error = f"{before}{route['dlogprob'][onset]:.2g} at position {onset}"
    for n, (first, last) in enumerate(runs, start=1):
        if first <= onset <= last + 1:
            where = (f"image {n}'s first token" if onset == first else f"token {onset - first + 1} of image {n}"
                     if onset <= last else f"the first token after image {n}")
            return (f"{error}, {where}: the server numbers image {n} (or what follows it) otherwise than the "
                    "reference does (its multimodal rotary positions)")
    if onset >= decoded_from:
        where = "the first position decoded after the prompt" if onset == decoded_from else "decoded after the prompt"
        return (f"{error}, {where}, the prompt itself within its floor: the server numbers the tokens it decodes "
                "otherwise than the reference does (their multimodal positions continue from the prompt's: "
                "Qwen2-VL's rope delta)")
    return ""


def reference_scores(reference: Subject, ids: tuple[int, ...], prompt: ImagePrompt,
                     floor: ServedFloor | None) -> Scores:
    """The reference's log-probs over IDS with the prompt's pixels: as run, in its finer dtype (its rounding), and at
    the served precision where one was given (a torch dtype: FLOOR.dtype)."""
    t = torch.tensor([ids], dtype=torch.long, device=reference.device)
    inputs = {"input_ids": t, "mm_token_type_ids": (t == prompt.image_token).long(),
              "pixel_values": prompt.pixel_values.to(reference.device),
              "image_grid_thw": prompt.image_grid_thw.to(reference.device)}

    def log_probs() -> torch.Tensor:
        reference.forward_count += 1
        with torch.inference_mode():
            out = reference.model(**in_model_dtype(reference.model, inputs), use_cache=False, return_dict=True)
        return out.logits[0].double().cpu().log_softmax(-1)

    lp = log_probs()
    fine, source = finer_of(reference, log_probs)
    rounding = (fine - lp).abs() if fine is not None else torch.zeros_like(lp)
    rounding, drawn = second_draw(reference, reference.stacks[-1], lp, rounding, log_probs, settle_masks=False)
    source += drawn
    at_served = None
    if floor is not None and floor.dtype is not None:
        with held_in(reference, floor.dtype):
            at_served = log_probs() - lp
        source += f"; {floor.source}"
    return Scores(list(ids), lp, rounding, at_served, source)


def image_route(reference: Subject, engine: ServedEngine, vocab: Vocabulary, prompt: ImagePrompt, k: int,
                floor: ServedFloor | None, profiles: list[LayerProfile], sources: set[str]) -> dict[str, Any]:
    """PROMPT through the chat API and NEW_TOKENS generated after it, scored at every position against the reference
    on the same pixels and the ids the server ran; judged as the prompt route, once the server's layout of the images
    is the reference's."""
    if floor is not None and floor.dtype is None:
        return {"status": "skip", "why": "the served precision's floor runs posdiag's conversion in llama.cpp, "
                                         "which takes text only: --served-dtype with a torch dtype judges images"}
    try:
        served = engine.chat(prompt.content, k, NEW_TOKENS)
    except EngineCrash as exc:  # the candidate's error on this route, as a crash is in process
        return {"status": "fail", "pattern": "server error", "why": f"the server failed on it ({exc})"}
    except PosdiagError as exc:
        return {"status": "skip", "why": f"the server does not take it ({exc})"}
    ids = served.ids + served.generated
    outside = [i for i in ids if not 0 <= i < len(vocab.pieces)]
    if outside:
        raise PosdiagError(f"tokenisation mismatch on the image route: the server's sequence holds token id "
                           f"{outside[0]}, outside the reference's {len(vocab.pieces)}-token vocabulary")
    laid_out, evidence = layout_words(prompt, served.ids)
    if not laid_out:
        return {"status": "skip", "why": evidence}
    scores = reference_scores(reference, ids[:-1], prompt, floor)
    sources.add(scores.floor_source)
    known = range(len(vocab.pieces))
    scored = [Scored(vocab.pieces[tid], got.get(tid), {vocab.pieces[i]: v for i, v in got.items() if i in known})
              for tid, got in zip(served.ids[1:], served.logprobs[1:], strict=True)] + list(served.scored)
    metrics = position_metrics(scores, scored, list(ids[1:]), list(range(len(ids) - 1)), vocab, k, [])
    decoded_from = len(served.ids)
    if served.generated:
        evidence += f"; {len(served.generated)} tokens decoded after it, from position {decoded_from}"
    out = {"tokens": len(served.ids), "generated": len(served.generated), "decoded_from": decoded_from,
           "processor": prompt.processor, "image_positions": spans(served.ids, prompt.image_token),
           **judged("images", metrics, 0, profiles, floor is not None),
           "premise": {"confirmed": True, "evidence": evidence}}
    if out["status"] == "fail":
        out["why"] = f"{onset_words(out, out['image_positions'], decoded_from) or out['why']}; {evidence}"
    return out
