"""Triton RMSNorm / residual-add + RMSNorm / RoPE / silu(gate) * up (kernels/norm_rope/norm_rope_triton.py)
against their torch references (kernels/norm_rope/norm_rope_ref.py, the ops the model runs on the CPU).

Without CUDA the kernels run under TRITON_INTERPRET=1 on small shapes; the interpreter casts
fp32 -> bf16 by truncation (not round-to-nearest), so bf16 gets a tolerance of a few ulps
there. With CUDA the `gpu` tests check Llama-like shapes (RoPE bit-exact in fp16/bf16), CUDA
graph capture, and the model's logits with the kernels vs HISPARSE_BACKEND=torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first triton import in this process
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from hisparse_cli.kernels.norm_rope import norm_rope_ref as ref  # noqa: E402
from hisparse_cli.kernels.norm_rope import norm_rope_triton as tri  # noqa: E402
from hisparse_cli.kernels.dispatch import KernelBackend, select_backend  # noqa: E402

CPU = not torch.cuda.is_available()
DEV = "cpu" if CPU else "cuda"
interp = pytest.mark.skipif(not CPU, reason="interpreter tests run only without CUDA")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# relative to max |ref|: fp32 sum order / rsqrt ulps; fp16 one rounding flip; bf16 in the
# interpreter: truncating casts (up to 3 roundings of 2^-7 each)
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 3e-2 if CPU else 8e-3}


def rnd(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEV, dtype=dtype)


def close(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    assert a.is_contiguous()
    err = float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))
    assert err <= TOL[b.dtype], f"relative error {err:.2e} ({b.dtype}, {tuple(b.shape)})"


def qkv_views(t, hq, hkv, d, dtype, seed=0):
    """The model's stacked projection output and its q, k and q|k head views."""
    qkv = rnd(t, (hq + 2 * hkv) * d, dtype=dtype, seed=seed)
    return (qkv, qkv[:, :hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d),
            qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d))


# -- interpreter (CPU) -----------------------------------------------------------------------
@interp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,h", [(1, 64), (5, 200), (19, 16)])  # ragged rows, non-pow2 H
def test_rms_norm_interpreter(dtype, rows, h):
    x, w = rnd(rows, h, dtype=dtype), rnd(h, dtype=dtype, seed=1)
    close(tri.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    wide = rnd(rows, h + 24, dtype=dtype, seed=2)[:, 8:8 + h]  # row stride != H
    close(tri.rms_norm(wide, w, 1e-5), ref.rms_norm(wide, w, 1e-5))


@interp
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_on_strided_head_views_interpreter(dtype):
    _, q, k, _ = qkv_views(3, 5, 2, 16, dtype)  # 15 / 6 rows of 16: ragged ROWS tiles
    w = rnd(16, dtype=dtype, seed=3)
    close(tri.rms_norm(q, w, 1e-6), ref.rms_norm(q, w, 1e-6))
    close(tri.rms_norm(k, w, 1e-6), ref.rms_norm(k, w, 1e-6))


@interp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("last_only", [False, True])
def test_add_rms_norm_interpreter(dtype, last_only):
    x, y = rnd(6, 96, dtype=dtype), rnd(6, 96, dtype=dtype, seed=1)
    w = rnd(96, dtype=dtype, seed=2)
    if last_only:  # DecoderLayer: x[-1:] + the last row's attention output
        x, y = x[-1:], y[-1:]
    s, out = tri.add_rms_norm(x, y, w, 1e-6)
    s_ref, out_ref = ref.add_rms_norm(x, y, w, 1e-6)
    if dtype != torch.bfloat16:  # the sum is one rounding: exact (bf16: interpreter truncates)
        assert torch.equal(s, s_ref)
    close(s, s_ref)
    close(out, out_ref)


@interp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,hq,hkv,d", [(1, 4, 2, 16), (3, 5, 1, 24), (2, 3, 3, 8)])
def test_rope_on_the_strided_qk_view_interpreter(dtype, t, hq, hkv, d):
    _, q, _, qk = qkv_views(t, hq, hkv, d, dtype)
    cos, sin = rnd(t, d, dtype=dtype, seed=4), rnd(t, d, dtype=dtype, seed=5)
    for x in (qk, q, q.contiguous()):
        out, want = tri.rope(x, cos, sin), ref.rope(x, cos, sin)
        if dtype == torch.float16:  # the reference's three roundings, reproduced
            assert torch.equal(out, want)
        close(out, want)


def kv_caches(nb, bs, hkv, d, dtype, head_major, seed=7):
    """A layer's K and V storage [nb, bs, hkv, d] with random contents, interleaved in memory
    or head-major (engine/kv_cache.py's CPU layout: a permuted view)."""
    g = torch.Generator().manual_seed(seed)
    shape = (hkv, nb, bs, d) if head_major else (nb, bs, hkv, d)
    k, v = (torch.randn(*shape, generator=g).to(device=DEV, dtype=dtype) for _ in range(2))
    return (k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)) if head_major else (k, v)


