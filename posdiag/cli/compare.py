"""`posdiag compare REFERENCE CANDIDATE`: a port against its reference, layer by layer and position
by position. Exit codes: 0 the same model within rounding (or inconclusive), 1 the candidate differs,
2 usage or load error. Heavy imports happen inside the command.
"""

from __future__ import annotations

import enum
from dataclasses import replace
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from posdiag.cli import validate
from posdiag.cli._flow import emit, quiet_transformers, show_config, text_of, tokenize
from posdiag.cli._io import fail, guarded, loading
from posdiag.cli.groups import Given, Opt, takes
from posdiag.cli.options import (
    CONFIG,
    DTYPE_METAVAR,
    GATE,
    LOAD,
    OUTPUT,
    RUN,
    Settings,
    load_options,
    parse_dtype,
    resolve,
)

CandidateArg = Annotated[str | None, typer.Argument(
    metavar="CANDIDATE",
    help="The port to check: hub id, directory, a .gguf file (llama.cpp), or module.path:factory returning a "
         "torch.nn.Module or an engine (an object with logits(ids) -> [T, V]). Left out when REFERENCE is a .gguf "
         "file: llama.cpp runs it against PyTorch running the same file dequantised.", show_default=False)]
ReferenceArg = Annotated[str, typer.Argument(
    metavar="REFERENCE",
    help="The trusted model: hub id, directory, module.path:factory, or (alone) a .gguf file.", show_default=False)]


CompareSeqLenOpt = Annotated[int | None, typer.Option(
    "--seq-len", min=4, help="Tokens to compare (default min(512, both declared contexts, the original context); "
                             "with --long: default twice the original context).")]
LongOpt = Annotated[bool, typer.Option(
    "--long", help="Run past the original context (rope_parameters.original_max_position_embeddings or "
                   "max_position_embeddings) to expose scaling bugs.")]
LayerMapOpt = Annotated[str | None, typer.Option(
    "--layer-map", help="Align hidden states as REF:CAND index pairs, e.g. '0:0,1:2,2:4' (0 = embeddings).")]
ComparePlotOpt = Annotated[str | None,
                           typer.Option("--plot", help="Write a PNG of error vs position (needs matplotlib).")]
CandidateDtypeOpt = Annotated[str | None, typer.Option(
    "--candidate-dtype", parser=parse_dtype, metavar=DTYPE_METAVAR,
    help="Load the candidate in this dtype and run it there, not upcast (e.g. 'is my bf16 deployment the same "
         "model?').")]
CompareTextOpt = Annotated[str | None, typer.Option(
    "--text", metavar="TEXT",
    help="Compare on this text (or the text of this file) through the reference's tokenizer instead of random ids; "
         "a server candidate is sent the text as it is.")]
CandidateAttnOpt = Annotated[str | None, typer.Option(
    "--candidate-attn-implementation", help="Attention implementation for the candidate (default: as the reference).")]
ServedModelOpt = Annotated[str | None, typer.Option(
    "--served-model", help="A server candidate (http://HOST:PORT/v1): the model to ask for (default: the one it "
                           "serves).")]
ApiKeyOpt = Annotated[str | None, typer.Option(
    "--api-key", help="A server candidate: its API key (default: the POSDIAG_API_KEY environment variable).")]
ServedDtypeOpt = Annotated[str | None, typer.Option(
    "--served-dtype", help="A server candidate: what it serves in, a dtype (bfloat16 for a bf16 vLLM deployment), a "
                           "ggml type (Q4_1) or the .gguf file it serves; the reference run at that precision joins "
                           "the noise floor. Default: REFERENCE's own types when it is a quantised .gguf file.")]
class Route(str, enum.Enum):
    both = "both"
    prompt = "prompt"
    generation = "generation"
    serving = "serving"
    images = "images"


RouteOpt = Annotated[Route, typer.Option(
    "--route", help="A server candidate: prompt (echo + logprobs), generation (greedy, top-k log-probs per token), "
                    "both, serving (the paths a server takes: a request cold, a prefix-cache hit, a prompt longer "
                    "than its batch, the request among concurrent ones; each judged as the generation route), or "
                    "images (two images through the chat API, scored at every prompt position against the reference "
                    "on the same pixels; `both` includes it where the reference takes images).")]
