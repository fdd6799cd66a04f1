"""`state`: the same input gives the same output whatever ran before it. Planted state bugs, each on three families
with its healthy twin (tests/plants_state.py), the zoo, and the run's fresh state for every check."""

from __future__ import annotations

import plants_state as plants
import pytest
import torch
from sweep_rows import exhaustive

from posdiag import api
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing import zoo

pytestmark = pytest.mark.filterwarnings("ignore")


def _state(model: torch.nn.Module, *sequences: str):
    """The state check on `model`, its sequences limited to those named (all when none are: a bug's twin runs the
    sequences its bug fails, which keeps each float64 re-run to what must be decided)."""
    options = RunOptions(check_options={"state": {"sequences": list(sequences)}} if sequences else {})
    return api.run_checks(from_module(model), ["state"], options).check("state")


def _failing(result) -> set[str]:
    table = result.tables[0]
    return {row[0] for row in table.rows if row[1] == "fail"}


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt_neox"])
def test_sticky_dynamic_ntk_fails_after_a_long_input(family):
    bad = _state(plants.dynamic_model(family, sticky=True), "long input", "batch after batch")
    assert bad.status is Status.FAIL, bad.summary
    assert _failing(bad) == {"long input"}
    assert bad.summary.startswith("long input: after a 140-token input, the same 64 tokens")
    assert "rotary_emb.inv_freq changed (buffer)" in bad.summary
    assert "does not shrink with precision" in bad.summary  # decided in float64, a bug
    # stock dynamic NTK resets on a short input
    good = _state(plants.dynamic_model(family, sticky=False), "long input", "batch after batch")
    assert good.status is Status.PASS, good.summary
    assert "dynamic-NTK threshold 128" in good.summary


@pytest.mark.parametrize("family", ["llama", "gpt2", "mistral"])
def test_kept_rope_deltas_fail_on_another_prompt(family):
    bad = _state(plants.kept_offset(zoo.tiny_model(family), reset=False), "another prompt", "batch after batch")
    assert bad.status is Status.FAIL, bad.summary
    assert "another prompt" in _failing(bad)
    assert "state kept from the earlier calls: rope_deltas None -> " in bad.summary
    good = _state(plants.kept_offset(zoo.tiny_model(family), reset=True), "another prompt", "batch after batch")
    assert good.status is Status.PASS, good.summary


AFTER_PADDING = ("batch after batch", "one request after a padded batch", "one request after a padded batch with "
                 "position_ids", "unpadded batch after a padded batch", "unpadded batch after a padded batch with "
                 "position_ids")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_an_offset_kept_from_a_padded_batch_fails_the_unpadded_request_after_it(family, dtype):
    """`model(**tokenizer(batch, padding=True))`, then one prompt or an unpadded batch of the same size: a model that
    works out its per-row offset only at a padded prefill (tests/plants_serving.py) decodes them at the padded
    batch's offsets. A padded batch after a padded batch works it out again and reads OK; position_ids passed are
    never offset."""
    import plants_serving

    bad = _state(plants_serving.rope_deltas(zoo.tiny_model(family, dtype=dtype), reset="padded"), *AFTER_PADDING)
    assert bad.status is Status.FAIL, bad.summary
    assert _failing(bad) == {"one request after a padded batch", "unpadded batch after a padded batch"}, bad.summary
    assert bad.summary.startswith("one request after a padded batch: after a plain forward of a left-padded batch of "
                                  "lengths [59, 64, 32], one 64-token prompt decoded 4 tokens in a hand-written loop "
                                  "(cache passed, no position_ids)"), bad.summary
    assert "does not shrink with precision" in bad.summary and "rope_deltas None -> tensor(3,)" in bad.summary
    good = _state(plants_serving.rope_deltas(zoo.tiny_model(family, dtype=dtype), reset="prompt"), *AFTER_PADDING)
    assert good.status is Status.PASS, good.summary


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_crop_that_keeps_a_rejected_draft_fails_assisted_decoding(family):
    """The draft disagrees at every odd position, so assisted decoding rolls its cache back: a crop that keeps one
    rejected draft changes its output from greedy's (with the model as its own assistant nothing was cropped)."""
    import plants_serving

    bad = _state(plants_serving.stale_crop(zoo.tiny_model(family), stale=1), "assisted decoding", "another prompt")
    assert bad.status is Status.FAIL and _failing(bad) == {"assisted decoding"}, bad.summary
    good = _state(plants_serving.stale_crop(zoo.tiny_model(family), stale=0), "assisted decoding", "another prompt")
    assert good.status is Status.PASS, good.summary