def rope_store_case(t, hq, hkv, d, dtype, cache_dtype, head_major, pad_slot):
    """(qkv as a row-strided view of the stacked projection, cos, sin, slots, k/v caches);
    pad_slot: the last token's slot is -1 (padding: nothing stored)."""
    nb, bs = 5, 4
    qkv = rnd(t, (hq + 2 * hkv) * d + 8, dtype=dtype)[:, :(hq + 2 * hkv) * d]
    cos, sin = rnd(t, d, dtype=dtype, seed=4), rnd(t, d, dtype=dtype, seed=5)
    slots = torch.randperm(nb * bs, generator=torch.Generator().manual_seed(t))[:t].to(DEV)
    if pad_slot:
        slots[-1] = -1
    return qkv, cos, sin, slots, kv_caches(nb, bs, hkv, d, cache_dtype, head_major)


@interp
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32),
                                               (torch.float16, torch.float16),
                                               (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.float16)])
@pytest.mark.parametrize("t,hq,hkv,d,pad_slot", [(1, 4, 2, 16, False), (3, 5, 1, 32, True),
                                                 (2, 3, 3, 8, False)])
@pytest.mark.parametrize("head_major", [False, True])
def test_rope_store_kv_interpreter(dtype, cache_dtype, t, hq, hkv, d, pad_slot, head_major):
    """One launch = rope() then store_kv() of the Triton kernels, bit for bit (q, and every
    cache entry, the untouched ones included), and the torch reference (fp16: bit-exact; other
    dtypes within the interpreter's casts); a padding slot stores nothing."""
    from hisparse_cli.kernels.attention.attention_triton import store_kv

    qkv, cos, sin, slots, (kc, vc) = rope_store_case(t, hq, hkv, d, dtype, cache_dtype,
                                                     head_major, pad_slot)
    kc2, vc2, kc_r, vc_r = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    q = tri.rope_store_kv(qkv, hq, hkv, cos, sin, kc, vc, slots)
    assert q.shape == (t, hq, d) and q.is_contiguous()
    # the two Triton kernels the fused one replaces
    qk = tri.rope(qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d), cos, sin)
    store_kv(kc2, vc2, qk[:, hq:], qkv[:, (hq + hkv) * d:].view(t, hkv, d), slots)
    assert torch.equal(q, qk[:, :hq])
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    # the reference (which takes no padding slot: the stored rows only)
    keep = slots >= 0
    q_ref = ref.rope_store_kv(qkv[keep], hq, hkv, cos[keep], sin[keep], kc_r, vc_r, slots[keep])
    close(q[keep].contiguous(), q_ref.contiguous())
    if dtype == torch.float16:
        assert torch.equal(q[keep], q_ref) and torch.equal(kc, kc_r) and torch.equal(vc, vc_r)
    for got, want in ((kc, kc_r), (vc, vc_r)):
        close(got.contiguous(), want.contiguous())
    if pad_slot:  # the padded token's k/v went nowhere: every entry not stored is unchanged
        written = torch.zeros(kc.shape[0] * kc.shape[1], dtype=torch.bool, device=DEV)
        written[slots[keep]] = True
        mask = written.view(kc.shape[0], kc.shape[1])
        assert torch.equal(kc2[~mask], kc[~mask])


