"""The torch reference's CPU fast paths (kernels/attention/attention_ref.py) vs an explicit gather and
softmax: the one scored query that reads the whole paged storage in place (masked slots of
freed, reused and never used blocks, unwritten slots of the last block, empty global slots)
and the SDPA path's in-place view of consecutive blocks."""

from __future__ import annotations

import pytest
import torch

from hisparse_cli.kernels.attention import attention_ref as ref

HQ, HKV, D, BS = 6, 2, 16, 4


def explicit(q, k_cache, v_cache, block_ids, block_starts, q_start, sinks, window, scale,
             g_k=None, g_v=None, g_pos=None, min_distance=0):
    """(out [T, Hq, D], key_mass [Hkv, nb*bs], global_mass [Hkv, G] | None) in float64 from
    a gather of the visible blocks and one softmax over (visible keys, valid globals)."""
    t, grp = q.shape[0], HQ // HKV
    k = k_cache[block_ids].reshape(-1, HKV, D).double()
    v = v_cache[block_ids].reshape(-1, HKV, D).double()
    k_pos = (block_starts[:, None] + torch.arange(BS)[None, :]).reshape(-1)
    q_pos = q_start + torch.arange(t)
    vis = ref.visibility_mask(q_pos, k_pos, sinks, window)  # [T, N]
    out = torch.zeros(t, HQ, D, dtype=torch.float64)
    key_mass = torch.zeros(HKV, k.shape[0], dtype=torch.float64)
    g_mass = torch.zeros(HKV, g_k.shape[1], dtype=torch.float64) if g_k is not None else None
    for h in range(HQ):
        kv = h // grp
        s = q[:, h].double() @ k[:, kv].T * scale  # [T, N]
        s = s.masked_fill(~vis, float("-inf"))
        if g_k is not None:
            sg = (q[:, h].double() @ g_k[kv].double().T * scale).masked_fill(g_pos[kv] < 0, float("-inf"))
            s = torch.cat((s, sg), dim=-1)
        p = torch.softmax(s, dim=-1)
        n = k.shape[0]
        out[:, h] = p[:, :n] @ v[:, kv] + (p[:, n:] @ g_v[kv].double() if g_k is not None else 0)
        far = (q_pos[:, None] - k_pos[None, :]) >= min_distance
        key_mass[kv] += (p[:, :n] * far).sum(0)
        if g_k is not None:
            g_mass[kv] += p[:, n:].sum(0)
    return out, key_mass, g_mass


