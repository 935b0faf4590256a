"""The guard's detectors on constructed outputs (every failure kind, and normal summaries that
must pass), scaffolding removal, sentence-end trimming, loop repair, the extractive digest and
the length targets."""

from __future__ import annotations

import pytest

from hisparse_cli.summarize.digest import extractive_digest
from hisparse_cli.summarize.guard import (clean_output, end_on_sentence, ends_mid_sentence,
                                          find_problem, repair_loop, split_sentences)
from hisparse_cli.summarize.lengths import (GENRE_WORDS, chunk_length_plan, length_plan,
                                            target_words)
from hisparse_cli.summarize.prompts import instruction_texts, task_sentence

GOOD = [
    # a paper abstract, a judgment headnote, a clause tl;dr, a report summary with numbers
    "The paper studies how crowdsourced annotators label word senses. The authors collect "
    "10,000 judgments from 200 workers and compare them with expert labels. Agreement reaches "
    "0.82 kappa, close to the experts' 0.85, at a tenth of the cost. The results suggest that "
    "non-expert annotation is a practical way to build sense-tagged corpora.",
    "Smith appealed a judgment for Jones after a jury trial. The question was whether the trial "
    "court erred in excluding the expert testimony. The court held that it did, because the "
    "testimony met the reliability standard. The judgment was reversed and the case remanded.",
    "You give the service a licence to use anything you upload, and they may end your account "
    "at any time without notice.",
    "GAO reviewed the Renewable Fuel Standard. Production of conventional ethanol met the "
    "statutory targets, but advanced biofuels reached only 4 percent of the 2022 goal. EPA "
    "lowered the annual volumes every year since 2010. GAO recommends that EPA assess whether "
    "the program can meet its greenhouse gas goals.",
    "1. The buyer pays $5,000 on 1 March 2024. 2. The seller delivers the goods within 30 days. "
    "3. Either party may terminate for breach after 14 days' notice.",
]


@pytest.mark.parametrize("text", GOOD)
def test_normal_summaries_pass(text):
    assert find_problem(text, instructions=instruction_texts("scientific")) is None
    assert not ends_mid_sentence(text)
    assert repair_loop(text) == " ".join(split_sentences(text))


@pytest.mark.parametrize("text, kind", [
    ("", "empty"),
    ("Summary.", "empty"),
    ("1\n2\n3\n4\n5", "number_list"),
    ("1. 2. 3. 4. 5. 6. 7. the", "number_list"),
    ("1990\n1991\n1992\nThe years.", "number_list"),
    ("I'm sorry, but I cannot summarize this document because it is too long.", "refusal"),
    ("As an AI language model, I do not have access to the document you mention here.",
     "refusal"),
    ("Summarize the paper in one paragraph: the problem, the method, the main results and the "
     "conclusions.", "echo"),
    ("You write faithful, concise summaries. Use only facts stated in the text; keep names, "
     "numbers, amounts and dates exact.", "echo"),
    ("The agency spent $3 million in 2019 on the roads. The agency spent $3 million in 2019 on "
     "the roads.", "loop"),
    ("The results were also compared to the baseline. The results were also compared to the "
     "oracle system. The results were also compared to human annotators.", "loop"),
    ("The RFS also includes the ability to meet the requirements of the 2019 federal renewable "
     "fuel standard, which is a requirement for vehicles, and the RFS also includes the ability "
     "to meet the requirements of the 2020 federal renewable fuel standard, which is a "
     "requirement for vehicles, so the RFS also includes the ability to meet the requirements "
     "of the 2021 federal renewable fuel standard, which is a requirement for all vehicles",
     "loop"),
    ("The study found that mice lacking the gene grew faster than the wild type and", "cut"),
])
def test_each_failure_kind_is_detected(text, kind):
    problem = find_problem(text, instructions=instruction_texts("scientific"))
    assert problem is not None and problem.kind == kind, problem


def test_echo_of_custom_instructions_is_detected():
    asked = "List every party and the date each obligation falls due in the contract."
    assert find_problem(asked + " Then stop.", instructions=instruction_texts(
        "contract", asked)).kind == "echo"
    assert task_sentence("contract", 40, asked) == asked


