"""Load a Llama-family checkpoint (safetensors only: one file or a sharded index) into our
`CausalLM`: build on the meta device, then copy each tensor (memory-mapped read) to the
target device and dtype. AWQ INT4 linears (`<name>.qweight`) become `AWQLinear` modules.
Never loads pickle files and never runs checkpoint code.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from hisparse_cli.errors import ModelError
from hisparse_cli.model.config import ModelConfig
from hisparse_cli.model.llama import CausalLM

LINEAR_SUFFIXES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# fused at load time (Engine): (submodule, fused attribute, the checkpoint linears it stacks)
FUSED = (("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
         ("mlp", "gate_up_proj", ("gate_proj", "up_proj")))


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise ModelError(f"bad safetensors index {index}: {exc}") from exc
        files = sorted({folder / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelError(f"shards listed in {index.name} are missing: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        from hisparse_cli.hub.resolve import PICKLE_HINT

        hint = PICKLE_HINT if pickles else None
        raise ModelError(f"no *.safetensors weights in {folder}", hint=hint)
    return files


CORRUPT_WEIGHTS_HINT = ("the file is truncated or corrupt: download it again (a registry "
                        "model: `hisparse models pull NAME --force`)")


def open_safetensors(path: Path, hint: str = CORRUPT_WEIGHTS_HINT):
    """`safe_open(path)`, memory-mapped; a file safetensors cannot parse (truncated, not
    safetensors at all) or cannot read is a ModelError (exit 4), never an internal error.
    Every safetensors file hisparse reads (model, quantize source, probe) opens here."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as exc:
        raise ModelError(f"cannot read weights {path}: {exc}", hint=hint) from None