BY_ONE = ("multi-turn", "assisted decoding")


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_position_advanced_by_one_fails_assisted_decoding(family):
    bad = _state(plants.counted_positions(zoo.tiny_model(family), by_tokens=False), *BY_ONE)
    assert bad.status is Status.FAIL, bad.summary
    failing = _failing(bad)
    assert failing == {"assisted decoding", "multi-turn"}  # calls that feed several tokens to a kept cache
    assert "next_position" in bad.summary
    good = _state(plants.counted_positions(zoo.tiny_model(family), by_tokens=True), *BY_ONE)
    assert good.status is Status.PASS, good.summary


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])
def test_padding_of_one_batch_leaking_into_the_next_fails(family):
    bad = _state(plants.kept_mask(zoo.tiny_model(family), reuse=True), "batch after batch", "long input")
    assert bad.status is Status.FAIL, bad.summary
    assert _failing(bad) == {"batch after batch"}
    assert "kept_mask None -> tensor(3, 64)" in bad.summary
    good = _state(plants.kept_mask(zoo.tiny_model(family), reuse=False), "batch after batch", "long input")
    assert good.status is Status.PASS, good.summary


@pytest.mark.parametrize("family", exhaustive(zoo.FAMILIES, always=("llama", "gpt2", "mistral", "bert")))
def test_every_zoo_family_passes_or_is_not_applicable(family):
    result = _state(zoo.tiny_model(family))
    if zoo.model_kind(family) == "encoder":
        assert result.status is Status.NA and "encoder" in result.summary
    else:
        assert result.status is Status.PASS, result.summary


def test_the_model_is_left_as_loaded_and_every_check_starts_fresh():
    """`batch` runs padded batches first: the kept-mask model keeps one of them. The run puts every module back before
    `state` (which then judges from the state as loaded, as when it runs alone) and after the last check."""
    once = RunOptions(check_options={"state": {"sequences": ["batch after batch"]}})
    alone = api.run_checks(from_module(plants.kept_mask(zoo.tiny_model("llama"), reuse=True)), ["state"], once)
    model = plants.kept_mask(zoo.tiny_model("llama"), reuse=True)
    after_batch = api.run_checks(from_module(model), ["batch", "state"], once)
    assert alone.check("state").status is after_batch.check("state").status is Status.FAIL
    assert alone.check("state").metrics["error"] == after_batch.check("state").metrics["error"]
    assert model.kept_mask is None  # the model as loaded, after the run
    model.kept_mask = torch.ones(1, 4)  # what the caller's model held before a run is what it holds after
    api.run_checks(from_module(model), ["causal"])
    assert torch.equal(model.kept_mask, torch.ones(1, 4))


def test_seq2seq_runs_the_paths_it_has_and_names_the_others():
    result = _state(zoo.tiny_model("bart"))
    assert result.status is Status.PASS, result.summary
    assert {row[0] for row in result.tables[0].rows} == {"long input", "batch after batch", "another prompt"}
    assert set(result.details["not_run"]) == {"multi-turn", "assisted decoding", "prompt lookup", *AFTER_PADDING[1:]}
    assert result.details["not_run"]["one request after a padded batch"] == ("an encoder-decoder: its decoder's cache "
                                                                             "is `cache`'s")


