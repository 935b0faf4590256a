"""Document → summary: prompt building, stream vs map-reduce, and the `SummaryResult`.

    result = summarize_document(doc, engine, SummarySettings(), progress=None)
    result.summary, result.strategy, result.stats["decode_tok_s"], result.to_dict()

Strategy (`SummarySettings.strategy`):
  * "stream":      the whole document in one prompt; the engine streams it through the sparse
                   KV cache in prefill chunks. Allowed only when prompt tokens +
                   max_new_tokens fit the model's trained positions (max_position_embeddings):
                   K is stored at its original position, never shifted.
  * "map-reduce":  split on pages/files into chunks that fit (chunking.py), summarize each
                   chunk (its prompt names "pages 3–5" / the files), then summarize the chunk
                   summaries; when those do not fit in one prompt either, summarize groups of
                   them first and repeat (every round at least halves the count).
  * "auto":        stream when it fits, else map-reduce.
`progress(step, phase, done, total)` is called during every generation: step names the
generation ("summary", "part 2/5 (pages 3–5)", "combine 1/2", "final summary"), phase is
the engine's "prefill" | "decode"; ("prefill", 0, n) first marks the generation's start.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from hisparse_cli.summarize.chunking import merge_labels, split_document
from hisparse_cli.documents.base import Document
from hisparse_cli.config.settings import GenerationConfig, check_positions
from hisparse_cli.errors import ConfigError, InputError
from hisparse_cli.summarize.prompts import (chunk_prompt, combine_prompt, document_prompt, render_prompt,
                                  tokenizable)

STRATEGIES = ("auto", "stream", "map-reduce")
PipelineProgress = Callable[[str, str, int, int], None]  # (step, phase, done, total)
CHUNK_MARGIN = 0.95  # token counts of separately tokenized pieces are not exactly additive
MIN_CHUNK_TOKENS = 16


@dataclass(frozen=True)
class SummarySettings:
    """How to summarize (the engine's sparse settings live in the Engine).

    strategy:          auto | stream | map-reduce (module docstring)
    generation:        decoding settings of the final summary (max_new_tokens = its length)
    chunk_tokens:      map-reduce: at most this many document tokens per chunk
                       (None = as many as the model's positions allow)
    chunk_new_tokens:  map-reduce: length of each chunk summary
                       (None = min(max_new_tokens, max_positions // 8))
    instructions:      replaces the genre's task sentence in every prompt
    """

    strategy: str = "auto"
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    chunk_tokens: int | None = None
    chunk_new_tokens: int | None = None
    instructions: str | None = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"strategy must be one of {', '.join(STRATEGIES)}, got "
                              f"{self.strategy!r}", hint="use --strategy auto, stream or map-reduce")
        for name in ("chunk_tokens", "chunk_new_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < MIN_CHUNK_TOKENS):
                raise ConfigError(f"{name} must be an integer >= {MIN_CHUNK_TOKENS}, got {value!r}")

    def to_dict(self) -> dict:
        return {"strategy": self.strategy, "generation": asdict(self.generation),
                "chunk_tokens": self.chunk_tokens, "chunk_new_tokens": self.chunk_new_tokens,
                "instructions": self.instructions}


@dataclass
class ChunkSummary:
    """One generation of a map-reduce run. level 0: a document part; 1+: a combine round."""

    label: str
    level: int
    prompt_tokens: int
    new_tokens: int
    summary: str


@dataclass
class SummaryResult:
    summary: str
    strategy: str  # the strategy used: "stream" | "map-reduce"
    chunks: list[ChunkSummary]
    prompt_tokens: int  # summed over every generation
    new_tokens: int
    runs: list[dict]  # per generation: step, finish_reason and the engine's RunStats
    settings: dict
    timings: dict
    rouge: dict | None = None

    @property
    def stats(self) -> dict:
        return aggregate_stats(self.runs)

    def to_dict(self) -> dict:
        return {"summary": self.summary, "strategy": self.strategy, "rouge": self.rouge,
                "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
                "stats": self.stats, "chunks": [asdict(c) for c in self.chunks],
                "runs": self.runs, "settings": self.settings, "timings": self.timings}


def aggregate_stats(runs: list[dict]) -> dict:
    """Totals over generations: tokens and seconds summed, peaks maxed, rates recomputed."""
    stats = [r["stats"] for r in runs]
    out = {key: sum(s.get(key, 0) for s in stats) for key in (
        "prompt_tokens", "new_tokens", "prefill_seconds", "decode_seconds", "recalibrations",
        "blocks_allocated", "blocks_freed", "pages_offloaded", "bytes_to_cache")}
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


class _Run:
    """State of one summarize_document call: the engine, the budgets, and the record."""

    def __init__(self, doc: Document, engine, settings: SummarySettings,
                 progress: PipelineProgress | None) -> None:
        self.doc, self.engine, self.settings, self.progress = doc, engine, settings, progress
        self.tok = engine.tokenizer
        self.max_pos = int(engine.cfg.max_position_embeddings)
        self.gen = settings.generation
        self.runs: list[dict] = []
        self.chunks: list[ChunkSummary] = []
        self.settings_extra: dict = {}

    def count(self, text: str) -> int:
        return len(self.tok(tokenizable(text), add_special_tokens=False)["input_ids"])

    def render(self, prompt) -> list[int]:
        return render_prompt(self.tok, prompt)

    def generate(self, ids: list[int], max_new: int, step: str) -> str:
        report = None
        if self.progress is not None:
            def report(phase: str, done: int, total: int) -> None:
                self.progress(step, phase, done, total)  # type: ignore[misc]
            report("prefill", 0, len(ids))  # the start: rates are measured from here
        res = self.engine.generate(ids, gen=self.gen, max_new_tokens=max_new, progress=report)
        self.runs.append({"step": step, "finish_reason": res.finish_reason,
                          "stats": res.stats.to_dict()})
        return self.tok.decode(res.token_ids, skip_special_tokens=True).strip()

    # -- map-reduce ------------------------------------------------------------------------
    def chunk_new_tokens(self) -> int:
        return self.settings.chunk_new_tokens or min(self.gen.max_new_tokens,
                                                     max(MIN_CHUNK_TOKENS, self.max_pos // 8))

    def chunk_budget(self, chunk_new: int) -> int:
        genre, instr = self.doc.genre, self.settings.instructions
        overhead = len(self.render(chunk_prompt("", label="pages 9999–9999, lines 9999–9999",
                                                index=999, total=999, genre=genre,
                                                instructions=instr)))
        budget = int((self.max_pos - chunk_new - overhead) * CHUNK_MARGIN)
        combine_need = (len(self.render(combine_prompt([("x", "")] * 2, genre=genre,
                                                        instructions=instr)))
                        + 2 * (chunk_new + 24) + self.gen.max_new_tokens)
        if budget < MIN_CHUNK_TOKENS or combine_need > self.max_pos:
            raise ConfigError(
                f"max_new_tokens {self.gen.max_new_tokens} (chunk summaries: {chunk_new}) is too "
                f"large for map-reduce with this model's {self.max_pos} positions",
                hint="lower --max-new-tokens (and --chunk-new-tokens)")
        if self.settings.chunk_tokens:
            budget = min(budget, self.settings.chunk_tokens)
        return budget

    def map_reduce(self) -> str:
        genre, instr = self.doc.genre, self.settings.instructions
        chunk_new = self.chunk_new_tokens()
        budget = self.chunk_budget(chunk_new)
        prompts: list[tuple[str, list[int]]] = []
        for _attempt in range(5):  # shrink when a rendered prompt overshoots the positions
            chunks = split_document(self.doc, budget, self.count)
            prompts = [(c.label, self.render(chunk_prompt(
                c.text(self.doc), label=c.label, index=i + 1, total=len(chunks), genre=genre,
                instructions=instr))) for i, c in enumerate(chunks)]
            if all(len(ids) + chunk_new <= self.max_pos for _, ids in prompts):
                break
            budget = max(MIN_CHUNK_TOKENS, int(budget * 0.8))
        else:
            raise ConfigError("could not split the document into chunks that fit the model",
                              hint="lower --max-new-tokens or --chunk-tokens")
        self.settings_extra = {"chunk_tokens_effective": budget, "chunk_new_tokens": chunk_new}
        parts: list[tuple[str, str]] = []
        for i, (label, ids) in enumerate(prompts):
            text = self.generate(ids, chunk_new, f"part {i + 1}/{len(prompts)} ({label})")
            self._record(label, 0, ids, text)
            parts.append((label, text))
        if len(parts) == 1:
            return parts[0][1]
        return self.reduce(parts, chunk_new)

    def _record(self, label: str, level: int, ids: list[int], text: str) -> None:
        self.chunks.append(ChunkSummary(label, level, len(ids),
                                        self.runs[-1]["stats"]["new_tokens"], text))

    def reduce(self, parts: list[tuple[str, str]], chunk_new: int) -> str:
        genre, instr = self.doc.genre, self.settings.instructions
        level = 1
        while True:
            ids = self.render(combine_prompt(parts, genre=genre, instructions=instr))
            if len(ids) + self.gen.max_new_tokens <= self.max_pos:
                text = self.generate(ids, self.gen.max_new_tokens, "final summary")
                self._record("final summary", level, ids, text)  # every step is in `chunks`
                return text
            groups: list[list[tuple[str, str]]] = [[]]
            for part in parts:
                candidate = groups[-1] + [part]
                size = len(self.render(combine_prompt(candidate, genre=genre, final=False,
                                                      instructions=instr)))
                if groups[-1] and size + chunk_new > self.max_pos:
                    groups.append([part])
                else:
                    groups[-1] = candidate
            if len(groups) == len(parts):  # no two summaries fit together: cannot progress
                raise ConfigError("chunk summaries are too long to combine within the model's "
                                  f"{self.max_pos} positions", hint="lower --chunk-new-tokens")
            merged = []
            for j, group in enumerate(groups):
                if len(group) == 1:
                    merged.append(group[0])
                    continue
                label = merge_labels([lab for lab, _ in group])
                ids = self.render(combine_prompt(group, genre=genre, final=False,
                                                 instructions=instr))
                text = self.generate(ids, chunk_new, f"combine {j + 1}/{len(groups)} ({label})")
                self._record(label, level, ids, text)
                merged.append((label, text))
            parts, level = merged, level + 1


def summarize_document(doc: Document, engine, settings: SummarySettings | None = None,
                       progress: PipelineProgress | None = None) -> SummaryResult:
    """Summarize `doc` with `engine` (an `Engine`, or anything with its `tokenizer`, `cfg`
    and `generate`). Raises InputError for an empty document and ConfigError when the
    requested strategy or lengths cannot work with the model's positions."""
    settings = settings or SummarySettings()
    started = time.perf_counter()
    if not doc.text.strip():
        raise InputError(f"{doc.source} has no text to summarize",
                         hint="check the document (an empty file or a folder without sources?)")
    run = _Run(doc, engine, settings, progress)
    check_positions(run.max_pos, max_new_tokens=run.gen.max_new_tokens)  # as `hisparse plan`
    ids = run.render(document_prompt(doc.text, genre=doc.genre, title=doc.title,
                                     instructions=settings.instructions))
    need = len(ids) + run.gen.max_new_tokens
    fits = need <= run.max_pos
    strategy = settings.strategy
    if strategy == "auto":
        strategy = "stream" if fits else "map-reduce"
    if strategy == "stream" and not fits:
        raise ConfigError(
            f"the document needs {need:,} positions ({len(ids):,} prompt + "
            f"{run.gen.max_new_tokens} new tokens) but the model was trained on "
            f"{run.max_pos:,}", hint="use --strategy map-reduce (or auto)")
    prepared = time.perf_counter()
    summary = run.generate(ids, run.gen.max_new_tokens, "summary") if strategy == "stream" \
        else run.map_reduce()
    done = time.perf_counter()
    settings_dict = {**settings.to_dict(), "max_positions": run.max_pos, **run.settings_extra}
    totals = aggregate_stats(run.runs)
    return SummaryResult(
        summary=summary, strategy=strategy, chunks=run.chunks,
        prompt_tokens=totals["prompt_tokens"], new_tokens=totals["new_tokens"], runs=run.runs,
        settings=settings_dict,
        timings={"prepare_seconds": prepared - started, "generate_seconds": done - prepared,
                 "total_seconds": done - started})


__all__ = ["STRATEGIES", "SummarySettings", "SummaryResult", "ChunkSummary",
           "summarize_document", "aggregate_stats"]
