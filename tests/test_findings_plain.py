"""The sweep's upstream findings (benchmarks/sweep.py FINDINGS) reproduced in plain transformers: two computations
that must agree, both in float64, no posdiag check involved, next to a healthy twin where one is meaningful (the same
model on the path that works, or with the one faulty piece held right).

Models are the sweep's tiny ones (posdiag.testing.multimodal.small_model: transformers' default init, eager attention
where the class takes it), each built once and converted to float64. A bug differs by more than BUG (relative), and
by more than TWIN_MARGIN times what the healthy twin differs: float64 rounding is ~1e-15, but some kernels keep a
float32 step inside a float64 model (Mamba's and Bamba's scans: their twins agree to ~4e-8), and every bug below is
1e-5 or more. Crashes are shown as the exception the finding's fingerprint names (the same entry the sweep classifies
its verdicts with), next to the path that runs.

Each reproduction asks the table whether its finding holds on the installed transformers: where upstream has fixed it
(the entry's `fixed_in`), the two computations must agree and the crashing call must run.
"""

from __future__ import annotations

import builtins
import contextlib
import copy
import re
import warnings

import pytest
import torch
import transformers
from sweep_support import WRONG, sweep_module

from posdiag.testing import zoo
from posdiag.testing.multimodal import small_model

BUG, TWIN_MARGIN = 1e-6, 1e3


@pytest.fixture(autouse=True)
def _quiet():
    warnings.filterwarnings("ignore")
    transformers.utils.logging.set_verbosity_error()


def finding(model_type: str, check: str):
    """The FINDINGS entry that holds on the installed transformers (None where upstream fixed it)."""
    return sweep_module().finding(model_type, check)


_BUILT: dict[str, torch.nn.Module] = {}


def small(key: str, **overrides) -> torch.nn.Module:
    """The model a findings key names: posdiag.testing.zoo's tiny model for "zoo:<family>", else the sweep's tiny model
    of the type before any ":<variant>" (the variant's config given as `overrides`)."""
    kind, _, family = key.partition(":")
    return zoo.tiny_model(family, **overrides) if kind == "zoo" else small_model(kind, **overrides)


def model64(key: str, **overrides) -> torch.nn.Module:
    """The model of findings key `key` (`small`) in float64 (MoE experts through the eager loop: grouped_mm has no
    float64 kernel), built once per session. Tests that change a model change a copy."""
    built = f"{key} {sorted(overrides.items())}"
    if built not in _BUILT:
        warnings.filterwarnings("ignore")
        _BUILT[built] = _float64(small(key, **overrides))
    return _BUILT[built]


def _float64(model: torch.nn.Module) -> torch.nn.Module:
    model = model.to(torch.float64).eval()
    if callable(getattr(model, "set_experts_implementation", None)):
        with contextlib.suppress(Exception):  # a class with one implementation only
            model.set_experts_implementation("eager")
    return model


