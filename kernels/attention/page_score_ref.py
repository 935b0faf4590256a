"""Torch reference of the retrieval tier's page kernels (runs on any device; test oracle).

Layouts (shared with page_score_triton.py):
    pages:     [Hkv, n, bs, D]   keys of n offloaded pages of one layer, per KV head
    summary:   (lo, hi) each a `Summary` of [Hkv, n, D]: "minmax" = per-channel min and max
               of the page's keys (Quest); "mean" = (mean key, mean key): the same scoring
               formula then gives q . mean. Stored in INT8 with one fp32 scale per page and
               KV head (symmetric: absmax / 127), a quarter of an fp32 cache's bytes and half
               of an fp16 one's: min rounds down and max up, so the dequantized min/max still
               bound every key of the page; the mean rounds to nearest
    q:         [T, Hq, D] the step's queries (after RoPE); GQA: query head h reads KV head
               h // (Hq // Hkv)
Page score (per KV head): each query row (a step's query x a query head of the KV head) rates
every page by the bound b = sum_d max(q_d * lo_d, q_d * hi_d) = q+ . hi + q- . lo (q+ =
max(q, 0), q- = min(q, 0)); for "minmax" an upper bound of q . k over the page's keys, for
"mean" q . mean key. Each row's estimated attention over the pages is the softmax over pages of
(scale * b), and a page's score is the largest probability any row gives it: the pages a few
rows want strongly (a copy head reading a passage seen once) are kept beside those the rows
want broadly. QUALITY.md measured it against the mass summed over the rows (what an attention
recall maximises) on 12 eval_dev documents at the same resident KV (SmolLM2, ~7K tokens): the
long-range retention ratio -0.48 [-0.97, -0.12], KL, top-1 and perplexity unchanged, recall
-0.006. (An earlier 2K-token study had found the summed mass far ahead of Quest's decode rule,
the largest unnormalised bound over the rows: retention ratio 2.66 against 7.18. The largest
here is taken over each row's normalised probabilities.) A prefill chunk's rows are its
queries pooled over 4 positions (`pool_queries`, by engine/retrieval.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

QMAX = 127  # symmetric INT8: values in [-127, 127]


class Summary(NamedTuple):
    """Page key summaries [..., n, D] as INT8 values and one fp32 scale a page [..., n]: the
    summary is values * scale (module doc)."""

    values: torch.Tensor  # int8 [..., n, D]
    scale: torch.Tensor  # float32 [..., n]

    def dequantize(self) -> torch.Tensor:
        """[..., n, D] float32."""
        return self.values.float() * self.scale.unsqueeze(-1)

    def pages(self, first: int, last: int) -> "Summary":
        """The pages [first, last) of every head (views)."""
        return Summary(self.values[..., first:last, :], self.scale[..., first:last])

    def heads_flat(self, heads: int) -> "Summary":
        """[L, Hkv, P, ...] seen as [heads = L * Hkv, P, ...] (views)."""
        return Summary(self.values.view(heads, *self.values.shape[-2:]),
                       self.scale.view(heads, self.scale.shape[-1]))


def quantize_summary(x: torch.Tensor, rounding: str = "nearest") -> Summary:
    """x [..., n, D] as a Summary: scale = absmax over D / 127 per page (1 for an all-zero
    page); rounding "down" (floor) for a minimum, "up" (ceil) for a maximum, so that the
    dequantized bound still holds, "nearest" otherwise."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / QMAX, 1.0)
    r = xf / scale.unsqueeze(-1)
    {"nearest": r.round_, "down": r.floor_, "up": r.ceil_}[rounding]()
    return Summary(r.clamp_(-QMAX, QMAX).to(torch.int8), scale)


def page_summary(pages: torch.Tensor, kind: str) -> tuple[Summary, Summary]:
    """(lo, hi) of pages [..., n, bs, D], each [..., n, D] in INT8 (module doc)."""
    if kind == "minmax":
        return (quantize_summary(pages.amin(dim=-2), "down"),
                quantize_summary(pages.amax(dim=-2), "up"))
    if kind == "mean":
        m = quantize_summary(pages.mean(dim=-2, dtype=torch.float32))
        return m, m
    raise ValueError(f"unknown summary kind {kind!r}")


