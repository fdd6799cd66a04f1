"""rope — does the model apply the rotation its config describes, at every position it claims?

Two probes against a float64 reference built from the config (frequencies from transformers'
own ROPE_INIT_FUNCTIONS, angles p·θ_i in float64), at positions spread over
[0, max(target, declared context)] in one forward (two for dynamic/longrope, one on each side of
their switch point):
1. tables: each rotary module's cos/sin, layout (rotate-half, interleaved, compact) fitted.
2. applied rotation: every position holds the same token, so every layer's pre-rotation q/k are
   the same vector u at every position (values are identical, so attention averages identical
   vectors). The q/k that reach attention (captured from the eager attention function, or the
   apply function's output) must then satisfy q(p) = R_p q(0) pair by pair, with the untouched
   dims unchanged: wrong pairing, partial-dim mistakes, q/k layout mismatch, a key never rotated
   show here even when tables look right. Math: R_p rotates pair (a_i, b_i) by p·θ_i.
3. attention factor (YaRN/longrope "mscale"): q(p) = s·R_p u scales every position alike, so probe 2
   cannot see s, and nor can anything else observed after the rotation (weights scaled by s are the
   same model). It is measured against the un-rotated q/k of the same forward (the inputs of
   apply_rotary_pos_emb, else the q_proj/k_proj outputs of an attention without norms between
   projection and rotation): a rotation keeps each pair's norm, so ||rotated dims|| / ||un-rotated
   dims|| = s at every position, 0 included, and must equal transformers' attention_scaling.
The tolerance per element is what an honest implementation carries (float32 angles, output
rounding) plus the measured spread of the layer inputs across positions (the noise floor of the
same-token premise); FAIL above FAIL_RATIO times it, or on non-finite values. The attention factor's
tolerance is the rounding bound of one honest rotation (a few units of the dtype relative to s):
PASS within it, WARN up to FAIL_RATIO times it (inconclusive), FAIL above.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from posdiag.tools import rope_math
from posdiag.model.introspect import recurrent_reason
from posdiag.options import RunOptions
from posdiag.model.probe import Row, run_rows
from posdiag.results import CheckResult, Status, Table
from posdiag.model.subject import Subject
from posdiag.verdict import FAIL_RATIO, LOW_PRECISION, MACHINE_EPSILON

TITLE = "RoPE frequencies and applied rotation"

LAYOUTS = ("half", "interleaved")


def run(subject: Subject, options: RunOptions) -> CheckResult:
    if subject.position_kind != "rope":
        return CheckResult("rope", Status.SKIP, f"not a RoPE model (positions: {subject.position_kind})")
    if not subject.is_hf:
        return CheckResult("rope", Status.SKIP, "factory model without a transformers config: no RoPE parameters to compare against")
    specs = rope_math.rope_specs(subject.config)
    if not specs:
        return CheckResult("rope", Status.SKIP, "RoPE model, but the config gives no rope parameters to build a reference from")
    if subject.kind == "seq2seq":
        return CheckResult("rope", Status.SKIP, "encoder-decoder RoPE models are not probed yet")
    try:
        specs_ok = [rope_math.inv_freq(subject.config, s) for s in specs]
    except Exception as exc:
        return CheckResult("rope", Status.SKIP, f"cannot build the reference frequencies: {exc}"[:300])
    del specs_ok

    settings = options.for_check("rope")
    declared = subject.max_positions
    target = int(settings.get("target_length") or declared or max(s.training_length or 0 for s in specs) or 4096)
    static = [rope_math.report_spec(subject.config, s, target) for s in specs]
    layer_spec = _layer_specs(subject, specs)

    cap = _table_cap(subject.model)
    top = max(target, declared or 0, 2)
    notes: list[str] = []
    if cap is not None and top > cap:
        notes.append(f"positions capped at {cap - 1}: the rotary table has {cap} rows")
        top = cap
    plans = _plans(specs, top, cap)

    token = int(subject.sample_ids(1, 1, options.seed)[0, 0])
    findings: list[Finding] = []
    probe_rows: list[tuple] = []
    factors: list[Finding] = []
    table_done = applied_done = False
    why_not_applied = ""
    with _restored_rotary_state(subject.model):
        for label, positions in plans:
            refs = {id(s): rope_math.inv_freq(subject.config, s, seq_len=int(positions.max()) + 1) for s in specs}
            t_find, t_done = _probe_tables(subject, specs, refs, positions)
            findings += [f.labelled(label) for f in t_find]
            table_done |= t_done
            a_find, a_rows, a_done, why, a_factors = _probe_applied(subject, layer_spec, refs, positions, token)
            findings += [f.labelled(label) for f in a_find]
            factors += a_factors
            probe_rows += [(label, *r) for r in a_rows]
            applied_done |= a_done
            why_not_applied = why_not_applied or why

    static_metrics = _static_metrics(static)
    warnings = [w for r in static for w in r.warnings]
    tables = [_static_table(static)]
    if probe_rows:
        tables.append(_position_table(probe_rows))
    if factors:
        tables.append(_factor_table(factors))
    worst = max(findings, key=_severity, default=None)
    metrics: dict[str, Any] = {
        "target_length": target, "declared_context": declared, "positions_probed": int(sum(len(p) for _, p in plans)),
        "max_position": int(max(int(p.max()) for _, p in plans)), "probes": len(plans),
        "tables_probed": table_done, "applied_probed": applied_done, "fail_ratio": FAIL_RATIO, **static_metrics,
    }
    details: dict[str, Any] = {
        "specs": [_spec_dict(r) for r in static], "warnings": warnings, "notes": notes + [n for r in static for n in r.notes],
        "error_by_position": [[label, int(p), float(r)] for label, p, r in probe_rows],
    }
    factor = _factor_summary(factors, [r.attention_scaling for r in static], subject.dtype_name)
    metrics.update(factor.metrics)
    details["attention_factor"] = factor.rows
    if factor.note:
        details["notes"].append(factor.note)
    if worst is not None:
        metrics.update(worst.metrics())
        details["worst"] = worst.where()
        details["failures"] = [f.where() for f in sorted(findings, key=_severity, reverse=True)[:8] if f.failed]

    if not table_done and not applied_done:
        return CheckResult("rope", Status.SKIP, f"could not observe the rotation: {why_not_applied or 'no rotary module or attention hook found'}",
                           metrics, details, tuple(tables))
    failed = [f for f in findings if f.failed]
    if failed:
        bad = max(failed, key=_severity)
        return CheckResult("rope", Status.FAIL, bad.sentence(), metrics, details, tuple(tables))
    ratio = f"worst {worst.ratio:.3g}x tolerance" if worst else "no comparison"
    if not applied_done:
        return CheckResult("rope", Status.WARN, f"tables match the config ({ratio}) but the applied rotation could not be observed: {why_not_applied}",
                           metrics, details, tuple(tables))
    if factor.warning:
        return CheckResult("rope", Status.WARN, f"rotation agrees with the config ({ratio}); {factor.warning}", metrics, details, tuple(tables))
    if warnings:
        return CheckResult("rope", Status.WARN, f"module agrees with the config ({ratio}); {warnings[0]}", metrics, details, tuple(tables))
    spec_text = ", ".join(f"{s.rope_type} θ={s.theta:g}" + (f" ({s.layer_type})" if s.layer_type else "") for s in specs)
    return CheckResult("rope", Status.PASS,
                       f"applied rotation matches the config ({spec_text}) up to position {metrics['max_position']}: {ratio}"
                       f"{factor.clause}",
                       metrics, details, tuple(tables))


# --------------------------------------------------------------------------- findings
@dataclass
class Finding:
    kind: str  # table | applied rotation | pass-through dims | layout | non-finite | attention factor
    ratio: float
    error: float = 0.0
    tolerance: float = 0.0
    layer: int | None = None
    tensor: str = ""
    head: int | None = None
    position: int | None = None
    dim: int | None = None
    expected: float | None = None
    actual: float | None = None
    message: str = ""
    probe: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return not (self.ratio <= FAIL_RATIO)  # NaN fails

    def labelled(self, label: str) -> "Finding":
        self.probe = label
        return self

    def where(self) -> dict[str, Any]:
        out = {k: v for k, v in (("kind", self.kind), ("probe", self.probe), ("layer", self.layer), ("tensor", self.tensor),
                                  ("head", self.head), ("position", self.position), ("dim", self.dim),
                                  ("expected", self.expected), ("actual", self.actual), ("error", self.error),
                                  ("tolerance", self.tolerance), ("ratio", self.ratio)) if v not in (None, "")}
        out.update(self.extra)
        if self.message:
            out["message"] = self.message
        return out

    def metrics(self) -> dict[str, Any]:
        m = {"worst_ratio": self.ratio, "error": self.error, "tolerance": self.tolerance}
        for k in ("layer", "position", "dim", "expected", "actual"):
            v = getattr(self, k)
            if v is not None:
                m[f"worst_{k}"] = v
        return m

    def sentence(self) -> str:
        if self.message:
            return self.message
        if self.kind == "attention factor":
            return _factor_sentence(self)
        where = ", ".join(x for x in (
            f"layer {self.layer}" if self.layer is not None else "", self.tensor,
            f"head {self.head}" if self.head is not None else "",
            f"position {self.position}" if self.position is not None else "",
            f"dim {self.dim}" if self.dim is not None else "") if x)
        exp = f": expected {self.expected:.6g}, got {self.actual:.6g}" if self.expected is not None and self.actual is not None else ""
        return (f"{self.kind} disagrees with the config at {where}{exp} "
                f"(error {self.error:.3g}, {self.ratio:.3g}x the tolerance {self.tolerance:.3g})")


def _severity(f: "Finding") -> tuple:
    """Failures first, then those that say where (layer/position), then by ratio (NaN counts as worst)."""
    located = f.position is not None or f.layer is not None
    ratio = f.ratio if f.ratio == f.ratio else float("inf")
    return (f.failed, located, ratio)


# --------------------------------------------------------------------------- planning
def _layer_specs(subject: Subject, specs: list[rope_math.RopeSpec]) -> list[rope_math.RopeSpec]:
    config = rope_math.text_config(subject.config)
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None) or 1
    if len(specs) == 1 or specs[0].layer_type is None:
        return [specs[0]] * int(layers)
    by_type = {s.layer_type: s for s in specs}
    types = list(getattr(config, "layer_types", None) or [])
    return [by_type.get(t, specs[0]) for t in types] if types else [specs[0]] * int(layers)


def _table_cap(model: torch.nn.Module) -> int | None:
    """Rotary modules with a precomputed position table (GPT-J) cannot be indexed past it."""
    for module in model.modules():
        table = getattr(module, "embed_positions", None)
        if "Rotary" in type(module).__name__ and isinstance(table, torch.Tensor):
            return int(table.shape[0])
    return None


def _positions(top: int, extra: tuple[int, ...] = ()) -> np.ndarray:
    """0..7, then ~40 geometric steps to top-1, plus the points in `extra` (all below top)."""
    last = max(top - 1, 1)
    pts = set(range(min(8, last + 1)))
    if last > 8:
        pts |= {int(round(x)) for x in np.geomspace(8, last, 40)}
    pts |= {e for e in extra if 0 <= e <= last}
    pts.add(last)
    return np.array(sorted(pts), dtype=np.int64)


def _plans(specs: list[rope_math.RopeSpec], top: int, cap: int | None) -> list[tuple[str, np.ndarray]]:
    switches = sorted({s.switch_length for s in specs if s.stateful and s.switch_length})
    marks = tuple(x for s in specs for L in (s.training_length,) if L for x in (L - 1, L, L + 1))
    if not switches:
        return [("all", _positions(top, marks))]
    switch = switches[0]
    long_top = max(top, 2 * switch)
    if cap is not None:
        long_top = min(long_top, cap)
    return [(f"below switch {switch}", _positions(switch, marks)),
            (f"beyond switch {switch}", _positions(long_top, marks + (switch - 1, switch, switch + 1)))]


@contextlib.contextmanager
def _restored_rotary_state(model: torch.nn.Module):
    """Stateful rotary modules rewrite their buffers and attributes when probed long: put them back."""
    saved = []
    for module in model.modules():
        if any(n.endswith("inv_freq") for n in module._buffers) or hasattr(module, "rope_type"):
            attrs = {k: v for k, v in module.__dict__.items() if not k.startswith("_")}
            buffers = {k: (None if v is None else v.detach().clone()) for k, v in module._buffers.items()}
            saved.append((module, attrs, buffers, set(module._non_persistent_buffers_set)))
    try:
        yield
    finally:
        for module, attrs, buffers, non_persistent in saved:
            for k in [k for k in module.__dict__ if not k.startswith("_") and k not in attrs]:
                delattr(module, k)
            module.__dict__.update(attrs)
            module._buffers.clear()
            module._buffers.update(buffers)
            module._non_persistent_buffers_set.clear()
            module._non_persistent_buffers_set.update(non_persistent)


# --------------------------------------------------------------------------- tables
def _rotary_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules()
            if "Rotary" in type(m).__name__ or any(n.endswith("inv_freq") for n in m._buffers)]


def _table_candidates(freqs: np.ndarray, scaling: float, positions: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    ang = rope_math.reference_angles(freqs, positions)
    c, s = np.cos(ang) * scaling, np.sin(ang) * scaling
    return {
        "half": (np.concatenate([c, c], -1), np.concatenate([s, s], -1)),
        "interleaved": (np.repeat(c, 2, -1), np.repeat(s, 2, -1)),
        "compact": (c, s),
    }


def _probe_tables(subject: Subject, specs, refs, positions: np.ndarray) -> tuple[list[Finding], bool]:
    findings: list[Finding] = []
    done = False
    pos = torch.as_tensor(positions, device=subject.device)[None]
    eps_out = MACHINE_EPSILON.get(subject.dtype_name, 1.2e-7)
    for module in _rotary_modules(subject.model):
        x = torch.zeros(1, 1, 1, dtype=subject.dtype, device=subject.device)
        for spec in specs:
            if spec.layer_type is not None and not hasattr(module, f"{spec.layer_type}_inv_freq"):
                continue
            try:
                with torch.inference_mode():
                    out = module(x, pos, spec.layer_type) if spec.layer_type is not None else module(x, pos)
            except Exception:
                continue
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                continue
            done = True
            a, b = (t.detach().double().cpu().reshape(-1, t.shape[-1]).numpy() for t in out)
            findings.append(_judge_table(a, b, *refs[id(spec)], positions, eps_out, spec))
    return findings, done


def _judge_table(a, b, freqs, scaling, positions, eps_out, spec) -> Finding:
    label = f"rotary table ({spec.layer_type})" if spec.layer_type else "rotary table"
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        bad = np.argwhere(~(np.isfinite(a) & np.isfinite(b)))[0]
        return Finding("non-finite", float("nan"), position=int(positions[bad[0]]), dim=int(bad[1]),
                       message=f"{label}: non-finite cos/sin at position {int(positions[bad[0]])}, dim {int(bad[1])}")
    tol_pairs = rope_math.angle_tolerance(freqs, positions, eps_out) * max(abs(scaling), 1.0)
    best = None
    for layout, (rc, rs) in _table_candidates(freqs, scaling, positions).items():
        if rc.shape != a.shape:
            continue
        tol = {"half": np.concatenate([tol_pairs, tol_pairs], -1), "interleaved": np.repeat(tol_pairs, 2, -1),
               "compact": tol_pairs}[layout]
        for order, (x, y) in (("cos,sin", (a, b)), ("sin,cos", (b, a))):
            err = np.maximum(np.abs(x - rc), np.abs(y - rs))
            ratio = err / tol
            i = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
            which = x if np.abs(x - rc)[i] >= np.abs(y - rs)[i] else y
            ref = rc if which is x else rs
            f = Finding("table", float(ratio[i]), error=float(err[i]), tolerance=float(tol[i]), tensor=label,
                        position=int(positions[i[0]]), dim=int(i[1]), expected=float(ref[i]), actual=float(which[i]),
                        extra={"layout": layout, "order": order})
            if best is None or f.ratio < best.ratio:
                best = f
    if best is None:
        return Finding("table", float("inf"), tensor=label, message=(
            f"{label}: cos/sin width {a.shape[-1]} fits no layout of the {freqs.shape[0]} pairs the config gives "
            f"(rotary dims {spec.rotary_dim} of head {spec.head_dim}: partial_rotary_factor {spec.partial_rotary_factor:g})"))
    return best


# --------------------------------------------------------------------------- applied rotation
class _Capture:
    """Record q/k as attention consumes them (eager function) or as the apply function returns them,
    each with the un-rotated q/k of the same call when one is observable (for the attention factor)."""

    def __init__(self, eager: bool):
        self.eager_mode = eager  # the model runs the eager attention function (it sees what attention consumes)
        # (module, q, k, [(q0, k0, source, q1, k1)]): q0/k0 un-rotated, q1/k1 the same call's rotated
        # output (None: the q/k attention consumed). Pairing the apply function's own input and output
        # keeps whatever runs between rotation and attention (HunYuan's q/k norm) out of the factor.
        self.records: list[tuple[Any, torch.Tensor, torch.Tensor, list[tuple]]] = []
        self.pending: tuple[torch.Tensor, ...] | None = None  # inputs and outputs of the last apply call
        self.projected: dict[int, dict[str, torch.Tensor]] = {}  # id(attention) -> q_proj/k_proj outputs

    def eager(self, original):
        def wrapped(module, query, key, value, *args, **kwargs):
            plain = [] if self.pending is None else [(*self.pending[:2], "apply_rotary_pos_emb inputs", *self.pending[2:])]
            self.pending = None
            proj = self.projected.pop(id(module), {})
            if {"q", "k"} <= set(proj):
                plain.append((proj["q"], proj["k"], "q_proj/k_proj outputs", None, None))
            self.records.append((module, query.detach().clone(), key.detach().clone(), plain))
            return original(module, query, key, value, *args, **kwargs)
        return wrapped

    def apply(self, original, record: bool):
        """record: the rotated q/k are captured here (no eager function to see them); else only the inputs."""
        def wrapped(*args, **kwargs):
            out = original(*args, **kwargs)
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                return out
            q_in = args[0] if len(args) > 0 else kwargs.get("q")
            k_in = args[1] if len(args) > 1 else kwargs.get("k")
            plain = None
            if all(isinstance(t, torch.Tensor) and t.shape == o.shape for t, o in zip((q_in, k_in), out)):
                plain = (q_in.detach().clone(), k_in.detach().clone())
            if not record:
                self.pending = None if plain is None else (*plain, out[0].detach().clone(), out[1].detach().clone())
            else:
                self.records.append((None, out[0].detach().clone(), out[1].detach().clone(),
                                     [(*plain, "apply_rotary_pos_emb inputs", None, None)] if plain else []))
            return out
        return wrapped

    def projection(self, attention: torch.nn.Module, name: str):
        def hook(_module, _inputs, output):
            if isinstance(output, torch.Tensor):
                self.projected.setdefault(id(attention), {})[name] = output.detach().clone()
        return hook


def _attention_globals(model: torch.nn.Module) -> list[dict]:
    seen, out = set(), []
    for module in _attention_modules(model):
        fn = module.__dict__.get("forward") or type(module).forward
        fn = getattr(fn, "__func__", fn)
        g = inspect.unwrap(fn).__globals__
        if id(g) not in seen:
            seen.add(id(g))
            out.append(g)
    return out


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules()
            if type(m).__name__.endswith(("Attention", "SelfAttention")) and "Rotary" not in type(m).__name__]


def _plain_projections(attention: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """q_proj/k_proj whose outputs are the un-rotated q/k: separate linear maps, no norm module after them."""
    if any("norm" in type(m).__name__.lower() for m in attention.modules()):
        return {}
    proj = {n: getattr(attention, f"{n}_proj", None) for n in ("q", "k")}
    return proj if all(isinstance(m, torch.nn.Linear) for m in proj.values()) else {}


@contextlib.contextmanager
def _capturing(subject: Subject, capture: _Capture):
    """Wrap eager attention (eager runs) and apply_rotary_pos_emb in every attention module's globals."""
    patched, hooks = [], []
    for g in _attention_globals(subject.model):
        eager = capture.eager_mode and callable(g.get("eager_attention_forward"))
        if eager:
            patched.append((g, "eager_attention_forward", g["eager_attention_forward"]))
            g["eager_attention_forward"] = capture.eager(g["eager_attention_forward"])
        if callable(g.get("apply_rotary_pos_emb")):
            patched.append((g, "apply_rotary_pos_emb", g["apply_rotary_pos_emb"]))
            g["apply_rotary_pos_emb"] = capture.apply(g["apply_rotary_pos_emb"], record=not eager)
    if capture.eager_mode:
        for attention in _attention_modules(subject.model):
            for name, proj in _plain_projections(attention).items():
                hooks.append(proj.register_forward_hook(capture.projection(attention, name)))
    try:
        yield bool(patched)
    finally:
        for h in hooks:
            h.remove()
        for g, name, original in reversed(patched):
            g[name] = original


