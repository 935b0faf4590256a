"""The extractive digest: the fallback text when a generation keeps failing the guard.

    extractive_digest(text, max_words=120) -> "First sentence. Central sentence. …"

Sentences of the source itself, so it cannot invent anything: the first usable sentence (the
lead: documents state their subject first — the "lead" baseline of summarization research),
then the most central ones (SumBasic-style: the mean document frequency of their content
words, Nenkova & Vanderwende 2005), skipping near-duplicates (more than half of their content
words already picked), in document order, until `max_words`. A usable sentence has 6–60
words, mostly letters, and is not a heading or a table row. Pure Python; deterministic.
"""

from __future__ import annotations

import re
from collections import Counter

from hisparse_cli.summarize.guard import split_sentences, words

MIN_SENTENCE_WORDS, MAX_SENTENCE_WORDS = 6, 60
_STOP = frozenset("""a an the and or but if then of to in on at by for with from as is are was
were be been being it its this that these those there their they them he she his her we our
you your i not no so such than too very can could may might must shall should will would do
does did has have had which who whom whose what when where why how all any each other some
into over under about after before between also only same both more most other""".split())


def _usable(sentence: str) -> bool:
    toks = words(sentence)
    if not MIN_SENTENCE_WORDS <= len(toks) <= MAX_SENTENCE_WORDS:
        return False
    letters = sum(c.isalpha() for c in sentence)
    if letters < 0.6 * len(sentence.replace(" ", "")):
        return False
    return sentence.count("|") < 2 and sentence.count("\t") < 2


def _content(sentence: str) -> list[str]:
    return [w for w in words(sentence) if w not in _STOP and len(w) > 2
            and not w.isdigit()]


def _closed(sentence: str) -> str:
    sentence = " ".join(sentence.split())
    return sentence if re.search(r"""[.!?]["'”’)\]]*$""", sentence) else sentence + "."


def extractive_digest(text: str, max_words: int) -> str:
    """Up to `max_words` words of the source's own sentences (module docstring); at least
    one sentence when the text has a usable one, "" when it has none."""
    sentences = [s for s in split_sentences(text) if _usable(s)]
    if not sentences:
        return ""
    content = [_content(s) for s in sentences]
    freq = Counter(w for toks in content for w in set(toks))
    total = len(sentences)

    def centrality(i: int) -> float:
        toks = content[i]
        return sum(freq[w] for w in toks) / (total * len(toks)) if toks else 0.0

    order = [0] + sorted(range(1, total), key=lambda i: (-centrality(i), i))
    picked: list[int] = []
    covered: set[str] = set()
    used = 0
    for i in order:
        toks = set(content[i])
        if toks and len(toks & covered) > 0.5 * len(toks):
            continue  # says what a picked sentence says
        size = len(words(sentences[i]))
        if picked and used + size > max_words:
            continue
        picked.append(i)
        covered |= toks
        used += size
        if used >= max_words:
            break
    return " ".join(_closed(sentences[i]) for i in sorted(picked))


__all__ = ["extractive_digest"]
