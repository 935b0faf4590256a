"""`hisparse quantize` on tiny random Llama models: the searches on planted cases, the exact
equivalence of folded scales, the output folder (layout, config, tokenizer), loading it back
(against HF transformers running the independently decoded weights), and the quality bound."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors import safe_open

from hisparse_cli.errors import ConfigError, ModelError
from hisparse_cli.kernels.int4.awq_pack import fake_quantize
from hisparse_cli.quantize.search import linear_outputs_loss, search_clip, search_scale
from test_awq_model import make_tiny_llama
from test_awq_ref import oracle_weight

WORDS = ("the of and to in is was for on that with as by at from it an be this which or are "
         "have not had contract party shall notice term patient dose").split()


def text(n_words: int, seed: int) -> str:
    r = random.Random(seed)
    return " ".join(r.choice(WORDS) for _ in range(n_words))


def save_byte_tokenizer(path) -> None:
    """A 256-token byte-level BPE with no merges (matches the tiny models' vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)


def make_model_folder(path, outliers: bool = True):
    """Tiny Llama; outliers: 4 hidden channels amplified 20x by every RMSNorm, like the
    massive activation channels of trained LLMs (what AWQ exists for)."""
    from safetensors.torch import load_file, save_file

    make_tiny_llama(path)
    if outliers:
        t = load_file(str(path / "model.safetensors"))
        for k in t:
            if "layernorm" in k:
                t[k][:4] = 20.0
        save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    save_byte_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def fp_folder(tmp_path_factory):
    return make_model_folder(tmp_path_factory.mktemp("awq") / "fp")


@pytest.fixture(scope="module")
def quantized(fp_folder):
    from hisparse_cli.quantize.api import quantize_model

    src = fp_folder
    root = src.parent
    calib = [text(2500, 1)]
    reports = {m: quantize_model(src, root / m, calib_texts=calib, group_size=32, n_samples=16,
                                 seq_len=128, method=m) for m in ("rtn", "awq")}
    reports["awq-head"] = quantize_model(src, root / "awq-head", calib_texts=calib,
                                         group_size=32, n_samples=8, seq_len=128,
                                         quantize_lm_head=True)
    return root, reports


def logits(folder, ids):
    from hisparse_cli.model.llama import forward_full
    from hisparse_cli.model.loader import load_model

    model, _ = load_model(folder, "cpu", torch.float32)
    return forward_full(model, ids)


def held_out_ids(root):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(root / "fp"))
    return torch.tensor(tok(text(300, 2))["input_ids"][:256])


def rel_err(a, ref) -> float:
    return float((a - ref).norm() / (ref - ref.mean()).norm())


# -- the searches on planted cases ---------------------------------------------------------
def test_scale_search_protects_outlier_channels():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 64, generator=g)
    x[:, :4] *= 30.0  # salient input channels
    w = torch.randn(48, 64, generator=g) / 8
    res = search_scale(x.abs().mean(0), [w], 32, linear_outputs_loss(x, [w]))
    assert res.alpha is not None and res.alpha > 0
    assert res.loss < 0.7 * res.rtn_loss
    assert bool((res.scales[:4] > res.scales[4:].max()).all())  # salient columns scaled up


def test_gram_loss_equals_direct_mse():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(300, 64, generator=g), torch.randn(40, 64, generator=g)
    q = fake_quantize(w, 32)
    direct = float((x @ w.t() - x @ q.t()).pow(2).mean())
    assert linear_outputs_loss(x, [w])([q]) == pytest.approx(direct, rel=1e-4)  # Gram path
    assert linear_outputs_loss(x[:20], [w])([q]) == pytest.approx(
        float((x[:20] @ (w - q).t()).pow(2).mean()), rel=1e-5)  # row path


def test_clip_search_clips_a_lone_outlier_and_never_hurts():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(512, 64, generator=g)
    w = torch.randn(16, 64, generator=g)
    w[:, 5] = 12.0  # one huge weight per row in group 0 ...
    x[:, 5] *= 0.01  # ... on an input channel that is almost silent
    lo, hi = search_clip(x, w, 32)
    assert float(hi[:, 0].mean()) < 0.8 * 12.0  # the outlier's group range shrinks

    def err(q):  # per (row, group) mean squared partial output, summed
        d = (w - q).view(16, 2, 32)
        return float(torch.einsum("tgk,rgk->trg", x.view(-1, 2, 32), d).pow(2).mean(0).sum())

    assert err(fake_quantize(w, 32, lo, hi)) < 0.8 * err(fake_quantize(w, 32))


