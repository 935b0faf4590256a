"""CUDA-graph decode (engine/cuda_graph.py) against the eager decode loop, on the GPU.

Oracle: the same engine with HISPARSE_CUDA_GRAPH=0 (eager steps, host sampling). fp32 caches
and weights, so the two paths see the same numbers and greedy tokens must agree exactly, across
block allocation, eviction and recalibrations (the padded block list and the device-side
q_start are the parts a graph changes)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SPARSE = dict(sink_tokens=4, window_size=64, global_tokens=8, block_size=16, prefill_chunk=32,
              recalibrate_every=32, recalibrate_topk=8)


def _engine(tmp_path, dtype, embeddings_on_host=False):
    from conftest import save_tiny

    from hisparse_cli.engine import Engine, SparseConfig

    path, _ = save_tiny(tmp_path, "llama", num_key_value_heads=2)
    eng = Engine.from_pretrained(path, device="cuda", dtype=dtype, sparse=SparseConfig(**SPARSE),
                                 backend="triton", embeddings_on_host=embeddings_on_host)
    assert eng.backend.attention == "triton"
    return eng


def _cpu_engine(tmp_path):
    """The tiny model on the CPU with Triton attention (under the interpreter; CPU tests)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CPU test: the Triton interpreter is only enabled without CUDA")
    from conftest import save_tiny

    from hisparse_cli.engine import Engine, SparseConfig
    from hisparse_cli.kernels.dispatch import KernelBackend

    path, _ = save_tiny(tmp_path, "llama", num_key_value_heads=2)
    eng = Engine.from_pretrained(path, device="cpu", sparse=SparseConfig(**SPARSE))
    eng.backend = KernelBackend(attention="triton", int4_linear="torch")
    return eng


def _both(eng, ids, monkeypatch, **gen):
    from hisparse_cli.engine import GenerationConfig

    g = GenerationConfig(**gen)
    assert eng._use_graph(g)
    graph = eng.generate(ids, gen=g)
    monkeypatch.setenv("HISPARSE_CUDA_GRAPH", "0")
    eng.replan()  # the plan is resolved once per engine: read the environment again
    assert not eng._use_graph(g)
    eager = eng.generate(ids, gen=g)
    monkeypatch.delenv("HISPARSE_CUDA_GRAPH")
    eng.replan()
    return graph, eager


@pytest.mark.parametrize("prompt,new,host_table,gather", [  # the host table's copy does
    (5, 40, False, False), (150, 60, False, False), (5, 40, True, False),  # not depend on
    (5, 40, True, True)])  # the length: the short run (~30 s interpreted, 150-60 ~90 s)
def test_graph_step_logic_equals_eager_on_cpu(tmp_path, monkeypatch, prompt, new, host_table,
                                              gather):
    """The decoder's static buffers (padded block list, q_start read from a tensor, pinned
    copies; with host_table, the embedded row copied from the table into a static input, by
    the host or (gather) by kernels/cuda/host_rows.py's kernel at the device-side token) run
    eagerly, without capture, through the Triton kernels under the interpreter: the same
    tokens as the plain eager loop, across a block boundary inside the padding and a
    recalibration."""
    from hisparse_cli.engine import GenerationConfig
    from hisparse_cli.engine import cuda_graph

    monkeypatch.setenv("HISPARSE_GRAPH_SAMPLER", "0")  # the host loop samples (DeviceSampler)
    eng = _cpu_engine(tmp_path)
    ids = torch.randint(3, 256, (prompt,), generator=torch.Generator().manual_seed(prompt))
    g = GenerationConfig(max_new_tokens=new, eos_token_ids=(), repetition_penalty=1.1,
                         no_repeat_ngram_size=3)
    eager = eng.generate(ids, gen=g)
    init = cuda_graph.GraphDecoder.__init__
    monkeypatch.setattr(cuda_graph.GraphDecoder, "__init__",
                        lambda self, *a, **k: init(self, *a, **{**k, "capture": False,
                                                                 "host_embeddings": host_table,
                                                                 "host_gather": gather}))
    body = cuda_graph.GraphDecoder._body
    used = []
    monkeypatch.setattr(cuda_graph.GraphDecoder, "_body",
                        lambda self, *a: used.append((self.host_table, self.host_gather))
                        or body(self, *a))
    monkeypatch.setattr(eng, "_use_graph", lambda gen: True)
    static = eng.generate(ids, gen=g)
    assert used and set(used) == {(host_table, gather)}
    assert static.token_ids == eager.token_ids
    assert static.stats.recalibrations == eager.stats.recalibrations > 0