TopKOpt = Annotated[int, typer.Option("--top-k", min=1, max=20, help="A server candidate: log-probs asked per token.")]
LongPromptOpt = Annotated[int | None, typer.Option(
    "--long-prompt-tokens", min=8, help="--route serving: tokens in the long-prompt path's prompt (default 90). Make "
                                       "it exceed the server's batch or prefill chunk size (llama.cpp --batch-size, "
                                       "vLLM --max-num-batched-tokens), or that path is one batch like the others.")]
PrefixTokensOpt = Annotated[int | None, typer.Option(
    "--prefix-tokens", min=8, help="--route serving: tokens the prefix-hit path's prompt shares with the request "
                                  "before it (default 256: two of vLLM's 128-token CPU cache blocks). A prefix "
                                  "shorter than the server's cache block is never a hit (reported: did not hit).")]


@takes(load=LOAD, run=RUN.only("seq_len", "seed", "text").but(seq_len=Opt(CompareSeqLenOpt), text=Opt(CompareTextOpt)),
       gate=GATE.only("fail_on", "require"), output=OUTPUT, config=CONFIG)
def compare(ctx: typer.Context, reference: ReferenceArg, candidate: CandidateArg = None, long: LongOpt = False,
            layer_map: LayerMapOpt = None, plot: ComparePlotOpt = None, candidate_dtype: CandidateDtypeOpt = None,
            candidate_attn: CandidateAttnOpt = None, served_model: ServedModelOpt = None, api_key: ApiKeyOpt = None,
            served_dtype: ServedDtypeOpt = None, route: RouteOpt = Route.both, top_k: TopKOpt = 5,
            long_prompt: LongPromptOpt = None, prefix_tokens: PrefixTokensOpt = None, *, load: Given, run: Given,
            gate: Given, output: Given, config: Given) -> None:
    """Compare a port with its reference, layer by layer and position by position.

    Same token ids, same dtype (unless --candidate-dtype). A position bug shows as error that is
    zero at position 0 and grows with position; a weight or norm bug is there at every position.

    Ports outside PyTorch (engines) are compared on their logits, position by position, against the
    reference's own float32-vs-float64 rounding. The engine protocol: an object with

      logits(ids: list[int]) -> array [T, V]   (numpy or torch; the logits of every position)

    and optionally name, settings (dict), context_length, boundaries (dict), quantization,
    approximations (e.g. ("gelu_f16",), measured on the reference and added to the floor), and

      logits_continued(ids, split) -> array [T, V]   (prefill, then continue the cache)

    (ids[:split] prefilled, the cache continued with the rest; judged as its own line).

    A module.path:factory candidate is an engine when the factory returns such an object, and a
    PyTorch model when it returns a torch.nn.Module. A .gguf candidate runs in llama.cpp
    (pip install llama-cpp-python gguf): all-position logits, float32 KV cache, the reference's token ids,
    the context the file declares, and a continuation from the middle. A quantised .gguf (Q8_0,
    Q4_0...) is judged per position against 10x the quantisation's own error, measured on posdiag's
    conversion of the reference at the same tensor types through the same engine (WARN when posdiag
    cannot write that conversion). By default the probe runs past the reference's sliding window;
    --long runs past the original context of scaled RoPE.

    http://HOST:PORT/v1 (an OpenAI-compatible server) is compared on its top-k log-probs, by text through
    the reference's tokenizer: the prompt route (echo + logprobs; a shifted route FAILs, never realigned)
    and the generation route (greedy from one token, --seq-len tokens, default 64), to that address only.
    A .onnx file runs in ONNX Runtime on the graph's own inputs (pip install onnxruntime onnx).

    posdiag compare model.gguf (one file): llama.cpp runs the file against PyTorch running the same
    weights, dequantised by transformers. A quantised file is also written as an F32 twin (every tensor
    dequantised, the metadata kept) and run through llama.cpp: the twin against PyTorch is position
    handling at float32 noise; the file against its twin is what quantisation alone adds. The same split
    judges a quantised candidate against any reference (K-quants too: nothing is re-quantised).
    """
    settings = _settings(ctx, Settings(model=reference, **load, **run, **output, **gate, **config), plot)
    candidate = _candidate_spec(reference, candidate)
    from posdiag.api import gate_policy

    policy = guarded(lambda: gate_policy(settings.fail_on, settings.require, also=("compare",)), settings.debug)
    mapping = guarded(lambda: _layer_map(layer_map), settings.debug) if layer_map else None
    candidate_settings = replace(  # the candidate's differ only where the candidate options say
        settings, model=candidate, dtype=candidate_dtype or settings.dtype,
        attn_implementation=candidate_attn or settings.attn_implementation,
        upcast=settings.upcast and candidate_dtype is None,
    )
    with _one_parse_per_file():  # a .gguf named as reference, candidate and --served-dtype: read once
        served = _served(reference, candidate, served_model, api_key, served_dtype, route, top_k, long_prompt,
                         settings.debug, prefix_tokens)
        ref, cand = _load_both(settings, candidate_settings, served)
        comparison = _compare(ref, cand, settings, long, mapping, served)
    _emit(comparison, ref, policy, settings, plot, f"posdiag compare {Path(reference).name} vs {Path(candidate).name}")


