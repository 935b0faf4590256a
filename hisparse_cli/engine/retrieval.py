"""The retrieval tier of one run: the offload store, the per-page key summaries and the page
cache through which each step attends to the offloaded pages its queries want.

A page is one KV block. When the host policy evicts a block that holds no sink
(`SparseSequence.evict`), it goes to the offload store instead of being dropped:
  * in place (the CPU: host and device are one memory): the block stays where it is in the
    paged storage, held by the store (never reused; `BlockPool.offload`), no copy;
  * copied (CUDA): its K/V are copied, on a side stream, into pinned host memory
    [L, Hkv, pages, bs, D]; the block goes back to the pool (the next step waits for the copy
    before writing into a reused block).
Its key summary (`retrieval_summary`: per-channel min/max, or the mean key; [L, Hkv, pages, D],
float16 for a float32 cache: a ranking needs no more) is written to resident memory then.

Every step, for every layer, before its attention: the step's queries score the offloaded
pages against their summaries (kernels/attention/page_score_ref.py: the largest bound over
the queries and the query heads of each KV head), and each KV head takes its best
`retrieval_pages`. Each KV head has a page cache of `page_cache_pages` slots in the layer's
extra key segment ([Hkv, G + S * bs, D]: the globals, then the slots; engine/kv_cache.py), the
segment every attention kernel already reads beside the paged blocks. A page already in a slot
is a hit; a miss is copied into the least recently used slot not needed this step (gather:
store -> slot). Slot positions say what each query sees: the pages chosen this step at their
real positions, every other slot -1 (masked), and a position that is also one of the KV
head's globals masked too (the same key never counts twice in a softmax). The attended set of
a step is then sinks ∪ the step's window blocks ∪ globals ∪ the retrieved pages; with a
budget covering every page it is every key: dense attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hisparse_cli.engine.kv_cache import PagedKVCache, int64_to_device


@dataclass
class RetrievalStats:
    """Counters of one run's retrieval tier (summed over layers and KV heads)."""

    pages_offloaded: int = 0  # pages moved to the offload store
    steps: int = 0  # steps that had offloaded pages to retrieve from
    pages_retrieved: int = 0  # (layer, KV head, page) picks over those steps
    hits: int = 0  # picks already in the page cache
    misses: int = 0  # picks copied store -> slot
    bytes_to_cache: int = 0  # K/V bytes copied into page-cache slots (host -> device on CUDA)
    bytes_offloaded: int = 0  # K/V bytes copied to the host store (0 in place)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.pages_retrieved if self.pages_retrieved else 0.0

    def to_dict(self) -> dict:
        return {"pages_offloaded": self.pages_offloaded, "retrieval_steps": self.steps,
                "pages_retrieved": self.pages_retrieved, "cache_hits": self.hits,
                "cache_misses": self.misses, "cache_hit_rate": self.hit_rate,
                "bytes_to_cache": self.bytes_to_cache, "bytes_offloaded": self.bytes_offloaded}


class PageCacheMap:
    """Host bookkeeping of one (layer, KV head)'s page-cache slots: which page each slot holds
    and when it was last picked (LRU among the slots a step does not need). Plain Python."""

    __slots__ = ("page", "slot_of", "used")

    def __init__(self, slots: int) -> None:
        self.page = [-1] * slots
        self.slot_of: dict[int, int] = {}
        self.used = [-1] * slots

    def place(self, pages: list[int], step: int) -> tuple[list[int], list[tuple[int, int]]]:
        """Slots of `pages` (len <= slots) and the misses [(slot, page)] to copy in."""
        want = set(pages)
        slots, misses = [], []
        free = sorted((s for s in range(len(self.page)) if self.page[s] not in want),
                      key=lambda s: self.used[s], reverse=True)  # LRU last: pop() takes it
        for p in pages:
            s = self.slot_of.get(p)
            if s is None:
                s = free.pop()
                old = self.page[s]
                if old >= 0:
                    del self.slot_of[old]
                self.page[s], self.slot_of[p] = p, s
                misses.append((s, p))
            self.used[s] = step
            slots.append(s)
        return slots, misses


