"""Importance scoring kernels: key_mass / global_mass of one attention step (return_scores).

Definition (kernels/attention/attention_ref.py:sparse_attention): mass[kvh, j] = sum over the step's
queries t and the query heads g of KV head kvh of softmax probability p[t, g, j]. Both kernels
need the row log-sum-exp that the attention kernel writes (lse2, log2 domain, [Hkv, T*GRP]).

- `_mass_from_logits` (exact, small T): the attention kernel also stored every visited logit
  s2 into a [Hkv, T*GRP, G + nb*bs] fp32 workspace; mass = sum_rows 2^(s2 - lse2). Costs one
  pass over T*GRP*(G+N)*4 bytes, used when T*GRP <= 16 (decode), instead of re-reading K.
  With split keys, `_attn_reduce_mass` runs it together with the split reduce (one launch;
  the lse then comes from the forward's last split program, attention_fwd_triton LSE_TAIL).
- `_mass_recompute` (prefill): one program per (key tile, KV head) loads its K tile once and
  recomputes q.k for a strided subset of the step's queries, t = T-1, T-1-r, T-1-2r, ...
  (r = score_stride; r = 1 is exact). Each key's sum is scaled by n_vis / n_sampled, where
  n_vis is the exact number of the step's queries that see it (visibility rule) and n_sampled
  those among the sampled ones: a ratio estimator, exact when r = 1, unbiased-ish for keys
  seen by many queries (every in-window key during a long prefill), and 0 for a key that no
  sampled query sees (only possible for keys newer than the last sampled query when
  window < r). Cost ~ 1/(2r) of the attention's matmul work. `strided_mass_reference`
  below is its torch oracle (tests/test_attention_kernels.py also measures its error vs exact).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hisparse_cli.kernels.attention.attention_fwd_triton import _reduce_row
from hisparse_cli.kernels.attention.attention_ref import visibility_mask
from hisparse_cli.kernels.pdl import enter as pdl_enter


@triton.jit
def _column_info(cols, bstart_ptr, gpos_ptr, kvh, n_keys, G, stride_ph, BS: tl.constexpr):
    """Column c < G is global c of kvh; column c >= G is list key j = c - G."""
    is_g = cols < G
    kj = cols - G
    in_list = (cols >= G) & (kj < n_keys)
    kj = tl.where(in_list, kj, 0)
    kpos = (tl.load(bstart_ptr + kj // BS, mask=in_list, other=0) + kj % BS).to(tl.int32)
    gp = tl.load(gpos_ptr + kvh * stride_ph + cols, mask=is_g, other=-1)
    return is_g & (gp >= 0), in_list, kj, kpos


@triton.jit
def _visible(g_ok, in_list, kpos, qpos, row_ok, sinks, window, WINDOWED: tl.constexpr):
    vis = in_list[None, :] & (kpos[None, :] <= qpos[:, None])
    if WINDOWED:
        vis = vis & ((kpos[None, :] < sinks) | (kpos[None, :] > qpos[:, None] - window))
    return row_ok[:, None] & (vis | g_ok[None, :])


@triton.jit
def _store_mass(mass, cols, g_ok, in_list, kj, bid_ptr, kmass_ptr, gmass_ptr, gseen_ptr, kvh,
                n_keys, G, T, stride_sb, stride_so, BS: tl.constexpr, HAS_G: tl.constexpr,
                ACCUM: tl.constexpr):
    """Write the masses (key_mass [Hkv, n_keys], global_mass [Hkv, G]), or with ACCUM add them
    where the run keeps them: each list key's mass into its slot's score (kmass_ptr = the
    layer's score [capacity, BS, Hkv]: the key's block id, offset, head), each global's into
    gmass, and T (the step's queries) into gseen. One program owns each column, and a block
    id appears once among a list's visible entries, so the read-add-write is race-free; the
    adds are the fp32 adds of `attention_ref.accumulate_scores` (the reference)."""
    if ACCUM:
        # only non-zero masses: adding 0 changes nothing, and a list may repeat a block id
        # whose extra entries no query sees (the CUDA-graph decoder pads its list with its
        # first block at an unreachable start position): their exact-0 columns must not
        # race the real column's read-add-write of the same slot
        add = in_list & (mass != 0.0)
        bid = tl.load(bid_ptr + kj // BS, mask=add, other=0)
        sp = kmass_ptr + bid * stride_sb + (kj % BS) * stride_so + kvh
        tl.store(sp, tl.load(sp, mask=add, other=0.0) + mass, mask=add)
    else:
        tl.store(kmass_ptr + kvh * n_keys + kj, mass, mask=in_list)
    if HAS_G:
        gm = cols < G
        g_add = tl.where(g_ok, mass, 0.0)
        if ACCUM:
            gp = gmass_ptr + kvh * G + cols
            tl.store(gp, tl.load(gp, mask=gm, other=0.0) + g_add, mask=gm)
            sp2 = gseen_ptr + kvh * G + cols
            tl.store(sp2, tl.load(sp2, mask=gm, other=0.0) + T, mask=gm)
        else:
            tl.store(gmass_ptr + kvh * G + cols, g_add, mask=gm)


@triton.jit
def _logits_mass(s_ptr, lse, rows, row_ok, cols, g_ok, in_list, kpos, kvh, q_start, sinks,
                 window, stride_sh, stride_sr, GRP: tl.constexpr, WINDOWED: tl.constexpr):
    """sum over the rows [BLOCK_R] of 2^(s2 - lse2) for the columns [BLOCK_N]: the stored
    logits of the visible (row, column) pairs, lse [BLOCK_R] the rows' log-sum-exp."""
    vis = _visible(g_ok, in_list, kpos, q_start + rows // GRP, row_ok, sinks, window, WINDOWED)
    s = tl.load(s_ptr + kvh * stride_sh + rows[:, None] * stride_sr + cols[None, :],
                mask=vis, other=float("-inf"))
    return tl.sum(tl.math.exp2(s - lse[:, None]), 0)


@triton.jit(do_not_specialize=["T", "n_keys", "G", "q_start", "sinks", "window"])
def _mass_from_logits(
    s_ptr, lse_ptr, bid_ptr, bstart_ptr, gpos_ptr, kmass_ptr, gmass_ptr, gseen_ptr,
    T, n_keys, G, q_start, sinks, window, stride_sh, stride_sr, stride_ph, stride_sb, stride_so,
    qs_ptr,
    GRP: tl.constexpr, BS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOWED: tl.constexpr, HAS_G: tl.constexpr, QS_PTR: tl.constexpr, ACCUM: tl.constexpr,
    PDL_WAIT: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = False,
):
    pdl_enter(PDL_WAIT, PDL_TRIGGER)  # kernels/pdl.py: the next (PDL) kernel may start
    if QS_PTR:
        q_start = tl.load(qs_ptr).to(tl.int32)
    kvh = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g_ok, in_list, kj, kpos = _column_info(cols, bstart_ptr, gpos_ptr, kvh, n_keys, G,
                                           stride_ph, BS)
    n_rows = T * GRP
    mass = tl.zeros([BLOCK_N], tl.float32)
    for r0 in range(0, n_rows, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_ok = rows < n_rows
        lse = tl.load(lse_ptr + kvh * n_rows + rows, mask=row_ok, other=0.0)
        mass += _logits_mass(s_ptr, lse, rows, row_ok, cols, g_ok, in_list, kpos, kvh, q_start,
                             sinks, window, stride_sh, stride_sr, GRP, WINDOWED)
    _store_mass(mass, cols, g_ok, in_list, kj, bid_ptr, kmass_ptr, gmass_ptr, gseen_ptr, kvh,
                n_keys, G, T, stride_sb, stride_so, BS, HAS_G, ACCUM)


@triton.jit(do_not_specialize=["T", "n_keys", "G", "q_start", "sinks", "window", "n_split"])
def _attn_reduce_mass(
    m_ws, l_ws, acc_ws, out_ptr, lse_ptr, s_ptr, bid_ptr, bstart_ptr, gpos_ptr, kmass_ptr, gmass_ptr,
    gseen_ptr, T, n_keys, G, q_start, sinks, window, n_split, stride_ot, stride_oh, stride_sh,
    stride_sr, stride_ph, stride_sb, stride_so, qs_ptr,
    HKV: tl.constexpr, GRP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    SPLIT_P2: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOWED: tl.constexpr, HAS_G: tl.constexpr, QS_PTR: tl.constexpr, ACCUM: tl.constexpr,
    PDL_WAIT: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = False,
):
    """The split reduce and `_mass_from_logits` of a decode step in one launch (T * GRP <=
    BLOCK_R rows, split keys, stored logits): programs (r < T * GRP, kvh) combine row r's
    partials into the output (attention_fwd_triton._reduce_row); programs (T * GRP + c, kvh)
    the mass of column tile c from the rows' log-sum-exp, which the forward's last split
    program wrote (its LSE_TAIL). Neither kind waits for the other, and the chain has one
    kernel fewer a layer: the o projection waited for the reduce, then for the mass kernel
    behind it. (H200 run 52: computing the lse in every mass program from the partials
    instead was slower than two launches: a [SPLIT_P2, BLOCK_R] reduction per program.)"""
    pdl_enter(PDL_WAIT, PDL_TRIGGER)  # kernels/pdl.py
    n_rows = T * GRP
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    if pid < n_rows:
        _reduce_row(m_ws, l_ws, acc_ws, out_ptr, out_ptr, pid, kvh, n_rows, n_split, stride_ot,
                    stride_oh, HKV, GRP, D, SPLIT_P2, False)
    else:
        if QS_PTR:
            q_start = tl.load(qs_ptr).to(tl.int32)
        cols = (pid - n_rows) * BLOCK_N + tl.arange(0, BLOCK_N)
        g_ok, in_list, kj, kpos = _column_info(cols, bstart_ptr, gpos_ptr, kvh, n_keys, G,
                                               stride_ph, BS)
        rows = tl.arange(0, BLOCK_R)
        row_ok = rows < n_rows
        lse = tl.load(lse_ptr + kvh * n_rows + rows, mask=row_ok, other=0.0)
        mass = _logits_mass(s_ptr, lse, rows, row_ok, cols, g_ok, in_list, kpos, kvh, q_start,
                            sinks, window, stride_sh, stride_sr, GRP, WINDOWED)
        _store_mass(mass, cols, g_ok, in_list, kj, bid_ptr, kmass_ptr, gmass_ptr, gseen_ptr,
                    kvh, n_keys, G, T, stride_sb, stride_so, BS, HAS_G, ACCUM)


@triton.jit(do_not_specialize=["T", "n_keys", "G", "q_start", "sinks", "window", "stride"])
def _mass_recompute(
    q_ptr, k_ptr, bid_ptr, bstart_ptr, gk_ptr, gpos_ptr, lse_ptr, kmass_ptr, gmass_ptr,
    gseen_ptr, T, n_keys, G, q_start, sinks, window, qk_scale, stride,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_gh, stride_gg, stride_ph,
    stride_sb, stride_so, qs_ptr,
    GRP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr, HAS_G: tl.constexpr, UPCAST: tl.constexpr,
    QS_PTR: tl.constexpr, ACCUM: tl.constexpr,
):
    if QS_PTR:
        q_start = tl.load(qs_ptr).to(tl.int32)
    kvh = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g_ok, in_list, kj, kpos = _column_info(cols, bstart_ptr, gpos_ptr, kvh, n_keys, G,
                                           stride_ph, BS)
    offs_d = tl.arange(0, D)
    bid = tl.load(bid_ptr + kj // BS, mask=in_list, other=0)
    k_list = k_ptr + (bid * stride_kb + (kj % BS) * stride_ks + kvh * stride_kh)[:, None]
    gc = tl.where(cols < G, cols, 0)
    k_glob = gk_ptr + (kvh * stride_gh + gc * stride_gg)[:, None]
    k_row = tl.where(in_list[:, None], k_list, k_glob)
    k = tl.load(k_row + offs_d[None, :], mask=(in_list | (cols < G))[:, None], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)

    # queries that may see this tile: t in [t_min, t_max] (globals and sinks: every query)
    any_g = tl.sum(g_ok.to(tl.int32), 0) > 0
    p_min = tl.min(tl.where(in_list, kpos, 2147483647), 0)
    p_max = tl.max(tl.where(in_list, kpos, -1), 0)
    t_min = tl.where(any_g, 0, tl.maximum(p_min - q_start, 0))
    t_max = T - 1
    if WINDOWED:
        any_sink = tl.sum((in_list & (kpos < sinks)).to(tl.int32), 0) > 0
        lim = tl.minimum(p_max + window - 1 - q_start, T - 1)
        t_max = tl.where(any_g | any_sink, T - 1, lim)
    # sampled query i is t = T-1 - i*stride; keep those with t_min <= t <= t_max
    i_lo = tl.cdiv(tl.maximum(T - 1 - t_max, 0), stride)
    i_hi = tl.where(t_max >= t_min, (T - 1 - t_min) // stride + 1, i_lo)

    mass = tl.zeros([BLOCK_N], tl.float32)
    seen = tl.zeros([BLOCK_N], tl.float32)
    offs_m = tl.arange(0, BLOCK_M)
    for r0 in range(i_lo * GRP, i_hi * GRP, BLOCK_M):
        u = r0 + offs_m
        row_ok = u < i_hi * GRP
        t = T - 1 - (u // GRP) * stride
        t = tl.where(row_ok, t, 0)
        g = u % GRP
        q = tl.load(q_ptr + t[:, None] * stride_qt + (kvh * GRP + g)[:, None] * stride_qh
                    + offs_d[None, :], mask=row_ok[:, None], other=0.0).to(k_ptr.dtype.element_ty)
        if UPCAST:
            q = q.to(tl.float32)
        lse = tl.load(lse_ptr + kvh * (T * GRP) + t * GRP + g, mask=row_ok, other=0.0)
        vis = _visible(g_ok, in_list, kpos, q_start + t, row_ok, sinks, window, WINDOWED)
        if UPCAST:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        else:
            s = tl.dot(q, tl.trans(k)) * qk_scale
        p = tl.where(vis, tl.math.exp2(s - lse[:, None]), 0.0)
        mass += tl.sum(p, 0)
        seen += tl.sum(vis.to(tl.float32), 0)

    # ratio estimator: scale by (queries that see the key) / (sampled queries that saw it)
    lo = tl.maximum(kpos - q_start, 0)
    hi = T - 1 + kpos * 0
    if WINDOWED:
        hi = tl.where(kpos < sinks, hi, tl.minimum(hi, kpos + window - 1 - q_start))
    n_vis = tl.where(g_ok, T, tl.where(in_list, tl.maximum(hi - lo + 1, 0), 0)).to(tl.float32)
    ratio = tl.where(seen > 0, n_vis * GRP / tl.maximum(seen, 1.0), 0.0)
    mass = tl.where(stride > 1, mass * ratio, mass)
    _store_mass(mass, cols, g_ok, in_list, kj, bid_ptr, kmass_ptr, gmass_ptr, gseen_ptr, kvh,
                n_keys, G, T, stride_sb, stride_so, BS, HAS_G, ACCUM)


def strided_mass_reference(q, k_cache, v_cache, block_ids, block_starts, q_start, sinks, window,
                           scale, g_k=None, g_v=None, g_pos=None, stride: int = 1):
    """Torch oracle of `_mass_recompute`: exact probabilities (full softmax), summed over the
    sampled queries t = T-1-i*stride and the group's heads, scaled per key by n_vis/n_sampled.
    Returns (key_mass [Hkv, nb*bs], global_mass [Hkv, G] | None), fp32."""
    t_len, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    grp = hq // hkv
    k = k_cache[block_ids].reshape(-1, hkv, d).permute(1, 0, 2).float()
    k_pos = (block_starts[:, None] + torch.arange(bs, device=q.device)[None, :]).reshape(-1)
    q_pos = q_start + torch.arange(t_len, device=q.device)
    mask = visibility_mask(q_pos, k_pos, sinks, window)  # [T, N]
    qf = q.float().reshape(t_len, hkv, grp, d).permute(1, 2, 0, 3)  # [Hkv, grp, T, D]
    s = torch.matmul(qf, k.transpose(1, 2)[:, None]) * scale
    s = s.masked_fill(~mask, float("-inf"))
    n = s.shape[-1]
    has_g = g_k is not None and g_k.shape[1] > 0
    if has_g:
        sg = torch.matmul(qf, g_k.float().transpose(1, 2)[:, None]) * scale
        sg = sg.masked_fill((g_pos < 0)[:, None, None, :], float("-inf"))
        s = torch.cat((s, sg), dim=-1)
    p = torch.softmax(s, dim=-1)  # [Hkv, grp, T, N (+G)]
    sampled = torch.zeros(t_len, dtype=torch.bool, device=q.device)
    sampled[torch.arange(t_len - 1, -1, -stride, device=q.device)] = True
    mass = p[:, :, sampled].sum(dim=(1, 2))  # [Hkv, N (+G)]
    n_vis = mask.sum(0).float()
    n_smp = mask[sampled].sum(0).float()
    if has_g:
        valid = (g_pos >= 0).float()
        n_vis = torch.cat((n_vis.expand(hkv, -1), valid * t_len), dim=1)
        n_smp = torch.cat((n_smp.expand(hkv, -1), valid * int(sampled.sum())), dim=1)
    ratio = torch.where(n_smp > 0, n_vis / n_smp.clamp(min=1), torch.zeros_like(n_vis))
    mass = mass * ratio if stride > 1 else mass
    return mass[:, :n], (mass[:, n:] if has_g else None)
