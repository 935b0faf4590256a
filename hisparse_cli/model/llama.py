"""Llama-family decoder (llama, mistral, qwen2, qwen3) with our own forward pass.

Module names mirror Hugging Face checkpoints (model.layers.N.self_attn.q_proj, ...), so
safetensors keys map 1:1. One sequence at a time: activations are [T, hidden]. Attention is
delegated to an `AttentionContext` (the KV cache + sparse policy of the run), so the same
module serves chunked prefill, decode, and the plain dense full-sequence forward.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from hisparse_cli.model.config import ModelConfig
from hisparse_cli.model.rope import RotaryEmbedding, apply_rope


class AttentionContext(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] (after RoPE) -> out [T, Hq, D]."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        hs = cfg.hidden_size
        self.q_proj = nn.Linear(hs, self.hq * self.d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(hs, self.hkv * self.d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(hs, self.hkv * self.d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.hq * self.d, hs, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx: AttentionContext, last_only: bool = False) -> torch.Tensor:
        t = x.shape[0]
        if getattr(ctx, "wants_hidden", False):  # learned importance probe reads hidden states
            ctx.observe(self.layer, x)
        q = self.q_proj(x).view(t, self.hq, self.d)  # q: [T, Hq, D]
        k = self.k_proj(x).view(t, self.hkv, self.d)  # k: [T, Hkv, D]
        v = self.v_proj(x).view(t, self.hkv, self.d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = ctx.attend(self.layer, q, k, v)  # [T, Hq, D]
        if last_only:  # every K/V is stored; only the last position's output is used
            out, t = out[-1:], 1
        return self.o_proj(out.reshape(t, self.hq * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hs, im = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(hs, im, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(hs, im, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(im, hs, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # silu and the product in place: two [T, intermediate] temporaries at a time, not three
        h = F.silu(self.gate_proj(x), inplace=True)
        h.mul_(self.up_proj(x))
        return self.down_proj(h)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, ctx, last_only: bool = False):
        """last_only: return only the last position's output (the last layer of a step that
        needs one logit row: its K/V are stored for every position, the rest is skipped)."""
        h = self.self_attn(self.input_layernorm(x), cos, sin, ctx, last_only)
        x = x[-1:] + h if last_only else x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Decoder + LM head. Build on the meta device, then `loader.load_weights`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope: RotaryEmbedding | None = None

    def init_rope(self, device: torch.device) -> None:
        self.rope = RotaryEmbedding(self.cfg, device)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                all_logits: bool = False, full_last_layer: bool = False) -> torch.Tensor:
        """input_ids, positions: [T] -> logits [T, V] (all_logits) or [1, V] (last position).
        For one logit row the last layer computes only the last position past its K/V store,
        unless full_last_layer (callers that read every position's final hidden state)."""
        # the embedding is looked up inside forward_hidden, so no frame keeps it past layer 0
        return self.forward_hidden(None, positions, ctx, all_logits, full_last_layer, input_ids)

    def forward_hidden(self, x: torch.Tensor | None, positions: torch.Tensor,
                       ctx: AttentionContext, all_logits: bool = False,
                       full_last_layer: bool = False,
                       input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`forward` from the embedded input x [T, hidden] (compute dtype), or from input_ids
        when x is None. CUDA-graph decode with a host-resident table copies the row in itself
        and captures only this."""
        if x is None:
            emb = self.model.embed_tokens
            if emb.weight.device != input_ids.device:  # host-resident table (tight-VRAM option)
                x = emb(input_ids.cpu()).to(positions.device, non_blocking=True)
            else:
                x = emb(input_ids)  # [T, hidden]
            x = x.to(self.compute_dtype)
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, ctx, last_only=not (all_logits or full_last_layer) and i == last)
        if not all_logits:
            x = x[-1:]
        return self.lm_head(self.model.norm(x)).float()


class DenseCausalContext:
    """Plain causal attention over one whole sequence, no cache (calibration, perplexity)."""

    def __init__(self, window: int | None = None) -> None:
        self.window = window

    def attend(self, layer, q, k, v):
        t, hq, d = q.shape
        rep = hq // k.shape[1]
        kk = k.repeat_interleave(rep, dim=1).transpose(0, 1)
        vv = v.repeat_interleave(rep, dim=1).transpose(0, 1)
        if self.window is None:
            out = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, is_causal=True)
        else:
            i = torch.arange(t, device=q.device)
            mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - self.window)
            out = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask)
        return out.transpose(0, 1)


@torch.inference_mode()
def forward_full(model: CausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """Dense causal logits [T, V] for a whole sequence in one pass (no KV cache)."""
    pos = torch.arange(input_ids.shape[0], device=input_ids.device)
    return model(input_ids, pos, DenseCausalContext(model.cfg.sliding_window), all_logits=True)
