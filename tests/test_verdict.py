from posdiag.results import Status
from posdiag.verdict import FAIL_RATIO, PASS_RATIO, judge_position_signal, noise_floor


def test_floor_never_below_unit_roundoff():
    assert noise_floor(0.0, "float32") > 0
    assert noise_floor(1e-3, "float32") == 1e-3


def test_fp32_rounding_level_residual_fails():
    assert judge_position_signal(1.3e-7, 1.2e-7, "float32").status is Status.FAIL


def test_far_above_floor_passes():
    v = judge_position_signal(7e-3, 1.4e-7, "float32")
    assert v.status is Status.PASS and v.ratio > PASS_RATIO


def test_between_the_ratios_warns():
    floor = 1e-7
    assert judge_position_signal(floor * (FAIL_RATIO + PASS_RATIO) / 2, floor, "float32").status is Status.WARN


def test_half_precision_never_fails_on_a_small_ratio():
    v = judge_position_signal(1e-2, 8e-3, "bfloat16")
    assert v.status is Status.WARN and "inconclusive" in v.reason


def test_nan_fails():
    assert judge_position_signal(float("nan"), 1e-7, "float32").status is Status.FAIL


def test_band_helpers_ask_the_same_questions_as_the_judges():
    """The helpers checks use instead of FAIL_RATIO / PASS_RATIO agree with judge_agreement and
    judge_position_signal on both sides of each band, and a NaN is never within a band nor clears one."""
    from posdiag.verdict import (
        above_rounding,
        band_tolerance,
        clear_signal,
        judge_agreement,
        shrinks_with_precision,
        within_band,
        within_tolerance,
    )

    floor = 1e-6
    for ratio in (0.5, FAIL_RATIO, FAIL_RATIO * 1.01, PASS_RATIO, PASS_RATIO * 1.01):
        error = ratio * floor
        agrees = judge_agreement(error, floor, "float32").status is Status.PASS
        assert within_tolerance(error, floor) is agrees
        assert (error <= band_tolerance(floor)) is agrees
        assert within_band(ratio) is (ratio <= FAIL_RATIO)
        assert clear_signal(ratio) is (judge_position_signal(error, floor, "float32").status is Status.PASS)
        assert above_rounding(ratio) is (judge_position_signal(error, floor, "float32").status is not Status.FAIL)
    nan = float("nan")
    assert not within_tolerance(nan, floor) and not within_band(nan)
    assert not above_rounding(nan) and not clear_signal(nan)
    assert shrinks_with_precision(4.4e-7, 0.0) and not shrinks_with_precision(4.9e-2, 4.9e-2)
