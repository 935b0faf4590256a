"""The retrieval tier's sizes without torch, shared by the tier (engine/retrieval.py) and the
planner (planner/run.py), which must not import torch: the page summaries' bytes and the
offload copy's group of pages."""

from __future__ import annotations

COPY_GROUP_BYTES = 16 << 20  # the offload copy's largest side-stream temporary


def summary_bytes(heads: int, pages: int, d: int, kind: str) -> int:
    """Device bytes of the summaries of `pages` pages for `heads` (layer, KV head) pairs: per
    summary INT8 values [.., D] and an fp32 scale a page (page_score_ref.Summary); minmax keeps
    two summaries, mean one."""
    return (1 if kind == "mean" else 2) * heads * pages * (d + 4)


def copy_group_pages(page_k_bytes: int) -> int:
    """Pages a group of the offload copy takes: K (or V) bytes within COPY_GROUP_BYTES, >= 1."""
    return max(1, COPY_GROUP_BYTES // page_k_bytes)


__all__ = ["COPY_GROUP_BYTES", "summary_bytes", "copy_group_pages"]
