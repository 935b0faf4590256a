"""benchmarks/gpu_llama_cpp.py's random Llama-shaped GGUF (the llama.cpp GPU peer's model):
written tiny, read back with gguf's GGUFReader. The Q4_0 blocks are checked against our own
reading of the block layout (fp16 d, then 16 bytes; element j < 16 the low nibble of byte j,
element 16 + j its high nibble; value (nibble - 8) * d), and against gguf's dequantizer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_llama_cpp",
                                               ROOT / "benchmarks" / "gpu_llama_cpp.py")
glc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(glc)

TINY = dict(layers=2, hidden=256, heads=4, kv_heads=2, ffn=512, vocab=1024, ctx=4096)


def q4_0_dequant(raw: np.ndarray, cols: int) -> np.ndarray:
    """Our own Q4_0 reading: raw (rows, cols / 32 * 18) bytes -> float32 (rows, cols)."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, cols // 32, 18)
    d = blocks[:, :, :2].copy().view("<f2").astype(np.float32)  # (rows, nb, 1)
    qs = blocks[:, :, 2:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)  # lo 0..15, hi
    return ((codes - 8.0) * d).reshape(rows, cols)


def tensors(path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def test_q4_0_pack_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    rows, cols = 8, 96
    codes = rng.integers(0, 16, (rows, cols), dtype=np.uint8)
    d = rng.uniform(0.001, 0.1, (rows, cols // 32)).astype(np.float16)
    raw = glc.q4_0_pack(codes, d)
    assert raw.shape == (rows, cols // 32 * 18)
    want = (codes.astype(np.float32) - 8) * np.repeat(d.astype(np.float32), 32, axis=1)
    path = tmp_path / "one.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("x", raw, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = tensors(path)["x"]
    assert t.tensor_type == gguf.GGMLQuantizationType.Q4_0
    assert list(t.shape) == [cols, rows]  # GGUF order: ne0 = the row length
    got = q4_0_dequant(np.asarray(t.data).reshape(rows, -1), cols)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
                                  .reshape(rows, cols), want)


def test_random_llama_gguf(tmp_path):
    path = tmp_path / "tiny.gguf"
    info = glc.write_gguf(path, **TINY, log=lambda *_: None)
    r = gguf.GGUFReader(str(path))
    ts = {t.name: t for t in r.tensors}
    specs = glc.model_tensors(TINY["layers"], TINY["hidden"], TINY["heads"], TINY["kv_heads"],
                              TINY["ffn"], TINY["vocab"], "q6_k")
    assert list(ts) == [s[0] for s in specs]
    assert len(ts) == 2 + 9 * TINY["layers"] + 1
    Q = gguf.GGMLQuantizationType
    kinds = {"q4_0": Q.Q4_0, "q6_k": Q.Q6_K, "ones": Q.F32}
    for name, shape, kind, fan_in in specs:
        t = ts[name]
        assert t.tensor_type == kinds[kind], name
        assert list(t.shape) == list(reversed(shape)), name
        if kind == "ones":
            np.testing.assert_array_equal(np.asarray(t.data), np.ones(shape, np.float32))
            continue
        rows, cols = shape
        raw = np.asarray(t.data).reshape(rows, -1)
        d = info["scales"][name]
        assert d == pytest.approx(1 / ((glc.Q4_0_STD if kind == "q4_0" else glc.Q6_K_STD
                                        * glc.Q6_K_SCALE) * fan_in ** 0.5), rel=1e-3)
        ref = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(rows, cols)
        assert np.isfinite(ref).all()
        if kind == "q4_0":
            # every block carries the intended scale; values are (nibble - 8) * d
            assert (raw.reshape(rows, -1, 18)[:, :, :2].copy().view("<f2") == d).all()
            vals = q4_0_dequant(raw, cols)
            np.testing.assert_array_equal(vals, ref)
            codes = np.rint(vals / d + 8)
            np.testing.assert_array_equal(codes * d - 8 * d, vals)
            assert codes.min() == 0 and codes.max() == 15
        # weights' std is 1 / sqrt(fan_in) (random codes: within a few percent)
        assert float(ref.std()) == pytest.approx(fan_in ** -0.5, rel=0.05), name

    f = r.fields
    assert f["general.architecture"].contents() == "llama"
    assert f["llama.block_count"].contents() == TINY["layers"]
    assert f["llama.attention.head_count_kv"].contents() == TINY["kv_heads"]
    assert f["llama.rope.freq_base"].contents() == 500000.0
    assert f["llama.context_length"].contents() == TINY["ctx"]
    toks = f["tokenizer.ggml.tokens"].contents()
    assert len(toks) == TINY["vocab"] == len(set(toks))
    assert toks[3 + 0x0A] == "<0x0A>"  # the byte tokens llama.cpp's SPM vocabulary requires
    assert info["n_params"] == sum(int(np.prod(s[1])) for s in specs)


def test_8b_shape_sizes():
    """The full-size model's tensors: Llama-3-8B's 8.03 B parameters, 4.33 GiB of Q4_0 with
    a Q6_K output (llama.cpp's own figures for its Llama-3-8B Q4_0)."""
    specs = glc.model_tensors(32, 4096, 32, 8, 14336, 128256, "q6_k")
    n = sum(int(np.prod(s[1])) for s in specs)
    assert n == 8_030_261_248
    per = {"q4_0": 18 / 32, "q6_k": 210 / 256, "ones": 4}
    size = sum(int(np.prod(s[1])) * per[s[2]] for s in specs)
    assert size / 2**30 == pytest.approx(4.33, abs=0.01)


def test_pack_keeps_what_the_cuda_build_needs():
    keep = glc.keep
    for rel in ("CMakeLists.txt", "ggml/src/ggml.c", "ggml/src/ggml-cuda/fattn.cu",
                "ggml/src/ggml-cuda/template-instances/mmq-instance-q4_0.cu",
                "ggml/src/ggml-cpu/ggml-cpu.c", "src/llama.cpp", "common/common.cpp",
                "vendor/nlohmann/json.hpp", "tools/CMakeLists.txt",
                "tools/llama-bench/llama-bench.cpp", "cmake/build-info.cmake"):
        assert keep(rel), rel
    for rel in ("docs/build.md", "models/ggml-vocab-llama-bpe.gguf", "tests/test-backend-ops.cpp",
                "ggml/src/ggml-vulkan/ggml-vulkan.cpp", "ggml/src/ggml-metal/ggml-metal.m",
                "tools/server/server.cpp", "tools/mtmd/clip.cpp", "gguf-py/gguf/gguf.py",
                "examples/simple/simple.cpp", ".github/workflows/build.yml",
                "vendor/miniaudio/miniaudio.h"):
        assert not keep(rel), rel
