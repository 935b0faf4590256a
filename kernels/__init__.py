"""Compute kernels: torch references (any device) and Triton kernels (CUDA).

Mapped into `hisparse_cli.kernels` on purpose: a PyPI distribution named `kernels` is probed
by transformers, so this folder is never a top-level package. `dispatch.py` is the one place
that chooses an implementation; nothing else imports triton.
"""