@interp
def test_dispatch_rope_store_kv(monkeypatch):
    """KernelBackend.rope_store_kv: the fused kernel with Triton attention and elementwise
    kernels; with any torch family, rope then store_kv: same values."""
    t, hq, hkv, d = 3, 4, 2, 16
    qkv, cos, sin, slots, (kc, vc) = rope_store_case(t, hq, hkv, d, torch.float16,
                                                     torch.float16, False, False)
    outs = []
    for backend, fuse in ((KernelBackend(attention="triton", elementwise="triton"), True),
                          (KernelBackend(attention="triton"), True), (KernelBackend(), True)):
        k2, v2 = kc.clone(), vc.clone()
        calls = []
        monkeypatch.setattr(tri, "rope_store_kv",
                            lambda *a, _f=tri.rope_store_kv: calls.append(1) or _f(*a))
        q = backend.rope_store_kv(qkv, hq, hkv, cos, sin, k2, v2, slots)
        assert bool(calls) == (fuse and backend.elementwise == "triton"), (backend, fuse)
        outs.append((q.contiguous(), k2, v2))
    for q, k2, v2 in outs[1:]:
        assert torch.equal(q, outs[0][0]) and torch.equal(k2, outs[0][1])
        assert torch.equal(v2, outs[0][2])


def _engine_tokens_fused_vs_not(tmp_path, monkeypatch, new_tokens):
    """The model's fused path (Attention.forward -> StepContext.attend_qkv ->
    rope_store_kv): the same tokens as RoPE and store_kv as two kernels (the run's kernels
    with the torch elementwise family: the reference RoPE, then the Triton store_kv; the
    model's norms stay Triton), and the fused kernel actually ran. On the CPU the Triton
    elementwise kernels are forced (CausalLM._fused picks them on CUDA only) and run in the
    interpreter; on CUDA the decode runs from a captured graph."""
    from conftest import save_tiny

    from hisparse_cli.engine import Engine, GenerationConfig, SparseConfig
    from hisparse_cli.model import llama

    path, _ = save_tiny(tmp_path, "llama", num_key_value_heads=2)
    backend = KernelBackend(attention="triton", elementwise="triton")
    if CPU:
        monkeypatch.setattr(llama.CausalLM, "_fused", lambda self, x: backend)

    def engine(run_kernels=backend):  # a new engine per setting: no decode graph kept
        eng = Engine.from_pretrained(path, device=DEV, sparse=SparseConfig(
            sink_tokens=4, window_size=32, global_tokens=4, block_size=8, prefill_chunk=16,
            recalibrate_every=16, recalibrate_topk=4))
        if CPU or run_kernels is not backend:
            eng.backend = run_kernels  # the runs' kernels (the model's own stay Triton)
        return eng

    ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(3))
    g = GenerationConfig(max_new_tokens=new_tokens, eos_token_ids=())
    calls = []
    monkeypatch.setattr(tri, "rope_store_kv",
                        lambda *a, _f=tri.rope_store_kv: calls.append(1) or _f(*a))
    fused = engine().generate(ids, gen=g)
    assert calls, "the fused kernel did not run"
    n = len(calls)
    unfused = engine(KernelBackend(attention="triton")).generate(ids, gen=g)
    assert len(calls) == n
    assert fused.token_ids == unfused.token_ids and len(fused.token_ids) == new_tokens
    return fused


@interp
def test_engine_tokens_with_fused_rope_store(tmp_path, monkeypatch):
    _engine_tokens_fused_vs_not(tmp_path, monkeypatch, 6)


def silu_case(t, inter, dtype, pad=0, seed=0):
    """A stacked gate|up output [t, 2 inter], as a view with row stride 2 inter + pad."""
    return rnd(t, 2 * inter + pad, dtype=dtype, seed=seed)[:, :2 * inter]


@interp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,inter,pad", [(1, 64, 0), (3, 1500, 0), (5, 2048, 24), (2, 3, 1)])
def test_silu_mul_interpreter(dtype, t, inter, pad):
    """In place over the gate half (ragged column blocks, strided rows); the up half and the
    padding are left alone; fp16 matches the reference's two roundings except where the
    exp's last ulp flips one (checked within one fp16 ulp of the value)."""
    gu = silu_case(t, inter, dtype, pad)
    before = gu.clone()
    want = ref.silu_mul_(before.clone(), inter)
    out = tri.silu_mul_(gu, inter)
    assert out.data_ptr() == gu.data_ptr() and out.shape == (t, inter)
    assert torch.equal(gu[:, inter:], before[:, inter:])
    close(out.contiguous(), want.contiguous())
    if dtype == torch.float16:
        assert torch.allclose(out.float(), want.float(), rtol=2 ** -10, atol=2 ** -24)


