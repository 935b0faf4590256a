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
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Annotated, Callable, Mapping, Optional, get_type_hints

import typer

P_MODEL, P_SPARSE, P_GEN, P_OUT = "Model and profile", "Sparse attention", "Generation", "Output"


class Attention(str, Enum):
    auto = "auto"
    dense = "dense"
    sparse = "sparse"


class Reduce(str, Enum):
    auto = "auto"
    select = "select"
    generate = "generate"


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


@dataclass(frozen=True)
class RunOptions:
    """The shared options, each declared once: its field here is its CLI option (the
    annotation's typer.Option) and its default. The sparse policy's options are not listed:
    they come from SparseConfig's fields (config/settings.py) and arrive in `sparse_flags`
    (field name -> value given; absent = not given)."""

    profile: Annotated[str, _opt("--profile", "-p", panel=P_MODEL, help=(
        "Hardware profile: a name from `hisparse profiles list`, 'auto' (detect the GPU) or "
        "a .toml file."))] = "auto"
    model: Annotated[Optional[str], _opt("--model", "-m", panel=P_MODEL, help=(
        "Model: a registry name, a local HF folder, a .gguf file, or an org/name already in "
        "the Hugging Face cache.  [default: the embedded smollm2-135m-instruct]"))] = None
    strategy: Annotated[Strategy, _opt("--strategy", panel=P_GEN, case_sensitive=False,
        help="stream: one pass; map-reduce: chunk summaries then a final one; auto: stream "
             "when it fits the model's positions.")] = Strategy.auto
    reduce: Annotated[Reduce, _opt("--reduce", panel=P_GEN, case_sensitive=False,
        help="Map-reduce's final summary: select (the most central sentences of the parts' "
             "notes, led by the first), generate (the model writes it from the notes), auto "
             "(select for models under 1B parameters, generate otherwise).")] = Reduce.auto
    max_new_tokens: Annotated[Optional[int], _opt("--max-new-tokens", "-n", panel=P_GEN,
        min=1, help="Summary length limit in tokens.  [default: the profile's]")] = None
    chunk_tokens: Annotated[Optional[int], _opt("--chunk-tokens", panel=P_GEN, min=16,
        help="Map-reduce: document tokens per chunk.  [default: as many as fit]")] = None
    chunk_new_tokens: Annotated[Optional[int], _opt("--chunk-new-tokens", panel=P_GEN,
        min=16, help="Map-reduce: length of each chunk summary in tokens.")] = None
    words: Annotated[Optional[int], _opt("--words", "-w", panel=P_GEN, min=5,
        help="Target summary length in words (the prompt asks for it; --max-new-tokens still "
             "caps the tokens).  [default: from the genre and the document's length]")] = None
    instructions: Annotated[Optional[str], _opt("--instructions", "-i", panel=P_GEN,
        help="Replace the genre's task sentence in the prompt.")] = None
    temperature: Annotated[float, _opt("--temperature", panel=P_GEN, parser=_TEMPERATURE,
        help=f"0 = greedy.  {_TEMPERATURE_NOTE}")] = 0.0
    top_p: Annotated[float, _opt("--top-p", panel=P_GEN, parser=_TOP_P,
        help=f"Nucleus sampling mass (with --temperature > 0).  {_TOP_P_NOTE}")] = 1.0
    seed: Annotated[Optional[int], _opt("--seed", panel=P_GEN,
        help="Random seed for sampling.")] = None
    repetition_penalty: Annotated[float, _opt("--repetition-penalty", panel=P_GEN,
        parser=_PENALTY, help=f"> 1 discourages repeating tokens.  {_PENALTY_NOTE}")] = 1.1
    no_repeat_ngram: Annotated[int, _opt("--no-repeat-ngram", panel=P_GEN, min=0,
        help="Never repeat an n-gram of this size (0 = off).")] = 8
    attention: Annotated[Optional[Attention], _opt("--attention", panel=P_SPARSE,
        case_sensitive=False, help="auto: dense attention whenever the memory planner says the "
        "document's whole KV fits the budget (host RAM on the CPU, the profile's VRAM budget "
        "on a GPU), else the largest sparse working set that fits; dense: always exact; "
        "sparse: the profile's window and globals.  [default: the profile's, auto]")] = None
    probe: Annotated[Optional[Path], _opt("--probe", panel=P_SPARSE, readable=False,
        help="Probe file for --importance probe (implies it).  [default: the shipped one for "
             "the model]")] = None
    dense: Annotated[bool, _opt("--dense", panel=P_SPARSE,
        help="Same as --attention dense (kept for scripts).")] = False
    threads: Annotated[Optional[int], _opt("--threads", "-t", panel=P_MODEL, min=1,
        help="CPU threads, in every phase (overrides HISPARSE_THREADS).  [default: every CPU "
             "this process may use, fewer while other work holds CPUs]")] = None
    password: Annotated[Optional[str], _opt("--password", panel=P_MODEL,
        help="Password of encrypted PDFs.")] = None
    include_secrets: Annotated[bool, _opt("--include-secrets", panel=P_MODEL, help=(
        "Also read a folder's secrets (.env*, private keys, credential files, text holding a "
        "key or token), which are otherwise skipped and reported."))] = False
    quiet: Annotated[bool, _opt("--quiet", "-q", panel=P_OUT,
        help="No progress, log lines or stats table on stderr (errors still).")] = False
    sparse_flags: Mapping[str, object] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, **settings) -> "RunOptions":
        """RunOptions from Python keywords (the Ray Data Summarizer, tests): its own fields
        and SparseConfig's field names (the sparse flags); ConfigError for any other name."""
        from hisparse_cli.config.settings import SparseConfig
        from hisparse_cli.errors import ConfigError

        sparse_names = {f.name for f in fields(SparseConfig)}
        own = {f.name for f in fields(cls)} - {"sparse_flags"}
        unknown = sorted(set(settings) - own - sparse_names)
        if unknown:
            raise ConfigError(f"unknown setting(s) {', '.join(unknown)}",
                              hint=f"use the summarize flags as keywords: "
                                   f"{', '.join(sorted(own | sparse_names))}")
        sparse = {k: settings.pop(k) for k in list(settings) if k in sparse_names}
        if isinstance(settings.get("strategy"), str):
            settings["strategy"] = Strategy(settings["strategy"])
        if isinstance(settings.get("reduce"), str):
            settings["reduce"] = Reduce(settings["reduce"])
        if settings.get("probe") is not None:
            settings["probe"] = Path(settings["probe"])
        return cls(**settings, sparse_flags={k: v for k, v in sparse.items() if v is not None})

    def load_profile(self):
        from hisparse_cli.config.profiles import load_profile

        return load_profile(self.profile)

    def attention_mode(self, profile) -> str:
        """auto | dense | sparse: --attention, --dense (its alias), else the profile's.
        --dense with --attention auto/sparse is a usage error (exit 2)."""
        from hisparse_cli.errors import ConfigError

        if self.dense and self.attention not in (None, Attention.dense):
            raise ConfigError(f"--dense cannot be combined with --attention "
                              f"{self.attention.value}",
                              hint="--dense is --attention dense; give one of them")
        if self.dense:
            return "dense"
        return self.attention.value if self.attention is not None else profile.attention

    def explicit_sparse(self) -> bool:
        """Sparse working-set flags given (with --attention auto they mean sparse)."""
        from hisparse_cli.config.settings import SparseConfig

        shaping = {f.name for f in fields(SparseConfig) if f.metadata["sparse_only"]}
        return self.probe is not None or bool(shaping & set(self.sparse_flags))

    def sparse(self, profile):
        from hisparse_cli.errors import ConfigError
        from hisparse_cli.summarize.runtime import sparse_settings

        from hisparse_cli.config.settings import SparseConfig

        dense = self.attention_mode(profile) == "dense"
        declared = {f.name: f.metadata for f in fields(SparseConfig)}
        flags = dict(self.sparse_flags)
        given = [declared[n]["flag"] for n in flags if declared[n]["sparse_only"]]
        if dense and given:
            shown = " and ".join(given)
            raise ConfigError(f"dense attention cannot be combined with {shown}",
                              hint="dense attention has no window and no global tokens: drop "
                                   f"{shown}, or use --attention sparse")
        importance = flags.pop("importance", None)
        if self.probe is not None:  # a probe file says which importance is wanted
            if dense:
                raise ConfigError("dense attention cannot be combined with --probe",
                                  hint="dense attention keeps every token: nothing to score")
            if importance is None:
                importance = "probe"
            elif importance.strip().lower() != "probe":
                raise ConfigError(f"--probe is used only with --importance probe, not "
                                  f"--importance {importance}",
                                  hint="drop --probe, or use --importance probe")
        return sparse_settings(profile, dense=dense, importance=importance, **flags)

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
                               instructions=self.instructions, words=self.words,
                               reduce=self.reduce.value)


