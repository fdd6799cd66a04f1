"""kernels — every attention implementation must compute the same function as eager attention.

Tiled online-softmax attention (FlashAttention, SDPA) is exact in math: a running max m, a
running sum l, partial sums rescaled by exp(m_old − m_new). It differs from naive attention only
in summation order. So, with the same weights and inputs, each implementation's hidden states
must stay within rounding of a higher-precision eager reference (float64 on CPU when memory
allows, else float32), by FlashAttention's own rule:
    err(impl) <= 2 · err(eager in the run dtype) + atol,      err = ||h − h_ref|| / ||h_ref||
per layer, over valid (non-padding) positions, on three inputs: an unpadded batch (the model
builds no mask: the is_causal path), a left-padded batch (the mask handed to the kernel, fully
masked padding queries), and a chunk of several new tokens decoded against a KV cache (causal
alignment when q_len != k_len). NaN/Inf at valid positions fails; what a kernel writes at
padding queries is reported as information.
"""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from posdiag.checks.kernels.isolated import ISOLATED, Outcome, describe_exception, run_isolated
from posdiag.options import RunOptions, probe_ids
from posdiag.results import CheckResult, Status, Table
from posdiag.model.subject import Subject
from posdiag.model.placement import is_dispatched
from posdiag.verdict import MACHINE_EPSILON

TITLE = "Attention kernels agree with eager"

FACTOR = 2.0  # FlashAttention's rule: at most 2x the error of plain attention in the same dtype
# Rounding keeps a forward pass in any inference dtype far closer than this to a more precise run of
# the same function (bf16's unit roundoff is 0.4%): eager farther from the reference means the
# reference computed something else there (measured: Zamba2's recurrence carries the float64 run's
# zeroed padding rows into valid tokens, 1.1-1.4 off), and that input is not judged.
SAME_FUNCTION = 0.1
BLOCK_NAMES = ("layers", "layer", "h", "block", "blocks")
# Which class flag says an implementation is supported (transformers 5.x PreTrainedModel).
SUPPORT_FLAG = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn",
                "flash_attention_3": "_supports_flash_attn", "flex_attention": "_supports_flex_attn"}


# ------------------------------------------------------------------------------ what to compare
def default_implementations(subject: Subject) -> tuple[list[str], dict[str, str]]:
    """(implementations to run, {implementation: why not run}) for this machine."""
    run, skipped = ["sdpa"], {}
    cuda = subject.device.type == "cuda"
    for name, module in (("flash_attention_2", "flash_attn"), ("flash_attention_3", "flash_attn_interface")):
        if not cuda:
            skipped[name] = "needs a CUDA device"
        elif importlib.util.find_spec(module) is None:
            skipped[name] = f"package {module} is not installed"
        else:
            run.append(name)
    skipped["flex_attention"] = ("not run by default (it compiles its kernels first: minutes on a CPU); "
                                 "`--impl sdpa,flex_attention` runs it in a separate process")
    return run, skipped


@dataclass
class Scenario:
    name: str
    ids: torch.Tensor
    mask: torch.Tensor | None  # 2D padding mask (long) or None
    position_ids: torch.Tensor | None
    valid: torch.Tensor  # bool [B, T] of the tokens whose outputs are compared
    prefill: int = 0  # > 0: decode; the first `prefill` tokens go in first, the rest as one chunk


@dataclass
class Run:
    hidden: list[torch.Tensor] = field(default_factory=list)  # per layer, [B, T, D] (decode: the chunk)
    logits: torch.Tensor | None = None  # [B, V] at the last position
    layer_names: list[str] = field(default_factory=list)


