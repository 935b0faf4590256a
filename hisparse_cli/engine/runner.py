"""One sequence's run through the model: host policy (`SparseSequence`) + device state
(`PagedKVCache`) + the step context the attention layers call. Prefill and decode are the same
`step` with T tokens or one.

Order of a step: reserve slots -> forward (each layer stores its K/V, attends over
{sinks ∪ globals ∪ window}, adds importance mass) -> evict blocks that left every future
window (best tokens copied to candidate slots first, then freed) -> recalibrate the globals
when the step crossed a multiple of recalibrate_every.
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
        self.block_ids = int64_to_device(ids, dev)
        self.block_starts = int64_to_device(starts, dev)
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
        glob = cache.G > 0
        # masses go straight into the layer's score / global_mass / global_seen
        out, _, _ = run.backend.sparse_attention(
            q, k_l, v_l, self.block_ids, self.block_starts, self.q_start,
            run.seq.sinks, run.seq.window, run.scale,
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
    already reset (Engine's reuse across generate calls); None allocates a new one."""

    def __init__(self, cfg: ModelConfig, sparse: SparseConfig, device: torch.device,
                 kv_dtype: torch.dtype, backend: KernelBackend, pool: BlockPool,
                 token_scorer=None, *, total_tokens: int | None = None,
                 chunk: int | None = None,
                 cache_source: Callable[[dict], PagedKVCache | None] | None = None) -> None:
        self.cfg, self.sparse, self.device, self.backend, self.pool = cfg, sparse, device, backend, pool
        self.seq = SparseSequence(sparse, pool, model_window=cfg.sliding_window)
        self.chunk = chunk or sparse.prefill_chunk  # longest step the storage is sized for
        if total_tokens is not None:  # a pool capped below the bound fails before allocating
            self.seq.check_fits(self.chunk, total_tokens)
        capacity = self.seq.working_set_bound(self.chunk, total_tokens)
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
            importance=imp, sinks=self.seq.sinks, queries_per_candidate=per_candidate)
        cache = cache_source(spec) if cache_source is not None else None
        if cache is not None:
            assert cache.spec == spec, "a kept KV cache of another shape"
        self.cache = cache if cache is not None else PagedKVCache(**spec)
        self.scale = cfg.head_dim ** -0.5
        stride = sparse.score_stride
        self.score_kwargs = {"score_stride": stride} if self.track_scores and stride > 1 else {}
        if self.track_scores and imp == "snapkv" and w - obs > 0:
            self.score_kwargs["score_min_distance"] = w - obs
        self.kv_bytes_peak = 0

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
        new_blocks = self.seq.append(n)  # ids < cache.capacity (the pool is bound to it)
        self.cache.reset_scores(new_blocks)
        live_bytes = self.pool.live * self.cache.bytes_per_block() + self.cache.slot_bytes()
        self.kv_bytes_peak = max(self.kv_bytes_peak, live_bytes)
        ctx = StepContext(self, start, n)
        positions = torch.arange(start, start + n, device=self.device)
        logits = model(input_ids, positions, ctx, all_logits=all_logits)
        evicted = self.seq.evict()
        if evicted:
            self.cache.evict_to_candidates([e.physical for e in evicted], [e.start for e in evicted])
        if self.cache.G and self.seq.recalibration_due(start, start + n):
            self.cache.recalibrate()
            self.seq.recalibrations += 1
        return logits

    # -- introspection for tests and the eval harness ---------------------------------------
    def global_positions(self, layer: int) -> torch.Tensor:
        """[Hkv, G] positions of the layer's current globals (-1 = empty slot)."""
        return self.cache.gpos[layer].clone()
