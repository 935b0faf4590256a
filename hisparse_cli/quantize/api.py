"""`quantize_model`: an fp Llama-family folder -> an AWQ INT4 (GEMM layout) folder.

The library side of `hisparse quantize MODEL --out DIR`. Calibration runs our own forward pass
(model/llama.py, dense full-sequence attention), one decoder layer at a time on `device`
while the model waits in host memory, so a model larger than the GPU can be quantized.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hisparse_cli.errors import ConfigError, ModelError
from hisparse_cli.quantize.layerwise import GroupResult

CPU_MLP_TOKENS = 1024  # the MLP-output objective dominates CPU time; fewer rows there
Progress = Callable[[str, int, int], None]  # (stage, done, total); stage: calibrate|layer|write


@dataclass(frozen=True)
class QuantizeReport:
    out_dir: str
    method: str  # "awq" | "rtn"
    group_size: int
    n_samples: int  # calibration blocks actually used
    seq_len: int
    calib_tokens: int
    quantized: tuple[str, ...]  # module names stored as INT4
    kept_fp: tuple[str, ...]  # linears left in fp16 (lm_head unless quantize_lm_head)
    size_bytes: int  # tensors written
    seconds: float
    groups: tuple[GroupResult, ...]  # per scaled group: calibration loss RTN vs AWQ

    @property
    def loss_ratio(self) -> float | None:
        """Geometric mean over groups of AWQ loss / RTN loss on calibration data (<= 1)."""
        import math

        r = [g.awq_loss / g.rtn_loss for g in self.groups if g.rtn_loss > 0]
        return math.exp(sum(map(math.log, r)) / len(r)) if r else None


def _group_inputs(cfg) -> dict[str, int]:
    """The input widths a quantization group must divide (every decoder linear's K)."""
    return {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "attention width": cfg.num_attention_heads * cfg.head_dim}


def _check_group_size(cfg, group_size: int | None, quantize_lm_head: bool) -> int:
    """The group size to use, or a
    ConfigError naming the widths that do not fit and what would."""
    from hisparse_cli.model.awq import SUPPORTED_GROUP_SIZES

    if group_size is not None and group_size not in SUPPORTED_GROUP_SIZES:
        sizes = ", ".join(map(str, SUPPORTED_GROUP_SIZES))
        raise ConfigError(f"--group-size must be one of {sizes}, got {group_size}",
                          hint="leave --group-size out to use the largest that divides the model")
    outs = {"kv width": cfg.num_key_value_heads * cfg.head_dim}
    if quantize_lm_head:
        outs["vocab_size"] = cfg.vocab_size
    bad_out = [f"{k} {v}" for k, v in outs.items() if v % 8]
    if bad_out:
        raise ConfigError(f"INT4 packs 8 output columns a word: this model's "
                          f"{', '.join(bad_out)} is not a multiple of 8",
                          hint="leave the output head in fp16 (no --quantize-lm-head)"
                          if bad_out == [f"vocab_size {cfg.vocab_size}"] else None)
    ins = _group_inputs(cfg)
    ok = [g for g in SUPPORTED_GROUP_SIZES if all(v % g == 0 for v in ins.values())]
    if not ok:
        raise ConfigError("no supported group size ("
                          + ", ".join(map(str, SUPPORTED_GROUP_SIZES))
                          + ") divides this model's "
                          + ", ".join(f"{k} {v}" for k, v in ins.items()))
    if group_size is None:
        return max(ok)
    bad = [f"{k} {v}" for k, v in ins.items() if v % group_size]
    if bad:
        raise ConfigError(f"group size {group_size} does not divide this model's "
                          f"{', '.join(bad)}",
                          hint=f"use --group-size {' or '.join(map(str, ok))}, or leave it out "
                               f"(the largest that fits)")
    return group_size


def check_destination(out_dir: str | Path, device: str | None) -> None:
    """ConfigError (exit 2) for an --out that cannot become the new model folder (an existing
    file, a non-empty folder) and for a --device other than cpu/cuda, or cuda without one;
    checked before any model or calibration text is read."""
    import torch

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a folder",
                          hint="give a new folder for the INT4 model")
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"output folder {out} is not empty", hint="pick a new --out folder")
    if device is not None and device not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be cpu or cuda, got {device!r}",
                          hint="leave --device out to use cuda when available, else cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda, but no CUDA GPU is available",
                          hint="use --device cpu (or leave --device out)")


