"""CLI of the retrieval tier: --retrieval-tokens reaches the run (its stats in --json and the
stats table), --trace writes one JSON line per step, hisparse plan shows the offload store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers_cli import run, show
from helpers_tokenizer import make_tiny_model_dir

FLAGS = ["--profile", "cpu", "-n", "5", "--window", "32", "--prefill-chunk", "32",
         "--global-tokens", "4", "--recalibrate-every", "32", "--recalibrate-topk", "4",
         "--block-size", "8"]
TEXT = ("The provider shall host the platform. The client pays a monthly fee of EUR 7,400 "
        "within thirty days. Either party may end the agreement with ninety days notice.\n")


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HISPARSE_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("cli41"), max_position_embeddings=1024)


def test_retrieval_tokens_and_trace(tiny, tmp_path):
    doc = tmp_path / "deal.txt"
    doc.write_text(TEXT * 3, encoding="utf-8")
    trace = tmp_path / "steps.jsonl"
    res = run("summarize", doc, "--model", tiny, "--json", "--retrieval-tokens", "16",
              "--trace", trace, *FLAGS)
    assert res.exit_code == 0, show(res)
    rec = json.loads(res.stdout)
    assert rec["settings"]["sparse"]["retrieval_tokens"] == 16
    stats = rec["stats"]
    assert stats["pages_offloaded"] > 0 and stats["offload_bytes"] > 0
    assert 0.0 <= stats["cache_hit_rate"] <= 1.0 and stats["bytes_to_cache"] > 0
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    prefill = [x for x in lines if x["phase"] == "prefill"]
    decode = [x for x in lines if x["phase"] == "decode"]
    # the guard may generate again (a random model's text fails it): every generation is
    # traced from its first prefill chunk, and the stats sum over the generations
    runs = [i for i, x in enumerate(lines) if x["phase"] == "prefill" and x["start"] == 0]
    assert len(runs) == stats["generations"] >= 1
    assert prefill and len(decode) >= stats["new_tokens"] - stats["generations"]
    assert sum(x["tokens"] for x in prefill) == stats["prompt_tokens"]
    per_run = [lines[a:b] for a, b in zip(runs, runs[1:] + [len(lines)])]
    assert sum(max(x["offloaded_pages"] for x in r) for r in per_run) == stats["pages_offloaded"]
    assert all(x["hits"] <= x["retrieved"] for x in lines)
    assert sum(x["retrieved"] for x in lines) > 0
    # without the flag: no retrieval fields, and the same trace format otherwise
    res = run("summarize", doc, "--model", tiny, "--json", "--trace", trace, *FLAGS)
    assert res.exit_code == 0, show(res)
    first = json.loads(trace.read_text().splitlines()[0])
    assert "retrieved" not in first and "active_blocks" in first


def test_dense_refuses_retrieval_tokens(tiny, tmp_path):
    doc = tmp_path / "deal.txt"
    doc.write_text(TEXT, encoding="utf-8")
    res = run("summarize", doc, "--model", tiny, "--dense", "--retrieval-tokens", "16",
              "--profile", "cpu")
    assert res.exit_code == 2, show(res)
    assert "--retrieval-tokens" in res.stderr


def test_plan_shows_the_offload_store(tiny):
    res = run("plan", "--model", tiny, "--profile", "4060ti-6g", "--context", "900", "-n", "8",
              "--retrieval-tokens", "64", "--json")
    assert res.exit_code == 0, show(res)
    plan = json.loads(res.stdout)
    assert plan["offload_store_bytes"] > 0 and plan["host_bytes"] >= plan["offload_store_bytes"]
    ex = plan["execution"]
    assert ex["graph_decode"]["value"] == "on"  # the page cache is filled inside the graph
    assert ex["decode_kernel"]["value"] == "layers", ex["decode_kernel"]  # (not INT4)
    from hisparse_cli.engine import SparseConfig
    from hisparse_cli.kernels.cuda.cuda_step import settings_unsupported

    # the persistent kernel reads the page cache as part of the key segment (the choice runs
    # before it, engine/retrieval.py): the retrieval tier takes nothing from what it serves
    assert settings_unsupported(SparseConfig(retrieval_tokens=64), torch.float16) is None
    assert settings_unsupported(SparseConfig(), torch.float16) is None
    assert "fp16" in settings_unsupported(SparseConfig(retrieval_tokens=64), torch.float32)
    names = [i["name"] for i in plan["items"]]
    assert "kv.page_summaries" in names and "offload_store (host RAM)" in names
