"""Renderers: each consumes a finished Report and returns text; only the CLI decides where it goes."""
