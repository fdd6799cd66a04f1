"""Decode positions after images (multimodal RoPE, shared by `cache` and `generate`).

A Qwen-VL-style prompt holding image placeholder grids is numbered by the model's `get_rope_index`: each grid
takes t/h/w positions from one start, and the text after it resumes past the grid's largest position, so the last
prompt position is below the token count and `rope_deltas` (last position + 1 - tokens, negative) is stored for
decoding. Every later token must sit at (tokens so far + rope_deltas) on all three streams. Decode steps that
restart at 0, count tokens (rope_deltas dropped) or freeze are position bugs (mlx-vlm #1983); so is a second image
numbered from the first one's start.

The probe: text, two images of deterministic pixels, text (posdiag.model.multimodal_inputs); the model's rotary
module is watched for the position ids each forward hands it, and every token's positions, the prompt's in the
prefill and the decoded (or generated) ones after it, must equal the layout's numbering of the whole sequence
(posdiag.model.mrope_layout), exactly (integers: no tolerance). The decoded logits must equal the full forward's,
judged like text: against the jitter floor of that full forward (its token embeddings ~1 ulp off, same dtype) and
decided in float64 (posdiag.model.arbitration.arbitrate), so a bug in how the positions are applied, below what the
rotary module is handed, FAILs and float32 rounding PASSes. Applies where the model has get_rope_index, an image
token inside its vocabulary and a vision config with patch sizes; elsewhere a reason, reported by the caller when
the model has multimodal RoPE at all. A crash of the probed path (the cache continuation, generate()) after the
plain forward of the same prompt ran is a FAIL naming the exception; a prompt the plain forward refuses is posdiag's
input, not the model's answer: "not probed", with the reason.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from posdiag.model.arbitration import arbitrate
from posdiag.model.caches import cache_keyword, new_cache
from posdiag.model.jitter import FLOOR_SOURCE, jittered
from posdiag.model.mrope_layout import layout_positions
from posdiag.model.multimodal_inputs import MultimodalPrompt, Span, build_prompt, in_model_dtype
from posdiag.model.quiet import transformers_quiet
from posdiag.model.subject import Subject
from posdiag.model.tensors import relative_l2
from posdiag.results import CheckResult, Status
from posdiag.tools import mrope, rope_math
from posdiag.verdict import FloorVerdict, judge_agreement, noise_floor, powered, worst_error


@dataclass
class Watch:
    """Position ids the language model's rotary module received, forward by forward ([3, T] each)."""

    seen: list[torch.Tensor] = field(default_factory=list)

    def hook(self, _module, args, kwargs):
        pos = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        if isinstance(pos, torch.Tensor):
            pos = pos.detach().cpu()
            pos = pos[-3:] if pos.ndim == 3 else pos[:1].expand(3, -1)  # [4, B, T] leads with the text positions
            self.seen.append(pos[:, 0] if pos.ndim == 3 else pos)

    def mismatch(self, expected: torch.Tensor, start: int, spans: tuple[Span, ...] = ()) -> str:
        """The first position (index >= start) that differs from `expected` [3, T], named ('' if none): a prompt
        token by its span, a later one by its decode step."""
        got = torch.cat(self.seen, dim=-1) if self.seen else torch.zeros(3, 0, dtype=torch.long)
        if got.shape[-1] < expected.shape[-1]:
            return f"the rotary module saw {got.shape[-1]} positions for {expected.shape[-1]} tokens"
        prompt = spans[-1].stop if spans else 0
        for t in range(start, expected.shape[-1]):
            if not torch.equal(got[:, t], expected[:, t]):
                e, g = (tuple(int(x) for x in v[:, t]) for v in (expected, got))
                if t < prompt:
                    span = next(s for s in spans if s.start <= t < s.stop)
                    return f"token {t} of {span.name()} ran at (t, h, w) = {g}; the layout puts it at {e}"
                deltas = int(expected[:, :prompt].max()) + 1 - prompt
                return (f"token {t} (decode step {t - prompt}) ran at (t, h, w) = {g}; after the images the "
                        f"layout puts it at {e} (rope_deltas {deltas})")
        return ""


