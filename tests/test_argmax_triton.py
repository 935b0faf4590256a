"""kernels/sampling/argmax_triton.py: greedy_pick against torch.argmax on a masked copy (the oracle),
under the Triton interpreter on the CPU and on CUDA (gpu marker)."""

from __future__ import annotations

import os

import pytest
import torch


def _oracle(x: torch.Tensor, suppress: torch.Tensor | None) -> int:
    y = x.clone()
    if suppress is not None and suppress.numel():
        y[suppress] = float("-inf")
    return int(torch.argmax(y))


def _cases(device: str, vocab: int):
    """(name, x, suppress): random rows, ties (first index wins), all -inf, NaN (the first
    wins, as torch.argmax), suppressed winners, a suppress list past the in-kernel limit."""
    from hisparse_cli.kernels.sampling.argmax_triton import BLOCK, MAX_SUPPRESS

    g = torch.Generator().manual_seed(vocab)
    r = torch.randn(vocab, generator=g)
    cases = [("random", r, None)]
    tie = r.clone()
    top = float(r.max()) + 1
    tie[[vocab - 1, BLOCK + 3 if vocab > BLOCK + 3 else 1, vocab // 2]] = top
    cases.append(("ties", tie, None))
    cases.append(("all -inf", torch.full((vocab,), float("-inf")), None))
    nan = r.clone()
    nan[[vocab - 2, vocab // 3]] = float("nan")
    cases.append(("nan", nan, None))
    winner = int(torch.argmax(r))
    cases.append(("suppressed winner", r, torch.tensor([winner, 0])))
    second = int(torch.argsort(r, descending=True)[1])
    cases.append(("suppressed top two", r, torch.tensor([second, winner])))
    many = torch.argsort(r, descending=True)[:MAX_SUPPRESS + 3]
    cases.append(("long suppress list", r, many))
    cases.append(("fp16", r.half(), torch.tensor([winner])))
    return [(n, x.to(device), None if s is None else s.to(device)) for n, x, s in cases]


@pytest.mark.parametrize("vocab", [2, 7, 1024, 1025, 5000])
def test_greedy_pick_interpreted_equals_torch_argmax(vocab, monkeypatch):
    """The kernels under TRITON_INTERPRET=1 (a subprocess: the interpreter is chosen at import)."""
    import subprocess
    import sys

    code = f"""
import torch, sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
from test_argmax_triton import _cases, _oracle
from hisparse_cli.kernels.sampling.argmax_triton import greedy_pick_triton
bad = []
for name, x, s in _cases("cpu", {vocab}):
    out = torch.full((1,), -1, dtype=torch.int64)
    got = int(greedy_pick_triton(x, s, out=out)[0])
    if got != _oracle(x, s):
        bad.append((name, got, _oracle(x, s)))
print(bad)
assert not bad, bad
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]


def test_greedy_pick_cpu_path():
    """The CPU path (torch) applies the same masking."""
    from hisparse_cli.kernels.sampling.argmax_triton import greedy_pick

    for name, x, s in _cases("cpu", 300):
        assert int(greedy_pick(x, s)[0]) == _oracle(x, s), name
    out = torch.empty(1, dtype=torch.int64)
    x = torch.arange(10.0)
    assert greedy_pick(x, torch.tensor([9]), out=out) is out and int(out) == 8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("vocab", [7, 1025, 32000, 128256])
def test_greedy_pick_cuda_equals_torch_argmax(vocab):
    from hisparse_cli.kernels.sampling.argmax_triton import greedy_pick

    for name, x, s in _cases("cuda", vocab):
        assert int(greedy_pick(x, s)[0]) == _oracle(x, s), name