def ids_of(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """Ordinary token ids: above the ids tokenizers reserve, below the special ids the small configs move to the top
    of the 256-row vocabulary."""
    return torch.randint(4, 200, (batch, length), generator=torch.Generator().manual_seed(seed))


def pad_of(model) -> int:
    """The model's padding id (its embedding row is what padding reads), else an ordinary one."""
    pad = getattr(model.config.get_text_config(), "pad_token_id", None)
    return pad if isinstance(pad, int) and 0 <= pad < model.get_input_embeddings().weight.shape[0] else 1


def output(out) -> torch.Tensor:
    return out.logits if "logits" in out else out.last_hidden_state


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def assert_as_found(key: str, check: str, bug: float, twin: float) -> None:
    """Where the finding holds, the buggy computation differs (more than BUG, and TWIN_MARGIN times its twin); where
    upstream fixed it, it does not."""
    differs = bug > BUG and bug > TWIN_MARGIN * twin
    assert differs == (finding(key, check) is not None), f"the bug differs {bug:.3g}, the healthy twin {twin:.3g}"


def cache_of(out):
    return out.cache if "cache" in out else out.past_key_values


# ------------------------------------------------------------------ cached continuations against the full forward
def _continue(model, ids, prefill: int, chunk: int, cache=None, position_ids: bool = True, **extra):
    """Logits of ids[prefill:] fed `chunk` tokens at a time after a prefill, through a cache (the DynamicCache(config)
    generate() builds, by default: RecurrentGemma returns none of its own)."""
    cache = transformers.DynamicCache(config=model.config) if cache is None else cache
    model(ids[:, :prefill], cache=cache, use_cache=True, **extra)
    logits = []
    for start in range(prefill, ids.shape[1], chunk):
        step = ids[:, start:start + chunk]
        kwargs = {"position_ids": torch.arange(start, start + step.shape[1])[None]} if position_ids else {}
        logits.append(model(step, cache=cache, use_cache=True, **kwargs, **extra).logits)
    return torch.cat(logits, dim=1)




# ------------------------------------------------------------------ generate() after generate(): state's sequences
def _greedy(model, ids: torch.Tensor, **extra):
    """Greedy generate() of 6 tokens: (its output, the logits of every step)."""
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, num_beams=1,
                         output_logits=True, return_dict_in_generate=True, eos_token_id=None,
                         pad_token_id=pad_of(model), **extra)
    return out, torch.stack(out.logits, 1)


def _multi_turn(model) -> float:
    """A conversation: generate() on a prompt, a user turn appended to what it returned, generate() continued from
    the cache it returned, against generate() on the whole conversation from scratch."""
    first, _ = _greedy(model, ids_of(1, 12))
    conversation = torch.cat([first.sequences, ids_of(1, 8, seed=1)], 1)
    return rel(_greedy(model, conversation, cache=cache_of(first))[1], _greedy(model, conversation)[1])


def _prompt_lookup(model) -> float:
    """Prompt-lookup decoding (3 candidates a step) on a prompt whose n-grams recur, against greedy generate()."""
    ids = ids_of(1, 12)
    prompt = torch.cat([ids, ids[:, :6]], 1)
    return rel(_greedy(model, prompt, prompt_lookup_num_tokens=3)[1], _greedy(model, prompt)[1])


# model type -> the path that differs. Mamba, FalconMamba, Jamba: the continuation feeds the reply's last token and the
# user's turn in one step, scanned from a zero SSM state (as `cache`'s chunks), and prompt lookup's verification is
# such a step too; Zamba2: candidates the lookup rejects are not taken back out of the Mamba state. The twin: the same
# path on Llama, whose cache continues and crops right (prompt lookup: 0.0 in float64; the multi-turn path: 8.4e-8,
# not float64 rounding, which is why Jamba, 5.6e-5 on it, is shown by its lookup path: 3.1e-4 against 0.0).
# The hybrids beside Zamba2 keep an SSM or linear-attention state next to their attention cache, and the lookup's
# rejected candidates stay in it as well; CPM-Ant and RecurrentGemma (whose recurrent state lives on its modules)
# differ on the conversation continued from the returned cache.
KEPT_REJECTED = ("bailing_hybrid", "glm5_next", "granitemoehybrid", "kimi_linear", "lara_mini", "mamba2", "olmo_hybrid",
                 "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next")
STATE_PATHS = {"mamba": _multi_turn, "falcon_mamba": _multi_turn, "jamba": _prompt_lookup, "zamba2": _prompt_lookup,
               "cpmant": _multi_turn, "recurrent_gemma": _multi_turn, **dict.fromkeys(KEPT_REJECTED, _prompt_lookup)}
LOOKUP_EXACT = 1e-9
"""Prompt lookup on Llama equals greedy exactly in float64 (0.0), so a difference of 1e-9 (1e7x float64's rounding
of these logits) is no rounding: GraniteMoeHybrid's is 2e-7 here, Lara-mini's 2e-5."""


