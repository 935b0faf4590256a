"""Per-setting summaries of harness rows: means with 95% bootstrap intervals over documents,
and ROUGE differences to the dense baseline as paired bootstrap intervals.

    summary = summarize_settings(result)   # {setting name: {metric: {mean, lo, hi}, ...}}
    goal_check(summary[name])              # the issue's steering goal, per criterion

Documents are the resampling unit (a document's teacher-forced positions are not
independent draws). Paired differences keep each document's dense/sparse pair together.
"""

from __future__ import annotations

import math
from dataclasses import asdict

from hisparse_cli.scoring import ROUGE_TYPES, bootstrap_ci, paired_bootstrap_ci

TF_METRICS = ("recall", "recall_min_layer", "kl", "top1_agreement", "ppl_ratio",
              "retention_ratio", "kv_fraction", "kv_bytes_peak", "offload_bytes",
              "cache_hit_rate", "tf_tok_s")
GEN_METRICS = ("prefill_tok_s", "decode_tok_s", "kv_bytes_peak")
GOAL = {"kv_fraction_max": 0.10, "rougeL_delta_min": -0.005, "recall_min": 0.90}


def _ci(values: list[float], n_resamples: int) -> dict | None:
    vals = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not vals:
        return None
    mean, lo, hi = bootstrap_ci(vals, n_resamples=n_resamples)
    return {"mean": mean, "lo": lo, "hi": hi, "n": len(vals)}


def summarize_settings(result, n_resamples: int = 2000) -> dict[str, dict]:
    """{name: {"config": ..., metric: ci, "rouge": {type: ci}, "rouge_delta": {type: ci},
    "gen": {metric: ci}}} in the order of result.settings."""
    by_setting: dict[str, dict[str, dict]] = {s.name: {} for s in result.settings}
    for row in result.rows:
        by_setting[row["setting"]][row["doc"]] = row
    dense_name = result.settings[0].name
    dense_rows = by_setting[dense_name]
    out: dict[str, dict] = {}
    for s in result.settings:
        rows = by_setting[s.name]
        entry: dict = {"config": asdict(s.sparse), "documents": len(rows)}
        for m in TF_METRICS:
            entry[m] = _ci([r[m] for r in rows.values() if m in r], n_resamples)
        scored = [d for d, r in rows.items() if "rouge" in r]
        if scored:
            entry["rouge"] = {t: _ci([rows[d]["rouge"][t] for d in scored], n_resamples)
                              for t in ROUGE_TYPES}
            paired = [d for d in scored if "rouge" in dense_rows.get(d, {})]
            if paired:
                entry["rouge_delta"] = {}
                for t in ROUGE_TYPES:
                    mean, lo, hi = paired_bootstrap_ci(
                        [rows[d]["rouge"][t] for d in paired],
                        [dense_rows[d]["rouge"][t] for d in paired], n_resamples=n_resamples)
                    entry["rouge_delta"][t] = {"mean": mean, "lo": lo, "hi": hi, "n": len(paired)}
            entry["gen"] = {m: _ci([rows[d]["gen"][m] for d in scored], n_resamples)
                            for m in GEN_METRICS}
        out[s.name] = entry
    return out


def goal_check(entry: dict) -> dict[str, bool | None]:
    """Steering goal: KV <= 10% of dense, ROUGE-L within 0.5 points of dense (mean paired
    difference >= -0.005), attention recall >= 0.9. None = not measured."""
    def mean(x):
        return None if x is None else x["mean"]

    kv, rec = mean(entry.get("kv_fraction")), mean(entry.get("recall"))
    delta = mean((entry.get("rouge_delta") or {}).get("rougeL"))
    return {"kv": None if kv is None else kv <= GOAL["kv_fraction_max"],
            "rougeL": None if delta is None else delta >= GOAL["rougeL_delta_min"],
            "recall": None if rec is None else rec >= GOAL["recall_min"]}


__all__ = ["summarize_settings", "goal_check", "TF_METRICS", "GEN_METRICS", "GOAL"]
