"""More model types of the support sweep: errors and false FAILs on healthy default-init models, each fixed or
classified, next to a planted twin that still fails or a healthy sibling that passes.

- A forward that names no `position_ids` takes none (TrOCR, RoFormer, XLNet): `positions` SKIPs instead of FAILing.
- PEGASUS-X's encoder returns states padded to whole blocks and its last entry as (token, global-token) states.
- RoFormer rotates q/k by a sinusoidal table: RoPE, judged by `shift`, no table to probe.
- XLNet (attn_type="bi") and CPM-Ant (a prefix LM) are not causal by design; CPM-Ant reads no attention mask and is
  decoded as generate() feeds it (the whole sequence at every cached step).
- UltraVBert, a masked LM around a bidirectional text encoder, is an encoder.
- Switch Transformers' experts fill a capacity in storage order: no consistent permutation, no invisible prefix.
- ProphetNet asserts it caches one decoder token at a time: those cache paths are named, not judged.
- Upstream findings (transformers 5.24): TrOCR's generate() on a left-padded batch, YOSO's padding mask (a no-op),
  ProphetNet and CPM-Ant with a static cache.
"""

from __future__ import annotations

import pytest
import torch
from sweep_support import SHORT, pinned, run_named, sweep_model

from posdiag.api import run_checks
from posdiag.model.classes import auto_class
from posdiag.model.families import GENERIC, for_model
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing.multimodal import small_config

_model, _run = sweep_model, run_named


# ------------------------------------------------------------------ what the forward declares
def test_a_forward_without_position_ids_takes_none():
    class Declares(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None, position_ids=None):
            return input_ids

    class Swallows(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None, **kwargs):
            return input_ids

    assert for_model(GENERIC, Declares()).position_ids == "honoured"
    assert for_model(GENERIC, Swallows()).position_ids == "ignored"


def test_trocr_positions_skip_and_its_left_padded_generate_is_an_upstream_finding():
    found = _run(_model("trocr"), ["positions", "batch", "generate"])
    assert found["positions"].status is Status.NA and "takes no position_ids" in found["positions"].summary
    assert found["batch"].status is Status.PASS, found["batch"].summary  # right padding (left: not the same input)
    generate = found["generate"]
    if pinned(generate, "trocr", "generate"):
        assert "float64" in generate.summary  # decided there: not rounding
        single = generate.details["runs"]["dynamic/single"]
        assert single["status"] is Status.PASS, single


def test_gpt2_left_padded_generate_passes_where_trocr_fails():
    generate = _run(_model("gpt2"), ["generate"])["generate"]
    assert generate.status is Status.PASS, generate.summary


# ------------------------------------------------------------------ hidden states and kinds
def test_pegasus_x_block_padded_hidden_states_are_read_as_token_states():
    found = _run(_model("pegasus_x"), ["shuffle", "batch"])
    for name, result in found.items():
        assert result.status is Status.PASS, (name, result.summary)


def test_roformer_is_rope_from_a_sinusoidal_table():
    model = _model("roformer")
    assert from_module(model).position_kind == "rope"
    found = _run(model, ["positions", "shift", "table", "batch"])
    assert found["positions"].status is Status.NA and "takes no position_ids" in found["positions"].summary
    assert found["shift"].status is Status.PASS, found["shift"].summary
    assert found["table"].status is Status.NA, found["table"].summary
    assert found["batch"].status is Status.PASS and "a left-padded" in found["batch"].summary


def test_roformer_with_its_rotation_removed_fails_shuffle():
    model = _model("roformer")
    with torch.no_grad():
        model.encoder.embed_positions.weight.zero_()  # sin 0 (and cos 0): no position reaches q or k
    found = _run(model, ["shuffle"])
    assert found["shuffle"].status is Status.FAIL, found["shuffle"].summary


@pytest.mark.parametrize("model_type", ["xlnet", "cpmant"])
def test_bidirectional_decoders_are_not_causal_by_design(model_type):
    causal = _run(_model(model_type), ["causal"])["causal"]
    assert causal.status is Status.NA and causal.summary.startswith("not causal by design"), causal.summary


def test_ultravbert_is_an_encoder():
    model = _model("ultravbert")
    assert from_module(model).kind == "encoder"
    found = _run(model, ["causal", "shuffle"])
    assert found["causal"].status is Status.NA and "bidirectional encoder" in found["causal"].summary
    assert found["shuffle"].status is Status.PASS, found["shuffle"].summary


def test_switch_transformers_capacity_routing_is_storage_order_mixing():
    subject = from_module(_model("switch_transformers"))
    assert "expert_capacity" in subject.family.token_mixing
    shift = run_checks(subject, ["shift"], SHORT).checks[0]
    assert shift.status is Status.SKIP and "invisible prefix" in shift.summary, shift.summary


