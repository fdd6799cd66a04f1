"""`serving`: chunked prefill, a shared prefix's cache, a request inside a padded batch, speculative decoding and
hand-written decode loops each against one full forward. Planted serving bugs on three families with their healthy
twins (tests/plants_serving.py), paths a model cannot take named as not run, and the zoo. The real SmolLM2 passes in
tests/test_fit_pretrained.py (its every-check report)."""

from __future__ import annotations

import plants_serving as plants
import pytest
import torch
from sweep_rows import exhaustive

from posdiag import api
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing import zoo

pytestmark = pytest.mark.filterwarnings("ignore")
FAMILIES = ["llama", "qwen2", "mistral"]


def _serving(model: torch.nn.Module, *paths: str, **settings):
    """The serving check on `model`, its paths limited to the kinds named (a bug's twin runs the same kinds, which
    keeps each float64 re-run to what must be decided)."""
    table = {**({"paths": list(paths)} if paths else {}), **settings}
    return api.run_checks(from_module(model), ["serving"], RunOptions(check_options={"serving": table})).check(
        "serving")


def _failing(result) -> set[str]:
    return {row[0] for row in result.tables[0].rows if row[1] == "fail"}


@pytest.mark.parametrize("reset", ["never", "batch size"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_position_offset_kept_from_a_padded_batch_fails_the_next_batch_decode(family, reset):
    """The issue's case: the per-row offset of one padded batch (rope_deltas, text only) reused by the next batch's
    decode steps, never reset or reset only when the batch size changes. Every other path passes position_ids or
    decodes one unpadded request, where the offset is 0."""
    kinds = ("decode loop after a padded batch", "decode loop after another prompt", "padded batch")
    bad = _serving(plants.rope_deltas(zoo.tiny_model(family), reset=reset), *kinds)
    assert bad.status is Status.FAIL, bad.summary
    assert _failing(bad) == {"decode loop after a padded batch"}
    assert bad.summary.startswith("decode loop after a padded batch: a hand-written decode loop (4 steps, no "
                                  "position_ids) on a left-padded batch of 3 after the same loop on another batch")
    assert "first departs at row 0 decode step 1 (position 61)" in bad.summary  # the prefill itself is right
    assert "does not shrink with precision" in bad.summary  # decided in float64: a bug
    good = _serving(plants.rope_deltas(zoo.tiny_model(family), reset="prompt"), *kinds)
    assert good.status is Status.PASS, good.summary


@pytest.mark.parametrize("family", FAMILIES)
def test_chunks_numbered_from_zero_fail_at_the_first_chunk_boundary(family):
    bad = _serving(plants.chunk_restart(zoo.tiny_model(family), restart=True), "chunks", "generate prefill_chunk_size")
    assert bad.status is Status.FAIL, bad.summary
    assert _failing(bad) == {"chunks of 3", "chunks of 16", "generate prefill_chunk_size=3",
                             "generate prefill_chunk_size=16"}
    assert bad.summary.startswith("chunks of 3: the 64-token prompt fed 3 tokens a forward into one cache: first "
                                  "departs at position 3 by"), bad.summary
    assert "chunks of 16: the 64-token prompt fed 16 tokens a forward into one cache: first departs at position 16" \
        in bad.summary
    good = _serving(plants.chunk_restart(zoo.tiny_model(family), restart=False), "chunks",
                    "generate prefill_chunk_size")
    assert good.status is Status.PASS, good.summary


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prefix_cache_hit_one_slot_off_fails_shared_prefix(family):
    bad = _serving(plants.prefix_slot(zoo.tiny_model(family), off=1), "shared prefix", "chunks")
    assert bad.status is Status.FAIL, bad.summary
    assert _failing(bad) == {"shared prefix"}
    assert "first departs at suffix A position 32 by" in bad.summary  # the first token after the cached prefix
    good = _serving(plants.prefix_slot(zoo.tiny_model(family), off=0), "shared prefix", "chunks")
    assert good.status is Status.PASS, good.summary


@pytest.mark.parametrize("family", FAMILIES)
def test_drafts_numbered_one_off_after_a_rollback_fail_speculative_decoding(family):
    """Rejected drafts crop the cache; numbering the next verification from one slot off changes the step after. The
    assistant's draft disagrees at every odd position, so assisted decoding rolls back too (with the model as its own
    assistant every draft was accepted and this plant passed there)."""
    bad = _serving(plants.drafts_off(zoo.tiny_model(family), off=1), "prompt lookup", "assisted decoding")
    assert bad.status is Status.FAIL, bad.summary
    assert _failing(bad) == {"prompt lookup", "assisted decoding"}
    assert "first departs at generated step" in bad.summary
    good = _serving(plants.drafts_off(zoo.tiny_model(family), off=0), "prompt lookup", "assisted decoding")
    assert good.status is Status.PASS, good.summary


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_crop_that_keeps_a_rejected_draft_fails_assisted_decoding(family, dtype):
    """Only a rollback crops the cache: a crop that keeps one rejected draft FAILs assisted decoding, whose run counts
    the drafts it rejected (the premise of the path); the healthy twin PASSes having rolled back."""
    bad = _serving(plants.stale_crop(zoo.tiny_model(family, dtype=dtype), stale=1), "assisted decoding")
    assert bad.status is Status.FAIL and _failing(bad) == {"assisted decoding"}, bad.summary
    assert "does not shrink with precision" in bad.summary
    good = _serving(plants.stale_crop(zoo.tiny_model(family, dtype=dtype), stale=0), "assisted decoding")
    assert good.status is Status.PASS, good.summary
    premise = good.details["paths"]["assisted decoding"]["premise"]
    assert premise["held"] and premise["what"].split()[0] != "0", premise


def test_assisted_decoding_that_never_rolls_back_is_not_confirmed(monkeypatch):
    """A draft that always agrees (the model as its own assistant, as before) verifies without a rollback: the path
    agrees with the full forward, but its premise did not run, so it is not a PASS."""
    from posdiag.model import drafts

    monkeypatch.setattr(drafts, "runner_up", lambda module, args, kwargs, output: output)
    result = _serving(zoo.tiny_model("llama"), "assisted decoding")
    assert result.status is Status.WARN, result.summary
    assert result.summary.startswith("assisted decoding: not confirmed: rollback not exercised: verification "
                                     "accepted every draft (0 drafted tokens rejected"), result.summary


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_continuation_numbered_one_early_fails_in_float32_and_bfloat16(family, dtype):
    """A cached forward without position_ids numbered from cache length - 1: in bfloat16 its error sits under the
    floor (a PASS that could not have failed, before); the same weights held in float32 decide it, and the report says
    where it departs."""
    kinds = ("chunks", "shared prefix")
    bad = _serving(plants.continued_early(zoo.tiny_model(family, dtype=dtype), early=1), *kinds)
    assert bad.status is Status.FAIL and _failing(bad) == {"chunks of 3", "chunks of 16", "shared prefix"}, bad.summary
    assert bad.summary.startswith("chunks of 3: the 64-token prompt fed 3 tokens a forward into one cache: first "
                                  "departs at position 3 by"), bad.summary
    if dtype == torch.bfloat16:
        assert bad.details["dtypes"]["decided_in"] == "float32", bad.summary
    good = _serving(plants.continued_early(zoo.tiny_model(family, dtype=dtype), early=0), *kinds)
    assert good.status is Status.PASS, good.summary


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_every_path_could_have_failed_in_float32(family):
    """Each path's one-position slip (its continued forwards numbered one early by posdiag), measured in the same run
    against the same reference and floor, stands above the tolerance: the PASS could have failed. The one path with
    no slip is the padded batch decoded without position_ids (the model numbers it itself: posdiag does not guess)."""
    from posdiag.verdict import FAIL_RATIO

    result = _serving(zoo.tiny_model(family))
    assert result.status is Status.PASS, result.summary
    slips = {name: path["slip"] for name, path in result.details["paths"].items()}
    unslipped = {name for name, slip in slips.items() if slip["ratio"] is None}
    assert unslipped == {"decode loop after a padded batch"}, slips
    assert all(slip["ratio"] > FAIL_RATIO for name, slip in slips.items() if name not in unslipped), slips
    assert result.metrics["slip_ratio_min"] > FAIL_RATIO
    assert "weakest power: a one-position slip on " in result.summary


def test_a_pass_whose_slip_the_band_would_pass_is_inconclusive_in_bfloat16(monkeypatch):
    """In bfloat16 a tiny Llama's floor swamps a one-position slip; where neither float32 (the weights cannot be held
    in it: a dispatched model, no memory) nor a float64 re-run can decide, a PASS there could not have failed: WARN
    naming the dtype and the slip's ratio, never PASS."""
    from posdiag.model import arbitration, precision
    from posdiag.model.precision import FinerRun

    monkeypatch.setattr(precision, "float32_copy_refused", lambda subject: "no memory for it here")
    monkeypatch.setattr(arbitration, "run_finer", lambda *args, **kwargs: FinerRun(
        None, torch.float64, reason="no float64 here"))
    result = _serving(zoo.tiny_model("llama", dtype=torch.bfloat16), "chunks", "shared prefix")
    assert result.status is Status.WARN, result.summary
    assert result.summary.startswith("chunks of 3: inconclusive in bfloat16: a one-position slip on chunks of 3 "
                                     "measures "), result.summary


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_after_the_first_losing_the_cache_offset_fail_the_padded_batch(family):
    bad = _serving(plants.rows_offset(zoo.tiny_model(family), dropped=True), "padded batch",
                   "decode loop after another prompt")
    assert bad.status is Status.FAIL, bad.summary
    assert _failing(bad) == {"padded batch"}
    assert bad.summary.startswith("padded batch: the 56-token request as row 1 of a left-padded batch of lengths "
                                  "[64, 56, 28], position_ids from the mask, 4 decode steps: first departs at decode "
                                  "step 1 (position 56)"), bad.summary
    good = _serving(plants.rows_offset(zoo.tiny_model(family), dropped=False), "padded batch",
                    "decode loop after another prompt")
    assert good.status is Status.PASS, good.summary


def test_paths_a_model_cannot_take_are_named_never_passed():
    """MPT: transformers refuses assisted decoding ("requires a cache"): named as not run; with only those paths
    asked for, nothing ran, a SKIP. A chunk as long as the prompt is no chunked prefill: not run either."""
    model = zoo.tiny_model("mpt")
    some = _serving(model, "assisted decoding", "prompt lookup", "padded batch")
    assert some.status is Status.PASS, some.summary
    assert [row[0] for row in some.tables[0].rows] == ["padded batch"]
    assert "not run: assisted decoding (transformers refuses it for this model: RuntimeError: Assisted decoding " \
           "requires a cache)" in some.summary
    none = _serving(model, "assisted decoding", "prompt lookup")
    assert none.status is Status.SKIP, none.summary
    assert none.summary.startswith("no serving path ran: assisted decoding: transformers refuses it")
    long_chunk = _serving(zoo.tiny_model("llama"), "chunks", chunk_sizes=[64])
    assert long_chunk.status is Status.SKIP, long_chunk.summary
    assert "chunks of 64: a chunk of 64 holds the whole 64-token prompt" in long_chunk.summary


def test_encoders_and_encoder_decoders_are_na():
    for family in ("bert", "t5"):
        result = _serving(zoo.tiny_model(family))
        assert result.status is Status.NA and "the serving paths continue a decoder-only prompt" in result.summary


def test_an_unknown_path_is_a_usage_error():
    from posdiag.errors import PosdiagError

    with pytest.raises(PosdiagError, match=r"\[checks.serving\] paths: unknown nope"):
        _serving(zoo.tiny_model("llama"), "nope")


@pytest.mark.parametrize("family", exhaustive([f for f in zoo.FAMILIES if f not in ("bert", "roberta", "distilbert",
                                                                                      "modernbert", "t5", "bart",
                                                                                      "marian")],
                                              always=("llama", "gpt2", "gemma2")))
def test_every_decoder_family_passes(family):
    """Stock transformers takes every serving path right on every decoder family of the zoo (those it refuses are
    named: MPT's assisted decoding)."""
    result = _serving(zoo.tiny_model(family))
    assert result.status is Status.PASS, result.summary
    assert ("not run" in result.summary) == (family in ("mpt", "falcon_alibi", "bloom")), result.summary
