"""W4A8 prefill products (kernels/fp8/): the activation quantizer against its contract (block
maxima, e4m3 round-to-nearest-even, ties and subnormals) and the Triton kernel against torch's
own e4m3 conversion bit for bit; the dequantize's codes against the AWQ unpacking (K-major,
tiled and item layouts); the product's reference against fp64 sums; the wiring of
PreparedLinearK / PreparedItemsLinear into cuBLAS's block-scaled GEMM through a stand-in
that enforces cuBLAS's layout rules; the execution plan's choice and the planner's bytes.
`gpu`: the real cuBLAS GEMM against the reference and against W4A16."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first triton import in this process
    os.environ["TRITON_INTERPRET"] = "1"

from hisparse_cli.kernels.fp8 import w4a8_linear  # noqa: E402
from hisparse_cli.kernels.fp8.act_quant_triton import quantize_act  # noqa: E402
from hisparse_cli.kernels.fp8.w4a8_ref import (E4M3, codes_ref, quantize_act_ref,  # noqa: E402
                                               w4a8_linear_ref, w4a8_matmul_ref)
from hisparse_cli.kernels.int4 import awq_triton  # noqa: E402
from hisparse_cli.kernels.int4.awq_layout import repack_kmajor, tile_kmajor  # noqa: E402
from hisparse_cli.kernels.int4.awq_ref import dequantize_weight  # noqa: E402
from test_awq_ref import random_awq  # noqa: E402

CPU = not torch.cuda.is_available()
interp = pytest.mark.skipif(not CPU, reason="interpreter tests run only without CUDA")
E4M3_GRID = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
E4M3_GRID = torch.unique(E4M3_GRID[torch.isfinite(E4M3_GRID)])  # every finite e4m3 value


def hard_activations(m: int, k: int, seed: int = 0) -> torch.Tensor:
    """fp16 rows over many magnitudes, with an all-zero block, a one-hot block and values that
    land exactly halfway between e4m3 neighbours once scaled (ties) or in the subnormals."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, k, generator=g) * 2)
    x[0, :128] = 0.0
    x[1, 128:256] = 0.0
    x[1, 130] = -3.0
    # row 2, block 0: max 448 (scale 1): 17 is a tie between 16 and 18, 0.0029296875 = 1.5
    # subnormal steps (tie between 2^-9 and 2^-8), 9.5 (tie 9 / 10 round to even 10? no: the
    # grid at 8-16 has step 1, so 9.5 is a tie between 9 and 10 -> 10)
    x[2, :128] = 0.5
    x[2, 0], x[2, 1], x[2, 2], x[2, 3] = 448.0, 17.0, 0.0029296875, 9.5
    return x.half()


def test_act_reference_contract():
    x = hard_activations(4, 256)
    x8, sa = quantize_act_ref(x)
    assert x8.dtype == E4M3 and sa.shape == (2, 4) and sa.is_contiguous()
    amax = x.float().view(4, 2, 128).abs().amax(-1).t()
    assert torch.equal(sa, torch.where(amax > 0, amax / 448.0, torch.ones_like(amax)))
    assert sa[0, 0] == 1.0 and sa[1, 1] == 3.0 / 448.0
    v = x.float().view(4, 2, 128) / sa.t()[:, :, None]
    q = x8.float().view(4, 2, 128)
    assert bool((q.abs() <= 448).all()) and bool(torch.isin(q, E4M3_GRID).all())
    # the nearest grid value, ties to the even mantissa
    d = (E4M3_GRID[None, :] - v.reshape(-1, 1)).abs()
    nearest = d.min(1).values
    assert torch.equal((q.reshape(-1) - v.reshape(-1)).abs(), nearest)
    assert x8[2, 1].float() == 16.0 and x8[2, 3].float() == 10.0  # ties to even mantissas
    assert x8[2, 2].float() == 2.0**-8  # a subnormal tie: 1.5 steps -> 2 steps


