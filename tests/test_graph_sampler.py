"""kernels/sampling/graph_sampler.py: the greedy sampler with its state on the device, against
engine/cuda_graph.py's DeviceSampler (the oracle: the host-side loop's sampler), token by token
over sequences built to repeat (so the penalty, the n-gram ban and the EOS suppression all
bite): its torch path on the CPU, its kernels under the Triton interpreter (a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

# (repetition_penalty, no_repeat_ngram_size, min_new_tokens, eos)
CONFIGS = [(1.0, 0, 0, ()), (1.1, 8, 0, (3,)), (1.3, 2, 6, (3, 7)), (1.0, 1, 0, ()),
           (1.2, 3, 30, (5,)), (1.0, 0, 4, (0,))]


def _rows(vocab: int, steps: int, seed: int) -> list[torch.Tensor]:
    """Logits rows that favour a few tokens every step (greedy would repeat them), with the
    EOS ids among the favoured, plus a NaN-free noise."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(vocab, generator=g)
    base[[3, 5, 7, 0]] += 4.0
    base[[11, 12, 13]] += 3.0
    return [base + 0.3 * torch.randn(vocab, generator=g) for _ in range(steps)]


def _oracle(rows, cfg) -> list[int]:
    from hisparse_cli.engine import GenerationConfig
    from hisparse_cli.engine.sampling.device import DeviceSampler

    pen, n, min_new, eos = cfg
    gen = GenerationConfig(max_new_tokens=len(rows), repetition_penalty=pen,
                           no_repeat_ngram_size=n, min_new_tokens=min_new, eos_token_ids=eos)
    s = DeviceSampler(gen, rows[0].shape[0], torch.device("cpu"))
    eos_t = torch.tensor(sorted(eos), dtype=torch.int64) if eos else None
    return [int(s(r.view(1, -1), eos_t if i < min_new else None)[0])
            for i, r in enumerate(rows)]


def _ours(rows, cfg, capacity=None) -> tuple[list[int], list[int]]:
    from hisparse_cli.engine import GenerationConfig
    from hisparse_cli.engine.sampling.graph import GraphSampler

    pen, n, min_new, eos = cfg
    gen = GenerationConfig(max_new_tokens=len(rows), repetition_penalty=pen,
                           no_repeat_ngram_size=n, min_new_tokens=min_new, eos_token_ids=eos)
    gs = GraphSampler(rows[0].shape[0], capacity or len(rows), torch.device("cpu"))
    gs.reset(gen, eos)
    out = torch.full((1,), -1, dtype=torch.int64)
    picked = []
    for r in rows:
        gs(r, out)
        picked.append(int(out[0]))
    return picked, gs.toks[:len(rows)].tolist()


