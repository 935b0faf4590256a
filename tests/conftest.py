"""Shared fixtures: tiny random Llama-family checkpoints written as safetensors, the `gpu`
marker that skips without CUDA, and the real model's home for the slow tests.

OpenMP's spin-wait is bounded before torch loads (hisparse_cli/threads.py), as the CLI does:
the suite's torch calls then do not collapse when another process holds a CPU."""

from __future__ import annotations

import os
from pathlib import Path

from hisparse_cli.threads import prepare_openmp

prepare_openmp()  # before the first `import torch` of the session (libgomp reads it once)

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def real_model_home() -> str:
    """Where the slow tests find (or pull, once) the real embedded model: HISPARSE_TEST_HOME,
    else the user's HISPARSE_HOME, else hisparse's default (~/.cache/hisparse) — never a
    second copy beside the one the user already has."""
    return (os.environ.get("HISPARSE_TEST_HOME") or os.environ.get("HISPARSE_HOME")
            or str(Path.home() / ".cache" / "hisparse"))


@pytest.fixture
def real_home(monkeypatch) -> str:
    """HISPARSE_HOME set to `real_model_home()` for one test."""
    home = real_model_home()
    monkeypatch.setenv("HISPARSE_HOME", home)
    return home


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="also run slow end-to-end tests (real embedded model; CI runs them)")


def pytest_collection_modifyitems(config, items):
    run_slow = config.getoption("--slow") or os.environ.get("HISPARSE_SLOW_TESTS") == "1"
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_slow = pytest.mark.skip(reason="slow end-to-end test: run with --slow")
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
