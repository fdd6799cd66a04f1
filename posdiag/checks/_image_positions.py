"""`positions` with images and a video (multimodal RoPE): numbered as the layout calls for, each axis read.

Two questions on a prompt of two still images and a 4-frame video between text (posdiag.model.multimodal_inputs, the
video as the family's processor writes it: a table keyed on the model type):
1. Numbering. The positions the forward really applies, observed at the language model's rotary module during the
   model's plain forward (never get_rope_index called aside: a bug in the forward's own numbering shows), must number
   every span as the layout does (posdiag.model.mrope_layout: the second image from where the text before it ends, the
   video's temporal index by its interval, the text after a block past the block's largest position). Integers: a span
   off the layout FAILs naming it and the axes that differ, with how far the outputs from there move against the same
   forward given the layout's positions.
2. Each axis read. With the layout's positions handed in, each of t, h, w is shifted on the vision tokens alone; the
   outputs from the first vision token on must move (position signal against a floor: every position of every axis
   shifted alike, which RoPE's relativity leaves unchanged but for rounding). An axis whose shift moves nothing is
   not rotated: a FAIL naming the axis and its pairs (the section boundaries). Chunked layouts give h and w the
   slowest pairs, whose signal can sit near float32's rounding: a verdict not clear in the run dtype is decided with
   the measurement re-run in float64.
The video proves it ran: a prompt of images and a video that the plain forward refuses is run again as its parts (the
images alone, the video alone); a crash of what the family's own processor would write is a FAIL naming the exception
(the parts that ran are still judged). A type whose video layout posdiag does not know, or without a video token, gets
images only, and the summary says so first. A prompt posdiag cannot build, or images the plain forward refuses (a
vision tower that cannot run here), is "not probed" with the reason, and the text verdict stands.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from posdiag.checks._image_decode import has_mrope, watching
from posdiag.errors import describe_error, raised_in_posdiag
from posdiag.model.arbitration import decide_signal
from posdiag.model.mrope_layout import AXES, Departure, departures, layout_positions
from posdiag.model.multimodal_inputs import MultimodalPrompt, build_prompt, in_model_dtype, video_refusal
from posdiag.model.subject import Subject
from posdiag.model.tensors import relative_l2
from posdiag.results import CheckResult, Status, Table
from posdiag.tools import mrope, rope_math
from posdiag.verdict import FloorVerdict, judge_position_signal

SHIFT = 5  # positions an axis moves by on the vision tokens (and every axis everywhere, for the floor)


@dataclass
class AxisProbe:
    """The forwards of the per-axis question: the layout's positions, each axis shifted, all shifted (the floor)."""

    subject: Subject
    prompt: MultimodalPrompt
    layout: torch.Tensor  # [3, T]

    def measure(self) -> dict[str, torch.Tensor]:
        vision = self.prompt.vision().cpu()
        runs = {"layout": self.layout, "floor": self.layout + SHIFT}
        for a, axis in enumerate(AXES):
            moved = self.layout.clone()
            moved[a, vision] += SHIFT
            runs[axis] = moved
        return {name: _logits(self.subject, self.prompt, pos) for name, pos in runs.items()}

    def figures(self, axis: str):
        first = int(self.prompt.vision().nonzero()[0])

        def of(out: dict[str, torch.Tensor]) -> tuple[float, float, str]:
            ref = out["layout"][first:]
            return (relative_l2(out[axis][first:], ref), relative_l2(out["floor"][first:], ref),
                    f"every axis of every position shifted by {SHIFT}")
        return of


@dataclass
class Ran:
    """One prompt's plain forward: its logits and the positions the rotary module was handed ([3, T])."""

    prompt: MultimodalPrompt
    own: torch.Tensor
    observed: torch.Tensor


@dataclass
class ImageOutcome:
    runs: list[Ran] = field(default_factory=list)  # the prompt (or its parts, where together they crashed)
    not_probed: str = ""
    crashed: str = ""  # what the model's plain forward raised on a prompt its own processor would write
    video_left_out: str = ""  # why the prompt holds no video (the type's layout unknown, no video token)
    departures: list[Departure] = field(default_factory=list)
    moved_by_numbering: float = 0.0  # outputs from the first departure on: own numbering vs the layout's
    axes: dict[str, FloorVerdict] = field(default_factory=dict)
    pairs: dict[str, str] = field(default_factory=dict)  # axis -> its rotary pairs, named

    @property
    def prompt(self) -> MultimodalPrompt:
        return self.runs[0].prompt

    @property
    def contents(self) -> str:
        return " and ".join(r.prompt.contents for r in self.runs) if not self.crashed else \
            ", ".join(f"{r.prompt.contents} alone" for r in self.runs)


