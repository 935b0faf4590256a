"""The persistent decode step (kernels/cuda/cuda_step.py, kernels/cuda/decode_step.cu) and the item
layout of AWQLinear it reads.

CPU: the host mirror of the kernel's parameter struct, the CTA ranges behind the reduction
buffer's size, why a model/run is refused, AWQLinear's item layout against its other layouts,
and (where libnvrtc is found) that the kernel compiles for the GQA / hidden sizes it serves.
GPU (H200): every decode step of small random INT4 Llamas through the kernel against the
engine's layer-by-layer Triton step from the same state (benchmarks/gpu_decode.py bench's
check), and an Engine.generate that runs it inside the CUDA graph.
"""

from __future__ import annotations

import ctypes
import importlib.util
import re
from pathlib import Path

import pytest
import torch

from hisparse_cli.kernels.cuda import cuda_step
from hisparse_cli.model.awq import AWQLinear

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
SM90 = CUDA and torch.cuda.get_device_capability() >= (9, 0)


def _c_struct_fields() -> list[tuple[str, str]]:
    """(name, C type) of decode_step.cu's StepParams, in declaration order."""
    src = cuda_step.SOURCE.read_text()
    body = re.search(r"struct StepParams \{(.*?)\n\};", src, re.S).group(1)
    out = []
    for line in body.splitlines():
        code = line.split("//")[0].strip().rstrip(";")
        if not code:
            continue
        m = re.match(r"(const\s+)?([\w]+)\s*(\*?)\s*(.*)", code)
        ctype = m.group(2) + m.group(3)
        for name in m.group(4).split(","):
            name = name.strip().lstrip("*")
            out.append((name, ctype + ("*" if "*" in code.split(name)[0][-2:] else "")))
    return out


def test_step_params_mirror_the_kernel_struct():
    fields = _c_struct_fields()
    assert [n for n, _ in fields] == [n for n, _ in cuda_step.StepParams._fields_]
    width = {ctypes.c_void_p: "ptr", ctypes.c_longlong: "i64", ctypes.c_int: "int",
             ctypes.c_float: "float"}
    for (name, ctype), (_, pytype) in zip(fields, cuda_step.StepParams._fields_):
        kind = "ptr" if "*" in ctype else {"i64": "i64", "int": "int", "float": "float"}[ctype]
        assert width[pytype] == kind, name
    # the C layout: 15 pointers, an int64, 14 ints, 3 floats, padded to 8
    assert ctypes.sizeof(cuda_step.StepParams) == 15 * 8 + 8 + 14 * 4 + 3 * 4 + 4


def test_source_is_one_string_for_nvrtc():
    # NVRTC gets no include path: ring.cuh is inlined, once, where decode_step.cu includes it
    src = cuda_step.source()
    ring = (cuda_step.SOURCE.parent / "ring.cuh").read_text()
    assert "#include" not in src and src.count(ring) == 1
    assert src.index("page_qk(") < src.index("decode_step(const StepParams")


