"""AWQ GEMM packing: hand-built words against the specified nibble order, round trips, and the
group-wise INT4 grid. Oracle: a per-nibble Python decoder written from the format description
(nibble p of a word holds logical column [0, 2, 4, 6, 1, 3, 5, 7][p])."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_cli.kernels.int4.awq_pack import (fake_quantize, group_minmax_params, pack_int4,
                                           quantize_weight, unpack_int4)
from hisparse_cli.kernels.int4.awq_ref import dequantize_weight

SPEC_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def to_int32(u: int) -> int:
    return u - (1 << 32) if u >= 1 << 31 else u


def oracle_unpack_word(word: int) -> list[int]:
    """One int32 word -> 8 logical column values, decoded nibble by nibble."""
    u = word & 0xFFFFFFFF
    cols = [0] * 8
    for p in range(8):
        cols[SPEC_ORDER[p]] = (u >> (4 * p)) & 0xF
    return cols


def test_values_0_to_7_pack_to_the_published_word():
    word = pack_int4(torch.arange(8).view(1, 8))
    assert word.dtype == torch.int32 and word.shape == (1, 1)
    assert int(word) == 0x75316420


def test_high_values_pack_to_a_negative_int32_word():
    word = pack_int4(torch.arange(8, 16).view(1, 8))
    assert int(word) == to_int32(0xFDB9ECA8)


def test_hand_built_words_unpack_in_spec_order():
    words = torch.tensor([[0x75316420, to_int32(0xFDB9ECA8)], [0, -1]], dtype=torch.int32)
    codes = unpack_int4(words)
    assert codes.tolist() == [list(range(8)) + list(range(8, 16)), [0] * 8 + [15] * 8]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=12),
       st.integers(1, 3))
def test_unpack_matches_per_nibble_oracle_and_repacks(flat, rows):
    words = torch.tensor(flat * rows, dtype=torch.int32).view(rows, len(flat))
    codes = unpack_int4(words)
    expect = [sum((oracle_unpack_word(w) for w in row), []) for row in words.tolist()]
    assert codes.tolist() == expect
    assert torch.equal(pack_int4(codes), words)


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError):
        pack_int4(torch.zeros(2, 7, dtype=torch.int64))
    with pytest.raises(ValueError):
        pack_int4(torch.full((1, 8), 16))
    with pytest.raises(ValueError):
        unpack_int4(torch.zeros(1, 1, dtype=torch.int64))


@pytest.mark.parametrize("group", [32, 64, 128])
def test_quantize_weight_layout_and_dequant(group):
    torch.manual_seed(group)
    out_f, in_f = 24, 2 * group
    w = torch.randn(out_f, in_f)
    p = quantize_weight(w, group)
    assert p.qweight.shape == (in_f, out_f // 8) and p.qweight.dtype == torch.int32
    assert p.qzeros.shape == (in_f // group, out_f // 8) and p.qzeros.dtype == torch.int32
    assert p.scales.shape == (in_f // group, out_f) and p.scales.dtype == torch.float16
    # qzeros decode (same packing) to the zero points of the grid, per (group, out column)
    scale, zero = group_minmax_params(w, group)
    z = torch.tensor([sum((oracle_unpack_word(x) for x in row), []) for row in p.qzeros.tolist()])
    assert torch.equal(z, zero.t().long())
    # the packed weight dequantizes to the fake-quantized weight, within half a step of w
    deq = dequantize_weight(p.qweight, p.qzeros, p.scales, group).t()  # [out, in]
    assert torch.allclose(deq, fake_quantize(w, group), atol=1e-6)
    step = p.scales.float().t().repeat_interleave(group, dim=1)
    assert ((deq - w).abs() <= step / 2 + 1e-6).all()


def test_grid_keeps_zero_and_clip_ranges():
    w = torch.tensor([[0.5, 1.0, 2.0, 3.0] * 8])  # all positive: the grid still reaches 0
    scale, zero = group_minmax_params(w, 32)
    assert float(zero) == 0 and float(scale) == float(torch.tensor(3.0 / 15).half())
    clipped = fake_quantize(w, 32, wmin=torch.zeros(1, 1), wmax=torch.full((1, 1), 1.5))
    assert float(clipped.max()) == pytest.approx(1.5, abs=1e-3)