@pytest.mark.parametrize("model_type", sorted(STATE_PATHS))
def test_generate_continued_or_drafted_differs_from_plain_generate(model_type):
    found = finding(model_type, "state")
    assert found is None or found.test.endswith(test_generate_continued_or_drafted_differs_from_plain_generate
                                                .__name__)
    path = STATE_PATHS[model_type]
    bug, twin = path(model64(model_type)), path(model64("llama"))
    if path is _prompt_lookup:
        assert twin == 0.0 and (bug > LOOKUP_EXACT) == (found is not None), \
            f"the bug differs {bug:.3g}, the healthy twin {twin:.3g}"
    else:
        assert_as_found(model_type, "state", bug, twin)


@pytest.mark.parametrize("model_type", ["zamba", "zaya"])
def test_prompt_lookup_crashes(model_type):
    """Zamba and ZAYA: prompt-lookup decoding raises; greedy generate() on the same prompt runs."""
    model = model64(model_type)
    _raises_as_found(model_type, "state", lambda: _prompt_lookup(model))
    ids = ids_of(1, 12)
    _greedy(model, torch.cat([ids, ids[:, :6]], 1))


# model type -> (overrides, the buggy continuation, the healthy twin): each a function of (model, ids) giving the
# logits to compare with the full forward's ids[:, 6:].
RECURRENT_CHUNK = (lambda m, ids: _continue(m, ids, 6, 3, position_ids=False),
                   lambda m, ids: _continue(m, ids, 6, 1, position_ids=False))
CONTINUATIONS = {
    # Mamba, FalconMamba, Jamba: a multi-token chunk after a prefill is scanned from a zero SSM state (the cached
    # state is read only for single-token steps); one token at a time agrees.
    "mamba": ({}, *RECURRENT_CHUNK),
    "falcon_mamba": ({}, *RECURRENT_CHUNK),
    "jamba": ({}, lambda m, ids: _continue(m, ids, 6, 3), lambda m, ids: _continue(m, ids, 6, 1)),
    # RecurrentGemma: a chunk restarts the temporal convolution's state; one token at a time agrees.
    "recurrent_gemma": ({}, lambda m, ids: _continue(m, ids, 6, 3), lambda m, ids: _continue(m, ids, 6, 1)),
    # Bamba: a cached step without position_ids is numbered arange(new tokens) from 0; with explicit ids it agrees.
    "bamba": ({}, lambda m, ids: _continue(m, ids, 6, 1, position_ids=False), lambda m, ids: _continue(m, ids, 6, 1)),
    # GPT-Neo (the zoo's: a local window of 8): its causal buffer is sliced by the key length, which is max_cache_len
    # with a StaticCache, so a local layer whose window is shorter than the cache reads the wrong window's rows; the
    # DynamicCache agrees. (The sweep's window spans the whole context: there a cache longer than the buffer crashes,
    # below.)
    "zoo:gpt_neo": ({}, lambda m, ids: _continue(m, ids, 6, 1, cache=_static(m, 16)),
                    lambda m, ids: _continue(m, ids, 6, 1)),
    # Inkling (v1), full-attention layers only: with a StaticCache the relative bias reads the query offset after
    # cache.update grew it (one step too far); the DynamicCache agrees.
    "inkling_text": (dict(layer_types=["hybrid", "hybrid"], swa_num_attention_heads=4, swa_num_key_value_heads=2,
                          swa_head_dim=16),
                     lambda m, ids: _continue(m, ids, 6, 1, cache=_static(m, 16)),
                     lambda m, ids: _continue(m, ids, 6, 1)),
}


@pytest.mark.parametrize("model_type", sorted(CONTINUATIONS))
def test_cached_continuation_differs_from_the_full_forward(model_type):
    overrides, buggy, healthy = CONTINUATIONS[model_type]
    model = model64(model_type, **overrides)
    ids = ids_of(1, 12)
    with torch.no_grad():
        full = model(ids).logits[:, 6:]
        bug, twin = rel(buggy(model, ids), full), rel(healthy(model, ids), full)
    assert_as_found(model_type, "cache", bug, twin)


