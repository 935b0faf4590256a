"""Reuse of the KV storage and decode graph across `Engine.generate` calls
(engine/decode_state.py). Oracle: a fresh engine per call (nothing kept) -- the tokens must be
identical, and a reused cache must hold exactly what a new one holds."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SPARSE = dict(sink_tokens=4, window_size=64, global_tokens=8, block_size=16, prefill_chunk=32,
              recalibrate_every=32, recalibrate_topk=8)


def test_reset_restores_a_fresh_cache():
    from hisparse_cli.engine.kv_cache import PagedKVCache

    kw = dict(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float32,
              device=torch.device("cpu"), capacity_blocks=3, global_tokens=2, candidate_slots=3,
              track_scores=True, window=8)
    fresh, used = PagedKVCache(**kw), PagedKVCache(**kw)
    names = ("k", "v", "score", "gk", "gv", "gpos", "gmass", "gseen", "ck", "cv", "cpos",
             "cmass", "cseen")
    ptrs = [getattr(used, n).data_ptr() for n in names]
    for n in names:
        getattr(used, n).random_(1, 9)
    used.reset()
    assert used.spec == fresh.spec
    for n, p in zip(names, ptrs):
        assert torch.equal(getattr(used, n), getattr(fresh, n)), n
        assert getattr(used, n).data_ptr() == p, n  # in place: captured pointers stay valid


def _cpu_graph_engine(tmp_path, monkeypatch):
    """A CPU engine on the graph-decode path with capture=False (the static-buffer step run
    eagerly through the Triton interpreter), so the reuse logic runs without CUDA."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CPU test: the Triton interpreter is only enabled without CUDA")
    from conftest import save_tiny

    from hisparse_cli.engine import Engine, SparseConfig, cuda_graph
    from hisparse_cli.kernels.dispatch import KernelBackend

    path, _ = save_tiny(tmp_path, "llama", num_key_value_heads=2)
    init = cuda_graph.GraphDecoder.__init__
    monkeypatch.setattr(cuda_graph.GraphDecoder, "__init__",
                        lambda self, *a, **k: init(self, *a, **{**k, "capture": False}))

    def make():
        eng = Engine.from_pretrained(path, device="cpu", sparse=SparseConfig(**SPARSE))
        eng.backend = KernelBackend(attention="triton", int4_linear="torch")
        monkeypatch.setattr(eng, "_use_graph", lambda gen: True)
        return eng
    return make


def test_reuse_gives_the_tokens_of_fresh_engines_on_cpu(tmp_path, monkeypatch):
    """Two generates of the same shape share the cache and decoder and give the tokens of a
    fresh engine each; a different length re-keys (new storage, old state dropped); logits()
    and release_cached_state() free what is kept."""
    from hisparse_cli.engine import GenerationConfig

    make = _cpu_graph_engine(tmp_path, monkeypatch)
    # 12 new tokens: 110 + 12 crosses a block boundary (block 16); the interpreter runs each
    # decode step's attention in ~0.35 s, and the test makes eight generates
    g = GenerationConfig(max_new_tokens=12, eos_token_ids=(), repetition_penalty=1.1,
                         no_repeat_ngram_size=3)
    a = torch.randint(3, 256, (110,), generator=torch.Generator().manual_seed(1))
    b = torch.randint(3, 256, (110,), generator=torch.Generator().manual_seed(2))
    short = torch.randint(3, 256, (20,), generator=torch.Generator().manual_seed(3))
    eng = make()
    first = eng.generate(a, gen=g)
    state = eng._decode_state
    cache, dec = state.cache, state.decoder
    assert dec is not None and dec.captures == 0  # capture=False: eager static steps
    second = eng.generate(b, gen=g)
    assert eng._decode_state is state and state.cache is cache and state.decoder is dec
    assert dec.run.cache is cache and second.stats.recalibrations > 0
    assert first.token_ids == make().generate(a, gen=g).token_ids
    assert second.token_ids == make().generate(b, gen=g).token_ids
    # after a longer run (same prompt b: dirty globals, candidates, scores), then b again
    assert eng.generate(b, gen=g).token_ids == second.token_ids
    # a short text: fewer blocks of storage -> another key, the kept state is replaced
    third = eng.generate(short, gen=g)
    assert eng._decode_state is not state and state.cache is None and dec.graph is None
    assert eng._decode_state.cache.capacity < cache.capacity
    assert third.token_ids == make().generate(short, gen=g).token_ids
    eng.logits(short)  # a run outside the graph path frees the kept state first
    assert eng._decode_state is None
    eng.generate(short, gen=g)
    assert eng._decode_state is not None
    eng.release_cached_state()
    assert eng._decode_state is None
    eng.release_cached_state()  # idempotent


def test_cpu_path_keeps_nothing(tmp_path):
    from conftest import save_tiny

    from hisparse_cli.engine import Engine, SparseConfig

    path, _ = save_tiny(tmp_path, "llama", num_key_value_heads=2)
    eng = Engine.from_pretrained(path, device="cpu", sparse=SparseConfig(**SPARSE))
    res = eng.generate(list(range(3, 60)), max_new_tokens=5)
    assert eng._decode_state is None and "cuda_graph" not in res.extra


def test_failed_generate_drops_the_kept_state(tmp_path, monkeypatch):
    from hisparse_cli.engine import GenerationConfig

    make = _cpu_graph_engine(tmp_path, monkeypatch)
    eng = make()
    g = GenerationConfig(max_new_tokens=4, eos_token_ids=())
    eng.generate(list(range(3, 40)), gen=g)
    assert eng._decode_state is not None

    def boom(*a):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        eng.generate(list(range(3, 40)), gen=g, progress=boom)
    assert eng._decode_state is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_second_generate_replays_without_capture(tmp_path, monkeypatch, dtype):
    """On the GPU: consecutive generates of one engine give the tokens of fresh engines, and
    only the first captures a graph (the second replays it from its first decode step)."""
    from conftest import save_tiny

    from hisparse_cli.engine import Engine, GenerationConfig, SparseConfig, cuda_graph

    path, _ = save_tiny(tmp_path, "llama", num_key_value_heads=2)
    captures = []
    capture = cuda_graph.GraphDecoder._capture
    monkeypatch.setattr(cuda_graph.GraphDecoder, "_capture",
                        lambda self: captures.append(1) or capture(self))

    def make():
        return Engine.from_pretrained(path, device="cuda", dtype=dtype,
                                      sparse=SparseConfig(**SPARSE), backend="triton")
    g = GenerationConfig(max_new_tokens=80, eos_token_ids=(), repetition_penalty=1.1,
                         no_repeat_ngram_size=3)
    prompts = [torch.randint(3, 256, (200,), generator=torch.Generator().manual_seed(s))
               for s in (1, 2, 3)]
    fresh = [make().generate(p, gen=g).token_ids for p in prompts]
    assert len(captures) == 3
    eng = make()
    res = [eng.generate(p, gen=g) for p in prompts]
    assert len(captures) == 4  # one capture for the three runs
    assert [r.extra["cuda_graph"] for r in res] == ["new", "reused", "reused"]
    assert [r.token_ids for r in res] == fresh
    short = torch.randint(3, 256, (20,), generator=torch.Generator().manual_seed(4))
    other = eng.generate(short, gen=g)  # fewer storage blocks: re-keyed, captured anew
    assert len(captures) == 5 and other.extra["cuda_graph"] == "new"
    assert other.token_ids == make().generate(short, gen=g).token_ids
    eng.release_cached_state()
    assert eng._decode_state is None
