#!/usr/bin/env bash
# Decoding defaults by measured ROUGE (issue: CLI, "defaults chosen by measured ROUGE"):
# repetition control and summary length with the embedded model on eval_dev's legal_tldr
# documents (short legal texts with one-paragraph human summaries), greedy, cpu profile.
# Each configuration is one `hisparse batch` run; the end table has mean ROUGE with 95 %
# bootstrap intervals. Usage: benchmarks/decoding_study.sh [EVAL_DEV_DIR] [OUT_DIR]
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0;; esac
DOCS="${1:-$(dirname "$0")/../../shared/eval_dev}/legal_tldr"
OUT="${2:-/tmp/decoding_study}"
mkdir -p "$OUT"
run() {  # name, options...
  local name=$1; shift
  hisparse batch "$DOCS" --out "$OUT/$name.jsonl" --resume --profile cpu "$@" -q \
    2> "$OUT/$name.log" || true
  python3 - "$OUT/$name.jsonl" "$name" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
ok = [r for r in rows if r.get("rouge")]
def m(k): return statistics.mean(r["rouge"][k] for r in ok) * 100 if ok else float("nan")
toks = statistics.mean((r.get("stats") or {}).get("new_tokens", 0) for r in ok) if ok else 0
print(f"| {sys.argv[2]} | {len(ok)}/{len(rows)} | {m('rouge1'):.1f} | {m('rouge2'):.1f} | "
      f"{m('rougeL'):.1f} | {m('rougeLsum'):.1f} | {toks:.0f} |")
PY
}
echo "| config | docs | R-1 | R-2 | R-L | R-Lsum | new tokens |"
echo "|---|---|---:|---:|---:|---:|---:|"
run default
run no-rep-control --repetition-penalty 1.0 --no-repeat-ngram 0
run penalty-only --no-repeat-ngram 0
run ngram-only --repetition-penalty 1.0
run ngram4 --no-repeat-ngram 4
run short128 --max-new-tokens 128