def test_recurrent_gemma_cached_step_without_ids_restarts_at_0():
    """transformers 5.25 moved RecurrentGemma's state into Cache layers: a cached forward without position_ids
    numbers its tokens from cache.get_seq_length(), which reads layer 0, a recurrent layer holding no sequence length,
    so the step is numbered 0 and the recurrence restarts there; with explicit ids it agrees. Up to 5.24 the state
    lived on the modules and both agree (the finding's `since`)."""
    model = model64("recurrent_gemma")
    ids = ids_of(1, 12)
    with torch.no_grad():
        full = model(ids).logits[:, 6:]
        bug = rel(_continue(model, ids, 6, 1, position_ids=False), full)
        twin = rel(_continue(model, ids, 6, 1), full)
    found = finding("recurrent_gemma", "cache")
    if found is not None and found.path == "dynamic/decode":
        assert bug > BUG and bug > TWIN_MARGIN * twin, (bug, twin)
    else:
        assert bug < 1e-9 and twin < 1e-9, (bug, twin)


# ------------------------------------------------------------------ serving's paths on a selective-scan cache
def _masked_steps(model, ids: torch.Tensor, prefill: int) -> tuple[torch.Tensor, list[int]]:
    """ids[prefill:] fed one token a forward after a prefill, each forward given the 2D mask of every token so far (as
    attention models take it, and as a hand-written loop or a padded batch's decode passes it): (the last logits of
    each step, how many positions each step returned)."""
    cache = transformers.DynamicCache(config=model.config)
    model(ids[:, :prefill], cache=cache, use_cache=True, attention_mask=torch.ones_like(ids[:, :prefill]))
    steps = [model(ids[:, t:t + 1], cache=cache, use_cache=True, attention_mask=torch.ones_like(ids[:, :t + 1])).logits
             for t in range(prefill, ids.shape[1])]
    return torch.cat([s[:, -1:] for s in steps], 1), [s.shape[1] for s in steps]


@pytest.mark.parametrize("model_type", ["mamba", "falcon_mamba"])
def test_cached_step_given_every_token_s_mask_broadcasts_it(model_type):
    """Mamba and FalconMamba on serving's paths, two causes. A multi-token continuation (chunks, chunked prefill, a
    shared prefix's suffix, prompt lookup's verification) is scanned from a zero SSM state, as `cache`'s chunks. And a
    one-token cached step given the 2D mask of every token so far multiplies the token's [B, 1, D] states by the
    [B, T, 1] mask: T copies of the token are scanned as a new sequence and the step returns T positions
    (generate() drops the mask after its prefill; a hand-written loop and a padded batch's decode pass it). The twin:
    the same one-token steps without the mask."""
    model = model64(model_type)
    ids = ids_of(1, 12)
    with torch.no_grad():
        full = model(ids).logits[:, 6:]
        chunks = rel(_continue(model, ids, 6, 3, position_ids=False), full)
        twin = rel(_continue(model, ids, 6, 1, position_ids=False), full)
        masked, widths = _masked_steps(model, ids, 6)
    assert_as_found(model_type, "serving", chunks, twin)
    assert_as_found(model_type, "serving", rel(masked, full), twin)
    assert (widths == list(range(7, 13))) == (finding(model_type, "serving") is not None), widths


def test_cpmant_forward_continuing_a_cache_returns_too_few_positions():
    """CPM-Ant prepends its prompt tokens to every input and slices the output by the cache's length, as if each
    forward were fed the whole sequence: 3 tokens continuing a 3-token cache return no position (serving's chunks and
    a shared prefix's suffixes; more new tokens than that mis-size the position bias, and its decode loops crash).
    The twin: the same 3 tokens without a cache return 3."""
    model = model64("cpmant")
    ids = ids_of(1, 6)
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :3], past_key_values=cache, use_cache=True)
        continued = model(ids[:, 3:], past_key_values=cache, use_cache=True).logits
        alone = model(ids[:, 3:], use_cache=False).logits
    assert alone.shape[1] == 3
    assert (continued.shape[1] < 3) == (finding("cpmant", "serving") is not None), continued.shape


