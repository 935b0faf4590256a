"""One-row products (decode) on the CPU, spread over torch's threads.

MKL runs a one-row float32 product `x[1, in] @ W` on one thread whatever torch's thread count
(on the 2-core development machine a 576x3072 product took the same time with 1 and 2
threads). A batched product over `k` column slices of the same weight, `bmm(x expanded to
[k, 1, in], W as [k, in, out/k])`, runs the slices on different threads, and its output
[k, 1, out/k] is the [1, out] row in memory order (a view, no copy). Products of more than one
row (prefill) keep `F.linear`. docs/history/cpu-2026-12-01.md (seventh session) has the numbers.

The slices are views of the module's own weight, whichever way the loader laid it out
(`loader.converted`: [out, in] rows or input-major), so nothing is copied or kept twice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RowSplitLinear(nn.Linear):
    """nn.Linear whose one-row forward runs as `splits` column slices in one batched product."""

    splits: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] != 1:
            return F.linear(x, self.weight, self.bias)
        w, b = self.weight, self.bias
        if self._key != (w.data_ptr(), None if b is None else b.data_ptr()):
            self._slice()  # the parameters were replaced or moved since the views were made
        xb = x.expand(self.splits, 1, self.in_features)
        if self._b_slices is None:
            y = torch.bmm(xb, self._w_slices)
        else:
            y = torch.baddbmm(self._b_slices, xb, self._w_slices)
        return y.view(1, self.out_features)

    def _slice(self) -> None:
        k, w = self.splits, self.weight
        # [out, in] -> [in, out] -> [in, k, out/k] -> [k, in, out/k]: views for either layout
        self._w_slices = w.t().unflatten(1, (k, self.out_features // k)).transpose(0, 1)
        self._b_slices = None if self.bias is None else self.bias.view(k, 1, self.out_features // k)
        # plain attributes (a Parameter assigned to a Module attribute would register)
        self._key = (w.data_ptr(), None if self.bias is None else self.bias.data_ptr())

    @classmethod
    def wrap(cls, lin: nn.Linear, splits: int) -> "RowSplitLinear":
        """A RowSplitLinear holding `lin`'s own parameters (a tied head stays tied)."""
        with torch.device("meta"):
            new = cls(lin.in_features, lin.out_features, bias=lin.bias is not None)
        new.weight = lin.weight
        new.bias = lin.bias
        new.splits = splits
        new._slice()
        return new


MIN_SLICE = 128  # outputs per slice at least: narrower slices cost more than they spread


def row_splits(out_features: int, threads: int) -> int:
    """How many column slices a one-row product of `out_features` outputs runs as: one per
    thread, fewer where `out_features` does not divide evenly or a slice would be narrower
    than MIN_SLICE; 1 = a plain product. Measured with 2 threads only (the development
    machine); more slices than threads were no faster there."""
    for k in range(min(max(threads, 1), out_features // MIN_SLICE), 1, -1):
        if out_features % k == 0:
            return k
    return 1


@torch.no_grad()
def split_row_products(model: nn.Module, threads: int | None = None) -> int:
    """Replace (in place) every plain float32 CPU nn.Linear of `model` by a RowSplitLinear.
    Returns how many were replaced. Nothing happens with one thread or on another device."""
    threads = torch.get_num_threads() if threads is None else threads
    swaps = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if (type(child) is nn.Linear and child.weight.device.type == "cpu"
                    and child.weight.dtype == torch.float32):
                k = row_splits(child.out_features, threads)
                if k > 1:
                    swaps.append((parent, name, RowSplitLinear.wrap(child, k)))
    for parent, name, new in swaps:
        setattr(parent, name, new)
    return len(swaps)
