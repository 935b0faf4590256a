"""One sequence's run through the model: host policy (`SparseSequence`) + device state
(`PagedKVCache`) + the step context the attention layers call. Prefill and decode are the same
`step` with T tokens or one.

Order of a step: reserve slots -> (the retrieval tier, a decode step: every layer's page cache
filled for the last step's queries, engine/retrieval.py) -> forward (each layer stores its K/V;
with the retrieval tier a prefill chunk fills the layer's page cache for its queries; attends
over {sinks ∪ globals ∪ window ∪ retrieved pages}, adds importance mass) -> evict blocks that
left every future window (best tokens copied to candidate slots first; with the retrieval tier
the blocks go to the offload store, engine/retrieval.py; then freed) -> recalibrate the
globals when the step crossed a multiple of recalibrate_every.
"""

from __future__ import annotations

from typing import Callable

import torch

from hisparse_cli.engine.block_pool import BlockPool
from hisparse_cli.config.settings import SparseConfig
from hisparse_cli.engine.kv_cache import PagedKVCache, int64_to_device
from hisparse_cli.engine.sparsity import SparseSequence
from hisparse_cli.kernels.dispatch import KernelBackend
from hisparse_cli.model.config import ModelConfig


class StepContext:
    """AttentionContext of one step: where the step's tokens go and which blocks it reads."""

    def __init__(self, run: "KVRun", q_start: int, n: int) -> None:
        self.run, self.q_start, self.n = run, q_start, n
        dev = run.device
        seq = run.seq
        self.slots = int64_to_device(seq.slot_mapping(q_start, n), dev)  # no host sync
        ids, starts = seq.visible_blocks(q_start, n)
        self.host_block_ids = ids  # (the native CPU decode reads the list, model/cpu_decode.py)
        self.block_ids = int64_to_device(ids, dev)
        self.block_starts = int64_to_device(starts, dev)
        self.window = seq.step_window(q_start, n)
        self.memo: dict = {}  # per-step values shared by all layers (torch reference)
        self.wants_hidden = run.token_scorer is not None

    def observe(self, layer: int, x: torch.Tensor) -> None:
        """Probe policy: score the step's tokens from the layer's normed hidden states [T, hs]."""
        self.run.cache.set_token_scores(layer, self.slots, self.run.token_scorer(layer, x))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        run = self.run
        k_l, v_l = run.cache.layer_views[layer][:2]
        run.backend.store_kv(k_l, v_l, k, v, self.slots)
        return self._attention(layer, q)

    def attend_qkv(self, layer: int, qkv: torch.Tensor, hq: int, hkv: int, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
        """attend() from the stacked projection's output qkv [T, (hq + 2 hkv) D] before RoPE
        (cos, sin [T, D]): RoPE of q and k and the K/V store in one backend call
        (KernelBackend.rope_store_kv: one Triton launch instead of two), then the attention."""
        run = self.run
        k_l, v_l = run.cache.layer_views[layer][:2]
        q = run.backend.rope_store_kv(qkv, hq, hkv, cos, sin, k_l, v_l, self.slots)
        return self._attention(layer, q)

    def _attention(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """The layer's sparse attention of q over its stored keys (the step's included)."""
        run, cache = self.run, self.run.cache
        k_l, v_l, gk, gv, gpos, gmass, gseen, score = cache.layer_views[layer]
        glob = cache.G + cache.P > 0
        if run.retrieval is not None:  # the page cache (the segment after the globals)
            run.retrieval.prepare(layer, q)
        # masses go straight into the layer's score / global_mass / global_seen
        out, _, _ = run.backend.sparse_attention(
            q, k_l, v_l, self.block_ids, self.block_starts, self.q_start,
            run.seq.sinks, self.window, run.scale,
            g_k=gk if glob else None, g_v=gv if glob else None,
            g_pos=gpos if glob else None, return_scores=run.track_scores,
            scores_into=(score, gmass, gseen) if run.track_scores else None,
            memo=self.memo, **run.score_kwargs)
        return out


class KVRun:
    """KV state of one sequence. Use as a context manager: every block returns to the pool.

    The paged storage is allocated here, once, at the working-set bound of steps of at most
    `chunk` tokens (default: the prefill chunk) over `total_tokens` positions (prompt + new
    tokens; required for dense attention, whose bound is the whole text).

    cache_source(spec) may return a kept PagedKVCache whose `spec` equals the one this run needs,
    already reset (Engine's reuse across generate calls); None allocates a new one. Where it
    did, tier_source(args) may likewise return that cache's kept RetrievalTier, reset.

    Retrieval tier (sparse.retrieval): offloaded pages stay in place on the CPU (the storage is
    then every block of the run) and are copied to pinned host memory on CUDA; copy_offload
    copies on the CPU too (tests of the copy path)."""

    def __init__(self, cfg: ModelConfig, sparse: SparseConfig, device: torch.device,
                 kv_dtype: torch.dtype, backend: KernelBackend, pool: BlockPool,
                 token_scorer=None, *, total_tokens: int | None = None,
                 chunk: int | None = None, copy_offload: bool = False,
                 cache_source: Callable[[dict], PagedKVCache | None] | None = None,
                 tier_source: Callable[[dict], "RetrievalTier | None"] | None = None) -> None:
        self.cfg, self.sparse, self.device, self.backend, self.pool = cfg, sparse, device, backend, pool
        self.seq = SparseSequence(sparse, pool, model_window=cfg.sliding_window,
                                  offload_in_place=device.type == "cpu" and not copy_offload)
        self.chunk = chunk or sparse.prefill_chunk  # longest step the storage is sized for
        if total_tokens is not None:  # a pool capped below the bound fails before allocating
            self.seq.check_fits(self.chunk, total_tokens)
        capacity = self.seq.storage_blocks(self.chunk, total_tokens)
        pool.bind_storage(capacity)  # no id past the storage: it never grows
        use_globals = self.seq.window is not None and sparse.global_tokens > 0
        imp = sparse.importance
        self.track_scores = use_globals and imp in ("attention", "snapkv")
        if use_globals and imp == "probe" and token_scorer is None:
            from hisparse_cli.errors import ConfigError

            raise ConfigError("importance='probe' needs a trained probe",
                              hint="train one with `hisparse probe train` or pick another importance")
        self.token_scorer = token_scorer if use_globals and imp == "probe" else None
        w = self.seq.window or 1
        obs = min(sparse.observation_window, w)
        per_candidate = {"attention": w, "snapkv": obs}.get(imp, 1)
        spec = dict(
            num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim, block_size=sparse.block_size, dtype=kv_dtype, device=device,
            capacity_blocks=capacity,
            global_tokens=sparse.global_tokens if use_globals else 0,
            candidate_slots=sparse.recalibrate_topk if use_globals else 0,
            track_scores=self.track_scores or self.token_scorer is not None, window=self.seq.window,
            importance=imp, sinks=self.seq.sinks, queries_per_candidate=per_candidate,
            page_cache_tokens=sparse.page_cache_pages * sparse.block_size if self.seq.retrieval
            else 0)
        cache = cache_source(spec) if cache_source is not None else None
        if cache is not None:
            assert cache.spec == spec, "a kept KV cache of another shape"
        self.cache = cache if cache is not None else PagedKVCache(**spec)
        self.scale = cfg.head_dim ** -0.5
        stride = sparse.score_stride
        self.score_kwargs = {"score_stride": stride} if self.track_scores and stride > 1 else {}
        if self.track_scores and imp == "snapkv" and w - obs > 0:
            self.score_kwargs["score_min_distance"] = w - obs
        self.retrieval = None
        if self.seq.retrieval:
            from hisparse_cli.engine.retrieval import RetrievalTier

            args = dict(max_pages=capacity if self.seq.offload_in_place else
                        -(-(total_tokens or 0) // sparse.block_size),
                        retrieval_pages=sparse.retrieval_pages,
                        cache_pages=sparse.page_cache_pages, summary=sparse.retrieval_summary,
                        in_place=self.seq.offload_in_place, backend=backend,
                        every=sparse.retrieval_every, query_heads=cfg.num_attention_heads)
            kept = tier_source(args) if tier_source is not None and cache is not None else None
            self.retrieval = kept if kept is not None else RetrievalTier(self.cache, **args)
        self.kv_bytes_peak = 0  # resident: working-set blocks, slots, page cache, summaries
        self.offload_bytes = 0  # pages in the offload store (host memory)
        self.trace = None  # callable(dict) receiving one record per step (--trace)

    def __enter__(self) -> "KVRun":
        return self

    def __exit__(self, *exc) -> None:
        self.seq.release()

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens

    def step(self, model, input_ids: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """input_ids: [T] on the device -> logits [T, V] or [1, V] (fp32)."""
        n = input_ids.shape[0]
        start = self.seq.num_tokens
        self.begin_step()
        new_blocks = self.seq.append(n)  # ids < cache.capacity (the pool is bound to it)
        self.cache.reset_scores(new_blocks)
        self.kv_bytes_peak = max(self.kv_bytes_peak, self.resident_bytes())
        ctx = StepContext(self, start, n)
        if self.retrieval is not None and self.retrieval.decoding:  # a decode step's pages,
            self.retrieval.choose_decode()  # every layer's, from the last step's queries
        positions = torch.arange(start, start + n, device=self.device)
        logits = model(input_ids, positions, ctx, all_logits=all_logits)
        evicted = self.end_step(start, n)
        if self.trace is not None:
            self.trace(self.step_record(start, n, int(ctx.block_ids.numel()), evicted))
        return logits

    def begin_step(self) -> None:
        """Before a step's forward (the retrieval tier: order after the last offload copy,
        count the step)."""
        if self.retrieval is not None:
            self.retrieval.wait_offload()  # a reused block is written after its copy out
            self.retrieval.begin_step(traced=self.trace is not None)

    def end_step(self, start: int, n: int) -> list:
        """After a step's forward over [start, start + n): evict the blocks that left every
        future window (best tokens to candidate slots; offloaded ones into the retrieval
        tier's store), recalibrate the globals when due. Returns the evicted blocks."""
        evicted = self.seq.evict()
        if evicted:
            self.cache.evict_to_candidates([e.physical for e in evicted], [e.start for e in evicted])
            off = [e for e in evicted if e.offloaded]
            if off:
                tier, bs = self.retrieval, self.sparse.block_size
                tier.offload([e.physical for e in off], [e.start // bs for e in off])
                self.offload_bytes = len(tier.offloaded) * tier.page_bytes()
        if self.cache.G and self.seq.recalibration_due(start, start + n):
            self.cache.recalibrate()
            self.seq.recalibrations += 1
            if self.retrieval is not None:  # no retrieved key may duplicate a new global
                self.retrieval.globals_changed = True
        return evicted

    def resident_bytes(self) -> int:
        """Bytes of the working set now: resident blocks, the global / candidate / page-cache
        slots and the page summaries (offloaded pages are host memory: `offload_bytes`)."""
        summ = self.retrieval.summary_bytes() if self.retrieval is not None else 0
        return (self.seq.resident_blocks() * self.cache.bytes_per_block()
                + self.cache.slot_bytes() + summ)

    def step_record(self, start: int, n: int, active_blocks: int, evicted: list) -> dict:
        """One --trace line: what the step read, evicted and retrieved (the retrieval tier's
        counts are read from the device: tracing waits for every step)."""
        rec = {"phase": "prefill" if n > 1 else "decode", "start": start, "tokens": n,
               "active_blocks": active_blocks, "evicted": len(evicted),
               "resident_blocks": self.seq.resident_blocks(),
               "recalibrations": self.seq.recalibrations}
        tier = self.retrieval
        if tier is not None:
            picks, hits, moved = tier.step_counts()
            rec.update(offloaded_pages=len(tier.offloaded), retrieved=picks, hits=hits,
                       bytes_to_cache=moved)
        return rec

    # -- introspection for tests and the eval harness ---------------------------------------
    def global_positions(self, layer: int) -> torch.Tensor:
        """[Hkv, G] positions of the layer's current globals (-1 = empty slot)."""
        return self.cache.gpos[layer].clone()
