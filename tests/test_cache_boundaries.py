"""cache: the probe reaches each boundary the model declares and no further than it needs, and paths sharing their
first forwards feed them once. A chunked-attention size is passed like a window (a planted bug there FAILs, the
healthy twin PASSes); a window longer than PAST_WINDOW is run PAST_BOUNDARY tokens past, and the tokens fed are
what the schedules say; a cache that cannot be copied safely is fed again, never shared."""

import plants_cache as plants
import torch

from posdiag.api import run_checks
from posdiag.checks._cache_plan import PAST_BOUNDARY, plan_probe, schedules
from posdiag.model.caches import copied_cache
from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.results import Status
from posdiag.testing import zoo

OPTIONS = RunOptions(seq_len=12, check_options={"cache": {"decode_steps": 4}})
LONG_WINDOW = 96  # > PAST_WINDOW: the probe runs window + PAST_BOUNDARY tokens, not 2 x window + 4


def cache(model, options=OPTIONS):
    return run_checks(from_module(model), ["cache"], options).check("cache")


def _chunked_llama4():
    return zoo.tiny_model_of_type("llama4_text", attention_chunk_size=8)


def test_chunked_attention_probe_passes_the_chunk_and_a_misplaced_chunk_fails():
    healthy = cache(_chunked_llama4())
    assert healthy.status is Status.PASS, healthy.summary
    assert healthy.details["boundaries"] == {"attention chunk": 8}
    assert healthy.details["seq_len"] == 2 * 8 + 4  # 12 asked: the probe is extended past the chunk
    decode = healthy.details["paths"]["dynamic/decode"]["steps"]
    assert decode[0][1] > 8  # the prefill is longer than the chunk, the steps run past it
    # the cache's chunk placed by its buffer length (as window_by_buffer_length plants it for windows)
    planted = cache(plants.window_by_buffer_length(_chunked_llama4()))
    assert planted.status is Status.FAIL, planted.summary
    assert planted.details["paths"]["dynamic/decode"]["status"] is Status.FAIL