def read_safetensors(path: Path, hint: str = CORRUPT_WEIGHTS_HINT) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file (`open_safetensors`'s errors)."""
    handle = open_safetensors(path, hint)
    return {key: handle.get_tensor(key) for key in handle.keys()}


class _Tensors:
    """Name -> file lookup over one or many safetensors files, opened memory-mapped."""

    def __init__(self, files: list[Path]) -> None:
        self._handles = []
        self._where: dict[str, object] = {}
        for f in files:
            h = open_safetensors(f)
            self._handles.append(h)
            for key in h.keys():
                self._where[key] = h

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def get(self, key: str) -> torch.Tensor:
        try:
            return self._where[key].get_tensor(key)
        except KeyError:
            raise ModelError(f"checkpoint is missing tensor {key!r}") from None

    def keys(self):
        return self._where.keys()


def _set_param(module: nn.Module, name: str, value: torch.Tensor) -> None:
    setattr(module, name, nn.Parameter(value, requires_grad=False))


def decode_input_major(out_features: int, in_features: int) -> bool:
    """Whether the CPU decode layout stores an [out, in] weight input-major: where it is at
    least twice as wide as it is deep (gate|up, the vocabulary head). The one-row products of
    decode run as column slices on the threads (model/row_split.py); measured on the 2-core
    development machine, a slice of a wide weight reads faster input-major (a short output row
    accumulated while rows of W stream by), and a slice of a square or narrow one (q|k|v, o,
    down) faster as the checkpoint's [out, in] rows (long dot products). BENCHMARKS.md, CPU
    section, seventh session: now docs/history/cpu-2026-12-01.md)."""
    return out_features >= 2 * in_features


def converted(w: torch.Tensor, device: torch.device, dtype: torch.dtype,
              input_major: bool = False) -> torch.Tensor:
    """`w` on `device` in `dtype`; input_major: the same [out, in] matrix stored input-major
    (a transposed view of [in, out] storage), written in one copy from the checkpoint (no
    second full-size temporary). Multi-row matmuls (prefill) run at the same speed either way,
    except a vocabulary-sized head over many positions (slower input-major)."""
    if not input_major:
        return w.to(device=device, dtype=dtype)
    out = torch.empty((w.shape[1], w.shape[0]), dtype=dtype, device=device)
    out.copy_(w.t())
    return out.t()


def _load_linear(parent: nn.Module, attr: str, prefix: str, tensors: _Tensors, awq_cfg,
                 device: torch.device, dtype: torch.dtype, input_major: bool = False) -> None:
    lin: nn.Linear = getattr(parent, attr)
    if f"{prefix}.qweight" in tensors:
        if awq_cfg is None:
            raise ModelError(f"{prefix} holds INT4 tensors but config.json has no AWQ quantization_config")
        from hisparse_cli.model.awq import AWQLinear

        bias = tensors.get(f"{prefix}.bias") if f"{prefix}.bias" in tensors else None
        setattr(parent, attr, AWQLinear.from_checkpoint(
            qweight=tensors.get(f"{prefix}.qweight"), qzeros=tensors.get(f"{prefix}.qzeros"),
            scales=tensors.get(f"{prefix}.scales"), bias=bias, group_size=awq_cfg.group_size,
            device=device, dtype=dtype))
        return
    w = tensors.get(f"{prefix}.weight")
    if tuple(w.shape) != (lin.out_features, lin.in_features):
        raise ModelError(f"{prefix}.weight has shape {tuple(w.shape)}, config implies "
                         f"{(lin.out_features, lin.in_features)}")
    _set_param(lin, "weight", converted(w, device, dtype,
                                        input_major and decode_input_major(*w.shape)))
    if lin.bias is not None:
        _set_param(lin, "bias", tensors.get(f"{prefix}.bias").to(device=device, dtype=dtype))


def _load_fused(parent: nn.Module, attr: str, parts: tuple[str, ...], pre: str, tensors: _Tensors,
                awq_cfg, device: torch.device, dtype: torch.dtype, input_major: bool) -> bool:
    """Load the linears `parts` of `parent` as one linear `attr` whose output stacks theirs
    (q|k|v, gate|up): one matmul instead of several, the same bytes. The stacked weight is
    written piece by piece into its final storage (no second full-size temporary). Returns
    False, loading nothing, where the pieces differ in format or bias (a mixed AWQ checkpoint
    that left some of them fp16): the caller loads them one by one."""
    prefixes = [f"{pre}.{p}" for p in parts]
    quant = {f"{p}.qweight" in tensors for p in prefixes}
    has_bias = {f"{p}.bias" in tensors for p in prefixes}
    if len(quant) > 1 or len(has_bias) > 1:
        return False
    lins: list[nn.Linear] = [getattr(parent, p) for p in parts]
    in_f, out_f = lins[0].in_features, sum(lin.out_features for lin in lins)
    bias = (torch.cat([tensors.get(f"{p}.bias") for p in prefixes]).to(device=device, dtype=dtype)
            if has_bias == {True} else None)
    if quant == {True}:
        if awq_cfg is None:
            raise ModelError(f"{prefixes[0]} holds INT4 tensors but config.json has no AWQ "
                             "quantization_config")
        from hisparse_cli.model.awq import AWQLinear

        # AWQ GEMM tensors are [rows, out/8] / [groups, out]: stacking outputs is a concat
        cat = {k: torch.cat([tensors.get(f"{p}.{k}") for p in prefixes], dim=1)
               for k in ("qweight", "qzeros", "scales")}
        setattr(parent, attr, AWQLinear.from_checkpoint(
            bias=bias, group_size=awq_cfg.group_size, device=device, dtype=dtype,
            name=f"{pre}.{attr}", expect=(out_f, in_f), **cat))
    else:
        input_major = input_major and decode_input_major(out_f, in_f)
        w = torch.empty((in_f, out_f) if input_major else (out_f, in_f), dtype=dtype, device=device)
        o = 0
        for p, lin in zip(prefixes, lins):
            piece = tensors.get(f"{p}.weight")
            if tuple(piece.shape) != (lin.out_features, in_f):
                raise ModelError(f"{p}.weight has shape {tuple(piece.shape)}, config implies "
                                 f"{(lin.out_features, in_f)}")
            n = lin.out_features
            (w[:, o:o + n] if input_major else w[o:o + n]).copy_(piece.t() if input_major else piece)
            o += n
        with torch.device("meta"):
            fused = nn.Linear(in_f, out_f, bias=bias is not None)
        _set_param(fused, "weight", w.t() if input_major else w)
        if bias is not None:
            _set_param(fused, "bias", bias)
        setattr(parent, attr, fused)
    for p in parts:
        setattr(parent, p, None)
    return True


def _map_host_table(emb: nn.Embedding) -> None:
    """A host-resident table for a CUDA run: copied into memory of its own (the checkpoint's
    tensor may share a file mapping) and registered for the device to read
    (kernels/cuda/host_rows.py: CUDA-graph decode then gathers the token's row on the device).
    Left as it is, read on the host, where registration is not possible."""
    from hisparse_cli.kernels.dispatch import triton_available

    if not triton_available():  # the gather is a Triton kernel; graph decode needs Triton too
        return
    from hisparse_cli.kernels.cuda import host_rows

    table = torch.empty(emb.weight.shape, dtype=emb.weight.dtype)
    table.copy_(emb.weight)
    _set_param(emb, "weight", table)
    host_rows.map_table(emb.weight)


def load_model(path: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, embeddings_on_host: bool = False,
               decode_layout: bool = False, fuse: bool = False,
               lm_head_int8: bool = False) -> tuple[CausalLM, ModelConfig]:
    """lm_head_int8: an fp output head (its own or the tied table) becomes an Int8Linear,
    quantized where the checkpoint's tensor lies (host memory) before it moves, so the fp
    head is never resident on the device; an INT4 head stays INT4. decode_layout: on a CPU in
    float32, store the wide linear weights input-major
    (`converted`, `decode_input_major`) for faster decode. fuse: load q|k|v and gate|up as one linear each (`_load_fused`): fewer,
    larger matmuls. The engine asks for both; tools that write weights back (quantize) and
    read the checkpoint's module names do not."""
    folder = Path(path)
    if not folder.is_dir():
        raise ModelError(f"model folder not found: {folder}")
    cfg = ModelConfig.from_folder(folder)
    awq_cfg = None
    if cfg.quantization_config is not None:
        from hisparse_cli.model.awq import parse_quantization_config

        awq_cfg = parse_quantization_config(cfg.quantization_config)
    device = torch.device(device)
    input_major = decode_layout and device.type == "cpu" and dtype == torch.float32
    tensors = _Tensors(safetensors_files(folder))
    with torch.device("meta"):
        model = CausalLM(cfg)
    emb_device = torch.device("cpu") if embeddings_on_host else device
    emb = tensors.get("model.embed_tokens.weight")
    # a tied table is also the head's weight: laid out for the head's GEMV (the lookup of a
    # few rows does not care)
    tied = cfg.tie_word_embeddings and "lm_head.weight" not in tensors and "lm_head.qweight" not in tensors
    _set_param(model.model.embed_tokens, "weight",
               converted(emb, emb_device, dtype, input_major and tied and not embeddings_on_host
                         and decode_input_major(*emb.shape)))
    for i, layer in enumerate(model.model.layers):
        pre = f"model.layers.{i}"
        done: set[str] = set()
        for sub, attr, parts in FUSED if fuse else ():
            if _load_fused(getattr(layer, sub), attr, parts, f"{pre}.{sub}", tensors, awq_cfg,
                           device, dtype, input_major):
                done.update(f"{sub}.{p}" for p in parts)
        for suffix in LINEAR_SUFFIXES:
            if suffix in done:
                continue
            sub, attr = suffix.split(".")
            _load_linear(getattr(layer, sub), attr, f"{pre}.{suffix}", tensors, awq_cfg, device, dtype,
                         input_major)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            _set_param(getattr(layer, norm), "weight",
                       tensors.get(f"{pre}.{norm}.weight").to(device=device, dtype=dtype))
        if cfg.qk_norm:
            for norm in ("q_norm", "k_norm"):
                _set_param(getattr(layer.self_attn, norm), "weight",
                           tensors.get(f"{pre}.self_attn.{norm}.weight").to(device=device, dtype=dtype))
    _set_param(model.model.norm, "weight", tensors.get("model.norm.weight").to(device=device, dtype=dtype))
    if lm_head_int8 and "lm_head.qweight" not in tensors:
        from hisparse_cli.model.int8_linear import Int8Linear

        fp = tensors.get("lm_head.weight") if "lm_head.weight" in tensors else (
            model.model.embed_tokens.weight if cfg.tie_word_embeddings else None)
        if fp is None:
            raise ModelError("checkpoint has no lm_head.weight and does not tie embeddings")
        model.lm_head = Int8Linear.from_float(fp, device)
    elif "lm_head.weight" in tensors or "lm_head.qweight" in tensors:
        _load_linear(model, "lm_head", "lm_head", tensors, awq_cfg, device, dtype, input_major)
    elif cfg.tie_word_embeddings:
        head = model.model.embed_tokens.weight
        if embeddings_on_host:
            head = head.to(device)
        model.lm_head.weight = head if not embeddings_on_host else nn.Parameter(head, requires_grad=False)
    else:
        raise ModelError("checkpoint has no lm_head.weight and does not tie embeddings")
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise ModelError(f"checkpoint did not provide {len(left)} tensor(s), e.g. {left[0]}")
    if embeddings_on_host and device.type == "cuda":
        _map_host_table(model.model.embed_tokens)
    model.init_rope(device)
    model.eval()
    return model, cfg
