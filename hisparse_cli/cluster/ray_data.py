"""The Ray Data entry point: summarize the rows of a Ray Dataset with `map_batches`.

    import ray
    from ray.data import ActorPoolStrategy
    from hisparse_cli.cluster.ray_data import Summarizer

    ds = ray.data.from_items([{"path": "contract.pdf", "reference": None},
                              {"text": "Some long report…", "reference": "Its summary."}])
    out = ds.map_batches(Summarizer, fn_constructor_kwargs={"profile": "cpu",
                                                             "max_new_tokens": 200},
                         compute=ActorPoolStrategy(size=2), num_gpus=0, batch_size=4)
    # (Ray before 2.51 also takes concurrency=2 for compute=…)

Each actor builds the same Job the CLI builds from the same settings (`fn_constructor_kwargs`
are the flags of `hisparse summarize`/`batch` as keywords: profile, model, max_new_tokens,
window, dense, strategy, …, plus `threads`), is placed like a batch worker (its assigned GPU,
or no GPU at all: cluster/worker.place_worker) and loads the model once.

Input columns, per row: `path` (a PDF, text file or repository folder readable on the
worker's node) or, when it is null, `text` (the document itself); `reference` (optional:
the reference summary's text; null or missing: no ROUGE). The names are settable
(path_column, text_column, reference_column). The input columns are passed through, and
these are added:
    summary      str | None        None when the row failed
    strategy     str | None        "stream" | "map-reduce"
    rouge        dict | None       rouge1, rouge2, rougeL, rougeLsum F1 (with a reference)
    stats        dict | None       the summarize stats (tokens, tok/s, KV peak, device, …)
    error        dict | None       {type, message, hint, exit_code}; None when it succeeded
    seconds      float             the row's time on its worker
    settings_id  str               the same fingerprint as a batch record's
A failing row never fails the batch; a model that cannot load fails the actor (Ray's error).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path

from hisparse_cli.errors import ConfigError, InputError

OUTPUT_COLUMNS = ("summary", "strategy", "rouge", "stats", "error", "seconds", "settings_id")


def text_document(text, source: str = "<text>"):
    """A Document from text given in a row (the checks of a text file: not empty, at most
    IngestLimits().max_total_chars characters; genre guessed)."""
    from hisparse_cli.documents import IngestLimits, guess_genre
    from hisparse_cli.documents.base import Document, Section

    if not isinstance(text, str) or not text.strip():
        raise InputError(f"{source}: the text is empty", hint="give the document's text")
    limit = IngestLimits().max_total_chars
    if len(text) > limit:
        raise InputError(f"{source} is longer than the limit of {limit:,} characters",
                         hint="split the document into parts and summarize them separately")
    doc = Document(text=text, kind="text", source=source,
                   sections=(Section(label=source, start=0, end=len(text)),), title="")
    return replace(doc, genre=guess_genre(text, "text"))


def _value(row: dict, column: str | None):
    """A cell as a Python value; None for a null. (A column that is null throughout a batch
    reaches numpy batches as float NaN, pandas ones as NaN too.)"""
    value = row.get(column) if column else None
    if getattr(value, "ndim", None) == 0:  # a numpy scalar
        value = value.item()
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return value


class Summarizer:
    """Callable class for `Dataset.map_batches` (module docstring)."""

    def __init__(self, *, path_column: str = "path", text_column: str = "text",
                 reference_column: str | None = "reference", threads: int | None = None,
                 **settings) -> None:
        from hisparse_cli.cluster.worker import (drop_shadowing_paths, place_worker,
                                                 set_worker_threads)

        drop_shadowing_paths()  # before anything imports transformers in this actor
        from hisparse_cli.cli.options import RunOptions
        from hisparse_cli.cli.summarize import build_job

        try:
            self.options = RunOptions.from_settings(**{**settings, "quiet": True})
        except ConfigError as exc:
            raise ConfigError(f"Summarizer: {exc.message}", hint=exc.hint) from None
        self.columns = (path_column, text_column, reference_column)
        self.job = build_job(self.options)
        self.settings_id = self.job.settings_id()
        self.placement = place_worker()
        set_worker_threads(threads)
        self.job.engine()  # once per actor

    def __call__(self, batch) -> dict:
        if hasattr(batch, "to_dict") and hasattr(batch, "columns"):  # batch_format="pandas"
            batch = {column: batch[column].tolist() for column in batch.columns}
        batch = dict(batch)
        size = len(next(iter(batch.values()))) if batch else 0
        rows = [{column: values[i] for column, values in batch.items()} for i in range(size)]
        out = {column: [] for column in OUTPUT_COLUMNS}
        for row in rows:
            for column, value in self._summarize_row(row).items():
                out[column].append(value)
        return {**batch, **out}

    def _summarize_row(self, row: dict) -> dict:
        from hisparse_cli.summarize.batch import printable_record
        from hisparse_cli.summarize.batch_document import error_record, release_cuda_memory
        from hisparse_cli.documents import load_document

        path_column, text_column, reference_column = self.columns
        started = time.perf_counter()
        result = {"summary": None, "strategy": None, "rouge": None, "stats": None,
                  "error": None}
        try:
            path = _value(row, path_column)
            if path is not None:
                doc = load_document(Path(str(path)), password=self.options.password)
            else:
                doc = text_document(_value(row, text_column))
            ingest = time.perf_counter() - started
            reference = _value(row, reference_column)
            reference = str(reference) if reference is not None and str(reference).strip() \
                else None
            record = self.job.run(doc, reference_text=reference, ingest_seconds=ingest)
            result.update(summary=record["summary"], strategy=record["strategy"],
                          rouge=record["rouge"], stats=record["stats"])
        except Exception as exc:  # noqa: BLE001 - a failing row never fails the batch
            result["error"] = error_record(exc)
            if not isinstance(exc, InputError):
                release_cuda_memory()
        result = printable_record(result)
        result.update(seconds=time.perf_counter() - started, settings_id=self.settings_id)
        return result


__all__ = ["Summarizer", "text_document", "OUTPUT_COLUMNS"]
