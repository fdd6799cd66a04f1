"""The `posdiag compare REFERENCE CANDIDATE` command (registered on the app defined in posdiag.cli).

Exit codes: 0 the same model within rounding (or inconclusive), 1 the candidate differs,
2 usage or load error. Heavy imports happen inside the command.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from posdiag.cli import (
    AttnOpt,
    DebugOpt,
    DeviceMapOpt,
    DeviceOpt,
    MaxMemoryOpt,
    OffloadOpt,
    DType,
    DtypeOpt,
    Device,
    JsonOpt,
    MaxBatchOpt,
    PickleOpt,
    QuietOpt,
    RevisionOpt,
    SeedOpt,
    TextOpt,
    TrustOpt,
    UpcastOpt,
    _fail,
    _guarded,
    _quiet_transformers,
    app,
)

CandidateArg = Annotated[str, typer.Argument(help="The port to check: hub id, directory, or module.path:factory.",
                                             show_default=False)]
ReferenceArg = Annotated[str, typer.Argument(help="The trusted model: hub id, directory, or module.path:factory.",
                                             show_default=False)]


@app.command()
def compare(
    reference: ReferenceArg,
    candidate: CandidateArg,
    seq_len: Annotated[Optional[int], typer.Option(
        "--seq-len", min=4, help="Tokens to compare (default min(512, both declared contexts, the original context); "
                                 "with --long: default twice the original context).")] = None,
    long: Annotated[bool, typer.Option(
        "--long", help="Run past the original context (rope_parameters.original_max_position_embeddings or "
                       "max_position_embeddings) to expose scaling bugs.")] = False,
    layer_map: Annotated[Optional[str], typer.Option(
        "--layer-map", help="Align hidden states as REF:CAND index pairs, e.g. '0:0,1:2,2:4' (0 = embeddings).")] = None,
    plot: Annotated[Optional[str], typer.Option("--plot", help="Write a PNG of error vs position (needs matplotlib).")] = None,
    candidate_dtype: Annotated[Optional[DType], typer.Option(
        "--candidate-dtype", help="Load the candidate in this dtype and run it there, not upcast "
                                  "(e.g. 'is my bf16 deployment the same model?').")] = None,
    candidate_attn: Annotated[Optional[str], typer.Option(
        "--candidate-attn-implementation", help="Attention implementation for the candidate (default: as the reference).")] = None,
    revision: RevisionOpt = None, trust_remote_code: TrustOpt = False, dtype: DtypeOpt = DType.auto,
    device: DeviceOpt = Device.auto, device_map: DeviceMapOpt = None, max_memory: MaxMemoryOpt = None,
    offload_folder: OffloadOpt = None, attn_implementation: AttnOpt = "eager",
    upcast: UpcastOpt = True, allow_pickle: PickleOpt = False, seed: SeedOpt = 0, text: TextOpt = None,
    max_batch: MaxBatchOpt = None, json: JsonOpt = None, quiet: QuietOpt = False, debug: DebugOpt = False,
) -> None:
    """Compare a port with its reference, layer by layer and position by position.

    Same token ids, same dtype (unless --candidate-dtype). A position bug shows as error that is
    zero at position 0 and grows with position; a weight or norm bug is there at every position.
    """
    from rich.console import Console

    from posdiag.errors import PosdiagError

    if plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            _fail("--plot needs matplotlib: pip install 'posdiag[plot]'")
    mapping = _guarded(lambda: _layer_map(layer_map), debug) if layer_map else None

    err = Console(stderr=True)
    ref_opts = _load_options(locals(), dtype.value, attn_implementation, upcast)
    cand_opts = _load_options(locals(), candidate_dtype.value if candidate_dtype else dtype.value,
                              candidate_attn or attn_implementation, upcast and candidate_dtype is None)
    from posdiag.model.loading import load_subject

    _quiet_transformers()
    with err.status(f"loading {reference}…"):
        ref = _guarded(lambda: load_subject(reference, ref_opts), debug)
    with err.status(f"loading {candidate}…"):
        cand = _guarded(lambda: load_subject(candidate, cand_opts), debug)

    from posdiag.api import versions
    from posdiag.tools.compare import compare_subjects
    from posdiag.options import RunOptions
    from posdiag.report.compare_console import render_compare, write_png
    from posdiag.report.json_report import format_json
    from posdiag.results import Report

    def run():
        token_ids = None
        if text:
            from posdiag.cli import _tokenize

            token_ids = _tokenize(reference, text, revision, trust_remote_code)
            if max(token_ids) >= min(ref.vocab_size, cand.vocab_size):
                raise PosdiagError("the tokenizer produced ids outside a model's vocabulary")
        options = RunOptions(seq_len=seq_len, seed=seed, token_ids=token_ids)
        return compare_subjects(ref, cand, options, long=long, layer_map=mapping)

    with err.status("comparing…"):
        comparison = _guarded(run, debug)
    report = Report(model=ref.info, checks=(comparison.result,), versions=versions())

    out = Console(stderr=True) if json == "-" else Console()
    render_compare(report, out, quiet=quiet)
    if json:
        data = format_json(report)
        if json == "-":
            sys.stdout.write(data)
        else:
            _guarded(lambda: Path(json).write_text(data), debug)
    if plot and comparison.profiles:
        _guarded(lambda: write_png(plot, comparison, f"posdiag compare {Path(reference).name} vs {Path(candidate).name}"), debug)
        out.print(f"plot written to {plot}", style="dim")
    raise typer.Exit(report.exit_code)


def _layer_map(text: str):
    from posdiag.tools.compare import parse_layer_map

    return parse_layer_map(text)


def _load_options(args: dict, dtype: str, attn: str, upcast: bool):
    from posdiag.options import LoadOptions

    return LoadOptions(
        revision=args["revision"], trust_remote_code=args["trust_remote_code"], dtype=dtype,
        device=args["device"].value, device_map=args["device_map"], max_memory=args["max_memory"],
        offload_folder=args["offload_folder"], attn_implementation=attn,
        upcast=upcast, allow_pickle=args["allow_pickle"], max_batch=args["max_batch"],
    )