def test_red_tiles_cover_every_cta_range():
    # the kernel's CTA c takes items [n c / P, n (c + 1) / P) of a GEMV with G groups a tile
    for ctas in (34, 132):
        for g, t in ((32, 48), (112, 32), (32, 224), (32, 1002), (8, 12)):
            need = cuda_step.red_tiles_needed([(g, t)], ctas)
            spans = []
            n = g * t
            for c in range(ctas):
                a, b = n * c // ctas, n * (c + 1) // ctas
                if b > a:
                    spans.append(len({i // g for i in range(a, b)}))
            assert need == max(spans)


def test_ring_stages_fit_the_shared_memory():
    # an H200 block may opt in to 227 KiB: 16 slots for GQA 4; GQA 8 with the mass (its
    # scores' buffer is larger) gives up 4 slots; too little memory for 8 slots is refused
    limit = 227 * 1024
    assert cuda_step.ring_stages(10, 4, True, limit) == 16
    assert cuda_step.ring_stages(10, 8, True, limit) == 12
    for gqa in (4, 8):
        for mass in (False, True):
            st = cuda_step.ring_stages(10, gqa, mass, limit)
            assert st % 4 == 0 and cuda_step.smem_bytes(st, 10, gqa, mass) <= limit
    assert cuda_step.ring_stages(10, 4, True, 100 * 1024) is None


def test_unsupported_says_why_on_the_cpu():
    class Run:
        device = torch.device("cpu")

    assert cuda_step.unsupported(object(), Run()) == "not a CUDA device"


def test_settings_the_kernel_serves():
    from hisparse_cli.config.settings import SparseConfig

    ok = SparseConfig(block_size=16, global_tokens=64, importance="attention")
    assert cuda_step.settings_unsupported(ok, torch.float16) is None
    assert "fp16" in cuda_step.settings_unsupported(ok, torch.float32)
    assert "block size 8" in cuda_step.settings_unsupported(
        SparseConfig(block_size=8), torch.float16)
    assert "40 global" in cuda_step.settings_unsupported(
        SparseConfig(global_tokens=40, recalibrate_topk=40), torch.float16)
    assert "probe" in cuda_step.settings_unsupported(
        SparseConfig(importance="probe"), torch.float16)
    # dense attention has no globals: their count does not matter
    assert cuda_step.settings_unsupported(
        SparseConfig(window_size=None, global_tokens=40, recalibrate_topk=40),
        torch.float16) is None


@pytest.mark.parametrize("kernel", ["persistent", ""])
def test_engine_keeps_the_layout_where_the_kernel_cannot_run(monkeypatch, kernel):
    """HISPARSE_DECODE_KERNEL=persistent, or unset (auto), on a CPU engine: the note says why
    and the INT4 linears keep their layout (items would make every decode product a dequantize
    + matmul)."""
    from hisparse_cli.config.settings import SparseConfig
    from hisparse_cli.engine.engine import Engine
    from hisparse_cli.model.config import ModelConfig
    from hisparse_cli.model.llama import CausalLM

    if kernel:
        monkeypatch.setenv("HISPARSE_DECODE_KERNEL", kernel)
    else:
        monkeypatch.delenv("HISPARSE_DECODE_KERNEL", raising=False)
    cfg = ModelConfig.from_dict({"model_type": "llama", "vocab_size": 256, "hidden_size": 128,
                                 "intermediate_size": 256, "num_hidden_layers": 1,
                                 "num_attention_heads": 1, "num_key_value_heads": 1,
                                 "max_position_embeddings": 512})
    model = CausalLM(cfg)
    model.model.layers[0].mlp.down_proj = _awq(128, 256)
    model.init_rope(torch.device("cpu"))
    eng = Engine(model, cfg, sparse=SparseConfig(), device=torch.device("cpu"),
                 kv_dtype=torch.float32)
    assert eng.decode_kernel_note  # CUDA-graph decode is off on the CPU
    assert eng.model.model.layers[0].mlp.down_proj.layout != "items"


def test_engine_puts_item_layout_linears_back():
    """A model an earlier (persistent) plan left in the item layout, given to an engine whose
    plan is not persistent (a shared model, replan()): its INT4 linears return to a layout the
    plan decodes with, and the logits are the model's before the conversion."""
    from hisparse_cli.config.settings import SparseConfig
    from hisparse_cli.engine.engine import Engine
    from hisparse_cli.model.config import ModelConfig
    from hisparse_cli.model.llama import CausalLM

    cfg = ModelConfig.from_dict({"model_type": "llama", "vocab_size": 256, "hidden_size": 128,
                                 "intermediate_size": 256, "num_hidden_layers": 1,
                                 "num_attention_heads": 1, "num_key_value_heads": 1,
                                 "max_position_embeddings": 512})
    torch.manual_seed(0)
    model = CausalLM(cfg)
    lin = model.model.layers[0].mlp.down_proj = _awq(128, 256)
    model.init_rope(torch.device("cpu"))
    kw = dict(sparse=SparseConfig(), device=torch.device("cpu"), kv_dtype=torch.float32)
    ids = list(range(3, 40))
    want = Engine(model, cfg, **kw).logits(ids)
    assert lin.set_layout("items") and lin.layout == "items"
    eng = Engine(model, cfg, **kw)
    assert eng.execution.int4_layout.value != "none"  # built in code: no quantization_config
    assert lin.layout in ("awq", "kmajor", "tiled") and lin.qzeros is not None
    assert torch.allclose(eng.logits(ids), want, rtol=1e-5, atol=1e-5)


def test_set_layout_refuses_unknown_layouts():
    lin = _awq(128, 256)
    assert lin.set_layout("items")
    for name in ("none", "int4pack", "bogus"):  # (plan values that are not a layout)
        assert not lin.set_layout(name) and lin.layout == "items"


def _awq(out_f: int, in_f: int, seed: int = 0) -> AWQLinear:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g)
    return AWQLinear.from_float(w, None, 128, dtype=torch.float32)


def test_awq_linear_item_layout_round_trip_and_forward():
    lin = _awq(384, 256)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    qw, qz, sc = lin.checkpoint_qweight().clone(), lin.qzeros.clone(), lin.scales.clone()
    from hisparse_cli.kernels.int4.awq_ref import dequantize_weight

    ref = x @ dequantize_weight(qw, qz, sc, 128).float()  # the AutoAWQ tensors' own meaning
    assert lin.set_layout("items") and lin.layout == "items"
    assert lin.qweight.shape == (3 * 2, 2128) and lin.qzeros is None and lin.scales is None
    assert torch.allclose(lin(x), ref, rtol=1e-5, atol=1e-4)
    assert torch.equal(lin.checkpoint_qweight(), qw)
    assert lin.set_layout("awq") and lin.layout == "awq"
    assert torch.equal(lin.qweight, qw) and torch.equal(lin.qzeros, qz)
    assert torch.equal(lin.scales, sc)


def test_item_layout_conversion_failure_leaves_a_working_linear(monkeypatch):
    """Out of memory (or Ctrl-C) while the items are made: the linear keeps its weights in
    the AWQ layout and computes what it did; the error reaches the caller."""
    from hisparse_cli.kernels.int4 import awq_items

    lin = _awq(256, 256, 7)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(8))
    want = lin(x)

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory (test)")

    monkeypatch.setattr(awq_items, "items_from_awq", oom)
    with pytest.raises(torch.OutOfMemoryError):
        lin.set_layout("items")
    assert lin.layout == "awq" and lin.qweight is not None
    assert torch.allclose(lin(x), want, rtol=1e-5, atol=1e-5)


def test_item_layout_refuses_other_group_sizes():
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(2))
    lin = AWQLinear.from_float(w, None, 64, dtype=torch.float32)
    assert not lin.set_layout("items") and lin.layout != "items"


