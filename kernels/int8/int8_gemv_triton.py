"""Triton INT8 weight-only GEMV: y [M, N] = x [M, K] @ (weight_q * scale)^T for a few rows of
x (decode, the last position of a prefill chunk). Contract: kernels/int8/int8_ref.py.

Memory-bound: every int8 row of W is read once per program (one program per BLOCK_N output
rows and per row of x; the M <= GEMV_MAX_ROWS rows of x share W through L2), dequantized as
float(q) in registers, multiplied with x in fp32, and scaled once per output at the end
(scale [N] fp32: y[n] = scale[n] * sum_k q[n, k] x[k]). For the 128,256 x 4,096 head of a
Llama-3 model that is 525 MB a token instead of the fp16 head's 1,050 MB. Deterministic (no
split-K, fixed summation order), CUDA-graph capturable (allocates only y).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GEMV_MAX_ROWS = 16  # more rows of x: int8_ref.int8_linear_chunked (dequantize + matmul)
BLOCK_N = 16
BLOCK_K = 512


@triton.jit(do_not_specialize=["N", "K", "stride_xm", "stride_ym"])
def _int8_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, stride_xm, stride_ym,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    rows = offs_n.to(tl.int64) * K  # N * K passes 2^31 for a 128K-vocab head
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < K
        x = tl.load(x_ptr + m * stride_xm + kk, mask=mask_k, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None] + kk[None, :], mask=mask_n[:, None] & mask_k[None, :],
                    other=0).to(tl.float32)
        acc += w * x[None, :]
    s = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)
    y = tl.sum(acc, axis=1) * s
    tl.store(y_ptr + m * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)


def int8_gemv(x2: torch.Tensor, weight_q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x2 [M, K] (M <= GEMV_MAX_ROWS, unit stride along K) -> y [M, N] in x2's dtype."""
    m, k = x2.shape
    n = weight_q.shape[0]
    if weight_q.shape[1] != k or not weight_q.is_contiguous() or x2.stride(1) != 1:
        raise ValueError(f"int8_gemv: x {tuple(x2.shape)} (stride {x2.stride()}) does not fit "
                         f"a contiguous weight {tuple(weight_q.shape)}")
    y = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    _int8_gemv_kernel[(triton.cdiv(n, BLOCK_N), m)](x2, weight_q, scale, y, n, k, x2.stride(0),
                                                    y.stride(0), BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return y
