"""causal — does any position see the future?

Change the token at position j; in a causal stack every output before j must be unchanged.
The sweep covers every j = 1..T-1 (one edited copy of the probe per j, batched in chunks that
each carry the baseline), so a leak anywhere is found, not only from a suffix: a mis-gathered relative bias can
carry token 9 back to query 3 while editing every token from 30 on moves nothing before 30.
leak(i, j) = ||h_j[i] − h[i]|| / ||h[i]|| for i < j (final hidden state, per token), judged as
agreement against a floor measured in the same forward: the probe repeated with its token
embeddings jittered by ~1 ulp (see `positions`). In a correct eager model a masked key gets
exactly zero weight, so the measured leaks are 0.0; the floor keeps the rule honest for kernels
whose rows round differently.

Two paths, one forward per chunk of edited copies each: the model's default mask (nothing passed: the model builds its
causal mask) and the explicit mask (posdiag's additive 4D pattern in the family's form).
Encoders are bidirectional by design: skipped. Encoder-decoders: the decoder stack, with one
fixed encoder input for every row. Reports the first leaking (query, key) pair (lowest key),
the largest leak, the distances j − i that leak, and the first layer where the leak shows.

Recurrent / linear-attention / convolutional mixers (posdiag.model.introspect) are swept the same way: the test edits
tokens, never permutes them, so it needs no consistent permutation; the recurrence is causal by
construction (a bidirectional scan or a centred (non-causal) convolution would leak and be caught), and the explicit
mask reaches the attention layers only, which is what that path checks.
"""

from __future__ import annotations

import torch

from posdiag.checks import CheckSpec, Option, _image_mask
from posdiag.model.arbitration import arbitrate
from posdiag.model.introspect import attention_free, recurrent_mixers
from posdiag.model.jitter import FLOOR_SOURCE, jittered
from posdiag.model.probe import Row, run_rows
from posdiag.model.subject import Subject
from posdiag.model.tensors import layer_name, per_token_change
from posdiag.options import RunOptions, probe_ids
from posdiag.results import CheckResult, Status, Table
from posdiag.verdict import LOW_PRECISION, FloorVerdict, agreement_tolerance, judge_agreement

SPEC = CheckSpec(
    name="causal",
    title="Causal masking (no position sees the future)",
    proves="no output depends on a later token, under the model's default mask and posdiag's explicit one",
    applies_to=("causal", "seq2seq"),
    options={
        "positions": Option(32, "positions swept: every (query, key) pair among the probe's first N tokens. The sweep "
                                "costs N forwards of N tokens, so it covers this many whatever the probe length "
                                "(--seq-len or --text); raise it to sweep a longer probe"),
    },
)
# Edited copies per forward. Each forward also carries the baseline and its jittered twin, so
# every comparison is within one batch; each chunk is reduced to leak matrices at once, so
# memory stays at one chunk of hidden states whatever T is: as many rows as fit in a tenth of
# the weights' size, or in 64 MiB for small models (all of them for a 32-token sweep of a 125M
# model), at least MIN_CHUNK.
MIN_CHUNK = 8
SMALL_BUDGET = 64 * 2**20


