"""Allocation traces of a whole engine step: the forward pass (model/llama.py), the attention
backends (kernels/attention/attention_ref.py, kernels/attention/attention_triton.py) and the KV cache's own work
(engine/kv_cache.py: eviction into candidate slots, recalibration). Each function returns the
peak of its temporaries measured from zero (`SubPeak`); see planner/trace.py for the rules.
"""

from __future__ import annotations

from dataclasses import replace

from hisparse_cli.planner.attn import AttnStep, attn_ref, attn_triton, memo_bytes
from hisparse_cli.planner.trace import (StepShape, SubPeak, Trace, add_rms_norm, cos_sin, linear,
                                       rms_norm, rope)


# -- one decoder layer and the whole forward -------------------------------------------------
def _attention(tr: Trace, s: StepShape, a: AttnStep, first: bool, last_only: bool,
               h: int) -> int:
    """Attention of the normed input h (freed here, with the attention's tensors) -> the o
    projection's output. The engine's model has q|k|v stacked in one linear
    (model/llama.py:fuse_projections; a mixed AWQ checkpoint that keeps some pieces apart is
    not modelled): q, k and v are views of its output, which lives until the attention ends."""
    t, hs, qd, kd = a.t, s.hidden, s.hq * s.d, s.hkv * s.d
    qkv = linear(tr, s, "attn.qkv", t, hs, qd + 2 * kd, s.awq, s.qkv_bias)
    if s.qk_norm:
        q2 = rms_norm(tr, s, "attn.q", t * s.hq, s.d)
        k2 = rms_norm(tr, s, "attn.k", t * s.hkv, s.d)
        q = rope(tr, s, "attn.q", t, s.hq)
        k = rope(tr, s, "attn.k", t, s.hkv)
        tr.free(q2, k2)
    elif s.backend == "triton":
        # KernelBackend.rope_store_kv: q rotated into its own tensor, k and v into the cache
        q, k = rope(tr, s, "attn.q", t, s.hq), -1
    else:  # one RoPE over the q and k heads; q and k are views of its output
        q, k = rope(tr, s, "attn.qk", t, s.hq + s.hkv), -1
    v = qkv
    if s.backend == "torch" and s.kvb != s.cb:  # store_kv: k.to(cache dtype), then v
        tr.free(tr.alloc("attn.store", t * kd * s.kvb))
    if s.backend == "triton" and s.min_distance > 0:
        # dispatch: snapkv masses are not fused in Triton; the reference computes them
        # (without the memo) after the Triton output
        out, _ = attn_triton(tr, replace(s, track_scores=False), a)
        ref_out, masses = attn_ref(tr, s, a, first=True, keep_memo=False)
        tr.free(ref_out)
    elif s.backend == "triton":
        out, masses = attn_triton(tr, s, a)
    else:
        out, masses = attn_ref(tr, s, a, first)
    tr.free(*masses)
    rows = 1 if last_only else t  # the last layer of a one-logit step: the last row only
    copy = s.backend == "torch" and t > 1  # reshape of the reference's transposed output
    flat = tr.alloc("attn.out", rows * qd * s.cb) if copy else -1
    o = linear(tr, s, "attn.o", rows, qd, hs, s.awq, s.o_bias)
    tr.free(flat, q, k, v, out, h)
    return o


def layer_peak(s: StepShape, a: AttnStep, first: bool = False, last_only: bool = False,
               chained: bool = False, pair_in: bool = False) -> SubPeak:
    """One DecoderLayer.forward on top of its input x [t, hidden] (held by the caller).
    first: the step's first layer, which builds the reference's mask memo (left live).
    last_only: the model's last layer in a step that needs one logit row (model/llama.py):
    attention over all t rows, then o_proj, residual and MLP of the last row only.
    chained: DecoderLayer.forward_unadded in CausalLM.forward_hidden's residual chain
    (model/llama.py's residual chain, Triton): the layer owns its input (here allocated first, not
    held by the caller) - x, and with pair_in the previous layer's unadded output h_prev,
    added inside the input norm - and leaves its own output unadded: (x', d) stay live."""
    tr = Trace(s.cuda)
    hs, cb, t0 = s.hidden, s.cb, a.t
    x = tr.alloc("residual", t0 * hs * cb) if chained else -1
    if chained and pair_in:  # x, n = add_rms_norm(x, h_prev): both inputs die at the add
        h_prev = tr.alloc("residual", t0 * hs * cb)
        x2, n = add_rms_norm(tr, s, "norm", t0, hs)
        tr.free(x, h_prev)
        x = x2
    else:
        n = rms_norm(tr, s, "norm", t0, hs)
    att = _attention(tr, s, a, first, last_only, n)
    t = 1 if last_only else t0
    if s.backend == "triton":  # the residual add fused into the norm; att dies after both
        x2, h2 = add_rms_norm(tr, s, "norm", t, hs)
        tr.free(att, x)  # (chained: the layer's x dies at this add)
    else:
        x2 = tr.alloc("residual", t * hs * cb)
        tr.free(att)
        h2 = rms_norm(tr, s, "norm", t, hs)
    # gate|up stacked in one linear: silu and the product in place in its gate half, which
    # down_proj reads as a strided view
    g = linear(tr, s, "mlp.gate_up", t, hs, 2 * s.inter, s.awq, s.mlp_bias)
    d = linear(tr, s, "mlp.down", t, s.inter, hs, s.awq, s.mlp_bias)
    tr.free(g, h2)
    if not chained:  # x2 + d: the layer's output (the caller's x from here)
        tr.alloc("residual", t * hs * cb)
        tr.free(d, x2)
    return SubPeak.of(tr)


