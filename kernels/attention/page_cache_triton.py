"""Triton page-cache kernels of the retrieval tier (the contract and the torch oracle:
kernels/attention/page_cache_ref.py; selected by kernels/dispatch.py where the attention runs in
Triton). Both read and write device tensors only, so a CUDA graph captures a decode step with
them, and the host never learns which pages a step picked.

`_place_pages`: one program per KV head. The slots [S] and the picks [R] meet in [S, R] tiles:
  hit slots by equality, the free slots' LRU order by an [S, S] rank count (no sort), the
  miss of the k-th smallest missing page (an [R, R] rank count: any pick order) takes the free
  slot of rank k. Writes slot_page,
  slot_used and fill_row, and adds (picks, hits, misses) to counts with atomics.
`_fill_page_slots`: one program per (KV head, slot). A slot with a fill row copies its page
  [bs, D] from the source (the pinned host store, read by the device at its mapped address
  under unified addressing, or the paged storage in place) and every slot writes its bs
  positions (picked this step: the page's positions, else -1; -1 where a global holds it).
Head size and block size must be powers of two (asserted by the caller's dispatch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _place_pages(picks_ptr, sp_ptr, su_ptr, step_ptr, row_ptr, fill_ptr, counts_ptr, R, S,
                 R_P: tl.constexpr, S_P: tl.constexpr):
    h = tl.program_id(0)
    r = tl.arange(0, R_P)
    s = tl.arange(0, S_P)
    p = tl.load(picks_ptr + h * R + r, mask=r < R, other=-1)
    valid = p >= 0
    s_ok = s < S
    sp = tl.load(sp_ptr + h * S + s, mask=s_ok, other=-2)  # -2: equals no pick
    su = tl.load(su_ptr + h * S + s, mask=s_ok, other=0)
    step = tl.load(step_ptr)
    eq = (sp[:, None] == p[None, :]) & valid[None, :]  # [S, R]: slot s holds pick r already
    hit = tl.max(eq.to(tl.int32), axis=0) > 0
    needed = tl.max(eq.to(tl.int32), axis=1) > 0
    free = s_ok & (needed == 0)
    key = (su + 1) * S_P + (S_P - 1 - s)  # LRU first; equal steps: the higher slot first
    earlier = free[None, :] & (key[None, :] < key[:, None])  # [S, S']: free s' goes before s
    frank = tl.sum(earlier.to(tl.int32), axis=1)
    miss = valid & (hit == 0)
    # a miss's rank: the misses of smaller pages ([R, R']: miss r' goes before r)
    rank = tl.sum((miss[None, :] & (p[None, :] < p[:, None])).to(tl.int32), axis=1)
    take = free[:, None] & (frank[:, None] == rank[None, :]) & miss[None, :]  # [S, R]
    picked = tl.max((eq | take).to(tl.int32), axis=1) > 0
    filled = tl.max(take.to(tl.int32), axis=1) > 0
    page = tl.sum(tl.where(take, p[None, :], 0), axis=1)
    rows = tl.load(row_ptr + tl.where(valid, p, 0), mask=valid, other=-1)
    fill = tl.sum(tl.where(take, rows[None, :], 0), axis=1)
    tl.store(sp_ptr + h * S + s, tl.where(filled, page, sp), mask=s_ok)
    tl.store(su_ptr + h * S + s, tl.where(picked, step, su), mask=s_ok)
    tl.store(fill_ptr + h * S + s, tl.where(filled, fill, -1), mask=s_ok)
    tl.atomic_add(counts_ptr, tl.sum(valid.to(tl.int64), axis=0))
    tl.atomic_add(counts_ptr + 1, tl.sum(hit.to(tl.int64), axis=0))
    tl.atomic_add(counts_ptr + 2, tl.sum(miss.to(tl.int64), axis=0))


def place_pages(picks: torch.Tensor, slot_page: torch.Tensor, slot_used: torch.Tensor,
                step: torch.Tensor, row_of_page: torch.Tensor,
                counts: torch.Tensor) -> torch.Tensor:
    h, r = picks.shape
    s = slot_page.shape[1]
    assert r <= s and slot_used.shape == slot_page.shape
    for t in (picks, slot_page, slot_used, step, row_of_page, counts):
        assert t.dtype == torch.int64 and t.is_contiguous()
    fill = torch.empty_like(slot_page)
    r_p, s_p = triton.next_power_of_2(r), triton.next_power_of_2(s)
    _place_pages[(h,)](picks, slot_page, slot_used, step, row_of_page, fill, counts, r, s,
                       R_P=r_p, S_P=s_p, num_warps=4 if s_p <= 64 else 8)
    return fill


@triton.jit
def _fill_page_slots(dk_ptr, dv_ptr, sk_ptr, sv_ptr, fill_ptr, sp_ptr, su_ptr, step_ptr,
                     gpos_ptr, pos_ptr, S, G, s_dh, s_ds, s_dt, s_kh, s_kr, s_kt, s_vh,
                     s_vr, s_vt, s_gh, s_ph, BS: tl.constexpr, D: tl.constexpr,
                     G_P: tl.constexpr, HAS_G: tl.constexpr):
    h = tl.program_id(0)
    s = tl.program_id(1)
    t = tl.arange(0, BS)
    dd = tl.arange(0, D)
    row = tl.load(fill_ptr + h * S + s)
    if row >= 0:
        dst = h * s_dh + s * s_ds + t[:, None] * s_dt + dd[None, :]
        k = tl.load(sk_ptr + h * s_kh + row * s_kr + t[:, None] * s_kt + dd[None, :])
        tl.store(dk_ptr + dst, k)
        v = tl.load(sv_ptr + h * s_vh + row * s_vr + t[:, None] * s_vt + dd[None, :])
        tl.store(dv_ptr + dst, v)
    page = tl.load(sp_ptr + h * S + s)
    shown = tl.load(su_ptr + h * S + s) == tl.load(step_ptr)
    pos = tl.where(shown, page * BS + t, -1)
    if HAS_G:
        g = tl.arange(0, G_P)
        gp = tl.load(gpos_ptr + h * s_gh + g, mask=g < G, other=-1)
        dup = tl.max(((pos[:, None] == gp[None, :]) & (pos >= 0)[:, None]).to(tl.int32), axis=1)
        pos = tl.where(dup > 0, -1, pos)
    tl.store(pos_ptr + h * s_ph + s * BS + t, pos)


def fill_page_slots(dst_k: torch.Tensor, dst_v: torch.Tensor, src_k: torch.Tensor,
                    src_v: torch.Tensor, fill_row: torch.Tensor, slot_page: torch.Tensor,
                    slot_used: torch.Tensor, step: torch.Tensor, gpos: torch.Tensor | None,
                    pos_out: torch.Tensor) -> None:
    h, s, bs, d = dst_k.shape
    assert dst_k.stride() == dst_v.stride() and dst_k.stride(-1) == 1
    assert src_k.stride(-1) == 1 and src_v.stride(-1) == 1 and src_k.dtype == dst_k.dtype
    assert pos_out.shape == (h, s * bs) and pos_out.stride(1) == 1
    g = gpos.shape[1] if gpos is not None else 0
    gp = gpos if g else pos_out  # (unread without globals)
    _fill_page_slots[(h, s)](
        dst_k, dst_v, src_k, src_v, fill_row, slot_page, slot_used, step, gp, pos_out, s, g,
        dst_k.stride(0), dst_k.stride(1), dst_k.stride(2), src_k.stride(0), src_k.stride(1),
        src_k.stride(2), src_v.stride(0), src_v.stride(1), src_v.stride(2), gp.stride(0),
        pos_out.stride(0), BS=bs, D=d, G_P=triton.next_power_of_2(max(g, 1)), HAS_G=g > 0,
        num_warps=2)


__all__ = ["place_pages", "fill_page_slots"]
