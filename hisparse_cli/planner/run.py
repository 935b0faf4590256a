"""Replay of one `Engine.generate` run: the host policy itself (engine/sparsity.py's
`SparseSequence` on an engine/block_pool.py `BlockPool`: plain Python, no torch) decides,
step by step, how many blocks are live, how many each step reads, which are evicted and when
the globals are recalibrated; the device-side tensors of each step are replayed with the
traces of planner/step.py on top of what is resident (ids, slots, logits, and the paged KV
storage, which `KVRun` allocates once before prefill at the working-set bound of the prefill
chunk over prompt + new tokens and which never grows).

The result is the peak of device bytes the run allocates besides the weights (and cuBLAS's
workspace), what was live at that moment, and the KV numbers `RunStats` reports.

Retrieval tier (engine/retrieval.py): the key segment is G + page-cache slots wide, the page
summaries are resident, the storage holds every block where pages are offloaded in place (the
CPU) and the pinned host store every page on CUDA (`extra["offload_store_host_bytes"]`); each
step with offloaded pages adds its scoring transient (the chunk's queries pooled over
QUERY_POOL positions; page_score_ref.page_scores: their fp32 copies and two
[Hkv, T / QUERY_POOL * grp, pages] fp32 score tensors) and each eviction its
summary transient.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hisparse_cli.engine.block_pool import BlockPool
from hisparse_cli.config.settings import SparseConfig
from hisparse_cli.engine.sparsity import SparseSequence, cdiv
from hisparse_cli.engine.retrieval_sizes import (QUERY_POOL, copy_group_pages, pooled_queries,
                                                 summary_bytes)
from hisparse_cli.planner.attn import AttnStep
from hisparse_cli.planner.step import evict_peak, forward_peak, recalibrate_peak
from hisparse_cli.planner.trace import StepShape, SubPeak, Trace


@dataclass(frozen=True)
class KVSummary:
    """KV numbers of the run. `peak_live_blocks` / `kv_bytes_peak` are what `RunStats`
    reports as kv_blocks_peak / kv_bytes_peak (live blocks x bytes per block + K/V slots)."""

    block_size: int
    bytes_per_block: int  # K and V of one block, every layer
    window: int | None  # effective window (profile window, capped by a model-native one)
    sinks: int
    sink_blocks: int
    span_blocks: int  # blocks spanning window + chunk - 1 positions, plus one boundary block
    working_set_bound_blocks: int  # SparseSequence.working_set_bound (what check_fits uses)
    peak_live_blocks: int
    kv_bytes_peak: int
    capacity_blocks: int  # paged storage, allocated once (= the bound, >= peak live)
    global_slots: int  # per layer and KV head
    candidate_slots: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class RunTrace:
    peak: int  # device bytes allocated at the run's peak, weights and workspace excluded
    peak_live: dict[str, int]  # what was live then, by name
    peak_label: str  # when: "prefill step 12 (tokens 6144-6655): forward"
    phase_peaks: dict[str, int]  # largest transient of each kind of work
    resident_end: dict[str, int]  # live after the last step
    kv: KVSummary
    prefill_steps: int
    decode_steps: int
    extra: dict = field(default_factory=dict)


def visible_count(seq: SparseSequence, q_start: int, n: int) -> int:
    """len(seq.visible_blocks(q_start, n)[0]) without building the lists."""
    bs = seq.cfg.block_size
    last = (q_start + n - 1) // bs
    if seq.window is None:
        return last + 1
    lo = max(seq.sinks, q_start - seq.window + 1)
    a = min(cdiv(seq.sinks, bs), last + 1)  # sink blocks [0, a)
    b = min(lo, q_start + n - 1) // bs  # window blocks [b, last]
    return (last + 1 - b) + min(a, b)


def blocks_in_order(seq: SparseSequence, q_start: int, n: int) -> bool:
    """Whether the step's visible blocks are consecutive physical ids (attention_ref reads
    them in place on the CPU). Always for dense attention: its blocks are minted in order and
    never freed (answered without building the list of a long text's blocks)."""
    if seq.window is None:
        return True
    ids = seq.visible_blocks(q_start, n)[0]
    return ids == list(range(ids[0], ids[0] + len(ids)))


def sampled_queries(q_start: int, n: int, stride: int) -> int:
    """Positions q in [q_start, q_start + n) with q % stride == 0."""
    return (q_start + n - 1) // stride - (q_start - 1) // stride


def page_scoring(tr: Trace, s: StepShape, n: int, pages: int, k: int) -> SubPeak:
    """The temporaries of one layer's page scoring (RetrievalTier.select) for a chunk of n
    queries over `pages` offloaded pages, keeping k: the queries pooled (pooled_queries(n)
    rows of [Hq, D], held to the end; with a partial last group two parts and their cat);
    Triton's kernel writes only the [Hkv, pages] fp32 scores, the torch reference also holds
    the pooled queries (fp32, clamped twice) and two [Hkv, rows * grp, pages] fp32 logits.
    Then topk's values and indices, and their sort."""
    m = pooled_queries(n)
    held = tr.size(m * s.hq * s.d * s.cb) if m != n else 0
    pooling = 2 * held if n > QUERY_POOL and n % QUERY_POOL else held
    scores = tr.size(s.hkv * pages * 4)
    if s.backend == "triton" and s.d >= 16 and s.d & (s.d - 1) == 0:
        scoring = held + scores
    else:
        rows = m * s.hq
        scoring = held + 3 * tr.size(rows * s.d * 4) + 2 * tr.size(rows * pages * 4) + scores
    idx = tr.size(s.hkv * k * 8)
    pick = held + scores + max(tr.size(s.hkv * k * 4) + idx, 3 * idx)  # topk; then idx.sort()
    peak = max(pooling, scoring, pick)
    return SubPeak(peak, {"retrieval.page_scoring": peak})


def decode_page_choice(tr: Trace, s: StepShape, max_pages: int, k: int,
                       cache_pages: int) -> SubPeak:
    """The temporaries of a decode step's page choice for every layer at once
    (RetrievalTier.choose_decode), over the whole summary table (the CUDA graph's static
    form; the eager CPU step the same, over the same table): the [L * Hkv, pages] fp32
    scores (Triton's kernel writes only these; the torch reference also holds the queries in
    fp32 clamped twice, two [L * Hkv, grp, pages] fp32 logits and their masked copy and
    softmax), then topk's values and indices and the masked indices, and the placement's
    fill rows [L * Hkv, S] int64."""
    heads = s.layers * s.hkv
    scores = tr.size(heads * max_pages * 4)
    if s.backend == "triton" and s.d >= 16 and s.d & (s.d - 1) == 0:
        scoring = scores
    else:
        rows = s.layers * s.hq
        logits = tr.size(rows * max_pages * 4)
        scoring = 3 * tr.size(rows * s.d * 4) + 2 * logits + scores
        scoring = max(scoring, 2 * logits + scores)  # masked copy, then its softmax
    pick = scores + tr.size(heads * k * 4) + 2 * tr.size(heads * k * 8)
    peak = max(scoring, pick, tr.size(heads * k * 8) + tr.size(heads * cache_pages * 8))
    return SubPeak(peak, {"retrieval.page_choice": peak})


def policy(sparse: SparseConfig, model_window: int | None) -> SparseSequence:
    return SparseSequence(sparse, BlockPool(), model_window=model_window)


def simulate_run(s: StepShape, sparse: SparseConfig, model_window: int | None, prompt: int,
                 new_tokens: int, graph_workspace: int = 0, graph_input_bytes: int = 0,
                 sampler_bytes: tuple[int, ...] = (), sampler_kept: bool = False) -> RunTrace:
    """graph_workspace > 0: decode runs as a CUDA graph (engine/cuda_graph.py), whose side
    stream holds a cuBLAS workspace of that many bytes from the first decode step on;
    graph_input_bytes: its static embedded-row input (host-resident table), if any;
    sampler_bytes: the graph decode's sampler buffers, allocated at its start; sampler_kept:
    they are the in-graph sampler's (kernels/sampling/graph_sampler.py: no per-token temporaries, kept
    with the decode graph after the run), else DeviceSampler's (freed at the run's end)."""
    pool = BlockPool()
    seq = SparseSequence(sparse, pool, model_window=model_window, offload_in_place=not s.cuda)
    assert (seq.window, seq.sinks) == (s.window, s.sinks), "StepShape disagrees with the policy"
    tr = Trace(s.cuda)
    tr.label = "setup"
    lh, bs, chunk = s.layers * s.hkv, sparse.block_size, sparse.prefill_chunk
    ids = tr.alloc("input_ids", prompt * 8)
    cap = seq.storage_blocks(chunk, prompt + new_tokens)  # KVRun: storage allocated once
    P = sparse.page_cache_pages * bs if seq.retrieval else 0  # page-cache slots
    max_pages = cap if seq.offload_in_place else cdiv(prompt + new_tokens, bs)
    pool.bind_storage(cap)
    kv_bytes = s.layers * cap * bs * s.hkv * s.d * s.kvb
    tr.alloc("kv.paged_kv", kv_bytes)  # K
    tr.alloc("kv.paged_kv", kv_bytes)  # V
    if s.score_tensor:
        tr.alloc("kv.importance_scores", s.layers * cap * bs * s.hkv * 4)
    for name, n in (("kv.global_slots" if not P else "kv.global_and_page_cache_slots", s.G + P),
                    ("kv.candidate_slots", s.C)):
        for nbytes in (lh * n * s.d * s.kvb, lh * n * s.d * s.kvb, lh * n * 8, lh * n * 4,
                       lh * n * 4):
            tr.alloc(name, nbytes)
    summ_bytes = 0
    if seq.retrieval:  # RetrievalTier: INT8 summaries [L, Hkv, pages, D] + fp32 scales
        n_summ = 1 if sparse.retrieval_summary == "mean" else 2
        for _ in range(n_summ):
            tr.alloc("kv.page_summaries", lh * max_pages * s.d)
            tr.alloc("kv.page_summaries", lh * max_pages * 4)
        summ_bytes = summary_bytes(lh, max_pages, s.d, sparse.retrieval_summary)
        # RetrievalTier's device state: row_of_page, range, slot_page, slot_used, step,
        # counts, step_base, pick_ids (int64); last_q (the cache's dtype)
        slots = lh * sparse.page_cache_pages
        for n in (max_pages, 2, slots, slots, 1, 3, 3, sparse.retrieval_pages):
            tr.alloc("kv.page_cache_state", n * 8)
        tr.alloc("kv.page_cache_state", s.layers * s.hq * s.d * s.kvb)
    store_host = 0 if seq.offload_in_place or not seq.retrieval else (
        2 * lh * max_pages * bs * s.d * s.kvb)
    bpb = 2 * s.layers * bs * s.hkv * s.d * s.kvb
    slot_bytes = 2 * lh * (s.G + s.C + P) * s.d * s.kvb  # PagedKVCache.slot_bytes()
    logits, kv_peak = -1, 0
    samp: list[int] = []
    fwd_memo: dict[tuple, tuple[SubPeak, list[int]]] = {}
    g_valid = c_valid = 0  # filled global / candidate slots (reference mask branch)
    evict_memo: dict[int, SubPeak] = {}
    recal = recalibrate_peak(s) if s.G else None
    phase: dict[str, int] = {}

    def note(kind: str, value: int) -> None:
        phase[kind] = max(phase.get(kind, 0), value)

    steps = [(st, min(chunk, prompt - st)) for st in range(0, prompt, chunk)]
    n_prefill = len(steps)
    steps += [(prompt + i, 1) for i in range(max(new_tokens - 1, 0))]
    sample = SubPeak(tr.size(s.vocab * 4) + tr.size(8), {"sampling": tr.size(s.vocab * 4)})
    for i, (start, n) in enumerate(steps):
        decode = i >= n_prefill
        where = (f"decode step {i - n_prefill + 1} (position {start})" if decode else
                 f"prefill step {i + 1}/{n_prefill} (tokens {start}-{start + n - 1})")
        tr.label = where
        inp = -1
        if decode and graph_workspace and start == prompt:  # GraphDecoder: built, warmed up
            # (eager, on its stream: the workspace), captured; its buffers live to the end
            nb_max = (min(seq.working_set_bound(1), cdiv(prompt + new_tokens, bs))
                      if seq.window is not None else cdiv(prompt + new_tokens, bs))
            tr.alloc("cuda_graph", (2 + 2 * nb_max) * 8)  # static step inputs
            tr.alloc("cuda_graph", 8)  # static token
            tr.alloc("cuda_graph", graph_input_bytes)  # the embedded row (host table)
            tr.alloc("workspace.cublas_graph_stream", graph_workspace)
            samp = [tr.alloc("sampler", b) for b in sampler_bytes]
        if decode and not sampler_kept:  # sampler on the previous logits, then the token
            tr.bump(sample, where + ": sampling")
            inp = tr.alloc("step_tensors", 8)
        new_blocks = seq.append(n)
        if s.score_tensor and new_blocks:  # reset_scores: index tensor
            tr.bump(SubPeak(tr.size(8 * len(new_blocks))), where)
        kv_peak = max(kv_peak, (pool.live - pool.offloaded) * bpb + slot_bytes + summ_bytes)
        n_off = (seq._next_evict - cdiv(seq.sinks, bs)) if seq.retrieval else 0
        if decode and seq.retrieval and (n_off or graph_workspace):  # every layer's choice
            tr.bump(decode_page_choice(tr, s, max_pages, sparse.retrieval_pages,
                                       sparse.page_cache_pages), where + ": page choice")
        elif not decode and n_off > sparse.retrieval_pages:  # the chunk's queries, a layer
            tr.bump(page_scoring(tr, s, n, n_off, sparse.retrieval_pages),
                    where + ": page scoring")
        nb = visible_count(seq, start, n)
        ctx = [tr.alloc("step_tensors", n * 8), tr.alloc("step_tensors", nb * 8),
               tr.alloc("step_tensors", nb * 8), tr.alloc("step_tensors", n * 8)]
        ts = (sampled_queries(start, n, s.score_stride)
              if s.backend == "torch" and s.track_scores and s.score_stride > 1 else 0)
        a = AttnStep(t=n, nb=nb, ts=ts, globals_full=g_valid == s.G,
                     in_place=not s.cuda and s.backend == "torch" and blocks_in_order(seq, start, n))
        if a.key not in fwd_memo:
            fwd_memo[a.key] = forward_peak(s, a)
        fwd, kept = fwd_memo[a.key]
        note("decode_forward" if decode else "prefill_forward", fwd.peak)
        tr.bump(fwd, where + ": forward")
        ctx += [tr.alloc("step_tensors", b) for b in kept]  # the reference's mask memo
        new_logits = tr.alloc("logits", s.vocab * 4)
        evicted = seq.evict()
        if seq.retrieval and any(e.offloaded for e in evicted):  # summaries of the new pages
            no = sum(e.offloaded for e in evicted)
            keys = tr.size(s.layers * no * bs * s.hkv * s.d * s.kvb)
            # page_summary: the min or max (or the fp32 mean), its fp32 copy and quotient,
            # the INT8 values and scales (an upper estimate of the live set)
            one = lh * no
            summ = (tr.size(one * s.d * s.kvb) + 2 * tr.size(one * s.d * 4)
                    + n_summ * (tr.size(one * s.d) + 2 * tr.size(one * 4)))
            copy = 0  # the copy to the host store: one group's gather (RetrievalTier._copy_out)
            if not seq.offload_in_place:
                page_k = s.layers * bs * s.hkv * s.d * s.kvb
                copy = tr.size(min(no, copy_group_pages(page_k)) * page_k)
            tr.bump(SubPeak(keys + summ + copy), where + ": offload")
        if evicted and s.C:
            ne = len(evicted)
            fresh = sum(bs - min(bs, max(0, seq.sinks - e.start)) for e in evicted)
            c_valid = min(s.C, c_valid + fresh)
            if ne not in evict_memo:
                evict_memo[ne] = evict_peak(s, ne)
            note("evict", evict_memo[ne].peak)
            tr.bump(evict_memo[ne], where + ": eviction to candidate slots")
        if recal is not None and seq.recalibration_due(start, start + n):
            g_valid, c_valid = min(s.G, g_valid + c_valid), 0
            note("recalibrate", recal.peak)
            tr.bump(recal, where + ": recalibration")
        tr.free(*ctx, inp, logits)
        logits = new_logits
    if new_tokens and not sampler_kept:
        tr.bump(sample, "final sampling")
    if samp and not sampler_kept:
        tr.free(*samp)
    resident = tr.live_by_name()
    tr.free(ids)
    bound_seq = policy(sparse, model_window)
    kv = KVSummary(
        block_size=bs, bytes_per_block=bpb, window=seq.window, sinks=seq.sinks,
        sink_blocks=cdiv(seq.sinks, bs) if seq.window is not None else 0,
        span_blocks=cdiv(seq.window + chunk - 1, bs) + 1 if seq.window is not None else 0,
        working_set_bound_blocks=bound_seq.working_set_bound(chunk, prompt + new_tokens),
        peak_live_blocks=pool.peak_resident, kv_bytes_peak=kv_peak, capacity_blocks=cap,
        global_slots=s.G, candidate_slots=s.C)
    extra = {}
    if seq.retrieval:
        extra = {"offload_store_host_bytes": store_host, "page_summary_bytes": summ_bytes,
                 "page_cache_slots": P, "offloaded_pages": pool.offloaded if
                 seq.offload_in_place else seq._next_evict - cdiv(seq.sinks, bs),
                 "offload_in_place": seq.offload_in_place}
        extra["offload_bytes"] = extra["offloaded_pages"] * bpb
    seq.release()
    return RunTrace(peak=tr.peak, peak_live=tr.peak_live, peak_label=tr.peak_label,
                    phase_peaks=phase, resident_end=resident, kv=kv, prefill_steps=n_prefill,
                    decode_steps=len(steps) - n_prefill, extra=extra)