def _probe_applied(subject: Subject, layer_spec, refs, positions: np.ndarray, token: int):
    """-> (findings, [(position, worst ratio)], observed, why not, attention-factor rows)."""
    eager = getattr(rope_math.text_config(subject.config), "_attn_implementation", "eager") in ("eager", None)
    capture = _Capture(eager)
    ids = torch.full((len(positions),), token, dtype=torch.long, device=subject.device)
    with _capturing(subject, capture) as hooked:
        if not hooked:
            return [], [], False, "no eager attention function or apply_rotary_pos_emb to observe", []
        out = run_rows(subject, [Row(ids, positions=torch.as_tensor(positions))])
    if not capture.records:
        return [], [], False, "the attention function was never called with q/k", []
    # The same token at every position gives the same pre-rotation q/k only when nothing before the
    # attention layer reads order; a recurrent mixer does (healthy Qwen3-Next, LFM2, Bamba FAILed here
    # at 1e2-7e5x). The attention factor (rotated / un-rotated length) needs no such premise.
    recurrent = recurrent_reason(subject)
    eps = MACHINE_EPSILON.get(subject.dtype_name, 1.2e-7)
    findings: list[Finding] = []
    factors: list[Finding] = []
    by_pos = np.zeros(len(positions))
    for layer, (module, q, k, plain) in enumerate(capture.records):
        judged_at = "attention input"
        for _q0, _k0, _source, q1, k1 in plain:
            # Something changed q/k between the rotation and attention (HunYuan's q/k norm after RoPE):
            # what attention receives is no pure rotation, so judge the rotation where it is applied.
            if q1 is not None and q1.shape == q.shape and k1.shape == k.shape and not (torch.equal(q1, q) and torch.equal(k1, k)):
                q, k, judged_at = q1, k1, "apply_rotary_pos_emb output (q/k change between rotation and attention)"
                break
        spec = layer_spec[min(layer, len(layer_spec) - 1)]
        freqs, scaling = refs[id(spec)]
        hidden = out.hidden[min(layer, len(out.hidden) - 1)][0].double()
        spread = float(((hidden - hidden[:1]).norm(dim=-1) / hidden[:1].norm(dim=-1).clamp_min(1e-30)).max())
        floor = max(spread, eps)
        fits = {}
        for name, t in (("q", q), ("k", k)):
            arr = _heads(t, len(positions))
            if arr is None:
                return [], [], False, f"captured {name} has shape {tuple(t.shape)}, not [batch, heads, positions, dim]", []
            if not np.isfinite(arr).all():
                bad = np.argwhere(~np.isfinite(arr))[0]
                findings.append(Finding("non-finite", float("nan"), layer=layer, tensor=name, head=int(bad[0]),
                                        position=int(positions[bad[1]]), dim=int(bad[2]),
                                        message=f"non-finite rotated {name} at layer {layer}, position {int(positions[bad[1]])}, dim {int(bad[2])}"))
                fits[name] = None
                continue
            fits[name] = None if recurrent else {
                lay: _judge_applied(arr, freqs, spec, positions, lay, eps, floor, layer, name) for lay in LAYOUTS}
            for q0, k0, source, q1, k1 in plain:  # the first un-rotated capture that lines up with this tensor
                rotated = (q1 if name == "q" else k1)
                after = arr if rotated is None else _heads(rotated, len(positions))
                if after is None or not np.isfinite(after).all():
                    continue
                rot = min(2 * freqs.shape[0], after.shape[-1])
                before = _unrotated(q0 if name == "q" else k0, after.shape, rot, len(positions))
                if before is not None and positions[0] == 0 and _same_vectors(after, before, rot, eps):
                    factors.append(_judge_factor(after, before, rot, scaling, eps, positions, layer, name, source))
                    break
        if fits.get("q") is None or fits.get("k") is None:
            continue
        best = {n: min(f.values(), key=lambda x: x[0].ratio) for n, f in fits.items()}
        lay_q = min(fits["q"], key=lambda lay: fits["q"][lay][0].ratio)
        lay_k = min(fits["k"], key=lambda lay: fits["k"][lay][0].ratio)
        for n in ("q", "k"):
            findings.append(best[n][0])
            by_pos = np.maximum(by_pos, best[n][1])
        if not best["q"][0].failed and not best["k"][0].failed and lay_q != lay_k:
            findings.append(Finding("layout", float("inf"), layer=layer, message=(
                f"q and k are paired differently at layer {layer}: q {lay_q}, k {lay_k} "
                f"(<R_m q, R_n k> is no longer a function of n - m)")))
        elif best["q"][0].failed and not best["k"][0].failed:
            alt = fits["q"][lay_k][0]
            if alt.ratio > FAIL_RATIO:
                alt.message = ""
        for f in (best["q"][0], best["k"][0]):
            f.extra["layout"] = lay_q if f.tensor == "q" else lay_k
            f.extra["input_spread"] = spread
            f.extra["judged_at"] = judged_at
    if recurrent:
        return findings + factors, [], False, f"{recurrent} (the same token gives a different q/k at each position)", factors
    rows = [(int(p), float(r)) for p, r in zip(positions, by_pos)]
    return findings + factors, rows, True, "", factors


