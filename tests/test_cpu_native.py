"""The CPU decode kernels (kernels/cpu/decode.c via kernels/cpu/native.py) against their torch
references over weight formats, shapes and thread counts, each ISA version of the hot loop
(AVX-512, AVX2, portable C: the same source built with the others switched off), and the
engine's native decode against transformers and against the torch decode path (greedy
tokens, logits), dense and sparse. Skipped where the machine has no C compiler."""

from __future__ import annotations

import copy
import ctypes
import platform

import pytest
import torch

from hisparse_cli.kernels.cpu import native as cn

pytestmark = pytest.mark.skipif(cn.native_library() is None,
                                reason=f"native CPU kernels unavailable: {cn.native_unavailable_reason()}")

WTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _variants():
    """(name, library) per ISA version this machine can run."""
    out = [("native", cn.native_library())]
    if platform.machine() in ("x86_64", "AMD64"):
        import tempfile
        from pathlib import Path

        folder = Path(tempfile.mkdtemp(prefix="hs-isa-"))
        for name, extra in (("avx2", ("-mno-avx512f",)),
                            ("portable", ("-march=x86-64", "-mtune=generic"))):
            target = folder / f"{name}.so"
            cn.build(target, cn._compiler(), extra)
            out.append((name, cn.load(str(target))))
    return out


VARIANTS = _variants()


@pytest.fixture(params=[v[0] for v in VARIANTS])
def lib(request):
    lib = dict(VARIANTS)[request.param]
    want = {"native": None, "avx2": 1, "portable": 0}[request.param]
    if want is not None:
        assert lib.hs_isa() == want  # the build really is that version
    return lib


@pytest.mark.parametrize("dtype", WTYPES)
@pytest.mark.parametrize("out_f, in_f", [(960, 576), (13, 32), (3, 16), (4100, 64), (576, 1536)])
@pytest.mark.parametrize("nth", [1, 2])
def test_linear_matches_reference(lib, dtype, out_f, in_f, nth):
    g = torch.Generator().manual_seed(out_f * 7 + in_f)
    w = torch.randn(out_f, in_f, generator=g).to(dtype).float()
    bias = torch.randn(out_f, generator=g) if out_f % 2 else None
    tw = cn.TiledWeight.from_linear(w, bias, dtype=dtype)
    assert tw.data.dtype == dtype and torch.equal(tw.dense(), w)  # the layout loses nothing
    assert tw.nbytes == cn.tiled_bytes(out_f, in_f, tw.data.element_size())
    x = torch.randn(in_f, generator=g)
    y = torch.full((out_f,), float("nan"))
    lib.hs_linear(tw.data.data_ptr(), tw.wtype, cn.ptr(tw.bias), x.data_ptr(), y.data_ptr(),
                  out_f, in_f, nth)
    ref = cn.linear_reference(tw, x)
    scale = (w.abs() @ x.abs()).max().item()
    assert (y - ref).abs().max().item() <= 1e-6 * scale + 1e-6