def forward_peak(s: StepShape, a: AttnStep) -> tuple[SubPeak, list[int]]:
    """CausalLM.forward for a step -> (peak of its temporaries, byte sizes of what stays live
    until the step ends besides the logits: the reference's mask memo)."""
    tr = Trace(s.cuda)
    x = tr.alloc("residual", a.t * s.hidden * s.cb)  # embedding rows (also when host-resident)
    cos, sin = cos_sin(tr, s, a.t)
    kept: list[int] = []
    n = s.layers
    if s.residual_chain and s.backend == "triton":
        return _chained_forward_peak(s, a, tr, x, cos, sin), kept
    if s.backend == "torch":
        tr.bump(layer_peak(s, a, first=True, last_only=n == 1), "layer")
        kept = [tr.size(b) for b in memo_bytes(s, a)]
        for b in kept:
            tr.alloc("attn.memo", b)
    if n > (2 if s.backend == "torch" else 1):  # the middle layers, as many as there are
        tr.bump(layer_peak(s, a), "layer")
    if n > 1 or s.backend != "torch":
        tr.bump(layer_peak(s, a, last_only=True), "layer")
    tr.free(x)  # the last layer returned the last row only
    x = tr.alloc("residual", s.hidden * s.cb)
    h = rms_norm(tr, s, "final_norm", 1, s.hidden)
    y = linear(tr, s, "lm_head", 1, s.hidden, s.vocab, s.awq and s.awq_lm_head)
    logits = tr.alloc("logits", s.vocab * 4) if s.cb != 4 else y
    tr.free(h, x, cos, sin)
    if logits != y:
        tr.free(y)
    return SubPeak.of(tr), kept


def _chained_forward_peak(s: StepShape, a: AttnStep, tr: Trace, x: int, cos: int,
                          sin: int) -> SubPeak:
    """forward_peak's rest with the residual chain (model/llama.py; Triton): the embedding rows x
    pass to the first layer (the chain holds each layer's input in its call alone), every
    layer leaves its output unadded as (x', d), and the final norm adds the last pair."""
    n = s.layers
    tr.free(x)  # owned by the first layer's trace from here
    tr.bump(layer_peak(s, a, last_only=n == 1, chained=True), "layer")
    if n > 2:  # the middle layers: input (x, h_prev)
        tr.bump(layer_peak(s, a, chained=True, pair_in=True), "layer")
    if n > 1:
        tr.bump(layer_peak(s, a, last_only=True, chained=True, pair_in=True), "layer")
    x, d = (tr.alloc("residual", s.hidden * s.cb) for _ in range(2))  # the last row, unadded
    s1, h = add_rms_norm(tr, s, "final_norm", 1, s.hidden)
    tr.free(s1)  # only the normed half is kept: lm_head(add_rms_norm(x, d)[1])
    y = linear(tr, s, "lm_head", 1, s.hidden, s.vocab, s.awq and s.awq_lm_head)
    tr.free(h)  # the argument dies when lm_head returns, before .float()
    logits = tr.alloc("logits", s.vocab * 4) if s.cb != 4 else y
    tr.free(x, d, cos, sin)
    if logits != y:
        tr.free(y)
    return SubPeak.of(tr)


# -- KV cache work after the forward ---------------------------------------------------------
def top_peak(tr: Trace, s: StepShape, width: int, keep: int, name: str) -> tuple[int, int]:
    """PagedKVCache._top over [L, H, width] entries keeping `keep` -> (idx, pos_sel) handles."""
    lh = s.layers * s.hkv
    if s.importance == "uniform":
        p1 = tr.alloc(name, lh * width * 8)  # pos + 1
        ng = tr.alloc(name, lh * width * 8)
        an = tr.alloc(name, lh * width * 8)  # p1 & -p1
        tr.free(ng)
        cl = tr.alloc(name, lh * width * 8)
        tr.free(an)
        fl = tr.alloc(name, lh * width * 4)
        tr.free(cl)
        pr = tr.alloc(name, lh * width * 4)  # log2
        tr.free(fl)
    else:
        cl = tr.alloc(name, lh * width * 4)  # seen.clamp
        pr = tr.alloc(name, lh * width * 4)  # mass / seen
        tr.free(cl)
    neg = tr.alloc(name, lh * width)  # pos < 0
    pr2 = tr.alloc(name, lh * width * 4)  # masked_fill
    tr.free(neg, pr, p1 if s.importance == "uniform" else -1)
    vals, idx = tr.alloc(name, lh * keep * 4), tr.alloc(name, lh * keep * 8)  # topk
    g1 = tr.alloc(name, lh * keep * 8)  # pos.gather
    eq = tr.alloc(name, lh * keep)
    pos = tr.alloc(name, lh * keep * 8)  # masked_fill
    tr.free(g1, eq, pr2, vals)
    return idx, pos


