"""INT8 weight-only linear, the contract and its torch reference.

Layout: weight_q [out, in] int8 (row-major, one output row per row), scale [out] fp32, per
output row, symmetric: W[n, k] ~= weight_q[n, k] * scale[n], scale = max |W[n, :]| / 127
(a zero row gets scale 0... stored as 1 so the division is defined; its codes are 0).
Round to nearest, ties away from zero (torch.round rounds half to even: the difference is
one code on exact halves, which never matters for the error bound |W - Wq| <= scale / 2).

y [..., out] = x [..., in] @ (weight_q * scale[:, None])^T, accumulated in fp32, one rounding
to x's dtype. The Triton GEMV (int8_gemv_triton.py) and this reference agree to fp32
summation order.
"""

from __future__ import annotations

import torch

QMAX = 127
DEQUANT_CHUNK_ROWS = 2048  # output rows dequantized at a time (4096 inputs: a 32 MiB fp32 temp)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight_q int8 [out, in], scale fp32 [out]) of a float weight [out, in], on its device.
    Works row chunk by row chunk so that a 1 GiB head needs no fp32 copy of itself."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a 2-D float tensor, got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    out, _ = weight.shape
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(out, dtype=torch.float32, device=weight.device)
    for n0 in range(0, out, DEQUANT_CHUNK_ROWS):
        w = weight[n0:n0 + DEQUANT_CHUNK_ROWS].float()
        s = w.abs().amax(dim=1) / QMAX
        s = torch.where(s > 0, s, torch.ones_like(s))
        r = w / s[:, None]
        q[n0:n0 + DEQUANT_CHUNK_ROWS] = (r.sign() * (r.abs() + 0.5).floor()).clamp_(
            -QMAX, QMAX).to(torch.int8)
        scale[n0:n0 + DEQUANT_CHUNK_ROWS] = s
    return q, scale


def dequantize_rows(weight_q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                    n0: int = 0, n1: int | None = None) -> torch.Tensor:
    """Rows [n0, n1) of the float weight, in dtype (the product rounded once)."""
    n1 = weight_q.shape[0] if n1 is None else n1
    return (weight_q[n0:n1].float() * scale[n0:n1, None]).to(dtype)


def int8_linear_ref(x: torch.Tensor, weight_q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The exact reference: fp32 products of x and the dequantized rows, x's dtype out."""
    w = weight_q.float() * scale[:, None]
    return (x.float() @ w.t()).to(x.dtype)


def int8_linear_chunked(x: torch.Tensor, weight_q: torch.Tensor,
                        scale: torch.Tensor) -> torch.Tensor:
    """y = x @ W^T for any number of rows and any device: W dequantized to x's dtype
    DEQUANT_CHUNK_ROWS output rows at a time, each chunk one matmul (cuBLAS / the CPU's)."""
    out = weight_q.shape[0]
    y = torch.empty(*x.shape[:-1], out, dtype=x.dtype, device=x.device)
    for n0 in range(0, out, DEQUANT_CHUNK_ROWS):
        n1 = min(out, n0 + DEQUANT_CHUNK_ROWS)
        y[..., n0:n1] = x @ dequantize_rows(weight_q, scale, x.dtype, n0, n1).t()
    return y
