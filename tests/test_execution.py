"""The environment (config/env.py) and the execution plan (config/execution.py): what each
HISPARSE_* variable decides, the reasons, and that the Engine, the planner and `hisparse plan`
see the same plan."""

from __future__ import annotations

import json

import pytest
import torch

from hisparse_cli.config.env import Environment, read_environment
from hisparse_cli.config.execution import resolve_execution
from hisparse_cli.config.settings import SparseConfig
from hisparse_cli.errors import ConfigError
from hisparse_cli.kernels.dispatch import KernelBackend
from hisparse_cli.planner.shapes import shape_config


def test_environment_reads_each_variable_and_refuses_bad_values():
    env = read_environment({})
    assert env == Environment()  # auto backend, graphs and the in-graph sampler on, auto kernel
    env = read_environment({"HISPARSE_BACKEND": "torch", "HISPARSE_CUDA_GRAPH": "0",
                            "HISPARSE_GRAPH_SAMPLER": " 0 ", "HISPARSE_DECODE_KERNEL": " Layers"})
    assert env == Environment(backend="torch", cuda_graph=False, graph_sampler=False,
                              decode_kernel="layers")
    assert read_environment({"HISPARSE_CUDA_GRAPH": "1"}).cuda_graph
    with pytest.raises(ConfigError, match="HISPARSE_BACKEND must be auto, torch or triton"):
        read_environment({"HISPARSE_BACKEND": "cuda"})
    with pytest.raises(ConfigError, match="persistant.*auto, persistent, layers"):
        read_environment({"HISPARSE_DECODE_KERNEL": "persistant"})


def _plan(device="cuda", env=None, weight_awq=True, kernels=None, **over):
    cfg = shape_config("llama-3-8b-awq" if weight_awq else "llama-3-8b")
    kw = dict(device=device, model_cfg=cfg, sparse=SparseConfig(), compute_dtype="float16",
              kv_dtype="float16", weight_awq=weight_awq,
              kernels=kernels or KernelBackend("triton", "triton", "triton"), env=env)
    return resolve_execution(**{**kw, **over})


def test_a_planned_cuda_run_and_each_variable_that_changes_it(monkeypatch):
    from hisparse_cli.kernels.cuda import cuda_step

    monkeypatch.setattr(cuda_step, "device_unsupported", lambda device=None: None)  # an sm_90
    from hisparse_cli.kernels.fp8 import w4a8_linear

    monkeypatch.setattr(w4a8_linear, "device_support", lambda index: None)  # with CUDA 13
    p = _plan(env=Environment())
    assert p.graph_decode.value and p.persistent and p.sampler.value == "graph"
    assert p.int4_layout.value == "items"  # the persistent kernel's layout
    assert [r[0] for r in p.rows()] == ["backend", "graph decode", "decode kernel", "sampler",
                                        "INT4 layout", "INT4 prefill"]
    assert p.int4_prefill.value == "w4a16"  # W4A8 is opt-in (HISPARSE_PREFILL_FP8=1)
    assert _plan(env=Environment(prefill_fp8=True)).int4_prefill.value == "w4a8"
    assert all(reason for _, _, reason in p.rows())
    off = _plan(env=Environment(cuda_graph=False))
    assert not off.graph_decode.value and "HISPARSE_CUDA_GRAPH=0" in off.graph_decode.reason
    assert off.decode_kernel.value == "layers" and off.sampler.value == "host"
    assert off.int4_layout.value == "tiled"
    layers = _plan(env=Environment(decode_kernel="layers"))
    assert layers.decode_kernel.value == "layers" and "=layers" in layers.decode_kernel.reason
    device = _plan(env=Environment(graph_sampler=False))
    assert device.sampler.value == "device" and "HISPARSE_GRAPH_SAMPLER=0" in device.sampler.reason
    fp16 = _plan(env=Environment(), weight_awq=False)
    assert fp16.decode_kernel.value == "layers" and "not AWQ INT4" in fp16.decode_kernel.reason
    assert fp16.int4_layout.value == "none"
    kv32 = _plan(env=Environment(), kv_dtype="float32")
    assert kv32.decode_kernel.value == "layers" and "fp16 KV" in kv32.decode_kernel.reason


