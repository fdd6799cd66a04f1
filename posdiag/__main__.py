"""`python -m posdiag` runs the command line."""

from posdiag.cli import app

app()
