"""The evaluation harness: documents × settings → one row of measurements per pair.

    result = evaluate(engine, docs, settings, HarnessConfig(), progress=None)
    result.rows      [{doc, setting, recall, kl, top1_agreement, ppl_ratio, retention_ratio,
                       kv_bytes_peak, kv_fraction, tf_tok_s, rouge?, gen?}, ...]

Per document: one dense teacher-forced run captures q/k and the last hidden states (the
oracle); each sparse setting then runs teacher-forced over the same tokens (dataset.Layout)
and is compared position by position (metrics.py). With ROUGE on and a reference present,
every setting (dense included) also writes a summary through the product pipeline
(`summarize_document`, stream strategy, same greedy decoding) of the same truncated
document, scored against the reference. Same model, same decoding, only the KV policy varies.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from hisparse_cli.quality.capture import Trace, engine_with, logits_at, teacher_forced
from hisparse_cli.quality.dataset import (EvalDocument, Layout, LayoutConfig, build_layout,
                                          truncate_text)
from hisparse_cli.quality.metrics import (FidelitySums, attention_recall, kept_mask,
                                          token_fidelity)
from hisparse_cli.quality.settings import NamedSetting

Progress = Callable[[str, int, int], None]  # (what, done, total)
LOGIT_BLOCK = 128  # positions per LM-head block when scoring (bounds memory: 128 x V fp32)


@dataclass(frozen=True)
class HarnessConfig:
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    teacher_forced: bool = True
    rouge: bool = True
    max_new_tokens: int = 160
    repetition_penalty: float = 1.1
    no_repeat_ngram_size: int = 8

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class EvalResult:
    settings: list[NamedSetting]
    rows: list[dict]
    config: HarnessConfig
    meta: dict = field(default_factory=dict)


def _fidelity(engine, dense: Trace, sparse: Trace, layout: Layout, positions: list[int]) -> FidelitySums:
    total = FidelitySums()
    for s in range(0, len(positions), LOGIT_BLOCK):
        rows = positions[s:s + LOGIT_BLOCK]
        idx = torch.tensor(rows)
        targets = torch.tensor(layout.targets(rows), device=engine.device)
        total = total + token_fidelity(logits_at(engine, dense.hidden[idx]),
                                       logits_at(engine, sparse.hidden[idx]), targets)
    return total


def attention_recall_per_layer(engine, dense: Trace, sparse: Trace) -> list[float]:
    """Mean recall (over sampled queries and query heads) of each layer."""
    q_pos = torch.tensor(dense.q_positions)
    n_keys = int(q_pos.max()) + 1
    hkv = engine.cfg.num_key_value_heads
    scale = engine.cfg.head_dim ** -0.5
    out = []
    for layer in range(engine.cfg.num_hidden_layers):
        gpos = None
        if sparse.globals_at:
            gpos = torch.stack([sparse.globals_at[p][layer] for p in dense.q_positions])
        if sparse.retrieved_at:  # the page cache's positions beside the globals
            rpos = torch.stack([_pad(sparse.retrieved_at.get(p), layer, sparse.retrieved_at, hkv)
                                for p in dense.q_positions])
            gpos = rpos if gpos is None else torch.cat((gpos, rpos), dim=-1)
        starts = None
        if sparse.window_at:
            starts = torch.tensor([sparse.window_at.get(p, 0) for p in dense.q_positions])
        keep = kept_mask(q_pos, n_keys, sparse.sinks, sparse.window, gpos, hkv, starts)
        r = attention_recall(dense.q[layer], dense.k[layer][:n_keys], q_pos, keep, scale)
        out.append(float(r.mean()))
    return out


def _pad(rpos, layer: int, all_rpos: dict, hkv: int) -> torch.Tensor:
    """A step's retrieved positions of `layer`, or -1s of the same width for a step without."""
    if rpos is not None:
        return rpos[layer]
    width = next(iter(all_rpos.values())).shape[-1]
    return torch.full((hkv, width), -1, dtype=torch.int64)


