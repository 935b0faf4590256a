"""One summarization setup shared by `summarize` and `batch`: profile + model + settings,
the engine loaded once (lazily), and a document (+ reference) → one JSON-ready result.

    job = Job(profile, sparse, settings, model_spec=None)
    record = job.run(load_document(path), reference_text=None, progress=None)
    record["summary"], record["rouge"], record["stats"], record["settings"]

Everything is validated in the constructor's inputs (profile, SparseConfig, SummarySettings
raise ConfigError), so a bad flag fails before the model is resolved or loaded.

`job.spec()` is the same setup as a picklable `JobSpec`: a Ray worker builds its own Job from
it (`spec.build()`), loads the model once and summarizes what the driver hands it.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from hisparse_cli.documents.base import Document
from hisparse_cli.config.settings import SparseConfig
from hisparse_cli.errors import InputError
from hisparse_cli.summarize.pipeline import PipelineProgress, SummarySettings, summarize_document
from hisparse_cli.config.profiles import HardwareProfile

PROMPT_OVERHEAD_TOKENS = 320  # system message, task sentences, chat template: above any prompt's


def document_info(doc: Document, count: Callable[[str], int] | None = None) -> dict:
    """What the JSON output says about the document. `items`: every file read — a
    repository's files, a collection's documents, else the one input — with its size in
    bytes and (given `count`, the tokenizer's counter) the tokens its text adds."""
    unit = {"pdf": "pages", "repository": "files", "collection": "documents"}.get(
        doc.kind, "sections")
    number = doc.meta.get(unit, len(doc.sections)) if unit != "sections" else len(doc.sections)
    if doc.kind in ("repository", "collection"):
        spans = [(s.label, s.bytes, doc.text[s.start:s.end]) for s in doc.sections]
    else:
        spans = [(doc.source, doc.meta.get("bytes"), doc.text)]
    items = [{"path": path, "bytes": size, "tokens": count(text) if count else None}
             for path, size, text in spans]
    return {"source": doc.source, "kind": doc.kind, "genre": doc.genre, "title": doc.title,
            "chars": len(doc.text), "unit": unit, "sections": number, "items": items,
            "skipped": len(doc.skipped),
            "skipped_items": [{"item": item, "reason": why} for item, why in doc.skipped]}


def document_path(path: str | Path, given: str = "PATH") -> Path:
    """`path` (home expanded) checked reachable and readable before `load_document` reads
    it: a file or folder the user may not read, or one inside a folder that cannot be
    entered, is an InputError (exit 3) with one line, never a PermissionError. A missing
    path passes: load_document reports it."""
    path = Path(path).expanduser()
    try:
        is_dir = stat.S_ISDIR(path.stat().st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return path
    except OSError as exc:  # EACCES on a parent folder, ELOOP, ...
        raise InputError(f"cannot read {path}: {exc.strerror or exc}",
                         hint=f"check the path given as {given} and its folders' "
                              "permissions") from None
    if not os.access(path, os.R_OK | (os.X_OK if is_dir else 0)):
        what = "folder" if is_dir else "file"
        raise InputError(f"cannot read {path}: permission denied",
                         hint=f"make the {what} readable (chmod u+r{'x' if is_dir else ''}) "
                              f"or give another {given}")
    return path


def read_reference(path: str | Path, role: str = "reference",
                   given: str = "--reference") -> str:
    """A reference summary file as text, decoded like a text document (`decode_bytes`: a BOM,
    else UTF-8, else cp1252); InputError when missing/unreadable/binary/empty. role and given
    name the file in the messages (`hisparse score` reads its SUMMARY through this too)."""
    from hisparse_cli.documents.text import SNIFF_BYTES, decode_bytes, looks_binary

    path = Path(path).expanduser()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise InputError(f"{role} {path}: no such file",
                         hint=f"check the path given as {given}") from None
    except IsADirectoryError:
        raise InputError(f"{role} {path} is a folder, not a text file",
                         hint=f"give a plain-text file as {given}") from None
    except OSError as exc:
        raise InputError(f"cannot read {role} {path}: {exc.strerror or exc}",
                         hint=f"give a readable plain-text {role}") from None
    if looks_binary(data[:SNIFF_BYTES]):
        raise InputError(f"{role} {path} looks like a binary file, not text",
                         hint=f"give a plain-text {role}")
    try:
        text = decode_bytes(data)[0]
    except InputError as exc:
        raise InputError(f"cannot read {role} {path}: {exc.message}", hint=exc.hint) from None
    if not text.strip():
        raise InputError(f"{role} {path} is empty", hint=f"give a non-empty {role}")
    return text


def cpu_run_stats(runs: list[dict]) -> dict:
    """What a result's stats say about the CPU runtime over its generations: the decode path
    (model/cpu_decode.py) and the thread counts each phase ran with (threads.py), in order,
    e.g. {"prefill": [2], "decode": [2, 1]}."""
    out: dict = {}
    threads: dict[str, list[int]] = {}
    for run in runs:
        stats = run.get("stats", {})
        if stats.get("decode_path"):
            out["decode_path"] = stats["decode_path"]
        for phase, counts in (stats.get("threads") or {}).items():
            seq = threads.setdefault(phase, [])
            for n in counts:
                if not seq or seq[-1] != n:
                    seq.append(n)
    if threads:
        out["threads"] = threads
    return out


class Job:
    """`attention`: auto | dense | sparse (planner/attention_choice.py); `explicit_sparse`:
    sparse flags were given on the command line (auto then means sparse)."""

    def __init__(self, profile: HardwareProfile, sparse: SparseConfig,
                 settings: SummarySettings, *, model_spec: str | None = None,
                 warn: Callable[[str], None] | None = None, model_progress=None,
                 resolve: Callable | None = None, probe_path: Path | None = None,
                 stage: Callable[[str], object] | None = None,
                 threads: int | None = None, attention: str = "auto",
                 explicit_sparse: bool = False) -> None:
        from hisparse_cli.planner.attention_choice import check_mode

        self.profile, self.sparse, self.settings = profile, sparse, settings
        self.stage = stage  # a context manager per slow stage (console.status), or None
        self.attention, self.explicit_sparse = check_mode(attention), explicit_sparse
        self.probe_path, self.threads = probe_path, threads
        self.model_spec, self.warn, self.model_progress = model_spec, warn, model_progress
        self._resolve = resolve
        self._engine = None
        self.model_path: Path | None = None
        self.device_plan = None
        self.model = {}

    @property
    def loaded(self) -> bool:
        return self._engine is not None

    def resolve(self) -> Path:
        """The model's folder, resolved (pulled when needed) once."""
        if self.model_path is None:
            from hisparse_cli import hub as models
            from hisparse_cli.summarize.runtime import model_info

            resolve = self._resolve or models.resolve_model
            self.model_path = Path(resolve(self.model_spec, progress=self.model_progress))
            self.model = model_info(self.model_path)
        return self.model_path

    def spec(self, model_path: Path | None = None) -> "JobSpec":
        """This setup as a picklable JobSpec (for worker processes). `model_path`: a folder
        already resolved here, which the workers load instead of resolving the spec again."""
        return JobSpec(self.profile, self.sparse, self.settings,
                       model_spec=str(model_path) if model_path is not None else self.model_spec,
                       probe_path=self.probe_path)

    def engine(self):
        """The Engine, resolved (pulled when needed) and loaded on first use."""
        if self._engine is None:
            from contextlib import nullcontext

            from hisparse_cli.summarize.runtime import load_engine

            self.resolve()
            with (self.stage(f"loading model {self.model_path.name}") if self.stage
                  else nullcontext()):
                self._engine, self.device_plan = load_engine(self.model_path, self.profile,
                                                             self.sparse, warn=self.warn,
                                                             probe_path=self.probe_path,
                                                             threads=self.threads)
        return self._engine

    def release(self) -> None:
        """Free what the engine keeps between generate calls (KV storage, decode graph)."""
        release = getattr(self._engine, "release_cached_state", None)
        if release is not None:
            release()

    def settings_dict(self) -> dict:
        """Profile, model, device and sparse settings (the pipeline adds its own)."""
        return {"profile": self.profile.name, "model": self.model,
                "device": self.device_plan.to_dict() if self.device_plan else None,
                "sparse": asdict(self.sparse)}

    def settings_view(self) -> dict:
        """What decides a summary, known before the model loads: the model and probe as asked
        for (an existing local path resolved), the profile, sparse and summary settings (the
        keys of `settings` in a result, except `model`, which is the loaded model there)."""
        def asked(spec) -> str | None:
            if spec is None:
                return None
            path = Path(spec).expanduser()
            return str(path.resolve()) if path.exists() else str(spec)

        view = {"model": asked(self.model_spec), "probe": asked(self.probe_path),
                "profile": self.profile.name, "attention": self.attention,
                "sparse": asdict(self.sparse), **self.settings.to_dict()}
        return json.loads(json.dumps(view, default=str))  # as a results file holds it

    def settings_id(self) -> str:
        """A short fingerprint of `settings_view` (batch records carry it; --resume compares)."""
        text = json.dumps(self.settings_view(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def context_for(self, doc: Document) -> int:
        """The prompt tokens of `doc`'s largest generation, as the plans below are asked."""
        engine = self.engine()
        max_pos = int(engine.cfg.max_position_embeddings)
        cap = self.settings.generation.max_new_tokens
        context = max(1, min(max_pos - cap, len(doc.text) // 2 + PROMPT_OVERHEAD_TOKENS))
        if self.attention == "auto" and not self.explicit_sparse and not self.sparse.dense:
            from hisparse_cli.summarize.prompts import count_tokens

            tokens = count_tokens(engine.tokenizer, doc.text)
            context = max(1, min(max_pos - cap, tokens + PROMPT_OVERHEAD_TOKENS))
        return context

    def choose_attention(self, doc: Document):
        """The AttentionChoice for `doc` (planner/attention_choice.py): the planner asked about
        the dense KV of the document's largest generation on this run's device and budget."""
        return self.attention_for(self.context_for(doc), self.settings.generation.max_new_tokens)

    def keep_prefill_weights(self, context: int, new_tokens: int, sparse: SparseConfig) -> int:
        """Give the engine the prefill weight cache the plan of this generation has room for
        (planner/memory.py: on CUDA with INT4 weights, the layers whose W^T fit the budget
        beside the run; else none) before it runs; returns the layers kept."""
        engine = self.engine()
        layers = 0
        if self.device_plan is not None and self.device_plan.device == "cuda":
            from hisparse_cli.planner.profile import plan_for_profile

            plan = plan_for_profile(engine.cfg, self.profile, context_tokens=context,
                                    max_new_tokens=new_tokens, sparse=sparse,
                                    device_kind="cuda", prefill_cache_layers=None)
            layers = int(plan.settings.get("prefill_cache_layers") or 0)
        keep = getattr(engine, "keep_prefill_weights", None)
        if keep is not None and (layers or getattr(engine, "prefill_cache_layers", 0)):
            keep(layers)
        return layers

    def attention_for(self, context: int, new_tokens: int):
        """The AttentionChoice for a generation of `context` prompt + `new_tokens` positions
        (what choose_attention asks for a document; `hisparse warmup` asks it by length)."""
        from hisparse_cli.planner.attention_choice import choose_attention

        engine, cap = self.engine(), new_tokens
        device = self.device_plan.device if self.device_plan else "cpu"
        budget_name = "host RAM" if device == "cpu" else "VRAM budget"

        def plan(sparse: SparseConfig):
            from hisparse_cli.planner.profile import plan_for_profile

            return plan_for_profile(engine.cfg, self.profile, context_tokens=context,
                                    max_new_tokens=cap, sparse=sparse, device_kind=device)

        return choose_attention(self.attention, sparse=self.sparse, plan=plan,
                                context_tokens=context + cap,
                                explicit_sparse=self.explicit_sparse, budget_name=budget_name)

    def run(self, doc: Document, *, reference_text: str | None = None,
            reference_path: str | None = None, ingest_seconds: float = 0.0,
            progress: PipelineProgress | None = None) -> dict:
        """Summarize `doc` (and score it when a reference is given) → the result object."""
        from hisparse_cli.planner.attention_choice import running_under

        engine = self.engine()
        context, cap = self.context_for(doc), self.settings.generation.max_new_tokens
        choice = self.attention_for(context, cap)
        cache_layers = self.keep_prefill_weights(context, cap, choice.sparse)
        with running_under(engine, choice.sparse):
            result = summarize_document(doc, engine, self.settings, progress)
        if reference_text is not None:
            from hisparse_cli.scoring import rouge_scores

            started = time.perf_counter()
            result.rouge = rouge_scores(result.summary, reference_text)
            result.timings["rouge_seconds"] = time.perf_counter() - started
        out = result.to_dict()
        out["stats"].update(cpu_run_stats(out.get("runs", [])))
        out["timings"] = {"ingest_seconds": ingest_seconds, **out["timings"],
                          "kernel_compile_seconds": out["stats"]["kernel_compile_seconds"],
                          "kernel_load_seconds": out["stats"]["kernel_load_seconds"]}
        out["settings"] = {**self.settings_dict(), "attention": choice.to_dict(),
                           "prefill_cache_layers": cache_layers, **out["settings"]}
        out["settings"]["sparse"] = asdict(choice.sparse)  # the policy the run used
        out["reference"] = reference_path
        tokenizer = getattr(engine, "tokenizer", None)
        out["document"] = document_info(doc, _token_counter(tokenizer) if tokenizer else None)
        return out


@dataclass(frozen=True)
class JobSpec:
    """What a worker process needs to build the same Job (picklable: validated dataclasses
    and strings, no engine). `build(warn)` gives a Job that has not loaded anything yet."""

    profile: HardwareProfile
    sparse: SparseConfig
    settings: SummarySettings
    model_spec: str | None = None
    probe_path: Path | None = None

    def build(self, warn: Callable[[str], None] | None = None) -> Job:
        return Job(self.profile, self.sparse, self.settings, model_spec=self.model_spec,
                   probe_path=self.probe_path, warn=warn)


def _token_counter(tokenizer) -> Callable[[str], int]:
    from hisparse_cli.summarize.prompts import count_tokens

    def count(text: str) -> int:
        return count_tokens(tokenizer, text)

    return count


__all__ = ["Job", "JobSpec", "cpu_run_stats", "document_info", "document_path", "read_reference"]
