"""Encoders and long-context encoder-decoders of the support sweep: errors and false FAILs on healthy default-init
models, each fixed or classified, next to a planted twin that still fails (or a healthy sibling that passes).

- LayoutLM: x/y/h/w tables indexed by the layout box (every token reads row 0 by default) are not position tables;
  its 4D-mask misreading shows only with two rows or more (the mask-refusal probe runs two).
- LUKE: the entity position table is read through entity inputs only; the word position table is still judged.
- LED: a model without position ids is probed by one row of at most max_long_row tokens (its 16384-position encoder
  table asked for a 2 GiB mask); its decoder with a StaticCache is wrong at single-token steps (upstream finding).
- MobileBERT (trigram input), Nystromformer (value convolution) and MPNet (relative bias from storage order) read
  storage order besides attention: no consistent permutation. Nystromformer's convolution also reads padding
  values (upstream finding: the reference code masks them).
"""

from __future__ import annotations

import pytest
import torch
from sweep_support import pinned, run_named, sweep_model

from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing import zoo

_model, _run = sweep_model, run_named


def _zero(model, table: str):
    """Zero the parameter named `table` (any prefix of the head class before it)."""
    (param,) = [p for n, p in model.named_parameters() if n == table or n.endswith("." + table)]
    with torch.no_grad():
        param.zero_()
    return model


# ------------------------------------------------------------------ tables indexed by another input
def test_layoutlm_box_tables_are_not_position_tables():
    found = _run(_model("layoutlm", max_position_embeddings=32, max_2d_position_embeddings=32),
                 ["shuffle", "positions", "shift", "table"])
    assert found["shuffle"].status is Status.PASS, found["shuffle"].summary
    assert found["positions"].status is Status.PASS, found["positions"].summary
    assert found["shift"].status is Status.NA and "absolute" in found["shift"].summary
    table = found["table"]
    assert table.status is Status.PASS, table.summary
    others = table.details["not_positions"]
    assert {n.split(".")[1] for n in others} == {"x_position_embeddings", "y_position_embeddings",
                                                 "h_position_embeddings", "w_position_embeddings"}
    assert all("reads its row 0" in why for why in others.values())


def test_layoutlm_without_its_sequence_table_fails():
    model = _zero(_model("layoutlm", max_position_embeddings=32, max_2d_position_embeddings=32),
                  "embeddings.position_embeddings.weight")
    table = _run(model, ["table"])["table"]
    assert table.status is Status.FAIL, table.summary


def test_luke_entity_table_is_excluded_and_word_table_judged():
    table = _run(_model("luke", max_position_embeddings=64, entity_vocab_size=64), ["table"])["table"]
    assert table.status is Status.PASS, table.summary
    (other,) = table.details["not_positions"]
    assert other.endswith("entity_embeddings.position_embeddings.weight")
    assert "no row of it is read" in table.summary
    assert any(n.endswith(".embeddings.position_embeddings.weight") or n == "embeddings.position_embeddings.weight"
               for n in table.details["tables"] if n != other)
    assert table.metrics["positions_probed"] == 64


def test_luke_without_its_word_table_fails():
    model = _zero(_model("luke", max_position_embeddings=64, entity_vocab_size=64),
                  "embeddings.position_embeddings.weight")
    table = _run(model, ["table"])["table"]
    assert table.status is Status.FAIL, table.summary


# ------------------------------------------------------------------ bounded long rows (LED)
def test_long_row_of_a_derived_position_model_is_bounded():
    model = _model("led", max_encoder_position_embeddings=64, max_decoder_position_embeddings=64, attention_window=8)
    options = RunOptions(seq_len=12, check_options={"table": {"max_long_row": 32}})
    table = _run(model, ["table"], options)["table"]
    assert table.status is Status.PASS, table.summary
    assert table.metrics["encoder_positions_probed"] == 32 and table.metrics["decoder_positions_probed"] == 32
    skipped = [p["message"] for p in table.details["parts"]["capacity"] if p["status"] == "skip"]
    assert len(skipped) == 2 and all("positions 32..63 of 64" in m and "max_long_row = 32" in m for m in skipped)


# ------------------------------------------------------------------ LED static cache (upstream finding)
def test_led_static_cache_is_an_upstream_finding_and_bart_passes():
    """LEDDecoder builds no causal mask for a single-token input: right for a dynamic cache, wrong for a StaticCache,
    whose unused slots are then attended. transformers accepts generate(cache_implementation="static") on it."""
    led = _run(_model("led", attention_window=8), ["cache", "generate"])
    for name in ("cache", "generate"):
        result = led[name]
        if not pinned(result, "led", name):
            continue
        assert "in float64: a bug" in result.summary
        runs = result.details["paths" if name == "cache" else "runs"]
        dynamic = {k: v for k, v in runs.items() if k.startswith("dynamic/")}
        assert dynamic and all(v["status"] is Status.PASS for v in dynamic.values()), dynamic
    bart = _run(zoo.tiny_model("bart"), ["cache", "generate"])
    assert all(r.status is Status.PASS for r in bart.values()), {n: r.summary for n, r in bart.items()}


# ------------------------------------------------------------------ storage-order mixing besides attention
@pytest.mark.parametrize(("model_type", "table"), [("mobilebert", "embeddings.position_embeddings.weight"),
                                                   ("mpnet", "embeddings.position_embeddings.weight")])
def test_storage_order_mixing_has_no_consistent_permutation(model_type, table):
    found = _run(_model(model_type, max_position_embeddings=64), ["shuffle", "positions", "shift", "table"])
    for name in ("shuffle", "positions", "table"):
        assert found[name].status is Status.PASS, f"{name}: {found[name].summary}"
    assert "consistent permutation not run" in found["positions"].summary
    assert found["shift"].status is Status.NA and "absolute" in found["shift"].summary
    broken = _run(_zero(_model(model_type, max_position_embeddings=64), table), ["positions"])["positions"]
    assert broken.status is Status.FAIL, broken.summary


def test_mobilebert_floor_is_rounding_again():
    """The consistent permutation (0.30 off P f(x) through the trigram) was the floor; now the jittered baseline."""
    shuffle = _run(_model("mobilebert", max_position_embeddings=64), ["shuffle"])["shuffle"]
    assert shuffle.metrics["noise_floor"] < 1e-5, shuffle.summary


def test_nystromformer_padding_reaches_valid_tokens_through_its_convolution():
    """Upstream finding: the value convolution runs over padded values (the reference implementation multiplies
    them by the mask first). Without the convolution every padded row equals itself alone."""
    found = _run(_model("nystromformer", max_position_embeddings=64), ["positions", "batch"])
    assert found["positions"].status is Status.PASS, found["positions"].summary
    assert "convolution" in found["positions"].summary
    batch = found["batch"]
    if pinned(batch, "nystromformer", "batch"):
        assert "in float64: a bug" in batch.summary, batch.summary
    model = _model("nystromformer", max_position_embeddings=64)
    for module in model.modules():
        if hasattr(module, "conv_kernel_size"):
            module.conv_kernel_size = None
    model.config.__dict__["conv_kernel_size"] = None
    healthy = _run(model, ["positions", "batch"])
    assert all(r.status is Status.PASS for r in healthy.values()), {n: r.summary for n, r in healthy.items()}
