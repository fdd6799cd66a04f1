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