def test_stacked_item_linears_equal_their_parts():
    from hisparse_cli.model.llama import _stack_linears

    parts = [_awq(256, 256, 3), _awq(128, 256, 4), _awq(128, 256, 5)]
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(6))
    for p in parts:
        assert p.set_layout("items")
    want = torch.cat([p(x) for p in parts], dim=1)
    fused = _stack_linears(parts)
    assert fused.layout == "items" and fused.out_features == 512
    assert torch.allclose(fused(x), want, rtol=1e-5, atol=1e-5)


def _nvrtc() -> bool:
    from hisparse_cli.kernels.cuda import cuda_rt

    return cuda_rt.nvrtc_available()


@pytest.mark.skipif(not _nvrtc(), reason="no libnvrtc found (HISPARSE_NVRTC points at one)")
@pytest.mark.parametrize("gqa,norm_pairs,extra", [
    (4, 4, ()), (7, 4, ()), (8, 8, ()), (3, 1, ()), (4, 4, ("-DTIMELINE=1",)),
    (4, 4, ("-DATT_WARPS=2",)), (8, 8, ("-DATT_WARPS=2",))])
def test_kernel_compiles_for_the_shapes_it_serves(gqa, norm_pairs, extra, tmp_path,
                                                  monkeypatch):
    """The shapes, the 2-warp attention build and the profiling build (TIMELINE) compile
    with NVRTC (no CUDA headers)."""
    from hisparse_cli.kernels.cuda import cuda_rt

    monkeypatch.setenv("HISPARSE_HOME", str(tmp_path))
    names = ["decode_step<false>", "decode_step<true>"]
    c = cuda_rt.compile_cubin(cuda_step.source(), arch=(9, 0), name_expressions=names,
                              options=[f"-DGQA={gqa}", f"-DNORM_PAIRS={norm_pairs}", *extra])
    assert len(c.cubin) > 10000 and set(c.lowered) == set(names)


