"""The support sweep: every model type of transformers' text and image-text auto mappings, as a tiny model.

Driven by `python benchmarks/support_matrix.py --all`. Each type runs in its own subprocess under a time limit
(a hang or a crash costs one row); each finished row is appended to benchmarks/sweep.jsonl at once, so an
interrupted sweep resumes where it stopped. The table in docs/support.md is rebuilt from that file.
"""

from __future__ import annotations

import json
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "sweep.jsonl"
MEMORY_LIMIT = 6 << 30  # bytes of address space per model type: a config that asks for more is listed, not run
PAGE = HERE.parent / "docs" / "support.md"
README = HERE.parent / "README.md"
MAPPINGS = {  # kind shown in the table -> transformers.models.auto.modeling_auto mapping
    "causal": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "masked": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "image-text": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
}
SYMBOL = {"pass": "PASS", "fail": "**FAIL**", "warn": "WARN", "skip": "skip", "error": "**ERROR**"}
# model type -> {check: the upstream bug it FAILs on}: real bugs in stock transformers on paths it accepts, each
# pinned by a regression test and described under "Findings" in docs/support.md. Any other FAIL on these healthy
# default-init models is a false verdict to fix.
FINDINGS: dict[str, dict[str, str]] = {
    "gpt2": {"batch": "positions from the first padding column without position_ids"},
    "gpt_neo": {"batch": "positions from the first padding column without position_ids",
                "cache": "wrong logits with a static cache", "generate": "wrong logits with a static cache"},
    "openai-gpt": {"batch": "positions from the first padding column without position_ids"},
    "mamba": {"cache": "a multi-token cache continuation differs from the full forward"},
    "jamba": {"cache": "a multi-token cache continuation differs from the full forward"},
    "paligemma": {"kernels": "the SDPA path is not causal on text without token_type_ids"},
    "deepseek_v4": {"generate": "a left-padded batch differs from each row alone once a compressed entry exists",
                    "batch": "the compressor pools left padding into its first storage window"},
    "hunyuan_vl": {"rope": "XD-RoPE pairs read two different position streams: no rotation for image tokens"},
    "led": {"cache": "wrong logits at single-token steps with a static cache",
            "generate": "wrong logits at single-token steps with a static cache"},
    "nystromformer": {"batch": "its value convolution reads padded tokens"},
    "gpt-sw3": {"batch": "positions from the first padding column without position_ids"},
    "gpt_bigcode": {"batch": "positions from the first padding column without position_ids"},
    "biogpt": {"batch": "positions from the first padding column without position_ids"},
    "xglm": {"batch": "positions from the first padding column without position_ids"},
    "blip": {"batch": "positions from the first padding column without position_ids"},
    "vision-encoder-decoder": {"batch": "positions from the first padding column without position_ids"},
    "whisper": {"generate": "positions from the first padding column: its forward takes position_ids only through "
                            "**kwargs, so generate() derives none"},
    "kosmos-2": {"cache": "crashes with a static cache",
                 "generate": "cached steps count a left-padded row's pads into its positions; static cache crashes"},
    "ctrl": {"batch": "positions from the first padding column without position_ids"},
    "moshi": {"cache": "its forward ignores the sliding window its cache applies",
              "generate": "its forward ignores the sliding window its cache applies"},
    "beam": {"batch": "without position_ids its absolute query scale reads positions from the first padding column"},
    "git": {"batch": "positions from the first padding column without position_ids",
            "generate": "each cached step widens the padding mask by the image patch tokens"},
    "falcon_mamba": {"cache": "a multi-token cache continuation restarts the recurrent state"},
    "convbert": {"batch": "its convolution branch reads padded tokens"},
    "fsmt": {"generate": "a static cache's empty slots are attended (no mask when decoding)"},
    "rwkv": {"batch": "attention_mask accepted and ignored: left padding runs through the recurrence"},
    "recurrent_gemma": {"batch": "without position_ids a left-padded row reads its pads into the recurrence",
                        "cache": "a multi-token cache continuation restarts the convolution state"},
    "trocr": {"generate": "positions from the first padding column: the position_ids generate() derives are dropped"},
    "yoso": {"batch": "its padding mask is a no-op (a 0/1 mask read as additive)"},
    "bamba": {"cache": "a cached forward without position_ids numbers the new tokens from 0"},
    "blt": {"generate": "every cached forward crashes: DynamicCache(config) reads a num_hidden_layers BltConfig lacks"},
    "prophetnet": {"cache": "crashes with a static cache", "generate": "crashes with a static cache"},
    "cpmant": {"cache": "crashes with a static cache (prompt positions not counted)",
               "generate": "crashes with a static cache (prompt positions not counted)"},
    "kosmos-2.5": {"generate": "cached steps number a left-padded row from its first padding column"},
    **{t: {"generate": "static cache past the sliding window crashes (hybrid_sliding mask sized for full layers)"}
       for t in ("inkling2", "inkling2_loop", "inkling2_loop_text", "inkling2_text")},
    **{t: {"generate": "static cache past the sliding window crashes (hybrid_sliding mask sized for full layers)",
           "cache": "static cache: the relative bias reads the query offset after the update has grown it"}
       for t in ("inkling_text", "inkling_mm_model")},
}


