"""The CPU INT4 decode path (kernels/int4/awq_cpu.py: torch's packed int4 kernel on bf16
activations) against the fp32 dequantized matmul, and the dispatch rules around it."""

from __future__ import annotations

import pytest
import torch

from hisparse_cli.kernels.int4 import awq_cpu
from hisparse_cli.kernels.int4.awq_pack import quantize_weight
from hisparse_cli.kernels.int4.awq_ref import awq_linear, dequantize_weight
from hisparse_cli.kernels.dispatch import KernelBackend, select_backend

pytestmark = pytest.mark.skipif(not awq_cpu.int4pack_available(),
                                reason="this torch has no working packed int4 CPU kernel")

# relative to max |y|: x and y rounded to bf16 (8 bits), the scales' bf16 rounding and
# (8 - z) s rounded to bf16 (both exact for the fp16 scales' top 8 bits only)
TOL = 1.5e-2


def layer(k, n, group, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    p = quantize_weight(torch.randn(n, k, generator=g), group)
    b = torch.randn(n, generator=g) if bias else None
    return p, b


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("k,n", [(128, 16), (256, 48), (576, 1728)])
@pytest.mark.parametrize("m", [1, 3, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int4pack_linear_matches_dequantized_matmul(group, k, n, m, dtype):
    if k % group:
        pytest.skip("in_features not a multiple of the group")
    p, b = layer(k, n, group, seed=m, bias=True)
    packed, sz = awq_cpu.pack_for_cpu(p.qweight, p.qzeros, p.scales)
    assert packed.shape == (n, k // 2) and sz.shape == (k // group, n, 2)
    assert (packed.nbytes, sz.nbytes) == awq_cpu.packed_bytes(k, n, group)
    x = torch.randn(2, m, k, generator=torch.Generator().manual_seed(9)).to(dtype)
    y = awq_cpu.int4pack_linear(x, packed, sz, b.to(dtype), group)
    ref = x.float() @ dequantize_weight(p.qweight, p.qzeros, p.scales, group) + b
    assert y.shape == (2, m, n) and y.dtype == dtype
    err = float((y.float() - ref).abs().max() / ref.abs().max())
    assert err <= TOL, err


def test_int4pack_applies_rule():
    assert awq_cpu.int4pack_applies(576, 1728, 64)
    assert not awq_cpu.int4pack_applies(576, 1736, 64)  # out not a multiple of 16
    assert not awq_cpu.int4pack_applies(576, 1728, 16)  # group the kernel does not take
    assert not awq_cpu.int4pack_applies(100, 32, 64)  # in not a multiple of the group


def test_backend_dispatch_threshold_and_reference_switch(monkeypatch):
    p, _ = layer(256, 64, 64)
    packed, sz = awq_cpu.pack_for_cpu(p.qweight, p.qzeros, p.scales)
    args = (p.qweight, p.qzeros, p.scales, None, 64)
    be = select_backend("cpu")
    assert be.int4_linear == "int4pack"
    m = awq_cpu.CPU_INT4_MAX_TOKENS
    x = torch.randn(m + 1, 256)
    # up to the threshold: the packed kernel's result (not the reference's bits) ...
    y = be.awq_linear(x[:m], *args, cpu_pack=(packed, sz))
    assert torch.equal(y, awq_cpu.int4pack_linear(x[:m], packed, sz, None, 64))
    assert not torch.equal(y, awq_linear(x[:m], *args))
    # ... beyond it, and without a packed copy, the reference's bits (a faster dequantize)
    assert torch.equal(be.awq_linear(x, *args, cpu_pack=(packed, sz)), awq_linear(x, *args))
    assert torch.equal(be.awq_linear(x[:1], *args), awq_linear(x[:1], *args))
    empty = be.awq_linear(x[:0], *args, cpu_pack=(packed, sz))  # no rows: the dequantize path
    assert empty.shape == (0, 64)
    ref_be = KernelBackend(int4_linear="torch")
    assert torch.equal(ref_be.awq_linear(x[:1], *args, cpu_pack=(packed, sz)),
                       awq_linear(x[:1], *args))
    monkeypatch.setenv("HISPARSE_BACKEND", "torch")
    assert select_backend("cpu").int4_linear == "torch"


def test_awq_linear_module_keeps_copy_only_where_it_applies(monkeypatch):
    from hisparse_cli.model.awq import AWQLinear

    p, _ = layer(256, 64, 64)
    mod = AWQLinear.from_checkpoint(p.qweight, p.qzeros, p.scales, None, 64)
    assert mod.int4pack is not None
    p2, _ = layer(256, 40, 64)  # out 40: not a multiple of 16
    assert AWQLinear.from_checkpoint(p2.qweight, p2.qzeros, p2.scales, None, 64).int4pack is None
    monkeypatch.setenv("HISPARSE_BACKEND", "torch")
    assert AWQLinear.from_checkpoint(p.qweight, p.qzeros, p.scales, None, 64).int4pack is None


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("k,n", [(128, 8), (256, 200), (1536, 576)])
def test_dequantize_cpu_is_the_references_bits(group, k, n):
    if k % group:
        pytest.skip("in_features not a multiple of the group")
    p, b = layer(k, n, group, seed=k + n, bias=True)
    qw = p.qweight.clone()
    qw[0, 0] = -1  # the sign bit: an arithmetic shift must still give 8 nibbles of 15
    assert torch.equal(awq_cpu.dequantize_cpu(qw, p.qzeros, p.scales, group),
                       dequantize_weight(qw, p.qzeros, p.scales, group))
    x = torch.randn(70, k)
    for xx, bb in ((x, b), (x.bfloat16(), b.bfloat16()), (x[:3], None)):
        assert torch.equal(awq_cpu.awq_linear_dequant(xx, qw, p.qzeros, p.scales, bb, group),
                           awq_linear(xx, qw, p.qzeros, p.scales, bb, group))
