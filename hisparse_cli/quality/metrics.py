"""Fidelity metrics of a sparse run against the dense run over the same tokens (pure torch).

    keep = kept_mask(q_pos, n_keys, sinks, window, gpos)     # [S, Hkv, N] bool
    r = attention_recall(q, k, q_pos, keep, scale)           # [S, Hq] in [0, 1]
    f = token_fidelity(dense_logits, sparse_logits, targets) # FidelitySums (additive)

Attention recall (Quest / SnapKV style): the share of the *dense* attention probability
of a query that falls on the keys the sparse run kept for it — sinks ∪ window ∪ the globals
its layer/KV head held at that step. 1.0 means the sparse set lost nothing the dense
softmax looked at. Token fidelity: KL(dense ‖ sparse) of the next-token distributions,
top-1 agreement, and the negative log-likelihoods of the actual next tokens under both
(perplexity ratio = exp(mean NLL sparse − mean NLL dense)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def kept_mask(q_pos: torch.Tensor, n_keys: int, sinks: int, window: int | None,
              gpos: torch.Tensor | None, num_kv_heads: int,
              window_start: torch.Tensor | None = None) -> torch.Tensor:
    """[S, Hkv, N] bool: keys 0..N-1 the sparse run let each query see.

    q_pos: [S] positions; gpos: [S, Hkv, G] globals in force at each query's step
    (-1 = empty slot) or None, with the retrieval tier also the positions its page cache
    showed (concatenated); the visibility rule is the engine's (sparsity.py). window_start:
    [S] the first window position of each query's step (the retrieval tier's whole window
    blocks), instead of `window`."""
    k_pos = torch.arange(n_keys, device=q_pos.device)
    causal = k_pos[None, :] <= q_pos[:, None]  # [S, N]
    if window is None:
        vis = causal
    elif window_start is not None:
        vis = causal & ((k_pos[None, :] < sinks) | (k_pos[None, :] >= window_start[:, None]))
    else:
        vis = causal & ((k_pos[None, :] < sinks) | (k_pos[None, :] > q_pos[:, None] - window))
    keep = vis[:, None, :].expand(-1, num_kv_heads, -1).clone()  # [S, Hkv, N]
    if gpos is not None and gpos.numel():
        ok = (gpos >= 0) & (gpos < n_keys)
        idx = torch.where(ok, gpos, torch.full_like(gpos, n_keys))  # invalid -> spare column
        extra = torch.zeros(keep.shape[:2] + (n_keys + 1,), dtype=torch.bool, device=keep.device)
        extra.scatter_(2, idx, True)
        keep |= extra[..., :n_keys]
    return keep


def attention_probs(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Dense causal softmax [S, Hq, N] of queries q [S, Hq, D] over keys k [N, Hkv, D]."""
    s, hq, d = q.shape
    n, hkv, _ = k.shape
    grp = hq // hkv
    kk = k.float().repeat_interleave(grp, dim=1)  # [N, Hq, D]
    scores = torch.einsum("shd,nhd->shn", q.float(), kk) * scale
    causal = torch.arange(n, device=q.device)[None, :] <= q_pos[:, None]  # [S, N]
    scores = scores.masked_fill(~causal[:, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1)


def attention_recall(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor,
                     keep: torch.Tensor, scale: float) -> torch.Tensor:
    """[S, Hq]: dense attention mass on the kept keys (keep: [S, Hkv, N] bool)."""
    p = attention_probs(q, k, q_pos, scale)  # [S, Hq, N]
    grp = q.shape[1] // k.shape[1]
    return (p * keep.repeat_interleave(grp, dim=1)).sum(-1).clamp(max=1.0)


def recall_ceiling(p: torch.Tensor, base: torch.Tensor, budget: int, num_kv_heads: int,
                   page: int = 1) -> torch.Tensor:
    """[S, Hq]: the most dense attention mass any selection of `budget` more keys can reach.

    p: [S, Hq, N] dense attention probabilities; base: [S, N] bool, the keys every selection
    keeps anyway (sinks and window). page == 1: each query head takes its own best `budget`
    keys (the token oracle: no method that keeps `budget` keys per head does better).
    page > 1: keys are taken in aligned pages of `page` positions, `budget // page` pages per
    KV head, the same pages for the KV head's query heads, chosen by their mass summed over
    those heads (the best a page-retrieval tier of that budget can do for one query). A budget
    of 0 or less keeps the base alone."""
    s, hq, n = p.shape
    grp = hq // num_kv_heads
    kept = (p * base[:, None, :]).sum(-1)
    rest = p.masked_fill(base[:, None, :], 0.0)
    if page == 1:
        k = max(0, min(budget, n))
        return (kept + rest.topk(k, dim=-1).values.sum(-1)).clamp(max=1.0) if k else kept
    pages = -(-n // page)
    k = max(0, min(budget // page, pages))
    if not k:
        return kept
    mass = torch.nn.functional.pad(rest, (0, pages * page - n)).view(s, hq, pages, page).sum(-1)
    per_kv = mass.view(s, num_kv_heads, grp, pages).sum(2)  # [S, Hkv, pages]
    top = per_kv.topk(k, dim=-1).indices
    chosen = torch.zeros_like(per_kv).scatter_(-1, top, 1.0).repeat_interleave(grp, dim=1)
    return (kept + (mass * chosen).sum(-1)).clamp(max=1.0)


@dataclass
class FidelitySums:
    """Additive sums over scored positions (merge with `+`)."""

    n: int = 0
    kl: float = 0.0
    agree: int = 0
    nll_dense: float = 0.0
    nll_sparse: float = 0.0

    def __add__(self, other: "FidelitySums") -> "FidelitySums":
        return FidelitySums(self.n + other.n, self.kl + other.kl, self.agree + other.agree,
                            self.nll_dense + other.nll_dense, self.nll_sparse + other.nll_sparse)

    @property
    def mean_kl(self) -> float:
        return self.kl / self.n if self.n else float("nan")

    @property
    def top1_agreement(self) -> float:
        return self.agree / self.n if self.n else float("nan")

    @property
    def ppl_dense(self) -> float:
        return math.exp(self.nll_dense / self.n) if self.n else float("nan")

    @property
    def ppl_sparse(self) -> float:
        return math.exp(self.nll_sparse / self.n) if self.n else float("nan")

    @property
    def ppl_ratio(self) -> float:
        return math.exp((self.nll_sparse - self.nll_dense) / self.n) if self.n else float("nan")

    def to_dict(self) -> dict:
        return {"positions": self.n, "kl": self.mean_kl, "top1_agreement": self.top1_agreement,
                "ppl_dense": self.ppl_dense, "ppl_sparse": self.ppl_sparse,
                "ppl_ratio": self.ppl_ratio}


def token_fidelity(dense_logits: torch.Tensor, sparse_logits: torch.Tensor,
                   targets: torch.Tensor) -> FidelitySums:
    """Sums over positions of KL(dense ‖ sparse), top-1 agreement and both NLLs of `targets`.
    dense_logits, sparse_logits: [n, V]; targets: [n] next-token ids."""
    if targets.numel() == 0:
        return FidelitySums()
    ld = torch.log_softmax(dense_logits.float(), dim=-1)
    ls = torch.log_softmax(sparse_logits.float(), dim=-1)
    kl = (ld.exp() * (ld - ls)).sum(-1).clamp(min=0.0)  # [n]
    agree = (ld.argmax(-1) == ls.argmax(-1)).sum()
    t = targets[:, None]
    return FidelitySums(n=int(targets.numel()), kl=float(kl.sum()), agree=int(agree),
                        nll_dense=float(-ld.gather(1, t).sum()),
                        nll_sparse=float(-ls.gather(1, t).sum()))


__all__ = ["kept_mask", "attention_probs", "attention_recall", "recall_ceiling", "FidelitySums",
           "token_fidelity"]
