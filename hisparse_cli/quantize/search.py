"""The AWQ searches on one group of linears, as pure tensor functions (no model code).

Scale search (activation-aware scaling): the linears of a group read the same input X [T, in].
Multiplying weight column i by s_i and dividing the input channel by s_i (folded into the
previous op) is exact in floating point arithmetic, but changes what INT4 rounding destroys:
salient channels (large mean |x|) get finer steps. With per-channel statistics
x_mean = mean_t |x_ti| and w_mean = mean over rows of |w| / (its group max), candidates are
    s(alpha) = x_mean^alpha / w_mean^(1 - alpha),  alpha in {0, 1/n, ..., (n-1)/n}
normalised to geometric mean 1, plus s = 1 (plain round-to-nearest). The winner minimises the
group's output error on calibration tokens, so it is never worse than RTN on that objective.

Clip search: per (output row, input group) the quantization range [min, max] shrinks by
r in {1, 1 - 1/n, ..., 1 - max_shrink}; the r minimising the mean squared partial output
(x_g . (w_g - Q(w_g)))^2 over calibration tokens wins (r = 1 is a candidate).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hisparse_cli.kernels.int4.awq_pack import fake_quantize


@dataclass(frozen=True)
class ScaleResult:
    scales: torch.Tensor  # [in] fp32, the winning s (ones when RTN won)
    alpha: float | None  # winning exponent; None when s = 1 won
    rtn_loss: float  # objective with s = 1
    loss: float  # objective with the winner


def weight_salience(weights: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """Mean over all rows of |w| / max|w| of its (row, group): [in]."""
    w = torch.cat([x.float() for x in weights], 0)  # [sum_out, in]
    out, inf = w.shape
    g = w.abs().view(out, inf // group_size, group_size)
    g = g / g.amax(-1, keepdim=True).clamp(min=1e-8)
    return g.view(out, inf).mean(0)


def linear_outputs_loss(x: torch.Tensor, weights: list[torch.Tensor]
                        ) -> Callable[[list[torch.Tensor]], float]:
    """Objective: mean squared error of the group's outputs x @ w.T, summed over linears.

    With more rows than input channels the error of D = w - q is read off the Gram matrix,
    mean((x D^T)^2) = sum((D G) * D) / (T * out) with G = x^T x: same value, less work.
    """
    x = x.float()
    ws = [w.float() for w in weights]
    t, d = x.shape
    gram = x.t() @ x if t > d else None  # [in, in]

    def loss(qweights: list[torch.Tensor]) -> float:
        total = 0.0
        for w, q in zip(ws, qweights):
            diff = w - q.float()  # [out, in]
            if gram is not None:
                total += float(((diff @ gram) * diff).sum()) / (t * diff.shape[0])
            else:
                total += float((x @ diff.t()).pow(2).mean())
        return total

    return loss


def gated_mlp_loss(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                   act: Callable[[torch.Tensor], torch.Tensor]
                   ) -> Callable[[list[torch.Tensor]], float]:
    """Objective for [gate, up]: MSE of the whole MLP output down(act(x Wg) * (x Wu))."""
    down = down.float()
    ref = (act(x @ gate.float().t()) * (x @ up.float().t())) @ down.t()

    def loss(qweights: list[torch.Tensor]) -> float:
        qg, qu = qweights
        return float(((act(x @ qg.t()) * (x @ qu.t())) @ down.t() - ref).pow(2).mean())

    return loss


def search_scale(x_mean: torch.Tensor, weights: list[torch.Tensor], group_size: int,
                 loss: Callable[[list[torch.Tensor]], float], n_grid: int = 20) -> ScaleResult:
    """Grid search of the AWQ scaling exponent (see module doc). x_mean: [in]."""
    ws = [w.float() for w in weights]
    x_mean = x_mean.float().clamp(min=1e-6)
    w_mean = weight_salience(ws, group_size).clamp(min=1e-6)
    rtn = loss([fake_quantize(w, group_size) for w in ws])
    best = ScaleResult(torch.ones_like(x_mean), None, rtn, rtn)
    for i in range(n_grid):
        alpha = i / n_grid
        s = x_mean.pow(alpha) / w_mean.pow(1.0 - alpha)
        s = s / (s.max() * s.min()).sqrt()
        s = s.clamp(min=1e-4, max=1e4)
        err = loss([fake_quantize(w * s, group_size) / s for w in ws])
        if err < best.loss:
            best = ScaleResult(s, alpha, rtn, err)
    return best


def search_clip(x: torch.Tensor, w: torch.Tensor, group_size: int, n_grid: int = 20,
                max_shrink: float = 0.5, chunk_elems: int = 1 << 24
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(row, group) quantization range minimising the partial-output error.

    x: [T, in] calibration inputs (already divided by the group's scales), w: [out, in].
    The error of row r, group g is mean_t (x_tg . d_rg)^2 = d_rg G_g d_rg / T with the
    group's Gram block G_g = x_g^T x_g [G, G]. Returns (wmin, wmax) [out, in/group] for
    awq_pack.quantize_weight.
    """
    w = w.float()
    out, inf = w.shape
    ng = inf // group_size
    xg = x.float().view(-1, ng, group_size).transpose(0, 1)  # [ng, T, G]
    gram = xg.transpose(1, 2) @ xg  # [ng, G, G]
    rows = max(8, chunk_elems // inf)  # bounds the [rows, in] temporaries
    lo_all = torch.empty(out, ng, device=w.device)
    hi_all = torch.empty(out, ng, device=w.device)
    steps = int(round(max_shrink * n_grid))
    for r0 in range(0, out, rows):
        wc = w[r0:r0 + rows]  # [R, in]
        lo0, hi0 = torch.aminmax(wc.view(-1, ng, group_size), dim=-1)  # [R, ng]
        best_err = torch.full_like(lo0, float("inf"))
        best_lo, best_hi = lo0.clone(), hi0.clone()
        for i in range(steps + 1):
            r = 1.0 - i / n_grid
            lo, hi = lo0 * r, hi0 * r
            diff = (wc - fake_quantize(wc, group_size, lo, hi)).view(-1, ng, group_size)
            diff = diff.transpose(0, 1)  # [ng, R, G]
            err = ((diff @ gram) * diff).sum(-1).t()  # [R, ng]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_lo = torch.where(better, lo, best_lo)
            best_hi = torch.where(better, hi, best_hi)
        lo_all[r0:r0 + rows] = best_lo
        hi_all[r0:r0 + rows] = best_hi
    return lo_all, hi_all