@pytest.mark.parametrize("cfg", CONFIGS)
def test_torch_path_equals_the_device_sampler(cfg, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rows = _rows(40, 60, seed=len(cfg[3]) + cfg[1])
    want = _oracle(rows, cfg)
    got, hist = _ours(rows, cfg)
    assert got == want and hist == want
    if cfg[1] == 1:  # no token twice, until every one is banned (then all -inf: index 0)
        assert len(set(got[:40])) == 40 and set(got[40:]) == {0}
    if cfg[2]:  # no EOS before min_new_tokens
        assert not set(got[:cfg[2]]) & set(cfg[3])


def test_the_state_is_reset_and_the_settings_are_watched(monkeypatch):
    """reset re-arms a generate (nothing seen, nothing generated) and says when the settings
    (which a captured graph holds) differ from the last ones."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from hisparse_cli.engine import GenerationConfig
    from hisparse_cli.engine.sampling.graph import GraphSampler

    rows = _rows(40, 20, seed=1)
    gen = GenerationConfig(max_new_tokens=20, repetition_penalty=1.1, no_repeat_ngram_size=2)
    gs = GraphSampler(40, 20, torch.device("cpu"))
    assert gs.reset(gen, ()) is True
    out = torch.zeros(1, dtype=torch.int64)
    first = []
    for r in rows:
        gs(r, out)
        first.append(int(out[0]))
    assert int(gs.count[0]) == 20 and int(gs.seen.sum()) == len(set(first))
    assert gs.reset(gen, ()) is False  # same settings: the graph may replay
    assert int(gs.count[0]) == 0 and int(gs.seen.sum()) == 0 and int(gs.ban.sum()) == 0
    again = []
    for r in rows:
        gs(r, out)
        again.append(int(out[0]))
    assert again == first
    other = GenerationConfig(max_new_tokens=20, repetition_penalty=1.2, no_repeat_ngram_size=2)
    assert gs.reset(other, ()) is True
    assert GraphSampler.serves(gen, ()) and not GraphSampler.serves(
        GenerationConfig(temperature=0.7), ())


def test_history_past_the_capacity_is_not_written(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rows = _rows(40, 12, seed=2)
    cfg = (1.0, 0, 0, ())
    got, _ = _ours(rows, cfg, capacity=5)
    assert got == _oracle(rows, cfg)


def _past_capacity(cap: int = 6, steps: int = 20) -> tuple[list[int], list[int]]:
    """Picks with the n-gram ban past a capacity of `cap` tokens (a benchmark replaying the
    graph beyond the run): the first cap + 1 follow the oracle (the ban still sees the whole
    history); later ones ban from the first `cap` tokens, as the kernels read them."""
    rows = _rows(40, steps, seed=4)
    cfg = (1.2, 2, 0, ())
    got, _ = _ours(rows, cfg, capacity=cap)
    return got, _oracle(rows, cfg)


def test_the_ban_reads_no_history_past_the_capacity(monkeypatch):
    """The torch path (run 161: the kernels read toks[count - n + 1 ...] past the buffer once
    a benchmark replayed the graph beyond the run's capacity: an illegal address on the GPU)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    got, want = _past_capacity()
    assert got[:7] == want[:7] and len(got) == 20 and all(0 <= t < 40 for t in got)


@pytest.mark.parametrize("vocab", [40, 2500])
def test_kernels_interpreted_equal_the_device_sampler(vocab):
    """The three kernels under TRITON_INTERPRET=1 (a subprocess: the interpreter is chosen at
    import), every config, a vocabulary of one block and of three."""
    pytest.importorskip("triton")
    code = f"""
import sys, torch
sys.path.insert(0, {os.path.dirname(__file__)!r})
from test_graph_sampler import CONFIGS, _rows, _oracle, _ours
bad = []
for k, cfg in enumerate(CONFIGS):
    rows = _rows({vocab}, 36, seed=k)
    want = _oracle(rows, cfg)
    got, hist = _ours(rows, cfg)
    if got != want or hist != want:
        bad.append((cfg, got, want))
from test_graph_sampler import _past_capacity
import torch as _t
_t.manual_seed(0)
with_cap = _past_capacity()
import os
os.environ.pop("TRITON_INTERPRET")  # (read at each call: the torch path for the same state)
if with_cap[0] != _past_capacity()[0]:
    bad.append(("past capacity", with_cap))
print(bad)
assert not bad, bad
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


_COMPILE = """
import sys
sys.path.insert(0, 'benchmarks')
import sm90_compile as c
from hisparse_cli.kernels.sampling import argmax_triton as a
from hisparse_cli.kernels.sampling import graph_sampler as g
scratch = dict(vals_ptr='*fp32', idx_ptr='*i32', nan_ptr='*i32')
for S in (0, 2):
    c.compile_one(a._stage1, dict(x_ptr='*fp32', n='i32', sup_ptr='*i64', **scratch),
                  dict(S=S, BLOCK=a.BLOCK), 4, ())
c.compile_one(a._stage2, dict(**scratch, nb='i32', n='i32', out_ptr='*i64'), dict(NB=128), 4, ())
for N in (1, 3, 8):
    c.compile_one(g._ban, dict(toks_ptr='*i64', count_ptr='*i64', ban_ptr='*u8', cap='i32'),
                  dict(N=N, BAN_BLOCK=g.BAN_BLOCK), 4, ())
for pen, ng, S in ((False, False, 0), (True, True, 2)):
    c.compile_one(g._pick1, dict(x_ptr='*fp32', n='i32', seen_ptr='*u8', ban_ptr='*u8',
                  count_ptr='*i64', sup_ptr='*i64', **scratch, penalty='fp32',
                  inv_penalty='fp32', min_new='i32'), dict(PEN=pen, NG=ng, S=S, BLOCK=a.BLOCK),
                  4, ())
    c.compile_one(g._pick2, dict(**scratch, nb='i32', n='i32', out_ptr='*i64', toks_ptr='*i64',
                  cap='i32', seen_ptr='*u8', count_ptr='*i64'), dict(PEN=pen, NB=128), 4, ())
print("compiled")
"""


def test_kernels_compile_for_sm90():
    """What the interpreter cannot say: the kernels (argmax_triton's shared helpers included)
    go through Triton's compiler and ptxas for sm_90, no GPU needed."""
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # (other test
    # modules set it for this process; compiling needs the real jit)
    r = subprocess.run([sys.executable, "-c", _COMPILE], cwd=root, capture_output=True,
                       text=True, timeout=600, env={**env, "PYTHONPATH": root})
    assert r.returncode == 0 and "compiled" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


def test_buffer_bytes_are_what_the_samplers_allocate():
    """The planner's sampler line (GraphSampler.buffer_bytes, DeviceSampler.buffer_bytes) is
    what the samplers allocate: counted here by recording every storage they create."""
    from test_planner import AllocRecorder

    from hisparse_cli.config.settings import GenerationConfig
    from hisparse_cli.engine.sampling.device import DeviceSampler
    from hisparse_cli.engine.sampling.graph import GraphSampler

    for vocab, new in [(1000, 1), (49152, 200), (128256, 4096)]:
        rec = AllocRecorder()
        with rec:
            gs = GraphSampler(vocab, new, torch.device("cpu"))
        assert rec.cur == sum(GraphSampler.buffer_bytes(vocab, new))
        rec = AllocRecorder()
        with rec:
            ds = DeviceSampler(GenerationConfig(max_new_tokens=new), vocab, torch.device("cpu"))
            toks = torch.empty(new, dtype=torch.int64)  # Engine._decode_graph's token buffer
        assert rec.cur == sum(DeviceSampler.buffer_bytes(vocab, new))
        del gs, ds, toks
