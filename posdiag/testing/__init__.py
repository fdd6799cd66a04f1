"""Test support: the tiny-model zoo and the pytest plugin."""
