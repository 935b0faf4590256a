"""The retrieval tier of one run: the offload store, the per-page key summaries and the page
cache through which each step attends to the offloaded pages its queries want.

A page is one KV block. When the host policy evicts a block that holds no sink
(`SparseSequence.evict`), it goes to the offload store instead of being dropped:
  * in place (the CPU: host and device are one memory): the block stays where it is in the
    paged storage, held by the store (never reused; `BlockPool.offload`), no copy;
  * copied (CUDA): its K/V are copied, on a side stream, into pinned host memory
    [pages, L, Hkv, bs, D] (page-major: a step's evicted pages, consecutive, are contiguous
    asynchronous copies of at most retrieval_sizes.COPY_GROUP_BYTES each); the block goes back
    to the pool (the next step waits for the copy before writing into a reused block).
Its key summary (`retrieval_summary`: per-channel min/max, or the mean key; [L, Hkv, pages, D]
in INT8 with an fp32 scale a page and KV head, page_score_ref.Summary: a ranking needs no more,
and the summaries are the one resident part that grows with the document) is written to
resident memory then.

A prefill chunk, for every layer, before its attention: the chunk's queries, pooled (the mean
query of every QUERY_POOL consecutive positions, per query head), score the offloaded pages
against their summaries (kernels/attention/page_score_ref.py: each page's score is the largest
estimated attention probability any pooled query of the KV head's query heads gives it), and
each KV head takes its best `retrieval_pages`. Each KV head has a page cache of `page_cache_pages`
slots in the layer's extra key segment ([Hkv, G + S * bs, D]: the globals, then the slots;
engine/kv_cache.py), the segment every attention kernel already reads beside the paged blocks.
A page already in a slot is a hit; a miss is copied into the least recently used slot not
needed this step (store -> slot; on CUDA the kernel reads the pinned store at its mapped
address). Slot positions say what each query sees: the pages chosen this step at their real
positions, every other slot -1 (masked), and a position that is also one of the KV head's
globals masked too (the same key never counts twice in a softmax). The attended set of a step
is then sinks ∪ the step's window blocks ∪ globals ∪ the retrieved pages; with a budget
covering every page it is every key: dense attention.

A decode step chooses before its forward, for every layer at once, from the queries of the
step before it (`last_q` [L, Hq, D], RoPE'd: each layer's last query row, written by the layer
as it attends, or by the persistent decode kernel's step from its q sums): one scoring, one
top-k, one placement and one copy over L x Hkv heads instead of five launches a layer, and no
retrieval work between a layer's projection and its attention -- so the persistent decode
kernel (kernels/cuda/cuda_step.py), which reads the page cache as part of the key segment,
serves retrieval runs too. The query one position back stands for this one (consecutive
queries attend alike; the choice is kept for `retrieval_every` steps anyway).

Decode steps may keep the last choice (`retrieval_every` = k > 1, LServe's reusable page
selector): the pages are chosen anew on every prefill chunk, on the first decode step, k decode
steps after the last choice, and at once after a page was offloaded or the globals were
recalibrated (so a page leaving the window is reachable on the next step, and no retrieved key
duplicates a new global); between those the slots keep their pages and positions, nothing is
scored or copied. The choice is one host decision per step (`choose`, made before the step's
forward); the CUDA-graph decoder replays a graph without the choice's kernels on the steps
that keep it (engine/cuda_graph.py).

Device-resident: picks, slot choice (kernels/attention/page_cache_*.py), the copy and the
counters stay on the device; the host only knows which pages are offloaded (it evicted them)
and mirrors that range into a device tensor. A step therefore never waits for the device, and
a decode step is captured in a CUDA graph (`choose_decode(static=True)`: the scoring then runs
over the whole summary table with the range read on the device). The counters are read once, by
`stats` at the end of a run (and per step only for `--trace`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hisparse_cli.engine.kv_cache import PagedKVCache, int64_to_device
from hisparse_cli.engine.retrieval_sizes import QUERY_POOL, copy_group_pages
from hisparse_cli.kernels.attention.page_score_ref import Summary, pool_queries, top_valid_pages
from hisparse_cli.kernels.norm_rope.norm_rope_ref import rope_tabled


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


class RetrievalTier:
    """Offload store + page summaries + page cache of one run (module doc)."""

    def __init__(self, cache: PagedKVCache, *, max_pages: int, retrieval_pages: int,
                 cache_pages: int, summary: str, in_place: bool, backend, every: int = 1,
                 query_heads: int) -> None:
        assert cache_pages >= retrieval_pages > 0, (cache_pages, retrieval_pages)
        self.cache, self.backend, self.kind = cache, backend, summary
        self.args = dict(max_pages=max_pages, retrieval_pages=retrieval_pages,
                         cache_pages=cache_pages, summary=summary, in_place=in_place,
                         backend=backend, every=every,
                         query_heads=query_heads)  # what a kept tier must match
        self.every = every
        self.L, self.H, self.D, self.bs = cache.L, cache.H, cache.D, cache.bs
        self.R, self.S = retrieval_pages, cache_pages
        self.max_pages, self.in_place = max_pages, in_place
        dev, dt = cache.device, cache.dtype
        self.lo = _summary_table(self.L, self.H, max_pages, self.D, dev)
        self.hi = self.lo if summary == "mean" else _summary_table(self.L, self.H, max_pages,
                                                                   self.D, dev)
        cuda = dev.type == "cuda"
        if in_place:
            self.store_k = self.store_v = None
        else:  # [pages, L, Hkv, bs, D] (module doc)
            host = (max_pages, self.L, self.H, self.bs, self.D)
            self.store_k = _host_store(host, dt, cuda)
            self.store_v = _host_store(host, dt, cuda)
        self.side = torch.cuda.Stream(dev) if cuda and not in_place else None
        # device state (kernels/attention/page_cache_ref.py has the layouts)
        i64 = dict(dtype=torch.int64, device=dev)
        self.row_of_page = torch.full((max_pages,), -1, **i64)  # page -> store row / block id
        self.range = torch.zeros(2, **i64)  # (first offloaded page, pages offloaded)
        self.slot_page = torch.full((self.L, self.H, self.S), -1, **i64)
        self.slot_used = torch.full((self.L, self.H, self.S), -1, **i64)
        self.step = torch.zeros(1, **i64)  # the step number slot_used compares with
        self.counts = torch.zeros(3, **i64)  # picks, hits, misses over the run
        self.step_base = torch.zeros(3, **i64)  # counts when the current step began (trace)
        self.pick_ids = torch.arange(self.R, **i64)
        # each layer's last query row (RoPE'd) of the latest step: a decode step's choice
        self.last_q = torch.zeros((self.L, query_heads, self.D), dtype=dt, device=dev)
        self.seg_base = cache.G  # first slot column of the page cache in the key segment
        self._start_host_state()

    def _start_host_state(self) -> None:
        self.row = [-1] * self.max_pages  # logical page -> row of the store (in place: block)
        self.offloaded: list[int] = []  # logical pages in the store, in eviction order
        self.first_page = 0  # the lowest logical page ever offloaded (sink blocks are below)
        self.offload_done = None  # event: the last offload copy finished reading the blocks
        self.step_no = 0
        self.steps = 0  # steps that had offloaded pages
        self.decoding = False  # mark_decode: steps from now may keep the last choice
        self.choose = True  # this step chooses its pages (module doc)
        self.kept_for = 0  # decode steps served by the last choice
        self.offloaded_at_choice = 0  # len(offloaded) when the pages were last chosen
        self.globals_changed = False  # a recalibration since the last choice
        self.pages_offloaded = self.bytes_offloaded = 0
        self.decode_base = None  # counts when decode started (mark_decode)

    def reset(self) -> None:
        """In place, a new tier's state (the same device tensors, so a captured decode graph
        that reads them stays valid: Engine keeps the tier with the KV cache)."""
        if self.offload_done is not None:
            self.offload_done.synchronize()
        for t in (self.row_of_page, self.slot_page, self.slot_used):
            t.fill_(-1)
        for t in (self.range, self.step, self.counts, self.step_base, self.last_q):
            t.zero_()  # (stale summaries need no reset: a page is scored once it is written)
        self._start_host_state()

    # -- sizes -----------------------------------------------------------------------------
    def summary_bytes(self) -> int:
        tables = (self.lo,) if self.hi is self.lo else (self.lo, self.hi)
        return sum(t.values.numel() + t.scale.numel() * 4 for t in tables)

    def page_bytes(self) -> int:
        """K and V bytes of one page over every layer."""
        return self.cache.bytes_per_block()

    def host_bytes(self) -> int:
        """The offload store's own host allocation (0 in place: the pages stay in storage)."""
        if self.store_k is None:
            return 0
        return 2 * self.store_k.numel() * self.store_k.element_size()

    # -- counters ----------------------------------------------------------------------------
    @property
    def stats(self) -> RetrievalStats:
        """The run's counters (reads the device's: one synchronisation)."""
        picks, hits, misses = self.counts.tolist()
        return RetrievalStats(pages_offloaded=self.pages_offloaded, steps=self.steps,
                              pages_retrieved=picks, hits=hits, misses=misses,
                              bytes_to_cache=misses * self._slot_page_bytes(),
                              bytes_offloaded=self.bytes_offloaded)

    def mark_decode(self) -> None:
        """Remember the counters where decode starts (`decode_stats`; a device copy); the
        steps from here may keep the last choice (`every`); the first one chooses."""
        self.decode_base = self.counts.clone()
        self.decoding, self.kept_for = True, self.every

    def decode_stats(self) -> RetrievalStats:
        """Picks, hits, misses and bytes copied since `mark_decode` (zeros without it)."""
        if self.decode_base is None:
            return RetrievalStats()
        picks, hits, misses = (self.counts - self.decode_base).tolist()
        return RetrievalStats(pages_retrieved=picks, hits=hits, misses=misses,
                              bytes_to_cache=misses * self._slot_page_bytes())

    def _slot_page_bytes(self) -> int:
        """K and V bytes of one (layer, KV head) page: what one miss copies."""
        return 2 * self.bs * self.D * self.cache.k.element_size()

    def step_counts(self) -> tuple[int, int, int]:
        """(picks, hits, bytes copied) of the current step (--trace; waits for the device)."""
        picks, hits, misses = (self.counts - self.step_base).tolist()
        return picks, hits, misses * self._slot_page_bytes()

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
        pairs = [(self.lo, lo)] if self.hi is self.lo else [(self.lo, lo), (self.hi, hi)]
        for table, new in pairs:
            table.values.index_copy_(2, pg, new.values)
            table.scale.index_copy_(2, pg, new.scale)
        if self.in_place:
            rows = physical
            self.row_of_page.index_copy_(0, pg, ids)
        else:
            rows = pages
            self.row_of_page.index_copy_(0, pg, pg)
            self._copy_out(ids, pages)
            self.bytes_offloaded += len(pages) * self.page_bytes()
        for p, r in zip(pages, rows):
            self.row[p] = r
        if not self.offloaded:
            self.first_page = pages[0]
            self.range[0].fill_(self.first_page)  # a scalar kernel argument: no copy, no wait
        self.offloaded += pages
        self.range[1].fill_(len(self.offloaded))
        self.pages_offloaded += len(pages)

    def _copy_out(self, ids: torch.Tensor, pages: list[int]) -> None:
        """The blocks `ids` (logical `pages`) into the host store, on the side stream, in
        groups of at most retrieval_sizes.COPY_GROUP_BYTES of K (or V): each group one gather
        straight into the store's layout [n, L, Hkv, bs, D] and one copy. The side stream's
        allocations stay cached in its own pool, which the main stream cannot reuse:
        whole-chunk temporaries (a gather and its contiguous copy, 64 MiB each at 8B with
        1,024-token chunks) held ~192 MiB of a 6 GiB card there for the rest of the run;
        groups hold ~32 MiB."""
        cache, side = self.cache, self.side
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(cache.device))
            ids.record_stream(side)  # made on the main stream, read on the side stream
        group = copy_group_pages(self.page_bytes() // 2)
        with torch.cuda.stream(side) if side is not None else _nullcontext():
            for src, dst in ((cache.k, self.store_k), (cache.v, self.store_v)):
                by_page = src.permute(1, 0, 3, 2, 4)  # [cap, L, Hkv, bs, D] (a view)
                for g in range(0, len(pages), group):
                    part = pages[g:g + group]
                    blocks = by_page.index_select(0, ids[g:g + group])  # contiguous
                    if part == list(range(part[0], part[0] + len(part))):  # one copy for a run
                        dst[part[0]:part[0] + len(part)].copy_(blocks,
                                                               non_blocking=side is not None)
                        continue
                    for j, p in enumerate(part):
                        dst[p].copy_(blocks[j], non_blocking=side is not None)
            if side is not None:
                self.offload_done = torch.cuda.Event()
                self.offload_done.record(side)

    def wait_offload(self) -> None:
        """Order the current stream's next work after the last offload copy (CUDA): writes into
        the freed blocks, and the page-cache kernels' reads of the store."""
        if self.offload_done is not None:
            torch.cuda.current_stream(self.cache.device).wait_event(self.offload_done)

    # -- retrieval ---------------------------------------------------------------------------
    def begin_step(self, traced: bool = False) -> None:
        """A new step: its number on the device; traced (--trace): the counters it starts
        from, for `step_counts`."""
        self.step_no += 1
        self.step.add_(1)
        if traced:
            self.step_base.copy_(self.counts)
        if self.offloaded:
            self.steps += 1
        choose = (not self.decoding or self.kept_for >= self.every or self.globals_changed
                  or len(self.offloaded) != self.offloaded_at_choice)
        if choose:
            self.kept_for, self.globals_changed = 0, False
            self.offloaded_at_choice = len(self.offloaded)
        self.kept_for += 1
        self.choose = choose

    def select(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """[Hkv, R] int64: the pages each KV head of `layer` attends this prefill chunk
        (distinct; -1 in unused entries), scored by the chunk's queries q [T, Hq, D], pooled
        over QUERY_POOL positions."""
        scale = self.D ** -0.5
        n, lo = len(self.offloaded), self.first_page  # the contiguous range [lo, lo + n)
        if n <= self.R:  # the budget covers every offloaded page: no scoring
            ids = self.pick_ids
            return torch.where(ids < n, ids + lo, -1).expand(self.H, -1).contiguous()
        lo_s, hi_s = (Summary(t.values[layer], t.scale[layer]).pages(lo, lo + n)
                      for t in (self.lo, self.hi))
        if self.hi is self.lo:
            hi_s = lo_s  # (the reference then dequantizes once)
        q = pool_queries(q, QUERY_POOL)
        top = self.backend.score_top_pages(q, lo_s, hi_s, self.R, scale)
        return (top + lo).contiguous()

    def prepare(self, layer: int, q: torch.Tensor) -> None:
        """Before `layer` attends with the step's queries q [T, Hq, D]: keep its last row for
        the next decode step's choice; in a prefill chunk (not `decoding`) also fill the
        layer's page-cache slots and their positions for q, all on the device (a decode step
        chose before its forward: `choose_decode`)."""
        self.last_q[layer].copy_(q[-1])
        if self.decoding or not (self.offloaded and self.choose):
            return
        picks = self.select(layer, q)
        fill = self.backend.place_pages(picks, self.slot_page[layer], self.slot_used[layer],
                                        self.step, self.row_of_page, self.counts)
        self._fill(layer, fill)

    def choose_decode(self, static: bool = False) -> None:
        """A decode step's page choice for every layer at once, before its forward, from the
        previous step's queries (`last_q`; module doc), where this step chooses. static: the
        CUDA graph's form, the same kernels whatever the offloaded range (read on the device;
        the graph replayed on steps that keep the choice has none of them); else only where
        pages are offloaded."""
        if not self.choose or not (static or self.offloaded):
            return
        L, H, S = self.L, self.H, self.S
        heads = L * H  # (layer, KV head) pairs score as the heads of one step
        q = self.last_q.view(1, -1, self.D)
        lo, hi = self.lo.heads_flat(heads), self.hi.heads_flat(heads)
        if self.hi is self.lo:
            hi = lo  # (the reference then dequantizes once)
        scores = self.backend.page_scores_in_range(q, lo, hi, self.range, self.D ** -0.5)
        picks = top_valid_pages(scores, self.R)
        fill = self.backend.place_pages(picks, self.slot_page.view(heads, S),
                                        self.slot_used.view(heads, S), self.step,
                                        self.row_of_page, self.counts).view(L, H, S)
        if self.in_place:  # the layers' storage does not merge into one head axis
            for layer in range(L):
                self._fill(layer, fill[layer])
            return
        cache, bs, D = self.cache, self.bs, self.D
        # views, never copies (view() refuses what would need one): the kernel writes dst
        dst_k, dst_v = (t[:, :, self.seg_base:].view(heads, S, bs, D)  # [L * Hkv, S, bs, D]
                        for t in (cache.sk, cache.sv))
        src_k, src_v = (t.permute(1, 2, 0, 3, 4).view(heads, self.max_pages, bs, D)
                        for t in (self.store_k, self.store_v))  # [L * Hkv, pages, bs, D]
        gpos = cache.gpos.view(heads, cache.G) if cache.G else None
        self.backend.fill_page_slots(dst_k, dst_v, src_k, src_v, fill.view(heads, S),
                                     self.slot_page.view(heads, S), self.slot_used.view(heads, S),
                                     self.step, gpos,
                                     cache.spos[:, :, self.seg_base:].view(heads, S * bs))

    def _fill(self, layer: int, fill: torch.Tensor) -> None:
        """Copy `layer`'s fill rows [Hkv, S] into its slots and write their positions."""
        cache = self.cache
        if self.in_place:  # the layer's storage [cap, bs, Hkv, D] seen per head
            src_k, src_v = (t[layer].permute(2, 0, 1, 3) for t in (cache.k, cache.v))
        else:  # [pages, Hkv, bs, D] -> [Hkv, pages, bs, D] (strides)
            src_k, src_v = (t[:, layer].transpose(0, 1) for t in (self.store_k, self.store_v))
        dst_k, dst_v = (self._slot_view(t[layer]) for t in (cache.sk, cache.sv))
        self.backend.fill_page_slots(dst_k, dst_v, src_k, src_v, fill, self.slot_page[layer],
                                     self.slot_used[layer], self.step,
                                     cache.gpos[layer] if cache.G else None,
                                     self.positions(layer))

    def keep_queries(self, raw_q: torch.Tensor, cos: torch.Tensor, sin_rot: torch.Tensor) -> None:
        """last_q from a step's pre-RoPE queries raw_q [L, Hq, D] (any float type; the
        persistent decode kernel's q sums) and the step position's `rope_tables` operands."""
        self.last_q.copy_(rope_tabled(raw_q, cos, sin_rot))

    def stored_page(self, layer: int, page: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) [Hkv, bs, D] of an offloaded page of `layer` as the store holds it (in place:
        its block in the paged storage)."""
        r = self.row[page]
        if self.in_place:
            return tuple(t[layer, r].transpose(0, 1) for t in (self.cache.k, self.cache.v))
        return self.store_k[r, layer], self.store_v[r, layer]

    def _slot_view(self, seg: torch.Tensor) -> torch.Tensor:
        """The page-cache part of a layer's key segment [Hkv, G + S*bs, D] as [Hkv, S, bs, D]."""
        return seg[:, self.seg_base:].unflatten(1, (self.S, self.bs))

    def positions(self, layer: int) -> torch.Tensor:
        """[Hkv, S*bs] positions the layer's page cache showed this step (-1 = not seen)."""
        return self.cache.spos[layer, :, self.seg_base:]


def _summary_table(L: int, H: int, pages: int, d: int, dev: torch.device) -> Summary:
    """A zeroed summary table: INT8 values [L, Hkv, pages, D], fp32 scales [L, Hkv, pages]."""
    return Summary(torch.zeros((L, H, pages, d), dtype=torch.int8, device=dev),
                   torch.zeros((L, H, pages), dtype=torch.float32, device=dev))


def _host_store(shape: tuple, dtype: torch.dtype, cuda: bool) -> torch.Tensor:
    """A zeroed offload store in host memory; for a CUDA run page-locked at exactly its size:
    ordinary memory registered and mapped for the device (kernels/cuda/host_rows.py, as the
    host embedding table is; the page-cache kernel reads it at its host address), not torch's
    pinned allocator, which rounds every block up to a power of two (a 2.0 GiB K store held
    4 GiB of pinned memory on the H100, 2026-12-07: twice what the planner counts). The pinned
    allocator only where the driver refuses the registration."""
    t = torch.zeros(shape, dtype=dtype)
    if not cuda:
        return t
    try:
        from hisparse_cli.kernels.cuda.host_rows import map_table
    except ImportError:  # no Triton: the registration helper is not importable
        map_table = None
    if map_table is not None and map_table(t):
        return t
    return torch.zeros(shape, dtype=dtype, pin_memory=True)


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


__all__ = ["RetrievalTier", "RetrievalStats"]
