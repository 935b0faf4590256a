"""Rendering of an `EvalResult`: a Markdown report, a JSON file and a PNG plot.

    paths = write_report(result, out_dir)   # report.md, report.json, fidelity_vs_kv.png
    text = summary_table(summary)           # the Markdown summary table alone (stdout)

The plot puts each setting at its KV memory (share of the dense run's KV bytes over the same
tokens) against attention recall, top-1 agreement and the perplexity ratio; matplotlib with
the Agg backend (no display needed).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from hisparse_cli.quality.aggregate import GOAL, goal_check, summarize_settings
from hisparse_cli.quality.settings import describe

MIB = 1024 * 1024


def _fmt(ci: dict | None, digits: int = 3, scale: float = 1.0, ci_on: bool = True) -> str:
    if not ci:
        return "–"
    m = ci["mean"] * scale
    if math.isnan(m):
        return "–"
    if not ci_on or ci.get("n", 1) < 2:
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} [{ci['lo'] * scale:.{digits}f}, {ci['hi'] * scale:.{digits}f}]"


def _goal_mark(entry: dict) -> str:
    checks = goal_check(entry)
    return " ".join(f"{k}{'✓' if v else '✗'}" for k, v in checks.items() if v is not None) or "–"


def summary_table(summary: dict[str, dict]) -> str:
    """One Markdown row per setting (means with 95% bootstrap intervals over documents)."""
    head = ("| setting | KV MiB | KV % dense | offloaded MiB | attn recall | KL(dense‖sparse) | top-1 agree | "
            "ppl ratio | retention ppl ratio | ROUGE-L | ΔROUGE-L vs dense | TF tok/s | goal |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, e in summary.items():
        kv = e.get("kv_bytes_peak")
        rouge = (e.get("rouge") or {}).get("rougeL")
        delta = (e.get("rouge_delta") or {}).get("rougeL")
        lines.append(
            f"| `{name}` | {_fmt(kv, 1, 1 / MIB, False)} | {_fmt(e.get('kv_fraction'), 1, 100, False)} "
            f"| {_fmt(e.get('offload_bytes'), 1, 1 / MIB, False)} | {_fmt(e.get('recall'))} | {_fmt(e.get('kl'))} | {_fmt(e.get('top1_agreement'))} "
            f"| {_fmt(e.get('ppl_ratio'))} | {_fmt(e.get('retention_ratio'))} "
            f"| {_fmt(rouge, 2, 100)} | {_fmt(delta, 2, 100)} "
            f"| {_fmt(e.get('tf_tok_s'), 0, 1, False)} | {_goal_mark(e)} |")
    return "\n".join(lines)


def _doc_table(result, name: str) -> str:
    rows = [r for r in result.rows if r["setting"] == name]
    head = ("| document | tokens | KV % | recall | min-layer recall | KL | top-1 | ppl ratio | "
            "retention ratio | ROUGE-L | prefill tok/s | decode tok/s |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]

    def f(v, d=3, s=1.0):
        return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v * s:.{d}f}"

    for r in rows:
        gen = r.get("gen", {})
        out.append(f"| {r['doc']} | {r.get('tokens', '–')} | {f(r.get('kv_fraction'), 1, 100)} "
                   f"| {f(r.get('recall'))} | {f(r.get('recall_min_layer'))} | {f(r.get('kl'))} "
                   f"| {f(r.get('top1_agreement'))} | {f(r.get('ppl_ratio'))} "
                   f"| {f(r.get('retention_ratio'))} "
                   f"| {f((r.get('rouge') or {}).get('rougeL'), 2, 100)} "
                   f"| {f(gen.get('prefill_tok_s'), 0)} | {f(gen.get('decode_tok_s'), 1)} |")
    return "\n".join(out)


def markdown_report(result, summary: dict[str, dict]) -> str:
    meta = result.meta
    lay = result.config.layout
    parts = [
        "# hisparse quality report", "",
        *(f"- {k}: {v}" for k, v in meta.items()),
        f"- teacher-forced tokens per document: up to {lay.max_tokens} (document + a "
        f"{lay.passage_tokens}-token passage from 10% into it, repeated at the end); scored "
        f"region: from {lay.score_from:.0%} of the document; {lay.recall_queries} recall queries"
        " (all layers and heads)",
        f"- generation: stream, greedy, max {result.config.max_new_tokens} new tokens, "
        f"repetition penalty {result.config.repetition_penalty}, no-repeat n-gram "
        f"{result.config.no_repeat_ngram_size}" if result.config.rouge else "- generation: off",
        f"- goal: KV ≤ {GOAL['kv_fraction_max']:.0%} of dense, ΔROUGE-L ≥ "
        f"{GOAL['rougeL_delta_min'] * 100:.1f} points, recall ≥ {GOAL['recall_min']}", "",
        "## Summary (mean [95% bootstrap CI over documents]; ROUGE in points)", "",
        summary_table(summary), "", "![fidelity vs KV memory](fidelity_vs_kv.png)", ""]
    for s in result.settings:
        parts += [f"## `{s.name}`", "", describe(s.sparse), "", _doc_table(result, s.name), ""]
    return "\n".join(parts)


def plot(summary: dict[str, dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("recall", "attention recall"), ("top1_agreement", "top-1 agreement"),
              ("ppl_ratio", "perplexity ratio sparse/dense"))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    markers = {"attention": "o", "snapkv": "s", "uniform": "^", "probe": "D"}
    for ax, (metric, label) in zip(axes, panels):
        for name, e in summary.items():
            kv, m = e.get("kv_fraction"), e.get(metric)
            if not kv or not m:
                continue
            imp = "dense" if e["config"]["window_size"] is None else e["config"]["importance"]
            ax.scatter(kv["mean"] * 100, m["mean"], marker=markers.get(imp, "*"), s=40,
                       label=imp)
            ax.annotate(name, (kv["mean"] * 100, m["mean"]), fontsize=6, alpha=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("KV memory, % of dense (log)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    axes[0].legend(uniq.values(), uniq.keys(), fontsize=7)
    fig.suptitle("Teacher-forced fidelity vs KV memory")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(result, out_dir: str | Path) -> dict[str, Path]:
    """Write report.md, report.json and fidelity_vs_kv.png into `out_dir` (created)."""
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize_settings(result)
    paths = {"markdown": out / "report.md", "json": out / "report.json",
             "plot": out / "fidelity_vs_kv.png"}
    paths["markdown"].write_text(markdown_report(result, summary), encoding="utf-8")
    doc = {"meta": result.meta, "config": result.config.to_dict(),
           "settings": [{"name": s.name, "sparse": summary[s.name]["config"]}
                        for s in result.settings],
           "summary": summary, "rows": result.rows}
    paths["json"].write_text(json.dumps(doc, indent=2, ensure_ascii=False, default=str),
                             encoding="utf-8")
    try:
        import matplotlib  # noqa: F401  (optional: pip install "hisparse[eval]")
    except ImportError:
        matplotlib = None
    if matplotlib is not None and any(e.get("kv_fraction") for e in summary.values()):
        plot(summary, paths["plot"])
    else:
        if matplotlib is None:
            import sys

            print("hisparse: warning: matplotlib is not installed, so no fidelity_vs_kv.png "
                  '(pip install "hisparse[eval]")', file=sys.stderr)
        paths.pop("plot")
    return paths


__all__ = ["write_report", "summary_table", "markdown_report", "plot"]
