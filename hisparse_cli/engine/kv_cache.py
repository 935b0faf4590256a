"""Device-side KV state of one run: paged K/V blocks for every layer, the importance score of
each live token, and per layer / KV head the global slots and the candidate slots.

Storage grows with the block pool's capacity (never with a maximum sequence length):
sparse runs stop growing at the working-set bound, dense runs grow with the text.

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


class PagedKVCache:
    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, global_tokens: int = 0,
                 candidate_slots: int = 0, track_scores: bool = False, window: int | None = None,
                 importance: str = "attention", sinks: int = 0, queries_per_candidate: float = 1.0) -> None:
        self.L, self.H, self.D, self.bs = num_layers, num_kv_heads, head_dim, block_size
        self.dtype, self.device = dtype, device
        self.window, self.importance, self.sinks = window, importance, sinks
        self.queries_per_candidate = queries_per_candidate  # normaliser of a candidate's mass
        self.capacity = 0
        shape = (num_layers, 0, block_size, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.track_scores = track_scores
        self.score = torch.empty((num_layers, 0, block_size, num_kv_heads), dtype=torch.float32,
                                 device=device) if track_scores else None
        self.G, self.C = global_tokens, candidate_slots
        L, H, D = num_layers, num_kv_heads, head_dim

        def slots(n: int):
            return (torch.zeros((L, H, n, D), dtype=dtype, device=device),
                    torch.zeros((L, H, n, D), dtype=dtype, device=device),
                    torch.full((L, H, n), -1, dtype=torch.int64, device=device),
                    torch.zeros((L, H, n), dtype=torch.float32, device=device),  # mass
                    torch.zeros((L, H, n), dtype=torch.float32, device=device))  # queries seen

        self.gk, self.gv, self.gpos, self.gmass, self.gseen = slots(self.G)
        self.ck, self.cv, self.cpos, self.cmass, self.cseen = slots(self.C)

    # -- storage ---------------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        return 2 * self.L * self.bs * self.H * self.D * self.k.element_size()

    def slot_bytes(self) -> int:
        """Bytes of the global and candidate slots (fixed for the run)."""
        return 2 * self.L * self.H * (self.G + self.C) * self.D * self.k.element_size()

    def ensure_capacity(self, n_blocks: int) -> None:
        """Grow paged storage to hold physical ids < n_blocks (doubling, copies live data)."""
        if n_blocks <= self.capacity:
            return
        new_cap = max(n_blocks, min(2 * self.capacity, n_blocks + self.capacity)) if self.capacity else n_blocks

        def grow(t: torch.Tensor) -> torch.Tensor:
            shape = list(t.shape)
            shape[1] = new_cap
            # zeros, not empty: masked-out slots must hold finite values (0 * NaN = NaN)
            out = torch.zeros(shape, dtype=t.dtype, device=t.device)
            out[:, : self.capacity] = t[:, : self.capacity]
            return out

        self.k, self.v = grow(self.k), grow(self.v)
        if self.score is not None:
            self.score = grow(self.score)
        self.capacity = new_cap

    def reset_scores(self, blocks: list[int]) -> None:
        if self.score is not None and blocks:
            self.score[:, torch.tensor(blocks, device=self.device)] = 0.0

    def add_key_mass(self, layer: int, block_ids: torch.Tensor, key_mass: torch.Tensor) -> None:
        # key_mass: [Hkv, nb*bs] -> score[layer][block, offset, head]
        nb = block_ids.shape[0]
        self.score[layer].index_add_(0, block_ids, key_mass.reshape(self.H, nb, self.bs).permute(1, 2, 0))

    def set_token_scores(self, layer: int, slots: torch.Tensor, scores: torch.Tensor) -> None:
        """Probe policy: per-token scores [T, Hkv] written at the tokens' slots."""
        self.score[layer].view(-1, self.H).index_copy_(0, slots, scores.float())

    def add_global_mass(self, layer: int, g_mass: torch.Tensor, n_queries: int) -> None:
        self.gmass[layer] += g_mass
        self.gseen[layer] += n_queries

    # -- globals ---------------------------------------------------------------------------
    def _priority(self, pos: torch.Tensor, mass: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        if self.importance == "uniform":
            p1 = pos + 1
            pr = torch.log2((p1 & -p1).clamp(min=1).float())
        else:
            pr = mass / seen.clamp(min=1.0)
        return pr.masked_fill(pos < 0, NEG_INF)

    def _select(self, k, v, pos, mass, seen, n: int):
        """Keep the n best of the candidate tensors along dim 2 (per layer and head)."""
        pr = self._priority(pos, mass, seen)
        top = torch.topk(pr, n, dim=-1, sorted=False)
        idx = top.indices
        gather = idx[..., None].expand(-1, -1, -1, self.D)
        pos_sel = pos.gather(-1, idx).masked_fill(top.values == NEG_INF, -1)
        return (k.gather(2, gather), v.gather(2, gather), pos_sel, mass.gather(-1, idx),
                seen.gather(-1, idx))

    @staticmethod
    def _assign(dst: tuple, src: tuple) -> None:
        """Update slot tensors in place: their storage stays fixed (CUDA-graph safe)."""
        for d, s in zip(dst, src):
            d.copy_(s)

    def evict_to_candidates(self, physical: list[int], starts: list[int]) -> None:
        """Score the tokens of evicted blocks and keep the best `C` per layer/head as candidates.
        Must run before the blocks are reused (they are freed by the host policy)."""
        if self.C == 0 or not physical:
            return
        ids = torch.tensor(physical, device=self.device)
        ne = len(physical)
        k = self.k[:, ids].reshape(self.L, ne * self.bs, self.H, self.D).transpose(1, 2)
        v = self.v[:, ids].reshape(self.L, ne * self.bs, self.H, self.D).transpose(1, 2)
        pos = (torch.tensor(starts, device=self.device)[:, None]
               + torch.arange(self.bs, device=self.device)[None, :]).reshape(-1)
        pos = pos.masked_fill(pos < self.sinks, -1)[None, None, :].expand(self.L, self.H, -1)
        if self.score is not None:
            mass = self.score[:, ids].reshape(self.L, ne * self.bs, self.H).transpose(1, 2)
        else:
            mass = torch.zeros(pos.shape, dtype=torch.float32, device=self.device)
        seen = torch.full(pos.shape, float(self.queries_per_candidate), device=self.device)
        cat = [torch.cat(pair, dim=2) for pair in ((self.ck, k), (self.cv, v), (self.cpos, pos),
                                                   (self.cmass, mass), (self.cseen, seen))]
        self._assign((self.ck, self.cv, self.cpos, self.cmass, self.cseen), self._select(*cat, n=self.C))

    def recalibrate(self) -> None:
        """Segmented recalibration: new globals = best G of (globals ∪ candidates)."""
        if self.G == 0:
            return
        cat = [torch.cat(pair, dim=2) for pair in ((self.gk, self.ck), (self.gv, self.cv),
                                                   (self.gpos, self.cpos), (self.gmass, self.cmass),
                                                   (self.gseen, self.cseen))]
        self._assign((self.gk, self.gv, self.gpos, self.gmass, self.gseen), self._select(*cat, n=self.G))
        self.cpos.fill_(-1)
        self.cmass.zero_()
        self.cseen.zero_()
