"""Device bytes of a model's weights, by kind, as model/loader.py places them.

Unquantized weights load in the compute dtype (the loader casts every tensor to it). AWQ INT4
linears (AutoAWQ GEMM layout, model/awq.py) hold per linear in -> out with group g:
    qweight int32 [in, out/8]   = in*out/2 bytes
    qzeros  int32 [in/g, out/8] = (in/g)*(out/8)*4 bytes
    scales  fp16  [in/g, out]   = (in/g)*out*2 bytes
plus a bias [out] in the compute dtype where the architecture has one. Norms, embeddings and
(unless `awq_lm_head`) the LM head stay in the compute dtype; `lm_head_int8` (the profile's
lm_head_format = "int8") makes an fp head INT8 [V, H] with fp32 row scales (its own tensor,
tied or not). With `embeddings_on_host` the embedding table stays in host RAM; a tied LM
head then gets its own device copy.
On CUDA every tensor is sized as the caching allocator counts it (planner_trace.cuda_block_bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from hisparse_cli.model.config import ModelConfig
from hisparse_cli.planner.trace import cuda_block_bytes


@dataclass(frozen=True)
class WeightItem:
    name: str
    bytes: int
    formula: str
    on_device: bool = True


def awq_linear_bytes(in_f: int, out_f: int, group: int) -> tuple[int, int, int]:
    """(qweight, qzeros, scales) bytes of one AWQ GEMM linear."""
    return in_f * out_f // 2, (in_f // group) * (out_f // 8) * 4, (in_f // group) * out_f * 2


def linear_shapes(cfg: ModelConfig) -> list[tuple[str, int, int, bool]]:
    """(name, in, out, has_bias) of one decoder layer's linears."""
    hs, qd, kd, im = (cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim,
                      cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size)
    ab, mb = cfg.attention_bias, cfg.mlp_bias
    return [("q_proj", hs, qd, ab), ("k_proj", hs, kd, ab), ("v_proj", hs, kd, ab),
            ("o_proj", qd, hs, cfg.o_bias), ("gate_proj", hs, im, mb), ("up_proj", hs, im, mb),
            ("down_proj", im, hs, mb)]


def prefill_cache_layer_bytes(cfg: ModelConfig, cb: int, cuda: bool) -> int:
    """Bytes of one decoder layer's prefill weight cache (AWQLinear.keep_prefill_weight):
    W^T of each INT4 linear as the engine runs them (q|k|v and gate|up stacked) in the compute
    dtype, one tensor each."""
    hs, qd, kd, im = (cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim,
                      cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size)
    a = cuda_block_bytes if cuda else (lambda n: n)
    return sum(a(i * o * cb) for i, o in ((hs, qd + 2 * kd), (qd, hs), (hs, 2 * im), (im, hs)))


def cpu_int4pack_items(cfg: ModelConfig, group: int, awq_lm_head: bool) -> list[WeightItem]:
    """The packed CPU decode copies of the AWQ linears (kernels/int4/awq_cpu.py), per linear as the
    loader stacks them (q|k|v, gate|up) and only where the shape allows the packing."""
    from hisparse_cli.kernels.int4.awq_cpu import int4pack_applies, packed_bytes

    hs, qd, kd, im = (cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim,
                      cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size)
    stacked = [("qkv", hs, qd + 2 * kd), ("o", qd, hs), ("gate_up", hs, 2 * im),
               ("down", im, hs)]
    per_layer, parts = 0, []
    for name, i, o in stacked:
        if int4pack_applies(i, o, group):
            per_layer += sum(packed_bytes(i, o, group))
            parts.append(f"{name} {i}x{o}")
    items = []
    if per_layer:
        items.append(WeightItem(
            "weights.linears_cpu_int4pack", cfg.num_hidden_layers * per_layer,
            f"{cfg.num_hidden_layers} layers x ({', '.join(parts)}): in*out/2 + "
            f"(in/{group})*out*4 each (packed decode copy, bf16 scales and zeros)"))
    if awq_lm_head and int4pack_applies(hs, cfg.vocab_size, group):
        b = sum(packed_bytes(hs, cfg.vocab_size, group))
        items.append(WeightItem("weights.lm_head_cpu_int4pack", b,
                                f"INT4 {hs}x{cfg.vocab_size} packed decode copy"))
    return items


def cpu_decode_item(cfg: ModelConfig, esize: int) -> WeightItem:
    """The native CPU decode's tiled copy of the linears and the head (model/cpu_decode.py),
    `esize` bytes an element (2: a float16/bfloat16 checkpoint's own values). An upper
    bound where the checkpoint's values are exactly GGUF Q4_1 / Q8_0 groups (the default
    model): the copy then holds 0.625 / 1.06 bytes a weight, which only the values tell."""
    from hisparse_cli.kernels.cpu.native import tiled_bytes

    H, L, V = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    qd, kd, im = (cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim,
                  cfg.intermediate_size)
    per_layer = (tiled_bytes(qd + 2 * kd, H, esize) + tiled_bytes(H, qd, esize)
                 + tiled_bytes(2 * im, H, esize) + tiled_bytes(H, im, esize))
    return WeightItem("weights.cpu_decode_copy", L * per_layer + tiled_bytes(V, H, esize),
                      f"{L} layers x (q|k|v, o, gate|up, down) + head [{V}, {H}], tiled, "
                      f"{esize} B (the native decode's copy; rows padded to 8; at most: "
                      "4-/8-bit where the values are exactly GGUF Q4_1/Q8_0 groups)")