# serving's FAILs whose first failing path is the computation another check's finding reproduces: (type, that check).
# Jamba's chunks restart its SSM state as `cache`'s do, Bamba's and RecurrentGemma's are numbered from 0; the hybrids'
# prompt lookup keeps the rejected candidates in the recurrent state (Zamba's and ZAYA's crashes) as `state`'s does
# (the same generate() call); GIT's, TrOCR's and the Kosmos models' left-padded batches decode as `generate`'s do,
# DeepSeek-V4's compressor pools the padding as in `batch`.
SERVING_AS = (("jamba", "cache"), ("bamba", "cache"), ("recurrent_gemma", "cache"), ("git", "generate"),
              ("trocr", "generate"), ("kosmos-2", "generate"), ("kosmos-2.5", "generate"), ("deepseek_v4", "batch"),
              ("zamba", "state"), ("zaya", "state"), ("bailing_hybrid", "state"), ("glm5_next", "state"),
              ("granitemoehybrid", "state"), ("kimi_linear", "state"), ("lara_mini", "state"), ("mamba2", "state"),
              ("olmo_hybrid", "state"), ("qwen3_5", "state"), ("qwen3_5_moe", "state"), ("qwen3_5_moe_text", "state"),
              ("qwen3_5_text", "state"), ("qwen3_next", "state"))


@pytest.mark.parametrize("model_type, check", SERVING_AS)
def test_serving_fails_where_another_check_s_reproduction_shows(model_type, check):
    serving, other = finding(model_type, "serving"), finding(model_type, check)
    assert (serving is None) == (other is None)
    assert serving is None or serving.test == other.test


# ------------------------------------------------------------------ a padded row against the same row alone
def _padded(model, left: bool, position_ids: bool = False) -> float:
    """A 10-token row padded by 4 (left or right, masked) against the row alone: relative logit difference over the
    valid tokens; with `position_ids`, both numbered from the mask (attention_mask.cumsum(-1) - 1)."""
    ids = ids_of(1, 10)
    pads, zeros = torch.full((1, 4), pad_of(model)), torch.zeros(1, 4, dtype=torch.long)
    padded = torch.cat([pads, ids] if left else [ids, pads], dim=1)
    mask = torch.cat([zeros, torch.ones_like(ids)] if left else [torch.ones_like(ids), zeros], dim=1)

    def numbered(m):
        return {"position_ids": (m.cumsum(-1) - 1).clamp(min=0)} if position_ids else {}

    with torch.no_grad():
        out = output(model(padded, attention_mask=mask, **numbered(mask)))
        alone = output(model(ids, attention_mask=torch.ones_like(ids), **numbered(torch.ones_like(ids))))
    return rel(out[:, 4:] if left else out[:, :10], alone)


def _without_value_convolution(model):
    model = copy.deepcopy(model)
    for module in model.modules():
        if hasattr(module, "conv_kernel_size"):
            module.conv_kernel_size = None
    return model


def _additive_mask(model):
    """YOSO's attention with its mask made additive (0 / -10000), as YosoSelfAttention reads it."""
    model = copy.deepcopy(model)

    def additive(module, args, kwargs):
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        if mask is not None and mask.ndim == 2:
            kwargs["attention_mask"], args = (mask - 1.0) * 10000.0, args[:1]
        return args, kwargs

    for module in model.modules():
        if type(module).__name__ == "YosoSelfAttention":
            module.register_forward_pre_hook(additive, with_kwargs=True)
    return model


def _model(model_type, **overrides):
    return lambda: model64(model_type, **overrides)


