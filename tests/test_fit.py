"""`fit` on fast models: the trained rope-copy fixture (no tokenizer: repeated random sequences), its planted
broken copies, default-init zoo models (SKIP, one forward) and the exact restore of every alternative.

The real pretrained model (SmolLM2) is in test_fit_pretrained.py."""

import math
import shutil
from pathlib import Path

import pytest
import torch
from plants_fit import interleaved_qk, spurious_scaling, theta_lost, window_declared

from posdiag import api
from posdiag.checks.fit.alternatives import plan_alternatives
from posdiag.checks.fit.edits import deinterleave, interleave
from posdiag.checks.fit.material import Material
from posdiag.model.loading import from_module, load_subject
from posdiag.model.logits import reduce_logits, rows_per_chunk, score_targets
from posdiag.results import Status
from posdiag.testing import zoo

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "rope-copy"


def fit(subject):
    return api.run_checks(subject, ["fit"]).checks[0]


@pytest.fixture(scope="module")
def healthy():
    subject = load_subject(str(FIXTURE))
    start = subject.forward_count
    result = fit(subject)
    return subject, result, subject.forward_count - start


def test_healthy_copy_model_passes_with_the_nearest_margin(healthy):
    _, result, _ = healthy
    assert result.status is Status.PASS, result.summary
    assert "repeated random sequences" in result.details["source"]
    assert result.metrics["z"] < 5 and "nearest" in result.summary
    assert result.metrics["loss"] < 0.2 < result.metrics["unigram"]  # it copies: far below the unigram entropy


def test_forwards_are_one_per_candidate_plus_the_copy_evidence(healthy):
    _, result, forwards = healthy
    candidates = 1 + len(result.details["candidates"])
    # the configuration's first rows and their destroyed twins, its other rows, then one per alternative: the copy
    # evidence of repeated sequences is read from the same forwards
    assert forwards == candidates + 1


def test_the_model_is_restored_bitwise(healthy, tmp_path):
    subject = load_subject(str(FIXTURE))
    ids = subject.sample_ids(2, 24, 5)
    with torch.inference_mode():
        before = subject.model(input_ids=ids).logits.clone()
    weights = {n: p.detach().clone() for n, p in subject.model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in subject.model.named_buffers()}
    fit(subject)
    with torch.inference_mode():
        after = subject.model(input_ids=ids).logits
    assert torch.equal(before, after)
    assert all(torch.equal(weights[n], p) for n, p in subject.model.named_parameters())
    assert all(torch.equal(buffers[n], b) for n, b in subject.model.named_buffers())


@pytest.mark.parametrize("plant, names", [
    (lambda src, dst: theta_lost(src, dst, theta=1000.0), "rope_theta ~ "),
    (interleaved_qk, "q/k rows in the interleaved pairing order"),
    (spurious_scaling, "no rope scaling"),
])
def test_planted_copies_fail_naming_the_alternative(tmp_path, plant, names):
    broken = load_subject(str(plant(FIXTURE, tmp_path / "broken")))
    result = fit(broken)
    assert result.status is Status.FAIL, result.summary
    assert f"the weights fit {names}" in result.summary, result.summary
    assert result.metrics["z"] >= 5 and -result.metrics["margin"] >= 0.03
    assert "copy accuracy at distance 15" in result.summary
    assert (FIXTURE / "model.safetensors").stat().st_size < 1_000_000  # the fixture itself untouched


@pytest.mark.parametrize("family, init", [(f, "default") for f in ("llama", "gpt2", "qwen2", "gemma3", "phi",
                                                                    "gpt_neox", "opt", "bloom")]
                         + [("gpt2", "strong"), ("llama", "strong")])
