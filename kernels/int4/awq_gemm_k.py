"""Triton INT4 (AWQ) fused dequant-GEMM on the K-major run-time layout, for prefill:
y [M, N] = x [M, K] @ W (+ bias) for M > GEMV_MAX_TOKENS tokens, W dequantized in registers.

Why: the other prefill path (awq_triton.awq_dequant_matmul_k) writes the whole fp16 W^T once
per call and cuBLAS reads it back, so INT4 moves the weight bytes ~2.5x more than fp16 does
(4096x14336: 40.7 us of dequantize per call on the H200; BENCHMARKS.md run 7/9). Here every
packed word is read once per token tile and never leaves the SM as fp16.

Formulation ("swap AB"): acc [BLOCK_N, BLOCK_M] = W^T tile [BLOCK_N, BLOCK_K] @ x^T tile
[BLOCK_K, BLOCK_M], so the output columns fill the MMA's M slot (>= 64 on Hopper's wgmma)
and the tokens its N slot (small M needs no padding to 64), and the dequantized weight is the
register operand. Per K step (BLOCK_K inside one group, so one z and s per output column):
- a [BLOCK_N, BLOCK_KW] word tile (rows contiguous along K: 16-byte loads), each nibble
  dequantized as q s - z s in fp32 (q through the 2^23 magic-number bitcast, one rounding to
  x's dtype; bit-identical to awq_dequantize_k), then put back in K order by a permutation
  inside each run of 4 words (kernels/int4/awq_layout.py);
- x^T [BLOCK_K, BLOCK_M] loaded from rows of x (unit stride in K, any row stride; padding
  tokens read row 0 and are masked at the store);
- tl.dot with fp32 accumulation (fp32 x: IEEE products, no TF32).
Packed dequantization (fp16 x on NVIDIA; the interpreter runs an fp32
emulation): per word, one LOP3 a nibble pair into the fp16 magic 1024 + q (1024 + 16 q for a
byte's upper nibble), one HADD2 / HFMA2 to the exact integer q - z, one HMUL2 by s: fp16
(q - z) s rounded once, the same bits as the fp32 path above (whose q s - z s is exact in
fp32 before its one rounding). sm_90 loop of the table's 1,024-token tile: 312 -> 221
instructions (`sm90_compile.py awq`); timed by `benchmarks/gpu_prefill_packed.sh`.
Epilogue: + bias in fp32, one rounding to x's dtype. Program order: all token tiles of one
column tile are consecutive, so a weight tile comes from DRAM once and from L2 after.

Launch: awq_layout.gemm_config (a table by token bucket and N class; nothing tuned at run
time: deterministic and CUDA-graph capturable; allocates only y). Written for Triton >= 3.0
(3.6 on the H200): plain loads, tl.join/reshape/permute, tl.dot; no descriptors, no
autotune. benchmarks/sm90_compile.py awq compiles it for sm_90 without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hisparse_cli.kernels.int4 import awq_layout
from hisparse_cli.kernels.int4.awq_gemv import (_bits2, _row_bases, _word_ptrs, check_gemv_args,
                                           check_x, nibble_pairs_ptx)


@triton.jit
def _dequant_nibble(words, SHIFT: tl.constexpr, s2, sz, dt: tl.constexpr):
    """(q - z) s of the nibble at bit SHIFT, in dt: q s - z s exact in fp32, one rounding."""
    q = (((words >> SHIFT) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    return (q * s2 - sz).to(dt)


_DEQUANT8 = tl.constexpr("{\n.reg .b32 t0, t1, t2, t3, w8;\n" + nibble_pairs_ptx("$8") + """
    add.rn.f16x2 t0, t0, $9;
    fma.rn.f16x2 t1, t1, $11, $10;
    add.rn.f16x2 t2, t2, $9;
    fma.rn.f16x2 t3, t3, $11, $10;
    mul.rn.f16x2 t0, t0, $12;
    mul.rn.f16x2 t1, t1, $12;
    mul.rn.f16x2 t2, t2, $12;
    mul.rn.f16x2 t3, t3, $12;
    mov.b32 {$0, $4}, t0;
    mov.b32 {$1, $5}, t1;
    mov.b32 {$2, $6}, t2;
    mov.b32 {$3, $7}, t3;
    }""")


@triton.jit
def _dequant8_packed(words, zw, zshift, sv, ASM: tl.constexpr):
    """The 8 nibbles of each word [BN, BKW] as fp16 (q - z) s, bit-identical to
    _dequant_nibble's (q s - z s is exact in fp32, then one rounding): per nibble pair one
    LOP3 into the fp16 magic 1024 + q (1024 + 16 q for a byte's upper nibble), one HADD2 /
    HFMA2 to the exact integer q - z, one HMUL2 by s (rounding once); zw [BN] zero-point
    words, sv [BN] fp16 scales. ASM false (the CPU interpreter): the same values in fp32."""
    zi = ((zw >> zshift) & 0xF)[:, None]  # [BN, 1]
    if ASM:
        z1 = (-(1024 + zi)).to(tl.float16)  # exact: integers below 2048
        z16 = (-(64 + zi)).to(tl.float16)
        s1 = sv.to(tl.float16)[:, None]
        return tl.inline_asm_elementwise(
            asm=_DEQUANT8, constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r",
            args=[words, _bits2(z1, z1), _bits2(z16, z16),
                  tl.full(words.shape, 0x2C002C00, tl.int32), _bits2(s1, s1)],
            dtype=(tl.float16,) * 8, is_pure=True, pack=1)
    s = sv.to(tl.float32)[:, None]
    z = zi.to(tl.float32)
    return (_code(words, 0, z, s), _code(words, 4, z, s), _code(words, 8, z, s),
            _code(words, 12, z, s), _code(words, 16, z, s), _code(words, 20, z, s),
            _code(words, 24, z, s), _code(words, 28, z, s))


@triton.jit
def _code(words, SHIFT: tl.constexpr, z, s):
    return ((((words >> SHIFT) & 0xF).to(tl.float32) - z) * s).to(tl.float16)


@triton.jit
def _dequant_words_k(words, s2, sz, dt: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_KW: tl.constexpr, PACKED: tl.constexpr = False, zw=None,
                     zshift=None, sv=None, ASM: tl.constexpr = False):
    """K-major words [BN, BKW] -> W^T tile [BN, 8 BKW] in K order, in dt (PACKED: fp16 by
    _dequant8_packed from the zero-point words zw and scales sv; the same values)."""
    if PACKED:
        v0, v1, v2, v3, v4, v5, v6, v7 = _dequant8_packed(words, zw, zshift, sv, ASM)
    else:
        v0 = _dequant_nibble(words, 0, s2, sz, dt)
        v1 = _dequant_nibble(words, 4, s2, sz, dt)
        v2 = _dequant_nibble(words, 8, s2, sz, dt)
        v3 = _dequant_nibble(words, 12, s2, sz, dt)
        v4 = _dequant_nibble(words, 16, s2, sz, dt)
        v5 = _dequant_nibble(words, 20, s2, sz, dt)
        v6 = _dequant_nibble(words, 24, s2, sz, dt)
        v7 = _dequant_nibble(words, 28, s2, sz, dt)
    # [BN, BKW, 2, 2, 2] with element (a, b, c) at flat position 4a + 2b + c = nibble index i
    v = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)),
                tl.join(tl.join(v1, v5), tl.join(v3, v7)))
    # word w = 4 r + j, nibble i is K row 32 r + 4 i + j: [BN, r, j, i] -> [BN, r, i, j]
    v = tl.permute(tl.reshape(v, (BLOCK_N, BLOCK_KW // 4, 4, 8)), (0, 1, 3, 2))
    return tl.reshape(v, (BLOCK_N, BLOCK_KW * 8))


@triton.jit(do_not_specialize=["M"])
def _awq_gemm_k_kernel(x_ptr, qt_ptr, qz_ptr, s_ptr, b_ptr, y_ptr, M, N, KW, W8,
                       stride_xm, stride_ym, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, HAS_BIAS: tl.constexpr,
                       IEEE: tl.constexpr, TILED: tl.constexpr = False, T: tl.constexpr = 16,
                       PACKED: tl.constexpr = False, ASM: tl.constexpr = False):
    """y[m, n] = sum_k x[m, k] w[k, n] (+ b[n]) for one [BLOCK_M tokens, BLOCK_N columns]
    tile; BLOCK_KW words (8 BLOCK_KW K rows, inside one group) per loop step. M (the step's
    tokens: a ragged last prefill chunk takes any value) is not specialized: it only masks
    the token tiles and sets their count, while every address is a token times stride_xm
    (specialized, fixed per model); N, KW, W8 and the strides keep their 16-divisibility."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % grid_m  # token tiles of one column tile run together (weights from L2)
    pid_n = pid // grid_m
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = tl.where(mask_n, offs_n, 0)  # clamped: weight loads need no mask
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    toks = tl.where(mask_m, offs_m, 0).to(tl.int64)  # M * stride can pass 2^31
    offs_w = tl.arange(0, BLOCK_KW)
    offs_k = tl.arange(0, BLOCK_KW * 8)
    jn = rows % 8
    zshift = (4 * (jn % 2) + jn // 2) * 4  # zero points stay in the AWQ nibble order
    w_row = _row_bases(qt_ptr, rows, KW, TILED, T)  # [BN, 1]
    x_tok = x_ptr + toks[None, :] * stride_xm  # [1, BM]
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for w0 in range(0, KW, BLOCK_KW):
        words = tl.load(_word_ptrs(w_row, w0, offs_w, TILED, T))  # [BN, BKW] int32
        g = (w0 * 8) // GROUP
        if PACKED:  # fp16 x: the packed dequantization (same values)
            w = _dequant_words_k(words, None, None, dt, BLOCK_N, BLOCK_KW, True,
                                 tl.load(qz_ptr + g * W8 + rows // 8), zshift,
                                 tl.load(s_ptr + g * N + rows), ASM)
        else:
            z = ((tl.load(qz_ptr + g * W8 + rows // 8) >> zshift) & 0xF).to(tl.float32)  # [BN]
            s = tl.load(s_ptr + g * N + rows).to(tl.float32)  # [BN]
            w = _dequant_words_k(words, s[:, None], (s * z)[:, None], dt, BLOCK_N, BLOCK_KW)
        xt = tl.load(x_tok + (w0 * 8 + offs_k)[:, None])  # [BK, BM]
        if IEEE:
            acc = tl.dot(w, xt, acc, input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows).to(tl.float32)[:, None]
    y = y_ptr + toks[None, :] * stride_ym + offs_n[:, None]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])


def awq_gemm_k(x2, qweight_k, qzeros, scales, bias, group_size, *, config=None,
               checked: bool = False, tiled: bool = False, packed: bool = True):
    """Fused dequant-GEMM on the K-major layout: x2 [M, K] -> y [M, N] in x2's dtype
    (fp16/bf16 on tensor cores; fp32 with IEEE products). Allocates only y.

    config: awq_layout.GemmConfig; default awq_layout.gemm_config (the table). Its block_k
    is capped at the group size (one z and s per column and step). checked: as awq_gemv_k.
    tiled: the words are in awq_layout.tile_kmajor's order. packed: fp16 x takes the packed
    dequantization (_dequant8_packed: the same weight values in ~30 % fewer sm_90 loop
    instructions, run 89: 1-16 % faster); False runs the fp32-path dequantization (the tests'
    bit-equality oracle).
    """
    if checked:
        check_x(x2, qweight_k)
    else:
        check_gemv_args(x2, qweight_k, qzeros, scales, bias, group_size)
    assert x2.dtype in (torch.float16, torch.bfloat16, torch.float32), f"x dtype {x2.dtype}"
    (m, k), (n, kw) = x2.shape, qweight_k.shape
    cfg = config or awq_layout.gemm_config(m, n)
    bk = min(cfg.block_k, group_size)
    assert group_size % bk == 0 and bk % 32 == 0, f"block_k {bk} must divide group {group_size}"
    y = torch.empty((m, n), device=x2.device, dtype=x2.dtype)
    if m == 0:
        return y
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    asm = x2.is_cuda and torch.version.hip is None  # the packed path's PTX: NVIDIA only
    packed = packed and x2.dtype == torch.float16 and (asm or not x2.is_cuda)
    _awq_gemm_k_kernel[grid](
        x2, qweight_k, qzeros, scales, bias if bias is not None else scales, y, m, n, kw,
        n // 8, x2.stride(0), y.stride(0), GROUP=group_size, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_KW=bk // 8, HAS_BIAS=bias is not None,
        IEEE=x2.dtype == torch.float32, TILED=tiled, T=awq_layout.tile_words(group_size),
        PACKED=packed, ASM=asm, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y

