"""PagedKVCache: storage allocated once at the run's working-set bound (never grown, the pool
cannot hand out an id past it), and the slot selections (eviction into candidates,
recalibration of globals) against a brute-force oracle that concatenates every candidate's
K/V and gathers the winners."""

from __future__ import annotations

import pytest
import torch

from hisparse_cli.engine import Engine, SparseConfig
from hisparse_cli.engine.block_pool import BlockPool
from hisparse_cli.engine.kv_cache import NEG_INF, PagedKVCache
from hisparse_cli.engine.runner import KVRun
from hisparse_cli.engine.sparsity import SparseSequence, cdiv
from hisparse_cli.kernels.dispatch import select_backend
from hisparse_cli.model.config import ModelConfig


# -- oracle: every candidate's K/V concatenated, the winners gathered -------------------------
def _oracle_select(cache, k, v, pos, mass, seen, n):
    pr = cache._priority(pos, mass, seen)
    top = torch.topk(pr, n, dim=-1, sorted=False)
    idx = top.indices
    g = idx[..., None].expand(-1, -1, -1, cache.D)
    return (k.gather(2, g), v.gather(2, g),
            pos.gather(-1, idx).masked_fill(top.values == NEG_INF, -1),
            mass.gather(-1, idx), seen.gather(-1, idx))


def oracle_evict(cache, physical, starts):
    L, H, D, bs = cache.L, cache.H, cache.D, cache.bs
    ids = torch.tensor(physical)
    n = len(physical) * bs
    k = cache.k[:, ids].reshape(L, n, H, D).transpose(1, 2)
    v = cache.v[:, ids].reshape(L, n, H, D).transpose(1, 2)
    pos = (torch.tensor(starts)[:, None] + torch.arange(bs)[None, :]).reshape(-1)
    pos = pos.masked_fill(pos < cache.sinks, -1)[None, None, :].expand(L, H, -1)
    mass = (cache.score[:, ids].reshape(L, n, H).transpose(1, 2) if cache.score is not None
            else torch.zeros(pos.shape))
    seen = torch.full(pos.shape, float(cache.queries_per_candidate))
    cat = [torch.cat(p, dim=2) for p in ((cache.ck, k), (cache.cv, v), (cache.cpos, pos),
                                         (cache.cmass, mass), (cache.cseen, seen))]
    return _oracle_select(cache, *cat, n=cache.C)


def oracle_recalibrate(cache):
    cat = [torch.cat(p, dim=2) for p in ((cache.gk, cache.ck), (cache.gv, cache.cv),
                                         (cache.gpos, cache.cpos), (cache.gmass, cache.cmass),
                                         (cache.gseen, cache.cseen))]
    return _oracle_select(cache, *cat, n=cache.G)


def random_cache(seed, *, G, C, importance="attention", scores=True, capacity=9, bs=4,
                 L=3, H=2, D=8, sinks=3):
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(num_layers=L, num_kv_heads=H, head_dim=D, block_size=bs,
                         dtype=torch.float32, device=torch.device("cpu"), capacity_blocks=capacity,
                         global_tokens=G, candidate_slots=C, track_scores=scores,
                         importance=importance, sinks=sinks, queries_per_candidate=5.0)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    if scores:
        cache.score.copy_(torch.rand(cache.score.shape, generator=g))
    for pos, mass, seen, k, v in ((cache.gpos, cache.gmass, cache.gseen, cache.gk, cache.gv),
                                  (cache.cpos, cache.cmass, cache.cseen, cache.ck, cache.cv)):
        # some slots filled (positions >= 0), some empty (-1)
        pos.copy_(torch.randint(-1, 200, pos.shape, generator=g))
        mass.copy_(torch.rand(mass.shape, generator=g) * 3)
        seen.copy_(torch.randint(1, 9, seen.shape, generator=g).float())
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    return cache


SLOTS = lambda c, pre: tuple(getattr(c, pre + x) for x in ("k", "v", "pos", "mass", "seen"))  # noqa: E731


