"""Probe 1: each rotary module's cos/sin against the float64 reference, layout (rotate-half,
interleaved, compact) and order (cos,sin or sin,cos) fitted; tolerance from float32 angles."""

from __future__ import annotations

import numpy as np
import torch

from posdiag.checks.rope import angles as rope_angles
from posdiag.checks.rope.findings import Finding
from posdiag.errors import describe_error
from posdiag.model.subject import Subject
from posdiag.verdict import MACHINE_EPSILON


def probe_tables(subject: Subject, specs, refs, positions: np.ndarray) -> tuple[list[Finding], bool, list[str]]:
    """-> (findings, whether any table was probed, what could not be probed and why)."""
    findings: list[Finding] = []
    not_probed: list[str] = []
    served: set[int] = set()
    pos = torch.as_tensor(positions, device=subject.device)[None]
    eps_out = MACHINE_EPSILON.get(subject.dtype_name, 1.2e-7)
    modules = _rotary_modules(subject.language_model)
    for module in modules:
        x = torch.zeros(1, 1, 1, dtype=subject.dtype, device=subject.device)
        name = type(module).__name__
        for spec in specs:
            if spec.layer_type is not None and not hasattr(module, f"{spec.layer_type}_inv_freq"):
                continue  # this module does not serve that layer type
            what = f"rotary table of {name}" + (f" ({spec.layer_type})" if spec.layer_type else "")
            try:
                with torch.inference_mode():
                    out = module(x, pos, spec.layer_type) if spec.layer_type is not None else module(x, pos)
            except Exception as exc:  # posdiag calls the module alone, the way transformers' rotary classes take it
                not_probed.append(f"{what}: calling it with (x, position_ids) raised {describe_error(exc)}")
                continue
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                not_probed.append(f"{what}: it returned {_shape_of(out)}, not a (cos, sin) pair")
                continue
            served.add(id(spec))
            a, b = (t.detach().double().cpu().reshape(-1, t.shape[-1]).numpy() for t in out)
            findings.append(_judge_table(a, b, *refs[id(spec)], positions, eps_out, spec))
    if not modules:
        not_probed.append("rotary tables: no rotary module found")
    for s in specs:
        if modules and s.layer_type is not None and not any(hasattr(m, f"{s.layer_type}_inv_freq") for m in modules):
            not_probed.append(f"rotary table ({s.layer_type}): no rotary module holds {s.layer_type}_inv_freq")
    return findings, bool(served), not_probed


def _shape_of(out) -> str:
    if isinstance(out, torch.Tensor):
        return f"one tensor of shape {tuple(out.shape)}"
    if isinstance(out, (tuple, list)):
        return f"{len(out)} values"
    return type(out).__name__


def _rotary_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules()
            if "Rotary" in type(m).__name__ or any(n.endswith("inv_freq") for n in m._buffers)]


def _table_candidates(freqs: np.ndarray, scaling: float,
                      positions: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    ang = rope_angles.reference_angles(freqs, positions)
    c, s = np.cos(ang) * scaling, np.sin(ang) * scaling
    return {
        "half": (np.concatenate([c, c], -1), np.concatenate([s, s], -1)),
        "interleaved": (np.repeat(c, 2, -1), np.repeat(s, 2, -1)),
        "compact": (c, s),
    }


def _judge_table(a, b, freqs, scaling, positions, eps_out, spec) -> Finding:
    label = f"rotary table ({spec.layer_type})" if spec.layer_type else "rotary table"
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        bad = np.argwhere(~(np.isfinite(a) & np.isfinite(b)))[0]
        return Finding("non-finite", float("nan"), position=int(positions[bad[0]]), dim=int(bad[1]),
                       message=f"{label}: non-finite cos/sin at position {int(positions[bad[0]])}, dim {int(bad[1])}")
    tol_pairs = rope_angles.angle_tolerance(freqs, positions, eps_out) * max(abs(scaling), 1.0)
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
            f"(rotary dims {spec.rotary_dim} of head {spec.head_dim}: partial_rotary_factor "
            f"{spec.partial_rotary_factor:g})"))
    return best
