"""Map-reduce for documents longer than the model's positions, and collections of documents.

Map: the document is split on its own boundaries (pages, files, member documents; chunking.py)
into chunks of equal size — as many tokens as fit, or `chunk_tokens`, divided evenly so the
last chunk is not a scrap. Each chunk gets notes (prompts.chunk_prompt: the facts a reader of
the genre needs, a tenth of the chunk's words within lengths.CHUNK_WORDS). A chunk whose notes
fail the guard is retried, and when every attempt fails its notes are an extractive digest of
the chunk: a failed generation never reaches the reduce step.
Reduce (`reduce_mode`): "select" takes the final summary from the notes themselves: their most
central sentences, led by the first (digest.extractive_digest over the notes, which the model
wrote from the whole document), within the summary's target words. Measured on the embedded
135M model (QUALITY.md, 15 long documents, the notes unchanged): its own final step wrote
generic text ("Overall, the study provides insights into...") and scored 2.0 ROUGE-L below
the selection. "generate" (the default for models of 1B parameters or more, whose reduce
this machine cannot measure, and whenever --instructions are given): one summary from the
notes, each headed "Part i of n (pages 3–5)", with the
document's opening lines (title, purpose; OPENING_TOKENS tokens, 1/32 of a small model's
positions) as grounding — a
merge that sees some source text invents less than one that sees only model notes. When the
notes do not fit one prompt, or there are more than FAN_IN of them, consecutive groups of at
most FAN_IN are combined into notes first (a tree with bounded fan-in); every round at least
halves the count.
Collections (kind "collection", one section per member document, two or more members): each
member is summarized as its own document (stream, or map-reduce when it is long) in
MEMBER_WORDS words, then the collection from the member summaries, each headed by the
member's name (prompts.collection_prompt), reduced the same way when they do not fit.
"""

from __future__ import annotations

import math
from typing import Callable

from hisparse_cli.summarize.chunking import merge_labels, split_document
from hisparse_cli.documents.base import Document
from hisparse_cli.documents.genre import guess_genre
from hisparse_cli.errors import ConfigError
from hisparse_cli.summarize.guard import end_on_sentence, words
from hisparse_cli.summarize.lengths import (LengthPlan, chunk_length_plan, plan_for,
                                            target_words, tokens_per_word)
from hisparse_cli.summarize.prompts import chunk_prompt, collection_prompt, combine_prompt

SELECT_BELOW_PARAMETERS = 1_000_000_000  # reduce "auto": select for smaller models

FAN_IN = 8
OPENING_TOKENS = 160
CHUNK_MARGIN = 0.95  # token counts of separately tokenized pieces are not exactly additive
BALANCE_SLACK = 1.05
MIN_CHUNK_TOKENS = 16
MEMBER_WORDS = (30, 120)
NOTES_CAP_DIVISOR = 8  # a chunk's notes never take more than positions/8 tokens


def is_collection(doc: Document) -> bool:
    return doc.kind == "collection" and len(doc.sections) >= 2


def _prefix(step: str) -> str:
    return "" if step == "summary" else f"{step}: "