def image_prompt(subject: Subject, seed: int) -> tuple[MultimodalPrompt | None, str]:
    """The probe's prompt (two images between text), or why this model gets none."""
    prompt, why = build_prompt(subject.model, seed, video=False)
    if prompt is None:
        return None, why
    try:
        pos = prompt.numbering()
    except Exception as exc:
        return None, f"get_rope_index raised {type(exc).__name__} on an image prompt"
    if int(pos.max()) + 1 >= prompt.ids.shape[1]:
        return None, "get_rope_index numbers the image prompt like text (no rope_deltas to carry)"
    return prompt, ""


def expected_positions(prompt: MultimodalPrompt, length: int) -> torch.Tensor:
    """[3, length]: the layout's numbering of the prompt and the text tokens after it."""
    tail = (Span("text", 0, prompt.ids.shape[1], length),) if length > prompt.ids.shape[1] else ()
    return layout_positions(prompt.spans + tail)


@contextlib.contextmanager
def watching(subject: Subject):
    """Watch the language model's rotary module (the first non-vision one) while the block runs."""
    watch = Watch()
    rotary = _rotary(subject)
    handle = None if rotary is None else rotary.register_forward_pre_hook(watch.hook, with_kwargs=True)
    try:
        yield watch
    finally:
        if handle is not None:
            handle.remove()


@contextlib.contextmanager
def slipped(subject: Subject):
    """posdiag's one-position slip on the image paths (their power): while it holds, every forward that continues a
    cache (a decode step, a later prefill chunk) is rotated one position early on all three streams, at the language
    model's rotary module; prefills and the full forward are left alone. Yields the count of forwards it reached."""
    rotary = _rotary(subject)
    state = {"past": 0, "reached": 0}

    def past(_module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        get = getattr(cache, "get_seq_length", None)
        state["past"] = int(get()) if callable(get) else 0

    def early(_module, args, kwargs):
        if state["past"] <= 0:
            return None
        state["reached"] += 1
        if "position_ids" in kwargs:
            return args, {**kwargs, "position_ids": kwargs["position_ids"] - 1}
        return (args[0], args[1] - 1, *args[2:]), kwargs

    handles = [subject.model.register_forward_pre_hook(past, with_kwargs=True)]
    if rotary is not None:
        handles.append(rotary.register_forward_pre_hook(early, with_kwargs=True))
    try:
        yield state
    finally:
        for handle in handles:
            handle.remove()


def _rotary(subject: Subject):
    """The language model's rotary module: the first one that is not the vision tower's (None if none)."""
    return next((m for n, m in subject.model.named_modules() if "Rotary" in type(m).__name__
                 and "vision" not in (n + type(m).__name__).lower()), None)


@dataclass
class ImageRun:
    """One decode (or generate) after the image prompt: positions checked exactly, logits against the full forward."""

    name: str  # "after images: decode" | "after images: generate"
    mismatch: str = ""  # the first decode position off the model's own numbering
    errors: list[float] = field(default_factory=list)  # per new token, relative to the full forward
    floor: float = 0.0  # the full forward against itself with its token embeddings jittered by ~1 ulp
    crashed: str = ""  # the exception the probed path raised after the plain forward of the same input ran
    invalid: str = ""  # the plain forward refused posdiag's input: the probe says nothing about the model


def _named(exc: BaseException) -> str:
    from posdiag.errors import raised_in_posdiag

    if raised_in_posdiag(exc):  # posdiag's own bug: an ERROR, never a verdict about the model
        raise exc
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def _continuation(prompt: MultimodalPrompt, steps: int, seed: int, vocab: int) -> torch.Tensor:
    """Text tokens after the prompt: never a placeholder or delimiter id (those would open another image)."""
    gen = torch.Generator().manual_seed(seed + 1)
    new = torch.randint(0, vocab, (1, steps), generator=gen).to(prompt.ids.device)
    special = _special_ids(prompt)
    ordinary = int(prompt.ids[0, 0])  # the prompt's first token is text drawn from the ordinary ids
    return torch.tensor([[ordinary if v in special else v for v in new[0].tolist()]], device=prompt.ids.device)


def _special_ids(prompt: MultimodalPrompt) -> set[int]:
    """Placeholder and delimiter ids: a generated or continued text token never takes one (it would open an image
    whose pixels the forward does not have)."""
    config = prompt.rope_owner.config
    return {int(v) for v in prompt.ids[0][prompt.vision()].tolist()} | {
        int(getattr(config, k)) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                          "vision_end_token_id") if isinstance(getattr(config, k, None), int)}