@pytest.mark.parametrize("every", [1, 4])
def test_graph_step_with_retrieval_equals_eager_on_cpu(tmp_path, monkeypatch, every):
    """The retrieval tier in the decoder's step (its static form, before the forward: every
    layer's pages scored over the whole summary table with the offloaded range read from a
    device tensor, slots placed and filled by the page-cache kernels), uncaptured: the same tokens, offloads
    and page-cache counters as the eager loop, which scores the host-known slice. every 4:
    the steps that keep the last choice run no choice (the decoder's step without it: the
    graph captured without its kernels)."""
    from hisparse_cli.engine import GenerationConfig, SparseConfig
    from hisparse_cli.engine import cuda_graph

    monkeypatch.setenv("HISPARSE_GRAPH_SAMPLER", "0")
    eng = _cpu_engine(tmp_path)
    eng.sparse = SparseConfig(**SPARSE, retrieval_tokens=32, page_cache_tokens=48,
                              retrieval_every=every)
    ids = torch.randint(3, 256, (130,), generator=torch.Generator().manual_seed(7))
    g = GenerationConfig(max_new_tokens=24, eos_token_ids=(), repetition_penalty=1.1)
    traces: dict[str, list] = {"eager": [], "static": []}
    from hisparse_cli.engine.retrieval import RetrievalTier

    calls = []  # (static form, the step chooses) of each choose_decode call
    choose = RetrievalTier.choose_decode
    monkeypatch.setattr(RetrievalTier, "choose_decode", lambda self, static=False: calls.append(
        (static, self.choose)) or choose(self, static))
    eng.step_trace = traces["eager"].append  # --trace: one record a step, both loops
    eager = eng.generate(ids, gen=g)
    eager_calls, calls[:] = list(calls), []
    assert len(eager_calls) == 23 and not any(st for st, _ in eager_calls)
    eng.step_trace = traces["static"].append
    init = cuda_graph.GraphDecoder.__init__
    monkeypatch.setattr(cuda_graph.GraphDecoder, "__init__",
                        lambda self, *a, **k: init(self, *a, **{**k, "capture": False}))
    monkeypatch.setattr(eng, "_use_graph", lambda gen: True)
    static = eng.generate(ids, gen=g)
    chose = sum(c for _, c in eager_calls)  # the steps that chose their pages
    assert calls == [(True, True)] * chose  # those only, in the static form
    assert chose == 23 if every == 1 else 5 < chose < 23
    assert static.token_ids == eager.token_ids
    for key in ("pages_offloaded", "pages_retrieved_per_step", "cache_hit_rate",
                "bytes_to_cache"):
        assert getattr(static.stats, key) == getattr(eager.stats, key), key
    assert static.stats.pages_offloaded > 2 and 0 < static.stats.cache_hit_rate < 1
    decode = {k: [r for r in v if r["phase"] == "decode"] for k, v in traces.items()}
    assert len(decode["static"]) == 23 and decode["static"] == decode["eager"]
    assert any(r["retrieved"] > r["hits"] for r in decode["static"])
    if every > 1:  # some steps kept the last choice: no picks counted there
        assert any(r["retrieved"] == 0 for r in decode["static"])


