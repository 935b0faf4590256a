"""Torch reference of the paged sparse attention kernels (runs on any device; test oracle).

Layouts (shared with the Triton kernels):
    k_cache, v_cache: [num_blocks, block_size, Hkv, D]   paged storage of one layer
    slot_mapping:     [T] int64, physical slot (block * block_size + offset) of each new token
    block_ids:        [nb] int64, physical blocks the step may read, in position order
    block_starts:     [nb] int64, position of each block's first token
    g_k, g_v:         [Hkv, G, D] the layer's global tokens (per KV head); g_pos [Hkv, G] int64,
                      -1 for an empty slot. Globals are older than every live window.
Visibility: query position q sees key position k iff k <= q and (k < sinks or k > q - window)
(window None: k <= q), plus every valid global of its KV head. GQA: query head h reads KV head
h // (Hq // Hkv).
"""

from __future__ import annotations

import torch


def heads_view(cache: torch.Tensor) -> torch.Tensor | None:
    """[Hkv, nb * bs, D], a view, when a layer's storage [nb, bs, Hkv, D] is head-major in
    memory (engine/kv_cache.py allocates it so on the CPU: each KV head's keys one matrix);
    None for the interleaved layout (a contiguous [nb, bs, Hkv, D])."""
    hm = cache.permute(2, 0, 1, 3)
    if not hm.is_contiguous():
        return None
    return hm.view(hm.shape[0], -1, hm.shape[-1])


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write new K/V ([T, Hkv, D]) into their paged slots (either memory layout)."""
    nb, bs, hkv, d = k_cache.shape
    assert k.shape[1:] == (hkv, d) and v.shape == k.shape, (k.shape, k_cache.shape)
    assert slot_mapping.shape == (k.shape[0],)
    for cache, x in ((k_cache, k), (v_cache, v)):  # (no dispatched no-op cast: CPU decode)
        x = x if x.dtype == cache.dtype else x.to(cache.dtype)
        hm = heads_view(cache)
        if hm is not None:
            hm.index_copy_(1, slot_mapping, x.transpose(0, 1))
        else:
            cache.view(nb * bs, hkv, d).index_copy_(0, slot_mapping, x)


def visibility_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, sinks: int,
                    window: int | None) -> torch.Tensor:
    """[T, N] bool: which keys each query sees (without globals)."""
    causal = k_pos[None, :] <= q_pos[:, None]
    if window is None:
        return causal
    in_window = k_pos[None, :] > (q_pos[:, None] - window)
    return causal & ((k_pos[None, :] < sinks) | in_window)


def _step_keys(memo: dict | None, block_starts, bs, q_start, t, sinks, window, device):
    """Key positions and the additive visibility mask [T, N] of a step: the same for every
    layer, so computed once per step when the caller passes a memo dict."""
    if memo is not None and "mask" in memo:
        return memo["k_pos"], memo["q_pos"], memo["mask"]
    k_pos = (block_starts[:, None] + torch.arange(bs, device=device)[None, :]).reshape(-1)
    q_pos = q_start + torch.arange(t, device=device)
    vis = visibility_mask(q_pos, k_pos, sinks, window)
    mask = torch.zeros(vis.shape, device=device).masked_fill_(~vis, float("-inf"))
    if memo is not None:
        memo.update(k_pos=k_pos, q_pos=q_pos, mask=mask)
    return k_pos, q_pos, mask


def _block_run(block_ids: torch.Tensor, memo: dict | None) -> int | None:
    """The first id when the step's blocks are consecutive physical ids (a dense run's
    always are: its blocks are never freed; a sparse run's until blocks are reused), else
    None. Read on the host, once a step (memo), and only on the CPU: on CUDA it would cost a
    host sync per step."""
    if memo is not None and "block_run" in memo:
        return memo["block_run"]
    run = None
    if block_ids.device.type == "cpu":
        ids = block_ids.tolist()
        if ids == list(range(ids[0], ids[0] + len(ids))):
            run = ids[0]
    if memo is not None:
        memo["block_run"] = run
    return run


def _visible(cache: torch.Tensor, block_ids: torch.Tensor, memo: dict | None) -> torch.Tensor:
    """The step's keys (or values) of a layer's storage [nb, bs, Hkv, D] as [Hkv, N, D]:
    a view when the blocks are one run of consecutive ids (a dense 5K-token decode step read
    2 x 3.8 MB of copies per layer otherwise), else a gather (index_select, not
    cache[block_ids]: the same gather, 4x faster on the CPU). Head-major storage (the CPU's)
    gives each head's [N, D] contiguous; the interleaved one a strided view of it."""
    first = _block_run(block_ids, memo)
    nb = block_ids.shape[0]
    hkv, d = cache.shape[2], cache.shape[3]
    hm = cache.permute(2, 0, 1, 3)  # [Hkv, nb, bs, D]
    if hm.is_contiguous():
        blocks = hm[:, first:first + nb] if first is not None else hm.index_select(1, block_ids)
        return blocks.reshape(hkv, -1, d)
    blocks = cache[first:first + nb] if first is not None else cache.index_select(0, block_ids)
    return blocks.reshape(-1, hkv, d).transpose(0, 1)


def sparse_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    block_starts: torch.Tensor,
    q_start: int,
    sinks: int,
    window: int | None,
    scale: float,
    g_k: torch.Tensor | None = None,
    g_v: torch.Tensor | None = None,
    g_pos: torch.Tensor | None = None,
    return_scores: bool = False,
    score_stride: int = 1,
    score_min_distance: int = 0,
    memo: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Returns (out [T, Hq, D] in q's dtype, key_mass [Hkv, nb*bs] fp32 | None,
    global_mass [Hkv, G] fp32 | None): attention probability each key received, summed over
    the step's queries and the query heads of its KV head (the importance signal).

    score_stride s > 1 estimates the masses from the step's queries T-1, T-1-s, T-1-2s, ...,
    each key's sum scaled by (queries that see it) / (sampled queries that see it): the cost
    falls by s; s = 1 is exact, and so is every single-query (decode) step.
    score_min_distance m > 0 counts a window key's mass only from queries at least m positions
    after it (the "observation window" of SnapKV: the last window - m queries before eviction).
    memo: an optional dict shared by the layers of one step (caches the step's mask)."""
    t, hq, d = q.shape
    nb_total, bs, hkv, _ = k_cache.shape
    grp = hq // hkv
    assert hq % hkv == 0 and k_cache.shape[-1] == d and block_ids.shape == block_starts.shape
    if t == 1 and return_scores:  # a scored decode step: one softmax gives the output and
        # the masses (without scores, SDPA below is faster on long dense key sets)
        return _decode_attention(q, k_cache, v_cache, block_ids, block_starts, q_start, sinks,
                                 window, scale, g_k, g_v, g_pos, score_min_distance, memo)
    dt = torch.float32 if q.device.type == "cpu" else q.dtype
    # keys of the step: [Hkv, N, D], N = nb * bs
    k, v = (_visible(c, block_ids, memo).to(dt) for c in (k_cache, v_cache))
    k_pos, q_pos, mask = _step_keys(memo, block_starts, bs, q_start, t, sinks, window, q.device)
    n = k.shape[1]
    has_g = g_k is not None and g_k.shape[1] > 0
    if has_g:  # globals: an extra key segment per KV head
        k = torch.cat((k, g_k.to(dt)), dim=1)
        v = torch.cat((v, g_v.to(dt)), dim=1)
        g_ok = g_pos >= 0  # [Hkv, G]
        if bool(g_ok.all()):  # [T, N+G]: the same for every layer of the step (memo)
            mask = _memoized(memo, "mask_g", lambda: torch.cat(
                (mask, mask.new_zeros(t, g_ok.shape[1])), dim=-1))
        else:
            g_add = torch.zeros(g_ok.shape, device=q.device).masked_fill_(~g_ok, float("-inf"))
            mask = torch.cat((mask[None].expand(hkv, t, n), g_add[:, None, :].expand(hkv, t, -1)), -1)
            mask = mask.repeat_interleave(grp, dim=0)[None]  # [1, Hq, T, N+G]
    qh = q.to(dt).transpose(0, 1)  # [Hq, T, D]
    out = torch.nn.functional.scaled_dot_product_attention(
        qh[None], k[None], v[None], attn_mask=mask.to(dt), scale=scale, enable_gqa=grp > 1)[0]
    out = out.transpose(0, 1).to(q.dtype)  # [T, Hq, D]
    if not return_scores:
        return out, None, None
    # a [T, N(+G)] mask is the step's, shared by every layer: what follows from it alone (the
    # sampled rows, the snapkv distance filter, the per-key sampling ratio) is computed by the
    # step's first layer and kept in the memo; a per-head mask (globals not all filled) is not
    shared = memo if mask.dim() == 2 else None
    rows, ms, far_s, ratio = _memoized(shared, f"score_consts_{mask.shape[-1]}", lambda: _score_consts(
        mask, q_pos, k_pos, n, t, grp, score_stride, score_min_distance))
    qs = qh if rows is None else qh[:, rows]  # [Hq, Ts, D]
    ts = qs.shape[1]
    s = torch.bmm(qs.reshape(hkv, -1, d).float(), k.float().transpose(1, 2)) * scale  # [Hkv, grp*Ts, N(+G)]
    p = torch.softmax(s.view(hkv, grp, ts, -1) + ms, dim=-1)
    if far_s is not None:  # snapkv: only queries at least m positions after the key
        p = p * far_s
    p = p.sum(dim=(1, 2))  # [Hkv, N(+G)]
    if ratio is not None:  # scale each key by (queries that see it) / (sampled queries that see it)
        p = p * ratio
    return out, p[:, :n].contiguous(), (p[:, n:].contiguous() if has_g else None)


def _memoized(memo: dict | None, key: str, make):
    """memo[key], made by make() on first use; without a memo, make() every time."""
    if memo is None:
        return make()
    if key not in memo:
        memo[key] = make()
    return memo[key]


def _score_consts(mask, q_pos, k_pos, n, t, grp, score_stride, score_min_distance):
    """What the scoring of sparse_attention needs from the step's mask alone: (the sampled
    queries' indices or None when every query is scored; their mask, broadcastable to [Hkv, grp, Ts, N(+G)]; the snapkv distance filter of those
    queries or None; the per-key ratio (queries that see it) / (sampled queries that see it),
    [N(+G)] or [Hkv, N+G], or None when every query is scored). Sampled queries: T-1, T-1-s,
    T-1-2s, ... (the last query of a step is always scored)."""
    rows = torch.arange(t - 1, -1, -score_stride, device=mask.device) if score_stride > 1 else None
    ms = mask if rows is None else mask[..., rows, :]
    hkv = mask.shape[1] // grp if ms.dim() == 4 else 1
    ms = ms.reshape(hkv, grp, ms.shape[-2], -1) if ms.dim() == 4 else ms[None, None]
    vis = torch.isfinite(mask if mask.dim() == 2 else mask[0, ::grp])  # [T, N+G] or [Hkv, T, N+G]
    far_s = None
    if score_min_distance > 0:  # snapkv: only queries at least m positions after the key
        far = (q_pos[:, None] - k_pos[None, :]) >= score_min_distance  # [T, N]
        far = torch.cat((far, far.new_ones(t, vis.shape[-1] - n)), dim=-1)
        vis = vis & far
        far_s = far if rows is None else far[rows]
    ratio = None
    if rows is not None:
        n_vis = vis.sum(-2).float()
        n_smp = vis[..., rows, :].sum(-2).float()
        ratio = torch.where(n_smp > 0, n_vis / n_smp.clamp(min=1), torch.zeros_like(n_vis))
    return rows, ms, far_s, ratio


def _f32(t: torch.Tensor) -> torch.Tensor:
    """t in float32; an fp32 tensor is returned as is (skips a dispatched no-op cast: the
    one-token CPU decode path runs ~90 torch ops per layer, each a few microseconds)."""
    return t if t.dtype == torch.float32 else t.float()


def _storage_mask(memo: dict | None, mask: torch.Tensor, block_ids: torch.Tensor,
                  capacity: int, bs: int) -> torch.Tensor:
    """(the one query's additive mask [capacity * bs] over a layer's whole paged storage: the
    step's block-order mask [1, nb * bs] scattered to the visible blocks' slots, -inf in
    every other slot (freed or never used blocks); None, or with repeated block ids the list
    entries [1, nb * bs] that are themselves visible). The same for every layer (memo)."""
    if memo is not None and "storage_mask" in memo:
        return memo["storage_mask"], memo["list_ok"]
    smask = mask.new_full((capacity, bs), float("-inf"))
    ids = block_ids.tolist() if block_ids.device.type == "cpu" else None
    if ids is not None and len(set(ids)) == len(ids):
        smask = smask.index_copy_(0, block_ids, mask.view(-1, bs)).view(-1)
        list_ok = None
    else:  # a repeated id (the CUDA-graph decoder pads its list with its first block at an
        # unreachable start): a slot is visible if any entry makes it so, and the masses
        # picked back in list order are kept only where the entry itself is visible
        smask = smask.index_reduce_(0, block_ids, mask.view(-1, bs), "amax").view(-1)
        list_ok = mask.view(1, -1) == 0
    if memo is not None:
        memo["storage_mask"], memo["list_ok"] = smask, list_ok
    return smask, list_ok


def _decode_attention(q, k_cache, v_cache, block_ids, block_starts, q_start, sinks, window, scale,
                      g_k, g_v, g_pos, score_min_distance, memo):
    """sparse_attention for one scored query (T = 1), fp32 math: the probabilities are
    computed once and serve the output and the key masses (the general path runs SDPA, then
    re-scores); the paged keys and the globals are two key segments, never concatenated.

    The query attends over the layer's whole storage (`_storage_mask` hides every slot it
    does not see) read in place, not over a gather of its visible blocks: the storage is the
    run's working-set bound, a few blocks more than a sparse step's visible set, and the
    gather (two [nb * bs, Hkv, D] copies per layer and token) cost more than those extra
    keys (the storage is zero-initialised, so unused slots are finite). The key masses are
    then picked in block_ids order, the contract of the other paths."""
    _, hq, d = q.shape
    cap, bs, hkv, _ = k_cache.shape
    grp = hq // hkv
    k_pos, q_pos, mask = _step_keys(memo, block_starts, bs, q_start, 1, sinks, window, q.device)
    smask, list_ok = _storage_mask(memo, mask, block_ids, cap, bs)  # [cap * bs]
    qg = _f32(q[0].reshape(hkv, grp, d))  # [Hkv, grp, D]
    hk, hv = heads_view(k_cache), heads_view(v_cache)
    # [Hkv, D, cap * bs], a view (head-major: each head's keys one contiguous matrix)
    kt = _f32(hk.transpose(1, 2) if hk is not None else k_cache.view(-1, hkv, d).permute(1, 2, 0))
    n = kt.shape[-1]
    # scale * (q . k) + mask in one op each (baddbmm), for the paged keys and the globals
    s = torch.baddbmm(smask, qg, kt, alpha=scale)  # [Hkv, grp, N]
    has_g = g_k is not None and g_k.shape[1] > 0
    if has_g:
        g_add = torch.where(g_pos[:, None, :] < 0, float("-inf"), 0.0)  # [Hkv, 1, G] fp32
        sg = torch.baddbmm(g_add, qg, _f32(g_k).transpose(1, 2), alpha=scale)
        s = torch.cat((s, sg), dim=-1)  # [Hkv, grp, N + G]
    p = torch.softmax(s, dim=-1)
    # P.V: head-major storage is one batched matmul over each KV head's contiguous [N, D]
    # values; the interleaved layout is read once, in order, as the flat [N, Hkv * D]: every
    # query head against every KV head's values, [Hq, Hkv * D], of which the diagonal blocks
    # are the output (the per-head batched form over its strided [Hkv, N, D] view took
    # ~1.3-1.6x as long on a 2-core CPU; 3x the multiply-adds here are still tiny)
    if hv is not None:
        out = torch.bmm(p[..., :n], _f32(hv))  # [Hkv, grp, D]
    else:
        full = torch.mm(p[..., :n].reshape(hq, n), _f32(v_cache.view(-1, hkv * d)))
        out = full.view(hkv, grp, hkv, d).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    if has_g:
        out += torch.matmul(p[..., n:], _f32(g_v))
    out = out.reshape(1, hq, d)
    if out.dtype != q.dtype:
        out = out.to(q.dtype)
    p = p.sum(dim=1)  # [Hkv, N + G]: summed over the query heads of each KV head
    # the visible blocks' masses, in block_ids order: [Hkv, nb * bs]
    key_mass = p[:, :n].view(hkv, cap, bs).index_select(1, block_ids).view(hkv, -1)
    if list_ok is not None:
        key_mass = key_mass * list_ok
    if score_min_distance > 0:  # snapkv: count only keys at least m positions back
        key_mass = key_mass * ((q_pos[0] - k_pos) >= score_min_distance)
    return out, key_mass, (p[:, n:] if has_g else None)


def accumulate_scores(scores_into: tuple, block_ids: torch.Tensor, key_mass: torch.Tensor,
                      g_mass: torch.Tensor | None, n_queries: int) -> None:
    """Add one step's masses where a run keeps them (reference of `scores_into`):
    scores_into = (score [capacity, bs, Hkv] fp32, global_mass [Hkv, G], global_seen [Hkv, G]);
    key j of the step's list (key_mass [Hkv, nb * bs]) goes to score[block_ids[j // bs], j % bs],
    each global's mass to global_mass and the step's query count to global_seen."""
    score, gmass, gseen = scores_into
    nb, (_, bs, hkv) = block_ids.shape[0], score.shape
    score.index_add_(0, block_ids, key_mass.reshape(hkv, nb, bs).permute(1, 2, 0))
    if g_mass is not None:
        gmass.add_(g_mass)
        gseen.add_(n_queries)
