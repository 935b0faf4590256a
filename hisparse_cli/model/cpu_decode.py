"""CPU decode through the native kernels (kernels/cpu/decode.c): one token, layer by layer,
in a few C calls instead of ~60 torch operations a layer.

`NativeDecode.attach(model)` gives a float32 CPU model a decode copy of its linear weights in
the tiled layout, each in the narrowest format that holds it exactly (a float16 or bfloat16
checkpoint: its own 16-bit values, half the bytes a token reads; kernels/cpu/native.py). The
prefill's multi-row products keep the float32 weights and torch (MKL). Per layer, a decode
step is: `hs_pre_attn` (norm, q|k|v product, q/k norms, RoPE) -> attention -> `hs_post_attn`
(o product and residual, norm, gate|up, silu * up, down and residual). The attention runs in C
too (`hs_attn_dense`: K/V store and a split-key softmax over the layer's head-major storage)
where the run is dense over consecutive blocks, else through the run's own attention context
(sparse windows, globals, importance scores: the torch reference path).

Arithmetic is float32 throughout; against the torch path only summation orders differ
(tests/test_cpu_native.py compares logits and greedy tokens with it and with transformers).
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from hisparse_cli.kernels.cpu.native import (TK, TiledWeight, compiler_available,
                                             native_library, native_unavailable_reason)


class _Layer(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int) for n in ("hidden", "hq", "hkv", "d", "inter", "wt_qkv",
                                             "wt_o", "wt_gate_up", "wt_down")] + [
        ("eps", ctypes.c_float)] + [(n, ctypes.c_void_p) for n in (
            "in_norm", "post_norm", "q_norm", "k_norm", "qkv", "o", "gate_up", "down",
            "qkv_b", "o_b", "gate_up_b", "down_b")]


def unsupported(model: nn.Module) -> str | None:
    """Why `model` cannot decode through the native kernels (None: it can)."""
    cfg = model.cfg
    p = model.model.norm.weight
    if p.device.type != "cpu" or p.dtype != torch.float32:
        return "native decode runs float32 models on the CPU"
    for layer in model.model.layers:
        att, mlp = layer.self_attn, layer.mlp
        for lin in (att.qkv_proj, att.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if not isinstance(lin, nn.Linear) or lin.weight.dtype != torch.float32:
                return "a linear is not a float32 nn.Linear (AWQ INT4, or unfused projections)"
    if not isinstance(model.lm_head, nn.Linear):
        return "the LM head is not a float32 nn.Linear"
    return _shapes_unsupported(cfg) or native_unavailable_reason()


def _shapes_unsupported(cfg) -> str | None:
    d = cfg.head_dim
    sizes = (cfg.hidden_size, cfg.num_attention_heads * d, cfg.intermediate_size)
    if any(s % TK for s in sizes) or d % 2:
        return f"hidden, heads x head_dim and intermediate sizes must be multiples of {TK}"
    return None


def config_unsupported(cfg, compute_dtype: str) -> str | None:
    """`unsupported` from a model config (the memory planner's view: no weights loaded, no
    build; a compiler on this machine stands for the library)."""
    if compute_dtype != "float32":
        return "native decode runs float32 models on the CPU"
    if not compiler_available():
        return "no C compiler (cc/gcc/clang) found"
    return _shapes_unsupported(cfg)


def copy_element_bytes(cfg) -> int:
    """Bytes an element of the decode copy holds at most: 2 for a float16/bfloat16
    checkpoint (its own values), else 4 (4-/8-bit forms are found from the values at load)."""
    return 2 if (cfg.torch_dtype or "") in ("float16", "bfloat16") else 4


class NativeDecode:
    """The decode copy of a model's weights and the step that runs them (module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.lib = native_library()
        cfg = self.cfg = model.cfg
        self.model = model
        self.hidden, self.hq, self.hkv, self.d = (cfg.hidden_size, cfg.num_attention_heads,
                                                  cfg.num_key_value_heads, cfg.head_dim)
        self.inter = cfg.intermediate_size
        self.keep: list[torch.Tensor] = []  # everything a layer struct points to
        self.layers = [self._layer(layer) for layer in model.model.layers]
        head = model.lm_head
        self.head = TiledWeight.from_linear(head.weight, head.bias)
        self.norm = model.model.norm
        qkv = (self.hq + 2 * self.hkv) * self.d
        self.x = torch.empty(self.hidden)
        self.xn = torch.empty(self.hidden)
        self.qkv = torch.empty(qkv)
        self.attn = torch.empty(self.hq * self.d)
        self.gu = torch.empty(2 * self.inter)
        self.h = torch.empty(self.inter)
        self.scratch = torch.empty(0)
        tiled = [w for L in self.layers for w in L[1]] + [self.head]
        self.weight_dtype = "+".join(sorted({w.fmt_name for w in tiled}))
        self.nbytes = sum(w.nbytes for w in tiled)

    @classmethod
    def attach(cls, model: nn.Module) -> None:
        """Give `model` its native decode (model.native_decode), once (the ExecutionPlan
        decided it applies: config/execution.py)."""
        if not isinstance(model.native_decode, cls):
            model.native_decode = cls(model)

    def _layer(self, layer: nn.Module):
        att, mlp = layer.self_attn, layer.mlp
        lins = (att.qkv_proj, att.o_proj, mlp.gate_up_proj, mlp.down_proj)
        ws = [TiledWeight.from_linear(lin.weight, lin.bias) for lin in lins]
        norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        qkn = [att.q_norm.weight, att.k_norm.weight] if att.q_norm is not None else [None, None]
        tensors = [t.detach().contiguous() if t is not None else None for t in norms + qkn]
        self.keep += [t for t in tensors if t is not None] + [w.data for w in ws] + [
            w.bias for w in ws if w.bias is not None]
        p = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        struct = _Layer(self.hidden, self.hq, self.hkv, self.d, self.inter, *(w.wtype for w in ws),
                        layer.input_layernorm.eps, *map(p, tensors), *(w.data.data_ptr() for w in ws),
                        *(p(w.bias) for w in ws))
        return struct, ws

    def _dense_span(self, ctx) -> tuple[int, int] | None:
        """(first slot, number of keys) when ctx's step is one query of a dense run over
        consecutive head-major float32 blocks: the attention hs_attn_dense serves."""
        run = getattr(ctx, "run", None)
        ids = getattr(ctx, "host_block_ids", None)
        if run is None or ids is None or ctx.n != 1 or run.seq.window is not None:
            return None
        cache = run.cache
        if (cache.G or run.track_scores or run.token_scorer is not None or not cache.head_major
                or cache.dtype != torch.float32 or ids != list(range(ids[0], ids[0] + len(ids)))):
            return None
        return ids[0] * cache.bs, ctx.q_start + 1

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """One token (input_ids, positions: [1]) -> logits [1, V] float32."""
        lib, model = self.lib, self.model
        x, xn, qkv, attn = self.x, self.xn, self.qkv, self.attn
        x.copy_(model.model.embed_tokens(input_ids)[0])
        cos, sin = (t.contiguous() for t in model.rope.cos_sin(positions, torch.float32))
        nth = torch.get_num_threads()
        hq, hkv, d = self.hq, self.hkv, self.d
        span = self._dense_span(ctx)
        if span is not None:
            slot0, n = span
            need = lib.hs_attn_scratch(n, hq, hkv, d)
            if self.scratch.numel() < need:
                self.scratch = torch.empty(max(need, 2 * self.scratch.numel()))
            cache = ctx.run.cache
            head_stride = cache.capacity * cache.bs * d
        q = qkv[: hq * d]
        k = qkv[hq * d:(hq + hkv) * d]
        v = qkv[(hq + hkv) * d:]
        for i, (layer, _) in enumerate(self.layers):
            lib.hs_pre_attn(ctypes.byref(layer), x.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                            xn.data_ptr(), qkv.data_ptr(), nth)
            if getattr(ctx, "wants_hidden", False):
                ctx.observe(i, xn.view(1, -1))
            if span is not None:
                k_l, v_l = cache.layer_views[i][:2]
                lib.hs_attn_dense(q.data_ptr(), k.data_ptr(), v.data_ptr(), k_l.data_ptr(),
                                  v_l.data_ptr(), head_stride, slot0, n, hq, hkv, d,
                                  ctx.run.scale, attn.data_ptr(), self.scratch.data_ptr(), nth)
                out = attn
            else:
                out = ctx.attend(i, q.view(1, hq, d), k.view(1, hkv, d), v.view(1, hkv, d))
                out = out.reshape(-1).contiguous()
            lib.hs_post_attn(ctypes.byref(layer), x.data_ptr(), out.data_ptr(), xn.data_ptr(),
                             self.gu.data_ptr(), self.h.data_ptr(), nth)
        lib.hs_rms_norm(x.data_ptr(), self.norm.weight.data_ptr(), self.norm.eps,
                        xn.data_ptr(), self.hidden)
        logits = torch.empty(1, self.head.out_features)
        lib.hs_linear(self.head.data.data_ptr(), self.head.wtype,
                      None if self.head.bias is None else self.head.bias.data_ptr(),
                      xn.data_ptr(), logits.data_ptr(), self.head.out_features, self.hidden, nth)
        return logits


__all__ = ["NativeDecode", "unsupported"]
