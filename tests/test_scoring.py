"""ROUGE against hand-computed scores and against plain rouge-score; bootstrap CIs against
constant data, normal theory and simulated coverage."""

from __future__ import annotations

import math
import random
import statistics

import pytest
from rouge_score import rouge_scorer
from rouge_score import tokenize as rouge_tokenize
from nltk.stem import porter

from hisparse_cli.scoring import (ROUGE_TYPES, ScriptAwareTokenizer, bootstrap_ci,
                                  paired_bootstrap_ci, rouge_scores, split_sentences)


def f1(overlap: int, n_summary: int, n_reference: int) -> float:
    p, r = overlap / n_summary, overlap / n_reference
    return 0.0 if overlap == 0 else 2 * p * r / (p + r)


def test_identical_and_disjoint():
    text = "The committee approved the budget. Spending rises next year."
    assert rouge_scores(text, text) == {k: pytest.approx(1.0) for k in ROUGE_TYPES}
    assert rouge_scores("alpha beta gamma", "delta epsilon") == {k: 0.0 for k in ROUGE_TYPES}
    assert rouge_scores("", "delta epsilon") == {k: 0.0 for k in ROUGE_TYPES}


def test_hand_computed_english_pair():
    # summary: the cat lay on the mat   reference: the cat sat on the mat
    # unigrams: the x2, cat, on, mat match -> 5/6; bigrams: the-cat, on-the, the-mat -> 3/5;
    # LCS: the cat on the mat -> 5
    got = rouge_scores("The cat lay on the mat.", "The cat sat on the mat.")
    assert got["rouge1"] == pytest.approx(5 / 6)
    assert got["rouge2"] == pytest.approx(3 / 5)
    assert got["rougeL"] == pytest.approx(5 / 6)
    assert got["rougeLsum"] == pytest.approx(5 / 6)


def test_stemming_is_applied():
    # "running dogs" -> [run, dog]; "the dog runs" -> [the, dog, run]: overlap 2, LCS 1
    got = rouge_scores("running dogs", "the dog runs")
    assert got["rouge1"] == pytest.approx(f1(2, 2, 3))
    assert got["rougeL"] == pytest.approx(f1(1, 2, 3))


def test_lsum_uses_sentence_split():
    # Sentences swapped: whole-text LCS is 2 of 4, but per-sentence union LCS recovers all 4.
    got = rouge_scores("aa bb. cc dd.", "cc dd. aa bb.")
    assert got["rougeL"] == pytest.approx(0.5)
    assert got["rougeLsum"] == pytest.approx(1.0)


def test_sentence_splitter():
    assert split_sentences('One. "Two." Three (four.) Five!\nSix 今日は晴れ。明日は雨。') == [
        "One.", '"Two."', "Three (four.)", "Five!", "Six 今日は晴れ。", "明日は雨。"]


ASCII_CASES = [
    ("The Fed raised rates by 0.25% on Tuesday, citing persistent inflation.",
     "On Tuesday the Federal Reserve raised interest rates a quarter point. Inflation persists."),
    ("Patients receiving the drug recovered faster; side-effects were mild.",
     "The trial found faster recovery in treated patients. Side effects were generally mild."),
    ("don't STOP-believing: hold_on to that feeling (1980s) x-ray 3.14",
     "Don't stop believing! Hold on to that feeling... a 1980s hit."),
]


@pytest.mark.parametrize("summary, reference", ASCII_CASES)
def test_agrees_with_plain_rouge_score_on_ascii(summary, reference):
    plain = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
    expected = plain.score("\n".join(split_sentences(reference)),
                           "\n".join(split_sentences(summary)))
    got = rouge_scores(summary, reference)
    for name in ROUGE_TYPES:
        assert got[name] == pytest.approx(expected[name].fmeasure, abs=1e-12), name


@pytest.mark.parametrize("text", [s for pair in ASCII_CASES for s in pair])
def test_tokenizer_matches_default_on_ascii(text):
    assert ScriptAwareTokenizer().tokenize(text) == rouge_tokenize.tokenize(
        text, porter.PorterStemmer())


