"""The prefill weight cache (AWQLinear.keep_prefill_weight, Engine.keep_prefill_weights, the
planner's `weights.prefill_cache`): a prefill-sized product multiplies by W^T dequantized once
and equals the independent oracle (x @ the fp32-decoded weight); decode-sized products keep the
INT4 kernels; an engine whose layers keep W^T gives the logits it gives without; the planner
counts the cache, fills the budget's room with whole layers, drops the dequantize workspace
from the trace when every layer keeps W^T, and plans none without a budget or off CUDA."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hisparse_cli.model.awq import AWQLinear
from test_awq_ref import oracle_weight, random_awq


def _linear(layout: str, bias: bool = True) -> tuple[AWQLinear, torch.Tensor, torch.Tensor]:
    qw, qz, s, b = random_awq(256, 384, 128, seed=3, bias=bias)
    mod = AWQLinear.from_checkpoint(qw, qz, s, b, 128, "cpu", torch.float32)
    assert mod.set_layout(layout)
    w = oracle_weight(qw, qz, s, 128).float()  # [in, out], decoded independently
    return mod, w, (torch.zeros(384) if b is None else b.float())


@pytest.mark.parametrize("layout", ["awq", "items"])
def test_cached_product_equals_the_oracle_and_decode_keeps_int4(layout, monkeypatch):
    monkeypatch.setenv("HISPARSE_BACKEND", "torch")  # the uncached product: the fp32 reference
    mod, w, b = _linear(layout)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(1))
    before = mod(x)
    held = mod.keep_prefill_weight(True, torch.float32)
    assert held == 384 * 256 * 4 and mod.prefill_weight.shape == (384, 256)
    calls = []
    real = nn.functional.linear
    monkeypatch.setattr(nn.functional, "linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    after = mod(x)
    assert calls == [1]  # one F.linear over the kept W^T
    expect = x @ w + b
    assert torch.allclose(after, expect, atol=1e-5, rtol=1e-5)
    assert torch.allclose(after, before, atol=1e-5, rtol=1e-5)
    calls.clear()
    one = mod(x[:1])  # a decode-sized product: the INT4 path, not the cache
    assert calls == [] and torch.allclose(one, expect[:1], atol=1e-5, rtol=1e-5)
    assert mod.keep_prefill_weight(False) == 0 and mod.prefill_weight is None
    assert "prefill_weight" not in mod.state_dict()  # never saved with the checkpoint


def test_cached_product_allocates_only_its_output():
    """What planner/trace.linear counts for a cached layer's prefill product: y alone."""
    from test_planner import AllocRecorder

    mod, _, _ = _linear("awq", bias=False)
    mod.keep_prefill_weight(True, torch.float32)
    x = torch.randn(40, 256)
    rec = AllocRecorder()
    with rec:
        y = mod(x)
    assert rec.peak == rec.cur == y.numel() * y.element_size()


def test_engine_keeps_whole_layers_and_the_logits_stay(tmp_path, monkeypatch):
    from test_awq_model import _mixed_checkpoint

    from hisparse_cli.config.settings import SparseConfig
    from hisparse_cli.engine.engine import Engine

    monkeypatch.setenv("HISPARSE_BACKEND", "torch")
    out, _ = _mixed_checkpoint(tmp_path)
    eng = Engine.from_pretrained(out, "cpu", torch.float32,
                                 sparse=SparseConfig(window_size=None, global_tokens=0,
                                                     recalibrate_topk=0, prefill_chunk=16))
    ids = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(2)).tolist()
    expect = eng.logits(ids)
    layers = eng.model.model.layers

    def kept(layer):  # a registered buffer (what forward reads), stacked q|k|v / gate|up too
        mods = [m for m in layer.modules() if isinstance(m, AWQLinear)]
        assert any(m.out_features > 64 for m in mods)  # layer 0's stacked q|k|v is among them
        return [m._buffers["prefill_weight"] is not None for m in mods]

    released = []
    monkeypatch.setattr(eng, "release_cached_state", lambda: released.append(1))
    held = eng.keep_prefill_weights(1)
    assert released == [1]  # growing: a kept run's storage goes first
    assert eng.prefill_cache_layers == 1 and all(kept(layers[0])) and not any(kept(layers[1]))
    assert held == sum(m.in_features * m.out_features * 4 for m in layers[0].modules()
                       if isinstance(m, AWQLinear))
    assert torch.allclose(eng.logits(ids), expect, atol=1e-5, rtol=1e-5)
    n = len(released)  # (logits releases the kept state itself)
    eng.keep_prefill_weights(99)  # capped at the model's layers
    assert len(released) == n + 1
    assert eng.prefill_cache_layers == 2 and all(kept(layers[1]))
    assert torch.allclose(eng.logits(ids), expect, atol=1e-5, rtol=1e-5)
    n = len(released)
    assert eng.keep_prefill_weights(0) == 0 and not any(kept(layers[0]) + kept(layers[1]))
    assert len(released) == n  # shrinking frees memory: the kept state may stay
    assert eng.model.lm_head.prefill_weight is None  # the head is never kept (prefill: 1 row)


def _plan(budget_gib, layers=None, device="cuda", context=32768):
    from hisparse_cli.config.profiles import load_profile
    from hisparse_cli.model.config import ModelConfig
    from hisparse_cli.planner.memory import GIB, plan_memory
    from hisparse_cli.planner.shapes import SHAPES

    cfg = ModelConfig.from_dict(SHAPES["llama-3-8b"])
    sparse = load_profile("h200-141g").sparse_config()
    return cfg, plan_memory(cfg, weight_format="awq-int4", sparse=sparse,
                            context_tokens=context, max_new_tokens=256, kv_dtype="float16",
                            compute_dtype="float16" if device == "cuda" else "float32",
                            device_kind=device, backend="triton" if device == "cuda" else "torch",
                            budget_bytes=None if budget_gib is None else int(budget_gib * GIB),
                            prefill_cache_layers=layers)