def weight_items(cfg: ModelConfig, *, cb: int, awq: bool, group: int, awq_lm_head: bool,
                 embeddings_on_host: bool, cuda: bool, lm_head_int8: bool = False,
                 cpu_int4: bool = False, cpu_decode: int = 0,
                 prefill_cache_layers: int = 0) -> list[WeightItem]:
    """cpu_decode: the element size of the native CPU decode copy (0: none).
    prefill_cache_layers: decoder layers whose INT4 linears keep W^T for prefill."""
    def a(n: int) -> int:
        return cuda_block_bytes(n) if cuda else max(n, 0)

    V, H, L, D = cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim
    dt = {2: "2 B", 4: "4 B"}[cb]
    items = [WeightItem("weights.embeddings", a(V * H * cb), f"[{V}, {H}] x {dt}",
                        on_device=not embeddings_on_host)]
    per_layer, parts, bias = 0, [], 0
    for name, i, o, has_bias in linear_shapes(cfg):
        if awq:
            qw, qz, sc = awq_linear_bytes(i, o, group)
            per_layer += a(qw) + a(qz) + a(sc)
            parts.append(f"{name} {i}x{o}")
        else:
            per_layer += a(i * o * cb)
            parts.append(f"{name} {i}x{o}")
        if has_bias:
            bias += a(o * cb)
    if awq:
        lin_formula = (f"{L} layers x ({', '.join(parts)}) as INT4: in*out/2 + (in/{group})*"
                       f"(out/8)*4 + (in/{group})*out*2 each")
    else:
        lin_formula = f"{L} layers x ({', '.join(parts)}) x {dt}"
    items.append(WeightItem("weights.linears", L * per_layer, lin_formula))
    if bias:
        items.append(WeightItem("weights.biases", L * bias, f"{L} layers x q/k/v/o/mlp biases"))
    norm = 2 * a(H * cb) + (2 * a(D * cb) if cfg.qk_norm else 0)
    qk = f" + 2 x [{D}] (q/k norm)" if cfg.qk_norm else ""
    items.append(WeightItem("weights.norms", L * norm + a(H * cb),
                            f"{L} layers x (2 x [{H}]{qk}) + final [{H}], x {dt}"))
    if awq and awq_lm_head:
        qw, qz, sc = awq_linear_bytes(H, V, group)
        items.append(WeightItem("weights.lm_head", a(qw) + a(qz) + a(sc),
                                f"INT4 {H}x{V}: {qw} + {qz} + {sc}"))
    elif lm_head_int8:  # model/int8_linear.py: int8 [V, H] + fp32 scale [V]
        items.append(WeightItem("weights.lm_head", a(V * H) + a(V * 4),
                                f"INT8 [{V}, {H}] x 1 B + fp32 row scales [{V}] x 4 B"))
    elif cfg.tie_word_embeddings and not embeddings_on_host:
        items.append(WeightItem("weights.lm_head", 0, "tied to the embeddings (shared tensor)"))
    else:
        why = " (device copy of the host-resident tied table)" if cfg.tie_word_embeddings else ""
        items.append(WeightItem("weights.lm_head", a(V * H * cb), f"[{V}, {H}] x {dt}{why}"))
    items.append(WeightItem("weights.rope", a(D // 2 * 4), f"inv_freq [{D // 2}] fp32"))
    if awq and prefill_cache_layers:
        items.append(WeightItem(
            "weights.prefill_cache", prefill_cache_layers * prefill_cache_layer_bytes(cfg, cb, cuda),
            f"{prefill_cache_layers} of {L} layers x W^T of (q|k|v, o, gate|up, down) x {dt}: "
            "dequantized once, what prefill chunks multiply by (the budget's room after the run)"))
    if awq and cpu_int4 and not cuda:
        items += cpu_int4pack_items(cfg, group, awq_lm_head)
    if cpu_decode and not cuda and not awq:
        items.append(cpu_decode_item(cfg, cpu_decode))
    return items


def check_awq_shapes(cfg: ModelConfig, group: int, awq_lm_head: bool) -> str | None:
    """Why this model cannot be AWQ-quantized with `group`, or None."""
    shapes = [(n, i, o) for n, i, o, _ in linear_shapes(cfg)]
    if awq_lm_head:
        shapes.append(("lm_head", cfg.hidden_size, cfg.vocab_size))
    for name, i, o in shapes:
        if i % group or o % 8:
            return (f"{name} ({i} -> {o}) needs in_features divisible by group_size {group} "
                    f"and out_features by 8")
    return None
