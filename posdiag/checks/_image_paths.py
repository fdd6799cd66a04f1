"""Two more paths an image prompt takes (multimodal RoPE, beside posdiag.checks._image_decode): a chunked prefill
(`cache`) and a left-padded batch (`batch`).

- Chunked prefill: generate() with `prefill_chunk_size` feeds the prompt into its cache a few tokens a forward, the
  images' features encoded once and sliced per chunk, so chunks end inside an image. Every chunk's tokens must run at
  the positions the layout gives them in the whole prompt, and the decoded tokens after it at the layout's too; a
  chunk numbered from its own ids or as text departs (mlx-vlm #1741). Judged as generate()'s image probe is: positions
  exactly, logits against one full forward of the generated sequence, judged against its jitter floor and decided in
  float64 like text (a chunk rotated at other positions than it is handed FAILs on its logits).
- A left-padded batch: the image prompt as row 0 behind padding, beside a longer text row, in one plain forward (the
  model's own numbering from the 2D attention mask, as users batch prompts of different lengths). The row's tokens
  must run at the positions the prompt takes alone (padding is no position), and its logits must equal the prompt's
  alone. A numbering that counts the padding moves every token of the row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from posdiag.checks._image_decode import (
    ImageRun,
    as_run,
    generate_after_image,
    has_mrope,
    image_prompt,
    watching,
    with_image_decode,
)
from posdiag.errors import describe_error, raised_in_posdiag
from posdiag.model.arbitration import arbitrate
from posdiag.model.jitter import FLOOR_SOURCE, jittered
from posdiag.model.mrope_layout import layout_positions
from posdiag.model.multimodal_inputs import MultimodalPrompt
from posdiag.model.subject import Subject
from posdiag.model.tensors import relative_l2
from posdiag.results import CheckResult, Status
from posdiag.verdict import judge_agreement, worst_error

CHUNK = 5  # tokens a prefill forward: chunks end inside both images of posdiag's prompt (tokens 4-7 and 13-18)
PADDING = 4  # padding columns before the image row


def _pad_id(subject: Subject) -> int:
    pad = getattr(subject.config, "pad_token_id", None)
    return pad if isinstance(pad, int) and 0 <= pad < subject.vocab_size else 0


def with_chunked_prefill(result: CheckResult, subject: Subject, seed: int, new_tokens: int) -> CheckResult:
    """`result` with the chunked prefill of the image prompt folded in (after the decode probe, whose reason stands
    where no image prompt can be built)."""
    if result.status is Status.SKIP or not has_mrope(subject) or "not_probed" in result.details.get("after_image", {}):
        return result
    return with_image_decode(result, subject, seed, lambda prompt: generate_after_image(
        subject, prompt, new_tokens, _pad_id(subject), seed, f"images: chunked prefill ({CHUNK} tokens a forward)",
        prefill_chunk_size=CHUNK), key="chunked_prefill")


@dataclass
class PaddedRow:
    """The padded image row's figures: each token's logits against the prompt alone, and the same-forward floor (the
    prompt alone with its token embeddings jittered by ~1 ulp)."""

    errors: list[float]
    floor: float
    seen: list[torch.Tensor]  # the positions the rotary module was handed in the batch's forward


def _padded_inputs(subject: Subject, prompt: MultimodalPrompt, seed: int) -> tuple[dict[str, Any], torch.Tensor]:
    n, pad = prompt.ids.shape[1], _pad_id(subject)
    text = subject.sample_ids(1, n + PADDING, seed + 4127).to(prompt.ids.device)
    row = torch.cat([torch.full((1, PADDING), pad, device=prompt.ids.device), prompt.ids], dim=1)
    kinds = torch.cat([torch.zeros(1, PADDING, dtype=prompt.kinds.dtype, device=prompt.kinds.device), prompt.kinds], 1)
    mask = torch.ones(2, n + PADDING, dtype=torch.long, device=prompt.ids.device)
    mask[0, :PADDING] = 0
    inputs = {**prompt.inputs(torch.cat([row, text])), "mm_token_type_ids": torch.cat([kinds, torch.zeros_like(kinds)])}
    return inputs, mask


def _measure_padded(subject: Subject, prompt: MultimodalPrompt, seed: int) -> PaddedRow:
    """The prompt alone, alone jittered (the floor) and as the padded row, in the model's dtype as it runs now."""
    n = prompt.ids.shape[1]
    inputs, mask = _padded_inputs(subject, prompt, seed)
    alone = _logits(subject, prompt.inputs())[0]
    with jittered(subject, subject.stacks[0], 0, 1, seed, settle_masks=False):
        shaken = _logits(subject, prompt.inputs())[0]
    with watching(subject) as watch:
        batch = _logits(subject, inputs, attention_mask=mask)[0, PADDING:]
    return PaddedRow([relative_l2(batch[t], alone[t]) for t in range(n)],
                     max(relative_l2(shaken[t], alone[t]) for t in range(n)), watch.seen)