def model_types() -> dict[str, str]:
    """model type -> the first mapping (in MAPPINGS order) that builds it."""
    from transformers.models.auto import modeling_auto

    out: dict[str, str] = {}
    for kind, name in MAPPINGS.items():
        for model_type in getattr(modeling_auto, name):
            out.setdefault(model_type, kind)
    return out


def run_one(model_type: str) -> None:
    """Build, check, print one JSON line (run in a subprocess by run_all)."""
    print(json.dumps(check_one(model_type)))


def check_one(model_type: str, seq_len: int = 16, threads: int = 1) -> dict:
    """The sweep's row of one model type: its tiny model built and every check but `load` run on it."""
    import warnings

    import torch
    import transformers

    warnings.filterwarnings("ignore")
    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(threads)
    from posdiag import checks
    from posdiag.api import run_checks
    from posdiag.model.loading import from_module
    from posdiag.options import RunOptions
    from posdiag.testing.multimodal import small_model

    row: dict = {"type": model_type, "kind": model_types().get(model_type, "?")}
    try:
        subject = from_module(small_model(model_type), name=model_type)
    except Exception as exc:  # not instantiable from a small config on CPU: listed with the reason
        row["unbuildable"] = f"{type(exc).__name__}: {_first_line(exc)}"[:200]
        return row
    row.update(position_kind=subject.position_kind, family_kind=subject.kind, tested=subject.tested)
    try:  # a small config transformers builds but cannot run (inconsistent sizes) is not a model to judge
        subject.forward(subject.sample_ids(1, min(seq_len, 8), 0))
    except Exception as exc:
        why = subject.tested[subject.tested.find("not drivable by text alone"):] if "not drivable" in subject.tested \
            else f"{type(exc).__name__}: {_first_line(exc)}"
        row["unbuildable"] = f"builds, but a plain forward of the small config fails: {why}"[:300]
        return row
    names = [n for n in checks.available() if n != "load"]
    report = run_checks(subject, names, RunOptions(seq_len=seq_len))
    row["checks"] = {c.name: [c.status.value, c.summary[:240]] for c in report.checks}
    return row


def _first_line(exc: BaseException) -> str:
    """The exception's first non-blank line (transformers' missing-backend ImportError starts with a newline)."""
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), "")


def done() -> dict[str, dict]:
    rows: dict[str, dict] = {}
    if RESULTS.exists():
        for line in RESULTS.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                rows[row["type"]] = row
    return rows


def run_all(timeout: float, only: list[str], write: bool) -> None:
    types = model_types()
    todo = [t for t in (only or sorted(types)) if t not in done()]
    script = HERE / "support_matrix.py"
    for i, model_type in enumerate(todo):
        start = time.time()
        try:
            proc = subprocess.run([sys.executable, str(script), "--one", model_type], capture_output=True,
                                  text=True, timeout=timeout, preexec_fn=_limit_memory)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            last = (proc.stderr.strip().splitlines() or [""])[-1][:200]
            row = json.loads(lines[-1]) if lines else {
                "type": model_type, "kind": types.get(model_type, "?"),
                "unbuildable": f"process exited {proc.returncode}: {last}"}
        except subprocess.TimeoutExpired:
            row = {"type": model_type, "kind": types.get(model_type, "?"), "timeout": timeout}
        with RESULTS.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"[{i + 1}/{len(todo)}] {model_type} {time.time() - start:.0f}s", flush=True)
    if write:
        write_page()


