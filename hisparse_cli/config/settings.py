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
from dataclasses import Field, dataclass, field, fields, replace

from hisparse_cli.errors import ConfigError

IMPORTANCE_POLICIES = ("attention", "snapkv", "uniform", "probe")
RETRIEVAL_SUMMARIES = ("minmax", "mean")


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}",
                          hint=f"set {name} to a whole number of at least {minimum}")


def setting(default: object, *, flag: str, help: str, short: str | None = None,
            aliases: tuple[str, ...] = (), minimum: int | None = None,
            choices: tuple[str, ...] | None = None, positions: bool = False,
            optional: bool = False, sparse_only: bool = True) -> object:
    """A SparseConfig field and everything said about it, declared once: its CLI flag and help
    (cli/options.py makes `--flag` from it), its `hisparse eval --settings` short letter and
    key aliases (quality/settings.py), its rule (`minimum` for whole numbers, `choices` for
    names; `optional`: None allowed), and `positions`: counted in positions, so never above
    the model's (check_positions); `sparse_only`: shapes the sparse working set, so a dense run
    refuses it (block size and prefill chunk apply to dense runs too). Profiles hold these
    fields in their `[sparse]` table."""
    return field(default=default, metadata={
        "flag": flag, "help": help, "short": short, "aliases": aliases, "minimum": minimum,
        "choices": choices, "positions": positions, "optional": optional,
        "sparse_only": sparse_only})


def check_setting(f: Field, value: object) -> None:
    """ConfigError (exit 2) naming the field when `value` breaks `f`'s declared rule."""
    meta = f.metadata
    if value is None and meta["optional"]:
        return
    if meta["minimum"] is not None:
        _check_int(f.name, value, meta["minimum"])
    elif meta["choices"] is not None and value not in meta["choices"]:
        raise ConfigError(f"{f.name} must be one of {', '.join(meta['choices'])}, got {value!r}",
                          hint=f"set {f.name} to one of: {', '.join(meta['choices'])}")