def _scenarios(subject: Subject, options: RunOptions) -> list[Scenario]:
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
    out = [Scenario("unpadded", ids, None, None, ones),
           Scenario("left-padded", ids, mask, pos, mask.bool())]
    if causal and getattr(subject.model, "can_generate", lambda: False)() and t >= 8:
        prefill = t - max(2, t // 4)
        out.append(Scenario("decode", ids, None, None, ones[:, prefill:], prefill))
        out.append(Scenario("decode left-padded", ids, mask, pos, mask[:, prefill:].bool(), prefill))
    return out


# ------------------------------------------------------------------------------ running the model
def _forward(subject: Subject, sc: Scenario) -> Run:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # past_key_values -> cache rename (5.x)
        return _forward_once(subject, sc)


def _forward_once(subject: Subject, sc: Scenario) -> Run:
    model = subject.model
    with torch.inference_mode():
        if subject.kind == "seq2seq":
            subject.forward_count += 1
            out = model(input_ids=sc.ids, attention_mask=sc.mask, decoder_input_ids=sc.ids, use_cache=False,
                        output_hidden_states=True, return_dict=True)
            enc, dec = list(out.encoder_hidden_states), list(out.decoder_hidden_states)
            names = [f"encoder {i}" for i in range(len(enc))] + [f"decoder {i}" for i in range(len(dec))]
            return Run(enc + dec, out.logits[:, -1].double(), names)
        kwargs: dict[str, Any] = {"output_hidden_states": True, "return_dict": True}
        if subject._takes_logits_to_keep:
            kwargs["logits_to_keep"] = 1  # only the last position's logits are compared
        if subject.kind == "causal":
            kwargs["use_cache"] = sc.prefill > 0
        if sc.prefill:
            p = sc.prefill
            subject.forward_count += 1
            first = model(input_ids=sc.ids[:, :p], attention_mask=None if sc.mask is None else sc.mask[:, :p],
                          **({"position_ids": sc.position_ids[:, :p]} if sc.position_ids is not None else {}), **kwargs)
            kwargs["past_key_values"] = first.past_key_values
            ids, mask = sc.ids[:, p:], sc.mask  # the chunk sees the whole mask (cache + chunk)
            pos = None if sc.position_ids is None else sc.position_ids[:, p:]
        else:
            ids, mask, pos = sc.ids, sc.mask, sc.position_ids
        if pos is not None:
            kwargs["position_ids"] = pos
        subject.forward_count += 1
        out = model(input_ids=ids, attention_mask=mask, **kwargs)
        hidden = list(out.hidden_states if out.hidden_states is not None else (out.last_hidden_state,))
        logits = getattr(out, "logits", None)
        names = ["embeddings"] + [f"block {i}" for i in range(1, len(hidden))]
        return Run(hidden, None if logits is None else logits[:, -1].double(), names)


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    found = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.split(".")[-1] in BLOCK_NAMES and len(module):
            found.extend(module)
    return found


@contextlib.contextmanager
def _finite_padding(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """For the float64 reference only: transformers' eager softmax runs in float32, so finfo(float64).min
    becomes -inf and a fully masked (padding) query row turns NaN; the next layer then multiplies
    that NaN value by a zero weight at every valid query (0 · NaN = NaN). Valid queries never see
    padding keys, so zeroing non-finite values in block outputs changes no valid output."""
    if not enabled:
        yield
        return

    def hook(module, args, output):
        def clean(x):
            return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
        if isinstance(output, tuple):
            return (clean(output[0]), *output[1:])
        return clean(output)

    handles = [b.register_forward_hook(hook) for b in _blocks(model)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


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


@contextlib.contextmanager
def implementation(subject: Subject, name: str) -> Iterator[str]:
    """Switch the model to `name` for the block; restore every config afterwards (a failed switch
    can leave the shared config changed). Yields a note; raises _Refused with the reason."""
    model = subject.model
    configs = _configs(model)
    saved = [(c, c._attn_implementation_internal) for c in configs]
    note = ""
    try:
        if name != "eager" and name == "sdpa" and subject.family.eager_only:
            raise _Refused(f"{subject.family.name} refuses sdpa in transformers 5.x (eager only)")
        try:
            model.set_attn_implementation(name)
        except Exception as exc:
            text = str(exc).strip().splitlines()
            raise _Refused((text[0] if text else type(exc).__name__)[:200]) from None
        if model.config._attn_implementation != name:
            flag = SUPPORT_FLAG.get(name)
            if flag and getattr(model, flag, False):
                # The class declares support but cannot switch after init (reads the config at forward: Falcon).
                for c in configs:
                    c._attn_implementation_internal = name
                note = "set on the config (this class cannot switch implementations after loading)"
            else:
                raise _Refused(f"{type(model).__name__} does not support {name}")
        yield note
    finally:
        for c, value in saved:
            c._attn_implementation_internal = value


class _Refused(Exception):
    pass


def _run_here(subject: Subject, name: str, scenarios: list[Scenario]) -> Outcome:
    try:
        with implementation(subject, name) as note:
            return Outcome(runs=[_forward(subject, sc) for sc in scenarios], note=note)
    except _Refused as exc:
        return Outcome(kind="refused", reason=str(exc))
    except Exception as exc:
        kind, reason = describe_exception(name, exc)
        return Outcome(kind=kind, reason=reason)


@contextlib.contextmanager
def _as_dtype(model: torch.nn.Module, dtype: torch.dtype, current: torch.dtype) -> Iterator[None]:
    """Convert in place and back (exact: float32/bf16/fp16 -> float64 -> back is lossless)."""
    if dtype == current:
        yield
        return
    model.to(dtype)
    try:
        yield
    finally:
        model.to(current)


@contextlib.contextmanager
def _streamed_dtype(model: torch.nn.Module, dtype: torch.dtype, per_block: bool = False) -> Iterator[None]:
    """Run in `dtype` one module at a time, so memory holds one module's higher-precision copy
    instead of the whole model's. Each module's own floating parameters and buffers are converted
    when it is called and put back (the original storage: memory-mapped weights stay mapped) when
    it returns. The largest modules never get a whole copy: an embedding lookup is exact in any
    dtype, so its output is converted instead of its table; a large linear layer (the LM head)
    converts its weight a slice of rows at a time. Copies go into reused buffers (_Scratch).
    Measured on a 125M Llama (2 CPU cores, 64 tokens), peak RSS of the check over a bare load +
    forward: 2.2x whole model, 1.7x per module, 1.3x with embedding/head, ~1.15x reusing buffers.
    A module whose weights are read outside its own forward (T5's feed-forward casts to its child's
    weight dtype) makes the matmul dtypes clash: per_block=True then converts each transformer block
    whole on entry (memory: one block's copy), and the caller's last resort is the whole model."""
    scratch = _Scratch(dtype)
    saved: dict[int, list] = {}
    blocks = _blocks(model) if per_block else []
    whole = {id(b) for b in blocks}
    covered = {id(m) for b in blocks for m in b.modules() if m is not b}

    def own(module: torch.nn.Module) -> list[torch.Tensor]:
        recurse = id(module) in whole
        tensors = list(module.parameters(recurse=recurse)) + list(module.buffers(recurse=recurse))
        return [t for t in tensors if t.is_floating_point()]

    def pre(module, args):
        tensors = own(module)
        saved.setdefault(id(module), []).append([t.data for t in tensors])
        for t in tensors:
            t.data = scratch.take(t.data)

    def post(module, args, out):
        stack = saved.get(id(module))
        if stack:
            kept = _storages(out)
            for t, original in zip(own(module), stack.pop()):
                scratch.give(t.data, reusable=t.data.untyped_storage().data_ptr() not in kept)
                t.data = original

    def embedding_output(module, args, out):
        return out.to(dtype) if isinstance(out, torch.Tensor) and out.is_floating_point() else out

    def around_accelerate(hook):
        """accelerate loads an offloaded module's weights inside module.forward (its hook's
        pre_forward) and drops them again in post_forward: convert after the one, restore before
        the other. Torch's own pre-hooks would see meta tensors."""
        load, unload = hook.pre_forward, hook.post_forward

        def pre_forward(module, *args, **kwargs):
            args, kwargs = load(module, *args, **kwargs)
            pre(module, args)
            return args, kwargs

        def post_forward(module, output):
            post(module, None, output)
            return unload(module, output)

        hook.pre_forward, hook.post_forward = pre_forward, post_forward
        return hook

    handles, swapped, wrapped = [], [], []
    for module in model.modules():
        if id(module) in covered or not own(module):
            continue
        accelerate_hook = getattr(module, "_hf_hook", None)  # set by accelerate's dispatch (device maps)
        if isinstance(module, torch.nn.Embedding):
            handles.append(module.register_forward_hook(embedding_output))
        elif accelerate_hook is not None:
            wrapped.append(around_accelerate(accelerate_hook))
        elif (type(module) is torch.nn.Linear and "forward" not in vars(module)
              and module.weight.numel() * dtype.itemsize > _SLICE_BYTES):
            module.forward = _sliced_linear(module, scratch)
            swapped.append(module)
        else:
            handles.append(module.register_forward_pre_hook(pre))
            handles.append(module.register_forward_hook(post, always_call=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for module in swapped:
            del module.forward
        for hook in wrapped:
            del hook.pre_forward, hook.post_forward  # the class's methods again


class _Scratch:
    """Higher-precision copies of weights in buffers reused by shape. Fresh copies freed after each
    module make glibc raise its mmap threshold and keep later copies on the heap: peak RSS crept
    from 1.16x to 1.32x of a bare load + forward (125M Llama). A buffer that the module's output
    still points into is dropped, never reused."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.free: dict[tuple, list[torch.Tensor]] = {}

    def take(self, source: torch.Tensor) -> torch.Tensor:
        pool = self.free.get((tuple(source.shape), source.device))
        buffer = pool.pop() if pool else torch.empty(source.shape, dtype=self.dtype, device=source.device)
        return buffer.copy_(source)

    def give(self, buffer: torch.Tensor, reusable: bool = True) -> None:
        if reusable and buffer.dtype == self.dtype and buffer.is_contiguous():
            self.free.setdefault((tuple(buffer.shape), buffer.device), []).append(buffer)


def _storages(out: Any) -> set[int]:
    """Data pointers of the storages behind every tensor in a module's output."""
    found: set[int] = set()
    stack = [out]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            found.add(x.untyped_storage().data_ptr())
        elif isinstance(x, (tuple, list)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return found


_SLICE_BYTES = 16 << 20  # the most higher-precision weight a sliced linear layer holds at once


def _sliced_linear(module: torch.nn.Linear, scratch: _Scratch):
    """module's forward computed in the scratch dtype from row slices of its weight (each output
    feature is one row: slicing changes no sum). The input is not converted: a dtype clash still
    surfaces."""
    weight, bias = module.weight, module.bias
    rows = max(1, _SLICE_BYTES // (weight.shape[1] * scratch.dtype.itemsize))

    def forward(x: torch.Tensor) -> torch.Tensor:
        parts = []
        for i in range(0, weight.shape[0], rows):
            w = scratch.take(weight[i:i + rows])
            parts.append(torch.nn.functional.linear(x, w, None if bias is None else bias[i:i + rows].to(scratch.dtype)))
            scratch.give(w)
        return torch.cat(parts, dim=-1)

    return forward


def _reference_runs(subject: Subject, scenarios: list[Scenario],
                    preferred: torch.dtype) -> tuple[list[Run] | None, torch.dtype, str]:
    """(reference runs, their dtype, how they were built) or (None, preferred, why not).

    In `preferred` one module at a time, else one block at a time, else the whole model converted
    (not on a dispatched model: accelerate refuses to move it). A model with an op that has no
    float64 kernel (grouped_mm in MoE experts) falls back to float32 when that is still more precise
    than the run dtype (a bf16 model); with nothing more precise that runs there is no reference."""
    if preferred == subject.dtype:
        with _finite_padding(subject.model, preferred == torch.float64):
            return [_forward(subject, sc) for sc in scenarios], preferred, "no conversion"
    dispatched = is_dispatched(subject.model)
    candidates = [preferred] + [d for d in (torch.float32,)
                                if preferred.itemsize > d.itemsize > subject.dtype.itemsize]
    failure = ""
    for ref_dtype in candidates:
        padding_guard = ref_dtype == torch.float64
        ways = [("one module at a time", lambda: _streamed_dtype(subject.model, ref_dtype, False))]
        if not dispatched:
            ways += [("one block at a time", lambda: _streamed_dtype(subject.model, ref_dtype, True)),
                     ("whole model converted", lambda: _as_dtype(subject.model, ref_dtype, subject.dtype))]
        for how, converted in ways:
            try:
                with _eager_experts(subject.model) as experts, converted(), _finite_padding(subject.model, padding_guard):
                    runs = [_forward(subject, sc) for sc in scenarios]
                if all(r.hidden[-1].dtype == ref_dtype for r in runs):
                    return runs, ref_dtype, how + ("; MoE experts through the eager loop" if experts else "")
                failure = f"{str(ref_dtype).removeprefix('torch.')}: the conversion did not reach every module"
            except (RuntimeError, TypeError) as exc:
                text = str(exc).strip().splitlines()
                failure = f"{str(ref_dtype).removeprefix('torch.')}: {(text[0] if text else type(exc).__name__)[:120]}"
    where = "this offloaded model (run it where the model fits in memory)" if dispatched else "this model"
    return None, preferred, (f"no reference more precise than {subject.dtype_name} runs on {where}: {failure}; "
                             f"FlashAttention's rule needs one")


@contextlib.contextmanager
def _eager_experts(model: torch.nn.Module) -> Iterator[bool]:
    """MoE experts through transformers' eager loop for the reference: grouped_mm has no float64
    kernel ("Expected mat_a to be Float32, BFloat16 or Float16"). Same function, other summation
    order, like any reference. Restored afterwards."""
    get = getattr(model, "get_experts_implementation", None)
    saved = get() if callable(get) else {}
    if not any(v not in (None, "eager") for v in saved.values()):
        yield False
        return
    try:
        model.set_experts_implementation("eager")
    except Exception:  # the class cannot switch: the reference runs as the model is
        yield False
        return
    try:
        yield True
    finally:
        model.set_experts_implementation(saved)


def _reference_dtype(subject: Subject) -> torch.dtype:
    """float64 where the copy fits (CPU: a fraction of RAM; CUDA: of free memory), else float32."""
    params = sum(p.numel() for p in subject.model.parameters())
    for dtype in (torch.float64, torch.float32):
        if dtype.itemsize <= subject.dtype.itemsize:
            return subject.dtype
        extra = params * dtype.itemsize
        if subject.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(subject.device)
            if extra < 0.5 * free:
                return dtype
        elif subject.device.type == "cpu":
            try:
                import os
                avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            except (ValueError, OSError, AttributeError):
                avail = 8 << 30
            if extra < 0.4 * avail:
                return dtype
    return subject.dtype


# ------------------------------------------------------------------------------ judging
def _rel(a: torch.Tensor, ref: torch.Tensor, valid: torch.Tensor) -> float:
    a, r = a.double()[valid], ref.double()[valid]
    denom = r.norm().item()
    num = (a - r).norm().item()
    return num / denom if denom else (0.0 if num == 0 else float("inf"))


def _valid_for(run: Run, sc: Scenario, layer: int) -> torch.Tensor:
    name = run.layer_names[layer]
    if name.startswith("decoder"):
        return torch.ones(run.hidden[layer].shape[:2], dtype=torch.bool, device=run.hidden[layer].device)
    return sc.valid.to(run.hidden[layer].device)


def _padding_content(run: Run, sc: Scenario) -> str:
    if bool(sc.valid.all()):
        return ""
    h = run.hidden[-1 if not run.layer_names[-1].startswith("decoder") else 0]
    pad = h[~sc.valid.to(h.device)]
    if not bool(torch.isfinite(pad).all()):
        return "NaN/Inf"
    return "zeros" if bool((pad == 0).all()) else "finite"


def _first_non_finite(run: Run, sc: Scenario) -> str | None:
    for layer, h in enumerate(run.hidden):
        valid = _valid_for(run, sc, layer)
        bad = ~torch.isfinite(h[valid]).all(-1)
        if bool(bad.any()):
            rows, cols = torch.nonzero(valid, as_tuple=True)
            i = int(torch.nonzero(bad)[0])
            return f"{run.layer_names[layer]}, row {int(rows[i])}, position {int(cols[i])}"
    return None


def _next_token(ref: torch.Tensor | None, got: torch.Tensor | None) -> tuple[float, float] | None:
    if ref is None or got is None or not bool(torch.isfinite(got).all()):
        return None
    agree = (ref.argmax(-1) == got.argmax(-1)).double().mean().item()
    logp, logq = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kl = (logp.exp() * (logp - logq)).sum(-1).mean().item()
    return agree, max(kl, 0.0)


# ------------------------------------------------------------------------------ the check
def run(subject: Subject, options: RunOptions) -> CheckResult:
    settings = options.for_check("kernels")
    if not subject.is_hf:
        return CheckResult("kernels", Status.SKIP, "factory models have a single attention path: nothing to compare")
    if not hasattr(subject.model, "set_attn_implementation"):
        return CheckResult("kernels", Status.SKIP, "the model cannot switch attention implementations")
    names, skipped = default_implementations(subject)
    if settings.get("implementations"):
        names = [n for n in settings["implementations"] if n != "eager"]
        skipped = {}
    extra = subject.options.attn_implementation
    if extra not in ("eager", *names) and extra not in skipped:
        names.append(extra)

    dtype = subject.dtype
    dname = subject.dtype_name
    scenarios = _scenarios(subject, options)
    base_impl = subject.config._attn_implementation
    if base_impl not in (None, "eager"):
        return CheckResult("kernels", Status.SKIP, f"the model runs {base_impl}; load it with eager attention to compare")

    # Reference and the same-dtype eager baseline.
    # The model as it is first: if that cannot run, the check errors; it is not a missing reference.
    eager = [_forward(subject, sc) for sc in scenarios]
    reference, ref_dtype, built = _reference_runs(subject, scenarios, _reference_dtype(subject))
    if reference is None:
        return CheckResult("kernels", Status.SKIP, built)

    runs: dict[str, list[Run] | str] = {"eager": eager}
    notes: dict[str, str] = {}
    for name in names:
        outcome = run_isolated(subject, name, scenarios) if name in ISOLATED else _run_here(subject, name, scenarios)
        runs[name] = outcome.runs if outcome.runs is not None else outcome.reason
        if outcome.kind == "crashed":  # the implementation crashed on these inputs: that is a finding
            notes[name] = "crash"
        elif outcome.note:
            notes[name] = outcome.note

    atol = MACHINE_EPSILON.get(dname, 1.2e-7) / 2  # unit roundoff of the run dtype (relative)
    floor_note = f"reference eager in {str(ref_dtype).removeprefix('torch.')}" + (
        f" (converted {built})" if ref_dtype != dtype else
        " (no higher precision fits: the eager baseline is the reference itself)")

    rows_table: list[tuple] = []
    layer_rows: list[tuple] = []
    impl_results: dict[str, dict[str, Any]] = {}
    worst_status = []
    untrusted: dict[str, float] = {}
    for si, sc in enumerate(scenarios):
        last = len(eager[si].hidden) - 1
        off = _rel(eager[si].hidden[last], reference[si].hidden[last], _valid_for(eager[si], sc, last))
        if not off < SAME_FUNCTION:
            untrusted[sc.name] = off
    if len(untrusted) == len(scenarios):
        return CheckResult("kernels", Status.SKIP, "the higher-precision reference is not the same function as eager here "
                           f"(eager is {max(untrusted.values()):.3g} off it): nothing to judge against",
                           {"reference_dtype": str(ref_dtype).removeprefix("torch.")}, {"untrusted_inputs": untrusted})

    for name, got in runs.items():
        if isinstance(got, str):
            crashed = notes.get(name) == "crash"
            impl_results[name] = {"status": "fail" if crashed else "skip", "reason": got}
            worst_status.append(Status.FAIL if crashed else Status.SKIP)
            rows_table.append((name, "all", "-", "-", "-", "-", "-", "CRASH" if crashed else "SKIP", got[:80]))
            continue
        result: dict[str, Any] = {"status": "pass", "scenarios": {}}
        status = Status.PASS
        for si, sc in enumerate(scenarios):
            if sc.name in untrusted:
                continue
            r, e, g = reference[si], eager[si], got[si]
            where_bad = _first_non_finite(g, sc)
            errs = [_rel(g.hidden[l], r.hidden[l], _valid_for(g, sc, l)) for l in range(len(g.hidden))]
            base = [_rel(e.hidden[l], r.hidden[l], _valid_for(g, sc, l)) for l in range(len(g.hidden))]
            tols = [FACTOR * b + atol for b in base]
            ratios = [x / t for x, t in zip(errs, tols)]
            worst = max(range(len(errs)), key=lambda l: ratios[l])
            crossing = next((g.layer_names[l] for l in range(len(errs)) if errs[l] > tols[l]), None)
            nt = _next_token(r.logits, g.logits) if subject.kind != "encoder" else None
            sc_status = Status.FAIL if (where_bad or crossing) else Status.PASS
            status = Status.worst([status, sc_status])
            result["scenarios"][sc.name] = {
                "error": errs[worst], "eager_error": base[worst], "tolerance": tols[worst], "ratio": ratios[worst],
                "worst_layer": g.layer_names[worst], "first_layer_over_tolerance": crossing,
                "final_error": errs[-1], "final_eager_error": base[-1],
                "non_finite_at": where_bad, "padding_rows": _padding_content(g, sc),
                "top1_agreement": None if nt is None else nt[0], "kl": None if nt is None else nt[1],
            }
            verdict = "FAIL" if sc_status is Status.FAIL else "ok"
            why = f"NaN/Inf at {where_bad}" if where_bad else (f"over tolerance from {crossing}" if crossing else "")
            rows_table.append((name, sc.name, f"{errs[worst]:.2e}", f"{base[worst]:.2e}", f"{ratios[worst]:.3g}",
                               g.layer_names[worst], "-" if nt is None else f"{nt[0]:.0%} / {nt[1]:.1e}",
                               verdict, why or result["scenarios"][sc.name]["padding_rows"]))
            if name != "eager":
                for l in range(len(errs)):
                    layer_rows.append((name, sc.name, g.layer_names[l], f"{errs[l]:.2e}", f"{base[l]:.2e}",
                                       f"{tols[l]:.2e}", "over" if errs[l] > tols[l] else ""))
        result["status"] = status.value
        if name in notes:
            result["note"] = notes[name]
        impl_results[name] = result
        worst_status.append(status)

    compared = [n for n in runs if n != "eager" and not isinstance(runs[n], str)]
    status = Status.worst(worst_status)
    metrics: dict[str, Any] = {"reference_dtype": str(ref_dtype).removeprefix("torch."), "factor": FACTOR, "atol": atol}
    # The deciding numbers: the worst (implementation, scenario) by ratio.
    decided = None
    for name in compared or ["eager"]:
        for sc_name, s in impl_results[name]["scenarios"].items():
            if decided is None or s["ratio"] > decided[2]["ratio"] or (s["non_finite_at"] and not decided[2]["non_finite_at"]):
                decided = (name, sc_name, s)
    if decided:
        name, sc_name, s = decided
        metrics.update({"implementation": name, "scenario": sc_name, "error": s["error"], "eager_error": s["eager_error"],
                        "tolerance": s["tolerance"], "ratio": s["ratio"], "worst_layer": s["worst_layer"]})
    for name in compared:
        sc = impl_results[name]["scenarios"]
        metrics[f"{name}_ratio"] = max(s["ratio"] for s in sc.values())
    details = {"implementations": impl_results, "scenarios": [s.name for s in scenarios], "reference": floor_note,
               "not_run": skipped, "rule": f"error <= {FACTOR:g} x eager {dname} error + {atol:.1e} (relative L2, valid positions)"}
    tables = (Table("error vs reference (worst layer per input)",
                    ("implementation", "input", "error", "eager error", "ratio", "worst layer", "top-1 / KL", "verdict", "where"),
                    tuple(rows_table)),
              Table("per-layer error", ("implementation", "input", "layer", "error", "eager error", "tolerance", ""),
                    tuple(layer_rows)))

    if not compared:
        reasons = "; ".join(f"{n}: {r}" for n, r in runs.items() if isinstance(r, str))
        if status is Status.FAIL:
            summary = f"an attention implementation crashed: {reasons}"
        else:
            status = Status.SKIP
            summary = f"nothing to compare with eager here ({reasons})"
        return CheckResult("kernels", status, summary, metrics, details, tables)

    failed = [(n, sn, s) for n in compared + ["eager"] for sn, s in impl_results[n].get("scenarios", {}).items()
              if s["non_finite_at"] or s["first_layer_over_tolerance"]]
    crashed = [n for n in runs if isinstance(runs[n], str) and notes.get(n) == "crash"]
    if failed:
        n, sn, s = max(failed, key=lambda f: (bool(f[2]["non_finite_at"]), f[2]["ratio"]))
        if s["non_finite_at"]:
            summary = f"{n} gives NaN/Inf at valid positions on the {sn} input ({s['non_finite_at']})"
        else:
            summary = (f"{n} differs from eager on the {sn} input: error {s['error']:.3g} vs eager's {s['eager_error']:.3g} "
                       f"in {dname} = {s['ratio']:.3g}x the tolerance {s['tolerance']:.2g}, from {s['first_layer_over_tolerance']} "
                       f"(worst {s['worst_layer']})")
    elif crashed:
        summary = f"{', '.join(crashed)} crashed: " + "; ".join(str(runs[n]) for n in crashed)
    else:
        name, sc_name, s = decided
        refused = [n for n in runs if isinstance(runs[n], str)]
        summary = (f"{', '.join(compared)} agree with eager: worst error {s['error']:.3g} vs eager's {s['eager_error']:.3g} "
                   f"in {dname} ({s['ratio']:.2g}x the tolerance, {name}, {sc_name}, {s['worst_layer']})")
        if refused:  # asked for and not run: the check as asked is not complete (skip, never pass)
            summary = "not compared: " + "; ".join(f"{n} ({runs[n]})" for n in refused) + ". " + summary
    if untrusted:
        details["untrusted_inputs"] = untrusted
        summary += (f"; not judged: {', '.join(untrusted)} (eager is {max(untrusted.values()):.3g} off the "
                    f"{str(ref_dtype).removeprefix('torch.')} reference there: not the same function)")
        if status is Status.PASS:
            status = Status.WARN  # part of the inputs could not be judged: inconclusive, not a pass
    return CheckResult("kernels", status, summary, metrics, details, tables)
