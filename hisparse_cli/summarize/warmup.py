"""`hisparse warmup`: compile ahead every GPU kernel a summarize run of one setup needs.

A run's GPU kernels are Triton specializations — one per set of constexprs: the tiles a
step's token count picks (attention rows, the INT4 GEMV's 1-4 tokens, the fused GEMM's
token tiles), dense or windowed attention, the split-K count of a decode step (it grows with
the keys a step sees), the in-graph sampler's options — and, on sm_90 with AWQ weights, the
NVRTC decode kernel. Which of them a document needs depends on its length, so the warm-up
runs real generations through the loaded engine, with the setup's own attention choice
(`Job.attention_for`: dense where the planner says it fits, else the sparse set), at prompt
lengths that reach every one of those choices:

    1, 2, 3, 4 tokens        the GEMV's token counts (a ragged last prefill chunk)
    12, 24, 48               the fused INT4 GEMM's token tiles, attention's small row tiles
    n, n + 3, n + 12, n + 40  for n = 96, 192, ... (×2) below `context`, and `context`: the
                             key counts that change the split count of a step (decode and a
                             ragged tail alike), under each of attention's row tiles (a
                             tail of 3, 12, 40 tokens); full prefill chunks, eviction past
                             the window where the run is sparse
each with WARMUP_NEW_TOKENS decoded tokens (the CUDA-graph decoder warms up, captures and
replays on its first steps) and min_new_tokens set, as the pipeline's length floor sets it;
at the shortest and longest lengths also without it, and at one length each of the guard's
retry decodings (stronger repetition control, then sampling). Integers that differ between
documents (positions, lengths, counts) compile nothing new (the kernels' do_not_specialize
lists, tests/test_specializations.py), so these lengths stand for every document up to
`context` tokens; longer documents reuse the longest length's kernels (the split count and
tiles stop changing once a step sees a few thousand keys: at most 64 splits of 64-key
tiles, reached by 8,192 keys).

What was compiled lands in the disk caches (kernels/compile_cache.py): a later process loads
instead of compiling. `warmup_steps(...)` says what will run (pure); `run_warmup(job, steps)`
runs it and returns a `WarmupReport` (per step: tokens, attention, seconds, the engine's
compile counts).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

from hisparse_cli.config.settings import GenerationConfig

SHORT_LENGTHS = (1, 2, 3, 4, 12, 24, 48)
FIRST_DOUBLING = 96  # then ×2 up to the context
TAILS = (0, 3, 12, 40)  # added to each doubling: attention's row tiles at that key count
DEFAULT_CONTEXT = 8192  # past this a run compiles nothing the longest length did not (module doc)
WARMUP_NEW_TOKENS = 4


@dataclass(frozen=True)
class WarmupStep:
    prompt_tokens: int
    decoding: str  # "default" | "no length floor" | a retry decoding's description
    gen: GenerationConfig


@dataclass
class StepResult:
    prompt_tokens: int
    decoding: str
    attention: str  # "dense" | "sparse, window W, G globals"
    seconds: float
    kernel_compiles: int
    kernel_compile_seconds: float
    kernel_loads: int
    kernel_load_seconds: float


@dataclass
class WarmupReport:
    steps: list[StepResult] = field(default_factory=list)
    seconds: float = 0.0

    def total(self, key: str):
        return sum(getattr(s, key) for s in self.steps)

    def to_dict(self) -> dict:
        return {"steps": [asdict(s) for s in self.steps], "seconds": self.seconds,
                **{k: self.total(k) for k in ("kernel_compiles", "kernel_compile_seconds",
                                              "kernel_loads", "kernel_load_seconds")}}


def warmup_lengths(context: int) -> list[int]:
    """Prompt lengths up to `context` tokens (module doc), ascending; `context` itself last."""
    lengths = {n for n in SHORT_LENGTHS if n < context}
    n = FIRST_DOUBLING
    while n < context:
        lengths.update(n + tail for tail in TAILS if n + tail < context)
        n *= 2
    return sorted(lengths) + [context]


def warmup_steps(gen: GenerationConfig, context: int) -> list[WarmupStep]:
    """The generations the warm-up runs for decoding settings `gen` (the summarize flags') and
    prompts up to `context` tokens."""
    from hisparse_cli.summarize.summary_run import retry_decodings

    base = replace(gen, max_new_tokens=WARMUP_NEW_TOKENS, min_new_tokens=WARMUP_NEW_TOKENS)
    lengths = warmup_lengths(context)
    steps = [WarmupStep(n, "default", base) for n in lengths]
    free = replace(base, min_new_tokens=0)
    steps += [WarmupStep(n, "no length floor", free) for n in sorted({lengths[0], lengths[-1]})]
    retry_at = lengths[min(len(lengths) - 1, len(SHORT_LENGTHS))]
    steps += [WarmupStep(retry_at, why, retry) for why, retry in retry_decodings(base)]
    return steps


def default_context(max_positions: int) -> int:
    """DEFAULT_CONTEXT, or less for a model with fewer positions (room for the new tokens)."""
    return max(1, min(DEFAULT_CONTEXT, max_positions - WARMUP_NEW_TOKENS))


def run_warmup(job, steps: list[WarmupStep],
               progress: Callable[[int, int, WarmupStep], None] | None = None) -> WarmupReport:
    """Run `steps` on `job`'s engine (loaded now if it was not), each under the attention a
    summarize of that length would get. Token ids are fixed pseudo-random ones."""
    import torch

    from hisparse_cli.planner.attention_choice import running_under

    engine = job.engine()
    vocab = int(engine.cfg.vocab_size)
    g = torch.Generator().manual_seed(42)
    report, started = WarmupReport(), time.perf_counter()
    for i, step in enumerate(steps):
        if progress is not None:
            progress(i, len(steps), step)
        ids = torch.randint(0, vocab, (step.prompt_tokens,), generator=g).tolist()
        # the attention a summarize of this length gets (its own cap of new tokens)
        cap = job.settings.generation.max_new_tokens
        choice = job.attention_for(step.prompt_tokens, cap)
        job.keep_prefill_weights(step.prompt_tokens, cap, choice.sparse)  # as summarize would
        t0 = time.perf_counter()
        with running_under(engine, choice.sparse):
            result = engine.generate(ids, gen=step.gen)
        s = result.stats
        shape = "dense" if choice.sparse.dense else (
            f"sparse, window {choice.sparse.window_size}, {choice.sparse.global_tokens} globals")
        report.steps.append(StepResult(step.prompt_tokens, step.decoding, shape,
                                       time.perf_counter() - t0, s.kernel_compiles,
                                       s.kernel_compile_seconds, s.kernel_loads,
                                       s.kernel_load_seconds))
    job.release()
    report.seconds = time.perf_counter() - started
    return report


__all__ = ["WarmupStep", "StepResult", "WarmupReport", "warmup_lengths", "warmup_steps",
           "default_context", "run_warmup", "WARMUP_NEW_TOKENS", "DEFAULT_CONTEXT"]