@dataclass(frozen=True)
class SparseConfig:
    """Sparse attention policy. All sizes are in tokens; each field's metadata (see `setting`)
    is its one declaration: help text, flag, eval key, rule.

    "snapkv" importance: attention mass from the last `observation_window` queries before the
    token leaves the window; "attention" (H2O-like): mass received while in the window;
    "uniform": evenly spaced tokens (the naive baseline); "probe": a learned scorer on hidden
    states (needs a probe). `window_size=None` is dense attention through the same paged path.
    """

    sink_tokens: int = setting(4, flag="--sink-tokens", short="s", aliases=("sinks", "sink"),
                               minimum=0, positions=True,
                               help="First positions every query always sees.")
    window_size: int | None = setting(1024, flag="--window", short="w", aliases=("window",),
                                      minimum=1, optional=True,
                                      help="Sliding window of recent tokens.")
    global_tokens: int = setting(64, flag="--global-tokens", short="g",
                                 aliases=("globals", "global"), minimum=0, positions=True,
                                 help="Important evicted tokens kept per layer and KV head.")
    block_size: int = setting(16, flag="--block-size", short="b", aliases=("block",),
                              minimum=1, positions=True, sparse_only=False,
                              help="Tokens per paged KV block.")
    recalibrate_every: int = setting(256, flag="--recalibrate-every", short="r",
                                     aliases=("recal", "every"), minimum=1,
                                     help="Re-choose the global tokens every N tokens.")
    recalibrate_topk: int = setting(64, flag="--recalibrate-topk", short="k", aliases=("topk",),
                                    minimum=0, positions=True,
                                    help="Candidates per layer/head held for the next "
                                         "recalibration.")
    prefill_chunk: int = setting(256, flag="--prefill-chunk", short="c", aliases=("chunk",),
                                 minimum=1, sparse_only=False,
                                 help="Tokens per forward pass while prefilling.")
    importance: str = setting("attention", flag="--importance", aliases=("policy",),
                              choices=IMPORTANCE_POLICIES,
                              help="How global tokens are chosen: attention, snapkv, uniform "
                                   "or probe.")
    score_stride: int = setting(4, flag="--score-stride", short="t", aliases=("stride",),
                                minimum=1, help="Importance is scored from every N-th query "
                                                "(1 = exact).")
    observation_window: int = setting(64, flag="--observation-window", short="o",
                                      aliases=("obs",), minimum=1,
                                      help="snapkv: queries before eviction that score a token.")
    retrieval_tokens: int = setting(0, flag="--retrieval-tokens", short="q",
                                    aliases=("retrieval",), minimum=0, positions=True,
                                    help="Retrieval tier (engine/retrieval.py): pages leaving "
                                         "the window are kept in an offload store and each step "
                                         "attends, per layer and KV head, to the best N tokens' "
                                         "pages of them by their key summaries (0 = off: evicted "
                                         "pages are dropped).")
    page_cache_tokens: int = setting(0, flag="--page-cache-tokens", short="p",
                                     aliases=("page_cache",), minimum=0, positions=True,
                                     help="Retrieval tier: resident page-cache slots per layer "
                                          "and KV head (0 = as many as --retrieval-tokens); more "
                                          "keep recently used pages resident.")
    retrieval_every: int = setting(4, flag="--retrieval-every", minimum=1,
                                   help="Retrieval tier: decode steps one page choice serves "
                                        "(1 = chosen anew every step; a page newly offloaded "
                                        "or a global recalibration chooses anew at once; "
                                        "prefill chunks always choose). 4: no ROUGE lost on "
                                        "the CPU study, 3.6x fewer bytes copied a token "
                                        "(QUALITY.md, BENCHMARKS.md).")
    retrieval_summary: str = setting("mean", flag="--retrieval-summary",
                                     aliases=("summary",), choices=RETRIEVAL_SUMMARIES,
                                     help="Retrieval tier: the per-page key summary pages are "
                                          "scored by: mean (the mean key; measured better, half "
                                          "the bytes) or minmax (Quest's per-channel bounds).")

    def __post_init__(self) -> None:
        for f in fields(self):
            check_setting(f, getattr(self, f.name))
        if self.page_cache_tokens and self.page_cache_tokens < self.retrieval_tokens:
            raise ConfigError(
                f"page_cache_tokens ({self.page_cache_tokens}) must be at least "
                f"retrieval_tokens ({self.retrieval_tokens})",
                hint="raise --page-cache-tokens, or set it to 0 (as many as --retrieval-tokens)")

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




def check_positions(max_positions: int, *, sparse: SparseConfig | None = None,
                    max_new_tokens: int | None = None) -> None:
    """ConfigError (exit 2) for settings pointless for a model of `max_positions` positions:
    a sparse size above it (a run sees at most that many tokens: sinks, globals and candidates
    are chosen among them, a block holds them all), or a summary length that leaves no room for
    even one prompt token. Caught before anything is allocated for them."""
    for f in fields(sparse) if sparse is not None else ():
        name, value, flag = f.name, getattr(sparse, f.name), f.metadata["flag"]
        if f.metadata["positions"] and value > max_positions:
            raise ConfigError(f"{name} {value:,} is larger than the model's {max_positions:,} "
                              "positions", hint=f"lower {flag} to at most {max_positions:,} "
                              "(`hisparse profiles show NAME` lists a profile's values)")
    if max_new_tokens is not None and max_new_tokens >= max_positions:
        raise ConfigError(f"max_new_tokens {max_new_tokens:,} leaves no room for a prompt within "
                          f"the model's {max_positions:,} positions",
                          hint=f"lower --max-new-tokens (below {max_positions:,})")


__all__ = ["SparseConfig", "GenerationConfig", "IMPORTANCE_POLICIES", "RETRIEVAL_SUMMARIES",
           "check_positions", "check_setting", "setting"]
