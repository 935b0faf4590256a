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

from hisparse_cli.kernels.dispatch import KernelBackend, select_backend
from hisparse_cli.kernels.norm_rope.norm_rope_ref import rms_norm, rope_tabled, rope_tables, silu_mul_
from hisparse_cli.model.config import ModelConfig
from hisparse_cli.model.rope import RotaryEmbedding


class AttentionContext(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] (after RoPE) -> out [T, Hq, D]."""

    # optional (engine/runner.py:StepContext): attend_qkv(layer, qkv, hq, hkv, cos, sin), the
    # same from the stacked projection's output before RoPE; used with `fused` when q|k|v are
    # stacked and there is no q/k norm


# `fused` below: the backend whose Triton kernels replace the elementwise chains (RMSNorm,
# the residual add before the second norm, RoPE), chosen once per forward by
# CausalLM.forward_hidden; None (the CPU, the torch backend, direct module calls): torch ops.
# cos, sin: [T, D] with `fused`; without it, the `rope_tables` operands [T, 1, D] (made once
# per forward).
def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          fused: KernelBackend | None) -> torch.Tensor:
    return fused.rope(x, cos, sin) if fused is not None else rope_tabled(x, cos, sin)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, fused: KernelBackend | None = None) -> torch.Tensor:
        # x: [..., dim]; one Triton kernel with `fused`, else kernels/norm_rope_ref.py's ops
        if fused is not None:
            return fused.rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


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
        # set by the loader when it fuses the projections (then q/k/v_proj are None)
        self.qkv_proj: nn.Module | None = None

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             fused: KernelBackend | None):
        t, hq, hkv, d = x.shape[0], self.hq, self.hkv, self.d
        if self.qkv_proj is None:
            q = self.q_proj(x).view(t, hq, d)  # q: [T, Hq, D]
            k = self.k_proj(x).view(t, hkv, d)  # k: [T, Hkv, D]
            v = self.v_proj(x).view(t, hkv, d)
            if self.q_norm is not None:
                q, k = self.q_norm(q, fused), self.k_norm(k, fused)
            return _rope(q, cos, sin, fused), _rope(k, cos, sin, fused), v
        # one matmul for q, k and v; q, k, v are views of its output [T, (Hq + 2 Hkv) D]
        qkv = self.qkv_proj(x)
        v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
        if self.q_norm is not None:
            q = self.q_norm(qkv[:, :hq * d].view(t, hq, d), fused)
            k = self.k_norm(qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d), fused)
            return _rope(q, cos, sin, fused), _rope(k, cos, sin, fused), v
        # no q/k norm: one RoPE over the q and k heads together
        qk = _rope(qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d), cos, sin, fused)
        return qk[:, :hq], qk[:, hq:], v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx: AttentionContext, last_only: bool = False,
                fused: KernelBackend | None = None) -> torch.Tensor:
        t = x.shape[0]
        if getattr(ctx, "wants_hidden", False):  # learned importance probe reads hidden states
            ctx.observe(self.layer, x)
        attend_qkv = getattr(ctx, "attend_qkv", None)
        if (fused is not None and attend_qkv is not None and self.qkv_proj is not None
                and self.q_norm is None):  # RoPE and the K/V store in one call (the engine's)
            out = attend_qkv(self.layer, self.qkv_proj(x), self.hq, self.hkv, cos, sin)
        else:
            q, k, v = self._qkv(x, cos, sin, fused)
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
        self.im = im
        # set by the loader when it fuses gate and up (then gate_proj/up_proj are None)
        self.gate_up_proj: nn.Module | None = None

    def forward(self, x: torch.Tensor, fused: KernelBackend | None = None) -> torch.Tensor:
        # silu and the product in place: two [T, intermediate] temporaries at a time, not three
        if self.gate_up_proj is not None:  # one matmul; the product lands in its gate half
            gu = self.gate_up_proj(x)
            # one Triton kernel for silu and the product with `fused`, else torch's two ops
            h = fused.silu_mul_(gu, self.im) if fused is not None else silu_mul_(gu, self.im)
            return self.down_proj(h)
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

    def forward(self, x, cos, sin, ctx, last_only: bool = False,
                fused: KernelBackend | None = None):
        """last_only: return only the last position's output (the last layer of a step that
        needs one logit row: its K/V are stored for every position, the rest is skipped)."""
        if fused is not None:  # Triton: the residual add and the second norm in one kernel
            x, h = self.forward_unadded([x, None], cos, sin, ctx, last_only, fused)
            return x + h
        # the attention output dies with the residual add (not held through the MLP)
        x = (x[-1:] if last_only else x) + self.self_attn(self.input_layernorm(x), cos, sin, ctx,
                                                          last_only)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_unadded(self, xh: list, cos, sin, ctx, last_only: bool,
                        fused: KernelBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """The Triton path of forward on the input x + h_prev, xh = [x, h_prev] (h_prev None:
        x), returning (x', h) for the output x' + h: the residual adds are left to the norm
        after them, so that in the residual chain the previous layer's add runs inside this
        layer's input norm (one add_rms_norm kernel). CausalLM.forward_hidden chains layers
        this way; a direct call (hooks, quantize) goes through forward, which adds. xh is
        emptied: x and h_prev die at the add, not when the caller lets go of them."""
        x, h_prev = xh
        xh.clear()
        norm_in = self.input_layernorm
        if h_prev is None:
            n = norm_in(x, fused)
        else:
            x, n = fused.add_rms_norm(x, h_prev, norm_in.weight, norm_in.eps)
            del h_prev
        att = self.self_attn(n, cos, sin, ctx, last_only, fused)
        del n  # the normed input dies with the attention (the planner's order)
        norm = self.post_attention_layernorm
        x, h = fused.add_rms_norm(x[-1:] if last_only else x, att, norm.weight, norm.eps)
        del att  # and the attention output with the add, before the MLP
        return x, self.mlp(h, fused)  # the norm output dies in the MLP, before any add


# CausalLM.forward_hidden on CUDA with the Triton elementwise kernels: each layer's closing
# residual add runs inside the next norm (the next layer's input norm, or the final one) as one
# add_rms_norm kernel: 32 torch add launches a Llama-3-8B token fewer, and no non-PDL kernel
# breaking the programmatic-dependent-launch chain between the down projection and the next
# norm (H200 run 57, `gpu_awq_ab.py --fuse-residual`: decode +2.0-3.0 % INT4, +1.3-1.8 %
# fp16). The memory planner models the chain (planner/step.py: layer_peak, chained). Not
# taken while any hook is registered on a layer (quality/capture.py, quantize): their callers
# see whole layer outputs.


def _hooked(layers: nn.ModuleList) -> bool:
    """Whether a forward hook or pre-hook (global, or on a decoder layer) would see layer
    calls that the fused residual chain skips."""
    from torch.nn.modules import module as _m

    if _m._global_forward_hooks or _m._global_forward_pre_hooks:
        return True
    return any(layer._forward_hooks or layer._forward_pre_hooks for layer in layers)


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
        # kernels for the elementwise chains (the Engine sets its own); None: select_backend
        self.backend: KernelBackend | None = None
        # one-token steps through the CPU's native kernels (model/cpu_decode.py; the Engine
        # attaches it on the CPU where it applies); None: the torch modules below
        self.native_decode = None

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
        native = self.native_decode
        if (native is not None and input_ids.shape[0] == 1 and not full_last_layer
                and not _hooked(self.model.layers)):
            return native.forward(input_ids, positions, ctx)  # [1, V]
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
        fused = self._fused(x)
        if fused is None:
            cos, sin = rope_tables(cos, sin)
        layers = self.model.layers
        last = len(layers) - 1
        if fused is not None and not _hooked(layers):
            h = None  # the output is x + h: each add runs in the norm after it
            for i, layer in enumerate(layers):
                xh = [x, h]
                del x, h  # held by xh alone, which the layer empties
                x, h = layer.forward_unadded(
                    xh, cos, sin, ctx, not (all_logits or full_last_layer) and i == last, fused)
            if not all_logits:
                x, h = x[-1:], h[-1:]
            norm = self.model.norm
            return self.lm_head(fused.add_rms_norm(x, h, norm.weight, norm.eps)[1]).float()
        for i, layer in enumerate(layers):
            x = layer(x, cos, sin, ctx, last_only=not (all_logits or full_last_layer) and i == last,
                      fused=fused)
        if not all_logits:
            x = x[-1:]
        return self.lm_head(self.model.norm(x, fused)).float()

    def _fused(self, x: torch.Tensor) -> KernelBackend | None:
        """The backend when its Triton kernels run the elementwise chains for x (CUDA), else
        None: the torch ops, always on the CPU and with the torch backend."""
        if not x.is_cuda:
            return None
        backend = self.backend or select_backend("cuda")
        return backend if backend.elementwise == "triton" else None


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


FUSIONS = (("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
            ("mlp", "gate_up_proj", ("gate_proj", "up_proj")))


def _stack_linears(lins: list[nn.Module]) -> nn.Module | None:
    """One linear whose output stacks those of `lins` (all nn.Linear or all AWQLinear in
    one layout, same input size and bias presence), or None where they differ."""
    from hisparse_cli.model.awq import AWQLinear

    kinds = {(type(m), getattr(m, "layout", None), m.bias is not None, m.in_features) for m in lins}
    if len(kinds) != 1:
        return None
    bias = torch.cat([m.bias for m in lins]) if lins[0].bias is not None else None
    if isinstance(lins[0], AWQLinear):
        if len({m.group_size for m in lins}) != 1:
            return None
        fused = AWQLinear.__new__(AWQLinear)
        nn.Module.__init__(fused)
        fused.in_features, fused.group_size = lins[0].in_features, lins[0].group_size
        fused.out_features = sum(m.out_features for m in lins)
        fused.layout = lins[0].layout
        # AWQ layout qweight [in, out/8]: outputs along dim 1; K-major [out, in/8]: dim 0 (and
        # tiled: whole 64-row tiles, so the pieces' tiles follow one another)
        fused.register_buffer("qweight", torch.cat(
            [m.qweight for m in lins], dim=0 if fused.layout in ("kmajor", "tiled", "items")
            else 1))  # items: column tile-major, so the pieces' tiles follow one another too
        items = fused.layout == "items"  # (scales and zero points inside the items)
        fused.register_buffer("qzeros", None if items else torch.cat([m.qzeros for m in lins], 1))
        fused.register_buffer("scales", None if items else torch.cat([m.scales for m in lins], 1))
        fused.register_buffer("bias", bias)
        fused.register_buffer("int4pack", None, persistent=False)
        fused.register_buffer("int4pack_sz", None, persistent=False)
        fused.register_buffer("prefill_weight", None, persistent=False)  # (kept per layer)
        fused._pack_for_cpu()  # its own CPU decode copy (the pieces' go with them)
        return fused
    if type(lins[0]) is not nn.Linear:
        return None
    w0 = lins[0].weight
    input_major = w0.dim() == 2 and w0.stride(0) == 1 and w0.stride(1) != 1  # loader.converted
    w = (torch.cat([m.weight.t() for m in lins], dim=1).t() if input_major
         else torch.cat([m.weight for m in lins], dim=0))
    with torch.device("meta"):
        fused = nn.Linear(lins[0].in_features, w.shape[0], bias=bias is not None)
    fused.weight = nn.Parameter(w, requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    return fused


@torch.no_grad()
def fuse_projections(model: CausalLM) -> CausalLM:
    """Stack q|k|v and gate|up of every layer into one linear each (in place; a no-op for a
    model the loader already fused): one matmul instead of three and two, the same bytes.
    Each group's pieces are freed as its stacked copy is made, so the transient is one
    group. Groups whose pieces differ (a mixed AWQ checkpoint) stay separate."""
    for layer in model.model.layers:
        for sub, attr, parts in FUSIONS:
            parent = getattr(layer, sub)
            if getattr(parent, attr) is not None:
                continue
            fused = _stack_linears([getattr(parent, p) for p in parts])
            if fused is None:
                continue
            setattr(parent, attr, fused)
            for p in parts:
                setattr(parent, p, None)
    return model


@torch.inference_mode()
def forward_full(model: CausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """Dense causal logits [T, V] for a whole sequence in one pass (no KV cache)."""
    pos = torch.arange(input_ids.shape[0], device=input_ids.device)
    return model(input_ids, pos, DenseCausalContext(model.cfg.sliding_window), all_logits=True)
