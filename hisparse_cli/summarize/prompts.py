"""Prompts: what the model is asked, per document genre, and how the ask becomes token ids.

Three prompt shapes:
  * `document_prompt`  the whole document (strategy "stream");
  * `chunk_prompt`     one part of it, named by its reference ("pages 3–5", "src/app.py");
  * `combine_prompt`   part summaries, each headed by its reference → one summary.
The task instruction comes *after* the text. With sparse attention the model keeps the first
few tokens (sinks), a few globals and a recent window; an instruction placed only at the start
could fall out of the window before generation starts, one at the end never does.

The focus sentence depends on the genre (`Document.genre`: legal, medical, scientific, code,
generic); `instructions` (``--instructions``) replaces it. `render_prompt` uses the model's
chat template when the tokenizer has one (system + user message, generation prompt added),
and a plain "system / text / Summary:" prompt otherwise. Text reaches the tokenizer through
`tokenizable`: a file name that is not UTF-8 (a title, a repository's file label) carries
os.fsdecode's lone surrogates, which tokenizers refuse; each becomes U+FFFD.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SURROGATES = re.compile("[\ud800-\udfff]")

SYSTEM = ("You write faithful, concise summaries. Use only facts stated in the text; keep "
          "names, numbers, amounts and dates exact.")

FOCUS = {
    "legal": ("Summarize this legal document: the parties, what each must do, fees and payment "
              "terms, service levels, term and termination, liability, data protection, and "
              "governing law."),
    "medical": ("Summarize this medical record: the presenting problem, diagnoses, key findings "
                "and results, treatments and medications with doses, the course of care, and the "
                "discharge plan and follow-up. Do not add advice."),
    "scientific": ("Summarize this paper: the question, the method and data, the main results "
                   "with their numbers, and the limitations."),
    "code": ("Summarize this code repository: what the software does, how it is organised "
             "(main files and their roles), how it is used, and notable design choices or "
             "limitations. Refer to files by name."),
    "generic": "Summarize this document: its main points, key facts and conclusions.",
}

NOUN = {"legal": "legal document", "medical": "medical record", "scientific": "paper",
        "code": "code repository", "generic": "document"}


@dataclass(frozen=True)
class Prompt:
    """A system message and a user message (rendered by `render_prompt`)."""

    system: str
    user: str


def _genre(genre: str | None) -> str:
    return genre if genre in FOCUS else "generic"


def focus_for(genre: str | None, instructions: str | None = None) -> str:
    """The task sentence: the user's instructions when given, else the genre's."""
    if instructions and instructions.strip():
        return instructions.strip()
    return FOCUS[_genre(genre)]


def document_prompt(text: str, *, genre: str | None, title: str = "",
                    instructions: str | None = None) -> Prompt:
    noun = NOUN[_genre(genre)]
    head = f"The {noun} below" + (f" is titled “{title}”." if title else " follows.")
    return Prompt(SYSTEM, f"{head}\n\n{text.strip()}\n\n---\n{focus_for(genre, instructions)}")


def chunk_prompt(text: str, *, label: str, index: int, total: int, genre: str | None,
                 instructions: str | None = None) -> Prompt:
    noun = NOUN[_genre(genre)]
    head = f"Part {index} of {total} of a longer {noun} ({label}):"
    task = (f"{focus_for(genre, instructions)}\nCover only this part ({label}) in a few "
            "sentences; mention page numbers or file names where they help.")
    return Prompt(SYSTEM, f"{head}\n\n{text.strip()}\n\n---\n{task}")


def combine_prompt(parts: list[tuple[str, str]], *, genre: str | None, final: bool = True,
                   instructions: str | None = None) -> Prompt:
    """`parts`: (reference, summary) pairs in document order."""
    noun = NOUN[_genre(genre)]
    body = "\n\n".join(f"[{label}]\n{summary.strip()}" for label, summary in parts)
    scope = f"the whole {noun}" if final else "these parts together"
    task = (f"{focus_for(genre, instructions)}\nWrite one summary of {scope} from the part "
            "summaries above, without repeating yourself; cite pages or files where useful.")
    return Prompt(SYSTEM, f"Summaries of consecutive parts of a {noun}, each headed by the "
                          f"part it covers:\n\n{body}\n\n---\n{task}")


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
    return list(tokenizer(text, add_special_tokens=add_special)["input_ids"])


__all__ = ["Prompt", "SYSTEM", "FOCUS", "focus_for", "document_prompt", "chunk_prompt",
           "combine_prompt", "render_prompt", "prompt_text", "has_chat_template", "tokenizable"]