def as_run(subject: Subject, inputs: dict[str, Any]) -> dict[str, Any]:
    """`inputs` with the pixels in the model's dtype as it runs now."""
    return in_model_dtype(subject.model, inputs)


def full_forward(subject: Subject, inputs: dict[str, Any], seed: int) -> tuple[torch.Tensor, float]:
    """The reference: one plain forward of the whole sequence (logits [T, V], float64), and its jitter floor (the
    same forward with the token embeddings ~1 ulp off: the rounding the comparison is judged against)."""
    def logits() -> torch.Tensor:
        subject.forward_count += 1
        with torch.inference_mode():
            out = subject.model(**as_run(subject, inputs), use_cache=False, return_dict=True).logits[0]
        return out.detach().to(torch.float64)

    full = logits()
    with jittered(subject, subject.stacks[0], 0, 1, seed, settle_masks=False):
        shaken = logits()
    return full, max(relative_l2(shaken[t], full[t]) for t in range(full.shape[0]))


def decode_after_image(subject: Subject, prompt: MultimodalPrompt, steps: int, seed: int) -> ImageRun:
    """Prefill the image prompt into a new dynamic cache, then decode `steps` text tokens one by one (no position ids:
    the model's own numbering from the stored rope_deltas, as a manual decode loop runs)."""
    run = ImageRun("after images: decode")
    model, n = subject.model, prompt.ids.shape[1]
    full_ids = torch.cat([prompt.ids, _continuation(prompt, steps, seed, model.get_input_embeddings().weight.shape[0])],
                         dim=1)
    try:
        full, run.floor = full_forward(subject, prompt.inputs(full_ids), seed)
    except Exception as exc:
        run.invalid = f"the plain forward of posdiag's image prompt raised {_named(exc)}"
        return run
    try:
        with torch.inference_mode(), watching(subject) as watch:
            passed = {cache_keyword(model): new_cache(subject, "dynamic", max_len=full_ids.shape[1] + 1)}
            model(**as_run(subject, prompt.inputs()), **passed, use_cache=True, return_dict=True)
            outs = [model(input_ids=full_ids[:, t:t + 1], **passed, use_cache=True,
                          return_dict=True).logits[0, -1].to(torch.float64) for t in range(n, full_ids.shape[1])]
        subject.forward_count += 1 + steps
    except Exception as exc:
        run.crashed = _named(exc)
        return run
    run.errors = [relative_l2(o, full[n + i]) for i, o in enumerate(outs)]
    run.mismatch = watch.mismatch(expected_positions(prompt, full_ids.shape[1]), 0, prompt.spans)
    return run


