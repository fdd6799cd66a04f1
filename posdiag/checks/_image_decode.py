"""Decode positions after an image (multimodal RoPE, shared by `cache` and `generate`).

A Qwen-VL-style prompt holding an image placeholder grid is numbered by the model's `get_rope_index`: the grid
takes t/h/w positions from one start, and the text after it resumes at start + max(h, w), so the last prompt
position is below the token count and `rope_deltas` (last position + 1 - tokens, negative) is stored for decoding.
Every later token must sit at (tokens so far + rope_deltas) on all three streams: exactly where the model's own
get_rope_index puts it when the whole sequence is numbered at once. Decode steps that restart at 0, count tokens
(rope_deltas dropped) or freeze are position bugs (mlx-vlm #1983).

The probe: text + a grid of image tokens + text, with random pixel values of the vision config's patch shape
(the tiny towers of tests cost milliseconds) and `image_grid_thw`; the model's rotary module is watched for the
position ids each forward hands it, and the decoded (or generated) tokens' positions must equal the whole
sequence's get_rope_index numbering, exactly (integers: no tolerance). The caller also compares the decoded
logits with the full forward. Applies where the model has get_rope_index, an image token inside its
vocabulary and a vision config with patch sizes; elsewhere a reason, reported by the caller when the model has
multimodal RoPE at all. A crash of the probed path (the cache continuation, generate()) after the plain forward
of the same prompt ran is a FAIL naming the exception; a prompt the plain forward refuses is posdiag's input, not
the model's answer: "not probed", with the reason.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from posdiag.model.caches import cache_keyword
from posdiag.model.quiet import transformers_quiet
from posdiag.model.subject import Subject
from posdiag.results import CheckResult, Status
from posdiag.tools import mrope, rope_math
from posdiag.verdict import FAIL_RATIO, noise_floor

GRID = 4  # merged image tokens per side (16 image tokens; rope_deltas = -12)
TEXT = 3  # text tokens before and after the grid


@dataclass
class ImagePrompt:
    ids: torch.Tensor  # [1, T] prompt ids, the grid's tokens the image token
    kinds: torch.Tensor  # [1, T] mm_token_type_ids (1 on the grid)
    pixel_values: torch.Tensor
    grid_thw: torch.Tensor  # [1, 3] in patches
    rope_owner: Any  # the module whose get_rope_index numbers a sequence

    def inputs(self, ids: torch.Tensor | None = None) -> dict[str, Any]:
        """Model inputs for `ids` (default: the prompt) that start with the prompt; later tokens are text."""
        ids = self.ids if ids is None else ids
        kinds = torch.zeros_like(ids, dtype=self.kinds.dtype)
        kinds[:, : self.kinds.shape[1]] = self.kinds
        return {"input_ids": ids, "mm_token_type_ids": kinds, "pixel_values": self.pixel_values,
                "image_grid_thw": self.grid_thw}

    def positions(self, ids: torch.Tensor) -> torch.Tensor:
        """[3, T] positions of `ids` as the model's own get_rope_index numbers the whole sequence."""
        inputs = self.inputs(ids)
        with torch.inference_mode():
            pos, _ = self.rope_owner.get_rope_index(inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"],
                                                    image_grid_thw=self.grid_thw)
        return pos[:, 0].cpu()


@dataclass
class Watch:
    """Position ids the language model's rotary module received, forward by forward ([3, T] each)."""

    seen: list[torch.Tensor] = field(default_factory=list)

    def hook(self, _module, args, kwargs):
        pos = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        if isinstance(pos, torch.Tensor):
            pos = pos.detach().cpu()
            self.seen.append(pos.expand(3, -1, -1)[:, 0] if pos.ndim == 3 else pos[0].expand(3, -1))

    def mismatch(self, expected: torch.Tensor, start: int) -> str:
        """The first decode position (index >= start) that differs from `expected` [3, T], named; '' if none."""
        got = torch.cat(self.seen, dim=-1) if self.seen else torch.zeros(3, 0, dtype=torch.long)
        if got.shape[-1] < expected.shape[-1]:
            return f"the rotary module saw {got.shape[-1]} positions for {expected.shape[-1]} tokens"
        for t in range(start, expected.shape[-1]):
            if not torch.equal(got[:, t], expected[:, t]):
                e, g = (tuple(int(x) for x in v[:, t]) for v in (expected, got))
                deltas = int(expected[0, -1]) + 1 - expected.shape[-1]
                return (f"token {t} (decode step {t - start}) ran at (t, h, w) = {g}; after the image grid the "
                        f"model's own numbering puts it at {e} (rope_deltas {deltas})")
        return ""


