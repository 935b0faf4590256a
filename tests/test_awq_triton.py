"""Triton INT4 kernels against the fp32 dequantized matmul (the torch reference's oracle).

Without CUDA the kernels run under TRITON_INTERPRET=1 on tiny shapes (seconds); with CUDA the
`gpu` tests sweep group sizes, Llama-like shapes and 1..512 tokens in fp16 and bf16.
"""

from __future__ import annotations

from dataclasses import replace
import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first triton import in this process
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from hisparse_cli.kernels.int4 import awq_gemm_k  # noqa: E402
from hisparse_cli.kernels.int4 import awq_gemv  # noqa: E402
from hisparse_cli.kernels.int4 import awq_layout  # noqa: E402
from hisparse_cli.kernels.int4 import awq_triton  # noqa: E402
from hisparse_cli.kernels.int4.awq_layout import GemmConfig, GemvConfig  # noqa: E402
from hisparse_cli.kernels.int4.awq_ref import dequantize_weight  # noqa: E402
from test_awq_ref import random_awq  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402,F401 - the interpreter wants it in jit'd globals

CPU = not torch.cuda.is_available()


@triton.jit
def _no_pdl_wait(WAIT, TRIGGER):
    """kernels/pdl.enter without gdc_wait (the interpreter has none): PDL forced on in tests."""
    pass
interp = pytest.mark.skipif(not CPU, reason="interpreter tests run only without CUDA")

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


def test_set_layout_reaches_the_k_major_layouts_from_the_awq_one():
    """set_layout("kmajor" / "tiled") on a linear in the AutoAWQ layout (as its docstring
    says: every layout is reached through the AutoAWQ tensors): the same words as the loader's
    repack, the checkpoint layout given back exactly, the same outputs; a shape whose rows do
    not fill 64-row tiles stays K-major (and says so)."""
    from hisparse_cli.model.awq import AWQLinear

    g = torch.Generator().manual_seed(5)
    w = torch.randn(128, 256, generator=g) / 16
    x = torch.randn(3, 256, generator=g).half()
    for layout in ("kmajor", "tiled"):
        q = AWQLinear.from_float(w, None, 32, dtype=torch.float16)
        p_qw = q.qweight.clone()
        want = x.float() @ dequantize_weight(p_qw, q.qzeros, q.scales, 32)  # exact, fp32
        assert q.layout == "awq" and q.set_layout(layout) and q.layout == layout
        tiled = 32 if layout == "tiled" else None
        assert torch.equal(q.qweight, awq_layout.repack_kmajor(p_qw, tiled))
        assert torch.equal(q.checkpoint_qweight(), p_qw)
        err = float((q(x).float() - want).abs().max() / want.abs().max())
        assert err <= 4e-3, err  # one rounding to fp16 (the reference backend, K-major)
    odd = AWQLinear.from_float(torch.randn(72, 256, generator=g) / 16, None, 32,
                               dtype=torch.float16)
    assert not odd.set_layout("tiled") and odd.layout == "kmajor"


@pytest.mark.gpu
@pytest.mark.skipif(CPU, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16, 33, 64, 128, 512])
@pytest.mark.parametrize("fn", ["gemv", "gemm", "dequant_matmul", "linear"])
def test_kernels_cuda(dtype, group, k, n, m, fn):
    if fn == "gemv" and m > 16:
        pytest.skip("GEMV is for few tokens")
    x, qw, qz, s, b = case(m, k, n, group, dtype, "cuda", seed=m)
    y = getattr(awq_triton, f"awq_{fn}")(x, qw, qz, s, b, group)
    check(y, x, qw, qz, s, b, group)


# -- K-major layout (kernels/int4/awq_layout.py): what AWQLinear runs on CUDA -----------------------
def case_k(m, k, n, group, dtype, device, bias=True, seed=0):
    from hisparse_cli.kernels.int4.awq_layout import repack_kmajor

    x, qw, qz, s, b = case(m, k, n, group, dtype, device, bias=bias, seed=seed)
    return x, qw, repack_kmajor(qw), qz, s, b


