"""Retrieval tier vs eviction-only at the same resident KV, on CPU (QUALITY.md, issue 41).

    HISPARSE_HOME=/work/hh chrt -i 0 python benchmarks/retrieval_quality.py \
        --docs @/work/qual/docs.txt --max-tokens 7168 --out /tmp/retrieval_q [--no-rouge] [--limit N]

Runs `hisparse eval` one document at a time (a document's finished report is kept when a later
one is interrupted; a document already done is skipped on a rerun), then pools every
document's rows into one summary: means with 95% bootstrap intervals over documents, ΔROUGE-L
as paired intervals against dense (hisparse_cli/quality/aggregate.py), and prints the table
QUALITY.md quotes. Settings (SmolLM2-135M, fp32 KV, 7168 tokens; resident KV counted as
blocks at their peak + global/candidate/page-cache slots + page summaries):
  retrieval:      window=192,globals=16,chunk=64,retrieval_tokens=256
  eviction-only:  window=512,globals=32,chunk=64   (about the same resident KV)
ROUGE and recall do not depend on timing, so SCHED_IDLE (contended) runs are fine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

RETRIEVAL = "window=192,globals=16,chunk=64,retrieval_tokens=256"
EVICTION = "window=512,globals=32,chunk=64"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", required=True, help="@FILE (one path a line) or a folder")
    ap.add_argument("--max-tokens", type=int, default=7168)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--no-rouge", action="store_true")
    ap.add_argument("--limit", type=int, default=0, help="first N documents only")
    ap.add_argument("--min-tokens", type=int, default=4096,
                    help="pool only documents at least this long (tokens after truncation): "
                         "a 700-token document has no eviction to speak of")
    ap.add_argument("--settings", nargs="*", default=[EVICTION, RETRIEVAL])
    a = ap.parse_args()
    if a.docs.startswith("@"):
        docs = [Path(x) for x in Path(a.docs[1:]).read_text().split() if x]
    else:
        docs = sorted(p for p in Path(a.docs).rglob("*.txt") if not p.name.endswith(".ref.txt"))
    by_genre: dict[str, list[Path]] = {}
    for d in docs:  # round robin over the genres (folders): a --limit run mixes them
        by_genre.setdefault(d.parent.name, []).append(d)
    docs = [g[i] for i in range(max(map(len, by_genre.values()))) for g in by_genre.values()
            if i < len(g)]
    if a.limit:
        docs = docs[:a.limit]
    rows, meta = [], None
    for doc in docs:
        out = a.out / doc.stem
        report = out / "report.json"
        if not report.exists():
            cmd = [str(Path(sys.executable).parent / "hisparse"), "eval", str(doc), "--profile", "cpu",
                   "--max-tokens", str(a.max_tokens), "--out", str(out), "--quiet", "--json",
                   "-s", "dense", *[x for s in a.settings for x in ("-s", s)]]
            if a.no_rouge:
                cmd.append("--no-rouge")
            print(f"# {doc.stem}", file=sys.stderr, flush=True)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        data = json.loads(report.read_text())
        rows += [r for r in data["rows"] if r.get("tokens", 0) >= a.min_tokens]
        meta = data
    if meta is None:
        sys.exit("no documents")
    from hisparse_cli.config.settings import SparseConfig
    from hisparse_cli.quality.aggregate import summarize_settings
    from hisparse_cli.quality.harness import EvalResult, HarnessConfig
    from hisparse_cli.quality.report import summary_table
    from hisparse_cli.quality.settings import NamedSetting

    settings = [NamedSetting(s["name"], SparseConfig(**s["sparse"])) for s in meta["settings"]]
    summary = summarize_settings(EvalResult(settings=settings, rows=rows, config=HarnessConfig()))
    print(f"{len({r['doc'] for r in rows})} documents of {a.min_tokens}-{a.max_tokens} tokens "
          f"(of {len(docs)} run)")
    print(summary_table(summary))
    (a.out / "pooled.json").write_text(json.dumps(summary, indent=2, default=str))


if __name__ == "__main__":
    main()
