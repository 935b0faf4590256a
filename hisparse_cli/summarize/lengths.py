"""Summary length: a target in words from the genre and the document's length, and the token
cap of the generation that writes it.

    plan = length_plan("scientific", doc_words=5200, doc_tokens=6800, cap_tokens=256)
    plan.target_words, plan.max_new_tokens

The target is a tenth of the source (the classic compression ratio of summarization
evaluations, e.g. DUC's 10 % / 100-word tasks), kept inside the range a reader of the genre
expects: a clause or terms section gets a few sentences, a paper an abstract (ACL and most
journals cap abstracts at 150–250 words; a patent abstract is at most 150 words by USPTO
rule), a government report a one-page executive summary. The prompt asks for "about N words";
the generation may take `target × tokens-per-word × SLACK + RESERVE_TOKENS` tokens, never
more than the cap (`--max-new-tokens` or the profile's), so a model that runs on can still
close its sentence; the pipeline then ends the text on its last complete sentence. A floor of
MIN_SHARE of the target's tokens keeps the model from ending before it (its end-of-text token
is suppressed until then: `min_new_tokens`, as `min_length` in the summarization setups of
BART/PEGASUS): left alone, SmolLM2-135M ends most summaries after 60–110 words whatever the
target.
Tokens per word are measured on the document itself (its tokens / its words), clamped to
[1.15, 1.6] (prose, not tables or references).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hisparse_cli.documents.genre import canonical_genre

RATIO = 0.10
GENRE_WORDS: dict[str, tuple[int, int]] = {  # (fewest, most) words of a final summary
    "judgment": (80, 250),    # a headnote: parties, question, holding, reasons
    "contract": (30, 200),    # a clause: a sentence or two; a whole contract: the key terms
    "patent": (50, 150),      # USPTO: an abstract of at most 150 words
    "clinical": (60, 200),    # a discharge or clinic letter summary
    "biomedical": (100, 250), # a structured journal abstract
    "scientific": (80, 200),  # a conference-paper abstract
    "report": (120, 300),     # an executive summary
    "code": (80, 250),        # a README overview
    "collection": (100, 300), # the common subject + a line per document
    "generic": (50, 200),
}
CHUNK_WORDS = (60, 120)  # a map-reduce chunk's notes: enough to keep its facts, short to merge
SLACK = 1.25
MIN_SHARE = 0.6  # the floor: 60 % of the target's tokens (a small model stops far too early)
RESERVE_TOKENS = 24
MIN_TOKENS_PER_WORD, MAX_TOKENS_PER_WORD = 1.15, 1.6


@dataclass(frozen=True)
class LengthPlan:
    """target_words: what the prompt asks for; max_new_tokens: the generation's cap;
    min_new_tokens: the floor before the model may end it (its end-of-text is suppressed)."""

    target_words: int
    max_new_tokens: int
    min_new_tokens: int = 0


def tokens_per_word(doc_tokens: int, doc_words: int) -> float:
    ratio = doc_tokens / doc_words if doc_words else MAX_TOKENS_PER_WORD
    return min(MAX_TOKENS_PER_WORD, max(MIN_TOKENS_PER_WORD, ratio))


def target_words(genre: str | None, doc_words: int) -> int:
    """RATIO of the document's words, inside the genre's range."""
    low, high = GENRE_WORDS[canonical_genre(genre)]
    return int(min(high, max(low, round(doc_words * RATIO))))


def tokens_for(words: int, per_word: float, cap_tokens: int) -> int:
    """The generation cap for a text of about `words` words (module docstring)."""
    return max(1, min(cap_tokens, math.ceil(words * per_word * SLACK) + RESERVE_TOKENS))


def floor_tokens(words: int, per_word: float, max_new: int) -> int:
    """MIN_SHARE of the target's tokens, below the cap's reserve."""
    return max(0, min(max_new - RESERVE_TOKENS, int(MIN_SHARE * words * per_word)))


def plan_for(words: int, per_word: float, cap_tokens: int) -> LengthPlan:
    """Target, cap and floor of a text of about `words` words."""
    max_new = tokens_for(words, per_word, cap_tokens)
    return LengthPlan(words, max_new, floor_tokens(words, per_word, max_new))


def length_plan(genre: str | None, *, doc_words: int, doc_tokens: int, cap_tokens: int,
                words: int | None = None) -> LengthPlan:
    """The final summary's target and cap. `words` (--words) replaces the computed target;
    the cap still bounds the tokens (a target the cap cannot hold is lowered to fit)."""
    per_word = tokens_per_word(doc_tokens, doc_words)
    target = words if words is not None else target_words(genre, doc_words)
    max_new = tokens_for(target, per_word, cap_tokens)
    fits = max(1, int((max_new - RESERVE_TOKENS) / (per_word * SLACK)))
    target = min(target, fits) if max_new == cap_tokens else target
    return LengthPlan(target, max_new, floor_tokens(target, per_word, max_new))


def chunk_length_plan(*, chunk_words: int, per_word: float, cap_tokens: int,
                      words: int | None = None) -> LengthPlan:
    """A map-reduce chunk's notes: RATIO of the chunk inside CHUNK_WORDS (or `words`)."""
    low, high = CHUNK_WORDS
    target = words if words is not None else int(min(high, max(low, round(chunk_words * RATIO))))
    return plan_for(target, per_word, cap_tokens)


__all__ = ["LengthPlan", "length_plan", "plan_for", "floor_tokens", "MIN_SHARE",
           "chunk_length_plan", "target_words", "tokens_for", "tokens_per_word", "GENRE_WORDS",
           "CHUNK_WORDS", "RATIO"]
