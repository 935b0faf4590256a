"""Pipeline: prompts, stream vs map-reduce selection at the position limit, chunking on page
and file boundaries (with the references kept), recursive reduction, and engine setup.

Two engines: the real Engine over a tiny random Llama with a trained 256-token BPE (plumbing
end to end), and a recording fake with the same tokenizer (exact budgets, cheap). The fake
checks the invariant every generation must keep: prompt tokens + max_new_tokens fit the
model's positions.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers_tokenizer import build_tokenizer, make_tiny_model_dir
from hisparse_cli.summarize.chunking import merge_labels, split_document, split_span
from hisparse_cli.documents.base import Document, Section
from hisparse_cli.config.settings import GenerationConfig, SparseConfig
from hisparse_cli.errors import ConfigError, InputError
from hisparse_cli.summarize.pipeline import SummarySettings, aggregate_stats, summarize_document
from hisparse_cli.config.profiles import load_profile
from hisparse_cli.documents.genre import GENRES
from hisparse_cli.summarize.prompts import (FOCUS, NOUN, chunk_prompt, document_prompt,
                                            prompt_text, render_prompt, task_sentence)
from hisparse_cli.summarize.runtime import load_probe_for, plan_device, sparse_settings

TINY_SPARSE = SparseConfig(sink_tokens=4, window_size=64, global_tokens=8, block_size=16,
                           recalibrate_every=64, recalibrate_topk=8, prefill_chunk=64)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(chat_template=True)


SENTENCE = "The provider delivers the platform and the client pays the monthly fee."


@dataclass
class FakeEngine:
    """Engine stand-in: real tokenizer, given positions, fixed outputs; records prompts and
    decodings. `reply`: a text, or a function (prompt text, GenerationConfig) -> text."""

    tokenizer: object
    max_pos: int
    reply: object = SENTENCE
    parameters: int = 8_000_000_000  # the model's size (map-reduce's final step: reduce_mode)
    calls: list = field(default_factory=list)
    gens: list = field(default_factory=list)

    @property
    def cfg(self):
        return SimpleNamespace(max_position_embeddings=self.max_pos, parameters=self.parameters)

    def generate(self, ids, max_new_tokens=None, *, gen=None, progress=None):
        assert len(ids) + max_new_tokens <= self.max_pos, "prompt + new tokens exceed positions"
        self.calls.append((list(ids), max_new_tokens))
        self.gens.append(gen)
        text = self.reply(self.tokenizer.decode(ids), gen) if callable(self.reply) else self.reply
        out = self.tokenizer(text, add_special_tokens=False)["input_ids"][:max_new_tokens]
        if progress:
            progress("prefill", len(ids), len(ids))
            progress("decode", len(out), max_new_tokens)
        stats = SimpleNamespace(to_dict=lambda: {"prompt_tokens": len(ids), "new_tokens": len(out),
                                                 "prefill_seconds": 0.5, "decode_seconds": 0.25,
                                                 "kv_blocks_peak": 3, "recalibrations": 1})
        full = len(self.tokenizer(text, add_special_tokens=False)["input_ids"]) <= max_new_tokens
        return SimpleNamespace(token_ids=out, stats=stats, finish_reason="eos" if full else "length")

    def prompts(self) -> list[str]:
        return [self.tokenizer.decode(ids) for ids, _ in self.calls]


def _settings(max_new=8, **kw) -> SummarySettings:
    return SummarySettings(generation=GenerationConfig(max_new_tokens=max_new), **kw)


def _pdf(pages: list[str]) -> Document:
    text, sections = "", []
    for i, body in enumerate(pages, 1):
        block = f"[page {i}]\n{body}\n"
        sections.append(Section(f"page {i}", len(text), len(text) + len(block)))
        text += block
    return Document(text=text, kind="pdf", source="x.pdf", sections=tuple(sections),
                    genre="legal", title="X")


def _repo(files: dict[str, str]) -> Document:
    text, sections = "", []
    for name, body in files.items():
        block = f"===== {name} =====\n{body}\n"
        sections.append(Section(name, len(text), len(text) + len(block)))
        text += block
    return Document(text=text, kind="repository", source="repo", sections=tuple(sections),
                    genre="code", title="repo")


WORDS = ("the provider shall deliver the platform and the client pays the monthly fee "
         "within thirty days of the invoice ").split()


def _words(n: int, seed: int = 0) -> str:
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(n))


# --- prompts ----------------------------------------------------------------------------------
def test_chat_template_is_used_and_the_task_comes_before_and_after_the_text(tokenizer):
    prompt = document_prompt("BODY TEXT", genre="legal", title="Deal Terms", target_words=40)
    text = prompt_text(tokenizer, prompt)
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": prompt.system}, {"role": "user", "content": prompt.user}],
        add_generation_prompt=True, tokenize=False)
    assert text == expected and text.endswith("<|assistant|>")
    task = task_sentence("contract", 40)
    assert FOCUS["contract"] in task and "about 40 words" in task
    assert text.index(task) < text.index("BODY TEXT") < text.rindex(task)  # the end never leaves
    assert "Title: Deal Terms" in text  # the window, the start is how models are asked


def test_plain_prompt_without_chat_template():
    tok = build_tokenizer(chat_template=False)
    text = prompt_text(tok, document_prompt("BODY", genre="medical"))
    assert "<|assistant|>" not in text and text.rstrip().endswith("Summary:")
    assert FOCUS["clinical"] in text  # "medical" is the old name of "clinical"
    assert render_prompt(tok, document_prompt("BODY", genre="medical")) == \
        tok(text)["input_ids"]


@pytest.mark.parametrize("genre", GENRES)
def test_every_genre_has_its_own_request(genre):
    task = task_sentence(genre, 100)
    assert FOCUS[genre] in task and NOUN[genre] in task
    assert task_sentence(genre, 100) != task_sentence("generic", 100) or genre == "generic"


def test_instructions_replace_the_genre_focus(tokenizer):
    prompt = chunk_prompt("T", label="pages 3–5", index=2, total=4, genre="code",
                          instructions="List every function.")
    assert "List every function." in prompt.user and "pages 3–5" in prompt.user
    assert "part 2 of 4" in prompt.user
    doc = document_prompt("T", genre="code", instructions="List every function.")
    assert FOCUS["code"] not in doc.user and "List every function." in doc.user


def test_identifier_titles_are_not_given_to_the_model():
    assert "Title" not in document_prompt("T", genre="generic", title="legalsum04").user
    assert "Title: services agreement" in document_prompt("T", genre="generic",
                                                         title="services_agreement").user


# --- chunking ---------------------------------------------------------------------------------
def _count_words(text: str) -> int:
    return len(text.split())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(alphabet="ab \n", min_size=0, max_size=60), min_size=1, max_size=6),
       st.integers(min_value=1, max_value=12))
def test_chunks_cover_the_text_in_order_and_respect_the_budget(pages, budget):
    doc = _pdf(pages)
    chunks = split_document(doc, budget, _count_words)
    assert "".join(c.text(doc) for c in chunks) == doc.text  # nothing lost, nothing repeated
    assert all(c.tokens <= budget or _count_words(c.text(doc)) <= 1 for c in chunks)
    assert all(c.tokens == _count_words(c.text(doc)) for c in chunks)


def test_split_span_without_separators_halves_until_it_fits():
    text = "x" * 40
    spans = split_span(text, 0, 40, 5, lambda s: len(s))
    assert "".join(text[a:b] for a, b in spans) == text and all(b - a <= 5 for a, b in spans)


def test_pdf_chunks_are_whole_pages_with_page_labels():
    doc = _pdf([_words(30, s) for s in range(5)])
    chunks = split_document(doc, 70, _count_words)  # two 32-word pages fit, three do not
    assert [c.label for c in chunks] == ["pages 1–2", "pages 3–4", "page 5"]


def test_a_page_over_budget_is_cut_at_lines_and_labelled_with_them():
    doc = _pdf(["\n".join(_words(10, s) for s in range(6))])
    labels = [c.label for c in split_document(doc, 25, _count_words)]
    assert len(labels) >= 3 and all(re.fullmatch(r"page 1, lines? \d+(–\d+)?", lab)
                                    for lab in labels)


def test_repository_chunks_name_their_files():
    doc = _repo({f"src/m{i}.py": _words(20, i) for i in range(7)})
    chunks = split_document(doc, 50, _count_words)
    assert chunks[0].label == "src/m0.py, src/m1.py"
    big = split_document(doc, 1000, _count_words)
    assert big[0].label == "src/m0.py, src/m1.py, src/m2.py, src/m3.py and 3 more files"


def test_collection_and_docx_html_chunks_are_labelled_by_file_and_page():
    from dataclasses import replace

    members = _repo({f"notes/ch{i}.md": _words(20, i) for i in range(3)})
    collection = replace(members, kind="collection", genre="collection")
    assert split_document(collection, 50, _count_words)[0].label == "notes/ch0.md, notes/ch1.md"
    for kind in ("docx", "html"):
        paged = replace(_pdf([_words(30, s) for s in range(3)]), kind=kind)
        assert [c.label for c in split_document(paged, 70, _count_words)] == ["pages 1–2",
                                                                               "page 3"]
    headed = replace(_repo({"Introduction": _words(30, 0), "Methods": _words(30, 1)}),
                     kind="html", genre="scientific")
    assert [c.label for c in split_document(headed, 40, _count_words)] == ["Introduction",
                                                                            "Methods"]


def test_merge_labels():
    assert merge_labels(["pages 1–2", "page 3"]) == "pages 1–3"
    assert merge_labels(["page 3, lines 1–9", "page 3, lines 9–20"]) == "page 3"
    assert merge_labels(["lines 1–5", "line 6"]) == "lines 1–6"
    assert merge_labels(["a.py", "b.py"]) == "a.py; b.py"


# --- strategy selection -------------------------------------------------------------------------
def _sentences(n_sentences: int, seed: int = 0) -> str:
    return " ".join(_words(8, seed + i).capitalize() + "." for i in range(n_sentences))


def test_auto_streams_exactly_up_to_the_position_limit(tokenizer):
    doc = Document(text=_words(400), kind="text", source="a.txt", genre="legal", title="a")
    probe = FakeEngine(tokenizer, max_pos=100_000)
    summarize_document(doc, probe, _settings(200))
    ids, max_new = probe.calls[0]
    assert max_new < 200  # the length plan: 40 words (10 % of 400) of a legal document
    need = len(ids) + max_new
    at_limit = FakeEngine(tokenizer, max_pos=need)
    result = summarize_document(doc, at_limit, _settings(200))
    assert result.strategy == "stream" and len(at_limit.calls) == 1
    assert result.length["target_words"] == 40 and result.length["max_new_tokens"] == max_new
    one_short = FakeEngine(tokenizer, max_pos=need - 1)
    result = summarize_document(doc, one_short, _settings(200))
    assert result.strategy == "map-reduce" and len(one_short.calls) > 1


def test_forced_stream_that_does_not_fit_is_a_usage_error(tokenizer):
    doc = Document(text=_words(200), kind="text", source="a.txt")
    with pytest.raises(ConfigError, match="needs \\d+ positions .* trained on 256") as info:
        summarize_document(doc, FakeEngine(tokenizer, 256), _settings(8, strategy="stream"))
    assert "map-reduce" in info.value.hint and info.value.exit_code == 2


def test_map_reduce_prompts_cite_pages_and_final_sees_every_part(tokenizer):
    doc = _pdf([_words(40, s) for s in range(4)])
    engine = FakeEngine(tokenizer, max_pos=4096)
    result = summarize_document(doc, engine, _settings(64, strategy="map-reduce",
                                                       chunk_tokens=120))
    parts = [c for c in result.chunks if c.level == 0]
    assert len(parts) >= 2 and result.strategy == "map-reduce"
    prompts = engine.prompts()
    for part, prompt in zip(parts, prompts):
        assert f"({part.label})" in prompt
    final_prompt = prompts[-1]
    assert all(f"Part {i + 1} of {len(parts)} ({p.label}):" in final_prompt
               for i, p in enumerate(parts))
    assert "Beginning of the legal document:" in final_prompt  # grounding: the opening lines
    assert result.runs[-1]["step"] == "final summary"
    assert result.summary == SENTENCE and result.warnings == []
    final = result.chunks[-1]  # every step is listed, the final combine too
    assert (final.label, final.level) == ("final summary", 1) and len(result.chunks) == \
        len(parts) + 1 and final.summary == result.summary


def test_chunks_are_balanced(tokenizer):
    doc = Document(text="\n\n".join(_words(30, s) for s in range(30)), kind="text",
                   source="a.txt")
    engine = FakeEngine(tokenizer, max_pos=100_000)
    result = summarize_document(doc, engine, _settings(64, strategy="map-reduce",
                                                       chunk_tokens=400))
    sizes = [p for p, _ in ((c.prompt_tokens, c) for c in result.chunks if c.level == 0)]
    assert len(sizes) >= 3 and max(sizes) - min(sizes) < 0.3 * max(sizes)  # no scrap at the end


def test_reduction_recurses_when_summaries_do_not_fit_together(tokenizer):
    doc = _pdf([_words(60, s) for s in range(12)])
    engine = FakeEngine(tokenizer, max_pos=700, reply=_sentences(12))
    result = summarize_document(doc, engine, _settings(24, strategy="map-reduce"))
    assert {c.level for c in result.chunks} >= {0, 1}  # parts, then an intermediate round
    combines = [r["step"] for r in result.runs if r["step"].startswith("combine")]
    assert len(combines) >= 2 and re.match(r"combine 1/\d+ \(pages 1–\d+\)", combines[0])
    assert result.runs[-1]["step"] == "final summary"
    # every generation kept prompt + new tokens within the positions (FakeEngine asserts)


def test_max_new_tokens_too_large_for_map_reduce(tokenizer):
    doc = _pdf([_words(80, s) for s in range(3)])
    with pytest.raises(ConfigError, match="too large"):
        summarize_document(doc, FakeEngine(tokenizer, 300), _settings(200, words=150))


# --- the guard in the pipeline ------------------------------------------------------------------
def test_a_degenerate_chunk_is_retried_then_replaced_by_a_digest_never_reduced(tokenizer):
    pages = [_sentences(6, 10 * s) for s in range(3)]
    doc = _pdf(pages)

    def reply(prompt: str, gen) -> str:
        return "1\n2\n3\n4" if "part 2 of 3" in prompt else _sentences(3, 99)

    engine = FakeEngine(tokenizer, max_pos=100_000, reply=reply)
    one_page = max(len(tokenizer(doc.text[sec.start:sec.end])["input_ids"])
                   for sec in doc.sections)
    result = summarize_document(doc, engine, _settings(64, strategy="map-reduce",
                                                       chunk_tokens=int(one_page * 1.2)))
    steps = [r["step"] for r in result.runs]
    assert steps[1:4] == ["part 2/3 (page 2)", "part 2/3 (page 2) (retry 1)",
                          "part 2/3 (page 2) (retry 2)"]
    base, stronger, sampled = engine.gens[1:4]
    assert stronger.repetition_penalty >= 1.3 and stronger.no_repeat_ngram_size == 4
    assert sampled.temperature > 0 and sampled.seed is not None  # seeded: reproducible
    part2 = next(c for c in result.chunks if c.label == "page 2")
    assert part2.status == "digest" and part2.summary.split(". ")[0] in pages[1].replace(
        "\n", " ")
    final_prompt = engine.prompts()[-1]
    assert "1\n2\n3" not in final_prompt and part2.summary in final_prompt
    assert result.guard["retries"] == 2 and result.guard["digests"] == 1
    assert result.stats["guard_retries"] == 2
    assert len(result.warnings) == 3 and all("part 2/3" in w for w in result.warnings)
    assert "digest" in result.warnings[-1]


def test_a_failed_summary_is_retried_and_the_retry_kept(tokenizer):
    doc = Document(text=_sentences(20), kind="text", source="a.txt", genre="report")
    replies = iter(["Summarize the report in one paragraph: its purpose, its main findings "
                    "and its recommendations or options.", SENTENCE])
    engine = FakeEngine(tokenizer, max_pos=100_000, reply=lambda p, g: next(replies))
    result = summarize_document(doc, engine, _settings(64))
    assert result.summary == SENTENCE and len(engine.calls) == 2
    assert result.guard["retries"] == 1 and "echo" in result.warnings[0]


def test_a_loop_is_cut_without_a_new_generation(tokenizer):
    doc = Document(text=_sentences(20), kind="text", source="a.txt", genre="generic")
    looping = ("The provider hosts the platform. The client pays the fee monthly. Either side "
               "may end the deal. The client pays the fee monthly.")
    engine = FakeEngine(tokenizer, max_pos=100_000, reply=looping)
    result = summarize_document(doc, engine, _settings(400, words=20))
    assert len(engine.calls) == 1 and result.guard["repairs"] == 1
    assert result.summary == ("The provider hosts the platform. The client pays the fee "
                              "monthly. Either side may end the deal.")


def test_a_summary_cut_at_the_cap_ends_on_its_last_sentence(tokenizer):
    doc = Document(text=_sentences(20), kind="text", source="a.txt")
    engine = FakeEngine(tokenizer, max_pos=100_000, reply=SENTENCE + " Either " + _words(300))
    result = summarize_document(doc, engine, _settings(200))
    assert result.summary == SENTENCE and result.runs[0]["finish_reason"] == "length"
    assert result.guard["trimmed"] == 1


def test_a_summary_the_model_ended_itself_is_kept_whole(tokenizer):
    doc = Document(text=_sentences(20), kind="text", source="a.txt")
    prose = "The provider delivers the platform and the client pays the fee every month"
    result = summarize_document(doc, FakeEngine(tokenizer, 100_000, reply=prose), _settings(200))
    assert result.summary == prose + "." and result.guard["trimmed"] == 0
    listed = ("The contract sets three duties:\n- the provider hosts the platform\n- the client "
              "pays the monthly fee\n- either side gives ninety days notice")
    result = summarize_document(doc, FakeEngine(tokenizer, 100_000, reply=listed), _settings(200))
    assert result.summary == listed  # a list keeps its last item as written


def test_no_sequence_length_warning_on_long_documents(tokenizer, caplog):
    import copy
    import logging

    tok = copy.deepcopy(tokenizer)
    tok.model_max_length = 32  # as a real tokenizer's limit, far below our documents
    doc = _pdf([_words(60, s) for s in range(4)])
    with caplog.at_level(logging.WARNING):
        summarize_document(doc, FakeEngine(tok, max_pos=100_000), _settings(32))
    assert "sequence length" not in caplog.text


# --- collections ------------------------------------------------------------------------------
def _collection(members: dict[str, str]) -> Document:
    text, sections = "", []
    for name, body in members.items():
        block = f"===== {name} =====\n{body}\n"
        sections.append(Section(name, len(text), len(text) + len(block)))
        text += block
    return Document(text=text, kind="collection", source="folder", sections=tuple(sections),
                    genre="collection", title="folder", meta={"documents": len(members)})


def test_a_collection_is_summarized_member_by_member_then_as_a_whole(tokenizer):
    def body(marker: str, n: int) -> str:
        return " ".join(f"The {marker} report covers item {i} of the plan." for i in range(n))

    doc = _collection({"a.md": body("alpha", 4), "notes/b.txt": body("bravo", 60),
                       "c.md": body("charlie", 3)})
    engine = FakeEngine(tokenizer, max_pos=1200)
    result = summarize_document(doc, engine, _settings(64))
    assert result.strategy == "collection"
    steps = [r["step"] for r in result.runs]
    assert steps[0] == "document 1/3 (a.md)" and steps[-1] == "final summary"
    assert any(s.startswith("document 2/3 (notes/b.txt): part ") for s in steps)  # split further
    prompts = engine.prompts()
    for prompt in prompts[:-1]:  # chunks follow member boundaries: one member per prompt
        assert sum(f"The {m} report" in prompt for m in ("alpha", "bravo", "charlie")) == 1
    final = prompts[-1]
    assert "Document 1 of 3 (a.md):" in final and "Document 3 of 3 (c.md):" in final
    assert "collection of documents" in final
    assert [c.label for c in result.chunks if c.level == 0][0] == "a.md"


def test_a_one_member_collection_is_one_document(tokenizer):
    doc = _collection({"only.md": _sentences(5)})
    engine = FakeEngine(tokenizer, max_pos=100_000)
    result = summarize_document(doc, engine, _settings(64))
    assert result.strategy == "stream" and len(engine.calls) == 1


def test_empty_document_is_an_input_error(tokenizer):
    with pytest.raises(InputError):
        summarize_document(Document(text="  \n", kind="text", source="e.txt"),
                           FakeEngine(tokenizer, 512))


def test_settings_validation():
    with pytest.raises(ConfigError, match="strategy"):
        SummarySettings(strategy="sideways")
    with pytest.raises(ConfigError, match="chunk_tokens"):
        SummarySettings(chunk_tokens=3)
    with pytest.raises(ConfigError, match="words"):
        SummarySettings(words=2)


def test_aggregate_stats_sums_tokens_and_keeps_peaks():
    runs = [{"stats": {"prompt_tokens": 100, "new_tokens": 10, "prefill_seconds": 1.0,
                       "decode_seconds": 2.0, "kv_blocks_peak": 4, "peak_memory_bytes": 7}},
            {"stats": {"prompt_tokens": 300, "new_tokens": 30, "prefill_seconds": 1.0,
                       "decode_seconds": 2.0, "kv_blocks_peak": 9, "peak_memory_bytes": 5}}]
    agg = aggregate_stats(runs)
    assert agg["prompt_tokens"] == 400 and agg["prefill_tok_s"] == 200.0
    assert agg["decode_tok_s"] == 10.0 and agg["kv_blocks_peak"] == 9
    assert agg["peak_memory_bytes"] == 7 and agg["generations"] == 2


# --- real engine over the tiny model ------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    from hisparse_cli.engine.engine import Engine

    path = make_tiny_model_dir(tmp_path_factory.mktemp("pipe"), max_position_embeddings=512)
    return Engine.from_pretrained(path, "cpu", torch.float32, sparse=TINY_SPARSE)


def test_tiny_engine_stream_and_map_reduce_end_to_end(tiny_engine):
    short = Document(text=_words(40), kind="text", source="s.txt", genre="legal")
    calls = []
    res = summarize_document(short, tiny_engine, _settings(6),
                             progress=lambda *a: calls.append(a))
    assert res.strategy == "stream" and all(r["stats"]["new_tokens"] <= 6 for r in res.runs)
    assert {c[1] for c in calls} <= {"prefill", "decode"} and calls[0][0] == "summary"
    assert calls[0][1:3] == ("prefill", 0)  # the start is reported (progress rates need it)
    assert res.runs[0]["stats"]["prompt_tokens"] == res.runs[0]["stats"]["prompt_tokens"]
    assert res.prompt_tokens == sum(r["stats"]["prompt_tokens"] for r in res.runs)
    json.dumps(res.to_dict())  # JSON-ready
    # a random model writes nonsense: the guard retried it (and then took a digest)
    assert len(res.runs) == 1 + res.guard["retries"]

    long = _pdf([_words(150, s) for s in range(3)])
    res = summarize_document(long, tiny_engine, _settings(6))
    assert res.strategy == "map-reduce" and len(res.runs) >= 3
    assert res.stats["prompt_tokens"] == sum(r["stats"]["prompt_tokens"] for r in res.runs)
    assert all(r["stats"]["prompt_tokens"] + 6 <= 512 for r in res.runs)
    assert res.settings["max_positions"] == 512


# --- engine setup: device and precedence ---------------------------------------------------------
def test_plan_device():
    cpu, gpu = load_profile("cpu"), load_profile("3090-24g")
    assert plan_device(cpu, cuda_available=True).device == "cpu"
    assert plan_device(cpu, cuda_available=True).dtype == "float32"
    fallback = plan_device(gpu, cuda_available=False)
    assert (fallback.device, fallback.dtype) == ("cpu", "float32") and "CUDA" in fallback.warning
    on_gpu = plan_device(gpu, cuda_available=True)
    assert (on_gpu.device, on_gpu.dtype, on_gpu.kv_dtype) == ("cuda", "float16", gpu.kv_dtype)


def test_sparse_precedence_flag_over_profile_over_default():
    profile = load_profile("4060ti-6g")
    cfg = sparse_settings(profile, window_size=100)
    assert cfg.window_size == 100  # flag
    assert cfg.global_tokens == profile.sparse.global_tokens  # profile
    assert cfg.importance == SparseConfig().importance  # default (profile leaves it)
    dense = sparse_settings(profile, dense=True, block_size=32)
    assert dense.window_size is None and dense.global_tokens == 0 and dense.block_size == 32
    with pytest.raises(ConfigError, match="--dense"):
        sparse_settings(profile, dense=True, window_size=64)


def test_probe_importance_needs_a_probe_for_the_model(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}))
    assert load_probe_for(folder, SparseConfig(importance="attention")) is None
    assert load_probe_for(folder, SparseConfig(importance="probe", global_tokens=0)) is None
    with pytest.raises(ConfigError, match="no shipped probe"):
        load_probe_for(folder, SparseConfig(importance="probe"))


def test_every_generation_gets_the_length_floor(tokenizer):
    doc = Document(text=_sentences(200), kind="text", source="a.txt", genre="report")
    engine = FakeEngine(tokenizer, max_pos=100_000)
    result = summarize_document(doc, engine, _settings(256))
    floor = result.length["min_new_tokens"]
    assert 0 < floor < result.length["max_new_tokens"] and engine.gens[0].min_new_tokens == floor
    parts = FakeEngine(tokenizer, max_pos=100_000)
    summarize_document(_pdf([_sentences(30, s) for s in range(3)]), parts,
                       _settings(256, strategy="map-reduce", chunk_tokens=400))
    assert all(g.min_new_tokens > 0 for g in parts.gens)  # notes and the final summary


# --- map-reduce's final step: selected or generated ---------------------------------------------
def test_reduce_mode_by_flag_instructions_and_model_size():
    from hisparse_cli.summarize.mapreduce import reduce_mode

    small, large = 134_515_008, 8_030_261_248
    assert reduce_mode(_settings(), small)[0] == "select"
    assert reduce_mode(_settings(), large)[0] == "generate"
    assert reduce_mode(_settings(instructions="List the fees."), small)[0] == "generate"
    assert reduce_mode(_settings(reduce="generate"), small) == ("generate", "--reduce generate")
    assert reduce_mode(_settings(reduce="select"), large) == ("select", "--reduce select")
    with pytest.raises(ConfigError, match="reduce must be one of"):
        _settings(reduce="extractive")


NOTE_SENTENCES = [
    "The provider delivers the hosted platform to the client every month.",
    "The client pays the monthly fee within thirty days of each invoice.",
    "Either party may end the agreement with sixty days of written notice.",
    "The provider keeps the client's records confidential for five years.",
]


def test_a_small_models_final_summary_is_selected_from_the_notes(tokenizer):
    """Reduce "select": no final generation; the summary is digest.extractive_digest of the
    notes (written by the model from each part), within the target words."""
    from hisparse_cli.summarize.digest import extractive_digest

    doc = _pdf([_words(40, s) for s in range(4)])
    notes = iter(NOTE_SENTENCES * 4)
    engine = FakeEngine(tokenizer, max_pos=4096, parameters=134_515_008,
                        reply=lambda prompt, gen: next(notes) + " " + next(notes))
    result = summarize_document(doc, engine, _settings(64, strategy="map-reduce",
                                                       chunk_tokens=120, words=20))
    parts = [c for c in result.chunks if c.level == 0]
    assert len(parts) >= 2 and len(engine.calls) == len(parts)  # the notes, nothing after
    want = extractive_digest("\n".join(p.summary for p in parts), result.length["target_words"])
    assert result.summary == want and result.summary
    final = result.chunks[-1]
    assert (final.label, final.level, final.status, final.new_tokens) == \
        ("final summary", 1, "selected", 0)
    assert result.settings["final_step"]["mode"] == "select"
    assert result.settings["reduce"] == "auto"


def test_selection_without_a_usable_note_sentence_generates(tokenizer, monkeypatch):
    """Notes with no sentence a digest can take (code, tables): the model writes the final
    summary after all."""
    import hisparse_cli.summarize.summary_run as summary_run

    monkeypatch.setattr(summary_run, "extractive_digest", lambda text, words: "")
    doc = _pdf([_words(40, s) for s in range(4)])
    engine = FakeEngine(tokenizer, max_pos=4096, parameters=134_515_008)
    result = summarize_document(doc, engine, _settings(64, strategy="map-reduce",
                                                       chunk_tokens=120, reduce="select"))
    assert result.runs[-1]["step"] == "final summary"  # the model wrote it
    assert result.chunks[-1].status == "ok" and result.summary == SENTENCE


def test_model_parameters_match_the_published_counts():
    from hisparse_cli.model.config import ModelConfig
    from hisparse_cli.planner.shapes import SHAPES

    # Meta-Llama-3-8B 8,030,261,248; SmolLM2-135M 134,515,008; Mistral-7B-v0.3 7,248,023,552
    assert ModelConfig.from_dict(SHAPES["llama-3-8b"]).parameters == 8_030_261_248
    assert ModelConfig.from_dict(SHAPES["smollm2-135m"]).parameters == 134_515_008
    assert ModelConfig.from_dict(SHAPES["mistral-7b"]).parameters == 7_248_023_552
