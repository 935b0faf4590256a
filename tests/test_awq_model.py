"""AWQ checkpoints in the model: which quantization_configs load, `AWQLinear`, a mixed
checkpoint (some linears INT4, some fp) against HF transformers with the independently decoded
weights (the oracle)."""

from __future__ import annotations

import json

import pytest
import torch

from hisparse_cli.errors import ModelError
from hisparse_cli.kernels.int4.awq_pack import quantize_weight
from hisparse_cli.model.awq import AWQConfig, AWQLinear, parse_quantization_config
from test_awq_ref import oracle_weight

PUBLISHED = {"bits": 4, "group_size": 128, "modules_to_not_convert": None,
             "quant_method": "awq", "version": "GEMM", "zero_point": True}


def test_published_config_parses():
    cfg = parse_quantization_config(PUBLISHED)
    assert cfg == AWQConfig(group_size=128)
    assert parse_quantization_config(None) is None
    t5 = {"quant_method": "awq", "bits": 4, "group_size": 64, "format": "gemm",
          "backend": "autoawq", "zero_point": True, "modules_to_not_convert": ["visual"]}
    cfg = parse_quantization_config(t5)
    assert cfg.group_size == 64 and cfg.keeps_fp("visual.blocks.0") and not cfg.keeps_fp("lm_head")
    assert parse_quantization_config(cfg.to_dict()) == cfg  # what we write, we read


@pytest.mark.parametrize("change", [
    {"version": "gemv"}, {"version": "gemv_fast"}, {"version": "exllama"},
    {"version": "marlin"}, {"backend": "llm-awq"}, {"bits": 8}, {"bits": 3},
    {"zero_point": False}, {"group_size": 256}, {"group_size": -1},
    {"quant_method": "gptq"}, {"quant_method": "bitsandbytes"},
])
def test_other_variants_are_refused_naming_what_is_supported(change):
    with pytest.raises(ModelError) as exc:
        parse_quantization_config({**PUBLISHED, **change})
    assert "gemm" in str(exc.value) and "group_size 32/64/128" in str(exc.value)


def test_awq_linear_forward_and_checkpoint_validation():
    torch.manual_seed(0)
    w, b = torch.randn(40, 64), torch.randn(40)
    p = quantize_weight(w, 32)
    lin = AWQLinear.from_checkpoint(p.qweight, p.qzeros, p.scales, b, 32, dtype=torch.float32)
    assert (lin.in_features, lin.out_features, lin.group_size) == (64, 40, 32)
    x = torch.randn(2, 5, 64)
    expect = x.double() @ oracle_weight(p.qweight, p.qzeros, p.scales, 32) + b.double()
    assert torch.allclose(lin(x).double(), expect, atol=1e-4)
    assert {n for n, _ in lin.named_buffers()} == {"qweight", "qzeros", "scales", "bias"}
    with pytest.raises(ModelError, match="int16"):
        AWQLinear.from_checkpoint(p.qweight.to(torch.int16), p.qzeros, p.scales, None, 32)
    with pytest.raises(ModelError, match="GEMM layout"):
        AWQLinear.from_checkpoint(p.qweight, p.qzeros, p.scales, None, 64)
    with pytest.raises(ModelError, match="GEMM layout"):  # transposed words [out, in/8]
        AWQLinear.from_checkpoint(torch.zeros(64, 8, dtype=torch.int32), p.qzeros, p.scales,
                                  None, 32, expect=(40, 64))


def test_kmajor_linear_prepares_once_and_again_when_buffers_change():
    """The K-major forward binds the backend's linear to the buffers once (checks and launch
    constants: host time bounds INT4 prefill), again once a buffer object is replaced, and
    drops it on .to() (so the old buffers are not kept alive)."""
    from hisparse_cli.kernels.int4.awq_layout import repack_kmajor

    torch.manual_seed(0)
    p = quantize_weight(torch.randn(40, 64), 32)
    lin = AWQLinear.from_checkpoint(p.qweight, p.qzeros, p.scales, None, 32, dtype=torch.float32)
    x = torch.randn(3, 64)
    expect = lin(x)
    lin.qweight, lin.layout = repack_kmajor(lin.qweight), "kmajor"
    assert lin._prepared is None
    assert torch.allclose(lin(x), expect, atol=1e-5)
    first = lin._prepared
    assert first is not None and torch.equal(lin(x), lin(x)) and lin._prepared is first
    lin.scales = lin.scales * 2  # a replaced buffer: prepared again, and used
    assert torch.allclose(lin(x), 2 * expect, atol=1e-4) and lin._prepared is not first
    lin.to(torch.float64)
    assert lin._prepared is None and lin._prepared_key is None


def make_tiny_llama(path, seed=0, **over):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    kw.update(over)
    model = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name
                    else torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return model


