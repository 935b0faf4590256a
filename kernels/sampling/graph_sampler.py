"""Greedy decoding's whole sampler inside the captured decode graph (the default on CUDA;
HISPARSE_GRAPH_SAMPLER=0 turns it off).

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
-inf gives 0: kernels/argmax_triton.py's rules).

Kernels (CUDA, or the Triton interpreter):
  _ban: one program: the n-gram matches over the generated tokens -> ban[id] = 1;
  _pick1: one program per BLOCK ids: penalty, ban (and clears it), suppression, the block's
    best (value, first index, first NaN);
  _pick2: one program: the winner -> the step's input token, the history, seen; count + 1.
The CPU runs the same state through torch (`_torch_step`).
"""

from __future__ import annotations

import os

import numpy as np
import torch
import triton
import triton.language as tl

from hisparse_cli.kernels.sampling.argmax_triton import (BLOCK, MAX_SUPPRESS, blocks_winner,
                                                 store_block_best)

BAN_BLOCK = 256  # n-gram windows a loop turn


def enabled() -> bool:
    """Greedy CUDA-graph decodes sample inside the graph unless HISPARSE_GRAPH_SAMPLER=0
    (H200 runs 158-159: the same tokens as the host loop; 2.4 % faster INT4 decode at the
    CLI's sampler settings, within 2 % either way at plain greedy)."""
    return os.environ.get("HISPARSE_GRAPH_SAMPLER", "").strip() != "0"


@triton.jit
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


@triton.jit
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


@triton.jit
def _pick2(vals_ptr, idx_ptr, nan_ptr, nb, n, out_ptr, toks_ptr, cap, seen_ptr, count_ptr,
           PEN: tl.constexpr, NB: tl.constexpr):
    tok = blocks_winner(vals_ptr, idx_ptr, nan_ptr, nb, n, NB)
    count = tl.load(count_ptr)
    tl.store(out_ptr, tok)
    tl.store(toks_ptr + count, tok, mask=count < cap)
    if PEN:
        tl.store(seen_ptr + tok, 1)
    tl.store(count_ptr, count + 1)


class GraphSampler:
    """A greedy sampler whose state is on the device (module doc). One per GraphDecoder: the
    captured graph holds its buffers' addresses, so `reset` re-arms them for each generate and
    says whether the settings (which the graph also holds) changed."""

    @staticmethod
    def buffer_bytes(vocab: int, capacity: int) -> tuple[int, ...]:
        """Its device buffers' sizes, as __init__ allocates them (the planner's count)."""
        nb = triton.cdiv(vocab, BLOCK)
        return (vocab, vocab, 8, max(capacity, 1) * 8, MAX_SUPPRESS * 8, nb * 4, nb * 4, nb * 4)

    def __init__(self, vocab: int, capacity: int, device: torch.device) -> None:
        self.vocab, self.capacity, self.device = vocab, max(capacity, 1), device
        self.seen = torch.zeros(vocab, dtype=torch.uint8, device=device)
        self.ban = torch.zeros(vocab, dtype=torch.uint8, device=device)
        self.count = torch.zeros(1, dtype=torch.int64, device=device)
        self.toks = torch.zeros(self.capacity, dtype=torch.int64, device=device)
        self.sup = torch.zeros(MAX_SUPPRESS, dtype=torch.int64, device=device)
        self.key: tuple | None = None
        nb = triton.cdiv(vocab, BLOCK)
        self.scratch = (torch.empty(nb, dtype=torch.float32, device=device),
                        torch.empty(nb, dtype=torch.int32, device=device),
                        torch.empty(nb, dtype=torch.int32, device=device))

    @staticmethod
    def serves(gen, eos) -> bool:
        """Greedy, with at most MAX_SUPPRESS EOS ids to suppress."""
        return gen.temperature == 0 and len(eos) <= MAX_SUPPRESS

    def reset(self, gen, eos) -> bool:
        """Arm the state for a new generate (nothing generated); True when the settings differ
        from the last ones (a graph captured with those must be captured again)."""
        sup = tuple(sorted(eos)) if gen.min_new_tokens > 0 else ()
        key = (float(gen.repetition_penalty), int(gen.no_repeat_ngram_size),
               int(gen.min_new_tokens), sup)
        changed = key != self.key
        self.key = key
        self.penalty, self.n, self.min_new = key[0], key[1], key[2]
        self.inv_penalty = float(np.float32(1.0) / np.float32(self.penalty))
        self.n_sup = len(sup)
        if sup:  # (pinned and asynchronous: no wait for the device)
            from hisparse_cli.engine.kv_cache import int64_to_device

            self.sup[:len(sup)].copy_(int64_to_device(list(sup), self.device))
        self.seen.zero_()
        self.ban.zero_()
        self.count.zero_()
        return changed

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """x: the logits row [V] (any float dtype); out: [1] int64, the step's input token.
        Appends the pick to self.toks; nothing here waits for the device."""
        if x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
            self._triton_step(x.contiguous(), out)
        else:
            self._torch_step(x, out)

    def _triton_step(self, x: torch.Tensor, out: torch.Tensor) -> None:
        n = x.shape[0]
        pen = self.penalty != 1.0
        if self.n:
            _ban[(1,)](self.toks, self.count, self.ban, self.capacity, N=self.n,
                       BAN_BLOCK=BAN_BLOCK,
                       num_warps=4)
        vals, idx, nan = self.scratch
        nb = vals.shape[0]
        _pick1[(nb,)](x, n, self.seen, self.ban, self.count, self.sup, vals, idx, nan,
                      self.penalty, self.inv_penalty, self.min_new, PEN=pen, NG=self.n > 0,
                      S=self.n_sup,
                      BLOCK=BLOCK, num_warps=4)
        _pick2[(1,)](vals, idx, nan, nb, n, out, self.toks, self.capacity, self.seen,
                     self.count, PEN=pen, NB=max(16, triton.next_power_of_2(nb)), num_warps=4)

    def _torch_step(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """The same step in torch (the CPU; DeviceSampler's operations on this state)."""
        from hisparse_cli.kernels.sampling.argmax_triton import greedy_pick

        count = int(self.count[0])
        x = x.float()
        if self.penalty != 1.0:
            pen = torch.where(x > 0, x / self.penalty, x * self.penalty)
            x = torch.where(self.seen.bool(), pen, x)
        length = min(count, self.capacity)  # the history (as _ban reads it)
        if self.n and length >= self.n - 1 and length > 0:
            n, h = self.n, self.toks[:length]
            starts = length - n + 1
            if n == 1:
                x = x.index_fill(0, h, float("-inf"))
            elif starts > 0:
                windows = h.unfold(0, n - 1, 1)[:starts]
                match = (windows == h[length - n + 1:]).all(dim=1)
                x = x.index_fill(0, h[n - 1:length][match], float("-inf"))
        sup = self.sup[:self.n_sup] if self.n_sup and count < self.min_new else None
        tok = greedy_pick(x, sup)
        out.copy_(tok.reshape(1))
        if count < self.capacity:
            self.toks[count] = tok.reshape(())
        if self.penalty != 1.0:
            self.seen[tok.reshape(())] = 1
        self.count += 1