def _unrotated(t: torch.Tensor, shape: tuple, rot: int, n: int) -> np.ndarray | None:
    """The un-rotated q/k as [H, T, D] like the rotated capture (or only its rotary dims, as partial-rotary
    attention hands them to the apply function), or None when it does not line up."""
    if t.ndim == 3 and t.shape[-1] % shape[-1] == 0:  # projection output [B, T, H*D]
        t = t.reshape(*t.shape[:2], -1, shape[-1])
    arr = _heads(t, n)
    if arr is None or arr.shape[:-1] != shape[:-1] or arr.shape[-1] not in (shape[-1], rot):
        return None
    return arr if np.isfinite(arr).all() else None


def _rounding_bound(eps: float) -> float:
    """Relative error of one honest rotation: cos/sin from float32 angles scaled and rounded to the dtype
    (one unit each), products and sum rounded (two units): 3 units of the dtype + 2 of float32."""
    return 3 * eps + 2 * float(np.finfo(np.float32).eps)


def _same_vectors(after: np.ndarray, before: np.ndarray, rot: int, eps: float) -> bool:
    """At position 0 the rotation is the identity, so the rotated vector is a multiple of the un-rotated one;
    a capture of another tensor (another layer's call, something applied between) is far from parallel."""
    a, b = after[:, 0, :rot], before[:, 0, :rot]
    c = (a * b).sum(-1, keepdims=True) / np.maximum((b * b).sum(-1, keepdims=True), 1e-300)
    off = np.linalg.norm(a - c * b, axis=-1) / np.maximum(np.linalg.norm(a, axis=-1), 1e-300)
    return bool((off <= FAIL_RATIO * _rounding_bound(eps)).all())


