"""What every check on half-precision weights must show (posdiag.half_precision): decided in float32, where
its one-position slip stands far above the floor, and, for an agreement check, its paths once more as stored."""

from posdiag.verdict import AS_RUN_RATIO


def assert_decided_in_float32(result, stored: str = "bfloat16", stored_pass: bool = True) -> None:
    dtypes = result.details["dtypes"]
    assert dtypes["decided_in"] == "float32", dtypes
    assert "decided in float32" in result.summary, result.summary
    slip = result.details.get("slip")
    if isinstance(slip, dict) and slip.get("error") is not None:
        assert slip["dtype"] == "float32" and slip["ratio"] > 10, slip  # the PASS could have failed, in float32
    if stored_pass:
        assert dtypes["as_stored"] == stored, dtypes
        ran = dtypes["stored_pass"]
        assert ran["status"] in ("pass", "fail", "warn"), ran  # it ran and was judged
        if result.status.value == "pass":
            assert ran["ratio"] < AS_RUN_RATIO, ran


def assert_healthy_with_power(result, dtype: str) -> None:
    """A healthy twin's PASS that could have failed: its one-position slip, measured in float32 (bfloat16 weights are
    held in float32 to decide), stands above the band; bfloat16 weights also show their stored pass."""
    assert result.status.value == "pass", result.summary
    slip = result.details["slip"]
    assert slip["dtype"] == "float32" and slip["ratio"] > 10, slip
    if dtype == "bfloat16":
        assert_decided_in_float32(result)
