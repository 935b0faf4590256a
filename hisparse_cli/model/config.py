"""`ModelConfig`: the architecture fields our forward pass needs, read from an HF config.json.

Reads the raw JSON (no transformers import), accepting both the transformers-4 keys
(`rope_theta`, `rope_scaling`) and the transformers-5 key (`rope_parameters`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from hisparse_cli.errors import ModelError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": ..., "factor": ..., ...}
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (qwen2: always; llama: attention_bias)
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # qwen3: RMSNorm on q and k per head, before RoPE
    sliding_window: int | None = None  # model-native sliding window (mistral), if active
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    quantization_config: dict | None = field(default=None, compare=False)

    @property
    def parameters(self) -> int:
        """Weights in the model (embeddings, attention, MLP, norms, head; biases left out),
        from the shapes alone."""
        h, d, L = self.hidden_size, self.head_dim, self.num_hidden_layers
        attn = h * d * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + L * layer + h + head

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        mt = cfg.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ModelError(
                f"unsupported model_type {mt!r}: hisparse runs {', '.join(SUPPORTED_MODEL_TYPES)}",
                hint="pick a Llama, Mistral, Qwen2 or Qwen3 checkpoint",
            )
        try:
            n_heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            head_dim = cfg.get("head_dim") or hidden // n_heads
            rope = cfg.get("rope_parameters") or {}
            scaling = cfg.get("rope_scaling") or None
            if rope and scaling is None and rope.get("rope_type", "default") != "default":
                scaling = dict(rope)
            if scaling is not None:
                scaling = dict(scaling)
                scaling.setdefault("rope_type", scaling.get("type", "default"))
                if scaling["rope_type"] == "default":
                    scaling = None
            theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            window = cfg.get("sliding_window")
            if mt == "qwen2" or mt == "qwen3":
                if not cfg.get("use_sliding_window", False):
                    window = None
            return cls(
                model_type=mt,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=n_heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or n_heads),
                head_dim=int(head_dim),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                rope_theta=float(theta),
                rope_scaling=scaling,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", False)) or mt == "qwen2",
                o_bias=bool(cfg.get("attention_bias", False)) and mt != "qwen2",
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                qk_norm=mt == "qwen3",
                sliding_window=int(window) if window else None,
                hidden_act=str(cfg.get("hidden_act", "silu")),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
                torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
                quantization_config=cfg.get("quantization_config"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelError(f"config.json is missing or has a bad field: {exc}") from exc

    @classmethod
    def from_folder(cls, path: str | Path) -> "ModelConfig":
        p = Path(path) / "config.json"
        if not p.is_file():
            raise ModelError(f"no config.json in {path}",
                             hint="point --model at a Hugging Face model folder (config.json + *.safetensors)")
        try:
            cfg = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelError(f"cannot read {p}: {exc}") from exc
        return cls.from_dict(cfg)
