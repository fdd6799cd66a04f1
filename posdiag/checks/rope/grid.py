"""Probe 4 (multimodal RoPE): the applied rotation where the position streams differ.

For text tokens the t/h/w streams are equal, so every pair turns by p·θ_i whichever stream drives it: sections
swapped between q and k, the wrong layout (chunked vs interleaved) or wrong section sizes are invisible to
probe 2. Here the same token sits at 3-stream positions [3, 1, T] whose streams differ, and pair i of q and k must
turn by pos[stream(i)]·θ_i, the stream of each pair read from the config (`mrope_section`, layout:
tools/mrope.py), against the vector at (0, 0, 0):
- "image grid": text, an image placeholder grid, text, positioned by the model's own `get_rope_index`
  (the grid's h/w streams step along rows and columns, t stays; the text after it resumes past the grid);
- "distinct streams": t, h and w each a different shuffle of the probe-2 positions (up to the context), so
  every pair is exercised far from its neighbours' angles.
The same-token premise, tolerance and verdict are probe 2's (applied.py).
"""

from __future__ import annotations

import numpy as np
import torch

from posdiag.checks.rope.applied import best_fits, input_spread, judge_applied, judged_qk, layouts_for, non_finite
from posdiag.checks.rope.capture import Capture, capturing, heads, without_rope
from posdiag.checks.rope.findings import Finding
from posdiag.errors import one_line
from posdiag.model.introspect import recurrent_reason
from posdiag.model.subject import Outputs, Subject
from posdiag.tools import mrope, rope_math
from posdiag.verdict import MACHINE_EPSILON

GRID_SIDE = 12  # merged image tokens per side of the placeholder grid (144 image tokens)
TEXT_AROUND = 4  # text tokens before and after the grid


def stream_owner(config, spec: rope_math.RopeSpec, pairs: int) -> tuple[np.ndarray, str] | None:
    """pair -> the stream index (0 t, 1 h, 2 w) that drives it, and the layout; None when not mRoPE."""
    section = mrope.mrope_section(spec.params)
    if section is None or sum(section) != pairs:
        return None
    kind = mrope.layout(rope_math.text_config(config), spec.params or {})
    owner = np.zeros(pairs, dtype=np.int64)
    for i, idx in enumerate(mrope.stream_pairs(section, kind).values()):
        owner[idx] = i
    return owner, f"{kind} {section}: {boundaries(section, kind)}"


def boundaries(section: list[int], kind: str) -> str:
    """The section boundaries by axis: "t pairs 0-3 | h 4-5 | w 6-7" (chunked), the pairs listed where interleaved."""
    def named(pairs: np.ndarray) -> str:
        listed = [int(p) for p in pairs]
        if not listed:
            return "none"
        if listed == list(range(listed[0], listed[-1] + 1)):
            return f"{listed[0]}-{listed[-1]}" if len(listed) > 1 else str(listed[0])
        return ",".join(map(str, listed))
    return " | ".join(f"{'t pairs ' if axis == 't' else axis + ' '}{named(p)}"
                      for axis, p in mrope.stream_pairs(section, kind).items())


def pair_of(dim: int, layout: str, pairs: int) -> int | None:
    """The rotary pair a head dim belongs to, for a leading rotary slice (None where the slice trails)."""
    if "trailing" in layout or dim >= 2 * pairs:
        return None
    return dim // 2 if layout.startswith("interleaved") else dim % pairs


def probe_grid(subject: Subject, layer_spec, refs, positions: np.ndarray, token: int, seed: int):
    """-> (findings, probed labels, why not): the rotation at differing streams, judged layer by layer."""
    owners = {}
    for spec in {id(s): s for s in layer_spec if s is not None}.values():
        found = stream_owner(subject.config, spec, refs[id(spec)][0].shape[0])
        if found is not None:
            owners[id(spec)] = found
    if not owners:
        return [], [], ""
    recurrent = recurrent_reason(subject)
    if recurrent:
        return [], [], f"mRoPE streams: {recurrent} (the same token gives a different q/k at each position)"
    probes = [("distinct streams", _distinct_streams(positions, seed))]
    grid, why_grid = _model_grid(subject.model, token)
    if grid is not None:
        probes.insert(0, ("image grid", grid))
    findings: list[Finding] = []
    done: list[str] = []
    for label, streams in probes:
        found, why = _judge_streams(subject, layer_spec, refs, owners, streams, token)
        if why:
            return findings, done, f"mRoPE {label}: {why}"
        findings += [f.labelled(label) for f in found]
        done.append(label)
    return findings, done, "" if grid is not None else f"mRoPE image grid: {why_grid}"


def _distinct_streams(positions: np.ndarray, seed: int) -> np.ndarray:
    """[3, T]: t the positions in order, h and w two shuffles of them; every stream is 0 at index 0."""
    rng = np.random.default_rng(seed)
    rest = np.asarray(positions[1:])
    return np.stack([np.asarray(positions), np.r_[positions[0], rng.permutation(rest)],
                     np.r_[positions[0], rng.permutation(rest)]]).astype(np.int64)


