"""The previous decode GEMV (v2, what H200 run 4 measured and the engine ran until the v3
kernel of hisparse_cli/kernels/awq_gemv.py), kept only as the baseline that
`gpu_awq.py --gemv-sweep` times the new kernel against. Not used by the package.

Layout: natural nibble order, word (n, w) holds q[8 w + i, n] at bits 4 i (int32 [N, K/8]).
Kernel: its measured-best mode only (nibbles masked in place and read as fp32 subnormals,
next tile prefetched into registers), one program per (column tile, K split, token),
32 columns x 16 words, 2 warps, K split to ~16 programs per SM, fp32 partials + reduction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hisparse_cli.kernels.int4.awq_pack import PACK, unpack_int4


def repack_v2(qweight: torch.Tensor) -> torch.Tensor:
    """AWQ GEMM qweight int32 [K, N/8] -> v2 layout int32 [N, K/8] (natural nibble order)."""
    codes = unpack_int4(qweight).t().to(torch.int32)  # [N, K]
    c8 = codes.reshape(codes.shape[0], -1, PACK)
    word = c8[..., 0].clone()
    for i in range(1, PACK):
        word |= c8[..., i] << (4 * i)
    return word.contiguous()


@triton.jit
def _splitk_reduce_kernel(p_ptr, b_ptr, y_ptr, total, N, stride_ps,
                          SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """v2's second pass: y[e] = sum_s p[s, e] (+ bias[e % N]) over the flattened [M, N] output."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
    for sp in tl.static_range(1, SPLIT):
        acc += tl.load(p_ptr + sp * stride_ps + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemv_v2_kernel(x_ptr, qt_ptr, qz_ptr, s_ptr, y_ptr, N, KW, W8, stride_xm, stride_ym,
                    stride_ys, KW_PER_SPLIT, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_KW: tl.constexpr, PARTIAL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = tl.where(mask_n, offs_n, 0)
    offs_w = tl.arange(0, BLOCK_KW)
    jn = rows % 8
    zshift = (4 * (jn % 2) + jn // 2) * 4
    w_row = qt_ptr + rows.to(tl.int64)[:, None] * KW
    x_row = x_ptr + m * stride_xm
    w_start = pid_k * KW_PER_SPLIT
    w_stop = w_start + KW_PER_SPLIT
    acc = tl.zeros((BLOCK_N, BLOCK_KW), dtype=tl.float32)
    words_next = tl.load(w_row + (w_start + offs_w)[None, :])
    for w0 in range(w_start, w_stop, BLOCK_KW):
        kw = w0 + offs_w
        words = words_next
        nxt = tl.minimum(w0 + BLOCK_KW, w_stop - BLOCK_KW)
        words_next = tl.load(w_row + (nxt + offs_w)[None, :])
        g = (w0 * 8) // GROUP
        z = ((tl.load(qz_ptr + g * W8 + rows // 8) >> zshift) & 0xF).to(tl.float32)
        s = tl.load(s_ptr + g * N + rows).to(tl.float32)
        hi = words >> 16
        t = tl.zeros((BLOCK_N, BLOCK_KW), dtype=tl.float32)
        xs = tl.zeros((BLOCK_KW,), dtype=tl.float32)
        for i in tl.static_range(8):
            xi = tl.load(x_row + kw * 8 + i).to(tl.float32)
            xs += xi
            if i < 4:
                src = words
            else:
                src = hi
            if i % 4 == 0:  # masked nibble j reads as q 16^j 2^-149; x times 2^100 16^-j
                qm = src & 0xF
                sc = 1.2676506002282294e30
            elif i % 4 == 1:
                qm = src & 0xF0
                sc = 7.922816251426434e28
            elif i % 4 == 2:
                qm = src & 0xF00
                sc = 4.951760157141521e27
            else:
                qm = src & 0xF000
                sc = 3.094850098213451e26
            t += qm.to(tl.float32, bitcast=True) * (xi * sc)[None, :]
        acc += (s * 562949953421312.0)[:, None] * t - (s * z)[:, None] * xs[None, :]
    out = tl.sum(acc, axis=1)
    if PARTIAL:
        tl.store(y_ptr + pid_k * stride_ys + m * stride_ym + offs_n, out, mask=mask_n)
    else:
        tl.store(y_ptr + m * stride_ym + offs_n, out.to(y_ptr.dtype.element_ty), mask=mask_n)


def gemv_v2(x2, qt_v2, qzeros, scales, group_size, sms):
    """v2 GEMV without bias: x2 [M, K] -> y [M, N] (M <= 4), its own launch rule."""
    (m, k), (n, kw) = x2.shape, qt_v2.shape
    bn, bkw = 32, min(group_size // 8, 16)
    tiles, steps, split = triton.cdiv(n, bn) * m, kw // bkw, 1
    while tiles * split * 2 <= 16 * sms and steps % (2 * split) == 0 and steps // (2 * split) >= 2:
        split *= 2
    y = torch.empty((m, n), device=x2.device, dtype=x2.dtype)
    grid = (triton.cdiv(n, bn), split, m)
    if split == 1:
        _gemv_v2_kernel[grid](x2, qt_v2, qzeros, scales, y, n, kw, n // 8, x2.stride(0),
                              y.stride(0), 0, kw, GROUP=group_size, BLOCK_N=bn, BLOCK_KW=bkw,
                              PARTIAL=False, num_warps=2)
        return y
    part = torch.empty((split, m, n), device=x2.device, dtype=torch.float32)
    _gemv_v2_kernel[grid](x2, qt_v2, qzeros, scales, part, n, kw, n // 8, x2.stride(0),
                          part.stride(1), part.stride(0), kw // split, GROUP=group_size,
                          BLOCK_N=bn, BLOCK_KW=bkw, PARTIAL=True, num_warps=2)
    _splitk_reduce_kernel[(triton.cdiv(m * n, 1024),)](part, scales, y, m * n, n, part.stride(0),
                                                       SPLIT=split, HAS_BIAS=False, BLOCK=1024,
                                                       num_warps=4)
    return y
