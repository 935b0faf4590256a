"""Sparse attention through the paged cache equals brute-force masked attention over the full
K/V history, with the mask built from the policy's own index sets (sinks, window, and the
globals the cache held at each step). Random Q/K/V drive one attention layer directly."""

from __future__ import annotations

import pytest
import torch

from hisparse_cli.engine.block_pool import BlockPool
from hisparse_cli.config.settings import SparseConfig
from hisparse_cli.engine.runner import KVRun
from hisparse_cli.kernels.dispatch import select_backend
from hisparse_cli.model.config import ModelConfig

HQ, HKV, D = 4, 2, 16


def _cfg(layers: int = 1) -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=8, hidden_size=HQ * D, intermediate_size=8,
                       num_hidden_layers=layers, num_attention_heads=HQ, num_key_value_heads=HKV,
                       head_dim=D, rms_norm_eps=1e-6, max_position_embeddings=10_000)


class RandomQKV:
    """Stands in for the model: feeds fixed random q/k/v per position into ctx.attend and
    records the outputs and the globals visible at each step."""

    def __init__(self, n: int, seed: int = 0, planted: dict[int, float] | None = None):
        g = torch.Generator().manual_seed(seed)
        self.q = torch.randn(n, HQ, D, generator=g)
        self.k = torch.randn(n, HKV, D, generator=g)
        self.v = torch.randn(n, HKV, D, generator=g)
        if planted:  # keys every query aligns with: they draw most attention
            direction = torch.randn(D, generator=g)
            self.q += direction
            for pos, strength in planted.items():
                self.k[pos] = strength * direction
        self.out = torch.zeros(n, HQ, D)
        self.globals_at: dict[int, torch.Tensor] = {}
        self.run: KVRun | None = None

    def __call__(self, input_ids, positions, ctx, all_logits=False):
        p = positions.tolist()
        for layer in range(self.run.cfg.num_hidden_layers):
            self.globals_at[p[0]] = self.run.global_positions(layer)
            self.out[p] = ctx.attend(layer, self.q[p], self.k[p], self.v[p])
        return torch.zeros(len(p), 8)


def brute_force(src: RandomQKV, q_pos: int, sinks: int, window: int | None, gpos: torch.Tensor):
    """Reference output for one query from the full history and an explicit allowed set."""
    out = torch.empty(HQ, D)
    grp = HQ // HKV
    for h in range(HQ):
        kv = h // grp
        allowed = set(range(q_pos + 1)) if window is None else \
            {k for k in range(q_pos + 1) if k < sinks or k > q_pos - window}
        g = {int(x) for x in gpos[kv].tolist() if x >= 0}
        assert not (g & allowed), "a global duplicates a visible key"
        assert all(sinks <= x <= q_pos - (window or 0) for x in g)
        idx = torch.tensor(sorted(allowed | g))
        s = (src.k[idx, kv] @ src.q[q_pos, h]) * D ** -0.5
        out[h] = torch.softmax(s, 0) @ src.v[idx, kv]
    return out


def drive(cfg: SparseConfig, n: int, chunk: int, src: RandomQKV, decode_from: int | None = None):
    pool = BlockPool()
    run = KVRun(_cfg(), cfg, torch.device("cpu"), torch.float32, select_backend("cpu"), pool,
                total_tokens=n, chunk=chunk)
    src.run = run
    with run:
        pos = 0
        while pos < n:
            step = 1 if decode_from is not None and pos >= decode_from else min(chunk, n - pos)
            step = min(step, n - pos)
            run.step(src, torch.zeros(step, dtype=torch.int64))
            pos += step
    assert pool.live == 0 and pool.allocated == pool.freed
    return run, pool


CASES = [  # sinks, window, globals, block, chunk, n, importance
    (4, 16, 4, 8, 8, 100, "attention"),
    (2, 3, 2, 8, 5, 70, "attention"),     # window smaller than a block
    (4, 64, 4, 8, 16, 40, "attention"),   # sequence shorter than the window
    (0, 10, 6, 4, 7, 90, "attention"),    # chunk not a multiple of the block, no sinks
    (3, 12, 0, 4, 5, 60, "attention"),    # no globals
    (4, 16, 5, 8, 11, 100, "uniform"),
    (0, None, 0, 8, 13, 50, "attention"),  # dense through the paged path
]


