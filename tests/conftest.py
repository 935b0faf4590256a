"""Shared fixtures: tiny random Llama-family checkpoints written as safetensors; the `gpu`
marker that skips without CUDA; `--gpu-group NAME`, the GPU tests in groups that each fit one
device call (GPU_GROUPS; README, Development); the real model's home for the slow tests.

OpenMP's spin-wait is bounded before torch loads (config/env.py: bound_openmp_spin), as the
CLI does: the suite's torch calls then do not collapse when another process holds a CPU. CUDA's
allocator gets expandable segments as the CLI gives it (prefer_expandable_segments)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from hisparse_cli.config.env import bound_openmp_spin, prefer_expandable_segments

bound_openmp_spin()  # before the first `import torch` of the session (libgomp reads it once)
prefer_expandable_segments()  # the GPU tests run the CLI's CUDA allocator settings

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# `python -m pytest` from the repository root puts the root on sys.path, where the top-level
# kernels/ folder (installed as hisparse_cli.kernels) would shadow the `kernels` distribution
# that transformers imports: the tests run against the installation only.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]

if importlib.util.find_spec("hisparse_cli.kernels") is None:  # kernels/ maps in on install
    pytest.exit("hisparse_cli.kernels is not importable: install this checkout (pip install "
                "-e . ; with the dependencies already there: python3 -m pip install --no-deps "
                "--no-build-isolation -e .), PYTHONPATH alone does not map kernels/", 2)

# GPU test groups, each within a ~6-minute device call (H100, 2026-12-06: int4-k-a 203 s,
# int4-k-b 212 s, int4-rest 285 s; H200 run logs: test_awq_triton's kernels_k_cuda cases took
# 205 s for the fp16 half and 249 s for the bf16 one, its kernels_cuda cases 131 s, 64 of its
# 192 packed GEMV cases 64 s, the engine files 124-136 s). name -> (test files, predicate on
# the test's name); a gpu test in no group is in "rest". Run one with `python3 -m pytest -q -m gpu tests --gpu-group NAME`.
GPU_GROUPS = {
    "int4-k-a": (("test_awq_triton.py",),
                 lambda name: "kernels_k_cuda" in name and "dtype0" in name),
    "int4-k-b": (("test_awq_triton.py",),
                 lambda name: "kernels_k_cuda" in name and "dtype0" not in name),
    "int4-kernels": (("test_awq_triton.py",), lambda name: name.startswith("test_kernels_cuda[")),
    "int4-rest": (("test_awq_triton.py", "test_awq_items.py", "test_awq_model.py",
                   "test_awq_cpu.py", "test_awq_layout.py"),
                  lambda name: "kernels_k_cuda" not in name
                  and not name.startswith("test_kernels_cuda[")),
    "kernels": (("test_attention_kernels.py", "test_norm_rope_kernels.py",
                 "test_argmax_triton.py", "test_graph_sampler.py", "test_host_rows.py",
                 "test_pdl.py", "test_cuda_rt.py", "test_attention_ref.py"), lambda name: True),
    "engine": (("test_cuda_step.py", "test_cuda_graph.py", "test_graph_reuse.py",
                "test_planner.py", "test_engine_parity.py", "test_sparse_attention.py",
                "test_kv_cache.py", "test_block_pool.py"), lambda name: True),
}


def gpu_group(item) -> str:
    """The GPU_GROUPS name of a collected test ("rest" when none takes it)."""
    for name, (files, takes) in GPU_GROUPS.items():
        if item.path.name in files and takes(item.name):
            return name
    return "rest"


# read when the suite starts: a test's own isolated HISPARSE_HOME (monkeypatched before
# `real_home` runs) must not become the place the real model is looked for
_REAL_MODEL_HOME = (os.environ.get("HISPARSE_TEST_HOME") or os.environ.get("HISPARSE_HOME")
                    or str(Path.home() / ".cache" / "hisparse"))


def real_model_home() -> str:
    """Where the slow tests find (or pull, once) the real embedded model: HISPARSE_TEST_HOME,
    else the user's HISPARSE_HOME, else hisparse's default (~/.cache/hisparse) — never a
    second copy beside the one the user already has. As the environment was at start-up."""
    return _REAL_MODEL_HOME


@pytest.fixture
def real_home(monkeypatch) -> str:
    """HISPARSE_HOME set to `real_model_home()` for one test."""
    home = real_model_home()
    monkeypatch.setenv("HISPARSE_HOME", home)
    return home


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="also run slow end-to-end tests (real embedded model; CI runs them)")
    parser.addoption("--gpu-group", default=None, choices=[*GPU_GROUPS, "rest"],
                     help="only the tests of this GPU group (with -m gpu: one device call)")


def pytest_collection_modifyitems(config, items):
    run_slow = config.getoption("--slow") or os.environ.get("HISPARSE_SLOW_TESTS") == "1"
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_slow = pytest.mark.skip(reason="slow end-to-end test: run with --slow")
    group = config.getoption("--gpu-group")
    if group is not None:
        keep = [item for item in items if gpu_group(item) == group]
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)


TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
            rms_norm_eps=1e-6, tie_word_embeddings=False)


def tiny_config(arch: str, **over):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    kw = dict(TINY)
    if arch == "llama":
        cls = LlamaConfig
        kw.update(rope_theta=10000.0)
    elif arch == "mistral":
        cls = MistralConfig
        kw.update(sliding_window=None, num_key_value_heads=1)
    elif arch == "qwen2":
        cls = Qwen2Config
        kw.update(tie_word_embeddings=True)
    elif arch == "qwen3":
        cls = Qwen3Config
        kw.update(head_dim=32)
    else:
        raise ValueError(arch)
    kw.update(over)
    return cls(**kw)


def save_tiny(tmp_dir, arch: str, seed: int = 0, **over):
    """Build a random HF model of `arch`, save as safetensors; returns (path, hf_model)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch, **over)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():  # larger-than-default weights so logits are far from uniform
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.ndim == 1:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (1.0 / p.shape[-1] ** 0.5))
    path = tmp_dir / arch
    model.save_pretrained(path, safe_serialization=True)
    return path, model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: save_tiny(root, arch) for arch in ("llama", "mistral", "qwen2", "qwen3")}