def _chunk_size(subject: Subject, length: int) -> int:
    weights = sum(p.numel() * p.element_size() for p in subject.model.parameters())
    layers = getattr(subject.config, "num_hidden_layers", None) or 12
    width = getattr(subject.config, "hidden_size", None) or 1024
    per_row = (layers + 1) * length * width * torch.finfo(subject.dtype).bits // 8
    return max(MIN_CHUNK, min(length - 1, max(weights // 10, SMALL_BUDGET) // max(per_row, 1)))


def run(subject: Subject, options: RunOptions) -> CheckResult:
    if subject.kind == "encoder":
        return SPEC.result(Status.NA, "bidirectional encoder: every token sees every other by design, there is no "
                                      "future to leak")
    if subject.family.not_causal:
        return SPEC.result(Status.NA, f"not causal by design: {subject.family.not_causal}")
    # The same sweep whether the probe length is the default or typed: one rule, not "--seq-len given or not".
    ids = probe_ids(subject, options)[0][: max(2, int(SPEC.setting(options, "positions")))]
    alt = _replacements(subject, ids, options.seed)
    results, explicit_not_run = _paths_judged(subject, ids, alt, options.seed)
    image = _image_mask.probe(subject, options.seed)  # token_type_ids masks: image tokens see each other
    if isinstance(image, dict):
        results.append(image)
    return _report(subject, ids.shape[0], results, image, explicit_not_run)


def _paths_judged(subject: Subject, ids: torch.Tensor, alt: torch.Tensor, seed: int) -> tuple[list[dict], str | None]:
    """The sweep on each mask path, judged (a leak above tolerance decided in float64).
    -> (one result per path, why the explicit path did not run: None when it did)."""
    paths = [("default mask", False)]
    ok, why = subject.explicit_mask_supported
    if ok and attention_free(subject.language_model):
        ok, why = False, "no attention layer reads it (only recurrent sequence mixers)"
    if ok:
        paths.append(("explicit mask", True))
    results = []
    for name, explicit in paths:
        def sweep_path(explicit: bool = explicit) -> _Sweep:
            return _sweep(subject, ids, alt, explicit, seed)

        sweep = sweep_path()
        if explicit and subject.mask_refusals.get("decoder"):
            # The model refused the explicit mask and ran the 2D padding form of the same pattern: that is the
            # default path again, not a test of the explicit one.
            ok, why = False, subject.mask_refusals["decoder"]
            continue
        result = _judge(name, sweep, ids.shape[0], subject.dtype_name)
        if (result["status"] is Status.FAIL or subject.dtype_name in LOW_PRECISION) and not sweep.non_finite:
            result = _arbitrated(subject, name, sweep, sweep_path, result, subject.dtype_name)
        results.append(result)
    return results, None if ok else why


def _report(subject: Subject, length: int, results: list[dict], image: dict | str | None,
            explicit_not_run: str | None) -> CheckResult:
    """The worst path decides; every path's numbers are kept, prefixed by the path."""
    status = Status.worst([r["status"] for r in results])
    metrics: dict = {}
    for r in results:
        key = r["path"].split()[0]
        metrics.update({f"{key}_{k}": v for k, v in r["metrics"].items()})
    worst = max(results, key=lambda r: (r["status"].rank, r["metrics"]["leak"]))
    metrics.update(worst["metrics"])
    details: dict = {"seq_len": length, "edited_positions": length - 1, "floor_source": FLOOR_SOURCE,
                     "paths": {r["path"]: r["details"] for r in results}}
    if isinstance(image, str):
        details["image_mask"] = image
    if explicit_not_run is not None:
        details["explicit_mask"] = f"not run: {explicit_not_run}"
    recurrent = recurrent_mixers(subject.language_model)
    if recurrent:
        details["recurrent_mixers"] = recurrent
        details["explicit_mask_reaches"] = "attention layers only (the recurrent mixers are causal by construction)"
    summary = _summary(status, length, results, worst, image)
    return SPEC.result(status, summary, metrics, details, (_table(results),))


def _summary(status: Status, length: int, results: list[dict], worst: dict, image: dict | str | None) -> str:
    if status is Status.PASS:
        summary = (f"no output before j moves when token j changes, for every j (max change "
                   f"{worst['metrics']['leak']:.2g} <= {worst['metrics']['tolerance']:.2g}; "
                   f"{' and '.join(r['path'] for r in results if r is not image)}; {length} tokens)")
        if isinstance(image, dict):
            summary += f"; {image['summary']}"
    else:
        failing = [r for r in results if r["status"] is not Status.PASS]
        texts = {r["summary"].replace(f"({r['path']})", "(PATH)") for r in failing}
        if len(failing) > 1 and len(texts) == 1:  # the same leak on every path: say it once
            summary = texts.pop().replace("(PATH)", f"({' and '.join(r['path'] for r in failing)})")
        else:
            summary = "; ".join(r["summary"] for r in failing)
    if isinstance(image, str):
        summary += f"; image-token mask {image}"
    return summary


def _table(results: list[dict]) -> Table:
    rows = tuple(
        (r["path"], r["status"].value, f"{r['metrics']['leak']:.3e}", f"{r['metrics']['noise_floor']:.2e}",
         str(r["details"].get("first_leak") or "-"), str(r["details"].get("leak_distances") or "-"))
        for r in results)
    return Table("future leaks by mask path", ("path", "status", "max leak", "noise floor", "first (query, key)",
                                                "distances j-i"), rows)


def _sweep(subject: Subject, ids: torch.Tensor, alt: torch.Tensor, explicit: bool, seed: int) -> _Sweep:
    """Edit every token j in turn (chunks of edits per forward) and record how much each earlier output moves."""
    length = ids.shape[0]
    sweep = _Sweep(length)
    chunk = _chunk_size(subject, length)
    for start in range(1, length, chunk):
        edited_at = list(range(start, min(start + chunk, length)))
        rows = [Row(ids), Row(ids)]  # baseline, jittered baseline (the floor)
        for j in edited_at:
            edited = ids.clone()
            edited[j] = alt[j]
            rows.append(Row(edited))
        encoder_ids = ids[None].expand(len(rows), -1) if subject.kind == "seq2seq" else None
        with jittered(subject, "decoder", 1, len(rows), seed) as has_jitter:
            out = run_rows(subject, rows, stack="decoder", explicit_mask=explicit, encoder_ids=encoder_ids)
        sweep.add(out.hidden, edited_at, has_jitter)
        del out
        if sweep.non_finite:
            break
    return sweep


def _arbitrated(subject: Subject, path: str, sweep: _Sweep, sweep_path, result: dict, dtype: str) -> dict:
    """A leak above the tolerance is measured again in float64 at the layer that decided: a leak stays, rounding
    shrinks. A float64 pass replaces the result; a confirmed leak keeps it, with both figures. In half precision a
    pass is measured again too (the output layer): a leak under the bfloat16 floor that float64 resolves FAILs in
    float64's words (which query sees which key)."""
    layer = result["details"]["verdict_layer"]
    m = result["metrics"]
    verdict = FloorVerdict(Status.FAIL, m["leak"], m["noise_floor"], m["ratio"], "")
    finer: list[_Sweep] = []
    arbitration = arbitrate(subject, sweep_path, sweep.floors[layer], {path: verdict}, dtype,
                            lambda sw: finer.append(sw) or (sw.floors[layer] if sw.floors else 0.0,
                                                            {path: float(sw.leaks[layer].max()) if sw.leaks else
                                                             float("nan")}))
    decided = arbitration.verdicts.get(path)
    if decided is not None and decided.status is Status.FAIL and result["status"] is not Status.FAIL and finer:
        result = {**_judge(path, finer[0], finer[0].length, "float64"), "status": Status.FAIL}
        result["metrics"] = {**m, "leak_float64": result["metrics"]["leak"]}
        result["summary"] += (f"; in float64: the {dtype} run's floor {m['noise_floor']:.2g} is above this leak "
                              f"(largest change as run {m['leak']:.3g})")
    result["details"].update(arbitration.details)
    result["metrics"].update(arbitration.metrics)
    if decided is None or decided.status is Status.FAIL:
        if decided is not None:
            result["summary"] += f" ({decided.reason})"
        return result
    summary = f"no leak ({path}; {decided.reason})" if decided.status is Status.PASS else f"{path}: {decided.reason}"
    return {**result, "status": decided.status, "summary": summary}


def _replacements(subject: Subject, ids: torch.Tensor, seed: int) -> torch.Tensor:
    """A different ordinary token for every position."""
    alt = subject.sample_ids(1, ids.shape[0], seed + 3571)[0]
    same = alt == ids
    if bool(same.any()):
        alt = torch.where(same, ids.roll(1), alt)  # ids are distinct within the row
    return alt


class _Sweep:
    """Leak matrices [query, key] per layer and the jitter floor, accumulated chunk by chunk."""

    def __init__(self, length: int):
        self.length = length
        self.leaks: list[torch.Tensor] = []
        self.floors: list[float] = []
        self.non_finite: tuple[int, str] | None = None

    def add(self, hidden: list[torch.Tensor], edited_at: list[int], has_jitter: bool) -> None:
        if not self.leaks:
            self.leaks = [torch.zeros(self.length, self.length, dtype=torch.float64) for _ in hidden]
            self.floors = [0.0] * len(hidden)
        for l, h in enumerate(hidden):
            finite = torch.isfinite(h).flatten(1).all(1)
            if not bool(finite.all()):
                row = int((~finite).nonzero()[0])
                where = "the baseline" if row < 2 else f"the probe with token {edited_at[row - 2]} edited"
                self.non_finite = (l, where)
                return
            if has_jitter:
                self.floors[l] = max(self.floors[l], float(per_token_change(h[1], h[0]).max()))
            for i, j in enumerate(edited_at):
                self.leaks[l][:j, j] = per_token_change(h[2 + i][:j], h[0][:j])


def _judge(path: str, sweep: _Sweep, length: int, dtype: str) -> dict:
    if sweep.non_finite:
        layer, where = sweep.non_finite
        return {"path": path, "status": Status.FAIL,
                "summary": f"non-finite hidden states at layer {layer} in {where} ({path})",
                "metrics": {"leak": float("nan"), "noise_floor": float("nan"), "ratio": float("nan"),
                            "tolerance": float("nan")},
                "details": {"non_finite_layer": layer, "non_finite_row": where}}
    # Leak matrices [query, key] per layer; the verdict takes the layer with the worst ratio to its
    # own floor (the final output in practice). The first leaking pair is read at the earliest layer
    # that leaks: deeper layers compound a leak (query 0 -> key 6 -> key 1 after two layers), the
    # earliest one shows the direct pair.
    per_layer = [(leak_l, floor_l, judge_agreement(float(leak_l.max()), floor_l, dtype))
                 for leak_l, floor_l in zip(sweep.leaks, sweep.floors, strict=True)]
    verdict_layer = max(range(len(per_layer)), key=lambda l: per_layer[l][2].ratio)
    if per_layer[verdict_layer][2].status is Status.PASS:
        verdict_layer = len(per_layer) - 1  # report the output's numbers
    leak, floor, verdict = per_layer[verdict_layer]
    tol = agreement_tolerance(floor, dtype)
    metrics = {"leak": verdict.residual, "noise_floor": verdict.noise_floor, "ratio": verdict.ratio, "tolerance": tol}
    details: dict = {"leaking_pairs": int((per_layer[-1][0] > agreement_tolerance(per_layer[-1][1], dtype)).sum()),
                     "verdict_layer": verdict_layer}
    if verdict.status is Status.PASS:
        return {"path": path, "status": verdict.status, "summary": f"no leak ({path})", "metrics": metrics,
                "details": details}
    first_layer = next(l for l, (m, f, _) in enumerate(per_layer) if float(m.max()) > agreement_tolerance(f, dtype))
    m0, f0, _ = per_layer[first_layer]
    direct = m0 > agreement_tolerance(f0, dtype)
    key = int(direct.any(0).nonzero().flatten()[0])
    query = int(m0[:, key].argmax())
    out_leak = per_layer[-1][0]
    big_q, big_k = divmod(int(out_leak.argmax()), length)
    distances = sorted({k - q for q, k in direct.nonzero().tolist()})
    layer = layer_name(first_layer, len(per_layer))
    size = float(per_layer[-1][0][query, key])
    details.update({"first_leak": (query, key), "first_leak_size": size, "leak_shows_at": layer,
                    "largest_leak": (big_q, big_k), "largest_leak_size": float(out_leak[big_q, big_k]),
                    "leak_distances": distances[:8], "direct_leaking_pairs": int(direct.sum())})
    more = "" if len(distances) <= 3 else f" (+{len(distances) - 3} more)"
    summary = (f"query {query} sees key {key} ({path}): changing token {key} moves output {query} by "
               f"{size:.3g} = {size / verdict.noise_floor:.3g}x floor {verdict.noise_floor:.2g}; leak shows at "
               f"{layer} at distances {', '.join(f'+{d}' for d in distances[:3])}{more}; "
               f"{details['leaking_pairs']} leaking pairs in the output")
    return {"path": path, "status": verdict.status, "summary": summary, "metrics": metrics, "details": details}


