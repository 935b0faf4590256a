"""The genre guess: which kind of document this is, from its content (and how it was read).

    guess_genre(text, kind) -> "judgment" | "contract" | "patent" | "clinical" | "biomedical"
                               | "scientific" | "report" | "code" | "collection" | "generic"

The genre picks the prompt family (prompts.py) and the summary's target length (lengths.py).
How it is read:
  * the kind decides first: a repository is "code", a folder of prose documents (kind
    "collection") is "collection" — a folder of documents is never summarized as code;
  * otherwise each genre has weighted cue patterns (words and phrases that readers of that
    genre know: "appellant", "the present invention", "you agree", "mg", "cells", "we
    propose", "Congress", …). Matches are counted in the first 50,000 characters; the first
    1,500 characters (title, heading, first paragraph) count twice. A genre needs matches of at
    least 3 distinct cues; its score is the weighted count per 1,000 words of the sample;
  * the best score wins when it reaches MIN_SCORE and beats the runner-up by MARGIN (x1.15);
    else "generic" — an uncertain guess gets the generic prompt, which suits anything.
Old genre names are accepted everywhere a genre is given: "legal" means "contract" and
"medical" means "clinical" (GENRE_ALIASES).
"""

from __future__ import annotations

import re

GENRES = ("judgment", "contract", "patent", "clinical", "biomedical", "scientific", "report",
          "code", "collection", "generic")
GENRE_ALIASES = {"legal": "contract", "medical": "clinical", "paper": "scientific",
                 "repository": "code"}
SAMPLE_CHARS = 50_000
HEAD_CHARS = 1_500
MIN_DISTINCT = 3
MIN_SCORE = 4.0  # weighted matches per 1,000 words
MARGIN = 1.15