def test_norm_pairs_cover_the_hidden_size():
    """NORM_PAIRS: every one of hidden / 2 pairs held by one of the nw * 32 consumer threads
    (the default 16 warps: hidden / 1024; the NW=12 variant's 384 threads need more)."""
    assert cuda_step.norm_pairs(4096) == 4 and cuda_step.norm_pairs(8192) == 8
    assert cuda_step.norm_pairs(4096, 12) == 6 and cuda_step.norm_pairs(8192, 12) == 11
    assert cuda_step.norm_pairs(2560) == 3 and cuda_step.norm_pairs(128, 12) == 1
    for hidden in range(128, cuda_step.MAX_HIDDEN + 1, 128):
        for nw in (8, 12, 16):
            p = cuda_step.norm_pairs(hidden, nw)
            assert p * nw * 32 >= hidden // 2 > (p - 1) * nw * 32


def test_ring_slots_are_a_multiple_of_every_consumer_unit_count():
    """Every group that takes every units-th ring entry must own its slots (ring_units: a
    parity wait on a slot whose previous fill another group took can pass while that fill is
    still in flight; run 153's launch failures). GEMV groups nw / 4, attention groups nw /
    att_warps."""
    assert cuda_step.ring_units(16, 4) == 4 and cuda_step.ring_units(16, 2) == 8
    assert cuda_step.ring_units(12, 4) == 3 and cuda_step.ring_units(12, 2) == 6
    assert cuda_step.ring_units(8, 4) == 2 and cuda_step.ring_units(8, 2) == 4
    plan = cuda_step.ring_plan
    # the default build (16 warps): GQA 4 holds 16 slots, both attention builds run all 16
    assert plan(16, 16, 19) == (2, 16) and plan(16, 16, 9) == (4, 16)
    # GQA 8 holds 12: the 2-warp build's 8 groups could run only 8, so 4 warps a page
    assert plan(12, 16, 19) == (4, 12)
    assert plan(12, 16, 19, att_warps_=2) == (2, 8)  # asked for: 8 slots, sound
    # 12 consumer warps (3 GEMV groups): 15 slots with 4 warps a page, 12 with 2 (6 groups)
    assert plan(16, 12, 9) == (4, 15) and plan(16, 12, 19) == (4, 15)
    assert plan(16, 12, 19, att_warps_=2) == (2, 12)
    assert plan(16, 8, 19) == (2, 16)
    with pytest.raises(ValueError, match="a multiple of 3, 8 to 8"):
        plan(8, 12, 9)  # 8 slots allocated: 3 groups could run only 6
    for allocated in (12, 16):
        for nw in (8, 12, 16):
            for pages in (1, 9, 19):
                aw, st = plan(allocated, nw, pages)
                assert st % cuda_step.ring_units(nw, aw) == 0 and 8 <= st <= allocated


def test_attention_warps_follow_the_pages_a_unit():
    """The default build's warps an attention page: 4 at the 4060ti-6g settings' ~9 pages a
    unit, 2 at h200-141g's ~19 (runs 145-146 timed both builds at both); the step asks for
    the 2-warp build only then (or where asked: CudaDecodeStep's att_warps)."""
    assert cuda_step.att_warps(1) == 4 and cuda_step.att_warps(9) == 4
    assert cuda_step.att_warps(19) == 2 and cuda_step.att_warps(cuda_step.MASS_PAGES) == 2
    assert cuda_step.att_warps(cuda_step.ATT_WARPS_2_PAGES - 1) == 4
    # the merge space holds the 2-warp build's 8 groups at every GQA the kernel takes
    assert cuda_step.MERGE_GROUPS * 2 == cuda_step.NW


def _bench():
    spec = importlib.util.spec_from_file_location(
        "gpu_decode", ROOT / "benchmarks" / "gpu_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", range(3))