def evict_peak(s: StepShape, ne: int) -> SubPeak:
    """evict_to_candidates for ne blocks: the choice on positions/scores, then only the
    winners' K/V rows (old candidate or paged storage), written into the slots in place."""
    tr = Trace(s.cuda)
    lh, n, name, c = s.layers * s.hkv, ne * s.bs, "evict", s.C
    tmp = [tr.alloc(name, ne * 8)]  # ids
    a, b = tr.alloc(name, ne * 8), tr.alloc(name, s.bs * 8)
    p0 = tr.alloc(name, n * 8)
    tr.free(a, b)
    lt = tr.alloc(name, n)
    tmp.append(tr.alloc(name, n * 8))  # pos.masked_fill
    tr.free(lt, p0)
    tmp.append(tr.alloc(name, lh * n * 4))  # mass (score gather or zeros)
    tmp.append(tr.alloc(name, lh * n * 4))  # seen
    w = c + n
    tmp += [tr.alloc(name, lh * w * 8), tr.alloc(name, lh * w * 4), tr.alloc(name, lh * w * 4)]
    tmp += top_peak(tr, s, w, c, name)
    t1 = tr.alloc(name, lh * c * 8)  # idx - C
    tmp.append(tr.alloc(name, lh * c * 8))  # j = clamp
    tr.free(t1)
    t2 = tr.alloc(name, lh * c * 8)  # j // bs
    tmp.append(tr.alloc(name, lh * c * 8))  # blk = ids[...]
    tr.free(t2)
    if s.cuda:  # interleaved storage: ((arange(L) * capacity + blk) * bs + j % bs) * H + h
        m1 = tr.alloc(name, s.layers * 8)  # arange(L), then * capacity
        m = tr.alloc(name, s.layers * 8)
        tr.free(m1)
    else:  # head-major (the CPU's): (arange(L * H) * capacity + blk) * bs + j % bs
        m1 = tr.alloc(name, lh * 8)
        m = tr.alloc(name, lh * 8)
        tr.free(m1)
    for _ in range(2):  # + blk, * bs
        m2 = tr.alloc(name, lh * c * 8)
        tr.free(m)
        m = m2
    m4 = tr.alloc(name, lh * c * 8)  # j % bs
    m5 = tr.alloc(name, lh * c * 8)
    tr.free(m, m4)
    if s.cuda:
        m6 = tr.alloc(name, lh * c * 8)  # * H
        tr.free(m5)
        ah = tr.alloc(name, s.hkv * 8)  # arange(H)
        tmp.append(tr.alloc(name, lh * c * 8))  # rows
        tr.free(m6, ah)
    else:
        tmp.append(m5)  # rows
    tmp.append(tr.alloc(name, lh * c))  # keep = idx < C
    tmp.append(tr.alloc(name, lh * c * 8))  # idx.clamp
    for _ in range(2):  # K, then V: old candidates' rows and the storage's, where(out=slots)
        tr.free(tr.alloc(name, lh * c * s.d * s.kvb), tr.alloc(name, lh * c * s.d * s.kvb))
    tr.free(tr.alloc(name, lh * c * 4), tr.alloc(name, lh * c * 4))  # mass, seen gathers
    tr.free(*tmp)
    return SubPeak.of(tr)


def recalibrate_peak(s: StepShape) -> SubPeak:
    """recalibrate: the choice on positions/scores of globals ∪ candidates, then the winners'
    K/V rows written into the global slots in place."""
    tr = Trace(s.cuda)
    lh, w, name, g = s.layers * s.hkv, s.G + s.C, "recalibrate", s.G
    tmp = [tr.alloc(name, lh * w * 8), tr.alloc(name, lh * w * 4), tr.alloc(name, lh * w * 4)]
    tmp += top_peak(tr, s, w, g, name)
    rows = lh * g * s.d * s.kvb
    if s.C:
        tmp.append(tr.alloc(name, lh * g))  # keep = idx < G
        tmp.append(tr.alloc(name, lh * g * 8))  # idx.clamp
        t = tr.alloc(name, lh * g * 8)  # idx - G
        tmp.append(tr.alloc(name, lh * g * 8))  # clamp
        tr.free(t)
        for _ in range(2):  # K, then V: globals' rows and candidates' rows, where(out=slots)
            tr.free(tr.alloc(name, rows), tr.alloc(name, rows))
    else:
        for _ in range(2):
            tr.free(tr.alloc(name, rows))
    tr.free(tr.alloc(name, lh * g * 4), tr.alloc(name, lh * g * 4))  # mass, seen gathers
    tr.free(*tmp)
    return SubPeak.of(tr)
