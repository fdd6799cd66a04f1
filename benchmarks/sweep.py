"""The support sweep: every model type of transformers' text and image-text auto mappings, as a tiny model.

Driven by `python benchmarks/support_matrix.py --all`. Each type runs in its own subprocess under a time limit
(a hang or a crash costs one row); each finished row is appended to benchmarks/sweep.jsonl at once, so an
interrupted sweep resumes where it stopped. The table in docs/support.md is rebuilt from that file.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace
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
SYMBOL = {"pass": "PASS", "fail": "**FAIL**", "warn": "WARN", "skip": "skip", "n/a": "n/a", "error": "**ERROR**"}
# Rows swept since checks report "n/a" (does not apply by design) carry this; older rows report those as skips.
ROW_STATUSES = "with n/a"
WRONG = "wrong values"  # Finding.kind of a path that runs and gives outputs that differ from what they must equal
PLAIN = "tests/test_findings_plain.py"  # the plain-transformers reproductions (two float64 computations, no verdict)
MULTIMODAL = "tests/test_findings_multimodal.py"  # the same for multimodal prompts (images and a video)


@dataclass(frozen=True)
class Finding:
    """One upstream finding: a check FAILs (or WARNs) on a path of a stock model for a reason shown in plain
    transformers (or in llama.cpp, for an `engine` finding). A verdict is this finding only when its summary matches
    the fingerprint (path and kind). The tests read the table to know what to expect on the installed versions
    (tests/sweep_support.pinned): the FAIL where the finding holds, a PASS where upstream fixed it."""

    path: str  # the failing path as the check's summary names it first ("static/decode", "row 'a right-padded'")
    kind: str  # WRONG, or for a crash its exception type ("RuntimeError")
    what: str  # what goes wrong, in a few words
    test: str  # the test that reproduces it in plain transformers (path::name)
    message: str = ""  # for a crash: a fragment of the exception's message
    design: bool = False  # faithful to the published architecture: by design, not a bug
    since: str = ""  # the first `engine` release it holds on ("": every release tested before it)
    fixed_in: str = ""  # the first release where upstream no longer shows it ("": holds on the newest tested)
    engine: str = "transformers"  # the distribution whose releases `since` and `fixed_in` count ("llama-cpp-python")

    def holds(self, version: str | None = None) -> bool:
        """Whether this finding holds on `version` of its engine (the installed one by default; a finding of an
        engine that is not installed does not hold)."""
        from packaging.version import Version

        version = version or _installed(self.engine)
        if version is None:
            return False
        v = Version(version)
        return (not self.since or v >= Version(self.since)) and (not self.fixed_in or v < Version(self.fixed_in))

    def versions(self) -> str:
        """The releases it holds on, as the page shows them (prefixed by the engine where it is not transformers)."""
        if self.since and self.fixed_in:
            span = f"{self.since} to before {self.fixed_in}"
        elif self.since:
            span = f"{self.since} and later"
        else:
            span = f"before {self.fixed_in}" if self.fixed_in else "every release tested"
        return span if self.engine == "transformers" else f"{self.engine}: {span}"

    def matches(self, summary: str) -> bool:
        """The summary names this path first and fails it the way this finding does."""
        if self.path not in summary:
            return False
        crashed = f"{self.path} crashed: "
        state_crash = "the call crashed ("  # `state` names the sequence first, then how its call crashed
        serving_crash = ": crashed ("  # `serving` names the path and what it ran, then how it crashed
        # the path's own clause (up to the next "; "); a finding naming no path owns the whole summary
        own = (summary.split(self.path, 1)[1] if self.path else summary).split("; ", 1)[0]
        if self.kind == WRONG:  # the path's own clause is no crash; a later path's may be
            return not own.startswith(" crashed: ") and state_crash not in own and serving_crash not in own
        return (f"{crashed}{self.kind}:" in summary or f"{state_crash}{self.kind}: " in summary
                or f"{serving_crash}{self.kind}: " in own) and self.message in summary


def _crash(path: str, kind: str, message: str, what: str, test: str, **versions: str) -> Finding:
    return Finding(path, kind, what, test, message, **versions)


def _static_crash(path: str, what: str, **versions: str) -> Finding:
    return _crash(path, "RuntimeError", "must match the size of tensor b", what, f"{PLAIN}::test_cached_path_crashes",
                  **versions)


def _installed(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


# The transformers release the rows of benchmarks/sweep.jsonl without a "transformers" field were swept on.
LEGACY_ROWS = "5.24.0"


# batch's WARN for the caller's contract (only the left-padded row without position_ids differs; explicit ids right)
DEFAULTS_ROW = "left-padded rows without position_ids are numbered from the first padding column"
CONTINUATION = f"{PLAIN}::test_cached_continuation_differs_from_the_full_forward"
PADDED = f"{PLAIN}::test_padded_row_differs_from_itself_alone"
LEFT_PADDED_GENERATE = f"{PLAIN}::test_left_padded_generate_differs_from_each_row_alone"
GENERATE_STATE = f"{PLAIN}::test_generate_continued_or_drafted_differs_from_plain_generate"
# state's multi-turn: generate() continued from the cache it returned feeds the reply's last token and the user's turn
# in one multi-token step, scanned from a zero SSM state like cache's chunks (prompt lookup's verification too).
KEPT_CACHE_TURN = Finding("multi-turn", WRONG, "generate() continued from the cache it returned differs from "
                          "generating the whole conversation (a multi-token step restarts the recurrent state); "
                          "prompt-lookup decoding differs from greedy too", GENERATE_STATE)
# state's prompt lookup on models that keep a recurrent (SSM or linear-attention) state beside their attention cache:
# the candidates the lookup rejects are cropped from the attention cache, not taken back out of that state.
KEPT_REJECTED = Finding("prompt lookup", WRONG, "prompt-lookup decoding differs from greedy generate(): rejected "
                        "candidates are not taken back out of the recurrent state", GENERATE_STATE)
LOOKUP_CRASH = _crash("prompt lookup", "IndexError", "list index out of range", "prompt-lookup decoding crashes "
                      "(greedy generate() runs)", f"{PLAIN}::test_prompt_lookup_crashes")
# state with images (Qwen2-VL's compute_3d_position_ids, copied by the families after it): rope_deltas set by an image
# prompt stay on the model, and a call on an empty cache without images does not reset them.
STALE_ROPE_DELTAS = Finding("text after an image:", WRONG, "a text prompt decoded in a plain loop (no position_ids) "
                            "after an image prompt takes the image prompt's rope_deltas; after a two-row image batch "
                            "the same loop crashes (the kept deltas repeated 1 // 2 = 0 times)",
                            f"{MULTIMODAL}::test_text_after_an_image_decodes_with_stale_rope_deltas")
# serving on Mamba and FalconMamba: a multi-token continuation is scanned from a zero state (`cache`'s chunks), and a
# one-token cached step given the 2D mask of every token so far multiplies the token by that mask (T copies scanned).
SCAN_SERVING = Finding("chunks of 3", WRONG, "a multi-token cache continuation restarts the SSM state (chunks, chunked "
                       "prefill, a shared prefix's suffixes, prompt lookup); a one-token cached step given the mask of "
                       "every token so far broadcasts the token over it (the padded batch, the decode loops)",
                       f"{PLAIN}::test_cached_step_given_every_token_s_mask_broadcasts_it")
# serving on the omni thinkers: rope_deltas set by every prefill (a text prompt's too), so a cached step without
# position_ids numbers every token of the 2D mask it is given instead of the new one.
OMNI_MASKED_STEP = _crash("decode loop after another prompt", "RuntimeError", "must match the size of tensor b",
                          "a cached step given the 2D mask of every token so far and no position_ids crashes: "
                          "compute_3d_position_ids numbers every token of the mask, not the new one (rope_deltas are "
                          "set by every prefill, text alone too)",
                          f"{MULTIMODAL}::test_a_decode_step_given_the_whole_mask_crashes_the_omni_thinkers")
INKLING_SLIDING = "static cache past the sliding window crashes (hybrid_sliding mask sized for the full layers)"
INKLING_BIAS = "static cache: the relative bias reads the query offset after the update has grown it"
# model type -> {check: Finding}: the verdicts on these healthy default-init models that are upstream findings (bugs in
# stock transformers on paths it accepts, or by design), each reproduced in plain transformers by the test it names and
# described under "Findings" in docs/support.md. Any other FAIL, or a FAIL of a listed check that does not match its
# fingerprint, is a false verdict to fix (counted as unclassified).
FINDINGS: dict[str, dict[str, Finding | tuple[Finding, ...]]] = {
    "gpt_neo": {"cache": _static_crash(
        "static/decode", "a StaticCache longer than max_position_embeddings crashes with every position in range: "
        "the hard-coded causal buffer is max_position_embeddings wide")},
    "mamba": {"cache": Finding("dynamic/chunks", WRONG, "a multi-token cache continuation differs from the full "
                               "forward", CONTINUATION), "state": KEPT_CACHE_TURN, "serving": SCAN_SERVING},
    "jamba": {"cache": Finding("dynamic/chunks", WRONG, "a multi-token cache continuation differs from the full "
                               "forward", CONTINUATION), "state": KEPT_CACHE_TURN,
              "serving": Finding("chunks of 3", WRONG, "a multi-token cache continuation differs from the full forward "
                                 "(chunks, chunked prefill, a shared prefix's suffixes, prompt lookup)", CONTINUATION)},
    "falcon_mamba": {"cache": Finding("dynamic/chunks", WRONG, "a multi-token cache continuation restarts the "
                                      "recurrent state", CONTINUATION), "state": KEPT_CACHE_TURN,
                     "serving": SCAN_SERVING},
    "zamba2": {"state": Finding("prompt lookup", WRONG, "prompt-lookup decoding differs from greedy generate(): "
                                "rejected candidates are not taken back out of the Mamba state", GENERATE_STATE)},
    **{t: {"state": KEPT_REJECTED, "serving": KEPT_REJECTED}
       for t in ("bailing_hybrid", "glm5_next", "granitemoehybrid", "kimi_linear", "lara_mini", "mamba2", "olmo_hybrid",
                 "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next")},
    "zamba": {"state": LOOKUP_CRASH, "serving": LOOKUP_CRASH},
    "zaya": {"state": LOOKUP_CRASH, "serving": LOOKUP_CRASH},
    "paligemma": {"kernels": Finding("on the unpadded input", WRONG, "the SDPA path is not causal on text without "
                                     "token_type_ids", f"{PLAIN}::test_paligemma_sdpa_is_not_causal_on_text")},
    "deepseek_v4": {"generate": Finding("dynamic/batch", WRONG, "a left-padded batch differs from each row alone "
                                        "once a compressed entry exists", LEFT_PADDED_GENERATE),
                    "batch": Finding("row 'a left-padded'", WRONG, "the compressor pools left padding into its "
                                     "first storage window", PADDED)},
    "hunyuan_vl": {"rope": Finding("mRoPE rotation disagrees", WRONG, "XD-RoPE pairs read two different position "
                                   "streams: no rotation for image tokens",
                                   "tests/test_sweep_findings_b.py::test_hunyuan_vl_xdrope_is_no_rotation_for_image_tokens")},
    "led": {"cache": Finding("static/decode", WRONG, "wrong logits at single-token steps with a static cache",
                             CONTINUATION),
            "generate": Finding("static/single", WRONG, "wrong logits at single-token steps with a static cache",
                                f"{PLAIN}::test_static_cache_generate_differs_from_the_dynamic_one")},
    "nystromformer": {"batch": Finding("row 'a right-padded'", WRONG, "its value convolution reads padded tokens",
                                       PADDED)},
    "biogpt": {"batch": Finding(DEFAULTS_ROW, WRONG, "its position embedding's mask-derived branch never runs: the "
                                "forward fills missing position_ids with arange first", PADDED)},
    "whisper": {"generate": Finding("dynamic/batch", WRONG, "positions from the first padding column: its forward "
                                    "takes position_ids only through **kwargs, so generate() derives none",
                                    LEFT_PADDED_GENERATE)},
    "kosmos-2": {"cache": _static_crash("static/decode", "crashes with a static cache (its mask is expanded to the "
                                        "cache length)"),
                 "generate": Finding("dynamic/batch", WRONG, "cached steps count a left-padded row's pads into its "
                                     "positions (the static cache crashes as well)", LEFT_PADDED_GENERATE)},
    "moshi": {"cache": Finding("dynamic/decode", WRONG, "its forward ignores the sliding window its cache applies",
                               "tests/test_sweep_sliding.py::test_moshi_forward_ignores_the_window_its_cache_applies"),
              "generate": Finding("dynamic/single", WRONG, "its forward ignores the sliding window its cache applies",
                                  "tests/test_sweep_sliding.py::test_moshi_forward_ignores_the_window_its_cache_applies")},
    "git": {"generate": Finding("dynamic/batch", WRONG, "each cached step widens the padding mask by the image patch "
                                "tokens", LEFT_PADDED_GENERATE)},
    "convbert": {"batch": Finding("row 'a right-padded'", WRONG, "its convolution branch reads padded tokens (the "
                                  "published architecture's span convolution has no mask)", PADDED, design=True)},
    "fsmt": {"generate": Finding("static/single", WRONG, "a static cache's empty slots are attended (no mask when "
                                 "decoding)", f"{PLAIN}::test_static_cache_generate_differs_from_the_dynamic_one")},
    "rwkv": {"batch": Finding("row 'a left-padded'", WRONG, "no attention_mask in the published recurrence: left "
                              "padding runs through it", PADDED, design=True)},
    "recurrent_gemma": {"batch": Finding(DEFAULTS_ROW, WRONG, "without position_ids a left-padded row reads its pads "
                                         "into the recurrence", PADDED),
                        "cache": (Finding("dynamic/chunks", WRONG, "a multi-token cache continuation restarts the "
                                          "convolution state", CONTINUATION, fixed_in="5.25.0"),
                                  Finding("dynamic/decode", WRONG, "a cached forward without position_ids numbers the "
                                          "new tokens from 0 (the cache's length is read from a recurrent layer); "
                                          "multi-token continuations restart the convolution state as before",
                                          f"{PLAIN}::test_recurrent_gemma_cached_step_without_ids_restarts_at_0",
                                          since="5.25.0")),
                        "state": Finding("multi-turn", WRONG, "generate() continued from the cache it returned "
                                         "differs from generating the whole conversation: the recurrent state is held "
                                         "on its modules, outside the cache", GENERATE_STATE)},
    "trocr": {"generate": Finding("dynamic/batch", WRONG, "positions from the first padding column: the position_ids "
                                  "generate() derives are dropped", LEFT_PADDED_GENERATE)},
    "yoso": {"batch": Finding("row 'a right-padded'", WRONG, "its padding mask is a no-op (a 0/1 mask read as "
                              "additive)", PADDED)},
    "bamba": {"cache": Finding("dynamic/decode", WRONG, "a cached forward without position_ids numbers the new tokens "
                               "from 0", CONTINUATION),
              "serving": Finding("chunks of 3", WRONG, "a cached forward without position_ids numbers the new tokens "
                                 "from 0 (chunks, a shared prefix's suffixes)", CONTINUATION)},
    "blt": {name: _crash(path, "AttributeError", "num_hidden_layers", "every cached forward crashes: "
                         "DynamicCache(config) reads a num_hidden_layers BltConfig lacks",
                         f"{PLAIN}::test_cached_path_crashes")
            for name, path in (("generate", "dynamic/single"), ("serving", "chunks of 3"))},
    "prophetnet": {"cache": _static_crash("static/decode", "crashes with a static cache (its mask is built for the "
                                          "static key length)"),
                   "generate": _crash("static/single", "RuntimeError", "expand(", "crashes with a static cache (its "
                                      "n-gram mask is built for the static key length)",
                                      f"{PLAIN}::test_cached_path_crashes")},
    **{"cpmant": {name: _crash(path, "IndexError", "index_copy_()", "crashes with a static cache (its prompt "
                               "positions are not counted)", f"{PLAIN}::test_cached_path_crashes")
                  for name, path in (("cache", "static/decode"), ("generate", "static/single"))}
                  | {"serving": Finding("chunks of 3", WRONG, "a forward continuing a cache slices its output by the "
                                        "cache's length as if fed the whole sequence: 3 tokens after 3 return none "
                                        "(its decode loops crash)", f"{PLAIN}::test_cpmant_forward_continuing_a_cache_"
                                        "returns_too_few_positions")}
                  | {"state": Finding("multi-turn", WRONG, "generate() continued from the cache it returned differs "
                                      "from generating the whole conversation; prompt-lookup decoding differs from "
                                      "greedy too", GENERATE_STATE)}},
    "kosmos-2.5": {"generate": Finding("dynamic/batch", WRONG, "cached steps number a left-padded row from its first "
                                       "padding column", "tests/test_sweep_kosmos25.py::"
                                       "test_kosmos25_decode_positions_count_the_padding_plain_transformers")},
    **{t: {"generate": (_static_crash("static/single", INKLING_SLIDING, fixed_in="5.25.0"),)}
       for t in ("inkling2", "inkling2_loop", "inkling2_loop_text", "inkling2_text")},
    **{t: {"generate": (_static_crash("static/single", INKLING_SLIDING, fixed_in="5.25.0"),
                        Finding("static/single", WRONG, INKLING_BIAS, f"{PLAIN}::test_static_cache_generate_differs_"
                                "from_the_dynamic_one", since="5.25.0")),
           "cache": Finding("static/decode", WRONG, INKLING_BIAS, CONTINUATION)}
       for t in ("inkling_text", "inkling_mm_model")},
    # ---- beyond the sweep's models (keys that are no model type, so no sweep row is judged by them):
    # "zoo:<family>" a tiny model of posdiag.testing.zoo; "<type>:<variant>" the type under a config the sweep does
    # not build; "llama.cpp:<what>" llama.cpp's behaviour, versioned by llama-cpp-python (the `engine`).
    # Falcon with ALiBi (the sweep's falcon type is built with RoPE)
    "zoo:falcon_alibi": {
        "kernels": Finding("", WRONG, "eager adds ALiBi twice (once folded into the mask, once in the attention): "
                           "eager and SDPA disagree", "tests/test_kernels.py::test_falcon_alibi_eager_adds_alibi_twice",
                           fixed_in="5.25.0"),
        "shift": Finding("", WRONG, "the ALiBi bias is computed in bfloat16: positions past 256 round",
                         "tests/test_shift.py::test_falcon_alibi_bias_is_computed_in_bfloat16"),
        "cache": _static_crash("static/decode", "crashes with a static cache (ALiBi is built over the query length, "
                               "not the static key length)"),
        "generate": _crash("static/single", "ValueError", "too many values to unpack", "generate() with a static "
                           "cache crashes", f"{PLAIN}::test_cached_path_crashes")},
    "zoo:gpt_neo": {name: Finding(path, WRONG, "a static cache longer than the local window reads the wrong rows of "
                                  "the causal buffer (sliced by the key length, max_cache_len)", CONTINUATION)
                    for name, path in (("cache", "static/decode"), ("generate", "static/single"))},
    # transformers' own default GraniteMoeHybrid config: every layer Mamba, and a cache of linear-attention layers only
    # is refused by the mask builder (Cache.get_seq_length up to 5.24, Cache.get_mask_sizes from 5.25)
    "granitemoehybrid:all-mamba": {name: tuple(
        _crash(path, "ValueError", refused_by, "every cached forward crashes", f"{PLAIN}::test_cached_path_crashes",
               **versions) for refused_by, versions in (("get_seq_length", {"fixed_in": "5.25.0"}),
                                                         ("get_mask_sizes", {"since": "5.25.0"})))
        for name, path in (("cache", "dynamic/decode"), ("generate", "dynamic/single"))},
    # the thinker given a sliding window (its config documents one; the sweep builds the default, None)
    "qwen3_omni_moe_thinker:sliding_window": {name: Finding(path, WRONG, "the cache built from the config evicts keys "
                                                            "past the window, the attention uses none",
                                                            "tests/test_sweep_omni.py::test_qwen3_omni_thinker_cache_"
                                                            "evicts_past_a_window_its_attention_ignores")
                                              for name, path in (("cache", "dynamic/decode"),
                                                                 ("generate", "dynamic/single"))},
    "qwen3_vl_moe:sliding_window": {"cache": Finding("dynamic/decode", WRONG, "the cache built from the config evicts "
                                                     "keys past the window, the attention uses none",
                                                     "tests/test_sweep_sliding.py::test_a_window_the_forward_ignores_"
                                                     "fails_cache_and_none_passes")},
    # Multimodal prompts (posdiag.model.multimodal_inputs: two images between text, a 4-frame video).
    # 5.25's get_rope_index resumes the text after a video at start + max(h, w) (5.2 and vLLM: past the video's largest
    # position), so a video whose temporal positions reach further numbers its text inside the video's t range: the
    # config class's default of 4 temporal positions per second does (the released checkpoints' 2 does not).
    "qwen2_5_vl": {"positions": Finding("text after video 1", WRONG, "the text after a video is numbered inside the "
                                        "video's temporal range", f"{MULTIMODAL}::test_text_after_a_video_overlaps_it",
                                        since="5.3.0"),
                   "state": STALE_ROPE_DELTAS},
    **{t: {"serving": OMNI_MASKED_STEP} for t in ("qwen2_5_omni_thinker", "qwen3_omni_moe_thinker")},
    **{t: {"state": STALE_ROPE_DELTAS} for t in ("qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "glm46v", "glmga",
                                                 "glm_ocr", "cosmos3_edge", "cosmos3_omni")},
    # GLM-4V's processor writes a video's frames as image tokens (mm_token_type_ids 2); its forward counts every image
    # token against the still images' features, so a prompt holding images and a video crashes (each alone runs).
    "glm4v": {"state": STALE_ROPE_DELTAS, "positions": _crash(
        "2 images and a 4-frame video", "ValueError", "Image features and image tokens do not match",
        "a prompt holding images and a video crashes the forward (the video's frames counted as image tokens)",
        f"{MULTIMODAL}::test_glm4v_crashes_on_images_and_a_video_together")},
    # RobertaForCausalLM with is_decoder=True (the sweep builds roberta as a masked LM)
    "roberta:is_decoder": {"generate": Finding("dynamic/single", WRONG, "generate() numbers positions from 0, the "
                                               "forward from padding_idx + 1", f"{PLAIN}::test_roberta_decoder_"
                                               "generate_numbers_positions_from_0")},
    "llama.cpp:qwen2": {"compare": Finding("= sliding_window", WRONG, "llama.cpp's qwen2 graph has no sliding window: "
                                           "a Qwen2 that uses its window differs from the window on",
                                           "tests/test_gguf.py::test_llama_cpp_qwen2_has_no_sliding_window",
                                           engine="llama-cpp-python")},
    "llama.cpp:llama": {"load": Finding("while loading it", "PosdiagError", "the Llama loader refuses a rotary size "
                                        "(rope.dimension_count) other than the head size", "tests/test_gguf_real.py::"
                                        "test_a_wrong_rope_dimension_count_is_refused_in_one_line",
                                        "llama.cpp failed on", design=True, engine="llama-cpp-python")},
    "llama.cpp:server": {"compare": Finding("prompt route", WRONG, "the prompt route's echoed log-probs are shifted by "
                                            "one position (llama-cpp-python #1983)", "tests/test_served.py::"
                                            "test_the_shifted_prompt_route_is_named_on_the_real_file",
                                            engine="llama-cpp-python")},
}


# serving's FAILs whose first failing path runs the computation a listed finding of another check reproduces (model
# type -> that check, serving's path): chunks numbered from 0 or restarting the convolution state, a left-padded
# batch's cached steps, the compressor pooling left padding.
SERVING_AS = {"bamba": ("cache", "chunks of 3"), "recurrent_gemma": ("cache", "chunks of 3"),
              "git": ("generate", "padded batch"), "trocr": ("generate", "padded batch"),
              "kosmos-2": ("generate", "decode loop after a padded batch"),
              "kosmos-2.5": ("generate", "decode loop after a padded batch"), "deepseek_v4": ("batch", "padded batch")}
for _type, (_check, _path) in SERVING_AS.items():
    _entry = FINDINGS[_type][_check]
    FINDINGS[_type]["serving"] = tuple(replace(f, path=_path) for f in _entry) if isinstance(_entry, tuple) \
        else replace(_entry, path=_path)


def model_types() -> dict[str, str]:
    """model type -> the first mapping (in MAPPINGS order) that builds it."""
    from transformers.models.auto import modeling_auto

    out: dict[str, str] = {}
    for kind, name in MAPPINGS.items():
        for model_type in getattr(modeling_auto, name):
            out.setdefault(model_type, kind)
    return out


def run_one(model_type: str, names: list[str] | None = None) -> None:
    """Build, check, print one JSON line (run in a subprocess by run_all)."""
    print(json.dumps(check_one(model_type, names=names)))


def check_one(model_type: str, seq_len: int = 16, threads: int | None = 1, names: list[str] | None = None) -> dict:
    """The sweep's row of one model type: its tiny model built and every check but `load` run on it, or only the
    checks `names` (on THREADS torch threads; None: the caller's count, which an in-process caller keeps)."""
    import warnings

    import torch
    import transformers

    warnings.filterwarnings("ignore")
    transformers.utils.logging.set_verbosity_error()
    if threads is not None:
        torch.set_num_threads(threads)
    from posdiag import checks
    from posdiag.api import run_checks
    from posdiag.model.loading import from_module
    from posdiag.options import RunOptions
    from posdiag.testing.multimodal import small_model

    row: dict = {"type": model_type, "kind": model_types().get(model_type, "?"), "statuses": ROW_STATUSES,
                 "transformers": transformers.__version__}
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
    names = names or [n for n in checks.available() if n != "load"]
    report = run_checks(subject, names, RunOptions(seq_len=seq_len))
    row["checks"] = {c.name: [c.status.value, c.summary[:240]] for c in report.checks}
    row["tested"] = report.model.tested  # what the checks fed (images and a video, where they could)
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


def run_all(timeout: float, only: list[str], write: bool, rerun: bool = False, jobs: int = 1,
            names: list[str] | None = None) -> None:
    """Sweep the types not swept yet (or, with `rerun`, the `only` types again: their new rows replace the old),
    JOBS subprocesses at a time (each single-threaded: two jobs fill two cores). With `names`, only those checks run
    and their verdicts replace the same checks' in each type's committed row (a row swept on another transformers
    release, or not judged, is swept whole instead: its other verdicts would not be of the same release)."""
    from concurrent.futures import ThreadPoolExecutor
    from threading import Lock

    import transformers

    types = model_types()
    todo = [t for t in (only or sorted(types)) if rerun or t not in done()]
    lock, finished = Lock(), [0]

    def sweep(model_type: str) -> None:
        start = time.time()
        old = done().get(model_type, {})
        subset = names if names and "checks" in old and old.get("transformers") == transformers.__version__ else None
        row = _run_type(model_type, types.get(model_type, "?"), timeout, subset)
        if subset and "checks" in row:
            row = {**old, "checks": {**old["checks"], **row["checks"]}}
        with lock:
            with RESULTS.open("a") as f:
                f.write(json.dumps(row) + "\n")
            finished[0] += 1
            print(f"[{finished[0]}/{len(todo)}] {model_type} {time.time() - start:.0f}s", flush=True)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(sweep, todo))
    compact()
    if write:
        write_page()


