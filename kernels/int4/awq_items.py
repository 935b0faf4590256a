"""The "item" INT4 layout of the persistent CUDA decode kernel, made from (and back into) the
AutoAWQ GEMM layout, and its torch reference. Torch only: the Triton dequantize is
awq_items_triton.py, the linear over items (prefill and CPU) awq_items_linear.py.

Why: the decode kernel (kernels/cuda/decode_step.cu, `item_mma`) streams weights through
a shared-memory ring in fixed 8512-byte items and feeds each word straight to
`mma.sync.m16n8k16` as the A fragment of one lane, so an item must hold, in fragment order,
everything one 128 x 128 block needs. Group size 128 only. Terms: "rows" are the linear's
output columns (the MMA's M), "K" its input features; W^T [out, in] is nn.Linear's weight.

Item (tile, j) = rows 128 tile .. +127 x K 128 j .. +127 (group j); int32 [2128]:
    words   [0, 2048)     [rt 8][kt // 4  2][lane 32 = 4 g + t][kt % 4  4]; the word of
                          (rt, kt, lane) holds at bits 4 p + 16 h (p = 2 pk + pr, h = 0, 1)
                          q[row 16 rt + 8 pr + g, K 16 kt + 8 pk + 2 t + h]
    scales  [2048, 2112)  fp16 [g 8][rt 8][pr 2]: s of row 16 rt + 8 pr + g
    zeros   [2112, 2128)  bytes [g 8][rt 8]: z of row 16 rt + g (low nibble), + 8 (high)
(byte offsets 0, 8192 = SCALES_OFF, 8448 = ZEROS_OFF; ITEM_BYTES 8512 = the AWQ bytes of the
block: 8192 of qweight, 256 of scales, 64 of qzeros). W^T[row, K] = (q - z) * s. A linear's
items are int32 [T * G, 2128], item index tile * G + j (T = out / 128, G = in / 128): one
tile's groups are consecutive, as the kernel walks K.

Conversion is pure byte shuffling: an AWQ word holds the 8 rows g = 0..7 of one (rt, pr) and
one K, byte b holding rows AWQ_ORDER[2 b] (low nibble) and AWQ_ORDER[2 b + 1] (high) (AWQ
order, kernels/int4/awq_pack.py); an item byte holds one (row g, K) for pr = 0 (low) and 1
(high). Both directions are the same 2 x 2 nibble transpose between the two pr bytes of an
AWQ word pair (_transpose) plus one permutation of whole bytes, on uint8 tensors (int32 seen
as little-endian bytes, as on every CUDA and x86/ARM host), chunk by chunk of output tiles
(CONVERT_CHUNK_ELEMS codes a step: ~3 bytes of temporaries a code, ~50 MB for any linear).

Intended use (not wired yet): AWQLinear holds `items_from_awq(qweight, qzeros, scales)` in
place of qweight/qzeros/scales (same bytes, made once at load on the weights' device);
decode (few tokens) runs the persistent CUDA kernel on the items; any other token count
runs `awq_items_linear.items_linear` (dequantize W^T chunk by chunk into one workspace, then cuBLAS), on CPU
the torch reference. `items_to_awq` gives the checkpoint tensors back (export, checks).
"""

from __future__ import annotations

import torch


GROUP = 128  # K per item: the only group size of the layout
TILE = 128  # rows (output columns) per item
WORDS = 2048  # int32 words of nibbles per item
SCALES_WORD, ZEROS_WORD, ITEM_WORDS = 2048, 2112, 2128
ITEM_BYTES = 4 * ITEM_WORDS  # 8512 (decode_step.cu: ITEM_BYTES, SCALES_OFF, ZEROS_OFF)
CONVERT_CHUNK_ELEMS = 1 << 24  # codes converted per step (bounds the temporaries)

# Byte tensors of one chunk of t tiles (K = 128 j + 64 kt4 + 16 kc + 8 pk + 2 tt + h, kt =
# 4 kt4 + kc; row = 128 tile + 16 rt + 8 pr + g; a byte holds pr 0 low, pr 1 high):
#   pairs       uint8 [K, t, rt 8, i 8] in AWQ byte order: i = 2 a + c holds g = 4 c + a
#               (_transpose's output), seen as [j, kt4, kc, pk, tt, h, tile, rt, a, c]
#   item bytes  [tile, j, rt, kt4, c, a, tt, kc, h, pk]: word [rt][kt4][lane 4 g + tt][kc],
#               byte 2 h + pk of it
_TO_ITEM = (6, 0, 7, 1, 9, 8, 4, 2, 5, 3)
_TO_PAIRS = tuple(_TO_ITEM.index(d) for d in range(10))


