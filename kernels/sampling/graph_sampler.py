"""The kernels of greedy decoding's whole sampler inside the captured decode graph (the default
on CUDA; HISPARSE_GRAPH_SAMPLER=0 turns it off). Its state and the torch path of the same step
live in engine/sampling/graph.py (`GraphSampler`); `sample_step` launches the kernels on it.

engine/cuda_graph.py's `DeviceSampler` runs between two graph replays: with the CLI's default
repetition penalty and no-repeat n-gram ban that is ~15 small kernels and their launches a
token, plus the copies of the picked token into the step's input and the history. Here the
sampler's state lives on the device (seen tokens, the generated tokens, their count), so the
same work is three kernels the decode graph captures after the step itself, and the picked
token is written straight into the step's input: a token costs the host one input copy (the
position) and one replay.

Semantics are DeviceSampler's at temperature 0 (its torch code is the oracle,
tests/test_graph_sampler.py): the repetition penalty divides positive logits of seen tokens by
the penalty and multiplies the others; a token that would complete an n-gram already generated
is banned (generated tokens only); the EOS ids are suppressed while fewer than min_new_tokens
tokens were generated; then the first index of the maximum (NaN larger than any number, all
-inf gives 0: kernels/sampling/argmax_triton.py's rules).

Kernels (CUDA, or the Triton interpreter):
  _ban: one program: the n-gram matches over the generated tokens -> ban[id] = 1;
  _pick1: one program per BLOCK ids: penalty, ban (and clears it), suppression, the block's
    best (value, first index, first NaN);
  _pick2: one program: the winner -> the step's input token, the history, seen; count + 1.
The CPU runs the same state through torch (engine/sampling/graph.py).
The run's history capacity (`cap`, the prompt + new tokens of a generate) and min_new (the
guard's retries change it) are not specialized: they are compared with a count, and
specializing them would compile variants per document length for no gain.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hisparse_cli.kernels.sampling.argmax_triton import (BLOCK, MAX_SUPPRESS, blocks_winner,
                                                 store_block_best)

BAN_BLOCK = 256  # n-gram windows a loop turn


@triton.jit(do_not_specialize=["cap"])
def _ban(toks_ptr, count_ptr, ban_ptr, cap, N: tl.constexpr, BAN_BLOCK: tl.constexpr):
    # the history holds the first `cap` tokens: a graph replayed past the run's capacity (a
    # benchmark's replays) bans from those, and never reads past the buffer
    length = tl.minimum(tl.load(count_ptr), cap).to(tl.int32)
    starts = length - N + 1  # windows toks[j : j + N - 1] that a generated token follows
    for j0 in range(0, tl.maximum(starts, 0), BAN_BLOCK):
        j = j0 + tl.arange(0, BAN_BLOCK)
        match = j < starts
        for k in tl.static_range(N - 1):
            a = tl.load(toks_ptr + j + k, mask=match, other=-1)
            b = tl.load(toks_ptr + (starts + k) + j * 0, mask=match, other=-2)
            match = match & (a == b)
        nxt = tl.load(toks_ptr + j + (N - 1), mask=match, other=0)
        tl.store(ban_ptr + nxt, 1, mask=match)


@triton.jit(do_not_specialize=["min_new"])
def _pick1(x_ptr, n, seen_ptr, ban_ptr, count_ptr, sup_ptr, vals_ptr, idx_ptr, nan_ptr,
           penalty, inv_penalty, min_new, PEN: tl.constexpr, NG: tl.constexpr,
           S: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    x = tl.load(x_ptr + offs, mask=inside, other=float("-inf")).to(tl.float32)
    if PEN:
        seen = tl.load(seen_ptr + offs, mask=inside, other=0)
        # x / penalty as torch computes it on CUDA for a scalar divisor: x * (1 / penalty)
        x = tl.where(seen != 0, tl.where(x > 0, x * inv_penalty, x * penalty), x)
    if NG:
        b = tl.load(ban_ptr + offs, mask=inside, other=0)
        x = tl.where(b != 0, float("-inf"), x)
        tl.store(ban_ptr + offs, tl.zeros_like(b), mask=inside & (b != 0))  # clean for the next
    if S > 0:
        active = tl.load(count_ptr) < min_new
        for s in tl.static_range(S):
            sid = tl.load(sup_ptr + s)
            x = tl.where(active & (offs == sid), float("-inf"), x)
    store_block_best(x, offs, inside, n, pid, vals_ptr, idx_ptr, nan_ptr)


@triton.jit(do_not_specialize=["cap"])
def _pick2(vals_ptr, idx_ptr, nan_ptr, nb, n, out_ptr, toks_ptr, cap, seen_ptr, count_ptr,
           PEN: tl.constexpr, NB: tl.constexpr):
    tok = blocks_winner(vals_ptr, idx_ptr, nan_ptr, nb, n, NB)
    count = tl.load(count_ptr)
    tl.store(out_ptr, tok)
    tl.store(toks_ptr + count, tok, mask=count < cap)
    if PEN:
        tl.store(seen_ptr + tok, 1)
    tl.store(count_ptr, count + 1)


def sample_step(x: torch.Tensor, out: torch.Tensor, s) -> None:
    """One greedy step on the sampler state `s` (engine/sampling/graph.py's GraphSampler:
    toks, count, ban, seen, sup, scratch, capacity, penalty, inv_penalty, n, min_new, n_sup):
    x the contiguous logits row [V], out the [1] int64 step input the pick is written to."""
    n = x.shape[0]
    pen = s.penalty != 1.0
    if s.n:
        _ban[(1,)](s.toks, s.count, s.ban, s.capacity, N=s.n, BAN_BLOCK=BAN_BLOCK, num_warps=4)
    vals, idx, nan = s.scratch
    nb = vals.shape[0]
    _pick1[(nb,)](x, n, s.seen, s.ban, s.count, s.sup, vals, idx, nan, s.penalty,
                  s.inv_penalty, s.min_new, PEN=pen, NG=s.n > 0, S=s.n_sup, BLOCK=BLOCK,
                  num_warps=4)
    _pick2[(1,)](vals, idx, nan, nb, n, out, s.toks, s.capacity, s.seen, s.count, PEN=pen,
                 NB=max(16, triton.next_power_of_2(nb)), num_warps=4)