def _run_type(model_type: str, kind: str, timeout: float, names: list[str] | None = None) -> dict:
    """One type's row (only the checks `names`, if given), from its own subprocess: a crash or a hang costs that row
    only."""
    script = HERE / "support_matrix.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subset = ["--checks", ",".join(names)] if names else []
    try:
        proc = subprocess.run([sys.executable, str(script), "--one", model_type, *subset], capture_output=True,
                              text=True, timeout=timeout, preexec_fn=_limit_memory, env=env)
    except subprocess.TimeoutExpired:
        return {"type": model_type, "kind": kind, "timeout": timeout}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    last = (proc.stderr.strip().splitlines() or [""])[-1][:200]
    return json.loads(lines[-1]) if lines else {
        "type": model_type, "kind": kind, "unbuildable": f"process exited {proc.returncode}: {last}"}


def compact() -> None:
    """One row per model type in benchmarks/sweep.jsonl (a re-run appends rows; the latest is kept), sorted."""
    rows = done()
    RESULTS.write_text("".join(json.dumps(rows[t]) + "\n" for t in sorted(rows)))


def _limit_memory() -> None:
    """A small config whose model still asks for many GB must fail alone, not take the machine down."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def finding(model_type: str, check: str, version: str | None = None) -> Finding | None:
    """The entry of FINDINGS for (model_type, check) that holds on transformers `version` (installed by default);
    None where there is none, or upstream fixed it by then."""
    entry = FINDINGS.get(model_type, {}).get(check)
    entries = entry if isinstance(entry, tuple) else (entry,) if entry else ()
    return next((f for f in entries if f.holds(version)), None)


def every_finding() -> list[tuple[str, str, Finding]]:
    """(model type, check, finding) for every entry, each version range apart."""
    return [(t, n, f) for t, by_check in sorted(FINDINGS.items()) for n, entry in sorted(by_check.items())
            for f in (entry if isinstance(entry, tuple) else (entry,))]


def finding_of(row: dict, name: str) -> Finding | None:
    """The listed finding a row's verdict of check `name` is: a FAIL or WARN matching the entry's fingerprint (the
    entry that holds on the transformers the row was swept on)."""
    found = finding(row["type"], name, row.get("transformers", LEGACY_ROWS))
    status, summary = row.get("checks", {}).get(name, ("skip", ""))
    return found if found and status in ("fail", "warn") and found.matches(summary) else None


def stale_findings() -> list[str]:
    """FINDINGS entries the committed rows do not show (the row passes, or fails some other way)."""
    rows = done()
    return [f"{t} {n}" for t, by_check in FINDINGS.items() for n in by_check
            if t in rows and finding(t, n, rows[t].get("transformers", LEGACY_ROWS))
            and finding_of(rows[t], n) is None]


def counts() -> dict[str, int]:
    """The sweep's headline figures (docs/support.md and the README quote them; tests/test_support_subset.py checks
    that the README's match)."""
    rows = done()
    judged = [r for r in rows.values() if "checks" in r]
    statuses = [(r, n, s) for r in judged for n, (s, _) in r["checks"].items()]
    fails = [finding_of(r, n) for r, n, s in statuses if s == "fail"]
    return {"total": len(model_types()), "swept": len(rows), "judged": len(judged),
            "not_built": len(rows) - len(judged), "skips": sum(s == "skip" for *_, s in statuses),
            "errors": sum(s == "error" for *_, s in statuses), "fails": len(fails),
            "not_applicable": sum(s == "n/a" for *_, s in statuses),
            "current": sum(r.get("statuses") == ROW_STATUSES for r in rows.values()),
            "unclassified": sum(f is None for f in fails), "by_design": sum(bool(f and f.design) for f in fails),
            **{f"on {v}": n for v, n in sorted(Counter(r.get("transformers", LEGACY_ROWS) for r in rows.values())
                                               .items())}}