def _check_shape(in_features: int, out_features: int) -> None:
    if in_features % GROUP or out_features % TILE or in_features <= 0 or out_features <= 0:
        raise ValueError(f"item layout needs in_features % {GROUP} == 0 and out_features % "
                         f"{TILE} == 0, got in {in_features}, out {out_features}")


def check_items(items: torch.Tensor, in_features: int, out_features: int) -> None:
    """ValueError unless items is a contiguous int32 [T * G, 2128] for this shape."""
    _check_shape(in_features, out_features)
    want = ((out_features // TILE) * (in_features // GROUP), ITEM_WORDS)
    if items.dtype != torch.int32 or tuple(items.shape) != want or not items.is_contiguous():
        raise ValueError(f"items must be contiguous int32 {want} for in {in_features}, out "
                         f"{out_features}; got {items.dtype} {tuple(items.shape)}")


def _tile_chunks(in_features: int, out_features: int):
    """(t0, t1): ranges of output tiles converted per step."""
    tiles = out_features // TILE
    step = max(1, CONVERT_CHUNK_ELEMS // (TILE * in_features))
    return [(t0, min(tiles, t0 + step)) for t0 in range(0, tiles, step)]


def _transpose(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Bytes a, b [..., 4] (nibbles a0 | a1 << 4, b0 | b1 << 4) -> [..., 8]: a0 | b0 << 4 at
    0..3, a1 | b1 << 4 at 4..7. Applied to its own output halves it gives back cat(a, b)."""
    return torch.cat(((a & 0xF) | (b << 4), (a >> 4) | (b & 0xF0)), dim=-1)


def _pairs(awq: torch.Tensor) -> torch.Tensor:
    """AWQ words int32 [R, 16 t] -> pairs uint8 [R, t, rt, i] (above): the nibbles of rows
    16 rt + g (low) and 16 rt + g + 8 (high) of each of the R rows of awq."""
    r, w = awq.shape
    by = awq.contiguous().view(torch.uint8).view(r, w // 16, 8, 2, 4)  # [R, t, rt, pr, b]
    return _transpose(by[..., 0, :], by[..., 1, :])


def _awq_words(pairs: torch.Tensor) -> torch.Tensor:
    """The inverse of _pairs: uint8 [R, t, rt, i] -> AWQ words int32 [R, 16 t]."""
    r, t = pairs.shape[:2]
    awq = _transpose(pairs[..., :4], pairs[..., 4:])  # [R, t, rt, (pr, b)]
    return awq.view(r, 16 * t, 4).view(torch.int32).view(r, 16 * t)


def _natural(pairs: torch.Tensor) -> torch.Tensor:
    """[..., i] in AWQ byte order -> [..., g] (i = 2 a + c holds g = 4 c + a)."""
    return pairs.unflatten(-1, (4, 2)).transpose(-1, -2).flatten(-2)


def items_from_awq(qweight: torch.Tensor, qzeros: torch.Tensor,
                   scales: torch.Tensor) -> torch.Tensor:
    """AutoAWQ GEMM tensors (qweight int32 [in, out/8], qzeros int32 [in/128, out/8], scales
    fp16 [in/128, out]; group 128) -> items int32 [T * G, 2128] on their device."""
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"qweight must be int32 [in, out/8], got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    _check_shape(k, n)
    g = k // GROUP
    if qzeros.dtype != torch.int32 or tuple(qzeros.shape) != (g, n // 8):
        raise ValueError(f"qzeros must be int32 {(g, n // 8)} (group size 128 only), got "
                         f"{qzeros.dtype} {tuple(qzeros.shape)}")
    if scales.dtype != torch.float16 or tuple(scales.shape) != (g, n):
        raise ValueError(f"scales must be fp16 {(g, n)} (group size 128 only), got "
                         f"{scales.dtype} {tuple(scales.shape)}")
    if not qweight.device == qzeros.device == scales.device:
        raise ValueError("qweight, qzeros and scales on different devices")
    items = torch.empty((n // TILE, g, ITEM_WORDS), dtype=torch.int32, device=qweight.device)
    for t0, t1 in _tile_chunks(k, n):
        t, cols = t1 - t0, slice(16 * t0, 16 * t1)
        pairs = _pairs(qweight[:, cols]).view(g, 2, 4, 2, 4, 2, t, 8, 4, 2)
        items[t0:t1, :, :WORDS] = pairs.permute(_TO_ITEM).reshape(t, g, WORDS, 4).view(
            torch.int32)[..., 0]
        zb = _pairs(qzeros[:, cols]).view(g, t, 8, 4, 2)  # [G, t, rt, a, c] -> [c, a][rt]
        items[t0:t1, :, ZEROS_WORD:] = zb.permute(1, 0, 4, 3, 2).reshape(t, g, 16, 4).view(
            torch.int32)[..., 0]
        s = scales[:, TILE * t0: TILE * t1].view(g, t, 8, 2, 8)  # [G, t, rt, pr, g]
        items[t0:t1, :, SCALES_WORD:ZEROS_WORD] = s.permute(1, 0, 4, 2, 3).reshape(
            t, g, 64, 2).view(torch.int32)[..., 0]
    return items.view(-1, ITEM_WORDS)


def _unpack(items: torch.Tensor, in_features: int, t0: int, t1: int):
    """Tiles [t0, t1) of items -> (pairs uint8 [K, t, rt, i], zero pairs uint8 [G, t, rt, i],
    scales fp16 [G, t, rt, pr, g])."""
    g, t = in_features // GROUP, t1 - t0
    it = items.view(-1, g, ITEM_WORDS)[t0:t1]
    words = it[..., :WORDS].contiguous().view(torch.uint8).view(t, g, 8, 2, 2, 4, 4, 4, 2, 2)
    pairs = words.permute(_TO_PAIRS).reshape(in_features, t, 8, 8)
    zb = it[..., ZEROS_WORD:].contiguous().view(torch.uint8).view(t, g, 2, 4, 8)
    s = it[..., SCALES_WORD:ZEROS_WORD].contiguous().view(torch.float16).view(t, g, 8, 8, 2)
    return pairs, zb.permute(1, 0, 4, 3, 2).reshape(g, t, 8, 8), s.permute(1, 0, 3, 4, 2)


def items_to_awq(items: torch.Tensor, in_features: int, out_features: int):
    """The exact inverse of items_from_awq: -> (qweight, qzeros, scales) in the AWQ GEMM
    layout (group 128)."""
    check_items(items, in_features, out_features)
    k, n, g = in_features, out_features, in_features // GROUP
    dev = items.device
    qweight = torch.empty((k, n // 8), dtype=torch.int32, device=dev)
    qzeros = torch.empty((g, n // 8), dtype=torch.int32, device=dev)
    scales = torch.empty((g, n), dtype=torch.float16, device=dev)
    for t0, t1 in _tile_chunks(k, n):
        pairs, zb, s = _unpack(items, k, t0, t1)
        qweight[:, 16 * t0: 16 * t1] = _awq_words(pairs)
        qzeros[:, 16 * t0: 16 * t1] = _awq_words(zb)
        scales[:, TILE * t0: TILE * t1] = s.reshape(g, TILE * (t1 - t0))
    return qweight, qzeros, scales


def dequantize_items_ref(items: torch.Tensor, in_features: int, out_features: int,
                         col_start: int = 0, col_end: int | None = None) -> torch.Tensor:
    """fp32 W^T rows [col_start, col_end) (output columns, whole tiles): [cols, in] =
    (q - z) * s, exact (products of a 5-bit integer and an fp16 fit fp32)."""
    check_items(items, in_features, out_features)
    t0, t1 = _tile_range(out_features, col_start, col_end)
    k, g, rows = in_features, in_features // GROUP, TILE * (t1 - t0)
    pairs, zb, s = _unpack(items, k, t0, t1)
    q = _natural(torch.stack((pairs & 0xF, pairs >> 4), dim=3)).view(g, GROUP, rows)
    z = _natural(torch.stack((zb & 0xF, zb >> 4), dim=3)).view(g, 1, rows)
    w = (q.float() - z.float()) * s.reshape(g, 1, rows).float()  # [G, 128, rows]: W
    return w.view(k, rows).t().contiguous()


def _tile_range(out_features: int, col_start: int, col_end: int | None) -> tuple[int, int]:
    """Output tiles [t0, t1) of the column range; ValueError unless whole tiles inside."""
    col_end = out_features if col_end is None else col_end
    if col_start % TILE or col_end % TILE or not 0 <= col_start < col_end <= out_features:
        raise ValueError(f"column range [{col_start}, {col_end}) must be whole {TILE}-column "
                         f"tiles inside [0, {out_features})")
    return col_start // TILE, col_end // TILE
