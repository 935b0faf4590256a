"""Torch reference of the retrieval tier's page-cache kernels: which slot each retrieved page
takes (LRU), and the copy of the missing pages into their slots with the slots' positions.
Shared contract with page_cache_triton.py; the oracle of both is tests/test_page_cache_kernels.py
(a plain-Python LRU, page by page).

Per layer and KV head the page cache has S slots. Device state (engine/retrieval.py):
    slot_page  [Hkv, S] int64  the logical page a slot holds (-1: empty)
    slot_used  [Hkv, S] int64  the step that last picked the slot (-1: never)
A step's picks are [Hkv, R] int64 (R <= S): the pages the step retrieves, distinct, in any
order, -1 in unused entries. `place_pages`:
  * a pick already in a slot is a hit: the slot is reused;
  * the slots no pick holds are free, ordered least recently used first (slot_used ascending;
    between equal steps the higher slot first); the misses, in ascending page order, take
    them in that order, and the page a taken slot held is dropped from the cache;
  * every picked slot gets slot_used = step; counts [3] += (picks, hits, misses);
  * fill_row [Hkv, S] int64: for each slot that must be filled this step, the store row of its
    new page (row_of_page[page]); -1 elsewhere.
`fill_page_slots` then copies the fill rows' pages from the source (the offload store, or the
paged storage in place) into their slots, bit for bit, and writes the slot positions the
attention reads: a slot picked this step shows its page's real positions, every other slot -1,
and a position that is also one of the KV head's globals -1 too (a key counts once).
No step needs the host: every input and output is a device tensor (CUDA-graph capturable in the
Triton version; this reference's copy reads the fill rows on the host).
"""

from __future__ import annotations

import torch


def place_pages(picks: torch.Tensor, slot_page: torch.Tensor, slot_used: torch.Tensor,
                step: torch.Tensor, row_of_page: torch.Tensor,
                counts: torch.Tensor) -> torch.Tensor:
    """Slots for the step's picks (module doc); updates slot_page, slot_used and counts in
    place and returns fill_row [Hkv, S]."""
    h, r = picks.shape
    s = slot_page.shape[1]
    assert r <= s and slot_used.shape == slot_page.shape and picks.dtype == torch.int64
    dev = picks.device
    valid = picks >= 0
    eq = (slot_page[:, :, None] == picks[:, None, :]) & valid[:, None, :]  # [Hkv, S, R]
    hit = eq.any(1)
    needed = eq.any(2)
    sidx = torch.arange(s, device=dev)
    key = (slot_used + 1) * s + (s - 1 - sidx)  # LRU first; equal steps: the higher slot first
    key = key.masked_fill(needed, torch.iinfo(torch.int64).max)
    order = key.argsort(dim=1)  # free slots first, in the order misses take them
    miss = valid & ~hit
    # a miss's rank: the misses of smaller pages (page order, whatever the picks' order)
    rank = (miss[:, None, :] & (picks[:, None, :] < picks[:, :, None])).sum(-1)
    miss_slot = order.gather(1, rank)
    hit_slot = (eq * sidx[None, :, None]).sum(1)
    slot = torch.where(hit, hit_slot, miss_slot)
    tgt = torch.where(miss, miss_slot, s)  # column s: a sink for everything but misses
    rows = row_of_page[picks.clamp(min=0)]
    fill = torch.full((h, s + 1), -1, dtype=torch.int64, device=dev)
    fill.scatter_(1, tgt, torch.where(miss, rows, -1))
    pages = torch.cat([slot_page, slot_page.new_zeros(h, 1)], 1)
    pages.scatter_(1, tgt, picks)
    slot_page.copy_(pages[:, :s])
    used = torch.cat([slot_used, slot_used.new_zeros(h, 1)], 1)
    used.scatter_(1, torch.where(valid, slot, s), step.reshape(1, 1).expand(h, r))
    slot_used.copy_(used[:, :s])
    counts += torch.stack([valid.sum(), hit.sum(), miss.sum()]).to(counts.dtype)
    return fill[:, :s]


def slot_positions(slot_page: torch.Tensor, slot_used: torch.Tensor, step: torch.Tensor,
                   block_size: int, gpos: torch.Tensor | None) -> torch.Tensor:
    """[Hkv, S * bs] positions the slots show this step (module doc)."""
    h, s = slot_page.shape
    picked = (slot_used == step.reshape(1, 1))[:, :, None]
    offs = torch.arange(block_size, device=slot_page.device)
    pos = torch.where(picked, slot_page[:, :, None] * block_size + offs, -1).reshape(h, -1)
    if gpos is not None and gpos.shape[1]:
        dup = (pos[:, :, None] == gpos[:, None, :]).any(-1) & (pos >= 0)
        pos = pos.masked_fill(dup, -1)
    return pos


def fill_page_slots(dst_k: torch.Tensor, dst_v: torch.Tensor, src_k: torch.Tensor,
                    src_v: torch.Tensor, fill_row: torch.Tensor, slot_page: torch.Tensor,
                    slot_used: torch.Tensor, step: torch.Tensor, gpos: torch.Tensor | None,
                    pos_out: torch.Tensor) -> None:
    """dst[h, s] = src[h, fill_row[h, s]] where fill_row >= 0 (dst [Hkv, S, bs, D] slots,
    src [Hkv, rows, bs, D] on any device, any strides; bit for bit), and pos_out [Hkv, S * bs]
    = slot_positions(...)."""
    assert dst_k.dtype == src_k.dtype and dst_k.shape[2:] == src_k.shape[2:]
    h, s = (fill_row >= 0).nonzero(as_tuple=True)
    if h.numel():
        r = fill_row[h, s]
        hs, rs = h.to(src_k.device), r.to(src_k.device)
        for dst, src in ((dst_k, src_k), (dst_v, src_v)):
            dst[h, s] = src[hs, rs].to(dst.device)
    pos_out.copy_(slot_positions(slot_page, slot_used, step, dst_k.shape[2], gpos))


__all__ = ["place_pages", "slot_positions", "fill_page_slots"]
