"""Sampling on the device between CUDA-graph replays: `DeviceSampler`.

Greedy / temperature + top-p sampling with a repetition penalty and no-repeat n-gram blocking,
all on the device (tensor shapes depend only on the step count, which the host knows, so
nothing here waits for the device). Engine._decode_graph uses it where the step does not sample
itself (engine/sampling/graph.py): sampling with temperature > 0, HISPARSE_GRAPH_SAMPLER=0, or
a host embedding table the device cannot read.
"""

from __future__ import annotations

import torch

from hisparse_cli.config.settings import GenerationConfig


class DeviceSampler:
    """Greedy / temperature + top-p sampling with a repetition penalty and no-repeat n-gram
    blocking, all on the device (tensor shapes depend only on the step count, which the host
    knows, so nothing here waits for the device; tests/test_cuda_graph.py checks on the GPU)."""

    @staticmethod
    def buffer_bytes(vocab: int, max_new_tokens: int) -> tuple[int, ...]:
        """Its device buffers' sizes (seen, history) and Engine._decode_graph's token buffer:
        the planner's count (planner_run.simulate_run)."""
        return (vocab, max(max_new_tokens, 1) * 8, max_new_tokens * 8)

    def __init__(self, gen: GenerationConfig, vocab: int, device: torch.device) -> None:
        self.gen = gen
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.hist = torch.zeros(max(gen.max_new_tokens, 1), dtype=torch.int64, device=device)
        self.count = 0
        self.rng = None
        if gen.temperature > 0:
            self.rng = torch.Generator(device=device)
            self.rng.manual_seed(gen.seed if gen.seed is not None else 0)

    def __call__(self, logits: torch.Tensor, suppress: torch.Tensor | None) -> torch.Tensor:
        from hisparse_cli.kernels.sampling.argmax_triton import greedy_pick

        g = self.gen
        x = logits[-1]  # [V]; copied before anything changes it (logits is the graph's buffer)
        if g.repetition_penalty != 1.0:
            pen = torch.where(x > 0, x / g.repetition_penalty, x * g.repetition_penalty)
            x = torch.where(self.seen, pen, x)
        ban = self._ngram_banned(x.shape[0])
        if ban is not None:
            x = torch.where(ban, float("-inf"), x)
        if g.temperature == 0:  # suppressed ids masked inside the pick (no copy of the row)
            tok = greedy_pick(x, suppress)
        else:
            if suppress is not None:  # index_fill_, not x[suppress] = ...: an indexed
                # assignment of a Python scalar waits for the device (a host sync per token,
                # found in H200 run 41)
                x = x.clone().index_fill_(0, suppress, float("-inf"))
            probs = torch.softmax(x / g.temperature, dim=-1)
            if g.top_p < 1.0:
                sp, si = torch.sort(probs, descending=True)
                keep = torch.cumsum(sp, -1) - sp < g.top_p
                probs = torch.zeros_like(probs).scatter_(0, si, sp * keep)
            tok = torch.multinomial(probs, 1, generator=self.rng)
        if g.repetition_penalty != 1.0:  # the state only the penalty and the ban read
            self.seen.index_fill_(0, tok.reshape(-1), True)
        if g.no_repeat_ngram_size and self.count < self.hist.shape[0]:
            self.hist[self.count:self.count + 1].copy_(tok.reshape(1))
        self.count += 1
        return tok

    def _ngram_banned(self, vocab: int) -> torch.Tensor | None:
        """[V] bool: tokens that would complete an n-gram already generated (the semantics of
        sampling.NgramBlocker: generated tokens only)."""
        n, length = self.gen.no_repeat_ngram_size, self.count
        if n == 0 or length < n - 1 or length == 0:
            return None
        h = self.hist[:length]
        if n == 1:
            nxt, match = h, torch.ones_like(h, dtype=torch.bool)
        else:
            starts = length - n + 1  # windows h[i:i+n-1] that a generated token follows
            if starts <= 0:
                return None
            windows = h.unfold(0, n - 1, 1)[:starts]  # [starts, n-1]
            match = (windows == h[length - n + 1:]).all(dim=1)
            nxt = h[n - 1:length]
        ban = torch.zeros(vocab, dtype=torch.int32, device=h.device)
        ban.scatter_reduce_(0, nxt, match.to(torch.int32), reduce="amax")
        return ban.bool()
