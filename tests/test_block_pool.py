"""Block pool and host policy: property-based allocate/free sequences, working-set bound,
memory flat in document length, no leak after engine runs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_cli.engine import Engine, SparseConfig
from hisparse_cli.engine.block_pool import BlockPool
from hisparse_cli.engine.sparsity import SparseSequence
from hisparse_cli.errors import ResourceError


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 1000)), max_size=200),
       st.one_of(st.none(), st.integers(1, 40)))
def test_pool_invariants_under_random_ops(ops, cap):
    pool = BlockPool(cap)
    held: list[int] = []
    for is_alloc, pick in ops:
        if is_alloc:
            try:
                b = pool.allocate()
            except ResourceError:
                assert cap is not None and pool.capacity == cap and pool.num_free == 0
                continue
            assert b not in held
            held.append(b)
        elif held:
            pool.free(held.pop(pick % len(held)))
        assert pool.live == len(held)
        assert pool.live + pool.num_free == pool.capacity
        assert pool.allocated - pool.freed == pool.live
        assert pool.peak_live >= pool.live
        assert cap is None or pool.capacity <= cap
    for b in held:
        pool.free(b)
    assert pool.live == 0


def test_double_free_is_an_error():
    pool = BlockPool()
    b = pool.allocate()
    pool.free(b)
    with pytest.raises(ValueError):
        pool.free(b)


@settings(max_examples=60, deadline=None)
@given(sinks=st.integers(0, 20), window=st.integers(1, 80), block=st.sampled_from([1, 4, 8, 16]),
       chunk=st.integers(1, 40), n=st.integers(1, 600))
def test_host_policy_respects_bound_and_frees_everything(sinks, window, block, chunk, n):
    cfg = SparseConfig(sink_tokens=sinks, window_size=window, global_tokens=0, block_size=block,
                       prefill_chunk=chunk)
    pool = BlockPool()
    seq = SparseSequence(cfg, pool)
    bound = seq.working_set_bound(chunk)
    pos = 0
    while pos < n:
        step = min(chunk, n - pos)
        seq.append(step)
        ids, starts = seq.visible_blocks(pos, step)
        assert all(pool.is_live(b) for b in ids)
        assert starts == sorted(starts)
        assert pool.live <= bound
        seq.evict()
        pos += step
    seq.release()
    assert pool.live == 0 and pool.allocated == pool.freed


def test_pool_cap_fails_early_with_clear_message(tiny_models):
    path, _ = tiny_models["llama"]
    sparse = SparseConfig(sink_tokens=4, window_size=64, global_tokens=4, block_size=8, prefill_chunk=32)
    eng = Engine.from_pretrained(path, sparse=sparse, pool_cap_blocks=5)
    with pytest.raises(ResourceError, match="needs .* blocks but the pool is capped at 5"):
        eng.generate(list(range(200)), max_new_tokens=4)


def test_engine_peak_blocks_bounded_and_flat_in_length(tiny_models):
    path, _ = tiny_models["qwen3"]
    sparse = SparseConfig(sink_tokens=4, window_size=32, global_tokens=8, block_size=8,
                          recalibrate_every=16, recalibrate_topk=8, prefill_chunk=16)
    eng = Engine.from_pretrained(path, sparse=sparse)
    torch.manual_seed(0)
    short = torch.randint(0, 256, (150,))
    long = torch.randint(0, 256, (600,))
    r1 = eng.generate(short, max_new_tokens=8, eos_token_ids=())
    r2 = eng.generate(long, max_new_tokens=8, eos_token_ids=())
    bound = 1 + -(-(32 + 16 - 1) // 8) + 1  # sink block + window/chunk span + 1
    for r in (r1, r2):
        assert r.stats.blocks_allocated == r.stats.blocks_freed
        assert r.stats.kv_blocks_peak <= bound
        assert r.stats.recalibrations > 0
    assert r1.stats.kv_blocks_peak == r2.stats.kv_blocks_peak
    assert r1.stats.kv_bytes_peak == r2.stats.kv_bytes_peak
    dense = Engine.from_pretrained(path, sparse=SparseConfig.dense_config(block_size=8, prefill_chunk=16))
    rd = dense.generate(long, max_new_tokens=8, eos_token_ids=())
    assert rd.stats.kv_blocks_peak == -(-(600 + 7) // 8)  # dense grows with the text
    assert rd.stats.kv_bytes_peak > 3 * r2.stats.kv_bytes_peak


def test_logits_run_releases_all_blocks(tiny_models, monkeypatch):
    from hisparse_cli.engine import engine as engine_mod

    pools = []
    real = engine_mod.Engine.new_run

    def spy(self, total, chunk=None):
        run, pool = real(self, total, chunk)
        pools.append(pool)
        return run, pool

    monkeypatch.setattr(engine_mod.Engine, "new_run", spy)
    path, _ = tiny_models["mistral"]
    eng = Engine.from_pretrained(path, sparse=SparseConfig(window_size=16, block_size=4, prefill_chunk=8,
                                                           global_tokens=2, recalibrate_every=8))
    eng.logits(list(range(70)))
    assert pools and pools[0].live == 0 and pools[0].allocated == pools[0].freed > 0
