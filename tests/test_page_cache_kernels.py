"""The retrieval tier's page-cache kernels (kernels/attention/page_cache_*.py) against a plain
Python LRU page by page (`PageCacheMap`): which slot each pick takes, which pages are copied
in, the counters; the copy bit for bit and the slot positions against brute force. The torch
reference on the CPU; the Triton kernels under TRITON_INTERPRET=1 without CUDA and on the GPU
(`gpu`), the GPU reading a pinned host store."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hisparse_cli.kernels.attention import page_cache_ref as ref

CPU = not torch.cuda.is_available()


class PageCacheMap:
    """One KV head's slots in plain Python: a pick already held is a hit; misses, in ascending
    page order, take the free slot (not holding a pick) least recently used, the higher slot
    first between equals."""

    def __init__(self, slots: int) -> None:
        self.page = [-1] * slots
        self.slot_of: dict[int, int] = {}
        self.used = [-1] * slots

    def place(self, pages: list[int], step: int) -> tuple[list[int], list[tuple[int, int]]]:
        want = set(pages)
        free = sorted((s for s in range(len(self.page)) if self.page[s] not in want),
                      key=lambda s: (self.used[s], -s))
        slots, misses = [], []
        for p in sorted(pages):
            s = self.slot_of.get(p)
            if s is None:
                s = free.pop(0)
                if self.page[s] >= 0:
                    del self.slot_of[self.page[s]]
                self.page[s], self.slot_of[p] = p, s
                misses.append((s, p))
            self.used[s] = step
            slots.append(s)
        return slots, misses


def test_oracle_hits_and_lru():
    m = PageCacheMap(3)
    slots, miss = m.place([5, 7], step=1)
    assert miss == [(slots[0], 5), (slots[1], 7)] and slots == [2, 1]  # empty: higher first
    slots2, miss2 = m.place([7, 9], step=2)  # 7 hits; 9 takes the empty slot
    assert miss2 == [(0, 9)] and slots2[0] == slots[1]
    _, miss3 = m.place([9, 11], step=3)  # 11 evicts the least recently used: 5 (step 1)
    assert miss3[0][0] == slots[0] and 5 not in m.slot_of and {7, 9, 11} == set(m.slot_of)


def _place(impl: str):
    if impl == "ref":
        return ref.place_pages
    pytest.importorskip("triton")
    from hisparse_cli.kernels.attention.page_cache_triton import place_pages

    return place_pages


def _fill(impl: str):
    if impl == "ref":
        return ref.fill_page_slots
    pytest.importorskip("triton")
    from hisparse_cli.kernels.attention.page_cache_triton import fill_page_slots

    return fill_page_slots


def _impls():
    out = [pytest.param("ref", "cpu", id="ref")]
    if CPU:
        out.append(pytest.param("triton", "cpu", id="triton-interpreted"))
    out.append(pytest.param("triton", "cuda", id="triton-cuda", marks=[pytest.mark.gpu,
                pytest.mark.skipif(CPU, reason="needs CUDA")]))
    return out


@pytest.mark.parametrize("impl,dev", _impls())
@pytest.mark.parametrize("heads,slots,picks,pages,steps", [
    (3, 4, 4, 9, 12),  # every slot picked every step: hits, or LRU among the rest
    (2, 6, 3, 7, 15),  # spare slots keep pages for later hits
    (1, 5, 5, 30, 8),  # mostly misses
    (2, 40, 24, 200, 6),  # sizes past one power of two (padded tiles)
])
def test_place_pages_equals_the_python_lru(impl, dev, heads, slots, picks, pages, steps):
    g = torch.Generator().manual_seed(heads * 100 + slots)
    maps = [PageCacheMap(slots) for _ in range(heads)]
    i64 = dict(dtype=torch.int64, device=dev)
    slot_page = torch.full((heads, slots), -1, **i64)
    slot_used = torch.full((heads, slots), -1, **i64)
    row_of_page = (torch.randperm(pages, generator=g) + 1000).to(dev)
    counts = torch.zeros(3, **i64)
    want_counts = [0, 0, 0]
    place = _place(impl)
    for step in range(1, steps + 1):
        rows = []
        for _ in range(heads):  # between 0 and `picks` distinct pages, ascending, -1 after
            n = int(torch.randint(0, picks + 1, (1,), generator=g)) if step % 4 else picks
            sel = torch.randperm(pages, generator=g)[:n].tolist() + [-1] * (picks - n)
            order = torch.randperm(picks, generator=g).tolist() if step % 2 else range(picks)
            rows.append([sel[i] for i in order])  # any order, -1 anywhere
        got = place(torch.tensor(rows, **i64), slot_page, slot_used,
                    torch.tensor([step], **i64), row_of_page, counts).cpu()
        want_fill = torch.full((heads, slots), -1, dtype=torch.int64)
        for h, m in enumerate(maps):
            sel = [p for p in rows[h] if p >= 0]
            _, misses = m.place(sel, step)
            for s, p in misses:
                want_fill[h, s] = int(row_of_page[p])
            want_counts = [want_counts[0] + len(sel), want_counts[1] + len(sel) - len(misses),
                           want_counts[2] + len(misses)]
        assert torch.equal(got, want_fill), (step, got, want_fill)
        assert slot_page.cpu().tolist() == [m.page for m in maps], step
        assert slot_used.cpu().tolist() == [m.used for m in maps], step
        assert counts.cpu().tolist() == want_counts


@pytest.mark.parametrize("impl,dev", _impls())
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("globals_", [0, 5])
def test_fill_copies_bit_exactly_and_writes_positions(impl, dev, dtype, globals_):
    """Slots with a fill row get that page of the source, bit for bit, and nothing else is
    written; positions: picked this step (slot_used == step) -> the page's positions, else -1,
    and -1 where one of the head's globals holds the position."""
    heads, slots, bs, d, rows = 3, 6, 8, 16, 20
    g = torch.Generator().manual_seed(globals_ + d)
    # the source as the engine passes it: a strided view (the store per layer, or the paged
    # storage [cap, bs, Hkv, D] permuted to [Hkv, cap, bs, D]); pinned host memory on CUDA
    storage = torch.randn(rows, bs, heads, d, generator=g).to(dtype)
    if dev == "cuda":
        storage = storage.pin_memory()
    src_k = storage.permute(2, 0, 1, 3)
    src_v = (storage * 2).permute(2, 0, 1, 3)
    if dev == "cuda":
        src_v = src_v.contiguous().pin_memory()
    seg_k = torch.full((heads, globals_ + slots * bs, d), 7.0, dtype=dtype, device=dev)
    seg_v = seg_k.clone()
    dst_k = seg_k[:, globals_:].unflatten(1, (slots, bs))
    dst_v = seg_v[:, globals_:].unflatten(1, (slots, bs))
    fill = torch.tensor([[3, -1, -1, 19, -1, 0], [-1] * 6, [-1, 5, -1, -1, -1, -1]])
    slot_page = torch.tensor([[4, 9, -1, 11, 2, 0], [1, 2, 3, 4, 5, 6], [-1, 8, 7, 3, 12, 13]])
    slot_used = torch.tensor([[5, 4, -1, 5, 5, 5], [5, 5, 1, 5, 5, 5], [-1, 5, 5, 2, 5, 0]])
    gpos = torch.tensor([[35, 0, 90, -1, 17], [9, 10, 11, 12, 13], [-1] * 5])[:, :globals_]
    pos = torch.zeros(heads, slots * bs, dtype=torch.int64, device=dev)
    to = (lambda t: t.to(dev))
    _fill(impl)(dst_k, dst_v, src_k, src_v, to(fill), to(slot_page), to(slot_used),
                to(torch.tensor([5])), to(gpos) if globals_ else None, pos)
    seg_k, seg_v, pos = seg_k.cpu(), seg_v.cpu(), pos.cpu()
    for h in range(heads):
        for s in range(slots):
            got_k = seg_k[h, globals_ + s * bs:globals_ + (s + 1) * bs]
            got_v = seg_v[h, globals_ + s * bs:globals_ + (s + 1) * bs]
            r = int(fill[h, s])
            if r >= 0:
                assert torch.equal(got_k, src_k[h, r].cpu()) and torch.equal(got_v, src_v[h, r].cpu())
            else:
                assert (got_k == 7).all() and (got_v == 7).all()
            for j in range(bs):
                p = int(slot_page[h, s]) * bs + j
                shown = int(slot_used[h, s]) == 5 and p not in gpos[h].tolist()
                assert int(pos[h, s * bs + j]) == (p if shown else -1), (h, s, j)
    if globals_:
        assert (seg_k[:, :globals_] == 7).all()
