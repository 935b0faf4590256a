"""ROUGE for summaries in any script, and bootstrap confidence intervals for their means.

`rouge_scores(summary, reference)` returns the F1 of rouge1, rouge2, rougeL and rougeLsum
computed by Google's `rouge_score` package with Porter stemming, but with our own tokenizer:
rouge-score's default keeps only [a-z0-9], so any Chinese, Japanese, Korean, Cyrillic, Greek
or Arabic summary scores exactly zero. `ScriptAwareTokenizer`:
  * lowercases;
  * cuts text into runs of letters, digits and combining marks (any script);
  * splits CJK (Han, Hiragana, Katakana, Hangul) and the unspaced Southeast-Asian scripts
    (Thai, Lao, Khmer, Myanmar) into one token per character — they have no spaces between
    words, and character n-grams are the usual ROUGE unit for them;
  * stems Latin-script tokens longer than 3 characters with the same Porter stemmer as
    rouge-score. On ASCII text it yields exactly rouge-score's default tokens.
rougeLsum needs one sentence per line: `split_sentences` splits on newlines and after
sentence-final punctuation (. ! ? … and 。！？), and the result is joined with "\\n".
"""

from __future__ import annotations

import math
import random
import re
import unicodedata
from typing import Sequence

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")

_CHAR_TOKEN_RANGES = (
    (0x0E00, 0x0EFF),    # Thai, Lao
    (0x1000, 0x109F),    # Myanmar
    (0x1100, 0x11FF),    # Hangul Jamo
    (0x1780, 0x17FF),    # Khmer
    (0x2E80, 0x2FDF),    # CJK radicals, Kangxi radicals
    (0x3040, 0x30FF),    # Hiragana, Katakana
    (0x3100, 0x31FF),    # Bopomofo, Hangul compatibility Jamo, Kanbun, Katakana ext.
    (0x3400, 0x4DBF),    # CJK Extension A
    (0x4E00, 0x9FFF),    # CJK Unified Ideographs
    (0xA960, 0xA97F),    # Hangul Jamo Extended-A
    (0xAC00, 0xD7FF),    # Hangul syllables, Jamo Extended-B
    (0xF900, 0xFAFF),    # CJK compatibility ideographs
    (0xFF66, 0xFFDC),    # half-width Katakana and Hangul
    (0x20000, 0x3134F),  # CJK Extensions B-G
)


def _is_char_token(ch: str) -> bool:
    code = ord(ch)
    return any(lo <= code <= hi for lo, hi in _CHAR_TOKEN_RANGES)


def _is_word_char(ch: str) -> bool:
    return ch.isalnum() or unicodedata.category(ch).startswith("M")


def _is_latin(token: str) -> bool:
    """ASCII letters/digits and the Latin-1/Latin Extended letter blocks."""
    for ch in token:
        code = ord(ch)
        if code < 0x80:
            continue
        if not (0xC0 <= code <= 0x24F or 0x1E00 <= code <= 0x1EFF) or code in (0xD7, 0xF7):
            return False
    return True


class ScriptAwareTokenizer:
    """Tokenizer object for `rouge_scorer.RougeScorer(tokenizer=...)` (see module docstring)."""

    def __init__(self, use_stemmer: bool = True) -> None:
        from nltk.stem import porter  # the stemmer rouge-score itself uses

        self._stemmer = porter.PorterStemmer() if use_stemmer else None

    def _finish(self, word: str) -> str:
        if self._stemmer is not None and len(word) > 3 and _is_latin(word):
            return self._stemmer.stem(word)
        return word

    def tokenize(self, text: str) -> list[str]:
        tokens: list[str] = []
        word: list[str] = []
        for ch in text.lower():
            if _is_char_token(ch):
                if word:
                    tokens.append(self._finish("".join(word)))
                    word = []
                tokens.append(ch)
            elif _is_word_char(ch):
                word.append(ch)
            elif word:
                tokens.append(self._finish("".join(word)))
                word = []
        if word:
            tokens.append(self._finish("".join(word)))
        return tokens


_SENTENCE_END = re.compile(r"([.!?…][\"'”’)\]]*)\s+")  # keeps closing quotes/brackets
_CJK_SENTENCE_END = re.compile(r"([。！？][」』”’）]*)")


def split_sentences(text: str) -> list[str]:
    """Simple splitter: newlines, then after . ! ? … followed by space, and after 。！？."""
    marked = _CJK_SENTENCE_END.sub("\\1\n", _SENTENCE_END.sub("\\1\n", text))
    return [piece.strip() for piece in marked.splitlines() if piece.strip()]


_SCORER = None


def _scorer():
    global _SCORER  # lazily built once: constructing the stemmer is not free
    if _SCORER is None:
        from rouge_score import rouge_scorer

        _SCORER = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True,
                                           tokenizer=ScriptAwareTokenizer(use_stemmer=True))
    return _SCORER


def rouge_scores(summary: str, reference: str) -> dict[str, float]:
    """F1 of rouge1/rouge2/rougeL/rougeLsum of `summary` against `reference` (0..1)."""
    summary_lines = "\n".join(split_sentences(summary))
    reference_lines = "\n".join(split_sentences(reference))
    scores = _scorer().score(reference_lines, summary_lines)  # (target, prediction)
    return {name: float(scores[name].fmeasure) for name in ROUGE_TYPES}


# --- bootstrap ------------------------------------------------------------------------------

def _percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default method), q in [0, 1]."""
    position = q * (len(sorted_values) - 1)
    lo = math.floor(position)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (position - lo)


def _check(n_resamples: int, confidence: float) -> None:
    if isinstance(n_resamples, bool) or not isinstance(n_resamples, int) or n_resamples < 1:
        raise ValueError(f"n_resamples must be a positive integer, got {n_resamples!r}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")


def bootstrap_ci(values: Sequence[float], n_resamples: int = 2000, confidence: float = 0.95,
                 seed: int = 0) -> tuple[float, float, float]:
    """(mean, lo, hi): the sample mean and its percentile-bootstrap confidence interval.

    Deterministic for a given seed. A single value v gives (v, v, v).
    """
    data = [float(v) for v in values]
    if not data:
        raise ValueError("bootstrap_ci needs at least one value")
    _check(n_resamples, confidence)
    mean = math.fsum(data) / len(data)
    if len(data) == 1:
        return mean, mean, mean
    rng = random.Random(seed)
    n = len(data)
    means = sorted(math.fsum(rng.choices(data, k=n)) / n for _ in range(n_resamples))
    alpha = (1.0 - confidence) / 2.0
    return mean, _percentile(means, alpha), _percentile(means, 1.0 - alpha)


def paired_bootstrap_ci(a: Sequence[float], b: Sequence[float], n_resamples: int = 2000,
                        confidence: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """(mean of a-b, lo, hi): paired bootstrap CI of the mean difference of two systems
    scored on the same items (items are resampled together, keeping the pairing)."""
    if len(a) != len(b):
        raise ValueError(f"paired_bootstrap_ci needs equal lengths, got {len(a)} and {len(b)}")
    return bootstrap_ci([float(x) - float(y) for x, y in zip(a, b)], n_resamples=n_resamples,
                        confidence=confidence, seed=seed)


__all__ = ["rouge_scores", "split_sentences", "ScriptAwareTokenizer", "bootstrap_ci",
           "paired_bootstrap_ci", "ROUGE_TYPES"]