def test_untrained_models_are_settled_after_one_forward(family, init):
    """At chance (default init): the context gain over the destroyed twin, paired by target token, is bounded within
    +-0.4 nats by the first row and its twin alone (one forward); built in memory, nothing was trained: N/A, which
    never fails a gate. Confidently wrong (large random weights): the paired gains spread widely, so the first row
    cannot always settle it; with the whole material and a twin of all of it (three forwards at most) they either
    bound the gain within +-0.4 nats (N/A) or neither bound it nor put it above 0 (SKIP, saying it cannot tell).
    Never a verdict either way."""
    from posdiag.checks.fit.screen import UNTRAINED_GAIN

    subject = from_module(zoo.tiny_model(family, init=init))
    start = subject.forward_count
    result = fit(subject)
    gain, spread = result.metrics["context_gain"], result.metrics["context_gain_error"]
    if init == "default":
        assert result.status is Status.NA, result.summary
        assert "predicts like an untrained one" in result.summary
        assert "settled on the screen's first row" in result.summary and "built in memory" in result.summary
        assert subject.forward_count - start == 1
    else:
        assert subject.forward_count - start <= 3
        if abs(gain) + 3 * spread < UNTRAINED_GAIN:
            assert result.status is Status.NA and "predicts like an untrained one" in result.summary, result.summary
        else:
            assert result.status is Status.SKIP, result.summary
            assert "cannot tell whether the model is trained" in result.summary, result.summary
    assert abs(gain) < 3 * spread + UNTRAINED_GAIN


def test_the_screen_is_an_equivalence_test():
    """Untrained only when the gain's interval lies within +-0.4 nats; trained when it lies above 0; a wide interval
    around a positive gain (the Welch screen's +1.58 at z = 4.7) is neither, so more material is scored."""
    from posdiag.checks.fit.screen import Screen

    assert Screen(0.01, 0.02, 100, 5.0, 5.0).untrained
    assert Screen(0.144, 0.018, 1023, 10.9, 11.0).untrained  # fresh SmolLM2 weights on Python's LICENSE.txt
    assert not Screen(0.3, 0.05, 100, 5.0, 5.0).untrained and not Screen(0.3, 0.15, 100, 5.0, 5.0).trained
    assert Screen(1.579, 0.336, 256, 6.0, 7.6).trained and not Screen(1.579, 0.6, 256, 6.0, 7.6).trained
    assert "cannot tell" in Screen(0.3, 0.2, 256, 6.0, 6.3).reason() and Screen(2.0, 0.1, 9, 3, 5).reason() == ""


