"""The retrieval tier's sizes without torch, shared by the tier (engine/retrieval.py) and the
planner (planner/run.py), which must not import torch: the page summaries' bytes and the
offload copy's group of pages, and the prefill scoring's query pooling."""

from __future__ import annotations

COPY_GROUP_BYTES = 16 << 20  # the offload copy's largest side-stream temporary

# A prefill chunk scores its pages from the mean query of every 4 consecutive positions
# (page_score_ref.pool_queries): on the CPU study (QUALITY.md, 12 eval_dev documents, SmolLM2,
# ~7K tokens, teacher-forced, paired against every query) long-range retention -0.37 [-1.39,
# +0.38], KL -0.003 [-0.006, +0.001], recall +0.002; 2 positions: KL -0.003 [-0.005, -0.002],
# retention -0.11. That holds for the mean-key summary: scoring with the exact keys instead,
# pooling lost most of their gain (retention 3.89 against 0.95 unpooled, QUALITY.md), so a
# sharper summary must re-measure it. The scoring reads a quarter of the rows (the GPU
# prefill's one per-layer cost that grows with the chunk).
QUERY_POOL = 4


def summary_bytes(heads: int, pages: int, d: int, kind: str) -> int:
    """Device bytes of the summaries of `pages` pages for `heads` (layer, KV head) pairs: per
    summary INT8 values [.., D] and an fp32 scale a page (page_score_ref.Summary); minmax keeps
    two summaries, mean one."""
    return (1 if kind == "mean" else 2) * heads * pages * (d + 4)


def pooled_queries(n: int) -> int:
    """Rows a prefill chunk of n queries scores with: ceil(n / QUERY_POOL) (n itself for n <= 1,
    page_score_ref.pool_queries)."""
    return n if n <= 1 else -(-n // QUERY_POOL)


def copy_group_pages(page_k_bytes: int) -> int:
    """Pages a group of the offload copy takes: K (or V) bytes within COPY_GROUP_BYTES, >= 1."""
    return max(1, COPY_GROUP_BYTES // page_k_bytes)


__all__ = ["COPY_GROUP_BYTES", "QUERY_POOL", "summary_bytes", "pooled_queries",
           "copy_group_pages"]