NO_COMPRESSED_ENTRY = {"compressed_sparse_attention": 128, "heavily_compressed_attention": 128}
# model type -> (the bug: padding, the healthy twin: a model builder and its padding), each _padded's keywords.
PADDINGS = {
    # BioGPT: BioGptModel.forward fills missing position_ids with arange(T) before its position embedding, whose
    # mask-derived branch (cumsum of the mask) then never runs; ids from the mask are right.
    "biogpt": (dict(left=True), _model("biogpt"), dict(left=True, position_ids=True)),
    # RecurrentGemma: without ids a left-padded row runs its pads through the recurrence; ids from the mask reset it
    # at the first real token.
    "recurrent_gemma": (dict(left=True), _model("recurrent_gemma"), dict(left=True, position_ids=True)),
    # RWKV (by design: its recurrence has no mask): left pads run through the state; right pads come after every real
    # token of a causal recurrence, so they change none.
    "rwkv": (dict(left=True), _model("rwkv"), dict(left=False)),
    # Nystromformer: the depthwise value convolution runs over padded values; without it every row is exact.
    "nystromformer": (dict(left=False), lambda: _without_value_convolution(model64("nystromformer")),
                      dict(left=False)),
    # ConvBERT (by design: the published span convolution has no mask): kernel 9 reads the pads; kernel 1 cannot.
    "convbert": (dict(left=False), _model("convbert", conv_kernel_size=1), dict(left=False)),
    # YOSO: YosoModel hands its attention the 0/1 mask, which reads it as additive (every key weighted 1).
    "yoso": (dict(left=False), lambda: _additive_mask(model64("yoso")), dict(left=False)),
    # DeepSeek-V4: the compressor pools storage windows of compress_rate keys, padding included, whatever the mask;
    # with no compressed entry in reach (rate 128) the row is exact.
    "deepseek_v4": (dict(left=True, position_ids=True), _model("deepseek_v4", compress_rates=NO_COMPRESSED_ENTRY),
                    dict(left=True, position_ids=True)),
}


@pytest.mark.parametrize("model_type", sorted(PADDINGS))
def test_padded_row_differs_from_itself_alone(model_type):
    bug_padding, twin_model, twin_padding = PADDINGS[model_type]
    assert_as_found(model_type, "batch", _padded(model64(model_type), **bug_padding),
                    _padded(twin_model(), **twin_padding))


# ------------------------------------------------------------------ generate() on a left-padded batch
def _generated(model, ids, mask, pad, **kwargs):
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, num_beams=1,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=pad, **kwargs)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, dim=1)


def _generate_row_alone(model, row: int, **kwargs) -> float:
    """generate() on a batch of a 12-token row and an 8-token row left-padded by 4: relative logit difference of
    `row` against generate() on that row alone, over the steps up to the first differing token (later steps see
    different prefixes)."""
    ids, pad = ids_of(2, 12), pad_of(model)
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = pad, 0
    start = 4 if row == 1 else 0
    with torch.no_grad():
        tokens, logits = _generated(model, ids, mask, pad, **kwargs)
        alone_tokens, alone = _generated(model, ids[row:row + 1, start:], mask[row:row + 1, start:], pad, **kwargs)
    same = next((i for i in range(3) if tokens[row, i] != alone_tokens[0, i]), 2) + 1
    return rel(logits[row, :same], alone[0, :same])


def _text_model(model_type):
    """Kosmos-2's text model (its forward needs pixel values), under float64 as torch's default dtype: its mask
    floor is built in the default dtype (finfo(float64).min overflows float32)."""
    return lambda: model64(model_type).text_model


LEFT_PADDED = {
    # Whisper's causal LM takes position_ids only through **kwargs, so generate() derives none; TrOCR drops the ones
    # it derives; GIT widens each cached step's mask by image patch tokens it does not hold; Kosmos-2's text model
    # counts the pads into its cached steps' positions; DeepSeek-V4 pools the padding into a compressed entry.
    "whisper": _model("whisper"), "trocr": _model("trocr"), "git": _model("git"), "kosmos-2": _text_model("kosmos-2"),
    "deepseek_v4": _model("deepseek_v4"),
}


@pytest.mark.parametrize("model_type", sorted(LEFT_PADDED))
def test_left_padded_generate_differs_from_each_row_alone(model_type):
    """The twin is the unpadded row of the same batch, which equals itself alone."""
    model = LEFT_PADDED[model_type]()
    with torch.device("cpu"):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            bug, twin = _generate_row_alone(model, 1), _generate_row_alone(model, 0)
        finally:
            torch.set_default_dtype(previous)
    assert_as_found(model_type, "generate", bug, twin)