def gemv_cfg(group, block_n=16, split=1, num_stages=1):
    return GemvConfig(block_n=block_n, block_kw=min(16, group // 8), split=split, num_warps=2,
                      num_stages=num_stages)


@interp
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_gemv_k_interpreter_tokens(group, m):
    # n 200: 12.5 tiles of 16 columns (a partial tile); 3 loop steps of one group each
    x, qw, qt, qz, s, b = case_k(m, 3 * group, 200, group, torch.float16, "cpu", seed=m)
    check(awq_gemv.awq_gemv_k(x, qt, qz, s, b, group, config=gemv_cfg(group)),
          x, qw, qz, s, b, group)


@interp
@pytest.mark.parametrize("split,m", [(2, 1), (4, 3), (2, 4)])
@pytest.mark.parametrize("group", [32, 128])
def test_gemv_k_interpreter_split(split, m, group):
    # K = 4 groups: split 4 gives every program one step; bias only added by the reduction
    x, qw, qt, qz, s, b = case_k(m, 4 * group, 40, group, torch.float16, "cpu", seed=split)
    cfg = gemv_cfg(group, block_n=32, split=split, num_stages=2)
    check(awq_gemv.awq_gemv_k(x, qt, qz, s, b, group, config=cfg), x, qw, qz, s, b, group)


@interp
@pytest.mark.parametrize("split,m", [(1, 1), (2, 3), (4, 4)])
@pytest.mark.parametrize("group", [32, 128])
def test_gemv_k_interpreter_prefetch_same_bits(split, m, group):
    """The register-prefetch loop (next step's words loaded before this one computes; the
    last step reloads itself) adds the same terms in the same order as the plain loop."""
    x, qw, qt, qz, s, b = case_k(m, 8 * group, 40, group, torch.float16, "cpu", seed=split)
    plain = awq_gemv.awq_gemv_k(x, qt, qz, s, b, group, config=gemv_cfg(group, 32, split))
    cfg = GemvConfig(block_n=32, block_kw=min(16, group // 8), split=split, num_warps=1,
                     num_stages=1, prefetch=1)
    y = awq_gemv.awq_gemv_k(x, qt, qz, s, b, group, config=cfg)
    assert torch.equal(y, plain)
    check(y, x, qw, qz, s, b, group)


@interp
@pytest.mark.parametrize("stream,prefetch", [(1, 0), (2, 0), (2, 1)])
@pytest.mark.parametrize("split,m", [(1, 1), (2, 4)])
def test_gemv_k_interpreter_stream_same_bits(stream, prefetch, split, m):
    """The cache hints of GemvConfig.stream change where the words and x are cached, never
    the arithmetic: the same bits as the plain loop."""
    x, qw, qt, qz, s, b = case_k(m, 4 * 128, 40, 128, torch.float16, "cpu", seed=stream)
    plain = awq_gemv.awq_gemv_k(x, qt, qz, s, b, 128, config=gemv_cfg(128, 32, split))
    cfg = GemvConfig(block_n=32, block_kw=16, split=split, num_warps=2, num_stages=1,
                     prefetch=prefetch, stream=stream)
    y = awq_gemv.awq_gemv_k(x, qt, qz, s, b, 128, config=cfg)
    assert torch.equal(y, plain)
    check(y, x, qw, qz, s, b, 128)


def test_repack_straight_into_tiles(monkeypatch):
    """repack_kmajor(tiled_group=...) writes tile_kmajor's order chunk by chunk (chunks of
    whole 64-row tiles, here several of them): the same tensor as tiling the K-major one."""
    from hisparse_cli.kernels.int4.awq_layout import repack_kmajor, tile_kmajor
    from hisparse_cli.kernels.int4.awq_pack import quantize_weight

    p = quantize_weight(torch.randn(320, 256, generator=torch.Generator().manual_seed(1)), 64)
    monkeypatch.setattr(awq_layout, "REPACK_CHUNK_ELEMS", 8 * 256 * 3)  # 3 words: rounded up
    assert torch.equal(repack_kmajor(p.qweight, 64), tile_kmajor(repack_kmajor(p.qweight), 64))


def test_tile_kmajor_puts_each_word_where_the_formula_says():
    """awq_layout.tile_kmajor: word (n, w) at ((n // 64) KW/T + w // T) 64 T + (n % 64) T +
    w % T (T = tile_words(group)); untile_kmajor inverts it."""
    from hisparse_cli.kernels.int4.awq_layout import tile_kmajor, tile_words, untile_kmajor

    for group, (n, kw) in ((128, (128, 48)), (32, (192, 12)), (64, (64, 8))):
        qt = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, kw), dtype=torch.int32,
                           generator=torch.Generator().manual_seed(group))
        tiled = tile_kmajor(qt, group)
        t, flat = tile_words(group), tiled.reshape(-1)
        assert tiled.shape == qt.shape
        for r, w in ((0, 0), (63, t - 1), (64 % n, 0), (n - 1, kw - 1), (5, t % kw),
                     (70 % n, kw - t + 1)):
            at = ((r // 64) * (kw // t) + w // t) * 64 * t + (r % 64) * t + w % t
            assert flat[at] == qt[r, w], (group, r, w)
        assert torch.equal(untile_kmajor(tiled, group), qt)


@interp
@pytest.mark.parametrize("group,block_n,split,m,packed,prefetch", [
    (128, 64, 1, 1, 2, 0), (128, 128, 2, 4, 2, 0), (32, 64, 2, 3, 0, 0),
    (64, 128, 1, 2, 1, 1), (128, 64, 4, 1, 0, 1)])
def test_gemv_k_interpreter_tiled_same_bits(group, block_n, split, m, packed, prefetch):
    """GemvConfig.tiled reads the words in tile_kmajor's order: the same words into the same
    arithmetic, so the same bits as the plain K-major layout, for every path (packed 0/1/2,
    the register prefetch, split-K, 128-row programs spanning two tiles, partial last tile of
    columns masked by n)."""
    from hisparse_cli.kernels.int4.awq_layout import tile_kmajor

    n = 192  # three 64-row tiles; block_n 128: the second program's upper half is masked
    x, qw, qt, qz, s, b = case_k(m, 8 * group, n, group, torch.float16, "cpu", seed=m)
    kw = dict(block_n=block_n, block_kw=min(16, group // 8), split=split, num_warps=2,
              num_stages=1, prefetch=prefetch, packed=packed)
    plain = awq_gemv.awq_gemv_k(x, qt, qz, s, b, group, config=GemvConfig(**kw))
    y = awq_gemv.awq_gemv_k(x, tile_kmajor(qt, group), qz, s, b, group,
                            config=GemvConfig(**kw, tiled=1))
    assert torch.equal(y, plain)
    check(y, x, qw, qz, s, b, group)
    if group > 32:  # a step must be one whole tile: block_kw = the group's tile width
        with pytest.raises(AssertionError, match="tiled GEMV"):
            awq_gemv.awq_gemv_k(x, qt, qz, s, b, group,
                                config=GemvConfig(**{**kw, "block_kw": 4}, tiled=1))


@interp
@pytest.mark.parametrize("group,split,m,packed,tiled", [
    (128, 1, 1, 2, 0), (128, 2, 4, 2, 1), (32, 2, 3, 0, 0), (64, 1, 2, 1, 1), (128, 8, 1, 2, 0)])
def test_gemv_k_interpreter_pdl_same_bits(group, split, m, packed, tiled, monkeypatch):
    """With PDL a program loads its first K step before the wait and runs it peeled from the
    loop: the same words into the same arithmetic, so the bits of no PDL. The interpreter
    has no gdc_wait, so PDL is forced on with a no-op wait (the interpreter ignores
    launch_pdl). Split 8 leaves a program one step (the peeled step alone)."""
    monkeypatch.setattr(awq_gemv, "pdl_enabled", lambda device: True)
    monkeypatch.setattr(awq_gemv, "pdl_enter", _no_pdl_wait)
    x, qw, qt, qz, s, b = case_k(m, 8 * group, 192, group, torch.float16, "cpu", seed=m)
    w = awq_layout.tile_kmajor(qt, group) if tiled else qt
    kw = dict(block_n=64, block_kw=min(16, group // 8), split=split, num_warps=2, num_stages=1,
              packed=packed, tiled=tiled)
    plain = awq_gemv.awq_gemv_k(x, w, qz, s, b, group, config=GemvConfig(**kw))
    one = awq_gemv.awq_gemv_k(x, w, qz, s, b, group, config=GemvConfig(**kw, pdl=1))
    assert torch.equal(one, plain)
    check(one, x, qw, qz, s, b, group)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [1, 2])
def test_gemv_k_interpreter_dtypes(dtype, split):
    x, qw, qt, qz, s, b = case_k(2, 256, 48, 64, dtype, "cpu", bias=split == 1)
    cfg = gemv_cfg(64, split=split)
    check(awq_gemv.awq_gemv_k(x, qt, qz, s, b, 64, config=cfg), x, qw, qz, s, b, 64)


@interp
def test_gemv_k_interpreter_default_config_and_strided_x():
    # rows of x with a stride > K (a slice of a wider buffer), the table's own config
    x, qw, qt, qz, s, b = case_k(3, 256, 64, 128, torch.float16, "cpu")
    wide = torch.zeros(3, 256 + 32, dtype=torch.float16)
    wide[:, :256] = x
    y = awq_gemv.awq_gemv_k(wide[:, :256], qt, qz, s, b, 128)
    check(y, x, qw, qz, s, b, 128)


@interp
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequantize_k_interpreter(group, dtype):
    _, qw, qt, qz, s, _ = case_k(1, 2 * group, 136, group, dtype, "cpu")
    w = dequantize_weight(qw, qz, s, group).t()  # fp32 W^T [n, k], exact
    wt = awq_triton.awq_dequantize_k(qt, qz, s, group, dtype, block_n=32)
    if dtype == torch.float16:
        assert torch.equal(wt, w.half())
    else:  # the 3.9 interpreter truncates fp32 -> bf16 (the GPU rounds to nearest)
        assert torch.allclose(wt.float(), w, rtol=2**-7, atol=0)
    part = awq_triton.awq_dequantize_k(qt, qz, s, group, dtype, n0=40, n1=96)
    assert torch.equal(part, wt[40:96])


@interp
@pytest.mark.parametrize("m", [1, 4, 5, 70])
def test_awq_linear_k_paths_interpreter(m, monkeypatch):
    monkeypatch.setattr(awq_triton, "DEQUANT_CHUNK_ELEMS_K", 128 * 64)  # 64-row W^T chunks
    x, qw, qt, qz, s, b = case_k(m, 128, 200, 32, torch.float16, "cpu")
    y = awq_triton.awq_linear_k(x.view(1, m, 128), qt, qz, s, b, 32)
    assert y.shape == (1, m, 200)
    check(y.view(m, 200), x, qw, qz, s, b, 32)


@interp
@pytest.mark.parametrize("m", [1, 5, 70])
@pytest.mark.parametrize("chunked", [False, True])
def test_prepared_linear_k_equals_awq_linear_k(m, chunked, monkeypatch):
    """What AWQLinear runs per call (weights checked once, launch constants kept) gives the
    bits of awq_linear_k on every path (GEMV, fused GEMM at 5 tokens, dequantize + cuBLAS in
    one or several W^T chunks) and still checks x."""
    if chunked:
        monkeypatch.setattr(awq_triton, "DEQUANT_CHUNK_ELEMS_K", 128 * 64)  # 64-row chunks
    monkeypatch.setitem(awq_layout.FUSED_MAX_TOKENS, "small_n", 8)
    x, qw, qt, qz, s, b = case_k(m, 128, 200, 32, torch.float16, "cpu")
    lin = awq_triton.PreparedLinearK(qt, qz, s, b, 32)
    y = lin(x.view(1, m, 128))
    assert y.shape == (1, m, 200)
    assert torch.equal(y[0], awq_triton.awq_linear_k(x, qt, qz, s, b, 32))
    assert torch.equal(awq_triton.awq_linear_k(x, qt, qz, s, b, 32, checked=True), y[0])
    with pytest.raises(AssertionError):  # x of the wrong width
        lin(torch.zeros(m, 96, dtype=torch.float16))
    with pytest.raises(AssertionError):  # 1 x 4 x 96: as many elements as 3 rows of 128
        lin(torch.zeros(1, 4, 96, dtype=torch.float16))
    with pytest.raises(AssertionError):  # the weights are checked when prepared
        awq_triton.PreparedLinearK(qw, qz, s, b, 32)


@interp
@pytest.mark.parametrize("m,group", [(1, 128), (4, 32), (5, 64), (70, 128), (70, 32)])
def test_prepared_linear_k_tiled_same_bits(m, group, monkeypatch):
    """Tiled words (awq_layout.tile_kmajor) through PreparedLinearK(tiled=True): the bits of
    the K-major layout on every path - the GEMV (1, 4 tokens), the fused GEMM (5: its block_k
    64 reads half a tile's width a step, block_kw 8 of 16) and dequantize + matmul (70)."""
    monkeypatch.setitem(awq_layout.FUSED_MAX_TOKENS, "small_n", 8)
    x, qw, qt, qz, s, b = case_k(m, 2 * 128, 192, group, torch.float16, "cpu", seed=m)
    plain = awq_triton.PreparedLinearK(qt, qz, s, b, group)
    tiled = awq_triton.PreparedLinearK(awq_layout.tile_kmajor(qt, group), qz, s, b, group,
                                       tiled=True)
    assert torch.equal(tiled(x), plain(x))
    gemm = awq_triton.awq_gemm_k(x, awq_layout.tile_kmajor(qt, group), qz, s, b, group,
                                 config=awq_layout.GemmConfig(block_m=16, block_n=64,
                                                              block_k=64, num_warps=4,
                                                              num_stages=1), tiled=True)
    assert torch.equal(gemm, awq_triton.awq_gemm_k(
        x, qt, qz, s, b, group, config=awq_layout.GemmConfig(block_m=16, block_n=64, block_k=64,
                                                            num_warps=4, num_stages=1)))
    w = awq_triton.awq_dequantize_k(awq_layout.tile_kmajor(qt, group), qz, s, group,
                                    torch.float16, n0=64, n1=192, tiled=True)
    assert torch.equal(w, awq_triton.awq_dequantize_k(qt, qz, s, group, torch.float16, n0=64,
                                                      n1=192))
    with pytest.raises(AssertionError, match="64-row tiles"):  # rows must fill whole tiles
        awq_triton.PreparedLinearK(qt[:136], qz[:, :17].contiguous(),
                                   s[:, :136].contiguous(), None, group, tiled=True)


@pytest.mark.gpu
@pytest.mark.skipif(CPU, reason="needs CUDA")
@pytest.mark.parametrize("chunked", [False, True])
def test_prepared_linear_k_graph_dequantize_cuda(chunked, monkeypatch):
    """On CUDA the prefill path replays its dequantize from CUDA graphs, one per (W^T rows,
    workspace address): the bits of the eager path on every call (the first captures), at
    most GRAPHS_PER_LINEAR graphs, from another stream too, and inside someone else's graph
    capture the launch is captured there (no nested capture)."""
    if chunked:
        monkeypatch.setattr(awq_triton, "DEQUANT_CHUNK_ELEMS_K", 1024 * 256)  # 256-row chunks
    x, qw, qt, qz, s, b = case_k(300, 1024, 1000, 128, torch.float16, "cuda")
    ref = awq_triton.awq_linear_k(x, qt, qz, s, b, 128)
    lin = awq_triton.PreparedLinearK(qt, qz, s, b, 128)
    for _ in range(4):
        assert torch.equal(lin(x), ref)
    rows = ({(n0, min(1000, n0 + 256)) for n0 in range(0, 1000, 256)} if chunked
            else {(0, 1000)})
    assert lin.graphs and {key[:2] for key in lin.graphs} <= rows
    assert len(lin.graphs) <= awq_triton.GRAPHS_PER_LINEAR
    held = [torch.empty(1 << 22, device="cuda") for _ in range(3)]  # move the allocator along
    for _ in range(2):
        assert torch.equal(lin(x), ref)
    assert len(lin.graphs) <= awq_triton.GRAPHS_PER_LINEAR
    del held
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = lin(x)
    torch.cuda.synchronize()
    assert torch.equal(y, ref)
    xb = x.to(torch.bfloat16)  # another activation dtype: its own graphs (the kernel's output
    yb = lin(xb)                # dtype is compiled in), the bits of the eager path
    assert torch.equal(yb, awq_triton.awq_linear_k(xb, qt, qz, s, b, 128))
    before = dict(lin.graphs)
    outer = torch.cuda.CUDAGraph()
    with torch.cuda.graph(outer):
        y_static = lin(x)
    outer.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_static, ref) and lin.graphs == before


@interp
def test_k_launchers_assert_layout():
    x, qw, qt, qz, s, b = case_k(2, 64, 128, 32, torch.float16, "cpu")
    with pytest.raises(AssertionError):
        awq_triton.awq_gemv_k(x, qw, qz, s, b, 32)  # AWQ-layout words, not K-major
    with pytest.raises(AssertionError):  # a K step straddling two groups
        awq_triton.awq_gemv_k(x, qt, qz, s, b, 32, config=gemv_cfg(64))
    with pytest.raises(AssertionError):  # 5 tokens: the dequantize + cuBLAS path's job
        awq_triton.awq_gemv_k(torch.cat([x, x, x[:1]]), qt, qz, s, b, 32)


@interp
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m,block_m", [(5, 16), (37, 32)])  # 37: a partial token tile
def test_gemm_k_interpreter(group, m, block_m):
    # n 200: 3.1 tiles of 64 columns; K 2 groups: block_k 128 capped at group 32/64
    x, qw, qt, qz, s, b = case_k(m, 2 * group, 200, group, torch.float16, "cpu", seed=m)
    cfg = GemmConfig(block_m=block_m, block_n=64, block_k=128, num_warps=4, num_stages=2)
    check(awq_gemm_k.awq_gemm_k(x, qt, qz, s, b, group, config=cfg), x, qw, qz, s, b, group)


def _gemm_packed_same_bits(group, tiled, monkeypatch):
    """awq_gemm_k's packed dequantization: fp16 x through it (PTX on CUDA, its fp32
    emulation in the interpreter) gives the bits of the fp32-path dequantization: the same
    fp16 (q - z) s values into the same dot."""
    dev = "cpu" if CPU else "cuda"
    x, qw, qt, qz, s, b = case_k(37, 2 * group, 192, group, torch.float16, dev, seed=3)
    s = s * torch.linspace(0.5, 3.0, s.numel(), device=dev).view(s.shape).to(s.dtype)
    words = awq_layout.tile_kmajor(qt, group) if tiled else qt
    cfg = GemmConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=2)
    ys = []
    for packed in (True, False):
        ys.append(awq_gemm_k.awq_gemm_k(x, words, qz, s, b, group, config=cfg, tiled=tiled,
                                        packed=packed))
    assert torch.equal(ys[0], ys[1])
    check(ys[0], x, qw, qz, s, b, group)


@interp
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("tiled", [False, True])
def test_gemm_k_packed_dequant_same_bits_interpreter(group, tiled, monkeypatch):
    _gemm_packed_same_bits(group, tiled, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(CPU, reason="needs CUDA")
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("tiled", [False, True])
def test_gemm_k_packed_dequant_same_bits_cuda(group, tiled, monkeypatch):
    _gemm_packed_same_bits(group, tiled, monkeypatch)


@interp
def test_gemm_k_interpreter_fp32_strided_x_no_bias():
    # fp32 activations (IEEE products); rows of x with a stride > K, as a column half of a
    # wider buffer (gate|up's outputs); the table's own config (gemm_config)
    x, qw, qt, qz, s, _ = case_k(9, 128, 48, 64, torch.float32, "cpu", bias=False)
    wide = torch.zeros(9, 2 * 128, dtype=torch.float32)
    wide[:, 128:] = x
    check(awq_gemm_k.awq_gemm_k(wide[:, 128:], qt, qz, s, None, 64), x, qw, qz, s, None, 64)
    xh = x.half()
    wide = wide.half()
    check(awq_gemm_k.awq_gemm_k(wide[:, 128:], qt, qz, s, None, 64), xh, qw, qz, s, None, 64)


@interp
def test_gemm_k_interpreter_bf16_dot_is_broken():
    """bf16 tl.dot is wrong in the Triton 3.9 interpreter (huge values), so the fused GEMM's
    bf16 path is checked only on CUDA (test_kernels_k_cuda, gpu_awq.py). If this starts
    failing, the interpreter was fixed: add bfloat16 to test_gemm_k_interpreter."""
    x, qw, qt, qz, s, b = case_k(5, 64, 64, 32, torch.bfloat16, "cpu")
    cfg = GemmConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1)
    y = awq_gemm_k.awq_gemm_k(x, qt, qz, s, b, 32, config=cfg)
    ref = x.float() @ dequantize_weight(qw, qz, s, 32)
    assert y.dtype == torch.bfloat16 and float((y.float() - ref).abs().max()) > 1e3


@interp
@pytest.mark.parametrize("m,fused", [(5, True), (64, True), (65, False)])
def test_awq_linear_k_prefill_dispatch(m, fused, monkeypatch):
    calls = []
    real = awq_triton.awq_gemm_k
    monkeypatch.setattr(awq_triton, "awq_gemm_k", lambda *a, **kw: calls.append(1) or real(*a))
    monkeypatch.setitem(awq_layout.FUSED_MAX_TOKENS, "small_n", 64)
    x, qw, qt, qz, s, b = case_k(m, 64, 40, 32, torch.float16, "cpu")
    check(awq_triton.awq_linear_k(x, qt, qz, s, b, 32), x, qw, qz, s, b, 32)
    assert bool(calls) == fused
    calls.clear()  # fp32 activations: never the fused path
    xf = x.float()
    check(awq_triton.awq_linear_k(xf, qt, qz, s, b.float(), 32), xf, qw, qz, s, b.float(), 32)
    assert not calls


@interp
@pytest.mark.parametrize("m,dtype,max_fused", [(2, torch.float16, 64), (7, torch.float16, 64),
                                               (7, torch.float16, 4), (7, torch.float32, 64)])
def test_planner_mirrors_awq_linear_k_allocations(m, dtype, max_fused, monkeypatch):
    """planner_trace._awq_triton predicts every byte awq_linear_k allocates on each path
    (GEMV + split-K partials, fused GEMM: y only, dequantize + cuBLAS: W^T and y)."""
    from types import SimpleNamespace

    from test_planner import AllocRecorder

    from hisparse_cli.planner.trace import Trace, _awq_triton

    monkeypatch.setitem(awq_layout.FUSED_MAX_TOKENS, "small_n", max_fused)
    k, n = 128, 200
    x, _, qt, qz, s, _ = case_k(m, k, n, 32, dtype, "cpu")
    awq_gemv._counter_buffer(x.device)  # made once per device (the planner's
    # workspace.awq_gemv_counters), not per call: made here, before the recording
    rec = AllocRecorder()
    with rec:
        y = awq_triton.awq_linear_k(x, qt, qz, s, None, 32)
    tr = Trace()
    shape = SimpleNamespace(cb=x.element_size(), group=32, num_sms=awq_gemv._sm_count(x.device),
                            fp8_prefill=False)
    _awq_triton(tr, shape, "lin", m, k, n)
    assert rec.peak == tr.peak and rec.cur == tr.cur == y.numel() * y.element_size()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("k,n", SHAPES + [(14336, 4096)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 33, 512])
@pytest.mark.parametrize("fn", ["gemv_k", "gemm_k", "dequant_matmul_k", "linear_k",
                                "linear_k_prepared"])
@pytest.mark.gpu
@pytest.mark.skipif(CPU, reason="needs CUDA")
def test_kernels_k_cuda(dtype, group, k, n, m, fn):
    if fn == "gemv_k" and m > awq_layout.GEMV_MAX_TOKENS:
        pytest.skip("the GEMV takes 1..GEMV_MAX_TOKENS tokens (awq_linear_k routes more elsewhere)")
    x, qw, qt, qz, s, b = case_k(m, k, n, group, dtype, "cuda", seed=m)
    if fn == "gemm_k":
        check(awq_gemm_k.awq_gemm_k(x, qt, qz, s, b, group), x, qw, qz, s, b, group)
        return
    if fn == "linear_k_prepared":  # AWQLinear's per-call path (weights checked once)
        y = awq_triton.PreparedLinearK(qt, qz, s, b, group)(x)
        assert torch.equal(y, awq_triton.awq_linear_k(x, qt, qz, s, b, group))
        check(y, x, qw, qz, s, b, group)
        return
    check(getattr(awq_triton, f"awq_{fn}")(x, qt, qz, s, b, group), x, qw, qz, s, b, group)


@pytest.mark.gpu
@pytest.mark.skipif(CPU, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequantize_k_cuda_exact(dtype):
    _, qw, qt, qz, s, _ = case_k(1, 4096, 4096 + 8 * 13, 128, dtype, "cuda")
    wt = awq_triton.awq_dequantize_k(qt, qz, s, 128, dtype)
    assert torch.equal(wt, dequantize_weight(qw, qz, s, 128).t().to(dtype))


# -- packed fp16 GEMV (GemvConfig.packed: PTX inline assembly, CUDA only) ---------------------
def _fp16_bits(v: float) -> int:
    return int(torch.tensor(v, dtype=torch.float16).view(torch.int16)) & 0xFFFF


def _from_bits(bits: int) -> torch.Tensor:
    """The fp16 whose bits are the low 16 of bits (int32 -> int16 wraps)."""
    return torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.float16)


@pytest.mark.parametrize("packed,div", [(1, 64), (2, 128)])
def test_packed_gemv_constants_exact(packed, div):
    """The constants of the packed path (awq_gemv._dequant_pairs) against their definition:
    for every code q and zero point z, the fp16 1024 + q (1024 + 16 q for a byte's upper
    nibble) times the scale plus the offset is (q - z) / div exactly, in one fp16 rounding
    (an HFMA2), and the offsets' bits are what the kernel builds from z."""
    from hisparse_cli.kernels.int4 import awq_gemv as ag

    z1, z16 = (ag._Z1_64, ag._Z16_64) if packed == 1 else (ag._Z1_128, ag._Z16_128)
    c1, c16 = 1.0 / div, 1.0 / (16 * div)
    assert _fp16_bits(c1) == (0x2400 if div == 64 else 0x2000)  # the asm's c1 / c16
    assert _fp16_bits(c16) == (0x1400 if div == 64 else 0x1000)
    q = torch.arange(16, dtype=torch.float64)
    for z in range(16):
        o1, o16 = _from_bits(z1.value + z), _from_bits(z16.value + 16 * z)
        assert float(o1) == -(1024 / div + z / div)
        assert float(o16) == -(1024 / (16 * div) + z / div)
        for h, c, o in ((1024 + q, c1, o1), (1024 + 16 * q, c16, o16)):
            exact = h * c + float(o)  # float64: exact for these values
            assert torch.equal(exact.to(torch.float16).double(), exact)  # one rounding: none
            assert torch.equal(exact, (q - z) / div)


@pytest.mark.gpu
@pytest.mark.skipif(CPU, reason="needs CUDA")
@pytest.mark.parametrize("packed", [1, 2])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("k,n", SHAPES + [(14336, 4096)])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("split", [1, 2])
def test_packed_gemv_cuda(packed, group, k, n, m, split, monkeypatch):
    x, qw, qt, qz, s, b = case_k(m, k, n, group, torch.float16, "cuda", seed=m)
    cfg = GemvConfig(block_n=32, block_kw=min(16, group // 8), split=split, num_warps=1,
                     num_stages=1, stream=2, packed=packed)
    y = awq_gemv.awq_gemv_k(x, qt, qz, s, b, group, config=cfg)
    check(y, x, qw, qz, s, b, group)
    if group != 128 or m not in (1, 4):
        return
    for other in (replace(cfg, maxnreg=64), replace(cfg, num_stages=3)):  # same products
        yo = awq_gemv.awq_gemv_k(x, qt, qz, s, b, group, config=other)
        assert torch.equal(yo, y) or float((yo.float() - y.float()).abs().max()) <= \
            1e-3 * float(y.float().abs().max()), other  # fp32 sums may be ordered otherwise


@interp
def test_awq_linear_tiled_layout_and_stacking(monkeypatch):
    """AWQLinear.set_tiled: the K-major words in tiled order and back (same checkpoint
    qweight), its forward the K-major one's bits through the Triton kernels (interpreter) and
    through the reference (which reads an untiled copy); q|k stacked from tiled pieces
    (llama._stack_linears, whole 64-row tiles) equals the pieces' outputs side by side; a
    shape whose rows do not fill tiles stays K-major."""
    from hisparse_cli.kernels.int4.awq_pack import quantize_weight
    from hisparse_cli.kernels.dispatch import KernelBackend
    from hisparse_cli.model import awq as awq_mod
    from hisparse_cli.model.awq import AWQLinear
    from hisparse_cli.model.llama import _stack_linears

    def lin_of(out_f, seed):
        p = quantize_weight(torch.randn(out_f, 256, generator=torch.Generator().manual_seed(seed)),
                            32)
        lin = AWQLinear.from_checkpoint(p.qweight, p.qzeros, p.scales, None, 32,
                                        dtype=torch.float16)
        lin.qweight, lin.layout = awq_layout.repack_kmajor(lin.qweight), "kmajor"
        return lin, p

    tri = KernelBackend(attention="triton", int4_linear="triton", elementwise="triton")
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(9)).half()
    q, p = lin_of(128, 0)
    k, _ = lin_of(64, 1)
    ref_y = q(x)  # the reference backend, K-major
    monkeypatch.setattr(awq_mod, "select_backend", lambda device_type: tri)
    want = q(x)
    assert q.set_tiled(True) and q.layout == "tiled" and q._prepared is None
    assert torch.equal(q.qweight, awq_layout.tile_kmajor(awq_layout.repack_kmajor(p.qweight), 32))
    assert torch.equal(q.checkpoint_qweight(), p.qweight)
    assert torch.equal(q(x), want) and q._prepared.tiled
    monkeypatch.undo()
    assert torch.equal(q(x), ref_y)  # the reference on an untiled copy
    monkeypatch.setattr(awq_mod, "select_backend", lambda device_type: tri)
    want_k = k(x)
    assert k.set_tiled(True)
    qk = _stack_linears([q, k])
    assert qk is not None and qk.layout == "tiled"
    assert torch.equal(qk(x), torch.cat([want, want_k], dim=1))
    assert q.set_tiled(False) and q.layout == "kmajor" and torch.equal(q(x), want)
    odd, _ = lin_of(72, 2)  # 72 rows: not whole 64-row tiles
    assert not odd.set_tiled(True) and odd.layout == "kmajor"
    # what from_checkpoint stores on CUDA + Triton: the tiled words
    monkeypatch.setattr(AWQLinear, "repacks_on", staticmethod(lambda device: True))
    loaded = AWQLinear.from_checkpoint(p.qweight, p.qzeros, p.scales, None, 32,
                                       dtype=torch.float16)
    assert loaded.layout == "tiled" and torch.equal(loaded.qweight, q.set_tiled(True) and q.qweight)


@pytest.mark.gpu
@pytest.mark.skipif(CPU, reason="needs CUDA")
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("k,n", [(4096, 6144), (14336, 4096), (4096, 28672)])
@pytest.mark.parametrize("m", [1, 4])
def test_tiled_gemv_cuda_same_bits(group, k, n, m):
    """GemvConfig.tiled on sm_90 (16-byte loads of the tiled words): the same bits as the
    K-major layout with the table's tile and split, and with a 128-row and a 32-row tile."""
    from hisparse_cli.kernels.int4.awq_layout import gemv_config, tile_kmajor

    x, qw, qt, qz, s, b = case_k(m, k, n, group, torch.float16, "cuda", seed=m)
    tiled = tile_kmajor(qt, group)
    base = gemv_config(m, k, n, group, awq_gemv._sm_count(x.device))
    for cfg in (base, replace(base, block_n=128, num_warps=4),
                replace(base, block_n=32, num_warps=1)):
        y = awq_gemv.awq_gemv_k(x, qt, qz, s, b, group, config=cfg)
        yt = awq_gemv.awq_gemv_k(x, tiled, qz, s, b, group, config=replace(cfg, tiled=1))
        assert torch.equal(yt, y), cfg
    check(yt, x, qw, qz, s, b, group)


@pytest.mark.gpu
@pytest.mark.skipif(CPU, reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 3, 16, 200, 1500])
def test_tiled_linear_cuda_same_bits(m):
    """The tiled layout on every CUDA path of PreparedLinearK (GEMV, fused GEMM, dequantize +
    cuBLAS, as prefill_path picks by m): the K-major layout's bits."""
    x, qw, qt, qz, s, b = case_k(m, 4096, 6144, 128, torch.float16, "cuda", seed=m)
    plain = awq_triton.PreparedLinearK(qt, qz, s, b, 128)(x)
    tiled = awq_triton.PreparedLinearK(awq_layout.tile_kmajor(qt, 128), qz, s, b, 128,
                                       tiled=True)(x)
    assert torch.equal(tiled, plain)
    check(tiled, x, qw, qz, s, b, 128)


