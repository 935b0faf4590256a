"""No Triton recompiles for values that change run by run (issue 42: a new process paid for
thousands of JIT specializations): launches that differ only in integers — a step's tokens
(1 in decode, a ragged last prefill chunk), positions, lengths, a chunk's first tile, a run's
history capacity — share one compiled variant per kernel; only constexprs, dtypes and pointer
alignment may add variants.

Oracle: Triton's own specialization rule (its binder's `native_specialize_impl`, with each
kernel's do_not_specialize lists), applied to every launch the interpreter runs
(helpers_specializations.py); the number of distinct keys per kernel must equal the number
left when the integer arguments' classes are erased. CPU only (on a GPU the kernels compile
instead of being interpreted; benchmarks/gpu_first_run.py counts the real compiles there).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first triton import in this process
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(torch.cuda.is_available() or
                                os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU test: launches are recorded under the interpreter")


@pytest.fixture
def rec(monkeypatch):
    from helpers_specializations import SpecializationRecorder

    return SpecializationRecorder.install(monkeypatch)


def _no_int_classes(rec, kernel: str, *args: str) -> None:
    assert rec.extra_variants() == {}
    classes = rec.value_classes()[kernel]
    for arg in args:  # each varying value was seen, in the one unspecialized class
        assert classes[arg] == {"('i32', None)"}, (arg, classes[arg])


def test_rms_norm_rows(rec):
    """Decode (1 row), a full chunk (a multiple of 16) and ragged chunks, with and without
    the residual add."""
    from hisparse_cli.kernels.norm_rope.norm_rope_triton import add_rms_norm, rms_norm

    w = torch.rand(64) + 0.5
    for rows in (1, 5, 16, 32, 37):
        x = torch.randn(rows, 64)
        rms_norm(x, w, 1e-6)
        add_rms_norm(x, torch.randn(rows, 64), w, 1e-6)
    _no_int_classes(rec, "norm_rope_triton._rms_norm", "R")
    assert len(rec.keys["norm_rope_triton._rms_norm"]) == 2  # HAS_RES False / True


def test_page_scoring_rows_and_pages(rec):
    """The retrieval tier's prefill scoring: a chunk's rows (ragged last chunk) and the pages
    offloaded so far (one more every block; the scales' head stride is a page count) add no
    variant."""
    from hisparse_cli.kernels.attention.page_score_ref import page_summary
    from hisparse_cli.kernels.attention.page_score_triton import page_scores

    for t, n in ((4, 1), (4, 16), (4, 17), (3, 33)):  # 16 rows (BLOCK_M 16), then 12
        lo, hi = page_summary(torch.randn(2, n, 4, 16), "minmax")
        page_scores(torch.randn(t, 4, 16), lo, hi, 0.25)
    _no_int_classes(rec, "page_score_triton._page_mass", "n_rows", "n_pages", "s_lsh", "s_hsh",
                    "s_oh")
    assert len(rec.keys["page_score_triton._page_mass"]) == 1


def test_fused_int4_gemm_tokens(rec):
    """The prefill GEMM's token counts of one tile size (5..16 tokens: BLOCK_M 16) and of the
    next (17..32): one variant each, whatever the count."""
    from test_awq_ref import random_awq

    from hisparse_cli.kernels.int4.awq_gemm_k import awq_gemm_k
    from hisparse_cli.kernels.int4.awq_layout import repack_kmajor

    qw, qz, s, b = random_awq(64, 64, 32)
    qt = repack_kmajor(qw)
    for m in (5, 16, 17, 32):
        awq_gemm_k(torch.randn(m, 64), qt, qz, s, b, 32)
    _no_int_classes(rec, "awq_gemm_k._awq_gemm_k_kernel", "M")
    assert len(rec.keys["awq_gemm_k._awq_gemm_k_kernel"]) == 2  # BLOCK_M 16 and 32


def test_item_dequantize_chunks(rec):
    """A linear's dequantize chunk by chunk (its first row tile varies)."""
    from test_awq_items import random_awq as random_items_awq

    from hisparse_cli.kernels.int4.awq_items import items_from_awq
    from hisparse_cli.kernels.int4.awq_items_triton import dequant_items_launch

    items = items_from_awq(*random_items_awq(128, 128 * 17))
    for t0 in (0, 1, 5, 16):
        out = torch.empty(128, 128, dtype=torch.float16)
        dequant_items_launch(items, 1, t0, t0 + 1, out)
    _no_int_classes(rec, "awq_items_triton._dequant_items_kernel", "tile0")


def test_graph_sampler_capacity_and_min_new(rec):
    """The in-graph sampler of runs of other lengths (history capacity) and of the guard's
    retries (min_new_tokens): the same three kernel variants per setting of its options."""
    from hisparse_cli.engine import GenerationConfig
    from hisparse_cli.engine.sampling.graph import GraphSampler

    row = torch.randn(40)
    for capacity, min_new in ((1, 0), (16, 3), (23, 5), (48, 7)):
        gen = GenerationConfig(max_new_tokens=capacity, repetition_penalty=1.1,
                               no_repeat_ngram_size=3, min_new_tokens=min_new,
                               eos_token_ids=(3,))
        gs = GraphSampler(40, capacity, torch.device("cpu"))
        gs.reset(gen, {3})
        out = torch.full((1,), -1, dtype=torch.int64)
        for _ in range(3):
            gs(row, out)
    assert rec.extra_variants() == {}
    assert rec.value_classes()["graph_sampler._pick2"]["cap"] == {"('i32', None)"}
    assert rec.value_classes()["graph_sampler._pick1"]["min_new"] == {"('i32', None)"}


def test_generations_of_other_lengths_add_no_variant(tmp_path, rec):
    """The engine's attention path (store, sparse attention with globals, importance mass,
    split-K reduce) over two prompts whose chunks, ragged tails, block counts and decode
    positions differ: every integer that changed stays in one class."""
    from conftest import save_tiny

    from hisparse_cli.engine import Engine, GenerationConfig, SparseConfig
    from hisparse_cli.kernels.dispatch import KernelBackend

    path, _ = save_tiny(tmp_path, "llama", num_key_value_heads=2)
    sparse = SparseConfig(sink_tokens=4, window_size=32, global_tokens=8, block_size=16,
                          prefill_chunk=32, recalibrate_every=32, recalibrate_topk=8)
    eng = Engine.from_pretrained(path, device="cpu", sparse=sparse)
    eng.backend = KernelBackend(attention="triton", int4_linear="torch")
    g = torch.Generator().manual_seed(0)
    for n in (45, 70):  # tails of 13 and 6 tokens; 70 evicts past the window
        eng.generate(torch.randint(0, 256, (n,), generator=g).tolist(),
                     gen=GenerationConfig(max_new_tokens=6))
    assert rec.extra_variants() == {}
    classes = rec.value_classes()["attention_fwd_triton._attn_fwd"]
    for arg in ("T", "nb", "q_start"):
        assert classes[arg] == {"('i32', None)"}, (arg, classes[arg])