def test_graph_sampler_in_the_step_equals_eager_on_cpu(tmp_path, monkeypatch):
    """HISPARSE_GRAPH_SAMPLER=1: the step samples itself (kernels/sampling/graph_sampler.py, its
    kernels under the interpreter) and writes the next token into its own input; uncaptured
    here. The same tokens as the plain eager loop, generate after generate: the penalty and
    n-gram ban, a suppressed EOS under min_new_tokens and a stop at EOS, new settings (the
    sampler re-armed), and a sampled generate (temperature > 0), which the host samples."""
    from hisparse_cli.engine import GenerationConfig
    from hisparse_cli.engine import cuda_graph

    eng = _cpu_engine(tmp_path)
    ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(4))
    free = eng.generate(ids, max_new_tokens=20, eos_token_ids=()).token_ids
    gens = [GenerationConfig(max_new_tokens=20, eos_token_ids=(), repetition_penalty=1.1,
                             no_repeat_ngram_size=3),
            GenerationConfig(max_new_tokens=20, eos_token_ids=(free[2],), min_new_tokens=6),
            GenerationConfig(max_new_tokens=20, eos_token_ids=(free[8],)),
            GenerationConfig(max_new_tokens=20, eos_token_ids=(), repetition_penalty=1.1,
                             no_repeat_ngram_size=3),
            GenerationConfig(max_new_tokens=12, eos_token_ids=(), temperature=0.8, seed=1)]
    eager = [eng.generate(ids, gen=g) for g in gens]
    init = cuda_graph.GraphDecoder.__init__
    monkeypatch.setattr(cuda_graph.GraphDecoder, "__init__",
                        lambda self, *a, **k: init(self, *a, **{**k, "capture": False}))
    monkeypatch.setattr(eng, "_use_graph", lambda gen: True)
    monkeypatch.setenv("HISPARSE_GRAPH_SAMPLER", "1")
    sampled = []
    step = cuda_graph.GraphDecoder.step
    monkeypatch.setattr(cuda_graph.GraphDecoder, "step",
                        lambda self, token: sampled.append(token is None) or step(self, token))
    for g, e in zip(gens, eager):
        sampled.clear()
        got = eng.generate(ids, gen=g)
        assert got.token_ids == e.token_ids and got.finish_reason == e.finish_reason
        assert set(sampled) == {g.temperature == 0}  # the step sampled itself when greedy
    assert len(eager[1].token_ids) >= 6  # its EOS (token 2 unsuppressed) held back
    assert eager[2].finish_reason == "eos" and len(eager[2].token_ids) == free.index(free[8])


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_device_sampler_ngram_blocking_equals_host_sampler(n):
    """DeviceSampler's tensor n-gram ban against sampling.Sampler's dictionary of n-grams,
    on logits built to repeat: a few favourite tokens dominate every step."""
    from hisparse_cli.engine import GenerationConfig
    from hisparse_cli.engine.sampling.device import DeviceSampler
    from hisparse_cli.engine.sampling.host import Sampler

    vocab, steps = 12, (10 if n == 1 else 80)  # n = 1 bans every generated token
    g = GenerationConfig(max_new_tokens=steps, no_repeat_ngram_size=n, repetition_penalty=1.05)
    host, dev = Sampler(g, torch.device("cpu")), DeviceSampler(g, vocab, torch.device("cpu"))
    gen = torch.Generator().manual_seed(n)
    fav = torch.zeros(vocab)
    fav[:3] = 6.0
    for _ in range(steps):
        logits = fav + torch.randn(vocab, generator=gen)
        a = host(logits)
        b = int(dev(logits.view(1, -1), None))
        assert a == b


def test_device_sampler_suppresses_and_remembers_tokens():
    """The suppressed ids are never chosen (the next best is) and every sampled token is marked
    seen, for the repetition penalty of later steps."""
    from hisparse_cli.engine import GenerationConfig
    from hisparse_cli.engine.sampling.device import DeviceSampler

    g = GenerationConfig(max_new_tokens=4, repetition_penalty=2.0)
    dev = DeviceSampler(g, 8, torch.device("cpu"))
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, 2.5, 1.0, 0.5, 0.2]])
    assert int(dev(logits, torch.tensor([1, 2]))) == 3
    assert int(dev(logits, None)) == 1
    assert dev.seen.nonzero().flatten().tolist() == [1, 3]
    # seen tokens are penalised: 5/2 and 3/2 fall below 4 (token 2), then 4/2 below 2.5
    assert int(dev(logits, None)) == 2
    assert int(dev(logits, torch.tensor([1]))) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("gen,host", [
    (dict(), False), (dict(repetition_penalty=1.1, no_repeat_ngram_size=3), False),
    (dict(temperature=0.8, top_p=0.9, seed=0), False),
    (dict(repetition_penalty=1.1, no_repeat_ngram_size=3), True),
    (dict(repetition_penalty=1.1, no_repeat_ngram_size=3, graph_sampler=True), False)])