def test_auto_needs_this_machines_gpu_but_persistent_plans_it_anyway(monkeypatch):
    from hisparse_cli.kernels.cuda import cuda_step

    monkeypatch.setattr(cuda_step, "device_unsupported", lambda device=None: "no CUDA device")
    auto = _plan(env=Environment())
    assert auto.decode_kernel.value == "layers" and auto.decode_kernel.reason == "no CUDA device"
    asked = _plan(env=Environment(decode_kernel="persistent"))
    assert asked.persistent and asked.decode_kernel_asked == "persistent"


def test_a_cpu_run():
    p = resolve_execution(device="cpu", model_cfg=shape_config("smollm2-135m"),
                          sparse=SparseConfig(), compute_dtype="float32", kv_dtype="float32",
                          weight_awq=True, env=Environment(backend="torch"))
    assert p.kernels.attention == "torch" and "HISPARSE_BACKEND=torch" in p.backend.reason
    assert not p.graph_decode.value and p.sampler.value == "host"
    assert p.decode_kernel.value == "layers" and p.int4_layout.value == "awq"
    d = json.loads(json.dumps(p.to_dict()))
    assert d["graph_decode"]["value"] == "off" and d["kernels"]["attention"] == "torch"


def test_engine_plan_and_replan(tiny_models, monkeypatch):
    """The Engine resolves its plan once, from the model it loaded; replan() reads the
    environment again."""
    from hisparse_cli.engine import Engine

    path, _ = tiny_models["llama"]
    monkeypatch.delenv("HISPARSE_DECODE_KERNEL", raising=False)
    eng = Engine.from_pretrained(path, sparse=SparseConfig(window_size=64, global_tokens=8,
                                                           recalibrate_topk=8))
    plan = eng.execution
    assert plan.device == "cpu" and not plan.graph_decode.value and eng.backend is plan.kernels
    assert eng.decode_kernel_note == plan.decode_kernel.reason  # why not the persistent kernel
    monkeypatch.setenv("HISPARSE_DECODE_KERNEL", "layers")
    assert eng.execution is plan  # nothing re-read until asked
    assert eng.replan().decode_kernel_asked == "layers" and eng.decode_kernel_note is None
    res = eng.generate(torch.arange(3, 40), max_new_tokens=4, eos_token_ids=())
    assert len(res.token_ids) == 4


def test_the_planner_takes_the_plan_and_plan_prints_it(monkeypatch):
    from typer.testing import CliRunner

    from hisparse_cli.cli.app import app
    from hisparse_cli.planner.memory import plan_memory

    cfg = shape_config("llama-3-8b")
    kw = dict(weight_format="fp16", sparse=SparseConfig(), context_tokens=4096,
              max_new_tokens=16, kv_dtype="float16", compute_dtype="float16",
              device_kind="cuda", backend="triton")
    with_graph = plan_memory(cfg, **kw)
    assert with_graph.execution.graph_decode.value
    assert any(i.name == "workspace.cublas_graph_stream" for i in with_graph.items)
    given = _plan(env=Environment(cuda_graph=False), weight_awq=False)
    without = plan_memory(cfg, **kw, execution=given)
    assert without.execution is given
    assert not any(i.name == "workspace.cublas_graph_stream" for i in without.items)
    out = CliRunner().invoke(app, ["plan", "--model", "llama-3-8b", "--profile", "h200-141g",
                                   "--json"])
    assert out.exit_code == 0, out.output
    execution = json.loads(out.stdout)["execution"]
    assert execution["graph_decode"]["value"] == "on" and execution["sampler"]["reason"]
    table = CliRunner().invoke(app, ["plan", "--model", "llama-3-8b", "--profile", "cpu"])
    assert table.exit_code == 0 and "decode kernel" in table.stdout and "INT4 layout" in table.stdout
