"""The plan of a run described the way commands describe runs: a model config + a hardware
profile (+ CLI overrides). Precedence, as everywhere: CLI flag > profile > built-in default.

Device, dtypes and embedding placement follow runtime.plan_device for the profile's own
device: a profile with a VRAM budget plans CUDA in float16 with the profile's KV dtype and the
Triton backend (what a GPU machine with triton runs); `cpu` plans float32 with the torch
reference. Weights are what will actually load: a checkpoint with an AWQ quantization_config
is INT4 (its group size), anything else loads unquantized in the compute dtype, whatever the
profile's `weight_format` prefers (a note says so). The budget, unless one is given: the
profile's VRAM budget on CUDA; on the CPU this machine's physical RAM (`host_memory_bytes`),
so that a plan the host cannot hold does not fit either. Nothing here imports torch.
"""

from __future__ import annotations

from hisparse_cli.config.settings import SparseConfig
from hisparse_cli.model.config import ModelConfig
from hisparse_cli.planner.memory import DEFAULT_NUM_SMS, MemoryPlan, plan_memory
from hisparse_cli.config.profiles import HardwareProfile


def checkpoint_format(cfg: ModelConfig) -> tuple[str | None, int]:
    """("awq-int4", group) for an AWQ checkpoint, (None, 128) otherwise."""
    qc = cfg.quantization_config
    if qc is None:
        return None, 128
    from hisparse_cli.model.awq import parse_quantization_config

    awq = parse_quantization_config(qc)
    return "awq-int4", awq.group_size


def host_memory_bytes() -> int:
    """This machine's physical RAM in bytes (psutil: a dependency already)."""
    import psutil

    return int(psutil.virtual_memory().total)


def plan_for_profile(cfg: ModelConfig, profile: HardwareProfile, *, context_tokens: int,
                     max_new_tokens: int | None = None, sparse: SparseConfig | None = None,
                     device_kind: str | None = None, backend: str | None = None,
                     weight_format: str | None = None, kv_dtype: str | None = None,
                     embeddings_on_host: bool | None = None, awq_lm_head: bool = False,
                     lm_head_format: str | None = None, budget_bytes: int | None = None,
                     model_name: str = "",
                     num_sms: int = DEFAULT_NUM_SMS,
                     prefill_cache_layers: int | None = 0) -> MemoryPlan:
    """plan_memory for `cfg` run under `profile`; every keyword overrides the profile.
    prefill_cache_layers None: as many layers' prefill weight cache as the budget has room for
    (what `summarize` keeps: planner/memory.py)."""
    device_kind = device_kind or ("cpu" if profile.vram_budget_gib is None else "cuda")
    cuda = device_kind == "cuda"
    compute = "float16" if cuda else "float32"
    ckpt_format, group = checkpoint_format(cfg)
    notes = []
    if weight_format is None:
        weight_format = ckpt_format or {"float16": "fp16", "float32": "fp32"}[compute]
        if profile.weight_format == "awq-int4" and ckpt_format is None and cuda:
            notes.append(f"profile {profile.name!r} prefers AWQ INT4 weights but this model is "
                         "not quantized: planned as it would load (unquantized)")
    if weight_format == "awq-int4" and cuda:  # on the cpu the run is float32 (runtime.py)
        compute = "float16"
    source = "given"
    if budget_bytes is None and cuda:
        budget_bytes, source = profile.vram_budget_bytes, "profile"
    elif budget_bytes is None:
        budget_bytes, source = host_memory_bytes(), "host RAM"
        notes.append(f"cpu without --budget-gib: the budget is this machine's physical RAM "
                     f"({budget_bytes / (1 << 30):.1f} GiB)")
    plan = plan_memory(
        cfg, weight_format=weight_format, group_size=group, awq_lm_head=awq_lm_head,
        embeddings_on_host=(profile.embeddings_on_host if embeddings_on_host is None
                            else embeddings_on_host) and cuda,
        lm_head_int8=(cuda and not awq_lm_head
                      and (lm_head_format or profile.lm_head_format) == "int8"),
        sparse=sparse or profile.sparse_config(), context_tokens=context_tokens,
        max_new_tokens=profile.max_new_tokens if max_new_tokens is None else max_new_tokens,
        kv_dtype=kv_dtype or (profile.kv_dtype if cuda else "float32"), compute_dtype=compute,
        device_kind=device_kind, backend=backend or ("triton" if cuda else "torch"),
        budget_bytes=budget_bytes, num_sms=num_sms, model_name=model_name,
        prefill_cache_layers=prefill_cache_layers)
    from dataclasses import replace

    return replace(plan, notes=plan.notes + tuple(notes),
                   settings={**plan.settings, "profile": profile.name,
                             "budget_source": source if budget_bytes is not None else None})


__all__ = ["plan_for_profile", "checkpoint_format", "host_memory_bytes"]