def _counted(model):
    """The model with a pre-hook summing the tokens each call feeds (as benchmarks/bench.py counts them)."""
    fed = []

    def count(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            fed.append(int(ids.numel()))

    model.register_forward_pre_hook(count, with_kwargs=True)
    return model, fed


def test_a_long_window_is_run_a_few_tokens_past_and_each_shared_forward_is_fed_once():
    model, fed = _counted(zoo.tiny_model("mistral", sliding_window=LONG_WINDOW, max_position_embeddings=256))
    result = cache(model)
    assert result.status is Status.PASS, result.summary
    length = LONG_WINDOW + PAST_BOUNDARY
    assert result.details["seq_len"] == length
    paths = result.details["paths"]
    decode, chunked, chunks = (paths[f"dynamic/{n}"]["steps"] for n in ("decode", "chunked_prefill", "chunks"))
    assert decode[0] == (0, length - 4) and decode[0][1] > LONG_WINDOW
    assert chunked[-1][0] < LONG_WINDOW < chunked[-1][1]  # the chunked prefill's last forward crosses the window
    assert any(start < LONG_WINDOW < end for start, end in chunks[2:])  # so does a chunk of the continuation
    continues = {name: p.get("continues") for name, p in paths.items()}
    assert continues["dynamic/chunks"] == {"path": "dynamic/chunked_prefill", "steps_shared": 2}
    assert continues["dynamic/decode+position_ids"] == {"path": "dynamic/decode", "steps_shared": 1}
    # tokens: the full forward, the floor's prefix (the decode prefill), a jittered full forward where that floor
    # was degenerate, every path's own steps (not those it shares), the two-token cache probe and the one-token slip
    # (the decode path's first step one position early: the run's power)
    own = sum(end - start for p in paths.values() for start, end in p["steps"][(p.get("continues") or {}).get(
        "steps_shared", 0):])
    jitter = length if "jittered" in result.details["floor_source"] else 0
    assert sum(fed) == 2 + length + (length - 4) + jitter + own + 1
    tail = 2 * PAST_BOUNDARY  # chunks continue from window - PAST_BOUNDARY: the window sits mid-tail
    assert chunks[2][0] == LONG_WINDOW - PAST_BOUNDARY
    assert own == 2 * (length + length + tail) + 4 + tail  # dynamic and static: decode, chunked, chunks; ids twins
    planted = cache(plants.window_by_buffer_length(zoo.tiny_model("mistral", sliding_window=LONG_WINDOW,
                                                                  max_position_embeddings=256)))
    assert planted.status is Status.FAIL, planted.summary
    assert planted.details["paths"]["dynamic/decode"]["status"] is Status.FAIL


def test_short_windows_keep_twice_the_window_plus_four():
    subject = from_module(zoo.tiny_model("mistral"))
    assert plan_probe(subject, RunOptions(seq_len=12)).length == 2 * zoo.SLIDING_WINDOW + 4


def test_a_boundary_past_the_declared_context_is_named_not_claimed():
    model = zoo.tiny_model("mistral", sliding_window=LONG_WINDOW, max_position_embeddings=64)
    result = cache(model)
    assert "sliding window" in result.details["boundaries_not_reached"]
    assert "not reached, not judged: sliding window 96" in result.summary, result.summary


def test_a_longrope_original_context_caps_the_probe_and_is_named():
    """Past a LongRoPE block's original context a forward rotates every position with its long factors: the full
    forward is no reference across it (a 64-token probe's floor came out at 1.1e-2, by design, and hid everything),
    so the probe stays within it and the report names it."""
    rope = {"rope_type": "longrope", "factor": 2.0, "rope_theta": 10000.0, "original_max_position_embeddings": 40,
            "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    short = cache(zoo.tiny_model("llama", rope_parameters=rope))
    assert short.status is Status.PASS, short.summary
    assert short.details["seq_len"] == 12 and "original context" in short.details["boundaries_not_reached"]
    assert "not reached, not judged: original context 40 (LongRoPE" in short.summary
    capped = cache(zoo.tiny_model("llama", rope_parameters=rope), RunOptions(seq_len=64))
    assert capped.status is Status.PASS, capped.summary
    assert capped.details["seq_len"] == 40 and capped.metrics["noise_floor"] < 1e-5, capped.summary


def test_the_schedules_cross_the_boundary_and_share_their_first_forwards():
    plan = schedules(524, 8, 512)  # the Gemma-3-270M shape: window 512
    assert plan["decode"].steps[0] == (0, 516)
    assert plan["chunked_prefill"].steps == [(0, 175), (175, 500), (500, 524)]
    assert plan["chunks"].steps[:2] == plan["chunked_prefill"].steps[:2] and plan["chunks"].shared == 2
    assert sum(end - start for start, end in plan["chunks"].steps[2:]) == 24


def test_a_cache_copy_shares_nothing_and_a_cache_holding_a_function_is_not_copied():
    from transformers import DynamicCache

    model = zoo.tiny_model("llama")
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([[5, 6, 7]]), cache=cache, use_cache=True)
    copied = copied_cache(cache)
    assert copied is not None and copied.get_seq_length() == 3
    assert copied.layers[0].keys.data_ptr() != cache.layers[0].keys.data_ptr()
    cache.layers[0].get_seq_length = lambda: 0  # an instance function may read the original: not shared
    assert copied_cache(cache) is None


def test_continuing_a_copied_cache_gives_the_errors_of_feeding_every_step(monkeypatch):
    """Sharing is only a saving: with no cache copied (each path feeds its own first forwards) every step's error is
    the same, bit for bit, and only the tokens fed grow."""
    import posdiag.checks.cache as cache_check

    shared_model, shared_fed = _counted(zoo.tiny_model("mistral"))
    shared = cache(shared_model)
    monkeypatch.setattr(cache_check, "copied_cache", lambda c: None)
    alone_model, alone_fed = _counted(zoo.tiny_model("mistral"))
    alone = cache(alone_model)
    assert shared.status is alone.status is Status.PASS, (shared.summary, alone.summary)
    errors = {name: p["step_errors"] for name, p in shared.details["paths"].items()}
    assert errors == {name: p["step_errors"] for name, p in alone.details["paths"].items()}
    assert not any("continues" in p for p in alone.details["paths"].values())
    assert sum(alone_fed) > sum(shared_fed)


def test_a_decode_paths_static_cache_keeps_room_past_the_probe():
    """generate() sizes a static cache for the tokens still to come, and so does each decode path (7 tokens of room;
    the chunked paths' holds exactly the probe). GPT-Neo cuts its position buffer (max_position_embeddings square) by
    the cache length: the sweep's GPT-Neo (window 256 = its context, so the probe runs to the context) crashes on the
    static decode path, as docs/support.md has it; a cache sized to the probe hid that."""
    from sweep_support import pinned, run_named, sweep_model

    result = run_named(sweep_model("gpt_neo"), ["cache"])["cache"]
    if not pinned(result, "gpt_neo", "cache"):  # upstream fixed: every path passes, the static decode included
        return
    assert result.summary.startswith("static/decode crashed: RuntimeError"), result.summary
    chunked = result.details["paths"]["static/chunked_prefill"]  # exactly the probe: within the buffer, judged
    assert "crashed" not in chunked and chunked["status"] is Status.PASS, chunked
