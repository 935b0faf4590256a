"""Memory planner against independent oracles: hand arithmetic (weights, AWQ bytes, KV), the
engine's own RunStats and loaded parameters, and every byte torch allocates during a real CPU
`Engine.generate` (recorded by a dispatch mode: op outputs and their lifetimes, by storage).
The `gpu` test compares the predicted peak with torch.cuda.max_memory_allocated.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import weakref
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from conftest import save_tiny
from hisparse_cli.engine import Engine, SparseConfig
from hisparse_cli.engine.block_pool import BlockPool
from hisparse_cli.engine.sparsity import SparseSequence
from hisparse_cli.errors import ConfigError, ResourceError
from hisparse_cli.kernels.int4 import awq_cpu
from hisparse_cli.model.config import ModelConfig
from hisparse_cli.planner.memory import GIB, plan_memory
from hisparse_cli.planner.run import visible_count
from hisparse_cli.planner.shapes import shape_config
from hisparse_cli.planner.trace import cuda_block_bytes
from hisparse_cli.planner.weights import awq_linear_bytes


class AllocRecorder(TorchDispatchMode):
    """Live bytes of every storage an op creates while active, and their peak. Blind to
    buffers a kernel allocates and frees inside one op, except SDPA's (see below)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage ptr -> [bytes, tensors alive]
        self.cur = self.peak = 0

    def _drop(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.cur -= entry[0]
            del self.live[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() == 0:
                continue
            key = t.untyped_storage().data_ptr()
            if key not in self.live:
                if key in inputs and func is not torch.ops.aten.lift_fresh.default:
                    continue  # a view / in-place result of a tensor made before recording
                self.live[key] = [t.untyped_storage().nbytes(), 0]
                self.cur += self.live[key][0]
                self.peak = max(self.peak, self.cur)
            self.live[key][1] += 1
            weakref.finalize(t, self._drop, key)
        if func is torch.ops.aten.scaled_dot_product_attention.default:
            # not decomposed under inference mode: the CPU flash kernel's log-sum-exp
            # [B, Hq, T] fp32 lives inside the op, beside its output
            self.peak = max(self.peak, self.cur + args[0].shape[:-1].numel() * 4)
        return out


def cpu_plan(path, sparse, prompt, new, dtype=torch.float32, **kw):
    cfg = ModelConfig.from_folder(path)
    return plan_memory(cfg, weight_format=kw.pop("weight_format", "fp32"), sparse=sparse,
                       context_tokens=prompt, max_new_tokens=new, kv_dtype=dtype,
                       compute_dtype=dtype, device_kind="cpu", backend="torch", **kw)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    return {a: save_tiny(root, a)[0] for a in ("llama", "qwen2", "qwen3", "mistral")}


# -- weights: hand arithmetic and the loaded model ---------------------------------------------
def test_llama3_8b_fp16_weights_are_16_06_gb():
    plan = plan_memory(shape_config("llama-3-8b"), weight_format="fp16", sparse=SparseConfig(),
                       context_tokens=1024, max_new_tokens=1, kv_dtype="float16",
                       compute_dtype="float16", device_kind="cpu", backend="torch")
    items = {i.name: i.bytes for i in plan.items}
    emb = 128256 * 4096 * 2
    layer = (4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336 + 2 * 4096) * 2
    assert items["weights.embeddings"] == items["weights.lm_head"] == emb
    assert items["weights.linears"] + items["weights.norms"] == 32 * layer + 4096 * 2
    assert plan.weights_bytes - items["weights.rope"] == 16_060_522_496  # 8,030,261,248 params


def test_awq_bytes_of_one_4096x4096_linear():
    qweight = 4096 * 4096 // 2  # int32 [4096, 512]: 8 nibbles a word
    qzeros = (4096 // 128) * (4096 // 8) * 4  # int32 [32, 512]
    scales = (4096 // 128) * 4096 * 2  # fp16 [32, 4096]
    assert awq_linear_bytes(4096, 4096, 128) == (qweight, qzeros, scales) == (8388608, 65536,
                                                                               262144)
    plan = plan_memory(shape_config("llama-3-8b-awq"), weight_format="awq-int4",
                       sparse=SparseConfig(), context_tokens=64, max_new_tokens=1,
                       kv_dtype="float16", compute_dtype="float16", device_kind="cuda",
                       backend="triton")
    per_layer = sum(sum(awq_linear_bytes(i, o, 128)) for i, o in (
        (4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096), (4096, 14336), (4096, 14336),
        (14336, 4096)))  # every tensor is a multiple of 512 B: no allocator rounding
    assert {i.name: i.bytes for i in plan.items}["weights.linears"] == 32 * per_layer


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_weights_equal_the_loaded_model(tiny, arch):
    """The plan's weights are the engine's: the loaded tensors, plus the native CPU decode's
    tiled copy where the engine holds one (model/cpu_decode.py)."""
    from hisparse_cli.model.loader import load_model

    model, _ = load_model(tiny[arch], "cpu", torch.float32)
    tensors = {t.data_ptr(): t.nbytes for t in list(model.parameters()) + list(model.buffers())}
    loaded = sum(tensors.values()) + model.rope.inv_freq.nbytes
    plan = cpu_plan(tiny[arch], SparseConfig(), 64, 1)
    native = Engine.from_pretrained(tiny[arch], sparse=SparseConfig()).model.native_decode
    copy = {i.name: i.bytes for i in plan.items}.get("weights.cpu_decode_copy", 0)
    assert copy == (native.nbytes if native is not None else 0)
    assert plan.weights_bytes == loaded + copy


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # an own head, and a tied one
def test_int8_head_bytes_equal_the_loaded_model(tiny, arch):
    """lm_head_format int8: the plan's head is the loaded Int8Linear's bytes (codes + scales),
    for an untied head and for a tied table (the head becomes its own tensor)."""
    from hisparse_cli.model.int8_linear import Int8Linear
    from hisparse_cli.model.loader import load_model

    model, _ = load_model(tiny[arch], "cpu", torch.float32, lm_head_int8=True)
    assert isinstance(model.lm_head, Int8Linear)
    head = model.lm_head.weight_q.nbytes + model.lm_head.scale.nbytes
    loaded = sum({t.data_ptr(): t.nbytes for t in list(model.parameters())
                  + list(model.buffers())}.values()) + model.rope.inv_freq.nbytes
    plan = cpu_plan(tiny[arch], SparseConfig(), 64, 1, lm_head_int8=True)
    items = {i.name: i.bytes for i in plan.items}
    assert items["weights.lm_head"] == head
    assert plan.weights_bytes - items.get("weights.cpu_decode_copy", 0) == loaded


def test_int8_head_plan_on_cuda_by_hand():
    """Llama-3-8B's head: 128,256 x 4,096 int8 + 128,256 fp32 scales (allocator-rounded) in
    place of 1,002 MiB of fp16; a profile with lm_head_format int8 plans it."""
    from hisparse_cli.config.profiles import load_profile
    from hisparse_cli.planner.profile import plan_for_profile

    cfg = shape_config("llama-3-8b-awq")
    kw = dict(weight_format="awq-int4", sparse=SparseConfig(), context_tokens=64,
              max_new_tokens=1, kv_dtype="float16", compute_dtype="float16",
              device_kind="cuda", backend="triton", embeddings_on_host=True)
    fp = {i.name: i.bytes for i in plan_memory(cfg, **kw).items}["weights.lm_head"]
    i8 = {i.name: i.bytes for i in plan_memory(cfg, lm_head_int8=True, **kw).items}
    assert fp == 128256 * 4096 * 2
    assert i8["weights.lm_head"] == cuda_block_bytes(128256 * 4096) + cuda_block_bytes(128256 * 4)
    assert cuda_block_bytes(128256 * 4096) == 251 * (1 << 21)  # the allocator's 2 MiB rounding
    prof = load_profile("4060ti-6g")
    for fmt, want in ((None, prof.lm_head_format == "int8"), ("int8", True),
                      ("checkpoint", False)):
        p = plan_for_profile(cfg, prof, context_tokens=4096, lm_head_format=fmt)
        assert p.request["lm_head_int8"] is want
        assert p.settings["lm_head_int8"] is want


# -- KV: the engine's numbers and the engine's bound -------------------------------------------
def test_tiny_kv_lines_by_hand(tiny):
    """llama tiny: L=2, Hkv=2, D=16, fp32 KV, bs=16, window 64, chunk 32, G=C=8, 200+8 tokens."""
    sp = SparseConfig(window_size=64, global_tokens=8, recalibrate_topk=8, prefill_chunk=32)
    plan = cpu_plan(tiny["llama"], sp, 200, 8)
    bpb = 2 * 2 * 16 * 2 * 16 * 4  # K and V x L x bs x Hkv x D x 4 B = 8 KiB
    assert plan.kv.bytes_per_block == bpb
    # sinks: 1 block; span: window + chunk - 1 = 95 positions -> 6 blocks, +1 boundary
    assert plan.kv.working_set_bound_blocks == 1 + 6 + 1
    # live blocks grow 2, 4, 6, then 7 (chunk 3 evicts); the storage is allocated once, at
    # the bound (min(8, cdiv(208, 16) = 13) = 8 blocks), before prefill
    assert plan.kv.peak_live_blocks == 7 and plan.kv.capacity_blocks == 8
    slot = 2 * (2 * 2 * 8 * 16 * 4) + 2 * 2 * 8 * (8 + 4 + 4)  # K, V + pos int64, mass, seen
    items = {i.name: i.bytes for i in plan.items if i.counted}
    assert items["kv.paged_kv"] == 8 * bpb
    assert items["kv.importance_scores"] == 8 * 2 * 16 * 2 * 4  # blocks x L x bs x Hkv x fp32
    assert "growth" not in plan.peak_when and "kv_growth" not in plan.phase_peaks
    assert items["kv.global_slots"] == items["kv.candidate_slots"] == slot
    assert plan.kv.kv_bytes_peak == 7 * bpb + 2 * 2 * 2 * (8 + 8) * 16 * 4
    assert items["logits"] in (256 * 4, 2 * 256 * 4)  # the previous step's and the new one


@pytest.mark.parametrize("sp,prompt,new,blocks", [
    # short text: 20 + 8 tokens use cdiv(28, 16) = 2 blocks, not the bound's 8
    (dict(window_size=64, global_tokens=8, recalibrate_topk=8, prefill_chunk=32), 20, 8, 2),
    # dense: every position, allocated once: cdiv(200 + 8, 16) = 13 blocks
    (dict(window_size=None, global_tokens=0, recalibrate_topk=0, sink_tokens=0,
          prefill_chunk=48), 200, 8, 13),
])
def test_storage_is_allocated_once_at_min_of_bound_and_text(tiny, sp, prompt, new, blocks):
    plan = cpu_plan(tiny["llama"], SparseConfig(**sp), prompt, new)
    assert plan.kv.capacity_blocks == plan.kv.working_set_bound_blocks == blocks
    items = {i.name: i.bytes for i in plan.items if i.counted}
    assert items["kv.paged_kv"] == blocks * 8192  # 8 KiB blocks (see above)
    assert plan.resident_bytes - plan.weights_bytes >= blocks * 8192


KV_CASES = [
    ("llama", dict(window_size=64, global_tokens=8, recalibrate_topk=8, prefill_chunk=32), 200, 8),
    ("llama", dict(window_size=None, global_tokens=0, recalibrate_topk=0, sink_tokens=0,
                   prefill_chunk=48), 200, 8),
    ("llama", dict(window_size=40, global_tokens=0, sink_tokens=0, prefill_chunk=7,
                   block_size=4), 97, 30),
    ("qwen2", dict(window_size=48, global_tokens=4, recalibrate_topk=6, prefill_chunk=20,
                   recalibrate_every=40, block_size=8), 177, 6),
    ("qwen3", dict(window_size=48, global_tokens=4, recalibrate_topk=6, prefill_chunk=20,
                   block_size=8, importance="snapkv", observation_window=16), 177, 6),
    ("mistral", dict(window_size=48, global_tokens=4, recalibrate_topk=6, prefill_chunk=20,
                     block_size=8, importance="uniform", score_stride=1), 150, 12),
    ("llama", dict(window_size=64, global_tokens=8, recalibrate_topk=8, prefill_chunk=32,
                   score_stride=1, sink_tokens=20), 150, 5),
]


@pytest.mark.parametrize("arch,sp,prompt,new", KV_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_peak_and_kv_equal_a_recorded_cpu_run(tiny, arch, sp, prompt, new, dtype):
    """Every byte the run allocates besides the weights: recorded == planned; and the KV
    numbers RunStats reports == planned."""
    sparse = SparseConfig(**sp)
    eng = Engine.from_pretrained(tiny[arch], sparse=sparse, dtype=dtype)
    rec = AllocRecorder()
    with rec:
        res = eng.generate(list(range(1, prompt + 1)), max_new_tokens=new, min_new_tokens=new)
    plan = cpu_plan(tiny[arch], sparse, prompt, new, dtype)
    assert res.stats.kv_blocks_peak == plan.kv.peak_live_blocks
    assert res.stats.kv_bytes_peak == plan.kv.kv_bytes_peak
    assert res.stats.recalibrations >= 0
    assert rec.peak == plan.peak_allocated_bytes - plan.weights_bytes, plan.peak_when


def _awq_checkpoint(path, group: int, head: bool) -> None:
    """The fp16 checkpoint at path rewritten as an AutoAWQ GEMM one: every *proj linear (and
    lm_head if head) round-to-nearest INT4 with this group size."""
    from safetensors.torch import load_file, save_file

    from hisparse_cli.kernels.int4.awq_pack import quantize_weight

    tensors = load_file(str(path / "model.safetensors"))
    for name in [k[:-7] for k in tensors
                 if k.endswith("proj.weight") or (head and k == "lm_head.weight")]:
        p = quantize_weight(tensors.pop(name + ".weight"), group)
        tensors.update({f"{name}.qweight": p.qweight, f"{name}.qzeros": p.qzeros,
                        f"{name}.scales": p.scales})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group,
                                  "zero_point": True, "version": "gemm"}
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("chunk,backend", [(32, "auto"), (100, "auto"), (100, "torch")])
def test_awq_cpu_run_matches(tmp_path, monkeypatch, chunk, backend):
    """Every CPU INT4 path: decode-sized calls through the packed kernel (chunk 32: the whole
    run), prefill chunks over CPU_INT4_MAX_TOKENS through the broadcasting dequantize
    (chunk 100), and the exact reference everywhere (HISPARSE_BACKEND=torch)."""
    path, _ = save_tiny(tmp_path, "llama")
    _awq_checkpoint(path, 32, head=True)
    sparse = SparseConfig(window_size=64, global_tokens=8, recalibrate_topk=8,
                          prefill_chunk=chunk)
    monkeypatch.setenv("HISPARSE_BACKEND", backend)
    eng = Engine.from_pretrained(path, sparse=sparse)
    rec = AllocRecorder()
    with rec:
        eng.generate(list(range(1, 121)), max_new_tokens=4, min_new_tokens=4)
    plan = cpu_plan(path, sparse, 120, 4, weight_format="awq-int4", group_size=32,
                    awq_lm_head=True)
    model_bytes = sum(t.nbytes for t in list(eng.model.parameters()) + list(eng.model.buffers()))
    assert plan.weights_bytes == model_bytes + eng.model.rope.inv_freq.nbytes
    assert rec.peak == plan.peak_allocated_bytes - plan.weights_bytes, plan.peak_when


def test_bound_is_the_engines_and_visible_count_matches():
    rng = random.Random(0)
    for _ in range(300):
        sp = SparseConfig(sink_tokens=rng.randint(0, 40), block_size=rng.choice([1, 4, 16]),
                          window_size=rng.choice([None, 1, 17, 64, 300]),
                          prefill_chunk=rng.randint(1, 90))
        seq = SparseSequence(sp, BlockPool())
        pos = 0
        for n in [sp.prefill_chunk] * rng.randint(1, 6) + [1] * rng.randint(0, 20):
            seq.append(n)
            assert visible_count(seq, pos, n) == len(seq.visible_blocks(pos, n)[0])
            seq.evict()
            pos += n
        total = pos
        cfg = ModelConfig.from_dict({"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                                     "intermediate_size": 64, "num_hidden_layers": 1,
                                     "num_attention_heads": 2, "num_key_value_heads": 1})
        plan = plan_memory(cfg, weight_format="fp32", sparse=sp, context_tokens=total,
                           max_new_tokens=0, kv_dtype="float32", compute_dtype="float32",
                           device_kind="cpu", backend="torch")
        expect = SparseSequence(sp, BlockPool()).working_set_bound(sp.prefill_chunk, total)
        assert plan.kv.working_set_bound_blocks == expect
        assert plan.kv.peak_live_blocks <= expect


def test_eviction_and_recalibration_traces_equal_recorded_allocations():
    """planner_step.evict_peak / recalibrate_peak against every byte the cache's own calls
    allocate (they are rarely the run's peak in the tiny runs above, so check them alone)."""
    from test_kv_cache import random_cache

    from hisparse_cli.planner.step import evict_peak, recalibrate_peak
    from hisparse_cli.planner.trace import StepShape

    for importance, G, C, scores in (("attention", 4, 5, True), ("uniform", 6, 3, True),
                                     ("attention", 3, 0, True), ("attention", 2, 7, False)):
        shape = StepShape(layers=3, hidden=16, inter=32, vocab=64, hq=4, hkv=2, d=8, cb=4,
                          kvb=4, cuda=False, backend="torch", awq=False, group=128,
                          awq_lm_head=False, qkv_bias=False, o_bias=False, mlp_bias=False,
                          qk_norm=False, bs=4, sinks=3, window=16, G=G, C=C,
                          track_scores=scores, score_tensor=scores, score_stride=1,
                          min_distance=0, importance=importance, num_sms=1)
        for ne in (1, 3):
            cache = random_cache(ne, G=G, C=C, importance=importance, scores=scores)
            if C:
                rec = AllocRecorder()
                with rec:
                    cache.evict_to_candidates([8, 1, 4][:ne], [0, 20, 44][:ne])
                assert rec.peak == evict_peak(shape, ne).peak, (importance, G, C, ne)
            rec = AllocRecorder()
            with rec:
                cache.recalibrate()
            assert rec.peak == recalibrate_peak(shape).peak, (importance, G, C)


@pytest.mark.parametrize("layers", [1, 2, 4])
@pytest.mark.parametrize("chain", [False, True])
def test_triton_layer_order_equals_recorded_allocations(tmp_path, monkeypatch, chain, layers):
    """planner_step.forward_peak's Triton layer order, with model/llama.py's residual chain
    (chain) and without (a hooked layer), against every byte a CPU forward allocates. The path
    is CUDA's; here its elementwise kernels are stand-ins that allocate what the Triton kernels
    return (norm: the output; add + norm: the sum, then the output; silu * up: in place) and
    the attention, on both sides, is one fresh [rows, hidden] output after which the normed
    input dies (its own trace is checked by the recorded runs above and the GPU test)."""
    from hisparse_cli.kernels.dispatch import KernelBackend
    from hisparse_cli.model import llama
    from hisparse_cli.planner.attn import AttnStep
    from hisparse_cli.planner.step import forward_peak
    from hisparse_cli.planner.trace import StepShape

    class TritonAllocs(KernelBackend):
        def rms_norm(self, x, weight, eps):
            return torch.empty_like(x, memory_format=torch.contiguous_format)

        def add_rms_norm(self, x, y, weight, eps):
            s = x + y
            return s, torch.empty_like(s)

        def silu_mul_(self, gu, inter):
            return gu[..., :inter]

    def attn_model(self, x, cos, sin, ctx, last_only=False, fused=None):
        return torch.ones(1 if last_only else x.shape[0], hidden)

    def attn_plan(tr, s, a, first, last_only, h):
        o = tr.alloc("attn.o", (1 if last_only else a.t) * s.hidden * s.cb)
        tr.free(h)
        return o

    path, _ = save_tiny(tmp_path, "llama", num_hidden_layers=layers)
    model = Engine.from_pretrained(path).model
    cfg, hidden, t = model.cfg, model.cfg.hidden_size, 23
    if not chain:  # forward_hidden takes the layer-by-layer path while a layer has a hook
        model.model.layers[0].register_forward_pre_hook(lambda m, args: None)
    monkeypatch.setattr(llama.CausalLM, "_fused", lambda self, x: TritonAllocs())
    monkeypatch.setattr(llama.Attention, "forward", attn_model)
    monkeypatch.setattr("hisparse_cli.planner.step._attention", attn_plan)
    ids, pos = torch.arange(1, t + 1), torch.arange(t)
    calls = []
    monkeypatch.setattr(llama.DecoderLayer, "forward_unadded",
                        lambda self, *a, _f=llama.DecoderLayer.forward_unadded: calls.append(a[0])
                        or _f(self, *a))
    rec = AllocRecorder()
    with torch.no_grad(), rec:
        model(ids, pos, llama.DenseCausalContext())
    assert len(calls) == layers
    assert all(xh == [] for xh in calls)  # each layer emptied its input list
    shape = StepShape(layers=layers, hidden=hidden, inter=cfg.intermediate_size,
                      vocab=cfg.vocab_size, hq=cfg.num_attention_heads,
                      hkv=cfg.num_key_value_heads, d=cfg.head_dim, cb=4, kvb=4, cuda=False,
                      backend="triton", awq=False, group=128, awq_lm_head=False,
                      qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False, bs=16,
                      sinks=4, window=64, G=0, C=0, track_scores=False, score_tensor=False,
                      score_stride=1, min_distance=0, importance="attention", num_sms=1,
                      residual_chain=chain)
    peak, kept = forward_peak(shape, AttnStep(t=t, nb=2, ts=0, globals_full=True))
    assert kept == [] and rec.peak == peak.peak, (rec.peak, peak)
    # the chain holds one [t, hidden] less through the MLP (the layer's input dies at the
    # post-attention add instead of living in the caller until the layer returns)
    if layers == 4:
        other = forward_peak(replace(shape, residual_chain=not chain),
                             AttnStep(t=t, nb=2, ts=0, globals_full=True))[0].peak
        assert (other - peak.peak) * (1 if chain else -1) == t * hidden * 4


def test_8b_at_128k_on_h200_by_hand():
    """llama-3-8b fp16, the h200-141g sparse settings, 131008 + 512 tokens: the storage is
    allocated once at 1 sink block + cdiv(8192 + 2048 - 1, 16) = 640 + 1 = 642 blocks of
    2*32*16*8*128*2 B = 2 MiB; the peak is a 2048-token chunk's forward (no growth copy) and
    is flat in the document's length apart from the prompt's ids."""
    MiB = 1 << 20
    base = dict(weight_format="fp16", sparse=H200_LIKE, max_new_tokens=512,
                kv_dtype="float16", compute_dtype="float16", device_kind="cuda",
                backend="triton")
    plan = plan_memory(shape_config("llama-3-8b"), context_tokens=131008, **base)
    assert plan.kv.capacity_blocks == 642 and plan.kv.bytes_per_block == 2 * MiB
    items = {i.name: i.bytes for i in plan.items if i.counted}
    assert items["kv.paged_kv"] == 642 * 2 * MiB
    assert items["kv.importance_scores"] == 642 * 32 * 16 * 8 * 4
    lh = 32 * 8  # layers x KV heads; 512 slots: K, V fp16 [128] + pos int64, mass, seen fp32
    assert items["kv.global_slots"] == items["kv.candidate_slots"] == lh * 512 * (
        2 * 128 * 2 + 8 + 4 + 4) == 66 * MiB
    # at down_proj: the stacked gate|up output [2048, 2 x 14336] fp16 (silu and product in
    # place in its gate half) and down's output [2048, 4096], the residual after the
    # attention [2048, 4096] fp16 (the layer's input died at that add: model/llama.py's
    # residual chain), the normed input, RoPE cos/sin [2048, 128] fp16
    assert "forward" in plan.peak_when
    assert items["activations.at_peak"] == (2 * 56 + 16 + 16 + 16 + 1) * MiB
    shorter = plan_memory(shape_config("llama-3-8b"), context_tokens=32768, **base)
    ids = (131008 * 8 // 512) * 512, -(-32768 * 8 // 512) * 512
    assert plan.peak_allocated_bytes - shorter.peak_allocated_bytes == ids[0] - ids[1]


def test_graph_decode_counts_its_sampler(monkeypatch):
    """The graph decode's sampler buffers: DeviceSampler's (seen, history, tokens) live through
    the decode and are freed at its end; the in-graph sampler's (HISPARSE_GRAPH_SAMPLER on)
    stay with the kept graph (resident after the run) and it makes no per-token temporaries.
    A short text, whose decode is the peak, shows both in the peak."""
    from hisparse_cli.engine.sampling.device import DeviceSampler
    from hisparse_cli.engine.sampling.graph import GraphSampler
    from hisparse_cli.planner.trace import Trace

    size = Trace(True).size
    cfg = shape_config("llama-3-8b")
    base = dict(weight_format="fp16", sparse=H200_LIKE, context_tokens=64, max_new_tokens=300,
                kv_dtype="float16", compute_dtype="float16", device_kind="cuda", backend="triton")
    monkeypatch.delenv("HISPARSE_CUDA_GRAPH", raising=False)
    plans = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("HISPARSE_GRAPH_SAMPLER", flag)
        plans[flag] = plan_memory(cfg, **base)
    host, dev = plans["0"], plans["1"]
    v = cfg.vocab_size
    host_bytes = sum(size(b) for b in DeviceSampler.buffer_bytes(v, 300))
    dev_bytes = sum(size(b) for b in GraphSampler.buffer_bytes(v, 300))
    assert dev.resident_bytes - host.resident_bytes == dev_bytes  # kept with the graph
    assert "decode" in host.peak_when and "decode" in dev.peak_when
    items = {i.name: i.bytes for i in dev.items}
    assert items["sampler"] == dev_bytes
    # the host sampler's buffers are in its peak too, with its per-token temporaries
    assert dict((i.name, i.bytes) for i in host.items)["sampler"] == host_bytes
    monkeypatch.setenv("HISPARSE_CUDA_GRAPH", "0")  # eager decode: no graph, no such buffers
    assert "sampler" not in {i.name for i in plan_memory(cfg, **base).items}


def test_graph_decode_adds_its_stream_workspace(monkeypatch):
    """CUDA-graph decode (CUDA + Triton, HISPARSE_CUDA_GRAPH not 0) warms up and captures on
    one side stream, whose cuBLAS workspace (32 MiB) stays allocated, plus the graph's static
    inputs (with a host-resident table, also the embedded row); eager decode has neither."""
    from hisparse_cli.planner.memory import CUBLAS_WORKSPACE_BYTES

    MiB = 1 << 20
    base = dict(weight_format="fp16", sparse=H200_LIKE, context_tokens=32768, max_new_tokens=64,
                kv_dtype="float16", compute_dtype="float16", device_kind="cuda", backend="triton")
    cfg = shape_config("llama-3-8b")
    monkeypatch.delenv("HISPARSE_CUDA_GRAPH", raising=False)
    monkeypatch.setenv("HISPARSE_GRAPH_SAMPLER", "0")  # (its kept buffers: the test above)
    graph = plan_memory(cfg, **base)
    host_graph = plan_memory(cfg, embeddings_on_host=True, **base)
    torch_ref = plan_memory(cfg, **{**base, "backend": "torch"})  # no graph: eager decode
    monkeypatch.setenv("HISPARSE_CUDA_GRAPH", "0")
    eager = plan_memory(cfg, **base)
    host_eager = plan_memory(cfg, embeddings_on_host=True, **base)
    extra = graph.resident_bytes - eager.resident_bytes
    assert CUBLAS_WORKSPACE_BYTES == 32 * MiB and 32 * MiB < extra < 32 * MiB + 64 * 1024
    # the embedded row [1, 4096] fp16 = 8 KiB on top, with the table in host memory
    assert host_graph.resident_bytes - host_eager.resident_bytes == extra + 4096 * 2
    assert torch_ref.resident_bytes - eager.resident_bytes < 32 * MiB  # no graph workspace
    # the prefill chunk stays the peak at this shape: the graph adds to the decode phase only
    assert graph.peak_allocated_bytes == eager.peak_allocated_bytes and "prefill" in graph.peak_when
    short = dict(base, context_tokens=64, max_new_tokens=64)
    monkeypatch.delenv("HISPARSE_CUDA_GRAPH")
    g_short = plan_memory(cfg, **short)  # a short text: decode with the graph is the peak
    monkeypatch.setenv("HISPARSE_CUDA_GRAPH", "0")
    e_short = plan_memory(cfg, **short)
    assert "decode" in g_short.peak_when
    assert g_short.peak_allocated_bytes - e_short.peak_allocated_bytes > 32 * MiB - 8 * MiB


# -- budgets and suggestions -------------------------------------------------------------------
def test_items_sum_to_peak_and_json_round_trips():
    plan = plan_memory(shape_config("qwen2.5-7b"), weight_format="fp16", sparse=SparseConfig(),
                       context_tokens=32000, max_new_tokens=256, kv_dtype="float16",
                       compute_dtype="float16", device_kind="cuda", backend="triton",
                       budget_bytes=40 << 30)
    assert sum(i.bytes for i in plan.items if i.counted) == plan.peak_allocated_bytes
    assert plan.fits and plan.device_total_bytes == plan.peak_allocated_bytes + \
        plan.cuda_context_bytes
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["peak_allocated_bytes"] == plan.peak_allocated_bytes and d["kv"]["block_size"] == 16


H200_LIKE = SparseConfig(window_size=8192, global_tokens=512, recalibrate_topk=512,
                         prefill_chunk=2048, recalibrate_every=2048)


@pytest.mark.parametrize("budget,expect", [(5.5, "together:"), (16.0, "AWQ"),
                                           ("window 4096", "--window 4096")])
def test_suggestions_make_a_non_fitting_plan_fit(budget, expect):
    from hisparse_cli.planner.suggest import _replan

    base = dict(weight_format="fp16", context_tokens=65536, max_new_tokens=256,
                kv_dtype="float16", compute_dtype="float16", device_kind="cuda",
                backend="triton")
    cfg = shape_config("llama-3-8b")
    if isinstance(budget, str):  # exactly what the smaller window needs
        budget = plan_memory(cfg, sparse=replace(H200_LIKE, window_size=4096),
                             **base).peak_allocated_bytes
    else:
        budget = int(budget * (1 << 30))
    plan = plan_memory(cfg, sparse=H200_LIKE, budget_bytes=budget, **base)
    assert plan.fits is False and plan.suggestions
    fitting = [s for s in plan.suggestions if s.fits]
    assert any(s.change.startswith(expect) for s in fitting), [s.change for s in fitting]
    for s in fitting:  # re-planned with the suggestion's overrides, the plan fits
        over = dict(s.overrides)
        fields = {k[7:]: over.pop(k) for k in list(over) if k.startswith("sparse.")}
        if fields:
            over["sparse"] = replace(H200_LIKE, **fields)
        again = _replan(plan, plan_memory, **over)
        assert again.peak_allocated_bytes == s.peak_allocated_bytes
        assert again.peak_allocated_bytes <= again.budget_bytes


def test_check_plan_fits_and_oom_guard():
    from hisparse_cli.planner.vram import allocator_cap_bytes, check_plan_fits, oom_guard

    plan = plan_memory(shape_config("llama-3-8b"), weight_format="fp16", sparse=SparseConfig(),
                       context_tokens=8192, max_new_tokens=64, kv_dtype="float16",
                       compute_dtype="float16", device_kind="cuda", backend="triton",
                       budget_bytes=6 << 30)
    with pytest.raises(ResourceError) as err:
        check_plan_fits(plan)
    assert err.value.exit_code == 5 and "AWQ" in err.value.hint
    check_plan_fits(plan_memory(**{**plan.request, "budget_bytes": 40 << 30}))
    with pytest.raises(ResourceError, match="out of memory during prefill"):
        with oom_guard("prefill"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with pytest.raises(ValueError):
        with oom_guard():
            raise ValueError("not an OOM")
    mib = 1 << 20
    assert allocator_cap_bytes(4992 * mib) == 5248 * mib  # a profile's budget: + the margin
    # a card: - its display - the CUDA context; headless: - the context only
    assert allocator_cap_bytes(6 << 30, card=True, context_bytes=1 << 29,
                               display_bytes=300 * mib) == 6144 * mib - 812 * mib
    assert allocator_cap_bytes(6 << 30, card=True, context_bytes=1 << 29,
                               display_bytes=0) == 11 << 29
    with pytest.raises(ConfigError, match="leaves nothing"):
        allocator_cap_bytes(512 * mib, card=True)


def test_the_planner_imports_no_torch():
    """`hisparse plan`'s arithmetic (and the budget checks) load without torch: the retrieval
    tier's sizes come from engine/retrieval_sizes.py, not from the tier or its kernels."""
    code = ("import sys, hisparse_cli.planner.memory, hisparse_cli.planner.vram; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# torch 2.11's message when an emulated 6 GiB card ran out at 128K (H100, 2026-12-07)
_FRAGMENTED = ("CUDA out of memory. Tried to allocate 128.00 MiB. GPU 0 has a total capacity of "
               "79.18 GiB of which 73.46 GiB is free. Including non-PyTorch memory, this process "
               "has 5.68 GiB memory in use. 5.03 GiB allowed; Of the allocated memory 4.59 GiB "
               "is allocated by PyTorch, and 342.79 MiB is reserved by PyTorch but unallocated. "
               "If reserved but unallocated memory is large try setting "
               "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


def test_a_fragmented_allocator_says_so_and_names_expandable_segments(monkeypatch):
    """A CUDA OOM whose reserved-but-unallocated memory covers the refused size is reported
    as fragmentation, with expandable segments in the hint (one line, exit 5); a full card,
    or expandable segments already on, keeps the plain message and hint."""
    from hisparse_cli.planner.vram import oom_error

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    err = oom_error(torch.OutOfMemoryError(_FRAGMENTED), "prefill")
    assert err.exit_code == 5 and "\n" not in str(err)
    assert "342.79 MiB was reserved by torch but unallocated" in str(err)
    assert str(err).startswith("out of memory during prefill: CUDA out of memory. Tried to "
                               "allocate 128.00 MiB, while")
    assert err.hint.startswith("add expandable_segments:True to PYTORCH_CUDA_ALLOC_CONF")
    assert "--prefill-chunk" in err.hint
    full = _FRAGMENTED.replace("342.79 MiB is reserved", "20.00 MiB is reserved")
    err = oom_error(torch.OutOfMemoryError(full))
    assert "fragmented" not in str(err) and "expandable" not in err.hint
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    err = oom_error(torch.OutOfMemoryError(_FRAGMENTED))
    assert "fragmented" not in str(err) and "expandable" not in err.hint


def test_expandable_segments_are_preferred_unless_the_user_configured_the_allocator():
    """The CLI, load_engine and the tests turn torch's expandable segments on, before CUDA
    initialises, unless PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF is set (then kept as
    set, even without expandable segments) or CUDA is initialised already (torch has read
    them)."""
    from hisparse_cli.config.env import allocator_setting, prefer_expandable_segments

    env: dict = {}
    assert prefer_expandable_segments(env, cuda_initialized=False) == \
        "expandable_segments:True"
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        env = {name: "max_split_size_mb:128"}
        assert prefer_expandable_segments(env, cuda_initialized=False) == \
            "max_split_size_mb:128"
        assert env == {name: "max_split_size_mb:128"}
    env = {"PYTORCH_CUDA_ALLOC_CONF": "  "}  # blank: not a choice
    assert prefer_expandable_segments(env, cuda_initialized=False) == \
        "expandable_segments:True"
    env = {}
    assert prefer_expandable_segments(env, cuda_initialized=True) == "" and env == {}
    assert allocator_setting({"PYTORCH_CUDA_ALLOC_CONF": "a:1", "PYTORCH_ALLOC_CONF": "b:2"}) \
        == "a:1,b:2"


@pytest.mark.gpu
def test_expandable_segments_reach_torch_and_keep_the_budget_cap():
    """On CUDA, the setting made after `import torch` (before CUDA initialises) is the one
    torch's allocator runs with: its segments are expandable, and an emulated card's cap
    (set_per_process_memory_fraction, vram.apply_budget) still refuses what exceeds it."""
    code = ("import os, torch\n"
            "from hisparse_cli.config.env import prefer_expandable_segments\n"
            "os.environ.pop('PYTORCH_CUDA_ALLOC_CONF', None)\n"
            "os.environ.pop('PYTORCH_ALLOC_CONF', None)\n"
            "print(prefer_expandable_segments())\n"
            "x = torch.empty(64 << 20, dtype=torch.uint8, device='cuda')\n"
            "segs = torch.cuda.memory._snapshot()['segments']\n"
            "print(all(s.get('is_expandable') for s in segs) and len(segs) > 0)\n"
            "total = torch.cuda.get_device_properties(0).total_memory\n"
            "torch.cuda.set_per_process_memory_fraction((1 << 30) / total)\n"
            "y = torch.empty(512 << 20, dtype=torch.uint8, device='cuda')\n"
            "try:\n"
            "    z = torch.empty(768 << 20, dtype=torch.uint8, device='cuda')\n"
            "    print('not capped')\n"
            "except torch.OutOfMemoryError:\n"
            "    print('capped')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={k: v for k, v in os.environ.items()
                                          if "ALLOC_CONF" not in k})
    assert out.stdout.split() == ["expandable_segments:True", "True", "capped"]


def test_a_refused_host_allocation_is_a_resource_error():
    """torch's CPU allocator refusing an allocation (a RuntimeError, not MemoryError) is an
    out-of-memory error: oom_guard and the CLI's handler make it exit 5, in one line."""
    from hisparse_cli.cli.app import as_resource_error
    from hisparse_cli.planner.vram import oom_guard

    with pytest.raises(ResourceError) as err:
        with oom_guard("prefill"):
            torch.empty(1 << 50, dtype=torch.uint8)  # 1 PiB: refused at once
    assert err.value.exit_code == 5 and "\n" not in err.value.message
    assert err.value.message == ("out of memory during prefill: the host could not allocate "
                                 "1048576.00 GiB")
    try:
        torch.empty(1 << 50, dtype=torch.uint8)
    except RuntimeError as exc:
        assert as_resource_error(exc).message.startswith("out of memory: the host could not")
    assert as_resource_error(RuntimeError("shape mismatch")) is None


def test_validation_names_the_field():
    base = dict(sparse=SparseConfig(), context_tokens=10, max_new_tokens=1, kv_dtype="float16",
                compute_dtype="float16", device_kind="cuda", backend="triton")
    cfg = shape_config("smollm2-135m")
    with pytest.raises(ConfigError, match="weight_format"):
        plan_memory(cfg, weight_format="int8", **base)
    with pytest.raises(ConfigError, match="triton"):
        plan_memory(cfg, weight_format="fp16", **{**base, "device_kind": "cpu"})
    with pytest.raises(ConfigError, match="kv_dtype"):
        plan_memory(cfg, weight_format="fp16", **{**base, "kv_dtype": "int8"})
    with pytest.raises(ConfigError, match="group_size 128"):  # 576 = 4.5 groups of 128
        plan_memory(cfg, weight_format="awq-int4", **base)


def test_cli_plan_json_parses():
    from typer.testing import CliRunner

    from hisparse_cli.cli.app import app

    r = CliRunner().invoke(app, ["plan", "-m", "llama-3-8b-awq", "-p", "4060ti-6g", "-c",
                                 "32768", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["fits"] is True and d["settings"]["weight_format"] == "awq-int4"
    r = CliRunner().invoke(app, ["plan", "-m", "llama-3-8b", "-p", "4060ti-6g", "--check"])
    assert r.exit_code == 5


def _cli(*args: str):
    from typer.testing import CliRunner

    from hisparse_cli.cli.app import app

    return CliRunner().invoke(app, ["plan", *map(str, args)])


def _cli_peak(*args: str) -> int:
    r = _cli("--json", *args)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)["peak_allocated_bytes"]


SMOL_CPU = ("-m", "smollm2-135m", "-p", "cpu")
SMOL_8K_CPU = (*SMOL_CPU, "-c", "8000", "-n", "128")  # 8,128 positions: the window suggested is 2048
LLAMA_GPU = ("-m", "llama-3-8b", "-p", "3090-24g", "-c", "8000")


@pytest.mark.parametrize("base, alt, expect", [
    ((*SMOL_CPU, "--attention", "sparse"), ("--prefill-chunk", "128"), "--prefill-chunk 128"),
    (SMOL_8K_CPU, ("--window", "256"), "--window 256"),
    ((*SMOL_8K_CPU, "--dense"), ("--kv-dtype", "float16"), "--window 2048"),  # dense: a window
    ((*SMOL_8K_CPU, "--window", "4096", "--global-tokens", "2048", "--recalibrate-topk", "2048"),
     ("--global-tokens", "1024", "--recalibrate-topk", "1024"),
     "--global-tokens 1024 --recalibrate-topk 1024"),
    ((*SMOL_8K_CPU, "--dense"), ("--kv-dtype", "float16"), "--kv-dtype float16"),
    (LLAMA_GPU, ("--weight-format", "awq-int4"), "AWQ INT4 weights"),
    (LLAMA_GPU, ("--embeddings-on-host",), "embeddings in host RAM"),
    ((*SMOL_CPU, "--budget-gib", "0.1"), None, "together: kv_dtype=float16"),
    (("-m", "llama-3-8b", "--device", "cuda", "--budget-gib", "1"), None, "--profile a10-24g"),
])
def test_cli_check_exits_5_with_every_kind_of_suggestion(base, alt, expect):
    """Each branch of planner_suggest, through `hisparse plan --check`: the budget is what the
    plan with `alt` needs (so that change fits), or given in `base`. The float32 KV of the cpu
    profile once crashed the kv branch (exit 1 instead of 5)."""
    budget = () if alt is None else ("--budget-gib", repr((_cli_peak(*base, *alt) + 1024) / GIB))
    r = _cli("--json", "--check", *base, *budget)
    assert r.exit_code == 5, r.output
    assert r.stderr.startswith("Error: the run needs") and "\nHint: " in r.stderr, r.stderr
    plan = json.loads(r.stdout)
    assert plan["fits"] is False
    found = [s for s in plan["suggestions"] if s["change"].startswith(expect)]
    assert found, [s["change"] for s in plan["suggestions"]]
    assert found[0]["fits"] is (not expect.startswith("together")), found
    if found[0]["fits"]:  # within the plan's budget, or the suggested profile's
        limit = found[0]["overrides"].get("budget_bytes", plan["budget_bytes"])
        assert found[0]["peak_allocated_bytes"] <= limit


def test_plan_attention_auto_is_dense_when_it_fits_else_the_largest_sparse_set():
    dense = json.loads(_cli("--json", *SMOL_8K_CPU, "--budget-gib", "8").stdout)
    choice = dense["settings"]["attention"]
    assert choice["mode"] == "dense" and dense["settings"]["sparse"]["window_size"] is None
    assert "fits" in choice["reason"] and choice["requested"] == "auto"
    sparse_peak = json.loads(_cli("--json", *SMOL_8K_CPU, "--attention", "sparse").stdout)[
        "peak_allocated_bytes"]
    tight = json.loads(_cli("--json", *SMOL_8K_CPU, "--budget-gib",
                            repr((sparse_peak + 4096) / GIB)).stdout)
    assert tight["settings"]["attention"]["mode"] == "sparse" and tight["fits"] is True
    assert "dense needs" in tight["settings"]["attention"]["reason"]
    table = _cli(*SMOL_8K_CPU, "--budget-gib", "8").stdout
    assert "attention" in table and "auto: the whole KV" in table
    asked = json.loads(_cli("--json", *SMOL_8K_CPU, "--dense").stdout)["settings"]["attention"]
    assert (asked["mode"], asked["requested"], asked["reason"]) == ("dense", "dense", "asked for")


def test_cpu_plan_budget_is_the_hosts_ram(monkeypatch):
    """Without --budget-gib a cpu plan is held against physical RAM: --check fails (exit 5,
    "host memory") when the plan exceeds it, and no GPU profile is suggested to a cpu run."""
    import psutil

    from hisparse_cli.planner import profile as planner_profile

    plan = json.loads(_cli("--json", *SMOL_CPU).stdout)
    assert plan["budget_bytes"] == psutil.virtual_memory().total and plan["fits"] is True
    assert plan["settings"]["budget_source"] == "host RAM"
    assert any("physical RAM" in n for n in plan["notes"])
    monkeypatch.setattr(planner_profile, "host_memory_bytes", lambda: 256 << 20)
    r = _cli("--json", "--check", *SMOL_CPU)
    assert r.exit_code == 5, r.output
    assert "of host memory" in r.stderr and "this machine's RAM is 0.25 GiB" in r.stderr
    changes = [s["change"] for s in json.loads(r.stdout)["suggestions"]]
    assert changes and not any(c.startswith("--profile") for c in changes), changes
    gpu = _cli("--json", "--check", *SMOL_CPU, "--device", "cuda")  # a GPU plan: no RAM cap
    assert gpu.exit_code == 0 and json.loads(gpu.stdout)["budget_bytes"] is None, gpu.output


@pytest.mark.parametrize("flags, needle", [
    (("-n", "100000"), "max_new_tokens 100,000 leaves no room for a prompt"),
    (("-n", "8192"), "max_new_tokens 8,192 leaves no room"),
    (("--global-tokens", "1000000000"), "global_tokens 1,000,000,000 is larger than"),
    (("--recalibrate-topk", "9000"), "recalibrate_topk 9,000 is larger than"),
    (("--block-size", "1000000000"), "block_size 1,000,000,000 is larger than"),
])
def test_plan_refuses_what_summarize_refuses(flags, needle):
    """The same check as summarize (engine.config.check_positions): exit 2, not a plan of a
    run that cannot happen (smollm2-135m has 8,192 positions)."""
    r = _cli("--check", *SMOL_CPU, *flags)
    assert r.exit_code == 2, r.output
    assert r.stdout == "" and needle in r.stderr and "\nHint: " in r.stderr, r.stderr
    assert _cli("--check", *SMOL_CPU, "-n", "8191").exit_code == 0  # one prompt token fits


def test_check_positions():
    from hisparse_cli.config.settings import check_positions

    check_positions(64, sparse=SparseConfig(global_tokens=64, recalibrate_topk=64,
                                            block_size=64), max_new_tokens=63)
    for field_name in ("sink_tokens", "global_tokens", "recalibrate_topk", "block_size"):
        with pytest.raises(ConfigError, match=f"^{field_name} 65 is larger") as err:
            check_positions(64, sparse=replace(SparseConfig(), **{field_name: 65}))
        assert "--" + field_name.replace("_", "-") in err.value.hint
    with pytest.raises(ConfigError, match="max_new_tokens 64 leaves no room"):
        check_positions(64, max_new_tokens=64)


def test_profile_plan_of_an_awq_model_uses_the_runs_dtype():
    """An AWQ model runs in float16 on a GPU profile and in float32 on the cpu profile
    (runtime.plan_device): the plan's activations follow, and on the cpu it counts the
    packed decode copies."""
    from hisparse_cli.planner.profile import plan_for_profile
    from hisparse_cli.config.profiles import load_profile

    cfg = shape_config("llama-3-8b-awq")
    gpu = plan_for_profile(cfg, load_profile("4060ti-6g"), context_tokens=4096)
    cpu = plan_for_profile(cfg, load_profile("cpu"), context_tokens=4096)
    assert gpu.settings["compute_dtype"] == "float16"
    assert cpu.settings["compute_dtype"] == "float32"
    names = {i.name for i in cpu.items}
    assert ("weights.linears_cpu_int4pack" in names) == awq_cpu.int4pack_available()
    assert "weights.linears_cpu_int4pack" not in {i.name for i in gpu.items}


# -- the GPU: predicted vs torch.cuda.max_memory_allocated -------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_gpu_peak_within_5_percent(tmp_path, backend):
    from hisparse_cli.kernels.dispatch import triton_available

    if backend == "triton" and not triton_available():
        pytest.skip("triton is not installed")
    import json
    import subprocess
    import sys

    path, _ = save_tiny(tmp_path, "llama", vocab_size=32000, hidden_size=512,
                        intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=2, max_position_embeddings=8192)
    sparse = SparseConfig(window_size=1024, global_tokens=64, recalibrate_topk=64,
                          prefill_chunk=512, recalibrate_every=512)
    # measured in a fresh process: max_memory_allocated counts every live tensor of the
    # process, and earlier tests (a failed one's traceback, say) can keep theirs alive
    script = (
        "import json, sys, torch\n"
        "from hisparse_cli.engine import Engine, SparseConfig\n"
        f"sp = SparseConfig(**{sparse.__dict__!r})\n"
        f"eng = Engine.from_pretrained({str(path)!r}, device='cuda', dtype=torch.float16, "
        f"sparse=sp, kv_dtype=torch.float16, backend={backend!r})\n"
        "res = eng.generate(list(range(1, 4097)), max_new_tokens=32, min_new_tokens=32)\n"
        "print(json.dumps(res.stats.peak_memory_bytes))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True)
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    plan = plan_memory(ModelConfig.from_folder(path), weight_format="fp16", sparse=sparse,
                       context_tokens=4096, max_new_tokens=32, kv_dtype="float16",
                       compute_dtype="float16", device_kind="cuda", backend=backend,
                       num_sms=torch.cuda.get_device_properties(0).multi_processor_count)
    assert abs(plan.peak_allocated_bytes - measured) <= 0.05 * measured, (
        plan.peak_allocated_bytes, measured, plan.peak_when)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available()
                         and torch.cuda.get_device_capability() >= (9, 0)),
                    reason="needs an sm_90 GPU (the persistent decode step)")
@pytest.mark.parametrize("head", ["checkpoint", "int8"])
def test_gpu_peak_within_5_percent_persistent(tmp_path, monkeypatch, head):
    """HISPARSE_DECODE_KERNEL=persistent: an AWQ INT4 model (group 128, 128-dim heads, so the
    kernel applies) held in the item layout, its decode through the kernel; the plan (with
    workspace.persistent_decode) against the measured peak, as above. head int8: the fp16
    head quantized at load runs after the kernel (its final-norm output), still persistent."""
    import subprocess
    import sys

    from hisparse_cli.kernels.cuda.cuda_rt import nvrtc_available

    if not nvrtc_available():
        pytest.skip("no libnvrtc")
    path, _ = save_tiny(tmp_path, "llama", vocab_size=32000, hidden_size=1024,
                        intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=2, max_position_embeddings=8192)
    _awq_checkpoint(path, 128, head=False)
    sparse = SparseConfig(window_size=1024, global_tokens=64, recalibrate_topk=64,
                          prefill_chunk=512, recalibrate_every=512)
    monkeypatch.setenv("HISPARSE_DECODE_KERNEL", "persistent")
    script = (
        "import json, sys, torch\n"
        "from hisparse_cli.engine import Engine, SparseConfig\n"
        f"sp = SparseConfig(**{sparse.__dict__!r})\n"
        f"eng = Engine.from_pretrained({str(path)!r}, device='cuda', dtype=torch.float16, "
        f"sparse=sp, kv_dtype=torch.float16, backend='triton', lm_head_format={head!r})\n"
        "res = eng.generate(list(range(1, 4097)), max_new_tokens=32, min_new_tokens=32)\n"
        "print(json.dumps([res.stats.peak_memory_bytes, res.extra.get('decode_kernel'),\n"
        "                  res.extra.get('decode_kernel_note')]))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True)
    measured, kernel, note = json.loads(out.stdout.strip().splitlines()[-1])
    assert kernel == "persistent", (kernel, note)
    plan = plan_memory(ModelConfig.from_folder(path), weight_format="awq-int4", sparse=sparse,
                       context_tokens=4096, max_new_tokens=32, kv_dtype="float16",
                       compute_dtype="float16", device_kind="cuda", backend="triton",
                       lm_head_int8=head == "int8",
                       num_sms=torch.cuda.get_device_properties(0).multi_processor_count)
    assert "workspace.persistent_decode" in {i.name for i in plan.items}
    assert abs(plan.peak_allocated_bytes - measured) <= 0.05 * measured, (
        plan.peak_allocated_bytes, measured, plan.peak_when)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_retrieval_plan_items_sum_to_peak_at_128k(backend):
    """A 128K-token retrieval run on the 8B shape plans (its per-layer page scoring was a
    temporary missing from the items, and `hisparse plan` failed its own check)."""
    sparse = SparseConfig(window_size=2048, global_tokens=256, recalibrate_topk=256,
                          prefill_chunk=512, retrieval_tokens=1024)
    plan = plan_memory(shape_config("llama-3-8b"), weight_format="awq-int4", sparse=sparse,
                       context_tokens=131056, max_new_tokens=16, kv_dtype="float16",
                       compute_dtype="float16", device_kind="cuda", backend=backend,
                       budget_bytes=80 << 30)
    assert sum(i.bytes for i in plan.items if i.counted) == plan.peak_allocated_bytes
    assert plan.offload_store_bytes > 0


def test_page_scoring_temporaries_by_backend():
    """The chunk's queries pooled over QUERY_POOL positions are held throughout; Triton's
    scoring kernel writes only the [Hkv, pages] fp32 scores; the torch reference holds the
    pooled queries in fp32 and two [Hkv, rows, pages] fp32 logits; both then keep topk's
    values and indices."""
    from types import SimpleNamespace

    from hisparse_cli.engine.retrieval_sizes import QUERY_POOL
    from hisparse_cli.planner.run import page_scoring
    from hisparse_cli.planner.trace import Trace

    tr = Trace(False)  # CPU: sizes are the bytes themselves
    n, hq, hkv, d, pages, k = 512, 32, 8, 128, 8000, 64
    m = n // QUERY_POOL
    held = m * hq * d * 2
    shape = dict(hq=hq, hkv=hkv, d=d, cb=2)
    triton = page_scoring(tr, SimpleNamespace(backend="triton", **shape), n, pages, k)
    torch_ = page_scoring(tr, SimpleNamespace(backend="torch", **shape), n, pages, k)
    assert triton.peak == held + hkv * pages * 4 + max(hkv * k * 12, 3 * hkv * k * 8)
    assert torch_.peak == held + 3 * m * hq * d * 4 + 2 * m * hq * pages * 4 + hkv * pages * 4
    assert triton.live == {"retrieval.page_scoring": triton.peak}
    one = page_scoring(tr, SimpleNamespace(backend="triton", **shape), 1, pages, k)
    assert one.peak == hkv * pages * 4 + max(hkv * k * 12, 3 * hkv * k * 8)  # nothing pooled
    odd = page_scoring(tr, SimpleNamespace(backend="triton", hq=hq, hkv=hkv, d=96, cb=2), n,
                       pages, k)
    assert odd.peak > triton.peak  # no Triton scoring for a head size not a power of two