def quantize_model(model_dir: str | Path, out_dir: str | Path, *, calib_texts: list[str],
                   group_size: int | None = None, n_samples: int = 128, seq_len: int = 512,
                   progress: Progress | None = None, quantize_lm_head: bool = False,
                   method: str = "awq", device: str | None = None,
                   search_tokens: int = 4096) -> QuantizeReport:
    """Quantize every decoder linear (and lm_head when asked) to INT4 with AWQ; write out_dir.

    group_size None: the largest supported size that divides every linear's input width (128,
    the published checkpoints' size, where it fits, else 64 or 32); the report has it.
    method "rtn" skips the searches (plain round-to-nearest, same grid and layout): the baseline.
    device: where each layer is calibrated (default cuda when available, else cpu).
    """
    import torch

    from hisparse_cli.model.awq import AWQConfig
    from hisparse_cli.model.config import ModelConfig
    from hisparse_cli.model.llama import forward_full
    from hisparse_cli.model.loader import load_model, open_safetensors, safetensors_files
    from hisparse_cli.quantize import export
    from hisparse_cli.quantize.calibration import calibration_blocks
    from hisparse_cli.quantize.layerwise import (SearchSettings, capture_layer_inputs,
                                                 quantize_head, quantize_layer)

    t0 = time.perf_counter()
    report = progress or (lambda stage, done, total: None)
    src, out = Path(model_dir), Path(out_dir)
    if method not in ("awq", "rtn"):
        raise ConfigError(f"method must be awq or rtn, got {method!r}")
    if out.resolve() == src.resolve():
        raise ConfigError("--out must differ from the model folder")
    check_destination(out, device)
    cfg = ModelConfig.from_folder(src)
    if cfg.quantization_config is not None:
        raise ModelError(f"{src} is already quantized "
                         f"({cfg.quantization_config.get('quant_method', '?')})",
                         hint="quantize the original fp16/bf16 model")
    group_size = _check_group_size(cfg, group_size, quantize_lm_head)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(src))
    report("calibrate", 0, 1)
    blocks = calibration_blocks(tokenizer, calib_texts, n_samples, seq_len)
    report("calibrate", 1, 1)
    source_keys: list[str] = []
    n_params = 0
    for f in safetensors_files(src):
        with open_safetensors(f) as h:
            for k in h.keys():
                source_keys.append(k)
                n_params += _numel(h.get_slice(k).get_shape())
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    store_dtype = torch.float32 if n_params < 3e9 else torch.float16  # host copy while working
    cuda = dev.type == "cuda"
    st = SearchSettings(group_size=group_size, awq=method == "awq", search_tokens=search_tokens,
                        mlp_tokens=search_tokens if cuda else min(search_tokens, CPU_MLP_TOKENS),
                        device=dev, dtype=torch.float16 if cuda else torch.float32)
    model, cfg = load_model(src, "cpu", store_dtype)
    layers = model.model.layers
    calls = capture_layer_inputs(layers, lambda ids: forward_full(model, ids), blocks)
    packed, groups = {}, []
    for i, layer in enumerate(layers):
        calls, layer_packed, results = quantize_layer(i, layer, calls, st)
        packed.update({f"model.layers.{i}.{k}": v for k, v in layer_packed.items()})
        groups += results
        report("layer", i + 1, len(layers))
    if quantize_lm_head:
        head, result = quantize_head(model.model.norm, model.lm_head.weight, calls, st)
        packed["lm_head"] = head
        groups += [result] if result else []
    del calls

    report("write", 0, 1)
    out.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    biases = {p: state[f"{p}.bias"] for p in packed if f"{p}.bias" in state}
    tensors = export.awq_tensors(packed, biases)
    wanted = set(source_keys) - {"lm_head.weight"} if quantize_lm_head else set(source_keys)
    fp = {k: v for k, v in state.items() if k in wanted}
    for k in wanted - fp.keys():  # tensors our modules do not hold: copied as they are
        fp[k] = _read_tensor(src, k)
    tensors.update(export.fp16_tensors(fp, set(packed)))
    size = export.write_safetensors(tensors, out)
    kept = () if quantize_lm_head else ("lm_head",)
    awq = AWQConfig(group_size=group_size, modules_to_not_convert=kept)
    export.write_config(src, out, awq, untie_embeddings=quantize_lm_head)
    export.copy_tokenizer(src, out)
    report("write", 1, 1)
    return QuantizeReport(
        out_dir=str(out), method=method, group_size=group_size, n_samples=len(blocks),
        seq_len=seq_len, calib_tokens=sum(int(b.numel()) for b in blocks),
        quantized=tuple(sorted(packed)), kept_fp=kept, size_bytes=size,
        seconds=time.perf_counter() - t0, groups=tuple(groups))


def _read_tensor(src: Path, key: str):
    from hisparse_cli.model.loader import open_safetensors, safetensors_files

    for f in safetensors_files(src):
        with open_safetensors(f) as h:
            if key in h.keys():
                return h.get_tensor(key)
    raise ModelError(f"tensor {key} vanished from {src}")


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
