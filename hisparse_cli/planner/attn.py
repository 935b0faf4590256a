"""Allocation traces of the two attention backends for one layer of one step:
kernels/attention/attention_triton.py (explicit outputs and workspaces) and kernels/attention/attention_ref.py
(the torch reference; its per-step mask memo is built by the step's first layer and lives
until the step ends). Rules as in planner/trace.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from hisparse_cli.planner.trace import StepShape, Trace, cdiv

EXACT_SCORE_ROWS = 16  # attention_triton.LOGITS_MAX_ROWS


@dataclass(frozen=True)
class AttnStep:
    """What one step's attention depends on besides the model."""

    t: int  # queries of the step
    nb: int  # visible blocks
    ts: int  # sampled scoring queries (torch reference, score_stride > 1)
    globals_full: bool  # every global slot holds a token (reference: 2-D mask branch)
    # the visible blocks are consecutive physical ids and the reference reads them in place
    # (CPU only: attention_ref._visible), not through a gather
    in_place: bool = False

    @property
    def key(self) -> tuple:
        return (self.t, self.nb, self.ts, self.globals_full, self.in_place)


def triton_splits(s: StepShape, t: int, n_keys: int) -> int:
    """Split-K factor as attention_triton.choose_config / _pick_splits choose it."""
    n_rows = t * s.grp
    if s.kvb == 4:  # fp32 caches: small FMA tiles
        block_m, block_n = (16 if n_rows <= 16 else 32), (16 if s.d > 64 else 32)
    else:
        block_m, block_n = (16 if n_rows <= 16 else 64 if n_rows <= 64 else 128), 64
    m_tiles = cdiv(n_rows, block_m)
    visible = min(n_keys, s.window + s.sinks + t) if s.window is not None else n_keys
    key_tiles = cdiv(visible, block_n) + cdiv(s.G, block_n)
    progs, target = m_tiles * s.hkv, 2 * s.num_sms
    if progs >= target // 2 or key_tiles < 4:
        return 1
    return max(1, min(cdiv(target, progs), key_tiles // 2, 64))


def attn_triton(tr: Trace, s: StepShape, a: AttnStep) -> tuple[int, list[int]]:
    n_rows, n_keys, scores = a.t * s.grp, a.nb * s.bs, s.track_scores
    splits = triton_splits(s, a.t, n_keys)
    out = tr.alloc("attn.out", a.t * s.hq * s.d * s.cb)
    tmp = [tr.alloc("attn.lse", s.hkv * n_rows * 4) if scores else -1]
    if scores and n_rows <= EXACT_SCORE_ROWS:
        tmp.append(tr.alloc("attn.logits_ws", s.hkv * n_rows * (s.G + n_keys) * 4))
    if splits > 1:
        tmp.append(tr.alloc("attn.split_ws", splits * s.hkv * n_rows * 4))
        tmp.append(tr.alloc("attn.split_ws", splits * s.hkv * n_rows * 4))
        tmp.append(tr.alloc("attn.split_ws", splits * s.hkv * n_rows * s.d * 4))
    masses = []
    if scores:
        masses.append(tr.alloc("attn.key_mass", s.hkv * n_keys * 4))
        if s.G:
            masses.append(tr.alloc("attn.key_mass", s.hkv * s.G * 4))
    tr.free(*tmp)
    return out, masses


def _flat_mask(s: StepShape, a: AttnStep) -> bool:
    """The reference's step mask is [T, N(+G)], shared by every layer (not per head)."""
    return not s.G or a.globals_full


def _score_consts_bytes(s: StepShape, a: AttnStep) -> list[int]:
    """Bytes of attention_ref._score_consts' result (rows, sampled mask, snapkv filter,
    per-key ratio) for a [T, N(+G)] mask: kept in the memo when scoring."""
    if not s.track_scores or not _flat_mask(s, a):
        return []
    width = a.nb * s.bs + s.G
    strided = s.score_stride > 1
    ts = (a.t - 1) // s.score_stride + 1 if strided else a.t
    out = [ts * 8, ts * width * 4] if strided else []
    if s.min_distance > 0:
        out.append(ts * width)
    if strided:
        out.append(width * 4)
    return out


def memo_bytes(s: StepShape, a: AttnStep) -> list[int]:
    """Bytes of the reference's per-step memo: k_pos, q_pos, the mask [T, N]; with globals all
    filled, the mask with the globals' columns [T, N+G]; when scoring, _score_consts'."""
    n = a.nb * s.bs
    out = [n * 8, a.t * 8, a.t * n * 4]
    if s.G and a.globals_full:
        out.append(a.t * (n + s.G) * 4)
    return out + _score_consts_bytes(s, a)


def build_memo(tr: Trace, s: StepShape, a: AttnStep) -> list[int]:
    """attention_ref._step_keys: k_pos, q_pos and the fp32 additive mask [T, N] (kept)."""
    t, n = a.t, a.nb * s.bs
    tmp = tr.alloc("attn.memo", s.bs * 8)
    kp = tr.alloc("attn.memo", n * 8)
    tr.free(tmp)
    tmp = tr.alloc("attn.memo", t * 8)
    qp = tr.alloc("attn.memo", t * 8)
    tr.free(tmp)
    vis = causal = tr.alloc("attn.memo", t * n)  # visibility_mask
    if s.window is not None:
        qw = tr.alloc("attn.memo", t * 8)
        inw = tr.alloc("attn.memo", t * n)
        tr.free(qw)
        sk = tr.alloc("attn.memo", n)
        o = tr.alloc("attn.memo", t * n)
        tr.free(sk)
        vis = tr.alloc("attn.memo", t * n)
        tr.free(o, inw, causal)
    mask = tr.alloc("attn.memo", t * n * 4)  # zeros (default dtype fp32)
    tr.free(tr.alloc("attn.memo", t * n), vis)  # ~vis, then vis at return
    return [kp, qp, mask]


def attn_ref(tr: Trace, s: StepShape, a: AttnStep, first: bool,
             keep_memo: bool = True) -> tuple[int, list[int]]:
    """Returns (out, [key_mass, global_mass]); the mask memo is built when `first` and left
    live for the step's other layers when `keep_memo` (without a memo: freed at return)."""
    ab, t, n = s.attn_b, a.t, a.nb * s.bs
    live = []
    for name in ("attn.k", "attn.v"):  # a gather or a view of the blocks (+ .to(dt))
        g = -1 if a.in_place else tr.alloc(name, n * s.hkv * s.d * s.kvb)
        if s.kvb != ab:
            c = tr.alloc(name, n * s.hkv * s.d * ab)
            tr.free(g)
            g = c
        live.append(g)
    if first:
        memo = build_memo(tr, s, a)
        if not keep_memo:
            live += memo
    mask, width, mask_rows = -1, n, 1  # -1: the memo's [T, N] mask
    if s.G:
        width = n + s.G
        for i in (0, 1):  # k, v = cat((k, g.to(dt)))
            gc = tr.alloc("attn.k", s.hkv * s.G * s.d * ab) if s.kvb != ab else -1
            c = tr.alloc("attn.k" if i == 0 else "attn.v", s.hkv * width * s.d * ab)
            tr.free(gc, live[i])
            live[i] = c
        live.append(tr.alloc("attn.mask", s.hkv * s.G))  # g_ok
        if a.globals_full:  # memo "mask_g": made by the step's first layer
            if first or not keep_memo:
                z = tr.alloc("attn.mask", t * s.G * 4)
                mask = tr.alloc("attn.mask", t * width * 4)
                tr.free(z)
                if not keep_memo:
                    live.append(mask)
        else:
            ng = tr.alloc("attn.mask", s.hkv * s.G)
            live.append(tr.alloc("attn.mask", s.hkv * s.G * 4))  # g_add
            tr.free(ng)
            m2 = tr.alloc("attn.mask", s.hkv * t * width * 4)
            mask = tr.alloc("attn.mask", s.hq * t * width * 4)  # repeat_interleave(grp)
            tr.free(m2)
            mask_rows = s.hq
            live.append(mask)
    qh = tr.alloc("attn.q", t * s.hq * s.d * ab) if s.cb != ab else -1
    live.append(qh)
    mask_el = mask_rows * t * width
    mc = tr.alloc("attn.sdpa_mask", mask_el * ab) if ab != 4 else -1  # mask.to(dt)
    if s.cuda:  # fused CUDA kernels want the bias padded to 16 keys (estimate)
        tr.free(tr.alloc("attn.sdpa_mask", mask_rows * t * cdiv(width, 16) * 16 * ab))
    out = tr.alloc("attn.sdpa_out", s.hq * t * s.d * ab)
    tr.free(tr.alloc("attn.sdpa_lse", s.hq * t * 4) if not s.cuda else -1, mc)
    if s.cb != ab:
        o2 = tr.alloc("attn.out", t * s.hq * s.d * s.cb)
        tr.free(out)
        out = o2
    masses = _ref_scores(tr, s, a, width, mask_rows, first, keep_memo) if s.track_scores else []
    tr.free(*live)
    return out, masses


def _score_consts(tr: Trace, s: StepShape, a: AttnStep, width: int, mask_rows: int) -> list[int]:
    """attention_ref._score_consts -> handles of what it returns (rows, sampled mask, snapkv
    filter, ratio; -1 where that is None or a view)."""
    t, n = a.t, a.nb * s.bs
    strided = s.score_stride > 1
    ts = (t - 1) // s.score_stride + 1 if strided else t  # rows = arange(t-1, -1, -stride)
    rows = tr.alloc("attn.score", ts * 8) if strided else -1
    ms = tr.alloc("attn.score", mask_rows * ts * width * 4) if strided else -1  # mask[..., rows, :]
    vis_rows = 1 if mask_rows == 1 else s.hkv  # isfinite(mask or mask[0, ::grp])
    vis = tr.alloc("attn.score", vis_rows * t * width)
    far_s, tmp = -1, []
    if s.min_distance > 0:  # snapkv: only queries at least m positions after the key
        diff = tr.alloc("attn.score", t * n * 8)
        far = tr.alloc("attn.score", t * n)
        tr.free(diff)
        ones = tr.alloc("attn.score", t * (width - n))
        far2 = tr.alloc("attn.score", t * width)
        tr.free(ones, far)
        v2 = tr.alloc("attn.score", vis_rows * t * width)  # vis & far
        tr.free(vis)
        vis = v2
        if strided:
            far_s = tr.alloc("attn.score", ts * width)  # far[rows]
            tmp.append(far2)
        else:
            far_s = far2
    ratio = -1
    if strided:  # per-key scale: (queries that see it) / (sampled queries that see it)
        cnt = vis_rows * width
        a1 = tr.alloc("attn.score", cnt * 8)  # vis.sum(-2)
        n_vis = tr.alloc("attn.score", cnt * 4)
        tr.free(a1)
        sel = tr.alloc("attn.score", vis_rows * ts * width)  # vis[..., rows, :]
        a1 = tr.alloc("attn.score", cnt * 8)
        tr.free(sel)
        n_smp = tr.alloc("attn.score", cnt * 4)
        tr.free(a1)
        w = [tr.alloc("attn.score", cnt), tr.alloc("attn.score", cnt * 4),  # > 0, clamp
             tr.alloc("attn.score", cnt * 4), tr.alloc("attn.score", cnt * 4)]  # /, zeros_like
        ratio = tr.alloc("attn.score", cnt * 4)  # where
        tr.free(*w)
        tmp += [n_vis, n_smp]
    tr.free(vis, *tmp)
    return [rows, ms, far_s, ratio]


def _ref_scores(tr: Trace, s: StepShape, a: AttnStep, width: int, mask_rows: int,
                first: bool, keep_memo: bool) -> list[int]:
    """The reference's scoring after its SDPA -> [key_mass, global_mass]. _score_consts'
    result is kept in the memo by the step's first layer when the mask is [T, N(+G)]; a
    per-head mask, or no memo, makes it per call."""
    ab, t, n = s.attn_b, a.t, a.nb * s.bs
    strided = s.score_stride > 1
    ts = (t - 1) // s.score_stride + 1 if strided else t
    memo = keep_memo and mask_rows == 1
    consts = _score_consts(tr, s, a, width, mask_rows) if first or not memo else [-1] * 4
    tmp = [] if memo else consts
    if strided:
        tmp.append(tr.alloc("attn.score", s.hq * ts * s.d * ab))  # qh[:, rows]
    rows = s.hq * ts
    copy = not strided and t > 1 and s.grp > 1  # reshape of the transposed q copies
    qr = tr.alloc("attn.score", rows * s.d * ab) if copy else -1
    qf = tr.alloc("attn.score", rows * s.d * 4) if ab != 4 else -1
    kf = tr.alloc("attn.score", s.hkv * width * s.d * 4) if ab != 4 else -1
    s0 = tr.alloc("attn.score", rows * width * 4)  # bmm
    tr.free(qr, qf, kf)
    s1 = tr.alloc("attn.score", rows * width * 4)  # * scale
    tr.free(s0)
    added = tr.alloc("attn.score", rows * width * 4)  # + mask
    p = tr.alloc("attn.score", rows * width * 4)  # softmax
    tr.free(added)
    if s.min_distance > 0:  # p * far
        p2 = tr.alloc("attn.score", rows * width * 4)
        tr.free(p)
        p = p2
    su = tr.alloc("attn.score", s.hkv * width * 4)  # sum over (group, queries)
    tr.free(p)
    p = su
    if strided:  # p * ratio
        p2 = tr.alloc("attn.score", s.hkv * width * 4)
        tr.free(p)
        p = p2
    out = [tr.alloc("attn.key_mass", s.hkv * n * 4)]
    out += [tr.alloc("attn.key_mass", s.hkv * s.G * 4)] if s.G else []
    tr.free(p, s1, *tmp)
    return out