def generate_after_image(subject: Subject, prompt: MultimodalPrompt, new_tokens: int, pad: int, seed: int,
                         name: str = "after images: generate", **extra: Any) -> ImageRun:
    """Greedy generate() from the image prompt (`extra`: generate()'s options, such as prefill_chunk_size): the
    prompt's and the new tokens' positions and logits against one full forward of the generated sequence
    (teacher-forced) and its jitter floor."""
    from posdiag.errors import refused_by_generation

    run = ImageRun(name)
    model, n = subject.model, prompt.ids.shape[1]
    try:
        with torch.inference_mode():
            model(**as_run(subject, prompt.inputs()), use_cache=False, return_dict=True)
        subject.forward_count += 1
    except Exception as exc:
        run.invalid = f"the plain forward of posdiag's image prompt raised {_named(exc)}"
        return run
    try:
        with torch.inference_mode(), watching(subject) as watch, transformers_quiet():
            out = model.generate(**as_run(subject, prompt.inputs()), attention_mask=torch.ones_like(prompt.ids),
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=pad,
                                 suppress_tokens=sorted(_special_ids(prompt)),  # raw logits come back unchanged
                                 disable_compile=True,  # never transformers' automatic compile (generate's --compile)
                                 **extra)
        subject.forward_count += new_tokens
    except Exception as exc:
        if refused_by_generation(exc):  # refused before running: nothing was probed
            run.invalid = f"generate() refused the image prompt: {_named(exc)}"
        else:
            run.crashed = _named(exc)
        return run
    seq = out.sequences
    try:
        full, run.floor = full_forward(subject, prompt.inputs(seq), seed)
    except Exception as exc:
        run.invalid = f"the teacher-forced forward of the generated sequence raised {_named(exc)}"
        return run
    run.errors = [relative_l2(step[0].to(torch.float64), full[n - 1 + i]) for i, step in enumerate(out.logits)]
    # the last new token is never forwarded
    run.mismatch = watch.mismatch(expected_positions(prompt, seq.shape[1])[:, :-1], 0, prompt.spans)
    return run


def has_mrope(subject: Subject) -> bool:
    return any(mrope.mrope_section(s.params) for s in rope_math.rope_specs(subject.config) or [])


def with_image_decode(result: CheckResult, subject: Subject, seed: int, probe,
                      key: str = "after_image") -> CheckResult:
    """`result` with the after-an-image probe folded in (models with multimodal RoPE only; others unchanged).

    probe(prompt) -> ImageRun. Decode positions off the model's own numbering FAIL (exact integers); the logits are
    judged as agreement against the run's jitter floor and decided in float64 like text (arbitrate: in half precision
    always, in float32 where they are not a pass), so a FAIL is a bug and rounding PASSes; a probe that cannot run
    is named after "not probed"."""
    if result.status is Status.SKIP or not has_mrope(subject):
        return result
    prompt, why = image_prompt(subject, seed)
    run = None if prompt is None else probe(prompt)
    if run is not None and run.crashed:  # the model's own path crashed on an input its plain forward runs
        text = f"{run.name} raised {run.crashed} (the plain forward of the same prompt runs)"
        summary = f"{result.summary}; {text}" if result.status is Status.FAIL else text
        return _replaced(result, Status.FAIL, summary, {key: {"path": run.name, "crashed": run.crashed}})
    if run is None or run.invalid:
        why = run.invalid if run is not None else why
        return _replaced(result, result.status, f"{result.summary}; not probed: decode after images ({why})",
                         {key: {"not_probed": why}})
    deltas = int(expected_positions(prompt, 0).max()) + 1 - prompt.ids.shape[1]
    info: dict[str, Any] = {"path": run.name, "rope_deltas": deltas, "mismatch": run.mismatch, "errors": run.errors}
    if run.mismatch:
        text = f"{run.name}: {run.mismatch}"
        return _replaced(result, Status.FAIL, text if result.status is not Status.FAIL else f"{result.summary}; {text}",
                         {key: info})
    agreed, verdict, decided = _judged(subject, probe, prompt, run, info)
    if agreed and verdict.status is not Status.PASS:  # within tolerance, but a slip would have been too: no power
        text = (f"{run.name}: positions continue from rope_deltas {deltas} ({len(run.errors)} tokens, "
                f"{verdict.ratio:.3g}x noise floor), but {verdict.reason}")
        return _replaced(result, Status.worst([result.status, verdict.status]), f"{result.summary}; {text}",
                         {key: info})
    if verdict.status is not Status.PASS:
        text = (f"{run.name}: positions continue from rope_deltas {deltas}, but the logits differ from the full "
                f"forward by {verdict.residual:.3g} = {verdict.ratio:.3g}x the noise floor{decided}")
        if verdict.status is Status.FAIL and result.status is not Status.FAIL:
            return _replaced(result, Status.FAIL, f"{text}; text: {result.summary}", {key: info})
        return _replaced(result, Status.worst([result.status, verdict.status]), f"{result.summary}; {text}",
                         {key: info})
    return _replaced(result, result.status, f"{result.summary}; {run.name}: positions continue from rope_deltas "
                     f"{deltas} ({len(run.errors)} tokens, {verdict.ratio:.3g}x noise floor{decided})", {key: info})