def gguf_like(out_f: int, in_f: int, fmt: str, seed: int = 0) -> torch.Tensor:
    """A float32 [out, in] matrix whose every group of 32 inputs is exactly a GGUF Q4_1
    (fp16(d*q + m), q in 0..15, min and max used) or Q8_0 (fp16(d*q), q int8) group, as
    the GGUF dequantization followed by a float16 conversion makes them."""
    g = torch.Generator().manual_seed(seed)
    groups = (out_f, in_f // 32)
    d = (torch.rand(groups, generator=g) * 0.02 + 1e-3).half().float()[..., None]
    if fmt == "q4":
        q = torch.randint(0, 16, (*groups, 32), generator=g).float()
        q[..., 0], q[..., 1] = 0, 15
        m = (-torch.rand(groups, generator=g) * 0.1).half().float()[..., None]
        w = (d * q + m).half().float()
    else:
        q = torch.randint(-127, 128, (*groups, 32), generator=g).float()
        q[..., 0] = 127
        w = (d * q).half().float()
    return w.reshape(out_f, in_f)


@pytest.mark.parametrize("fmt", ["q4", "q8"])
@pytest.mark.parametrize("out_f, in_f", [(960, 576), (13, 64), (576, 1536)])
def test_quantized_exact_formats(lib, fmt, out_f, in_f):
    """A GGUF-derived matrix packs into its 4-/8-bit form without loss (every value
    reproduced: dense() equals it), input-major storage included, and its product matches
    the reference in every ISA version of the kernel."""
    w = gguf_like(out_f, in_f, fmt, seed=out_f)
    tw = cn.TiledWeight.from_linear(w)
    assert tw.fmt == fmt and torch.equal(tw.dense(), w)
    assert tw.nbytes == cn.tiled_bytes(out_f, in_f, fmt)
    assert torch.equal(cn.TiledWeight.from_linear(w.t().contiguous().t()).data, tw.data)
    x = torch.randn(in_f, generator=torch.Generator().manual_seed(1))
    y = torch.empty(out_f)
    lib.hs_linear(tw.data.data_ptr(), tw.wtype, None, x.data_ptr(), y.data_ptr(), out_f, in_f, 2)
    ref = w.double() @ x.double()
    assert (y.double() - ref).abs().max().item() <= 1e-6 * (w.abs() @ x.abs()).max().item()


def test_a_value_off_the_grid_keeps_a_16_bit_format():
    w = gguf_like(64, 64, "q4")
    w[5, 7] = (w[5, 7].half().view(torch.int16) + 1).view(torch.float16).float()  # one ulp
    tw = cn.TiledWeight.from_linear(w)
    assert tw.fmt in (torch.float16, torch.bfloat16) and torch.equal(tw.dense(), w)
    q8 = gguf_like(64, 64, "q8")
    assert cn.TiledWeight.from_linear(q8).fmt == "q8"  # not a Q4_1 grid: the 8-bit form


def test_tile_layout_matches_reference_for_strided_sources():
    w = torch.randn(37, 48)
    for src in (w, w.t().contiguous().t()):  # [out, in] rows and input-major storage
        for dtype in WTYPES:
            tw = cn.TiledWeight.from_linear(src, dtype=dtype)
            assert torch.equal(tw.data, cn.tile_reference(src.to(dtype)))


def test_exact_dtype_keeps_every_value():
    half = torch.randn(64, 64).half().float()
    assert cn.exact_dtype(half) == torch.float16
    big = torch.randn(64, 64) * 1e6  # outside float16's range: bfloat16 holds these
    assert cn.exact_dtype(big.bfloat16().float()) == torch.bfloat16
    assert cn.exact_dtype(torch.randn(64, 64).bfloat16().float()) == torch.bfloat16
    assert cn.exact_dtype(torch.randn(64, 64)) == torch.float32
    assert cn.exact_dtype(half, big.bfloat16().float()) == torch.float32  # none holds both
    with pytest.raises(ValueError, match="multiple of 16"):
        cn.TiledWeight.from_linear(torch.randn(8, 20))


@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (4, 2, 32), (8, 2, 128), (4, 4, 48)])
@pytest.mark.parametrize("n", [1, 17, 255, 256, 257, 700])
def test_dense_attention_matches_reference(lib, hq, hkv, d, n):
    g = torch.Generator().manual_seed(n + d)
    cap, slot0 = 800, 5
    kc, vc = torch.randn(hkv, cap, d, generator=g), torch.randn(hkv, cap, d, generator=g)
    q = 3 * torch.randn(hq, d, generator=g)  # peaked softmax rows
    k_new, v_new = torch.randn(hkv, d, generator=g), torch.randn(hkv, d, generator=g)
    out = torch.empty(hq, d)
    scratch = torch.empty(lib.hs_attn_scratch(n, hq, hkv, d))
    lib.hs_attn_dense(q.data_ptr(), k_new.data_ptr(), v_new.data_ptr(), kc.data_ptr(),
                      vc.data_ptr(), cap * d, slot0, n, hq, hkv, d, d ** -0.5, out.data_ptr(),
                      scratch.data_ptr(), 2)
    assert torch.equal(kc[:, slot0 + n - 1], k_new) and torch.equal(vc[:, slot0 + n - 1], v_new)
    ref = cn.attn_dense_reference(q, kc[:, slot0:slot0 + n], vc[:, slot0:slot0 + n], d ** -0.5)
    assert (out - ref).abs().max().item() <= 2e-5


def test_rms_norm_matches_reference(lib):
    from hisparse_cli.kernels.norm_rope.norm_rope_ref import rms_norm

    for n in (16, 576, 37):
        x, w = torch.randn(n), torch.randn(n)
        y = torch.empty(n)
        lib.hs_rms_norm(x.data_ptr(), w.data_ptr(), ctypes.c_float(1e-5), y.data_ptr(), n)
        assert torch.allclose(y, rms_norm(x, w, 1e-5), rtol=1e-6, atol=1e-6)


def test_library_key_follows_source_and_compiler():
    a = cn.library_key("int x;", "gcc 12")
    assert a == cn.library_key("int x;", "gcc 12")
    assert a != cn.library_key("int y;", "gcc 12") and a != cn.library_key("int x;", "gcc 13")


