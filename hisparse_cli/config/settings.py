"""Frozen, validated configuration of the sparse KV policy and of generation.

`SparseConfig` describes which keys every query attends to: the first `sink_tokens`
positions, the current global tokens of its layer/KV head, and the last `window_size`
positions (causal). `window_size=None` means dense attention through the same paged path.
Errors name the offending field (ConfigError -> exit code 2). `check_positions` refuses
settings no run of a given model can use (more global tokens than it has positions, a summary
that leaves no room for a prompt); the engine, the pipeline and the planner all call it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from hisparse_cli.errors import ConfigError

IMPORTANCE_POLICIES = ("attention", "snapkv", "uniform", "probe")
RETRIEVAL_SUMMARIES = ("minmax", "mean")


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}",
                          hint=f"set {name} to a whole number of at least {minimum}")


@dataclass(frozen=True)
class SparseConfig:
    """Sparse attention policy. All sizes are in tokens.

    sink_tokens:        first positions every query always sees (attention sinks)
    window_size:        sliding window of most recent positions; None = dense attention
    global_tokens:      per layer and KV head, evicted tokens kept for their importance
    block_size:         tokens per paged KV block
    recalibrate_every:  re-choose the global set every this many tokens ("segment")
    recalibrate_topk:   best evicted candidates per layer/head held for the next recalibration
    prefill_chunk:      tokens fed per forward pass while prefilling
    importance:         "attention" (H2O-like: attention mass received while in the window),
                        "snapkv" (mass from the last `observation_window` queries before the
                        token leaves the window), "uniform" (evenly spaced tokens: the naive
                        baseline), or "probe" (a learned scorer on hidden states; needs a probe)
    score_stride:       importance is estimated from the queries at positions that are multiples
                        of this (1 = exact; 4 cuts scoring cost 4x, see QUALITY.md)
    retrieval_tokens:   the retrieval tier (engine/retrieval.py): 0 = off (evicted pages are
                        dropped); N > 0 = pages leaving the window are kept in an offload
                        store and each step attends, per layer and KV head, to the best
                        ceil(N / block_size) of them by their key summaries
    page_cache_tokens:  resident page-cache slots per layer and KV head (0 = as many as
                        retrieval_tokens); more slots keep recently used pages resident
                        (fewer host-to-device copies on CUDA), the attended set stays the best
                        retrieval_tokens
    retrieval_summary:  per-page key summary the pages are scored by: "mean" (the mean key;
                        measured better, half the bytes) or "minmax" (Quest's per-channel
                        bounds, an upper bound of q.k); kernels/attention/page_score_ref.py
    """

    sink_tokens: int = 4
    window_size: int | None = 1024
    global_tokens: int = 64
    block_size: int = 16
    recalibrate_every: int = 256
    recalibrate_topk: int = 64
    prefill_chunk: int = 256
    importance: str = "attention"
    score_stride: int = 4
    observation_window: int = 64
    retrieval_tokens: int = 0
    page_cache_tokens: int = 0
    retrieval_summary: str = "mean"

    def __post_init__(self) -> None:
        _check_int("sink_tokens", self.sink_tokens, 0)
        if self.window_size is not None:
            _check_int("window_size", self.window_size, 1)
        _check_int("global_tokens", self.global_tokens, 0)
        _check_int("block_size", self.block_size, 1)
        _check_int("recalibrate_every", self.recalibrate_every, 1)
        _check_int("recalibrate_topk", self.recalibrate_topk, 0)
        _check_int("prefill_chunk", self.prefill_chunk, 1)
        _check_int("score_stride", self.score_stride, 1)
        _check_int("observation_window", self.observation_window, 1)
        _check_int("retrieval_tokens", self.retrieval_tokens, 0)
        _check_int("page_cache_tokens", self.page_cache_tokens, 0)
        if self.retrieval_summary not in RETRIEVAL_SUMMARIES:
            raise ConfigError(
                f"retrieval_summary must be one of {', '.join(RETRIEVAL_SUMMARIES)}, got "
                f"{self.retrieval_summary!r}", hint="use 'mean' (default) or 'minmax'")
        if self.page_cache_tokens and self.page_cache_tokens < self.retrieval_tokens:
            raise ConfigError(
                f"page_cache_tokens ({self.page_cache_tokens}) must be at least "
                f"retrieval_tokens ({self.retrieval_tokens})",
                hint="raise page_cache_tokens, or set it to 0 (as many as retrieval_tokens)")
        if self.importance not in IMPORTANCE_POLICIES:
            raise ConfigError(
                f"importance must be one of {', '.join(IMPORTANCE_POLICIES)}, got {self.importance!r}",
                hint="use importance='attention' (default), 'snapkv', 'uniform' or 'probe'",
            )

    @property
    def dense(self) -> bool:
        return self.window_size is None

    @property
    def uses_globals(self) -> bool:
        return not self.dense and self.global_tokens > 0

    @property
    def retrieval(self) -> bool:
        """The retrieval tier is on: a sparse window with a retrieval budget."""
        return not self.dense and self.retrieval_tokens > 0

    @property
    def retrieval_pages(self) -> int:
        """Pages attended per layer and KV head out of the offload store (0 = off)."""
        return -(-self.retrieval_tokens // self.block_size) if self.retrieval else 0

    @property
    def page_cache_pages(self) -> int:
        """Resident page-cache slots per layer and KV head (>= retrieval_pages)."""
        if not self.retrieval:
            return 0
        return max(self.retrieval_pages, -(-self.page_cache_tokens // self.block_size))

    def with_overrides(self, **overrides: object) -> "SparseConfig":
        """A copy with the non-None overrides applied (CLI flag > profile > default)."""
        known = {f.name for f in fields(self)}
        bad = set(overrides) - known
        if bad:
            raise ConfigError(f"unknown sparse setting(s): {', '.join(sorted(bad))}")
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    @classmethod
    def dense_config(cls, block_size: int = 16, prefill_chunk: int = 256) -> "SparseConfig":
        return cls(window_size=None, global_tokens=0, block_size=block_size,
                   prefill_chunk=prefill_chunk, sink_tokens=0, recalibrate_topk=0)


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding settings. temperature 0 = greedy."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    stop_strings: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] | None = None  # None: the model's own EOS ids
    min_new_tokens: int = 0

    def __post_init__(self) -> None:
        _check_int("max_new_tokens", self.max_new_tokens, 0)
        _check_int("no_repeat_ngram_size", self.no_repeat_ngram_size, 0)
        _check_int("min_new_tokens", self.min_new_tokens, 0)
        if not (0.0 <= self.temperature < math.inf):  # also false for nan
            raise ConfigError(f"temperature must be a finite number >= 0, got "
                              f"{self.temperature!r}",
                              hint="0 = greedy (the default); around 0.7 for varied text")
        if not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}",
                              hint="1 = no nucleus cut (the default); e.g. 0.9")
        if not (0.0 < self.repetition_penalty < math.inf):
            raise ConfigError(f"repetition_penalty must be a finite number > 0, got "
                              f"{self.repetition_penalty!r}",
                              hint="1 = no penalty; > 1 discourages repeats (e.g. 1.1)")


# Sparse sizes counted in positions: a run never holds more of them than the model has.
_POSITION_FIELDS = ("sink_tokens", "global_tokens", "recalibrate_topk", "block_size")


def check_positions(max_positions: int, *, sparse: SparseConfig | None = None,
                    max_new_tokens: int | None = None) -> None:
    """ConfigError (exit 2) for settings pointless for a model of `max_positions` positions:
    a sparse size above it (a run sees at most that many tokens: sinks, globals and candidates
    are chosen among them, a block holds them all), or a summary length that leaves no room for
    even one prompt token. Caught before anything is allocated for them."""
    for name in _POSITION_FIELDS if sparse is not None else ():
        value = getattr(sparse, name)
        if value > max_positions:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{name} {value:,} is larger than the model's {max_positions:,} "
                              "positions", hint=f"lower {flag} to at most {max_positions:,} "
                              "(`hisparse profiles show NAME` lists a profile's values)")
    if max_new_tokens is not None and max_new_tokens >= max_positions:
        raise ConfigError(f"max_new_tokens {max_new_tokens:,} leaves no room for a prompt within "
                          f"the model's {max_positions:,} positions",
                          hint=f"lower --max-new-tokens (below {max_positions:,})")


__all__ = ["SparseConfig", "GenerationConfig", "IMPORTANCE_POLICIES", "RETRIEVAL_SUMMARIES",
           "check_positions"]
