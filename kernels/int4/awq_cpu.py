"""CPU INT4 linear for decode-sized calls: torch's packed int4 weight-only matmul
(`aten._weight_int4pack_mm_for_cpu`, the CPU kernel behind torchao's int4 weight-only) on
bfloat16 activations. The torch reference (kernels/int4/awq_ref.py) dequantizes the whole weight
to fp32 on every call; at one token that is ~25x the matmul (SmolLM2-135M's linears on the
2-core CI machine: 393 ms a token against 22 ms for fp32 weights; this path: 14 ms).

    pack_for_cpu(qweight, qzeros, scales) -> (packed uint8 [out, in/2], sz bf16 [in/g, out, 2])
    int4pack_linear(x, packed, sz, bias, group) -> y  (x [..., in], any float dtype)

The kernel computes w = (q - 8) * scale + zero per group; AWQ's w = (q - z) * s is that with
scale = s and zero = (8 - z) * s (both rounded to bf16: s exactly as fp16 -> bf16 allows,
(8 - z) s to bf16's 8 bits). x is rounded to bf16 and y comes back in bf16, then x's dtype:
about 2^-8 relative error a product beyond the INT4 weights' own (measured 3-4e-3 of max |y|
on random layers), the price of a 25x faster decode. Used where AWQLinear holds the packed
copy (made at load on the CPU, `int4pack_applies`) and a call has at most
CPU_INT4_MAX_TOKENS rows; longer calls (prefill chunks) dequantize once per call and run an
fp32 matmul, which is faster there (at 128 rows 5.4 vs 5.4 ms, at 1024 rows 44 vs 83 ms for a
576x3072 layer), with `dequantize_cpu` (the reference's bits, ~2x faster). The packed copy
costs the INT4 bytes once more plus 2x the scales (the planner counts it: planner_weights).

The ops are private aten ops: `int4pack_available` checks that they exist and give the
reference's result on a small matrix once per process; otherwise the reference runs.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from hisparse_cli.kernels.int4.awq_pack import AWQ_ORDER_INV

CPU_INT4_MAX_TOKENS = 64  # rows per call up to which the packed kernel beats dequantize + fp32
GROUPS = (32, 64, 128, 256)  # the kernel's group sizes
N_MULTIPLE = 16  # the packing needs out_features divisible by this


def int4pack_applies(in_features: int, out_features: int, group_size: int) -> bool:
    """Whether an AWQ linear of this shape gets the packed CPU copy (a pure function of the
    shape and of this torch build: the memory planner calls it too)."""
    return (out_features % N_MULTIPLE == 0 and group_size in GROUPS
            and in_features % group_size == 0 and int4pack_available())


def packed_bytes(in_features: int, out_features: int, group_size: int) -> tuple[int, int]:
    """(packed, sz) bytes of one linear's CPU copy."""
    return out_features * in_features // 2, (in_features // group_size) * out_features * 2 * 2


def pack_for_cpu(qweight: torch.Tensor, qzeros: torch.Tensor,
                 scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ GEMM tensors (qweight int32 [in, out/8], qzeros [in/g, out/8], scales [in/g, out])
    -> the kernel's packed weight uint8 [out, in/2] and scales-and-zeros bf16 [in/g, out, 2]."""
    from hisparse_cli.kernels.int4.awq_pack import unpack_int4

    codes = unpack_int4(qweight).t().to(torch.int32).contiguous()  # [out, in], 0..15
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    del codes
    s = scales.float()
    z = unpack_int4(qzeros).float()
    sz = torch.stack([s, (8.0 - z) * s], dim=-1).to(torch.bfloat16).contiguous()
    return packed, sz


def int4pack_linear(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor,
                    bias: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """y [..., out] = x [..., in] @ W (+ bias) in x's dtype, through the packed kernel. Every
    intermediate is a fresh tensor whatever x's dtype (the memory planner traces them): x in
    bf16 [m, in], y in bf16 [m, out], y in x's dtype (bias added in place)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    xb = torch.empty(x2.shape, dtype=torch.bfloat16, device=x.device)
    xb.copy_(x2)
    yb = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, group_size, sz)
    del xb
    y = torch.empty(yb.shape, dtype=x.dtype, device=x.device)
    y.copy_(yb)
    del yb
    if bias is not None:
        y.add_(bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])


# int32 [8]: the nibble shifts in logical column order (made at import: a run allocates nothing
# for it, which the planner's exact trace relies on)
_SHIFTS = torch.tensor([4 * p for p in AWQ_ORDER_INV], dtype=torch.int32)


def dequantize_cpu(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   group_size: int) -> torch.Tensor:
    """fp32 W [in, out] = (q - z) s: the bits of awq_ref.dequantize_weight (the difference of
    two small integers and its fp32 conversion are exact; one fp32 product), ~2x faster and
    with half its temporaries: zeros and scales broadcast over each group instead of being
    repeated, the integer difference written straight into the fp32 output."""
    k, words = qweight.shape
    n, groups = words * 8, k // group_size
    q = (qweight.unsqueeze(-1) >> _SHIFTS) & 0xF  # int32 [k, out/8, 8], logical order
    z = (qzeros.unsqueeze(-1) >> _SHIFTS) & 0xF  # int32 [groups, out/8, 8]
    s = scales.float()
    w = torch.empty((groups, group_size, n), dtype=torch.float32, device=qweight.device)
    torch.sub(q.view(groups, group_size, n), z.view(groups, 1, n), out=w)
    w.mul_(s.view(groups, 1, n))
    return w.view(k, n)


def awq_linear_dequant(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
                       scales: torch.Tensor, bias: torch.Tensor | None,
                       group_size: int) -> torch.Tensor:
    """awq_ref.awq_linear on the CPU (the same bits) with the faster dequantize: prefill-sized
    calls of the CPU backend."""
    w = dequantize_cpu(qweight, qzeros, scales, group_size)
    y = x.float() @ w
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@lru_cache(maxsize=1)
def int4pack_available() -> bool:
    """The two aten ops exist and agree with the fp32 reference on a seeded 128 x 64 layer
    (group 32) within bf16's rounding: checked once per process."""
    ops = torch.ops.aten
    if not (hasattr(ops, "_convert_weight_to_int4pack_for_cpu")
            and hasattr(ops, "_weight_int4pack_mm_for_cpu")):
        return False
    from hisparse_cli.kernels.int4.awq_pack import quantize_weight
    from hisparse_cli.kernels.int4.awq_ref import dequantize_weight

    try:
        g = torch.Generator().manual_seed(0)
        p = quantize_weight(torch.randn(64, 128, generator=g), 32)
        x = torch.randn(3, 128, generator=g)
        packed, sz = pack_for_cpu(p.qweight, p.qzeros, p.scales)
        y = int4pack_linear(x, packed, sz, None, 32)
        ref = x @ dequantize_weight(p.qweight, p.qzeros, p.scales, 32)
        return bool(((y - ref).abs().max() <= 2e-2 * ref.abs().max()).item())
    except Exception:  # noqa: BLE001 - any failure of a private op: use the reference
        return False
