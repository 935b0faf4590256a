"""Triton forward kernel of paged sparse attention (prefill chunks and decode, one kernel).

Torch reference: kernels/attention/attention_ref.py:sparse_attention (same layouts, same visibility rule).
Public entry: kernels/attention/attention_triton.py. Versions: v1 flash-style online softmax over
{globals ∪ sinks ∪ window}, GQA rows, optional split along the keys (flash-decoding) with a
reduce kernel, optional logits side-output for exact small-T importance scoring; v2 one
pipelined loop per segment kind (a pointer select between the globals and the cache broke
16-byte vectorization and spilled), unmasked loop for fully visible prefill tiles.

Tiling. A program owns BLOCK_M "rows" of one KV head: row r = t * GRP + g (query t, query
head kvh * GRP + g), so the query heads that share a KV head are processed together and every
K/V tile is loaded once for all of them. Keys are read through the block list in BLOCK_N
tiles: key j of the list sits in physical block block_ids[j // BS] at offset j % BS and has
position block_starts[j // BS] + j % BS (no dense mask, positions derived per tile).
The visible part of the list for the program's query range [q_lo, q_hi] is two index ranges,
found by counting block_starts entries (the list is in position order):
    A = [0, min(n_sink_blocks, n_before_window) * BS)       blocks holding sink positions
    B = [n_before_window * BS, n_not_after_q_hi * BS)        blocks overlapping the window
Blocks outside A ∪ B are never touched; the exact rule is applied per element inside tiles.
The scan costs a few dependent loads, so it runs only with SCAN (several row tiles, i.e.
prefill); a single row tile (decode) walks the whole list, which the engine keeps visible.
The scan also yields [f_lo, f_hi): blocks inside every row's window and causally before all
of them. With FULL_TILES the B tiles wholly inside it run a second loop with no key, row or
visibility masks (FlashAttention's causal trick; in a prefill only the window-edge and
diagonal tiles, 2-4 per row tile, stay masked).
Globals ([Hkv, G, D], g_pos >= 0 valid) are a third key segment seen by every query.

Split-K. With SPLIT, program (m, kvh, s) walks only its share of the virtual tile sequence
(global tiles, then A tiles, then B tiles) and writes unnormalized partials (max, sum, acc)
to fp32 workspaces; `_attn_reduce` combines them. LSE_TAIL (decode with stored logits): each
program then bumps a counter of its (row tile, KV head) and the last one combines the rows'
lse from the partials (the GEMV's split-K tail pattern), so that importance_triton's
`_attn_reduce_mass` can run the reduce and the mass side by side in one launch.
All softmax math is fp32 in the log2 domain: s2 = q.k * scale * log2(e), lse2 = m + log2(l).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hisparse_cli.kernels.pdl import enter as pdl_enter


@triton.jit
def _visible_ranges(bstart_ptr, nb, q_lo, q_hi, sinks, window,
                    BS: tl.constexpr, WINDOWED: tl.constexpr, CB: tl.constexpr):
    """List-index ranges for queries [q_lo, q_hi]: visit [0, a_end) and [b_lo, b_hi);
    keys in [f_lo, f_hi) are visible to every one of those queries (no mask needed)."""
    c_hi = nb * 0  # entries with start <= q_hi (may hold a visible key)
    e_lo = nb * 0  # entries wholly before every query's window
    s_cnt = nb * 0  # entries holding a sink position
    f_lo = nb * 0  # entries with start <= q_hi - window (not wholly inside every window)
    f_hi = nb * 0  # entries wholly at or before q_lo (causally visible to every query)
    for i in range(0, nb, CB):
        idx = i + tl.arange(0, CB)
        ok = idx < nb
        st = tl.load(bstart_ptr + idx, mask=ok, other=0)
        c_hi += tl.sum((ok & (st <= q_hi)).to(tl.int32), axis=0)
        f_hi += tl.sum((ok & (st + (BS - 1) <= q_lo)).to(tl.int32), axis=0)
        if WINDOWED:
            e_lo += tl.sum((ok & (st + (BS - 1) <= q_lo - window)).to(tl.int32), axis=0)
            s_cnt += tl.sum((ok & (st < sinks)).to(tl.int32), axis=0)
            f_lo += tl.sum((ok & (st <= q_hi - window)).to(tl.int32), axis=0)
    return (tl.minimum(s_cnt, e_lo) * BS, e_lo * BS, c_hi * BS,
            tl.maximum(f_lo, e_lo) * BS, f_hi * BS)


@triton.jit
def _online_update(acc, m_i, l_i, q, k, v, visible, qk_scale, UPCAST: tl.constexpr,
                   MASKED: tl.constexpr = True):
    """One key tile of the online softmax. q [M, D], k/v [N, D], visible [M, N]."""
    if UPCAST:  # fp32 cache, or the interpreter (numpy has no bf16 matmul): exact fp32 dots
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if MASKED:
        s = tl.where(visible, s * qk_scale, float("-inf"))
    else:
        s = s * qk_scale
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if UPCAST:
        acc += tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc += tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i, s


@triton.jit
def _list_tiles(acc, m_i, l_i, q, lt_lo, lt_hi, n_at, a_end, b_lo, b_hi, rows, row_ok, n_rows,
                q_start, sinks, window, kvh, qk_scale, k_ptr, v_ptr, bid_ptr, bstart_ptr, s_row,
                G, stride_kb, stride_ks, stride_kh, GRP: tl.constexpr, D: tl.constexpr,
                BS: tl.constexpr, BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr,
                MASKED: tl.constexpr, STORE_S: tl.constexpr, UPCAST: tl.constexpr):
    """Key-list tiles [lt_lo, lt_hi) of the sequence A | B (one software-pipelined loop).
    MASKED=False only for tiles every row sees in full (no key or row masks at all)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    for lt in range(lt_lo, lt_hi):
        in_a = lt < n_at
        kj = tl.where(in_a, lt * BLOCK_N, b_lo + (lt - n_at) * BLOCK_N) + offs_n
        ent = kj // BS
        off = kj % BS
        if MASKED:
            k_ok = kj < tl.where(in_a, a_end, b_hi)
            bid = tl.load(bid_ptr + ent, mask=k_ok, other=0)
            kpos = (tl.load(bstart_ptr + ent, mask=k_ok, other=0) + off).to(tl.int32)
            kv_off = (bid * stride_kb + off * stride_ks + kvh * stride_kh)[:, None] + offs_d[None, :]
            k = tl.load(k_ptr + kv_off, mask=k_ok[:, None], other=0.0)
            v = tl.load(v_ptr + kv_off, mask=k_ok[:, None], other=0.0)
            # the visibility rule as a row interval per key: rows [r_lo, r_hi) see it
            r_lo = tl.where(k_ok, (kpos - q_start) * GRP, n_rows)  # q >= k
            if WINDOWED:  # and q < k + window unless k is a sink
                r_hi = tl.where(kpos < sinks, n_rows,
                                tl.minimum((kpos + window - q_start) * GRP, n_rows))
                vis = (rows[:, None] >= r_lo[None, :]) & (rows[:, None] < r_hi[None, :])
            else:
                vis = (rows[:, None] >= r_lo[None, :]) & row_ok[:, None]
        else:
            k_ok = kj < b_hi  # always true here (only used for STORE_S)
            bid = tl.load(bid_ptr + ent)
            kv_off = (bid * stride_kb + off * stride_ks + kvh * stride_kh)[:, None] + offs_d[None, :]
            k = tl.load(k_ptr + kv_off)
            v = tl.load(v_ptr + kv_off)
            vis = row_ok[:, None]
        acc, m_i, l_i, s = _online_update(acc, m_i, l_i, q, k, v, vis, qk_scale, UPCAST, MASKED)
        if STORE_S:
            tl.store(s_row + (G + kj)[None, :], s, mask=row_ok[:, None] & k_ok[None, :])
    return acc, m_i, l_i


