"""The learned importance probe: a tiny MLP over a layer's normed hidden states that scores
how much attention each token will draw while it is in the window (importance="probe").

    scorer = load_probe(find_probe(engine.cfg))   # or load_probe("my.safetensors")
    Engine.from_pretrained(path, sparse=SparseConfig(importance="probe"), probe=scorer)
    scorer(layer, x)   # x: [T, hidden] -> [T, Hkv] (higher = keep)

Architecture (one network for all layers, < 10K parameters):
    u = pool(x / rms(x))                             # scale-free input; hidden sizes above
                                                     # 1024 are average-pooled to 1024
    h = gelu(W_in u + b_in + E[layer])               # rank r, E: a learned layer embedding
    y = W_out[layer] h + b_out[layer]                # [Hkv]: one output per KV head
Files: `<name>.safetensors` (weights only — never pickle) + `<name>.json` sidecar (shape,
the model it was trained for, training data and fit). Shipped probes live in
hisparse_cli/probes/; `find_probe` picks the one whose sidecar matches the model's shape.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from hisparse_cli.errors import ConfigError

FORMAT = "hisparse-probe/1"
PARAM_BUDGET = 9_500  # < 10K parameters including embeddings and heads
MAX_INPUT = 1024  # larger hidden states are average-pooled to this many features
PROBES_DIR = Path(__file__).resolve().parent.parent / "probes"
FINGERPRINT_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_key_value_heads",
                    "vocab_size")


def rank_for(hidden: int, layers: int, kv_heads: int, budget: int = PARAM_BUDGET) -> int:
    """Largest bottleneck rank (1..16) whose parameter count stays within `budget`."""
    per_rank = min(hidden, MAX_INPUT) + 1 + layers + layers * kv_heads
    return max(1, min(16, (budget - layers * kv_heads) // per_rank))


class ImportanceProbe(nn.Module):
    def __init__(self, hidden_size: int, num_layers: int, num_kv_heads: int,
                 rank: int | None = None) -> None:
        super().__init__()
        rank = rank or rank_for(hidden_size, num_layers, num_kv_heads)
        self.hidden_size, self.num_layers, self.num_kv_heads, self.rank = (
            hidden_size, num_layers, num_kv_heads, rank)
        self.inp = nn.Linear(min(hidden_size, MAX_INPUT), rank)
        self.layer_emb = nn.Embedding(num_layers, rank)
        self.out_w = nn.Parameter(torch.randn(num_layers, num_kv_heads, rank) * rank ** -0.5)
        self.out_b = nn.Parameter(torch.zeros(num_layers, num_kv_heads))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, layer: torch.Tensor | int, x: torch.Tensor) -> torch.Tensor:
        """layer: int, or [N] int64 (one layer per row); x: [N, hidden] -> [N, Hkv]."""
        u = x.float()
        u = u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + 1e-6)
        if u.shape[-1] > MAX_INPUT:
            u = F.adaptive_avg_pool1d(u[None], MAX_INPUT)[0]
        if isinstance(layer, int):
            h = F.gelu(self.inp(u) + self.layer_emb.weight[layer])
            return F.linear(h, self.out_w[layer], self.out_b[layer])
        h = F.gelu(self.inp(u) + self.layer_emb(layer))  # [N, r]
        return torch.einsum("nr,nhr->nh", h, self.out_w[layer]) + self.out_b[layer]


class ProbeScorer:
    """The callable Engine(probe=...) takes: (layer, x [T, hidden]) -> scores [T, Hkv]."""

    def __init__(self, module: ImportanceProbe, meta: dict) -> None:
        self.module, self.meta = module.eval(), meta
        self._device = None

    @torch.inference_mode()
    def __call__(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        if self._device != x.device:
            self.module.to(x.device)
            self._device = x.device
        return self.module(int(layer), x)


def fingerprint(cfg) -> dict:
    """The model shape a probe is tied to (from a ModelConfig or a config dict)."""
    get = cfg.get if isinstance(cfg, dict) else lambda k: getattr(cfg, k)
    return {k: get(k) for k in FINGERPRINT_KEYS}


def save_probe(module: ImportanceProbe, path: str | Path, meta: dict) -> tuple[Path, Path]:
    """Write `path` (must end in .safetensors) and its .json sidecar; returns both paths."""
    from safetensors.torch import save_file

    path = Path(path).expanduser()
    if path.suffix != ".safetensors":
        raise ConfigError(f"probe {path} must be a .safetensors file",
                          hint=f"use {path.with_suffix('.safetensors').name} (the .json sidecar "
                               "is written beside it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
    save_file(tensors, str(path), metadata={"format": FORMAT})
    sidecar = path.with_suffix(".json")
    full = {"format": FORMAT, "hidden_size": module.hidden_size, "num_layers": module.num_layers,
            "num_kv_heads": module.num_kv_heads, "rank": module.rank,
            "parameters": module.num_parameters(), **meta}
    sidecar.write_text(json.dumps(full, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path, sidecar


def load_probe(path: str | Path) -> ProbeScorer:
    """A ProbeScorer from `path` (.safetensors with its .json sidecar beside it)."""
    from hisparse_cli.errors import ModelError
    from hisparse_cli.model.loader import read_safetensors

    path = Path(path).expanduser()
    if path.suffix != ".safetensors":
        raise ConfigError(f"probe {path} must be a .safetensors file",
                          hint="probes are saved by `hisparse probe train` (never pickle)")
    sidecar = path.with_suffix(".json")
    hint = "train one with `hisparse probe train --out FILE`"
    try:
        meta = json.loads(sidecar.read_text(encoding="utf-8"))
        if not path.is_file():
            raise FileNotFoundError(f"no such file: {path.name}")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read probe {path} (+ {sidecar.name}): {exc}",
                          hint=hint) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ConfigError(f"probe {path}: unknown format {found!r}", hint=hint)
    retrain = ("the probe file is truncated or corrupt: train it again with `hisparse probe "
               "train --out FILE` (or restore the shipped one)")
    tensors = read_safetensors(path, hint=retrain)  # a corrupt file: ModelError (exit 4)
    try:
        module = ImportanceProbe(meta["hidden_size"], meta["num_layers"], meta["num_kv_heads"],
                                 meta["rank"])
        module.load_state_dict(tensors)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        why = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise ModelError(f"probe {path} does not match its sidecar {sidecar.name}: {why}",
                         hint=retrain) from None
    return ProbeScorer(module, meta)


def find_probe(cfg, folder: Path = PROBES_DIR) -> Path:
    """The shipped probe trained for a model of `cfg`'s shape (ConfigError when none)."""
    want = fingerprint(cfg)
    for sidecar in sorted(Path(folder).glob("*.json")):
        try:
            meta = json.loads(sidecar.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if meta.get("format") == FORMAT and meta.get("model") == want:
            weights = sidecar.with_suffix(".safetensors")
            if weights.is_file():
                return weights
    raise ConfigError(f"no shipped probe for this model ({want['model_type']}, hidden "
                      f"{want['hidden_size']}, {want['num_hidden_layers']} layers)",
                      hint="train one with `hisparse probe train --model M --out FILE` and "
                           "pass it with --probe FILE")


__all__ = ["ImportanceProbe", "ProbeScorer", "load_probe", "save_probe", "find_probe",
           "fingerprint", "rank_for", "PROBES_DIR"]