def _mixed_checkpoint(tmp_path):
    """A tiny Llama with some linears AWQ INT4 (group 32) and the rest fp, and the HF model
    holding the independently decoded weights (the oracle): (folder, hf)."""
    from safetensors.torch import load_file, save_file

    hf = make_tiny_llama(tmp_path / "fp")
    tensors = load_file(str(tmp_path / "fp" / "model.safetensors"))
    quantized = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                 "model.layers.0.self_attn.v_proj", "model.layers.0.mlp.gate_proj",
                 "model.layers.0.mlp.up_proj",
                 "model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj",
                 "model.layers.1.self_attn.v_proj", "model.layers.1.mlp.up_proj", "lm_head"]
    group = 32
    for prefix in quantized:
        p = quantize_weight(tensors.pop(f"{prefix}.weight"), group)
        tensors.update({f"{prefix}.qweight": p.qweight, f"{prefix}.qzeros": p.qzeros,
                        f"{prefix}.scales": p.scales})
        with torch.no_grad():  # the oracle: HF forward with the independently decoded weight
            hf.get_submodule(prefix).weight.copy_(
                oracle_weight(p.qweight, p.qzeros, p.scales, group).t().float())
    out = tmp_path / "mixed"
    out.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "fp" / "config.json").read_text())
    cfg["quantization_config"] = {**PUBLISHED, "group_size": group,
                                  "modules_to_not_convert": ["layers.1.self_attn.k_proj"]}
    (out / "config.json").write_text(json.dumps(cfg))
    return out, hf


def test_mixed_checkpoint_matches_hf_with_decoded_weights(tmp_path, monkeypatch):
    """The exact path (HISPARSE_BACKEND=torch: the fp32 reference for every call) against
    HF with the decoded weights."""
    from hisparse_cli.model.llama import forward_full, fuse_projections
    from hisparse_cli.model.loader import load_model

    monkeypatch.setenv("HISPARSE_BACKEND", "torch")
    out, hf = _mixed_checkpoint(tmp_path)
    model, _ = load_model(out, "cpu", torch.float32)
    assert model.lm_head.int4pack is None  # the reference backend keeps no packed copy
    assert isinstance(model.get_submodule("lm_head"), AWQLinear)
    assert isinstance(model.get_submodule("model.layers.1.self_attn.v_proj"), AWQLinear)
    assert not isinstance(model.get_submodule("model.layers.1.self_attn.k_proj"), AWQLinear)
    ids = torch.randint(0, 256, (23,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expect = hf(ids[None]).logits[0]
    got = forward_full(model, ids)
    assert torch.allclose(got, expect, atol=2e-4, rtol=1e-4), float((got - expect).abs().max())
    # stacked q|k|v and gate|up (what the engine loads): AWQ groups are stacked, the mixed
    # ones of layer 1 (fp16 k_proj / gate_proj beside INT4 pieces) stay separate; the same
    # logits whether the loader stacks them or fuse_projections does it in memory
    fused, _ = load_model(out, "cpu", torch.float32, fuse=True)
    l0, l1 = fused.model.layers
    assert isinstance(l0.self_attn.qkv_proj, AWQLinear) and l0.self_attn.q_proj is None
    assert isinstance(l0.mlp.gate_up_proj, AWQLinear)
    assert l1.self_attn.qkv_proj is None and l1.mlp.gate_up_proj is None
    assert isinstance(l1.self_attn.v_proj, AWQLinear)
    assert torch.allclose(forward_full(fused, ids), got, atol=1e-5, rtol=1e-5)
    in_memory = fuse_projections(model)
    assert isinstance(in_memory.model.layers[0].self_attn.qkv_proj, AWQLinear)
    assert torch.allclose(forward_full(in_memory, ids), got, atol=1e-5, rtol=1e-5)


def test_mixed_checkpoint_cpu_int4pack_path(tmp_path):
    """The CPU default: decode-sized calls (<= CPU_INT4_MAX_TOKENS rows) through torch's
    packed int4 kernel on bf16 activations, against HF with the decoded weights: within
    bf16's rounding (x and y rounded to 8 bits: ~2^-8 of the logits' scale a layer); longer
    calls are the reference's bits; the packed copy follows stacking, is not saved, and is
    dropped off the CPU."""
    from hisparse_cli.kernels.int4.awq_cpu import CPU_INT4_MAX_TOKENS, int4pack_available
    from hisparse_cli.model.llama import forward_full, fuse_projections
    from hisparse_cli.model.loader import load_model

    if not int4pack_available():
        pytest.skip("this torch has no working packed int4 CPU kernel")
    out, hf = _mixed_checkpoint(tmp_path)
    model, _ = load_model(out, "cpu", torch.float32)
    head = model.lm_head
    assert head.int4pack is not None and head.int4pack.dtype == torch.uint8
    assert head.int4pack_sz.dtype == torch.bfloat16
    assert not any("int4pack" in k for k in model.state_dict())
    ids = torch.randint(0, 256, (23,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expect = hf(ids[None]).logits[0]
    got = forward_full(model, ids)
    scale = float(expect.abs().max())
    err = float((got - expect).abs().max())
    assert err <= 3e-2 * scale, (err, scale)
    assert err > 1e-6 * scale  # the bf16 path ran (the reference agrees to ~1e-6)
    long_ids = torch.randint(0, 256, (CPU_INT4_MAX_TOKENS + 1,),
                             generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expect_long = hf(long_ids[None]).logits[0]
    assert torch.allclose(forward_full(model, long_ids), expect_long, atol=2e-4, rtol=1e-4)
    fused = fuse_projections(model)
    qkv = fused.model.layers[0].self_attn.qkv_proj
    assert qkv.int4pack is not None and qkv.int4pack.shape[0] == qkv.out_features
    assert torch.allclose(forward_full(fused, ids), got, atol=1e-5, rtol=1e-5)
    head.to(torch.float64)  # a float cast: the copy is made again in bf16
    assert head.int4pack_sz.dtype == torch.bfloat16
    head.to("meta")  # off the CPU (as to a GPU): no copy
    assert head.int4pack is None and head.int4pack_sz is None
