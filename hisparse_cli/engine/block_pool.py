"""Block pool: physical KV block ids, a free list and counters. Plain Python, no torch.

Physical ids are handed out from the free list first (most recently freed first, so the
device storage stays compact), otherwise a new id is minted; `capacity` is the number of
distinct ids minted so far, which is how many blocks of device storage the KV cache needs.
An optional `max_blocks` cap raises `ResourceError` instead of growing past it.
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

    @property
    def live(self) -> int:
        return len(self._live)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def is_live(self, block_id: int) -> bool:
        return block_id in self._live

    def allocate(self) -> int:
        if self._free:
            block_id = self._free.pop()
        else:
            if self.max_blocks is not None and self.capacity >= self.max_blocks:
                raise ResourceError(
                    f"KV block pool is full ({self.max_blocks} blocks)",
                    hint="lower --window/--global-tokens/--prefill chunk or raise the profile's budget",
                )
            block_id = self.capacity
            self.capacity += 1
        self._live.add(block_id)
        self.allocated += 1
        self.peak_live = max(self.peak_live, len(self._live))
        return block_id

    def free(self, block_id: int) -> None:
        if block_id not in self._live:
            raise ValueError(f"block {block_id} is not allocated (double free?)")
        self._live.remove(block_id)
        self._free.append(block_id)
        self.freed += 1

    def free_all(self, block_ids: list[int]) -> None:
        for b in block_ids:
            self.free(b)
