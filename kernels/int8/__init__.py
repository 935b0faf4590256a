"""INT8 weight-only linear kernels (the output head of small-card profiles): per-row symmetric
quantization and the torch reference (int8_ref.py), the Triton GEMV (int8_gemv_triton.py)."""