# ------------------------------------------------------------------ caches
def test_prophetnet_refused_cache_paths_are_named_and_static_cache_is_an_upstream_finding():
    found = _run(_model("prophetnet", max_position_embeddings=32), ["cache", "generate", "shift", "table"])
    cache = found["cache"]
    paths = cache.details["paths"]
    assert paths["dynamic/decode"]["status"] is Status.PASS, paths["dynamic/decode"]
    assert "only supported for `decoder_input_ids` of length 1" in paths["dynamic/chunks"]["refused"]
    assert paths["dynamic/chunks"]["status"] is Status.SKIP
    pinned(cache, "prophetnet", "cache")
    generate = found["generate"]
    pinned(generate, "prophetnet", "generate")
    assert generate.details["runs"]["dynamic/batch"]["status"] is Status.PASS
    for name in ("shift", "table"):
        assert found[name].status not in (Status.ERROR, Status.FAIL), (name, found[name].summary)


def test_cpmant_is_decoded_as_generate_feeds_it_and_static_cache_is_an_upstream_finding():
    found = _run(_model("cpmant"), ["cache", "generate", "batch"])
    paths = found["cache"].details["paths"]
    for name in ("dynamic/decode", "dynamic/chunks", "dynamic/chunked_prefill"):
        assert paths[name]["status"] is Status.PASS, (name, paths[name])
    pinned(found["cache"], "cpmant", "cache")
    generate = found["generate"]
    pinned(generate, "cpmant", "generate")
    assert generate.details["runs"]["dynamic/single"]["status"] is Status.PASS
    batch = found["batch"]
    assert batch.status is Status.NA and "dummy parameter" in batch.summary, batch.summary  # it reads no mask


def test_bart_static_cache_passes_where_prophetnet_and_cpmant_crash():
    found = _run(_model("bart"), ["cache", "generate"])
    for name, result in found.items():
        assert result.status is Status.PASS, (name, result.summary)


# ------------------------------------------------------------------ YOSO's padding mask
def _additive_yoso_mask(model):
    """YosoSelfAttention reads its mask as additive (0 / -10000: `int(1 + mask / 10000)` weights each key), while
    YosoModel hands it the raw 0/1 mask, which weights every key 1. Convert it where the attention reads it."""
    def hook(module, args, kwargs):
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        if mask is not None and mask.ndim == 2:
            kwargs["attention_mask"] = (mask - 1.0) * 10000.0
            args = args[:1]
        return args, kwargs

    for module in model.modules():
        if type(module).__name__ == "YosoSelfAttention":
            module.register_forward_pre_hook(hook, with_kwargs=True)
    return model


def test_yoso_padding_mask_is_a_no_op_upstream_finding_and_fixed_mask_passes():
    batch = _run(_model("yoso"), ["batch"])["batch"]
    if pinned(batch, "yoso", "batch"):
        assert "float64" in batch.summary
    fixed = _run(_additive_yoso_mask(_model("yoso")), ["batch"])["batch"]
    assert fixed.status is Status.PASS, fixed.summary


@pytest.mark.parametrize("causal", [False, True])
def test_xlm_kind_follows_its_causal_flag(causal):
    """XLMWithLMHeadModel is in the causal-LM mapping, but XLM's default (causal=False, the MLM/TLM checkpoints)
    attends bidirectionally: judged as an encoder (`causal` FAILed 'query 0 sees key 1' when read as a decoder);
    with causal=True it is a decoder and `causal` judges it (and passes)."""
    from posdiag.model.families import family_for

    config = small_config("xlm", causal=causal)
    assert family_for(config).kind == ("causal" if causal else "encoder")
    torch.manual_seed(0)
    model = auto_class(config, family_for(config)).from_config(config).eval()
    result = run_checks(from_module(model), ["causal"], RunOptions(seq_len=12)).check("causal")
    assert result.status is (Status.PASS if causal else Status.NA), result.summary


@pytest.mark.parametrize("planted", [False, True])
def test_rope_probes_contiguously_a_model_that_takes_no_position_ids(planted):
    """MossTranscribeDiarize's wrapper drops position_ids (its text model numbers tokens by arange), so the rope probe
    is one contiguous forward read back at its positions: the healthy model PASSes (it FAILed at 1.2e6x when probed at
    sparse ids it never saw), and a rotary whose frequencies are zeroed (no rotation) FAILs."""
    config = small_config("moss_transcribe_diarize")
    from posdiag.model.families import family_for

    torch.manual_seed(0)
    model = auto_class(config, family_for(config)).from_config(config, attn_implementation="eager").eval()
    if planted:
        for module in model.modules():
            if hasattr(module, "inv_freq") and "Rotary" in type(module).__name__:
                module.inv_freq.zero_()
                module.original_inv_freq = module.inv_freq.clone()
    result = run_checks(from_module(model), ["rope"], RunOptions(seq_len=12)).check("rope")
    assert result.status is (Status.FAIL if planted else Status.PASS), result.summary
