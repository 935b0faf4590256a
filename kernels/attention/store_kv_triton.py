"""Triton `store_kv`: scatter the step's new K/V tokens into their paged cache slots.

Torch reference: kernels/attention/attention_ref.py:store_kv (index_copy_ into the [nb*bs, Hkv, D] view).
One program per new token copies its [Hkv, D] K and V rows to slot_mapping[t] (converted to
the cache dtype). A negative slot (padding) is skipped, which the reference does not accept.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hisparse_cli.kernels.pdl import chain_args
from hisparse_cli.kernels.pdl import enter as pdl_enter


@triton.jit
def _store_kv(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
              stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
              HKV: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
              PDL_WAIT: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = False):
    pdl_enter(PDL_WAIT, PDL_TRIGGER)  # kernels/pdl.py
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D)
    n_heads = tl.where(slot >= 0, HKV, 0)  # a padding slot writes nothing
    ok = (h[:, None] < n_heads) & (d[None, :] < D)
    dst = (slot // BS) * stride_cb + (slot % BS) * stride_cs + h[:, None] * stride_ch + d[None, :]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=ok)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=ok)
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=ok)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=ok)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write new K/V ([T, Hkv, D]) into k_cache/v_cache [num_blocks, block_size, Hkv, D]."""
    nb, bs, hkv, d = k_cache.shape
    assert v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride(), "cache layout"
    assert k_cache.stride(-1) == 1 and v_cache.dtype == k_cache.dtype, "cache must be D-contiguous"
    assert k.shape[1:] == (hkv, d) and v.shape == k.shape, (k.shape, k_cache.shape)
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "k/v must be contiguous along D"
    assert slot_mapping.shape == (k.shape[0],) and slot_mapping.dtype in (torch.int32, torch.int64)
    assert d & (d - 1) == 0, f"head_dim must be a power of two, got {d}"
    assert k.device == k_cache.device == slot_mapping.device
    if k.shape[0] == 0:
        return
    slots = slot_mapping if slot_mapping.is_contiguous() else slot_mapping.contiguous()
    _store_kv[(k.shape[0],)](
        k, v, k_cache, v_cache, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HKV=hkv, H_PAD=triton.next_power_of_2(hkv), D=d, BS=bs, num_warps=4,
        **chain_args(k.device))
