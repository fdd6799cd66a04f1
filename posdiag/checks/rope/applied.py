"""Probe 2, the applied rotation: every position holds the same token, so q(p) = R_p q(0) pair by pair
(R_p rotates pair (a_i, b_i) by p·θ_i), the dims past the rotary ones unchanged. Either direction (R_p or R_-p)
is relative when q and k share it; q and k that do not share pairing and direction fail."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from posdiag.checks.rope import angles as rope_angles
from posdiag.checks.rope.capture import Capture, capturing, heads, without_rope
from posdiag.checks.rope.factor import factor_finding
from posdiag.checks.rope.findings import Finding
from posdiag.checks.rope.paired import lined_up
from posdiag.model.introspect import recurrent_reason
from posdiag.model.probe import Row, run_rows
from posdiag.model.subject import Subject
from posdiag.tools import rope_math
from posdiag.verdict import MACHINE_EPSILON, within_band

# Pairing of the rotary dims (rotate-half or interleaved), where they sit in the head when only some rotate (the
# leading slice as Llama and Phi's partial rotary, or the trailing one, "-trailing": DeepSeek-V4 lays a head out as
# [nope | rope]), and direction: R_p or R_-p. NanoChat rotates by -p·θ_i (its rotate_half is (x2, -x1)); applied to q
# and k alike that is still relative, <R_-m q, R_-n k> = <q, R_(m-n) k>, so either direction passes when q and k
# agree, and q and k fitting different ones fails (best_fits).
_PLACED = ("half", "interleaved", "half-trailing", "interleaved-trailing")
LAYOUTS = _PLACED + tuple(f"{lay}, reversed" for lay in _PLACED)


@dataclass
class Applied:
    """What probe 2 observed at one plan's positions."""

    findings: list[Finding] = field(default_factory=list)  # every finding, the attention-factor ones included
    rows: list[tuple[int, float]] = field(default_factory=list)  # (position, worst ratio over the judged layers)
    observed: bool = False  # the applied rotation was judged
    why_not: str = ""  # why it was not
    factors: list[Finding] = field(default_factory=list)  # the attention factor per layer and tensor
    no_factor: list[str] = field(default_factory=list)  # "layer L q": no un-rotated q/k lined up with that q/k
    nope: dict[int, str] = field(default_factory=dict)  # layer -> why it runs without RoPE (by design)


@dataclass(frozen=True)
class _Context:
    """What every layer's judgement shares."""

    positions: np.ndarray
    eps: float
    recurrent: str  # why the same-token premise fails ('' when it holds): judged pairwise then


def probe_applied(subject: Subject, layer_spec, refs, positions: np.ndarray, token: int) -> Applied:
    """Capture q/k in one forward of the same token at `positions` and judge every layer's rotation."""
    # The same token at every position gives the same pre-rotation q/k only when nothing before the
    # attention layer reads order; a recurrent mixer does (healthy Qwen3-Next, LFM2, Bamba FAILed here
    # at 1e2-7e5x). There the rotation is judged against the un-rotated q/k of the same call (paired.py);
    # the attention factor (rotated / un-rotated length) needs no such premise either.
    recurrent = recurrent_reason(subject)
    records, out, why, nope = _capture_qk(subject, layer_spec, positions, token, bool(recurrent))
    if why:
        return Applied(why_not=why)
    ctx = _Context(positions=positions, eps=MACHINE_EPSILON.get(subject.dtype_name, 1.2e-7), recurrent=recurrent)
    seen = Applied()
    unpaired: list[str] = []  # no un-rotated capture lines up, where the rotation must be judged against it
    judged = 0
    by_pos = np.zeros(len(positions))
    for layer, _module, q, k, plain in records:
        if layer in nope:
            if nope[layer][1]:  # the config gives the layer no rotation, yet one was applied before its attention
                seen.findings.append(Finding("layout", float("inf"), layer=layer, message=(
                    f"layer {layer} rotates q/k although {nope[layer][0]}")))
            continue
        spec = layer_spec[min(layer, len(layer_spec) - 1)]
        spread = 0.0 if recurrent else input_spread(out, layer)  # judged pairwise: no premise, no spread
        fits = _layer_fits(ctx, seen, unpaired, layer, spec, refs[id(spec)], spread, q, k, plain)
        if isinstance(fits, str):
            return Applied(why_not=fits)
        if fits is None:
            continue
        layer_findings, layer_by_pos = best_fits(fits[0], layer, spread, fits[1])
        judged += 1
        seen.findings += layer_findings
        by_pos = np.maximum(by_pos, layer_by_pos)
    seen.findings += mixed_directions(seen.findings)
    if recurrent and (unpaired or not judged):  # a layer judged pairwise still FAILs on its own findings
        where = f"; no un-rotated q/k lined up with the rotated one at {', '.join(unpaired)}" if unpaired else ""
        return Applied(findings=seen.findings + seen.factors, factors=seen.factors, no_factor=seen.no_factor,
                       why_not=f"{recurrent} (the same token gives a different q/k at each position){where}")
    return Applied(findings=seen.findings + seen.factors, rows=[(int(p), float(r)) for p, r in zip(positions, by_pos,
                                                                                                   strict=True)],
                   observed=True, factors=seen.factors, no_factor=seen.no_factor,
                   nope={i: why for i, (why, _) in nope.items()})


