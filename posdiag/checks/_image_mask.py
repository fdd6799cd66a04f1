"""Bidirectional image-token masks (`causal` on models whose mask reads `token_type_ids`).

Gemma3-style models let each contiguous block of image tokens (token_type_ids == 1) see itself in both directions;
PaliGemma-style prefix-LM models let every prefix token (token_type_ids == 0: the image and the prompt) see every
other prefix token, the suffix (1) being causal. Elsewhere the mask is causal. Which rule a model declares is read
from its modelling code (the function that turns token_type_ids into mask groups), never from the masks it builds,
so a model that drops token_type_ids from its mask is judged against what it declares.

The probe: one row of text, a block of image positions marked in token_type_ids as the model's processor marks
them, text again; token embeddings (`inputs_embeds`: an image position carries the tower's features, not a token)
edited one position at a time, one forward for all edits, plus a copy jittered by ~1 ulp for the floor. For a
query i and a later key j, a change of output i above the floor means i sees j: a leak where the declared mask
forbids it (text seeing a later key, an image token seeing later text), and where the mask allows it (inside
one bidirectional group) its absence is the failure: the tokens do not see each other.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch

from posdiag.model.jitter import FLOOR_SOURCE
from posdiag.model.subject import Subject
from posdiag.model.tensors import per_token_change
from posdiag.results import Status
from posdiag.verdict import agreement_tolerance, noise_floor

PATH = "image-token mask"
TEXT_BEFORE, IMAGE, TEXT_AFTER = 5, 4, 3  # image tokens at 5-8 of 12
# Markers of the modelling code that builds mask groups from token_type_ids -> the rule it declares.
RULES = {"get_block_sequence_ids_for_mask": "image blocks", "torch.where(token_type_ids == 0, 0, -1)": "prefix"}


def declared_rule(subject: Subject) -> str | None:
    """'image blocks', 'prefix', 'unknown' (reads token_type_ids into its mask some other way) or None."""
    model = subject.model
    try:
        params = inspect.signature(model.forward).parameters
        source = inspect.getsource(importlib.import_module(type(model).__module__))
    except (TypeError, OSError, ImportError):
        return None
    if "token_type_ids" not in params or "block_sequence_ids" not in source:
        return None
    return next((rule for marker, rule in RULES.items() if marker in source), "unknown")


def layout(rule: str) -> tuple[torch.Tensor, torch.Tensor, str]:
    """token_type_ids [T], the declared groups [T] (-1: causal), and the bidirectional span's name."""
    length = TEXT_BEFORE + IMAGE + TEXT_AFTER
    kinds = torch.zeros(length, dtype=torch.long)
    if rule == "image blocks":
        kinds[TEXT_BEFORE : TEXT_BEFORE + IMAGE] = 1
        groups = torch.where(kinds == 1, 0, -1)
        return kinds, groups, f"image tokens {TEXT_BEFORE}-{TEXT_BEFORE + IMAGE - 1}"
    # prefix-LM: image + prompt (type 0) then the suffix (type 1), as PaliGemma's processor marks them
    prefix = IMAGE + TEXT_BEFORE
    kinds[prefix:] = 1
    return kinds, torch.where(kinds == 0, 0, -1), f"prefix tokens 0-{prefix - 1} (image and prompt)"


