"""W4A8 prefill products: the contract and its torch reference.

An AWQ INT4 weight is W[k, n] = (q[k, n] - z[g, n]) s[g, n] for the group g = k // 128. Its
codes c = q - z are integers in [-15, 15], which e4m3 holds exactly, so the weight side of an
FP8 product loses nothing: codes8 [N, K] e4m3 (W^T rows) with the group scales as they are
stored, s [G, N] fp32, one per output column and 128 inputs ("1x128 blocks" on the weight).

The activations are quantized in the same 1x128 blocks, per token: for token m and block b,
sa[b, m] = max |x[m, 128 b : 128 b + 128]| / 448 (1 where the block is all zero) and
x8[m, k] = e4m3(x[m, k] / sa[b, m]), rounded to nearest even (|x / sa| <= 448, e4m3's
largest finite value: nothing saturates).

    y[m, n] = sum_b sa[b, m] s[b, n] sum_{k in b} x8[m, k] codes8[n, k]

accumulated in fp32, one rounding to the output dtype. cuBLAS (CUDA >= 12.9, sm_90) computes
exactly this with `torch._scaled_mm` given scale_a = sa.t() ([M, G], strides (1, M)) and
scale_b = s.t() ([N, G], strides (1, N)): the layouts AWQ stores and this module writes.

Only the activations are rounded: on SmolLM2 (teacher-forced against the same INT4 model with
fp16 activations, QUALITY.md) this costs KL ~0.01 nats/token; per-token scales (one block of
K) cost more and a lossy e4m3 weight (per-column scale) 3x more.
"""

from __future__ import annotations

import torch

BLOCK = 128  # inputs per scale, both sides (cuBLAS's 1x128 block scaling)
E4M3_MAX = 448.0
E4M3 = torch.float8_e4m3fn


def quantize_act_ref(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8 [M, K] e4m3, sa [K / block, M] fp32) of x [M, K] (the contract above)."""
    m, k = x.shape
    if k % block:
        raise ValueError(f"{k} inputs: not a multiple of the {block}-input block")
    xb = x.float().view(m, k // block, block)
    amax = xb.abs().amax(-1)  # [M, G]
    sa = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    x8 = (xb / sa[:, :, None]).view(m, k).to(E4M3)
    return x8, sa.t().contiguous()


def w4a8_matmul_ref(x8: torch.Tensor, sa: torch.Tensor, codes8: torch.Tensor, s: torch.Tensor,
                    out_dtype: torch.dtype, block: int = BLOCK) -> torch.Tensor:
    """y [M, N] from x8 [M, K], sa [G, M], codes8 [N, K], s [G, N]: fp32 sums, one rounding."""
    m, k = x8.shape
    n = codes8.shape[0]
    g = k // block
    xb = x8.float().view(m, g, block).transpose(0, 1)  # [G, M, B]
    cb = codes8.float().view(n, g, block).permute(1, 2, 0)  # [G, B, N]
    part = torch.bmm(xb, cb)  # [G, M, N], exact: integer-valued products of e4m3 values
    y = (part * sa.float()[:, :, None] * s.float()[:, None, :]).sum(0)
    return y.to(out_dtype)


def codes_ref(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes8 [N, K] e4m3, s [G, N] fp32) of an AutoAWQ GEMM-layout weight (awq_ref's)."""
    from hisparse_cli.kernels.int4.awq_pack import unpack_int4

    q = unpack_int4(qweight).to(torch.int16)  # [K, N]
    z = unpack_int4(qzeros).to(torch.int16).repeat_interleave(group_size, dim=0)
    return (q - z).t().float().to(E4M3).contiguous(), scales.float().contiguous()


def w4a8_linear_ref(x: torch.Tensor, weight: torch.Tensor, group_scales: torch.Tensor | None
                    = None, block: int = BLOCK) -> torch.Tensor:
    """The W4A8 product emulated in fp32 from a dequantized weight [in, out] (exact INT4
    values): x's blocks rounded as above, the weight as it is. For quality studies on models
    whose group is not 128 (SmolLM2: 64), `block` sets the activation block; a K that is not
    a multiple of it ends in one shorter block. y in x's dtype."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k).float()
    main = (k // block) * block
    parts = []
    for lo, hi in ((0, main), (main, k)):
        if hi > lo:
            width = block if lo == 0 else hi - lo
            x8, sa = quantize_act_ref(x2[:, lo:hi], block=width)
            parts.append((x8.float().view(x2.shape[0], -1, width) * sa.t()[:, :, None])
                         .reshape(x2.shape[0], hi - lo))
    y = torch.cat(parts, -1) @ weight.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[1])
