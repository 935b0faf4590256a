"""Torch reference for the AWQ INT4 linear (GEMM layout): unpack, dequantize, matmul.

Contract shared with kernels/int4/awq_triton.py (the dispatch point calls either one):

    awq_linear(x, qweight, qzeros, scales, bias, group_size) -> y
        x        [..., in]          fp16 / bf16 (fp32 also accepted here)
        qweight  int32 [in, out/8]  AWQ nibble order (kernels/int4/awq_pack.py)
        qzeros   int32 [in/group, out/8]
        scales   [in/group, out]    fp16 (bf16/fp32 accepted)
        bias     [out] or None
        y        [..., out]         in x's dtype
    y = x @ W + bias, with W[i, o] = (q[i, o] - z[i // group, o]) * s[i // group, o]

Precision: the dequantized weight is computed exactly in fp32. On CPU the matmul runs in
fp32 and rounds once at the end (this is the oracle the Triton kernels are tested against);
on other devices the weight is rounded to x's dtype and the matmul accumulates as the
device's BLAS does (fp32 for fp16/bf16 on CUDA).
"""

from __future__ import annotations

import torch

from hisparse_cli.kernels.int4.awq_pack import PACK, unpack_int4


def check_awq_tensors(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
                      scales: torch.Tensor, bias: torch.Tensor | None, group_size: int) -> None:
    """Assert the layout contract (shapes, dtypes, devices); raises AssertionError."""
    k, words = qweight.shape
    n = words * PACK
    assert qweight.dtype == torch.int32 and qzeros.dtype == torch.int32, "qweight/qzeros int32"
    assert k % group_size == 0, f"in_features {k} not a multiple of group_size {group_size}"
    assert qzeros.shape == (k // group_size, words), f"qzeros {tuple(qzeros.shape)}"
    assert scales.shape == (k // group_size, n), f"scales {tuple(scales.shape)}"
    assert x.shape[-1] == k, f"x has {x.shape[-1]} features, weight expects {k}"
    assert bias is None or bias.shape == (n,), f"bias {tuple(bias.shape)}"
    devs = {t.device for t in (x, qweight, qzeros, scales) if t is not None}
    assert len(devs) == 1, f"tensors on different devices: {devs}"


def dequantize_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                      group_size: int) -> torch.Tensor:
    """fp32 weight [in, out] = (q - z) * s, computed exactly in fp32."""
    q = unpack_int4(qweight).to(torch.int16)  # [in, out]
    z = unpack_int4(qzeros).to(torch.int16).repeat_interleave(group_size, dim=0)  # [in, out]
    s = scales.float().repeat_interleave(group_size, dim=0)  # [in, out]
    return (q - z).float() * s


def awq_linear(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
               scales: torch.Tensor, bias: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """y [..., out] = x [..., in] @ dequant(qweight) + bias, in x's dtype (see module doc)."""
    check_awq_tensors(x, qweight, qzeros, scales, bias, group_size)
    w = dequantize_weight(qweight, qzeros, scales, group_size)  # [in, out] fp32
    if x.device.type == "cpu":
        y = x.float() @ w
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)
    y = x @ w.to(x.dtype)
    if bias is not None:
        y = y + bias.to(x.dtype)
    return y


def awq_linear_k(x: torch.Tensor, qweight_k: torch.Tensor, qzeros: torch.Tensor,
                 scales: torch.Tensor, bias: torch.Tensor | None, group_size: int, *,
                 checked: bool = False) -> torch.Tensor:
    """awq_linear with qweight in the K-major run-time layout [out, in/8]
    (kernels/int4/awq_layout.py): converted back to the AWQ GEMM layout, then the reference
    (which checks every argument; `checked` is accepted for the Triton path's signature)."""
    from hisparse_cli.kernels.int4.awq_layout import kmajor_to_awq

    return awq_linear(x, kmajor_to_awq(qweight_k), qzeros, scales, bias, group_size)
