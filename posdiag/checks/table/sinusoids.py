"""Sinusoidal tables: the layout (interleaved sin/cos or concatenated [sin|cos], either order) is
detected from row 0 = (sin 0, cos 0); the table must equal sin(p θ_i), cos(p θ_i), θ_i = b^(-2i/d),
and obey PE(p+k) = R(k θ_i) PE(p) per dim pair (fitted 2x2 maps, which must be rotations). Floors:
the same formula evaluated in the table's own dtype. Fairseq-style tables (M2M100, XGLM, Kosmos-2) zero
the row at padding_idx, below the row position 0 reads (padding_idx + 1): an all-zero row that no position
reads is left out of the judgement (measured on Kosmos-2.5: that row alone made the table "differ from the
formula by 2"; with it left out the rest matches to 1.4e-5, base 10000^(d/(d-2)))."""

from __future__ import annotations

import math
from typing import Any

import torch

from posdiag.checks.table.discovery import PositionTable
from posdiag.checks.table.helpers import Part
from posdiag.model.subject import Subject
from posdiag.results import Status
from posdiag.verdict import agreement_tolerance, judge_agreement


def sinusoid_part(t: PositionTable, subject: Subject, offset: int | None = None) -> Part:
    """offset: the row position 0 reads (the family's, or the one `table` discovered)."""
    where = f"{t.stack}_" if len(subject.stacks) > 1 else ""
    first = subject.family.position_offset if offset is None else offset
    values = t.tensor.detach()
    unread = tuple(r for r in range(1, min(first, values.shape[0])) if not bool(values[r].any()))
    rep = sinusoid_report(values, unread)
    metrics = {k: rep[k] for k in ("formula_error", "formula_floor", "rotation_residual", "rotation_floor", "base")}
    details = {"where": where, "layout": rep["layout"], "table": t.name, "unread_zero_rows": list(unread)}
    if rep["status"] is Status.PASS:
        return Part("sinusoid", Status.PASS,
                    f"{t.name}: {rep['layout']} sin/cos, base {rep['base']:.6g}; formula error "
                    f"{rep['formula_error']:.2g} (floor {rep['formula_floor']:.2g}), PE(p+k)=R_k PE(p) residual "
                    f"{rep['rotation_residual']:.2g}", metrics, details)
    return Part("sinusoid", Status.FAIL, f"{t.name}: not a sinusoid table: {rep['reason']} (overwritten at init?)",
                metrics, details)


def sinusoid_report(table: torch.Tensor, unread: tuple[int, ...] = ()) -> dict[str, Any]:
    """Detect layout and base, measure formula error and the rotation property (see the docstring).
    unread: rows (never row 0) that no position reads and that are left out (a zeroed padding row)."""
    dtype = table.dtype if table.dtype.is_floating_point else torch.float32
    name = str(dtype).removeprefix("torch.")
    w = table.detach().double().cpu()
    p_count, d = w.shape
    layout, row0_error, got = _layout(w)
    judged = torch.ones(p_count, dtype=torch.bool)
    judged[list(unread)] = False
    best = None
    for base in _base_candidates(got, d, int(judged[1:].int().argmax()) + 1 if p_count > 1 else 1):
        exact = _formula(p_count, d, base, torch.float64)
        err = float((got - exact)[judged].abs().max())
        if best is None or err < best[1]:
            best = (base, err, exact)
    base, err, exact = best
    floor = float((_formula(p_count, d, base, dtype) - exact).abs().max())
    verdict = judge_agreement(err, floor, name)
    tail = max(unread, default=0) + 1 if unread else 0  # the rotation is fitted on contiguous read rows
    rot, rot_floor = _rotation_residual(got[tail:]), _rotation_residual(_formula(p_count, d, base, dtype)[tail:])
    rot_verdict = judge_agreement(rot, rot_floor, name)
    reason = ""
    if row0_error > agreement_tolerance(floor, name):
        reason = f"row 0 is not (sin 0, cos 0) = (0, 1) in either layout (off by {row0_error:.2g})"
    elif verdict.status is not Status.PASS:
        reason = (f"differs from the sinusoid formula by {err:.2g} = {verdict.ratio:.3g}x "
                  f"floor {verdict.noise_floor:.2g}")
    elif rot_verdict.status is not Status.PASS:
        reason = f"PE(p+k) is not a rotation of PE(p): residual {rot:.2g} = {rot_verdict.ratio:.3g}x floor"
    status = Status.PASS if not reason else Status.FAIL
    return {"status": status, "reason": reason, "layout": layout, "base": base, "formula_error": err,
            "formula_floor": verdict.noise_floor, "rotation_residual": rot, "rotation_floor": rot_verdict.noise_floor,
            "row0_error": row0_error}