def scattered_run(seed: int, capacity: int = 9):
    """A paged storage of random (finite) garbage whose visible blocks are scattered over it:
    sinks in block 0, the window in reused ids out of order; the others are freed or unused."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(capacity, BS, HKV, D, generator=g)
    v_cache = torch.randn(capacity, BS, HKV, D, generator=g)
    block_ids = torch.tensor([0, 6, 2, 7, 4])  # logical blocks 0, 5, 6, 7, 8
    block_starts = torch.tensor([0, 20, 24, 28, 32])
    q_start = 34  # the last block (positions 32-35) holds an unwritten slot
    return g, k_cache, v_cache, block_ids, block_starts, q_start


@pytest.mark.parametrize("globals_", ["none", "full", "some_empty"])
@pytest.mark.parametrize("min_distance", [0, 6])
def test_one_query_over_the_whole_storage_equals_the_gather(globals_, min_distance):
    g, k_cache, v_cache, block_ids, block_starts, q_start = scattered_run(1)
    sinks, window, scale = 3, 12, D ** -0.5
    q = torch.randn(1, HQ, D, generator=g)
    kw = {}
    if globals_ != "none":
        gpos = torch.tensor([[5, 9, 11], [4, 7, 16]])
        if globals_ == "some_empty":
            gpos[0, 1] = gpos[1, 0] = gpos[1, 2] = -1
        kw = dict(g_k=torch.randn(HKV, 3, D, generator=g), g_v=torch.randn(HKV, 3, D, generator=g),
                  g_pos=gpos)
    for memo in (None, {}):  # without a memo, and a step's first layer building it
        out, km, gm = ref.sparse_attention(q, k_cache, v_cache, block_ids, block_starts, q_start,
                                           sinks, window, scale, return_scores=True,
                                           score_min_distance=min_distance, memo=memo, **kw)
        want_out, want_km, want_gm = explicit(q, k_cache, v_cache, block_ids, block_starts, q_start,
                                              sinks, window, scale, min_distance=min_distance, **kw)
        assert out.shape == (1, HQ, D) and km.shape == (HKV, len(block_ids) * BS)
        torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(km.double(), want_km, rtol=1e-5, atol=1e-7)
        if globals_ == "none":
            assert gm is None
        else:
            torch.testing.assert_close(gm.double(), want_gm, rtol=1e-5, atol=1e-7)
            if globals_ == "some_empty":
                assert (gm[gpos < 0] == 0).all()


def test_block_run_view_only_for_consecutive_ids():
    assert ref._block_run(torch.tensor([3, 4, 5]), None) == 3
    assert ref._block_run(torch.tensor([3, 5, 4]), None) is None
    memo: dict = {}
    assert ref._block_run(torch.tensor([0]), memo) == 0 and memo["block_run"] == 0
    cache = torch.randn(6, BS, HKV, D)
    view = ref._visible(cache, torch.tensor([2, 3, 4]), None)  # [Hkv, N, D]
    assert view.data_ptr() == cache[2].data_ptr()
    assert torch.equal(view, cache[2:5].reshape(-1, HKV, D).transpose(0, 1))
    # head-major memory (the CPU engine's): each head's keys come back as one contiguous view
    mem = torch.randn(HKV, 6, BS, D)
    hm = mem.permute(1, 2, 0, 3)
    view = ref._visible(hm, torch.tensor([2, 3, 4]), None)
    assert view.stride()[1:] == (D, 1) and view.data_ptr() == mem[0, 2].data_ptr()
    assert torch.equal(view, hm[2:5].reshape(-1, HKV, D).transpose(0, 1))
    gathered = ref._visible(hm, torch.tensor([4, 1]), None)
    assert torch.equal(gathered, hm[[4, 1]].reshape(-1, HKV, D).transpose(0, 1))


@pytest.mark.parametrize("t", [1, 5])
def test_sdpa_path_on_consecutive_blocks_equals_the_gather(t):
    """Unscored steps (dense decode, prefill) over consecutive ids read the storage in place:
    the same SDPA inputs as the gather, so the same output bit for bit."""
    g = torch.Generator().manual_seed(2)
    k_cache, v_cache = torch.randn(8, BS, HKV, D, generator=g), torch.randn(8, BS, HKV, D, generator=g)
    q = torch.randn(t, HQ, D, generator=g)
    ids, starts = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 4, 8, 12])
    got, _, _ = ref.sparse_attention(q, k_cache, v_cache, ids, starts, 15 - t, 0, None, 0.25)
    # the same blocks copied to scattered ids: the gather path
    perm = torch.tensor([6, 0, 5, 2])
    k2, v2 = torch.randn_like(k_cache), torch.randn_like(v_cache)
    k2[perm], v2[perm] = k_cache[ids], v_cache[ids]
    want, _, _ = ref.sparse_attention(q, k2, v2, perm, starts, 15 - t, 0, None, 0.25)
    assert torch.equal(got, want)
    ex, _, _ = explicit(q, k_cache, v_cache, ids, starts, 15 - t, 0, None, 0.25)
    torch.testing.assert_close(got.double(), ex, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("globals_", ["none", "full", "some_empty"])
@pytest.mark.parametrize("min_distance", [0, 3])
@pytest.mark.parametrize("stride", [1, 3])
def test_layers_sharing_a_step_memo_equal_separate_calls(globals_, min_distance, stride):
    """A prefill step's layers share one memo: the mask with the globals' columns and the
    scoring constants (sampled rows, their mask, the snapkv filter, the per-key ratio) are
    made by the first layer. Every layer's output and masses equal a call without the memo,
    bit for bit; with every query scored, they equal the explicit gather."""
    g, k_cache, v_cache, block_ids, block_starts, _ = scattered_run(3)
    t, q_start, sinks, window, scale = 7, 29, 3, 12, D ** -0.5
    memo: dict = {}
    for layer in range(3):
        q = torch.randn(t, HQ, D, generator=g)
        kc, vc = torch.randn_like(k_cache), torch.randn_like(v_cache)
        kw = {}
        if globals_ != "none":
            gpos = torch.tensor([[5, 9, 11], [4, 7, 16]])
            if globals_ == "some_empty":
                gpos[layer % 2, 1] = -1
            kw = dict(g_k=torch.randn(HKV, 3, D, generator=g),
                      g_v=torch.randn(HKV, 3, D, generator=g), g_pos=gpos)
        args = (q, kc, vc, block_ids, block_starts, q_start, sinks, window, scale)
        opts = dict(return_scores=True, score_stride=stride, score_min_distance=min_distance, **kw)
        got = ref.sparse_attention(*args, memo=memo, **opts)
        want = ref.sparse_attention(*args, memo=None, **opts)
        for a, b in zip(got, want):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
        if stride == 1:
            ex = explicit(q, kc, vc, block_ids, block_starts, q_start, sinks, window, scale,
                          min_distance=min_distance, **kw)
            torch.testing.assert_close(got[0].double(), ex[0], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got[1].double(), ex[1], rtol=1e-5, atol=1e-6)
    assert ("mask_g" in memo) == (globals_ == "full")
    assert any(k.startswith("score_consts_") for k in memo) == (globals_ != "some_empty")


def _head_major_copy(cache: torch.Tensor) -> torch.Tensor:
    """The same [nb, bs, Hkv, D] values in head-major memory (engine/kv_cache.py, CPU)."""
    mem = cache.permute(2, 0, 1, 3).contiguous()
    return mem.permute(1, 2, 0, 3)


@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("scored", [False, True])
def test_head_major_storage_gives_the_interleaved_results(t, scored):
    """store_kv, then sparse_attention (the scored one-query path, the SDPA path and its
    re-scoring) on head-major storage: what the interleaved layout gives."""
    g = torch.Generator().manual_seed(7 + t)
    nb = 7
    k_std = torch.randn(nb, BS, HKV, D, generator=g)
    v_std = torch.randn(nb, BS, HKV, D, generator=g)
    k_hm, v_hm = _head_major_copy(k_std), _head_major_copy(v_std)
    assert ref.heads_view(k_hm) is not None and ref.heads_view(k_std) is None
    slots = torch.tensor([5, 17, 2][:t])
    k_new, v_new = torch.randn(t, HKV, D, generator=g), torch.randn(t, HKV, D, generator=g)
    ref.store_kv(k_std, v_std, k_new, v_new, slots)
    ref.store_kv(k_hm, v_hm, k_new, v_new, slots)
    assert torch.equal(k_hm, k_std) and torch.equal(v_hm, v_std)
    q = torch.randn(t, HQ, D, generator=g)
    g_k, g_v = torch.randn(HKV, 3, D, generator=g), torch.randn(HKV, 3, D, generator=g)
    g_pos = torch.tensor([[0, 1, -1], [2, -1, 3]])
    for ids in ([4, 1, 6, 3], [2, 3, 4, 5]):  # a gather, then a run of consecutive blocks
        block_ids = torch.tensor(ids)
        starts = torch.tensor([8, 12, 16, 20])
        args = (block_ids, starts, 22 - t + 1, 2, 9, D ** -0.5, g_k, g_v, g_pos, scored)
        want = ref.sparse_attention(q, k_std, v_std, *args)
        got = ref.sparse_attention(q, k_hm, v_hm, *args)
        for w, x in zip(want, got):
            if w is None:
                assert x is None
            else:
                torch.testing.assert_close(x, w, rtol=1e-5, atol=1e-6)