def _logits(subject: Subject, prompt: MultimodalPrompt, positions: torch.Tensor | None) -> torch.Tensor:
    kwargs = {} if positions is None else {"position_ids": positions[:, None].to(prompt.ids.device)}
    with torch.inference_mode():
        out = subject.model(**_in_model_dtype(subject, prompt.inputs()), **kwargs, use_cache=False,
                            return_dict=True).logits[0]
    subject.forward_count += 1
    return out.detach().to(torch.float64).cpu()


def _in_model_dtype(subject: Subject, inputs: dict[str, Any]) -> dict[str, Any]:
    """Pixels in the model's dtype as it runs now."""
    return in_model_dtype(subject.model, inputs)


def _plain(subject: Subject, prompt: MultimodalPrompt) -> Ran:
    """The plain forward (no position_ids: the model numbers the prompt itself), its rotary module watched."""
    with watching(subject) as watch:
        own = _logits(subject, prompt, None)
    observed = watch.seen[0] if watch.seen else torch.zeros(3, 0, dtype=torch.long)
    return Ran(prompt, own, observed)


def _pairs(subject: Subject) -> dict[str, str]:
    """axis -> its pairs of the language model's rotary ("pairs 0-3 of 8", or listed where interleaved)."""
    for spec in rope_math.rope_specs(subject.config) or []:
        section = mrope.mrope_section(spec.params)
        if not section:
            continue
        kind = mrope.layout(subject.config, spec.params)
        out = {}
        for axis, pairs in mrope.stream_pairs(section, kind).items():
            listed = [int(p) for p in pairs]
            contiguous = listed == list(range(listed[0], listed[-1] + 1)) if listed else False
            out[axis] = ("no pairs" if not listed else f"pairs {listed[0]}-{listed[-1]}" if contiguous
                         else "pairs " + ",".join(map(str, listed))) + f" of {sum(section)} ({kind})"
        return out
    return {}


def _raised(exc: Exception) -> str:
    if raised_in_posdiag(exc):  # posdiag's own bug: an ERROR, never a verdict about the model
        raise exc
    return describe_error(exc)


def _runnable(subject: Subject, seed: int) -> ImageOutcome:
    """The prompt's plain forward; where images and a video together crash it, each part alone (the crash named)."""
    prompt, why = build_prompt(subject.model, seed)
    if prompt is None:
        return ImageOutcome(not_probed=why)
    left_out = "" if prompt.video_grid_thw is not None else video_refusal(subject.model)
    try:
        return ImageOutcome([_plain(subject, prompt)], video_left_out=left_out)
    except Exception as exc:
        crash = _raised(exc)
    text = f"the model's plain forward of posdiag's prompt ({prompt.contents}) raised {crash}"
    if prompt.video_grid_thw is None:  # the images themselves: the tower or posdiag's prompt
        return ImageOutcome(not_probed=f"{text}: the vision tower or the prompt")
    images, _ = build_prompt(subject.model, seed, video=False)
    video, _ = build_prompt(subject.model, seed, images=False)
    try:
        runs = [_plain(subject, images)]
    except Exception as exc:
        return ImageOutcome(not_probed=f"{text}, and of its 2 images alone {_raised(exc)}: the vision tower or the "
                                       "prompt")
    layout = f"the video as {subject.model.config.model_type}'s processor writes it: {prompt.video_layout.words()}"
    try:
        runs.append(_plain(subject, video))
        crashed = f"{prompt.contents} crashed: {crash} ({layout}; the images alone and the video alone run)"
    except Exception as exc:
        crashed = f"{video.contents} crashed: {_raised(exc)} ({layout}; the images alone run)"
    return ImageOutcome(runs, crashed=crashed)


def probe(subject: Subject, seed: int) -> ImageOutcome:
    outcome = _runnable(subject, seed)
    if not outcome.runs:
        return outcome
    for ran in outcome.runs:
        expected = layout_positions(ran.prompt.spans)
        if ran.observed.shape != expected.shape:
            outcome.runs, outcome.not_probed = [], (
                f"the language model's rotary module was handed {ran.observed.shape[-1]} positions for the "
                f"{expected.shape[-1]}-token prompt ({ran.prompt.contents}): the positions the forward applies could "
                "not be observed")
            return outcome
    outcome.pairs = _pairs(subject)
    first = outcome.runs[0]
    axis_probe = AxisProbe(subject, first.prompt, layout_positions(first.prompt.spans))
    out = axis_probe.measure()
    for ran in outcome.runs:
        found = departures(ran.observed, ran.prompt.spans)
        if found and not outcome.departures:
            layout = out["layout"] if ran is first else _logits(subject, ran.prompt, layout_positions(ran.prompt.spans))
            outcome.moved_by_numbering = relative_l2(ran.own[found[0].token:], layout[found[0].token:])
        outcome.departures += found
    dtype = subject.dtype_name
    finer: list[dict[str, torch.Tensor]] = []  # the float64 re-run, once for every axis it decides

    def measured_once() -> dict[str, torch.Tensor]:
        if not finer:
            finer.append(axis_probe.measure())
        return finer[0]

    for axis in AXES:
        residual, floor, _ = axis_probe.figures(axis)(out)
        verdict = judge_position_signal(residual, floor, dtype)
        if verdict.status is not Status.PASS:  # h and w ride the slowest pairs in chunked layouts: decide in float64
            verdict = decide_signal(subject, verdict, measured_once, axis_probe.figures(axis), dtype)
        outcome.axes[axis] = verdict
    return outcome


