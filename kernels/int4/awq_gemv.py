"""Triton INT4 (AWQ) decode GEMV on the K-major run-time layout: y [M, N] = x [M, K] @ W for
M <= GEMV_MAX_TOKENS tokens (kernels/int4/awq_layout.py owns the layout and the launch table).

Version 3 (v2, the natural-nibble-order kernel of H200 run 4, lives on as the baseline in
benchmarks/awq_gemv_v2.py in git history). What changed and why:
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

Packed fp16 path (GemvConfig.packed 1 / 2; fp16 activations only, other dtypes take the
fp32 path above). Per word: LOP3 ORs each nibble pair (nibbles p and p + 4) into the fp16x2
magic 1024 (a SHR brings nibbles 2, 3, 6, 7 down), one HFMA2 scales and subtracts the zero
point exactly, giving (q - z) / 64 (packed 2: / 128) per lane; then four fp16x2 products
with the word's x pairs, summed per lane in fp16 (packed 2: over two words), converted to
fp32 (two HADD2.F32 and an FADD) and scaled by 64 s (128 s) into the fp32 accumulator. The
division keeps every lane sum below 65504 for any finite fp16 x (4 x 15/64 x 65504, 8 x
15/128 x 65504); the price is at tiny x, where the products fall below fp16's normal range
and keep 2^-25 absolute precision (x 64 or 128 in y's units). SASS for sm_90
(`sm90_compile.py awq --packed`), one 16-word step of a thread at 1 token: 471 instructions
on the fp32 path, 370 packed 1, 338 packed 2 (96 registers); at 4 tokens 1270 / 891 / 752.
The two PTX blocks run only on CUDA (ASM); the CPU interpreter runs an fp16 emulation of them
(_dequant_pairs_emulated, _dot_lanes_emulated) through the same Triton code around them.
Timed on the H200 (run 39, benchmarks/gpu_gemv_packed.py in git history): at 1 token 1.02-1.20x the fp32
path per Llama-3-8B shape (with its best tile), at 2-4 tokens 1.1-1.45x; GEMV_TABLE uses
packed 2 for every shape class.

The x pairs (x of nibbles p and p + 4 in one fp16x2 register) come from two 8-byte loads,
each holding the x of 4 neighbouring words, joined by bit operations (one PRMT a pair
instead was neutral on the H200, run 57, and is gone).

Per-row zero points and scales: loaded as [BN] vectors, which the compiler converts to the
word tile's layout through shared memory (6 barriers a step in the sm_90 SASS); loading them
in the word tile's layout instead (no barrier) was slower on every shape (run 44: gate|up
25.9 -> 34.7 us) and is gone.
Programmatic dependent launch (pdl 1, GEMV_TABLE since H200 run 46; kernels/pdl.py): the
first step's weights are loaded before gdc_wait(), x and every store after it; the kernel
then triggers its dependents. +5.9 % INT4 decode at 32K with the producers' early trigger.
Loading a second step's weights before the wait too (GemvConfig.pre 2, commit 3b72b0d) was
slower in the engine (H200 run 73: INT4 decode -4.7 / -3.3 %) and is gone.

Written for Triton >= 3.0 (3.6 on the H200, 3.9 locally and under TRITON_INTERPRET=1); PTX
inline assembly only on the packed path; no descriptors or autotuning.
benchmarks/sm90_compile.py awq compiles it for sm_90 without a GPU.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import torch
import triton
import triton.language as tl

from hisparse_cli.kernels.int4 import awq_layout
from hisparse_cli.kernels.pdl import enter as pdl_enter
from hisparse_cli.kernels.pdl import pdl_enabled
from hisparse_cli.kernels.int4.awq_layout import check_gemv_args, check_x  # noqa: F401 (re-export)

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
def _row_bases(qt_ptr, rows, KW, TILED: tl.constexpr, T: tl.constexpr):
    """[BN, 1] word pointers of the rows' K word 0: K-major rows of KW words, or (TILED,
    awq_layout.tile_kmajor) the rows' first [64, T] block, row r at (r // 64) 64 KW + (r % 64) T."""
    r = rows.to(tl.int64)
    if TILED:
        return qt_ptr + ((r // 64) * 64 * KW + (r % 64) * T)[:, None]
    return qt_ptr + (r * KW)[:, None]


@triton.jit
def _word_ptrs(w_row, w0, offs_w, TILED: tl.constexpr, T: tl.constexpr):
    """[BN, BKW] pointers of a step's words at K word w0 (a multiple of the step's BKW, which
    divides T) from the rows' bases w_row [BN, 1] (_row_bases): along the row, or (TILED) in
    the [64, T] block that holds them, each block 64 T words after the previous one."""
    if TILED:
        if T == offs_w.shape[0]:  # a step is a whole block
            return w_row + ((w0 // T) * (64 * T) + offs_w)[None, :]
        inner = tl.multiple_of(w0 % T, offs_w.shape[0])
        return w_row + ((w0 // T) * (64 * T) + inner + offs_w)[None, :]
    return w_row + (w0 + offs_w)[None, :]


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
    element (acc + s t, then - s z xs); s49, sz: [BN, 1] or [BN, BKW]."""
    t, xs = _token_term(words, hi, xp, STREAM)
    acc = acc + s49 * t
    return acc - sz * xs[None, :]


# fp16 bits of the packed path's offsets at z = 0: -(16 + z/64) and -(1 + z/64) for a
# pair's lower and upper nibble (PACKED 1: codes (q - z) / 64); -(8 + z/128) and
# -(0.5 + z/128) for PACKED 2 (codes / 128). z adds z (16 z) units in the last place.
_Z1_64, _Z16_64 = tl.constexpr(0xCC00), tl.constexpr(0xBC00)
_Z1_128, _Z16_128 = tl.constexpr(0xC800), tl.constexpr(0xB800)


def nibble_pairs_ptx(word: str) -> str:
    """PTX putting the nibble pairs (p, p + 4) of the 32-bit operand `word` into the fp16x2
    registers t0..t3 as 1024 + q (t1, t3: 1024 + 16 q, a byte's upper nibble), one LOP3 each
    (the caller declares .reg .b32 t0, t1, t2, t3, w8)."""
    return "\n".join((f"lop3.b32 t0, {word}, 0x000F000F, 0x64006400, 0xEA;",
                      f"lop3.b32 t1, {word}, 0x00F000F0, 0x64006400, 0xEA;",
                      f"shr.u32 w8, {word}, 8;",
                      "lop3.b32 t2, w8, 0x000F000F, 0x64006400, 0xEA;",
                      "lop3.b32 t3, w8, 0x00F000F0, 0x64006400, 0xEA;"))


_DEQUANT_PAIRS = tl.constexpr("\n".join((
    "{", ".reg .b32 t0, t1, t2, t3, w8;", nibble_pairs_ptx("$4"),
    "fma.rn.f16x2 $0, t0, $7, $5;", "fma.rn.f16x2 $1, t1, $8, $6;",
    "fma.rn.f16x2 $2, t2, $7, $5;", "fma.rn.f16x2 $3, t3, $8, $6;", "}")))


@triton.jit
def _dequant_pairs(words, z1, z16, WIDE: tl.constexpr):
    """Packed fp16 dequantization (PACKED): the 8 nibbles of each word as 4 fp16x2 pairs
    (nibbles p and p + 4, p = 0..3) of (q - z) / 64 (WIDE: / 128), exact. Each pair is one
    LOP3 that ORs the masked nibbles into the fp16 1024 (0x6400: 1024 + q, or 1024 + 16 q for
    the upper nibble of a byte) and one HFMA2 that scales by 1/64 (1/1024) and adds
    -(16 + z/64) (-(1 + z/64)): z1, z16 are those constants' fp16x2 bits, per row (WIDE:
    1/128, 1/2048, -(8 + z/128), -(0.5 + z/128)). Every step is exact in fp16."""
    if WIDE:
        c1 = 0x20002000  # fp16x2 1/128
        c16 = 0x10001000  # fp16x2 1/2048
    else:
        c1 = 0x24002400  # fp16x2 1/64
        c16 = 0x14001400  # fp16x2 1/1024
    return tl.inline_asm_elementwise(
        asm=_DEQUANT_PAIRS,
        constraints="=r,=r,=r,=r,r,r,r,r,r",
        args=[words, z1, z16, tl.full(words.shape, c1, tl.int32),
              tl.full(words.shape, c16, tl.int32)],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


def _dot_asm(words: int) -> str:
    """PTX of _dot_pairs over `words` words: operands $1.. the codes (4 a word), then the x
    pairs in the same order; one fp16x2 chain, its two lanes added in fp32 into $0."""
    n = 4 * words
    chain = [f"mul.rn.f16x2 a, $1, ${n + 1};"]
    chain += [f"fma.rn.f16x2 a, ${i + 1}, ${n + i + 1}, a;" for i in range(1, n)]
    return "\n".join(["{", ".reg .b32 a;", ".reg .b16 lo, hi;", ".reg .f32 fl, fh;", *chain,
                      "mov.b32 {lo, hi}, a;", "cvt.f32.f16 fl, lo;", "cvt.f32.f16 fh, hi;",
                      "add.f32 $0, fl, fh;", "}"])


_DOT1 = tl.constexpr(_dot_asm(1))
_DOT2 = tl.constexpr(_dot_asm(2))


@triton.jit
def _dot_pairs(v0, v1, v2, v3, p0, p1, p2, p3):
    """sum over a word's 8 nibbles of ((q - z) / 64) x: four fp16x2 products summed per lane
    in fp16 (a lane's 4 terms are at most 4 x 15/64 x 65504 < 65504 in all: no overflow for
    any finite fp16 x), then the two lanes added in fp32. p0..p3: the x pairs' fp16x2 bits."""
    return tl.inline_asm_elementwise(
        asm=_DOT1, constraints="=f" + ",r" * 8, args=[v0, v1, v2, v3, p0, p1, p2, p3],
        dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _dot_pairs2(v0, v1, v2, v3, u0, u1, u2, u3, p0, p1, p2, p3, r0, r1, r2, r3):
    """_dot_pairs over two words (codes v of one, u of the other, / 128: a lane's 8 terms
    are at most 8 x 15/128 x 65504 < 65504), one fp32 conversion for both."""
    return tl.inline_asm_elementwise(
        asm=_DOT2, constraints="=f" + ",r" * 16,
        args=[v0, v1, v2, v3, u0, u1, u2, u3, p0, p1, p2, p3, r0, r1, r2, r3],
        dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _f16(bits):
    """fp16 from the low 16 bits of an int32 tensor."""
    return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _bits2(lo, hi):
    """fp16x2 bits (int32) of two fp16 tensors: lo in bits 0-15, hi in bits 16-31."""
    return ((lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF)
            | (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16))


@triton.jit
def _lane_mul(v, p, a):
    """fp16 v * p (+ a): the exact product (11 x 11 bits fits fp32), one fp16 rounding;
    with a, the add rounds in fp32 first (an HFMA2 rounds once: same value unless the
    fp32 sum was inexact)."""
    prod = _f16(v).to(tl.float32) * _f16(p).to(tl.float32)
    if a is None:
        return prod.to(tl.float16)
    return (prod + a.to(tl.float32)).to(tl.float16)


@triton.jit
def _dequant_pairs_emulated(words, z1, z16, WIDE: tl.constexpr):
    """_dequant_pairs without PTX, for the CPU interpreter: the same 1024 + q (1024 + 16 q)
    fp16 codes, scales and offset bits, in fp32 (exact), rounded to fp16 once."""
    if WIDE:
        c1 = 0.0078125  # 1/128
        c16 = 0.00048828125  # 1/2048
    else:
        c1 = 0.015625  # 1/64
        c16 = 0.0009765625  # 1/1024
    o1_lo = _f16(z1).to(tl.float32)
    o1_hi = _f16(z1 >> 16).to(tl.float32)
    o16_lo = _f16(z16).to(tl.float32)
    o16_hi = _f16(z16 >> 16).to(tl.float32)
    out0 = _bits2(((1024 + (words & 0xF)).to(tl.float32) * c1 + o1_lo).to(tl.float16),
                  ((1024 + ((words >> 16) & 0xF)).to(tl.float32) * c1 + o1_hi).to(tl.float16))
    out1 = _bits2(((1024 + (words & 0xF0)).to(tl.float32) * c16 + o16_lo).to(tl.float16),
                  ((1024 + ((words >> 16) & 0xF0)).to(tl.float32) * c16 + o16_hi)
                  .to(tl.float16))
    w8 = (words >> 8) & 0xFFFFFF  # shr.u32
    out2 = _bits2(((1024 + (w8 & 0xF)).to(tl.float32) * c1 + o1_lo).to(tl.float16),
                  ((1024 + ((w8 >> 16) & 0xF)).to(tl.float32) * c1 + o1_hi).to(tl.float16))
    out3 = _bits2(((1024 + (w8 & 0xF0)).to(tl.float32) * c16 + o16_lo).to(tl.float16),
                  ((1024 + ((w8 >> 16) & 0xF0)).to(tl.float32) * c16 + o16_hi)
                  .to(tl.float16))
    return out0, out1, out2, out3


@triton.jit
def _dot_lanes_emulated(v0, v1, v2, v3, p0, p1, p2, p3, lo, hi):
    """Lane sums (lo, hi) of _dot_pairs's chain (mul, then three fma), continued from
    (lo, hi) unless None."""
    lo = _lane_mul(v0, p0, lo)
    hi = _lane_mul(v0 >> 16, p0 >> 16, hi)
    lo = _lane_mul(v1, p1, lo)
    hi = _lane_mul(v1 >> 16, p1 >> 16, hi)
    lo = _lane_mul(v2, p2, lo)
    hi = _lane_mul(v2 >> 16, p2 >> 16, hi)
    lo = _lane_mul(v3, p3, lo)
    hi = _lane_mul(v3 >> 16, p3 >> 16, hi)
    return lo, hi


@triton.jit
def _x_pair(xp, off, STREAM: tl.constexpr):
    """fp16x2 bits (x[xp + off], x[xp + off + 16]): the x of nibbles p and p + 4."""
    if STREAM == 2:
        lo = tl.load(xp + off, eviction_policy="evict_last")
        hi = tl.load(xp + off + 16, eviction_policy="evict_last")
    else:
        lo = tl.load(xp + off)
        hi = tl.load(xp + off + 16)
    lo = lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi = hi.to(tl.int16, bitcast=True).to(tl.int32) << 16
    return lo | hi


@triton.jit
def _halves(t, BN: tl.constexpr, BKW: tl.constexpr):
    """[BN, BKW] -> ([BN, BKW/2] even, [BN, BKW/2] odd) along the last axis."""
    return tl.split(tl.reshape(t, (BN, BKW // 2, 2)))


@triton.jit
def _halves1(t, BKW: tl.constexpr):
    """[BKW] -> ([BKW/2] even, [BKW/2] odd)."""
    return tl.split(tl.reshape(t, (BKW // 2, 2)))


@triton.jit
def _accumulate_packed(acc, v0, v1, v2, v3, xp, sc, STREAM: tl.constexpr, ASM: tl.constexpr):
    """acc + s (q - z) x of one loop step for one token on the packed path (sc = 64 s,
    [BN, 1] or [BN, BKW])."""
    p0 = _x_pair(xp, 0, STREAM)[None, :]
    p1 = _x_pair(xp, 4, STREAM)[None, :]
    p2 = _x_pair(xp, 8, STREAM)[None, :]
    p3 = _x_pair(xp, 12, STREAM)[None, :]
    if ASM:
        d = _dot_pairs(v0, v1, v2, v3, p0, p1, p2, p3)
    else:
        lo, hi = _dot_lanes_emulated(v0, v1, v2, v3, p0, p1, p2, p3, None, None)
        d = lo.to(tl.float32) + hi.to(tl.float32)
    return acc + sc * d


@triton.jit
def _codes_packed2(words, zi, BN: tl.constexpr, BKW: tl.constexpr, ASM: tl.constexpr):
    """PACKED 2: the codes (q - z) / 128 of the even and odd words of a [BN, BKW] word tile
    (zi: the rows' zero points, [BN, 1] or [BN, BKW / 2]), as _dequant_pairs's fp16x2 tuples."""
    h1 = zi + _Z1_128
    h16 = zi * 16 + _Z16_128
    z1 = (h1 << 16) | h1
    z16 = (h16 << 16) | h16
    we, wo = _halves(words, BN, BKW)
    if ASM:
        return _dequant_pairs(we, z1, z16, True), _dequant_pairs(wo, z1, z16, True)
    return (_dequant_pairs_emulated(we, z1, z16, True),
            _dequant_pairs_emulated(wo, z1, z16, True))


@triton.jit
def _dot_packed2(acc, ve, vo, p0, r0, p1, r1, p2, r2, p3, r3, sc, ASM: tl.constexpr):
    """acc + sc * the packed-2 dot of the codes ve, vo (even and odd words) with the x pairs
    p (even words) and r (odd words), each [BKW/2] (the fp16x2 bits of _x_pair)."""
    if ASM:
        d = _dot_pairs2(ve[0], ve[1], ve[2], ve[3], vo[0], vo[1], vo[2], vo[3],
                        p0[None, :], p1[None, :], p2[None, :], p3[None, :],
                        r0[None, :], r1[None, :], r2[None, :], r3[None, :])
    else:
        lo, hi = _dot_lanes_emulated(ve[0], ve[1], ve[2], ve[3], p0[None, :], p1[None, :],
                                     p2[None, :], p3[None, :], None, None)
        lo, hi = _dot_lanes_emulated(vo[0], vo[1], vo[2], vo[3], r0[None, :], r1[None, :],
                                     r2[None, :], r3[None, :], lo, hi)
        d = lo.to(tl.float32) + hi.to(tl.float32)
    return acc + sc * d


@triton.jit
def _accumulate_packed2(acc, ve, vo, xp, sc, STREAM: tl.constexpr, BKW: tl.constexpr,
                        ASM: tl.constexpr):
    """PACKED 2: acc [BN, BKW/2] + s (q - z) x summed over each pair of words (sc = 128 s,
    [BN, 1] or [BN, BKW/2]; ve, vo: the codes of the even and odd words)."""
    p0, r0 = _halves1(_x_pair(xp, 0, STREAM), BKW)
    p1, r1 = _halves1(_x_pair(xp, 4, STREAM), BKW)
    p2, r2 = _halves1(_x_pair(xp, 8, STREAM), BKW)
    p3, r3 = _halves1(_x_pair(xp, 12, STREAM), BKW)
    return _dot_packed2(acc, ve, vo, p0, r0, p1, r1, p2, r2, p3, r3, sc, ASM)


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
def _load_rows(qz_ptr, s_ptr, g, W8, N, rows):
    """The zero-point words and scales of group g for the program's rows, as [BN] vectors
    (broadcast against the word tile through shared memory: 6 BAR.SYNC a step in the sm_90
    SASS)."""
    zw = tl.load(qz_ptr + g * W8 + rows // 8)
    sv = tl.load(s_ptr + g * N + rows)
    return zw, sv


@triton.jit
def _gemv_step(acc0, acc1, acc2, acc3, words, zw, sv, w0, x_ptr, x_off, zshift, stride_xm,
               M: tl.constexpr, STREAM: tl.constexpr, PACKED: tl.constexpr,
               BN: tl.constexpr, BKW: tl.constexpr, ASM: tl.constexpr):
    """One loop step: the [BN, BKW] word tile at K word w0 (inside one group: zw, sv are its
    rows' zero-point words and scales, from _load_rows) added into the M tokens'
    accumulators."""
    zi = ((zw >> zshift) & 0xF)[:, None]  # [BN, 1] int32
    s = sv.to(tl.float32)[:, None]
    xq = x_ptr + w0 * 8 + x_off  # [BKW]: the x of nibble 0 of each word
    if PACKED == 2:  # two words per fp32 conversion, codes / 128
        ve, vo = _codes_packed2(words, zi, BN, BKW, ASM)
        sc = s * 128.0
        acc0 = _accumulate_packed2(acc0, ve, vo, xq, sc, STREAM, BKW, ASM)
        if M > 1:
            acc1 = _accumulate_packed2(acc1, ve, vo, xq + stride_xm, sc, STREAM, BKW, ASM)
        if M > 2:
            acc2 = _accumulate_packed2(acc2, ve, vo, xq + 2 * stride_xm, sc, STREAM, BKW, ASM)
        if M > 3:
            acc3 = _accumulate_packed2(acc3, ve, vo, xq + 3 * stride_xm, sc, STREAM, BKW, ASM)
    elif PACKED == 1:
        h1 = zi + _Z1_64
        h16 = zi * 16 + _Z16_64
        z1 = (h1 << 16) | h1
        z16 = (h16 << 16) | h16
        if ASM:
            v0, v1, v2, v3 = _dequant_pairs(words, z1, z16, False)
        else:
            v0, v1, v2, v3 = _dequant_pairs_emulated(words, z1, z16, False)
        sc = s * 64.0
        acc0 = _accumulate_packed(acc0, v0, v1, v2, v3, xq, sc, STREAM, ASM)
        if M > 1:
            acc1 = _accumulate_packed(acc1, v0, v1, v2, v3, xq + stride_xm, sc, STREAM, ASM)
        if M > 2:
            acc2 = _accumulate_packed(acc2, v0, v1, v2, v3, xq + 2 * stride_xm, sc, STREAM, ASM)
        if M > 3:
            acc3 = _accumulate_packed(acc3, v0, v1, v2, v3, xq + 3 * stride_xm, sc, STREAM, ASM)
    else:
        z = zi.to(tl.float32)
        s49 = s * 562949953421312.0  # s 2^49 t = s q x (powers of two: exact)
        sz = s * z
        hi = words >> 16
        acc0 = _accumulate(acc0, words, hi, xq, s49, sz, STREAM)
        if M > 1:
            acc1 = _accumulate(acc1, words, hi, xq + stride_xm, s49, sz, STREAM)
        if M > 2:
            acc2 = _accumulate(acc2, words, hi, xq + 2 * stride_xm, s49, sz, STREAM)
        if M > 3:
            acc3 = _accumulate(acc3, words, hi, xq + 3 * stride_xm, s49, sz, STREAM)
    return acc0, acc1, acc2, acc3


@triton.jit
def _awq_gemv_kernel(x_ptr, qt_ptr, qz_ptr, s_ptr, b_ptr, y_ptr, p_ptr, cnt_ptr, N, KW, W8,
                     stride_xm, stride_ym, stride_ps, stride_pm, KW_PER_SPLIT,
                     GROUP: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_KW: tl.constexpr, NUM_STAGES: tl.constexpr,
                     HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, PREFETCH: tl.constexpr,
                     STREAM: tl.constexpr, PACKED: tl.constexpr = 0,
                     ASM: tl.constexpr = True,
                     PDL: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = False,
                     TILED: tl.constexpr = False):
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
    w_row = _row_bases(qt_ptr, rows, KW, TILED, BLOCK_KW)  # [BN, 1] (tiled: T = BLOCK_KW)
    w_start = pid_k * KW_PER_SPLIT
    ACC_KW: tl.constexpr = BLOCK_KW // 2 if PACKED == 2 else BLOCK_KW  # PACKED 2: word pairs
    acc0 = tl.zeros((BLOCK_N, ACC_KW), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, ACC_KW), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, ACC_KW), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, ACC_KW), dtype=tl.float32)
    if PREFETCH:  # registers double-buffer the next step's words, zeros and scales: their
        # loads are in flight while this step computes (the last step reloads itself)
        w_last = w_start + KW_PER_SPLIT - BLOCK_KW
        g = (w_start * 8) // GROUP
        words_n = _load_words(_word_ptrs(w_row, w_start, offs_w, TILED, BLOCK_KW), STREAM)
        zw_n, s_n = _load_rows(qz_ptr, s_ptr, g, W8, N, rows)
        if PDL:  # the loads above read weights only; x is the previous kernel's output
            pdl_enter(True, PDL_TRIGGER)
        for w0 in range(w_start, w_start + KW_PER_SPLIT, BLOCK_KW):
            words = words_n
            zw = zw_n
            sv = s_n
            nxt = tl.minimum(w0 + BLOCK_KW, w_last)
            g = (nxt * 8) // GROUP
            words_n = _load_words(_word_ptrs(w_row, nxt, offs_w, TILED, BLOCK_KW), STREAM)
            zw_n, s_n = _load_rows(qz_ptr, s_ptr, g, W8, N, rows)
            acc0, acc1, acc2, acc3 = _gemv_step(acc0, acc1, acc2, acc3, words, zw, sv, w0, x_ptr,
                                                x_off, zshift, stride_xm, M, STREAM, PACKED,
                                                BLOCK_N, BLOCK_KW, ASM)
    else:
        w_first = w_start
        if PDL:  # the first step's weights, zero points and scales (no kernel writes them)
            # are loaded while the previous kernel may still run; x (its output) after the wait
            words = _load_words(_word_ptrs(w_row, w_start, offs_w, TILED, BLOCK_KW), STREAM)
            zw, sv = _load_rows(qz_ptr, s_ptr, (w_start * 8) // GROUP, W8, N, rows)
            pdl_enter(True, PDL_TRIGGER)
            acc0, acc1, acc2, acc3 = _gemv_step(acc0, acc1, acc2, acc3, words, zw, sv, w_start,
                                                x_ptr, x_off, zshift, stride_xm, M, STREAM,
                                                PACKED, BLOCK_N, BLOCK_KW, ASM)
            w_first = w_start + BLOCK_KW
        for w0 in tl.range(w_first, w_start + KW_PER_SPLIT, BLOCK_KW, num_stages=NUM_STAGES):
            words = _load_words(_word_ptrs(w_row, w0, offs_w, TILED, BLOCK_KW),
                                STREAM)  # [BN, BKW] int32
            g = (w0 * 8) // GROUP
            zw, sv = _load_rows(qz_ptr, s_ptr, g, W8, N, rows)
            acc0, acc1, acc2, acc3 = _gemv_step(acc0, acc1, acc2, acc3, words, zw, sv, w0, x_ptr,
                                                x_off, zshift, stride_xm, M, STREAM, PACKED,
                                                BLOCK_N, BLOCK_KW, ASM)
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
               checked: bool = False, tiled: bool = False):
    """Fused dequant GEMV on the K-major layout: x2 [M, K] (M <= 4) -> y [M, N] in x2's dtype.

    config: awq_layout.GemvConfig; default awq_layout.gemv_config (the H200 table).
    split > 1: fp32 partials [split, M, N], summed by each column tile's last program.
    checked: the weights already passed check_gemv_args (only x is checked here).
    tiled: the words are in awq_layout.tile_kmajor's order (as a config with tiled 1 says).
    """
    if checked:
        check_x(x2, qweight_k)
    else:
        check_gemv_args(x2, qweight_k, qzeros, scales, bias, group_size)
    (m, k), (n, kw) = x2.shape, qweight_k.shape
    assert 1 <= m <= awq_layout.GEMV_MAX_TOKENS, f"{m} tokens: the GEMV takes 1..4"
    cfg = config or awq_layout.gemv_config(m, k, n, group_size, _sm_count(x2.device))
    if tiled and not cfg.tiled:
        cfg = replace(cfg, tiled=1)
    bkw, split = cfg.block_kw, cfg.split
    assert (group_size // 8) % bkw == 0 and bkw % 4 == 0, \
        f"block_kw {bkw}: a multiple of 4 words dividing the group's {group_size // 8}"
    assert kw % (bkw * split) == 0, f"{kw} words of K not a multiple of {bkw} x split {split}"
    assert not cfg.tiled or (n % awq_layout.TILE_ROWS == 0
                             and bkw == awq_layout.tile_words(group_size)), \
        f"tiled GEMV: n {n} a multiple of 64 and block_kw {bkw} = the tile's words"
    y = torch.empty((m, n), device=x2.device, dtype=x2.dtype)
    has_bias = bias is not None
    tiles = triton.cdiv(n, cfg.block_n)
    asm = x2.is_cuda and torch.version.hip is None  # the packed path's PTX: NVIDIA only
    packed = cfg.packed if x2.dtype == torch.float16 and (asm or not x2.is_cuda) else 0
    pdl = bool(cfg.pdl) and pdl_enabled(x2.device)
    common = dict(GROUP=group_size, M=m, BLOCK_N=cfg.block_n, BLOCK_KW=bkw,
                  NUM_STAGES=cfg.num_stages, HAS_BIAS=has_bias, SPLIT=split,
                  PREFETCH=cfg.prefetch, STREAM=cfg.stream,
                  PACKED=packed, ASM=asm, PDL=pdl, TILED=bool(cfg.tiled),
                  PDL_TRIGGER=pdl,
                  num_warps=cfg.num_warps)
    if pdl:  # kernels/pdl.py: may start before the previous kernel ends, waits before x
        common["launch_pdl"] = True
    if cfg.maxnreg:  # a compile option (Triton >= 3.0); not passed at all when unset
        common["maxnreg"] = cfg.maxnreg
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
