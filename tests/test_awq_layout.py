"""The K-major run-time INT4 layout (kernels/int4/awq_layout.py): repack against the reference
unpacking and hand-built words, its inverse, the torch reference on it, AWQLinear's repack,
and the GEMV launch choices the planner mirrors."""

from __future__ import annotations

import pytest
import torch

from hisparse_cli.kernels.int4 import awq_layout
from hisparse_cli.kernels.int4.awq_layout import (GemvConfig, gemv_config, kmajor_to_awq,
                                             repack_kmajor, unpack_kmajor)
from hisparse_cli.kernels.int4.awq_pack import pack_int4, quantize_weight, unpack_int4
from hisparse_cli.kernels.int4.awq_ref import awq_linear, awq_linear_k


def test_hand_built_words():
    # q[k, n] = (k + 3 n) % 16 for 32 input rows (one run of 4 words) and 8 output columns
    codes = torch.tensor([[(k + 3 * n) % 16 for n in range(8)] for k in range(32)])
    qt = repack_kmajor(pack_int4(codes))  # [8 out, 4 words]
    assert qt.shape == (8, 4)
    for n in range(8):  # nibble i of word j holds input row 4 i + j
        for j in range(4):
            expect = sum(((4 * i + j + 3 * n) % 16) << (4 * i) for i in range(8))
            assert qt[n, j].item() == (expect - 2**32 if expect >= 2**31 else expect)
    # the AWQ word holding 0..7 in columns 0..7 (0x75316420) becomes one word per column
    qt = repack_kmajor(torch.tensor([[0x75316420]], dtype=torch.int32).repeat(32, 1))
    assert [w & 0xF for w in qt[:, 0].tolist()] == list(range(8))
    assert all(w == int(f"{c:x}" * 8, 16) for c, w in enumerate(qt[:, 0].tolist()))


@pytest.mark.parametrize("k,n", [(32, 8), (64, 40), (256, 136)])
def test_round_trip_against_reference(k, n, monkeypatch):
    g = torch.Generator().manual_seed(k + n)
    qw = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, generator=g)
    monkeypatch.setattr(awq_layout, "REPACK_CHUNK_ELEMS", 8 * k * 2)  # several chunks
    monkeypatch.setattr(awq_layout, "TO_AWQ_CHUNK_ELEMS", 8 * k * 2)
    qt = repack_kmajor(qw)
    assert qt.shape == (n, k // 8) and qt.dtype == torch.int32 and qt.is_contiguous()
    assert torch.equal(unpack_kmajor(qt), unpack_int4(qw))  # codes [k, n] agree
    assert torch.equal(kmajor_to_awq(qt), qw)


@pytest.mark.parametrize("k,n,group,chunk_rows", [(128, 192, 128, 64), (256, 320, 64, 128),
                                                   (128, 64, 32, 512)])
def test_tiled_back_to_awq_in_chunks(k, n, group, chunk_rows, monkeypatch):
    """kmajor_to_awq of the tiled order, converted a few 64-row tiles at a time (bounded
    temporaries at load, H200 run 137), gives back the AWQ words; so does one chunk."""
    g = torch.Generator().manual_seed(k * n + group)
    qw = torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, generator=g)
    tiled = awq_layout.tile_kmajor(repack_kmajor(qw), group)
    monkeypatch.setattr(awq_layout, "TO_AWQ_CHUNK_ELEMS", chunk_rows * k)
    assert torch.equal(kmajor_to_awq(tiled, tiled_group=group), qw)
    assert torch.equal(kmajor_to_awq(awq_layout.untile_kmajor(tiled, group)), qw)