def _layer_fits(ctx: _Context, seen: Applied, unpaired: list[str], layer: int, spec, ref, spread: float,
                q: torch.Tensor, k: torch.Tensor, plain: list[tuple]) -> tuple[dict, str] | str | None:
    """Every layout's fit for this layer's q and k, and where they were judged; a reason string when the capture
    has the wrong shape; None when q or k cannot be judged (non-finite, or nothing to pair it with). Findings,
    attention factors and unpaired tensors go into `seen` and `unpaired`."""
    q, k, judged_at = judged_qk(q, k, plain)
    freqs, scaling = ref
    arrays = {name: heads(t, len(ctx.positions)) for name, t in (("q", q), ("k", k))}
    for name, t in (("q", q), ("k", k)):
        if arrays[name] is None:
            return f"captured {name} has shape {tuple(t.shape)}, not [batch, heads, positions, dim]"
    fits = {}
    for name, arr in arrays.items():
        if not np.isfinite(arr).all():
            seen.findings.append(non_finite(arr, ctx.positions, layer, name))
            fits[name] = None
            continue
        factor = factor_finding(arr, plain, name, freqs, scaling, ctx.eps, ctx.positions, layer)
        if factor is not None:
            seen.factors.append(factor)
        else:
            seen.no_factor.append(f"layer {layer} {name}")
        if not ctx.recurrent:
            fits[name] = {lay: judge_applied(arr, freqs, spec, ctx.positions, lay, ctx.eps, max(spread, ctx.eps),
                                             layer, name) for lay in layouts_for(freqs, arr.shape[-1])}
            continue
        pair = lined_up(arr, plain, name, min(2 * freqs.shape[0], arr.shape[-1]), ctx.positions, ctx.eps)
        if pair is None:
            unpaired.append(f"layer {layer} {name}")
            fits[name] = None
            continue
        after, before, judged_at = pair
        scale = scaling if factor is None else factor.extra["measured_factor"]  # the factor is judged apart
        fits[name] = {lay: judge_applied(after, freqs, spec, ctx.positions, lay, ctx.eps, ctx.eps, layer, name,
                                         base=before, scale=scale) for lay in layouts_for(freqs, after.shape[-1])}
    if fits["q"] is None or fits["k"] is None:
        return None
    return fits, judged_at


def _capture_qk(subject: Subject, layer_spec, positions: np.ndarray, token: int,
                hybrid: bool) -> tuple[list, object, str, dict]:
    """One forward of the same token at `positions`, q/k captured per attention call.
    -> ([(layer, module, q, k, plain)], output, why not, {layer: (why it runs without RoPE, rotated anyway)}).
    hybrid: recurrent mixers take some layers, so records are numbered by decoder layer (Capture.layer_indices)."""
    eager = getattr(rope_math.text_config(subject.config), "_attn_implementation", "eager") in ("eager", None)
    capture = Capture(eager)
    ids = torch.full((len(positions),), token, dtype=torch.long, device=subject.device)
    with capturing(subject, capture) as hooked:
        if not hooked:
            return [], None, "no eager attention function or apply_rotary_pos_emb to observe", {}
        out = run_rows(subject, [Row(ids, positions=torch.as_tensor(positions))])
    if not capture.records:
        return [], out, "the attention function was never called with q/k", {}
    capture.first_calls()
    layers = capture.layer_indices(len(layer_spec)) if hybrid else list(range(len(capture.records)))
    mapped = layers != list(range(len(layers)))
    nope = without_rope(subject, layer_spec, capture, layers if mapped else None)
    if mapped:  # a layer without attention calls (a recurrent mixer's) is no NoPE layer
        nope = {i: why for i, why in nope.items() if i in layers}
    rotated = dict(zip(layers, capture.rotated if len(capture.rotated) == len(layers) else [False] * len(layers),
                       strict=True))
    records = [(layer, *record) for layer, record in zip(layers, capture.records, strict=True)]
    return records, out, "", {i: (why, rotated.get(i, False) and layer_spec[i] is None) for i, why in nope.items()}


