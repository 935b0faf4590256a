"""RMSNorm, residual add, RoPE, silu * up: the torch reference (norm_rope_ref.py) and the
Triton kernels (norm_rope_triton.py)."""