def with_image_positions(result: CheckResult, subject: Subject, seed: int) -> CheckResult:
    """`result` with the image-and-video probe folded in (models with multimodal RoPE only; others unchanged)."""
    if result.status in (Status.SKIP, Status.NA) or not has_mrope(subject):
        return result
    outcome = probe(subject, seed)
    if outcome.not_probed:
        return _folded(result, result.status, f"not probed: images and video ({outcome.not_probed})",
                       {"not_probed": outcome.not_probed})
    prompt = outcome.prompt
    details: dict[str, Any] = {
        "tested": prompt.tested, "processor": prompt.processor, "positions_from": OBSERVED,
        "video_layout": prompt.video_layout.words() if prompt.video_layout else "",
        "spans": [s.name() for r in outcome.runs for s in r.prompt.spans if s.kind != "text"],
        "departures": [d.to_dict() for d in outcome.departures], "moved_by_numbering": outcome.moved_by_numbering,
        "crashed": outcome.crashed, "video_not_probed": outcome.video_left_out,
        "axes": {a: {"residual": v.residual, "noise_floor": v.noise_floor, "ratio": v.ratio, "status": v.status.value,
                     "reason": v.reason, "pairs": outcome.pairs.get(a, "")} for a, v in outcome.axes.items()}}
    table = Table(f"multimodal RoPE axes, each shifted by {SHIFT} on the vision tokens ({prompt.tested})",
                  ("axis", "pairs", "residual", "noise floor", "ratio", "status"),
                  tuple((a, outcome.pairs.get(a, "-"), f"{v.residual:.3e}", f"{v.noise_floor:.2e}", f"{v.ratio:.3g}",
                         v.status.value) for a, v in outcome.axes.items()))
    status, texts = _judged(outcome)
    lead = f"images only, video not probed ({outcome.video_left_out}): " if outcome.video_left_out else "images: "
    return _folded(result, status, lead + "; ".join(texts), details, table)


OBSERVED = "the language model's rotary module, watched during the model's plain forward"


def _judged(outcome: ImageOutcome) -> tuple[Status, list[str]]:
    """The verdict and its clauses: a crash, then numbering, then the axes."""
    texts, status = [], Status.PASS
    if outcome.crashed:
        status = Status.FAIL
        texts.append(outcome.crashed)
    if outcome.departures:
        status = Status.FAIL
        texts.append(f"{outcome.departures[0].words()} (as the forward applies it); the outputs from there move "
                     f"{outcome.moved_by_numbering:.3g} against the layout's numbering"
                     + (f" (and {len(outcome.departures) - 1} more spans off)" if len(outcome.departures) > 1 else ""))
    dead = [a for a, v in outcome.axes.items() if v.status is Status.FAIL]
    unsure = [a for a, v in outcome.axes.items() if v.status is Status.WARN]
    if dead:
        status = Status.FAIL
        texts.append("; ".join(f"shifting axis {a} on the vision tokens moves nothing "
                               f"({outcome.pairs.get(a, 'its pairs')}: {_figures(outcome.axes[a])})" for a in dead))
    if unsure:
        status = Status.worst([status, Status.WARN])
        texts.append("; ".join(f"axis {a}: {outcome.axes[a].reason}" for a in unsure))
    if status is Status.PASS or (outcome.crashed and not outcome.departures and not dead):
        moved = ", ".join(f"{a} {_figures(v)}" for a, v in outcome.axes.items())
        texts.append(f"{outcome.contents} numbered as the layout in the forward; each axis moves the outputs ({moved})")
    return status, texts


def _figures(verdict: FloorVerdict) -> str:
    finer = " in float64" if "in float64" in verdict.reason else ""
    return f"{verdict.residual:.2g} = {verdict.ratio:.3g}x the floor{finer}"


def _folded(result: CheckResult, status: Status, text: str, details: dict, table: Table | None = None) -> CheckResult:
    """The text verdict first where it fails; the image finding first where only it fails."""
    worst = Status.worst([result.status, status])
    if status is Status.FAIL and result.status is not Status.FAIL:
        summary = f"{text}; text: {result.summary}"
    else:
        summary = f"{result.summary}; {text}"
    tables = result.tables + ((table,) if table is not None else ())
    return replace(result, status=worst, summary=summary, details={**result.details, "multimodal": details},
                   tables=tables)