def _settings(ctx: typer.Context, given: Settings, plot: str | None) -> Settings:
    """The reference's settings (command line > config file > defaults), shown for --show-config, else checked:
    the output formats and files, the device and placement options."""
    settings = guarded(lambda: replace(resolve(ctx, given), model=given.model), given.debug)
    if settings.show_config:
        show_config(settings)
        raise typer.Exit(0)
    validate.output_format(settings)
    validate.outputs(json=settings.json, junit=settings.junit, html=settings.html, plot=plot)
    validate.load_options(settings)
    _require_matplotlib(plot)
    return settings


def _one_parse_per_file():
    from posdiag.model.gguf_file import one_parse_per_file

    return one_parse_per_file()


def _candidate_spec(reference: str, candidate: str | None) -> str:
    """Both specs checked before anything loads; a .gguf REFERENCE alone is its own candidate."""
    validate.model_spec(reference)
    if candidate is None:
        if not reference.lower().endswith(".gguf"):
            fail("compare needs REFERENCE and CANDIDATE; only a .gguf file is compared alone (with itself, "
                 "dequantised)")
        candidate = reference
    if candidate.lower().startswith(("http://", "https://")):
        validate.server_address(candidate)
    else:
        validate.model_spec(candidate)
    return candidate


def _served(reference: str, candidate: str, model: str | None, api_key: str | None, dtype: str | None,
            route: Route, top_k: int, long_prompt: int | None, debug: bool, prefix: int | None = None) -> dict:
    """The server options, refused in one line for a candidate that is not a server (or a route that does not read
    them). The precision it serves in defaults to REFERENCE's own tensor types when that is a quantised .gguf file
    (the file being served)."""
    given = [name for name, value in (("--served-model", model), ("--api-key", api_key), ("--served-dtype", dtype),
                                      ("--route", route is not Route.both or None),
                                      ("--long-prompt-tokens", long_prompt), ("--prefix-tokens", prefix)) if value]
    if given and not candidate.lower().startswith(("http://", "https://")):
        fail(f"{', '.join(given)}: for a server candidate (http://HOST:PORT/v1), not '{candidate}'")
    for option, value, path in (("--long-prompt-tokens", long_prompt, "long-prompt"), ("--prefix-tokens", prefix,
                                                                                         "prefix-hit")):
        if value is not None and route is not Route.serving:
            fail(f"{option}: for --route serving (its {path} path), not --route {route.value}")
    served = candidate.lower().startswith(("http://", "https://"))
    if not served:
        return dict(served_model=None, api_key=None, route=route.value, top_k=top_k, served_dtype=None,
                    long_prompt=None, prefix_tokens=None)
    from posdiag.ports.served import precision

    if dtype is None and reference.lower().endswith(".gguf"):
        own = guarded(lambda: precision.parse(reference), debug)
        dtype = reference if set(own.types.values()) - {"F32"} else None  # all F32: float32, nothing to add
    guarded(lambda: precision.parse(dtype), debug)  # checked before anything loads
    return dict(served_model=model, api_key=api_key, route=route.value, top_k=top_k, served_dtype=dtype,
                long_prompt=long_prompt, prefix_tokens=prefix)