def _judged(subject: Subject, probe, prompt: MultimodalPrompt, run: ImageRun,
            info: dict[str, Any]) -> tuple[bool, FloorVerdict, str]:
    """The logits judged like text: agreement against the run's jitter floor, decided in float64 (arbitrate), and a
    PASS checked for power (the path slipped one position). Returns whether they agreed, the verdict after the power
    check and the clause the summary carries; `info` takes the figures."""
    dtype = subject.dtype_name
    verdict = judge_agreement(worst_error(run.errors), run.floor, dtype)
    arbitration = arbitrate(subject, lambda: _again(probe, prompt), run.floor, {"logits": verdict}, dtype,
                            lambda again: (again.floor, {"logits": worst_error(again.errors)}))
    verdict = arbitration.verdicts.get("logits", verdict)
    agreed = verdict.status is Status.PASS
    slip, info["slip"] = _slip(subject, probe, prompt, run.floor, dtype) if agreed else \
        (None, {"error": None, "dtype": dtype, "how": "not planted: the path did not agree"})
    decided64 = bool(arbitration.details.get("arbitration", {}).get("ran"))
    verdicts, power = powered({"logits": verdict}, slip, run.floor, dtype, decided64, "its continued forwards")
    verdict = verdicts["logits"]
    info.update(noise_floor=verdict.noise_floor, floor_source=FLOOR_SOURCE, ratio=verdict.ratio, **arbitration.details)
    return agreed, verdict, arbitration.clause("logits") + (f"; {power}" if power else "")


def _slip(subject: Subject, probe, prompt: MultimodalPrompt, floor: float, dtype: str) -> tuple[float | None, dict]:
    """The path's power: the same probe with every continued forward one position early (slipped), its error against
    the same full forward, in the same dtype (None where the slip reached no forward or the slipped path did not run:
    no power claimed)."""
    if subject.as_stored_pass:
        return None, {"error": None, "dtype": dtype, "how": "not planted in the stored-dtype pass (float32 measured)"}
    with slipped(subject) as state:
        run = probe(prompt)
    if not state["reached"] or run.crashed or run.invalid:
        return None, {"error": None, "dtype": dtype, "how": "not planted: " + (
            "no forward continued a cache" if not state["reached"] else run.crashed or run.invalid)}
    error = worst_error(run.errors)
    return error, {"error": error, "dtype": dtype, "ratio": error / noise_floor(floor, dtype),
                   "how": f"{state['reached']} continued forwards rotated one position early"}


def _again(probe, prompt: MultimodalPrompt) -> ImageRun:
    """The probe re-run (in float64, by arbitrate); a re-run that could not compute the path is no measurement
    (RuntimeError: run_finer tries its next conversion way, then says why none ran)."""
    run = probe(prompt)
    if run.crashed or run.invalid or run.mismatch:
        raise RuntimeError(f"{run.name} re-run: {run.crashed or run.invalid or run.mismatch}")
    return run


def _replaced(result: CheckResult, status: Status, summary: str, details: dict) -> CheckResult:
    from dataclasses import replace

    return replace(result, status=status, summary=summary, details={**result.details, **details})
