"""generate, its inputs: the prompt generated alone (stretched past a sliding window where the probe stays within
one), the padded batch and its padding id."""

from __future__ import annotations

import torch

from posdiag.checks._reference import right_padded
from posdiag.model.memory import forward_refusal
from posdiag.model.subject import Subject
from posdiag.options import RunOptions, probe_length

ROWS = 3  # prompts in the padded batch


def pad_id(subject: Subject) -> tuple[int, str]:
    """The padding id: the config's pad (else eos, bos; config, then generation_config) when it is a
    row of the embedding table. Tiny or resized configs keep ids of the full vocabulary (measured:
    starcoder2/gpt_bigcode with vocab_size=256 keep bos/eos 50256 / 0 -> "index out of range in self"
    on the padded batch): posdiag never feeds an id >= vocab_size, and says which id it used."""
    vocab = subject.vocab_size
    invalid: list[str] = []
    sources = [subject.config, getattr(subject.model, "generation_config", None)]
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        for src in sources:
            value = getattr(src, name, None) if src is not None else None
            if isinstance(value, (list, tuple)):
                value = value[0] if value else None
            if isinstance(value, int) and not isinstance(value, bool):
                if 0 <= value < vocab:
                    return value, (f"padding with {name} {value} ({'; '.join(invalid)})" if invalid else "")
                text = f"{name} {value} is outside the vocabulary of {vocab}"
                if text not in invalid:
                    invalid.append(text)
    ordinary = sorted(set(range(min(vocab, 8))) - subject.special_ids())
    pad = ordinary[0] if ordinary else 0
    return pad, f"padding with id {pad} ({'; '.join(invalid)})" if invalid else ""


def prompts(subject: Subject, options: RunOptions, new_tokens: int) -> tuple[list[torch.Tensor], list[int]]:
    """The prompts and which of them make the padded batch; prompt 0 is generated alone.

    Where the probe stays within a sliding window, the prompt generated alone is stretched past it (window + 4
    tokens): decoding past the window is where window bugs live (Inkling's static cache, a cache that evicts what
    the forward attends). The padded batch keeps the probe length, rows [P, P - P/4, P - P/2]: its job is padding,
    and its shorter rows never reach the window however long its first row is. Without a stretch the prompt
    alone is the batch's first row."""
    base = probe_length(subject, options)
    window, declared = subject.sliding_window, subject.max_positions

    def fitted(length: int) -> int:  # prompt + generated tokens within the declared context
        return max(4, declared - new_tokens) if declared is not None and length + new_tokens > declared else length

    alone = fitted(window + 4 if window and base + new_tokens <= window + 2 and not window_refusal(
        subject, base, new_tokens) else base)
    base = fitted(base)
    lens = [base, max(2, base - max(1, base // 4)), max(2, base - max(2, base // 2))][:ROWS]
    sampled = subject.sample_ids(len(lens), max(alone, base), options.seed)
    if options.token_ids is not None:  # the text's tokens: no longer than the text, whatever was asked
        sampled = torch.tensor(options.token_ids, device=subject.device)[None].expand(len(lens), -1).clone()
    batch = [sampled[r, :n] for r, n in enumerate(lens)]
    if len(sampled[0, :alone]) == len(batch[0]):  # nothing stretched: the prompt alone is the batch's first row
        return batch, list(range(len(batch)))
    return [sampled[0, :alone], *batch], list(range(1, len(batch) + 1))


def window_refusal(subject: Subject, base: int, new_tokens: int) -> str:
    """Why the prompt alone is not stretched past the sliding window (memory cannot hold it, planned before it
    runs: decoding past the window is then not judged), or ""."""
    window = subject.sliding_window
    if not window or base + new_tokens > window + 2:
        return ""
    return forward_refusal(subject, f"the prompt past the {window}-token sliding window", 1, window + 4 + new_tokens,
                           logits_rows=new_tokens, cache=True)


def padded_batch(prompts: list[torch.Tensor], pad: int, seq2seq: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts as one batch and its mask: left-padded (decoder-only generation needs it), or right-padded
    (encoder inputs, by convention: _reference.right_padded)."""
    if seq2seq:
        return right_padded(prompts, pad, device)
    width = max(len(p) for p in prompts)
    batch = torch.full((len(prompts), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros_like(batch)
    for r, p in enumerate(prompts):
        batch[r, width - len(p):], mask[r, width - len(p):] = p, 1
    return batch, mask