def notes_cap(run) -> int:
    """Token cap of a chunk's notes: --chunk-new-tokens, else the summary's cap, at most
    positions/8 (the notes of several chunks must fit one reduce prompt)."""
    return run.settings.chunk_new_tokens or max(MIN_CHUNK_TOKENS, min(
        run.gen.max_new_tokens, run.max_pos // NOTES_CAP_DIVISOR))


def chunk_budget(run, doc: Document, notes_new: int, final_new: int) -> int:
    """Document tokens a chunk may hold so its prompt + notes fit the positions; ConfigError
    when even the reduce of two notes could not fit with the final summary."""
    instr = run.settings.instructions
    overhead = len(run.render(chunk_prompt("", label="pages 9999–9999, lines 9999–9999",
                                           index=999, total=999, genre=doc.genre,
                                           instructions=instr, target_words=999)))
    budget = int((run.max_pos - notes_new - overhead) * CHUNK_MARGIN)
    combine_need = (len(run.render(combine_prompt([("x", "")] * 2, genre=doc.genre,
                                                  instructions=instr, target_words=999,
                                                  opening="x")))
                    + opening_tokens(run) + 2 * (notes_new + 24) + final_new)
    if budget < MIN_CHUNK_TOKENS or combine_need > run.max_pos:
        raise ConfigError(
            f"max_new_tokens {final_new} (chunk notes: {notes_new}) is too large for "
            f"map-reduce with this model's {run.max_pos} positions",
            hint="lower --max-new-tokens (and --chunk-new-tokens)")
    if run.settings.chunk_tokens:
        budget = min(budget, run.settings.chunk_tokens)
    return budget


def opening_tokens(run) -> int:
    """The grounding's size: OPENING_TOKENS, or 1/32 of a small model's positions."""
    return min(OPENING_TOKENS, run.max_pos // 32)


def opening_lines(run, doc: Document) -> str:
    """The document's first opening_tokens() tokens, ended on a complete sentence."""
    n = opening_tokens(run)
    head = doc.text[:n * 8]
    ids = run.tok(head, add_special_tokens=False, verbose=False)["input_ids"][:n]
    return end_on_sentence(run.tok.decode(ids, skip_special_tokens=True))


def reduce_mode(settings, parameters: int) -> tuple[str, str]:
    """(select | generate, why) of map-reduce's final step (module docstring): --reduce when
    given, else by the model's size; user instructions need a generated final summary."""
    if settings.reduce != "auto":
        return settings.reduce, f"--reduce {settings.reduce}"
    if settings.instructions and settings.instructions.strip():
        return "generate", "auto: --instructions ask for a written final summary"
    size = f"{parameters / 1e9:.1f}B" if parameters >= 1e9 else f"{parameters / 1e6:.0f}M"
    if parameters < SELECT_BELOW_PARAMETERS:
        return "select", (f"auto: a {size}-parameter model (under 1B): the notes' central "
                          "sentences beat its own final step (QUALITY.md)")
    return "generate", f"auto: a {size}-parameter model (1B or more)"


def select_final(run, parts: list[tuple[str, str]], length: LengthPlan, *, step: str,
                 label: str | None) -> str:
    """The final summary chosen from the notes (reduce "select"); "" when no note sentence is
    usable (code, tables): the caller then generates it."""
    notes = "\n".join(text for _, text in parts)
    text = run.digest(notes, length.target_words, length.max_new_tokens)
    if not text:
        return ""
    return run.record_selection(label or "final summary", 1, text)


def map_reduce(run, doc: Document, length: LengthPlan, *, step: str = "summary",
               label: str | None = None) -> str:
    prefix = _prefix(step)
    cap = notes_cap(run)
    budget = chunk_budget(run, doc, cap, length.max_new_tokens)
    total_tokens = run.count(doc.text)
    per_word = tokens_per_word(total_tokens, len(words(doc.text)))
    pieces = max(1, math.ceil(total_tokens / budget))
    balanced = max(MIN_CHUNK_TOKENS, min(budget, math.ceil(total_tokens / pieces * BALANCE_SLACK)))
    prompts: list[tuple[str, str, list[int], LengthPlan]] = []
    for _attempt in range(5):  # shrink when a rendered prompt overshoots the positions
        chunks = split_document(doc, balanced, run.count)
        prompts = []
        for i, c in enumerate(chunks):
            text = c.text(doc)
            plan = chunk_length_plan(chunk_words=len(words(text)), per_word=per_word,
                                     cap_tokens=cap)
            ids = run.render(chunk_prompt(text, label=c.label, index=i + 1, total=len(chunks),
                                          genre=doc.genre, instructions=run.settings.instructions,
                                          target_words=plan.target_words))
            prompts.append((c.label, text, ids, plan))
        if all(len(ids) + plan.max_new_tokens <= run.max_pos for _, _, ids, plan in prompts):
            break
        balanced = max(MIN_CHUNK_TOKENS, int(balanced * 0.8))
    else:
        raise ConfigError("could not split the document into chunks that fit the model",
                          hint="lower --max-new-tokens or --chunk-tokens")
    run.settings_extra.setdefault("chunk_tokens_effective", balanced)
    run.settings_extra.setdefault("chunk_new_tokens", cap)
    parts: list[tuple[str, str]] = []
    for i, (chunk_label, text, ids, plan) in enumerate(prompts):
        name = f"{prefix}part {i + 1}/{len(prompts)} ({chunk_label})"
        notes = run.guarded(ids, plan.max_new_tokens, name, target_words=plan.target_words,
                            min_new=plan.min_new_tokens,
                            source=text, labels=(chunk_label,), level=0,
                            label=f"{label}: {chunk_label}" if label else chunk_label,
                            genre=doc.genre)
        parts.append((chunk_label, notes))
    mode, why = reduce_mode(run.settings, run.engine.cfg.parameters)
    run.settings_extra.setdefault("final_step", {"requested": run.settings.reduce, "mode": mode,
                                             "reason": why})
    if mode == "select" and (text := select_final(run, parts, length, step=step, label=label)):
        return text
    opening = opening_lines(run, doc)

    def final(group: list[tuple[str, str]], first: int, total: int, is_final: bool,
              words_wanted: int):
        return combine_prompt(group, genre=doc.genre, final=is_final,
                              instructions=run.settings.instructions, target_words=words_wanted,
                              opening=opening if is_final else "", total=total,
                              first_index=first)

    return reduce(run, parts, final, length, notes_new=cap, per_word=per_word, step=step,
                  label=label, source=doc.text, genre=doc.genre)


PromptFor = Callable[[list, int, int, bool, int], object]


def reduce(run, parts: list[tuple[str, str]], prompt_for: PromptFor, length: LengthPlan, *,
           notes_new: int, per_word: float, step: str, label: str | None, source: str,
           genre: str | None) -> str:
    """One text from `parts` ((reference, text) in order): the final prompt when it fits and
    holds at most FAN_IN parts, else groups combined first (module docstring)."""
    prefix, level = _prefix(step), 1
    while True:
        ids = run.render(prompt_for(parts, 1, len(parts), True, length.target_words))
        if len(parts) <= FAN_IN and len(ids) + length.max_new_tokens <= run.max_pos:
            return run.guarded(ids, length.max_new_tokens, f"{prefix}final summary",
                               target_words=length.target_words, source=source,
                               min_new=length.min_new_tokens,
                               labels=tuple(lab for lab, _ in parts), level=level,
                               label=label or "final summary", genre=genre)
        group_words = min(150, max(60, length.target_words))
        group_plan = plan_for(group_words, per_word, notes_new)
        groups: list[list[int]] = [[]]
        for i in range(len(parts)):
            candidate = groups[-1] + [i]
            size = len(run.render(prompt_for([parts[j] for j in candidate], candidate[0] + 1,
                                             len(parts), False, group_words)))
            too_long = size + group_plan.max_new_tokens > run.max_pos
            if groups[-1] and (len(candidate) > FAN_IN or too_long):
                groups.append([i])
            else:
                groups[-1] = candidate
        if len(groups) == len(parts):  # no two notes fit together: cannot progress
            raise ConfigError("chunk notes are too long to combine within the model's "
                              f"{run.max_pos} positions", hint="lower --chunk-new-tokens")
        merged = []
        for j, group in enumerate(groups):
            if len(group) == 1:
                merged.append(parts[group[0]])
                continue
            members = [parts[i] for i in group]
            merged_label = merge_labels([lab for lab, _ in members])
            ids = run.render(prompt_for(members, group[0] + 1, len(parts), False, group_words))
            text = run.guarded(ids, group_plan.max_new_tokens, f"{prefix}combine {j + 1}/"
                               f"{len(groups)} ({merged_label})", target_words=group_words,
                               min_new=group_plan.min_new_tokens,
                               source="\n\n".join(t for _, t in members),
                               labels=tuple(lab for lab, _ in members), level=level,
                               label=merged_label, genre=genre)
            merged.append((merged_label, text))
        parts, level = merged, level + 1


def summarize_collection(run, doc: Document, length: LengthPlan,
                         summarize_member: Callable[..., tuple[str, str]]) -> str:
    """Each member document, then the collection (module docstring). `summarize_member` is
    pipeline.summarize_single (passed in: the pipeline imports this module, not the reverse)."""
    members = sorted(doc.sections, key=lambda s: s.start)
    summaries: list[tuple[str, str]] = []
    for i, section in enumerate(members):
        text = doc.text[section.start:section.end]
        if not text.strip():
            continue
        member = Document(text=text, kind="text", source=section.label, title=section.label,
                          genre=guess_genre(text, "text"))
        n_words, n_tokens = len(words(text)), run.count(text)
        low, high = MEMBER_WORDS
        member_words = min(high, max(low, target_words(member.genre, n_words)))
        per_word = tokens_per_word(n_tokens, n_words)
        member_length = plan_for(member_words, per_word, length.max_new_tokens)
        summary, _ = summarize_member(run, member, member_length, run.settings.strategy,
                                      step=f"document {i + 1}/{len(members)} ({section.label})",
                                      label=section.label)
        summaries.append((section.label, summary))

    def final(group: list[tuple[str, str]], first: int, total: int, is_final: bool,
              words_wanted: int):
        if is_final:
            return collection_prompt(group, instructions=run.settings.instructions,
                                     target_words=words_wanted)
        return combine_prompt(group, genre="collection", final=False,
                              target_words=words_wanted, total=total, first_index=first)

    return reduce(run, summaries, final, length, notes_new=notes_cap(run),
                  per_word=tokens_per_word(run.count(doc.text), len(words(doc.text))),
                  step="summary", label="collection summary", source=doc.text,
                  genre="collection")


__all__ = ["map_reduce", "reduce", "summarize_collection", "is_collection", "chunk_budget",
           "opening_lines", "FAN_IN", "OPENING_TOKENS", "MEMBER_WORDS"]
