"""The run-time INT4 layout of the Triton kernels ("K-major"), made once at load time from the
AutoAWQ GEMM layout, and the launch choices the memory planner must mirror. Torch only.

Checkpoints, `hisparse quantize` and the torch reference keep the AutoAWQ GEMM layout
(kernels/int4/awq_pack.py): qweight int32 [in, out/8], 8 output columns per word. The Triton GEMV
and dequantize kernels read qweight instead as

    qweight_k  int32 [out, in/8]   word (n, w) holds q[32 (w // 4) + 4 i + w % 4, n]
                                   at bits 4i, i = 0..7

i.e. each word packs 8 input rows of ONE output column and a row of words is contiguous along
the input dimension; inside each run of 4 words (one 16-byte load, 32 input rows) nibble i of
word j is input row 4 i + j. For a fixed nibble the 4 words of a 16-byte load then need 4
consecutive x values (one 8-byte load), every word is loaded once with wide coalesced loads,
and all 8 nibbles of a word feed the same output column; the dequantized weight comes out as
W^T [out, in] (nn.Linear's layout). The order does not depend on the group size (any group
is a multiple of 32 input rows). Same bytes as qweight: `AWQLinear` replaces its buffer, it
never holds both. qzeros and scales are not repacked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hisparse_cli.kernels.int4.awq_pack import PACK, unpack_int4

RUN_WORDS = 4  # words of one 16-byte load: the interleaving period
RUN = RUN_WORDS * PACK  # input rows per run of words
REPACK_CHUNK_ELEMS = 1 << 24  # codes converted per step (bounds the repack's temporaries)
TO_AWQ_CHUNK_ELEMS = 1 << 21  # the same for kmajor_to_awq, whose pack_int4 works in int64
# (~30 bytes of temporaries a code at its peak: ~60 MB a step, the room a 6 GiB card has)
_SHIFTS = tuple(4 * i for i in range(PACK))


def _pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """integer codes [R, C] (0..15), C % 8 == 0 -> int32 [R, C/8], nibble i = column 8w + i."""
    r, c = codes.shape
    c8 = codes.to(torch.int32).view(r, c // PACK, PACK)
    word = c8[..., 0].clone()
    for i in range(1, PACK):  # disjoint bits: | == +; the top nibble wraps into the sign bit
        word |= c8[..., i] << _SHIFTS[i]
    return word


def _interleave(codes_t: torch.Tensor) -> torch.Tensor:
    """codes [R, K] in K order -> [R, K] in word order: position 8 w + i = K row
    32 (w // 4) + 4 i + w % 4 (module doc)."""
    r, k = codes_t.shape
    return codes_t.reshape(r, k // RUN, PACK, RUN_WORDS).transpose(-1, -2).reshape(r, k)


def _deinterleave(codes_w: torch.Tensor) -> torch.Tensor:
    """The inverse of _interleave."""
    r, k = codes_w.shape
    return codes_w.reshape(r, k // RUN, RUN_WORDS, PACK).transpose(-1, -2).reshape(r, k)


def repack_kmajor(qweight: torch.Tensor, tiled_group: int | None = None) -> torch.Tensor:
    """AWQ GEMM qweight int32 [in, out/8] -> K-major int32 [out, in/8] (module doc);
    tiled_group: in tile_kmajor's order for that group size, written chunk by chunk (whole
    64-row tiles: a chunk's tiles are one contiguous stretch), no second full-size copy."""
    assert qweight.dtype == torch.int32 and qweight.dim() == 2
    k, words = qweight.shape
    assert k % RUN == 0, f"in_features {k} must be a multiple of {RUN}"
    n = words * PACK
    out = torch.empty((n, k // PACK), dtype=torch.int32, device=qweight.device)
    step = max(1, REPACK_CHUNK_ELEMS // max(1, 8 * k))  # words of qweight per chunk
    if tiled_group is not None:
        assert tileable(n, k, tiled_group), (n, k, tiled_group)
        step = -(-step // (TILE_ROWS // PACK)) * (TILE_ROWS // PACK)  # whole tiles a chunk
    flat = out.view(-1)
    for w0 in range(0, words, step):
        w1 = min(words, w0 + step)
        codes = unpack_int4(qweight[:, w0:w1].contiguous())  # uint8 [k, 8 (w1 - w0)]
        rows = _pack_rows(_interleave(codes.t()))
        if tiled_group is None:
            out[8 * w0: 8 * w1] = rows
        else:
            flat[8 * w0 * (k // PACK): 8 * w1 * (k // PACK)] = \
                tile_kmajor(rows, tiled_group).view(-1)
    return out


def unpack_kmajor(qweight_k: torch.Tensor) -> torch.Tensor:
    """K-major int32 [out, in/8] -> uint8 codes [in, out] (the logical q of awq_pack)."""
    assert qweight_k.dtype == torch.int32 and qweight_k.dim() == 2
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=qweight_k.device)
    codes = (qweight_k.unsqueeze(-1) >> shifts) & 0xF  # [out, in/8, 8]
    return _deinterleave(codes.reshape(qweight_k.shape[0], -1)).t().to(torch.uint8)


def kmajor_to_awq(qweight_k: torch.Tensor, tiled_group: int | None = None) -> torch.Tensor:
    """The inverse of repack_kmajor: K-major [out, in/8] -> AWQ GEMM qweight [in, out/8];
    tiled_group: qweight_k is in tile_kmajor's order for that group size. Converted a chunk of
    output rows at a time (whole 64-row tiles when tiled), so the temporaries stay near
    TO_AWQ_CHUNK_ELEMS codes whatever the shape: the whole-tensor conversion of a 4096 x 14336
    linear allocated 448 MiB int64 blocks, which a 6 GiB card cannot spare at load (H200 run
    137, the persistent decode kernel's item layout made from the tiled weights)."""
    from hisparse_cli.kernels.int4.awq_pack import pack_int4

    n, kw = qweight_k.shape
    k = kw * PACK
    assert n % PACK == 0, f"out_features {n} must be a multiple of {PACK}"
    out = torch.empty((k, n // PACK), dtype=torch.int32, device=qweight_k.device)
    unit = TILE_ROWS if tiled_group is not None else PACK
    step = max(1, TO_AWQ_CHUNK_ELEMS // max(1, k) // unit) * unit  # output rows a chunk
    flat = qweight_k.reshape(-1)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        rows = flat[r0 * kw: r1 * kw].view(r1 - r0, kw)  # whole tiles: a contiguous stretch
        if tiled_group is not None:
            rows = untile_kmajor(rows, tiled_group)
        out[:, r0 // PACK: r1 // PACK] = pack_int4(unpack_kmajor(rows))
    return out


# -- tiled K-major (the engine's layout on CUDA since H200 run 65) ----------------------------
# The K-major GEMV reads each loop step as BN rows x 16 words: 64 contiguous bytes from each
# of BN rows 2 KB apart (K = 4096), i.e. short segments spread over many DRAM pages. The tiled
# order keeps a [TILE_ROWS, T] block of words (T = tile_words(group) = the GEMV's block_kw)
# contiguous: one step of a 64-row program is one 4 KiB run (two for 128 rows), as the weight
# layouts of Marlin-style INT4 kernels do. Same [N, KW] shape, same words, other memory order:
# word (n, w) sits at ((n // 64) * KW/T + w // T) * 64 T + (n % 64) T + w % T.
# H200 run 65 (`gpu_gemv_packed.py --tiled`, 1 token, group 128, best tile each): qkv 8.5 ->
# 7.0 us, o 5.6 -> 5.3, gate|up 25.9 -> 21.1, down 14.1 -> 12.3, lm_head 135.5 -> 81.7 (3.3
# TB/s): -8.4 us a Llama-3-8B layer.
TILE_ROWS = 64
# AWQLinear.from_checkpoint stores the K-major words of a CUDA + Triton run in the tiled order
# (layout "tiled", where the rows fill 64-row tiles; other shapes stay K-major), which every
# K-major kernel reads (awq_gemv / awq_gemm_k / the dequantize: TILED). Same bytes.


def tileable(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether a K-major weight of this shape can be stored tiled (whole 64-row tiles)."""
    return out_features % TILE_ROWS == 0 and (in_features // PACK) % tile_words(group_size) == 0


def tile_words(group_size: int) -> int:
    """Words of K in one tile of the tiled layout: the GEMV's block_kw for the group."""
    return min(group_size // PACK, 16)


def tile_kmajor(qweight_k: torch.Tensor, group_size: int) -> torch.Tensor:
    """K-major int32 [N, KW] -> the same words in tiled order (above), as an [N, KW] tensor
    (only the tiled GEMV reads it that way). N must be a multiple of TILE_ROWS."""
    n, kw = qweight_k.shape
    t = tile_words(group_size)
    assert n % TILE_ROWS == 0 and kw % t == 0, (n, kw, t)
    tiles = qweight_k.reshape(n // TILE_ROWS, TILE_ROWS, kw // t, t).permute(0, 2, 1, 3)
    return tiles.contiguous().view(n, kw)


def untile_kmajor(tiled: torch.Tensor, group_size: int) -> torch.Tensor:
    """The inverse of tile_kmajor."""
    n, kw = tiled.shape
    t = tile_words(group_size)
    tiles = tiled.reshape(n // TILE_ROWS, kw // t, TILE_ROWS, t).permute(0, 2, 1, 3)
    return tiles.contiguous().view(n, kw)


# -- argument checks of the K-major kernels (kernels/int4/awq_gemv.py, awq_gemm_k.py, awq_triton.py)
def check_gemv_args(x2, qweight_k, qzeros, scales, bias, group_size):
    """Assert the K-major GEMV/dequantize contract: x2 [M, K] unit stride in K, qweight_k
    int32 [N, K/8], qzeros int32 [K/group, N/8], scales [K/group, N], bias [N] or None."""
    n, kw = qweight_k.shape
    k = kw * 8
    assert qweight_k.dtype == torch.int32 and qzeros.dtype == torch.int32, "int32 words"
    assert x2.dim() == 2 and x2.shape[1] == k and x2.stride(1) == 1, \
        f"x must be [M, {k}] with unit stride in K"
    assert k % group_size == 0 and group_size % 32 == 0, f"K {k}, group {group_size}"
    assert qzeros.shape == (k // group_size, n // 8) and scales.shape == (k // group_size, n), \
        f"qzeros {tuple(qzeros.shape)} / scales {tuple(scales.shape)} for K-major [{n}, {kw}]"
    assert bias is None or bias.shape == (n,)
    for t in (qweight_k, qzeros, scales) + (() if bias is None else (bias,)):
        assert t.is_contiguous(), "qweight/qzeros/scales/bias must be contiguous"
        assert t.device == x2.device, "tensors on different devices"


def check_x(x2, qweight_k) -> None:
    """The part of check_gemv_args about x alone, for callers whose weights were checked
    once (`checked=True`: AWQLinear checks its buffers on first use, not per call)."""
    assert x2.dim() == 2 and x2.shape[1] == qweight_k.shape[1] * 8 and x2.stride(1) == 1, \
        f"x must be [M, {qweight_k.shape[1] * 8}] with unit stride in K"
    assert x2.device == qweight_k.device, "tensors on different devices"



# -- launch choices (the planner imports these: keep them free of triton) ----------------------
GEMV_MAX_TOKENS = 4  # more tokens: prefill_path (fused GEMM, or dequantize W^T + cuBLAS)
DEQUANT_CHUNK_ELEMS = 1 << 26  # temp W^T of the cuBLAS path: 128 MiB in fp16, so every
# Llama-3-8B decoder linear is one chunk (two chunks cost 5-10 % of the layer on the H200)


@dataclass(frozen=True)
class GemvConfig:
    """One launch of the K-major GEMV (kernels/int4/awq_gemv.py). block_n: output columns per
    program; block_kw: words of K per loop step (a multiple of 4, inside one group); split:
    programs along K (> 1: fp32 partials [split, m, n] + a reduction kernel); num_warps;
    num_stages: software-pipelining depth of the K loop (1: none); prefetch: 1 loads the next
    step's words into registers before this step computes (then num_stages is not used);
    stream: so that x (read by every column tile) stays in L1, 1 loads the words past L1
    (.cg); 2 marks the words first and x last to evict; packed: 1 dequantizes to fp16x2
    pairs and multiplies in fp16 within a word, 2 the same over two words (fp16 x only,
    other dtypes take the fp32 path); maxnreg: a register cap per thread for ptxas (0: its
    own choice), for more resident warps at the price of spills; pdl: 1 launches with
    programmatic dependent launch where kernels/pdl.py enables it (sm_90+): the first
    step's weights are loaded before waiting for the kernel that wrote x; tiled: 1 reads
    the weights in tile_kmajor's order (block_kw = tile_words(group), n a multiple of 64)."""

    block_n: int
    block_kw: int
    split: int
    num_warps: int
    num_stages: int
    prefetch: int = 0
    stream: int = 0
    packed: int = 0
    maxnreg: int = 0
    pdl: int = 0
    tiled: int = 0

    def __post_init__(self) -> None:
        for name in ("block_n", "block_kw", "split", "num_warps", "num_stages"):
            v = getattr(self, name)
            if v < 1 or (name != "num_stages" and v & (v - 1)):
                raise ValueError(f"GemvConfig.{name} = {v}: a power of two >= 1")
        if self.block_kw % RUN_WORDS:
            raise ValueError(f"GemvConfig.block_kw = {self.block_kw}: a multiple of {RUN_WORDS}")
        if self.prefetch not in (0, 1):
            raise ValueError(f"GemvConfig.prefetch = {self.prefetch}: 0 or 1")
        if self.stream not in (0, 1, 2):
            raise ValueError(f"GemvConfig.stream = {self.stream}: 0, 1 or 2")
        if self.packed not in (0, 1, 2):
            raise ValueError(f"GemvConfig.packed = {self.packed}: 0, 1 or 2")
        if self.pdl not in (0, 1):
            raise ValueError(f"GemvConfig.pdl = {self.pdl}: 0 or 1")
        if self.tiled not in (0, 1):
            raise ValueError(f"GemvConfig.tiled = {self.tiled}: 0 or 1")
        if self.maxnreg and not 24 <= self.maxnreg <= 255:
            raise ValueError(f"GemvConfig.maxnreg = {self.maxnreg}: 0 or 24..255")


@dataclass(frozen=True)
class GemvTile:
    """A row of GEMV_TABLE: the tile of one shape class and how many programs per SM the
    K split aims for (split-K only while columns alone give fewer)."""

    block_n: int
    num_warps: int
    num_stages: int
    programs_per_sm: int
    prefetch: int = 0
    stream: int = 0
    packed: int = 0
    maxnreg: int = 0
    pdl: int = 0


# Shape classes by output columns n at 1..4 tokens; `benchmarks/gpu_awq.py --gemv-sweep` times
# GEMV_CANDIDATES and prints the rows (the packed variants were swept by gpu_gemv_packed.py,
# in git history).
GEMV_TABLE = {
    # tiles from the H200 sweeps of 2026-12-01 (benchmarks/gpu_awq.py --gemv-sweep; results in
    # benchmarks/results/h200-run6 and h200-run31; stream 2: words evict-first, x evict-last);
    # packed 2 (the packed fp16 GEMV, two words per fp32 conversion) and the small/large_n
    # tiles from gpu_gemv_packed.py (git history), H200 run 39 (benchmarks/results/h200-run39):
    # 1 token, per layer qkv+o+gate_up+down 60.9 -> 55.6 us, lm_head 118.5 -> 116.2 us;
    # 2-4 tokens 1.1-1.45x faster than packed 0
    # pdl 1 (kernels/pdl.py, H200 run 46, gpu_awq_ab.py --pdl, 3 rounds at 32K): INT4 decode
    # +5.9 % with the producers' early trigger (+1.7 % without it); zero points / scales in
    # the word tile's layout lost on every shape (run 44: 9.0 -> 9.5 us qkv, 14.4 -> 19.9 us
    # down) and are gone
    # large_n / huge_n: the fastest tiles on the tiled layout (H200 run 65, `gpu_gemv_packed.py
    # --tiled`): gate|up 21.8 -> 21.1 us with bn 128 / 2 warps, lm_head 95.5 -> 81.7 us with
    # 32 programs an SM and no pipelining; small_n's tile is within 0.3 us of the best there
    "small_n": GemvTile(block_n=128, num_warps=4, num_stages=1, programs_per_sm=16,
                        stream=2, packed=2, pdl=1),  # < 8192
    "large_n": GemvTile(block_n=128, num_warps=2, num_stages=1, programs_per_sm=16,
                        stream=2, packed=2, pdl=1),  # < 65536
    "huge_n": GemvTile(block_n=64, num_warps=2, num_stages=1, programs_per_sm=32,
                       packed=2, pdl=1),  # lm_head
}
# packed 2 applies to fp16 activations on NVIDIA CUDA; bf16/fp32 and ROCm take the fp32
# path (packed 0) with the same tile
# (block_n, num_warps, num_stages, prefetch, stream) the sweep tries (the K split comes from
# programs_per_sm); a warp covers 8 rows x 16 words, so block_n / (8 num_warps) rows a thread
_PLAIN = ((64, 2, 1), (64, 2, 3), (32, 2, 1), (32, 2, 3), (32, 1, 1), (64, 1, 1), (64, 4, 1),
          (128, 4, 1), (128, 4, 3), (128, 2, 1), (256, 4, 1), (16, 1, 1))
GEMV_CANDIDATES = (tuple(t + (0, 0) for t in _PLAIN)
                   + ((32, 1, 1, 1, 0), (64, 2, 1, 1, 0), (64, 1, 1, 1, 0), (128, 4, 1, 1, 0))
                   + tuple((bn, w, st, pf, sm) for bn, w, st, pf in
                           ((32, 1, 1, 0), (64, 2, 1, 0), (128, 2, 1, 0), (64, 2, 3, 0),
                            (128, 4, 3, 0), (32, 1, 1, 1), (64, 2, 1, 1)) for sm in (1, 2)))


def gemv_shape_class(n: int) -> str:
    """GEMV_TABLE's key for n output columns."""
    return "small_n" if n < 8192 else "large_n" if n < 65536 else "huge_n"


def gemv_split(k: int, n: int, block_n: int, block_kw: int, programs_per_sm: int,
               sms: int) -> int:
    """Programs along K: doubled while the grid stays <= programs_per_sm * sms, the K words
    divide evenly and every program keeps >= 2 loop steps."""
    steps = (k // PACK) // block_kw
    tiles = -(-n // block_n)
    split = 1
    while (tiles * split * 2 <= programs_per_sm * sms and steps % (2 * split) == 0
           and steps // (2 * split) >= 2):
        split *= 2
    return split


def gemv_config(m: int, k: int, n: int, group: int, sms: int) -> GemvConfig:
    """Launch of the K-major GEMV for x [m, k] @ W [k, n] (m <= GEMV_MAX_TOKENS, all tokens in
    one program) on a GPU with sms multiprocessors: GEMV_TABLE's tile for n, 16 words of K
    per step (fewer when the group is smaller), and the K split of gemv_split. A pure
    function of its arguments: nothing is tuned at run time (CUDA-graph capture safe)."""
    assert 1 <= m <= GEMV_MAX_TOKENS, f"{m} tokens: the GEMV takes 1..{GEMV_MAX_TOKENS}"
    tile = GEMV_TABLE[gemv_shape_class(n)]
    block_kw = min(group // PACK, 16)
    split = gemv_split(k, n, tile.block_n, block_kw, tile.programs_per_sm, sms)
    return GemvConfig(block_n=tile.block_n, block_kw=block_kw, split=split,
                      num_warps=tile.num_warps, num_stages=tile.num_stages,
                      prefetch=tile.prefetch, stream=tile.stream, packed=tile.packed,
                      maxnreg=tile.maxnreg, pdl=tile.pdl)


def dequant_chunk(k: int, n: int, chunk_elems: int) -> int:
    """Rows of W^T [n, k] dequantized per step of the prefill path (>= n: one step)."""
    return max(128, (chunk_elems // k) // 128 * 128)


# -- prefill (M > GEMV_MAX_TOKENS): fused dequant-GEMM or dequantize + cuBLAS -------------------
@dataclass(frozen=True)
class GemmConfig:
    """One launch of the fused dequant-GEMM (kernels/int4/awq_gemm_k.py). block_m: tokens per
    program (the MMA's N slot); block_n: output columns per program (the MMA's M slot);
    block_k: K rows per loop step (capped at the group size; a multiple of 32)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"GemmConfig.{name} = {v}: a power of two >= 1")
        if self.block_m < 16 or self.block_n < 16:
            raise ValueError("GemmConfig.block_m/block_n: >= 16 (tl.dot)")
        if self.block_k < 32:
            raise ValueError(f"GemmConfig.block_k = {self.block_k}: >= 32 (one run of words)")
        if self.num_stages < 1:
            raise ValueError(f"GemmConfig.num_stages = {self.num_stages}: >= 1")


# Token buckets (upper bounds, inclusive; None: the rest) of the fused GEMM's table.
GEMM_M_BUCKETS = (64, 256, 1024, None)


def gemm_m_bucket(m: int) -> str:
    """GEMM_TABLE's token key for m tokens: "m64", "m256", "m1024" or "m_large"."""
    for hi in GEMM_M_BUCKETS:
        if hi is None or m <= hi:
            return f"m{hi}" if hi is not None else "m_large"
    raise AssertionError("unreachable")


# (token bucket, N class of gemv_shape_class) -> tile: the fastest candidate per bucket and
# class in the H200 prefill sweep with the packed dequantization (run 89,
# `benchmarks/gpu_prefill_packed.sh`, benchmarks/results/h200-run89/packed). Only the rows
# FUSED_MAX_TOKENS reaches are used (gate|up at 5-64 tokens: 87.7 -> 65.7 us at 64 tokens,
# 1.05x fp16 cuBLAS); the others launch (run 10's m1024 tile did not) and are what the fused
# GEMM would run if the threshold moved.
_TILES = {("m64", "small_n"): (32, 64, 128, 4, 4), ("m64", "large_n"): (64, 128, 128, 8, 3),
          ("m256", "small_n"): (64, 64, 128, 4, 3), ("m256", "large_n"): (128, 128, 64, 8, 3),
          ("m1024", "small_n"): (128, 128, 64, 8, 3), ("m1024", "large_n"): (256, 128, 64, 8, 3),
          ("m_large", "small_n"): (128, 128, 64, 8, 3),
          ("m_large", "large_n"): (128, 128, 64, 8, 3)}
GEMM_TABLE = {(b, c): GemmConfig(*_TILES[(b, "large_n" if c == "huge_n" else c)])
              for b in ("m64", "m256", "m1024", "m_large")
              for c in ("small_n", "large_n", "huge_n")}  # huge_n (lm_head): not swept
# what --prefill-sweep tries: (block_m, block_n, block_k, num_warps, num_stages)
GEMM_CANDIDATES = ((64, 64, 128, 4, 3), (64, 128, 128, 4, 3), (32, 64, 128, 4, 4),
                   (64, 64, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 128, 8, 3),
                   (128, 128, 64, 4, 4), (128, 64, 128, 4, 3), (64, 128, 64, 4, 4),
                   (256, 128, 64, 8, 3), (128, 256, 64, 8, 3))

# Tokens up to which M > GEMV_MAX_TOKENS takes the fused GEMM (per N class; fp16/bf16 only),
# beyond: dequantize + cuBLAS (GEMV_MAX_TOKENS: never fused). Set from the H200
# `gpu_awq.py --prefill-sweep` of run 10 (benchmarks/results/h200-run10): the fused kernel
# wins only on the stacked gate|up at 64 tokens (78 vs 146 us); on the small-N layers, and
# at 256+ tokens everywhere, dequantize + cuBLAS is faster. lm_head (huge_n) not swept.
# Run 89 (packed dequantization, the table above) confirms it: gate|up at 64 tokens 65.7 vs
# 146.8 us, at 256 170.4 vs 162.2; q|k|v, o, down lose at 64 already (35.8 / 34.3 / 117.3 vs
# 32.1 / 21.0 / 77.7 us).
FUSED_MAX_TOKENS = {"small_n": GEMV_MAX_TOKENS, "large_n": 64, "huge_n": GEMV_MAX_TOKENS}


def gemm_config(m: int, n: int) -> GemmConfig:
    """Launch of the fused GEMM for m tokens and n output columns: GEMM_TABLE's tile, with
    block_m cut to the next power of two >= m (>= 16) for small m. A pure function."""
    t = GEMM_TABLE[(gemm_m_bucket(m), gemv_shape_class(n))]
    bm = max(16, 1 << max(0, m - 1).bit_length())
    return t if bm >= t.block_m else GemmConfig(bm, t.block_n, t.block_k, t.num_warps,
                                                t.num_stages)


def prefill_path(m: int, n: int, itemsize: int) -> str:
    """What awq_linear_k runs for m > GEMV_MAX_TOKENS tokens of itemsize-byte activations:
    "fused" (awq_gemm_k: allocates y only) or "dequant" (W^T chunks + cuBLAS)."""
    fused = itemsize == 2 and m <= FUSED_MAX_TOKENS[gemv_shape_class(n)]
    return "fused" if fused else "dequant"