@pytest.mark.parametrize("importance", ["attention", "uniform"])
@pytest.mark.parametrize("G,C,scores", [(4, 5, True), (6, 3, True), (2, 7, False), (5, 1, True)])
def test_eviction_and_recalibration_equal_the_concatenating_oracle(importance, G, C, scores):
    for seed in range(4):
        cache = random_cache(seed, G=G, C=C, importance=importance, scores=scores)
        physical, starts = [7, 2, 5][: 1 + seed % 3], [0, 12, 40][: 1 + seed % 3]
        expect = oracle_evict(cache, physical, starts)
        ptrs = [t.data_ptr() for t in SLOTS(cache, "c")]
        cache.evict_to_candidates(physical, starts)
        for got, want in zip(SLOTS(cache, "c"), expect):
            assert torch.equal(got, want)
        assert [t.data_ptr() for t in SLOTS(cache, "c")] == ptrs  # in place (graph-safe)
        expect = oracle_recalibrate(cache)
        cache.recalibrate()
        for got, want in zip(SLOTS(cache, "g"), expect):
            assert torch.equal(got, want)
        assert (cache.cpos == -1).all()


def test_recalibration_without_candidate_slots_keeps_the_globals():
    cache = random_cache(1, G=4, C=0)
    expect = oracle_recalibrate(cache)
    cache.recalibrate()
    for got, want in zip(SLOTS(cache, "g"), expect):
        assert torch.equal(got, want)


# -- storage: allocated once at the bound --------------------------------------------------------
def _run(sparse, total, chunk=None):
    cfg = ModelConfig.from_dict({"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                                 "intermediate_size": 64, "num_hidden_layers": 2,
                                 "num_attention_heads": 2, "num_key_value_heads": 1})
    pool = BlockPool()
    return KVRun(cfg, sparse, torch.device("cpu"), torch.float32, select_backend("cpu"), pool,
                 total_tokens=total, chunk=chunk), pool


@pytest.mark.parametrize("total,expect", [(10_000, 1 + 6 + 1), (30, 2), (1, 1)])
def test_storage_is_the_bound_or_what_a_short_text_can_use(total, expect):
    """window 64, chunk 32, 16-token blocks, 4 sinks: 1 sink block + cdiv(95, 16) = 6 + 1;
    a 30-token run can use 2 blocks, a 1-token run 1."""
    sp = SparseConfig(window_size=64, sink_tokens=4, prefill_chunk=32, block_size=16)
    run, pool = _run(sp, total)
    assert run.cache.capacity == pool.storage_blocks == expect
    assert run.cache.k.shape[1] == run.cache.v.shape[1] == expect
    assert run.cache.k.abs().sum() == 0  # zero-initialised: masked-out slots are read
    dense, _ = _run(SparseConfig.dense_config(block_size=16, prefill_chunk=32), 200)
    assert dense.cache.capacity == cdiv(200, 16)  # dense: every position, allocated once


def test_pool_cannot_hand_out_an_id_past_the_storage():
    pool = BlockPool()
    pool.bind_storage(2)
    pool.allocate(), pool.allocate()
    with pytest.raises(RuntimeError, match="past the KV storage allocated once for 2 blocks"):
        pool.allocate()
    pool.free(1)
    assert pool.allocate() == 1  # reuse stays fine
    with pytest.raises(ValueError):
        pool.bind_storage(1)
    # a run sized for 8-token steps that is driven with a longer step fails loudly
    sp = SparseConfig(window_size=16, sink_tokens=0, prefill_chunk=8, block_size=4,
                      global_tokens=0)
    run, pool = _run(sp, 1000)
    assert run.cache.capacity == SparseSequence(sp, BlockPool()).working_set_bound(8) == 7
    with run, pytest.raises(RuntimeError, match="past the KV storage"):
        run.seq.append(40)


def test_generate_never_reallocates_the_storage(tiny_models, monkeypatch):
    path, _ = tiny_models["qwen3"]
    sparse = SparseConfig(sink_tokens=4, window_size=32, global_tokens=8, block_size=8,
                          recalibrate_every=16, recalibrate_topk=8, prefill_chunk=16)
    eng = Engine.from_pretrained(path, sparse=sparse)
    seen = []
    real_step = KVRun.step

    def step(self, model, ids, all_logits=False):
        seen.append((self.cache.k.data_ptr(), self.cache.v.data_ptr(), self.cache.capacity,
                     self.pool.capacity))
        return real_step(self, model, ids, all_logits)

    monkeypatch.setattr(KVRun, "step", step)
    res = eng.generate([i % 256 for i in range(1, 301)], max_new_tokens=6, min_new_tokens=6)
    bound = 1 + cdiv(32 + 16 - 1, 8) + 1
    assert len({s[:3] for s in seen}) == 1 and seen[0][2] == bound  # one storage, at the bound
    assert all(pool_cap <= bound for *_, pool_cap in seen)
    assert res.stats.kv_blocks_peak <= bound
