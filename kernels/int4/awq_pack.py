"""INT4 packing in the AutoAWQ "GEMM" layout, and group-wise asymmetric INT4 quantization.

Layout (what published `*-AWQ` checkpoints hold, with W the logical weight [out, in]):
    qweight  int32 [in, out/8]         8 nibbles per word, AWQ order (below)
    qzeros   int32 [in/group, out/8]   same packing, one zero point per (group, out column)
    scales   fp16  [in/group, out]
    W[o, i] = (q[i, o] - z[i // group, o]) * s[i // group, o]

AWQ order: the 8 logical columns j = 0..7 of a word go to nibble positions in the order
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7] (nibble p holds column AWQ_ORDER[p]); equivalently
column j sits at nibble AWQ_ORDER_INV[j] = [0, 4, 1, 5, 2, 6, 3, 7]. Packing the values
0..7 (value j in column j) therefore gives the word 0x75316420.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble position p holds logical column AWQ_ORDER[p]
AWQ_ORDER_INV = (0, 4, 1, 5, 2, 6, 3, 7)  # logical column j lives at nibble AWQ_ORDER_INV[j]
PACK = 8  # nibbles per int32 word
QMAX = 15  # 4-bit unsigned codes 0..15


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes: integer [R, C] with values 0..15, C % 8 == 0 -> int32 [R, C/8] in AWQ order."""
    if codes.dim() != 2 or codes.shape[1] % PACK:
        raise ValueError(f"pack_int4 needs [R, C] with C % 8 == 0, got {tuple(codes.shape)}")
    c = codes.to(torch.int64)
    if c.numel() and (int(c.min()) < 0 or int(c.max()) > QMAX):
        raise ValueError("pack_int4 codes must lie in 0..15")
    r, cols = c.shape
    c = c.view(r, cols // PACK, PACK)[..., list(AWQ_ORDER)]  # [R, W, 8] in nibble order
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=c.device)
    words = (c << shifts).sum(-1)  # [R, W], 0 .. 2^32-1 (nibbles are disjoint, sum == or)
    words = torch.where(words >= 2**31, words - 2**32, words)  # reinterpret as signed int32
    return words.to(torch.int32)


def unpack_int4(words: torch.Tensor) -> torch.Tensor:
    """words: int32 [R, W] in AWQ order -> uint8 [R, W*8] codes in logical column order."""
    if words.dtype != torch.int32 or words.dim() != 2:
        raise ValueError(f"unpack_int4 needs int32 [R, W], got {words.dtype} {tuple(words.shape)}")
    shifts = torch.tensor([4 * p for p in AWQ_ORDER_INV], dtype=torch.int32, device=words.device)
    # arithmetic shift then mask: the low 4 bits are the wanted nibble even for negative words
    codes = (words.unsqueeze(-1) >> shifts) & 0xF  # [R, W, 8], logical order
    return codes.reshape(words.shape[0], -1).to(torch.uint8)


@dataclass(frozen=True)
class PackedInt4:
    """One linear's INT4 tensors in the AWQ GEMM layout (see module docstring)."""

    qweight: torch.Tensor  # int32 [in, out/8]
    qzeros: torch.Tensor  # int32 [in/group, out/8]
    scales: torch.Tensor  # fp16 [in/group, out]
    group_size: int


def _round_small(x: torch.Tensor) -> torch.Tensor:
    """Round half to even of fp32 values with |x| < 2^22, in place (torch.round is slow on CPU)."""
    return x.add_(12582912.0).sub_(12582912.0)  # 1.5 * 2^23: the sum keeps no fraction bits


def group_minmax_params(w: torch.Tensor, group_size: int,
                        wmin: torch.Tensor | None = None, wmax: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit grid per (out row, input group) of w [out, in].

    wmin/wmax: optional [out, in/group] ranges (e.g. clipped); default the group's min/max.
    Returns (scale, zero), fp32 [out, in/group]: scale is already rounded to fp16 (what the
    checkpoint stores, so the zero point is chosen for the scale the kernel will see), zero is
    integer-valued in 0..15. The range is widened to include 0 (a zero weight stays exact).
    """
    out, inf = w.shape
    if wmin is None or wmax is None:
        lo, hi = torch.aminmax(w.float().view(out, inf // group_size, group_size), dim=-1)
    else:
        lo, hi = wmin.float(), wmax.float()
    lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
    scale = ((hi - lo) / QMAX).clamp_(min=1e-5).to(torch.float16).float()
    zero = _round_small((-lo / scale).clamp_(0, QMAX))
    return scale, zero


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                   group_size: int) -> torch.Tensor:
    """w [out, in], scale/zero [out, in/group] -> integer codes [out, in] in 0..15."""
    out, inf = w.shape
    g = w.float().view(out, inf // group_size, group_size)
    q = torch.div(g, scale.unsqueeze(-1)).add_(zero.unsqueeze(-1)).clamp_(0, QMAX)
    return _round_small(q).view(out, inf)  # clamping first is exact: the bounds are integers


def fake_quantize(w: torch.Tensor, group_size: int, wmin: torch.Tensor | None = None,
                  wmax: torch.Tensor | None = None) -> torch.Tensor:
    """Round-to-nearest INT4 then dequantize: what the packed weight will compute, [out, in]."""
    out, inf = w.shape
    scale, zero = group_minmax_params(w, group_size, wmin, wmax)
    s, z = scale.unsqueeze(-1), zero.unsqueeze(-1)
    g = w.float().view(out, inf // group_size, group_size)
    q = torch.div(g, s)  # code - zero, clamped to the grid's [-z, 15 - z], then rounded
    q = _round_small(torch.maximum(torch.minimum(q, QMAX - z), -z))
    return q.mul_(s).view(out, inf).to(w.dtype)


def quantize_weight(w: torch.Tensor, group_size: int, wmin: torch.Tensor | None = None,
                    wmax: torch.Tensor | None = None) -> PackedInt4:
    """Round-to-nearest INT4 of a linear weight w [out, in] into the AWQ GEMM layout."""
    out, inf = w.shape
    if inf % group_size or out % PACK:
        raise ValueError(f"weight {tuple(w.shape)}: in must be a multiple of group_size "
                         f"{group_size} and out a multiple of 8")
    scale, zero = group_minmax_params(w, group_size, wmin, wmax)
    codes = quantize_codes(w, scale, zero, group_size)  # [out, in]
    return PackedInt4(
        qweight=pack_int4(codes.t().contiguous()),  # [in, out/8]
        qzeros=pack_int4(zero.t().contiguous()),  # [in/group, out/8]
        scales=scale.to(torch.float16).t().contiguous(),  # [in/group, out]
        group_size=group_size,
    )

