"""compare's per-position marks say what they are: a bucket within a tolerance raised past the row's noise floor (a
quantised file judged within what its quantisation adds) is never drawn as noise."""

from posdiag.report.compare_console import AT_FLOOR, RAISED, sparkline
from posdiag.verdict import FAIL_RATIO


def test_a_raised_tolerance_is_not_drawn_as_the_noise_floor():
    floor, tolerance = 1e-6, 1e-1  # the logits row of a Q8_0 file: ratio ~1e4 to the float32 floor, a PASS
    values = [2e-2, 0.5 * FAIL_RATIO * floor, 2 * FAIL_RATIO * floor, 0.5]
    marks = sparkline(values, tolerance, floor).plain
    assert marks[:3] == RAISED + AT_FLOOR + RAISED and marks[3] not in (AT_FLOOR, RAISED), marks
    assert sparkline(values[:3], tolerance).plain == AT_FLOOR * 3  # no floor known: within tolerance, as before
