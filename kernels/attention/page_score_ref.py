"""Torch reference of the retrieval tier's page kernels (runs on any device; test oracle).

Layouts (shared with page_score_triton.py):
    pages:     [Hkv, n, bs, D]   keys of n offloaded pages of one layer, per KV head
    summary:   (lo, hi) [Hkv, n, D] each: "minmax" = per-channel min and max of the page's
               keys (Quest); "mean" = (mean key, mean key): the same scoring formula then
               gives q . mean
    q:         [T, Hq, D] the step's queries (after RoPE); GQA: query head h reads KV head
               h // (Hq // Hkv)
Page score (per KV head): each query row (a step's query x a query head of the KV head) rates
every page by the bound b = sum_d max(q_d * lo_d, q_d * hi_d) = q+ . hi + q- . lo (q+ =
max(q, 0), q- = min(q, 0)); for "minmax" an upper bound of q . k over the page's keys, for
"mean" q . mean key. A page's score is its estimated attention mass summed over the rows:
sum over rows of softmax over pages of (scale * b). Against the largest bound over the rows
(Quest's decode rule), on a 2K-token eval_dev document with 256 retrieved tokens per layer
and KV head (SmolLM2, prefill chunks of 128): recall 0.9375 vs 0.9357 (minmax), 0.9454 vs
0.9428 (mean), long-range retention ratio 2.66 vs 7.18 (mean): a chunk's queries share one
set of pages, and the mass sum picks the pages most of them want.
"""

from __future__ import annotations

import torch


def page_summary(pages: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) [..., n, D] of pages [..., n, bs, D], in the pages' dtype (module doc)."""
    if kind == "minmax":
        return pages.amin(dim=-2), pages.amax(dim=-2)
    if kind == "mean":
        m = pages.float().mean(dim=-2).to(pages.dtype)
        return m, m
    raise ValueError(f"unknown summary kind {kind!r}")


def page_scores(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                scale: float) -> torch.Tensor:
    """[Hkv, n] fp32: each page's score (module doc) for the step's queries q [T, Hq, D]."""
    t, hq, d = q.shape
    hkv = lo.shape[0]
    grp = hq // hkv
    qf = q.float().reshape(t, hkv, grp, d).permute(1, 0, 2, 3).reshape(hkv, t * grp, d)
    s = torch.bmm(qf.clamp(min=0), hi.float().transpose(1, 2))  # [Hkv, T*grp, n]
    s += torch.bmm(qf.clamp(max=0), lo.float().transpose(1, 2))
    return torch.softmax(s.mul_(scale), dim=-1).sum(dim=1)


def top_pages(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[Hkv, k] int64: the k best pages of each KV head (k <= n), in ascending page order."""
    idx = torch.topk(scores, k, dim=-1, sorted=False).indices
    return idx.sort(dim=-1).values


def score_top_pages(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k: int,
                    scale: float) -> torch.Tensor:
    """top_pages(page_scores(q, lo, hi, scale), k): the pages a step retrieves, per KV head."""
    return top_pages(page_scores(q, lo, hi, scale), k)


def gather_pages(dst: torch.Tensor, src: torch.Tensor, heads: torch.Tensor,
                 slots: torch.Tensor, rows: torch.Tensor) -> None:
    """dst[heads[i], slots[i]] = src[heads[i], rows[i]] for every i: pages of the offload
    store (src [Hkv, R, bs, D], any strides) copied into page-cache slots (dst [Hkv, S, bs, D],
    any strides), bit for bit (the same dtype)."""
    assert dst.dtype == src.dtype and dst.shape[0] == src.shape[0]
    assert dst.shape[2:] == src.shape[2:], (dst.shape, src.shape)
    assert heads.shape == slots.shape == rows.shape
    if heads.numel():
        dst[heads, slots] = src[heads, rows]


__all__ = ["page_summary", "page_scores", "top_pages", "score_top_pages", "gather_pages"]