@interp
@pytest.mark.parametrize("m", [1, 5, 16, 37])
def test_act_kernel_bits_equal_reference(m):
    x = hard_activations(max(m, 3), 384, seed=m)[:m] if m >= 3 else hard_activations(3, 384)[:m]
    x8, sa = quantize_act(x)
    r8, rsa = quantize_act_ref(x)
    assert torch.equal(sa, rsa)
    assert torch.equal(x8.view(torch.uint8), r8.view(torch.uint8))


@interp
def test_act_kernel_strided_rows_and_out():
    big = hard_activations(6, 512)
    x = big[:, :256]  # row stride 512
    out = (torch.empty(6, 256, dtype=E4M3), torch.empty(2, 6))
    x8, sa = quantize_act(x, out=out)
    assert x8 is out[0] and sa is out[1]
    r8, rsa = quantize_act_ref(x.contiguous())
    assert torch.equal(x8.view(torch.uint8), r8.view(torch.uint8)) and torch.equal(sa, rsa)
    with pytest.raises(ValueError):
        quantize_act(torch.zeros(2, 200, dtype=torch.float16))


def test_matmul_reference_against_fp64():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 256, generator=g).half()
    qw, qz, s, _ = random_awq(256, 48, 128, seed=4, bias=False)
    x8, sa = quantize_act_ref(x)
    codes, sc = codes_ref(qw, qz, s, 128)
    y = w4a8_matmul_ref(x8, sa, codes, sc, torch.float32)
    xd = (x8.double().view(7, 2, 128) * sa.t().double()[:, :, None]).view(7, 256)
    w = dequantize_weight(qw, qz, s, 128).double()  # [in, out], exact
    assert torch.allclose(y.double(), xd @ w, rtol=1e-6, atol=1e-6)
    # codes are the exact INT4 integers: codes * scales is the INT4 weight
    wc = (codes.double().view(48, 2, 128) * sc.t().double()[:, :, None]).view(48, 256).t()
    assert torch.equal(wc, w)
    # the emulation used by quality studies agrees with the two-factor form
    yl = w4a8_linear_ref(x.float(), w.float())
    assert torch.allclose(yl.double(), xd @ w, rtol=1e-5, atol=1e-5)


@interp
@pytest.mark.parametrize("tiled", [False, True])
def test_dequant_k_codes_and_scales(tiled):
    qw, qz, s, _ = random_awq(256, 128, 128, seed=5, bias=False)
    qt = repack_kmajor(qw)
    if tiled:
        qt = tile_kmajor(qt, 128)
    codes, sc = codes_ref(qw, qz, s, 128)
    lin = awq_triton.PreparedLinearK(qt, qz, s, None, 128, tiled=tiled)
    for n0, n1 in ((0, 128), (64, 128)):
        ws = w4a8_linear.workspace(n1 - n0, 256, torch.device("cpu"))
        lin._dequant(ws, n0, n1)
        c, scale = w4a8_linear.split_workspace(ws, n1 - n0, 256)
        assert torch.equal(c.view(torch.uint8), codes[n0:n1].view(torch.uint8))
        assert torch.equal(scale, sc[:, n0:n1])


@interp
def test_dequant_items_codes_and_scales():
    from hisparse_cli.kernels.int4.awq_items import items_from_awq
    from hisparse_cli.kernels.int4.awq_items_triton import PreparedItemsLinear

    qw, qz, s, _ = random_awq(256, 256, 128, seed=6, bias=False)
    items = items_from_awq(qw, qz, s)
    codes, sc = codes_ref(qw, qz, s, 128)
    lin = PreparedItemsLinear(items, 256, 256, None)
    ws = w4a8_linear.workspace(128, 256, torch.device("cpu"))
    lin._dequant(ws, 128, 256)
    c, scale = w4a8_linear.split_workspace(ws, 128, 256)
    assert torch.equal(c.view(torch.uint8), codes[128:].view(torch.uint8))
    assert torch.equal(scale, sc[:, 128:])


