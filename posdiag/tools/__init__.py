"""Tools that stand beside the checks: RoPE math, synthetic attention, port comparison, the copy probe."""
