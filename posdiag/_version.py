"""The version, in a module of its own so that results and the CLI can read it without importing the package API."""

__version__ = "0.1.0"