def judged_qk(q: torch.Tensor, k: torch.Tensor, plain: list[tuple]) -> tuple[torch.Tensor, torch.Tensor, str]:
    """The q/k to judge: what attention received, unless something changed them after the rotation."""
    for _q0, _k0, _source, q1, k1 in plain:
        # Something changed q/k between the rotation and attention (HunYuan's q/k norm after RoPE):
        # what attention receives is no pure rotation, so judge the rotation where it is applied.
        if (q1 is not None and q1.shape == q.shape and k1.shape == k.shape
                and not (torch.equal(q1, q) and torch.equal(k1, k))):
            return q1, k1, "apply_rotary_pos_emb output (q/k change between rotation and attention)"
    return q, k, "attention input"


def input_spread(out, layer: int) -> float:
    """How far the layer's input moves across positions (relative to position 0): the same-token premise's floor."""
    hidden = out.hidden[min(layer, len(out.hidden) - 1)][0].double()
    return float(((hidden - hidden[:1]).norm(dim=-1) / hidden[:1].norm(dim=-1).clamp_min(1e-30)).max())


def non_finite(arr: np.ndarray, positions: np.ndarray, layer: int, name: str) -> Finding:
    bad = np.argwhere(~np.isfinite(arr))[0]
    return Finding("non-finite", float("nan"), layer=layer, tensor=name, head=int(bad[0]),
                   position=int(positions[bad[1]]), dim=int(bad[2]),
                   message=f"non-finite rotated {name} at layer {layer}, position {int(positions[bad[1]])}, dim "
                           f"{int(bad[2])}")


def best_fits(fits: dict, layer: int, spread: float, judged_at: str) -> tuple[list[Finding], np.ndarray]:
    """The best layout for q and for k (and a finding when they differ). -> (findings, worst ratio by position)."""
    best = {n: min(f.values(), key=lambda x: x[0].ratio) for n, f in fits.items()}
    lay_q = min(fits["q"], key=lambda lay: fits["q"][lay][0].ratio)
    lay_k = min(fits["k"], key=lambda lay: fits["k"][lay][0].ratio)
    findings = [best["q"][0], best["k"][0]]
    # A pairing is only told apart when the other layout fails for that tensor: when the layer's input moves
    # across positions (spread), the tolerance can admit both, and a "best" layout then says nothing.
    decided = all(all(f[lay][0].failed for lay in f if lay != chosen)
                  for f, chosen in ((fits["q"], lay_q), (fits["k"], lay_k)))
    if not best["q"][0].failed and not best["k"][0].failed and lay_q != lay_k and decided:
        what = ("rotated in opposite directions" if _pairing(lay_q) == _pairing(lay_k) else "paired differently")
        findings.append(Finding("layout", float("inf"), layer=layer, message=(
            f"q and k are {what} at layer {layer}: q {lay_q}, k {lay_k} "
            f"(<R_m q, R_n k> is no longer a function of n - m)")))
    elif best["q"][0].failed and not best["k"][0].failed:
        alt = fits["q"][lay_k][0]
        if not within_band(alt.ratio):
            alt.message = ""
    for f in (best["q"][0], best["k"][0]):
        chosen = lay_q if f.tensor == "q" else lay_k
        f.extra["layout"] = chosen
        f.extra["direction_decided"] = _twin(chosen) in fits[f.tensor] and fits[f.tensor][_twin(chosen)][0].failed
        f.extra["input_spread"] = spread
        f.extra["judged_at"] = judged_at
    return findings, np.maximum(best["q"][1], best["k"][1])


def layouts_for(freqs: np.ndarray, dim: int) -> tuple[str, ...]:
    """The distinct layouts a head of `dim` dims can have: the trailing ones only where the rotation is partial
    (a full rotation's trailing slice is the leading one, and a duplicate would stop a pairing being told apart)."""
    return LAYOUTS if 2 * freqs.shape[0] < dim else tuple(lay for lay in LAYOUTS if "-trailing" not in lay)


def _pairing(layout: str) -> str:
    return layout.split(",")[0]


def _twin(layout: str) -> str:
    """The same pairing rotated the other way."""
    return _pairing(layout) if layout.endswith("reversed") else f"{layout}, reversed"


def mixed_directions(findings: list[Finding]) -> list[Finding]:
    """Either direction is a convention of the model's code (NanoChat rotates by -p·θ everywhere), but one model
    rotating some layers by +p·θ and others by -p·θ mixes two conventions: the odd layers are a bug (a port that
    negated sin in one place). Only layers whose direction the probe told apart count."""
    direction: dict[int, bool] = {}
    for f in findings:
        if f.layer is not None and not f.failed and f.extra.get("direction_decided"):
            direction.setdefault(f.layer, f.extra["layout"].endswith("reversed"))
    if len(set(direction.values())) < 2:
        return []
    reversed_layers = [layer for layer, rev in direction.items() if rev]
    forward_layers = [layer for layer, rev in direction.items() if not rev]
    odd, usual = sorted((reversed_layers, forward_layers), key=len)
    return [Finding("layout", float("inf"), layer=layer, message=(
        f"layer {layer} rotates by {'-' if layer in reversed_layers else '+'}p·θ while layers "
        f"{', '.join(map(str, usual[:6]))} rotate the other way: two conventions in one model")) for layer in odd]


