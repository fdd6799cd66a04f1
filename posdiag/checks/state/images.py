"""The sequences of `state` with images, for models with multimodal RoPE (Qwen-VL style `rope_deltas`).

An image prompt leaves the model holding its `rope_deltas` (the offset between its positions and its token count:
images take fewer positions than tokens), and the model reads them back when a cached call continues. A text prompt
after it must not take them: its decode steps would run at positions the image prompt's offset moved (transformers
#36013, mlx-vlm #756, TensorRT-LLM #15661). The call under test is the decode loop users write by hand: the prompt
prefilled into a cache, then one token a call with the cache passed, with no position_ids (the model's own numbering)
and with them (the caller's); its logits at every step are compared with the same loop on a fresh model. The
histories: one plain forward of posdiag's two-image prompt (posdiag.model.multimodal_inputs), and one of a left-padded
batch of two rows, the image prompt and a text row (an offset kept per row, then read by a batch of another size).
"""

from __future__ import annotations

from typing import Any

import torch

from posdiag.checks._image_decode import as_run, has_mrope, image_prompt
from posdiag.checks.state.sequences import Sequence
from posdiag.errors import describe_error, raised_in_posdiag
from posdiag.model.caches import cache_keyword, new_cache, takes_cache
from posdiag.model.multimodal_inputs import MultimodalPrompt
from posdiag.model.subject import Subject

AFTER_IMAGE = "text after an image"
WITH_POSITIONS = "text after an image, position_ids"
AFTER_BATCH = "prompt after an image batch"
IMAGE_SEQUENCES = (AFTER_IMAGE, WITH_POSITIONS, AFTER_BATCH)
PROMPT, STEPS = 8, 6  # the text prompt's tokens, then the tokens the loop decodes one by one
PADDING = 4  # left padding of the batch's text row


def image_plan(subject: Subject, seed: int, chosen: set[str],
               explicit: bool) -> tuple[list[Sequence], dict[str, str], str]:
    """The image sequences this model runs (of `chosen`), those it cannot (with why) and the inputs they feed
    ("language model with 2 images", for the report's header). A model without multimodal RoPE has none to run:
    named only where the sequences were asked for by name (`explicit`)."""
    wanted = [n for n in IMAGE_SEQUENCES if n in chosen]
    if not wanted:
        return [], {}, ""
    if subject.kind != "causal" or not has_mrope(subject):
        why = "no multimodal RoPE: no image prompt to leave rope_deltas behind"
        return [], dict.fromkeys(wanted, why) if explicit else {}, ""
    if not takes_cache(subject.model):
        return [], dict.fromkeys(wanted, f"{type(subject.model).__name__} takes no cache: no decode loop to "
                                         "continue"), ""
    prompt, why = image_prompt(subject, seed)
    if prompt is None:
        return [], dict.fromkeys(wanted, why), ""
    loops = _Loops(subject, prompt, seed)
    refused = loops.refusals()
    seqs = [Sequence(AFTER_IMAGE, f"after a plain forward of an image prompt ({prompt.contents}), a {PROMPT}-token "
                     f"text prompt decoded {STEPS} tokens in a hand-written loop (cache passed, no position_ids)",
                     loops.decoded, loops.image, lambda _: loops.decoded()),
            Sequence(WITH_POSITIONS, f"after a plain forward of an image prompt ({prompt.contents}), the same loop "
                     "with position_ids passed", lambda: loops.decoded(True), loops.image,
                     lambda _: loops.decoded(True)),
            Sequence(AFTER_BATCH, f"after a plain forward of a left-padded batch of two rows (the image prompt, a text "
                     f"row), a {PROMPT}-token text prompt decoded in the same loop (no position_ids)",
                     loops.decoded, loops.batch, lambda _: loops.decoded())]
    runs = [s for s in seqs if s.name in wanted and s.name not in refused]
    return runs, {n: refused[n] for n in wanted if n in refused}, prompt.tested if runs else ""


class _Loops:
    """The calls of the image sequences, counted in subject.forward_count."""

    def __init__(self, subject: Subject, prompt: MultimodalPrompt, seed: int):
        self.subject, self.prompt = subject, prompt
        device = prompt.ids.device
        self.text = subject.sample_ids(1, PROMPT + STEPS, seed + 4099).to(device)
        row = subject.sample_ids(1, prompt.ids.shape[1], seed + 4111).to(device)
        pad = getattr(subject.config, "pad_token_id", None)
        pad = pad if isinstance(pad, int) and 0 <= pad < subject.vocab_size else 0
        row[0, :PADDING] = pad
        self.rows = torch.cat([prompt.ids, row])
        self.mask = torch.ones_like(self.rows)
        self.mask[1, :PADDING] = 0
        self.kinds = torch.cat([prompt.kinds, torch.zeros_like(prompt.kinds)])

    def refusals(self) -> dict[str, str]:
        """Sequences whose history the plain forward refuses (posdiag's input, not the model's answer): name -> why."""
        out = {}
        for history, names in ((self.image, (AFTER_IMAGE, WITH_POSITIONS)), (self.batch, (AFTER_BATCH,))):
            try:
                history()
            except Exception as exc:
                if raised_in_posdiag(exc):
                    raise
                out.update(dict.fromkeys(names, f"the plain forward of its history raised {describe_error(exc)}"))
        return out

    def _forward(self, **inputs: Any) -> Any:
        self.subject.forward_count += 1
        with torch.inference_mode():
            return self.subject.model(**inputs, return_dict=True)

    def image(self) -> None:
        """The image prompt, as users call the model on a processor's output."""
        self._forward(**as_run(self.subject, self.prompt.inputs()))

    def batch(self) -> None:
        """The image prompt and a left-padded text row in one batch."""
        self._forward(**as_run(self.subject, {**self.prompt.inputs(self.rows), "mm_token_type_ids": self.kinds}),
                      attention_mask=self.mask)

    def decoded(self, positions: bool = False) -> torch.Tensor:
        """The text prompt prefilled into a new cache, then decoded one token a call: every logit, float64, flat."""
        model, ids = self.subject.model, self.text
        cache = {cache_keyword(model): new_cache(self.subject, "dynamic", ids.shape[1])}

        def at(start: int, stop: int) -> dict[str, torch.Tensor]:
            return {"position_ids": torch.arange(start, stop, device=ids.device)[None]} if positions else {}

        outs = [self._forward(input_ids=ids[:, :PROMPT], **cache, **at(0, PROMPT), use_cache=True).logits[0]]
        for t in range(PROMPT, ids.shape[1]):
            outs.append(self._forward(input_ids=ids[:, t:t + 1], **cache, **at(t, t + 1), use_cache=True).logits[0])
        return torch.cat(outs).to(torch.float64).flatten()