def page_bounds(q: torch.Tensor, lo: Summary, hi: Summary, scale: float) -> torch.Tensor:
    """[Hkv, T * grp, n] fp32: scale * the bound of every query row against every page."""
    t, hq, d = q.shape
    hkv = lo.values.shape[0]
    grp = hq // hkv
    qf = q.float().reshape(t, hkv, grp, d).permute(1, 0, 2, 3).reshape(hkv, t * grp, d)
    lo_f = lo.dequantize()
    if hi is lo:  # the mean: q+ . m + q- . m = q . m, one product
        return torch.bmm(qf, lo_f.transpose(1, 2)).mul_(scale)  # [Hkv, T*grp, n]
    s = torch.bmm(qf.clamp(min=0), hi.dequantize().transpose(1, 2))
    s += torch.bmm(qf.clamp(max=0), lo_f.transpose(1, 2))
    return s.mul_(scale)


def pool_queries(q: torch.Tensor, n: int) -> torch.Tensor:
    """[ceil(T / n), Hq, D]: the mean of every n consecutive queries of q [T, Hq, D] (per query
    head; the last group holds the T % n left over), in q's type; q itself for n <= 1."""
    t = q.shape[0]
    if n <= 1 or t <= 1:
        return q
    full = t - t % n
    parts = [q[:full].unflatten(0, (full // n, n)).mean(dim=1)] if full else []
    if full < t:
        parts.append(q[full:].mean(dim=0, keepdim=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def page_scores(q: torch.Tensor, lo: Summary, hi: Summary, scale: float) -> torch.Tensor:
    """[Hkv, n] fp32: each page's score (module doc) for the step's queries q [T, Hq, D]: the
    largest probability any row gives it."""
    return torch.softmax(page_bounds(q, lo, hi, scale), dim=-1).amax(dim=1)


def in_range(n_pages: int, rng: torch.Tensor) -> torch.Tensor:
    """[n_pages] bool: the pages p with first <= p < first + n, rng = (first, n) an int64
    device tensor (read on the device: no host synchronisation)."""
    ar = torch.arange(n_pages, device=rng.device)
    return (ar >= rng[0]) & (ar < rng[0] + rng[1])


def scores_from_bounds(bounds: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
    """[Hkv, P] page scores from the bounds [Hkv, rows, P] of the pages `inside` [P] (the
    softmax runs over those alone); every other page scores -1 (with no page inside, the
    softmax's NaN rows are all overwritten so)."""
    b = bounds.masked_fill(~inside, float("-inf"))
    return torch.softmax(b, dim=-1).amax(dim=1).masked_fill_(~inside, -1.0)


def page_scores_in_range(q: torch.Tensor, lo: Summary, hi: Summary, rng: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """[Hkv, P] fp32 over whole summary tables lo, hi ([Hkv, P, D]): the pages in the range
    rng = (first, n) (an int64 device tensor) score as page_scores over that slice would score
    them; every other page -1. Static shapes, no host read of the range (CUDA-graph decode)."""
    return scores_from_bounds(page_bounds(q, lo, hi, scale),
                              in_range(lo.values.shape[1], rng))


def top_valid_pages(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[Hkv, k] int64: the (up to) k best pages of scores [Hkv, P] whose score is >= 0, in
    no particular order, -1 in the other entries (the page cache places picks in page order
    whatever their order: page_cache_ref.place_pages)."""
    hkv, p = scores.shape
    kk = min(k, p)
    vals, idx = torch.topk(scores, kk, dim=-1, sorted=False)
    idx = torch.where(vals >= 0, idx, -1)
    if kk < k:
        idx = torch.cat([idx, idx.new_full((hkv, k - kk), -1)], dim=1)
    return idx


def top_pages(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[Hkv, k] int64: the k best pages of each KV head (k <= n), in ascending page order."""
    idx = torch.topk(scores, k, dim=-1, sorted=False).indices
    return idx.sort(dim=-1).values


def score_top_pages(q: torch.Tensor, lo: Summary, hi: Summary, k: int,
                    scale: float) -> torch.Tensor:
    """top_pages(page_scores(q, lo, hi, scale), k): the pages a step retrieves, per KV head."""
    return top_pages(page_scores(q, lo, hi, scale), k)


__all__ = ["Summary", "quantize_summary", "page_summary", "page_bounds", "pool_queries",
           "page_scores", "in_range", "scores_from_bounds", "page_scores_in_range", "top_pages",
           "top_valid_pages", "score_top_pages"]