@pytest.mark.parametrize("sinks,window,globs,block,chunk,n,importance", CASES)
@pytest.mark.parametrize("decode", [False, True])
def test_sparse_attention_matches_brute_force(sinks, window, globs, block, chunk, n, importance, decode):
    cfg = SparseConfig(sink_tokens=sinks, window_size=window, global_tokens=globs, block_size=block,
                       recalibrate_every=8, recalibrate_topk=6, prefill_chunk=chunk, importance=importance,
                       score_stride=1)
    src = RandomQKV(n, seed=n + block)
    drive(cfg, n, chunk, src, decode_from=n // 2 if decode else None)
    step_starts = sorted(src.globals_at)
    for i, start in enumerate(step_starts):
        end = step_starts[i + 1] if i + 1 < len(step_starts) else n
        gpos = src.globals_at[start]
        for q in range(start, end):
            ref = brute_force(src, q, sinks if window is not None else 0, window, gpos)
            assert torch.allclose(src.out[q], ref, atol=1e-5), (q, (src.out[q] - ref).abs().max())
    if globs and window is not None and n > window + 2 * block + 8:
        final = src.globals_at[step_starts[-1]]
        assert (final >= 0).sum() > 0, "globals were never filled"


def test_planted_heavy_tokens_become_globals():
    """Tokens that draw most attention while in the window are kept after they leave it."""
    planted = {20: 3.0, 37: 3.0, 58: 3.0}
    n = 200
    cfg = SparseConfig(sink_tokens=4, window_size=16, global_tokens=4, block_size=8,
                       recalibrate_every=16, recalibrate_topk=8, prefill_chunk=8, score_stride=1)
    src = RandomQKV(n, seed=3, planted=planted)
    run, _ = drive(cfg, n, 8, src)
    final = src.globals_at[max(src.globals_at)]
    for kv in range(HKV):
        kept = set(final[kv].tolist())
        assert set(planted) <= kept, (kv, kept)
    # the baseline policy keeps evenly spaced tokens instead, not the planted ones
    src_u = RandomQKV(n, seed=3, planted=planted)
    drive(SparseConfig(**{**cfg.__dict__, "importance": "uniform"}), n, 8, src_u)
    kept_u = set(src_u.globals_at[max(src_u.globals_at)][0].tolist())
    assert not set(planted) <= kept_u


def test_recalibration_counts_and_no_growth():
    cfg = SparseConfig(sink_tokens=4, window_size=16, global_tokens=4, block_size=8,
                       recalibrate_every=32, recalibrate_topk=4, prefill_chunk=8)
    peaks = []
    for n in (256, 1024):
        src = RandomQKV(n, seed=1)
        run, pool = drive(cfg, n, 8, src)
        assert run.seq.recalibrations == n // 32
        assert pool.peak_live <= run.seq.working_set_bound(8)
        peaks.append((pool.peak_live, pool.capacity))
    assert peaks[0] == peaks[1]  # memory flat in length


@pytest.mark.parametrize("t", [5, 1])  # a prefill chunk, and a decode step (its own code path)
def test_importance_mass_equals_brute_force_probabilities(t):
    from hisparse_cli.kernels.attention.attention_ref import sparse_attention

    g = torch.Generator().manual_seed(5)
    bs, nb, q_start, sinks, window = 4, 6, 19 + 5 - t, 2, 9
    kc, vc = torch.randn(nb, bs, HKV, D, generator=g), torch.randn(nb, bs, HKV, D, generator=g)
    q = torch.randn(t, HQ, D, generator=g)
    gk, gv = torch.randn(HKV, 3, D, generator=g), torch.randn(HKV, 3, D, generator=g)
    gpos = torch.tensor([[1, -1, 3], [2, 3, -1]]) + torch.tensor([[0, 0, 0], [0, 0, 0]])
    ids = torch.tensor([5, 0, 3, 1, 4, 2])
    starts = torch.arange(nb) * bs
    out, km, gm = sparse_attention(q, kc, vc, ids, starts, q_start, sinks, window, D ** -0.5,
                                   g_k=gk, g_v=gv, g_pos=gpos, return_scores=True)
    exp_k, exp_g = torch.zeros(HKV, nb * bs), torch.zeros(HKV, 3)
    for i in range(t):
        qp = q_start + i
        for h in range(HQ):
            kv = h // (HQ // HKV)
            keys = [(j, kc[ids[j // bs], j % bs, kv]) for j in range(nb * bs)
                    if j <= qp and (j < sinks or j > qp - window)]
            keys += [(-1 - m, gk[kv, m]) for m in range(3) if gpos[kv, m] >= 0]
            s = torch.stack([kk @ q[i, h] for _, kk in keys]) * D ** -0.5
            p = torch.softmax(s, 0)
            for (j, _), pj in zip(keys, p):
                if j >= 0:
                    exp_k[kv, j] += pj
                else:
                    exp_g[kv, -1 - j] += pj
    assert torch.allclose(km, exp_k, atol=1e-5) and torch.allclose(gm, exp_g, atol=1e-5)
    assert torch.allclose(km.sum() + gm.sum(), torch.tensor(float(t * HQ)), atol=1e-4)
    # the strided estimate keeps the total mass and stays close per key
    _, km4, gm4 = sparse_attention(q, kc, vc, ids, starts, q_start, sinks, window, D ** -0.5,
                                   g_k=gk, g_v=gv, g_pos=gpos, return_scores=True, score_stride=2)
    assert km4.shape == km.shape and (km4.sum() + gm4.sum()).item() > 0


def test_planted_tokens_found_with_strided_scoring():
    planted = {20: 3.0, 37: 3.0, 58: 3.0}
    cfg = SparseConfig(sink_tokens=4, window_size=16, global_tokens=4, block_size=8,
                       recalibrate_every=16, recalibrate_topk=8, prefill_chunk=8, score_stride=4)
    src = RandomQKV(200, seed=3, planted=planted)
    drive(cfg, 200, 8, src)
    final = src.globals_at[max(src.globals_at)]
    assert all(set(planted) <= set(final[kv].tolist()) for kv in range(HKV))


@pytest.mark.parametrize("stride", [2, 3])
def test_strided_scoring_decode_steps_without_sampled_query(stride):
    cfg = SparseConfig(sink_tokens=2, window_size=12, global_tokens=3, block_size=4,
                       recalibrate_every=8, recalibrate_topk=4, prefill_chunk=5, score_stride=stride)
    src = RandomQKV(80, seed=9)
    drive(cfg, 80, 5, src, decode_from=20)  # decode steps at positions not multiple of stride
    final = src.globals_at[max(src.globals_at)]
    assert (final >= 0).all()


def test_snapkv_decode_step_counts_only_keys_far_enough_back():
    from hisparse_cli.kernels.attention.attention_ref import sparse_attention

    g = torch.Generator().manual_seed(2)
    bs, nb, q_start, m = 4, 5, 19, 6
    kc, vc = torch.randn(nb, bs, HKV, D, generator=g), torch.randn(nb, bs, HKV, D, generator=g)
    q = torch.randn(1, HQ, D, generator=g)
    ids, starts = torch.tensor([3, 0, 4, 1, 2]), torch.arange(nb) * bs
    args = (q, kc, vc, ids, starts, q_start, 0, 16, D ** -0.5)
    out, full, _ = sparse_attention(*args, return_scores=True)
    out_m, obs, _ = sparse_attention(*args, return_scores=True, score_min_distance=m)
    far = (q_start - torch.arange(nb * bs)) >= m
    assert torch.equal(out, out_m)
    assert torch.allclose(obs, full * far, atol=0) and (obs[:, ~far] == 0).all()
    assert (full[:, (torch.arange(nb * bs) <= q_start) & ~far] > 0).all()


def test_snapkv_counts_only_the_observation_window():
    """A key attended only by queries right after it (not by the late observation queries)
    loses to one attended by the late queries under snapkv, and wins under attention."""
    from hisparse_cli.kernels.attention.attention_ref import sparse_attention

    g = torch.Generator().manual_seed(0)
    bs, t, window = 4, 16, 16
    kc = torch.randn(4, bs, HKV, D, generator=g) * 0.01
    vc = torch.randn(4, bs, HKV, D, generator=g)
    q = torch.randn(t, HQ, D, generator=g) * 0.01
    a, b = torch.zeros(D), torch.zeros(D)
    a[0], b[1] = 8.0, 8.0
    kc[0, 1, :], kc[0, 2, :] = a, b  # key positions 1 and 2
    q[1:9, :] += a  # early queries look at key 1
    q[13:16, :] += b  # only the last 3 queries look at key 2
    ids, starts = torch.arange(4), torch.arange(4) * bs
    _, full, _ = sparse_attention(q, kc, vc, ids, starts, 0, 0, window, 1.0, return_scores=True)
    _, obs, _ = sparse_attention(q, kc, vc, ids, starts, 0, 0, window, 1.0, return_scores=True,
                                 score_min_distance=window - 4)
    assert (full[:, 1] > full[:, 2]).all()
    assert (obs[:, 2] > obs[:, 1]).all()


def test_probe_policy_keeps_what_the_scorer_ranks_highest():
    """importance='probe': globals are the evicted tokens the scorer ranked highest."""
    from hisparse_cli.engine.engine import Engine

    favourite = {30, 45, 61}

    class PositionProbe:  # a stand-in scorer: ranks tokens by their (known) position
        def __init__(self):
            self.pos = 0

        def __call__(self, layer, x):
            t = x.shape[0]
            pos = torch.arange(self.pos, self.pos + t)
            if layer == 1:
                self.pos += t
            return torch.tensor([[10.0 if int(p) in favourite else 0.0] * 1 for p in pos]).expand(t, 1)

    import tempfile
    from pathlib import Path

    from conftest import save_tiny

    path, _ = save_tiny(Path(tempfile.mkdtemp()), "mistral")  # 1 KV head
    cfg = SparseConfig(sink_tokens=2, window_size=8, global_tokens=3, block_size=4,
                       recalibrate_every=8, recalibrate_topk=3, prefill_chunk=4, importance="probe")
    eng = Engine.from_pretrained(path, sparse=cfg, probe=PositionProbe())
    run, pool = eng.new_run(100)
    with run:
        for s in range(0, 100, 4):
            run.step(eng.model, torch.arange(s, s + 4) % 200)
        for layer in range(2):
            assert set(run.global_positions(layer)[0].tolist()) == favourite
    assert pool.live == 0


@pytest.mark.parametrize("stride", [2, 3])
def test_strided_scores_follow_the_kernel_contract(stride):
    """The reference's strided estimate is the same estimator the Triton kernel implements
    (importance_triton.strided_mass_reference), so both backends pick the same globals."""
    pytest.importorskip("triton")
    from hisparse_cli.kernels.attention.attention_ref import sparse_attention
    from hisparse_cli.kernels.attention.importance_triton import strided_mass_reference

    g = torch.Generator().manual_seed(stride)
    bs, nb, t, q_start = 4, 7, 11, 17
    kc, vc = torch.randn(nb, bs, HKV, D, generator=g), torch.randn(nb, bs, HKV, D, generator=g)
    q = torch.randn(t, HQ, D, generator=g)
    gk, gv = torch.randn(HKV, 3, D, generator=g), torch.randn(HKV, 3, D, generator=g)
    gpos = torch.tensor([[1, -1, 0], [0, 1, 2]])
    ids, starts = torch.tensor([6, 0, 2, 1, 4, 3, 5]), torch.arange(nb) * bs
    args = (q, kc, vc, ids, starts, q_start, 2, 9, D ** -0.5)
    _, km, gm = sparse_attention(*args, g_k=gk, g_v=gv, g_pos=gpos, return_scores=True,
                                 score_stride=stride)
    rk, rg = strided_mass_reference(*args, g_k=gk, g_v=gv, g_pos=gpos, stride=stride)
    assert torch.allclose(km, rk, atol=1e-5) and torch.allclose(gm, rg, atol=1e-5)
