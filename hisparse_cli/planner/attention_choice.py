"""`--attention auto|dense|sparse`: which KV policy a document's generations run under, and why.

    choice = choose_attention("auto", sparse=job_sparse, plan=plan_fn, context_tokens=6400)
    choice.mode ("dense" | "sparse"), choice.sparse (the SparseConfig to run), choice.reason

Quality first (DESIGN.md): dense attention is exact, so `auto` takes it whenever the memory
planner says the whole dense KV of the document's largest generation fits the budget — on the
CPU the host RAM the planner uses, on CUDA the profile's VRAM budget. Otherwise it takes the
sparse working set: the largest one that fits, trying the configured window and global set
doubled (window ×2, ×4, … below the context, globals and candidates doubled with it,
recalibration every window/4 as the profiles keep it), else the configured one (the planner's
suggestions then say what to change). `plan(sparse) -> MemoryPlan` is the planner bound to the
run's model, profile and device (planner/profile.py:plan_for_profile).
Explicit sparse flags (--window, --global-tokens, …) make `auto` mean `sparse`: the user asked
for that working set. `dense` and `sparse` are taken as asked, with no planning.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from hisparse_cli.config.settings import SparseConfig
from hisparse_cli.errors import ConfigError
from hisparse_cli.config.profiles import ATTENTION_MODES
MAX_DOUBLINGS = 6
MIB = 1 << 20


@dataclass(frozen=True)
class AttentionChoice:
    requested: str  # auto | dense | sparse
    mode: str  # dense | sparse
    reason: str
    sparse: SparseConfig
    peak_bytes: int | None = None  # the planner's peak for the chosen run (auto only)
    budget_bytes: int | None = None

    def to_dict(self) -> dict:
        return {"requested": self.requested, "mode": self.mode, "reason": self.reason,
                "window_size": self.sparse.window_size,
                "global_tokens": self.sparse.global_tokens if not self.sparse.dense else 0,
                "peak_bytes": self.peak_bytes, "budget_bytes": self.budget_bytes}

    def describe(self) -> str:
        """One line for tables: "dense (auto: …)"."""
        shape = "dense" if self.sparse.dense else (
            f"sparse, window {self.sparse.window_size}, {self.sparse.global_tokens} globals")
        return f"{shape} ({self.requested}: {self.reason})"


def check_mode(mode: str) -> str:
    if mode not in ATTENTION_MODES:
        raise ConfigError(f"attention must be one of {', '.join(ATTENTION_MODES)}, got {mode!r}",
                          hint="use --attention auto (the default), dense or sparse")
    return mode


def dense_of(sparse: SparseConfig) -> SparseConfig:
    """The dense policy with the run's block size and prefill chunk."""
    return replace(sparse, window_size=None, global_tokens=0, recalibrate_topk=0)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / MIB:.0f} MiB"


def _larger(sparse: SparseConfig, context_tokens: int) -> list[SparseConfig]:
    """The configured working set doubled while its window stays below the context."""
    out, current = [], sparse
    for _ in range(MAX_DOUBLINGS):
        window = (current.window_size or 0) * 2
        if window >= context_tokens:
            break
        globals_ = current.global_tokens * 2
        current = replace(current, window_size=window, global_tokens=globals_,
                          recalibrate_topk=max(current.recalibrate_topk, globals_),
                          recalibrate_every=max(1, window // 4))
        out.append(current)
    return out


def choose_attention(requested: str, *, sparse: SparseConfig,
                     plan: Callable[[SparseConfig], object] | None, context_tokens: int,
                     explicit_sparse: bool = False, budget_name: str = "the budget"
                     ) -> AttentionChoice:
    """The policy for a document whose largest generation holds `context_tokens` positions
    (module docstring). `sparse` is the configured working set (profile + flags)."""
    check_mode(requested)
    if requested == "dense" or sparse.dense:
        return AttentionChoice(requested, "dense", "asked for" if requested == "dense"
                               else "the settings have no window", dense_of(sparse))
    if requested == "sparse":
        return AttentionChoice(requested, "sparse", "asked for", sparse)
    if explicit_sparse:
        return AttentionChoice(requested, "sparse", "sparse settings given on the command line",
                               sparse)
    if plan is None:  # no planner for this model: the configured policy
        return AttentionChoice(requested, "sparse", "no memory plan for this model", sparse)
    dense = dense_of(sparse)
    dense_plan = plan(dense)
    budget = getattr(dense_plan, "budget_bytes", None)
    if dense_plan.fits is not False:
        where = f"{_gib(budget)} {budget_name}" if budget else "no budget set"
        return AttentionChoice(requested, "dense", f"the whole KV of {context_tokens:,} tokens "
                               f"fits: peak {_gib(dense_plan.peak_allocated_bytes)} of {where}",
                               dense, dense_plan.peak_allocated_bytes, budget)
    chosen, chosen_plan = sparse, plan(sparse)
    for candidate in _larger(sparse, context_tokens):
        candidate_plan = plan(candidate)
        if candidate_plan.fits is False:
            break
        chosen, chosen_plan = candidate, candidate_plan
    fits = "fits" if chosen_plan.fits is not False else "does not fit either (see hisparse plan)"
    return AttentionChoice(
        requested, "sparse", f"dense needs {_gib(dense_plan.peak_allocated_bytes)}, over "
        f"{_gib(budget)} {budget_name}; window {chosen.window_size} + {chosen.global_tokens} "
        f"globals {fits}", chosen, chosen_plan.peak_allocated_bytes, budget)


class running_under:  # noqa: N801 - a context manager used like a function
    """`with running_under(engine, sparse):` the engine's runs use `sparse`, then its own
    policy again. Kept KV storage of another shape is released by the engine's own check."""

    def __init__(self, engine, sparse: SparseConfig) -> None:
        self.engine, self.sparse = engine, sparse

    def __enter__(self):
        self.saved = getattr(self.engine, "sparse", None)
        if self.saved is not None:
            self.engine.sparse = self.sparse
        return self.engine

    def __exit__(self, *exc) -> None:
        if self.saved is not None:
            self.engine.sparse = self.saved


__all__ = ["ATTENTION_MODES", "AttentionChoice", "choose_attention", "check_mode", "dense_of",
           "running_under"]
