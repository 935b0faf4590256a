"""`hisparse warmup` (cli/warmup.py, summarize/warmup.py) on the CPU.

What it runs is checked against the kernel choices it has to reach (the INT4 GEMV's 1-4
tokens, each attention row tile at every doubling of the key count, the guard's retry
decodings, with and without the length floor); the run itself on a tiny model through the
same Job as summarize (each generation under the attention summarize would choose for that
length; the engine's compile counts summed); the CLI without a GPU (nothing to compile,
exit 0, no model resolved) and, with the CPU check bypassed, its report's shape. Whether a
warmed GPU machine then compiles nothing is measured by benchmarks/gpu_first_run.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers_cli import run, show
from hisparse_cli.config.settings import GenerationConfig
from hisparse_cli.summarize import warmup as wu


def test_lengths_reach_every_tile_choice():
    lengths = wu.warmup_lengths(8192)
    assert lengths == sorted(lengths) and len(set(lengths)) == len(lengths)
    assert lengths[:4] == [1, 2, 3, 4] and lengths[-1] == 8192  # the GEMV's token counts
    assert {12, 24, 48} <= set(lengths)  # the fused GEMM's token tiles
    n = wu.FIRST_DOUBLING
    while n < 8192:  # every doubling of the key count, with a tail in each row tile
        assert {n, n + 3, n + 12, n + 40} <= set(lengths), n
        n *= 2
    assert wu.warmup_lengths(5) == [1, 2, 3, 4, 5] and wu.warmup_lengths(1) == [1]
    assert max(wu.warmup_lengths(100)) == 100


def test_steps_cover_the_decodings_summarize_uses():
    gen = GenerationConfig(max_new_tokens=512, repetition_penalty=1.1, no_repeat_ngram_size=8)
    steps = wu.warmup_steps(gen, 2000)
    assert all(s.gen.max_new_tokens == wu.WARMUP_NEW_TOKENS for s in steps)
    floors = {s.gen.min_new_tokens for s in steps}
    assert floors == {0, wu.WARMUP_NEW_TOKENS}  # the in-graph EOS suppression on and off
    decodings = {(s.gen.repetition_penalty, s.gen.no_repeat_ngram_size, s.gen.temperature)
                 for s in steps}
    assert decodings == {(1.1, 8, 0.0), (1.3, 4, 0.0), (1.2, 4, 0.7)}  # + the guard's retries
    assert {s.prompt_tokens for s in steps} == set(wu.warmup_lengths(2000))


def test_default_context_leaves_room_in_a_small_model():
    assert wu.default_context(131072) == wu.DEFAULT_CONTEXT
    assert wu.default_context(2048) == 2048 - wu.WARMUP_NEW_TOKENS


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from helpers_tokenizer import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("warm"))


def _job(tiny, **sparse):
    from hisparse_cli.cli.options import RunOptions
    from hisparse_cli.cli.summarize import build_job

    return build_job(RunOptions.from_settings(profile="cpu", model=str(tiny), quiet=True,
                                              **sparse))


def test_each_generation_runs_under_the_attention_summarize_picks(tiny, monkeypatch):
    """Every step generates, under the AttentionChoice the job gives for its length (here a
    stand-in: dense below 100 tokens, sparse above; summarize's own is planner-made), with
    summarize's cap of new tokens asked; the job's policy is back afterwards; on the CPU
    nothing compiles."""
    from hisparse_cli.planner.attention_choice import AttentionChoice, dense_of

    job = _job(tiny, window_size=32, global_tokens=8, prefill_chunk=32, recalibrate_every=32,
               recalibrate_topk=8)
    engine = job.engine()
    asked, seen = [], []

    def attention_for(context, new_tokens):
        asked.append(new_tokens)
        if context < 100:
            return AttentionChoice("auto", "dense", "stand-in", dense_of(job.sparse))
        return AttentionChoice("auto", "sparse", "stand-in", job.sparse)

    real = engine.generate

    def generate(ids, gen):
        seen.append((len(ids), engine.sparse.dense))
        return real(ids, gen=gen)

    monkeypatch.setattr(job, "attention_for", attention_for)
    monkeypatch.setattr(engine, "generate", generate)
    steps = wu.warmup_steps(job.settings.generation, 150)
    report = wu.run_warmup(job, steps)
    assert seen == [(s.prompt_tokens, s.prompt_tokens < 100) for s in steps]
    assert set(asked) == {job.settings.generation.max_new_tokens}
    assert [r.attention == "dense" for r in report.steps] == [n < 100 for n, _ in seen]
    assert report.seconds > 0
    assert report.total("kernel_compiles") == 0 and report.total("kernel_loads") == 0
    assert engine.sparse == job.sparse


def test_cli_without_a_gpu_has_nothing_to_compile(monkeypatch):
    """Exit 0 and a line saying why, before any model is resolved (none is installed here)."""
    import hisparse_cli.hub as hub

    def no_resolve(*a, **k):
        raise AssertionError("warmup resolved a model on a CPU-only machine")

    monkeypatch.setattr(hub, "resolve_model", no_resolve)
    for args in ((), ("--profile", "4060ti-6g"), ("--profile", "cpu", "--json")):
        result = run("warmup", *args)
        assert result.exit_code == 0, show(result)
        assert "nothing to compile" in result.stdout
    assert json.loads(result.stdout)["kernel_compiles"] == 0


def test_cli_bad_profile_is_a_usage_error():
    result = run("warmup", "--profile", "no-such-card")
    assert result.exit_code == 2, show(result)
    assert "Error:" in result.stderr and result.stdout == ""


def test_cli_report_on_a_device_that_compiles(tiny, monkeypatch):
    """The GPU path's plumbing, run on the CPU (the device check bypassed): the report says
    how many generations ran, up to which length, and where the caches are."""
    from hisparse_cli.cli import warmup as cli_warmup

    monkeypatch.setattr(cli_warmup, "_cpu_note", lambda profile: None)
    result = run("warmup", "--model", tiny, "--profile", "cpu", "--context", "60",
                 "--window", "32", "--prefill-chunk", "32", "--global-tokens", "8",
                 "--recalibrate-every", "32", "--recalibrate-topk", "8", "--json", "-q")
    assert result.exit_code == 0, show(result)
    out = json.loads(result.stdout)
    assert out["context"] == 60 and out["kernel_compiles"] == 0 and out["kernels"] == {}
    assert len(out["steps"]) == len(wu.warmup_steps(GenerationConfig(), 60))
    assert out["triton_cache"] and out["nvrtc_cache"].endswith("kernels")
    text = run("warmup", "--model", tiny, "--profile", "cpu", "--context", "20", "-q")
    assert text.exit_code == 0, show(text)
    assert text.stdout.strip().splitlines()[-1].startswith("compiled 0 kernels")