def readme_sentence(c: dict[str, int]) -> str:
    """The README's coverage line, from counts(); write_page() puts it between the README's sweep-counts markers."""
    swept = "every model type" if c["swept"] == c["total"] else f"{c['swept']} of the {c['total']} model types"
    found = c["fails"] - c["unclassified"]
    fails = (f"{c['fails']} FAILs, {'all' if not c['unclassified'] else f'{found} of them'} upstream findings "
             f"({found - c['by_design']} bugs, {c['by_design']} by design)")
    return (f"Swept over {swept} of transformers' causal-LM, seq2seq, masked-LM and image-text-to-text mappings, a "
            f"tiny default-init model each ([the table](docs/support.md#every-model-type-the-sweep)"
            + (f"; {c['current']} rows re-swept on the current code, the others from the previous full sweep"
               if c["current"] < c["swept"] else "")
            + "; transformers " + ", ".join(f"{k[3:]}: {n} rows" for k, n in c.items() if k.startswith("on ")) + "): "
            f"**{c['judged']} of {c['total']} model types judged**, {c['skips']} check results skipped with their "
            f"reasons, {c['not_applicable']} not applicable by design, {c['errors']} errors, {fails}; "
            f"{c['not_built']} cannot be built from a small config on CPU (listed with the reason).")


