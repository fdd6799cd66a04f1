"""Capacity: the same token at every position 0..N-1 must give N distinct embedding outputs h(p).

For every p the nearest earlier position q = argmin_{q<p} ||h(p) - h(q)|| is found; the smallest
distance (relative to median ||h||) is judged against a floor from the same run (the same positions
computed again in other batch slots). A clamping or wrapping table makes two positions identical.
"""

from __future__ import annotations

from typing import Any

import torch

from posdiag.checks.table.helpers import Part, encoder_ids
from posdiag.errors import one_line, raised_in_posdiag
from posdiag.model.probe import Row, run_rows
from posdiag.model.subject import Subject
from posdiag.results import Status
from posdiag.verdict import agreement_tolerance, judge_position_signal

ROW_TOKENS = 64          # positions per row of the capacity probe (position ids passed)
DEFAULT_MAX_PROBE = 16384  # positions probed exhaustively; larger contexts are sampled evenly
# Tokens in the single row of a model that derives its positions (no position ids): the row's 4D mask and its
# attention scores grow with the square of its length. LED's 16384-position encoder table asked for a 2 GiB mask
# (two rows of 16384^2 float32) and the run died; at 2048 the mask is 32 MiB and a 16-head score tensor 512 MiB.
DEFAULT_MAX_LONG_ROW = 2048


def long_row_limit(settings: dict) -> int:
    """The longest single row the probes of a model without position ids may run (table setting max_long_row)."""
    return int(settings.get("max_long_row", DEFAULT_MAX_LONG_ROW))


def capacity(subject: Subject, settings: dict, stack: str, n: int, token: int, honoured: bool,
             label: str, where: str) -> tuple[Part, dict]:
    """Probe positions 0..n-1 (sampled evenly past max_probe_positions) and judge how close the closest
    pair comes. -> (the part, the probe's outputs for the `beyond` probe; empty when it failed)."""
    positions = _probe_positions(n, int(settings.get("max_probe_positions", DEFAULT_MAX_PROBE)))
    before = subject.forward_count
    try:
        if honoured:
            h_all, count, floor_pairs = _probe_short_rows(subject, stack, positions, token)
            h = h_all[:count]
        else:
            h_all, count, floor_pairs = _probe_long_row(subject, stack, int(positions.max()) + 1, token)
            h = h_all[:count][positions]
    except Exception as exc:  # the model failing inside the declared range is itself the finding
        if raised_in_posdiag(exc):  # posdiag's own bug: the run reports an error, never a verdict
            raise
        return Part("capacity", Status.FAIL, f"{label}probing positions 0..{n - 1} raised "
                    f"{type(exc).__name__}: {one_line(exc)}", details={"where": where}), {}
    if not torch.isfinite(h).all():
        bad = int(torch.nonzero(~torch.isfinite(h).all(-1))[0, 0])
        return Part("capacity", Status.FAIL, f"{label}non-finite embedding output at position {int(positions[bad])}",
                    details={"where": where, "first_bad_position": int(positions[bad])}), {}
    scale = float(h.norm(dim=-1).median()) or 1.0
    floor = max((float((h_all[a] - h_all[b]).norm()) for a, b in floor_pairs), default=0.0) / scale
    outputs = {"h": h, "positions": positions, "scale": scale, "floor": floor}
    probe = (f"position ids, rows of {ROW_TOKENS}" if honoured
             else "one row of the same token (positions derived by the model)")
    part = _judge_capacity(outputs, subject.dtype_name, subject.forward_count - before, probe, n, label, where)
    return part, outputs


def _probe_positions(n: int, limit: int) -> torch.Tensor:
    """0..n-1, or `limit` evenly spaced positions (always including both ends) when n is larger."""
    if n <= limit:
        return torch.arange(n)
    return torch.unique(torch.cat([torch.linspace(0, n - 1, limit).round().long(), torch.tensor([n - 1])]))


def _judge_capacity(outputs: dict, dtype: str, forwards: int, probe: str, n: int, label: str, where: str) -> Part:
    """The closest earlier pair against the floor; below the fail line, name the pattern (none/clamp/wrap)."""
    h, positions, scale, floor = outputs["h"], outputs["positions"], outputs["scale"], outputs["floor"]
    dist, twin = _nearest_earlier(h)
    dist = dist / scale
    line = agreement_tolerance(floor, dtype)
    min_i = int(torch.argmin(dist[1:])) + 1 if len(dist) > 1 else 0
    verdict = judge_position_signal(float(dist[min_i]) if len(dist) > 1 else float("inf"), floor, dtype)
    metrics = {"positions_probed": int(len(positions)), "capacity_min_distance": verdict.residual,
               "capacity_noise_floor": verdict.noise_floor, "capacity_ratio": verdict.ratio,
               "capacity_forwards": forwards}
    details: dict[str, Any] = {"where": where, "probe": probe,
                               "closest_pair": [int(positions[twin[min_i]]), int(positions[min_i])]}
    how = f"{len(positions)} positions in {forwards} forward(s)"
    if verdict.status is Status.PASS:
        msg = (f"{label}{how}: every position distinct; closest pair {int(positions[twin[min_i]])}/"
               f"{int(positions[min_i])} at {verdict.residual:.3g} = {verdict.ratio:.3g}x noise floor")
        return Part("capacity", Status.PASS, msg, metrics, details)
    bad = torch.nonzero(dist <= line).flatten()
    bad = bad[bad > 0]
    if len(bad) == 0:  # WARN band: nothing below the fail line, but too close to call
        return Part("capacity", verdict.status, f"{label}{how}: closest pair {int(positions[twin[min_i]])}/"
                    f"{int(positions[min_i])} at {verdict.residual:.3g} = {verdict.ratio:.3g}x noise floor: "
                    f"{verdict.reason}", metrics, details)
    first = int(bad[0])
    p, q = int(positions[first]), int(positions[twin[first]])
    pattern = _pattern(h, positions, bad, twin, line * scale)
    details.update({"first_bad_position": p, "twin": q, "colliding_positions": int(len(bad)), "pattern": pattern})
    metrics.update({"first_bad_position": p, "twin": q})
    text = {"none": f"no two positions can be told apart (position {p} == position {q}): no position signal",
            "clamp": f"every position from {p} on looks like position {q}: indices clamp at {q} "
                     f"({q + 1} usable positions of {n})",
            "wrap": f"position p looks like p-{p - q} from {p} on: indices wrap modulo {p - q}"}.get(
        pattern, f"position {p} looks like position {q} ({len(bad)} positions collide)")
    status = verdict.status if verdict.status is not Status.PASS else Status.FAIL
    note = f" [{verdict.reason}]" if status is Status.WARN else ""
    return Part("capacity", status, f"{label}{text}; distance {verdict.residual:.2g} = {verdict.ratio:.3g}x noise "
                f"floor ({how}){note}", metrics, details)