class RetrievalTier:
    """Offload store + page summaries + page cache of one run (module doc)."""

    def __init__(self, cache: PagedKVCache, *, max_pages: int, retrieval_pages: int,
                 cache_pages: int, summary: str, in_place: bool, backend) -> None:
        self.cache, self.backend, self.kind = cache, backend, summary
        self.L, self.H, self.D, self.bs = cache.L, cache.H, cache.D, cache.bs
        self.R, self.S = retrieval_pages, cache_pages
        self.max_pages, self.in_place = max_pages, in_place
        dev, dt = cache.device, cache.dtype
        shape = (self.L, self.H, max_pages, self.D)
        sdt = torch.float16 if dt == torch.float32 else dt  # summaries: 2 bytes a channel
        self.lo = torch.zeros(shape, dtype=sdt, device=dev)
        self.hi = self.lo if summary == "mean" else torch.zeros(shape, dtype=sdt, device=dev)
        self.row = [-1] * max_pages  # logical page -> row of the store (in place: block id)
        self.offloaded: list[int] = []  # logical pages in the store, in eviction order
        self.first_page = 0  # the lowest logical page ever offloaded (sink blocks are below)
        cuda = dev.type == "cuda"
        if in_place:
            self.store_k = self.store_v = None
        else:  # [L, Hkv, pages, bs, D]: a (layer, head)'s pages are one matrix
            host = (self.L, self.H, max_pages, self.bs, self.D)
            self.store_k = torch.zeros(host, dtype=dt, pin_memory=cuda)
            self.store_v = torch.zeros(host, dtype=dt, pin_memory=cuda)
        self.side = torch.cuda.Stream(dev) if cuda and not in_place else None
        self.offload_done = None  # event: the last offload copy finished reading the blocks
        self.maps = [[PageCacheMap(self.S) for _ in range(self.H)] for _ in range(self.L)]
        self.stats = RetrievalStats()
        self.step_no = 0
        self.step_picks = self.step_hits = self.step_bytes = 0  # of the current step (trace)
        self.seg_base = cache.G  # first slot column of the page cache in the key segment
        self.pos_offsets = torch.arange(self.bs, device=dev)

    # -- sizes -----------------------------------------------------------------------------
    def summary_bytes(self) -> int:
        n = 1 if self.kind == "mean" else 2
        return n * self.lo.numel() * self.lo.element_size()

    def page_bytes(self) -> int:
        """K and V bytes of one page over every layer."""
        return self.cache.bytes_per_block()

    def host_bytes(self) -> int:
        """The offload store's own host allocation (0 in place: the pages stay in storage)."""
        if self.store_k is None:
            return 0
        return 2 * self.store_k.numel() * self.store_k.element_size()

    # -- offload -----------------------------------------------------------------------------
    def offload(self, physical: list[int], pages: list[int]) -> None:
        """Evicted blocks (physical ids, their logical page indices) into the store: their
        summaries now; in place their ids stay theirs, otherwise their K/V are copied to the
        host store (on CUDA on the side stream; the caller frees the blocks after this call,
        and `wait_offload` orders the next writes after the copy)."""
        if not physical:
            return
        cache = self.cache
        ids = int64_to_device(physical, cache.device)
        pg = int64_to_device(pages, cache.device)
        keys = cache.k.index_select(1, ids).permute(0, 3, 1, 2, 4)  # [L, Hkv, n, bs, D]
        lo, hi = self.backend.page_summary(keys, self.kind)
        self.lo.index_copy_(2, pg, lo.to(self.lo.dtype))
        if self.hi is not self.lo:
            self.hi.index_copy_(2, pg, hi.to(self.hi.dtype))
        if self.in_place:
            rows = physical
        else:
            rows = pages
            self._copy_out(ids, pages)
            self.stats.bytes_offloaded += len(pages) * self.page_bytes()
        for p, r in zip(pages, rows):
            self.row[p] = r
        if not self.offloaded:
            self.first_page = pages[0]
        self.offloaded += pages
        self.stats.pages_offloaded += len(pages)

    def _copy_out(self, ids: torch.Tensor, pages: list[int]) -> None:
        cache, side = self.cache, self.side
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(cache.device))
            ids.record_stream(side)  # made on the main stream, read on the side stream
        with torch.cuda.stream(side) if side is not None else _nullcontext():
            for src, dst in ((cache.k, self.store_k), (cache.v, self.store_v)):
                blocks = src.index_select(1, ids).permute(0, 3, 1, 2, 4)  # [L, Hkv, n, bs, D]
                for j, p in enumerate(pages):
                    dst[:, :, p].copy_(blocks[:, :, j], non_blocking=side is not None)
            if side is not None:
                self.offload_done = torch.cuda.Event()
                self.offload_done.record(side)

    def wait_offload(self) -> None:
        """Order the current stream's next writes after the last offload copy (CUDA)."""
        if self.offload_done is not None:
            torch.cuda.current_stream(self.cache.device).wait_event(self.offload_done)

    # -- retrieval ---------------------------------------------------------------------------
    def begin_step(self) -> None:
        self.step_no += 1
        self.step_picks = self.step_hits = self.step_bytes = 0
        if self.offloaded:
            self.stats.steps += 1

    def select(self, layer: int, q: torch.Tensor) -> list[list[int]]:
        """The pages each KV head of `layer` attends this step ([Hkv] lists, ascending)."""
        n = len(self.offloaded)
        if n <= self.R:  # the budget covers every offloaded page: no scoring
            return [list(self.offloaded)] * self.H
        lo = self.first_page  # offloaded pages are the contiguous range [lo, lo + n)
        top = self.backend.score_top_pages(q, self.lo[layer, :, lo:lo + n],
                                           self.hi[layer, :, lo:lo + n], self.R, self.D ** -0.5)
        return (top + lo).tolist()

    def prepare(self, layer: int, q: torch.Tensor) -> None:
        """Fill `layer`'s page-cache slots and their positions for the step's queries q."""
        if not self.offloaded:
            return
        cache = self.cache
        picks = self.select(layer, q)
        maps = self.maps[layer]
        base = [-1] * (self.H * self.S)
        heads, slots, rows = [], [], []
        for h in range(self.H):
            got, misses = maps[h].place(picks[h], self.step_no)
            for s, p in zip(got, picks[h]):
                base[h * self.S + s] = p * self.bs
            for s, p in misses:
                heads.append(h)
                slots.append(s)
                rows.append(self.row[p])
        n_pick = sum(len(p) for p in picks)
        self.step_picks += n_pick
        self.step_hits += n_pick - len(heads)
        self.stats.pages_retrieved += n_pick
        self.stats.misses += len(heads)
        self.stats.hits += n_pick - len(heads)
        if heads:
            moved = len(heads) * 2 * self.bs * self.D * cache.k.element_size()
            self.step_bytes += moved
            self.stats.bytes_to_cache += moved
            self._gather(layer, heads, slots, rows)
        self._positions(layer, base)

    def _slot_view(self, seg: torch.Tensor) -> torch.Tensor:
        """The page-cache part of a layer's key segment [Hkv, G + S*bs, D] as [Hkv, S, bs, D]."""
        return seg[:, self.seg_base:].unflatten(1, (self.S, self.bs))

    def _gather(self, layer: int, heads: list[int], slots: list[int], rows: list[int]) -> None:
        cache, dev = self.cache, self.cache.device
        dst_k, dst_v = (self._slot_view(t[layer]) for t in (cache.sk, cache.sv))
        if self.in_place:  # the layer's storage [cap, bs, Hkv, D] seen per head
            h, s, r = (int64_to_device(x, dev) for x in (heads, slots, rows))
            for dst, src in ((dst_k, cache.k[layer]), (dst_v, cache.v[layer])):
                self.backend.gather_pages(dst, src.permute(2, 0, 1, 3), h, s, r)
            return
        if self.offload_done is not None:  # the host reads the store: the copies must be done
            self.offload_done.synchronize()
        hh, rr = torch.tensor(heads), torch.tensor(rows)
        h, s = (int64_to_device(x, dev) for x in (heads, slots))
        for dst, store in ((dst_k, self.store_k), (dst_v, self.store_v)):
            staged = store[layer][hh, rr]  # [m, bs, D] on the host
            if dev.type == "cuda":
                staged = staged.pin_memory().to(dev, non_blocking=True)
            dst[h, s] = staged

    def _positions(self, layer: int, base: list[int]) -> None:
        """Slot positions: each picked page's real positions, -1 elsewhere and where a
        position is also one of the head's globals."""
        cache = self.cache
        b = int64_to_device(base, cache.device).view(self.H, self.S, 1)
        pos = torch.where(b >= 0, b + self.pos_offsets, -1).view(self.H, -1)  # [Hkv, S*bs]
        if cache.G:
            gpos = cache.gpos[layer]  # [Hkv, G]
            dup = (pos[:, :, None] == gpos[:, None, :]).any(-1) & (pos >= 0)
            pos = pos.masked_fill(dup, -1)
        cache.spos[layer, :, self.seg_base:].copy_(pos)

    def positions(self, layer: int) -> torch.Tensor:
        """[Hkv, S*bs] positions the layer's page cache showed this step (-1 = not seen)."""
        return self.cache.spos[layer, :, self.seg_base:]


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


__all__ = ["RetrievalTier", "RetrievalStats", "PageCacheMap"]
