"""The K-major run-time INT4 layout (kernels/awq_layout.py): repack against the reference
unpacking and hand-built words, its inverse, the torch reference on it, AWQLinear's repack,
and the GEMV launch choices the planner mirrors."""

from __future__ import annotations

import pytest
import torch

from hisparse_cli.kernels import awq_layout
from hisparse_cli.kernels.awq_layout import (gemv_config, kmajor_to_awq, repack_kmajor,
                                             unpack_kmajor)
from hisparse_cli.kernels.awq_pack import pack_int4, quantize_weight, unpack_int4
from hisparse_cli.kernels.awq_ref import awq_linear, awq_linear_k


def test_hand_built_words():
    # q[k, n] = (k + 3 n) % 16 for 8 input rows and 8 output columns
    codes = torch.tensor([[(k + 3 * n) % 16 for n in range(8)] for k in range(8)])
    qt = repack_kmajor(pack_int4(codes))  # [8 out, 1 word]
    assert qt.shape == (8, 1)
    for n in range(8):  # nibble i of column n's word holds row i, natural order
        expect = sum(((i + 3 * n) % 16) << (4 * i) for i in range(8))
        assert qt[n, 0].item() == (expect - 2**32 if expect >= 2**31 else expect)
    # the AWQ word holding 0..7 in columns 0..7 (0x75316420) becomes one word per column
    qt = repack_kmajor(torch.tensor([[0x75316420]], dtype=torch.int32).repeat(8, 1))
    assert [w & 0xF for w in qt[:, 0].tolist()] == list(range(8))
    assert all(w == int(f"{c:x}" * 8, 16) for c, w in enumerate(qt[:, 0].tolist()))


@pytest.mark.parametrize("k,n", [(8, 8), (64, 40), (256, 136)])
def test_round_trip_against_reference(k, n, monkeypatch):
    g = torch.Generator().manual_seed(k + n)
    qw = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, generator=g)
    monkeypatch.setattr(awq_layout, "REPACK_CHUNK_ELEMS", 8 * k * 2)  # several chunks
    qt = repack_kmajor(qw)
    assert qt.shape == (n, k // 8) and qt.dtype == torch.int32 and qt.is_contiguous()
    assert torch.equal(unpack_kmajor(qt), unpack_int4(qw))  # codes [k, n] agree
    assert torch.equal(kmajor_to_awq(qt), qw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reference_on_kmajor(dtype):
    p = quantize_weight(torch.randn(48, 128), 32)
    x, b = torch.randn(3, 128).to(dtype), torch.randn(48).to(dtype)
    y = awq_linear_k(x, repack_kmajor(p.qweight), p.qzeros, p.scales, b, 32)
    assert torch.equal(y, awq_linear(x, p.qweight, p.qzeros, p.scales, b, 32))


def test_awq_linear_module_kmajor_layout():
    from hisparse_cli.model.awq import AWQLinear

    p = quantize_weight(torch.randn(40, 64), 32)
    lin = AWQLinear.from_checkpoint(p.qweight, p.qzeros, p.scales, None, 32, dtype=torch.float32)
    assert lin.layout == "awq"  # CPU: the checkpoint layout stays
    x = torch.randn(2, 64)
    y = lin(x)
    lin.qweight, lin.layout = repack_kmajor(lin.qweight), "kmajor"  # what CUDA+Triton does
    assert torch.equal(lin.checkpoint_qweight(), p.qweight)
    assert torch.equal(lin(x), y) and "layout=kmajor" in repr(lin)
    assert not AWQLinear.repacks_on(torch.device("cpu"))


@pytest.mark.parametrize("k,n,split", [(4096, 4096, 16), (4096, 1024, 16), (4096, 14336, 4),
                                       (14336, 4096, 16), (4096, 128256, 1)])
def test_gemv_config_llama_shapes(k, n, split):
    cfg = gemv_config(1, k, n, 128, 132)  # H200: 132 SMs
    assert cfg == dict(block_n=32, block_kw=16, split=split, num_warps=2)
    assert (k // 8) % (cfg["block_kw"] * cfg["split"]) == 0
    for group in (32, 64):
        c = gemv_config(3, k, n, group, 46)
        assert c["block_kw"] == group // 8 and (k // 8) % (c["block_kw"] * c["split"]) == 0
