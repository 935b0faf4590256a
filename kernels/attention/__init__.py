"""Attention kernels: the torch reference (attention_ref.py) and the Triton kernels beside it
(paged sparse attention, flash-style prefill, split-key decode, importance mass, K/V store)."""