def write_page() -> None:
    """Rebuild the sweep block of docs/support.md and the README's coverage line from the committed rows."""
    rows = done()
    c = counts()
    swept = (f"{c['swept']} of {c['total']} model types swept" if c["swept"] < c["total"]
             else f"all {c['total']} model types swept")
    found = c["fails"] - c["unclassified"]
    lines = [f"{swept}: {c['judged']} judged, {c['not_built']} not buildable as a small CPU model (listed below with "
             f"the reason); {c['skips']} check results skipped with reasons, {c['not_applicable']} not applicable by "
             f"design, {c['errors']} errors; {c['fails']} FAILs "
             f"on healthy default-init models, {found} of them upstream findings ({found - c['by_design']} bugs, "
             f"marked *finding*; {c['by_design']} by design, marked *by design*; see [findings](#findings-on-stock-"
             f"transformers) and [the list below](#what-each-finding-fails))"
             + (f", {c['unclassified']} not yet classified." if c["unclassified"] else "."), "",
             (f"{c['current']} of the {c['swept']} rows were swept since checks report *n/a* for what does not apply "
              "by design; the others come from the previous full sweep, which reported those as skips."
              if c["current"] < c["swept"] else "Every row was swept on the current checks (*n/a* for what does not "
              "apply by design, `fit` included)."),
             "Rows by the transformers release they were swept on: " + ", ".join(
                 f"{k[3:]}: {n}" for k, n in c.items() if k.startswith("on ")) + "."
             + (" A `-` cell: the row was swept before that check existed." if any(
                 len(r.get("checks", {})) < max(len(x.get("checks", {})) for x in rows.values())
                 for r in rows.values() if "checks" in r) else ""), "",
             *_verdict_table(rows), "", "Not judged (cannot be built from a small config on CPU, or over the time "
             "limit):", ""]
    for r in sorted((r for r in rows.values() if "checks" not in r), key=lambda r: r["type"]):
        why = r.get("unbuildable") or f"over the {r.get('timeout', 0):.0f} s limit per model type"
        lines.append(f"- `{r['type']}` ({r['kind']}): {why.replace('|', '/')}")
    lines += ["", "### What each finding fails", "", *_findings_table()]
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