# an 8B layer's W^T in fp16, by hand: q|k|v 4096x6144, o 4096x4096, gate|up 4096x28672,
# down 14336x4096 (each a whole number of the allocator's 2 MiB blocks): 416 MiB
LAYER_BYTES = 2 * (4096 * 6144 + 4096 * 4096 + 4096 * 28672 + 14336 * 4096)
assert LAYER_BYTES == 416 << 20


def test_planner_fills_the_room_with_whole_layers():
    from hisparse_cli.planner.weights import prefill_cache_layer_bytes

    cfg, base = _plan(12.0, layers=0)
    per = LAYER_BYTES
    assert prefill_cache_layer_bytes(cfg, 2, True) == per
    _, auto = _plan(12.0)
    n = auto.settings["prefill_cache_layers"]
    assert n == (auto.budget_bytes - base.peak_allocated_bytes) // per and 0 < n < 32
    item = next(i for i in auto.items if i.name == "weights.prefill_cache")
    assert item.bytes == n * per and auto.fits
    assert auto.peak_allocated_bytes == base.peak_allocated_bytes + n * per  # layers: the same
    assert auto.weights_bytes == base.weights_bytes + n * per  # trace (one uncached layer left)
    _, explicit = _plan(12.0, layers=n)
    assert explicit.peak_allocated_bytes == auto.peak_allocated_bytes


def test_every_layer_cached_drops_the_dequantize_workspace():
    cfg, base = _plan(80.0, layers=0)
    _, full = _plan(80.0)
    assert full.settings["prefill_cache_layers"] == 32
    cache = 32 * LAYER_BYTES
    activations = full.peak_allocated_bytes - full.weights_bytes
    assert activations < base.peak_allocated_bytes - base.weights_bytes  # no W^T workspace
    assert full.weights_bytes == base.weights_bytes + cache


@pytest.mark.parametrize("budget, device", [(None, "cuda"), (80.0, "cpu"), (4.0, "cuda")])
def test_no_cache_without_room_a_budget_or_cuda(budget, device):
    _, plan = _plan(budget, device=device)
    assert plan.settings["prefill_cache_layers"] == 0
    assert not any(i.name == "weights.prefill_cache" for i in plan.items)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["tiled", "items"])
def test_cuda_cache_equals_the_dequantize_path(layout, monkeypatch):
    """On the GPU: W^T from the layout's Triton dequantize equals the oracle's fp16 rounding
    bit for bit, and the cached product equals the per-chunk dequantize + cuBLAS product."""
    qw, qz, s, b = random_awq(4096, 1024, 128, seed=5, bias=False)
    mod = AWQLinear.from_checkpoint(qw, qz, s, b, 128, "cuda", torch.float16)
    assert mod.set_layout(layout)
    w = oracle_weight(qw, qz, s, 128).t().contiguous().half().cuda()  # [out, in]
    x = torch.randn(700, 4096, device="cuda", dtype=torch.float16)
    before = mod(x)
    mod.keep_prefill_weight(True)
    assert torch.equal(mod.prefill_weight, w)
    after = mod(x)
    torch.cuda.synchronize()
    scale = float(before.abs().max())
    assert float((after - before).abs().max()) <= 2e-3 * scale


class _EngineStub:
    """What Job.keep_prefill_weights reads and calls on an engine."""

    def __init__(self, cfg):
        self.cfg, self.prefill_cache_layers, self.kept = cfg, 0, []

    def keep_prefill_weights(self, layers: int) -> int:
        self.kept.append(layers)
        self.prefill_cache_layers = layers
        return layers


@pytest.mark.parametrize("profile, context, some", [
    ("h100-80g", 32768, True), ("3090-24g", 32768, True), ("3090-24g", 131072, False),
    ("4060ti-6g", 131072, False)])
def test_job_gives_the_engine_what_the_plan_has_room_for(profile, context, some):
    """summarize's wiring: the room beside the plan of the document's generation (the working
    set chosen first: dense KV takes the 3090's room at 128K) sizes the cache in whole
    416 MiB layers, and the engine is told before the run; a CPU run is never."""
    from types import SimpleNamespace

    from hisparse_cli.config.profiles import load_profile
    from hisparse_cli.model.config import ModelConfig
    from hisparse_cli.planner.profile import plan_for_profile
    from hisparse_cli.planner.shapes import SHAPES
    from hisparse_cli.summarize.job import Job
    from hisparse_cli.summarize.pipeline import SummarySettings

    prof = load_profile(profile)
    cfg = ModelConfig.from_dict(SHAPES["llama-3-8b-awq"])
    job = Job(prof, prof.sparse_config(), SummarySettings())
    job._engine = _EngineStub(cfg)
    job.device_plan = SimpleNamespace(device="cuda")
    choice = job.attention_for(context, 512)
    run = plan_for_profile(cfg, prof, context_tokens=context, max_new_tokens=512,
                           sparse=choice.sparse, device_kind="cuda")  # the run, no cache
    expect = min(32, (prof.vram_budget_bytes - run.peak_allocated_bytes) // LAYER_BYTES)
    assert (expect > 0) == some
    assert job.keep_prefill_weights(context, 512, choice.sparse) == expect
    assert job._engine.kept == ([expect] if expect else [])
    job._engine.prefill_cache_layers = 5  # an earlier document's cache, then a CPU plan:
    job.device_plan = SimpleNamespace(device="cpu")
    assert job.keep_prefill_weights(context, 512, choice.sparse) == 0
    assert job._engine.kept[-1] == 0  # dropped
