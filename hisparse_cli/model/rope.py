"""Rotary position embedding: inverse frequencies for the scaling types Llama-family configs use
(default, linear, llama3, yarn) and the rotate-half application.

Our own implementation of the published formulas; tests compare it with transformers'
rope initialisation functions (the oracle).
"""

from __future__ import annotations

import math

import torch

from hisparse_cli.errors import ModelError
from hisparse_cli.model.config import ModelConfig

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _base_inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, base: float, s: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    orig = s.get("original_max_position_embeddings") or max_pos
    factor = s.get("factor") or max_pos / orig
    factor = float(factor)
    attn = s.get("attention_factor")
    mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attn is None:
        attn = get_mscale(factor, mscale) / get_mscale(factor, mscale_all) if (mscale and mscale_all) \
            else get_mscale(factor)
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return inter * (1 - keep) + extra * keep, float(attn)


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2] fp32, attention_scaling applied to cos/sin)."""
    dim, base = cfg.head_dim, cfg.rope_theta
    s = cfg.rope_scaling
    kind = (s or {}).get("rope_type", "default")
    if kind == "default":
        return _base_inv_freq(dim, base), 1.0
    if kind == "linear":
        return _base_inv_freq(dim, base) / float(s["factor"]), 1.0
    if kind == "llama3":
        return _llama3(_base_inv_freq(dim, base), s), 1.0
    if kind == "yarn":
        return _yarn(dim, base, s, cfg.max_position_embeddings)
    raise ModelError(f"unsupported rope scaling type {kind!r}: hisparse supports {', '.join(ROPE_TYPES)}")


class RotaryEmbedding:
    """cos/sin tables computed on demand for the positions of a step (no max-length table)."""

    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        inv_freq, self.scaling = rope_inv_freq(cfg)
        self.inv_freq = inv_freq.to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] int64 -> cos, sin: [T, head_dim]
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)