@pytest.mark.parametrize("mlp", ["", "ATT_WARPS=2"])
def test_kernel_step_equals_the_triton_step(case, mlp):
    """Each step from the same state: logits, stored K/V, masses; the default build and the
    ATT_WARPS=2 build (which small models take only when asked). Bounds: fp16 activations
    rounded in other places (the kernel keeps the residual stream in fp32) move logits by
    ~2e-3 of their range after 4 layers (measured 1.9-2.5e-3); 1e-2 leaves room, while a
    wrong head, mask or key would be off by O(1)."""
    from hisparse_cli.model.config import ModelConfig

    bench = _bench()
    head_int4, window, globals_, prompt = bench.CHECKS[case]
    r = bench.check_one(ModelConfig.from_dict(bench.SMALL), head_int4, window, globals_, 12,
                        prompt, torch.device("cuda"), mlp)
    w = r["worst_rel"]
    assert r["argmax_agree"] == 12
    assert w["logits"] < 1e-2 and w["k"] < 1e-2 and w["v"] < 1e-2
    assert w["score"] < 1e-2 and w["gmass"] < 1e-2 and w["gseen"] == 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("shape,variant,want", [
    ("llama-3-8b", "", (2, 16)), ("gqa8", "", (4, 12))])
def test_the_ring_goes_round_soundly(shape, variant, want):
    """Many ring entries a CTA in each phase (the small checks above have about one): two
    layers of the 8B shape at the h200-141g-like window (17 pages a split; the INT4 head's 243
    items a CTA go round the ring 15 times), and a GQA-8 model (12 slots held: the 2-warp
    attention's 8 groups would not own their slots, so 4 warps a page) at 19 pages a split.
    Same bounds as above."""
    from hisparse_cli.model.config import ModelConfig
    from hisparse_cli.planner.shapes import SHAPES

    bench = _bench()
    if shape == "gqa8":  # 8 query heads over 1 KV head (32 splits): a longer window
        cfg = ModelConfig.from_dict({**bench.SMALL, "num_key_value_heads": 1})
        window, globals_, prompt = 9216, 256, 10000
    else:
        cfg = ModelConfig.from_dict({**SHAPES[shape], "num_hidden_layers": 2})
        window, globals_, prompt = 4096, 128, 5000
    r = bench.check_one(cfg, True, window, globals_, 6, prompt, torch.device("cuda"), variant)
    w = r["worst_rel"]
    assert (r["att_warps"], r["stages"]) == want and r["unit_pages"] >= 13
    assert r["argmax_agree"] == 6
    assert w["logits"] < 1e-2 and w["k"] < 1e-2 and w["v"] < 1e-2
    assert w["score"] < 1e-2 and w["gmass"] < 1e-2 and w["gseen"] == 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("kernel", ["persistent", ""])
def test_engine_generate_runs_the_kernel_in_its_graph(monkeypatch, kernel):
    """HISPARSE_DECODE_KERNEL=persistent, or unset (auto, the default): the captured graph
    runs the kernel (the run says so) and greedy decoding gives the layer-by-layer path's
    tokens (the per-step check above agreed on every argmax of these models; a near-tie could
    part them late, so the first 8 are compared)."""
    layers, extra_l = _engine_tokens("layers", monkeypatch)
    persistent, extra_p = _engine_tokens(kernel, monkeypatch)
    assert extra_l["decode_kernel"] == "layers"
    assert extra_p["decode_kernel"] == "persistent", extra_p
    assert "decode_kernel_note" not in extra_p
    assert len(persistent) == 24 and persistent[:8] == layers[:8]


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("every", [1, 4])
def test_engine_generate_with_retrieval_runs_the_kernel(monkeypatch, every):
    """The retrieval tier on the persistent kernel (engine/retrieval.py: a decode step chooses
    every layer's pages before the kernel, from the queries the last step left in its
    workspace; the kernel reads the page cache as more of the key segment): the run says
    persistent, offloads the pages the layer-by-layer run offloads, retrieves, and greedy
    decoding gives that run's tokens (first 8, as above)."""
    from hisparse_cli.config.settings import SparseConfig

    sparse = SparseConfig(sink_tokens=4, window_size=256, global_tokens=32, block_size=16,
                          recalibrate_every=128, recalibrate_topk=32, prefill_chunk=256,
                          retrieval_tokens=64, page_cache_tokens=96, retrieval_every=every)
    layers, extra_l, st_l = _engine_tokens("layers", monkeypatch, sparse, stats=True)
    persistent, extra_p, st_p = _engine_tokens("", monkeypatch, sparse, stats=True)
    assert extra_l["decode_kernel"] == "layers"
    assert extra_p["decode_kernel"] == "persistent", extra_p
    assert st_p.pages_offloaded == st_l.pages_offloaded > 0
    assert st_p.decode_bytes_to_cache > 0 and 0 <= st_p.decode_cache_hit_rate <= 1
    assert len(persistent) == 24 and persistent[:8] == layers[:8]