def test_graph_decode_waits_for_the_device_only_to_read_tokens(tmp_path, monkeypatch, gen, host):
    """The decode loop reads tokens back every 16 steps, waiting only on the read-back copy's
    event (the next step already queued), and must not wait for the GPU anywhere else (an
    indexed scalar assignment in the sampler did, twice a token, found in H200 run 41):
    sync debug mode is on for the loop of a run that replays the kept graph, across evictions,
    recalibrations, suppressed EOS, the penalty and n-gram ban, and top-p sampling; host: with
    the embedding table in host memory, whose rows a kernel gathers at the device-side token
    (kernels/cuda/host_rows.py; the host read the token every step before)."""
    import traceback
    import warnings

    from hisparse_cli.engine import Engine, GenerationConfig

    gen = dict(gen)  # graph_sampler: the step samples (kernels/sampling/graph_sampler.py)
    monkeypatch.setenv("HISPARSE_GRAPH_SAMPLER", "1" if gen.pop("graph_sampler", False) else "0")
    eng = _engine(tmp_path, torch.float16, embeddings_on_host=host)
    assert (eng.model.model.embed_tokens.weight.device.type == "cpu") == host
    ids = torch.randint(3, 256, (200,), generator=torch.Generator().manual_seed(3))
    g = GenerationConfig(max_new_tokens=64, min_new_tokens=64, eos_token_ids=(5,), **gen)
    eng.generate(ids, gen=g)  # warms up and captures the graph
    original = Engine._decode_graph

    def counted(self, *a, **k):
        torch.cuda.set_sync_debug_mode("warn")
        try:
            return original(self, *a, **k)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    syncs = []

    def show(message, category, filename, lineno, file=None, line=None):
        # a sync inside the loop has _decode_graph's frame on the stack (not one of the
        # sync-debug switch itself, which warns once in a process on some torch versions)
        stack = traceback.extract_stack()
        if "synchroniz" in str(message) and any(f.name == "_decode_graph" for f in stack):
            own = [f for f in stack if "hisparse_cli" in f.filename]
            syncs.append(f"{filename.split('/')[-1]}:{lineno} in {own[-1].name}:{own[-1].lineno}")

    waits = []  # event waits made by the loop itself (the read-backs); the decoder's own
    real_wait = torch.cuda.Event.synchronize  # (_prepare's, on a copy two steps old) excluded

    def counted_wait(self):
        if traceback.extract_stack()[-2].name == "_decode_graph":
            waits.append(1)
        return real_wait(self)

    monkeypatch.setattr(Engine, "_decode_graph", counted)
    monkeypatch.setattr(torch.cuda.Event, "synchronize", counted_wait)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        res = eng.generate(ids, gen=g)
    assert res.extra["cuda_graph"] == "reused" and len(res.token_ids) == 64
    assert res.stats.recalibrations > 0
    assert syncs == []  # no stream or device synchronisation in the loop at all
    assert len(waits) == 64 // 16  # the read-backs wait on their copy's event, nothing else
    assert eng._decode_state.decoder.host_gather == host


@pytest.mark.gpu
@pytest.mark.parametrize("prompt", [5, 200])
@pytest.mark.parametrize("sampler", ["0", "1"])  # HISPARSE_GRAPH_SAMPLER: host loop / in graph
def test_graph_greedy_equals_eager(tmp_path, monkeypatch, prompt, sampler):
    monkeypatch.setenv("HISPARSE_GRAPH_SAMPLER", sampler)
    eng = _engine(tmp_path, torch.float32)
    ids = torch.randint(3, 256, (prompt,), generator=torch.Generator().manual_seed(prompt))
    graph, eager = _both(eng, ids, monkeypatch, max_new_tokens=150, eos_token_ids=(),
                         repetition_penalty=1.1, no_repeat_ngram_size=3)
    assert len(graph.token_ids) == 150
    assert graph.token_ids == eager.token_ids
    assert graph.stats.recalibrations == eager.stats.recalibrations > 0


