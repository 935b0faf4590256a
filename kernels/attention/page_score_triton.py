"""Triton page scoring of the retrieval tier (the contract and the torch oracle:
kernels/attention/page_score_ref.py; selected by kernels/dispatch.py on CUDA).

    page_scores(q [T, Hq, D], lo, hi: Summary [Hkv, n, D], scale) -> [Hkv, n] fp32
    score_top_pages(q, lo, hi, k, scale) -> [Hkv, k] int64, ascending
    page_scores_in_range(q, lo, hi [Hkv, P, D], rng, scale) -> [Hkv, P] fp32 (-1 outside
        the device range rng = (first, n): the CUDA-graph decode step's static form)

Version 1 (`_page_mass`): one program per (KV head, tile of BLOCK_M query rows; a row is a
query x a query head of the KV head). Two passes over the pages: the first keeps each row's
running max and sum of exp (online softmax) of scale * (q+ . hi + q- . lo), the second takes
each page's largest probability over the tile's rows into the output with an atomic max (the
output starts at 0; probabilities are >= 0).
No [rows, pages] tensor is materialised (the reference's two fp32 [Hkv, T * grp, n] tensors:
268 MB at 128K tokens with chunks of 128 on an 8-KV-head model). Top-k: torch.topk on the
scores (k is at most a few hundred pages; a Triton top-k is not written).
`_ranged_mass` (the ranged form, a decode step's few rows, every layer's KV heads at once):
one program per KV head, the same two passes over the pages in the device-held range, the
largest probabilities stored (-1 for every page outside the range); no [rows, pages] tensor.
Dots: the summaries' INT8 values (page_score_ref.Summary) convert exactly to the queries'
type; fp16 (bf16) queries run on the tensor cores in that type (16-bit products are exact in
the fp32 accumulator), fp32 queries (an fp32 cache) in fp32 IEEE dots; each page's column is
then multiplied by its scale. The mean summary (lo is hi) bounds nothing: its score is
q . mean, one dot a tile instead of two (`ONE`). A prefill chunk's scoring (>= 256 rows) takes
128 x 128 tiles (rows x pages) with 16-bit queries, fewer rows 16 x 128 (fp32 queries: 64 x 64
and 16 x 64, the tiles the fp32 dots were measured with): at 32K with 4060ti-6g settings on an H100
the tier's prefill ran at 17.7K and 17.9K tok/s with 128 x 128 tiles against 12.1K and 14.3K
with 64 x 64, in two calls with the order swapped (BENCHMARKS.md).
Any strides on the last-but-one dims; the last dim must be contiguous (asserted).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hisparse_cli.kernels.attention.page_score_ref import Summary


@triton.jit
def _summary_dot(q, v_ptr, pg, ok, dd, s_vn, LOW: tl.constexpr):
    """q . v for the INT8 summary values v of the pages `pg` (zeros past the end): in q's
    16-bit type on the tensor cores with LOW (|v| <= 127 converts exactly; the products are
    exact in the fp32 accumulator), else fp32 IEEE dots."""
    v = tl.load(v_ptr + pg[:, None] * s_vn + dd[None, :], mask=ok[:, None], other=0)
    if LOW:  # (no early return: Triton would still compile the statements after the branch)
        s = tl.dot(q, tl.trans(v.to(q.dtype)))
    else:
        s = tl.dot(q, tl.trans(v.to(tl.float32)), input_precision="ieee")
    return s


@triton.jit
def _tile_scores(qp, qn, lo_ptr, hi_ptr, ls_ptr, hs_ptr, pg, ok, dd, s_ln, s_hn, scale,
                 LOW: tl.constexpr, ONE: tl.constexpr):
    """scale * (q+ . hi + q- . lo) of a tile of query rows against the pages `pg` of one KV
    head (the upper bound of q . k over a page's keys); pages past the end load as zeros. The
    summaries are INT8 with one fp32 scale a page (ls_ptr, hs_ptr): each dot runs on the
    integer values, then scales its page's column. ONE: lo is hi (the mean summary), qp is the
    whole q, and the bound is scale * q . mean: one dot, not two."""
    hs = tl.load(hs_ptr + pg, mask=ok, other=0.0)
    s = _summary_dot(qp, hi_ptr, pg, ok, dd, s_hn, LOW) * hs[None, :]
    if not ONE:
        ls = tl.load(ls_ptr + pg, mask=ok, other=0.0)
        s += _summary_dot(qn, lo_ptr, pg, ok, dd, s_ln, LOW) * ls[None, :]
    return s * scale


@triton.jit
def _query_rows(q_ptr, kvh, rows, n_rows, s_qt, s_qh, GRP: tl.constexpr, D: tl.constexpr,
                LOW: tl.constexpr, ONE: tl.constexpr):
    """(q+, q-, row_ok, dd) of query rows `rows` of KV head kvh (a row is a query x a query
    head of the KV head): in q's 16-bit type (exact) with LOW, else fp32. ONE (one summary):
    (q, q, ...), the sign split unneeded."""
    row_ok = rows < n_rows
    dd = tl.arange(0, D)
    t, g = rows // GRP, rows % GRP
    q = tl.load(q_ptr + t[:, None] * s_qt + (kvh * GRP + g)[:, None] * s_qh + dd[None, :],
                mask=row_ok[:, None], other=0.0)
    if not LOW:
        q = q.to(tl.float32)
    if ONE:
        qp, qn = q, q
    else:
        qp, qn = tl.maximum(q, 0.0).to(q.dtype), tl.minimum(q, 0.0).to(q.dtype)
    return qp, qn, row_ok, dd


@triton.jit(do_not_specialize=["n_rows", "n_pages", "s_lsh", "s_hsh", "s_oh"])  # rows, pages
# and the strides that are a page count (the scales' and the output's head strides)
def _page_mass(q_ptr, lo_ptr, hi_ptr, ls_ptr, hs_ptr, out_ptr, n_rows, n_pages, scale,
               s_qt, s_qh, s_lh, s_ln, s_hh, s_hn, s_lsh, s_hsh, s_oh,
               GRP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, LOW: tl.constexpr, ONE: tl.constexpr):
    kvh = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    qp, qn, row_ok, dd = _query_rows(q_ptr, kvh, rows, n_rows, s_qt, s_qh, GRP, D, LOW, ONE)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for start in range(0, n_pages, BLOCK_N):  # pass 1: each row's max and sum of exp
        pg = start + tl.arange(0, BLOCK_N)
        ok = pg < n_pages
        s = _tile_scores(qp, qn, lo_ptr + kvh * s_lh, hi_ptr + kvh * s_hh, ls_ptr + kvh * s_lsh,
                         hs_ptr + kvh * s_hsh, pg, ok, dd, s_ln, s_hn, scale, LOW, ONE)
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)
        m_i = m_new
    inv = tl.where(row_ok, 1.0 / l_i, 0.0)
    for start in range(0, n_pages, BLOCK_N):  # pass 2: each page's largest probability
        pg = start + tl.arange(0, BLOCK_N)
        ok = pg < n_pages
        s = _tile_scores(qp, qn, lo_ptr + kvh * s_lh, hi_ptr + kvh * s_hh, ls_ptr + kvh * s_lsh,
                         hs_ptr + kvh * s_hsh, pg, ok, dd, s_ln, s_hn, scale, LOW, ONE)
        p = tl.exp(s - m_i[:, None]) * inv[:, None]
        p = tl.where(row_ok[:, None] & ok[None, :], p, 0.0)
        tl.atomic_max(out_ptr + kvh * s_oh + pg, tl.max(p, axis=0), mask=ok)


def _low(q: torch.Tensor) -> bool:
    """The dots run in q's 16-bit type (fp16 or bf16)."""
    return q.dtype in (torch.float16, torch.bfloat16)


def _check(q: torch.Tensor, lo: Summary, hi: Summary) -> None:
    """The layouts the kernels assume (module doc)."""
    assert lo.values.shape == hi.values.shape and lo.values.shape[-1] == q.shape[-1]
    assert lo.values.dtype == torch.int8 and lo.scale.dtype == torch.float32
    assert q.stride(-1) == 1
    for x in (lo.values, hi.values, lo.scale, hi.scale):
        assert x.stride(-1) == 1


def page_scores(q: torch.Tensor, lo: Summary, hi: Summary, scale: float,
                block_m: int | None = None, block_n: int | None = None,
                num_warps: int = 4) -> torch.Tensor:
    t, hq, d = q.shape
    hkv, n, _ = lo.values.shape
    assert hq % hkv == 0
    _check(q, lo, hi)
    assert d >= 16 and d & (d - 1) == 0, "head_dim must be a power of two >= 16"
    grp = hq // hkv
    out = torch.zeros((hkv, n), dtype=torch.float32, device=q.device)
    if n == 0 or t == 0:
        return out
    rows = t * grp
    low = _low(q)
    block_n = block_n or (128 if low else 64)
    block_m = block_m or ((128 if low else 64) if rows >= 256 else 16)
    grid = (hkv, triton.cdiv(rows, block_m))
    _page_mass[grid](q, lo.values, hi.values, lo.scale, hi.scale, out, rows, n, float(scale),
                     q.stride(0), q.stride(1), lo.values.stride(0), lo.values.stride(1),
                     hi.values.stride(0), hi.values.stride(1), lo.scale.stride(0),
                     hi.scale.stride(0), out.stride(0),
                     GRP=grp, D=d, BLOCK_M=block_m, BLOCK_N=block_n, LOW=low,
                     ONE=hi is lo, num_warps=num_warps)
    return out


def score_top_pages(q: torch.Tensor, lo: Summary, hi: Summary, k: int,
                    scale: float) -> torch.Tensor:
    from hisparse_cli.kernels.attention.page_score_ref import top_pages

    return top_pages(page_scores(q, lo, hi, scale), k)


@triton.jit(do_not_specialize=["s_lsh", "s_hsh"])  # the scales' head stride: a page count
def _ranged_mass(q_ptr, lo_ptr, hi_ptr, ls_ptr, hs_ptr, rng_ptr, out_ptr, n_rows, n_pages,
                 scale, s_qt, s_qh, s_lh, s_ln, s_hh, s_hn, s_lsh, s_hsh, s_oh,
                 GRP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, LOW: tl.constexpr, ONE: tl.constexpr):
    """out[kvh, page] = the largest over the rows (<= BLOCK_M: one tile) of the softmax over
    the pages in [first, first + n) (rng_ptr, read here: no host read) of their bounds; -1 for
    every other page. One program per KV head: pass 1 over the pages in range keeps each row's max
    and sum of exp (online), pass 2 writes every page."""
    kvh = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    qp, qn, row_ok, dd = _query_rows(q_ptr, kvh, rows, n_rows, s_qt, s_qh, GRP, D, LOW, ONE)
    first = tl.load(rng_ptr)
    last = tl.minimum(first + tl.load(rng_ptr + 1), n_pages)
    lo_h, hi_h = lo_ptr + kvh * s_lh, hi_ptr + kvh * s_hh
    ls_h, hs_h = ls_ptr + kvh * s_lsh, hs_ptr + kvh * s_hsh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for start in range(first - first % BLOCK_N, last, BLOCK_N):  # pass 1: the range's tiles
        pg = start + tl.arange(0, BLOCK_N)
        inside = (pg >= first) & (pg < last)
        s = _tile_scores(qp, qn, lo_h, hi_h, ls_h, hs_h, pg, inside, dd, s_ln, s_hn, scale,
                         LOW, ONE)
        s = tl.where(inside[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no page yet
        l_i = l_i * tl.exp(m_i - safe) + tl.sum(tl.exp(s - safe[:, None]), axis=1)
        m_i = m_new
    inv = tl.where(row_ok & (l_i > 0), 1.0 / l_i, 0.0)
    m_i = tl.where(m_i == float("-inf"), 0.0, m_i)  # (such a row adds nothing: inv is 0)
    for start in range(0, n_pages, BLOCK_N):  # pass 2: every page (-1 outside the range)
        pg = start + tl.arange(0, BLOCK_N)
        inside = (pg >= first) & (pg < last)
        s = _tile_scores(qp, qn, lo_h, hi_h, ls_h, hs_h, pg, inside, dd, s_ln, s_hn, scale,
                         LOW, ONE)
        p = tl.exp(s - m_i[:, None]) * inv[:, None]
        p = tl.where(row_ok[:, None] & inside[None, :], p, 0.0)
        tl.store(out_ptr + kvh * s_oh + pg, tl.where(inside, tl.max(p, axis=0), -1.0),
                 mask=pg < n_pages)


MAX_RANGED_ROWS = 64  # page_scores_in_range's rows (T x grp) in one tile; more: the reference


def page_scores_in_range(q: torch.Tensor, lo: Summary, hi: Summary, rng: torch.Tensor,
                         scale: float, block_n: int = 64) -> torch.Tensor:
    """page_score_ref.page_scores_in_range: whole summary tables lo, hi ([Hkv, P, D]) and the
    device range rng = (first, n), one program per KV head (`_ranged_mass`; a decode step's
    choice passes every layer's KV heads as the heads: hundreds of programs). Static shapes:
    a CUDA graph captures it (one launch, no temporaries but the [Hkv, P] scores)."""
    from hisparse_cli.kernels.attention.page_score_ref import page_scores_in_range as reference

    t, hq, d = q.shape
    hkv, n, _ = lo.values.shape
    rows = t * (hq // hkv)
    if rows > MAX_RANGED_ROWS or d < 16 or d & (d - 1):
        return reference(q, lo, hi, rng, scale)
    _check(q, lo, hi)
    out = torch.empty((hkv, n), dtype=torch.float32, device=q.device)
    _ranged_mass[(hkv,)](
        q, lo.values, hi.values, lo.scale, hi.scale, rng, out, rows, n, float(scale),
        q.stride(0), q.stride(1), lo.values.stride(0), lo.values.stride(1),
        hi.values.stride(0), hi.values.stride(1), lo.scale.stride(0), hi.scale.stride(0),
        out.stride(0), GRP=hq // hkv, D=d, BLOCK_M=max(16, triton.next_power_of_2(rows)),
        BLOCK_N=block_n, LOW=_low(q), ONE=hi is lo)
    return out


__all__ = ["page_scores", "score_top_pages", "page_scores_in_range"]