def probe(subject: Subject, seed: int) -> dict[str, Any] | str | None:
    """A result in causal's path form, a 'not probed: ...' reason, or None (no token_type_ids mask)."""
    rule = declared_rule(subject)
    if rule is None:
        return None
    if rule == "unknown":
        return "not probed: the model reads token_type_ids into its mask by a rule posdiag does not know"
    embed = subject.model.get_input_embeddings() if hasattr(subject.model, "get_input_embeddings") else None
    if embed is None:
        return "not probed: the model has no input embedding module to feed inputs_embeds"
    kinds, groups, span = layout(rule)
    length = kinds.shape[0]
    ids = subject.sample_ids(1, length, seed + 7919)[0]
    alt = subject.sample_ids(1, length, seed + 104729)[0]
    alt = torch.where(alt == ids, ids.roll(1), alt)
    device = next(subject.model.parameters()).device
    try:
        with torch.inference_mode():
            base = embed(ids[None].to(device))[0]
            other = embed(alt[None].to(device))[0]
            rows = [base, base * (1 + torch.finfo(base.dtype).eps * _signs(base, seed))]
            for j in range(1, length):
                edited = base.clone()
                edited[j] = other[j]
                rows.append(edited)
            out = subject.model(inputs_embeds=torch.stack(rows), token_type_ids=kinds[None].expand(len(rows), -1)
                                .to(device), output_hidden_states=True, use_cache=False)
            hidden = out.hidden_states[-1].float().cpu()
    except Exception as exc:  # a model that cannot be driven with inputs_embeds + token_type_ids
        return f"not probed: the forward with inputs_embeds and token_type_ids raised {type(exc).__name__}"
    return _judge(subject, hidden, kinds, groups, span)


def _signs(base: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, base.shape, generator=gen) * 2 - 1).to(base.device, base.dtype)


def _judge(subject: Subject, hidden: torch.Tensor, kinds: torch.Tensor, groups: torch.Tensor, span: str) -> dict:
    length = kinds.shape[0]
    dtype = subject.dtype_name
    floor = float(per_token_change(hidden[1], hidden[0]).max())
    tol = agreement_tolerance(floor, dtype)
    change = torch.zeros(length, length, dtype=torch.float64)
    for j in range(1, length):
        change[:j, j] = per_token_change(hidden[1 + j][:j], hidden[0][:j]).double()
    later = torch.ones(length, length, dtype=torch.bool).triu(1)
    allowed = later & (groups[:, None] == groups[None, :]) & (groups[:, None] >= 0)
    forbidden = later & ~allowed
    leaks = forbidden & (change > tol)
    blind = allowed & (change <= tol)
    leak = float(change[forbidden].max()) if bool(forbidden.any()) else 0.0
    seen = float(change[allowed].min()) if bool(allowed.any()) else float("nan")
    metrics = {"leak": leak, "noise_floor": noise_floor(floor, dtype), "ratio": leak / noise_floor(floor, dtype),
               "tolerance": tol, "weakest_allowed": seen}
    details: dict = {"token_type_ids": kinds.tolist(), "bidirectional": span, "floor_source": FLOOR_SOURCE,
                     "allowed_later_pairs": int(allowed.sum()), "blind_pairs": int(blind.sum()),
                     "leaking_pairs": int(leaks.sum())}
    problems = []
    if bool(leaks.any()):
        q, k = (int(x) for x in leaks.nonzero()[0])
        who = "text" if kinds[k] == 0 or groups[k] < 0 else "image"
        details["first_leak"] = (q, k)
        details["leak_distances"] = sorted({k2 - q2 for q2, k2 in leaks.nonzero().tolist()})[:8]
        problems.append(f"query {q} sees later {who} key {k} where the declared mask forbids it "
                        f"({PATH}; change {float(change[q, k]):.3g} > tolerance {tol:.2g})")
    if bool(blind.any()):
        q, k = (int(x) for x in blind.nonzero()[0])
        details["first_blind"] = (q, k)
        problems.append(f"{span} do not see each other although the model declares them bidirectional "
                        f"({PATH}; query {q} unmoved by key {k}: change {float(change[q, k]):.2g} <= {tol:.2g}, "
                        f"{int(blind.sum())} of {int(allowed.sum())} allowed pairs blind)")
    if problems:
        return {"path": PATH, "status": Status.FAIL, "summary": "; ".join(problems), "metrics": metrics,
                "details": details}
    summary = (f"{span} see each other as the model declares (weakest change {seen:.2g} > {tol:.2g}) and no "
               f"query sees a later key the mask forbids ({PATH})")
    return {"path": PATH, "status": Status.PASS, "summary": summary, "metrics": metrics, "details": details}
