"""The guard on every generation: what a failed summary looks like, scaffolding removal, and
ending on a complete sentence. Pure Python (no model): the pipeline calls it on every chunk
summary and every final summary; benchmarks run `find_problem` over finished summaries.

    text = clean_output(raw, labels=("pages 3–5",))   # scaffolding and preambles removed
    text = end_on_sentence(text)                       # a cut last sentence dropped
    problem = find_problem(text, instructions=(task,)) # None, or Problem(kind, detail)

Problem kinds (each from a failure seen with small models):
  * "empty":       fewer than `min_words` words with letters (nothing, "1.", a stray heading);
  * "number_list": mostly numbers ("1\\n2\\n3", "1990 1991 1992 …"), not prose;
  * "echo":        the output restates the instructions (the task sentence, the system
                   message) instead of summarizing;
  * "refusal":     "I'm sorry, but I can't …", "As an AI …";
  * "loop":        a sentence said twice, three or more sentences opening with the same five
                   words ("The results were also compared to …"), or a large share of repeated
                   word 4-grams (a paraphrased loop that an n-gram ban lets through);
  * "cut":         no complete sentence at all (the text stops mid-sentence).
`repair_loop` keeps what came before a loop (whole sentences), the cheap fix tried before a
new generation. Sentences are split after . ! ? (closing quotes/brackets allowed) followed by
whitespace, and at line breaks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

MIN_WORDS = 5
HEADING_WORDS = 8  # a title line without punctuation
COLON_HEADING_WORDS = 4  # "Legal summary:", "Key points:" (not "The contract sets duties:")
LOOP_OPENING_WORDS = 5
LOOP_OPENING_REPEATS = 3
LOOP_NGRAM = 4
LOOP_REPEAT_SHARE = 0.25  # repeated 4-grams / all 4-grams (normal prose: under 0.1)
LOOP_MIN_NGRAMS = 20
ECHO_SHARE = 0.5
PARAPHRASE_MIN_NGRAMS = 5  # repair: a sentence of 8+ words re-using half its 4-grams loops
NUMBER_SHARE = 0.5

_SENTENCE_END = re.compile(r"""[.!?…]["'”’)\]]*(?=\s|$)""")
_FINAL = re.compile(r"""[.!?…]["'”’)\]*]*$""")
_SPLIT = re.compile(r"""(?<=[.!?…])["'”’)\]]*\s+|\n+""")
_WORD = re.compile(r"[^\W_]+(?:['’][^\W_]+)*")
_NUMBERISH = re.compile(r"^[\W_]*(?:\d[\d.,:/%-]*|[ivxlc]+\.?|[a-z]\))?[\W_]*$", re.I)
_REFUSAL = re.compile(r"^\W*(?:i'?m sorry|i am sorry|sorry, (?:but )?i|i cannot|i can'?t|"
                      r"as an ai|i am unable|i'm unable|unfortunately, i)", re.I)
# scaffolding a model copies from the prompt's layout: whole lines, or a lead-in sentence
_SCAFFOLD_LINE = re.compile(
    r"^\s*(?:#+\s*|\*\*)?(?:summary|final summary|part summar(?:y|ies)|combined summary|"
    r"concise summary|overall summary|tl;?dr)\s*(?:\*\*)?\s*:?\s*(?:\*\*)?\s*$"
    r"|^\s*\[[^\]\n]{1,80}\]\s*:?\s*$"
    r"|^\s*part \d+ of \d+\b[^\n]{0,80}:\s*$"
    r"|^\s*-{3,}\s*$", re.I)
_TITLE_LINE = re.compile(r"^\s*(?:\*\*)?title(?:\*\*)?\s*:", re.I)
_SCAFFOLD_SENTENCE = re.compile(
    r"\b(?:part summar(?:y|ies)|summaries above|the summary is again|(?:this|the) (?:part|"
    r"chunk) (?:covers|summary)|part \d+ of \d+)\b", re.I)
