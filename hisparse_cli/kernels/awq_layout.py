"""The run-time INT4 layout of the Triton kernels ("K-major"), made once at load time from the
AutoAWQ GEMM layout, and the launch choices the memory planner must mirror. Torch only.

Checkpoints, `hisparse quantize` and the torch reference keep the AutoAWQ GEMM layout
(kernels/awq_pack.py): qweight int32 [in, out/8], 8 output columns per word. The Triton GEMV
and dequantize kernels read qweight instead as

    qweight_k  int32 [out, in/8]   word (n, w) holds q[8w + i, n] at bits 4i, i = 0..7

i.e. each word packs 8 consecutive input rows of ONE output column, in natural nibble order,
and a row of words is contiguous along the input dimension. A word's 8 nibbles then feed one
accumulator, every word is loaded once with wide coalesced loads, and the dequantized weight
comes out as W^T [out, in] (nn.Linear's layout) with 16-byte stores. Same bytes as qweight:
`AWQLinear` replaces its buffer, it never holds both. qzeros and scales are not repacked.
"""

from __future__ import annotations

import torch

from hisparse_cli.kernels.awq_pack import PACK, unpack_int4

REPACK_CHUNK_ELEMS = 1 << 24  # codes converted per step (bounds the repack's temporaries)
_SHIFTS = tuple(4 * i for i in range(PACK))


def _pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """integer codes [R, C] (0..15), C % 8 == 0 -> int32 [R, C/8], nibble i = column 8w + i."""
    r, c = codes.shape
    c8 = codes.to(torch.int32).view(r, c // PACK, PACK)
    word = c8[..., 0].clone()
    for i in range(1, PACK):  # disjoint bits: | == +; the top nibble wraps into the sign bit
        word |= c8[..., i] << _SHIFTS[i]
    return word


def repack_kmajor(qweight: torch.Tensor) -> torch.Tensor:
    """AWQ GEMM qweight int32 [in, out/8] -> K-major int32 [out, in/8] (module doc)."""
    assert qweight.dtype == torch.int32 and qweight.dim() == 2
    k, words = qweight.shape
    assert k % PACK == 0, f"in_features {k} must be a multiple of 8"
    n = words * PACK
    out = torch.empty((n, k // PACK), dtype=torch.int32, device=qweight.device)
    step = max(1, REPACK_CHUNK_ELEMS // max(1, 8 * k))  # words of qweight per chunk
    for w0 in range(0, words, step):
        w1 = min(words, w0 + step)
        codes = unpack_int4(qweight[:, w0:w1].contiguous())  # uint8 [k, 8 (w1 - w0)]
        out[8 * w0: 8 * w1] = _pack_rows(codes.t())
    return out


def unpack_kmajor(qweight_k: torch.Tensor) -> torch.Tensor:
    """K-major int32 [out, in/8] -> uint8 codes [in, out] (the logical q of awq_pack)."""
    assert qweight_k.dtype == torch.int32 and qweight_k.dim() == 2
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=qweight_k.device)
    codes = (qweight_k.unsqueeze(-1) >> shifts) & 0xF  # [out, in/8, 8]
    return codes.reshape(qweight_k.shape[0], -1).t().to(torch.uint8)


def kmajor_to_awq(qweight_k: torch.Tensor) -> torch.Tensor:
    """The inverse of repack_kmajor: K-major [out, in/8] -> AWQ GEMM qweight [in, out/8]."""
    from hisparse_cli.kernels.awq_pack import pack_int4

    return pack_int4(unpack_kmajor(qweight_k))


# -- launch choices (the planner imports these: keep them free of triton) ----------------------
GEMV_MAX_TOKENS = 4  # more tokens: dequantize W^T (chunks of DEQUANT_CHUNK_ELEMS) + cuBLAS
DEQUANT_CHUNK_ELEMS = 1 << 26  # temp W^T of the cuBLAS path: 128 MiB in fp16, so every
# Llama-3-8B decoder linear is one chunk (two chunks cost 5-10 % of the layer on the H200)


def gemv_config(m: int, k: int, n: int, group: int, sms: int) -> dict:
    """Launch parameters of the K-major GEMV for x [m, k] @ W [k, n]: block_n (output columns
    per program), block_kw (words of K per loop step: at most one group), split (programs along
    K; > 1 means fp32 partials [split, m, n] and a reduction kernel), num_warps.

    From the H200 sweep (BENCHMARKS.md, 1 token, group 128): 32 columns x 16 words per
    2-warp program was best or within 5 % on every Llama-3-8B shape, with K split until about
    16 programs per SM (k/v: 16 splits, q/o 16, gate/up 4, down 16, lm_head 1)."""
    kw = k // PACK
    block_kw = min(group // PACK, 16)
    block_n, warps = 32, 2
    tiles = -(-n // block_n) * m
    steps = kw // block_kw
    split = 1
    while tiles * split * 2 <= 16 * sms and steps % (2 * split) == 0 and steps // (2 * split) >= 2:
        split *= 2
    return dict(block_n=block_n, block_kw=block_kw, split=split, num_warps=warps)


def dequant_chunk(k: int, n: int, chunk_elems: int) -> int:
    """Rows of W^T [n, k] dequantized per step of the prefill path (>= n: one step)."""
    return max(128, (chunk_elems // k) // 128 * 128)
