"""`hisparse plan PATH`: what a summarize run of PATH will do, known before any weights load.

The document is read as `summarize` reads it, then the pipeline itself runs on a *dry
engine*: the model's tokenizer and config (no weights), and a `generate` that records each
generation's prompt and returns a short fixed text at once. So the prompt, the strategy
(stream or map-reduce), the chunks and their labels and prompt sizes are the pipeline's own
decisions (pipeline.summarize_document: no rule is repeated here), and a summarize run with
the same settings gets the same ones. What the dry run cannot know: how long the real chunk
summaries will be, so the prompts of the combine steps (map-reduce) are not predicted.

    report = plan_document(doc, model_folder, settings)
    report.strategy, report.chunks, report.prompt_tokens, report.peak_generation
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hisparse_cli.documents.base import Document

DRY_SUMMARY = "This part states its main points."  # what every dry generation "writes"


@dataclass
class _DryStats:
    prompt_tokens: int
    new_tokens: int

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens}


@dataclass
class _DryResult:
    token_ids: list[int]
    stats: _DryStats
    finish_reason: str = "dry-run"
    extra: dict = field(default_factory=dict)


class DryEngine:
    """What the pipeline needs of an Engine (tokenizer, cfg, generate), without weights:
    `generate` records (prompt tokens, max new tokens) and returns DRY_SUMMARY's tokens."""

    def __init__(self, tokenizer, cfg) -> None:
        self.tokenizer, self.cfg = tokenizer, cfg
        self.calls: list[tuple[int, int]] = []
        self._reply = tokenizer(DRY_SUMMARY, add_special_tokens=False, verbose=False)["input_ids"]

    def generate(self, token_ids, max_new_tokens: int | None = None, *, gen=None,
                 progress=None, **_overrides) -> _DryResult:
        prompt = len(token_ids)
        new = max_new_tokens if max_new_tokens is not None else gen.max_new_tokens
        self.calls.append((prompt, new))
        reply = list(self._reply[:new])
        return _DryResult(reply, _DryStats(prompt, len(reply)))


@dataclass(frozen=True)
class DocumentPlan:
    document_tokens: int  # the document's text alone
    strategy: str  # "stream" | "map-reduce"
    prompt_tokens: int  # stream: the prompt; map-reduce: the chunk prompts summed
    chunks: tuple[dict, ...]  # map-reduce: label, prompt_tokens, new_tokens of each part
    peak_generation: tuple[int, int]  # (prompt, max new tokens) of the largest generation
    #                                   (map-reduce: the final one's bound, max_positions)
    max_positions: int
    settings: dict  # the pipeline's settings record (chunk budget, ...)

    def to_dict(self) -> dict:
        return {"document_tokens": self.document_tokens, "strategy": self.strategy,
                "prompt_tokens": self.prompt_tokens, "chunk_count": len(self.chunks),
                "chunks": list(self.chunks),
                "peak_generation": {"prompt_tokens": self.peak_generation[0],
                                    "max_new_tokens": self.peak_generation[1]},
                "max_positions": self.max_positions,
                "combine_prompts_predicted": False}


def load_tokenizer(folder: Path):
    """The model's tokenizer exactly as the Engine loads it (engine.Engine.tokenizer)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def plan_document(doc: Document, tokenizer, cfg, settings) -> DocumentPlan:
    """Run the pipeline on `doc` with a DryEngine (module docstring)."""
    from hisparse_cli.summarize.pipeline import summarize_document
    from hisparse_cli.summarize.prompts import count_tokens

    engine = DryEngine(tokenizer, cfg)
    result = summarize_document(doc, engine, settings)
    doc_tokens = count_tokens(tokenizer, doc.text)
    max_pos = int(cfg.max_position_embeddings)
    if result.strategy == "stream":
        chunks: tuple[dict, ...] = ()
        prompt = engine.calls[0][0]
        peak = engine.calls[0]
    else:
        chunk_new = int(result.settings.get("chunk_new_tokens") or 0)
        chunks = tuple({"label": c.label, "prompt_tokens": c.prompt_tokens,
                        "max_new_tokens": chunk_new}
                       for c in result.chunks if c.level == 0)
        prompt = sum(c["prompt_tokens"] for c in chunks)
        final_new = settings.generation.max_new_tokens  # the final summary: its prompt holds
        combine = (max_pos - final_new, final_new)      # real chunk summaries, at most this
        peak = max([(c["prompt_tokens"], chunk_new) for c in chunks] + [combine],
                   key=lambda call: call[0] + call[1])
    return DocumentPlan(doc_tokens, result.strategy, prompt, chunks, peak, max_pos,
                        result.settings)


__all__ = ["DocumentPlan", "DryEngine", "plan_document", "load_tokenizer", "DRY_SUMMARY"]