_PREAMBLE = re.compile(
    r"^\s*(?:(?:sure|certainly|okay|ok)[,!.]\s*)?(?:here(?:'s| is) (?:a |an |the |my )?"
    r"(?:\w+ ){0,3}summary[^\n:]{0,80}:|(?:\*\*)?summary(?:\*\*)?\s*:(?:\*\*)?)\s*", re.I)


@dataclass(frozen=True)
class Problem:
    kind: str  # empty | number_list | echo | refusal | loop | cut
    detail: str

    def __str__(self) -> str:
        return f"{self.kind} ({self.detail})"


def words(text: str) -> list[str]:
    """Lower-cased words (letters or digits; apostrophes inside kept)."""
    return [w.lower() for w in _WORD.findall(text)]


def split_sentences(text: str) -> list[str]:
    """Sentences (module docstring's rule), stripped, empty ones dropped."""
    return [s.strip() for s in _SPLIT.split(text) if s and s.strip()]


def ends_mid_sentence(text: str) -> bool:
    """True when the text does not end with sentence-final punctuation (quotes/brackets
    after it allowed). Empty text does not end mid-sentence."""
    stripped = text.rstrip()
    return bool(stripped) and _FINAL.search(stripped) is None


def end_on_sentence(text: str) -> str:
    """`text` ending at its last complete sentence; unchanged when it already ends on one.
    When no sentence ends anywhere, the text is returned unchanged (the guard's "cut")."""
    stripped = text.rstrip()
    if not ends_mid_sentence(stripped):
        return stripped
    last = None
    for match in _SENTENCE_END.finditer(stripped):
        last = match
    return stripped[:last.end()].rstrip() if last is not None else stripped


def clean_output(text: str, labels: Iterable[str] = ()) -> str:
    """Scaffolding removed: a preamble ("Here is a summary of the document:", "Summary:"),
    short first lines that are headings ("Key points:", "Title: …", a copied document title
    of up to 8 words without punctuation) when text follows, heading lines ("## Summary",
    "[pages 3–5]", "Part 2 of 5:"), sentences about the prompt's layout ("The part summary
    is again: …"), and lines that are only a chunk label."""
    labels = {lab.strip().lower() for lab in labels if lab.strip()}
    text = _PREAMBLE.sub("", text.strip(), count=1)
    while True:  # headings the model put above its text ("Legal summary:", a title line)
        first, _, rest = text.partition("\n")
        n = len(first.split())
        heading = (first.rstrip().endswith(":") and n <= COLON_HEADING_WORDS) or (
            n <= HEADING_WORDS and ends_mid_sentence(first) and not first.rstrip().endswith(":"))
        if not (rest.strip() and (heading or _TITLE_LINE.match(first))):
            break
        text = rest.strip()
    kept = []
    for line in text.splitlines():
        bare = line.strip().strip("[]():*#").strip().lower()
        if _SCAFFOLD_LINE.match(line) or (bare and bare in labels):
            continue
        if _SCAFFOLD_SENTENCE.search(line):
            pieces = [s for s in re.split(r"(?<=[.!?])\s+", line)
                      if not _SCAFFOLD_SENTENCE.search(s)]
            line = " ".join(pieces)
            if not line.strip():
                continue
        kept.append(line.rstrip())
    out = "\n".join(kept).strip()
    return re.sub(r"\n{3,}", "\n\n", out)


