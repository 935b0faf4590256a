"""Plan B of benchmarks/quality_gpu.py when hisparse's converter (transformers' GGUF reader)
fails on the GPU machine's transformers: dequantize a Llama-family GGUF with the `gguf`
package alone and write float16 safetensors beside the config/tokenizer files of a folder
that the converter produced elsewhere (`meta_dir`: config.json, tokenizer*.json, ...).

    convert_plain(Path("m.gguf"), Path("meta"), Path("/tmp/smollm2"))

llama.cpp stores q/k projections with their rotary halves interleaved per head; they are
permuted back exactly as transformers does (`reverse_permute_weights`). Checked against the
converter's own output: tensor for tensor equal after the float16 cast (see __main__).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
         "output.weight": "lm_head.weight"}
LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
         "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj"}
META_FILES = ("config.json", "generation_config.json", "special_tokens_map.json",
              "tokenizer.json", "tokenizer_config.json", "hisparse.json")


def hf_name(name: str) -> str:
    if name in NAMES:
        return NAMES[name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if not m or m.group(2) not in LAYER:
        raise ValueError(f"unknown GGUF tensor {name}")
    return f"model.layers.{m.group(1)}.{LAYER[m.group(2)]}.{m.group(3)}"


def reverse_permute(w, n_head: int):
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def read_state_dict(gguf_path: Path) -> dict:
    import numpy as np
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(gguf_path))
    arch = reader.get_field("general.architecture").contents()
    n_head = int(reader.get_field(f"{arch}.attention.head_count").contents())
    n_kv = int(reader.get_field(f"{arch}.attention.head_count_kv").contents())
    out = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape(tuple(int(x) for x in reversed(t.shape)))  # GGUF shapes are [in, out]
        if t.name.endswith("attn_q.weight"):
            w = reverse_permute(w, n_head)
        elif t.name.endswith("attn_k.weight"):
            w = reverse_permute(w, n_kv)
        out[hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(w)).to(torch.float16)
    return out


def convert_plain(gguf_path: Path, meta_dir: Path, dest: Path) -> Path:
    from safetensors.torch import save_file

    dest.mkdir(parents=True, exist_ok=True)
    save_file(read_state_dict(gguf_path), str(dest / "model.safetensors"), metadata={"format": "pt"})
    for name in META_FILES:
        if (meta_dir / name).is_file():
            shutil.copy(meta_dir / name, dest / name)
    return dest


if __name__ == "__main__":  # python benchmarks/gguf_fallback.py M.gguf CONVERTED_FOLDER
    import sys

    from safetensors.torch import load_file

    ours, ref = read_state_dict(Path(sys.argv[1])), load_file(f"{sys.argv[2]}/model.safetensors")
    assert set(ours) == set(ref), set(ours) ^ set(ref)
    bad = [k for k in ref if not bool((ours[k] == ref[k]).all())]
    print(f"{len(ref)} tensors, {len(bad)} differ: {bad[:5]}")
