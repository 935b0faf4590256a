"""FP8 (e4m3) activations for the INT4 prefill GEMMs on Hopper (W4A8): the contract and its
torch reference (w4a8_ref.py), the activation quantizer in Triton (act_quant_triton.py) and the
prefill product through cuBLAS's block-scaled FP8 GEMM (w4a8_linear.py)."""