def _probe_short_rows(subject: Subject, stack: str, positions: torch.Tensor, token: int):
    """All positions in one forward: rows of ROW_TOKENS tokens (the same token) with consecutive
    position ids; the embedding output of each token depends on its own position only. A second,
    shifted layout of a few rows puts the same positions in other slots: the noise floor."""
    t = min(ROW_TOKENS, len(positions))
    pad = (-len(positions)) % t
    main = torch.cat([positions, positions[:pad]]) if pad else positions
    shifted = torch.roll(main, t // 2)[: min(len(main), 4 * t)]
    chunks = list(main.view(-1, t)) + list(shifted.view(-1, t))
    # One guard token at each end of a row (the same token, its neighbour's position id), dropped from the
    # outputs: every probed token then has the same neighbours. An embedding that mixes neighbouring tokens
    # (MobileBERT's trigram input) gave the first and last token of a row another output than the same
    # position elsewhere: floor 0.13 and a false "no two positions can be told apart".
    ids = torch.full((t + 2,), token, dtype=torch.long)
    rows = [Row(ids, positions=torch.cat([c[:1], c, c[-1:]])) for c in chunks]
    out = run_rows(subject, rows, stack=stack, encoder_ids=encoder_ids(subject, stack, ids, len(rows)))
    h0 = out.hidden[0][:, 1:-1]
    n_main = main.numel() // t
    h = h0[:n_main].reshape(-1, h0.shape[-1])[: len(positions)].double().cpu()
    second = h0[n_main:].reshape(-1, h0.shape[-1]).double().cpu()
    index = {int(p): i for i, p in enumerate(positions)}
    pairs = [(index[int(p)], len(h) + j) for j, p in enumerate(shifted)]
    return torch.cat([h, second]), len(h), pairs


def _probe_long_row(subject: Subject, stack: str, length: int, token: int):
    """One row of `length` copies of the token (the model derives positions itself), twice."""
    ids = torch.full((length,), token, dtype=torch.long)
    rows = [Row(ids), Row(ids)]
    out = run_rows(subject, rows, stack=stack, encoder_ids=encoder_ids(subject, stack, ids, 2))
    h = torch.cat([out.hidden[0][0], out.hidden[0][1]]).double().cpu()
    step = max(1, length // 256)
    return h, length, [(i, length + i) for i in range(0, length, step)]


def _nearest_earlier(h: torch.Tensor, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row p: the distance to the nearest row q < p and q (row 0: inf, -1).

    Candidates come from a Gram-matrix screen (float64); the chosen pair's distance is then
    recomputed directly, so exact duplicates read exactly 0."""
    n = h.shape[0]
    sq = (h * h).sum(-1)
    dist = torch.full((n,), float("inf"), dtype=torch.float64)
    twin = torch.full((n,), -1, dtype=torch.long)
    upper = torch.ones(chunk, chunk, dtype=torch.bool).triu()  # column q >= row p: not earlier
    for start in range(1, n, chunk):
        stop = min(n, start + chunk)
        block = h[start:stop]
        d2 = torch.addmm(sq[None, :stop], block, h[:stop].T, alpha=-2.0)
        d2.add_(sq[start:stop, None])
        d2[:, start:stop].masked_fill_(upper[: stop - start, : stop - start], float("inf"))
        q = d2.argmin(-1)
        twin[start:stop] = q
        dist[start:stop] = (block - h[q]).norm(dim=-1)
    return dist, twin


def _pattern(h: torch.Tensor, positions: torch.Tensor, bad: torch.Tensor, twin: torch.Tensor, line: float) -> str:
    first = int(bad[0])
    q0 = int(twin[first])
    p_first, p_twin = int(positions[first]), int(positions[q0])
    tail = torch.arange(first, len(positions))
    same_as_twin = (h[tail] - h[q0]).norm(dim=-1) <= line
    if bool(same_as_twin.all()):
        return "none" if p_twin == 0 and p_first == int(positions[1]) else "clamp"
    shift = p_first - p_twin
    if shift > 0 and all(int(positions[int(b)]) - shift >= 0 for b in bad):
        lookup = {int(p): i for i, p in enumerate(positions)}
        ok = [lookup.get(int(positions[int(b)]) - shift) for b in tail]
        if all(o is not None for o in ok) and bool(
                ((h[tail] - h[torch.tensor(ok)]).norm(dim=-1) <= line).all()):
            return "wrap"
    return "collide"
