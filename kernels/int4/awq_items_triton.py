"""Triton dequantize of the item INT4 layout (kernels/int4/awq_items.py) into W^T rows: the
first half of the "dequantize a chunk, then cuBLAS" prefill path of a linear held as items
(awq_items_linear.dequantize_items / items_linear call it; argument checks live there).

One program per item (tile, j) and block of BLOCK_RT row tiles: it loads the words of its row
tiles as a [BLOCK_RT * 8 (rt, g), 32 (kt4, tt, kc)] tile (each row two 64-byte runs, every
word once), takes the 8 nibbles of each word with constant shifts, dequantizes each as
(q - z) s in fp32 (exact: a 5-bit integer times an fp16) with one rounding to the output
dtype, and puts them in K order in registers: per pr (row half), the 4 nibbles (pk, h) are
joined to [R, 32, pk, h] and permuted from (kt4, tt, kc, pk, h) to K = 64 kt4 + 16 kc +
8 pk + 2 tt + h, then stored as rows 16 rt + 8 pr + g of W^T, 128 contiguous K values each
(256 bytes in fp16). Consecutive programs take consecutive groups j of one tile: they read
consecutive items and write adjacent stretches of the same W^T rows.

Written for Triton >= 3.0 like kernels/int4/awq_triton.py: plain loads/stores, tl.join /
tl.reshape / tl.permute; runs under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hisparse_cli.kernels.fp8 import w4a8_linear
from hisparse_cli.kernels.int4.awq_items import (GROUP, ITEM_WORDS, SCALES_WORD, TILE, ZEROS_WORD,
                                           check_items)
from hisparse_cli.kernels.int4.awq_layout import (DEQUANT_CHUNK_ELEMS, GEMV_MAX_TOKENS,
                                                 dequant_chunk)
from hisparse_cli.kernels.int4.awq_triton import GraphedDequant, _dequant_matmul

# Row tiles per program (8: the whole item) and warps: for sm_90 (benchmarks/sm90_compile.py)
# 48 registers, no spills, 16-byte loads and stores, the K permutation through shared memory
# (STS.128 + LDSM); 4 warps take 95 registers. Not yet timed on a GPU.
BLOCK_RT = 8
NUM_WARPS = 8


@triton.jit
def _nibble(words, SHIFT: tl.constexpr, z, s, dt: tl.constexpr):
    """(q - z) s of the nibble at bit SHIFT of words [R, 32], z/s [R, 1] fp32, in dt."""
    return ((((words >> SHIFT) & 0xF).to(tl.float32) - z) * s).to(dt)


@triton.jit
def _store_half(w_ptr, words, zb, s_ptr, j, rows0, rt, g, stride_wn, sc_ptr, stride_sc,
                PR: tl.constexpr, R: tl.constexpr, CODES: tl.constexpr):
    """Rows 16 rt + 8 PR + g (out row rows0 + that) of the item: nibbles 4 (2 pk + PR) + 16 h.
    CODES: the codes q - z, and the scales into sc[j, row] in fp32."""
    dt: tl.constexpr = w_ptr.dtype.element_ty
    z = ((zb >> (4 * PR)) & 0xF).to(tl.float32)[:, None]  # [R, 1]
    s = tl.load(s_ptr + g * 16 + rt * 2 + PR).to(tl.float32)[:, None]
    if CODES:
        srow = (rows0 + rt * 16 + PR * 8 + g).to(tl.int64)
        tl.store(sc_ptr + j * stride_sc + srow[:, None], s)
        s = tl.full((R, 1), 1.0, tl.float32)
    v00 = _nibble(words, 4 * PR, z, s, dt)  # (pk 0, h 0)
    v10 = _nibble(words, 8 + 4 * PR, z, s, dt)  # (pk 1, h 0)
    v01 = _nibble(words, 16 + 4 * PR, z, s, dt)  # (pk 0, h 1)
    v11 = _nibble(words, 24 + 4 * PR, z, s, dt)  # (pk 1, h 1)
    v = tl.join(tl.join(v00, v10), tl.join(v01, v11))  # [R, 32, pk, h]
    # [R, kt4, tt, kc, pk, h] -> [R, kt4, kc, pk, tt, h]: K order
    v = tl.permute(tl.reshape(v, (R, 2, 4, 4, 2, 2)), (0, 1, 3, 4, 2, 5))
    v = tl.reshape(v, (R, 128))
    rows = (rows0 + rt * 16 + PR * 8 + g).to(tl.int64)
    tl.store(w_ptr + rows[:, None] * stride_wn + (j * 128 + tl.arange(0, 128))[None, :], v)


# tile0 (the chunk's first row tile) varies chunk by chunk: an item's address is a multiple
# of ITEM words whatever it is, so its divisibility gains nothing; one variant for all chunks
@triton.jit(do_not_specialize=["tile0"])
def _dequant_items_kernel(it_ptr, s_ptr, z_ptr, w_ptr, G, tile0, stride_wn, sc_ptr, stride_sc,
                          ITEM: tl.constexpr, SCALES: tl.constexpr, ZEROS: tl.constexpr,
                          BLOCK_RT: tl.constexpr, CODES: tl.constexpr = False):
    j = tl.program_id(0)  # input group
    tile = tile0 + tl.program_id(1)
    R: tl.constexpr = BLOCK_RT * 8
    r = tl.arange(0, R)
    rt = tl.program_id(2) * BLOCK_RT + r // 8  # [R] row tile of (rt, g)
    g = r % 8
    item = tile.to(tl.int64) * G + j
    col = tl.arange(0, 32)  # (kt4, tt, kc): word rt * 256 + kt4 * 128 + g * 16 + tt * 4 + kc
    words = tl.load(it_ptr + item * ITEM + (rt * 256 + g * 16)[:, None]
                    + ((col // 16) * 128 + col % 16)[None, :])  # [R, 32] int32
    zb = tl.load(z_ptr + item * (4 * ITEM) + 4 * ZEROS + g * 8 + rt).to(tl.int32)  # [R] byte
    s_item = s_ptr + item * (2 * ITEM) + 2 * SCALES
    rows0 = tl.program_id(1) * 128
    _store_half(w_ptr, words, zb, s_item, j, rows0, rt, g, stride_wn, sc_ptr, stride_sc, 0, R,
                CODES)
    _store_half(w_ptr, words, zb, s_item, j, rows0, rt, g, stride_wn, sc_ptr, stride_sc, 1, R,
                CODES)


def dequant_items_launch(items: torch.Tensor, groups: int, t0: int, t1: int,
                         out: torch.Tensor, block_rt: int = BLOCK_RT,
                         num_warps: int = NUM_WARPS, codes_scales: torch.Tensor | None = None
                         ) -> None:
    """W^T rows of tiles [t0, t1) into out [128 (t1 - t0), 128 groups] (unit stride in K);
    items int32 [T * groups, 2128] contiguous (checked by the caller). codes_scales: fp32
    [groups, >= 128 (t1 - t0)]: out (e4m3) gets the codes q - z and it the scales (W4A8)."""
    assert 8 % block_rt == 0 and out.stride(1) == 1 and items.is_contiguous()
    grid = (groups, t1 - t0, 8 // block_rt)
    sc = codes_scales if codes_scales is not None else out
    _dequant_items_kernel[grid](items, items.view(torch.float16), items.view(torch.uint8), out,
                                groups, t0, out.stride(0), sc, sc.stride(0), ITEM=ITEM_WORDS,
                                SCALES=SCALES_WORD, ZEROS=ZEROS_WORD, BLOCK_RT=block_rt,
                                CODES=codes_scales is not None, num_warps=num_warps)


class PreparedItemsLinear(GraphedDequant):
    """awq_items_linear.items_linear bound to one linear's items on CUDA, as PreparedLinearK is for
    the tiled layout: the items are checked once, a call checks only x, and each chunk's
    dequantize is replayed from a CUDA graph (GraphedDequant) before its cuBLAS product. The
    prefill is host-bound at small chunks (4060ti-6g: 512 tokens), where the per-call checks
    and Triton launches of items_linear cost the item layout 20-30 % of the INT4 prefill
    against the tiled layout (runs 141-145). Same values as items_linear (the same
    dequantized W^T, the same cuBLAS product). AWQLinear makes one per items buffer on CUDA;
    on the CPU (tests, TRITON_INTERPRET=1) the launches are eager."""

    __slots__ = ("items", "k", "n", "bias", "chunk", "device", "fp8")

    def __init__(self, items: torch.Tensor, in_features: int, out_features: int,
                 bias: torch.Tensor | None) -> None:
        check_items(items, in_features, out_features)
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise ValueError(f"bias must be [{out_features}], got {tuple(bias.shape)}")
        self.items, self.k, self.n, self.bias = items, in_features, out_features, bias
        self.chunk = min(out_features, dequant_chunk(in_features, out_features,
                                                     DEQUANT_CHUNK_ELEMS))
        self.graphs: dict | None = {} if items.is_cuda else None  # (CPU: the interpreter)
        self.device = items.device
        self.fp8 = w4a8_linear.usable(GROUP, in_features)  # W4A8 prefill where active

    def _dequant(self, w, n0, n1) -> None:
        sc = None
        if w.dtype == torch.uint8:  # a W4A8 workspace (kernels/fp8/w4a8_linear.py): codes
            w, sc = w4a8_linear.split_workspace(w, n1 - n0, self.k)
        dequant_items_launch(self.items, self.k // GROUP, n0 // TILE, n1 // TILE, w,
                             codes_scales=sc)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        k, n = self.k, self.n
        if x.shape[-1] != k or x.device != self.device:
            raise ValueError(f"x must be [..., {k}] on {self.device}, got {tuple(x.shape)} on "
                             f"{x.device}")
        x2 = x.reshape(-1, k)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        if self.fp8 and x2.shape[0] > GEMV_MAX_TOKENS and w4a8_linear.active(self.device):
            y = w4a8_linear.w4a8_matmul(x2, n, k, self.chunk, self._dequant if self.graphs
                                        is None else self._launch, self.bias)
            return y.view(*x.shape[:-1], n)
        y = _dequant_matmul(x2, None, None, None, self.bias, None, n, k, self.chunk,
                            self._dequant if self.graphs is None else self._launch)
        return y.view(*x.shape[:-1], n)