def test_no_compiler_means_torch_decode_with_the_reason(monkeypatch, tiny_models):
    from hisparse_cli.engine import Engine, SparseConfig

    cn.native_library.cache_clear()
    try:
        with monkeypatch.context() as m:
            m.setattr(cn.shutil, "which", lambda name: None)
            assert cn.native_library() is None
            assert cn.native_unavailable_reason() == "no C compiler (cc/gcc/clang) found"
            path, _ = tiny_models["llama"]
            eng = Engine.from_pretrained(path, sparse=SparseConfig.dense_config())
            assert eng.model.native_decode is None
            assert eng.decode_path == "torch (no C compiler (cc/gcc/clang) found)"
            res = eng.generate([1, 2, 3], max_new_tokens=4, eos_token_ids=())
            assert res.stats.new_tokens == 4
    finally:
        cn.native_library.cache_clear()
    assert cn.native_library() is not None  # the cached build, found again


# -- the engine ------------------------------------------------------------------------------
def _engine(path, sparse, native: bool, monkeypatch):
    from hisparse_cli.engine import Engine
    from hisparse_cli.model import cpu_decode

    with monkeypatch.context() as m:
        if not native:
            m.setattr(cpu_decode, "unsupported", lambda model: "switched off")
        eng = Engine.from_pretrained(path, sparse=sparse)
    assert (eng.model.native_decode is not None) == native
    return eng


SPARSE = dict(sink_tokens=4, window_size=24, global_tokens=8, block_size=8, prefill_chunk=16,
              recalibrate_every=16, recalibrate_topk=8)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("sparse", ["dense", "attention", "snapkv", "uniform"])
def test_native_decode_matches_the_torch_decode(tiny_models, arch, sparse, monkeypatch):
    """Greedy tokens equal the torch path's, and each decode step's logits agree (the
    torch path: HF's logits in test_engine_parity); dense runs take the C attention,
    sparse ones the run's own attention between the C halves of each layer."""
    from hisparse_cli.engine import SparseConfig

    path, _ = tiny_models[arch]
    cfg = (SparseConfig.dense_config(block_size=8, prefill_chunk=16) if sparse == "dense"
           else SparseConfig(importance=sparse, **SPARSE))
    ids = torch.randint(3, 256, (45,), generator=torch.Generator().manual_seed(5))
    got, want = (_engine(path, cfg, n, monkeypatch).generate(ids, max_new_tokens=40,
                                                           eos_token_ids=()) for n in (True, False))
    assert got.token_ids == want.token_ids
    assert got.stats.recalibrations == want.stats.recalibrations
    assert got.stats.decode_path.startswith("native") and want.stats.decode_path.startswith("torch")
    native, ref = _engine(path, cfg, True, monkeypatch), _engine(path, cfg, False, monkeypatch)
    seq = ids.tolist() + want.token_ids[:30]
    runs = [e.new_run(len(seq)) for e in (native, ref)]
    for (run, _), eng in zip(runs, (native, ref)):
        run.step(eng.model, torch.tensor(seq[:16]))
    for t in seq[16:]:
        a, b = (run.step(e.model, torch.tensor([t])) for (run, _), e in zip(runs, (native, ref)))
        assert a.shape == b.shape == (1, 256)
        assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item() + 1e-5
    for run, _ in runs:
        run.seq.release()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sixteen_bit_checkpoints_decode_from_their_own_format(tmp_path, dtype, monkeypatch):
    """A checkpoint stored in float16 / bfloat16 keeps its 16-bit values in the decode copy
    (half the bytes a token reads), and decodes HF's greedy tokens (HF in float32 on the
    same values)."""
    from conftest import save_tiny

    from hisparse_cli.engine import SparseConfig

    path, hf = save_tiny(tmp_path, "llama", hidden_size=128, intermediate_size=256)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(dtype).float())
    # a copy is saved in `dtype` (converting hf itself would round its RoPE buffer too)
    copy.deepcopy(hf).to(dtype).save_pretrained(path, safe_serialization=True)
    eng = _engine(path, SparseConfig.dense_config(block_size=16, prefill_chunk=16), True,
                  monkeypatch)
    assert eng.decode_path == f"native ({str(dtype)[6:]} weights)"
    ids = torch.randint(3, 256, (30,), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ref = hf.generate(ids[None], max_new_tokens=20, do_sample=False, eos_token_id=None,
                          pad_token_id=0, attention_mask=torch.ones(1, 30, dtype=torch.long))
    assert eng.generate(ids, max_new_tokens=20, eos_token_ids=()).token_ids == ref[0, 30:].tolist()


def test_hooks_and_full_last_layer_take_the_torch_modules(tiny_models, monkeypatch):
    """A forward hook on a layer (quality/capture.py) sees every layer call: the native
    step steps aside while one is registered."""
    from hisparse_cli.engine import SparseConfig

    path, _ = tiny_models["llama"]
    eng = _engine(path, SparseConfig.dense_config(), True, monkeypatch)
    calls = []
    handle = eng.model.model.layers[0].register_forward_hook(lambda *a: calls.append(1))
    try:
        eng.generate([5, 6, 7], max_new_tokens=3, eos_token_ids=())
    finally:
        handle.remove()
    assert len(calls) == 3  # the prefill and two decode steps