# ------------------------------------------------------------------ a static cache against the dynamic one
@pytest.mark.parametrize("model_type", ["fsmt", "led"])
def test_static_cache_generate_differs_from_the_dynamic_one(model_type):
    """FSMT's cached decoder passes no mask and LED's builds none for a one-token step, so a StaticCache's empty slots
    are attended at the first step already; generate() with the default (dynamic) cache, which holds no empty slot,
    equals the plain forward of the decoder start token (to the float32 rounding generate() casts its logits to)."""
    model = model64(model_type)
    ids = ids_of(1, 10)
    greedy = dict(max_new_tokens=3, do_sample=False, num_beams=1, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        static = model.generate(ids, cache_implementation="static", **greedy)
        dynamic = model.generate(ids, **greedy)
        forward = model(ids, decoder_input_ids=dynamic.sequences[:, :1]).logits[:, -1]
    assert_as_found(model_type, "generate", rel(static.logits[0], forward), rel(dynamic.logits[0], forward))


# ------------------------------------------------------------------ PaliGemma: SDPA not causal on text alone
def test_paligemma_sdpa_is_not_causal_on_text():
    """Without token_type_ids PaliGemma's eager path masks text causally and its SDPA path does not; text marked as
    the causal suffix (token_type_ids = 1) gives the same function on both."""
    eager = model64("paligemma")
    sdpa = copy.deepcopy(eager)
    sdpa.set_attn_implementation("sdpa")
    ids = ids_of(1, 10)
    suffix = torch.ones_like(ids)
    with torch.no_grad():
        bug = rel(sdpa(ids).logits, eager(ids).logits)
        twin = rel(sdpa(ids, token_type_ids=suffix).logits, eager(ids, token_type_ids=suffix).logits)
    assert_as_found("paligemma", "kernels", bug, twin)


# ------------------------------------------------------------------ crashes on cached paths transformers accepts
def _raises_as_found(model_type: str, check: str, call) -> None:
    """`call` raises the exception the finding's fingerprint names, with its message fragment; where upstream fixed
    the crash (the entry's `fixed_in`), `call` runs."""
    found = finding(model_type, check)
    if found is None or found.kind == WRONG:
        call()
        return
    with pytest.raises(getattr(builtins, found.kind), match=re.escape(found.message)):
        call()


def _decode_step(model, cache, prefill: int = 8):
    """The logits of token `prefill` decoded through `cache` after a prefill, and of the full forward there."""
    ids = ids_of(1, prefill + 1)
    out = model(ids[:, :prefill], cache=cache, use_cache=True)
    step = model(ids[:, prefill:], cache=cache_of(out), use_cache=True).logits[:, -1]
    return step, model(ids).logits[:, -1]


def _agrees(pair) -> None:
    step, full = pair
    assert rel(step, full) < 1e-5, rel(step, full)  # float32 rounding


def _static(model, length: int, seq2seq: bool = False):
    config = model.config.get_text_config(decoder=True)
    cache = transformers.StaticCache(config=config, max_cache_len=length)
    return transformers.EncoderDecoderCache(cache, transformers.StaticCache(config=config, max_cache_len=10)) \
        if seq2seq else cache


def _seq2seq_decode(model, cache):
    ids, decoder = ids_of(1, 10), ids_of(1, 5, seed=1)
    out = model(ids, decoder_input_ids=decoder[:, :4], cache=cache, use_cache=True)
    return model(ids, decoder_input_ids=decoder[:, 4:], cache=cache_of(out), use_cache=True).logits


def _generate(model, **kwargs):
    return model.generate(ids_of(1, 12), max_new_tokens=3, do_sample=False, num_beams=1, **kwargs)


def _text(model):
    return getattr(model, "text_model", model)


INKLING = dict(sliding_window=8, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16)
# (model type, check) -> (overrides, the crashing call, the twin that runs), each a function of the float32 model.
CRASHES = {
    # GPT-Neo's causal buffer is max_position_embeddings (256) wide: a longer StaticCache crashes with every position
    # in range; one of 256 slots decodes like the forward.
    ("gpt_neo", "cache"): ({}, lambda m: _decode_step(m, _static(m, 263)), lambda m: _agrees(_decode_step(m, _static(
        m, 256)))),
    # Kosmos-2's text model expands its mask to the cache length; the DynamicCache decodes like the forward.
    ("kosmos-2", "cache"): ({}, lambda m: _decode_step(_text(m), _static(_text(m), 16)), lambda m: _agrees(
        _decode_step(_text(m), transformers.DynamicCache(config=_text(m).config)))),
    # ProphetNet builds its n-gram masks for the static key length; CPM-Ant prepends 32 prompt positions to a cache
    # sized for the text. Both generate() with the default cache.
    ("prophetnet", "cache"): ({}, lambda m: _seq2seq_decode(m, _static(m, 16, seq2seq=True)), _generate),
    ("prophetnet", "generate"): ({}, lambda m: _generate(m, cache_implementation="static"), _generate),
    ("cpmant", "cache"): ({}, lambda m: _decode_step(m, _static(m, 16)), _generate),
    ("cpmant", "generate"): ({}, lambda m: _generate(m, cache_implementation="static"), _generate),
    # BLT: any cached forward builds DynamicCache(config) on a BltConfig with no num_hidden_layers; it runs uncached.
    **{("blt", check): ({}, _generate, lambda m: m(ids_of(1, 12), use_cache=False)) for check in ("generate",
                                                                                                  "serving")},
    # Inkling: generate(cache_implementation="static") past the sliding window builds a full-length mask for the
    # window-long sliding layers; the dynamic cache runs.
    **{(t, "generate"): (INKLING, lambda m: _generate(m, cache_implementation="static"), _generate)
       for t in ("inkling_text", "inkling2_text", "inkling2_loop_text")},
    # Falcon with ALiBi (the zoo's): the bias is built over the query length, not a static cache's key length, and
    # generate() with a static cache fails to unpack; the dynamic cache runs.
    ("zoo:falcon_alibi", "cache"): ({}, lambda m: _decode_step(m, _static(m, 16)), _generate),
    ("zoo:falcon_alibi", "generate"): ({}, lambda m: _generate(m, cache_implementation="static"), _generate),
    # GraniteMoeHybrid as its own default config has it (every layer Mamba): the mask builder refuses a cache of
    # linear-attention layers only, so any cached forward raises; it runs uncached.
    **{("granitemoehybrid:all-mamba", check): (dict(layer_types=["linear_attention"] * 2), crashing,
                                               lambda m: m(ids_of(1, 12), use_cache=False))
       for check, crashing in (("cache", lambda m: _decode_step(m, transformers.DynamicCache(config=m.config))),
                               ("generate", _generate))},
}


@pytest.mark.parametrize("model_type, check", sorted(CRASHES), ids=lambda v: v)
def test_cached_path_crashes(model_type, check):
    overrides, crashing, twin = CRASHES[model_type, check]
    key = f"float32 {model_type} {sorted(overrides.items())}"
    if key not in _BUILT:
        _BUILT[key] = small(model_type, **overrides)
    model = _BUILT[key]
    with torch.no_grad():
        _raises_as_found(model_type, check, lambda: crashing(model))
        twin(model)


# ------------------------------------------------------------------ RoBERTa as a decoder: generate() vs the forward
def test_roberta_decoder_generate_numbers_positions_from_0():
    """RobertaForCausalLM (is_decoder=True) numbers positions from padding_idx + 1 when called without position_ids
    (RoBERTa's table), but generate() hands it position_ids from the mask, from 0: the first generated logits differ
    from the forward's on the same prompt. BERT's table starts at 0, and there the two agree."""
    sizes = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                 max_position_embeddings=64, is_decoder=True)
    ids = ids_of(1, 10)
    differs = {}
    for name, config, model_class in (("roberta", transformers.RobertaConfig, transformers.RobertaForCausalLM),
                                      ("bert", transformers.BertConfig, transformers.BertLMHeadModel)):
        torch.manual_seed(0)
        model = _float64(model_class(config(**sizes)))
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                                 num_beams=1, output_logits=True, return_dict_in_generate=True, pad_token_id=1)
            differs[name] = rel(out.logits[0], model(ids).logits[:, -1])
    assert_as_found("roberta:is_decoder", "generate", differs["roberta"], differs["bert"])
