"""Decode's one-row products as column slices on the threads (model/row_split.py): the same
values as the plain product (oracle: a float64 matmul of the same weight), for either weight
layout, with and without bias; the module keeps its parameters (no copies, ties intact)."""

import pytest
import torch
from torch import nn

from hisparse_cli.model.row_split import RowSplitLinear, row_splits, split_row_products


def _linear(in_f, out_f, bias, input_major, seed=0):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(in_f, out_f, bias=bias)
    w = torch.randn(out_f, in_f, generator=g)
    if input_major:  # the loader's decode layout for wide weights: [in, out] storage
        w = w.t().contiguous().t()
    lin.weight = nn.Parameter(w, requires_grad=False)
    if bias:
        lin.bias = nn.Parameter(torch.randn(out_f, generator=g), requires_grad=False)
    return lin


def _oracle(lin, x):
    y = x.double() @ lin.weight.double().t()
    return y + lin.bias.double() if lin.bias is not None else y


@pytest.mark.parametrize("input_major", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("splits", [2, 3, 4])
@pytest.mark.parametrize("rows", [1, 5])
def test_row_split_linear_matches_the_product(input_major, bias, splits, rows):
    lin = _linear(48, 96, bias, input_major)
    split = RowSplitLinear.wrap(lin, splits)
    x = torch.randn(rows, 48, generator=torch.Generator().manual_seed(1))
    y = split(x)
    assert y.shape == (rows, 96) and y.is_contiguous()
    assert torch.allclose(y.double(), _oracle(lin, x), atol=1e-5, rtol=1e-5)


def test_wrap_keeps_the_parameters_and_follows_a_replaced_weight():
    lin = _linear(32, 64, True, False)
    split = RowSplitLinear.wrap(lin, 2)
    assert split.weight is lin.weight and split.bias is lin.bias
    assert [n for n, _ in split.named_parameters()] == ["weight", "bias"]
    assert set(split.state_dict()) == {"weight", "bias"}
    other = _linear(32, 64, True, True, seed=5)
    split.weight, split.bias = other.weight, other.bias
    x = torch.randn(1, 32)
    assert torch.allclose(split(x).double(), _oracle(other, x), atol=1e-5, rtol=1e-5)


def test_row_splits_divides_the_outputs():
    assert row_splits(576, 2) == 2
    assert row_splits(49152, 4) == 4
    assert row_splits(387, 4) == 3  # 4 does not divide 387
    assert row_splits(7 * 128 + 1, 2) == 1  # odd
    assert row_splits(576, 16) == 4  # slices of at least 128 outputs
    assert row_splits(200, 2) == 1
    assert row_splits(576, 1) == 1
    assert row_splits(576, 0) == 1


def test_split_row_products_swaps_cpu_float32_linears_and_keeps_ties():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(512, 8)
            self.a = nn.Linear(8, 256)
            self.fp16 = nn.Linear(8, 256).to(torch.float16)
            self.odd = nn.Linear(8, 257)
            self.narrow = nn.Linear(8, 64)
            self.head = nn.Linear(8, 512, bias=False)
            self.head.weight = self.emb.weight

    m = Tiny()
    params = {id(p) for p in m.parameters()}
    assert split_row_products(m, threads=2) == 2  # a and head
    assert type(m.a) is RowSplitLinear and type(m.head) is RowSplitLinear
    assert m.a.splits == 2 and m.head.splits == 2
    for name in ("fp16", "odd", "narrow"):
        assert type(getattr(m, name)) is nn.Linear, name
    assert m.head.weight is m.emb.weight
    assert {id(p) for p in m.parameters()} == params
    x = torch.randn(1, 8)
    assert torch.allclose(m.head(x), x @ m.emb.weight.t(), atol=1e-6)
    assert split_row_products(Tiny(), threads=1) == 0