def test_folded_scales_leave_the_fp_layer_unchanged(fp_folder):
    from hisparse_cli.model.llama import forward_full
    from hisparse_cli.model.loader import load_model
    from hisparse_cli.quantize.layerwise import (SearchSettings, capture_layer_inputs,
                                                 quantize_layer)

    model, _ = load_model(fp_folder, "cpu", torch.float32)
    seqs = [torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(i))
            for i in range(3)]
    calls = capture_layer_inputs(model.model.layers, lambda ids: forward_full(model, ids), seqs)
    layer = model.model.layers[0]
    before = [layer(*a, **k) for a, k in calls]
    out_calls, packed, results = quantize_layer(0, layer, calls, SearchSettings(group_size=32))
    assert any(r.alpha is not None for r in results), "planted outliers: scales must move"
    for (args, _), b, (a2, k2) in zip(out_calls, before, calls):
        assert torch.allclose(args[0], b, atol=1e-5)  # the next layer sees fp outputs
        err = (layer(*a2, **k2) - b).abs().max() / b.abs().max()
        assert err < 1e-5  # folding the scales is exact up to fp32 rounding
    assert set(packed) == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                           "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}


# -- the output folder -----------------------------------------------------------------------
def test_output_folder_layout(quantized):
    root, reports = quantized
    out = root / "awq"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": 32,
                                          "zero_point": True, "version": "gemm",
                                          "modules_to_not_convert": ["lm_head"]}
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    with safe_open(str(out / "model.safetensors"), "pt") as h:
        keys = set(h.keys())
        assert h.metadata() == {"format": "pt"}
        p = "model.layers.1.mlp.down_proj"
        assert h.get_tensor(f"{p}.qweight").dtype == torch.int32
        assert tuple(h.get_tensor(f"{p}.qweight").shape) == (128, 64 // 8)
        assert tuple(h.get_tensor(f"{p}.qzeros").shape) == (128 // 32, 64 // 8)
        assert h.get_tensor(f"{p}.scales").dtype == torch.float16
        assert h.get_tensor("model.norm.weight").dtype == torch.float16
        assert h.get_tensor("lm_head.weight").dtype == torch.float16
    assert not any(k.endswith("proj.weight") for k in keys)
    assert len(reports["awq"].quantized) == 14 and reports["awq"].kept_fp == ("lm_head",)


def test_loaded_awq_model_matches_hf_running_the_decoded_weights(quantized):
    """Oracle: HF LlamaForCausalLM with weights decoded from the files by the per-nibble
    decoder; our loader + INT4 reference linear must give the same logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root, _ = quantized
    out = root / "awq"
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("quantization_config")
    hf = LlamaForCausalLM(LlamaConfig(**cfg)).float().eval()
    state = {}
    with safe_open(str(out / "model.safetensors"), "pt") as h:
        for k in h.keys():
            if k.endswith(".qweight"):
                p = k[: -len(".qweight")]
                state[f"{p}.weight"] = oracle_weight(
                    h.get_tensor(k), h.get_tensor(f"{p}.qzeros"), h.get_tensor(f"{p}.scales"),
                    32).t().float()
            elif not k.endswith((".qzeros", ".scales")):
                state[k] = h.get_tensor(k).float()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing)
    ids = held_out_ids(root)
    with torch.no_grad():
        expect = hf(ids[None]).logits[0]
    got = logits(out, ids)
    assert torch.allclose(got, expect, atol=1e-3, rtol=1e-3), float((got - expect).abs().max())


def weight_rel_error(fp_folder, q_folder) -> float:
    """eps = ||W_q - W|| / ||W|| over all quantized linears (weights decoded by the oracle)."""
    from safetensors.torch import load_file

    fp = load_file(str(fp_folder / "model.safetensors"))
    num = den = 0.0
    with safe_open(str(q_folder / "model.safetensors"), "pt") as h:
        for k in (k for k in h.keys() if k.endswith(".qweight")):
            p = k[: -len(".qweight")]
            wq = oracle_weight(h.get_tensor(k), h.get_tensor(f"{p}.qzeros"),
                               h.get_tensor(f"{p}.scales"), 32).t()
            num += float((wq - fp[f"{p}.weight"].double()).pow(2).sum())
            den += float(fp[f"{p}.weight"].double().pow(2).sum())
    return (num / den) ** 0.5


def test_rtn_logits_stay_within_the_rounding_bound(tmp_path):
    """Bound (model without outlier channels): rounding to a 4-bit grid moves each weight by at
    most half a step; the measured relative weight error eps = ||W_q - W|| / ||W|| (about 0.08
    for Gaussian weights in groups of 32) perturbs each linear's output by ~eps. Logits see at
    most 8 quantized linears in series (2 layers x 2 blocks x 2 linears); independent rounding
    errors add in quadrature, so the relative logit error is ~ eps * sqrt(8) = 2.8 eps.
    We allow 4.5 eps, and require it to be non-trivial (> 0.5 eps: quantization happened)."""
    from hisparse_cli.quantize.api import quantize_model

    src = make_model_folder(tmp_path / "fp", outliers=False)
    quantize_model(src, tmp_path / "rtn", calib_texts=[text(300, 1)], group_size=32,
                   n_samples=2, seq_len=128, method="rtn")
    eps = weight_rel_error(src, tmp_path / "rtn")
    ids = held_out_ids(tmp_path)
    err = rel_err(logits(tmp_path / "rtn", ids), logits(src, ids))
    assert 0.04 < eps < 0.12
    assert 0.5 * eps < err <= 4.5 * eps, (eps, err)


def test_awq_beats_rtn_where_activations_have_outlier_channels(quantized):
    """RMSNorm outlier channels (x20) make the same weight error cost 20x more on those inputs;
    AWQ's scales protect them, so on held-out text its logits must be clearly closer to fp.
    Quantizing lm_head too adds one more INT4 linear: the error may grow, within 25%."""
    root, reports = quantized
    ids = held_out_ids(root)
    ref = logits(root / "fp", ids)
    errs = {m: rel_err(logits(root / m, ids), ref) for m in ("rtn", "awq", "awq-head")}
    assert errs["awq"] < 0.9 * errs["rtn"], errs
    assert errs["awq-head"] < 1.25 * errs["awq"], errs
    assert reports["awq"].loss_ratio < 0.8  # calibration objective: AWQ / RTN


def test_quantized_lm_head_unties_and_loads(quantized):
    from hisparse_cli.model.awq import AWQLinear
    from hisparse_cli.model.loader import load_model

    root, reports = quantized
    out = root / "awq-head"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False
    assert cfg["quantization_config"]["modules_to_not_convert"] is None
    model, _ = load_model(out, "cpu", torch.float32)
    assert isinstance(model.lm_head, AWQLinear) and "lm_head" in reports["awq-head"].quantized


# -- refusals ---------------------------------------------------------------------------------
def test_refusals(quantized, tmp_path):
    from hisparse_cli.quantize.api import quantize_model

    root, _ = quantized
    calib = [text(400, 3)]
    with pytest.raises(ConfigError, match="does not divide") as exc:
        quantize_model(root / "fp", tmp_path / "a", calib_texts=calib, group_size=128)
    assert "32 or 64" in exc.value.hint and "leave it out" in exc.value.hint
    with pytest.raises(ConfigError, match="not empty"):
        quantize_model(root / "fp", root / "awq", calib_texts=calib, group_size=32)
    with pytest.raises(ModelError, match="already quantized"):
        quantize_model(root / "awq", tmp_path / "b", calib_texts=calib, group_size=32)
    with pytest.raises(ConfigError):
        quantize_model(root / "fp", tmp_path / "c", calib_texts=calib, group_size=48)


def test_group_size_default_is_the_largest_that_divides():
    """No group size given: 128 where it divides every linear's input width (the published
    checkpoints' size), else 64, else 32; none: a clear refusal. Output widths not a multiple
    of 8 are refused whatever the group size (INT4 packs 8 columns a word)."""
    from types import SimpleNamespace

    from hisparse_cli.quantize.api import _check_group_size

    def cfg(hidden, inter, heads=8, head_dim=64, kv=2, vocab=256):
        return SimpleNamespace(hidden_size=hidden, intermediate_size=inter,
                               num_attention_heads=heads, head_dim=head_dim,
                               num_key_value_heads=kv, vocab_size=vocab)

    assert _check_group_size(cfg(4096, 14336, 32, 128, 8), None, False) == 128  # Llama-3-8B
    assert _check_group_size(cfg(576, 1536, 9, 64, 3), None, False) == 64  # SmolLM2-135M
    assert _check_group_size(cfg(96, 160, 3, 32), None, False) == 32
    assert _check_group_size(cfg(4096, 14336, 32, 128, 8), 32, False) == 32  # as asked
    with pytest.raises(ConfigError, match="no supported group size"):
        _check_group_size(cfg(80, 160, 5, 16), None, False)
    with pytest.raises(ConfigError, match="vocab_size 250 is not a multiple of 8") as exc:
        _check_group_size(cfg(4096, 14336, vocab=250), None, True)
    assert "--quantize-lm-head" in exc.value.hint
    assert _check_group_size(cfg(4096, 14336, vocab=250), None, False) == 128  # head kept fp16
