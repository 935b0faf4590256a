"""The summary pipeline's quality table (QUALITY.md): `hisparse batch` with the default settings
and with `--attention dense` on a document list, scored with ONE scorer against those, the
HF-transformers truncation anchor and the code before this round.

    python benchmarks/quality_pipeline.py --docs /work/qual/docs.txt --work /work/qual38 \
        --anchor /work/qual/anchor.jsonl --before /work/qual/before_default.jsonl \
        --before-dense /work/qual/before_dense.jsonl [--idle] [--no-run] [--per-doc]

Runs (unless --no-run): `hisparse batch @DOCS --profile cpu --out WORK/default.jsonl` and the
same with `--attention dense` (WORK/dense.jsonl), both with --resume (an interrupted run goes
on where it stopped); `--idle` runs them under `chrt -i 0` (a shared machine: ROUGE does not
depend on timing, the seconds are then contended). The anchor is
../shared/tools/hf_truncation_baseline.py's JSONL (plain transformers, the document truncated
to the positions, one prompt, greedy) — produced by that tool, not reimplemented here;
`--before`/`--before-dense` are `hisparse batch` results of the previous code. `--extra
NAME=FILE` adds any other results file.

Each file is a JSONL of results: `hisparse batch` records (`input`, `summary`, `seconds`,
`status`) or the anchor's lines (`doc`, `summary`, `seconds`). Documents are matched by
resolved path; only documents every system has (and the list names) are scored — the table
says how many. References are `<stem>.ref.txt` beside each document.

The scorer is the anchor's: Google's rouge-score with the Porter stemmer and its default
tokenizer; rougeLsum on sentences split after . ! ? followed by whitespace (no nltk), one per
line, for both summary and reference. F1 × 100. Intervals: 95 % percentile bootstrap over
documents (10,000 resamples, seed 0); Δ columns are paired (documents resampled together).
Also per system: degenerate summaries (hisparse_cli.summarize.guard.find_problem, the
pipeline's own detector, with the genre's and the anchor's instructions as echo sources),
summaries ending mid-sentence (guard.ends_mid_sentence), mean words against the references'
mean words, and mean seconds per document as the files recorded them. The targets of issue 38
are checked at the end: default − anchor ROUGE-L ≥ +2.0 with the interval above 0, default −
dense ≥ −0.5, no degenerate default summary.
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


def run_batches(docs: str, work: Path, idle: bool) -> dict[str, Path]:
    import subprocess

    hisparse = Path(sys.executable).with_name("hisparse")
    outs = {"default": work / "default.jsonl", "dense": work / "dense.jsonl"}
    for name, extra in (("default", []), ("dense", ["--attention", "dense"])):
        cmd = [str(hisparse), "batch", f"@{docs}", "--profile", "cpu", "--out",
               str(outs[name]), "--resume", *extra]
        if idle:
            cmd = ["chrt", "-i", "0", *cmd]
        print("$", " ".join(cmd), flush=True)
        with open(work / f"{name}.log", "a", encoding="utf-8") as log:
            subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
    return outs


def score(systems: dict[str, str], base: str, docs_file: str | None, per_doc: bool) -> None:
    from rouge_score import rouge_scorer

    from hisparse_cli.documents.genre import guess_genre
    from hisparse_cli.summarize.guard import ends_mid_sentence, find_problem, words
    from hisparse_cli.summarize.prompts import instruction_texts

    data = {name: load(path) for name, path in systems.items()}
    docs = set.intersection(*(set(rows) for rows in data.values()))
    if docs_file:
        docs &= {str(Path(p).resolve()) for p in Path(docs_file).read_text().split()}
    docs = sorted(docs)
    if not docs:
        raise SystemExit("no document is in every results file")
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
    delta = {}
    for name in systems:
        cells = [fmt(bootstrap(scores[name][k])) for k in KEYS]
        if name == base:
            deltas = ["—", "—"]
        else:
            ds = [bootstrap([x - y for x, y in zip(scores[base][k], scores[name][k])])
                  for k in ("rougeL", "rougeLsum")]
            delta[name] = ds[0]
            deltas = [fmt(d, signed=True) for d in ds]
        e = extra[name]
        print(f"| {name} | " + " | ".join(cells + deltas) + f" | {e['degenerate']} | {e['mid']} | "
              f"{e['words']:.0f} | {e['seconds']:.1f} |")
    print(f"\nΔ = {base} − system (positive: {base} is better).")
    for name in systems:
        if extra[name]["problems"]:
            print(f"\n{name} degenerate: " + "; ".join(extra[name]["problems"]))
    if base == "default":
        checks = []
        if "anchor" in delta:
            m, lo, _ = delta["anchor"]
            checks.append(f"default − anchor ROUGE-L {m:+.2f} (low {lo:+.2f}): "
                          f"{'met' if m >= 2.0 and lo > 0 else 'NOT met'} (≥ +2.0, interval > 0)")
        if "dense" in delta:
            checks.append(f"default − dense ROUGE-L {delta['dense'][0]:+.2f}: "
                          f"{'met' if delta['dense'][0] >= -0.5 else 'NOT met'} (≥ −0.5)")
        n = extra["default"]["degenerate"]
        checks.append(f"degenerate default summaries: {n}: {'met' if n == 0 else 'NOT met'}")
        print("\nTargets: " + "; ".join(checks))
    if per_doc:
        print("\n| document | " + " | ".join(systems) + " |")
        print("|---|" + "---:|" * len(systems))
        for i, d in enumerate(docs):
            print(f"| {Path(d).parent.name}/{Path(d).stem} | " + " | ".join(
                f"{scores[n]['rougeL'][i]:.1f}" for n in systems) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", required=True, help="the documents, one path a line")
    ap.add_argument("--work", required=True, type=Path, help="folder for the batch results")
    ap.add_argument("--anchor", help="hf_truncation_baseline.py's JSONL")
    ap.add_argument("--before", help="hisparse batch results of the previous code (default)")
    ap.add_argument("--before-dense", help="the same with --dense")
    ap.add_argument("--extra", action="append", default=[], help="NAME=results.jsonl")
    ap.add_argument("--no-run", action="store_true", help="score the existing results only")
    ap.add_argument("--idle", action="store_true", help="run the batches under chrt -i 0")
    ap.add_argument("--per-doc", action="store_true", help="also print per-document ROUGE-L")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    print("$ " + " ".join(sys.argv), flush=True)
    outs = ({"default": a.work / "default.jsonl", "dense": a.work / "dense.jsonl"} if a.no_run
            else run_batches(a.docs, a.work, a.idle))
    systems = {name: str(path) for name, path in outs.items() if path.exists()}
    for name, path in (("anchor", a.anchor), ("before", a.before),
                       ("before_dense", a.before_dense)):
        if path:
            systems[name] = path
    systems.update(s.split("=", 1) for s in a.extra)
    score(systems, "default" if "default" in systems else next(iter(systems)), a.docs,
          a.per_doc)


if __name__ == "__main__":
    main()