def _pairs(layout: str, rotary_dim: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The dims (a_i, b_i) of each rotated pair i."""
    half, start = rotary_dim // 2, dim - rotary_dim if "-trailing" in layout else 0
    if layout.startswith("half"):
        return start + np.arange(half), start + np.arange(half) + half
    return start + np.arange(0, rotary_dim, 2), start + np.arange(1, rotary_dim, 2)


def judge_applied(arr: np.ndarray, freqs: np.ndarray, spec, positions: np.ndarray, layout: str, eps: float,
                  floor: float, layer: int, name: str, angles: np.ndarray | None = None,
                  base: np.ndarray | None = None, scale: float = 1.0) -> tuple[Finding, np.ndarray]:
    """arr [H, T, D]: observed rotated vectors; q(p) must be R_p q(0) (R_-p for a reversed layout) on the rotary
    dims, q(0) elsewhere.
    angles [T, pairs]: each pair's reference angle where it is not p·θ_i (mRoPE streams that differ).
    base [H, T, D]: the un-rotated q/k of each position (paired.py): q(p) must be scale·R_p base(p) on the rotary
    dims, base(p) elsewhere, with no same-token premise."""
    heads, _, dim = arr.shape
    rot = min(2 * freqs.shape[0], dim)
    freqs = freqs[: rot // 2]
    a_idx, b_idx = _pairs(layout, rot, dim)
    x0 = arr[:, :1] if base is None else base
    ang = (rope_angles.reference_angles(freqs, positions) if angles is None else angles[:, : rot // 2])[None]
    c, s = np.cos(ang), np.sin(ang) * (-1.0 if layout.endswith("reversed") else 1.0)
    xa, xb = scale * x0[..., a_idx], scale * x0[..., b_idx]
    ea, eb = xa * c - xb * s, xb * c + xa * s
    err_pair = np.sqrt((arr[..., a_idx] - ea) ** 2 + (arr[..., b_idx] - eb) ** 2)  # [H, T, pairs]
    norm_pair = np.sqrt(xa ** 2 + xb ** 2)
    norm_head = np.linalg.norm(x0, axis=-1, keepdims=True)
    angle_tol = rope_angles.angle_bound(ang, 0.0)
    tol_pair = norm_pair * angle_tol + norm_head * (4 * eps + 2 * floor) + 1e-30
    ratio = err_pair / tol_pair
    i = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    which_a = abs(arr[i[0], i[1], a_idx[i[2]]] - ea[i]) >= abs(arr[i[0], i[1], b_idx[i[2]]] - eb[i])
    d = int(a_idx[i[2]] if which_a else b_idx[i[2]])
    worst = Finding("applied rotation", float(ratio[i]), error=float(err_pair[i]), tolerance=float(tol_pair[i]),
                    layer=layer,
                    tensor=name, head=int(i[0]), position=int(positions[i[1]]), dim=d,
                    expected=float(ea[i] if which_a else eb[i]), actual=float(arr[i[0], i[1], d]),
                    extra={"pair": int(i[2]), "pair_angle": float(ang[0, i[1], i[2]])})
    by_pos = ratio.max(axis=(0, 2))
    if rot < dim:
        rest_idx = np.setdiff1d(np.arange(dim), np.concatenate([a_idx, b_idx]))  # the dims that must not move
        rest = arr[..., rest_idx]
        kept = np.broadcast_to(x0[..., rest_idx], rest.shape)
        err = np.abs(rest - kept)
        tol = np.broadcast_to(norm_head * (4 * eps + 2 * floor) + 1e-30, rest.shape)
        r = err / tol
        j = np.unravel_index(int(np.argmax(r)), r.shape)
        by_pos = np.maximum(by_pos, r.max(axis=(0, 2)))
        if r[j] > worst.ratio:
            worst = Finding("pass-through dims", float(r[j]), error=float(err[j]), tolerance=float(tol[j]),
                            layer=layer,
                            tensor=name, head=int(j[0]), position=int(positions[j[1]]), dim=int(rest_idx[j[2]]),
                            expected=float(kept[j]), actual=float(rest[j]),
                            extra={"rotary_dim": rot, "head_dim": dim})
    return worst, by_pos
