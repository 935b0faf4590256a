"""Sampling the next token: on the host (host.py) for eager decodes."""