def compare(engine, layout: Layout, dense: Trace, sparse: Trace) -> dict:
    """Fidelity, recall and retention of `sparse` against the `dense` oracle trace."""
    fid = _fidelity(engine, dense, sparse, layout, layout.score_positions)
    ret = _fidelity(engine, dense, sparse, layout, layout.retention_positions)
    per_layer = attention_recall_per_layer(engine, dense, sparse)
    return {
        "recall": sum(per_layer) / len(per_layer), "recall_min_layer": min(per_layer),
        "recall_per_layer": per_layer, **fid.to_dict(),
        "retention_ppl_dense": ret.ppl_dense, "retention_ppl_sparse": ret.ppl_sparse,
        "retention_ratio": ret.ppl_ratio,
        "kv_bytes_peak": sparse.kv_bytes_peak, "offload_bytes": sparse.offload_bytes,
        **({"retrieval": sparse.retrieval, "cache_hit_rate": sparse.retrieval["cache_hit_rate"]}
           if sparse.retrieval else {}),
        "kv_fraction": sparse.kv_bytes_peak / dense.kv_bytes_peak if dense.kv_bytes_peak else None,
        "tf_seconds": sparse.seconds, "tf_tok_s": sparse.tok_s,
        "recalibrations": sparse.recalibrations,
    }


def generate_summary(engine, doc: EvalDocument, setting: NamedSetting, cfg: HarnessConfig,
                     probe=None) -> dict:
    """Summary of the truncated document under `setting`, its ROUGE and its run stats."""
    from hisparse_cli.documents.base import Document
    from hisparse_cli.config.settings import GenerationConfig
    from hisparse_cli.summarize.pipeline import SummarySettings, summarize_document
    from hisparse_cli.scoring import rouge_scores

    eng = engine_with(engine, setting.sparse, probe)
    text = truncate_text(eng.tokenizer, doc.text, cfg.layout.max_tokens)
    document = Document(text=text, kind="text", source=doc.source, title=doc.title,
                        genre=doc.genre)
    gen = GenerationConfig(max_new_tokens=cfg.max_new_tokens,
                           repetition_penalty=cfg.repetition_penalty,
                           no_repeat_ngram_size=cfg.no_repeat_ngram_size)
    res = summarize_document(document, eng, SummarySettings(strategy="stream", generation=gen))
    stats = res.stats
    return {"summary": res.summary, "rouge": rouge_scores(res.summary, doc.reference),
            "gen": {k: stats[k] for k in ("prompt_tokens", "new_tokens", "prefill_tok_s",
                                          "decode_tok_s", "kv_bytes_peak", "prefill_seconds",
                                          "decode_seconds")}}


def _needs_probe(settings: list[NamedSetting]) -> bool:
    return any(s.sparse.uses_globals and s.sparse.importance == "probe" for s in settings)


def evaluate(engine, docs: list[EvalDocument], settings: list[NamedSetting],
             cfg: HarnessConfig | None = None, *, probe=None,
             progress: Progress | None = None) -> EvalResult:
    """Evaluate every setting on every document (module docstring). `settings[0]` must be
    the dense baseline (`settings.parse_settings` puts it there)."""
    cfg = cfg or HarnessConfig()
    if not settings or not settings[0].dense:
        raise ValueError("settings[0] must be the dense baseline")
    if probe is None and _needs_probe(settings):
        from hisparse_cli.quality.probe import find_probe, load_probe

        probe = load_probe(find_probe(engine.cfg))
    sparse_settings = settings[1:]
    per_doc = (1 + len(sparse_settings) if cfg.teacher_forced else 0) + (
        len(settings) if cfg.rouge else 0)
    total, done = per_doc * len(docs), 0
    rows: list[dict] = []

    def tick(what: str) -> None:
        nonlocal done
        done += 1
        if progress:
            progress(what, done, total)

    for doc in docs:
        doc_rows = {s.name: {"doc": doc.id, "setting": s.name} for s in settings}
        if cfg.teacher_forced:
            ids = engine.tokenizer(doc.text, verbose=False)["input_ids"]  # we chunk ourselves
            layout = build_layout(ids, cfg.layout)
            dense = teacher_forced(engine, layout.ids, settings[0].sparse,
                                   q_positions=layout.recall_positions, capture_qk=True)
            tick(f"{doc.id}: dense")
            for s in settings:
                trace = dense if s.dense else teacher_forced(
                    engine, layout.ids, s.sparse, q_positions=layout.recall_positions, probe=probe)
                doc_rows[s.name].update(tokens=len(layout.ids), doc_tokens=layout.n_doc,
                                        **compare(engine, layout, dense, trace))
                if not s.dense:
                    tick(f"{doc.id}: {s.name}")
            del dense
        if cfg.rouge and doc.reference:
            for s in settings:
                doc_rows[s.name].update(generate_summary(engine, doc, s, cfg, probe))
                tick(f"{doc.id}: summary {s.name}")
        elif cfg.rouge:
            done += len(settings)
        rows += doc_rows.values()
    return EvalResult(settings=settings, rows=rows, config=cfg)


__all__ = ["HarnessConfig", "EvalResult", "evaluate", "compare", "generate_summary",
           "attention_recall_per_layer"]
