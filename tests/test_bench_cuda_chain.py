"""benchmarks/gpu_cuda_chain.py's reference: its dequantization of the CUDA ring kernel's two
item layouts (benchmarks/cuda/gemv_chain_ring.cu) against a word-by-word reading of the
layouts as the .cu header specifies them, and the CUDA source builds for sm_90 where an nvcc
is present. The GPU run itself checks the kernel against this reference."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _bench():
    spec = importlib.util.spec_from_file_location("gpu_cuda_chain", BENCH / "gpu_cuda_chain.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_cuda_chain"] = mod
    spec.loader.exec_module(mod)
    return mod


def _items(mod, t: int, g: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    items = torch.randint(-2 ** 31, 2 ** 31 - 1, (t * g, mod.ITEM_WORDS), dtype=torch.int32,
                          generator=gen)
    scales = torch.rand(t * g, 128, generator=gen) + 0.5
    items[:, 2048:2112] = scales.half().view(torch.int32)
    return items


def _spec_lanes(words, scales, zeros, t: int, g: int) -> np.ndarray:
    """W [g*128, t*128] read word by word: word index (kp // 4) * 128 + lane * 4 + kp % 4;
    nibble i of the low half q(2 kp, 4 lane + i), of the high half q(2 kp + 1, ...)."""
    w = np.zeros((g * 128, t * 128))
    for ti in range(t):
        for gj in range(g):
            wd, sc, zw = words[ti, gj], scales[ti, gj], zeros[ti, gj]
            for lane in range(32):
                for kp in range(64):
                    word = int(wd[(kp // 4) * 128 + lane * 4 + kp % 4])
                    for i in range(4):
                        col = ti * 128 + 4 * lane + i
                        z = (int(zw.view(np.uint16)[lane]) >> (4 * i)) & 15
                        s = float(sc[lane * 4 + i])
                        for h in range(2):
                            q = (word >> (4 * i + 16 * h)) & 15
                            w[gj * 128 + 2 * kp + h, col] = (q - z) * s
    return w


def _spec_mma(words, scales, zeros, t: int, g: int) -> np.ndarray:
    """W read word by word in the mma.sync fragment layout: word ((rt * 2 + kt // 4) * 32 +
    lane) * 4 + kt % 4, lane = 4 gg + tt; nibble pair p = 2 pk + pr: row 16 rt + 8 pr + gg,
    K 16 kt + 8 pk + 2 tt + h; scales and zero nibbles [gg][rt][pr]."""
    w = np.zeros((g * 128, t * 128))
    for ti in range(t):
        for gj in range(g):
            wd, sc = words[ti, gj], scales[ti, gj]
            zb = zeros[ti, gj].view(np.uint8)
            for lane in range(32):
                gg, tt = divmod(lane, 4)
                for rt in range(8):
                    for kt in range(8):
                        word = int(wd[((rt * 2 + kt // 4) * 32 + lane) * 4 + kt % 4])
                        for p in range(4):
                            pk, pr = divmod(p, 2)
                            row = ti * 128 + 16 * rt + 8 * pr + gg
                            z = (int(zb[gg * 8 + rt]) >> (4 * pr)) & 15
                            s = float(sc[(gg * 8 + rt) * 2 + pr])
                            for h in range(2):
                                q = (word >> (4 * p + 16 * h)) & 15
                                w[gj * 128 + 16 * kt + 8 * pk + 2 * tt + h, row] = (q - z) * s
    return w


@pytest.mark.parametrize("mma", [0, 1])
def test_dequant_matches_the_specified_layout(mma):
    mod = _bench()
    t, g = 2, 2
    items = _items(mod, t, g, seed=mma)
    raw = items.view(t, g, mod.ITEM_WORDS).numpy().view(np.uint32)
    words, zeros = raw[..., :2048], raw[..., 2112:2128].copy()
    scales = raw[..., 2048:2112].copy().view(np.float16)
    spec = (_spec_mma if mma else _spec_lanes)(words, scales, zeros, t, g)
    got = mod.dequant(items, t, g, mma).numpy()
    np.testing.assert_allclose(got, spec, rtol=0, atol=1e-6)
    # the layouts differ: reading one as the other gives other weights
    other = mod.dequant(items, t, g, 1 - mma).numpy()
    assert np.abs(other - spec).max() > 1.0


def test_x_of_follows_the_kernel_transform():
    mod = _bench()
    x0 = torch.randn(4096)
    prev = torch.randn(2 * 14336)
    want = x0.repeat(4)[:14336] + 0.5 * torch.nn.functional.silu(prev[:14336]) * prev[14336:]
    torch.testing.assert_close(mod.x_of(prev, 14336, 1, x0), want.half())
    torch.testing.assert_close(mod.x_of(prev[:6144], 4096, 0, x0), (x0 + 0.5 * prev[:4096]).half())


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_cuda_source_builds_for_sm90_without_spills_in_the_best_variants(tmp_path):
    p = subprocess.run(["nvcc", "-O3", "-gencode", "arch=compute_90,code=sm_90", "-Xptxas", "-v",
                        "-cubin", "-o", str(tmp_path / "chain.cubin"),
                        str(BENCH / "cuda" / "gemv_chain_ring.cu")],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    lines = p.stderr.splitlines()
    # the variants BENCHMARKS.md reports: mma 1 / split 4 / nw 16 and mma 0 / split 2 / nw 16
    # (one accumulator chain each)
    for name in ("gemv_chain_ringILi1ELi4ELi16ELi1E", "gemv_chain_ringILi0ELi2ELi16ELi1E"):
        i = next(k for k, ln in enumerate(lines) if "Compiling entry" in ln and name in ln)
        assert "0 bytes spill stores" in lines[i + 2], lines[i:i + 4]
