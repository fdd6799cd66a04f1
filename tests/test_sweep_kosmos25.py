"""Kosmos-2.5 in the support sweep: its text model's positions, and an upstream finding on left-padded generate().

- Its text model (like Kosmos-2's) adds a fairseq-style sinusoidal table, numbered RoBERTa's way: its own ids start
  at padding_idx + 1 and explicit position_ids are read as table rows. posdiag passed 0-based ids, so the cache
  check's explicit-id paths read the zeroed padding row and FAILed (0.706, the same in float64): now the family row
  gives the offset, and the sinusoid check leaves out that zeroed row no position reads.
- Upstream finding (transformers 5.24): cached decoding numbers a left-padded row from its first padding column
  (padding_idx + 1 + cache length, the cache counting the pads), while its prefill skips the pads, and generate()
  drops the position_ids it derives: `generate` FAILs the left-padded batch runs; XGLM (the same table, positions
  handed by generate()) passes them.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch
from sweep_support import holds, pinned

from posdiag.api import run_checks
from posdiag.checks.table import sinusoid_report
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing.multimodal import small_model

SHORT = RunOptions(seq_len=12, check_options={"cache": {"decode_steps": 3}, "generate": {"new_tokens": 3}})


def _model(model_type: str):
    warnings.filterwarnings("ignore")
    return small_model(model_type)


def _run(subject, names: list[str]) -> dict:
    return {r.name: r for r in run_checks(subject, names, SHORT).checks}


def test_kosmos25_explicit_position_ids_start_at_padding_idx_plus_one():
    subject = from_module(_model("kosmos-2.5"))
    pad = subject.config.pad_token_id
    assert subject.position_kind == "sinusoidal"
    assert subject.family.explicit_position_offset == subject.family.position_offset == pad + 1
    assert subject.max_positions == subject.config.max_position_embeddings  # its offset rows come on top
    cache = _run(subject, ["cache"])["cache"]
    assert cache.status is Status.PASS, cache.summary
    explicit = [name for name in cache.details["paths"] if name.endswith("+position_ids")]
    assert explicit and all(cache.details["paths"][n]["status"] is Status.PASS for n in explicit)


def test_kosmos25_cache_fails_when_explicit_ids_miss_its_offset():
    # The twin: the same model driven with 0-based ids (posdiag's reading before the family row) must still FAIL.
    subject = from_module(_model("kosmos-2.5"))
    subject.family = dataclasses.replace(subject.family, explicit_position_offset=0)
    cache = _run(subject, ["cache"])["cache"]
    assert cache.status is Status.FAIL and "+position_ids" in cache.summary, cache.summary


def _fairseq_table(rows: int, dim: int, pad: int) -> torch.Tensor:
    """tensor2tensor's [sin|cos] table, θ_i = 10000^(-i/(d/2-1)), row padding_idx zeroed (M2M100, XGLM, Kosmos)."""
    half = dim // 2
    theta = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000) / (half - 1)))
    angles = torch.arange(rows, dtype=torch.float32)[:, None] * theta
    table = torch.cat([torch.sin(angles), torch.cos(angles)], 1)
    table[pad] = 0
    return table


def test_sinusoid_leaves_out_a_zeroed_row_no_position_reads_but_not_a_read_one():
    table = _fairseq_table(130, 32, pad=1)
    assert sinusoid_report(table, unread=(1,))["status"] is Status.PASS
    assert sinusoid_report(table)["status"] is Status.FAIL  # judged as a read row, the zeroed row is wrong
    table[5] = 0  # a row that position 3 reads
    assert sinusoid_report(table, unread=(1,))["status"] is Status.FAIL


def test_kosmos25_table_passes():
    table = _run(from_module(_model("kosmos-2.5")), ["table"])["table"]
    assert table.status is Status.PASS, table.summary
    (sinusoid,) = table.details["parts"]["sinusoid"]
    assert sinusoid["status"] == "pass" and sinusoid["unread_zero_rows"] == [1], sinusoid


def test_kosmos25_left_padded_generate_is_an_upstream_finding():
    found = _run(from_module(_model("kosmos-2.5")), ["batch", "generate"])
    assert found["batch"].status is Status.PASS, found["batch"].summary  # its forward skips pad ids: prefill is right
    generate = found["generate"]
    if not pinned(generate, "kosmos-2.5", "generate"):
        return
    assert "float64" in generate.summary  # decided there: not rounding
    runs = generate.details["runs"]
    assert runs["dynamic/single"]["status"] is Status.PASS and runs["static/single"]["status"] is Status.PASS


def test_kosmos25_decode_positions_count_the_padding_plain_transformers():
    # The mechanism without posdiag: a left-padded row's cached step differs from the row alone, and handing that
    # step the position the row alone has (padding_idx + 1 + its 8 tokens) makes them agree.
    model = _model("kosmos-2.5").text_model.eval()
    pad = model.config.pad_token_id
    ids = torch.randint(4, 200, (1, 9), generator=torch.Generator().manual_seed(0))
    padded = torch.cat([torch.full((1, 4), pad), ids[:, :8]], 1)
    mask = torch.cat([(padded != pad).long(), torch.ones(1, 1, dtype=torch.long)], 1)
    with torch.no_grad():
        alone = model(input_ids=ids).logits[0, -1]
        steps = []
        for position_ids in (None, torch.tensor([[pad + 1 + 8]])):
            cache = model(input_ids=padded, attention_mask=mask[:, :-1], use_cache=True).cache
            steps.append(model(input_ids=ids[:, 8:], attention_mask=mask, cache=cache,
                               position_ids=position_ids).logits[0, -1])
    error = [float((s - alone).norm() / alone.norm()) for s in steps]
    assert (error[0] > 0.1 if holds("kosmos-2.5", "generate") else error[0] < 1e-5) and error[1] < 1e-5, error


def test_xglm_left_padded_generate_passes_where_kosmos25_fails():
    generate = _run(from_module(_model("xglm")), ["generate"])["generate"]
    assert generate.status is Status.PASS, generate.summary
