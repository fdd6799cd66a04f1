"""Running the model for the `kernels` check: one forward per input, switching the attention
implementation (and restoring every config afterwards), and the finer-dtype eager reference
(posdiag.model.precision)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from posdiag.checks.kernels.scenarios import SDPA_BACKENDS, Run, Scenario, split_name, unknown_implementation
from posdiag.model.caches import cache_keyword
from posdiag.model.precision import REFERENCE_FRACTION, FinerRun, reference_dtype, run_finer, streamed_bytes
from posdiag.model.subject import Subject
from posdiag.model.tensors import token_states

# Exceptions from torch's compiler stack: the toolchain of this machine failed, not the model.
TOOLCHAIN_ERRORS = ("InductorError", "CppCompileError", "BackendCompilerFailed", "InvalidCxxCompiler")
# Which class flag says an implementation is supported (transformers 5.x PreTrainedModel).
SUPPORT_FLAG = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn",
                "flash_attention_3": "_supports_flash_attn", "flex_attention": "_supports_flex_attn"}


class Refused(Exception):
    """The model does not support an attention implementation (the message says why)."""


# How torch says that the pinned SDPA backend cannot run an input (its UserWarnings say why).
NO_BACKEND = ("No viable backend", "No available kernel")


class Outcome:
    """What one implementation gave: runs (one Run per scenario; None where a pinned SDPA backend refuses that input,
    the reason in `refused`), or a reason with a kind: refused (the model does not support it), unavailable (cannot
    run on this machine), crashed."""

    def __init__(self, runs: list[Run | None] | None = None, note: str = "", kind: str = "", reason: str = "",
                 refused: dict[str, str] | None = None):
        self.runs, self.note, self.kind, self.reason = runs, note, kind, reason
        self.refused = refused or {}


def describe_exception(name: str, exc: BaseException) -> tuple[str, str]:
    """(kind, reason) for an exception raised while running implementation `name`."""
    text = str(exc).strip().splitlines()
    first = (text[0] if text else "")[:160]
    kind = "unavailable" if any(t in type(exc).__name__ or t in first for t in TOOLCHAIN_ERRORS) else "crashed"
    if kind == "unavailable":
        return kind, (f"{name} could not be compiled on this machine ({type(exc).__name__}); "
                      "not a finding about the model")
    return kind, f"{type(exc).__name__}: {first}"


def run_here(subject: Subject, name: str, scenarios: list[Scenario]) -> Outcome:
    """Every scenario under implementation `name`, in this process."""
    try:
        with implementation(subject, name) as note:
            runs, refused = forward_each(subject, scenarios, split_name(name)[1] is not None)
        return Outcome(runs=runs, note=note, refused=refused)
    except Refused as exc:
        return Outcome(kind="refused", reason=str(exc))
    except Exception as exc:
        kind, reason = describe_exception(name, exc)
        return Outcome(kind=kind, reason=reason)


def reference_runs(subject: Subject, scenarios: list[Scenario]) -> FinerRun[list[Run]]:
    """Eager on every scenario in float64 where it fits (precision.reference_dtype), module by
    module, else per block, else the whole model; float32 for a half-precision model that cannot
    run float64. Judged reached when every run's last hidden state has the reference dtype. None finer
    fitting is a reason, never the run dtype as its own reference: eager's error would be 0 by construction
    and the tolerance one unit roundoff, a degenerate floor that fails healthy kernels."""
    dtype = reference_dtype(subject)
    if dtype.itemsize <= subject.dtype.itemsize:
        where = f"free memory on {subject.device.type}" if subject.device.type in REFERENCE_FRACTION else \
            f"a {subject.device.type} device"
        return FinerRun(None, dtype, reason=f"no reference more precise than {subject.dtype_name} fits ({where}: "
                                            f"{streamed_bytes(subject, torch.float64) / 2**20:.0f} MiB for one "
                                            "block in float64)")
    return run_finer(subject, lambda: forward_all(subject, scenarios), dtype,
                     reached=lambda runs, dtype: all(r.hidden[-1].dtype == dtype for r in runs), what="reference")


def finer_runs(subject: Subject, name: str, scenarios: list[Scenario], dtype: torch.dtype) -> list[Run] | None:
    """Implementation `name` on every scenario in `dtype` (the reference's), converted as the reference was;
    None where it cannot run there (no kernel in that dtype, a refusal): its rounding cannot be measured."""
    pinned = split_name(name)[1] is not None
    try:
        with implementation(subject, name):
            got = run_finer(subject, lambda: forward_each(subject, scenarios, pinned)[0], dtype,
                            reached=lambda runs, d: all(r is None or r.hidden[-1].dtype == d for r in runs))
    except Exception:  # refused or crashed in the finer dtype: undecided, the judgement says so
        return None
    return got.value if got.ran and got.dtype == dtype else None


def forward_all(subject: Subject, scenarios: list[Scenario]) -> list[Run]:
    """One Run per scenario, in order; a decode scenario's prefill forward gives the run of the scenario it stands
    for (`prefill_as`), which is then not fed again."""
    runs: dict[str, Run] = {}
    names = {sc.name for sc in scenarios}
    for sc in sorted(scenarios, key=lambda s: not s.prefill):  # decodes first: their prefills serve the others
        if sc.name in runs:
            continue
        first, runs[sc.name] = _forward(subject, sc)
        if sc.prefill_as in names and first is not None:
            runs[sc.prefill_as] = first
    return [runs[sc.name] for sc in scenarios]


def forward_each(subject: Subject, scenarios: list[Scenario], pinned: bool) -> tuple[list[Run | None],
                                                                                 dict[str, str]]:
    """forward_all, or, where a pinned SDPA backend refuses an input, each input alone: (runs, None for a refused
    input; {input: the backend's reason}). Any other exception propagates."""
    try:
        return list(forward_all(subject, scenarios)), {}
    except RuntimeError as exc:
        if not (pinned and any(t in str(exc) for t in NO_BACKEND)):
            raise
    runs: list[Run | None] = []
    refused: dict[str, str] = {}
    for sc in scenarios:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always", UserWarning)
            try:
                runs.append(forward(subject, sc))
                continue
            except RuntimeError as exc:
                if not any(t in str(exc) for t in NO_BACKEND):
                    raise
        reasons = [_reason(str(w.message)) for w in said if issubclass(w.category, UserWarning)]
        refused[sc.name] = "; ".join(dict.fromkeys(r for r in reasons if r)) or "no kernel for this input"
        runs.append(None)
    return runs, refused


def forward(subject: Subject, sc: Scenario) -> Run:
    """Hidden states of every layer (and the last position's logits) on one scenario."""
    return _forward(subject, sc)[1]


def _forward(subject: Subject, sc: Scenario) -> tuple[Run | None, Run]:
    """(the prefill's run where the scenario decodes, else None; the scenario's run)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if subject.kind == "seq2seq":
            return None, _forward_seq2seq(subject, sc)
        return _forward_once(subject, sc)


def _forward_seq2seq(subject: Subject, sc: Scenario) -> Run:
    with torch.inference_mode():
        subject.forward_count += 1
        out = subject.model(input_ids=sc.ids, attention_mask=sc.mask, decoder_input_ids=sc.ids, use_cache=False,
                            output_hidden_states=True, return_dict=True)
        enc = token_states(out.encoder_hidden_states, sc.ids.shape)
        dec = token_states(out.decoder_hidden_states, sc.ids.shape)
        names = [f"encoder {i}" for i in range(len(enc))] + [f"decoder {i}" for i in range(len(dec))]
        return Run(enc + dec, out.logits[:, -1].double(), names)


def _forward_once(subject: Subject, sc: Scenario) -> tuple[Run | None, Run]:
    model = subject.model
    with torch.inference_mode():
        kwargs: dict[str, Any] = {"output_hidden_states": True, "return_dict": True}
        if subject.takes_logits_to_keep:
            kwargs["logits_to_keep"] = 1  # only the last position's logits are compared
        if subject.kind == "causal":
            kwargs["use_cache"] = sc.prefill > 0
        first = None
        if sc.prefill:
            p = sc.prefill
            subject.forward_count += 1
            out = model(input_ids=sc.ids[:, :p], attention_mask=None if sc.mask is None else sc.mask[:, :p],
                        **({"position_ids": sc.position_ids[:, :p]} if sc.position_ids is not None else {}), **kwargs)
            first = _run_of(out, sc.ids[:, :p].shape)
            # by the keyword the forward takes (`cache`; `past_key_values` before transformers 5.24): the other one
            # goes into **kwargs and the chunk silently runs without the cache (Dory in 5.25 has no old-name shim)
            kwargs[cache_keyword(subject.model)] = out.cache if getattr(out, "cache", None) is not None \
                else out.past_key_values
            ids, mask = sc.ids[:, p:], sc.mask  # the chunk sees the whole mask (cache + chunk)
            pos = None if sc.position_ids is None else sc.position_ids[:, p:]
        else:
            ids, mask, pos = sc.ids, sc.mask, sc.position_ids
        if pos is not None:
            kwargs["position_ids"] = pos
        subject.forward_count += 1
        return first, _run_of(model(input_ids=ids, attention_mask=mask, **kwargs), ids.shape)


def _run_of(out: Any, shape: torch.Size) -> Run:
    hidden = token_states(out.hidden_states if out.hidden_states is not None else (out.last_hidden_state,), shape)
    logits = getattr(out, "logits", None)
    names = ["embeddings"] + [f"block {i}" for i in range(1, len(hidden))]
    return Run(hidden, None if logits is None else logits[:, -1].double(), names)


@contextlib.contextmanager
def implementation(subject: Subject, name: str) -> Iterator[str]:
    """Switch the model to `name` for the block; restore every config afterwards (a failed switch
    can leave the shared config changed). Yields a note; raises Refused with the reason."""
    model = subject.model
    configs = _configs(model)
    saved = [(c, c._attn_implementation_internal) for c in configs]
    note = ""
    unknown = unknown_implementation(name)  # transformers' own refusal lists its names in 300+ characters
    name, backend = split_name(name)
    try:
        if unknown:
            raise Refused(unknown)
        if name != "eager" and name == "sdpa" and subject.family.eager_only:
            raise Refused(f"{subject.family.name} refuses sdpa in transformers 5.x (eager only)")
        try:
            model.set_attn_implementation(name)
        except Exception as exc:
            text = str(exc).strip().splitlines()
            refusal = (text[0] if text else type(exc).__name__)[:200]
            note = _language_model_only(model, subject.config, name, refusal)
        if model.config._attn_implementation != name:
            flag = SUPPORT_FLAG.get(name)
            if flag and getattr(model, flag, False):
                # The class declares support but cannot switch after init (reads the config at forward: Falcon).
                for c in configs:
                    c._attn_implementation_internal = name
                note = "set on the config (this class cannot switch implementations after loading)"
            else:
                raise Refused(f"{type(model).__name__} does not support {name}")
        with pinned_backend(backend):
            yield note
    finally:
        for c, value in saved:
            c._attn_implementation_internal = value


@contextlib.contextmanager
def pinned_backend(backend: str | None) -> Iterator[None]:
    """SDPA pinned to one backend (a key of SDPA_BACKENDS) within the block; None: torch chooses."""
    if backend is None:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[backend])):
        yield


def _language_model_only(model: torch.nn.Module, text_config: Any, name: str, refusal: str) -> str:
    """A tower refusing the implementation (VibeVoice-ASR's acoustic tokenizer has no SDPA) does not keep the language
    model the checks drive from switching: set it on the top model and the text sub-config only. Raises Refused with
    the tower's refusal when the model has no such sub-config, or refuses that too."""
    key = next((k for k in getattr(model.config, "sub_configs", {}) or {}
                if getattr(model.config, k, None) is text_config), None)
    if key is None:
        raise Refused(refusal)
    try:
        model.set_attn_implementation({"": name, key: name})
    except Exception:
        raise Refused(refusal) from None
    return f"set on the language model only (a tower refuses {name})"


def _configs(model: torch.nn.Module) -> list[Any]:
    seen: dict[int, Any] = {}
    stack = [m.config for m in model.modules() if getattr(m, "config", None) is not None]
    while stack:
        cfg = stack.pop()
        if id(cfg) in seen or not hasattr(cfg, "_attn_implementation_internal"):
            continue
        seen[id(cfg)] = cfg
        for key in getattr(cfg, "sub_configs", {}) or {}:
            sub = getattr(cfg, key, None)
            if sub is not None:
                stack.append(sub)
    return list(seen.values())


def _reason(message: str) -> str:
    """torch's refusal warning without its source location; the "X not used because:" headers that only announce
    the next warning's reason (measured on an H200: "Flash Attention does not support non-null attn_mask") say
    nothing alone and are dropped."""
    text = " ".join(message.split(" (Triggered internally at")[0].split())
    return "" if text.endswith("because:") or text.endswith("runtime disabled.") else text[:160]

