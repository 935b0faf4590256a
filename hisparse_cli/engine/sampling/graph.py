"""Greedy decoding's whole sampler inside the captured decode graph: its state on the device
(the default on CUDA; HISPARSE_GRAPH_SAMPLER=0 turns it off, config/execution.py).

engine/sampling/device.py's `DeviceSampler` runs between two graph replays: with the CLI's
default repetition penalty and no-repeat n-gram ban that is ~15 small kernels and their
launches a token, plus the copies of the picked token into the step's input and the history.
Here the sampler's state lives on the device (seen tokens, the generated tokens, their count),
so the same work is three kernels (kernels/sampling/graph_sampler.py) that the decode graph
captures after the step itself, and the picked token is written straight into the step's
input: a token costs the host one input copy (the position) and one replay.

Semantics are DeviceSampler's at temperature 0 (its torch code is the oracle,
tests/test_graph_sampler.py); the CPU runs the same state through torch (`_torch_step`).
"""

from __future__ import annotations

import numpy as np
import torch

from hisparse_cli.config.env import triton_interpret
from hisparse_cli.engine.kv_cache import int64_to_device


class GraphSampler:
    """A greedy sampler whose state is on the device (module doc). One per GraphDecoder: the
    captured graph holds its buffers' addresses, so `reset` re-arms them for each generate and
    says whether the settings (which the graph also holds) changed."""

    @staticmethod
    def buffer_bytes(vocab: int, capacity: int) -> tuple[int, ...]:
        """Its device buffers' sizes, as __init__ allocates them (the planner's count; the
        kernels' module, and triton with it, is imported only here and when sampling)."""
        from hisparse_cli.kernels.sampling.argmax_triton import BLOCK, MAX_SUPPRESS

        nb = -(-vocab // BLOCK)
        return (vocab, vocab, 8, max(capacity, 1) * 8, MAX_SUPPRESS * 8, nb * 4, nb * 4, nb * 4)

    def __init__(self, vocab: int, capacity: int, device: torch.device) -> None:
        from hisparse_cli.kernels.sampling.argmax_triton import BLOCK, MAX_SUPPRESS

        self.vocab, self.capacity, self.device = vocab, max(capacity, 1), device
        self.seen = torch.zeros(vocab, dtype=torch.uint8, device=device)
        self.ban = torch.zeros(vocab, dtype=torch.uint8, device=device)
        self.count = torch.zeros(1, dtype=torch.int64, device=device)
        self.toks = torch.zeros(self.capacity, dtype=torch.int64, device=device)
        self.sup = torch.zeros(MAX_SUPPRESS, dtype=torch.int64, device=device)
        self.key: tuple | None = None
        nb = -(-vocab // BLOCK)
        self.scratch = (torch.empty(nb, dtype=torch.float32, device=device),
                        torch.empty(nb, dtype=torch.int32, device=device),
                        torch.empty(nb, dtype=torch.int32, device=device))

    @staticmethod
    def serves(gen, eos) -> bool:
        """Greedy, with at most MAX_SUPPRESS EOS ids to suppress."""
        from hisparse_cli.kernels.sampling.argmax_triton import MAX_SUPPRESS

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
            self.sup[:len(sup)].copy_(int64_to_device(list(sup), self.device))
        self.seen.zero_()
        self.ban.zero_()
        self.count.zero_()
        return changed

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """x: the logits row [V] (any float dtype); out: [1] int64, the step's input token.
        Appends the pick to self.toks; nothing here waits for the device."""
        if x.is_cuda or triton_interpret():
            from hisparse_cli.kernels.sampling.graph_sampler import sample_step

            sample_step(x.contiguous(), out, self)
        else:
            self._torch_step(x, out)

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
