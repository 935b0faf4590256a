"""Triton: activations x [M, K] -> e4m3 in 1x128 blocks per token (x8 [M, K], sa [K/128, M]),
the quantizer of the W4A8 prefill product (contract and reference: w4a8_ref.py).

One program per BLOCK_M tokens and one 128-input block: the block's max |x| per token gives
sa = max / 448 (1 for an all-zero block), and x / sa is rounded to e4m3 in fp32 arithmetic
(3 mantissa bits to nearest even above 2^-6, multiples of 2^-9 below: e4m3's subnormals)
before the conversion, which then is exact. (The Triton interpreter's own fp32 -> e4m3
conversion mis-rounds values that round up across a power of two; rounded first, every
backend stores the same bits as torch's RNE conversion in the reference.)
On the GPU a negative value that rounds to zero may come out as +0 where torch writes -0
(H100, 2026-12-07: 410 of 262,144 values of a hard test input): equal numbers, the products
unchanged. M (the chunk's tokens) is not specialized; x's row stride is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hisparse_cli.kernels.fp8.w4a8_ref import BLOCK, E4M3

BLOCK_M = 16


@triton.jit
def _round_e4m3(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32."""
    bits = v.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1  # the last mantissa bit e4m3 keeps
    normal = ((bits + 0x7FFFF + lsb) & -0x100000).to(tl.float32, bitcast=True)
    t = tl.abs(v) * 512.0  # subnormals: multiples of 2^-9, on the magnitude
    r = tl.floor(t + 0.5)
    r = tl.where((r - t == 0.5) & (r - 2.0 * tl.floor(r * 0.5) != 0.0), r - 1.0, r)
    sub = r * 0.001953125
    sub = tl.where(bits < 0, -sub, sub)  # the sign bit kept (-0 too, as torch's conversion)
    return tl.where(tl.abs(v) >= 0.015625, normal, sub)


@triton.jit(do_not_specialize=["M"])
def _act_quant_kernel(x_ptr, x8_ptr, sa_ptr, M, K, stride_xm, BLOCK_M: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    b = tl.program_id(1)
    cols = b * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = rows < M
    r64 = rows.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * stride_xm + cols[None, :], mask=mask[:, None],
                other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)  # [BLOCK_M]
    # IEEE divisions (div.rn: the reference's bits; Triton's `/` on fp32 may be approximate)
    sa = tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1.0)
    v = _round_e4m3(tl.math.div_rn(x, tl.broadcast_to(sa[:, None], x.shape)))
    tl.store(x8_ptr + r64[:, None] * K + cols[None, :], v.to(x8_ptr.dtype.element_ty),
             mask=mask[:, None])
    tl.store(sa_ptr + b.to(tl.int64) * M + rows, sa, mask=mask)


def quantize_act(x: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8 [M, K] e4m3, sa [K/128, M] fp32) of x [M, K] (unit stride in K), as
    w4a8_ref.quantize_act_ref; written into out's tensors if given."""
    m, k = x.shape
    if k % BLOCK or x.stride(1) != 1:
        raise ValueError(f"x [{m}, {k}] must have unit stride and a multiple of {BLOCK} inputs")
    if out is None:
        out = (torch.empty((m, k), dtype=E4M3, device=x.device),
               torch.empty((k // BLOCK, m), dtype=torch.float32, device=x.device))
    x8, sa = out
    grid = (triton.cdiv(m, BLOCK_M), k // BLOCK)
    _act_quant_kernel[grid](x, x8, sa, m, k, x.stride(0), BLOCK_M=BLOCK_M, BLOCK_K=BLOCK,
                            num_warps=4)
    return x8, sa