def fake_scaled_mm(calls):
    """torch._scaled_mm for 1x128 x 1x128 block scaling, with cuBLAS's layout rules enforced
    (torch's checks: scale_a [M, K/128] strides (1, M); scale_b [N, K/128] strides (1, N);
    mat_b column-major), computed by the reference."""
    def mm(a, b, scale_a, scale_b, out_dtype):
        m, k = a.shape
        n = b.shape[1]
        assert a.dtype == b.dtype == E4M3 and a.stride(1) == 1 and b.stride(0) == 1
        assert scale_a.shape == (m, k // 128) and scale_a.stride(0) == 1
        assert k // 128 == 1 or scale_a.stride(1) == m
        assert scale_b.shape == (n, k // 128) and scale_b.stride(0) == 1
        assert k // 128 == 1 or scale_b.stride(1) == n
        calls.append((m, n, k))
        return w4a8_matmul_ref(a, scale_a.t(), b.t(), scale_b.t(), out_dtype)
    return mm


@interp
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("layout", ["kmajor", "items"])
def test_prepared_linears_run_w4a8_where_active(chunked, layout, monkeypatch):
    from hisparse_cli.kernels.int4.awq_items import items_from_awq
    from hisparse_cli.kernels.int4.awq_items_triton import PreparedItemsLinear

    calls = []
    monkeypatch.setattr(w4a8_linear, "scaled_mm_1x128", fake_scaled_mm(calls))
    monkeypatch.setattr(w4a8_linear, "active", lambda device: True)
    qw, qz, s, b = random_awq(256, 256, 128, seed=7)
    b = b.half()
    if layout == "kmajor":
        lin = awq_triton.PreparedLinearK(repack_kmajor(qw), qz, s, b, 128)
    else:
        lin = PreparedItemsLinear(items_from_awq(qw, qz, s), 256, 256, b)
    if chunked:
        lin.chunk = 128
    x = hard_activations(9, 256, seed=8)
    y = lin(x.view(1, 9, 256))
    assert y.shape == (1, 9, 256) and y.dtype == torch.float16
    assert calls == ([(9, 128, 256)] * 2 if chunked else [(9, 256, 256)])
    x8, sa = quantize_act_ref(x)
    codes, sc = codes_ref(qw, qz, s, 128)
    ref = (w4a8_matmul_ref(x8, sa, codes, sc, torch.float32) + b.float()).half()
    assert torch.allclose(y[0].float(), ref.float(), rtol=2e-3, atol=2e-3)
    calls.clear()  # decode-sized calls keep the W4A16 GEMV
    lin(x[:1])
    assert calls == []


def test_capability_probe_says_why_not(monkeypatch):
    """device_support's probe: a cuBLAS that refuses the recipe, or computes something else,
    keeps W4A16 with the reason; one that agrees with the reference passes."""
    calls = []
    monkeypatch.setattr(w4a8_linear, "scaled_mm_1x128", fake_scaled_mm(calls))
    assert w4a8_linear._probe(torch.device("cpu")) is None and calls == [(32, 64, 256)]

    def refuses(*a, **k):
        raise RuntimeError("Only bf16 high precision output types are supported\nmore")
    monkeypatch.setattr(w4a8_linear, "scaled_mm_1x128", refuses)
    assert "refused: Only bf16" in w4a8_linear._probe(torch.device("cpu"))

    def wrong(a, b, scale_a, scale_b, out_dtype):  # the scales ignored
        return (a.float() @ b.float()).to(out_dtype)
    monkeypatch.setattr(w4a8_linear, "scaled_mm_1x128", wrong)
    assert "disagrees" in w4a8_linear._probe(torch.device("cpu"))


def test_linear_not_of_group_128_keeps_w4a16(monkeypatch):
    qw, qz, s, _ = random_awq(256, 64, 64, seed=9, bias=False)
    lin = awq_triton.PreparedLinearK(repack_kmajor(qw), qz, s, None, 64)
    assert not lin.fp8 and w4a8_linear.usable(128, 256) and not w4a8_linear.usable(128, 200)


def test_execution_plan_choice(monkeypatch):
    from hisparse_cli.config.env import Environment
    from hisparse_cli.config.execution import resolve_execution
    from hisparse_cli.config.settings import SparseConfig
    from hisparse_cli.planner.memory import planned_kernels
    from hisparse_cli.planner.shapes import shape_config

    cfg = shape_config("llama-3-8b-awq")
    kw = dict(model_cfg=cfg, sparse=SparseConfig(), compute_dtype="float16",
              kv_dtype="float16", weight_awq=True)
    triton_k = planned_kernels("cuda", "triton")  # a plan for a GPU (not this machine's)
    on = Environment(prefill_fp8=True)
    none = resolve_execution(device="cuda", kernels=triton_k, env=on, **kw)
    if CPU:  # this machine's GPU decides, as the decode kernel's auto: none here
        assert none.int4_prefill.value == "w4a16" and "this machine" in none.int4_prefill.reason
    monkeypatch.setattr(w4a8_linear, "device_support", lambda index: None)  # an sm_90
    plan = resolve_execution(device="cuda", kernels=triton_k, env=on, **kw)
    assert plan.int4_prefill.value == "w4a8"
    assert ("INT4 prefill", "w4a8", plan.int4_prefill.reason) in plan.rows()
    off = resolve_execution(device="cuda", kernels=triton_k, env=Environment(), **kw)
    assert off.int4_prefill.value == "w4a16" and "HISPARSE_PREFILL_FP8=1" in off.int4_prefill.reason
    g64 = resolve_execution(device="cuda", kernels=triton_k, env=on, **kw | {"group_size": 64})
    assert g64.int4_prefill.value == "w4a16"
    cpu = resolve_execution(device="cpu", env=on, **kw)
    assert cpu.int4_prefill.value == "w4a16"
    fp = resolve_execution(device="cuda", kernels=triton_k, env=on,
                           **kw | {"weight_awq": False})
    assert fp.int4_prefill.value == "none" and all(r[0] != "INT4 prefill" for r in fp.rows())


def test_environment_reads_prefill_fp8():
    from hisparse_cli.config.env import read_environment

    assert not read_environment({}).prefill_fp8  # opt-in
    assert not read_environment({"HISPARSE_PREFILL_FP8": "0"}).prefill_fp8
    assert read_environment({"HISPARSE_PREFILL_FP8": "1"}).prefill_fp8


def test_planner_trace_counts_the_w4a8_buffers():
    from hisparse_cli.planner.trace import Trace, _w4a8

    tr = Trace()
    m, k, n = 512, 4096, 28672
    y = _w4a8(tr, "gate_up", m, k, n, 2, chunk=n)
    assert tr.cur == tr.size(m * n * 2)  # only y lives on
    assert tr.peak == (tr.size(m * k) + tr.size(4 * 32 * m) + tr.size(n * k + 4 * 32 * n)
                       + tr.size(m * n * 2))
    tr.free(y)
    tr2 = Trace()
    _w4a8(tr2, "gate_up", m, k, n, 2, chunk=n // 4)
    assert tr2.peak == (tr2.size(m * k) + tr2.size(4 * 32 * m) + tr2.size(m * n * 2)
                        + tr2.size(n // 4 * k + 4 * 32 * n // 4) + tr2.size(m * n // 4 * 2))


# -- the GPU: cuBLAS's block-scaled FP8 GEMM ---------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("m", [64, 1000])
@pytest.mark.parametrize("layout", ["kmajor", "tiled", "items"])
def test_cuda_w4a8_against_reference_and_w4a16(m, layout):
    from hisparse_cli.kernels.int4.awq_items import items_from_awq
    from hisparse_cli.kernels.int4.awq_items_triton import PreparedItemsLinear

    why = w4a8_linear.device_support(torch.cuda.current_device())
    if why is not None:
        pytest.skip(why)
    k, n = 4096, 1536
    qw, qz, s, _ = random_awq(k, n, 128, seed=m, bias=False)
    dev = torch.device("cuda")
    if layout == "items":
        lin = PreparedItemsLinear(items_from_awq(qw, qz, s).to(dev), k, n, None)
    else:
        qt = repack_kmajor(qw)
        qt = tile_kmajor(qt, 128) if layout == "tiled" else qt
        lin = awq_triton.PreparedLinearK(qt.to(dev), qz.to(dev), s.to(dev), None, 128,
                                         tiled=layout == "tiled")
    x = hard_activations(m, k, seed=m).to(dev)
    w4a8_linear.set_enabled(True)
    try:
        y = lin(x)
        y2 = lin(x)  # the dequantize's graph replay
        x8, sa = quantize_act(x)
        r8, rsa = quantize_act_ref(x.cpu())
        # values equal (the GPU writes +0 for some tiny negatives the reference rounds to -0:
        # the same number in every product)
        assert torch.equal(x8.cpu().float(), r8.float())
        assert torch.equal(sa.cpu(), rsa)
        codes, sc = codes_ref(qw, qz, s, 128)
        ref = w4a8_matmul_ref(r8, rsa, codes, sc, torch.float32)
        err = float((y.float().cpu() - ref).abs().max() / ref.abs().max())
        assert err < 4e-3, err  # fp32 sums in another order, one fp16 rounding
        assert torch.equal(y, y2)
        w4a8_linear.set_enabled(False)
        y16 = lin(x)  # W4A16
        rel = float((y.float() - y16.float()).norm() / y16.float().norm())
        assert 1e-4 < rel < 0.06, rel  # FP8 activations: a few percent, not nothing
    finally:
        w4a8_linear.set_enabled(False)


@interp
@pytest.mark.parametrize("chunked", [False, True])
def test_planner_mirrors_w4a8_allocations(chunked, monkeypatch):
    """planner/trace._w4a8 predicts every byte the W4A8 call allocates (cuBLAS's output
    stands in as an empty tensor of its shape: the GEMM's own workspace is the planner's
    cuBLAS constant)."""
    from test_planner import AllocRecorder

    from hisparse_cli.planner.trace import Trace, _w4a8

    def mm(a, b, scale_a, scale_b, out_dtype):
        return torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype)

    monkeypatch.setattr(w4a8_linear, "scaled_mm_1x128", mm)
    monkeypatch.setattr(w4a8_linear, "active", lambda device: True)
    qw, qz, s, _ = random_awq(256, 256, 128, seed=10, bias=False)
    lin = awq_triton.PreparedLinearK(repack_kmajor(qw), qz, s, None, 128)
    if chunked:
        lin.chunk = 128
    x = hard_activations(40, 256)
    rec = AllocRecorder()
    with rec:
        y = lin(x)
    tr = Trace()
    _w4a8(tr, "lin", 40, 256, 256, 2, lin.chunk)
    assert rec.peak == tr.peak and rec.cur == tr.cur == y.numel() * y.element_size()


def test_off_unless_a_run_turns_it_on(monkeypatch):
    """Opt-in: a capable device alone does not take W4A8; the Engine's plan turns it on."""
    monkeypatch.setattr(w4a8_linear, "device_support", lambda index: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setitem(w4a8_linear._STATE, "on", False)
    cuda = torch.device("cuda", 0)
    assert not w4a8_linear.active(cuda)
    w4a8_linear.set_enabled(True)
    assert w4a8_linear.active(cuda) and not w4a8_linear.active(torch.device("cpu"))
    w4a8_linear.set_enabled(False)
    assert not w4a8_linear.active(cuda)
