"""The options `summarize` and `batch` share (profile, model, sparse policy, generation).

`@run_options` appends them to a command's signature and hands the command one `RunOptions`
object (parameter `opts`), so both commands take exactly the same flags. `RunOptions`
resolves them with the precedence stated once in profiles/ and runtime.py:

    CLI flag  >  profile  >  built-in default
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass, fields
from enum import Enum
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer

P_MODEL, P_SPARSE, P_GEN, P_OUT = "Model and profile", "Sparse attention", "Generation", "Output"


class Strategy(str, Enum):
    auto = "auto"
    stream = "stream"
    map_reduce = "map-reduce"


def _opt(*decls: str, panel: str, **kw) -> typer.models.OptionInfo:
    return typer.Option(*decls, rich_help_panel=panel, **kw)


def finite_float(low: float | None = None, high: float | None = None, *,
                 low_open: bool = False) -> tuple[Callable[[object], float], str]:
    """(parser, help note) for a float flag that must be finite and within [low, high]
    (`low_open`: low itself excluded), the bounds GenerationConfig enforces. Typer's own
    min/max cannot exclude a bound and accept inf/nan; the note shows the true range."""
    if low is not None and high is not None:
        rule = f"{low:g}{'<' if low_open else '<='}x<={high:g}"
    elif low is not None:
        rule = f"x{'>' if low_open else '>='}{low:g}"
    else:
        rule = f"x<={high:g}"

    def parse(value: object) -> float:
        try:
            number = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise typer.BadParameter(f"{value!r} is not a number") from None
        below = low is not None and (number < low or (low_open and number == low))
        if not math.isfinite(number):
            raise typer.BadParameter(f"{value} is not a finite number ({rule})")
        if below or (high is not None and number > high):
            raise typer.BadParameter(f"{value} is not in the range {rule}")
        return number

    return parse, f"[{rule}]"


_TOP_P, _TOP_P_NOTE = finite_float(0.0, 1.0, low_open=True)
_TEMPERATURE, _TEMPERATURE_NOTE = finite_float(0.0)
_PENALTY, _PENALTY_NOTE = finite_float(0.0, low_open=True)


_SHARED: list[tuple[str, object, object]] = [
    ("profile", Annotated[str, _opt("--profile", "-p", panel=P_MODEL, help=(
        "Hardware profile: a name from `hisparse profiles list`, 'auto' (detect the GPU) or "
        "a .toml file."))], "auto"),
    ("model", Annotated[Optional[str], _opt("--model", "-m", panel=P_MODEL, help=(
        "Model: a registry name, a local HF folder, a .gguf file, or an org/name already in "
        "the Hugging Face cache.  [default: the embedded smollm2-135m-instruct]"))], None),
    ("strategy", Annotated[Strategy, _opt("--strategy", panel=P_GEN, case_sensitive=False,
        help="stream: one pass; map-reduce: chunk summaries then a final one; auto: stream "
             "when it fits the model's positions.")], Strategy.auto),
    ("max_new_tokens", Annotated[Optional[int], _opt("--max-new-tokens", "-n", panel=P_GEN,
        min=1, help="Summary length limit in tokens.  [default: the profile's]")], None),
    ("chunk_tokens", Annotated[Optional[int], _opt("--chunk-tokens", panel=P_GEN, min=16,
        help="Map-reduce: document tokens per chunk.  [default: as many as fit]")], None),
    ("chunk_new_tokens", Annotated[Optional[int], _opt("--chunk-new-tokens", panel=P_GEN,
        min=16, help="Map-reduce: length of each chunk summary in tokens.")], None),
    ("instructions", Annotated[Optional[str], _opt("--instructions", "-i", panel=P_GEN,
        help="Replace the genre's task sentence in the prompt.")], None),
    ("temperature", Annotated[float, _opt("--temperature", panel=P_GEN, parser=_TEMPERATURE,
        help=f"0 = greedy.  {_TEMPERATURE_NOTE}")], 0.0),
    ("top_p", Annotated[float, _opt("--top-p", panel=P_GEN, parser=_TOP_P,
        help=f"Nucleus sampling mass (with --temperature > 0).  {_TOP_P_NOTE}")], 1.0),
    ("seed", Annotated[Optional[int], _opt("--seed", panel=P_GEN,
        help="Random seed for sampling.")], None),
    ("repetition_penalty", Annotated[float, _opt("--repetition-penalty", panel=P_GEN,
        parser=_PENALTY, help=f"> 1 discourages repeating tokens.  {_PENALTY_NOTE}")], 1.1),
    ("no_repeat_ngram", Annotated[int, _opt("--no-repeat-ngram", panel=P_GEN, min=0,
        help="Never repeat an n-gram of this size (0 = off).")], 8),
    ("window", Annotated[Optional[int], _opt("--window", panel=P_SPARSE, min=1,
        help="Sliding window of recent tokens.  [default: the profile's]")], None),
    ("global_tokens", Annotated[Optional[int], _opt("--global-tokens", panel=P_SPARSE, min=0,
        help="Important evicted tokens kept per layer and KV head.")], None),
    ("sink_tokens", Annotated[Optional[int], _opt("--sink-tokens", panel=P_SPARSE, min=0,
        help="First positions every query always sees.")], None),
    ("block_size", Annotated[Optional[int], _opt("--block-size", panel=P_SPARSE, min=1,
        help="Tokens per paged KV block.")], None),
    ("recalibrate_every", Annotated[Optional[int], _opt("--recalibrate-every", panel=P_SPARSE,
        min=1, help="Re-choose the global tokens every N tokens.")], None),
    ("recalibrate_topk", Annotated[Optional[int], _opt("--recalibrate-topk", panel=P_SPARSE,
        min=0, help="Candidates per layer/head held for the next recalibration.")], None),
    ("prefill_chunk", Annotated[Optional[int], _opt("--prefill-chunk", panel=P_SPARSE, min=1,
        help="Tokens per forward pass while prefilling.")], None),
    ("retrieval_tokens", Annotated[Optional[int], _opt("--retrieval-tokens", panel=P_SPARSE,
        min=0, help="Retrieval tier: evicted pages are kept off the working set and each step "
             "attends to the best N tokens' pages of them per layer and KV head (0 = off).  "
             "[default: the profile's]")], None),
    ("importance", Annotated[Optional[str], _opt("--importance", panel=P_SPARSE,
        help="How global tokens are chosen: attention, snapkv, uniform or probe.  "
             "[default: the profile's]")], None),
    ("probe", Annotated[Optional[Path], _opt("--probe", panel=P_SPARSE, readable=False,
        help="Probe file for --importance probe (implies it).  [default: the shipped one for "
             "the model]")],
     None),
    ("dense", Annotated[bool, _opt("--dense", panel=P_SPARSE,
        help="Dense attention (no window, no globals): the exact baseline.")], False),
    ("password", Annotated[Optional[str], _opt("--password", panel=P_MODEL,
        help="Password of encrypted PDFs.")], None),
    ("include_secrets", Annotated[bool, _opt("--include-secrets", panel=P_MODEL, help=(
        "Also read a folder's secrets (.env*, private keys, credential files, text holding a "
        "key or token), which are otherwise skipped and reported."))], False),
    ("quiet", Annotated[bool, _opt("--quiet", "-q", panel=P_OUT,
        help="No progress, log lines or stats table on stderr (errors still).")], False),
]
SHARED_NAMES = tuple(name for name, _, _ in _SHARED)


@dataclass(frozen=True)
class RunOptions:
    profile: str = "auto"
    model: str | None = None
    strategy: Strategy = Strategy.auto
    max_new_tokens: int | None = None
    chunk_tokens: int | None = None
    chunk_new_tokens: int | None = None
    instructions: str | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.1
    no_repeat_ngram: int = 8
    window: int | None = None
    global_tokens: int | None = None
    sink_tokens: int | None = None
    block_size: int | None = None
    recalibrate_every: int | None = None
    recalibrate_topk: int | None = None
    prefill_chunk: int | None = None
    retrieval_tokens: int | None = None
    importance: str | None = None
    probe: Path | None = None
    dense: bool = False
    password: str | None = None
    include_secrets: bool = False
    quiet: bool = False

    def load_profile(self):
        from hisparse_cli.config.profiles import load_profile

        return load_profile(self.profile)

    def sparse(self, profile):
        from hisparse_cli.errors import ConfigError
        from hisparse_cli.summarize.runtime import sparse_settings

        importance = self.importance
        if self.probe is not None:  # a probe file says which importance is wanted
            if self.dense:
                raise ConfigError("--dense cannot be combined with --probe",
                                  hint="dense attention keeps every token: nothing to score")
            if importance is None:
                importance = "probe"
            elif importance.strip().lower() != "probe":
                raise ConfigError(f"--probe is used only with --importance probe, not "
                                  f"--importance {importance}",
                                  hint="drop --probe, or use --importance probe")
        return sparse_settings(
            profile, dense=self.dense, window_size=self.window, global_tokens=self.global_tokens,
            sink_tokens=self.sink_tokens, block_size=self.block_size,
            recalibrate_every=self.recalibrate_every, recalibrate_topk=self.recalibrate_topk,
            prefill_chunk=self.prefill_chunk, importance=importance,
            retrieval_tokens=self.retrieval_tokens)

    def summary_settings(self, profile):
        from hisparse_cli.config.settings import GenerationConfig
        from hisparse_cli.summarize.pipeline import SummarySettings

        gen = GenerationConfig(
            max_new_tokens=self.max_new_tokens or profile.max_new_tokens,
            temperature=self.temperature, top_p=self.top_p, seed=self.seed,
            repetition_penalty=self.repetition_penalty, no_repeat_ngram_size=self.no_repeat_ngram)
        return SummarySettings(strategy=self.strategy.value, generation=gen,
                               chunk_tokens=self.chunk_tokens,
                               chunk_new_tokens=self.chunk_new_tokens,
                               instructions=self.instructions)


assert SHARED_NAMES == tuple(f.name for f in fields(RunOptions)), "keep _SHARED and RunOptions in step"


def run_options(func):
    """Decorator: add the shared options to `func`'s CLI signature; pass them as `opts`."""
    sig = inspect.signature(func, eval_str=True)  # real objects: wrapper has other globals
    own = [p for p in sig.parameters.values() if p.name != "opts"]
    extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                               annotation=annotation) for name, annotation, default in _SHARED]

    @functools.wraps(func)
    def wrapper(**kwargs):
        opts = RunOptions(**{name: kwargs.pop(name) for name in SHARED_NAMES})
        return func(opts=opts, **kwargs)

    del wrapper.__wrapped__  # Typer must read the new signature, not func's
    wrapper.__signature__ = sig.replace(parameters=own + extra)
    wrapper.__annotations__ = {p.name: p.annotation for p in own + extra}
    return wrapper


__all__ = ["RunOptions", "Strategy", "run_options", "SHARED_NAMES", "P_OUT"]
