"""Int8Linear: a bias-free linear whose weight is INT8, one fp32 scale per output row.

What it is for: the output head of a small-card profile (`lm_head_format = "int8"`). A
Llama-3 head is 128,256 x 4,096: 1,002 MiB in fp16, 501 MiB in INT8, and every decode step
reads all of it. Per-row symmetric round-to-nearest keeps it near-lossless (QUALITY.md: the
teacher-forced KL of an INT8 head against the fp16 one), where a 4-bit head is not
(BENCHMARKS.md's AWQ quality table: +7 points of perplexity on the embedded model).

Made from a float weight with `from_float` (on the host, before the move: the fp16 head
never has to be resident on the device). forward: the Triton GEMV for a few rows on CUDA,
else W dequantized in row chunks and multiplied (cuBLAS, the CPU's matmul). Contract and
reference: kernels/int8/int8_ref.py.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import nn

from hisparse_cli.kernels.int8 import int8_ref


class Int8Linear(nn.Module):
    def __init__(self, weight_q: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        if (weight_q.dtype != torch.int8 or weight_q.dim() != 2
                or scale.shape != (weight_q.shape[0],)):
            raise ValueError(f"Int8Linear: weight_q int8 [out, in] and scale [out], got "
                             f"{weight_q.dtype} {tuple(weight_q.shape)} and {tuple(scale.shape)}")
        self.out_features, self.in_features = weight_q.shape
        self.register_buffer("weight_q", weight_q.contiguous())
        self.register_buffer("scale", scale.float().contiguous())
        self.bias = None

    @classmethod
    def from_float(cls, weight: torch.Tensor,
                   device: torch.device | str | None = None) -> "Int8Linear":
        """Quantize an fp weight [out, in] where it lies, then move the INT8 copy to device."""
        q, s = int8_ref.quantize_rows(weight.detach())
        device = weight.device if device is None else torch.device(device)
        return cls(q.to(device), s.to(device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype."""
        x2 = x.reshape(-1, self.in_features)
        if x.is_cuda and x2.shape[0] <= _gemv_max_rows():
            from hisparse_cli.kernels.int8.int8_gemv_triton import int8_gemv

            y = int8_gemv(x2 if x2.stride(1) == 1 else x2.contiguous(), self.weight_q, self.scale)
        else:
            y = int8_ref.int8_linear_chunked(x2, self.weight_q, self.scale)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-row"


@lru_cache(maxsize=1)
def _gemv_max_rows() -> int:
    """Rows of x the Triton GEMV takes (0 without Triton); once a process (decode calls it
    every step)."""
    from hisparse_cli.kernels.dispatch import triton_available

    if not triton_available():
        return 0
    from hisparse_cli.kernels.int8.int8_gemv_triton import GEMV_MAX_ROWS

    return GEMV_MAX_ROWS
