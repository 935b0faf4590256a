"""Host-side sparse policy of one sequence: block table, which blocks each step reads, which
blocks leave the window (evicted, scored as global candidates, freed), recalibration cadence.
Plain Python, no torch: decisions are testable in milliseconds.

Visibility rule (the same for prefill chunks and decode steps): a query at position q sees key
position k iff k <= q and (k < sink_tokens or k > q - window_size), plus its layer/head's current
global tokens (which are always older than any live window). window_size=None: every k <= q.
A block is evicted once every future query's window has passed its last position; it is freed
unless it holds a sink position.
"""

from __future__ import annotations

from dataclasses import dataclass

from hisparse_cli.engine.block_pool import BlockPool
from hisparse_cli.config.settings import SparseConfig
from hisparse_cli.errors import ResourceError


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class EvictedBlock:
    """A block whose tokens left every future window: candidates for the global set."""

    physical: int
    start: int  # position of the block's first token
    freed: bool  # False for a block that holds sinks (kept for them) or is offloaded in place
    offloaded: bool = False  # goes to the retrieval tier's offload store


class SparseSequence:
    """Block table and eviction bookkeeping of one sequence under a SparseConfig."""

    def __init__(self, cfg: SparseConfig, pool: BlockPool, model_window: int | None = None,
                 offload_in_place: bool = False) -> None:
        self.cfg = cfg
        self.pool = pool
        w = cfg.window_size
        if model_window is not None:  # a model-native sliding window (e.g. Mistral) also bounds it
            w = model_window if w is None else min(w, model_window)
        self.window = w
        self.sinks = cfg.sink_tokens if w is not None else 0
        # the retrieval tier: a model-native window is the model's own rule (no retrieval past it)
        self.retrieval = cfg.retrieval and w is not None and model_window is None
        if self.retrieval:
            self.sinks = cdiv(self.sinks, cfg.block_size) * cfg.block_size
        self.offload_in_place = self.retrieval and offload_in_place
        self.block_table: list[int | None] = []
        self.num_tokens = 0
        self._next_evict = 0  # logical index of the next block to evict
        self.recalibrations = 0

    # -- capacity ------------------------------------------------------------------------
    def working_set_bound(self, chunk: int, total_tokens: int | None = None) -> int:
        """Most blocks live at once while queries arrive `chunk` tokens at a time."""
        bs = self.cfg.block_size
        if self.window is None:
            if total_tokens is None:
                raise ValueError("dense attention needs total_tokens for its bound")
            return cdiv(total_tokens, bs)
        span = self.window + chunk - 1  # positions from the first window key to the last query
        bound = cdiv(self.sinks, bs) + cdiv(span, bs) + 1
        if total_tokens is not None:
            bound = min(bound, cdiv(total_tokens, bs))
        return bound

    def check_fits(self, chunk: int, total_tokens: int) -> None:
        need = self.working_set_bound(chunk, total_tokens)
        cap = self.pool.max_blocks
        if cap is not None and need > cap:
            raise ResourceError(
                f"the KV working set needs {need} blocks but the pool is capped at {cap}",
                hint="lower the window, prefill chunk or global tokens, or raise the memory budget",
            )

    # -- per step ------------------------------------------------------------------------
    def append(self, n: int) -> list[int]:
        """Reserve slots for positions [num_tokens, num_tokens + n); returns new physical blocks."""
        bs = self.cfg.block_size
        new_blocks = []
        end = self.num_tokens + n
        while len(self.block_table) * bs < end:
            b = self.pool.allocate()
            self.block_table.append(b)
            new_blocks.append(b)
        self.num_tokens = end
        return new_blocks

    def slot_mapping(self, start: int, n: int) -> list[int]:
        bs = self.cfg.block_size
        out = []
        for p in range(start, start + n):
            phys = self.block_table[p // bs]
            assert phys is not None, f"position {p} is in a freed block"
            out.append(phys * bs + p % bs)
        return out

    def visible_span(self, q_start: int, n: int) -> tuple[int, int]:
        """(first window block, last block) in logical indices: with the sink blocks they make
        `visible_blocks`, so two steps with the same span read the same blocks (O(1); the
        graph decoder rebuilds its block list only when this changes)."""
        bs = self.cfg.block_size
        last = (q_start + n - 1) // bs
        if self.window is None:
            return 0, last
        lo = max(self.sinks, q_start - self.window + 1)
        return min(lo, q_start + n - 1) // bs, last

    def step_window(self, q_start: int, n: int) -> int | None:
        """The window the step's attention applies: `window`, or with the retrieval tier the
        distance from the first window block's start to the step's last query (every query
        of the step then sees all of its window blocks; module doc)."""
        if not self.retrieval:
            return self.window
        first, _ = self.visible_span(q_start, n)
        return max(self.window, q_start + n - first * self.cfg.block_size)

    def storage_blocks(self, chunk: int, total_tokens: int | None) -> int:
        """Blocks of device storage a run allocates: the working-set bound, or with offload
        in place every block of the run (the offloaded pages stay in it)."""
        if self.offload_in_place:
            if total_tokens is None:
                raise ValueError("offload in place needs total_tokens for its storage")
            return cdiv(total_tokens, self.cfg.block_size)
        return self.working_set_bound(chunk, total_tokens)

    def visible_blocks(self, q_start: int, n: int) -> tuple[list[int], list[int]]:
        """(physical ids, start positions) of blocks holding keys any query in
        [q_start, q_start + n) may see, in position order (sinks first, then the window)."""
        bs = self.cfg.block_size
        first, last = self.visible_span(q_start, n)
        if self.window is None:
            logical = range(0, last + 1)
        else:
            sink_blocks = range(0, min(cdiv(self.sinks, bs), last + 1))
            logical = sorted(set(sink_blocks) | set(range(first, last + 1)))
        phys, starts = [], []
        for b in logical:
            p = self.block_table[b]
            assert p is not None, f"block {b} needed by the step was freed"
            phys.append(p)
            starts.append(b * bs)
        return phys, starts

    def evict(self) -> list[EvictedBlock]:
        """Blocks no future query (from num_tokens on) sees in its window: freed at once unless
        they hold a sink. Returned so their tokens can be scored as global candidates."""
        if self.window is None:
            return []
        bs = self.cfg.block_size
        first_visible = max(self.sinks, self.num_tokens - self.window + 1)
        out = []
        first_visible = min(first_visible, self.num_tokens)  # only complete, written blocks
        while (self._next_evict + 1) * bs <= first_visible:
            b = self._next_evict
            phys = self.block_table[b]
            assert phys is not None
            holds_sink = b * bs < self.sinks
            offloaded = self.retrieval and not holds_sink
            freed = not holds_sink and not self.offload_in_place
            if freed:
                self.pool.free(phys)
                self.block_table[b] = None
            elif offloaded:
                self.pool.offload(phys)
            out.append(EvictedBlock(physical=phys, start=b * bs, freed=freed,
                                    offloaded=offloaded))
            self._next_evict += 1
        return out

    def recalibration_due(self, before: int, after: int) -> bool:
        """True when [before, after) crosses a multiple of recalibrate_every."""
        r = self.cfg.recalibrate_every
        return self.window is not None and after // r > before // r

    def release(self) -> None:
        """Return every block still held to the pool (end of a run)."""
        for i, b in enumerate(self.block_table):
            if b is not None:
                self.pool.free(b)
                self.block_table[i] = None

    def live_blocks(self) -> list[int]:
        return [b for b in self.block_table if b is not None]

    def resident_blocks(self) -> int:
        """Blocks of the working set (live and not offloaded in place)."""
        return self.pool.live - self.pool.offloaded