@pytest.mark.gpu
@pytest.mark.parametrize("prompt,every", [(300, 1), (700, 1), (700, 4)])
def test_graph_with_retrieval_equals_eager(tmp_path, monkeypatch, prompt, every):
    """The retrieval tier inside the captured decode graph (pages read from the pinned store by
    the page-cache kernel, over PCIe): the same greedy tokens and page-cache counters as the
    eager loop; a second generate of the same shape replays the kept graph and tier."""
    from hisparse_cli.engine import SparseConfig

    monkeypatch.setenv("HISPARSE_GRAPH_SAMPLER", "1")
    eng = _engine(tmp_path, torch.float32)
    eng.sparse = SparseConfig(**SPARSE, retrieval_tokens=64, page_cache_tokens=96,
                              retrieval_every=every)
    ids = torch.randint(3, 256, (prompt,), generator=torch.Generator().manual_seed(prompt))
    gen = dict(max_new_tokens=120, eos_token_ids=(), repetition_penalty=1.1)
    graph, eager = _both(eng, ids, monkeypatch, **gen)
    assert graph.extra.get("cuda_graph") == "new"
    assert graph.token_ids == eager.token_ids
    for key in ("pages_offloaded", "cache_hit_rate", "bytes_to_cache"):
        assert getattr(graph.stats, key) == getattr(eager.stats, key), key
    first = eng.generate(ids, **gen)  # (the eager generate freed the kept state)
    again = eng.generate(ids, **gen)
    assert first.extra.get("cuda_graph") == "new"
    assert again.extra.get("cuda_graph") == "reused" and again.token_ids == graph.token_ids
    assert again.stats.cache_hit_rate == graph.stats.cache_hit_rate


@pytest.mark.gpu
@pytest.mark.parametrize("gen", [
    dict(), dict(repetition_penalty=1.1, no_repeat_ngram_size=3),
    dict(repetition_penalty=1.3, no_repeat_ngram_size=1, min_new_tokens=40, eos_token_ids=(7,))])
def test_graph_sampler_equals_eager(tmp_path, monkeypatch, gen):
    """HISPARSE_GRAPH_SAMPLER=1 on the GPU: the captured graph samples (its kernels, its
    state on the device); the same tokens as the eager loop, twice (the second replays the
    kept graph with the sampler re-armed)."""
    eng = _engine(tmp_path, torch.float32)
    ids = torch.randint(3, 256, (200,), generator=torch.Generator().manual_seed(2))
    g = {"max_new_tokens": 120, "eos_token_ids": (), **gen}
    monkeypatch.setenv("HISPARSE_GRAPH_SAMPLER", "1")
    eng.replan()
    first = eng.generate(ids, **g)
    again = eng.generate(ids, **g)
    assert first.extra["cuda_graph"] == "new" and again.extra["cuda_graph"] == "reused"
    assert eng._decode_state.decoder.sampled
    monkeypatch.setenv("HISPARSE_CUDA_GRAPH", "0")
    eng.replan()
    eager = eng.generate(ids, **g)
    assert first.token_ids == again.token_ids == eager.token_ids


@pytest.mark.gpu
def test_graph_stops_at_eos_and_min_tokens(tmp_path, monkeypatch):
    eng = _engine(tmp_path, torch.float32)
    ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(1))
    free = eng.generate(ids, max_new_tokens=60, eos_token_ids=()).token_ids
    eos = free[20]  # a token the model will emit at step 20 (or earlier)
    graph, eager = _both(eng, ids, monkeypatch, max_new_tokens=60, eos_token_ids=(eos,))
    assert graph.token_ids == eager.token_ids == free[:free.index(eos)]
    assert graph.finish_reason == eager.finish_reason == "eos"


@pytest.mark.gpu
def test_graph_sampling_is_seeded_and_fp16_runs(tmp_path, monkeypatch):
    eng = _engine(tmp_path, torch.float16)
    ids = torch.randint(3, 256, (100,), generator=torch.Generator().manual_seed(2))
    from hisparse_cli.engine import GenerationConfig

    g = GenerationConfig(max_new_tokens=80, eos_token_ids=(), temperature=0.8, top_p=0.9, seed=7)
    a, b = eng.generate(ids, gen=g), eng.generate(ids, gen=g)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 80
    assert all(0 <= t < eng.cfg.vocab_size for t in a.token_ids)
    greedy, eager = _both(eng, ids, monkeypatch, max_new_tokens=80, eos_token_ids=())
    agree = sum(x == y for x, y in zip(greedy.token_ids, eager.token_ids)) / 80
    assert agree >= 0.9, agree  # fp16: rare argmax ties may flip after a divergence


