"""Torch references for the decoder's elementwise chains: RMSNorm, residual add + RMSNorm,
and rotate-half RoPE. These are the ops model/llama.py runs on the CPU (and under
HISPARSE_BACKEND=torch), and the oracles of kernels/norm_rope_triton.py.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] -> weight * (x / rms(x)): fp32 statistics, normalised x cast back to x's
    dtype, then the weight product in the dtype."""
    dtype = x.dtype
    if dtype == torch.float32:  # the same ops without the two no-op casts (CPU decode)
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rms_norm(s)) with s = x + y (the new residual stream, rounded to the dtype)."""
    s = x + y
    return s, rms_norm(s, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (any strides), cos/sin [T, D] -> rotate-half RoPE, a new [T, H, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
