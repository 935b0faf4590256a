"""kernels/l2_prefetch.py: the byte ranges a decode step prefetches into L2.

Oracles: for the kernel's address arithmetic, Segment.runs (plain Python) through its RECORD
path under the CPU interpreter; for what an INT4 linear's plan covers, the tiled layout's
word-address formula (awq_layout's comment) applied to the words each program of the
split-K GEMV reads. On sm_90 (`gpu`): the kernel runs eagerly and inside a CUDA graph in the
PDL chain, and the GEMV after it, and an engine's greedy decode, give the same bits.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first triton import in this process
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from hisparse_cli.kernels import awq_layout  # noqa: E402
from hisparse_cli.kernels import l2_prefetch as lp  # noqa: E402
from hisparse_cli.kernels.awq_layout import repack_kmajor, tile_kmajor  # noqa: E402
from test_awq_ref import random_awq  # noqa: E402

CPU = not torch.cuda.is_available()
interp = pytest.mark.skipif(not CPU, reason="interpreter tests run only without CUDA")


def covered(pairs, base: int, nbytes: int) -> torch.Tensor:
    """bool [nbytes]: the bytes of [base, base + nbytes) that (address, size) pairs cover;
    any byte outside that range fails."""
    cov = torch.zeros(nbytes, dtype=torch.bool)
    for addr, size in pairs:
        assert size > 0 and size % 16 == 0 and addr % 16 == 0, (addr, size)
        assert base <= addr and addr + size <= base + nbytes, (addr, size, base, nbytes)
        cov[addr - base:addr - base + size] = True
    return cov


@interp
@pytest.mark.parametrize("total,run,period,max_run", [
    (4096, 4096, 4096, 1 << 16),  # one run
    (4096 * 37 + 512, 1024, 1024, 1 << 16),  # many runs over every program, a short last one
    (65536, 1024, 4096, 1 << 16),  # strided: a quarter of every 4 KiB
    (65536 + 2048, 3072, 8192, 1024),  # runs split in MAX_RUN pieces, the last run clipped
])
def test_kernel_issues_exactly_the_segment_runs(monkeypatch, total, run, period, max_run):
    monkeypatch.setattr(lp, "MAX_RUN", max_run)
    t = torch.zeros(total // 4 + 64, dtype=torch.int32)
    seg = lp.Segment(t, total, run, period)
    got = lp.record([seg], programs=3)
    assert all(size <= max_run for _, size in got)
    base, nbytes = t.data_ptr(), t.numel() * 4
    want = covered([(base + o, s) for o, s in seg.runs()], base, nbytes)
    assert torch.equal(covered(got, base, nbytes), want)
    assert int(want.sum()) == sum(s for _, s in seg.runs()) < nbytes or run == period


@interp
def test_kernel_walks_several_segments():
    a = torch.zeros(3000, dtype=torch.float16)
    b = torch.zeros(8192, dtype=torch.int32)
    segs = [lp.whole(a), lp.Segment(b, 8192 * 4, 256, 1024), lp.whole(b, 0.5)]
    got = lp.record(segs, programs=2)
    for seg in segs:
        t = seg.tensor
        base, nbytes = t.data_ptr(), t.numel() * t.element_size()
        mine = [(ad, sz) for ad, sz in got if base <= ad < base + nbytes]
        want = torch.zeros(nbytes, dtype=torch.bool)
        for s in segs:
            if s.tensor is t:
                want |= covered([(base + o, z) for o, z in s.runs()], base, nbytes)
        assert torch.equal(covered(mine, base, nbytes), want)
    assert len(got) == sum(len(s.runs()) for s in segs)


def test_segment_checks():
    t = torch.zeros(64, dtype=torch.int32)  # 256 bytes
    with pytest.raises(ValueError):
        lp.Segment(t, 512, 16, 16)  # longer than the tensor
    with pytest.raises(ValueError):
        lp.Segment(t, 256, 24, 32)  # not a 16-byte granule
    with pytest.raises(ValueError):
        lp.Segment(t, 256, 64, 32)  # run > period
    assert lp.whole(t, 0.01) is None  # under 16 bytes: nothing
    assert lp.whole(t, 0.5).total == 128


class _Lin:  # the fields awq_segments reads of an AWQLinear
    def __init__(self, qw, qz, s, group, layout, k):
        self.qweight, self.qzeros, self.scales = qw, qz, s
        self.group_size, self.layout, self.in_features = group, layout, k


@pytest.mark.parametrize("k,n,group,sms,fraction", [
    (4096, 1024, 128, 132, 0.5), (2048, 512, 64, 8, 0.25), (1024, 256, 128, 4, 1 / 3)])
def test_awq_plan_covers_the_first_steps_of_every_program(k, n, group, sms, fraction):
    """The tiled words prefetched are exactly those of the first round(fraction * steps)
    steps (at least one) that each program of the decode GEMV reads, for every row."""
    qw, qz, s, _ = random_awq(k, n, group, seed=1, bias=False)
    tiled = tile_kmajor(repack_kmajor(qw), group)  # [n, k/8] words
    lin = _Lin(tiled, qz, s, group, "tiled", k)
    segs = lp.awq_segments(lin, fraction, sms)
    assert {id(x.tensor) for x in segs} == {id(tiled), id(qz), id(s)}
    for x in segs:
        if x.tensor is not tiled:
            assert x.total == x.tensor.numel() * x.tensor.element_size()  # whole
    (seg,) = [x for x in segs if x.tensor is tiled]
    kw, t = k // 8, awq_layout.tile_words(group)
    split = awq_layout.gemv_config(1, k, n, group, sms).split
    steps = kw // t // split
    first = max(1, round(fraction * steps))
    # the oracle: word (row, w) of the tiled layout at
    # ((row // 64) * KW/T + w // T) * 64 T + (row % 64) T + w % T
    want = torch.zeros(n * kw, dtype=torch.bool)
    rows = torch.arange(n)[:, None]
    for c in range(split):
        w = torch.arange(c * steps * t, (c * steps + first) * t)[None, :]
        addr = ((rows // 64) * (kw // t) + w // t) * 64 * t + (rows % 64) * t + w % t
        want[addr.flatten()] = True
    got = covered([(tiled.data_ptr() + o, z) for o, z in seg.runs()], tiled.data_ptr(),
                  tiled.numel() * 4)
    assert torch.equal(got.view(-1, 4).all(1), want)
    assert torch.equal(got.view(-1, 4).any(1), want)  # whole words only


def test_kmajor_and_plain_linears_take_a_prefix():
    qw, qz, s, _ = random_awq(1024, 256, 128, seed=2, bias=False)
    km = repack_kmajor(qw)
    segs = lp.awq_segments(_Lin(km, qz, s, 128, "kmajor", 1024), 0.5, 4)
    (seg,) = [x for x in segs if x.tensor is km]
    assert seg.runs()[0][0] == 0 and seg.total == km.numel() * 2
    lin = torch.nn.Linear(64, 32, bias=False).half()
    (seg,) = lp.linear_segments(lin, 0.25, 4)
    assert seg.tensor is lin.weight and seg.total == 64 * 32 * 2 // 4
    assert lp.linear_segments(lin, 0.0, 4) == [] and lp.linear_segments(None, 1.0, 4) == []


def test_plan_model_is_a_no_op_off_sm90(tmp_path):
    from conftest import save_tiny

    from hisparse_cli.model.loader import load_model

    path, _ = save_tiny(tmp_path, "llama")
    model = load_model(path, device="cpu", dtype=torch.float32)[0]
    assert lp.plan_model(model, lp.Plan()) == 0
    assert all(layer.self_attn.l2_prefetch is None and layer.mlp.l2_prefetch is None
               for layer in model.model.layers)


# -- sm_90 ----------------------------------------------------------------------------------
needs_sm90 = pytest.mark.skipif(CPU or not lp.supported(torch.device("cuda")),
                                reason="needs CUDA sm_90+")


@pytest.mark.gpu
@needs_sm90
def test_prefetch_then_gemv_same_bits_eager_and_in_a_graph():
    from hisparse_cli.kernels import awq_gemv
    from test_awq_triton import case_k

    k, n = 4096, 28672
    x, qw, qt, qz, s, b = case_k(1, k, n, 128, torch.float16, "cuda", seed=3)
    tiled = tile_kmajor(qt, 128)
    sms = awq_gemv._sm_count(x.device)
    lin = _Lin(tiled, qz, s, 128, "tiled", k)
    want = awq_gemv.awq_gemv_k(x, tiled, qz, s, b, 128, tiled=True)
    before = tiled.clone()
    for f in (0.25, 1.0):
        for last, lines in ((False, False), (True, False), (False, True), (True, True)):
            pf = lp.Prefetcher(lp.awq_segments(lin, f, sms), evict_last=last, lines=lines)
            pf()
            assert torch.equal(awq_gemv.awq_gemv_k(x, tiled, qz, s, b, 128, tiled=True), want)
    assert torch.equal(tiled, before)  # a prefetch writes nothing

    def step():
        pf()
        return awq_gemv.awq_gemv_k(x, tiled, qz, s, b, 128, tiled=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    for _ in range(3):
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


@pytest.mark.gpu
@needs_sm90
def test_engine_greedy_decode_same_tokens_with_prefetch(tmp_path):
    from conftest import save_tiny

    from hisparse_cli.engine import Engine, GenerationConfig, SparseConfig

    path, _ = save_tiny(tmp_path, "llama", num_key_value_heads=2)
    sparse = SparseConfig(sink_tokens=4, window_size=64, global_tokens=8, block_size=16,
                          prefill_chunk=32, recalibrate_every=32, recalibrate_topk=8)

    def engine():  # a new engine: its decode graph is captured anew (graphs are kept)
        return Engine.from_pretrained(path, device="cuda", dtype=torch.float16, sparse=sparse,
                                      backend="triton")

    ids = torch.randint(0, 200, (150,), generator=torch.Generator().manual_seed(0))
    gen = GenerationConfig(max_new_tokens=40, min_new_tokens=40)
    plain = engine().generate(ids, gen=gen).token_ids
    for lines, side in ((False, False), (True, False), (False, True)):
        eng = engine()
        assert lp.plan_model(eng.model, lp.Plan(o=1.0, gate_up=0.5, mlp_down=0.5,
                                                lines=lines, side=side)) > 0
        calls = []
        att = eng.model.model.layers[0].self_attn
        inner = att.l2_prefetch
        att.l2_prefetch = lambda inner=inner: (calls.append(1), inner())
        got = eng.generate(ids, gen=gen).token_ids
        assert calls  # the hook ran (at least while the decode graph was captured)
        assert got == plain
