"""Dense parity with transformers (the oracle): our forward pass through the paged KV path
gives HF's logits and HF's greedy tokens, for llama, mistral, qwen2, qwen3."""

from __future__ import annotations

import pytest
import torch

from hisparse_cli.engine import Engine, SparseConfig
from hisparse_cli.errors import ModelError

ARCHS = ("llama", "mistral", "qwen2", "qwen3")


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(ids[None]).logits[0].float()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunk", [None, 7, 1])
def test_dense_logits_match_transformers(tiny_models, arch, chunk):
    path, hf = tiny_models[arch]
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (61,))
    ref = _hf_logits(hf, ids)
    assert ref.std() > 0.1  # a real, non-degenerate oracle
    eng = Engine.from_pretrained(path, sparse=SparseConfig.dense_config(block_size=8, prefill_chunk=chunk or 61))
    out = eng.logits(ids)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generate_matches_transformers(tiny_models, arch):
    path, hf = tiny_models[arch]
    torch.manual_seed(2)
    ids = torch.randint(3, 256, (40,))
    with torch.no_grad():
        ref = hf.generate(ids[None], max_new_tokens=24, do_sample=False, eos_token_id=None,
                          pad_token_id=0, attention_mask=torch.ones(1, 40, dtype=torch.long))
    ref_new = ref[0, 40:].tolist()
    eng = Engine.from_pretrained(path, sparse=SparseConfig.dense_config(block_size=16, prefill_chunk=16))
    res = eng.generate(ids, max_new_tokens=24, eos_token_ids=())
    assert res.token_ids == ref_new
    assert res.stats.blocks_allocated == res.stats.blocks_freed  # no leak
    assert res.stats.new_tokens == 24 and res.stats.prompt_tokens == 40


def test_sparse_with_everything_in_window_equals_dense(tiny_models):
    path, hf = tiny_models["llama"]
    ids = torch.randint(0, 256, (50,))
    ref = _hf_logits(hf, ids)
    eng = Engine.from_pretrained(path, sparse=SparseConfig(sink_tokens=2, window_size=64, global_tokens=4,
                                                           block_size=8, prefill_chunk=9))
    assert (eng.logits(ids) - ref).abs().max().item() <= 1e-4


def test_sparse_window_changes_logits_only_past_the_window(tiny_models):
    path, hf = tiny_models["qwen2"]
    ids = torch.randint(0, 256, (80,))
    ref = _hf_logits(hf, ids)
    eng = Engine.from_pretrained(path, sparse=SparseConfig(sink_tokens=0, window_size=20, global_tokens=0,
                                                           block_size=8, prefill_chunk=16))
    out = eng.logits(ids)
    assert (out[:20] - ref[:20]).abs().max().item() <= 1e-4  # positions whose window holds everything
    assert (out[40:] - ref[40:]).abs().max().item() > 1e-3  # later positions lost context


@pytest.mark.parametrize("rope_scaling", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
])
def test_rope_scaling_logits_match_transformers(tmp_path, rope_scaling):
    from conftest import save_tiny

    over = {"rope_scaling": dict(rope_scaling, rope_theta=10000.0)}
    path, hf = save_tiny(tmp_path, "llama", **over)
    ids = torch.randint(0, 256, (90,))
    ref = _hf_logits(hf, ids)
    eng = Engine.from_pretrained(path, sparse=SparseConfig.dense_config(block_size=16, prefill_chunk=32))
    assert (eng.logits(ids) - ref).abs().max().item() <= 1e-4


def test_unsupported_model_type_names_supported(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "vocab_size": 10}')
    with pytest.raises(ModelError, match="llama, mistral, qwen2, qwen3"):
        Engine.from_pretrained(tmp_path)


def test_missing_weights_and_pickle_only_are_refused(tiny_models, tmp_path):
    import shutil

    path, _ = tiny_models["llama"]
    shutil.copy(path / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelError, match="safetensors") as err:
        Engine.from_pretrained(tmp_path)
    assert "never pickle" in (err.value.hint or "")
    with pytest.raises(ModelError, match="not found"):
        Engine.from_pretrained(tmp_path / "nope")


def test_sharded_checkpoint_loads(tmp_path):
    from conftest import save_tiny

    path, hf = save_tiny(tmp_path, "llama")
    hf.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, 256, (20,))
    eng = Engine.from_pretrained(tmp_path / "sharded", sparse=SparseConfig.dense_config())
    assert (eng.logits(ids) - _hf_logits(hf, ids)).abs().max().item() <= 1e-4