def _engine_tokens(kernel: str, monkeypatch, sparse=None, stats: bool = False):
    from hisparse_cli.config.settings import SparseConfig
    from hisparse_cli.engine.engine import Engine
    from hisparse_cli.model.config import ModelConfig

    import sys

    bench = _bench()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_engine import build_ours, prompt

    if kernel:
        monkeypatch.setenv("HISPARSE_DECODE_KERNEL", kernel)
    else:
        monkeypatch.delenv("HISPARSE_DECODE_KERNEL", raising=False)
    cfg = ModelConfig.from_dict(bench.SMALL)
    dev = torch.device("cuda")
    model = build_ours(cfg, dev, awq=True, host_emb=False, awq_lm_head=True, seed=7)
    bench.to_items(model)
    sparse = sparse or SparseConfig(sink_tokens=4, window_size=256, global_tokens=32,
                                    block_size=16, recalibrate_every=128, recalibrate_topk=32,
                                    prefill_chunk=256)
    eng = Engine(model, cfg, sparse=sparse, device=dev, kv_dtype=torch.float16,
                 backend="triton")
    n = 1500 if sparse.retrieval else 600  # (pages offloaded well before decode)
    res = eng.generate(prompt(n, cfg.vocab_size, seed=8), max_new_tokens=24, min_new_tokens=24)
    eng.release_cached_state()
    return (res.token_ids, res.extra) + ((res.stats,) if stats else ())


def test_decode_kernel_setting(monkeypatch):
    """HISPARSE_DECODE_KERNEL: unset or empty is auto (the default), case and spaces do not
    matter, anything else is a ConfigError naming the three values."""
    from hisparse_cli.config.env import decode_kernel_setting as decode_kernel
    from hisparse_cli.errors import ConfigError

    monkeypatch.delenv("HISPARSE_DECODE_KERNEL", raising=False)
    assert decode_kernel() == "auto"
    for value, want in (("", "auto"), (" Layers ", "layers"), ("persistent", "persistent"),
                        ("AUTO", "auto")):
        monkeypatch.setenv("HISPARSE_DECODE_KERNEL", value)
        assert decode_kernel() == want
    monkeypatch.setenv("HISPARSE_DECODE_KERNEL", "persistant")
    with pytest.raises(ConfigError, match="persistant.*auto, persistent, layers"):
        decode_kernel()


def test_config_unsupported():
    """What the kernel serves, from a config alone (the planner's question): Llama-3-8B AWQ
    yes; a bias, q/k norms, another head dim, too many query heads a KV head, a group size
    other than 128 or a layer linear kept fp16 no; an fp16 lm_head is fine."""
    from dataclasses import replace

    from hisparse_cli.model.awq import AWQConfig
    from hisparse_cli.planner.shapes import shape_config

    cfg = shape_config("llama-3-8b-awq")
    assert cuda_step.config_unsupported(cfg) is None
    assert "bias" in cuda_step.config_unsupported(replace(cfg, attention_bias=True))
    assert "q/k norms" in cuda_step.config_unsupported(replace(cfg, qk_norm=True))
    assert "head dim 64" in cuda_step.config_unsupported(replace(cfg, head_dim=64))
    assert "query heads" in cuda_step.config_unsupported(replace(cfg, num_key_value_heads=2))
    assert "silu" in cuda_step.config_unsupported(replace(cfg, hidden_act="gelu"))
    assert "group size 64" in cuda_step.config_unsupported(cfg, 64)
    head_fp = AWQConfig(group_size=128, modules_to_not_convert=("lm_head",))
    assert cuda_step.config_unsupported(cfg, 128, head_fp) is None
    down_fp = AWQConfig(group_size=128, modules_to_not_convert=("model.layers.3.mlp.down_proj",))
    assert "layer 3 down_proj is kept fp16" in cuda_step.config_unsupported(cfg, 128, down_fp)


