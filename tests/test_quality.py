"""Quality harness: fidelity metrics against independent oracles on tiny random models.

Oracles: Hugging Face eager attention probabilities (attention recall), the engine's own
`Engine.logits` path + torch's kl_div (teacher-forced KL), brute-force Python sets for the
kept keys, and a planted long-range dependency built into the weights (a marker token every
layer-0 query attends to) that a tiny window must lose and a global slot must keep.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from hisparse_cli.engine import Engine, SparseConfig
from hisparse_cli.errors import ConfigError, ModelError
from hisparse_cli.quality.aggregate import goal_check, summarize_settings
from hisparse_cli.quality.capture import logits_at, teacher_forced
from hisparse_cli.quality.dataset import EvalDocument, LayoutConfig, build_layout
from hisparse_cli.quality.harness import HarnessConfig, compare, evaluate
from hisparse_cli.quality.metrics import kept_mask, recall_ceiling, token_fidelity
from hisparse_cli.quality.probe import (ImportanceProbe, find_probe, fingerprint, load_probe,
                                        save_probe)
from hisparse_cli.quality.probe_train import ProbeTrainConfig, train_probe
from hisparse_cli.quality.report import write_report
from hisparse_cli.quality.settings import parse_setting, parse_settings

from conftest import save_tiny
from helpers_tokenizer import SAMPLES, make_tiny_model_dir


def _ids(n: int, seed: int = 0, vocab: int = 256, avoid: int | None = None) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(8, vocab, (n,), generator=g)
    if avoid is not None:
        ids[ids == avoid] = avoid + 1
    return ids.tolist()


def _layout(ids, recall_queries=16):
    return build_layout(ids, LayoutConfig(max_tokens=len(ids), passage_tokens=0,
                                          recall_queries=recall_queries, score_from=0.5))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, hf = save_tiny(tmp_path_factory.mktemp("q"), "llama")
    return Engine.from_pretrained(path, sparse=SparseConfig.dense_config()), hf


@pytest.fixture(scope="module")
def tiny_text_model(tmp_path_factory):
    path = make_tiny_model_dir(tmp_path_factory.mktemp("qt"))
    return path, Engine.from_pretrained(path, sparse=SparseConfig.dense_config(prefill_chunk=64))


# --- settings -----------------------------------------------------------------------------

def test_setting_specs_short_and_key_value_forms():
    base = SparseConfig(window_size=1024, global_tokens=64, recalibrate_topk=64)
    s = parse_setting("w512-g32-uniform", base).sparse
    assert (s.window_size, s.global_tokens, s.recalibrate_topk, s.importance) == (512, 32, 32, "uniform")
    s = parse_setting("window=256,globals=16,importance=snapkv,topk=8,sinks=2", base).sparse
    assert (s.window_size, s.global_tokens, s.recalibrate_topk, s.sink_tokens, s.importance) == (
        256, 16, 8, 2, "snapkv")
    assert parse_setting("dense", base).sparse.dense
    assert parse_setting("profile", base).sparse == base
    names = [x.name for x in parse_settings(["w64", "w128-r32"], base)]
    assert names == ["dense", "w64", "w128-r32"]  # the baseline is added first


@pytest.mark.parametrize("spec", ["w", "x12", "w12-zz", "window=abc", "speed=3", "w0",
                                  "importance=h2o"])
def test_bad_setting_specs_are_config_errors(spec):
    with pytest.raises(ConfigError):
        parse_setting(spec, SparseConfig())


def test_duplicate_settings_refused():
    with pytest.raises(ConfigError, match="twice"):
        parse_settings(["w64", "w64"])


# --- metrics against brute force ----------------------------------------------------------

def test_kept_mask_matches_python_sets():
    q_pos = torch.tensor([5, 17, 30])
    gpos = torch.tensor([[[2, -1], [9, 3]], [[7, 8], [-1, -1]], [[0, 12], [25, 1]]])
    keep = kept_mask(q_pos, 31, sinks=2, window=4, gpos=gpos, num_kv_heads=2)
    for i, q in enumerate(q_pos.tolist()):
        for h in range(2):
            want = {k for k in range(q + 1) if k < 2 or k > q - 4}
            want |= {g for g in gpos[i, h].tolist() if g >= 0}
            assert set(torch.nonzero(keep[i, h]).flatten().tolist()) == want


@pytest.mark.parametrize("page,budget", [(1, 3), (1, 0), (2, 4), (2, 5), (3, 6)])
def test_recall_ceiling_is_the_best_selection_by_brute_force(page, budget):
    """Every selection of `budget` keys (per query head) or `budget // page` aligned pages
    (per KV head, shared by its query heads) enumerated: the ceiling is the best one's mass."""
    import itertools

    g = torch.Generator().manual_seed(page * 10 + budget)
    s, hkv, grp, n = 3, 2, 2, 9
    p = torch.softmax(torch.randn(s, hkv * grp, n, generator=g) * 2, dim=-1)
    base = torch.zeros(s, n, dtype=torch.bool)
    base[:, 0] = True  # a sink
    base[:, -2:] = True  # the window
    got = recall_ceiling(p, base, budget, hkv, page=page)
    want = torch.zeros(s, hkv * grp)
    for i in range(s):
        for h in range(hkv):
            heads = range(h * grp, (h + 1) * grp)
            if page == 1:
                options = [set(c) for c in itertools.combinations(range(n), min(budget, n))]
                for q in heads:  # each query head its own best keys
                    want[i, q] = max(float(p[i, q, sorted(base[i].nonzero().flatten().tolist()
                                                          + [k for k in c if not base[i, k]])].sum())
                                     for c in options)
                continue
            pages = [list(range(j, min(j + page, n))) for j in range(0, n, page)]
            best, best_sel = -1.0, None
            for c in itertools.combinations(range(len(pages)), min(budget // page, len(pages))):
                keys = {k for j in c for k in pages[j]} | set(base[i].nonzero().flatten().tolist())
                total = float(p[i, list(heads)][:, sorted(keys)].sum())  # the group's mass
                if total > best:
                    best, best_sel = total, sorted(keys)
            for q in heads:
                want[i, q] = float(p[i, q, best_sel].sum())
    assert torch.allclose(got, want, atol=1e-6), (got, want)


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("budget", [0, -5])
def test_recall_ceiling_without_budget_is_the_base_mass(page, budget):
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(2, 4, 10, generator=g), dim=-1)
    base = torch.zeros(2, 10, dtype=torch.bool)
    base[:, :3] = True
    want = p[:, :, :3].sum(-1)
    assert torch.allclose(recall_ceiling(p, base, budget, 2, page=page), want)


def test_token_fidelity_matches_torch_kl_div():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(7, 50, generator=g), torch.randn(7, 50, generator=g)
    t = torch.randint(0, 50, (7,), generator=g)
    f = token_fidelity(a, b, t)
    kl = torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True,
                                    reduction="sum")
    assert f.kl == pytest.approx(float(kl), rel=1e-5)
    assert f.agree == int((a.argmax(-1) == b.argmax(-1)).sum())
    ce_a = torch.nn.functional.cross_entropy(a, t, reduction="sum")
    ce_b = torch.nn.functional.cross_entropy(b, t, reduction="sum")
    assert f.ppl_ratio == pytest.approx(math.exp((float(ce_b) - float(ce_a)) / 7), rel=1e-5)
    same = token_fidelity(a, a, t)
    assert same.mean_kl == 0.0 and same.top1_agreement == 1.0 and same.ppl_ratio == 1.0