def _judge_factor(after: np.ndarray, before: np.ndarray, rot: int, expected: float, eps: float, positions: np.ndarray,
                  layer: int, name: str, source: str) -> Finding:
    """Scale of the rotary dims of each (head, position) vector: ||R_p u|| / ||u|| = s for a pure rotation,
    judged against s x the rounding bound of one honest rotation."""
    n_after = np.linalg.norm(after[..., :rot], axis=-1)  # [H, T]
    n_before = np.linalg.norm(before[..., :rot], axis=-1)
    live = n_before > 0
    measured = float(np.sqrt((n_after[live] ** 2).sum() / max((n_before[live] ** 2).sum(), 1e-300)))
    scale = np.where(live, n_after / np.where(live, n_before, 1.0), expected)
    tolerance = abs(expected) * _rounding_bound(eps) + 1e-30
    err = np.abs(scale - expected)
    h, t = np.unravel_index(int(np.argmax(err)), err.shape)
    return Finding("attention factor", float(err[h, t] / tolerance), error=float(err[h, t]), tolerance=tolerance,
                   layer=layer, tensor=name, head=int(h), position=int(positions[t]), expected=float(expected),
                   actual=float(scale[h, t]), extra={"measured_factor": measured, "source": source, "rotary_dims": rot})


def _heads(t: torch.Tensor, n: int) -> np.ndarray | None:
    """[B, H, T, D] (or [B, T, H, D]) -> float64 [H, T, D] of row 0."""
    if t.ndim != 4:
        return None
    if t.shape[2] == n:
        x = t[0]
    elif t.shape[1] == n:
        x = t[0].transpose(0, 1)
    else:
        return None
    return x.double().cpu().numpy()