@pytest.mark.parametrize("kernel", ["", "persistent", "layers"])
@pytest.mark.parametrize("gpu", [True, False])
def test_planner_plans_the_decode_the_engine_takes(monkeypatch, kernel, gpu):
    """Unset (auto): the buffers are counted only where this machine's GPU runs the kernel
    (device_unsupported stubbed here); =persistent: wherever the model and settings allow;
    =layers: never. The plan's notes say which decode it counts."""
    from hisparse_cli.config.settings import SparseConfig
    from hisparse_cli.planner.memory import plan_memory
    from hisparse_cli.planner.shapes import shape_config

    if kernel:
        monkeypatch.setenv("HISPARSE_DECODE_KERNEL", kernel)
    else:
        monkeypatch.delenv("HISPARSE_DECODE_KERNEL", raising=False)
    monkeypatch.setattr(cuda_step, "device_unsupported",
                        lambda device=None: None if gpu else "no CUDA device")

    def plan(**over):
        kw = dict(weight_format="awq-int4", awq_lm_head=True, sparse=SparseConfig(),
                  context_tokens=4096, max_new_tokens=16, kv_dtype="float16",
                  compute_dtype="float16", device_kind="cuda", backend="triton", num_sms=132)
        return plan_memory(shape_config("llama-3-8b-awq"), **{**kw, **over})

    p = plan()
    counted = "workspace.persistent_decode" in {i.name for i in p.items}
    assert counted == (kernel == "persistent" or (kernel == "" and gpu))
    assert any(n.startswith("decode: the persistent kernel") for n in p.notes) == counted
    # settings the kernel does not serve: never counted; asked for, the plan says why
    p = plan(kv_dtype="float32")
    assert "workspace.persistent_decode" not in {i.name for i in p.items}
    assert any("fp16 KV cache" in n for n in p.notes) == (kernel == "persistent")


def test_planner_counts_the_persistent_buffers(monkeypatch):
    from hisparse_cli.config.settings import SparseConfig
    from hisparse_cli.planner.memory import plan_memory
    from hisparse_cli.planner.shapes import shape_config

    cfg = shape_config("llama-3-8b-awq")
    # by hand, 132 SMs (the MLP as one K_MLP2 phase): workspace 4 + 32 x 6144 + 128256 floats
    # (INT4 head), rounded up to 512 B; residual 4096 floats; partials 8 KV heads x 16 splits
    # x 4 x 130 floats; phase table 129 x 12 int64, rounded up; 32 layers x (28672 gate|up
    # sums + 224 tile flags)
    ws = 4 * (4 + 32 * 6144 + 128256)
    want = (-(-ws // 512) * 512 + 4 * 4096 + 4 * 8 * 16 * 4 * 130 + -(-8 * 12 * 129 // 512) * 512
            + 4 * 32 * (28672 + 224))
    from hisparse_cli.planner.trace import cuda_block_bytes

    def counted(*args):  # the planner's sum: each request as the caching allocator counts it
        return sum(cuda_block_bytes(b) for b in cuda_step.buffer_bytes(*args))

    assert counted(cfg, True, 132) == want == 5294080
    # 100 SMs: 12 splits
    fewer = (-(-ws // 512) * 512 + 4 * 4096 + 4 * 8 * 12 * 4 * 130 + -(-8 * 12 * 129 // 512)
             * 512 + 4 * 32 * (28672 + 224))
    assert counted(cfg, True, 100) == fewer

    def plan():
        return plan_memory(cfg, weight_format="awq-int4", awq_lm_head=True,
                           sparse=SparseConfig(), context_tokens=4096, max_new_tokens=16,
                           kv_dtype="float16", compute_dtype="float16", device_kind="cuda",
                           backend="triton", num_sms=132)

    monkeypatch.delenv("HISPARSE_DECODE_KERNEL", raising=False)
    base = plan()
    monkeypatch.setenv("HISPARSE_DECODE_KERNEL", "persistent")
    with_kernel = plan()
    items = {i.name: i.bytes for i in with_kernel.items}
    assert items["workspace.persistent_decode"] == want
    assert "workspace.persistent_decode" not in {i.name for i in base.items}
    assert with_kernel.peak_allocated_bytes - base.peak_allocated_bytes == want
