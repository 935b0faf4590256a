"""Prompts: what the model is asked, per document genre, and how the ask becomes token ids.

Four prompt shapes:
  * `document_prompt`  the whole document (strategy "stream");
  * `chunk_prompt`     one part of it, named by its reference ("pages 3–5", "src/app.py"):
                       asks for notes on that part only;
  * `combine_prompt`   the parts' notes, each headed by its part number and reference, plus
                       the document's opening lines (grounding) → one summary (or, for a group
                       of parts in a long reduce, combined notes);
  * `collection_prompt` a collection's per-document summaries, each headed by the document's
                       name → one summary of the collection.
Prompts stay simple (a small model follows one plain instruction better than a checklist): a
task sentence "Summarize the <noun> in one paragraph of about N words: <what a reader of the
genre needs>." comes before the text and again, shortened, after it. Before: the way models are
tuned to be asked; after: with sparse attention the start of a long prompt may have left the
window when generation starts, the end never has.

Genres (documents/genre.py): judgment, contract, patent, clinical, biomedical, scientific,
report, code, collection, generic; `instructions` (``--instructions``) replaces the task
sentence. `render_prompt` uses the model's chat template when the tokenizer has one (system +
user message, generation prompt added), and a plain "system / text / Summary:" prompt
otherwise. Text reaches the tokenizer through `tokenizable`: a file name that is not UTF-8 (a
title, a repository's file label) carries os.fsdecode's lone surrogates, which tokenizers
refuse; each becomes U+FFFD.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hisparse_cli.documents.genre import canonical_genre

_SURROGATES = re.compile("[\ud800-\udfff]")

SYSTEM = ("You write faithful, concise summaries. Use only facts stated in the text; keep "
          "names, numbers, amounts and dates exact.")

NOUN = {"judgment": "court judgment", "contract": "legal document", "patent": "patent",
        "clinical": "clinical note", "biomedical": "research article",
        "scientific": "paper", "report": "report", "code": "code repository",
        "collection": "collection of documents", "generic": "document"}

FOCUS = {  # what a reader of the genre needs from the summary
    "judgment": "the parties, the legal question, what the court decided and its main reasons",
    "contract": "what it says the reader or each party must do, may do or gives up, and any "
                "fees, limits or deadlines",
    "patent": "the invention, the problem it solves, how it works and what is claimed",
    "clinical": "the patient's problem, the diagnoses and key findings, the treatment and "
                "the plan",
    "biomedical": "the question studied, the methods, the main findings and what they mean",
    "scientific": "the problem, the method, the main results and the conclusions",
    "report": "its purpose, its main findings and its recommendations or options",
    "code": "what the software does, how it is organised (main files and their roles) and how "
            "it is used; refer to files by name",
    "collection": "what the documents are about together and the main point of each",
    "generic": "its main points, key facts and conclusions",
}
NOTES_FOCUS = {  # what a chunk's notes keep (facts the final summary may need)
    "judgment": "the parties, facts, arguments, holdings and reasons in this part",
    "contract": "the obligations, rights, fees, limits and deadlines in this part",
    "patent": "the invention's parts, how they work and what is claimed in this part",
    "clinical": "the findings, diagnoses, treatments with doses and plans in this part",
    "biomedical": "the question, methods, findings with their numbers in this part",
    "scientific": "the problem, method, results with their numbers in this part",
    "report": "the findings, numbers and recommendations in this part",
    "code": "what these files do and how they fit together",
    "collection": "the main point of this document",
    "generic": "the main points and key facts of this part",
}


@dataclass(frozen=True)
class Prompt:
    """A system message and a user message (rendered by `render_prompt`)."""

    system: str
    user: str


def task_sentence(genre: str | None, target_words: int | None = None,
                  instructions: str | None = None) -> str:
    """The task: the user's instructions when given, else the genre's summary request."""
    if instructions and instructions.strip():
        return instructions.strip()
    g = canonical_genre(genre)
    size = f"one paragraph of about {target_words} words" if target_words else "one paragraph"
    return f"Summarize the {NOUN[g]} in {size}: {FOCUS[g]}."


def focus_for(genre: str | None, instructions: str | None = None) -> str:
    """The task sentence without a length (kept for callers that ask what a genre wants)."""
    return task_sentence(genre, None, instructions)


def readable_title(title: str) -> str:
    """The title when it reads as one. A title with spaces (a PDF's metadata title) is kept;
    a file stem is kept with its separators made spaces ("services_agreement" → "services
    agreement") when it is two or more words without digits; an identifier ("legalsum04",
    "report-2020-03", "README") → "" (the model would take it for a name and invent)."""
    title = (title or "").strip()
    if " " in title:
        return title
    text = " ".join(re.sub(r"[_\-.]+", " ", title).split())
    if any(ch.isdigit() for ch in text) or len(text.split()) < 2:
        return ""
    return text


def document_prompt(text: str, *, genre: str | None, title: str = "",
                    instructions: str | None = None, target_words: int | None = None) -> Prompt:
    task = task_sentence(genre, target_words, instructions)
    title = readable_title(title)
    head = f"Title: {title}\n\n" if title else ""
    return Prompt(SYSTEM, f"{task}\n\n{head}{text.strip()}\n\n---\n{task}")


def chunk_prompt(text: str, *, label: str, index: int, total: int, genre: str | None,
                 instructions: str | None = None, target_words: int | None = None) -> Prompt:
    g = canonical_genre(genre)
    size = f" in about {target_words} words" if target_words else ""
    task = (f"Write notes on part {index} of {total} of a {NOUN[g]} ({label}){size}: "
            f"{NOTES_FOCUS[g]}. Use full sentences; keep names and numbers exact.")
    if instructions and instructions.strip():
        task += f" The final summary is for this request: {instructions.strip()}"
    return Prompt(SYSTEM, f"{task}\n\n{text.strip()}\n\n---\n{task}")


def combine_prompt(parts: list[tuple[str, str]], *, genre: str | None, final: bool = True,
                   instructions: str | None = None, target_words: int | None = None,
                   opening: str = "", total: int | None = None,
                   first_index: int = 1) -> Prompt:
    """`parts`: (reference, notes) pairs in document order, numbered from `first_index` of
    `total` parts; `opening`: the document's first lines (its title and purpose)."""
    g = canonical_genre(genre)
    total = total or len(parts)
    body = "\n\n".join(f"Part {first_index + i} of {total} ({label}):\n{notes.strip()}"
                       for i, (label, notes) in enumerate(parts))
    start = f"Beginning of the {NOUN[g]}:\n{opening.strip()}\n\n" if opening.strip() else ""
    if final:
        task = task_sentence(g, target_words, instructions)
        rule = (f"Write it from the notes on its parts below, as one text about the whole "
                f"{NOUN[g]}; do not mention the parts or the notes.")
    else:
        size = f" in about {target_words} words" if target_words else ""
        task = f"Combine the notes below into one set of notes{size}: {NOTES_FOCUS[g]}."
        rule = "Keep names and numbers exact; do not mention the parts."
    return Prompt(SYSTEM, f"{task} {rule}\n\n{start}Notes on the parts, in order:\n\n{body}"
                          f"\n\n---\n{task}")


def collection_prompt(members: list[tuple[str, str]], *, instructions: str | None = None,
                      target_words: int | None = None) -> Prompt:
    """`members`: (document name, its summary) pairs of a collection, in order."""
    task = task_sentence("collection", target_words, instructions)
    body = "\n\n".join(f"Document {i + 1} of {len(members)} ({name}):\n{summary.strip()}"
                       for i, (name, summary) in enumerate(members))
    return Prompt(SYSTEM, f"{task} Write it from the summaries of its documents below; name "
                          f"documents where it helps.\n\n{body}\n\n---\n{task}")


def instruction_texts(genre: str | None, instructions: str | None = None) -> tuple[str, ...]:
    """Sentences of every prompt an output must not merely repeat (the guard's echo test)."""
    g = canonical_genre(genre)
    return (SYSTEM, task_sentence(g, None, instructions), FOCUS[g], NOTES_FOCUS[g])


def tokenizable(text: str) -> str:
    """`text` with every lone surrogate replaced by U+FFFD (module docstring)."""
    return _SURROGATES.sub("\ufffd", text)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def prompt_text(tokenizer, prompt: Prompt) -> str:
    """The prompt as the model sees it (chat template applied, or the plain layout)."""
    if has_chat_template(tokenizer):
        messages = [{"role": "system", "content": prompt.system},
                    {"role": "user", "content": prompt.user}]
        try:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=False)
        except Exception:  # noqa: BLE001 - some templates refuse a system role
            merged = [{"role": "user", "content": f"{prompt.system}\n\n{prompt.user}"}]
            return tokenizer.apply_chat_template(merged, add_generation_prompt=True,
                                                 tokenize=False)
    return f"{prompt.system}\n\n{prompt.user}\n\nSummary:\n"


def render_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of the prompt. A chat template writes its own BOS; the plain layout gets the
    tokenizer's usual special tokens."""
    text = tokenizable(prompt_text(tokenizer, prompt))
    add_special = not has_chat_template(tokenizer)
    # verbose=False: we chunk ourselves; transformers' "longer than the specified maximum
    # sequence length" warning would be wrong about every long document
    return list(tokenizer(text, add_special_tokens=add_special, verbose=False)["input_ids"])


def count_tokens(tokenizer, text: str) -> int:
    """Tokens of `text` alone (no special tokens), without transformers' length warning."""
    return len(tokenizer(tokenizable(text), add_special_tokens=False, verbose=False)["input_ids"])


__all__ = ["Prompt", "SYSTEM", "FOCUS", "NOTES_FOCUS", "NOUN", "task_sentence", "focus_for",
           "document_prompt", "readable_title", "chunk_prompt", "combine_prompt",
           "collection_prompt", "instruction_texts", "render_prompt", "count_tokens",
           "prompt_text", "has_chat_template", "tokenizable"]