# (pattern, weight): a weight of 3 marks a cue that by itself nearly decides the genre.
_CUES: dict[str, tuple[tuple[str, float], ...]] = {
    "judgment": (
        (r"appellants?", 3), (r"appellees?", 3), (r"respondents?", 2), (r"petitioners?", 2),
        (r"plaintiffs?", 2), (r"defendants?", 2), (r"the (?:trial |district |lower |high )?court",
                                                   1.5), (r"judgment", 1.5),
        (r"affirmed", 2), (r"reversed", 1.5), (r"remanded", 3), (r"we hold", 3),
        (r"dissent(?:ing)?", 2), (r"counsel", 1), (r"jury", 1.5), (r"verdict", 2),
        (r"conviction", 2), (r"sentenced", 1.5), (r"prosecution", 1.5), (r"tribunal", 1.5),
        (r"honou?r", 0.5), (r"j\.", 1), (r"v\.", 1.5), (r"case law", 2), (r"precedent", 1.5),
        (r"held that", 2), (r"the accused", 2), (r"testimony", 1.5), (r"statute", 1),
    ),
    "contract": (
        (r"agreement", 1.5), (r"hereby", 2), (r"herein", 2), (r"hereunder", 3),
        (r"whereas", 2), (r"part(?:y|ies)", 1), (r"shall", 0.7), (r"clause", 1.5),
        (r"indemnif(?:y|ication)", 3), (r"warrant(?:y|ies)", 1.5), (r"liabilit(?:y|ies)", 1.5),
        (r"terminat(?:e|ion)", 1), (r"governing law", 3), (r"licen[cs]ee", 3),
        (r"licen[cs]or", 3), (r"licen[cs]e", 1), (r"you agree", 3), (r"terms of (?:service|use)",
                                                                    3),
        (r"privacy policy", 2), (r"your (?:use|account|content|personal)", 2),
        (r"we may", 1), (r"breach", 1.5), (r"confidential(?:ity)?", 1), (r"fees?", 0.5),
        (r"obligations?", 1), (r"contract", 1), (r"at (?:its|our) (?:sole )?discretion", 3),
        (r"third part(?:y|ies)", 1),
    ),
    "patent": (
        (r"the present invention", 3), (r"embodiments?", 3), (r"wherein", 2),
        (r"what is claimed", 3), (r"claims?", 1), (r"prior art", 3), (r"invention", 2),
        (r"patent", 2), (r"apparatus", 1.5), (r"comprising", 1), (r"said", 0.5),
        (r"preferably", 1), (r"fig\.", 1), (r"according to (?:the|an|one) (?:invention|"
                                             r"embodiment)", 3),
    ),
    "clinical": (
        (r"the patient", 2), (r"admitted", 1.5), (r"admission", 1.5), (r"discharged?", 2),
        (r"diagnos(?:is|ed)", 1), (r"mg", 1.5), (r"history of", 1), (r"presented with", 2),
        (r"on examination", 3), (r"medications?", 1.5), (r"allerg(?:y|ies)", 1.5),
        (r"follow-up", 1), (r"ward", 1), (r"vital signs", 3), (r"physician", 1),
        (r"prescribed", 1.5), (r"symptoms", 1), (r"blood pressure", 1), (r"chief complaint",
                                                                         3),
        (r"daily", 0.5), (r"twice", 0.5), (r"plan", 0.5),
    ),
    "biomedical": (
        (r"cells?", 1), (r"proteins?", 1), (r"genes?", 1), (r"expression", 1),
        (r"mice", 2), (r"mouse", 1.5), (r"in vivo", 2), (r"in vitro", 2), (r"mutants?", 1.5),
        (r"receptors?", 1), (r"infection", 1), (r"cohort", 1), (r"genom(?:e|es|ic)", 1.5),
        (r"neurons?", 1.5), (r"tissues?", 1), (r"dna", 1), (r"rna", 1), (r"enzymes?", 1),
        (r"bacteria(?:l)?", 1), (r"species", 1), (r"clinical", 0.5), (r"patients", 0.5),
        (r"p ?[<=] ?0?\.\d", 1.5), (r"molecular", 1), (r"phenotypes?", 1.5),
        (r"pathways?", 1), (r"et al", 0.5), (r"strains?", 1), (r"disease", 0.5),
    ),
    "scientific": (
        (r"we propose", 2), (r"we present", 2), (r"in this paper", 3), (r"our (?:method|"
                                                                        r"approach|model|system)",
                                                                        2),
        (r"experiments?", 1), (r"results", 0.5), (r"datasets?", 1.5), (r"baselines?", 1.5),
        (r"table \d", 1), (r"figure \d", 0.5), (r"et al", 1), (r"evaluation", 1),
        (r"accuracy", 1), (r"algorithms?", 1), (r"corpus", 1.5), (r"related work", 3),
        (r"section \d", 1), (r"abstract", 1), (r"theorem", 2), (r"proof", 1),
        (r"hypothes(?:is|es)", 1), (r"empirical", 1), (r"state of the art", 2),
        (r"precision", 1), (r"recall", 1), (r"f-?(?:1|score|measure)", 1.5),
    ),
    "report": (
        (r"congress(?:ional)?", 2), (r"federal", 1), (r"agenc(?:y|ies)", 1),
        (r"gao", 2), (r"crs", 2), (r"department of", 1), (r"fiscal years?", 2),
        (r"programs?", 0.5), (r"polic(?:y|ies)", 0.5), (r"legislation", 1.5),
        (r"recommendations?", 1), (r"we recommend", 2), (r"government", 0.5),
        (r"officials", 1.5), (r"appropriations?", 2), (r"administration", 0.5),
        (r"stakeholders", 1), (r"ministry", 1), (r"public sector", 1.5), (r"oversight", 1),
        (r"this report", 2), (r"budget", 0.5), (r"funding", 0.5), (r"statutory", 1),
    ),
    "code": (
        (r"def", 1), (r"return", 1), (r"import", 1), (r"class", 0.5), (r"function", 0.5),
        (r"const", 1), (r"struct", 1), (r"void", 1), (r"#include", 3), (r"public", 0.5),
        (r"private", 0.5), (r"namespace", 1), (r"async", 1), (r"await", 1), (r"lambda", 1),
        (r"self", 0.5), (r"fn", 1), (r"impl", 1), (r"func", 1), (r"null", 0.5),
        (r"none", 0.5), (r"elif", 2), (r"typedef", 2),
    ),
}
_PATTERNS = {
    genre: [(re.compile(r"(?<![\w#])(?:" + pattern + r")(?![\w])"), weight)
            for pattern, weight in cues]
    for genre, cues in _CUES.items()
}
_WORD = re.compile(r"\w+")


def canonical_genre(genre: str | None) -> str:
    """The genre name prompts and lengths use: an alias mapped, an unknown name "generic"."""
    name = GENRE_ALIASES.get(genre or "", genre or "")
    return name if name in GENRES else "generic"


def genre_scores(text: str) -> dict[str, tuple[float, int]]:
    """Per genre: (weighted matches per 1,000 words, distinct cues matched) of the sample."""
    sample = text[:SAMPLE_CHARS].lower()
    head = sample[:HEAD_CHARS]
    words = max(1, len(_WORD.findall(sample)))
    out = {}
    for genre, patterns in _PATTERNS.items():
        total, distinct = 0.0, 0
        for pattern, weight in patterns:
            hits = len(pattern.findall(sample)) + len(pattern.findall(head))
            if hits:
                total += weight * hits
                distinct += 1
        out[genre] = (total * 1000.0 / words, distinct)
    return out


def guess_genre(text: str, kind: str) -> str:
    """The genre of a document (module docstring)."""
    if kind == "repository":
        return "code"
    if kind == "collection":
        return "collection"
    ranked = sorted(((score, genre) for genre, (score, distinct) in genre_scores(text).items()
                     if distinct >= MIN_DISTINCT), reverse=True)
    if not ranked or ranked[0][0] < MIN_SCORE:
        return "generic"
    if len(ranked) > 1 and ranked[0][0] < MARGIN * ranked[1][0]:
        return "generic"
    return ranked[0][1]


__all__ = ["GENRES", "GENRE_ALIASES", "canonical_genre", "genre_scores", "guess_genre"]
