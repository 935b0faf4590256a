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
from hisparse_cli.summarize.prompts import (FOCUS, chunk_prompt, document_prompt, prompt_text,
                                  render_prompt)
from hisparse_cli.summarize.runtime import load_probe_for, plan_device, sparse_settings

TINY_SPARSE = SparseConfig(sink_tokens=4, window_size=64, global_tokens=8, block_size=16,
                           recalibrate_every=64, recalibrate_topk=8, prefill_chunk=64)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(chat_template=True)


@dataclass
class FakeEngine:
    """Engine stand-in: real tokenizer, given positions, fixed outputs; records prompts."""

    tokenizer: object
    max_pos: int
    reply: str = "short summary"
    calls: list = field(default_factory=list)

    @property
    def cfg(self):
        return SimpleNamespace(max_position_embeddings=self.max_pos)

    def generate(self, ids, max_new_tokens=None, *, gen=None, progress=None):
        assert len(ids) + max_new_tokens <= self.max_pos, "prompt + new tokens exceed positions"
        self.calls.append((list(ids), max_new_tokens))
        out = self.tokenizer(self.reply, add_special_tokens=False)["input_ids"][:max_new_tokens]
        if progress:
            progress("prefill", len(ids), len(ids))
            progress("decode", len(out), max_new_tokens)
        stats = SimpleNamespace(to_dict=lambda: {"prompt_tokens": len(ids), "new_tokens": len(out),
                                                 "prefill_seconds": 0.5, "decode_seconds": 0.25,
                                                 "kv_blocks_peak": 3, "recalibrations": 1})
        return SimpleNamespace(token_ids=out, stats=stats, finish_reason="length")

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
def test_chat_template_is_used_and_instruction_follows_the_text(tokenizer):
    prompt = document_prompt("BODY TEXT", genre="legal", title="Deal")
    text = prompt_text(tokenizer, prompt)
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": prompt.system}, {"role": "user", "content": prompt.user}],
        add_generation_prompt=True, tokenize=False)
    assert text == expected and text.endswith("<|assistant|>")
    assert text.index("BODY TEXT") < text.index(FOCUS["legal"])  # task after the document


def test_plain_prompt_without_chat_template():
    tok = build_tokenizer(chat_template=False)
    text = prompt_text(tok, document_prompt("BODY", genre="medical"))
    assert "<|assistant|>" not in text and text.rstrip().endswith("Summary:")
    assert FOCUS["medical"] in text
    assert render_prompt(tok, document_prompt("BODY", genre="medical")) == \
        tok(text)["input_ids"]


def test_instructions_replace_the_genre_focus(tokenizer):
    prompt = chunk_prompt("T", label="pages 3–5", index=2, total=4, genre="code",
                          instructions="List every function.")
    assert "List every function." in prompt.user and FOCUS["code"] not in prompt.user
    assert "pages 3–5" in prompt.user and "Part 2 of 4" in prompt.user


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


def test_merge_labels():
    assert merge_labels(["pages 1–2", "page 3"]) == "pages 1–3"
    assert merge_labels(["page 3, lines 1–9", "page 3, lines 9–20"]) == "page 3"
    assert merge_labels(["lines 1–5", "line 6"]) == "lines 1–6"
    assert merge_labels(["a.py", "b.py"]) == "a.py; b.py"


# --- strategy selection -------------------------------------------------------------------------
def _stream_need(tokenizer, doc: Document, max_new: int) -> int:
    ids = render_prompt(tokenizer, document_prompt(doc.text, genre=doc.genre, title=doc.title))
    return len(ids) + max_new


def test_auto_streams_exactly_up_to_the_position_limit(tokenizer):
    doc = Document(text=_words(400), kind="text", source="a.txt", genre="legal", title="a")
    need = _stream_need(tokenizer, doc, 8)
    at_limit = FakeEngine(tokenizer, max_pos=need)
    result = summarize_document(doc, at_limit, _settings(8))
    assert result.strategy == "stream" and len(at_limit.calls) == 1
    assert len(at_limit.calls[0][0]) + 8 == need
    one_short = FakeEngine(tokenizer, max_pos=need - 1)
    result = summarize_document(doc, one_short, _settings(8))
    assert result.strategy == "map-reduce" and len(one_short.calls) > 1


def test_forced_stream_that_does_not_fit_is_a_usage_error(tokenizer):
    doc = Document(text=_words(200), kind="text", source="a.txt")
    with pytest.raises(ConfigError, match="needs 6\\d\\d positions .* trained on 256") as info:
        summarize_document(doc, FakeEngine(tokenizer, 256), _settings(8, strategy="stream"))
    assert "map-reduce" in info.value.hint and info.value.exit_code == 2


def test_map_reduce_prompts_cite_pages_and_final_sees_every_part(tokenizer):
    doc = _pdf([_words(40, s) for s in range(4)])
    engine = FakeEngine(tokenizer, max_pos=4096)
    result = summarize_document(doc, engine, _settings(8, strategy="map-reduce",
                                                       chunk_tokens=120))
    parts = [c for c in result.chunks if c.level == 0]
    assert len(parts) >= 2 and result.strategy == "map-reduce"
    prompts = engine.prompts()
    for part, prompt in zip(parts, prompts):
        assert f"({part.label})" in prompt
    assert all(f"[{p.label}]" in prompts[-1] for p in parts)  # the final combine prompt
    assert result.runs[-1]["step"] == "final summary"
    assert result.summary == "short summary"
    final = result.chunks[-1]  # every step is listed, the final combine too
    assert (final.label, final.level) == ("final summary", 1) and len(result.chunks) == \
        len(parts) + 1 and final.summary == result.summary


def test_reduction_recurses_when_summaries_do_not_fit_together(tokenizer):
    doc = _pdf([_words(60, s) for s in range(12)])
    engine = FakeEngine(tokenizer, max_pos=600, reply=_words(40))
    result = summarize_document(doc, engine, _settings(24, strategy="map-reduce"))
    assert {c.level for c in result.chunks} >= {0, 1}  # parts, then an intermediate round
    combines = [r["step"] for r in result.runs if r["step"].startswith("combine")]
    assert len(combines) >= 2 and re.match(r"combine 1/\d+ \(pages 1–\d+\)", combines[0])
    assert result.runs[-1]["step"] == "final summary"
    # every generation kept prompt + new tokens within the positions (FakeEngine asserts)


def test_max_new_tokens_too_large_for_map_reduce(tokenizer):
    doc = _pdf([_words(80, s) for s in range(3)])
    with pytest.raises(ConfigError, match="too large"):
        summarize_document(doc, FakeEngine(tokenizer, 300), _settings(200))


def test_empty_document_is_an_input_error(tokenizer):
    with pytest.raises(InputError):
        summarize_document(Document(text="  \n", kind="text", source="e.txt"),
                           FakeEngine(tokenizer, 512))


def test_settings_validation():
    with pytest.raises(ConfigError, match="strategy"):
        SummarySettings(strategy="sideways")
    with pytest.raises(ConfigError, match="chunk_tokens"):
        SummarySettings(chunk_tokens=3)


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
    assert res.strategy == "stream" and res.new_tokens <= 6
    assert {c[1] for c in calls} <= {"prefill", "decode"} and calls[0][0] == "summary"
    assert calls[0][1:3] == ("prefill", 0)  # the start is reported (progress rates need it)
    assert res.runs[0]["stats"]["prompt_tokens"] == res.prompt_tokens
    json.dumps(res.to_dict())  # JSON-ready

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
    assert cfg.global_tokens == profile.global_tokens  # profile
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