def _pairs(layout: str, rotary_dim: int) -> tuple[np.ndarray, np.ndarray]:
    half = rotary_dim // 2
    if layout == "half":
        return np.arange(half), np.arange(half) + half
    return np.arange(0, rotary_dim, 2), np.arange(1, rotary_dim, 2)


def _judge_applied(arr: np.ndarray, freqs: np.ndarray, spec, positions: np.ndarray, layout: str, eps: float,
                   floor: float, layer: int, name: str) -> tuple[Finding, np.ndarray]:
    """arr [H, T, D]: observed rotated vectors; q(p) must be R_p q(0) on the rotary dims, q(0) elsewhere."""
    heads, _, dim = arr.shape
    rot = min(2 * freqs.shape[0], dim)
    freqs = freqs[: rot // 2]
    a_idx, b_idx = _pairs(layout, rot)
    x0 = arr[:, :1]
    ang = rope_math.reference_angles(freqs, positions)[None]  # [1, T, pairs]
    c, s = np.cos(ang), np.sin(ang)
    xa, xb = x0[..., a_idx], x0[..., b_idx]
    ea, eb = xa * c - xb * s, xb * c + xa * s
    err_pair = np.sqrt((arr[..., a_idx] - ea) ** 2 + (arr[..., b_idx] - eb) ** 2)  # [H, T, pairs]
    norm_pair = np.sqrt(xa ** 2 + xb ** 2)
    norm_head = np.linalg.norm(x0, axis=-1, keepdims=True)
    angle_tol = rope_math.angle_tolerance(freqs, positions, 0.0)[None]
    tol_pair = norm_pair * angle_tol + norm_head * (4 * eps + 2 * floor) + 1e-30
    ratio = err_pair / tol_pair
    i = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    which_a = abs(arr[i[0], i[1], a_idx[i[2]]] - ea[i]) >= abs(arr[i[0], i[1], b_idx[i[2]]] - eb[i])
    d = int(a_idx[i[2]] if which_a else b_idx[i[2]])
    worst = Finding("applied rotation", float(ratio[i]), error=float(err_pair[i]), tolerance=float(tol_pair[i]), layer=layer,
                    tensor=name, head=int(i[0]), position=int(positions[i[1]]), dim=d,
                    expected=float(ea[i] if which_a else eb[i]), actual=float(arr[i[0], i[1], d]),
                    extra={"pair": int(i[2]), "pair_angle": float(ang[0, i[1], i[2]])})
    by_pos = ratio.max(axis=(0, 2))
    if rot < dim:
        rest = arr[..., rot:]
        err = np.abs(rest - x0[..., rot:])
        tol = norm_head * (4 * eps + 2 * floor) + 1e-30
        r = err / tol
        j = np.unravel_index(int(np.argmax(r)), r.shape)
        by_pos = np.maximum(by_pos, r.max(axis=(0, 2)))
        if r[j] > worst.ratio:
            worst = Finding("pass-through dims", float(r[j]), error=float(err[j]), tolerance=float(tol[j[0], 0, 0]), layer=layer,
                            tensor=name, head=int(j[0]), position=int(positions[j[1]]), dim=int(rot + j[2]),
                            expected=float(x0[j[0], 0, j[2] + rot]), actual=float(rest[j]),
                            extra={"rotary_dim": rot, "head_dim": dim})
    return worst, by_pos


# --------------------------------------------------------------------------- attention factor verdict
@dataclass
class _FactorSummary:
    metrics: dict[str, Any]
    rows: list[dict[str, Any]]
    warning: str = ""  # WARN reason (a deviation inside the FAIL level, or a factor != 1 never measured)
    note: str = ""
    clause: str = ""  # appended to the PASS summary


def _factor_sentence(f: Finding) -> str:
    measured = f.extra.get("measured_factor", f.actual)
    exp = f.expected or 0.0
    why = ""
    if exp != 1.0 and abs(measured - 1.0) < abs(measured - exp) / 10:
        why = " (the factor is dropped)"
    elif exp != 1.0 and abs(measured - exp * exp) < abs(measured - exp) / 10:
        why = " (the factor is applied twice)"
    return (f"attention factor on the applied path: layer {f.layer} {f.tensor} is scaled by {measured:.6g}, the config "
            f"expects {exp:.6g}{why}; worst at head {f.head}, position {f.position}: {f.actual:.6g}, "
            f"{f.ratio:.3g}x the rounding bound {f.tolerance:.3g} (measured against {f.extra.get('source', '?')})")


def _factor_summary(factors: list[Finding], expected: list[float], dtype: str) -> _FactorSummary:
    """Metrics, per-layer rows and the WARN band of the attention-factor probe (FAIL goes with the findings)."""
    rows = [{"probe": f.probe, "layer": f.layer, "tensor": f.tensor, "expected": f.expected,
             "measured": f.extra["measured_factor"], "worst_position": f.position, "worst_actual": f.actual,
             "ratio": f.ratio, "source": f.extra["source"]} for f in factors]
    trivial = all(e == 1.0 for e in expected)
    if not factors:
        text = "attention factor not measured on the applied path: no un-rotated q/k observed"
        if trivial:
            return _FactorSummary({"attention_factor_probed": False}, rows, note=text + " (the config's factor is 1)")
        return _FactorSummary({"attention_factor_probed": False}, rows,
                              warning=f"{text}; the factor {', '.join(f'{e:.6g}' for e in expected)} is checked on the rotary tables only")
    worst = max(factors, key=_severity)
    metrics = {"attention_factor_probed": True, "attention_factor_expected": worst.expected,
               "attention_factor_measured": worst.extra["measured_factor"], "attention_factor_ratio": worst.ratio,
               "attention_factor_tolerance": worst.tolerance, "attention_factor_source": worst.extra["source"]}
    if worst.ratio > 1.0 and not worst.failed:
        why = f"inconclusive in {dtype} (rerun in float32)" if dtype in LOW_PRECISION else "inconclusive"
        return _FactorSummary(metrics, rows, warning=f"{why}: {_factor_sentence(worst)} (FAIL above {FAIL_RATIO:g}x)")
    clause = "" if trivial else f"; attention factor {worst.extra['measured_factor']:.6g} (expected {worst.expected:.6g})"
    return _FactorSummary(metrics, rows, clause=clause)


# --------------------------------------------------------------------------- report pieces
def _static_metrics(static: list[rope_math.SpecReport]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in static:
        prefix = f"{r.spec.layer_type}_" if r.spec.layer_type and len(static) > 1 else ""
        a = r.after
        out.update({
            f"{prefix}rope_type": r.spec.rope_type, f"{prefix}rope_theta": r.spec.theta,
            f"{prefix}rotary_dim": r.spec.rotary_dim, f"{prefix}training_length": a.training_length,
            f"{prefix}critical_pair": a.critical_pair, f"{prefix}longest_wavelength": a.longest_wavelength,
            f"{prefix}unseen_pairs_at_target": a.unseen_pairs, f"{prefix}alias_offset": a.alias_offset,
            f"{prefix}decay_first_zero": a.decay_first_zero, f"{prefix}attention_scaling": r.attention_scaling,
        })
    return out


def _spec_dict(r: rope_math.SpecReport) -> dict[str, Any]:
    return {"layer_type": r.spec.layer_type, "rope_type": r.spec.rope_type, "theta": r.spec.theta,
            "head_dim": r.spec.head_dim, "rotary_dim": r.spec.rotary_dim, "params": r.spec.params,
            "attention_scaling": r.attention_scaling, "before": r.before.summary(), "after": r.after.summary()}


def _fmt(v: Any) -> str:
    if v is None:
        return "none"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _static_table(static: list[rope_math.SpecReport]) -> Table:
    rows = []
    for r in static:
        for label, a in (("before scaling", r.before), ("after scaling", r.after)):
            rows.append((f"{r.spec.label}: {label}", _fmt(a.critical_pair), _fmt(a.longest_wavelength), _fmt(a.unseen_pairs),
                         _fmt(a.alias_offset) if a.alias_offset else f"none ≤ {a.alias_scanned}", _fmt(a.decay_first_zero)))
    return Table("frequencies vs training length (information)",
                 ("where", "critical pair", "longest λ", "unseen pairs @N", "alias", "decay 1st zero"), tuple(rows))


def _factor_table(factors: list[Finding]) -> Table:
    return Table("attention factor on the applied path (||rotated|| / ||un-rotated|| of the rotary dims)",
                 ("where", "layer", "q/k", "expected", "measured", "worst x bound"),
                 tuple((f.probe, f.layer, f.tensor, f"{f.expected:.6g}", f"{f.extra['measured_factor']:.6g}", f"{f.ratio:.3g}")
                       for f in factors))


def _position_table(rows: list[tuple]) -> Table:
    picked = rows if len(rows) <= 12 else [rows[i] for i in np.unique(np.linspace(0, len(rows) - 1, 12).astype(int))]
    return Table("applied-rotation error by position (x tolerance)", ("where", "position", "error ratio"),
                 tuple((label, p, f"{r:.3g}") for label, p, r in picked))
