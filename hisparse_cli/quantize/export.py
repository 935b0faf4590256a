"""Write a quantized model folder laid out like published AutoAWQ "GEMM" checkpoints.

    config.json          the original config + quantization_config {quant_method: awq,
                         bits: 4, group_size, zero_point: true, version: gemm,
                         modules_to_not_convert}; dtype float16
    model*.safetensors   <linear>.qweight/.qzeros/.scales(/.bias) for quantized linears,
                         every other tensor in fp16; shards + model.safetensors.index.json
                         when larger than SHARD_BYTES; metadata {"format": "pt"}
    tokenizer files      copied unchanged (tokenizer.json, tokenizer_config.json, ...)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from hisparse_cli.kernels.int4.awq_pack import PackedInt4
from hisparse_cli.model.awq import AWQConfig

SHARD_BYTES = 4 * 1024**3
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")


def fp16_tensors(state: dict[str, torch.Tensor], skip_prefixes: set[str]) -> dict[str, torch.Tensor]:
    """Every tensor of `state` not belonging to a quantized linear, as contiguous CPU fp16."""
    out = {}
    for name, t in state.items():
        if name.rsplit(".", 1)[0] in skip_prefixes:
            continue
        t = t.detach().to("cpu")
        out[name] = (t.to(torch.float16) if t.is_floating_point() else t).contiguous()
    return out


def awq_tensors(packed: dict[str, PackedInt4], biases: dict[str, torch.Tensor]
                ) -> dict[str, torch.Tensor]:
    """prefix -> PackedInt4 (plus optional fp bias) -> flat checkpoint tensors."""
    out = {}
    for prefix, p in packed.items():
        out[f"{prefix}.qweight"] = p.qweight.contiguous()
        out[f"{prefix}.qzeros"] = p.qzeros.contiguous()
        out[f"{prefix}.scales"] = p.scales.to(torch.float16).contiguous()
        if prefix in biases:
            out[f"{prefix}.bias"] = biases[prefix].detach().to("cpu", torch.float16).contiguous()
    return out


def write_safetensors(tensors: dict[str, torch.Tensor], out_dir: Path,
                      shard_bytes: int = SHARD_BYTES) -> int:
    """model.safetensors, or model-0000i-of-0000n.safetensors + index. Returns total bytes."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    total = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
        total += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / "model.safetensors"), metadata=meta)
        return total
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / fname), metadata=meta)
        weight_map.update({name: fname for name in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def write_config(src_dir: Path, out_dir: Path, awq: AWQConfig, untie_embeddings: bool) -> dict:
    cfg = json.loads((src_dir / "config.json").read_text(encoding="utf-8"))
    cfg["quantization_config"] = awq.to_dict()
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = "float16"
    cfg["torch_dtype"] = "float16"  # transformers 4.x readers look for this key
    if untie_embeddings:
        cfg["tie_word_embeddings"] = False
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return cfg


def copy_tokenizer(src_dir: Path, out_dir: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (src_dir / name).is_file():
            shutil.copy2(src_dir / name, out_dir / name)
            copied.append(name)
    return copied
