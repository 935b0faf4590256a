"""Torch reference INT4 linear against an fp32 matmul with a weight decoded independently
(per-nibble Python decoder, tests/test_awq_pack.py), and its layout assertions."""

from __future__ import annotations

import pytest
import torch

from hisparse_cli.kernels.int4.awq_pack import quantize_weight
from hisparse_cli.kernels.int4.awq_ref import awq_linear
from test_awq_pack import oracle_unpack_word


def oracle_weight(qweight, qzeros, scales, group) -> torch.Tensor:
    """fp64 W [in, out] = (q - z) * s, decoded word by word."""
    q = torch.tensor([sum((oracle_unpack_word(w) for w in r), []) for r in qweight.tolist()])
    z = torch.tensor([sum((oracle_unpack_word(w) for w in r), []) for r in qzeros.tolist()])
    z = z.repeat_interleave(group, dim=0)
    s = scales.double().repeat_interleave(group, dim=0)
    return (q - z).double() * s


def random_awq(in_f: int, out_f: int, group: int, seed: int = 0, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    p = quantize_weight(torch.randn(out_f, in_f, generator=g) / in_f**0.5, group)
    b = torch.randn(out_f, generator=g) * 0.1 if bias else None
    return p.qweight, p.qzeros, p.scales, b


# tolerance relative to max |y|: one rounding of the output in the dtype, plus fp32 noise
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lead", [(1,), (5,), (2, 3)])
def test_reference_equals_fp32_dequantized_matmul(group, dtype, lead):
    in_f, out_f = 2 * group, 48
    qw, qz, s, b = random_awq(in_f, out_f, group, seed=group)
    x = torch.randn(*lead, in_f).to(dtype)
    y = awq_linear(x, qw, qz, s, b.to(dtype), group)
    assert y.shape == (*lead, out_f) and y.dtype == dtype
    expect = x.double() @ oracle_weight(qw, qz, s, group) + b.to(dtype).double()
    err = (y.double() - expect).abs().max() / expect.abs().max()
    assert err <= TOL[dtype], f"relative error {err:.2e}"


def test_reference_without_bias_and_layout_asserts():
    qw, qz, s, _ = random_awq(64, 16, 32, bias=False)
    x = torch.randn(3, 64)
    assert torch.allclose(awq_linear(x, qw, qz, s, None, 32),
                          (x.double() @ oracle_weight(qw, qz, s, 32)).float(), atol=1e-5)
    with pytest.raises(AssertionError):
        awq_linear(x, qw, qz[:1], s, None, 32)  # qzeros for the wrong group count
    with pytest.raises(AssertionError):
        awq_linear(x, qw, qz, s, None, 64)  # group size disagrees with the tensors
    with pytest.raises(AssertionError):
        awq_linear(torch.randn(3, 32), qw, qz, s, None, 32)  # wrong in_features