def _sparse_parameters() -> list[inspect.Parameter]:
    """One CLI option per SparseConfig field, from the field's declaration (config/settings.py):
    its flag, help and rule; None = not given (the profile's value applies)."""
    from hisparse_cli.config.settings import SparseConfig

    params = []
    for f in fields(SparseConfig):
        meta, kind = f.metadata, (str if f.metadata["choices"] else int)
        extra = {} if meta["minimum"] is None else {"min": meta["minimum"]}
        note = "  [default: the profile's]"
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                        annotation=Annotated[Optional[kind], _opt(
                                            meta["flag"], panel=P_SPARSE, help=meta["help"] + note,
                                            **extra)]))
    return params


def _shared_parameters() -> list[inspect.Parameter]:
    hints = get_type_hints(RunOptions, include_extras=True)
    return [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                              annotation=hints[f.name])
            for f in fields(RunOptions) if f.name != "sparse_flags"] + _sparse_parameters()


def _with_options(func, name: str, extra: list[inspect.Parameter], build):
    """`func` with the CLI parameters `extra` added to its signature; a call passes their
    values to `build(values)`, whose result reaches `func` as the keyword `name`."""
    sig = inspect.signature(func, eval_str=True)  # real objects: wrapper has other globals
    own = [p for p in sig.parameters.values() if p.name != name]

    @functools.wraps(func)
    def wrapper(**kwargs):
        return func(**{name: build({p.name: kwargs.pop(p.name) for p in extra})}, **kwargs)

    del wrapper.__wrapped__  # Typer must read the new signature, not func's
    wrapper.__signature__ = sig.replace(parameters=own + extra)
    wrapper.__annotations__ = {p.name: p.annotation for p in own + extra}
    return wrapper


def _given(values: dict) -> dict:
    return {n: v for n, v in values.items() if v is not None}


def run_options(func):
    """Decorator: add the shared options to `func`'s CLI signature; pass them as `opts`."""
    sparse_names = {p.name for p in _sparse_parameters()}

    def build(values):
        sparse = {n: values.pop(n) for n in sparse_names}
        return RunOptions(**values, sparse_flags=_given(sparse))

    return _with_options(func, "opts", _shared_parameters(), build)


def sparse_options(func):
    """Decorator: add one CLI option per SparseConfig field to `func`'s signature (for commands
    that take the sparse settings without the rest of the run options: `hisparse plan`); pass
    the given ones as `sparse_flags` (field name -> value)."""
    return _with_options(func, "sparse_flags", _sparse_parameters(), _given)


__all__ = ["RunOptions", "Strategy", "Attention", "run_options", "sparse_options", "P_OUT"]
