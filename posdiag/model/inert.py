"""Outputs that cannot carry a position signal, told apart from positions that were lost.

Positions reach a transformer's outputs through attention scores that vary with q·k and an attention output that
is added to the residual stream. Some architectures cut one of those paths at initialisation, so that a fresh model
starts as a near-identity map: NeoMME zeroes every attention output projection and MLP down projection (each block
adds nothing, so a token's output depends on that token alone), Zaya zeroes the learned key scale of its q/k norm
(every key is 0, every score equal: attention is a uniform average of the visible values). Permuting the tokens or
moving the position ids then changes nothing in exact arithmetic, and `shuffle`, `positions` and `shift` would FAIL
a model that is healthy, only untrained. A lost position (ids ignored, an identity rotation, a removed table) keeps
both paths — tokens still interact and scores still vary with the key — so its FAIL stands; so does a rotation that
itself zeroes q and k (equal scores are then the position bug): equal scores count only beside a rotary module seen
returning a sound rotation.

Tokens that never interact are no verdict only where zero-initialised branches explain it: a weight matrix that is
all zero in a model built in memory, or one the checkpoint does not store (initialised by the loader). A checkpoint
that stores those zeros, or code that lets each token see only itself (no weight zero), is a finding: position
cannot enter, and the check FAILs saying so (`Inert.finding`).

Both probes run only where a check found no position signal (or could not trust the explicit mask); each is one
small forward with the model's own mask and positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from posdiag.model.checkpoint import in_checkpoint
from posdiag.model.subject import Subject
from posdiag.model.tensors import relative_l2
from posdiag.results import Status
from posdiag.verdict import FAIL_RATIO, MACHINE_EPSILON


@dataclass(frozen=True)
class Inert:
    """Why outputs cannot show a position signal. `skip`: zero-initialised branches of a model as built (no verdict);
    `finding`: tokens that never interact because of what the checkpoint stored or the code does (a FAIL); both ""
    when outputs can carry positions (or it cannot be told: the check's verdict stands)."""

    skip: str = ""
    finding: str = ""


def inert_reason(subject: Subject, stack: str, ids: torch.Tensor) -> str:
    """Why this model's outputs cannot show a position signal on `stack` (probe ids [T]), when that is no finding
    (zero-initialised branches, equal scores); "" when they can, or when it cannot be told, or when it is a finding
    (`inert`'s `finding`: the check's FAIL stands)."""
    return inert(subject, stack, ids).skip


def inert(subject: Subject, stack: str, ids: torch.Tensor) -> Inert:
    """Isolated tokens (told apart: zero-initialised branches or a finding), else constant attention scores."""
    if ids.shape[-1] < 2:
        return Inert()
    change = isolated_tokens(subject, stack, ids)
    if change is None:
        return Inert(skip=constant_scores(subject, stack, ids))
    moved = (f"changing token 0 moves no other token's output at any layer (relative change {change:.2g}, through "
             "the model's own default mask)")
    zeros = zero_branches(subject)
    stored = stored_in_checkpoint(subject, zeros)
    if zeros and not stored:
        shown = ", ".join(zeros[:3]) + (f" (+{len(zeros) - 3} more)" if len(zeros) > 3 else "")
        return Inert(skip=f"tokens never interact: {moved}: each output depends on its own token alone, because "
                          f"mixing branches add nothing ({shown} all zero, as initialised: not loaded from a "
                          "checkpoint), so no order or position can reach the outputs; nothing to judge")
    if stored:
        return Inert(finding=f"{moved}: the checkpoint stores {', '.join(stored[:3])} as all zeros, so every block "
                             "adds nothing from other tokens and no position can enter")
    return Inert(finding=f"{moved}, though no weight is zero: the model's code lets each token see only itself, so "
                         "no position can enter")


def unfaithful_mask_verdict(subject: Subject, stack: str, ids: torch.Tensor, unfaithful: str,
                            finding: str) -> tuple[Status, str, dict[str, str]]:
    """(status, summary, details) where the explicit mask is not faithful: tokens that never interact through the
    model's own mask are the finding the unfaithful mask hides (FAIL, worded `finding` first), unless zero-initialised
    branches of a model as built explain them (SKIP); otherwise no verdict (SKIP). Shared by `shuffle`, `positions`."""
    why = inert(subject, stack, ids)
    if why.skip:  # zero-initialised branches: that is why the mask changes nothing
        return (Status.SKIP, f"no verdict: {why.skip} (the explicit mask changes nothing for the same reason)",
                {"inert": why.skip})
    if why.finding:
        return (Status.FAIL, f"{finding} ({why.finding}; the explicit mask was no help either: {unfaithful})",
                {"never_interact": why.finding})
    return Status.SKIP, f"mask not faithful, no verdict: {unfaithful}", {}


def isolated_tokens(subject: Subject, stack: str, ids: torch.Tensor) -> float | None:
    """Change token 0 (every later query sees it, causal or not) through the model's own default mask: the largest
    relative change of any other token's output at any layer when none moves beyond rounding, else None."""
    other = ids.clone()
    other[0] = ids[1]
    rows = torch.stack([ids, other])
    encoder_ids = rows[:1].expand(2, -1) if subject.kind == "seq2seq" and stack == "decoder" else None
    hidden = subject.forward(rows, stack=stack, encoder_ids=encoder_ids).hidden
    change = max(relative_l2(h[1, 1:], h[0, 1:]) for h in hidden[1:] or hidden)
    return change if change <= FAIL_RATIO * _eps(subject) else None


def zero_branches(subject: Subject) -> list[str]:
    """The weight matrices of the language model that are all zero (an output projection initialised to zero)."""
    found = []
    for name, param in subject.language_model.named_parameters():
        if param.dim() >= 2 and param.is_floating_point() and not param.is_meta and not bool(param.detach().any()):
            found.append(name)
    return found


def stored_in_checkpoint(subject: Subject, names: list[str]) -> list[str]:
    """Those of `names` the checkpoint stores (loaded, not initialised); none for a model built in memory."""
    keys = subject.load_info.checkpoint_keys
    if keys is None:
        return []
    known = set(keys)
    missing = set(subject.load_info.missing_keys)
    return [n for n in names if in_checkpoint(n, known) and not in_checkpoint(n, missing)]


def constant_scores(subject: Subject, stack: str, ids: torch.Tensor) -> str:
    """Ask the model for its attention probabilities: if in every attention layer each query's weights are equal
    over the keys it sees, q·k does not vary with the key, and a rotation by position cannot change any score.

    Equal scores are a position bug too when the rotation itself zeroes q and k (a RoFormer whose sinusoid table is
    zero: cos = sin = 0), so this holds only where the rotary modules (transformers' kind, frequencies in an
    `inv_freq` buffer) were seen returning a sound rotation in the same forward: cos² + sin² one constant > 0."""
    maps, rotations = _attention_maps(subject, stack, ids[None])
    if not maps or not rotations or not all(_sound(r) for r in rotations):
        return ""
    spread = max(_spread(a) for a in maps)
    if spread > FAIL_RATIO * _eps(subject):
        return ""
    return (f"attention scores are constant: in all {len(maps)} attention layers each query weighs the keys it sees "
            f"equally (relative spread {spread:.2g}) while the rotary module returns a sound rotation: q·k does not "
            "vary with the key (as with a key scale initialised to zero), so no rotation by position can change a "
            "score; nothing to judge")


def _attention_maps(subject: Subject, stack: str, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[Any]]:
    """The attention probabilities [B, H, T, S] per layer the model returns for output_attentions (none: []), and
    what each rotary module returned during that forward."""
    if not subject.is_hf:
        return [], []
    rotations: list[Any] = []
    hooks = [m.register_forward_hook(lambda _m, _a, out: rotations.append(out))
             for m in subject.language_model.modules()
             if any(n.endswith("inv_freq") for n, _ in m.named_buffers(recurse=False))]
    subject.forward_count += 1
    try:
        with torch.inference_mode():
            if subject.kind == "seq2seq":
                out = subject.model(input_ids=ids, decoder_input_ids=ids, output_attentions=True, return_dict=True)
                maps = out.encoder_attentions if stack == "encoder" else out.decoder_attentions
            else:
                out = subject.model(input_ids=ids, output_attentions=True, return_dict=True)
                maps = out.attentions
    except Exception:  # a model that returns no attentions: no second opinion, the check's verdict stands
        return [], []
    finally:
        for hook in hooks:
            hook.remove()
    return [a for a in maps or () if isinstance(a, torch.Tensor) and a.dim() >= 2 and a.is_floating_point()], rotations


def _sound(rotation: Any) -> bool:
    """A rotary module's output is a rotation up to one scale: (cos, sin) with cos² + sin² the same positive
    number everywhere (attention scaling allowed), or complex factors of one modulus. Anything else: unknown."""
    if isinstance(rotation, torch.Tensor) and rotation.is_complex():
        norm = rotation.abs().double()
    elif (isinstance(rotation, (tuple, list)) and len(rotation) == 2
          and all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in rotation)
          and rotation[0].shape == rotation[1].shape):
        norm = (rotation[0].double() ** 2 + rotation[1].double() ** 2).sqrt()
    else:
        return False
    if norm.numel() == 0:
        return False
    lo, hi = float(norm.min()), float(norm.max())
    return lo > 0 and hi - lo <= 1e-2 * hi  # half-precision tables round cos and sin to ~4e-3


def _spread(weights: torch.Tensor) -> float:
    """Largest (max - min) / max over each query's nonzero weights (masked keys weigh exactly 0)."""
    w = weights.detach().to(torch.float64)
    seen = w > 0
    if not bool(seen.any()):
        return float("inf")
    hi = w.masked_fill(~seen, float("-inf")).amax(-1)
    lo = w.masked_fill(~seen, float("inf")).amin(-1)
    rows = seen.any(-1)
    return float(((hi - lo) / hi)[rows].max())


def _eps(subject: Subject) -> float:
    return MACHINE_EPSILON.get(subject.dtype_name, MACHINE_EPSILON["float32"])
