"""Torch references for the decoder's elementwise chains: RMSNorm, residual add + RMSNorm,
rotate-half RoPE, and the gated MLP's silu(gate) * up. These are the ops model/llama.py runs
on the CPU (and under HISPARSE_BACKEND=torch), and the oracles of
kernels/norm_rope/norm_rope_triton.py.
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


def silu_mul_(gu: torch.Tensor, inter: int) -> torch.Tensor:
    """gu [T, 2 inter] (gate | up, the stacked projection's output) -> its gate half, now
    silu(gate) * up, written in place: silu rounded to the dtype, then the product rounded
    (no temporaries beyond gu)."""
    h = torch.nn.functional.silu(gu[..., :inter], inplace=True)
    return h.mul_(gu[..., inter:])


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (any strides), cos/sin [T, D] -> rotate-half RoPE, a new [T, H, D]."""
    return rope_tabled(x, *rope_tables(cos, sin))


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, D] -> (cos, sin with the rotate-half sign folded in) [T, 1, D], the
    operands of `rope_tabled`: made once a forward pass, not per layer (the CPU decode path
    pays a few microseconds per dispatched op)."""
    half = cos.shape[-1] // 2
    return cos[:, None, :], torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)[:, None, :]


def rope_tabled(x: torch.Tensor, cos: torch.Tensor, sin_rot: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [T, H, D] from `rope_tables` operands, a new [T, H, D]:
    rotate_half(x) * sin = roll(x, D/2) * sin_rot, element by element the same products
    (only signs move), so bit-identical to x * cos + rotate_half(x) * sin."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_rot


def rope_store_kv(qkv: torch.Tensor, hq: int, hkv: int, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> torch.Tensor:
    """The stacked projection's output qkv [T, (hq + 2 hkv) D] -> rope of its q heads [T, hq,
    D]; rope of its k heads and its v heads are stored into the paged cache at slot_mapping
    (attention_ref.store_kv). The oracle of norm_rope_triton.rope_store_kv (and the op the
    engine runs without Triton)."""
    from hisparse_cli.kernels.attention.attention_ref import store_kv

    t, d = qkv.shape[0], k_cache.shape[-1]
    qk = rope(qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d), cos, sin)
    store_kv(k_cache, v_cache, qk[:, hq:], qkv[:, (hq + hkv) * d:].view(t, hkv, d), slot_mapping)
    return qk[:, :hq]