@pytest.mark.gpu
def test_graph_with_host_embeddings_equals_eager(tmp_path, monkeypatch):
    """Tight-VRAM option: the table stays in host memory, registered for the device, and a
    kernel in the graph gathers the token's row from it; the graph must decode the same tokens
    as the eager loop."""
    from conftest import save_tiny

    from hisparse_cli.engine import Engine, SparseConfig, cuda_graph

    path, _ = save_tiny(tmp_path, "llama", num_key_value_heads=2)
    eng = Engine.from_pretrained(path, device="cuda", dtype=torch.float32,
                                 sparse=SparseConfig(**SPARSE), backend="triton",
                                 embeddings_on_host=True)
    assert eng.model.model.embed_tokens.weight.device.type == "cpu"
    ids = torch.randint(3, 256, (120,), generator=torch.Generator().manual_seed(5))
    body, used = cuda_graph.GraphDecoder._body, set()
    monkeypatch.setattr(cuda_graph.GraphDecoder, "_body",
                        lambda self, *a: used.add(self.host_gather) or body(self, *a))
    graph, eager = _both(eng, ids, monkeypatch, max_new_tokens=100, eos_token_ids=(),
                         repetition_penalty=1.1, no_repeat_ngram_size=3)
    assert len(graph.token_ids) == 100 and graph.token_ids == eager.token_ids
    assert used == {True}  # the row gathered on the device (kernels/cuda/host_rows.py)


@pytest.mark.parametrize("window,sinks", [(64, 4), (48, 20), (None, 0)])
def test_prepare_rebuilds_block_list_only_when_the_span_changes(window, sinks):
    """GraphDecoder._prepare keeps the padded block list between steps and writes only the
    position and slot (O(1) Python a token): the static inputs it copies must equal the row
    built from scratch (visible_blocks + slot_mapping) at every step, across block
    allocation, eviction (blocks freed and reused) and both pinned double buffers."""
    from types import SimpleNamespace

    from hisparse_cli.engine import SparseConfig
    from hisparse_cli.engine.block_pool import BlockPool
    from hisparse_cli.engine.cuda_graph import PAD_START, GraphDecoder
    from hisparse_cli.engine.runner import KVRun
    from hisparse_cli.kernels.dispatch import KernelBackend
    from hisparse_cli.model.config import ModelConfig

    cfg = ModelConfig.from_dict({"model_type": "llama", "vocab_size": 32, "hidden_size": 32,
                                 "intermediate_size": 64, "num_hidden_layers": 1,
                                 "num_attention_heads": 2, "num_key_value_heads": 1,
                                 "max_position_embeddings": 4096})
    sparse = SparseConfig(sink_tokens=sinks, window_size=window, global_tokens=0 if window is None
                          else 4, block_size=16, prefill_chunk=32, recalibrate_topk=4)
    prompt, new = 70, 120
    run = KVRun(cfg, sparse, torch.device("cpu"), torch.float32, KernelBackend(), BlockPool(),
                total_tokens=prompt + new)
    run.seq.append(prompt)
    run.seq.evict()
    model = SimpleNamespace(model=SimpleNamespace(embed_tokens=SimpleNamespace(
        weight=torch.zeros(1))))
    dec = GraphDecoder(model, run, prompt + new, capture=False, host_embeddings=False)
    rebuilt = 0
    for _ in range(new):
        p = run.seq.num_tokens
        version = dec._version
        dec._prepare()
        rebuilt += dec._version != version
        ids, starts = run.seq.visible_blocks(p, 1)
        pad = dec.nb_max - len(ids)
        row = [p, run.seq.slot_mapping(p, 1)[0]] + ids + [ids[0]] * pad + starts + [PAD_START] * pad
        assert dec.dev.tolist() == row, p
        dec.steps += 1
        run.seq.evict()
    assert rebuilt <= new // 16 * 2 + 2  # about once a block, not once a token
    run.seq.release()