def _limit_memory() -> None:
    """A small config whose model still asks for many GB must fail alone, not take the machine down."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def counts() -> dict[str, int]:
    """The sweep's headline figures (docs/support.md and the README quote them; tests/test_support_subset.py checks
    that the README's match)."""
    rows = done()
    judged = [r for r in rows.values() if "checks" in r]
    statuses = [(r["type"], n, s) for r in judged for n, (s, _) in r["checks"].items()]
    fails = [(t, n) for t, n, s in statuses if s == "fail"]
    return {"total": len(model_types()), "swept": len(rows), "judged": len(judged),
            "not_built": len(rows) - len(judged), "skips": sum(s == "skip" for *_, s in statuses),
            "errors": sum(s == "error" for *_, s in statuses), "fails": len(fails),
            "unclassified": sum(n not in FINDINGS.get(t, {}) for t, n in fails)}


def readme_sentence(c: dict[str, int]) -> str:
    """The README's coverage line, from counts(); write_page() puts it between the README's sweep-counts markers."""
    swept = "every model type" if c["swept"] == c["total"] else f"{c['swept']} of the {c['total']} model types"
    fails = (f"{c['fails']} FAILs, {c['fails'] - c['unclassified']} of them upstream findings" if c["unclassified"]
             else f"{c['fails']} FAILs, all upstream findings")
    return (f"Swept over {swept} of transformers' causal-LM, seq2seq, masked-LM and image-text-to-text mappings, a "
            f"tiny default-init model each ([the table](docs/support.md#every-model-type-the-sweep)): "
            f"**{c['judged']} of {c['total']} model types judged**, {c['skips']} check results skipped with their "
            f"reasons, {c['errors']} errors, {fails}; {c['not_built']} cannot be built from a small config on CPU "
            f"(listed with the reason).")


def write_page() -> None:
    from posdiag import checks

    names = [n for n in checks.available() if n != "load"]
    rows = done()
    judged = [r for r in rows.values() if "checks" in r]
    c = counts()
    swept = (f"{c['swept']} of {c['total']} model types swept" if c["swept"] < c["total"]
             else f"all {c['total']} model types swept")
    lines = [f"{swept}: {c['judged']} judged, {c['not_built']} not buildable as a small CPU model (listed below with "
             f"the reason); {c['skips']} check results skipped with reasons, {c['errors']} errors; {c['fails']} FAILs "
             f"on healthy default-init models, {c['fails'] - c['unclassified']} of them upstream findings (marked "
             f"*finding*, see [findings](#findings-on-stock-transformers-524))"
             + (f", {c['unclassified']} not yet classified." if c["unclassified"] else "."), "",
             "| model type | kind | positions | " + " | ".join(names) + " |", "|---" * (len(names) + 3) + "|"]
    for r in sorted(judged, key=lambda r: r["type"]):
        known = FINDINGS.get(r["type"], {})
        status = {n: r["checks"].get(n, ["skip"])[0] for n in names}
        cells = [SYMBOL[status[n]] + (" *finding*" if status[n] == "fail" and n in known else "") for n in names]
        kind = r["kind"] if r["kind"] == "image-text" else r["family_kind"]  # bart: seq2seq, though also a causal LM
        lines.append(f"| {r['type']} | {kind} | {r['position_kind']} | " + " | ".join(cells) + " |")
    lines += ["", "Not judged (cannot be built from a small config on CPU, or over the time limit):", ""]
    for r in sorted((r for r in rows.values() if "checks" not in r), key=lambda r: r["type"]):
        why = r.get("unbuildable") or f"over the {r.get('timeout', 0):.0f} s limit per model type"
        lines.append(f"- `{r['type']}` ({r['kind']}): {why.replace('|', '/')}")
    table = "\n".join(lines)
    text = PAGE.read_text()
    block = f"<!-- sweep:start -->\n{table}\n<!-- sweep:end -->"
    if "<!-- sweep:start -->" in text:
        text = re.sub(r"<!-- sweep:start -->.*?<!-- sweep:end -->", lambda _: block, text, flags=re.S)
    else:
        text += "\n## Every model type (the sweep)\n\n" + block + "\n"
    PAGE.write_text(text)
    readme = README.read_text()
    readme = re.sub(r"<!-- sweep-counts:start -->.*?<!-- sweep-counts:end -->",
                    lambda _: f"<!-- sweep-counts:start -->\n{readme_sentence(c)}\n<!-- sweep-counts:end -->", readme,
                    flags=re.S)
    README.write_text(readme)