def _verdict_table(rows: dict[str, dict]) -> list[str]:
    """One line per judged model type, one cell per check; a verdict that is a listed finding is marked."""
    from posdiag import checks

    names = [n for n in checks.available() if n != "load"]
    lines = ["| model type | kind | positions | " + " | ".join(names) + " |", "|---" * (len(names) + 3) + "|"]
    for r in sorted((r for r in rows.values() if "checks" in r), key=lambda r: r["type"]):
        cells = []
        for n in names:
            finding = finding_of(r, n)
            mark = "" if finding is None else " *by design*" if finding.design else " *finding*"
            cells.append(SYMBOL[r["checks"][n][0]] + mark if n in r["checks"] else "-")  # -: not swept with it
        kind = r["kind"] if r["kind"] == "image-text" else r["family_kind"]  # bart: seq2seq, though also a causal LM
        lines.append(f"| {r['type']} | {kind} | {r['position_kind']} | " + " | ".join(cells) + " |")
    return lines


def _findings_table() -> list[str]:
    """FINDINGS as the page shows it: what each entry fails, how (its fingerprint), and the plain reproduction."""
    lines = ["The fingerprint a verdict must match to count as the finding (anything else is unclassified): the path "
             "the check's summary names first, and how it fails there.", "",
             "| model type | check | path | fails as | what | bug or by design | releases | reproduced in |",
             "|---" * 8 + "|"]
    for model_type, name, f in every_finding():
        how = "wrong values" if f.kind == WRONG else f"crash: {f.kind} (`{f.message}`)"
        lines.append(f"| {model_type} | {name} | `{f.path}` | {how} | {f.what} | "
                     f"{'by design' if f.design else 'bug'} | {f.versions()} | `{f.test}` |")
    return lines