@triton.jit
def _split_lse(m_ws, l_ws, rows, row_ok, kvh, n_rows, n_split, HKV: tl.constexpr,
               SPLIT_P2: tl.constexpr):
    """The rows' log-sum-exp (log2 domain) from the split partials: [BLOCK_M] for rows
    [BLOCK_M] (what _reduce_row writes with WRITE_LSE, computed as a [SPLIT_P2, BLOCK_M] tile).
    Run by the forward's last split program (LSE_TAIL): the partials were written by other
    SMs, so they are read past L1 (.cg)."""
    sp = tl.arange(0, SPLIT_P2)
    ok = (sp < n_split)[:, None] & row_ok[None, :]
    ws = (sp[:, None] * HKV + kvh) * n_rows + rows[None, :]
    m_s = tl.load(m_ws + ws, mask=ok, other=float("-inf"), cache_modifier=".cg")
    m_max = tl.max(m_s, 0)
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_s = tl.load(l_ws + ws, mask=ok, other=0.0, cache_modifier=".cg")
    l_sum = tl.sum(tl.math.exp2(m_s - m_use[None, :]) * l_s, 0)
    return m_use + tl.math.log2(tl.where(l_sum == 0.0, 1.0, l_sum))


# runtime sizes/positions change every step: one compiled variant, not one per divisibility
@triton.jit(do_not_specialize=["T", "nb", "G", "q_start", "sinks", "window", "n_split"])
def _attn_fwd(
    q_ptr, k_ptr, v_ptr, bid_ptr, bstart_ptr, gk_ptr, gv_ptr, gpos_ptr,
    out_ptr, lse_ptr, m_ws, l_ws, acc_ws, s_ptr,
    T, nb, G, q_start, sinks, window, qk_scale, n_split,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_gh, stride_gg, stride_ph, stride_sh, stride_sr,
    qs_ptr, cnt_ptr,
    HKV: tl.constexpr, GRP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CB: tl.constexpr, QS_PTR: tl.constexpr,
    WINDOWED: tl.constexpr, HAS_G: tl.constexpr, SPLIT: tl.constexpr, SCAN: tl.constexpr,
    FULL_TILES: tl.constexpr,
    WRITE_LSE: tl.constexpr, STORE_S: tl.constexpr, UPCAST: tl.constexpr,
    LSE_TAIL: tl.constexpr = False, SPLIT_P2: tl.constexpr = 1,
    PDL_WAIT: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = False,
):
    pdl_enter(PDL_WAIT, PDL_TRIGGER)  # kernels/pdl.py
    if QS_PTR:  # position of the first query read from device memory (CUDA-graph replay)
        q_start = tl.load(qs_ptr).to(tl.int32)
    pid_m = tl.program_id(0)
    kvh = tl.program_id(1)
    sid = tl.program_id(2)
    n_rows = T * GRP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    t = rows // GRP
    hq = kvh * GRP + rows % GRP
    qpos = q_start + t
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + t[:, None] * stride_qt + hq[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0).to(k_ptr.dtype.element_ty)
    q_lo = q_start + (pid_m * BLOCK_M) // GRP
    q_hi = q_start + tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // GRP, T - 1)

    if SCAN:  # several row tiles (prefill): each visits only the blocks its queries see
        a_end, b_lo, b_hi, f_lo, f_hi = _visible_ranges(bstart_ptr, nb, q_lo, q_hi, sinks,
                                                        window, BS, WINDOWED, CB)
    else:  # one row tile (decode): every listed block is (nearly) all visible; no scan latency
        a_end = nb * 0
        b_lo = nb * 0
        b_hi = nb * BS
        f_lo = b_hi
        f_hi = b_hi
    n_gt = tl.cdiv(G, BLOCK_N) if HAS_G else 0
    n_at = tl.cdiv(a_end, BLOCK_N)
    n_bt = tl.cdiv(b_hi - b_lo, BLOCK_N)
    if SPLIT:  # this program's share [v0, v1) of the virtual tile sequence G | A | B
        per = tl.cdiv(n_gt + n_at + n_bt, n_split)
        v0 = sid * per
        v1 = tl.minimum(v0 + per, n_gt + n_at + n_bt)
    else:
        v0 = sid * 0
        v1 = n_gt + n_at + n_bt

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    s_row = s_ptr + kvh * stride_sh + rows[:, None] * stride_sr  # STORE_S: logits rows

    if HAS_G:  # global tiles: every row sees the valid entries of its KV head
        for vt in range(tl.maximum(v0, 0), tl.minimum(v1, n_gt)):
            gi = vt * BLOCK_N + offs_n
            g_ok = gi < G
            gp = tl.load(gpos_ptr + kvh * stride_ph + gi, mask=g_ok, other=-1)
            g_off = (kvh * stride_gh + gi * stride_gg)[:, None] + offs_d[None, :]
            k = tl.load(gk_ptr + g_off, mask=g_ok[:, None], other=0.0)
            v = tl.load(gv_ptr + g_off, mask=g_ok[:, None], other=0.0)
            vis = row_ok[:, None] & (gp >= 0)[None, :]
            acc, m_i, l_i, s = _online_update(acc, m_i, l_i, q, k, v, vis, qk_scale, UPCAST)
            if STORE_S:
                tl.store(s_row + gi[None, :], s, mask=row_ok[:, None] & g_ok[None, :])

    n_lt = n_at + n_bt
    if FULL_TILES:  # B tiles wholly inside [f_lo, f_hi) skip every mask (most of a prefill)
        fb_lo = tl.minimum(tl.maximum(tl.cdiv(f_lo - b_lo, BLOCK_N), 0), n_bt)
        fb_hi = tl.minimum(tl.maximum((f_hi - b_lo) // BLOCK_N, fb_lo), n_bt)
        acc, m_i, l_i = _list_tiles(
            acc, m_i, l_i, q, 0, n_at + fb_lo, n_at, a_end, b_lo, b_hi, rows, row_ok, n_rows,
            q_start, sinks, window, kvh, qk_scale, k_ptr, v_ptr, bid_ptr, bstart_ptr, s_row, G,
            stride_kb, stride_ks, stride_kh, GRP, D, BS, BLOCK_N, WINDOWED, True, STORE_S, UPCAST)
        acc, m_i, l_i = _list_tiles(
            acc, m_i, l_i, q, n_at + fb_lo, n_at + fb_hi, n_at, a_end, b_lo, b_hi, rows, row_ok,
            n_rows, q_start, sinks, window, kvh, qk_scale, k_ptr, v_ptr, bid_ptr, bstart_ptr,
            s_row, G, stride_kb, stride_ks, stride_kh, GRP, D, BS, BLOCK_N, WINDOWED, False,
            STORE_S, UPCAST)
        lt_lo = n_at + fb_hi
        lt_hi = n_lt
    else:
        lt_lo = tl.maximum(v0 - n_gt, 0)
        lt_hi = tl.minimum(v1 - n_gt, n_lt)
    acc, m_i, l_i = _list_tiles(
        acc, m_i, l_i, q, lt_lo, lt_hi, n_at, a_end, b_lo, b_hi, rows, row_ok, n_rows,
        q_start, sinks, window, kvh, qk_scale, k_ptr, v_ptr, bid_ptr, bstart_ptr, s_row, G,
        stride_kb, stride_ks, stride_kh, GRP, D, BS, BLOCK_N, WINDOWED, True, STORE_S, UPCAST)

    if SPLIT:
        ws = (sid * HKV + kvh) * n_rows + rows
        tl.store(m_ws + ws, m_i, mask=row_ok)
        tl.store(l_ws + ws, l_i, mask=row_ok)
        tl.store(acc_ws + ws[:, None] * D + offs_d[None, :], acc, mask=row_ok[:, None])
        if LSE_TAIL:  # the last split of (row tile, KV head) to finish writes the rows' lse
            cnt = cnt_ptr + pid_m * HKV + kvh  # acq_rel: partials visible to whoever counts
            done = tl.atomic_add(cnt, 1, sem="acq_rel")
            if done == n_split - 1:
                lse = _split_lse(m_ws, l_ws, rows, row_ok, kvh, n_rows, n_split, HKV, SPLIT_P2)
                tl.store(lse_ptr + kvh * n_rows + rows, lse, mask=row_ok)
                tl.atomic_xchg(cnt, 0, sem="relaxed")  # ready for the next call / replay
    else:
        out = acc / tl.where(row_ok, l_i, 1.0)[:, None]
        tl.store(out_ptr + t[:, None] * stride_ot + hq[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        if WRITE_LSE:
            lse = m_i + tl.math.log2(tl.where(row_ok, l_i, 1.0))
            tl.store(lse_ptr + kvh * n_rows + rows, lse, mask=row_ok)


@triton.jit
def _reduce_row(m_ws, l_ws, acc_ws, out_ptr, lse_ptr, row, kvh, n_rows, n_split, stride_ot,
                stride_oh, HKV: tl.constexpr, GRP: tl.constexpr, D: tl.constexpr,
                SPLIT_P2: tl.constexpr, WRITE_LSE: tl.constexpr):
    """Combine the split partials of one row (query t = row // GRP, head kvh GRP + row % GRP):
    out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, all n_split partials loaded at once
    ([SPLIT_P2, D] tile, no loop over splits: a serial loop made this ~0.3 us per split, which
    capped the split count a decode step could use)."""
    sp = tl.arange(0, SPLIT_P2)
    s_ok = sp < n_split
    ws = (sp * HKV + kvh) * n_rows + row
    m_s = tl.load(m_ws + ws, mask=s_ok, other=float("-inf"))
    m_max = tl.max(m_s, 0)
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m_s - m_use)
    l_sum = tl.sum(w * tl.load(l_ws + ws, mask=s_ok, other=0.0), 0)
    offs_d = tl.arange(0, D)
    a = tl.load(acc_ws + ws[:, None] * D + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    acc = tl.sum(w[:, None] * a, 0)
    t = row // GRP
    hq = kvh * GRP + row % GRP
    out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)
    tl.store(out_ptr + t * stride_ot + hq * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))
    if WRITE_LSE:
        lse = m_use + tl.math.log2(tl.where(l_sum == 0.0, 1.0, l_sum))
        tl.store(lse_ptr + kvh * n_rows + row, lse)


@triton.jit(do_not_specialize=["T", "n_split"])
def _attn_reduce(
    m_ws, l_ws, acc_ws, out_ptr, lse_ptr, T, n_split, stride_ot, stride_oh,
    HKV: tl.constexpr, GRP: tl.constexpr, D: tl.constexpr, SPLIT_P2: tl.constexpr,
    WRITE_LSE: tl.constexpr, PDL_WAIT: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = False,
):
    """One program per (row, KV head): _reduce_row. PDL_TRIGGER: kernels/pdl.py (the o
    projection's GEMV may be scheduled now; it waits for this kernel before reading its
    output). Decode steps that store logits for importance use importance_triton's
    `_attn_reduce_mass` instead (this reduce and the mass in one launch)."""
    pdl_enter(PDL_WAIT, PDL_TRIGGER)
    _reduce_row(m_ws, l_ws, acc_ws, out_ptr, lse_ptr, tl.program_id(0), tl.program_id(1),
                T * GRP, n_split, stride_ot, stride_oh, HKV, GRP, D, SPLIT_P2, WRITE_LSE)