def _layout(w: torch.Tensor) -> tuple[str, float, torch.Tensor]:
    """The layout whose row 0 is closest to (sin 0, cos 0) = (0, 1). -> (layout, that distance,
    the table as [P, half, 2] (sin, cos) pairs in that layout)."""
    d = w.shape[1]
    half = d // 2
    sin_start_cos = (d + 1) // 2
    layouts = {"interleaved": (torch.arange(0, 2 * half, 2), torch.arange(1, 2 * half, 2)),
               "concatenated": (torch.arange(half), torch.arange(sin_start_cos, sin_start_cos + half))}
    # the same two layouts with cos first ([cos|sin], cos/sin pairs) also exist in the wild
    layouts.update({f"{k} (cos first)": (c, s) for k, (s, c) in list(layouts.items())})
    row0 = {k: float(torch.cat([w[0, s].abs(), (w[0, c] - 1).abs()]).max()) for k, (s, c) in layouts.items()}
    layout = min(row0, key=row0.get)
    s_idx, c_idx = layouts[layout]
    return layout, row0[layout], torch.stack([w[:, s_idx], w[:, c_idx]], -1)


def _base_candidates(got: torch.Tensor, d: int, row: int = 1) -> list[float]:
    """10000, and the base fitted from the angles of `row` (the first judged row after 0), r θ_i = r b^(-2i/d)
    (least squares on ln θ_i), when it is sane: rows up to 3 keep r θ_0 = r below π, so atan2 does not wrap."""
    p_count, half = got.shape[0], got.shape[1]
    bases = [10000.0]
    if p_count > row and row <= 3:
        i = torch.arange(half, dtype=torch.float64)
        theta = torch.atan2(got[row, :, 0], got[row, :, 1]) / row
        ok = (theta[1:] > 0) & torch.isfinite(theta[1:])
        if bool(ok.all()) and half > 1:
            x = 2 * i[1:] / d
            ln_b = float(-(x * torch.log(theta[1:])).sum() / (x * x).sum())
            if math.isfinite(ln_b) and 0 < ln_b < 100:
                bases.append(math.exp(ln_b))
    return bases


def _formula(p_count: int, d: int, base: float, stored: torch.dtype) -> torch.Tensor:
    """The formula computed the way a table is built in practice: angles in float32 (or the
    table's own dtype when wider), the result stored in the table's dtype. -> [P, half, 2] float64."""
    i = torch.arange(d // 2, dtype=torch.float64)
    compute = stored if stored in (torch.float64, torch.float32) else torch.float32
    pos = torch.arange(p_count, dtype=compute)[:, None]
    theta = (base ** (-2 * i / d)).to(compute)
    ang = pos * theta
    return torch.stack([torch.sin(ang), torch.cos(ang)], -1).to(stored).double()


def _rotation_residual(pairs: torch.Tensor) -> float:
    """max over k in {1, 3, P/3} and dim pairs of the relative residual of the best 2x2 map
    X[p+k] = M X[p], plus how far each fitted M is from a rotation (||MᵀM - I||)."""
    p_count = pairs.shape[0]
    worst = 0.0
    for k in sorted({1, 3, max(1, p_count // 3)}):
        if k >= p_count - 2:
            continue
        a = pairs[:-k].transpose(0, 1)  # [half, P-k, 2]
        b = pairs[k:].transpose(0, 1)
        m = torch.linalg.lstsq(a, b).solution  # b ≈ a @ m
        resid = (a @ m - b).norm(dim=(1, 2)) / b.norm(dim=(1, 2)).clamp_min(1e-30)
        eye = torch.eye(2, dtype=m.dtype)
        ortho = (m.transpose(1, 2) @ m - eye).abs().amax(dim=(1, 2))
        worst = max(worst, float(resid.max()), float(ortho.max()))
    return worst