def image_prompt(subject: Subject, seed: int) -> tuple[ImagePrompt | None, str]:
    """The probe's prompt, or why this model gets none."""
    model = subject.model
    config = getattr(model, "config", None)
    # the inner model first: it stores rope_deltas and generate() calls its get_rope_index
    owner = next((m for m in (getattr(model, "model", None), model) if callable(getattr(m, "get_rope_index", None))),
                 None)
    vision = getattr(config, "vision_config", None)
    image_token = getattr(config, "image_token_id", None)
    if owner is None or vision is None or image_token is None:
        return None, "no get_rope_index, vision config or image token to build an image prompt from"
    vocab = model.get_input_embeddings().weight.shape[0]
    if not 0 <= int(image_token) < vocab:
        return None, f"the image token {image_token} is outside the {vocab}-row embedding"
    patch, temporal = getattr(vision, "patch_size", None), getattr(vision, "temporal_patch_size", 1) or 1
    channels = getattr(vision, "in_channels", None) or getattr(vision, "in_chans", None) or 3
    merge = int(getattr(vision, "spatial_merge_size", 1) or 1)
    if not patch:
        return None, "the vision config gives no patch size"
    side = GRID * merge
    gen = torch.Generator().manual_seed(seed)
    text = torch.randint(0, vocab, (2 * TEXT,), generator=gen)
    text[text == int(image_token)] = (int(image_token) + 1) % vocab
    ids = torch.cat([text[:TEXT], torch.full((GRID * GRID,), int(image_token)), text[TEXT:]])[None]
    kinds = torch.zeros_like(ids, dtype=torch.int)
    kinds[0, TEXT:TEXT + GRID * GRID] = 1
    dtype = next(model.parameters()).dtype
    pixels = torch.randn(side * side, channels * temporal * patch * patch, generator=gen).to(dtype)
    prompt = ImagePrompt(ids.to(subject.device), kinds.to(subject.device), pixels.to(subject.device),
                         torch.tensor([[1, side, side]], device=subject.device), owner)
    try:
        pos = prompt.positions(prompt.ids)
    except Exception as exc:
        return None, f"get_rope_index raised {type(exc).__name__} on an image prompt"
    if int(pos.max()) + 1 >= ids.shape[1]:
        return None, "get_rope_index numbers the image prompt like text (no rope_deltas to carry)"
    return prompt, ""


@contextlib.contextmanager
def watching(subject: Subject):
    """Watch the language model's rotary module (the first non-vision one) while the block runs."""
    watch = Watch()
    rotary = next((m for n, m in subject.model.named_modules() if "Rotary" in type(m).__name__
                   and "vision" not in (n + type(m).__name__).lower()), None)
    handle = None if rotary is None else rotary.register_forward_pre_hook(watch.hook, with_kwargs=True)
    try:
        yield watch
    finally:
        if handle is not None:
            handle.remove()


@dataclass
class ImageRun:
    """One decode (or generate) after the image prompt: positions checked exactly, logits against the full forward."""

    name: str  # "after an image: decode" | "after an image: generate"
    mismatch: str = ""  # the first decode position off the model's own numbering
    errors: list[float] = field(default_factory=list)  # per new token, relative to the full forward
    floor: float = 0.0  # prompt positions: prefill vs the full forward
    crashed: str = ""  # the exception the probed path raised after the plain forward of the same input ran
    invalid: str = ""  # the plain forward refused posdiag's input: the probe says nothing about the model