@pytest.mark.gpu
@pytest.mark.skipif(CPU, reason="needs CUDA")
@pytest.mark.parametrize("packed", [1, 2])
def test_packed_gemv_cuda_extreme_x(packed):
    """fp16 products within a word: no overflow for any finite fp16 x (a lane's terms are
    bounded by 65504 in all); small x (many subnormal products) within the tolerance."""
    _extreme_x(packed, "cuda", 4096, 1024)


@pytest.mark.gpu
@pytest.mark.skipif(CPU, reason="needs CUDA")
def test_packed_gemv_cuda_other_dtypes_take_fp32_path():
    """packed applies to fp16 x only: bf16 x with a packed config is the fp32 path's bits."""
    x, qw, qt, qz, s, b = case_k(1, 1024, 1024, 128, torch.bfloat16, "cuda")
    plain = GemvConfig(block_n=32, block_kw=16, split=1, num_warps=1, num_stages=1)
    packed = GemvConfig(block_n=32, block_kw=16, split=1, num_warps=1, num_stages=1, packed=2)
    assert torch.equal(awq_gemv.awq_gemv_k(x, qt, qz, s, b, 128, config=packed),
                       awq_gemv.awq_gemv_k(x, qt, qz, s, b, 128, config=plain))


@interp
@pytest.mark.parametrize("packed", [1, 2])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m,split", [(1, 1), (3, 2)])
def test_packed_gemv_interpreter(packed, group, m, split):
    """The packed path's Triton code (x pairs, word halves, zero-point bits, scales) with
    its two PTX blocks replaced by their fp16 emulation (ASM=False on CPU tensors)."""
    x, qw, qt, qz, s, b = case_k(m, 2 * group, 200, group, torch.float16, "cpu", seed=m)
    cfg = GemvConfig(block_n=32, block_kw=min(16, group // 8), split=split, num_warps=1,
                     num_stages=1, packed=packed)
    y = awq_gemv.awq_gemv_k(x, qt, qz, s, b, group, config=cfg)
    check(y, x, qw, qz, s, b, group)
    plain = awq_gemv.awq_gemv_k(x, qt, qz, s, b, group, config=replace(cfg, packed=0))
    assert not torch.equal(y, plain) or m == 1  # fp16 products: not the fp32 path's bits
    capped = awq_gemv.awq_gemv_k(x, qt, qz, s, b, group, config=replace(cfg, maxnreg=80))
    assert torch.equal(capped, y)  # a compile option: the interpreter takes and ignores it


@interp
@pytest.mark.parametrize("packed", [1, 2])
def test_packed_gemv_interpreter_extreme_x(packed):
    _extreme_x(packed, "cpu", 256, 64)


def _extreme_x(packed, device, k, n):
    """Row 0: runs of x at +-60000 (scales cut so that y fits fp16): finite, accurate.
    Row 1: x scaled by 1e-2 (rms 0.01, the small end of what reaches a decoder linear):
    products (q - z) x / 64 (/ 128) fall below fp16's normal range and keep only absolute
    precision (2^-25 a product, x 64 or 128 in y's units), still inside the tolerance."""
    x, qw, qt, qz, s, b = case_k(2, k, n, 128, torch.float16, device, seed=3)
    cfg = GemvConfig(block_n=32, block_kw=16, split=1, num_warps=1, num_stages=1, packed=packed)
    big = x[:1].clone()
    big[0, :64] = 60000.0
    big[0, 64:128] = -60000.0
    small = (x[1:].float() * 1e-2).half()
    for xi, si in ((big, (s.float() * 1e-3).half()), (small, s)):
        y = awq_gemv.awq_gemv_k(xi, qt, qz, si, None, 128, config=cfg)
        assert torch.isfinite(y).all()
        ref = xi.float() @ dequantize_weight(qw, qz, si, 128)
        err = float((y.float() - ref).abs().max() / ref.abs().max())
        assert err <= TOL[torch.float16], f"relative error {err:.2e}"


_COMPILE_PACKED = """
import sys
sys.path.insert(0, 'benchmarks')
import sm90_compile as c
from hisparse_cli.kernels.int4.awq_layout import GemvConfig
for packed, m, partial in ((1, 1, False), (2, 2, True)):
    cfg = GemvConfig(block_n=32, block_kw=16, split=1, num_warps=1, num_stages=1, stream=2,
                     packed=packed)
    k = c.compile_gemv(cfg, m, partial, 128, '*fp16')
    c.report(f'packed{packed}', k, None)
"""


@pytest.mark.slow
def test_packed_gemv_ptx_compiles_for_sm90():
    """The packed path's PTX blocks (which the CPU interpreter replaces by their emulation)
    go through ptxas for sm_90 (Triton's bundled toolchain, no GPU), with no spills, and the
    HFMA2 / LOP3 code they stand for is there."""
    import subprocess
    import sys
    from pathlib import Path

    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("no ptxas in this Triton")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)
    out = subprocess.run([sys.executable, "-c", _COMPILE_PACKED], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("packed")]
    assert len(lines) == 2, out.stdout
    for ln in lines:
        assert " local 0 " in ln and "HFMA2=" in ln and "LOP3=" in ln, ln
