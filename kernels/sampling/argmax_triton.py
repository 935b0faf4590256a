"""Greedy decoding's token pick: the argmax of one logits row, optional ids suppressed, on the GPU.

`torch.argmax` over a 128K-entry row is one single-pass reduction that took 27.6 us a token on
the H200 (run 134, `gpu_decode.py profile`: 1 % of an INT4 step, the largest kernel between
two decode graph replays); and a suppressed EOS (min_new_tokens) cost a clone and an
index_fill before it. Here two small kernels do both: stage 1, one program per BLOCK entries,
masks the suppressed ids and keeps its block's best (value, first index, first NaN index);
stage 2, one program, picks the winner and writes it as int64.

Semantics are torch.argmax's: the first index of the maximum; NaN counts as larger than any
number (the first NaN wins); all -inf gives index 0. Suppressed ids are treated as -inf.

`greedy_pick(x, suppress=None, out=None)`: x [V] on any device (CPU: torch.argmax after the
same masking), suppress int64 ids [S] on x's device or None; returns out (int64 [1]).
Oracle: torch.argmax on a masked copy (tests/test_argmax_triton.py; under TRITON_INTERPRET=1 on
the CPU, on CUDA with the gpu marker).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
MAX_SUPPRESS = 16  # ids masked in-kernel; longer lists are masked by index_fill on a copy


@triton.jit
def store_block_best(x, offs, inside, n, pid, vals_ptr, idx_ptr, nan_ptr):
    """Stage 1's end (also kernels/sampling/graph_sampler.py's): the block's best value, its first
    index and its first NaN's index (n: none) into the scratch at pid."""
    isnan = (x != x) & inside
    first_nan = tl.min(tl.where(isnan, offs, n), axis=0)  # n: no NaN here
    best = tl.max(tl.where(isnan, float("-inf"), x), axis=0)
    first = tl.min(tl.where((x == best) & inside, offs, n), axis=0)
    tl.store(vals_ptr + pid, best)
    tl.store(idx_ptr + pid, first)
    tl.store(nan_ptr + pid, first_nan)


@triton.jit
def blocks_winner(vals_ptr, idx_ptr, nan_ptr, nb, n, NB: tl.constexpr):
    """Stage 2 (also kernels/sampling/graph_sampler.py's): the winner over the nb blocks' bests, int64."""
    b = tl.arange(0, NB)
    ok = b < nb
    v = tl.load(vals_ptr + b, mask=ok, other=float("-inf"))
    i = tl.load(idx_ptr + b, mask=ok, other=n)
    first_nan = tl.min(tl.load(nan_ptr + b, mask=ok, other=n), axis=0)
    best = tl.max(v, axis=0)
    first = tl.min(tl.where(ok & (v == best), i, n), axis=0)  # blocks are in index order
    first = tl.where(first == n, 0, first)  # every entry -inf
    return tl.where(first_nan < n, first_nan, first).to(tl.int64)


@triton.jit
def _stage1(x_ptr, n, sup_ptr, vals_ptr, idx_ptr, nan_ptr,
            S: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    x = tl.load(x_ptr + offs, mask=inside, other=float("-inf")).to(tl.float32)
    for s in tl.static_range(S):
        sid = tl.load(sup_ptr + s)
        x = tl.where(offs == sid, float("-inf"), x)
    store_block_best(x, offs, inside, n, pid, vals_ptr, idx_ptr, nan_ptr)


@triton.jit
def _stage2(vals_ptr, idx_ptr, nan_ptr, nb, n, out_ptr, NB: tl.constexpr):
    tl.store(out_ptr, blocks_winner(vals_ptr, idx_ptr, nan_ptr, nb, n, NB))


class _Scratch:
    """Per-device stage-1 buffers, kept (a decode loop calls this every token)."""

    def __init__(self) -> None:
        self.bufs: dict[tuple, tuple[torch.Tensor, ...]] = {}

    def get(self, device: torch.device, nb: int) -> tuple[torch.Tensor, ...]:
        key = (device, nb)
        if key not in self.bufs:
            self.bufs[key] = (torch.empty(nb, dtype=torch.float32, device=device),
                              torch.empty(nb, dtype=torch.int32, device=device),
                              torch.empty(nb, dtype=torch.int32, device=device))
        return self.bufs[key]


_SCRATCH = _Scratch()


def greedy_pick_triton(x: torch.Tensor, suppress: torch.Tensor | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton path of greedy_pick (any device Triton runs on, the interpreter included)."""
    assert x.dim() == 1 and x.is_contiguous(), x.shape
    n = x.shape[0]
    assert 0 < n < 2**31 - 1
    if out is None:
        out = torch.empty(1, dtype=torch.int64, device=x.device)
    if suppress is not None and suppress.numel() > MAX_SUPPRESS:
        x = x.clone().index_fill_(0, suppress, float("-inf"))
        suppress = None
    s = 0 if suppress is None else suppress.numel()
    sup = suppress if s else out  # any pointer when S == 0 (never read)
    nb = triton.cdiv(n, BLOCK)
    vals, idx, nan = _SCRATCH.get(x.device, nb)
    _stage1[(nb,)](x, n, sup, vals, idx, nan, S=s, BLOCK=BLOCK, num_warps=4)
    _stage2[(1,)](vals, idx, nan, nb, n, out, NB=max(16, triton.next_power_of_2(nb)),
                  num_warps=4)
    return out


def greedy_pick(x: torch.Tensor, suppress: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """argmax of x [V] with the ids in suppress treated as -inf -> int64 [1] (out if given)."""
    if x.is_cuda:
        return greedy_pick_triton(x.contiguous(), suppress, out)
    if suppress is not None and suppress.numel():
        x = x.clone().index_fill_(0, suppress, float("-inf"))
    tok = torch.argmax(x).reshape(1)
    if out is None:
        return tok
    return out.copy_(tok)
