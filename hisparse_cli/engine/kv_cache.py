"""Device-side KV state of one run: paged K/V blocks for every layer, the importance score of
each live token, and per layer / KV head the global slots and the candidate slots.

Storage is allocated once, when the run starts (before prefill), for `capacity_blocks` blocks:
the run's working-set bound (`SparseSequence.working_set_bound(chunk, total_tokens)`), which for
sparse runs does not depend on the document's length and for dense runs is the whole text; a
short text gets only the blocks it can use (the bound is capped at its length). It never grows,
so there is no old + new copy of it at any moment, and its pointers stay valid for CUDA graphs;
the block pool is bound to it (`BlockPool.bind_storage`) and cannot hand out an id past it.

Importance (policy "attention", H2O-like): a token's score is the attention probability it
received while in the window, summed over queries and the query heads of its KV head, divided
by the number of queries that saw it (its mean attention per query). Globals keep accruing
mass and query count while they are global, so a global that stops being attended loses rank.
Policy "snapkv": the same, counting only the last `observation_window` queries before the
token leaves the window. Policy "probe": a learned scorer's output for the token (no mass).
Policy "uniform": priority = trailing zeros of (position + 1), so the kept set is evenly
spaced over the evicted history (the naive baseline).
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def int64_to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A host list as an int64 tensor on `device` without waiting for the device: on CUDA it
    is staged in pinned memory and copied asynchronously (`torch.tensor(..., device=cuda)`
    copies from pageable memory, which synchronises the stream: a pipeline drain each call).
    The device tensor is the same size either way (the memory planner's count)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.int64, device=device)
    host = torch.tensor(values, dtype=torch.int64, pin_memory=True)
    # the caching host allocator keeps `host` until the copy is done (an event on the stream)
    return host.to(device, non_blocking=True)


class PagedKVCache:
    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, capacity_blocks: int, global_tokens: int = 0,
                 candidate_slots: int = 0, track_scores: bool = False, window: int | None = None,
                 importance: str = "attention", sinks: int = 0, queries_per_candidate: float = 1.0,
                 page_cache_tokens: int = 0) -> None:
        # the constructor's arguments: a cache kept for reuse (engine/decode_state.py) serves a
        # later run only when they are equal
        self.spec = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         block_size=block_size, dtype=dtype, device=device,
                         capacity_blocks=capacity_blocks, global_tokens=global_tokens,
                         candidate_slots=candidate_slots, track_scores=track_scores, window=window,
                         importance=importance, sinks=sinks,
                         queries_per_candidate=queries_per_candidate,
                         page_cache_tokens=page_cache_tokens)
        self.L, self.H, self.D, self.bs = num_layers, num_kv_heads, head_dim, block_size
        self.dtype, self.device = dtype, device
        self.window, self.importance, self.sinks = window, importance, sinks
        self.queries_per_candidate = queries_per_candidate  # normaliser of a candidate's mass
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity = capacity_blocks
        # k, v: [L, capacity, bs, Hkv, D]; score: [L, capacity, bs, Hkv] fp32. Zeros, not
        # empty: masked-out slots are read (of a visible block, and on the CPU's one-query
        # path every slot of the storage), so they must be finite (0 * NaN = NaN); a reused
        # or freed block holds its old (finite) tokens.
        # On the CPU the K/V memory is head-major, [L, Hkv, capacity, bs, D], and k/v are that
        # storage seen as [L, capacity, bs, Hkv, D] (a permuted view; same bytes): each KV
        # head's keys are then one [capacity * bs, D] matrix, which the torch reference's
        # matmuls read as is (kernels/attention/attention_ref.py: heads_view). A one-query q.K over a
        # 5K-slot layer took 215-235 us on a 2-core CPU with the heads interleaved against
        # 67-92 us head-major, and dense decode's SDPA 1.5 against 0.8 ms a layer. The CUDA
        # kernels take any strides; on the GPU the layout stays [L, capacity, bs, Hkv, D].
        shape = (num_layers, capacity_blocks, block_size, num_kv_heads, head_dim)
        self.head_major = device.type == "cpu"
        if self.head_major:
            phys = (num_layers, num_kv_heads, capacity_blocks, block_size, head_dim)
            self.k = torch.zeros(phys, dtype=dtype, device=device).permute(0, 2, 3, 1, 4)
            self.v = torch.zeros(phys, dtype=dtype, device=device).permute(0, 2, 3, 1, 4)
        else:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.track_scores = track_scores
        self.score = torch.zeros(shape[:-1], dtype=torch.float32,
                                 device=device) if track_scores else None
        self.G, self.C = global_tokens, candidate_slots
        L, H, D = num_layers, num_kv_heads, head_dim

        def slots(n: int):
            return (torch.zeros((L, H, n, D), dtype=dtype, device=device),
                    torch.zeros((L, H, n, D), dtype=dtype, device=device),
                    torch.full((L, H, n), -1, dtype=torch.int64, device=device),
                    torch.zeros((L, H, n), dtype=torch.float32, device=device),  # mass
                    torch.zeros((L, H, n), dtype=torch.float32, device=device))  # queries seen

        # the extra key segment every query of a layer sees beside the paged blocks: the
        # globals, then (retrieval tier, engine/retrieval.py) the page-cache slots; g* are
        # views of its first G columns
        self.P = page_cache_tokens
        self.sk, self.sv, self.spos, self.smass, self.sseen = slots(self.G + self.P)
        self.gk, self.gv, self.gpos, self.gmass, self.gseen = (
            t[:, :, :self.G] for t in (self.sk, self.sv, self.spos, self.smass, self.sseen))
        self.ck, self.cv, self.cpos, self.cmass, self.cseen = slots(self.C)
        # per-layer views, made once (these tensors are never reallocated): a step's layers
        # pick from these lists instead of slicing [L, ...] tensors, an op per access on the
        # CPU's decode path; the segment's (k, v, pos, mass, seen) replace the globals' in
        # the attention call when there is a page cache
        seg = (self.sk, self.sv, self.spos, self.smass, self.sseen) if self.P else (
            self.gk, self.gv, self.gpos, self.gmass, self.gseen)
        self.layer_views = [tuple(t[i] if t is not None else None for t in (
            self.k, self.v, *seg, self.score)) for i in range(num_layers)]

    # -- storage ---------------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        return 2 * self.L * self.bs * self.H * self.D * self.k.element_size()

    def slot_bytes(self) -> int:
        """Bytes of the global, candidate and page-cache K/V slots (fixed for the run)."""
        return 2 * self.L * self.H * (self.G + self.C + self.P) * self.D * self.k.element_size()

    def reset(self) -> None:
        """In place, the contents `__init__` gives a fresh cache (the same storage and pointers,
        so a captured CUDA graph stays valid): K/V, slots and scores zero, slot positions -1.
        K/V would be overwritten before any unmasked read, but masked slots are read too and
        zeros make a reused cache byte-identical to a new one (one memset of the storage)."""
        for t in (self.k, self.v, self.score, self.sk, self.sv, self.smass, self.sseen,
                  self.ck, self.cv, self.cmass, self.cseen):
            if t is not None:
                t.zero_()
        self.spos.fill_(-1)
        self.cpos.fill_(-1)

    def reset_scores(self, blocks: list[int]) -> None:
        if self.score is not None and blocks:
            # index_fill_: an indexed assignment of a scalar would wait for the device
            self.score.index_fill_(1, int64_to_device(blocks, self.device), 0.0)

    def set_token_scores(self, layer: int, slots: torch.Tensor, scores: torch.Tensor) -> None:
        """Probe policy: per-token scores [T, Hkv] written at the tokens' slots."""
        self.score[layer].view(-1, self.H).index_copy_(0, slots, scores.float())

    # -- globals ---------------------------------------------------------------------------
    def _priority(self, pos: torch.Tensor, mass: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        if self.importance == "uniform":
            p1 = pos + 1
            pr = torch.log2((p1 & -p1).clamp(min=1).float())
        else:
            pr = mass / seen.clamp(min=1.0)
        return pr.masked_fill(pos < 0, NEG_INF)

    def _top(self, pos, mass, seen, n: int):
        """The n best entries along the last dim of [L, H, width] (per layer and head) ->
        (indices [L, H, n], their positions with -1 where an entry was empty)."""
        pr = self._priority(pos, mass, seen)
        top = torch.topk(pr, n, dim=-1, sorted=False)
        idx = top.indices
        return idx, pos.gather(-1, idx).masked_fill(top.values == NEG_INF, -1)

    def _expand(self, idx: torch.Tensor) -> torch.Tensor:
        return idx[..., None].expand(-1, -1, -1, self.D)

    @staticmethod
    def _assign(dst: tuple, src: tuple) -> None:
        """Update slot tensors in place: their storage stays fixed (CUDA-graph safe)."""
        for d, s in zip(dst, src):
            d.copy_(s)

    def evict_to_candidates(self, physical: list[int], starts: list[int]) -> None:
        """Score the tokens of evicted blocks and keep the best `C` per layer/head as candidates.
        Must run before the blocks are reused (they are freed by the host policy).
        Only the winners' K/V are read: the choice is made on positions and scores, then each
        slot takes its row from the old candidates or straight from the paged storage (no copy
        of the evicted blocks' K/V, so the transient is a few [L, Hkv, C, D] tensors)."""
        if self.C == 0 or not physical:
            return
        L, H, D, bs, C = self.L, self.H, self.D, self.bs, self.C
        ids = int64_to_device(physical, self.device)
        n = len(physical) * bs
        pos = (int64_to_device(starts, self.device)[:, None]
               + torch.arange(bs, device=self.device)[None, :]).reshape(-1)
        pos = pos.masked_fill(pos < self.sinks, -1)[None, None, :].expand(L, H, -1)
        if self.score is not None:
            mass = self.score[:, ids].reshape(L, n, H).transpose(1, 2)
        else:
            mass = torch.zeros(pos.shape, dtype=torch.float32, device=self.device)
        seen = torch.full(pos.shape, float(self.queries_per_candidate), device=self.device)
        cpos, cmass, cseen = (torch.cat(pair, dim=2) for pair in (
            (self.cpos, pos), (self.cmass, mass), (self.cseen, seen)))
        idx, pos_sel = self._top(cpos, cmass, cseen, C)  # idx < C: an old candidate
        # row of token j = idx - C of the evicted blocks in the storage's memory viewed as
        # [-1, D]: ((layer * capacity + block) * bs + offset) * H + head, or head-major
        # ((layer * H + head) * capacity + block) * bs + offset
        j = (idx - C).clamp(min=0)
        blk = ids[j // bs]
        if self.head_major:  # (planner_step.evict_peak traces both expressions' temporaries)
            rows = ((torch.arange(L * H, device=self.device).view(L, H, 1) * self.capacity + blk)
                    * bs + j % bs)
        else:
            rows = ((torch.arange(L, device=self.device)[:, None, None] * self.capacity + blk)
                    * bs + j % bs) * H + torch.arange(H, device=self.device)[None, :, None]
        keep = (idx < C)[..., None]
        old = self._expand(idx.clamp(max=C - 1))
        for slots, pages in ((self.ck, self.k), (self.cv, self.v)):  # one statement each: two
            # [L, H, C, D] temporaries at a time, the result written into the slots in place
            torch.where(keep, slots.gather(2, old),
                        self._memory(pages).index_select(0, rows.reshape(-1)).view(L, H, C, D),
                        out=slots)
        self._assign((self.cpos, self.cmass, self.cseen),
                     (pos_sel, cmass.gather(-1, idx), cseen.gather(-1, idx)))

    def _memory(self, pages: torch.Tensor) -> torch.Tensor:
        """k or v's memory in its own order, as [-1, D] (a view)."""
        return (pages.permute(0, 3, 1, 2, 4) if self.head_major else pages).reshape(-1, self.D)

    def recalibrate(self) -> None:
        """Segmented recalibration: new globals = best G of (globals ∪ candidates)."""
        if self.G == 0:
            return
        G, C = self.G, self.C
        gpos, gmass, gseen = (torch.cat(pair, dim=2) for pair in (
            (self.gpos, self.cpos), (self.gmass, self.cmass), (self.gseen, self.cseen)))
        idx, pos_sel = self._top(gpos, gmass, gseen, G)  # idx < G: a current global
        if C:
            keep = (idx < G)[..., None]
            old, new = self._expand(idx.clamp(max=G - 1)), self._expand((idx - G).clamp(min=0))
            for slots, cands in ((self.gk, self.ck), (self.gv, self.cv)):
                torch.where(keep, slots.gather(2, old), cands.gather(2, new), out=slots)
        else:
            for slots in (self.gk, self.gv):
                slots.copy_(slots.gather(2, self._expand(idx)))
        self._assign((self.gpos, self.gmass, self.gseen),
                     (pos_sel, gmass.gather(-1, idx), gseen.gather(-1, idx)))
        self.cpos.fill_(-1)
        self.cmass.zero_()
        self.cseen.zero_()