def padded_image_row(subject: Subject, prompt: MultimodalPrompt, seed: int) -> tuple[ImageRun, PaddedRow | None]:
    """The image prompt as row 0 of a left-padded batch vs alone: its positions and logits."""
    run = ImageRun("image prompt in a left-padded batch")
    try:
        _logits(subject, prompt.inputs())
    except Exception as exc:
        run.invalid = f"the plain forward of posdiag's image prompt raised {_named(exc)}"
        return run, None
    try:
        measured = _measure_padded(subject, prompt, seed)
    except Exception as exc:
        run.crashed = _named(exc)
        return run, None
    got = torch.cat(measured.seen, dim=-1)[:, PADDING:] if measured.seen else torch.zeros(3, 0, dtype=torch.long)
    run.mismatch = _first_departure(got, layout_positions(prompt.spans), prompt)
    run.errors, run.floor = measured.errors, measured.floor
    return run, measured


def _logits(subject: Subject, inputs: dict[str, Any], **extra: Any) -> torch.Tensor:
    """Logits in float64, the pixels cast to the model's dtype as it runs now (a float64 re-run converts the model)."""
    subject.forward_count += 1
    with torch.inference_mode():
        out = subject.model(**as_run(subject, inputs), **extra, use_cache=False, return_dict=True)
    return out.logits.detach().to(torch.float64)


def _named(exc: BaseException) -> str:
    if raised_in_posdiag(exc):  # posdiag's own bug: an ERROR, never a verdict about the model
        raise exc
    return describe_error(exc)


def _first_departure(got: torch.Tensor, expected: torch.Tensor, prompt: MultimodalPrompt) -> str:
    if got.shape != expected.shape:
        return f"the rotary module saw {got.shape[-1]} positions for the row's {expected.shape[-1]} tokens"
    for t in range(expected.shape[-1]):
        if not torch.equal(got[:, t], expected[:, t]):
            span = next(s for s in prompt.spans if s.start <= t < s.stop)
            g, e = (tuple(int(x) for x in v[:, t]) for v in (got, expected))
            return f"token {t} of {span.name()} ran at (t, h, w) = {g} behind {PADDING} padding tokens; alone at {e}"
    return ""


def with_padded_image_row(result: CheckResult, subject: Subject, seed: int) -> CheckResult:
    """`result` with the image prompt's left-padded row folded in (models with multimodal RoPE only): positions exactly,
    logits against the prompt alone judged as agreement against a measured floor and decided in float64 like text."""
    if result.status in (Status.SKIP, Status.NA) or not has_mrope(subject):
        return result
    prompt, why = image_prompt(subject, seed)
    run, _ = padded_image_row(subject, prompt, seed) if prompt is not None else (None, None)
    if run is None or run.invalid:
        why = run.invalid if run is not None else why
        return _folded(result, result.status, f"not probed: an image prompt in a padded batch ({why})",
                       {"not_probed": why})
    info: dict[str, Any] = {"path": run.name, "mismatch": run.mismatch, "errors": run.errors, "crashed": run.crashed}
    if run.crashed:
        return _folded(result, Status.FAIL, f"{run.name} raised {run.crashed} (the prompt alone runs)", info)
    if run.mismatch:
        return _folded(result, Status.FAIL, f"{run.name}: {run.mismatch}", info)
    dtype = subject.dtype_name
    verdict = judge_agreement(worst_error(run.errors), run.floor, dtype)
    arbitration = arbitrate(subject, lambda: _measure_padded(subject, prompt, seed), run.floor, {"row": verdict},
                            dtype, lambda m: (m.floor, {"row": worst_error(m.errors)}))
    verdict = arbitration.verdicts.get("row", verdict)
    info.update(noise_floor=verdict.noise_floor, floor_source=FLOOR_SOURCE, ratio=verdict.ratio, **arbitration.details)
    decided = arbitration.clause("row")
    if verdict.status is not Status.PASS:
        return _folded(result, verdict.status, f"{run.name}: numbered as alone, but the row's logits differ from the "
                       f"prompt's alone by {verdict.residual:.3g} = {verdict.ratio:.3g}x the noise floor{decided}",
                       info)
    return _folded(result, Status.PASS, f"{run.name}: the image row is numbered and computed as alone "
                   f"({prompt.contents}, {len(run.errors)} tokens, {verdict.ratio:.3g}x noise floor{decided})", info)


def _folded(result: CheckResult, status: Status, text: str, details: dict) -> CheckResult:
    """The text verdict first where it fails; the image finding first where only it fails."""
    worst = Status.worst([result.status, status])
    summary = f"{text}; text: {result.summary}" if status is Status.FAIL and result.status is not Status.FAIL \
        else f"{result.summary}; {text}"
    return replace(result, status=worst, summary=summary, details={**result.details, "padded_image": details})
