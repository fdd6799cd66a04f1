"""A port's error profile: its shape names a cause only for a profile that already stands above the band.

The band is FAIL_RATIO floors for the profile as a whole (root mean square of the errors over that of the floors).
A position over its own tolerance inside a profile within the band is rounding at an ill-conditioned position: the
healthy SmolLM2 Q4_1 file's F32 twin gave 1.7e-5 at position 1 against ~7e-7 elsewhere (the profile 1.82x its
floor) and FAILed "grows with position from 1". Both ways, on synthetic profiles and through compare_engine.
"""

import pytest
import torch
from engines_demo import TorchEngine
from plants_compare import copy_of

from posdiag.model.loading import from_module
from posdiag.options import RunOptions
from posdiag.ports.engines.logits_only import as_engine
from posdiag.ports.logits import compare_engine
from posdiag.ports.logits.shapes import judge_profile, profile_ratio
from posdiag.results import Status
from posdiag.testing import zoo

FLOOR = 7e-7
N = 64


def _profile(at1: float, rest: float) -> torch.Tensor:
    """Position 0 at the floor, position 1 at AT1, every later position at REST (float64)."""
    return torch.tensor([0.9 * FLOOR, at1] + [rest] * (N - 2), dtype=torch.float64)


def test_a_profile_within_the_band_that_rises_at_position_1_is_no_shape():
    e = _profile(1.7e-5, FLOOR)  # 24x its floor at position 1, the profile ~3x: the healthy twin
    out = judge_profile(e, 10 * FLOOR, {})
    assert profile_ratio(e, torch.full((N,), 10 * FLOOR, dtype=torch.float64)) < 10
    assert out["pattern"] == "none", out
    assert out["positions_over"] == 1 and out["worst_position"] == 1
    assert "rounding at ill-conditioned positions" in out["why"]


def test_a_profile_above_the_band_that_grows_is_named_growing():
    e = torch.tensor([0.9 * FLOOR] + [FLOOR * 30 * t / N for t in range(1, N)], dtype=torch.float64)
    out = judge_profile(e, 10 * FLOOR, {})
    assert out["profile_ratio"] > 10
    # over its tolerance from position 22 (30 t / 64 > 10); the rise before it names the growth (GROWS_FRACTION)
    assert out["pattern"] == "grows with position" and out["onset_position"] == 22, out


def test_a_position_not_computed_is_never_within_the_band():
    e = torch.full((N,), FLOOR, dtype=torch.float64)
    e[N // 2:] = float("nan")  # the engine's context ended: a boundary, whatever the rest's ratio
    assert judge_profile(e, 10 * FLOOR, {})["pattern"] == "step at a length"


class _Bumped:
    """A healthy engine whose logits are scaled by (1 + bump[t]) at position t (a rounding-sized wobble or a
    growing error, by the profile given)."""

    def __init__(self, engine: TorchEngine, bump: torch.Tensor):
        self.engine, self.bump = engine, bump

    def logits(self, ids):
        out = torch.as_tensor(self.engine.logits(ids)).double()
        return (out * (1 + self.bump[: out.shape[0], None])).float()


@pytest.fixture(scope="module")
def llama():
    return zoo.tiny_model("llama", init="strong")


def test_compare_passes_one_ill_conditioned_position_and_fails_a_growth(llama):
    reference = from_module(llama, name="reference")
    healthy = compare_engine(reference, as_engine(TorchEngine(copy_of(llama), "copy"), "e"), RunOptions(seq_len=N))
    floor = healthy.result.metrics["noise_floor"]
    one = torch.zeros(N, dtype=torch.float64)
    one[1] = 25 * floor
    wobble = compare_engine(reference, as_engine(_Bumped(TorchEngine(copy_of(llama), "copy"), one), "e"),
                            RunOptions(seq_len=N)).result
    layer = wobble.details["layers"][0]
    assert layer["positions_over"] >= 1 and layer["worst_position"] == 1  # over its own tolerance, as planted
    assert wobble.status is Status.PASS, wobble.summary
    assert "as a whole (logits: 1 of 64 positions over their own tolerance" in wobble.summary
    grows = torch.tensor([0.0] + [25 * floor] * (N - 1), dtype=torch.float64)  # from the first token that sees another
    growth = compare_engine(reference, as_engine(_Bumped(TorchEngine(copy_of(llama), "copy"), grows), "e"),
                            RunOptions(seq_len=N)).result
    assert growth.status is Status.FAIL, growth.summary
    assert growth.details["pattern"] == "grows with position" and growth.details["onset_position"] == 1
    assert "error grows with position from 1" in growth.summary
