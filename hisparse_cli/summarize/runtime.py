"""Building the `Engine` a command runs on: device, dtypes and sparse policy from a profile.

Precedence of every setting, stated once (as in profiles/):

    CLI flag  >  profile  >  built-in default

Device choice (`plan_device`, pure): a profile without a VRAM budget (`cpu`) runs on the CPU
in float32; a GPU profile runs on CUDA in float16 with the profile's KV dtype and embedding
placement; a GPU profile on a machine without CUDA falls back to the CPU in float32 with a
warning (the caller shows it). Nothing here imports torch at module import time.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Callable

from hisparse_cli.config.settings import SparseConfig, check_positions
from hisparse_cli.errors import ConfigError
from hisparse_cli.config.profiles import HardwareProfile



@dataclass(frozen=True)
class DevicePlan:
    device: str  # "cpu" | "cuda"
    dtype: str  # weights/activations: "float32" | "float16"
    kv_dtype: str
    embeddings_on_host: bool
    lm_head_format: str = "checkpoint"  # "int8": an fp head quantized at load (profiles.py)
    warning: str | None = None
    threads: dict | None = None  # the CPU thread policy (config/threads.py: ThreadPolicy.to_dict())

    def to_dict(self) -> dict:
        return asdict(self)


def plan_device(profile: HardwareProfile, cuda_available: bool) -> DevicePlan:
    """Where and in which dtypes `profile` runs on this machine (see module docstring)."""
    if profile.vram_budget_gib is None:
        return DevicePlan("cpu", "float32", "float32", False)
    if not cuda_available:
        return DevicePlan("cpu", "float32", "float32", False, warning=(
            f"profile {profile.name!r} is for a CUDA GPU, but none is available; running on "
            "the CPU in float32 (slow). Use --profile cpu to silence this."))
    return DevicePlan("cuda", "float16", profile.kv_dtype, profile.embeddings_on_host,
                      profile.lm_head_format)


def sparse_settings(profile: HardwareProfile, *, dense: bool = False,
                    **flags: int | str | None) -> SparseConfig:
    """The profile's SparseConfig with CLI flags applied (None = flag not given).

    `dense=True` turns the sliding window off (every query sees every key); it cannot be
    combined with --window or --global-tokens."""
    if dense:
        clash = [name for name in ("window_size", "global_tokens", "retrieval_tokens")
                 if flags.get(name)]
        if clash:
            flag = {f.name: f.metadata["flag"] for f in fields(SparseConfig)}
            opts = " and ".join(flag[n] for n in clash)
            raise ConfigError(f"--dense cannot be combined with {opts}",
                              hint="dense attention has no window and no global tokens")
    config = profile.sparse_config(**flags)
    if dense:
        config = replace(config, window_size=None, global_tokens=0, recalibrate_topk=0,
                         retrieval_tokens=0)
    return config


def model_info(model_path: Path) -> dict:
    """What the JSON output says about the model (read from config.json, no torch)."""
    info: dict = {"path": str(model_path), "name": model_path.name}
    try:
        cfg = json.loads((model_path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return info
    info.update(model_type=cfg.get("model_type"),
                max_position_embeddings=cfg.get("max_position_embeddings"),
                quantization=(cfg.get("quantization_config") or {}).get("quant_method"))
    return info


def remote_code_warning(model_path: Path) -> str | None:
    """A warning when the model's config.json asks for code of its own (`auto_map`,
    `trust_remote_code`): hisparse never runs it, it runs its own forward pass."""
    try:
        cfg = json.loads((model_path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict) or not (cfg.get("auto_map") or cfg.get("trust_remote_code")):
        return None
    asks = "auto_map" if cfg.get("auto_map") else "trust_remote_code"
    return (f"{model_path.name}/config.json asks for the model's own Python code ({asks}); "
            "hisparse never runs it (no trust_remote_code): it runs its own Llama-family "
            "forward pass, which may not match what that code does")


def weight_format_warning(profile: HardwareProfile, info: dict) -> str | None:
    if profile.weight_format == "awq-int4" and info.get("quantization") != "awq":
        return (f"profile {profile.name!r} expects AWQ INT4 weights but {info.get('name')} is "
                "not quantized; it loads in full precision and may not fit the profile's budget")
    return None


def load_probe_for(model_path: Path, sparse: SparseConfig, probe_path: Path | None = None):
    """The importance probe the engine needs for importance="probe" (else None): the file
    given, or the shipped probe that matches the model's shape (ConfigError when none)."""
    if not (sparse.importance == "probe" and sparse.uses_globals):
        return None
    from hisparse_cli.quality.probe import find_probe, load_probe

    cfg = json.loads((model_path / "config.json").read_text(encoding="utf-8"))
    if probe_path is None:
        probe_path = find_probe(cfg)
    scorer = load_probe(probe_path)
    theirs = {k: scorer.meta.get(k) for k in ("hidden_size", "num_layers", "num_kv_heads")}
    ours = {"hidden_size": cfg.get("hidden_size"), "num_layers": cfg.get("num_hidden_layers"),
            "num_kv_heads": cfg.get("num_key_value_heads", cfg.get("num_attention_heads"))}
    if theirs != ours:
        def shape(d: dict) -> str:
            return (f"hidden {d['hidden_size']}, {d['num_layers']} layers, "
                    f"{d['num_kv_heads']} KV heads")

        raise ConfigError(f"probe {probe_path} was trained for another model ({shape(theirs)}; "
                          f"this model: {shape(ours)})",
                          hint="train one for this model with `hisparse probe train --model M "
                               "--out FILE`, or leave out --probe")
    return scorer


def load_engine(model_path: Path, profile: HardwareProfile, sparse: SparseConfig, *,
                warn: Callable[[str], None] | None = None,
                cuda_available: bool | None = None, probe_path: Path | None = None,
                threads: int | None = None):
    """(Engine, DevicePlan) for `model_path` under `profile` (warnings go to `warn`).
    threads: --threads (None: HISPARSE_THREADS, else the automatic policy; config/threads.py),
    applied before the weights load; the engine's ExecutionPlan carries it. CUDA's allocator
    gets expandable segments unless the user configured it (config/env.py)."""
    from hisparse_cli.config.env import prefer_expandable_segments
    from hisparse_cli.config.threads import apply_thread_policy, resolve_thread_policy

    policy = apply_thread_policy(resolve_thread_policy(threads))  # before torch loads
    prefer_expandable_segments()  # before CUDA initialises (a worker process comes here first)
    import torch

    from hisparse_cli.engine.engine import Engine

    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    plan = plan_device(profile, cuda_available)
    info = model_info(model_path)
    for message in (plan.warning, weight_format_warning(profile, info)
                    if plan.device == "cuda" else None, remote_code_warning(model_path)):
        if message and warn is not None:
            warn(message)
    if isinstance(info.get("max_position_embeddings"), int):  # refused before the weights load
        check_positions(info["max_position_embeddings"], sparse=sparse)
    engine = Engine.from_pretrained(
        model_path, device=plan.device, dtype=getattr(torch, plan.dtype), sparse=sparse,
        kv_dtype=getattr(torch, plan.kv_dtype), embeddings_on_host=plan.embeddings_on_host,
        lm_head_format=plan.lm_head_format, probe=load_probe_for(model_path, sparse, probe_path),
        threads=policy)
    return engine, replace(plan, threads=policy.to_dict() if plan.device == "cpu" else None)


__all__ = ["DevicePlan", "plan_device", "sparse_settings", "load_engine", "load_probe_for",
           "model_info", "remote_code_warning"]
