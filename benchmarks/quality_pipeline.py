"""Rescore summary result files with ONE scorer and print the QUALITY.md pipeline table.

    python benchmarks/quality_pipeline.py default=/work/qual/after_default.jsonl \\
        anchor=/work/qual/anchor.jsonl dense=/work/qual/after_dense.jsonl \\
        before=/work/qual/before_default.jsonl --base default [--docs /work/qual/docs.txt]

Each NAME=FILE is a JSONL of results: `hisparse batch` records (`input`, `summary`,
`seconds`, `status`) or the anchor's lines (`doc`, `summary`, `seconds`, from
../shared/tools/hf_truncation_baseline.py). Documents are matched by resolved path; only
documents every system has (and, with --docs, that the list names) are scored — the table
says how many. References are `<stem>.ref.txt` beside each document.

The scorer is the anchor's: Google's rouge-score with the Porter stemmer and its default
tokenizer; rougeLsum on sentences split after . ! ? followed by whitespace (no nltk), one per
line, for both summary and reference. F1 × 100. Intervals: 95 % percentile bootstrap over
documents (10,000 resamples, seed 0); Δ columns are paired (documents resampled together).
Also per system: degenerate summaries (hisparse_cli.summarize.guard.find_problem, the pipeline's own
detector, with the genre's and the anchor's instructions as echo sources), summaries ending
mid-sentence (guard.ends_mid_sentence), mean words against the references' mean words, and
mean seconds per document (as the files recorded them: contended unless stated).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ANCHOR_INSTRUCTIONS = ("You are a helpful assistant that writes concise, faithful summaries.",
                       "Summarize the following document in one paragraph.")
KEYS = ("rouge1", "rouge2", "rougeL", "rougeLsum")
RESAMPLES = 10_000


def sentences(text: str) -> str:
    """The anchor's rougeLsum sentence split (hf_truncation_baseline.py)."""
    return "\n".join(s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s)


def load(path: str) -> dict[str, dict]:
    rows = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        if r.get("status", "ok") != "ok":
            continue
        doc = r.get("input") or r.get("doc")
        rows[str(Path(doc).resolve())] = r
    return rows


def bootstrap(values: list[float], seed: int = 0) -> tuple[float, float, float]:
    import random

    rng = random.Random(seed)
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, mean, mean
    means = sorted(sum(values[rng.randrange(n)] for _ in range(n)) / n
                   for _ in range(RESAMPLES))
    return mean, means[int(0.025 * RESAMPLES)], means[int(0.975 * RESAMPLES) - 1]


def fmt(ci: tuple[float, float, float], signed: bool = False) -> str:
    m, lo, hi = ci
    sign = "+" if signed else ""
    return f"{m:{sign}.2f} [{lo:{sign}.2f}, {hi:{sign}.2f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("systems", nargs="+", help="NAME=results.jsonl")
    ap.add_argument("--base", help="system the Δ columns compare against (default: the first)")
    ap.add_argument("--docs", help="a file listing the documents to score (one path a line)")
    ap.add_argument("--per-doc", action="store_true", help="also print per-document ROUGE-L")
    a = ap.parse_args()

    from rouge_score import rouge_scorer

    from hisparse_cli.documents.genre import guess_genre
    from hisparse_cli.summarize.guard import ends_mid_sentence, find_problem, words
    from hisparse_cli.summarize.prompts import instruction_texts

    systems = dict(s.split("=", 1) for s in a.systems)
    data = {name: load(path) for name, path in systems.items()}
    base = a.base or next(iter(systems))
    docs = set.intersection(*(set(rows) for rows in data.values()))
    if a.docs:
        wanted = {str(Path(p).resolve()) for p in Path(a.docs).read_text().split()}
        docs &= wanted
    docs = sorted(docs)
    scorer = rouge_scorer.RougeScorer(list(KEYS), use_stemmer=True)
    refs = {d: Path(re.sub(r"\.txt$", ".ref.txt", d)).read_text(encoding="utf-8") for d in docs}
    genres = {d: guess_genre(Path(d).read_text(encoding="utf-8"), "text") for d in docs}
    scores: dict[str, dict[str, list[float]]] = {}
    extra: dict[str, dict] = {}
    for name, rows in data.items():
        per = {k: [] for k in KEYS}
        degenerate, mid, n_words, secs, problems = 0, 0, [], [], []
        for d in docs:
            summary = rows[d]["summary"]
            s = scorer.score(sentences(refs[d]), sentences(summary))
            for k in KEYS:
                per[k].append(s[k].fmeasure * 100)
            problem = find_problem(summary, instructions=instruction_texts(genres[d])
                                   + ANCHOR_INSTRUCTIONS)
            if problem is not None:
                degenerate += 1
                problems.append(f"{Path(d).stem}: {problem}")
            mid += ends_mid_sentence(summary)
            n_words.append(len(words(summary)))
            secs.append(float(rows[d].get("seconds") or 0.0))
        scores[name] = per
        extra[name] = dict(degenerate=degenerate, mid=mid, words=sum(n_words) / len(docs),
                           seconds=sum(secs) / len(docs), problems=problems)
    ref_words = sum(len(words(refs[d])) for d in docs) / len(docs)
    print(f"{len(docs)} documents; scorer: rouge-score (Porter stemmer), rougeLsum on sentences "
          f"split after . ! ? + whitespace; 95% bootstrap over documents; reference words "
          f"{ref_words:.0f}\n")
    print("| system | ROUGE-1 | ROUGE-2 | ROUGE-L | ROUGE-Lsum | ΔROUGE-L vs "
          f"{base} | ΔROUGE-Lsum vs {base} | degenerate | mid-sentence | words | s/doc |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in systems:
        cells = [fmt(bootstrap(scores[name][k])) for k in KEYS]
        if name == base:
            deltas = ["—", "—"]
        else:
            deltas = [fmt(bootstrap([x - y for x, y in zip(scores[base][k], scores[name][k])]),
                          signed=True) for k in ("rougeL", "rougeLsum")]
        e = extra[name]
        print(f"| {name} | " + " | ".join(cells + deltas) + f" | {e['degenerate']} | {e['mid']} | "
              f"{e['words']:.0f} | {e['seconds']:.1f} |")
    print(f"\nΔ = {base} − system (positive: {base} is better).")
    for name in systems:
        if extra[name]["problems"]:
            print(f"\n{name} degenerate: " + "; ".join(extra[name]["problems"]))
    if a.per_doc:
        print("\n| document | " + " | ".join(systems) + " |")
        print("|---|" + "---:|" * len(systems))
        for i, d in enumerate(docs):
            print(f"| {Path(d).parent.name}/{Path(d).stem} | " + " | ".join(
                f"{scores[n]['rougeL'][i]:.1f}" for n in systems) + " |")


if __name__ == "__main__":
    main()