@pytest.mark.parametrize("raw, clean", [
    ("Here is a concise summary of the document:\n\nThe court held X.", "The court held X."),
    ("Sure! Here's a summary of the report:\nGAO found Y.", "GAO found Y."),
    ("Summary:\nThe plan costs $4.", "The plan costs $4."),
    ("**Summary:** The plan costs $4.", "The plan costs $4."),
    ("## Summary\nThe plan costs $4.", "The plan costs $4."),
    ("Legal summary:\nYou must pay on time.", "You must pay on time."),
    ("Pokemon GO Terms of Service\n\nTitle: \"Legal Document\"\nYou must pay on time.",
     "You must pay on time."),
    ("You must pay on time.\nA second line.", "You must pay on time.\nA second line."),
    ("[pages 3–5]\nThe lease ends in May.", "The lease ends in May."),
    ("Part 2 of 5 (lines 1–80):\nThe lease ends in May.", "The lease ends in May."),
    ("The lease ends in May. The part summary is again: the lease.", "The lease ends in May."),
    ("The lease ends in May.\n---", "The lease ends in May."),
    ("pages 3–5\nThe lease ends in May.", "The lease ends in May."),
])
def test_scaffolding_is_removed(raw, clean):
    assert clean_output(raw, labels=("pages 3–5",)) == clean


def test_clean_output_keeps_a_normal_text_untouched():
    for text in GOOD:
        assert clean_output(text) == text


@pytest.mark.parametrize("text, ended", [
    ("One. Two is cut", "One."),
    ("One. Two!", "One. Two!"),
    ('He said "stop." Then', 'He said "stop."'),
    ("Costs rose (see Table 2.) and", "Costs rose (see Table 2.)"),
    ("The rate was 3.5 per cent and the", "The rate was 3.5 per cent and the"),  # none ends
    ("", ""),
])
def test_end_on_sentence(text, ended):
    assert end_on_sentence(text) == ended


def test_repair_loop_keeps_the_sentences_before_the_loop():
    text = ("The act was passed in 1976. It lets the President declare emergencies. It was "
            "amended in 1983. It lets the President declare emergencies. It was amended.")
    assert repair_loop(text) == ("The act was passed in 1976. It lets the President declare "
                                 "emergencies. It was amended in 1983.")
    para = ("Results were compared to A and B. Results were compared to A and C. "
            "Results were compared to A and D. Results were compared to A and E.")
    assert repair_loop(para) == "Results were compared to A and B. Results were compared to A and C."
    paraphrased = ("The program also includes the ability to meet the 2019 fuel standard. "
                   "The program also includes the ability to meet the 2020 fuel standard.")
    assert repair_loop(paraphrased) == ("The program also includes the ability to meet the 2019 "
                                        "fuel standard.")


def test_extractive_digest_takes_the_lead_and_central_sentences_in_order():
    text = ("Wind farms cut the region's emissions by a fifth between 2010 and 2020.\n"
            "Table 3 | 12 | 14 | 15\n"
            "The weather was mild.\n"
            "Emissions from the region fell as wind farms replaced the coal plants.\n"
            "The coal plants closed after the wind farms had been built in the region.\n"
            "Emissions from the region fell as wind farms replaced the coal plants.\n")
    digest = extractive_digest(text, max_words=30)
    sentences = split_sentences(digest)
    assert sentences[0].startswith("Wind farms cut")  # the lead
    assert "Table 3" not in digest and len(digest.split()) <= 30
    assert len(sentences) == len(set(sentences))  # no duplicate
    assert find_problem(digest) is None and not ends_mid_sentence(digest)
    assert extractive_digest("x = 1\ny = 2\n", 50) == ""


def test_length_targets_follow_genre_and_document_length():
    assert target_words("contract", 300) == GENRE_WORDS["contract"][0]  # 10 % below the floor
    assert target_words("contract", 900) == 90
    assert target_words("scientific", 6000) == GENRE_WORDS["scientific"][1]
    assert target_words("legal", 900) == target_words("contract", 900)  # old name
    assert target_words("no-such-genre", 900) == 90
    plan = length_plan("scientific", doc_words=6000, doc_tokens=7800, cap_tokens=2000)
    assert plan.target_words == 200 and plan.max_new_tokens == 24 + -(-200 * 1.3 * 1.25 // 1)
    capped = length_plan("report", doc_words=9000, doc_tokens=12000, cap_tokens=256)
    assert capped.max_new_tokens == 256 and capped.target_words < 300  # what the cap holds
    assert length_plan("report", doc_words=9000, doc_tokens=12000, cap_tokens=900,
                       words=40).target_words == 40
    notes = chunk_length_plan(chunk_words=5000, per_word=1.3, cap_tokens=1024)
    assert notes.target_words == 120
