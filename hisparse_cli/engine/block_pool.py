"""Block pool: physical KV block ids, a free list and counters. Plain Python, no torch.

Physical ids are handed out from the free list first (most recently freed first, so the
device storage stays compact), otherwise a new id is minted; `capacity` is the number of
distinct ids minted so far (an id is minted only when every minted id is live, so it equals
`peak_live`). An optional `max_blocks` cap (the user's budget) raises `ResourceError` instead of
growing past it. `offload(id)`: a live block held by the retrieval tier's offload store in place (the CPU):
it stays live (never handed out again) but leaves the working set: `max_blocks` caps the
working set (live minus offloaded). `bind_storage(n)` ties the pool to device storage allocated once for `n`
blocks: minting an id >= n is then a bug of the caller (a step longer than the run was sized
for) and raises `RuntimeError` before any id points past the storage.
"""

from __future__ import annotations

from hisparse_cli.errors import ResourceError


class BlockPool:
    def __init__(self, max_blocks: int | None = None) -> None:
        if max_blocks is not None and max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        self.max_blocks = max_blocks
        self._free: list[int] = []
        self._live: set[int] = set()
        self.capacity = 0  # distinct physical ids minted
        self.allocated = 0  # allocate() calls over the pool's life
        self.freed = 0  # free() calls over the pool's life
        self.peak_live = 0
        self._offloaded: set[int] = set()
        self.peak_resident = 0  # most live blocks not offloaded at once
        self.storage_blocks: int | None = None  # device storage behind the ids (bind_storage)

    def bind_storage(self, n_blocks: int) -> None:
        """Physical ids must stay < n_blocks: the device storage was allocated once for them."""
        if n_blocks < self.capacity:
            raise ValueError(f"storage of {n_blocks} blocks is smaller than the {self.capacity} "
                             "ids already minted")
        self.storage_blocks = n_blocks

    @property
    def live(self) -> int:
        return len(self._live)

    @property
    def offloaded(self) -> int:
        return len(self._offloaded)

    def offload(self, block_id: int) -> None:
        if block_id not in self._live:
            raise ValueError(f"block {block_id} is not allocated")
        self._offloaded.add(block_id)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def is_live(self, block_id: int) -> bool:
        return block_id in self._live

    def allocate(self) -> int:
        if self._free:
            block_id = self._free.pop()
        else:
            if (self.max_blocks is not None
                    and self.capacity - len(self._offloaded) >= self.max_blocks):
                raise ResourceError(
                    f"KV block pool is full ({self.max_blocks} blocks)",
                    hint="lower --window/--global-tokens/--prefill chunk or raise the profile's budget",
                )
            if self.storage_blocks is not None and self.capacity >= self.storage_blocks:
                raise RuntimeError(
                    f"KV block pool would hand out id {self.capacity}, past the KV storage "
                    f"allocated once for {self.storage_blocks} blocks (the run's working-set "
                    "bound): a step longer than the chunk the run was sized for?")
            block_id = self.capacity
            self.capacity += 1
        self._live.add(block_id)
        self.allocated += 1
        self.peak_live = max(self.peak_live, len(self._live))
        self.peak_resident = max(self.peak_resident, len(self._live) - len(self._offloaded))
        return block_id

    def free(self, block_id: int) -> None:
        if block_id not in self._live:
            raise ValueError(f"block {block_id} is not allocated (double free?)")
        self._live.remove(block_id)
        self._offloaded.discard(block_id)
        self._free.append(block_id)
        self.freed += 1

    def free_all(self, block_ids: list[int]) -> None:
        for b in block_ids:
            self.free(b)