def _model_grid(model: torch.nn.Module, token: int) -> tuple[np.ndarray | None, str]:
    """[3, T] positions of text + an image placeholder grid + text, as the model's get_rope_index builds them."""
    owner = next((m for m in (model, getattr(model, "model", None)) if callable(getattr(m, "get_rope_index", None))),
                 None)
    if owner is None:
        return None, "the model has no get_rope_index"
    vision = getattr(getattr(model, "config", None), "vision_config", None)
    merge = int(getattr(vision, "spatial_merge_size", 1) or 1)
    n = 2 * TEXT_AROUND + GRID_SIDE * GRID_SIDE
    ids = torch.full((1, n), token, dtype=torch.long)
    kinds = torch.zeros(1, n, dtype=torch.int)
    kinds[0, TEXT_AROUND:TEXT_AROUND + GRID_SIDE * GRID_SIDE] = 1
    grid_thw = torch.tensor([[1, GRID_SIDE * merge, GRID_SIDE * merge]])
    try:
        with torch.inference_mode():
            pos, _ = owner.get_rope_index(ids, mm_token_type_ids=kinds, image_grid_thw=grid_thw)
    except Exception as exc:
        return None, f"get_rope_index raised {type(exc).__name__}: {one_line(exc)}"[:200]
    pos = pos.detach().cpu().numpy()
    if pos.ndim != 3 or pos.shape[0] != 3 or pos.shape[-1] != n or len({tuple(r) for r in pos[:, 0]}) < 3:
        return None, f"get_rope_index gave positions of shape {tuple(pos.shape)}, not three distinct streams"
    return pos[:, 0] - pos[:, 0, :1], ""  # from (0, 0, 0): the reference vector is the first token's


def _judge_streams(subject: Subject, layer_spec, refs, owners, streams: np.ndarray, token: int):
    records, out, why, nope = _capture(subject, layer_spec, streams, token)
    if why:
        return [], why
    n = streams.shape[1]
    index = np.arange(n)
    eps = MACHINE_EPSILON.get(subject.dtype_name, 1.2e-7)
    findings: list[Finding] = []
    for layer, (_module, q, k, plain) in enumerate(records):
        q, k, judged_at = judged_qk(q, k, plain)
        spec = layer_spec[min(layer, len(layer_spec) - 1)]
        if layer in nope or id(spec) not in owners:  # no rotation by design: the applied probe says why
            continue
        owner, described = owners[id(spec)]
        freqs = refs[id(spec)][0]
        angles = streams[owner].T.astype(np.float64) * freqs[None]  # [T, pairs]
        spread = input_spread(out, layer)
        fits: dict = {}
        for name, t in (("q", q), ("k", k)):
            arr = heads(t, n)
            if arr is None:
                return [], f"captured {name} has shape {tuple(t.shape)}, not [batch, heads, positions, dim]"
            if not np.isfinite(arr).all():
                findings.append(non_finite(arr, index, layer, name))
                fits[name] = None
                continue
            fits[name] = {lay: judge_applied(arr, freqs, spec, index, lay, eps, max(spread, eps), layer, name,
                                             angles=angles) for lay in layouts_for(freqs, arr.shape[-1])}
        if fits["q"] is None or fits["k"] is None:
            continue
        layer_findings, _ = best_fits(fits, layer, spread, judged_at)
        for f in layer_findings:
            _locate(f, streams, described, owner)
        findings += layer_findings
    return findings, ""


def _locate(f: Finding, streams: np.ndarray, described: str, owner: np.ndarray) -> None:
    """Name the token by its (t, h, w) position rather than its index, the dim by its pair and the axis the config
    gives that pair, and say what the config asks."""
    if f.position is None:
        return
    t, h, w = (int(x) for x in streams[:, f.position])
    f.extra.update(token=f.position, thw=[t, h, w], sections=described)
    f.position = None
    pair = None if f.dim is None else pair_of(int(f.dim), str(f.extra.get("layout", "half")), owner.shape[0])
    where = f" (pair {pair}: axis {mrope.STREAMS[int(owner[pair])]})" if pair is not None else ""
    if pair is not None:
        f.extra.update(pair=pair, axis=mrope.STREAMS[int(owner[pair])])
    if f.failed and not f.message and f.expected is not None:
        f.message = (f"mRoPE rotation disagrees with the config's sections ({described}) at layer {f.layer}, "
                     f"{f.tensor}, head {f.head}, (t, h, w) = ({t}, {h}, {w}), dim {f.dim}{where}: expected "
                     f"{f.expected:.6g}, got {f.actual:.6g} ({f.ratio:.3g}x the tolerance {f.tolerance:.3g})")


def _capture(subject: Subject, layer_spec, streams: np.ndarray, token: int) -> tuple[list, Outputs | None, str, dict]:
    eager = getattr(rope_math.text_config(subject.config), "_attn_implementation", "eager") in ("eager", None)
    capture = Capture(eager)
    n = streams.shape[1]
    ids = torch.full((1, n), token, dtype=torch.long, device=subject.device)
    position_ids = torch.as_tensor(streams, device=subject.device)[:, None, :]
    with capturing(subject, capture) as hooked:
        if not hooked:
            return [], None, "no eager attention function or apply_rotary_pos_emb to observe", {}
        try:
            with torch.inference_mode():
                out = subject.model(input_ids=ids, position_ids=position_ids, use_cache=False,
                                    output_hidden_states=True, return_dict=True)
        except Exception as exc:
            return [], None, f"the model did not take 3-stream position ids ({type(exc).__name__}: {one_line(exc)})", {}
    hidden = getattr(out, "hidden_states", None)
    if not capture.records or not hidden:
        return [], None, "the attention function was never called with q/k", {}
    capture.first_calls()
    return (capture.records, Outputs([h.to(subject.device) for h in hidden], None), "",
            without_rope(subject, layer_spec, capture))
