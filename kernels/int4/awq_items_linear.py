"""A linear held in the item INT4 layout (awq_items.py), any token count: `items_linear` (the
prefill path of AWQLinear's "items" layout, and its CPU path) and `dequantize_items` (the
Triton dequantize of whole tiles, awq_items_triton.py; the reference: awq_items.py's
dequantize_items_ref)."""

from __future__ import annotations

import torch

from hisparse_cli.kernels.int4.awq_items import (GROUP, TILE, _tile_range, check_items,
                                                 dequantize_items_ref)
from hisparse_cli.kernels.int4.awq_layout import DEQUANT_CHUNK_ELEMS, dequant_chunk


def dequantize_items(items: torch.Tensor, in_features: int, out_features: int,
                     col_start: int = 0, col_end: int | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton: W^T rows [col_start, col_end) (whole tiles) -> [cols, in] in out's dtype (fp16
    when out is None; written into out, unit stride in K). Values: the reference's, rounded
    once to the dtype. One program per item (kernels/int4/awq_items_triton.py)."""
    from hisparse_cli.kernels.int4.awq_items_triton import dequant_items_launch

    check_items(items, in_features, out_features)
    t0, t1 = _tile_range(out_features, col_start, col_end)
    shape = (TILE * (t1 - t0), in_features)
    if out is None:
        out = torch.empty(shape, dtype=torch.float16, device=items.device)
    assert tuple(out.shape) == shape and out.stride(1) == 1 and out.device == items.device, \
        f"out must be {shape} with unit stride in K on {items.device}"
    dequant_items_launch(items, in_features // GROUP, t0, t1, out)
    return out


def items_linear(x: torch.Tensor, items: torch.Tensor, in_features: int, out_features: int,
                 bias: torch.Tensor | None = None, *, chunk_cols: int | None = None,
                 triton: bool | None = None) -> torch.Tensor:
    """y [..., out] = x [..., in] @ W + bias for a linear held as items, any token count:
    W^T dequantized chunk_cols output columns at a time (default: awq_layout.dequant_chunk's
    rows, i.e. every Llama-3-8B decoder linear in one chunk, as the K-major prefill path)
    into one workspace, each chunk then one matmul into y's columns. triton: dequantize with
    the Triton kernel (default: on CUDA), else with the reference in fp32 and the matmul in
    fp32, rounded once to x's dtype (as awq_ref.awq_linear on CPU)."""
    check_items(items, in_features, out_features)
    k, n = in_features, out_features
    if x.shape[-1] != k or x.device != items.device:
        raise ValueError(f"x must be [..., {k}] on {items.device}, got {tuple(x.shape)} on "
                         f"{x.device}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    chunk = min(n, chunk_cols or dequant_chunk(k, n, DEQUANT_CHUNK_ELEMS))
    if chunk % TILE:
        raise ValueError(f"chunk_cols {chunk_cols}: a multiple of {TILE}")
    use_triton = items.is_cuda if triton is None else triton
    x2 = x.reshape(-1, k)
    x2 = (x2 if x2.stride(1) == 1 else x2.contiguous()) if use_triton else x2.float()
    y = torch.empty((x2.shape[0], n), dtype=x2.dtype, device=x.device)
    buf = torch.empty((chunk, k), dtype=x2.dtype, device=x.device) if use_triton else None
    for c0 in range(0, n, chunk):
        c1 = min(n, c0 + chunk)
        if use_triton:
            w = dequantize_items(items, k, n, c0, c1, out=buf[: c1 - c0])
        else:
            w = dequantize_items_ref(items, k, n, c0, c1)
        torch.matmul(x2, w.t(), out=y[:, c0:c1])
    if bias is not None:
        y += bias.to(y.dtype)
    return y.to(x.dtype).view(*x.shape[:-1], n)
