"""The retrieval tier (engine/retrieval.py): attention over sinks ∪ window ∪ globals ∪ retrieved
pages equals brute-force attention over exactly that set; a budget covering every page is dense
attention; a planted long-range key is attended after eviction with retrieval and not without;
offloaded pages round-trip bit-exactly (in place and copied). The page cache's LRU:
tests/test_page_cache_kernels.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hisparse_cli.config.settings import SparseConfig
from hisparse_cli.engine.block_pool import BlockPool
from hisparse_cli.engine.runner import KVRun
from hisparse_cli.errors import ConfigError
from hisparse_cli.kernels.attention.page_score_ref import quantize_summary
from hisparse_cli.kernels.dispatch import select_backend

from test_sparse_attention import HKV, HQ, D, RandomQKV, _cfg


class Recording(RandomQKV):
    """RandomQKV that also records, per step and layer, what the page cache showed."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen: dict[int, tuple] = {}  # step start -> (gpos, retrieved pos, window, n)
        self.chose: dict[int, bool] = {}  # step start -> the tier chose its pages this step

    def __call__(self, input_ids, positions, ctx, all_logits=False):
        p = positions.tolist()
        run = self.run
        for layer in range(run.cfg.num_hidden_layers):
            self.out[p] = ctx.attend(layer, self.q[p], self.k[p], self.v[p])
            tier = run.retrieval
            rpos = tier.positions(layer).clone() if tier is not None and tier.offloaded else None
            self.seen[p[0]] = (run.global_positions(layer), rpos, ctx.window, len(p))
            if tier is not None:
                self.chose[p[0]] = tier.choose
        return torch.zeros(len(p), 8)


def drive(cfg: SparseConfig, n: int, src: RandomQKV, decode_from: int | None = None,
          copy_offload: bool = False):
    pool = BlockPool()
    run = KVRun(_cfg(), cfg, torch.device("cpu"), torch.float32, select_backend("cpu"), pool,
                total_tokens=n, chunk=cfg.prefill_chunk, copy_offload=copy_offload)
    src.run = run
    with run:
        pos = 0
        while pos < n:
            if pos == decode_from and run.retrieval is not None:
                run.retrieval.mark_decode()  # as Engine.generate does where decode starts
            decoding = decode_from is not None and pos >= decode_from
            step = 1 if decoding else min(cfg.prefill_chunk, (decode_from or n) - pos)
            step = min(step, n - pos)
            run.step(src, torch.zeros(step, dtype=torch.int64))
            pos += step
        stats = run.retrieval.stats if run.retrieval is not None else None
    assert pool.live == 0 and pool.allocated == pool.freed
    return run, stats


def brute_force(src, q_pos: int, sinks: int, first: int, gpos, rpos):
    """One query's output over an explicit key set: sinks, the step's window blocks (from
    position `first` on, causal), globals, retrieved pages."""
    out = torch.empty(HQ, D)
    grp = HQ // HKV
    for h in range(HQ):
        kv = h // grp
        allowed = {k for k in range(q_pos + 1) if k < sinks or k >= first}
        g = {int(x) for x in gpos[kv].tolist() if x >= 0}
        r = {int(x) for x in rpos[kv].tolist() if x >= 0} if rpos is not None else set()
        assert not (r & g) and not (r & allowed) and not (g & allowed), "a key counted twice"
        idx = torch.tensor(sorted(allowed | g | r))
        s = (src.k[idx, kv] @ src.q[q_pos, h]) * D ** -0.5
        out[h] = torch.softmax(s, 0) @ src.v[idx, kv]
    return out


