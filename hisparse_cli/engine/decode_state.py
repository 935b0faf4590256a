"""What an `Engine` keeps between `generate` calls on the CUDA-graph path: the last run's KV
storage (`PagedKVCache`) and its `GraphDecoder` (static inputs, captured graph, output).

A graph captures pointers: to the KV storage, the slot tensors, the decoder's static inputs.
A run whose cache has the same shape (`PagedKVCache.spec`: capacity in blocks, dtype, globals /
candidates / scores, window, sinks, importance) takes the kept cache, reset in place to a fresh
cache's contents, and binds its new BlockPool and SparseSequence to it; when the padded block
list length and the kernel arguments also match (`GraphDecoder.rebind`), its first decode step
replays the kept graph: no warm-up, no capture. Any other shape frees the kept state before
the new storage is allocated, so memory never holds two. The retrieval tier's device state and
pinned store are kept the same way (`take_tier`), so a kept graph that reads them replays and
the store is not pinned again. Sampling stays outside the graph, so
sampler settings never prevent reuse.
"""

from __future__ import annotations

from hisparse_cli.engine.cuda_graph import GraphDecoder
from hisparse_cli.engine.kv_cache import PagedKVCache


class DecodeState:
    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self.decoder: GraphDecoder | None = None
        self.tier = None  # the run's RetrievalTier (engine/retrieval.py), kept with the cache

    def take_tier(self, args: dict):
        """The kept retrieval tier, reset, when it was made with `args` for the kept cache;
        else None (and it is dropped: the run makes its own)."""
        tier, self.tier = self.tier, None
        if tier is None or tier.cache is not self.cache or tier.args != args:
            return None
        tier.reset()
        return tier

    def take_cache(self, spec: dict) -> PagedKVCache | None:
        """The kept cache, reset, when its shape is `spec`; else None (the caller frees this
        state before allocating)."""
        if self.cache.spec != spec:
            return None
        self.cache.reset()
        return self.cache

    def decoder_for(self, model, run, total_tokens: int,
                    persistent: bool = False) -> tuple[GraphDecoder, bool]:
        """(decoder for `run`, whether it replays a kept graph). A decoder that does not fit
        is dropped (its graph freed) before the new one is built. persistent: the execution
        plan's decode kernel is the persistent one (GraphDecoder)."""
        assert run.cache is self.cache, "the run does not use the kept cache"
        dec = self.decoder
        if dec is not None and dec.persistent == persistent and \
                dec.rebind(model, run, total_tokens):
            return dec, dec.graph is not None
        self.release_decoder()
        self.decoder = GraphDecoder(model, run, total_tokens, persistent=persistent)
        return self.decoder, False

    def release_decoder(self) -> None:
        if self.decoder is not None:
            self.decoder.release()
            self.decoder = None

    def release(self) -> None:
        self.release_decoder()
        self.tier = None
        self.cache = None  # type: ignore[assignment]  # the storage goes with the last reference
