"""Triton INT4 kernels against the fp32 dequantized matmul (the torch reference's oracle).

Without CUDA the kernels run under TRITON_INTERPRET=1 on tiny shapes (seconds); with CUDA the
`gpu` tests sweep group sizes, Llama-like shapes and 1..512 tokens in fp16 and bf16.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first triton import in this process
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from hisparse_cli.kernels import awq_triton  # noqa: E402
from hisparse_cli.kernels.awq_ref import dequantize_weight  # noqa: E402
from test_awq_ref import random_awq  # noqa: E402

CPU = not torch.cuda.is_available()
interp = pytest.mark.skipif(not CPU, reason="interpreter tests run only without CUDA")
gpu = [pytest.mark.gpu, pytest.mark.skipif(CPU, reason="needs CUDA")]

# relative to max |y|: output rounding in the dtype + the dequantized weight rounded to it
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def check(y, x, qw, qz, s, b, group):
    w = dequantize_weight(qw, qz, s, group)  # fp32 [in, out]
    ref = x.float() @ w + (b.float() if b is not None else 0)
    assert y.shape == ref.shape and y.dtype == x.dtype
    err = float((y.float() - ref).abs().max() / ref.abs().max())
    assert err <= TOL[x.dtype], f"relative error {err:.2e} ({x.dtype}, {tuple(x.shape)})"


def case(m, k, n, group, dtype, device, bias=True, seed=0):
    qw, qz, s, b = random_awq(k, n, group, seed=seed, bias=bias)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    to = dict(device=device)
    return (x.to(**to), qw.to(**to), qz.to(**to), s.to(**to),
            None if b is None else b.to(device=device, dtype=dtype))


# -- interpreter (CPU) -----------------------------------------------------------------------
@interp
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("n", [64, 200])  # 200: 25 words, a partial word tile
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("split_k", [1, 2])
def test_gemv_interpreter(group, n, m, split_k):
    x, qw, qz, s, b = case(m, 2 * group, n, group, torch.float16, "cpu")
    check(awq_triton.awq_gemv(x, qw, qz, s, b, group, split_k=split_k), x, qw, qz, s, b, group)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_interpreter_dtypes_no_bias(dtype):
    x, qw, qz, s, b = case(2, 64, 48, 32, dtype, "cpu", bias=False)
    check(awq_triton.awq_gemv(x, qw, qz, s, b, 32, split_k=2), x, qw, qz, s, b, 32)


@interp
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 17])
def test_gemm_interpreter(group, m):
    # fp16 only: the 3.9 interpreter computes bf16 tl.dot wrongly (bf16 is covered on GPU)
    x, qw, qz, s, b = case(m, 2 * group, 72, group, torch.float16, "cpu")
    y = awq_triton.awq_gemm(x, qw, qz, s, b, group, config=(16, 32, 32, 4, 2))
    check(y, x, qw, qz, s, b, group)


@interp
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequant_matmul_interpreter_chunked(dtype, monkeypatch):
    monkeypatch.setattr(awq_triton, "DEQUANT_CHUNK_ELEMS", 64 * 128)  # force 3 column chunks
    x, qw, qz, s, b = case(6, 64, 328, 32, dtype, "cpu")
    check(awq_triton.awq_dequant_matmul(x, qw, qz, s, b, 32), x, qw, qz, s, b, 32)


@interp
@pytest.mark.parametrize("m", [1, 4, 5, 257])
def test_awq_linear_paths_interpreter(m, monkeypatch):
    monkeypatch.setattr(awq_triton, "FUSED_GEMM_MAX_TOKENS", 256)
    x, qw, qz, s, b = case(m, 64, 64, 32, torch.float16, "cpu")
    y = awq_triton.awq_linear(x.view(1, m, 64), qw, qz, s, b, 32)
    assert y.shape == (1, m, 64)
    check(y.view(m, 64), x, qw, qz, s, b, 32)


@interp
def test_launchers_assert_layout():
    x, qw, qz, s, b = case(2, 64, 64, 32, torch.float16, "cpu")
    with pytest.raises(AssertionError):
        awq_triton.awq_gemv(x.t().contiguous().t(), qw, qz, s, b, 32)  # K not unit stride
    with pytest.raises(AssertionError):
        awq_triton.awq_gemv(x, qw, qz, s, b, 32, block_k=64)  # K block straddles groups
    with pytest.raises(AssertionError):
        awq_triton.awq_gemm(x.float(), qw, qz, s, b, 32)  # tl.dot path takes fp16/bf16


# -- CUDA ------------------------------------------------------------------------------------
SHAPES = [(4096, 4096), (4096, 1024), (1024, 4096 + 8 * 13)]  # last: partial tiles


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16, 33, 64, 128, 512])
@pytest.mark.parametrize("fn", ["gemv", "gemm", "dequant_matmul", "linear"])
def test_kernels_cuda(dtype, group, k, n, m, fn, request):
    for mark in gpu:
        request.applymarker(mark)
    if CPU:
        pytest.skip("needs CUDA")
    if fn == "gemv" and m > 16:
        pytest.skip("GEMV is for few tokens")
    x, qw, qz, s, b = case(m, k, n, group, dtype, "cuda", seed=m)
    y = getattr(awq_triton, f"awq_{fn}")(x, qw, qz, s, b, group)
    check(y, x, qw, qz, s, b, group)
