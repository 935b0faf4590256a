"""AWQ INT4 linear kernels: packing and layouts, the torch reference (awq_ref.py), the CPU
packed-int4 path (awq_cpu.py) and the Triton GEMV / GEMM / dequantize kernels."""
