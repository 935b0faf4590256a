"""benchmarks/gpu_cuda_step.py's references, which its GPU run checks the whole-step skeleton
(benchmarks/cuda/step_ring.cu) against: the combine of the attention's split partials
against one softmax over all keys, RoPE against rotations of complex pairs, the V swizzle as
the .cu specifies it; and the CUDA source builds for sm_90 without spills where an nvcc is
present."""

from __future__ import annotations

import importlib.util
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def mod():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("gpu_cuda_step", BENCH / "gpu_cuda_step.py")
        m = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(m)
        yield m
    finally:
        sys.path.remove(str(BENCH))


def _partials(mod, q, k, v, splits):
    """Each split's (unnormalised acc, max, sum) packed as the kernel writes a unit's partial."""
    hkv, S, hd = k.shape[0], splits, k.shape[-1]
    part = torch.zeros(hkv, S, mod.ATT_STRIDE, dtype=torch.float64)
    for h in range(hkv):
        for s, idx in enumerate(torch.arange(k.shape[1]).chunk(S)):
            sc = q[h] @ k[h, idx].T  # [4 heads, keys]
            m = sc.max(dim=1).values
            p = torch.exp(sc - m[:, None])
            part[h, s, :4 * hd] = (p @ v[h, idx]).reshape(-1)
            part[h, s, 4 * hd:4 * hd + 4] = m
            part[h, s, 4 * hd + 4:] = p.sum(1)
    return part


def test_attention_partials_combine_to_one_softmax(mod):
    gen = torch.Generator().manual_seed(0)
    hkv, keys, hd = mod.HKV, 16 * 7, mod.HD
    q = torch.randn(hkv, 4, hd, generator=gen, dtype=torch.float64) * 0.3
    k = torch.randn(hkv, keys, hd, generator=gen, dtype=torch.float64)
    v = torch.randn(hkv, keys, hd, generator=gen, dtype=torch.float64)
    part = _partials(mod, q, k, v, mod.SPLITS)
    got = mod.attention_out(part.reshape(-1))
    ref = (torch.softmax(q @ k.transpose(1, 2), dim=-1) @ v).reshape(-1)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def test_attention_combine_ignores_empty_splits(mod):
    """A split that saw no key (max -inf, sum 0) must not turn the result into NaN."""
    gen = torch.Generator().manual_seed(1)
    hkv, hd = mod.HKV, mod.HD
    q = torch.randn(hkv, 4, hd, generator=gen, dtype=torch.float64)
    k = torch.randn(hkv, 32, hd, generator=gen, dtype=torch.float64)
    v = torch.randn(hkv, 32, hd, generator=gen, dtype=torch.float64)
    part = _partials(mod, q, k, v, 2)
    full = torch.zeros(hkv, mod.SPLITS, mod.ATT_STRIDE, dtype=torch.float64)
    full[:, :, 4 * hd:4 * hd + 4] = -math.inf
    full[:, :2] = part
    got = mod.attention_out(full.reshape(-1))
    ref = (torch.softmax(q @ k.transpose(1, 2), dim=-1) @ v).reshape(-1)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def test_rope_rotates_each_dim_pair_by_its_angle(mod):
    pos, hd = 1234, mod.HD
    cs = mod.rope_table(pos)
    x = torch.randn(3, hd, dtype=torch.float64)
    got = mod.rope(x.float(), cs)
    theta = pos * 500000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    z = torch.complex(x[:, :64], x[:, 64:]) * torch.exp(1j * theta)  # pair (i, i + 64)
    ref = torch.cat([z.real, z.imag], -1)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)


def test_rope_scores_depend_on_the_position_difference_only(mod):
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, mod.HD, generator=gen)
    a = mod.rope(q, mod.rope_table(40)) @ mod.rope(k, mod.rope_table(10))
    b = mod.rope(q, mod.rope_table(1030)) @ mod.rope(k, mod.rope_table(1000))
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_v_swizzle_puts_chunk_j_of_row_r_at_j_xor_r(mod):
    vc = torch.arange(2 * 3 * mod.HKV * mod.PAGE * mod.HD, dtype=torch.float32).view(
        2, 3, mod.HKV, mod.PAGE, mod.HD)
    sw = mod.swizzle_v(vc)
    for r in range(mod.PAGE):
        for j in range(mod.HD // 8):
            pos = j ^ (r & 7)
            assert torch.equal(sw[1, 2, 5, r, 8 * pos:8 * pos + 8], vc[1, 2, 5, r, 8 * j:8 * j + 8])
    assert torch.equal(mod.swizzle_v(sw), vc)  # an involution: the kernel's read undoes it


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_step_source_builds_for_sm90_without_spills_in_the_main_instance(tmp_path):
    p = subprocess.run(["nvcc", "-O3", "-gencode", "arch=compute_90,code=sm_90", "-Xptxas", "-v",
                        "-cubin", "-o", str(tmp_path / "step.cubin"),
                        str(BENCH / "cuda" / "step_ring.cu")], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    lines = p.stderr.splitlines()

    def spills(instance: str) -> int:
        i = next(k for k, ln in enumerate(lines) if "Compiling entry" in ln and instance in ln)
        m = re.search(r"(\d+) bytes spill stores", " ".join(lines[i + 1:i + 4]))
        return int(m.group(1))

    assert spills("step_ringILb0E") == 0, p.stderr  # the instance every timed row but the
    assert spills("step_ringILb1E") <= 16, p.stderr  # mass rows runs; the mass one: a few bytes