def test_kmajor_to_awq_temporaries_are_bounded(monkeypatch):
    """No chunk converts more than TO_AWQ_CHUNK_ELEMS codes (rounded up to one 64-row tile)."""
    from hisparse_cli.kernels.int4 import awq_pack

    seen = []
    real = awq_pack.pack_int4
    monkeypatch.setattr(awq_pack, "pack_int4", lambda c: seen.append(c.numel()) or real(c))
    monkeypatch.setattr(awq_layout, "TO_AWQ_CHUNK_ELEMS", 64 * 512)
    qw = torch.randint(-2**31, 2**31 - 1, (512, 1024 // 8), dtype=torch.int32)
    tiled = awq_layout.tile_kmajor(repack_kmajor(qw), 128)
    assert torch.equal(kmajor_to_awq(tiled, tiled_group=128), qw)
    assert len(seen) == 1024 // 64 and max(seen) == 64 * 512


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
def test_gemv_config_llama_shapes(k, n, split, monkeypatch):
    flat = awq_layout.GemvTile(block_n=32, num_warps=2, num_stages=3, programs_per_sm=16)
    monkeypatch.setattr(awq_layout, "GEMV_TABLE", dict.fromkeys(awq_layout.GEMV_TABLE, flat))
    cfg = gemv_config(1, k, n, 128, 132)  # H200: 132 SMs
    assert cfg == GemvConfig(block_n=32, block_kw=16, split=split, num_warps=2, num_stages=3)
    assert gemv_config(4, k, n, 128, 132) == cfg  # all tokens in one program: same grid


@pytest.mark.parametrize("k,n", [(4096, 6144), (4096, 1024), (4096, 28672), (14336, 4096),
                                 (4096, 128256), (256, 40)])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_gemv_config_valid_for_every_shape(k, n, group):
    for sms in (1, 46, 132):
        for m in range(1, awq_layout.GEMV_MAX_TOKENS + 1):
            c = gemv_config(m, k, n, group, sms)
            steps = (k // 8) // c.block_kw
            assert c.block_kw == min(group // 8, 16) and steps % c.split == 0
            assert c.split == 1 or steps // c.split >= 2


def test_gemv_config_rejects_bad_fields():
    with pytest.raises(ValueError, match="block_kw"):
        GemvConfig(block_n=32, block_kw=2, split=1, num_warps=2, num_stages=1)
    with pytest.raises(ValueError, match="split"):
        GemvConfig(block_n=32, block_kw=16, split=3, num_warps=2, num_stages=1)
    with pytest.raises(ValueError, match="stream"):
        GemvConfig(block_n=32, block_kw=16, split=1, num_warps=2, num_stages=1, stream=3)
    with pytest.raises(ValueError, match="packed"):
        GemvConfig(block_n=32, block_kw=16, split=1, num_warps=2, num_stages=1, packed=3)
    with pytest.raises(ValueError, match="maxnreg"):
        GemvConfig(block_n=32, block_kw=16, split=1, num_warps=2, num_stages=1, maxnreg=300)


@pytest.mark.parametrize("n", [6144, 4096, 28672, 128256, 40])
def test_gemm_config_and_prefill_path(n):
    for m in (5, 16, 17, 64, 65, 256, 1000, 1024, 2048, 5000):
        c = awq_layout.gemm_config(m, n)
        bucket = awq_layout.gemm_m_bucket(m)
        table = awq_layout.GEMM_TABLE[(bucket, awq_layout.gemv_shape_class(n))]
        assert (c.block_n, c.block_k, c.num_warps, c.num_stages) == (
            table.block_n, table.block_k, table.num_warps, table.num_stages)
        assert c.block_m == min(table.block_m, max(16, 1 << (m - 1).bit_length())) >= min(m, 16)
        fused = m <= awq_layout.FUSED_MAX_TOKENS[awq_layout.gemv_shape_class(n)]
        assert awq_layout.prefill_path(m, n, 2) == ("fused" if fused else "dequant")
        assert awq_layout.prefill_path(m, n, 4) == "dequant"  # fp32: dequantize + cuBLAS
    assert [awq_layout.gemm_m_bucket(m) for m in (64, 65, 256, 1024, 1025)] == [
        "m64", "m256", "m256", "m1024", "m_large"]


def test_gemm_config_rejects_bad_fields():
    with pytest.raises(ValueError, match="block_k"):
        awq_layout.GemmConfig(block_m=64, block_n=64, block_k=16, num_warps=4, num_stages=3)
    with pytest.raises(ValueError, match="block_m"):
        awq_layout.GemmConfig(block_m=8, block_n=64, block_k=64, num_warps=4, num_stages=3)
    with pytest.raises(ValueError, match="num_warps"):
        awq_layout.GemmConfig(block_m=64, block_n=64, block_k=64, num_warps=3, num_stages=3)
