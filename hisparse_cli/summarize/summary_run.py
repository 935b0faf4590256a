"""One summarize call's working state: the engine, token counting, and the guarded generation
every prompt goes through (pipeline.py and mapreduce.py build the prompts).

`SummaryRun.guarded(ids, max_new, step, …)` is the guard's loop (guard.py):
  1. generate; clean the text (scaffolding, preamble); when the token cap cut it, end it on
     its last complete sentence (a text the model ended itself is kept whole);
  2. no problem → done. A loop whose text before it still holds at least half the target
     length → that text ("repaired"), no new generation;
  3. otherwise generate again with changed decoding: first a stronger repetition control
     (penalty ≥ 1.3, no-repeat 4-grams), then seeded sampling (temperature 0.7, top-p 0.9,
     seed = --seed + attempt, so a run is reproducible) — `RETRY_DECODINGS`;
  4. every attempt failed → the best repaired text when one passed, else an extractive digest
     of the source (digest.py), marked "digest" in the run's chunk records and warnings.
Every retry, repair and digest is a line in `warnings` and a count in `guard`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from hisparse_cli.summarize.digest import extractive_digest
from hisparse_cli.documents.base import Document
from hisparse_cli.config.settings import GenerationConfig
from hisparse_cli.summarize.guard import (MIN_WORDS, Problem, clean_output, end_on_sentence,
                                          ends_mid_sentence, find_problem, repair_loop, words)
from hisparse_cli.summarize.prompts import count_tokens, instruction_texts, render_prompt

REPAIR_MIN_SHARE = 0.5  # a repaired text keeps at least this share of the target words
_LIST_ITEM = re.compile(r"^(?:[-*•]|\d+[.)])\s")
_SENTENCE_START = re.compile(r"^[A-Z\"“(]")


@dataclass
class ChunkSummary:
    """One step of a run: a document part (level 0), a combine round (1+), a member document
    of a collection ("document …"), or the final summary. status: ok | repaired | retried |
    digest | failed (the guard's outcome; failed: no digest possible, the last attempt kept) |
    selected (no generation: map-reduce's final summary chosen from the notes, mapreduce.py)."""

    label: str
    level: int
    prompt_tokens: int
    new_tokens: int
    summary: str
    status: str = "ok"


def retry_decodings(gen: GenerationConfig) -> list[tuple[str, GenerationConfig]]:
    """The changed decodings of the retries, in order, each with what changed."""
    ngram = 4 if gen.no_repeat_ngram_size in (0,) or gen.no_repeat_ngram_size > 4 \
        else gen.no_repeat_ngram_size
    penalty = max(1.3, gen.repetition_penalty)
    stronger = replace(gen, repetition_penalty=penalty, no_repeat_ngram_size=ngram)
    sampled = replace(stronger, temperature=0.7, top_p=0.9,
                      seed=(gen.seed or 0) + 1, repetition_penalty=max(1.2, gen.repetition_penalty))
    return [(f"repetition penalty {penalty:g}, no-repeat {ngram}-grams", stronger),
            (f"sampling (temperature 0.7, top-p 0.9, seed {sampled.seed})", sampled)]


class SummaryRun:
    def __init__(self, doc: Document, engine, settings, progress) -> None:
        self.doc, self.engine, self.settings, self.progress = doc, engine, settings, progress
        self.tok = engine.tokenizer
        self.max_pos = int(engine.cfg.max_position_embeddings)
        self.gen: GenerationConfig = settings.generation
        self.runs: list[dict] = []
        self.chunks: list[ChunkSummary] = []
        self.warnings: list[str] = []
        self.guard = {"retries": 0, "repairs": 0, "digests": 0, "trimmed": 0}
        self.settings_extra: dict = {}

    # -- tokens ------------------------------------------------------------------------------
    def count(self, text: str) -> int:
        return count_tokens(self.tok, text)

    def render(self, prompt) -> list[int]:
        return render_prompt(self.tok, prompt)

    # -- generation --------------------------------------------------------------------------
    def _generate(self, ids: list[int], max_new: int, step: str,
                  gen: GenerationConfig) -> tuple[str, str]:
        report = None
        if self.progress is not None:
            def report(phase: str, done: int, total: int) -> None:
                self.progress(step, phase, done, total)  # type: ignore[misc]
            report("prefill", 0, len(ids))  # the start: rates are measured from here
        res = self.engine.generate(ids, gen=gen, max_new_tokens=max_new, progress=report)
        self.runs.append({"step": step, "finish_reason": res.finish_reason,
                          "stats": res.stats.to_dict()})
        return self.tok.decode(res.token_ids, skip_special_tokens=True).strip(), \
            res.finish_reason

    def _finish(self, raw: str, labels: tuple[str, ...], reason: str) -> str:
        """Cleaned text that ends on a complete sentence. Cut at the token cap ("length"): the
        unfinished last sentence is dropped. Ended by the model itself ("eos") without final
        punctuation: a list keeps its last item, prose gets its full stop."""
        text = clean_output(raw, labels)
        if reason == "eos":
            last = text.rstrip().rsplit("\n", 1)[-1].lstrip()
            if ends_mid_sentence(text) and not _LIST_ITEM.match(last) and \
                    _SENTENCE_START.match(last):
                return text.rstrip().rstrip(",;:") + "."
            return text
        ended = end_on_sentence(text)
        if ended != text.rstrip():
            self.guard["trimmed"] += 1
        return ended

    def guarded(self, ids: list[int], max_new: int, step: str, *, target_words: int,
                source: str, labels: tuple[str, ...] = (), level: int = 0,
                label: str | None = None, genre: str | None = None,
                min_new: int = 0) -> str:
        """Generate for `step` under the guard (module docstring); record it under `label`
        (None: not recorded); the text. `genre`: the prompt's (default: the document's);
        `min_new`: the length floor (lengths.py), every attempt keeps it."""
        instructions = instruction_texts(genre or self.doc.genre, self.settings.instructions)
        min_words = max(MIN_WORDS, min(25, target_words // 5))
        attempts = [("", self.gen)] + retry_decodings(self.gen)
        fallback: str | None = None
        problem: Problem | None = None
        text = ""
        for n, (change, gen) in enumerate(attempts):
            name = step if n == 0 else f"{step} (retry {n})"
            if n:
                self.guard["retries"] += 1
                self.warnings.append(f"{step}: {problem}; retried with {change}")
            if min_new > gen.min_new_tokens:
                gen = replace(gen, min_new_tokens=min(min_new, max_new))
            raw, reason = self._generate(ids, max_new, name, gen)
            text = self._finish(raw, labels, reason)
            problem = find_problem(text, instructions=instructions, min_words=min_words)
            if problem is not None and problem.kind == "cut" and reason == "eos":
                problem = None  # the model ended it: a list without full stops, not a cut
            if problem is None:
                return self._record(step, label, level, ids, text, "retried" if n else "ok")
            if problem.kind == "loop":
                fixed = end_on_sentence(repair_loop(text))
                if find_problem(fixed, instructions=instructions, min_words=min_words) is None:
                    if len(words(fixed)) >= REPAIR_MIN_SHARE * target_words:
                        self.guard["repairs"] += 1
                        self.warnings.append(f"{step}: {problem}; kept the text before the "
                                             "repetition")
                        return self._record(step, label, level, ids, fixed, "repaired")
                    fallback = fallback or fixed
        if fallback is not None:
            self.guard["repairs"] += 1
            self.warnings.append(f"{step}: {problem} after {len(attempts)} attempts; kept the "
                                 "text before the repetition of the first attempt that had one")
            return self._record(step, label, level, ids, fallback, "repaired")
        digest = self.digest(source, max(target_words, 30), max_new)
        if not digest:  # nothing in the source reads as a sentence (code, a table)
            self.warnings.append(f"{step}: {problem} after {len(attempts)} attempts and no "
                                 "sentence in the source to extract; kept the last attempt")
            return self._record(step, label, level, ids, text, "failed")
        self.guard["digests"] += 1
        self.warnings.append(f"{step}: {problem} after {len(attempts)} attempts; used an "
                             "extractive digest of the source instead")
        return self._record(step, label, level, ids, digest, "digest")

    def digest(self, source: str, target_words: int, max_tokens: int) -> str:
        """An extractive digest of `source` that fits the generation's token cap too."""
        words_wanted = target_words
        while True:
            digest = extractive_digest(source, words_wanted)
            if not digest or self.count(digest) <= max_tokens or words_wanted <= 1:
                break
            words_wanted = max(1, words_wanted * 2 // 3)
        if digest and self.count(digest) > max_tokens:  # one sentence longer than the cap
            ids = self.tok(digest, add_special_tokens=False, verbose=False)["input_ids"]
            digest = self.tok.decode(ids[:max_tokens], skip_special_tokens=True).rstrip()
            digest = end_on_sentence(digest) if not ends_mid_sentence(
                end_on_sentence(digest)) else digest.rstrip(",;: ") + "."
        return digest

    def record_selection(self, label: str, level: int, text: str) -> str:
        """Record a step that generated nothing (its text chosen from earlier outputs)."""
        self.chunks.append(ChunkSummary(label, level, 0, 0, text, "selected"))
        return text

    def _record(self, step: str, label: str | None, level: int, ids: list[int], text: str,
                status: str) -> str:
        if label is not None:
            new = self.runs[-1]["stats"].get("new_tokens", 0) if self.runs else 0
            self.chunks.append(ChunkSummary(label, level, len(ids), new, text, status))
        return text


__all__ = ["SummaryRun", "ChunkSummary", "retry_decodings", "REPAIR_MIN_SHARE"]