# --- the harness against independent oracles -----------------------------------------------

def test_recall_equals_hf_attention_mass_on_the_kept_set(tiny):
    eng, hf = tiny
    ids = _ids(160, seed=3)
    layout = _layout(ids)
    cfg = SparseConfig(window_size=24, global_tokens=6, recalibrate_every=16, recalibrate_topk=6,
                       prefill_chunk=16, sink_tokens=2, score_stride=1)
    dense = teacher_forced(eng, ids, SparseConfig.dense_config(prefill_chunk=40),
                           q_positions=layout.recall_positions, capture_qk=True)
    sparse = teacher_forced(eng, ids, cfg, q_positions=layout.recall_positions)
    row = compare(eng, layout, dense, sparse)
    with torch.no_grad():
        att = hf(torch.tensor([ids]), output_attentions=True).attentions  # L x [1, Hq, T, T]
    hq, hkv = eng.cfg.num_attention_heads, eng.cfg.num_key_value_heads
    for layer, a in enumerate(att):
        vals = []
        for q in layout.recall_positions:
            for h in range(hq):
                g = sparse.globals_at[q][layer][h // (hq // hkv)].tolist()
                kept = {k for k in range(q + 1) if k < 2 or k > q - 24} | {x for x in g if x >= 0}
                vals.append(float(a[0, h, q, sorted(kept)].sum()))
        assert row["recall_per_layer"][layer] == pytest.approx(sum(vals) / len(vals), abs=2e-4)
    assert 0.0 < row["recall"] < 0.999  # the window really drops mass here
    assert sparse.recalibrations > 0 and any((g >= 0).any() for g in sparse.globals_at.values())


def test_teacher_forced_kl_matches_engine_logits(tiny):
    eng, _ = tiny
    ids = _ids(120, seed=4)
    layout = _layout(ids)
    cfg = SparseConfig(window_size=16, global_tokens=4, recalibrate_every=16, recalibrate_topk=4,
                       prefill_chunk=16, sink_tokens=2)
    dense_cfg = SparseConfig.dense_config(prefill_chunk=32)
    row = compare(eng, layout, teacher_forced(eng, ids, dense_cfg, q_positions=layout.recall_positions,
                                              capture_qk=True),
                  teacher_forced(eng, ids, cfg, q_positions=layout.recall_positions))
    eng_d, eng_s = Engine(eng.model, eng.cfg, sparse=dense_cfg, device=eng.device,
                          kv_dtype=eng.kv_dtype), Engine(eng.model, eng.cfg, sparse=cfg,
                                                         device=eng.device, kv_dtype=eng.kv_dtype)
    pos = layout.score_positions
    ld, ls = eng_d.logits(ids)[pos].log_softmax(-1), eng_s.logits(ids)[pos].log_softmax(-1)
    kl = torch.nn.functional.kl_div(ls, ld, log_target=True, reduction="batchmean")
    assert row["kl"] == pytest.approx(float(kl), rel=1e-4, abs=1e-6)
    assert row["kl"] > 1e-3  # the window changes the predictions
    agree = float((ld.argmax(-1) == ls.argmax(-1)).float().mean())
    assert row["top1_agreement"] == pytest.approx(agree)
    nll = torch.nn.functional.nll_loss
    t = torch.tensor(layout.targets(pos))
    assert row["ppl_dense"] == pytest.approx(math.exp(float(nll(ld, t))), rel=1e-4)
    assert row["ppl_sparse"] == pytest.approx(math.exp(float(nll(ls, t))), rel=1e-4)


def test_logits_at_equals_the_model_head(tiny):
    eng, _ = tiny
    ids = _ids(40, seed=5)
    tr = teacher_forced(eng, ids, SparseConfig.dense_config(prefill_chunk=16))
    torch.testing.assert_close(logits_at(eng, tr.hidden), eng.logits(ids), rtol=1e-5, atol=1e-5)


def test_dense_vs_dense_and_keep_everything_are_identical(tiny_text_model):
    _, eng = tiny_text_model
    text = (SAMPLES / "contract" / "services_agreement.txt").read_text(encoding="utf-8")
    ref = (SAMPLES / "contract" / "services_agreement.ref.txt").read_text(encoding="utf-8")
    docs = [EvalDocument("contract", text[:3000], ref, genre="legal")]
    base = SparseConfig(prefill_chunk=64)
    settings = parse_settings(["dense", "w100000-g4-r64", "w48-g4-r32-c16"], base)
    cfg = HarnessConfig(layout=LayoutConfig(max_tokens=400, passage_tokens=48, recall_queries=16),
                        max_new_tokens=12)
    res = evaluate(eng, docs, settings, cfg)
    rows = {r["setting"]: r for r in res.rows}
    for name in ("dense", "w100000-g4-r64"):  # dense vs itself; a window longer than the text
        r = rows[name]
        assert r["recall"] == pytest.approx(1.0, abs=1e-5)
        assert r["kl"] == pytest.approx(0.0, abs=1e-6)
        assert r["top1_agreement"] == 1.0
        assert r["ppl_ratio"] == pytest.approx(1.0, abs=1e-5)
        assert r["retention_ratio"] == pytest.approx(1.0, abs=1e-5)
        assert r["summary"] == rows["dense"]["summary"]
        assert r["rouge"] == rows["dense"]["rouge"]
    small = rows["w48-g4-r32-c16"]
    assert small["recall"] < 0.99 and small["kl"] > 1e-4 and small["kv_fraction"] < 0.5
    summary = summarize_settings(res)
    assert summary["w100000-g4-r64"]["rouge_delta"]["rougeL"]["mean"] == 0.0
    assert summary["dense"]["kv_fraction"]["mean"] == 1.0
    assert goal_check(summary["dense"])["kv"] is False


# --- a planted long-range dependency -------------------------------------------------------

MARKER, MARK_POS, SLOW = 5, 12, 7  # token id, its position, the slowest RoPE pair of head_dim 16


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """Tiny Llama whose layer-0 queries all attend to the MARKER token: q has a constant
    component (bias) on the slowest rotary pair and only the marker's key has one there."""
    path, hf = save_tiny(tmp_path_factory.mktemp("plant"), "llama", attention_bias=True)
    with torch.no_grad():
        emb = hf.model.embed_tokens.weight
        e = torch.nn.functional.normalize(torch.randn(emb.shape[1]), dim=0)
        emb -= (emb @ e)[:, None] * e[None, :]  # every other token orthogonal to e
        emb[MARKER] = e
        hf.model.layers[0].input_layernorm.weight.fill_(1.0)
        attn, d = hf.model.layers[0].self_attn, 16
        for h in range(attn.q_proj.out_features // d):
            for dim in (SLOW, SLOW + d // 2):
                attn.q_proj.weight[h * d + dim] = 0.0
                attn.q_proj.bias[h * d + dim] = 0.0
            attn.q_proj.bias[h * d + SLOW] = 3.0
        for h in range(attn.k_proj.out_features // d):
            for dim in (SLOW, SLOW + d // 2):
                attn.k_proj.weight[h * d + dim] = 0.0
                attn.k_proj.bias[h * d + dim] = 0.0
            attn.k_proj.weight[h * d + SLOW] = 3.0 * e
    hf.save_pretrained(path, safe_serialization=True)
    return Engine.from_pretrained(path, sparse=SparseConfig.dense_config())


class PositionProbe:
    """Scores the tokens at `positions` highest (counts positions per layer as steps arrive)."""

    def __init__(self, positions: set[int]) -> None:
        self.positions, self.seen = positions, {}

    def __call__(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        start = self.seen.get(layer, 0)
        self.seen[layer] = start + x.shape[0]
        hit = [float(p in self.positions) for p in range(start, start + x.shape[0])]
        return torch.tensor(hit)[:, None].expand(-1, 2).contiguous()


def test_planted_dependency_lost_by_window_kept_as_global(planted):
    ids = _ids(200, seed=6, avoid=MARKER)
    ids[MARK_POS] = MARKER
    layout = _layout(ids)
    dense = teacher_forced(planted, ids, SparseConfig.dense_config(prefill_chunk=50),
                           q_positions=layout.recall_positions, capture_qk=True)
    common = dict(window_size=16, sink_tokens=2, prefill_chunk=16, recalibrate_every=16)

    def run(probe=None, **kw):
        cfg = SparseConfig(**{**common, **kw})
        return compare(planted, layout, dense, teacher_forced(
            planted, ids, cfg, q_positions=layout.recall_positions, probe=probe))

    lost = run(global_tokens=0, recalibrate_topk=0)
    kept = run(PositionProbe({MARK_POS}), global_tokens=1, recalibrate_topk=1, importance="probe")
    h2o = run(global_tokens=1, recalibrate_topk=1, importance="attention", score_stride=1)
    uniform = run(global_tokens=1, recalibrate_topk=1, importance="uniform")
    # the dense layer-0 attention sits on the marker, far outside the 16-token window
    assert lost["recall_per_layer"][0] < 0.1
    assert kept["recall_per_layer"][0] > 0.9 and h2o["recall_per_layer"][0] > 0.9
    assert uniform["recall_per_layer"][0] < 0.1  # evenly spaced picks miss position 12
    assert kept["kl"] < 0.5 * lost["kl"]


# --- probe ---------------------------------------------------------------------------------

def test_probe_training_fits_its_target_with_few_parameters(tiny_text_model, tmp_path):
    path, eng = tiny_text_model
    text = (SAMPLES / "contract" / "services_agreement.txt").read_text(encoding="utf-8")
    cfg = ProbeTrainConfig(window=32, max_tokens=256, rows_per_piece=256, epochs=25, batch=256)
    module, meta = train_probe(eng, [("contract", text[:2500])], cfg)
    assert module.num_parameters() < 10_000
    assert meta["fit"]["train"]["pearson"] > 0.4 and meta["fit"]["train"]["spearman"] > 0.4
    weights, sidecar = save_probe(module, tmp_path / "p.safetensors", meta)
    scorer = load_probe(weights)
    x = torch.randn(9, eng.cfg.hidden_size)
    torch.testing.assert_close(scorer(1, x), module(1, x))
    assert json.loads(sidecar.read_text())["parameters"] == module.num_parameters()
    assert find_probe(eng.cfg, folder=tmp_path) == weights
    with pytest.raises(ConfigError):
        find_probe(eng.cfg, folder=tmp_path / "empty")
    with pytest.raises(ConfigError):
        load_probe(tmp_path / "p.json")


def test_probe_files_are_safetensors_and_bad_ones_are_clear_errors(tmp_path):
    """save_probe writes the path it is given or refuses it (it once wrote p.bin as
    p.safetensors); a missing sidecar or an unknown format is a ConfigError (exit 2), a
    corrupt probe file or one that does not match its sidecar a ModelError (exit 4, like
    corrupt weights), never a SafetensorError / RuntimeError escaping as an internal error."""
    module = ImportanceProbe(64, 2, 2)
    with pytest.raises(ConfigError, match=r"p\.bin must be a \.safetensors file") as err:
        save_probe(module, tmp_path / "p.bin", {})
    assert "p.safetensors" in err.value.hint and not list(tmp_path.iterdir())
    weights, sidecar = save_probe(module, tmp_path / "p.safetensors", {})
    fake = tmp_path / "fake.safetensors"
    fake.write_bytes(b"\xff" * 64)  # header length far beyond the file
    (tmp_path / "fake.json").write_bytes(sidecar.read_bytes())
    with pytest.raises(ModelError, match="cannot read weights .*fake.safetensors") as err:
        load_probe(fake)
    assert "probe train" in err.value.hint
    with pytest.raises(ConfigError, match="cannot read probe"):
        load_probe(tmp_path / "nosidecar.safetensors")
    other = json.loads(sidecar.read_text())
    other["hidden_size"] = 4096  # another model's shape: the weights do not fit
    sidecar.write_text(json.dumps(other))
    with pytest.raises(ModelError, match="does not match its sidecar"):
        load_probe(weights)
    sidecar.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="unknown format"):
        load_probe(weights)


def test_probe_train_cli_inputs_and_out(tiny_text_model, tmp_path):
    """--texts: missing or binary files are input errors (exit 3), binary files in a folder are
    skipped; --out: a non-.safetensors path is exit 2 before anything loads, an existing
    folder receives <model>.probe.safetensors and its sidecar."""
    from hisparse_cli.cli.app import app

    path, _ = tiny_text_model
    runner = CliRunner()

    def train(*args):
        return runner.invoke(app, ["probe", "train", "--model", str(path), "--window", "32",
                                   "--max-tokens", "256", "--epochs", "1", "-q",
                                   *map(str, args)])

    def error(res, code, needle):
        assert res.exit_code == code, res.output
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 2 and lines[0].startswith("Error: ") and needle in lines[0], lines
        assert lines[1].startswith("Hint: ") and res.stdout == "", res.output

    text = tmp_path / "a.txt"
    text.write_text((SAMPLES / "medical" / "discharge_report.txt").read_text()[:2500])
    binary = tmp_path / "bin.txt"
    binary.write_bytes(bytes(range(256)) * 64)
    error(train("--texts", tmp_path / "nope.txt"), 3, "nope.txt: no such file")
    error(train("--texts", binary), 3, "looks like a binary file")
    only_binary = tmp_path / "bindir"
    only_binary.mkdir()
    (only_binary / "x.txt").write_bytes(binary.read_bytes())
    error(train("--texts", only_binary), 3, "no training text found in")
    error(train("--texts", text, "--out", tmp_path / "p.bin"), 2, "a probe is written as a "
          ".safetensors file")
    error(train("--texts", text, "--out", tmp_path / "newdir"), 2, ".safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "bin.txt", "bindir"]
    folder = tmp_path / "probes"
    folder.mkdir()
    res = train("--texts", text, "--texts", only_binary, "--out", folder)
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in folder.iterdir()) == [f"{path.name}.probe.json",
                                                        f"{path.name}.probe.safetensors"]
    assert load_probe(folder / f"{path.name}.probe.safetensors").meta["parameters"] < 10_000


def test_probe_parameter_budget_holds_for_large_models():
    for hidden, layers, heads in ((64, 2, 2), (576, 30, 3), (4096, 32, 8), (8192, 80, 8),
                                  (5120, 64, 8), (3000, 100, 16)):
        probe = ImportanceProbe(hidden, layers, heads)
        assert probe.num_parameters() < 10_000
        assert probe(layers - 1, torch.randn(5, hidden)).shape == (5, heads)


def test_shipped_probe_matches_its_model_shape():
    from hisparse_cli.quality.probe import PROBES_DIR

    sidecars = sorted(PROBES_DIR.glob("*.json"))
    assert sidecars, "a trained probe ships in hisparse_cli/probes/"
    for sidecar in sidecars:
        meta = json.loads(sidecar.read_text())
        scorer = load_probe(sidecar.with_suffix(".safetensors"))
        assert scorer.module.num_parameters() == meta["parameters"] < 10_000
        assert find_probe(meta["model"]) == sidecar.with_suffix(".safetensors")
        assert meta["fit"]["heldout"]["spearman"] > 0.3


# --- report and CLI -----------------------------------------------------------------------

def test_report_files_and_cli(tiny_text_model, tmp_path):
    from hisparse_cli.cli.app import app

    path, _ = tiny_text_model
    docs = tmp_path / "docs"
    docs.mkdir()
    text = (SAMPLES / "medical" / "discharge_report.txt").read_text(encoding="utf-8")
    (docs / "a.txt").write_text(text[:2500], encoding="utf-8")
    (docs / "a.ref.txt").write_text("the patient was discharged home", encoding="utf-8")
    out = tmp_path / "rep"
    runner = CliRunner()
    res = runner.invoke(app, ["eval", str(docs), "--model", str(path), "--profile", "cpu",
                              "-s", "w32-g4-c16-r16", "-s", "dense", "--max-tokens", "300",
                              "-n", "8", "--out", str(out), "--recall-queries", "8"])
    assert res.exit_code == 0, res.output
    assert "`w32-g4-c16-r16`" in res.stdout and "`dense`" in res.stdout
    report = json.loads((out / "report.json").read_text())
    assert [s["name"] for s in report["settings"]] == ["dense", "w32-g4-c16-r16"]
    assert {r["doc"] for r in report["rows"]} == {"a"}
    assert (out / "report.md").read_text().count("## `") == 2
    assert (out / "fidelity_vs_kv.png").read_bytes()[:4] == b"\x89PNG"
    bad = runner.invoke(app, ["eval", str(docs), "--model", str(path), "-s", "w12-zz"])
    assert bad.exit_code == 2, bad.output
    res = runner.invoke(app, ["probe", "train", "--model", str(path), "--texts",
                              str(docs / "a.txt"), "--window", "32", "--max-tokens", "256",
                              "--epochs", "3", "--out", str(tmp_path / "pr.safetensors"), "-q"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["parameters"] < 10_000
    assert load_probe(tmp_path / "pr.safetensors").meta["model"] == fingerprint(
        Engine.from_pretrained(path).cfg)


def test_write_report_without_teacher_forcing(tiny_text_model, tmp_path):
    _, eng = tiny_text_model
    docs = [EvalDocument("x", "short text about a contract between two parties. " * 20,
                         "a contract", genre="legal")]
    res = evaluate(eng, docs, parse_settings(["w32-g4-c16"]),
                   HarnessConfig(teacher_forced=False, max_new_tokens=4))
    paths = write_report(res, tmp_path)
    assert "plot" not in paths and paths["markdown"].is_file()
    assert "rouge" in res.rows[0] and "kl" not in res.rows[0]


def test_eval_references_decode_like_documents(tmp_path):
    """<id>.ref.txt is read like a text document: cp1252 and a UTF-8 BOM decode (cp1252 was
    an internal UnicodeDecodeError), an empty one is no reference."""
    from hisparse_cli.quality.dataset import load_eval_documents

    for name, ref in (("a", "Le café coûte 3 €.".encode("cp1252")),
                      ("b", b"\xef\xbb\xbfThe fee is due."), ("c", b"  \n")):
        (tmp_path / f"{name}.txt").write_text(f"Document {name}. The client pays the fee.\n")
        (tmp_path / f"{name}.ref.txt").write_bytes(ref)
    docs = {d.id: d for d in load_eval_documents([tmp_path])}
    assert docs["a"].reference == "Le café coûte 3 €."
    assert docs["b"].reference == "The fee is due."
    assert docs["c"].reference is None
