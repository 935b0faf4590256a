"""Triton INT4 (AWQ) linear for CUDA.

What `AWQLinear` runs on CUDA is the K-major path (qweight repacked once at load into
kernels/int4/awq_layout.py's int32 [N, K/8], same bytes):
    awq_linear_k      M <= GEMV_MAX_TOKENS: `awq_gemv_k` (kernels/int4/awq_gemv.py: fused dequant
                      GEMV, all tokens in one program); otherwise, as
                      awq_layout.prefill_path says (token threshold per N class, set by
                      `gpu_awq.py --prefill-sweep`), `awq_gemm_k` (kernels/int4/awq_gemm_k.py:
                      fused dequant-GEMM, tl.dot) or `awq_dequant_matmul_k` (dequantize W^T
                      [N, K] with 16-byte stores, then cuBLAS x @ W^T.T).
The AWQ-GEMM-layout kernels below (`awq_linear`: `awq_gemv`, `awq_gemm`,
`awq_dequant_matmul`) serve callers holding checkpoint-layout tensors; they are slower
(BENCHMARKS.md).

Contract: identical to kernels/int4/awq_ref.py:awq_linear / awq_linear_k (the oracles). Written
for Triton >= 3.0 (checked with 3.6 on the H200 and 3.9 locally, also under
TRITON_INTERPRET=1): plain loads, `tl.join`/`tl.reshape`/`tl.permute`, `tl.dot`,
`tl.atomic_add`; no
descriptors, no autotune, no inline assembly. benchmarks/sm90_compile.py awq compiles them for
sm_90 without a GPU.

AWQ-layout unpacking: logical column n of a tile sits in word n // 8 at bit
4 * AWQ_ORDER_INV[n % 8], where AWQ_ORDER_INV[j] = 4 * (j % 2) + j // 2 (= [0, 4, 1, 5, 2, 6,
3, 7]). Every K block lies inside one quantization group (BLOCK_K divides group_size), so one
row of zeros/scales serves the whole block.

AWQ-layout paths (M = tokens):
    M <= GEMV_MAX_TOKENS             awq_gemv: one program per (word tile, K split, token),
                                     fp32 split-K partial sums combined with atomics
    M <= FUSED_GEMM_MAX_TOKENS       awq_gemm: tiled tl.dot on the dequantized tile
    otherwise                        awq_dequantize (chunked over N) + torch.matmul (cuBLAS)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hisparse_cli.kernels.fp8 import w4a8_linear
from hisparse_cli.kernels.int4 import awq_layout
from hisparse_cli.kernels.int4.awq_gemm_k import _dequant_words_k, awq_gemm_k
from hisparse_cli.kernels.int4.awq_gemv import (_row_bases, _sm_count, _word_ptrs, awq_gemv_k,
                                           check_gemv_args, check_x)
from hisparse_cli.kernels.int4.awq_ref import check_awq_tensors

GEMV_MAX_TOKENS = awq_layout.GEMV_MAX_TOKENS
DEQUANT_CHUNK_ELEMS_K = awq_layout.DEQUANT_CHUNK_ELEMS  # K-major path's temp W^T
# The fused GEMM lost to dequantize + cuBLAS at every measured size on the H200 (8 to 2048
# tokens, 20-60x slower; BENCHMARKS.md), so `awq_linear` does not pick it until it is fixed.
FUSED_GEMM_MAX_TOKENS = GEMV_MAX_TOKENS
DEQUANT_CHUNK_ELEMS = 1 << 25  # AWQ-layout path's temp weight (64 MiB in fp16)


@triton.jit
def _awq_gemv_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, b_ptr, y_ptr, N, K, W, stride_xm, stride_ym,
                     K_PER_SPLIT, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_W: tl.constexpr, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr):
    # Words are loaded once, as a coalesced 2-D [BLOCK_K, BLOCK_W] tile; the 8 nibbles of a
    # word are taken one at a time with constant shifts (a static loop), each a 2-D tensor with
    # its own [BLOCK_W] accumulator for columns 8 * w + j. No gathers, no 3-D broadcast.
    pid_w = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.program_id(2)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)  # [BW] word columns
    mask_w = offs_w < W
    offs_k = tl.arange(0, BLOCK_K)
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    for j in tl.static_range(8):
        shift = 4 * (4 * (j % 2) + j // 2)  # bit offset of column 8w + j (a constant)
        cols = offs_w * 8 + j
        mask_c = mask_w & (cols < N)
        acc = tl.zeros((BLOCK_W,), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            g = k0 // GROUP
            xk = tl.load(x_ptr + m * stride_xm + k0 + offs_k).to(tl.float32)  # [BK]
            words = tl.load(qw_ptr + (k0 + offs_k)[:, None] * W + offs_w[None, :],
                            mask=mask_w[None, :], other=0)  # [BK, BW] int32
            q = ((words >> shift) & 0xF).to(tl.float32)
            part = tl.sum(xk[:, None] * q, axis=0)  # [BW] = sum_k x_k q_k
            zw = tl.load(qz_ptr + g * W + offs_w, mask=mask_w, other=0)
            z = ((zw >> shift) & 0xF).to(tl.float32)
            s = tl.load(s_ptr + g * N + cols, mask=mask_c, other=0.0).to(tl.float32)
            # sum_k x_k (q_k - z) s = s (sum_k x_k q_k - z sum_k x_k): z, s constant in a block
            acc += s * (part - z * tl.sum(xk, axis=0))
        if HAS_BIAS:
            b = tl.load(b_ptr + cols, mask=mask_c, other=0.0).to(tl.float32)
            acc += tl.where(pid_k == 0, b, 0.0)
        if ATOMIC:
            tl.atomic_add(y_ptr + m * stride_ym + cols, acc, mask=mask_c)
        else:
            tl.store(y_ptr + m * stride_ym + cols, acc.to(y_ptr.dtype.element_ty), mask=mask_c)


@triton.jit
def _dequant_tile(qw_ptr, qz_ptr, s_ptr, k0, offs_k, offs_n, mask_n, N, W,
                  GROUP: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """[BK, BN] dequantized tile of rows k0 + offs_k and columns offs_n, in OUT_DTYPE."""
    jn = offs_n % 8
    shift = (4 * (jn % 2) + jn // 2) * 4  # [BN]
    g = k0 // GROUP
    words = tl.load(qw_ptr + (k0 + offs_k)[:, None] * W + (offs_n // 8)[None, :],
                    mask=mask_n[None, :], other=0)  # [BK, BN], each word loaded for 8 columns
    q = (words >> shift[None, :]) & 0xF
    zw = tl.load(qz_ptr + g * W + offs_n // 8, mask=mask_n, other=0)  # [BN]
    z = (zw >> shift) & 0xF
    s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)  # [BN]
    return ((q - z[None, :]).to(tl.float32) * s[None, :]).to(OUT_DTYPE)


# M (tokens) only masks rows and counts tiles: one variant for every token count
@triton.jit(do_not_specialize=["M"])
def _awq_gemm_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, b_ptr, y_ptr, M, N, K, W,
                     stride_xm, stride_ym, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     HAS_BIAS: tl.constexpr):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n  # grouped ordering: GROUP_M row tiles share weight tiles in L2
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    rows = offs_m.to(tl.int64)  # M * N can pass 2^31 (long prefill through lm_head)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + offs_k)[None, :],
                    mask=mask_m[:, None], other=0.0)  # [BM, BK]
        w = _dequant_tile(qw_ptr, qz_ptr, s_ptr, k0, offs_k, offs_n, mask_n, N, W,
                          GROUP, x_ptr.dtype.element_ty)  # [BK, BN]
        acc += tl.dot(a, w)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _awq_dequant_kernel(qw_ptr, qz_ptr, s_ptr, w_ptr, N, W, n0, stride_wk,
                        GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    k0 = tl.program_id(0) * BLOCK_K
    offs_k = tl.arange(0, BLOCK_K)
    offs_out = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of w_ptr's chunk
    offs_n = n0 + offs_out
    mask_n = offs_n < N
    w = _dequant_tile(qw_ptr, qz_ptr, s_ptr, k0, offs_k, offs_n, mask_n, N, W,
                      GROUP, w_ptr.dtype.element_ty)
    tl.store(w_ptr + (k0 + offs_k)[:, None] * stride_wk + offs_out[None, :], w,
             mask=mask_n[None, :])


def _check(x2: torch.Tensor, qweight, qzeros, scales, bias, group_size: int, block_k: int):
    check_awq_tensors(x2, qweight, qzeros, scales, bias, group_size)
    assert x2.dim() == 2 and x2.stride(1) == 1, "x must be [M, K] with unit stride in K"
    for t in (qweight, qzeros, scales) + (() if bias is None else (bias,)):
        assert t.is_contiguous(), "qweight/qzeros/scales/bias must be contiguous"
    assert group_size % block_k == 0 and block_k >= 16, f"block_k {block_k} must divide group"


def awq_gemv(x2, qweight, qzeros, scales, bias, group_size, *, block_k=None, block_w=32,
             split_k=None, num_warps=4):
    """Fused dequant GEMV for few tokens: x2 [M, K] -> y [M, N] in x2's dtype."""
    block_k = block_k or min(group_size, 64)  # H200 sweep (BENCHMARKS.md): 64 beat 32 and 128
    _check(x2, qweight, qzeros, scales, bias, group_size, block_k)
    (m, k), w_words = x2.shape, qweight.shape[1]
    n = w_words * 8
    tiles = triton.cdiv(w_words, block_w)
    k_blocks = k // block_k
    if split_k is None:  # enough programs to fill the GPU a few times over
        split_k = max(1, min(k_blocks, (4 * _sm_count(x2.device)) // max(1, tiles * m)))
    per_split = triton.cdiv(k_blocks, split_k) * block_k
    split_k = triton.cdiv(k, per_split)
    atomic = split_k > 1
    y = torch.zeros((m, n), device=x2.device, dtype=torch.float32) if atomic else \
        torch.empty((m, n), device=x2.device, dtype=x2.dtype)
    _awq_gemv_kernel[(tiles, split_k, m)](
        x2, qweight, qzeros, scales, bias if bias is not None else scales, y, n, k, w_words,
        x2.stride(0), y.stride(0), per_split, GROUP=group_size, BLOCK_K=block_k,
        BLOCK_W=block_w, HAS_BIAS=bias is not None, ATOMIC=atomic, num_warps=num_warps)
    return y.to(x2.dtype) if atomic else y


def _gemm_config(m: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for m tokens: a starting point."""
    if m <= 16:
        return 16, 64, 64, 4, 3
    if m <= 64:
        return 32, 128, 64, 4, 3
    return 64, 128, 64, 4, 3


def awq_gemm(x2, qweight, qzeros, scales, bias, group_size, *, config=None):
    """Fused dequant GEMM (tl.dot): x2 [M, K] -> y [M, N] in x2's dtype (fp16/bf16)."""
    bm, bn, bk, warps, stages = config or _gemm_config(x2.shape[0])
    bk = min(bk, group_size)
    _check(x2, qweight, qzeros, scales, bias, group_size, bk)
    assert x2.dtype in (torch.float16, torch.bfloat16), "tl.dot path takes fp16/bf16"
    (m, k), w_words = x2.shape, qweight.shape[1]
    n = w_words * 8
    y = torch.empty((m, n), device=x2.device, dtype=x2.dtype)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _awq_gemm_kernel[grid](
        x2, qweight, qzeros, scales, bias if bias is not None else scales, y, m, n, k, w_words,
        x2.stride(0), y.stride(0), GROUP=group_size, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        GROUP_M=8, HAS_BIAS=bias is not None, num_warps=warps, num_stages=stages)
    return y


def awq_dequantize(qweight, qzeros, scales, group_size, dtype, *, n0=0, n1=None, out=None,
                   block_k=32, block_n=128):
    """Dequantized weight columns [n0, n1): [K, n1 - n0] in dtype (written into out if given)."""
    k, w_words = qweight.shape
    n = w_words * 8
    n1 = n if n1 is None else n1
    block_k = min(block_k, group_size)
    assert group_size % block_k == 0 and 0 <= n0 < n1 <= n and n0 % 8 == 0
    for t in (qweight, qzeros, scales):
        assert t.is_contiguous(), "qweight/qzeros/scales must be contiguous"
    w = out if out is not None else torch.empty((k, n1 - n0), device=qweight.device, dtype=dtype)
    assert w.shape == (k, n1 - n0) and w.stride(1) == 1
    grid = (k // block_k, triton.cdiv(n1 - n0, block_n))
    _awq_dequant_kernel[grid](qweight, qzeros, scales, w, n, w_words, n0, w.stride(0),
                              GROUP=group_size, BLOCK_K=block_k, BLOCK_N=block_n)
    return w


def awq_dequant_matmul(x2, qweight, qzeros, scales, bias, group_size):
    """Dequantize (in column chunks of at most DEQUANT_CHUNK_ELEMS) then cuBLAS matmul."""
    _check(x2, qweight, qzeros, scales, bias, group_size, min(32, group_size))
    (m, k), n = x2.shape, qweight.shape[1] * 8
    chunk = max(128, (DEQUANT_CHUNK_ELEMS // k) // 128 * 128)
    if chunk >= n:
        y = x2 @ awq_dequantize(qweight, qzeros, scales, group_size, x2.dtype)
    else:
        y = torch.empty((m, n), device=x2.device, dtype=x2.dtype)
        buf = torch.empty((k, chunk), device=x2.device, dtype=x2.dtype)
        for n0 in range(0, n, chunk):
            n1 = min(n, n0 + chunk)
            w = awq_dequantize(qweight, qzeros, scales, group_size, x2.dtype, n0=n0, n1=n1,
                               out=buf[:, : n1 - n0])
            torch.matmul(x2, w, out=y[:, n0:n1])
    if bias is not None:
        y += bias.to(y.dtype)
    return y


def awq_linear(x, qweight, qzeros, scales, bias, group_size):
    """y [..., out] = x [..., in] @ dequant(W) + bias (contract: kernels/int4/awq_ref.py)."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        from hisparse_cli.kernels.int4.awq_ref import awq_linear as ref

        return ref(x, qweight, qzeros, scales, bias, group_size)  # fp32: no tensor-core path
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m <= GEMV_MAX_TOKENS:
        y = awq_gemv(x2, qweight, qzeros, scales, bias, group_size)
    elif m <= FUSED_GEMM_MAX_TOKENS:
        y = awq_gemm(x2, qweight, qzeros, scales, bias, group_size)
    else:
        y = awq_dequant_matmul(x2, qweight, qzeros, scales, bias, group_size)
    return y.reshape(*lead, y.shape[-1])


# == K-major layout (kernels/int4/awq_layout.py): what AWQLinear holds on CUDA ======================
# qweight_k int32 [N, K/8]: word (n, w) holds q[32 (w // 4) + 4 i + w % 4, n] at bits 4i. A
# row of words is contiguous along K, so a [BLOCK_N, BLOCK_KW] word tile loads with 16-byte
# coalesced loads, each word exactly once. The decode GEMV is kernels/int4/awq_gemv.py.

@triton.jit
def _awq_dequant_k_kernel(qt_ptr, qz_ptr, s_ptr, w_ptr, N, KW, W8, n0, n1, stride_wn,
                          sc_ptr, stride_sc,
                          GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
                          TILED: tl.constexpr = False, T: tl.constexpr = 16,
                          CODES: tl.constexpr = False):
    """W^T rows [n0 + ...] of the K-major weight: w[n - n0, k] = (q[k, n] - z) * s, written as
    contiguous runs of 8 * BLOCK_KW values per row (16-byte stores). One group per tile.
    CODES (the W4A8 path, kernels/fp8/w4a8_ref.py): w gets the codes q - z (exact in e4m3)
    and sc[g, n - n0] the group's scale in fp32 (stride_sc: sc's row stride)."""
    pid_w = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_out = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # rows of w_ptr's chunk
    offs_n = n0 + offs_out
    mask_n = offs_n < n1  # rows past the chunk belong to no one (w_ptr holds n1 - n0 rows)
    rows = tl.where(mask_n, offs_n, 0).to(tl.int64)
    w0 = pid_w * BLOCK_KW
    words = tl.load(_word_ptrs(_row_bases(qt_ptr, rows, KW, TILED, T), w0,
                               tl.arange(0, BLOCK_KW), TILED, T))
    g = (w0 * 8) // GROUP
    jn = offs_n % 8
    zshift = (4 * (jn % 2) + jn // 2) * 4
    z = ((tl.load(qz_ptr + g * W8 + rows // 8) >> zshift) & 0xF).to(tl.float32)  # [BN]
    s = tl.load(s_ptr + g * N + rows).to(tl.float32)
    if CODES:
        s2 = tl.full((BLOCK_N, 1), 1.0, tl.float32)
        sz = z[:, None]  # q - z: an integer in [-15, 15]
        if (w0 * 8) % GROUP == 0:  # the group's first program writes its scales
            tl.store(sc_ptr + g * stride_sc + offs_out, s, mask=mask_n)
    else:
        s2 = s[:, None]
        sz = (s * z)[:, None]  # (q - z) s = q s - z s, exact in fp32 (both exact products)
    v = _dequant_words_k(words, s2, sz, w_ptr.dtype.element_ty, BLOCK_N, BLOCK_KW)
    cols = w0 * 8 + tl.arange(0, BLOCK_KW * 8)
    tl.store(w_ptr + offs_out.to(tl.int64)[:, None] * stride_wn + cols[None, :], v,
             mask=mask_n[:, None])


def awq_dequantize_k(qweight_k, qzeros, scales, group_size, dtype, *, n0=0, n1=None, out=None,
                     block_n=16, block_kw=None, num_warps=1, tiled: bool = False):
    """Dequantized W^T rows [n0, n1) of the K-major weight: [n1 - n0, K] in dtype (nn.Linear
    layout; written into out if given). tiled: the words in awq_layout.tile_kmajor's order."""
    n, kw = qweight_k.shape
    k = kw * 8
    n1 = n if n1 is None else n1
    block_kw = block_kw or min(group_size // 8, 16)  # 16 x 16 words, 1 warp: H200 sweep
    assert (group_size // 8) % block_kw == 0 and 0 <= n0 < n1 <= n
    for t in (qweight_k, qzeros, scales):
        assert t.is_contiguous(), "qweight/qzeros/scales must be contiguous"
    w = out if out is not None else torch.empty((n1 - n0, k), device=qweight_k.device,
                                                dtype=dtype)
    assert w.shape == (n1 - n0, k) and w.stride(1) == 1
    _dequant_k_launch(qweight_k, qzeros, scales, group_size, w, n0, n1, block_n, block_kw,
                      num_warps, tiled)
    return w


def _dequant_k_launch(qweight_k, qzeros, scales, group_size, w, n0, n1, block_n=16,
                      block_kw=None, num_warps=1, tiled: bool = False, codes_scales=None):
    """The launch of awq_dequantize_k without its checks (the prefill path's arguments are
    checked once per call of awq_dequant_matmul_k, or once per module). codes_scales: an fp32
    [G, >= n1 - n0] tensor: w (e4m3) gets the codes and it the scales (the kernel's CODES)."""
    n, kw = qweight_k.shape
    block_kw = block_kw or min(group_size // 8, 16)
    grid = (kw // block_kw, triton.cdiv(n1 - n0, block_n))
    sc = codes_scales if codes_scales is not None else scales
    _awq_dequant_k_kernel[grid](qweight_k, qzeros, scales, w, n, kw, n // 8, n0, n1, w.stride(0),
                                sc, sc.stride(0),
                                GROUP=group_size, BLOCK_N=block_n, BLOCK_KW=block_kw,
                                TILED=tiled, T=awq_layout.tile_words(group_size),
                                CODES=codes_scales is not None, num_warps=num_warps)


def awq_dequant_matmul_k(x2, qweight_k, qzeros, scales, bias, group_size, *,
                         checked: bool = False, tiled: bool = False):
    """Dequantize W^T (in row chunks of at most DEQUANT_CHUNK_ELEMS) then cuBLAS x @ W^T.T.
    checked: as awq_gemv_k (the weights passed check_gemv_args before)."""
    if checked:
        check_x(x2, qweight_k)
    else:
        check_gemv_args(x2, qweight_k, qzeros, scales, bias, group_size)
    n, k = qweight_k.shape[0], x2.shape[1]
    return _dequant_matmul(x2, qweight_k, qzeros, scales, bias, group_size, n, k,
                           awq_layout.dequant_chunk(k, n, DEQUANT_CHUNK_ELEMS_K), tiled=tiled)


def _dequant_matmul(x2, qweight_k, qzeros, scales, bias, group_size, n, k, chunk, launch=None,
                    tiled: bool = False):
    """awq_dequant_matmul_k after its checks (n, k: the weight's; chunk: W^T rows a step).
    launch(w, n0, n1): dequantize W^T rows [n0, n1) into w (default: the Triton launch)."""
    if launch is None:
        def launch(w, n0, n1):
            _dequant_k_launch(qweight_k, qzeros, scales, group_size, w, n0, n1, tiled=tiled)
    if chunk >= n:
        w = torch.empty((n, k), device=x2.device, dtype=x2.dtype)
        launch(w, 0, n)
        y = x2 @ w.t()
    else:
        y = torch.empty((x2.shape[0], n), device=x2.device, dtype=x2.dtype)
        buf = torch.empty((chunk, k), device=x2.device, dtype=x2.dtype)
        for n0 in range(0, n, chunk):
            n1 = min(n, n0 + chunk)
            w = buf[: n1 - n0]
            launch(w, n0, n1)
            torch.matmul(x2, w.t(), out=y[:, n0:n1])
    if bias is not None:
        y += bias.to(y.dtype)
    return y


GRAPHS_PER_LINEAR = 4  # dequantize graphs kept per (rows, workspace address); then eager


class GraphedDequant:
    """The dequantize half of a prefill linear (W^T rows into a workspace, then cuBLAS),
    launched from CUDA graphs: a Triton launch costs the host ~18-23 us, a graph replay ~4 us
    (H200 box, `gpu_prefill_host.py --graph-probe`, git history). A graph holds its kernel's arguments, so
    one is captured per (W^T rows, workspace address, dtype): the workspace is still
    allocated per call (the planner's transient), and the caching allocator hands back the
    same block chunk after chunk, so a few graphs per linear serve a whole prefill. Beyond
    GRAPHS_PER_LINEAR addresses, or while another graph is being captured, the launch is
    eager. A graph holds no memory of its own (one kernel node writing the caller's
    workspace). Subclasses give `_dequant(w, n0, n1)`, the eager launch."""

    __slots__ = ("graphs",)

    def _dequant(self, w, n0, n1) -> None:
        raise NotImplementedError

    def _launch(self, w, n0, n1):
        """Dequantize W^T rows [n0, n1) into w: a graph replay where one is (or can be) kept."""
        graphs = self.graphs
        key = (n0, n1, w.data_ptr(), w.stride(0), w.dtype)  # the kernel is per output dtype
        g = graphs.get(key)
        capturing = torch.cuda.is_current_stream_capturing()  # someone else's graph: no
        if g is None or capturing:  # replay (nor capture) inside it, the launch is captured
            if capturing or len(graphs) >= GRAPHS_PER_LINEAR:
                self._dequant(w, n0, n1)
            else:
                graphs[key] = self._capture(w, n0, n1)  # runs this call's launch eagerly too
            return
        g.replay()

    def _capture(self, w, n0, n1):
        """A CUDA graph of the dequantize launch into w (captured on a side stream, without
        torch.cuda.graph's synchronize / empty_cache: this runs in the middle of a prefill)."""
        self._dequant(w, n0, n1)  # compiled (JIT) outside the capture; and it does this
        # call's work
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(device=w.device)
        side.wait_stream(torch.cuda.current_stream(w.device))
        with torch.cuda.stream(side):
            g.capture_begin(capture_error_mode="thread_local")
            try:
                self._dequant(w, n0, n1)
            finally:
                g.capture_end()
        torch.cuda.current_stream(w.device).wait_stream(side)
        return g


class PreparedLinearK(GraphedDequant):
    """awq_linear_k bound to one weight set: the weights' checks and the launch constants are
    done once, so a prefill call costs the host only x's checks, the dequantize launch and
    the cuBLAS call (on a slow host the per-call checks and dispatch were ~30 us of an
    INT4 prefill linear's ~100 us, against ~23 us for an fp16 F.linear). Same results as
    awq_linear_k, bit for bit. AWQLinear makes one per set of buffer objects
    (KernelBackend.prepare_awq_linear_k). On CUDA the prefill path's dequantize is replayed
    from a CUDA graph (GraphedDequant)."""

    __slots__ = ("qweight_k", "qzeros", "scales", "bias", "group_size", "n", "k", "chunk",
                 "device", "tiled", "fp8")

    def __init__(self, qweight_k, qzeros, scales, bias, group_size, tiled: bool = False):
        n, kw = qweight_k.shape
        check_gemv_args(qweight_k.new_empty((0, kw * 8), dtype=scales.dtype), qweight_k, qzeros,
                        scales, bias, group_size)
        self.qweight_k, self.qzeros, self.scales, self.bias = qweight_k, qzeros, scales, bias
        self.group_size, self.n, self.k, self.device = group_size, n, kw * 8, qweight_k.device
        self.chunk = awq_layout.dequant_chunk(self.k, n, DEQUANT_CHUNK_ELEMS_K)
        self.graphs: dict | None = {} if self.device.type == "cuda" else None
        self.tiled = tiled  # the words in awq_layout.tile_kmajor's order (AWQLinear "tiled")
        self.fp8 = w4a8_linear.usable(group_size, self.k)  # W4A8 prefill where active
        assert not tiled or n % awq_layout.TILE_ROWS == 0, f"{n} rows: not in 64-row tiles"

    def _dequant(self, w, n0, n1) -> None:
        sc = None
        if w.dtype == torch.uint8:  # a W4A8 workspace (kernels/fp8/w4a8_linear.py): codes
            from hisparse_cli.kernels.fp8.w4a8_linear import split_workspace

            w, sc = split_workspace(w, n1 - n0, self.k)
        _dequant_k_launch(self.qweight_k, self.qzeros, self.scales, self.group_size, w, n0, n1,
                          tiled=self.tiled, codes_scales=sc)

    def __call__(self, x):
        k, n = self.k, self.n
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # x's own width: checked below
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        m = x2.shape[0]
        if m <= GEMV_MAX_TOKENS or awq_layout.prefill_path(m, n, x2.element_size()) == "fused":
            y = awq_linear_k(x2, self.qweight_k, self.qzeros, self.scales, self.bias,
                             self.group_size, checked=True, tiled=self.tiled)
        else:
            assert x2.shape[1] == k and x2.device == self.device, \
                f"x must be [M, {k}] on {self.device}"
            if self.fp8 and w4a8_linear.active(self.device):
                y = w4a8_linear.w4a8_matmul(x2, n, k, self.chunk, self._dequant if self.graphs
                                            is None else self._launch, self.bias)
                return y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)
            y = _dequant_matmul(x2, self.qweight_k, self.qzeros, self.scales, self.bias,
                                self.group_size, n, k, self.chunk,
                                None if self.graphs is None else self._launch, tiled=self.tiled)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)


def awq_linear_k(x, qweight_k, qzeros, scales, bias, group_size, *, checked: bool = False,
                 tiled: bool = False):
    """y [..., out] = x [..., in] @ dequant(W) + bias with qweight in the K-major layout
    (kernels/int4/awq_layout.py); any float dtype (fp32 too). Contract otherwise as awq_linear.
    checked: the weights passed check_gemv_args before (AWQLinear checks them once): only x
    is checked per call (the host time of a prefill linear is what bounds INT4 prefill).
    tiled: the words in awq_layout.tile_kmajor's order (every path reads them so)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], qweight_k.shape[0]
    if m <= GEMV_MAX_TOKENS:
        y = awq_gemv_k(x2, qweight_k, qzeros, scales, bias, group_size, checked=checked,
                       tiled=tiled)
    elif awq_layout.prefill_path(m, n, x2.element_size()) == "fused":
        y = awq_gemm_k(x2, qweight_k, qzeros, scales, bias, group_size, checked=checked,
                       tiled=tiled)
    else:
        y = awq_dequant_matmul_k(x2, qweight_k, qzeros, scales, bias, group_size,
                                 checked=checked, tiled=tiled)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)