def _emit(comparison, ref, policy, settings: Settings, plot: str | None, title: str) -> NoReturn:
    """The comparison as a report: the console view and the plot, then every format the settings ask for (--json,
    --junit, --format) as `check` writes them; its exit code is the command's."""
    from posdiag.api import versions
    from posdiag.report.compare_console import render_compare, write_png
    from posdiag.results import Report

    report = Report(model=ref.info, checks=(comparison.result,), versions=versions(), policy=policy)

    def show(out) -> None:
        render_compare(report, out, quiet=settings.quiet)
        if plot and comparison.profiles:
            guarded(lambda: write_png(plot, comparison, title), settings.debug)
            out.print(f"wrote {plot}")

    emit(report, settings, show=show)


def _require_matplotlib(plot: str | None) -> None:
    if not plot:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        fail("--plot needs matplotlib: pip install matplotlib")


def _layer_map(text: str):
    from posdiag.ports.layers import parse_layer_map

    return parse_layer_map(text)


def _load_both(reference: Settings, candidate: Settings, served: dict):
    """The reference in PyTorch, and the port CANDIDATE names (posdiag/ports/candidates.open_candidate). A server is
    asked first (one request): an address where nothing answers is said at once, not after the reference loads."""
    from posdiag.model.loading import load_subject
    from posdiag.ports.candidates import PortOptions, open_candidate

    ref_opts, cand_opts = load_options(reference), load_options(candidate)
    quiet_transformers()
    port = PortOptions(served_model=served["served_model"], api_key=served["api_key"])

    def open_cand():
        return guarded(lambda: open_candidate(candidate.model, cand_opts, port), reference.debug)

    cand = open_cand() if candidate.model.lower().startswith(("http://", "https://")) else None  # one GET /models
    with loading(reference.model):
        ref = guarded(lambda: load_subject(reference.model, ref_opts), reference.debug)
    if cand is None:
        with loading(candidate.model):
            cand = open_cand()
    return ref, cand


def _compare(ref, cand, settings: Settings, long: bool, mapping, served: dict):
    """The comparison the candidate's paths choose (posdiag/ports/comparison.py), under a status line; --text
    tokenized with the reference's tokenizer where the judge takes token ids, sent as it is where it takes text."""
    from rich.console import Console

    from posdiag.ports.comparison import compare
    from posdiag.ports.protocol import CompareRequest

    text = guarded(lambda: text_of(settings.text), settings.debug) if settings.text else None
    request = CompareRequest(
        seq_len=settings.seq_len, seed=settings.seed, text=text, long=long, layer_map=mapping,
        tokenize=lambda text: tokenize(settings.model, text, settings.revision, settings.trust_remote_code),
        route=served["route"], top_k=served["top_k"], served_dtype=served["served_dtype"],
        long_prompt=served["long_prompt"], prefix_tokens=served["prefix_tokens"])
    err = Console(stderr=True)
    with err.status("compare…") as status:
        stages = Stages(status.update, log=not (settings.quiet or err.is_terminal))
        return guarded(lambda: compare(ref, cand, replace(request, stage=stages)), settings.debug)


class Stages:
    """The status line while the comparison runs: the stage it is in and the time since it started ("compare:
    candidate on 256 tokens · 12.3 s"), re-rendered by the spinner so the clock moves. Where stderr is no terminal
    (a CI log) the spinner shows nothing: one plain line per stage instead."""

    def __init__(self, update, log: bool) -> None:
        import time

        self.update, self.log, self.name, self.start = update, log, "", time.perf_counter()

    def __call__(self, name: str) -> None:
        import sys

        self.name = name
        self.update(self)
        if self.log:
            print(f"posdiag: compare: {name} ({self.elapsed():.1f} s)", file=sys.stderr, flush=True)

    def elapsed(self) -> float:
        import time

        return time.perf_counter() - self.start

    def __rich__(self) -> str:
        return f"compare: {self.name} · {self.elapsed():.1f} s"