def test_transformers4_style_rope_keys_are_read(tmp_path):
    """Older config.json files carry rope_theta/rope_scaling instead of rope_parameters."""
    import json

    from conftest import save_tiny

    path, hf = save_tiny(tmp_path, "llama", rope_scaling={"rope_type": "linear", "factor": 2.0,
                                                          "rope_theta": 5000.0})
    cfg = json.loads((path / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = {"type": "linear", "factor": params["factor"]}
    (path / "config.json").write_text(json.dumps(cfg))
    ids = torch.randint(0, 256, (40,))
    eng = Engine.from_pretrained(path, sparse=SparseConfig.dense_config())
    assert eng.cfg.rope_theta == 5000.0 and eng.cfg.rope_scaling["rope_type"] == "linear"
    assert (eng.logits(ids) - _hf_logits(hf, ids)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # tied (llama tiny) and qkv-bias configs
@pytest.mark.parametrize("native", [True, False])
def test_cpu_engine_holds_linears_in_the_decode_layout_with_the_checkpoint_values(
        tiny_models, arch, native, monkeypatch):
    """The engine stores fp32 CPU linear weights in the decode layout (wide ones input-major,
    the others as [out, in] rows) with q|k|v and gate|up stacked (one matmul each); decode
    runs through the native kernels' tiled copy of them (model/cpu_decode.py) or, without
    those, every linear wide enough to split is a RowSplitLinear; the values are the
    checkpoint's, and tools that write weights back get the checkpoint's separate [out, in]
    layout."""
    from hisparse_cli.kernels.cpu.native import native_library
    from hisparse_cli.model import cpu_decode
    from hisparse_cli.model.loader import decode_input_major, load_model
    from hisparse_cli.model.row_split import RowSplitLinear, row_splits

    if native and native_library() is None:
        pytest.skip("no C compiler: the native decode kernels are not built")
    if not native:
        monkeypatch.setattr(cpu_decode, "unsupported", lambda model: "switched off")
    path, hf = tiny_models[arch]
    eng = Engine.from_pretrained(path, sparse=SparseConfig.dense_config())
    assert (eng.model.native_decode is not None) == native
    assert eng.decode_path == ("native (float32 weights)" if native else "torch (switched off)")
    layouts, kinds = set(), set()
    for name, mod in eng.model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            out_f, in_f = mod.weight.shape
            split = not native and row_splits(out_f, torch.get_num_threads()) > 1
            assert (type(mod) is RowSplitLinear) == split, name
            kinds.add(split)
            wide = decode_input_major(out_f, in_f)
            assert mod.weight.stride() == ((1, out_f) if wide else (in_f, 1)), name
            layouts.add(wide)
    assert layouts == {True, False}  # the tiny configs exercise both layouts
    if torch.get_num_threads() > 1 and not native:
        assert kinds == {True, False}  # and split and plain products
    if native:  # the decode copy: the same values, tiled (float32: the tiny checkpoints')
        tiled = eng.model.native_decode.layers[0][1]
        layer = eng.model.model.layers[0]
        for w, lin in zip(tiled, (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                  layer.mlp.gate_up_proj, layer.mlp.down_proj)):
            assert torch.equal(w.dense(), lin.weight)
        assert torch.equal(eng.model.native_decode.head.dense(), hf.lm_head.weight)
    attn, ref_attn = eng.model.model.layers[0].self_attn, hf.model.layers[0].self_attn
    assert attn.q_proj is None and attn.k_proj is None and attn.v_proj is None
    ours = attn.qkv_proj.weight
    ref = torch.cat([ref_attn.q_proj.weight, ref_attn.k_proj.weight, ref_attn.v_proj.weight])
    assert ours.shape == ref.shape
    assert torch.equal(ours, ref)
    if arch == "qwen2":
        assert torch.equal(attn.qkv_proj.bias, torch.cat([ref_attn.q_proj.bias,
                                                          ref_attn.k_proj.bias,
                                                          ref_attn.v_proj.bias]))
    mlp, ref_mlp = eng.model.model.layers[0].mlp, hf.model.layers[0].mlp
    assert mlp.gate_proj is None and torch.equal(
        mlp.gate_up_proj.weight, torch.cat([ref_mlp.gate_proj.weight, ref_mlp.up_proj.weight]))
    assert torch.equal(eng.model.lm_head.weight, hf.lm_head.weight)
    assert eng.model.lm_head.weight.stride()[0] == 1
    if hf.config.tie_word_embeddings:  # the head's module was replaced, the tie kept
        assert eng.model.lm_head.weight is eng.model.model.embed_tokens.weight
    plain, _ = load_model(path)  # default: the checkpoint's [out, in] rows
    assert plain.model.layers[0].self_attn.q_proj.weight.is_contiguous()
    assert plain.model.embed_tokens.weight.is_contiguous()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # qkv bias; q/k norms on stacked views
@pytest.mark.parametrize("input_major", [False, True])
def test_fuse_projections_in_memory_keeps_logits(tiny_models, arch, input_major):
    """fuse_projections (what Engine does to a model built in memory) stacks q|k|v and
    gate|up, keeps the weight layout, and leaves the logits as they were."""
    from hisparse_cli.model.llama import forward_full, fuse_projections
    from hisparse_cli.model.loader import decode_input_major, load_model

    path, _ = tiny_models[arch]
    model, _ = load_model(path, decode_layout=input_major)
    ids = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(3))
    before = forward_full(model, ids)
    q = model.model.layers[0].self_attn.q_proj.weight
    assert (q.stride(0) == 1) == (input_major and decode_input_major(*q.shape))
    fuse_projections(model)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj is None and attn.qkv_proj is not None
    assert (attn.qkv_proj.weight.stride(0) == 1) == (q.stride(0) == 1)  # the pieces' layout
    assert torch.allclose(forward_full(model, ids), before, atol=1e-5, rtol=1e-5)