def _named(exc: BaseException) -> str:
    from posdiag.errors import raised_in_posdiag

    if raised_in_posdiag(exc):  # posdiag's own bug: an ERROR, never a verdict about the model
        raise exc
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def _continuation(prompt: ImagePrompt, steps: int, seed: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    new = torch.randint(0, vocab, (1, steps), generator=gen).to(prompt.ids.device)
    image = int(prompt.ids[0, TEXT])
    return new.masked_fill(new == image, (image + 1) % vocab)


def decode_after_image(subject: Subject, prompt: ImagePrompt, cache: Any, steps: int, seed: int) -> ImageRun:
    """Prefill the image prompt into `cache`, then decode `steps` text tokens one by one (no position ids: the
    model's own numbering from the stored rope_deltas, as a manual decode loop runs)."""
    from posdiag.model.tensors import relative_l2

    run = ImageRun("after an image: decode")
    model, n = subject.model, prompt.ids.shape[1]
    full_ids = torch.cat([prompt.ids, _continuation(prompt, steps, seed, model.get_input_embeddings().weight.shape[0])],
                         dim=1)
    try:
        with torch.inference_mode():
            full = model(**prompt.inputs(full_ids), use_cache=False, return_dict=True).logits[0]
        subject.forward_count += 1
    except Exception as exc:
        run.invalid = f"the plain forward of posdiag's image prompt raised {_named(exc)}"
        return run
    try:
        with torch.inference_mode(), watching(subject) as watch:
            passed = {cache_keyword(model): cache}
            first = model(**prompt.inputs(), **passed, use_cache=True, return_dict=True).logits[0]
            outs = [model(input_ids=full_ids[:, t:t + 1], **passed, use_cache=True,
                          return_dict=True).logits[0, -1] for t in range(n, full_ids.shape[1])]
        subject.forward_count += 1 + steps
    except Exception as exc:
        run.crashed = _named(exc)
        return run
    run.floor = max(relative_l2(first[t], full[t]) for t in range(n))
    run.errors = [relative_l2(o, full[n + i]) for i, o in enumerate(outs)]
    run.mismatch = watch.mismatch(prompt.positions(full_ids), n)
    return run


def generate_after_image(subject: Subject, prompt: ImagePrompt, new_tokens: int, pad: int) -> ImageRun:
    """Greedy generate() from the image prompt: the new tokens' positions and logits against one full forward of
    the generated sequence (teacher-forced)."""
    from posdiag.errors import refused_by_generation
    from posdiag.model.tensors import relative_l2

    run = ImageRun("after an image: generate")
    model, n = subject.model, prompt.ids.shape[1]
    try:
        with torch.inference_mode():
            model(**prompt.inputs(), use_cache=False, return_dict=True)
        subject.forward_count += 1
    except Exception as exc:
        run.invalid = f"the plain forward of posdiag's image prompt raised {_named(exc)}"
        return run
    try:
        with torch.inference_mode(), watching(subject) as watch, transformers_quiet():
            out = model.generate(**prompt.inputs(), attention_mask=torch.ones_like(prompt.ids),
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=pad,
                                 disable_compile=True)  # never transformers' automatic compile (generate's --compile)
        subject.forward_count += new_tokens
    except Exception as exc:
        if refused_by_generation(exc):  # refused before running: nothing was probed
            run.invalid = f"generate() refused the image prompt: {_named(exc)}"
        else:
            run.crashed = _named(exc)
        return run
    seq = out.sequences
    try:
        with torch.inference_mode():
            full = model(**prompt.inputs(seq), use_cache=False, return_dict=True).logits[0]
        subject.forward_count += 1
    except Exception as exc:
        run.invalid = f"the teacher-forced forward of the generated sequence raised {_named(exc)}"
        return run
    run.floor = 0.0  # generate() gives logits of new tokens only; the caller's floor applies
    run.errors = [relative_l2(step[0], full[n - 1 + i]) for i, step in enumerate(out.logits)]
    run.mismatch = watch.mismatch(prompt.positions(seq)[:, :-1], n)  # the last new token is never forwarded
    return run


def has_mrope(subject: Subject) -> bool:
    return any(mrope.mrope_section(s.params) for s in rope_math.rope_specs(subject.config) or [])


def with_image_decode(result: CheckResult, subject: Subject, seed: int, probe) -> CheckResult:
    """`result` with the after-an-image probe folded in (models with multimodal RoPE only; others unchanged).

    probe(prompt) -> ImageRun. Decode positions off the model's own numbering FAIL (exact integers); logits
    beyond the run dtype's tolerance with the positions right are a WARN (the cache paths above judge logits,
    with float64 arbitration); a probe that cannot run is named after "not probed"."""
    if result.status is Status.SKIP or not has_mrope(subject):
        return result
    prompt, why = image_prompt(subject, seed)
    run = None if prompt is None else probe(prompt)
    if run is not None and run.crashed:  # the model's own path crashed on an input its plain forward runs
        text = f"{run.name} raised {run.crashed} (the plain forward of the same prompt runs)"
        summary = f"{result.summary}; {text}" if result.status is Status.FAIL else text
        return _replaced(result, Status.FAIL, summary, {"after_image": {"path": run.name, "crashed": run.crashed}})
    if run is None or run.invalid:
        why = run.invalid if run is not None else why
        return _replaced(result, result.status, f"{result.summary}; not probed: decode after an image ({why})",
                         {"after_image": {"not_probed": why}})
    floor = noise_floor(run.floor, subject.dtype_name)
    worst = max(run.errors, default=0.0)
    deltas = int(prompt.positions(prompt.ids).max()) + 1 - prompt.ids.shape[1]
    info = {"after_image": {"path": run.name, "rope_deltas": deltas, "mismatch": run.mismatch, "errors": run.errors,
                            "noise_floor": floor}}
    if run.mismatch:
        status, text = Status.FAIL, f"{run.name}: {run.mismatch}"
        return _replaced(result, status, text if result.status is not Status.FAIL else f"{result.summary}; {text}",
                         info)
    if not worst <= FAIL_RATIO * floor:
        text = (f"{run.name}: positions continue from rope_deltas {deltas}, but the logits differ from the full "
                f"forward by {worst:.3g} = {worst / floor:.3g}x the noise floor (not arbitrated)")
        return _replaced(result, Status.worst([result.status, Status.WARN]), f"{result.summary}; {text}", info)
    return _replaced(result, result.status, f"{result.summary}; {run.name}: positions continue from rope_deltas "
                     f"{deltas} ({len(run.errors)} tokens, {worst / floor:.3g}x noise floor)", info)


def _replaced(result: CheckResult, status: Status, summary: str, details: dict) -> CheckResult:
    from dataclasses import replace

    return replace(result, status=status, summary=summary, details={**result.details, **details})