def dense(src, q_pos: int):
    grp = HQ // HKV
    out = torch.empty(HQ, D)
    for h in range(HQ):
        s = (src.k[:q_pos + 1, h // grp] @ src.q[q_pos, h]) * D ** -0.5
        out[h] = torch.softmax(s, 0) @ src.v[:q_pos + 1, h // grp]
    return out


def _check_steps(src, run, n):
    starts = sorted(src.seen)
    for i, start in enumerate(starts):
        gpos, rpos, window, steps = src.seen[start]
        end = starts[i + 1] if i + 1 < len(starts) else n
        first = start + steps - window  # the step's first window block
        assert first % run.sparse.block_size == 0 or first <= run.seq.sinks
        for q in range(start, end):
            ref = brute_force(src, q, run.seq.sinks, first, gpos, rpos)
            assert torch.allclose(src.out[q], ref, atol=1e-5), (q, (src.out[q] - ref).abs().max())


CASES = [  # sinks, window, globals, block, chunk, n, retrieval_tokens, cache tokens, summary
    (4, 16, 4, 8, 8, 120, 16, 0, "minmax"),
    (2, 24, 0, 4, 5, 90, 12, 24, "minmax"),  # no globals, a bigger page cache, odd chunk
    (0, 16, 6, 8, 16, 130, 24, 0, "mean"),
    (4, 16, 4, 8, 8, 100, 8, 16, "minmax"),
]


@pytest.mark.parametrize("sinks,window,globs,block,chunk,n,rt,ct,kind", CASES)
@pytest.mark.parametrize("decode,every", [(False, 1), (True, 1), (True, 3)])
@pytest.mark.parametrize("copy_offload", [False, True])
def test_retrieval_matches_brute_force(sinks, window, globs, block, chunk, n, rt, ct, kind,
                                       decode, every, copy_offload):
    """every 3: decode steps that keep the last choice attend to exactly its pages (their
    recorded positions), never to a key a global or the window also holds."""
    cfg = SparseConfig(sink_tokens=sinks, window_size=window, global_tokens=globs,
                       block_size=block, recalibrate_every=8, recalibrate_topk=globs,
                       prefill_chunk=chunk, score_stride=1, retrieval_tokens=rt,
                       page_cache_tokens=ct, retrieval_summary=kind, retrieval_every=every)
    src = Recording(n, seed=n + block)
    run, stats = drive(cfg, n, src, decode_from=n // 2 if decode else None,
                       copy_offload=copy_offload)
    _check_steps(src, run, n)
    assert stats.pages_offloaded > 0 and stats.pages_retrieved > 0
    assert stats.hits + stats.misses == stats.pages_retrieved
    picked = [r for _, r, _, _ in src.seen.values() if r is not None]
    assert all(int((r >= 0).sum()) <= HKV * rt for r in picked)  # within the budget


@pytest.mark.parametrize("decode,every", [(False, 1), (True, 1), (True, 4)])
@pytest.mark.parametrize("copy_offload", [False, True])
def test_budget_covering_every_page_is_dense(decode, every, copy_offload):
    """every 4: a kept choice is dense too, because a page offloaded since the last choice
    makes the next step choose (else it would be missing until then)."""
    n = 150
    cfg = SparseConfig(sink_tokens=4, window_size=16, global_tokens=4, block_size=8,
                       recalibrate_every=8, recalibrate_topk=4, prefill_chunk=12,
                       retrieval_tokens=n, retrieval_every=every)
    src = Recording(n, seed=5)
    drive(cfg, n, src, decode_from=n // 2 if decode else None, copy_offload=copy_offload)
    for q in range(n):
        assert torch.allclose(src.out[q], dense(src, q), atol=1e-5), q


@pytest.mark.parametrize("every", [2, 5])
def test_decode_keeps_a_choice_for_every_steps(every, monkeypatch):
    """The rule (engine/retrieval.py): prefill steps choose; decode steps choose on the first
    one, `every` steps after the last choice, and at once after an offload or a recalibration;
    the others show the last choice's positions unchanged and count no picks."""
    n, start = 200, 96
    cfg = SparseConfig(sink_tokens=4, window_size=16, global_tokens=4, block_size=8,
                       recalibrate_every=32, recalibrate_topk=4, prefill_chunk=16,
                       score_stride=1, retrieval_tokens=16, page_cache_tokens=24,
                       retrieval_every=every)
    src = Recording(n, seed=11)
    offloaded, recal, picks = {}, {}, {}
    step = KVRun.step

    def spy(self, model, ids):  # what the tier had before each step, and the picks it made
        p0 = self.seq.num_tokens
        offloaded[p0] = len(self.retrieval.offloaded)
        recal[p0] = self.seq.recalibrations
        before = int(self.retrieval.counts[0])
        out = step(self, model, ids)
        picks[p0] = int(self.retrieval.counts[0]) - before
        return out

    monkeypatch.setattr(KVRun, "step", spy)
    drive(cfg, n, src, decode_from=start)
    assert all(src.chose[p] for p in src.chose if p < start)  # prefill always chooses
    last, kept_steps = None, 0
    for p in range(start, n):
        if p not in src.chose:  # (no page offloaded yet: nothing to retrieve)
            continue
        want = (last is None or p - last >= every or offloaded[p] != offloaded[last]
                or recal[p] != recal[last])
        assert src.chose[p] == want, p
        if want:
            last = p
            assert picks[p] > 0
        else:
            kept_steps += 1
            assert picks[p] == 0
            assert torch.equal(src.seen[p][1], src.seen[last][1])  # the same positions shown
    assert kept_steps > 0


def _planted_run(retrieval_tokens: int, asked_from: int = 219, every: int = 4):
    """One key planted early (position 30) that the queries from `asked_from` on look for
    (the decode queries before it look away from it); decode from position 220 (the last
    prompt token, 219, asks already: a question at the end of a prompt)."""
    n = 240
    g = torch.Generator().manual_seed(11)
    src = Recording(n, seed=2)
    src.q *= 0.2
    src.k *= 0.2
    fact = torch.randn(D, generator=g)
    src.k[30] = 4.0 * fact
    src.q[220:asked_from] = -4.0 * fact
    src.q[asked_from:] = 4.0 * fact
    src.v[30] = 10.0
    cfg = SparseConfig(sink_tokens=4, window_size=32, global_tokens=0, block_size=8,
                       recalibrate_topk=0, prefill_chunk=16, retrieval_tokens=retrieval_tokens,
                       retrieval_every=every)
    run, _ = drive(cfg, n, src, decode_from=n - 20)
    return src


def test_planted_fact_is_attended_after_eviction_only_with_retrieval():
    with_r, without = _planted_run(16), _planted_run(0)
    grp = HQ // HKV
    for q in range(220, 240):  # the fact left the window long ago
        p_fact = []
        for src in (with_r, without):
            s = (src.k[:q + 1, 0] @ src.q[q, 0]) * D ** -0.5
            p_fact.append(float(torch.softmax(s, 0)[30]))
        assert p_fact[0] > 0.5  # dense attention finds it
        # with retrieval the value of the fact dominates the output; without, it is gone
        assert float(with_r.out[q, :grp].mean()) > 5.0, q
        assert float(without.out[q, :grp].mean()) < 1.0, q


def test_prefill_scores_pages_from_pooled_queries(monkeypatch):
    """A prefill chunk's page scoring gets the mean query of every QUERY_POOL consecutive
    positions of the chunk (engine/retrieval.py), per query head, not the raw queries."""
    from hisparse_cli.engine import retrieval

    seen = []
    backend_cls = type(select_backend("cpu"))
    original = backend_cls.score_top_pages

    def record(self, q, lo, hi, k, scale):
        seen.append(q.clone())
        return original(self, q, lo, hi, k, scale)

    monkeypatch.setattr(backend_cls, "score_top_pages", record)
    chunk, n = 10, 120
    cfg = SparseConfig(sink_tokens=4, window_size=16, global_tokens=0, block_size=8,
                       recalibrate_topk=0, prefill_chunk=chunk,
                       retrieval_tokens=8)
    src = Recording(n, seed=5)
    drive(cfg, n, src)
    assert seen and retrieval.QUERY_POOL == 4
    layers = _cfg().num_hidden_layers
    starts = [s for s in range(0, n, chunk) for _ in range(layers)][-len(seen):]
    for q, start in zip(seen, starts):  # groups of 4, 4 and the 2 left over
        want = torch.stack([src.q[a:b].mean(dim=0) for a, b in
                            ((start, start + 4), (start + 4, start + 8), (start + 8, start + 10))])
        assert q.shape == (3, HQ, D) and torch.allclose(q, want, atol=1e-6)


def test_decode_choice_uses_the_previous_steps_queries():
    """A decode step's pages are chosen, before its forward, from the queries of the step
    before it (engine/retrieval.py): with a choice every step, the fact asked for first at
    decode position 226 is attended from position 227 on, not at 226 itself."""
    src = _planted_run(16, asked_from=226, every=1)
    grp = HQ // HKV
    assert float(src.out[226, :grp].mean()) < 1.0
    for q in range(227, 240):
        assert float(src.out[q, :grp].mean()) > 5.0, q


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_offloaded_pages_round_trip_bit_exactly(dtype, monkeypatch):
    """Every offloaded page, read back through the store, is its tokens' K/V bit for bit; the
    copy out runs in groups of at most 2 pages here (COPY_GROUP_BYTES), so a step's 3 evicted
    pages take two groups: each group's gather (its temporary) holds at most 2 pages of K or
    V, and a step's copy gathers ceil(pages / 2) times for K and as often for V."""
    from hisparse_cli.engine import retrieval_sizes

    class Gathers(TorchDispatchMode):  # the row counts of the copy's gathers
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.index_select.default:
                self.rows.append(out.shape[0])
            return out

    n = 100
    for copy_offload in (False, True):
        cfg = SparseConfig(sink_tokens=4, window_size=16, global_tokens=0, block_size=8,
                           recalibrate_topk=0, prefill_chunk=24, retrieval_tokens=16,
                           retrieval_summary="minmax")
        pool = BlockPool()
        run = KVRun(_cfg(), cfg, torch.device("cpu"), dtype, select_backend("cpu"), pool,
                    total_tokens=n, copy_offload=copy_offload)
        src = Recording(n, seed=1)
        src.k, src.v = src.k.to(dtype), src.v.to(dtype)
        src.q, src.out = src.q.to(dtype), src.out.to(dtype)
        src.run = run
        with run:
            monkeypatch.setattr(retrieval_sizes, "COPY_GROUP_BYTES", run.retrieval.page_bytes())
            tier, copies = run.retrieval, []
            copy_out = tier._copy_out

            def recorded(ids, pages):
                with Gathers() as seen:
                    copy_out(ids, pages)
                copies.append((len(pages), seen.rows))

            monkeypatch.setattr(tier, "_copy_out", recorded)
            for s in range(0, n, 24):
                run.step(src, torch.zeros(min(24, n - s), dtype=torch.int64))
            assert bool(copies) == copy_offload
            for pages, rows in copies:
                groups = [min(2, pages - g) for g in range(0, pages, 2)]
                assert rows == groups + groups, (pages, rows)  # K's groups, then V's
            assert any(pages > 2 for pages, _ in copies) == copy_offload
            assert tier.offloaded == list(range(1, len(tier.offloaded) + 1))
            assert (tier.store_k is None) == (not copy_offload)
            for p in tier.offloaded:
                for got, ref in zip(tier.stored_page(0, p), (src.k, src.v)):
                    want = ref[p * 8:(p + 1) * 8].transpose(0, 1)  # [Hkv, bs, D]
                    assert torch.equal(got, want), (p, copy_offload)
                keys = src.k[p * 8:(p + 1) * 8].transpose(0, 1)  # summaries of the same bits
                for table, want in ((tier.lo, quantize_summary(keys.amin(1), "down")),
                                    (tier.hi, quantize_summary(keys.amax(1), "up"))):
                    assert torch.equal(table.values[0, :, p], want.values)
                    assert torch.equal(table.scale[0, :, p], want.scale)


def test_settings_validation():
    with pytest.raises(ConfigError, match="page_cache_tokens"):
        SparseConfig(retrieval_tokens=64, page_cache_tokens=32)
    with pytest.raises(ConfigError, match="retrieval_summary"):
        SparseConfig(retrieval_summary="max")
    c = SparseConfig(block_size=16, retrieval_tokens=40, page_cache_tokens=100)
    assert (c.retrieval_pages, c.page_cache_pages) == (3, 7)
    assert not SparseConfig.dense_config().retrieval


def test_engine_logits_with_full_budget_equal_dense(tiny_models):
    """The tiny random Llama through Engine.logits: the retrieval tier with a budget covering
    every page gives dense attention's logits; a small budget does not (the test can fail)."""
    from hisparse_cli.engine.engine import Engine

    path, _ = tiny_models["llama"]
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    eng = Engine.from_pretrained(path, sparse=SparseConfig.dense_config(block_size=8,
                                                                         prefill_chunk=32))
    want = eng.logits(ids)
    base = dict(sink_tokens=4, window_size=32, global_tokens=8, block_size=8,
                recalibrate_topk=8, recalibrate_every=32, prefill_chunk=32)
    eng.sparse = SparseConfig(**base, retrieval_tokens=300)
    full = eng.logits(ids)
    assert torch.allclose(full, want, atol=1e-4, rtol=1e-4), (full - want).abs().max()
    eng.sparse = SparseConfig(**base)
    evict_only = eng.logits(ids)
    assert (evict_only - want).abs().max() > 1e-2


@pytest.mark.parametrize("summary", ["mean", "minmax"])
def test_planner_bytes_equal_a_cpu_run(tiny_models, summary):
    """The planner's KV numbers with the retrieval tier == the CPU run's: resident KV peak and
    blocks (RunStats), offloaded bytes, and every byte of the run's KV allocations (storage for
    every block with offload in place, segment slots, candidates, scores, page summaries)."""
    from hisparse_cli.engine.engine import Engine
    from hisparse_cli.model.config import ModelConfig
    from hisparse_cli.planner.memory import plan_memory

    path, _ = tiny_models["llama"]
    sparse = SparseConfig(sink_tokens=4, window_size=32, global_tokens=8, block_size=8,
                          recalibrate_topk=8, recalibrate_every=32, prefill_chunk=32,
                          retrieval_tokens=24, page_cache_tokens=40, retrieval_summary=summary)
    prompt, new = 200, 6
    eng = Engine.from_pretrained(path, sparse=sparse)
    res = eng.generate(list(range(1, prompt + 1)), max_new_tokens=new, min_new_tokens=new)
    plan = plan_memory(ModelConfig.from_folder(path), weight_format="fp32", sparse=sparse,
                       context_tokens=prompt, max_new_tokens=new, kv_dtype=torch.float32,
                       compute_dtype=torch.float32, device_kind="cpu", backend="torch")
    assert res.stats.kv_bytes_peak == plan.kv.kv_bytes_peak
    assert res.stats.kv_blocks_peak == plan.kv.peak_live_blocks
    assert res.stats.pages_offloaded > 0
    items = {i.name: i.bytes for i in plan.items}
    assert items["offload_store (host RAM)"] == 0 and plan.offload_store_bytes == 0
    run, _ = eng.new_run(prompt + new)
    with run:
        c, t = run.cache, run.retrieval
        tensors = [c.k, c.v, c.score, c.sk, c.sv, c.spos, c.smass, c.sseen, c.ck, c.cv, c.cpos,
                   c.cmass, c.cseen, *t.lo, t.row_of_page, t.range, t.slot_page, t.slot_used,
                   t.step, t.counts, t.step_base, t.pick_ids, t.last_q] + (
            [*t.hi] if summary == "minmax" else [])
        allocated = sum(x.untyped_storage().nbytes() for x in tensors)
    planned = sum(items.get(n, 0) for n in ("kv.paged_kv", "kv.importance_scores",
                                             "kv.global_and_page_cache_slots",
                                             "kv.candidate_slots", "kv.page_summaries",
                                             "kv.page_cache_state"))
    assert allocated == planned
    # the offloaded pages at the end: the planner's replay and the run's store agree
    assert res.stats.offload_bytes == plan.offload_bytes > 0


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cuda_full_budget_equals_dense_and_store_round_trips(tiny_models, backend):
    """On CUDA: pages copied to pinned host memory on the side stream, gathered back into the
    page-cache slots; a budget covering every page gives the dense logits (fp16 tolerance)
    and every stored page equals its tokens' K/V bit for bit."""
    from hisparse_cli.engine.engine import Engine

    path, _ = tiny_models["llama"]
    ids = torch.randint(0, 256, (400,), generator=torch.Generator().manual_seed(0)).tolist()
    eng = Engine.from_pretrained(path, device="cuda", dtype=torch.float16, backend=backend,
                                 sparse=SparseConfig.dense_config(block_size=16,
                                                                  prefill_chunk=64))
    want = eng.logits(ids)
    base = dict(sink_tokens=4, window_size=64, global_tokens=8, block_size=16,
                recalibrate_topk=8, recalibrate_every=64, prefill_chunk=64)
    eng.sparse = SparseConfig(**base, retrieval_tokens=400, page_cache_tokens=512)
    got = eng.logits(ids)
    assert (got - want).abs().max() < 5e-2, (got - want).abs().max()
    x = torch.tensor(ids, device="cuda")
    eng.sparse = SparseConfig.dense_config(block_size=16, prefill_chunk=64)
    dense_run, _ = eng.new_run(len(ids))  # blocks minted in order: physical = logical
    with dense_run:
        for s in range(0, len(ids), 64):
            dense_run.step(eng.model, x[s:s + 64])
        k0 = dense_run.cache.k[0].clone()  # layer 0's keys depend on the tokens only
    eng.sparse = SparseConfig(**base, retrieval_tokens=64)
    run, _ = eng.new_run(len(ids))
    with run:
        for s in range(0, len(ids), 64):
            run.step(eng.model, x[s:s + 64])
        torch.cuda.synchronize()
        tier = run.retrieval
        assert not tier.in_place and tier.store_k.is_pinned() and tier.offloaded
        for p in tier.offloaded:  # [Hkv, bs, D] stored == [bs, Hkv, D] computed, bit for bit
            assert torch.equal(tier.stored_page(0, p)[0].cuda(), k0[p].transpose(0, 1)), p
    res = eng.generate(ids, max_new_tokens=8, min_new_tokens=8)
    assert res.stats.bytes_to_cache > 0 and res.stats.pages_offloaded > 0
    # Triton attention decodes in the CUDA graph (the page cache filled inside it), torch eagerly
    assert ("cuda_graph" in res.extra) == (backend == "triton"), res.extra


def test_keep_queries_rotates_the_raw_queries_at_the_position():
    """The persistent kernel's step leaves each layer's q before RoPE (fp32 sums); the tier
    keeps them rotated at the step's position: q cos + rotate_half(q) sin (the oracle written
    out here), in the cache's dtype."""
    from hisparse_cli.kernels.norm_rope.norm_rope_ref import rope_tables
    from hisparse_cli.model.rope import RotaryEmbedding

    cfg = SparseConfig(sink_tokens=4, window_size=16, global_tokens=0, block_size=8,
                       recalibrate_topk=0, prefill_chunk=8, retrieval_tokens=16)
    mcfg = _cfg()
    run = KVRun(mcfg, cfg, torch.device("cpu"), torch.float32, select_backend("cpu"),
                BlockPool(), total_tokens=64)
    with run:
        tier = run.retrieval
        L = mcfg.num_hidden_layers
        raw = torch.randn(L, HQ, D, generator=torch.Generator().manual_seed(3))
        rope = RotaryEmbedding(mcfg, torch.device("cpu"))
        pos = torch.tensor([37])
        cos, sin = rope.cos_sin(pos, torch.float32)
        tier.keep_queries(raw, *rope_tables(cos, sin))
        half = D // 2
        rot = torch.cat((-raw[..., half:], raw[..., :half]), dim=-1)
        want = raw * cos[0] + rot * sin[0]
        assert tier.last_q.shape == (L, HQ, D)
        assert torch.allclose(tier.last_q, want, atol=1e-6)
