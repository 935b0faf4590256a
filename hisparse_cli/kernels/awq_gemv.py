"""Triton INT4 (AWQ) decode GEMV on the K-major run-time layout: y [M, N] = x [M, K] @ W for
M <= GEMV_MAX_TOKENS tokens (kernels/awq_layout.py owns the layout and the launch table).

Version 3 (v2, the natural-nibble-order kernel of H200 run 4, lives on as the baseline in
benchmarks/awq_gemv_v2.py). What changed and why:
- Layout: a word's nibble i holds K index 32 (w // 4) + 4 i + w % 4 (w = word index in its
  row), so for a fixed nibble the 4 words of one 16-byte load need 4 *consecutive* x values:
  one 8-byte load per nibble and token instead of v2's four 2-byte gathers (v2's SASS: 32
  scalar x loads against 4 LDG.128 of weights per loop step).
- All M tokens in one program: the weight tile is loaded once and feeds M accumulators
  (v2 launched one program per token and re-read W per token).
- Pipelining by the compiler (`tl.range(num_stages=...)`) instead of a hand-written prefetch.

Per loop step a program loads a [BLOCK_N, BLOCK_KW] word tile (BLOCK_KW words of one group,
16-byte loads coalesced along K), z and s of its rows once, and for each nibble i masks it in
place: bits 16^j..16^(j+1) of a half-word read as the fp32 subnormal q 16^j 2^-149 (PTX
without .ftz keeps subnormals), x pre-scaled by the exact power of two 2^100 16^-j; the sum
is rescaled by 2^49 with s. Two instructions a nibble (LOP3 + FFMA); fp32 accumulation.
Split-K (SPLIT > 1) writes fp32 partials [SPLIT, M, N]; the last program of each column tile
(a counter per tile, atomically bumped) sums them in a fixed order: deterministic, one launch
(a second reduction kernel cost 2.6 µs x 128 calls = 0.34 ms per 8B decode token, H200 run
15), the same buffers every call (CUDA-graph capturable).

Written for Triton >= 3.0 (3.6 on the H200, 3.9 locally and under TRITON_INTERPRET=1); no
inline assembly, descriptors or autotuning. benchmarks/awq_sm90_compile.py compiles it for
sm_90 without a GPU.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from hisparse_cli.kernels import awq_layout
from hisparse_cli.kernels.awq_layout import check_gemv_args, check_x  # noqa: F401 (re-export)

@triton.jit
def _load_words(ptrs, STREAM: tl.constexpr):
    """A word tile, read once per call, so that x (re-read by every column tile) stays in
    L1: STREAM 1 reads it past L1 (.cg); 2 marks it first to evict (PTX allows one or the
    other on a load, not both)."""
    if STREAM == 1:
        return tl.load(ptrs, cache_modifier=".cg")
    if STREAM == 2:
        return tl.load(ptrs, eviction_policy="evict_first")
    return tl.load(ptrs)


@triton.jit
def _load_x(ptrs, STREAM: tl.constexpr):
    """x values in fp32; STREAM == 2 also marks them last to evict."""
    if STREAM == 2:
        return tl.load(ptrs, eviction_policy="evict_last").to(tl.float32)
    return tl.load(ptrs).to(tl.float32)


@triton.jit
def _token_term(words, hi, xp, STREAM: tl.constexpr):
    """(t [BN, BKW] = q x 2^-49 summed over each word's nibbles, xs [BKW] = the sum of each
    word's 8 x) of one loop step for one token: xp [BKW] points at the x of nibble 0 of
    each word (nibble i: + 4 i)."""
    x0 = _load_x(xp, STREAM)
    x1 = _load_x(xp + 4, STREAM)
    x2 = _load_x(xp + 8, STREAM)
    x3 = _load_x(xp + 12, STREAM)
    x4 = _load_x(xp + 16, STREAM)
    x5 = _load_x(xp + 20, STREAM)
    x6 = _load_x(xp + 24, STREAM)
    x7 = _load_x(xp + 28, STREAM)
    # nibble j of a half-word masked in place reads as the fp32 subnormal q 16^j 2^-149; x is
    # scaled by 2^100 16^-j (literals: no float constexpr arithmetic), so t = q x 2^-49
    t = (words & 0xF).to(tl.float32, bitcast=True) * (x0 * 1.2676506002282294e30)[None, :]
    t += (words & 0xF0).to(tl.float32, bitcast=True) * (x1 * 7.922816251426434e28)[None, :]
    t += (words & 0xF00).to(tl.float32, bitcast=True) * (x2 * 4.951760157141521e27)[None, :]
    t += (words & 0xF000).to(tl.float32, bitcast=True) * (x3 * 3.094850098213451e26)[None, :]
    t += (hi & 0xF).to(tl.float32, bitcast=True) * (x4 * 1.2676506002282294e30)[None, :]
    t += (hi & 0xF0).to(tl.float32, bitcast=True) * (x5 * 7.922816251426434e28)[None, :]
    t += (hi & 0xF00).to(tl.float32, bitcast=True) * (x6 * 4.951760157141521e27)[None, :]
    t += (hi & 0xF000).to(tl.float32, bitcast=True) * (x7 * 3.094850098213451e26)[None, :]
    xs = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))  # [BKW]
    return t, xs


@triton.jit
def _accumulate(acc, words, hi, xp, s49, sz, STREAM: tl.constexpr):
    """acc + s (q - z) x of one loop step for one token, as two fused multiply-adds per
    element (acc + s t, then - s z xs)."""
    t, xs = _token_term(words, hi, xp, STREAM)
    acc = acc + s49[:, None] * t
    return acc - sz[:, None] * xs[None, :]


@triton.jit
def _store_row(y_ptr, acc, b_ptr, offs_n, mask_n, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr):
    """One token's output row: the sum over the words of acc [BN, BKW] (+ bias unless a
    split-K partial, kept in fp32)."""
    out = tl.sum(acc, axis=1)
    if PARTIAL:
        tl.store(y_ptr + offs_n, out, mask=mask_n)
    else:
        if HAS_BIAS:
            out += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs_n, out.to(y_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _store_rows(y_ptr, stride_ym, acc0, acc1, acc2, acc3, b_ptr, offs_n, mask_n,
                M: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr):
    _store_row(y_ptr, acc0, b_ptr, offs_n, mask_n, HAS_BIAS, PARTIAL)
    if M > 1:
        _store_row(y_ptr + stride_ym, acc1, b_ptr, offs_n, mask_n, HAS_BIAS, PARTIAL)
    if M > 2:
        _store_row(y_ptr + 2 * stride_ym, acc2, b_ptr, offs_n, mask_n, HAS_BIAS, PARTIAL)
    if M > 3:
        _store_row(y_ptr + 3 * stride_ym, acc3, b_ptr, offs_n, mask_n, HAS_BIAS, PARTIAL)


@triton.jit
def _reduce_tile(p_ptr, b_ptr, y_ptr, offs_n, mask_n, stride_ps, stride_pm, stride_ym,
                 M: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y[m, tile] = sum_s p[s, m, tile] (+ bias) in the fixed order s = 0, 1, ...: the
    split-K sum of one column tile, run by the tile's last program to finish. The partials
    were written by other SMs: read them past L1 (.cg)."""
    for m in tl.static_range(M):
        out = tl.load(p_ptr + m * stride_pm + offs_n, mask=mask_n, other=0.0, cache_modifier=".cg")
        for sp in tl.static_range(1, SPLIT):
            out += tl.load(p_ptr + sp * stride_ps + m * stride_pm + offs_n, mask=mask_n,
                           other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            out += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * stride_ym + offs_n, out.to(y_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _gemv_step(acc0, acc1, acc2, acc3, words, zw, sv, w0, x_ptr, x_off, zshift, stride_xm,
               M: tl.constexpr, STREAM: tl.constexpr):
    """One loop step: the [BN, BKW] word tile at K word w0 (inside one group: zw, sv are its
    rows' zero-point words and scales) added into the M tokens' accumulators."""
    z = ((zw >> zshift) & 0xF).to(tl.float32)  # [BN]
    s = sv.to(tl.float32)  # [BN]
    s49 = s * 562949953421312.0  # s 2^49 t = s q x (powers of two: exact)
    sz = s * z
    hi = words >> 16
    xp = x_ptr + w0 * 8 + x_off  # [BKW]
    acc0 = _accumulate(acc0, words, hi, xp, s49, sz, STREAM)
    if M > 1:
        acc1 = _accumulate(acc1, words, hi, xp + stride_xm, s49, sz, STREAM)
    if M > 2:
        acc2 = _accumulate(acc2, words, hi, xp + 2 * stride_xm, s49, sz, STREAM)
    if M > 3:
        acc3 = _accumulate(acc3, words, hi, xp + 3 * stride_xm, s49, sz, STREAM)
    return acc0, acc1, acc2, acc3


@triton.jit
def _awq_gemv_kernel(x_ptr, qt_ptr, qz_ptr, s_ptr, b_ptr, y_ptr, p_ptr, cnt_ptr, N, KW, W8,
                     stride_xm, stride_ym, stride_ps, stride_pm, KW_PER_SPLIT,
                     GROUP: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_KW: tl.constexpr, NUM_STAGES: tl.constexpr,
                     HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, PREFETCH: tl.constexpr,
                     STREAM: tl.constexpr):
    """y[m, n] = sum_k x[m, k] w[k, n] for the M (1..4) tokens over this program's K range
    (a multiple of BLOCK_KW words; a step lies inside one group, so z and s are one value per
    row and step). One [BLOCK_N, BLOCK_KW] accumulator per token, all in the word tile's
    layout (a 3-D [M, BN, BKW] tile made Triton convert layouts through shared memory).
    SPLIT > 1 (split-K): fp32 partial sums to p + pid_k * stride_ps; then each program bumps
    its column tile's counter (acq_rel: its partials are visible to whoever sees the count)
    and the last one sums the tile's partials into y and resets the counter to 0, so one
    kernel does what a second reduction launch did (same order of adds: same bits), and the
    counters are ready for the next call or graph replay."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = tl.where(mask_n, offs_n, 0)  # clamped: weight loads need no mask
    offs_w = tl.arange(0, BLOCK_KW)
    x_off = (offs_w // 4) * 32 + offs_w % 4  # K index of nibble 0 of each word (+ 4 i)
    jn = rows % 8
    zshift = (4 * (jn % 2) + jn // 2) * 4  # zero points stay in the AWQ nibble order
    w_row = qt_ptr + rows.to(tl.int64)[:, None] * KW  # [BN, 1]
    w_start = pid_k * KW_PER_SPLIT
    acc0 = tl.zeros((BLOCK_N, BLOCK_KW), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_KW), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_KW), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_KW), dtype=tl.float32)
    if PREFETCH:  # registers double-buffer the next step's words, zeros and scales: their
        # loads are in flight while this step computes (the last step reloads itself)
        w_last = w_start + KW_PER_SPLIT - BLOCK_KW
        g = (w_start * 8) // GROUP
        words_n = _load_words(w_row + (w_start + offs_w)[None, :], STREAM)
        zw_n = tl.load(qz_ptr + g * W8 + rows // 8)
        s_n = tl.load(s_ptr + g * N + rows)
        for w0 in range(w_start, w_start + KW_PER_SPLIT, BLOCK_KW):
            words = words_n
            zw = zw_n
            sv = s_n
            nxt = tl.minimum(w0 + BLOCK_KW, w_last)
            g = (nxt * 8) // GROUP
            words_n = _load_words(w_row + (nxt + offs_w)[None, :], STREAM)
            zw_n = tl.load(qz_ptr + g * W8 + rows // 8)
            s_n = tl.load(s_ptr + g * N + rows)
            acc0, acc1, acc2, acc3 = _gemv_step(acc0, acc1, acc2, acc3, words, zw, sv, w0, x_ptr,
                                                x_off, zshift, stride_xm, M, STREAM)
    else:
        for w0 in tl.range(w_start, w_start + KW_PER_SPLIT, BLOCK_KW, num_stages=NUM_STAGES):
            words = _load_words(w_row + (w0 + offs_w)[None, :], STREAM)  # [BN, BKW] int32
            g = (w0 * 8) // GROUP
            zw = tl.load(qz_ptr + g * W8 + rows // 8)  # [BN] words of zero points
            sv = tl.load(s_ptr + g * N + rows)  # [BN]
            acc0, acc1, acc2, acc3 = _gemv_step(acc0, acc1, acc2, acc3, words, zw, sv, w0, x_ptr,
                                                x_off, zshift, stride_xm, M, STREAM)
    if SPLIT == 1:
        _store_rows(y_ptr, stride_ym, acc0, acc1, acc2, acc3, b_ptr, offs_n, mask_n, M,
                    HAS_BIAS, False)
    else:
        _store_rows(p_ptr + pid_k * stride_ps, stride_pm, acc0, acc1, acc2, acc3, b_ptr, offs_n,
                    mask_n, M, False, True)
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if done == SPLIT - 1:
            _reduce_tile(p_ptr, b_ptr, y_ptr, offs_n, mask_n, stride_ps, stride_pm, stride_ym,
                         M, SPLIT, HAS_BIAS)
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed")


def awq_gemv_k(x2, qweight_k, qzeros, scales, bias, group_size, *, config=None,
               checked: bool = False):
    """Fused dequant GEMV on the K-major layout: x2 [M, K] (M <= 4) -> y [M, N] in x2's dtype.

    config: awq_layout.GemvConfig; default awq_layout.gemv_config (the H200 table).
    split > 1: fp32 partials [split, M, N], summed by each column tile's last program.
    checked: the weights already passed check_gemv_args (only x is checked here).
    """
    if checked:
        check_x(x2, qweight_k)
    else:
        check_gemv_args(x2, qweight_k, qzeros, scales, bias, group_size)
    (m, k), (n, kw) = x2.shape, qweight_k.shape
    assert 1 <= m <= awq_layout.GEMV_MAX_TOKENS, f"{m} tokens: the GEMV takes 1..4"
    cfg = config or awq_layout.gemv_config(m, k, n, group_size, _sm_count(x2.device))
    bkw, split = cfg.block_kw, cfg.split
    assert (group_size // 8) % bkw == 0 and bkw % 4 == 0, \
        f"block_kw {bkw}: a multiple of 4 words dividing the group's {group_size // 8}"
    assert kw % (bkw * split) == 0, f"{kw} words of K not a multiple of {bkw} x split {split}"
    y = torch.empty((m, n), device=x2.device, dtype=x2.dtype)
    has_bias = bias is not None
    tiles = triton.cdiv(n, cfg.block_n)
    common = dict(GROUP=group_size, M=m, BLOCK_N=cfg.block_n, BLOCK_KW=bkw,
                  NUM_STAGES=cfg.num_stages, HAS_BIAS=has_bias, SPLIT=split,
                  PREFETCH=cfg.prefetch, STREAM=cfg.stream,
                  num_warps=cfg.num_warps)
    b = bias if has_bias else scales
    if split == 1:
        _awq_gemv_kernel[(tiles, 1)](x2, qweight_k, qzeros, scales, b, y, y, qzeros, n, kw,
                                     n // 8, x2.stride(0), y.stride(0), 0, 0, kw, **common)
        return y
    part = torch.empty((split, m, n), device=x2.device, dtype=torch.float32)
    _awq_gemv_kernel[(tiles, split)](x2, qweight_k, qzeros, scales, b, y, part,
                                     _tile_counters(x2.device, tiles), n, kw, n // 8,
                                     x2.stride(0), y.stride(0), part.stride(0), part.stride(1),
                                     kw // split, **common)
    return y


COUNTERS = 1 << 14  # column-tile counters of the split-K GEMV (64 KiB per device)


@lru_cache(maxsize=8)
def _counter_buffer(device: torch.device) -> torch.Tensor:
    """Zeros, made once per device (on its first GEMV: the CUDA-graph decoder's eager warm-up
    step, before any capture); every split-K call leaves them at zero again."""
    return torch.zeros(COUNTERS, dtype=torch.int32, device=device)


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    assert tiles <= COUNTERS, f"{tiles} column tiles: more than the {COUNTERS} counters"
    return _counter_buffer(device)


@lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter runs on CPU tensors: any small number exercises split-K
    return torch.cuda.get_device_properties(device).multi_processor_count