def _ngrams(tokens: list[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


def repeat_share(tokens: list[str], n: int = LOOP_NGRAM) -> float:
    """Share of the word n-grams that already occurred earlier in the text."""
    grams = _ngrams(tokens, n)
    if not grams:
        return 0.0
    seen: set[tuple[str, ...]] = set()
    repeats = 0
    for gram in grams:
        repeats += gram in seen
        seen.add(gram)
    return repeats / len(grams)


def _loop(text: str) -> str | None:
    seen: dict[tuple[str, ...], int] = {}
    openings: dict[tuple[str, ...], int] = {}
    for i, sentence in enumerate(split_sentences(text)):
        toks = tuple(words(sentence))
        if len(toks) >= 4:
            if toks in seen:
                return f"sentence {i + 1} repeats sentence {seen[toks] + 1}"
            seen[toks] = i
        if len(toks) > LOOP_OPENING_WORDS:
            key = toks[:LOOP_OPENING_WORDS]
            openings[key] = openings.get(key, 0) + 1
            if openings[key] >= LOOP_OPENING_REPEATS:
                return f"{openings[key]} sentences open with “{' '.join(key)}”"
    tokens = words(text)
    share = repeat_share(tokens)
    if len(tokens) - LOOP_NGRAM + 1 >= LOOP_MIN_NGRAMS and share >= LOOP_REPEAT_SHARE:
        return f"{share:.0%} of its word {LOOP_NGRAM}-grams are repeats"
    return None


def _echo(tokens: list[str], instructions: Iterable[str]) -> str | None:
    grams = set(_ngrams(tokens, 4))
    if not grams:
        return None
    for instruction in instructions:
        asked = set(_ngrams(words(instruction), 4))
        if not asked:
            continue
        copied = len(grams & asked)
        if copied / len(grams) >= ECHO_SHARE or copied / len(asked) >= ECHO_SHARE:
            return f"{copied} of its word 4-grams are the instructions'"
    return None


def find_problem(text: str, *, instructions: Iterable[str] = (),
                 min_words: int = MIN_WORDS) -> Problem | None:
    """The first failure found in `text` (module docstring), or None for a usable summary.
    `instructions`: the prompt's own sentences (task, system message) an echo would copy."""
    tokens = words(text)
    lettered = [t for t in tokens if any(c.isalpha() for c in t)]
    pieces = text.split()
    numbers = sum(1 for t in pieces if _NUMBERISH.match(t))
    lines = [ln for ln in text.splitlines() if ln.strip()]
    numeric_lines = sum(1 for ln in lines if _NUMBERISH.match(ln.strip()))
    if numbers >= 3 and (numbers / len(pieces) >= NUMBER_SHARE or (
            len(lines) >= 3 and numeric_lines / len(lines) >= NUMBER_SHARE)):
        return Problem("number_list", f"{numbers} of {len(pieces)} tokens are numbers")
    if len(lettered) < min_words:
        return Problem("empty", f"{len(lettered)} words")
    if _REFUSAL.match(text):
        return Problem("refusal", text.strip().split("\n")[0][:60])
    echo = _echo(tokens, instructions)
    if echo:
        return Problem("echo", echo)
    loop = _loop(text)
    if loop:
        return Problem("loop", loop)
    if not _SENTENCE_END.search(text):
        return Problem("cut", "no complete sentence")
    return None


def is_degenerate(text: str, instructions: Iterable[str] = ()) -> bool:
    return find_problem(text, instructions=instructions) is not None


def repair_loop(text: str) -> str:
    """The sentences before the loop starts: before the first sentence that repeats an
    earlier one, opens like two earlier ones, or mostly re-uses earlier word 4-grams (a
    paraphrased repeat). The whole text when no sentence starts a loop."""
    kept: list[str] = []
    seen: set[tuple[str, ...]] = set()
    grams: set[tuple[str, ...]] = set()
    openings: dict[tuple[str, ...], int] = {}
    for sentence in split_sentences(text):
        toks = tuple(words(sentence))
        own = _ngrams(list(toks), LOOP_NGRAM)
        if len(toks) >= 4 and toks in seen:
            break
        if len(own) >= PARAPHRASE_MIN_NGRAMS and sum(g in grams for g in own) / len(own) >= 0.5:
            break
        if len(toks) > LOOP_OPENING_WORDS:
            key = toks[:LOOP_OPENING_WORDS]
            if openings.get(key, 0) + 1 >= LOOP_OPENING_REPEATS:
                break
            openings[key] = openings.get(key, 0) + 1
        seen.add(toks)
        grams.update(own)
        kept.append(sentence)
    return " ".join(kept)


__all__ = ["Problem", "find_problem", "is_degenerate", "clean_output", "end_on_sentence",
           "ends_mid_sentence", "repair_loop", "split_sentences", "words", "repeat_share",
           "MIN_WORDS"]
