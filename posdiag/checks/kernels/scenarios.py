"""What the `kernels` check compares: which implementations run on this machine, and the inputs.

Inputs (Scenario): an unpadded batch (the model builds no mask: the is_causal path), a left-padded
batch (the mask handed to the kernel, fully masked padding queries), and, for a causal model that
can generate and keeps a KV cache, a chunk of several new tokens decoded against a KV cache, unpadded and left-padded
(causal alignment when q_len != k_len); there the unpadded and left-padded inputs are the decode inputs' prefills.
A Run holds one implementation's outputs on one input.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import torch

from posdiag.model.caches import keeps_kv_cache
from posdiag.model.subject import Subject
from posdiag.options import RunOptions, probe_ids

# SDPA's backends, each judged on its own (pinned with torch.nn.attention.sdpa_kernel): with a padding mask SDPA
# silently leaves flash for efficient or math, so the kernel users get for unpadded prefill and the one they get for
# padded batches differ. "sdpa[NAME]" runs SDPA pinned to backend NAME; plain "sdpa" lets torch choose.
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                 "math": "MATH"}
CPU_BACKENDS = ("flash", "math")
# Run by default where they may (flex_attention on CUDA): they compile first, so a compiler this machine lacks makes
# them not run, never the check a skip.
COMPILED_EXTRAS = ("flex_attention",)  # the CPU build has a flash kernel and math; efficient and cuDNN are CUDA kernels


def known_implementations() -> list[str]:
    """The attention implementations transformers registers here (eager, sdpa, flash_attention_2...), and SDPA
    pinned to each of its backends; a hub kernel (ORG/REPO) is known by its form (unknown_implementation)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    names = ["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]
    at = names.index("sdpa") + 1 if "sdpa" in names else len(names)
    return names[:at] + [f"sdpa[{b}]" for b in SDPA_BACKENDS] + names[at:]


def unknown_implementation(name: str) -> str | None:
    """Why `name` is no attention implementation transformers could switch to; None where it is one."""
    if name in known_implementations() or "/" in name:  # ORG/REPO[:kernel]: a hub kernel transformers fetches
        return None
    return f"not an attention implementation (known: {', '.join(known_implementations())}; or a hub kernel ORG/REPO)"


def split_name(name: str) -> tuple[str, str | None]:
    """("sdpa", "cudnn") for "sdpa[cudnn]"; (name, None) for any other implementation."""
    if name.startswith("sdpa[") and name.endswith("]") and name[5:-1] in SDPA_BACKENDS:
        return "sdpa", name[5:-1]
    return name, None


def default_implementations(subject: Subject) -> tuple[list[str], dict[str, str]]:
    """(implementations to run, {implementation: why not run}) for this machine: every SDPA backend the device
    has, each pinned, then the optional kernels."""
    run, skipped = [], {}
    cuda = subject.device.type == "cuda"
    for backend in SDPA_BACKENDS:
        if cuda or backend in CPU_BACKENDS:
            run.append(f"sdpa[{backend}]")
        else:
            skipped[f"sdpa[{backend}]"] = "a CUDA kernel"
    for name, module in (("flash_attention_2", "flash_attn"), ("flash_attention_3", "flash_attn_interface")):
        if not cuda:
            skipped[name] = "needs a CUDA device"
        elif importlib.util.find_spec(module) is None:
            skipped[name] = f"package {module} is not installed"
        else:
            run.append(name)
    reloadable = subject.is_hf and subject.load_info.checkpoint_keys is not None  # flex runs in a child process
    if cuda and reloadable and getattr(subject.model, "_supports_flex_attn", False):
        run.append("flex_attention")
    elif not cuda:
        skipped["flex_attention"] = ("not run by default on CPU (it compiles its kernels first: minutes); "
                                     "`--impl sdpa,flex_attention` runs it in a separate process")
    else:
        skipped["flex_attention"] = (f"{subject.family.name} does not support flex_attention" if reloadable else
                                     "runs in a separate process, which must load the model from a checkpoint")
    return run, skipped


@dataclass
class Scenario:
    name: str
    ids: torch.Tensor
    mask: torch.Tensor | None  # 2D padding mask (long) or None
    position_ids: torch.Tensor | None
    valid: torch.Tensor  # bool [B, T] of the tokens whose outputs are compared
    prefill: int = 0  # > 0: decode; the first `prefill` tokens go in first, the rest as one chunk
    prefill_as: str = ""  # decode: the scenario whose input its prefill is (that forward's states are its run)


@dataclass
class Run:
    hidden: list[torch.Tensor] = field(default_factory=list)  # per layer, [B, T, D] (decode: the chunk)
    logits: torch.Tensor | None = None  # [B, V] at the last position
    layer_names: list[str] = field(default_factory=list)


def build_scenarios(subject: Subject, options: RunOptions) -> list[Scenario]:
    """The inputs every implementation runs on (see the module docstring). Where the model decodes, the unpadded and
    left-padded inputs are the decode inputs' prefills (their own forwards: the same tokens, mask and positions), so
    each is fed once per implementation."""
    ids = probe_ids(subject, options, batch=3)
    b, t = ids.shape
    mask = torch.ones(b, t, dtype=torch.long, device=subject.device)
    mask[1, : t // 4] = 0
    mask[2, : t // 2] = 0
    causal = subject.kind == "causal"
    pos = None
    if causal and subject.family.takes_position_ids:  # as generate() builds them for left padding
        pos = subject.position_ids_for((mask.cumsum(-1) - 1).masked_fill(mask == 0, 1))
    ones = torch.ones(b, t, dtype=torch.bool, device=subject.device)
    if not (causal and getattr(subject.model, "can_generate", lambda: False)() and t >= 8 and keeps_kv_cache(subject)):
        return [Scenario("unpadded", ids, None, None, ones), Scenario("left-padded", ids, mask, pos, mask.bool())]
    p = t - max(2, t // 4)
    head = None if pos is None else pos[:, :p]
    return [Scenario("unpadded", ids[:, :p], None, None, ones[:, :p]),
            Scenario("left-padded", ids[:, :p], mask[:, :p], head, mask[:, :p].bool()),
            Scenario("decode", ids, None, None, ones[:, p:], p, "unpadded"),
            Scenario("decode left-padded", ids, mask, pos, mask[:, p:].bool(), p, "left-padded")]