@interp
def test_dispatch_picks_triton_or_the_reference():
    x, w = rnd(4, 32, dtype=torch.float16), rnd(32, dtype=torch.float16, seed=1)
    cos, sin = rnd(4, 16, dtype=torch.float16), rnd(4, 16, dtype=torch.float16, seed=2)
    qk = rnd(4, 3, 16, dtype=torch.float16, seed=3)
    torch_b, tri_b = KernelBackend(), KernelBackend(elementwise="triton")
    assert select_backend("cpu").elementwise == "torch"
    assert torch.equal(torch_b.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    assert torch.equal(torch_b.rope(qk, cos, sin), ref.rope(qk, cos, sin))
    close(tri_b.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    close(tri_b.add_rms_norm(x, x, w, 1e-6)[1], ref.add_rms_norm(x, x, w, 1e-6)[1])
    assert torch.equal(tri_b.rope(qk, cos, sin), ref.rope(qk, cos, sin))
    gu = silu_case(4, 40, torch.float16)
    assert torch.equal(torch_b.silu_mul_(gu.clone(), 40), ref.silu_mul_(gu.clone(), 40))
    close(tri_b.silu_mul_(gu.clone(), 40).contiguous(), ref.silu_mul_(gu.clone(), 40).contiguous())
    # outside the kernels' layout (fp32 weight with fp16 x): the reference, same promotion
    w32 = w.float()
    assert torch.equal(tri_b.rms_norm(x, w32, 1e-6), ref.rms_norm(x, w32, 1e-6))


def test_planner_counts_only_the_kernel_outputs():
    from hisparse_cli.planner.trace import (StepShape, Trace, add_rms_norm, cuda_block_bytes,
                                            rms_norm, rope)

    s = StepShape(layers=2, hidden=4096, inter=14336, vocab=128256, hq=32, hkv=8, d=128, cb=2,
                  kvb=2, cuda=True, backend="triton", awq=False, group=128, awq_lm_head=False,
                  qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False, bs=16, sinks=4,
                  window=64, G=0, C=0, track_scores=False, score_tensor=False, score_stride=1,
                  min_distance=0, importance="attention", num_sms=132)
    tr = Trace(cuda=True)
    tr.free(rms_norm(tr, s, "n", 3, s.hidden), rope(tr, s, "r", 3, s.hq + s.hkv))
    add_rms_norm(tr, s, "n", 3, s.hidden)
    row = cuda_block_bytes(3 * s.hidden * 2)
    assert tr.peak == max(row + cuda_block_bytes(3 * (s.hq + s.hkv) * s.d * 2), 2 * row)


@pytest.mark.parametrize("fuse", [True, False])
def test_planner_models_the_fused_rope_store(fuse):
    """planner_step._attention: with the fused RoPE + K/V store (the Triton kernels) the step
    allocates q [t, hq, D] (no q|k RoPE output); without it (the torch references) RoPE's
    outputs are q|k [t, hq + hkv, D], as the engine does."""
    from hisparse_cli.planner import step as planner_step
    from hisparse_cli.planner.attn import AttnStep
    from hisparse_cli.planner.trace import StepShape, Trace

    s = StepShape(layers=2, hidden=4096, inter=14336, vocab=128256, hq=32, hkv=8, d=128, cb=2,
                  kvb=2, cuda=True, backend="triton" if fuse else "torch", awq=False, group=128,
                  awq_lm_head=False, qkv_bias=False, o_bias=False, mlp_bias=False,
                  qk_norm=False, bs=16, sinks=4, window=64, G=0, C=0, track_scores=False,
                  score_tensor=False, score_stride=1, min_distance=0, importance="attention",
                  num_sms=132)
    seen = []

    class Rec(Trace):
        def alloc(self, name, nbytes):
            seen.append((name, nbytes))
            return super().alloc(name, nbytes)

    tr = Rec(cuda=True)
    t = 5
    h = tr.alloc("h", t * s.hidden * 2)
    planner_step._attention(tr, s, AttnStep(t=t, nb=4, ts=t, globals_full=False), True, False, h)
    rope_allocs = [(n, b) for n, b in seen if n in ("attn.q", "attn.qk")]
    if fuse:
        assert rope_allocs == [("attn.q", t * s.hq * s.d * 2)]
    else:  # the reference's RoPE temporaries and output, all over the q and k heads
        assert rope_allocs and all(n == "attn.qk" and b == t * (s.hq + s.hkv) * s.d * 2
                                   for n, b in rope_allocs)


def test_kernels_compile_for_sm90():
    """The sm_90 compiler (Triton's bundled ptxas) accepts every kernel, without spills."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "sm90_compile.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(script), "norm-rope", "--quick"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


# -- GPU ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(CPU, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t", [1, 7, 1024])
def test_llama_shapes_gpu(dtype, t):
    hs, hq, hkv, d = 4096, 32, 8, 128
    x, y = rnd(t, hs, dtype=dtype), rnd(t, hs, dtype=dtype, seed=1)
    w = rnd(hs, dtype=dtype, seed=2)
    close(tri.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))
    s, out = tri.add_rms_norm(x, y, w, 1e-5)
    s_ref, out_ref = ref.add_rms_norm(x, y, w, 1e-5)
    assert torch.equal(s, s_ref)
    close(out, out_ref)
    _, q, _, qk = qkv_views(t, hq, hkv, d, dtype)
    cos, sin = rnd(t, d, dtype=dtype, seed=4), rnd(t, d, dtype=dtype, seed=5)
    wq = rnd(d, dtype=dtype, seed=6)
    close(tri.rms_norm(q, wq, 1e-6), ref.rms_norm(q, wq, 1e-6))
    for v in (qk, q):
        # not bit-exact on the GPU (H200, run 10): the compiler contracts the product and
        # the sum into one FMA where the reference rounds the product first
        close(tri.rope(v, cos, sin), ref.rope(v, cos, sin))
    gu = silu_case(t, 14336, dtype, pad=8)
    want = ref.silu_mul_(gu.clone(), 14336)
    close(tri.silu_mul_(gu, 14336).contiguous(), want.contiguous())


@pytest.mark.gpu
@pytest.mark.skipif(CPU, reason="needs CUDA")
def test_kernels_capture_in_a_cuda_graph_gpu():
    dtype = torch.float16
    x, y = rnd(1, 4096, dtype=dtype), rnd(1, 4096, dtype=dtype, seed=1)
    w = rnd(4096, dtype=dtype, seed=2)
    _, _, _, qk = qkv_views(1, 32, 8, 128, dtype)  # a strided view of the qkv output
    cos, sin = rnd(1, 128, dtype=dtype, seed=4), rnd(1, 128, dtype=dtype, seed=5)

    gu = rnd(1, 2 * 14336, dtype=dtype, seed=9)

    def run():
        return (tri.rms_norm(x, w, 1e-5), tri.add_rms_norm(x, y, w, 1e-5),
                tri.rope(qk, cos, sin), tri.silu_mul_(gu, 14336))

    run()  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = run()
    x.copy_(rnd(1, 4096, dtype=dtype, seed=7))
    qk.copy_(rnd(1, 40, 128, dtype=dtype, seed=8))
    gu.copy_(rnd(1, 2 * 14336, dtype=dtype, seed=10))
    want = ref.silu_mul_(gu.clone(), 14336)
    g.replay()
    torch.cuda.synchronize()
    close(outs[0], ref.rms_norm(x, w, 1e-5))
    close(outs[1][1], ref.add_rms_norm(x, y, w, 1e-5)[1])
    close(outs[2], ref.rope(qk, cos, sin))
    close(outs[3].contiguous(), want.contiguous())


@pytest.mark.gpu
@pytest.mark.skipif(CPU, reason="needs CUDA")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_model_logits_with_kernels_match_torch_backend_gpu(tmp_path, monkeypatch, arch):
    from conftest import save_tiny
    from hisparse_cli.model.llama import forward_full
    from hisparse_cli.model.loader import load_model

    path, _ = save_tiny(tmp_path, arch)
    model, _ = load_model(path, torch.device("cuda"), torch.float16, fuse=True)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0)).cuda()
    monkeypatch.setenv("HISPARSE_BACKEND", "torch")
    want = forward_full(model, ids)
    monkeypatch.delenv("HISPARSE_BACKEND")
    got = forward_full(model, ids)
    err = float((got - want).abs().max() / want.abs().max())
    assert err < 1e-2, err


@pytest.mark.gpu
@pytest.mark.skipif(CPU, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 7, 1024])
def test_rope_store_kv_llama_shapes_gpu(dtype, t):
    """Llama-3-8B heads: the fused kernel equals rope() then store_kv() bit for bit (the same
    rotation code), and the reference within its tolerance."""
    from hisparse_cli.kernels.attention.attention_triton import store_kv

    hq, hkv, d, nb, bs = 32, 8, 128, 80, 16
    qkv = rnd(t, (hq + 2 * hkv) * d, dtype=dtype)
    cos, sin = rnd(t, d, dtype=dtype, seed=4), rnd(t, d, dtype=dtype, seed=5)
    slots = torch.randperm(nb * bs, generator=torch.Generator().manual_seed(t))[:t].to(DEV)
    kc, vc = kv_caches(nb, bs, hkv, d, dtype, False)
    kc2, vc2, kc_r, vc_r = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    q = tri.rope_store_kv(qkv, hq, hkv, cos, sin, kc, vc, slots)
    qk = tri.rope(qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d), cos, sin)
    store_kv(kc2, vc2, qk[:, hq:], qkv[:, (hq + hkv) * d:].view(t, hkv, d), slots)
    assert torch.equal(q, qk[:, :hq]) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    q_ref = ref.rope_store_kv(qkv, hq, hkv, cos, sin, kc_r, vc_r, slots)
    close(q, q_ref.contiguous())
    close(kc, kc_r)
    assert torch.equal(vc, vc_r)  # v is stored as it is


@pytest.mark.gpu
@pytest.mark.skipif(CPU, reason="needs CUDA")
def test_engine_tokens_with_fused_rope_store_gpu(tmp_path, monkeypatch):
    res = _engine_tokens_fused_vs_not(tmp_path, monkeypatch, 24)
    assert res.extra.get("cuda_graph") == "new", res.extra  # the decode ran from a graph


def _chain_logits(model, ids, all_logits, fuse, monkeypatch, hook=None):
    """fuse=False: the layer-by-layer path, which forward_hidden takes while any hook is on a
    layer (a pre-hook doing nothing here)."""
    from hisparse_cli.model import llama

    handles = [model.model.layers[-1].register_forward_hook(hook)] if hook else []
    if not fuse:
        handles.append(model.model.layers[0].register_forward_pre_hook(lambda m, a: None))
    try:
        with torch.no_grad():
            return model(ids, torch.arange(ids.shape[0]), llama.DenseCausalContext(),
                         all_logits=all_logits)
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("all_logits", [False, True])
def test_fused_residual_chain_equals_layer_by_layer(tiny_models, monkeypatch, all_logits):
    """The residual chain: CausalLM.forward_hidden leaves each layer's closing residual
    add to the next norm (add_rms_norm: the next layer's input norm, then the final norm).
    On the CPU, with the backend's reference ops standing in for the Triton kernels (the
    path is CUDA's), the logits equal the layer-by-layer path's bit for bit (the same adds
    and norms in the same order) and the torch path's within fp32 rounding; with a hook on
    a layer the chain is not taken, and the hook sees the whole layer output."""
    from hisparse_cli.engine.engine import Engine
    from hisparse_cli.model import llama

    path, _ = tiny_models["llama"]
    model = Engine.from_pretrained(path).model
    ids = torch.randint(0, 256, (19,), generator=torch.Generator().manual_seed(3))
    plain = _chain_logits(model, ids, all_logits, False, monkeypatch)  # CPU: the torch path
    monkeypatch.setattr(llama.CausalLM, "_fused", lambda self, x: KernelBackend())
    calls = []
    monkeypatch.setattr(llama.DecoderLayer, "forward_unadded",
                        lambda self, *a, _f=llama.DecoderLayer.forward_unadded: calls.append(1)
                        or _f(self, *a))
    by_layer = _chain_logits(model, ids, all_logits, False, monkeypatch)
    assert len(calls) == len(model.model.layers)  # forward -> forward_unadded, one a layer
    calls.clear()
    chain = _chain_logits(model, ids, all_logits, True, monkeypatch)
    assert len(calls) == len(model.model.layers)
    assert torch.equal(chain, by_layer)
    torch.testing.assert_close(chain, plain, rtol=1e-5, atol=1e-5)
    seen = []
    hooked = _chain_logits(model, ids, all_logits, True, monkeypatch,
                           hook=lambda m, i, out: seen.append(out.shape))
    assert seen == [(ids.shape[0] if all_logits else 1, model.cfg.hidden_size)]
    assert torch.equal(hooked, by_layer)