def test_a_model_without_a_cache_has_no_conversation_to_continue():
    """GPT-1 keeps no cache: generate() refuses one passed back to it, so the multi-turn sequence cannot run (it was
    a false FAIL "the call crashed" before)."""
    from posdiag.testing.multimodal import small_model

    result = _state(small_model("openai-gpt"))
    assert result.status is Status.PASS, result.summary
    assert result.details["not_run"]["multi-turn"] == ("generate() returns no cache to continue from "
                                                       "(OpenAIGPTLMHeadModel keeps none)")


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
def test_tokens_that_see_only_themselves_fail_shuffle_and_positions(family):
    """Attention that returns each token's own value ignores the explicit mask too: the mask-fidelity SKIP hid a
    model no position can enter. Through the model's own mask, changing a token moves no other: a FAIL."""
    report = api.run_checks(from_module(plants.self_only(zoo.tiny_model(family))), ["shuffle", "positions"])
    shuffle, positions = report.checks
    assert shuffle.status is Status.FAIL and shuffle.summary.startswith("tokens never interact: position cannot "
                                                                        "enter (changing token 0 moves no other")
    assert "the model's code lets each token see only itself" in shuffle.summary
    assert positions.status is Status.FAIL
    assert positions.summary.startswith("position_ids change nothing: tokens never interact")
    healthy = api.run_checks(from_module(zoo.tiny_model(family)), ["shuffle", "positions"])
    assert [c.status for c in healthy.checks] == [Status.PASS, Status.PASS]


def test_zero_branches_are_no_verdict_as_built_and_a_finding_when_the_checkpoint_stores_them(tmp_path):
    """The same zeroed output projections: a model built so (zero-initialised, nothing loaded) SKIPs; a checkpoint
    that stores the zeros FAILs, naming them."""
    from posdiag.model.loading import load_subject
    from posdiag.options import LoadOptions

    model = zoo.tiny_model("llama")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()
    built = api.run_checks(from_module(model), ["shuffle"]).check("shuffle")
    assert built.status is Status.SKIP and "as initialised: not loaded from a checkpoint" in built.summary
    model.save_pretrained(tmp_path)
    stored = api.run_checks(load_subject(str(tmp_path), LoadOptions()), ["shuffle"]).check("shuffle")
    assert stored.status is Status.FAIL, stored.summary
    assert "the checkpoint stores model.layers.0.self_attn.o_proj.weight" in stored.summary


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma2"])
def test_sliding_cache_returning_more_keys_than_the_mask_fails_assisted_decoding(family, monkeypatch):
    """A sliding-window cache that, recording the past for assisted decoding, returns every key it holds while the
    mask is sized for the window (#48280): the verification step crashes; greedy generate() never records the past."""
    from transformers import cache_utils

    healthy = cache_utils.DynamicSlidingWindowLayer.update
    good = _state(zoo.tiny_model(family), "assisted decoding", "another prompt")
    monkeypatch.setattr(cache_utils.DynamicSlidingWindowLayer, "update", plants.unbounded_sliding_update(healthy))
    bad = _state(zoo.tiny_model(family), "assisted decoding", "another prompt")
    assert bad.status is Status.FAIL and _failing(bad) == {"assisted decoding"}, bad.summary
    assert "the call crashed (RuntimeError: The size of tensor a" in bad.summary
    assert "though it runs greedily" in bad.summary
    assert good.status is Status.PASS, good.summary


def test_a_float64_re_run_with_a_sliced_head_survives_the_model_put_back_between_calls(monkeypatch):
    """As stored in bfloat16 with float64 deciding (the fallback where the weights cannot be held in float32), a large
    linear layer runs through posdiag's own sliced float64 forward; `state` puts the model back between its calls,
    which deleted that forward mid-re-run and then crashed its removal (ERROR on the real SmolLM2, whose tied head is
    226 MB in float64). A slice limit of 1 KB makes every tiny linear layer take that path."""
    from posdiag.model import conversion, precision

    monkeypatch.setattr(precision, "float32_copy_refused", lambda subject: "no memory for it here")
    monkeypatch.setattr(conversion, "SLICE_BYTES", 1024)
    result = api.run_checks(from_module(zoo.tiny_model("llama", dtype=torch.bfloat16)), ["state"],
                            RunOptions(seq_len=16)).check("state")
    assert result.status is Status.PASS, result.summary
    assert result.details["dtypes"] == {"as_stored": "bfloat16"}