def test_the_screen_pairs_each_twin_target_with_the_same_token():
    """Shuffled text: the twin's targets are a permutation of the material's, so each pairs with the same token; a
    model whose loss depends on the token alone gains exactly 0 with no spread."""
    import numpy as np

    from posdiag.checks.fit.judging import Scored
    from posdiag.checks.fit.screen import context_screen

    targets = np.array([5, 7, 5, 9, 11, 7, 3])
    loss = {3: 1.0, 5: 2.0, 7: 4.0, 9: 8.0, 11: 0.5}
    order = np.array([6, 2, 0, 4, 1, 3, 5])
    mine = Scored("c", np.array([loss[t] for t in targets]), np.zeros(7, bool), targets)
    twin = Scored("t", np.array([loss[t] for t in targets[order]]), np.zeros(7, bool), targets[order])
    screen = context_screen(mine, twin)
    assert screen.gain == 0 and screen.spread == 0 and screen.untrained


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
def test_an_untrained_checkpoint_is_na_only_where_its_weights_are_at_init(name, fixtures_dir, tmp_path):
    """Checkpoints saved at transformers' default init (two families; GPT-2's output projections at a scaled-down
    spread): the screen finds no context gain and every weight is as initialised (norm weights and biases constant,
    matrices at the init's spread): N/A, nothing trained to fit. The same weights with their norm weights moved
    (as any training moves them) still predict like an untrained model but are a SKIP: weights that do not use their
    context may be a trained model broken past use, which `--fail-on skip` must still catch."""
    from safetensors.torch import load_file, save_file

    result = fit(load_subject(str(fixtures_dir / name)))
    assert result.status is Status.NA and "predicts like an untrained one" in result.summary, result.summary
    assert "as transformers initialises them" in result.summary and "built in memory" not in result.summary
    moved = tmp_path / name
    shutil.copytree(fixtures_dir / name, moved)
    weights = load_file(moved / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for key, value in weights.items():
        if value.ndim == 1 and ("norm" in key or "ln" in key) and key.endswith("weight"):
            weights[key] = value * (1 + 0.05 * torch.randn(value.shape, generator=generator))
    save_file(weights, moved / "model.safetensors", metadata={"format": "pt"})
    result = fit(load_subject(str(moved)))
    assert result.status is Status.SKIP and "predicts like an untrained one" in result.summary, result.summary
    assert "initialises" not in result.summary


@pytest.mark.parametrize("family, kind", [("bert", "encoder"), ("t5", "seq2seq")])
def test_masked_and_seq2seq_models_are_not_applicable(family, kind):
    """By design: fit scores next-token predictions of plain text; an encoder makes none, an encoder-decoder
    predicts from an input fit does not have. N/A, not a SKIP: `--fail-on skip` passes every BERT and T5."""
    result = fit(from_module(zoo.tiny_model(family)))
    assert result.status is Status.NA and result.summary, result.summary
    assert ("predicts no next token" if kind == "encoder" else "an encoder-decoder (seq2seq)") in result.summary


def test_a_factory_model_without_a_config_is_not_applicable():
    from posdiag.model.loading import load_subject as load

    result = fit(load("fixtures.custom_model:healthy"))
    assert result.status is Status.NA and "no configuration to vary" in result.summary, result.summary


def test_alternatives_cover_each_layer_type_and_partial_rotary():
    gemma3 = from_module(zoo.tiny_model("gemma3"))
    labels = [a.label for a in plan_alternatives(gemma3)[0]]
    assert "bases swapped" in labels
    assert {"rope_theta x10 (sliding_attention)", "rope_theta x10 (full_attention)"} <= set(labels)
    neox = from_module(zoo.tiny_model("gpt_neox"))
    assert "full rotary" in [a.label for a in plan_alternatives(neox)[0]]
    gpt2 = from_module(zoo.tiny_model("gpt2"))
    assert [a.shift for a in plan_alternatives(gpt2)[0]] == [-2, -1, 1, 2]


def test_every_alternative_applies_and_restores_on_zoo_models():
    """Each alternative either changes the logits and is undone exactly, or says why it cannot apply."""
    for family in ("llama", "gemma3", "gpt_neox", "phi", "qwen3", "cohere"):
        subject = from_module(zoo.tiny_model(family, init="strong"))
        ids = subject.sample_ids(1, 16, 0)
        with torch.inference_mode():
            before = subject.model(input_ids=ids).logits.clone()
        for alt in plan_alternatives(subject)[0]:
            try:
                with alt.apply(subject), torch.inference_mode():
                    during = subject.model(input_ids=ids).logits
            except Exception as exc:
                assert type(exc).__name__ == "NotApplicable", (family, alt.label, exc)
                continue
            assert not torch.equal(during, before), (family, alt.label)
            with torch.inference_mode():
                assert torch.equal(subject.model(input_ids=ids).logits, before), (family, alt.label)


def test_pairing_permutations_are_inverse():
    for d, r in ((64, 64), (16, 8)):
        assert torch.equal(deinterleave(d, r)[interleave(d, r)], torch.arange(d))
    assert deinterleave(8, 8).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


def test_chunked_reduction_matches_log_softmax_and_bounds_rows():
    logits = torch.randn(3, 600, 50, dtype=torch.float64)
    targets = torch.randint(0, 50, (3, 600))
    targets[0, :5] = -1
    logprob, hit = reduce_logits(logits, targets)
    want = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    keep = targets >= 0
    assert torch.allclose(logprob[keep], want[keep], atol=1e-12) and torch.isnan(logprob[~keep]).all()
    assert torch.equal(hit, (logits.argmax(-1) == targets) & keep)
    assert rows_per_chunk(1024, 49152) == 1 and rows_per_chunk(32, 128) > 1000


def test_score_targets_runs_rows_in_chunks(healthy):
    subject = healthy[0]
    ids = subject.sample_ids(5, 20, 1)
    targets = torch.cat([ids[:, 1:], torch.full((5, 1), -1)], dim=1)
    start = subject.forward_count
    chunked = score_targets(subject, ids, targets, budget=2 * 20 * subject.vocab_size * 4)
    assert subject.forward_count - start == 3  # 2 + 2 + 1 rows
    whole = score_targets(subject, ids, targets)
    assert torch.allclose(chunked.logprob.nan_to_num(), whole.logprob.nan_to_num(), atol=1e-5)
    assert not math.isnan(float(chunked.logprob[0, 0]))


def test_trained_models_with_broken_positions_are_not_called_untrained(tmp_path):
    """The screen's premise: a trained model predicts its material far better than the destroyed twin even with
    its positions broken (the q/k rows interleaved: loss above chance), so the alternatives run."""
    from posdiag.checks.fit.judging import score
    from posdiag.checks.fit.material import destroyed, plan_material
    from posdiag.checks.fit.screen import context_screen
    from posdiag.options import RunOptions

    broken = load_subject(str(interleaved_qk(FIXTURE, tmp_path / "broken")))
    material = plan_material(broken, RunOptions(), {})
    configured, twin = score(broken, material, "configured"), score(broken, destroyed(broken, material, 0), "twin")
    assert configured.loss > math.log(broken.vocab_size)  # confidently wrong: a chance criterion would not tell
    assert context_screen(configured, twin).trained
    assert twin.loss - configured.loss > 1.0


def test_destroyed_twins_keep_the_targets_and_take_their_context_away():
    """Repeated sequences: the same targets, the first copy replaced; text: the same tokens, first kept, shuffled."""
    from posdiag.checks.fit.material import Material, destroyed, repeated_sequences

    subject = from_module(zoo.tiny_model("llama"))
    copies = repeated_sequences(subject, 0, 64)
    twin = destroyed(subject, copies, 0)
    assert torch.equal(twin.targets, copies.targets) and twin.distances == copies.distances
    for r, n in enumerate(copies.distances):
        start = int((copies.targets[r] >= 0).nonzero()[0, 0])
        assert not torch.equal(twin.ids[r, start - n:start], copies.ids[r, start - n:start])
        assert torch.equal(twin.ids[r, start:], copies.ids[r, start:])
    row = torch.arange(1, 301)[None]
    text = Material(row, torch.cat([row[:, 1:], torch.full((1, 1), -1)], dim=1), "text", 5.0)
    shuffled = destroyed(subject, text, 0)
    assert shuffled.ids.shape == (1, 257) and int(shuffled.ids[0, 0]) == 1
    assert sorted(shuffled.ids[0].tolist()) == list(range(1, 258)) and shuffled.count == 256
    assert not torch.equal(shuffled.ids, row[:, :257])


def test_no_candidate_below_the_unigram_entropy_skips():
    """The second guard, after the alternatives: a model that uses no context beyond token frequencies."""
    import numpy as np

    from posdiag.checks.fit.judging import Scored, below_unigram

    flat = Scored("best", np.full(100, 4.0), np.zeros(100, dtype=bool))
    assert "own frequencies" in below_unigram(flat, unigram=4.05)
    assert below_unigram(flat, unigram=4.2) == ""


def test_text_option_replaces_the_shipped_prose(tmp_path):
    from posdiag.checks.fit.material import plan_material
    from posdiag.cli._flow import text_of
    from posdiag.options import RunOptions

    doc = tmp_path / "doc.txt"
    doc.write_text("A document of my own.", encoding="utf-8")
    assert text_of(str(doc)) == "A document of my own." and text_of("plain words") == "plain words"
    subject = load_subject(str(FIXTURE))
    material = plan_material(subject, RunOptions(token_ids=tuple(range(4, 30))), {})
    assert material.source == "text (--text, 26 tokens)" and material.count == 25
    assert plan_material(subject, RunOptions(), {}).source.startswith("repeated random sequences")


def test_shipped_prose_is_package_data():
    from importlib import resources

    text = resources.files("posdiag.data").joinpath("prose.txt").read_text(encoding="utf-8")
    assert len(text.split()) > 1000
    pyproject = (FIXTURE.parent.parent / "pyproject.toml").read_text()
    assert "[tool.setuptools.package-data]" in pyproject and '"posdiag.data" = ["*.txt"]' in pyproject


@pytest.mark.parametrize("configured", [1000.0, 200.0])
def test_the_line_search_names_the_trained_base_and_its_interval(tmp_path, configured):
    """Trained at rope_theta 10000: configured at 1/10 of it the grid's x10 is exact; at 1/50 the grid's nearest
    point is x10 (2000), and the line search walks on to the value the weights fit."""
    import re

    broken = load_subject(str(theta_lost(FIXTURE, tmp_path / "broken", theta=configured)))
    result = fit(broken)
    assert result.status is Status.FAIL, result.summary
    found = re.search(r"rope_theta ~ ([0-9.e+]+) \(line search: ([0-9.e+]+) to ([0-9.e+]+) fit as well\)",
                      result.summary)
    assert found, result.summary
    value, lo, hi = (float(g) for g in found.groups())
    assert 5000 <= value <= 20000 and lo <= value <= hi and lo <= 10000 * 1.8 and hi >= 10000 / 1.8, result.summary
    assert 0 < result.metrics["line_search_forwards"] <= 4


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_window_alternatives_change_the_mask_and_restore_it(family):
    """A declared window is varied (none, half, double) on material that passes it: each alternative changes the
    logits of a row longer than the window, and the model is put back exactly; a row within it is not varied."""
    subject = from_module(zoo.tiny_model(family, init="strong", sliding_window=16))
    alts, notes = plan_alternatives(subject, 64)
    windows = [a for a in alts if "window" in a.label]
    assert [a.label for a in windows] == ["no window", "window x0.5", "window x2"], notes
    assert windows[0].fits == "no sliding window" and windows[0].configured == "the declared 16-token window"
    ids = subject.sample_ids(1, 64, 0)
    with torch.inference_mode():
        before = subject.model(input_ids=ids).logits.clone()
        for alt in windows:
            with alt.apply(subject):
                assert not torch.equal(subject.model(input_ids=ids).logits, before), alt.label
            assert torch.equal(subject.model(input_ids=ids).logits, before) and subject.sliding_window == 16
    assert not [a for a in plan_alternatives(subject, 16)[0] if "window" in a.label]
    assert "do not pass the declared 16-token window" in "; ".join(plan_alternatives(subject, 16)[1])


WINDOWED = Path(__file__).resolve().parent.parent / "fixtures" / "window-text"


def test_a_window_dropped_from_the_config_fails_fit_naming_it(tmp_path):
    """window-text (fixtures/train_window_model.py) was trained with a 16-token window. Converted without it, every
    query sees keys at distances it never learned: measured 4.35 nats a character on the shipped prose against 2.77
    with its window. The healthy twin declares the window; the no-window, x0.5 and x2 alternatives lose to it."""
    healthy = fit(load_subject(str(WINDOWED)))
    broken = fit(load_subject(str(window_declared(WINDOWED, tmp_path / "window-dropped", None))))
    assert healthy.status is Status.PASS, healthy.summary
    assert {"no window", "window x0.5", "window x2"} <= {c["label"] for c in healthy.details["candidates"]}
    assert broken.status is Status.FAIL, broken.summary
    assert broken.summary.startswith("the weights fit a 16-token sliding window, not no sliding window (none "
                                     "declared)"), broken.summary
    assert broken.metrics["z"] >= 10


def test_windows_are_tried_only_where_the_config_has_the_field():
    """Llama has no sliding_window field: no window alternatives (a model it describes was not trained with one);
    Qwen2 turns windows off by use_sliding_window: none either; Mistral with `sliding_window: null`, or with a
    window wider than the material's rows: 16, 64, 256... and the largest power of two up to half the rows."""
    def windows(family, length, **overrides):
        subject = from_module(zoo.tiny_model(family, **overrides))
        alts = [a for a in plan_alternatives(subject, length)[0] if a.label.startswith("window")]
        return [a.label for a in alts], {a.configured for a in alts}

    assert windows("llama", 1023)[0] == [] and windows("qwen2", 1023, use_sliding_window=False)[0] == []
    assert windows("mistral", 1023, sliding_window=None) == (["window 16", "window 64", "window 256"],
                                                             {"no sliding window (none declared)"})
    assert windows("mistral", 1024, sliding_window=32768, max_position_embeddings=65536) == (
        ["window 16", "window 64", "window 256", "window 512"],
        {"the declared 32768-token window, which the material's 1024-token rows never reach"})


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """window-text as shipped and with its window dropped, loaded once, and the tokenizer that turns --text into ids."""
    from posdiag.model.tokenizer import load_tokenizer

    healthy = load_subject(str(WINDOWED))
    dropped = load_subject(str(window_declared(WINDOWED, tmp_path_factory.mktemp("fit") / "dropped", None)))
    tokenizer, _ = load_tokenizer(healthy)
    return healthy, dropped, lambda text: tuple(int(i) for i in tokenizer(text)["input_ids"])


def test_a_one_sentence_text_is_a_skip_saying_how_much_text_would_decide(windowed):
    """`check fixtures/window-text --text "The quick brown fox..."` FAILed "does not predict text under any
    configuration tried": on 43 characters the best loss (3.66 nats) lies above the sentence's own unigram entropy
    (3.07), at z = 1.2 with per-character losses spread ~3 nats. Neither twin is decided on it; each SKIP says how
    many tokens would decide at the measured gain and spread."""
    from posdiag.options import RunOptions

    healthy, dropped, ids = windowed
    fox = RunOptions(token_ids=ids("The quick brown fox jumps over the lazy dog."))
    for subject in (healthy, dropped):
        result = fit_with(subject, fox)
        assert result.status is Status.SKIP, result.summary
        assert result.summary.startswith("cannot tell from 43 tokens (--text) whether this checkpoint predicts text")
        needed = int(result.summary.split("about ")[1].split(" tokens would decide")[0])
        assert needed > 43 and "without --text fit scores its shipped prose" in result.summary


def test_a_paragraph_of_text_decides_both_ways(windowed):
    """279 characters of prose as --text: the healthy model PASSes, the twin without its window FAILs naming the
    16-token window (measured z = 9.5)."""
    from importlib import resources

    from posdiag.options import RunOptions

    healthy, dropped, ids = windowed
    prose = resources.files("posdiag.data").joinpath("prose.txt").read_text(encoding="utf-8")
    paragraph = RunOptions(token_ids=ids(prose[prose.index("Volunteers filled"):prose.index("A good recipe")].strip()))
    assert fit_with(healthy, paragraph).status is Status.PASS
    broken = fit_with(dropped, paragraph)
    assert broken.status is Status.FAIL and broken.summary.startswith("the weights fit a 16-token sliding window")


def fit_with(subject, options):
    return api.run_checks(subject, ["fit"], options).checks[0]


def _scored(losses, targets):
    import numpy as np

    from posdiag.checks.fit.judging import Scored

    return Scored("candidate", np.asarray(losses, dtype=float), np.zeros(len(losses), dtype=bool),
                  np.asarray(targets))


def test_predicting_no_text_is_a_fail_only_beyond_noise():
    """The same excess over the unigram entropy (+0.5 nats, per-target spread 2) is a FAIL over 400 targets
    (z = 5.0) and a SKIP over 24 (z = 1.2), whose reason says how many targets would reach z = 3: 24 (3 / 1.2)^2."""
    import numpy as np

    from posdiag.checks.fit.undecided import predicts_no_text

    for n, verdict in ((400, "fail"), (24, "skip")):
        targets = np.arange(n) % 4  # four tokens, equally frequent: unigram surprisal log 4 for every target
        losses = math.log(4) + 0.5 + 2.0 * np.where(np.arange(n) % 2, 1.0, -1.0)
        material = Material(torch.zeros(1, n, dtype=torch.long), torch.zeros(1, n), "text (--text)", math.log(4))
        broken, cannot = predicts_no_text([_scored(losses, targets)], material)
        assert bool(broken) is (verdict == "fail") and bool(cannot) is (verdict == "skip"), (broken, cannot)
    assert "z = 1.2" in cannot and "about 151 tokens would decide" in cannot


def test_a_gain_short_of_the_bound_is_undecided_not_a_pass():
    """An alternative gaining more than MIN_GAIN at z < Z_BOUND: the material cannot confirm it, so no PASS (the
    window-dropped twin on 99 characters of prose PASSed with its fix at +1.45 nats, z = 4.4)."""
    from posdiag.checks.fit.alternatives import Alternative
    from posdiag.checks.fit.judging import MIN_GAIN, Z_BOUND, Comparison
    from posdiag.checks.fit.undecided import undecided

    material = Material(torch.zeros(1, 100, dtype=torch.long), torch.zeros(1, 100), "text (--text, 100 tokens)", 3.0)
    scored = _scored([1.0] * 99, [0] * 99)
    alt = Alternative("window 16", "a 16-token sliding window", "no sliding window")
    open_ = Comparison(alt, scored, gain=10 * MIN_GAIN, z=Z_BOUND / 2)
    assert "cannot decide on 100 tokens (--text): window 16 gains" in undecided([open_], material)
    assert "about 400 tokens would decide" in undecided([open_], material)
    for settled in (Comparison(alt, scored, 10 * MIN_GAIN, Z_BOUND), Comparison(alt, scored, MIN_GAIN / 2, 4.0),
                    Comparison(alt, scored, -1.0, -3.0)):
        assert undecided([settled], material) == ""


def test_copy_stages_split_the_targets_and_the_bound_is_exact():
    """Stages hold about a quarter of the targets each (whole rows); a candidate is out of reach only when copying
    every target not yet scored would still leave it under COPY_TRAINED."""
    import numpy as np

    from posdiag.checks.fit import copying
    from posdiag.checks.fit.judging import COPY_TRAINED, Scored

    targets = torch.full((8, 12), -1)
    targets[:, 2:12] = 1  # 10 targets a row, 80 in all
    material = Material(torch.zeros(8, 12, dtype=torch.long), targets, "repeated random sequences", 1.0, (10,) * 8)
    assert copying.stage_rows(material) == [2, 4, 6, 8]
    hits = np.zeros(20, dtype=bool)
    hits[:12] = True  # 12 of the first 20: 60%
    part = Scored("alt", np.zeros(20), hits)
    assert COPY_TRAINED == (12 + 60) / 80 and not copying.out_of_reach(part, 80)  # every later hit reaches it
    hits[11] = False
    assert copying.out_of_reach(Scored("alt", np.zeros(20), hits), 80)


@pytest.mark.parametrize("plant", [lambda src, dst: theta_lost(src, dst, theta=1000.0), interleaved_qk])
def test_stopping_alternatives_early_changes_no_verdict(tmp_path, plant, monkeypatch):
    """A broken copier copies little under its configuration, so its alternatives run stage by stage; the fix stays
    in reach, the others stop, and then score their remaining rows: every figure is the one scoring each alternative
    on the whole material gives."""
    import posdiag.checks.fit as fit_module
    from posdiag.checks.fit import copying

    broken = load_subject(str(plant(FIXTURE, tmp_path / "broken")))
    rows = []  # the rows of each scoring forward
    score = fit_module.score
    monkeypatch.setattr(fit_module, "score", lambda subject, material, *a: rows.append(material.ids.shape[0])
                        or score(subject, material, *a))
    staged = fit(broken)
    assert min(rows) < max(rows)  # stage by stage (the line search's points score every row at once)
    monkeypatch.setattr(copying, "STAGES", 1)
    rows.clear()
    whole = fit(broken)
    assert min(rows) == max(rows)
    assert staged.status is whole.status is Status.FAIL, staged.summary
    assert staged.summary == whole.summary and staged.metrics == whole.metrics
    assert staged.details["candidates"] == whole.details["candidates"]
