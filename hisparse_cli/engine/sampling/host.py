"""Next-token choice: repetition control, then greedy or temperature/top-p sampling.

Repetition penalty and no-repeat n-grams look at the *generated* tokens only (not the prompt):
a summary should be free to reuse the document's words, but not to loop on its own.
The penalty follows the CTRL rule (positive logits divided, negative multiplied).
"""

from __future__ import annotations

import torch

from hisparse_cli.config.settings import GenerationConfig


class NgramBlocker:
    """Tracks n-grams of the generated tokens; `banned()` lists tokens that would repeat one."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.seen: dict[tuple[int, ...], set[int]] = {}
        self.tokens: list[int] = []

    def push(self, tok: int) -> None:
        self.tokens.append(tok)
        if self.n and len(self.tokens) >= self.n:
            gram = tuple(self.tokens[-self.n:])
            self.seen.setdefault(gram[:-1], set()).add(gram[-1])

    def banned(self) -> set[int]:
        if self.n == 0 or len(self.tokens) < self.n - 1:
            return set()
        prefix = tuple(self.tokens[len(self.tokens) - self.n + 1:]) if self.n > 1 else ()
        return self.seen.get(prefix, set())


class Sampler:
    def __init__(self, gen: GenerationConfig, device: torch.device) -> None:
        self.gen = gen
        self.blocker = NgramBlocker(gen.no_repeat_ngram_size)
        self.generated: list[int] = []
        self.rng = None
        if gen.temperature > 0:
            self.rng = torch.Generator(device=device)
            self.rng.manual_seed(gen.seed if gen.seed is not None else 0)

    def __call__(self, logits: torch.Tensor, suppress: tuple[int, ...] = ()) -> int:
        """logits: [V] fp32 of the last position -> chosen token id."""
        logits = logits.clone()
        g = self.gen
        if g.repetition_penalty != 1.0 and self.generated:
            ids = torch.tensor(sorted(set(self.generated)), device=logits.device)
            vals = logits[ids]
            logits[ids] = torch.where(vals > 0, vals / g.repetition_penalty, vals * g.repetition_penalty)
        banned = self.blocker.banned()
        if banned:
            logits[torch.tensor(sorted(banned), device=logits.device)] = float("-inf")
        if suppress:
            logits[torch.tensor(suppress, device=logits.device)] = float("-inf")
        if g.temperature == 0:
            tok = int(torch.argmax(logits))
        else:
            probs = torch.softmax(logits / g.temperature, dim=-1)
            if g.top_p < 1.0:
                sp, si = torch.sort(probs, descending=True)
                keep = torch.cumsum(sp, dim=-1) - sp < g.top_p  # always keeps the top token
                sp = sp * keep
                probs = torch.zeros_like(probs).scatter_(0, si, sp)
            tok = int(torch.multinomial(probs / probs.sum(), 1, generator=self.rng))
        self.generated.append(tok)
        self.blocker.push(tok)
        return tok
