"""Allocation traces of the two attention backends for one layer of one step:
kernels/attention_triton.py (explicit outputs and workspaces) and kernels/attention_ref.py
(the torch reference; its per-step mask memo is built by the step's first layer and lives
until the step ends). Rules as in planner_trace.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from hisparse_cli.planner_trace import StepShape, Trace, cdiv

EXACT_SCORE_ROWS = 16  # attention_triton.LOGITS_MAX_ROWS


@dataclass(frozen=True)
class AttnStep:
    """What one step's attention depends on besides the model."""

    t: int  # queries of the step
    nb: int  # visible blocks
    ts: int  # sampled scoring queries (torch reference, score_stride > 1)
    globals_full: bool  # every global slot holds a token (reference: 2-D mask branch)

    @property
    def key(self) -> tuple:
        return (self.t, self.nb, self.ts, self.globals_full)


def triton_splits(s: StepShape, t: int, n_keys: int) -> int:
    """Split-K factor as attention_triton.choose_config / _pick_splits choose it."""
    n_rows = t * s.grp
    if s.kvb == 4:  # fp32 caches: small FMA tiles
        block_m, block_n = (16 if n_rows <= 16 else 32), 32
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


def memo_bytes(s: StepShape, a: AttnStep) -> tuple[int, int, int]:
    """(k_pos, q_pos, mask) bytes of the reference's per-step memo."""
    n = a.nb * s.bs
    return n * 8, a.t * 8, a.t * n * 4


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


def attn_ref(tr: Trace, s: StepShape, a: AttnStep, first: bool) -> tuple[int, list[int]]:
    """Returns (out, [key_mass, global_mass]); the memo is built when `first` (left live)."""
    ab, t, n = s.attn_b, a.t, a.nb * s.bs
    live = []
    for name in ("attn.k", "attn.v"):  # k_cache[block_ids] (+ .to(dt))
        g = tr.alloc(name, n * s.hkv * s.d * s.kvb)
        if s.kvb != ab:
            c = tr.alloc(name, n * s.hkv * s.d * ab)
            tr.free(g)
            g = c
        live.append(g)
    if first:
        build_memo(tr, s, a)
    mask, width, mask_rows = -1, n, 1  # -1: the memo's [T, N] mask
    if s.G:
        width = n + s.G
        for i in (0, 1):  # k, v = cat((k, g.to(dt)))
            gc = tr.alloc("attn.k", s.hkv * s.G * s.d * ab) if s.kvb != ab else -1
            c = tr.alloc("attn.k" if i == 0 else "attn.v", s.hkv * width * s.d * ab)
            tr.free(gc, live[i])
            live[i] = c
        live.append(tr.alloc("attn.mask", s.hkv * s.G))  # g_ok
        if a.globals_full:
            z = tr.alloc("attn.mask", t * s.G * 4)
            mask = tr.alloc("attn.mask", t * width * 4)
            tr.free(z)
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
    masses = _ref_scores(tr, s, a, width, mask_rows) if s.track_scores else []
    tr.free(*live)
    return out, masses


def _ref_scores(tr: Trace, s: StepShape, a: AttnStep, width: int, mask_rows: int) -> list[int]:
    ab, t, n, ts, tmp = s.attn_b, a.t, a.nb * s.bs, a.ts, []

    def masses() -> list[int]:
        out = [tr.alloc("attn.key_mass", s.hkv * n * 4)]
        return out + ([tr.alloc("attn.key_mass", s.hkv * s.G * 4)] if s.G else [])

    strided = s.score_stride > 1
    if strided:  # rows = nonzero(q_pos % stride == 0)
        m = tr.alloc("attn.score", t * 8)
        e = tr.alloc("attn.score", t)
        tr.free(m)
        tmp.append(tr.alloc("attn.score", ts * 8))
        tr.free(e)
        if ts == 0:
            out = masses()
            tr.free(*tmp)
            return out
        tmp.append(tr.alloc("attn.score", s.hq * ts * s.d * ab))  # qh[:, rows]
        tmp.append(tr.alloc("attn.score", mask_rows * ts * width * 4))  # mask[..., rows, :]
    else:
        ts = t
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
    if s.min_distance > 0:  # snapkv: only queries far enough from the key count
        qp = tr.alloc("attn.score", ts * 8) if strided else -1
        diff = tr.alloc("attn.score", ts * n * 8)
        far = tr.alloc("attn.score", ts * n)
        tr.free(diff)
        x1 = tr.alloc("attn.score", rows * n * 4)
        p2 = tr.alloc("attn.score", rows * width * 4)
        tr.free(x1, p)
        p = p2
        tmp += [qp, far]
    su = tr.alloc("attn.score", s.hkv * width * 4)  # sum over (group, queries)
    tr.free(p)
    p = tr.alloc("attn.score", s.hkv * width * 4)  # * score_stride
    tr.free(su)
    out = masses()
    tr.free(p, s1, *tmp)
    return out