def test_cjk_scores_are_not_zero_and_hand_checked():
    plain = rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True)
    assert plain.score("我喜欢猫", "我喜欢狗")["rouge1"].fmeasure == 0.0  # why we exist
    zh = rouge_scores("我喜欢狗", "我喜欢猫")  # 4 chars each: 3 shared; bigrams 2 of 3
    assert zh["rouge1"] == pytest.approx(0.75) and zh["rouge2"] == pytest.approx(2 / 3)
    assert zh["rougeL"] == pytest.approx(0.75)
    ja = rouge_scores("東京は広い", "東京は大きい")  # 東 京 は い shared: 4 of 5 vs 6
    assert ja["rouge1"] == pytest.approx(f1(4, 5, 6))
    ko = rouge_scores("나는 집에 간다", "나는 학교에 간다")  # syllables: 5 shared, 6 vs 7
    assert ko["rouge1"] == pytest.approx(f1(5, 6, 7))


def test_word_scripts_tokenized_by_word():
    ru = rouge_scores("Кошка лежит на ковре", "кошка сидит на ковре")
    assert ru["rouge1"] == pytest.approx(0.75) and ru["rouge2"] == pytest.approx(1 / 3)
    tok = ScriptAwareTokenizer()
    assert tok.tokenize("Καλημέρα κόσμε!") == ["καλημέρα", "κόσμε"]
    assert tok.tokenize("مَرْحَبًا بالعالم") == ["مَرْحَبًا", "بالعالم"]  # diacritics stay
    assert tok.tokenize("Cafés naïve") == ["café", "naïv"]  # Latin: Porter-stemmed
    assert tok.tokenize("GPU上で動く") == ["gpu", "上", "で", "動", "く"]


# --- bootstrap --------------------------------------------------------------------------------

def test_bootstrap_constant_and_single():
    assert bootstrap_ci([0.42] * 50) == pytest.approx((0.42, 0.42, 0.42))
    assert bootstrap_ci([0.7]) == (0.7, 0.7, 0.7)


def test_bootstrap_deterministic_and_ordered():
    values = [math.sin(i) ** 2 for i in range(25)]  # 25 distinct values in [0, 1]
    first = bootstrap_ci(values, seed=3)
    assert first == bootstrap_ci(values, seed=3)
    assert first != bootstrap_ci(values, seed=4)
    mean, lo, hi = first
    assert mean == pytest.approx(statistics.fmean(values)) and lo < mean < hi


def test_bootstrap_matches_normal_theory_for_large_n():
    rng = random.Random(7)
    values = [rng.gauss(0.5, 0.1) for _ in range(400)]
    mean, lo, hi = bootstrap_ci(values, n_resamples=2000)
    half = 1.959964 * statistics.stdev(values) / math.sqrt(len(values))
    assert lo == pytest.approx(mean - half, abs=0.15 * half)
    assert hi == pytest.approx(mean + half, abs=0.15 * half)


def test_bootstrap_coverage():
    rng = random.Random(11)
    trials, covered = 200, 0
    for trial in range(trials):
        sample = [rng.random() for _ in range(30)]  # true mean 0.5
        _, lo, hi = bootstrap_ci(sample, n_resamples=400, confidence=0.9, seed=trial)
        covered += lo <= 0.5 <= hi
    assert 0.80 <= covered / trials <= 0.97  # nominal 0.90; 200 trials: sd ~0.02


def test_paired_bootstrap():
    base = [0.2, 0.4, 0.35, 0.6, 0.5]
    assert paired_bootstrap_ci([b + 0.1 for b in base], base) == pytest.approx((0.1, 0.1, 0.1))
    rng = random.Random(5)
    b = [rng.random() for _ in range(60)]
    a = [x + 0.05 + rng.gauss(0, 0.01) for x in b]  # better on every item, noisy baseline
    diff, lo, hi = paired_bootstrap_ci(a, b)
    assert 0.0 < lo < diff < hi < 0.1
    _, ulo, uhi = bootstrap_ci(a)  # unpaired CI of a alone is far wider than the paired one
    assert (hi - lo) < (uhi - ulo) / 5
    with pytest.raises(ValueError):
        paired_bootstrap_ci([1.0, 2.0], [1.0])


@pytest.mark.parametrize("kwargs", [dict(values=[]), dict(values=[1.0], confidence=1.0),
                                    dict(values=[1.0, 2.0], n_resamples=0)])
def test_bootstrap_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        bootstrap_ci(**kwargs)
