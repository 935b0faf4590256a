"""Document → summary: strategy (stream vs map-reduce vs collection), length, and the result.

    result = summarize_document(doc, engine, SummarySettings(), progress=None)
    result.summary, result.strategy, result.warnings, result.stats["decode_tok_s"], result.to_dict()

Strategy (`SummarySettings.strategy`):
  * "stream":      the whole document in one prompt. Allowed only when prompt tokens + the
                   summary's token cap fit the model's trained positions
                   (max_position_embeddings): K is stored at its original position, never
                   shifted.
  * "map-reduce":  notes on each chunk, then one summary from the notes (mapreduce.py).
  * "auto":        stream when it fits, else map-reduce.
A collection of two or more documents (kind "collection", one section per member document) is
summarized member by member — each member as its own document, by stream or map-reduce — and
then as a collection (mapreduce.py), unless "stream" is asked for and it fits.
Length (lengths.py): the target words come from the genre and the document's length (or
`words`), the token cap from `generation.max_new_tokens`. Every generation goes through the
guard (summary_run.py): retries, repairs and digests are listed in `warnings` and counted in
`guard` and the stats.
`progress(step, phase, done, total)` is called during every generation: step names the
generation ("summary", "part 2/5 (pages 3–5)", "combine 1/2", "final summary", "document 2/4
(notes.md)"), phase is the engine's "prefill" | "decode"; ("prefill", 0, n) first marks the
generation's start.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from hisparse_cli.documents.base import Document
from hisparse_cli.config.settings import GenerationConfig, check_positions
from hisparse_cli.errors import ConfigError, InputError
from hisparse_cli.summarize.guard import words
from hisparse_cli.summarize.lengths import LengthPlan, length_plan
from hisparse_cli.summarize.prompts import document_prompt
from hisparse_cli.summarize.summary_run import ChunkSummary, SummaryRun

STRATEGIES = ("auto", "stream", "map-reduce")
REDUCES = ("auto", "select", "generate")
PipelineProgress = Callable[[str, str, int, int], None]  # (step, phase, done, total)
MIN_CHUNK_TOKENS = 16
MIN_WORDS_TARGET = 5


@dataclass(frozen=True)
class SummarySettings:
    """How to summarize (the engine's attention settings live in the Engine / Job).

    strategy:          auto | stream | map-reduce (module docstring)
    generation:        decoding settings; max_new_tokens caps the final summary's tokens
    chunk_tokens:      map-reduce: at most this many document tokens per chunk
                       (None = as many as the model's positions allow, chunks of equal size)
    chunk_new_tokens:  map-reduce: token cap of each chunk's notes (None = from its length)
    instructions:      replaces the genre's task sentence in every prompt
    words:             target words of the summary (None = from genre and document length)
    reduce:            map-reduce's final step: auto | select | generate (mapreduce.py:
                       reduce_mode)
    """

    strategy: str = "auto"
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    chunk_tokens: int | None = None
    chunk_new_tokens: int | None = None
    instructions: str | None = None
    words: int | None = None
    reduce: str = "auto"

    def __post_init__(self) -> None:
        if self.reduce not in REDUCES:
            raise ConfigError(f"reduce must be one of {', '.join(REDUCES)}, got {self.reduce!r}",
                              hint="use --reduce auto, select or generate")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"strategy must be one of {', '.join(STRATEGIES)}, got "
                              f"{self.strategy!r}", hint="use --strategy auto, stream or map-reduce")
        for name, low in (("chunk_tokens", MIN_CHUNK_TOKENS),
                          ("chunk_new_tokens", MIN_CHUNK_TOKENS), ("words", MIN_WORDS_TARGET)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < low):
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")

    def to_dict(self) -> dict:
        return {"strategy": self.strategy, "generation": asdict(self.generation),
                "chunk_tokens": self.chunk_tokens, "chunk_new_tokens": self.chunk_new_tokens,
                "instructions": self.instructions, "words": self.words, "reduce": self.reduce}


@dataclass
class SummaryResult:
    summary: str
    strategy: str  # the strategy used: "stream" | "map-reduce" | "collection"
    chunks: list[ChunkSummary]
    prompt_tokens: int  # summed over every generation
    new_tokens: int
    runs: list[dict]  # per generation: step, finish_reason and the engine's RunStats
    settings: dict
    timings: dict
    rouge: dict | None = None
    warnings: list[str] = field(default_factory=list)
    guard: dict = field(default_factory=dict)  # retries, repairs, digests, trimmed
    length: dict = field(default_factory=dict)  # target_words, max_new_tokens, words

    @property
    def stats(self) -> dict:
        return {**aggregate_stats(self.runs),
                **{f"guard_{key}": value for key, value in self.guard.items()}}

    def to_dict(self) -> dict:
        return {"summary": self.summary, "strategy": self.strategy, "rouge": self.rouge,
                "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
                "stats": self.stats, "length": self.length, "guard": self.guard,
                "warnings": list(self.warnings), "chunks": [asdict(c) for c in self.chunks],
                "runs": self.runs, "settings": self.settings, "timings": self.timings}


def aggregate_stats(runs: list[dict]) -> dict:
    """Totals over generations: tokens and seconds summed, peaks maxed, rates recomputed."""
    stats = [r["stats"] for r in runs]
    out = {key: sum(s.get(key, 0) for s in stats) for key in (
        "prompt_tokens", "new_tokens", "prefill_seconds", "decode_seconds", "recalibrations",
        "blocks_allocated", "blocks_freed", "pages_offloaded", "bytes_to_cache",
        "kernel_compiles", "kernel_compile_seconds", "kernel_loads", "kernel_load_seconds")}
    for key in ("kv_blocks_peak", "kv_bytes_peak", "peak_memory_bytes", "offload_bytes"):
        out[key] = max((s.get(key, 0) for s in stats), default=0)
    out["prefill_tok_s"] = (out["prompt_tokens"] / out["prefill_seconds"]
                            if out["prefill_seconds"] else 0.0)
    out["decode_tok_s"] = (out["new_tokens"] / out["decode_seconds"]
                           if out["decode_seconds"] else 0.0)
    last = stats[-1] if stats else {}
    for key in ("peak_memory_kind", "device", "backend"):
        out[key] = last.get(key, "")
    for key in ("cache_hit_rate", "pages_retrieved_per_step"):  # the last generation's
        out[key] = last.get(key, 0.0)
    out["generations"] = len(stats)
    return out


def plan_length(run: SummaryRun, doc: Document, cap: int, words_wanted: int | None,
                doc_tokens: int | None = None) -> LengthPlan:
    return length_plan(doc.genre, doc_words=len(words(doc.text)),
                       doc_tokens=doc_tokens if doc_tokens is not None else run.count(doc.text),
                       cap_tokens=cap, words=words_wanted)


def stream_ids(run: SummaryRun, doc: Document, length: LengthPlan) -> list[int]:
    return run.render(document_prompt(doc.text, genre=doc.genre, title=doc.title,
                                      instructions=run.settings.instructions,
                                      target_words=length.target_words))


def summarize_single(run: SummaryRun, doc: Document, length: LengthPlan, strategy: str,
                     step: str = "summary", label: str | None = None) -> tuple[str, str]:
    """(summary, strategy used) of one document: stream when `strategy` allows and it fits."""
    from hisparse_cli.summarize.mapreduce import map_reduce

    ids = stream_ids(run, doc, length)
    need = len(ids) + length.max_new_tokens
    fits = need <= run.max_pos
    if strategy == "stream" and not fits:
        raise ConfigError(
            f"the document needs {need:,} positions ({len(ids):,} prompt + "
            f"{length.max_new_tokens} new tokens) but the model was trained on "
            f"{run.max_pos:,}", hint="use --strategy map-reduce (or auto)")
    if strategy == "map-reduce" or not fits:
        return map_reduce(run, doc, length, step=step, label=label), "map-reduce"
    text = run.guarded(ids, length.max_new_tokens, step, target_words=length.target_words,
                       min_new=length.min_new_tokens,
                       source=doc.text, label=label, level=0 if label else 1)
    return text, "stream"


def summarize_document(doc: Document, engine, settings: SummarySettings | None = None,
                       progress: PipelineProgress | None = None) -> SummaryResult:
    """Summarize `doc` with `engine` (an `Engine`, or anything with its `tokenizer`, `cfg`
    and `generate`). Raises InputError for an empty document and ConfigError when the
    requested strategy or lengths cannot work with the model's positions."""
    from hisparse_cli.summarize.mapreduce import is_collection, summarize_collection

    settings = settings or SummarySettings()
    started = time.perf_counter()
    if not doc.text.strip():
        raise InputError(f"{doc.source} has no text to summarize",
                         hint="check the document (an empty file or a folder without sources?)")
    run = SummaryRun(doc, engine, settings, progress)
    cap = run.gen.max_new_tokens
    check_positions(run.max_pos, max_new_tokens=cap)  # as `hisparse plan`
    length = plan_length(run, doc, cap, settings.words)
    prepared = time.perf_counter()
    if is_collection(doc) and settings.strategy != "stream":
        summary, strategy = summarize_collection(run, doc, length, summarize_single), "collection"
    else:
        summary, strategy = summarize_single(run, doc, length, settings.strategy)
    done = time.perf_counter()
    settings_dict = {**settings.to_dict(), "max_positions": run.max_pos, **run.settings_extra}
    totals = aggregate_stats(run.runs)
    return SummaryResult(
        summary=summary, strategy=strategy, chunks=run.chunks,
        prompt_tokens=totals["prompt_tokens"], new_tokens=totals["new_tokens"], runs=run.runs,
        settings=settings_dict, warnings=run.warnings, guard=dict(run.guard),
        length={"target_words": length.target_words, "max_new_tokens": length.max_new_tokens,
                "min_new_tokens": length.min_new_tokens, "words": len(words(summary))},
        timings={"prepare_seconds": prepared - started, "generate_seconds": done - prepared,
                 "total_seconds": done - started})


__all__ = ["STRATEGIES", "SummarySettings", "SummaryResult", "ChunkSummary",
           "summarize_document", "summarize_single", "aggregate_stats", "plan_length"]
