"""Built-in model shapes for planning without weights (`hisparse plan --model llama-3-8b`).

Each shape is the architecture part of the model's published config.json (the fields our
forward pass reads, see model/config.py), so `plan_memory` sees exactly the `ModelConfig`
that loading the real checkpoint would produce. `*-awq` shapes carry an AutoAWQ GEMM
`quantization_config` (group 128, lm_head left in fp16, as published AWQ checkpoints do).
No torch, no files: `shape_config(name)` is a dictionary lookup.
"""

from __future__ import annotations

from hisparse_cli.errors import ConfigError
from hisparse_cli.model.config import ModelConfig

_AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
        "version": "gemm", "modules_to_not_convert": None}

# config.json fields as published (hub: meta-llama/Llama-3.1-8B-Instruct,
# mistralai/Mistral-7B-Instruct-v0.3, Qwen/Qwen2.5-7B-Instruct, HuggingFaceTB/SmolLM2-135M)
_LLAMA_3_8B = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}

SHAPES: dict[str, dict] = {
    "llama-3-8b": _LLAMA_3_8B,
    "llama-3-8b-awq": {**_LLAMA_3_8B, "quantization_config": _AWQ},
    "mistral-7b": {
        "model_type": "mistral", "vocab_size": 32768, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2,
    },
    "qwen2.5-7b": {
        "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "sliding_window": 131072, "use_sliding_window": False,
        "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
    },
    "smollm2-135m": {
        "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "tie_word_embeddings": True, "bos_token_id": 1,
        "eos_token_id": 2,
    },
}


def shape_names() -> tuple[str, ...]:
    return tuple(SHAPES)


def is_shape(name: str | None) -> bool:
    return name is not None and name.strip().lower() in SHAPES


def shape_config(name: str) -> ModelConfig:
    """The ModelConfig of a built-in shape; ConfigError naming the choices otherwise."""
    key = name.strip().lower()
    if key not in SHAPES:
        raise ConfigError(f"unknown model shape {name!r}; built-in shapes: {', '.join(SHAPES)}",
                          hint="pass one of the shapes, or --model with a model folder")
    return ModelConfig.from_dict(SHAPES[key])


__all__ = ["SHAPES", "shape_names", "is_shape", "shape_config"]
