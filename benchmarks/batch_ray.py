"""Documents per hour of `hisparse batch`: local vs `--ray local --workers 1` vs
`--ray local --workers 2 --threads-per-worker 1`, on a subset of ../shared/eval_dev (issue 43).

    python benchmarks/batch_ray.py --out-dir /tmp/batch-ray [--docs 8] [--rounds 1]
        [--max-new-tokens 128] [--eval-dir ../shared/eval_dev] [--modes local,ray1,ray2]

Each mode runs `hisparse batch @LIST --out … --profile cpu -q
--max-new-tokens M` as its own process on the same documents (wall clock from process start
to exit: imports, Ray's cluster start, model loads and shutdown included). Rounds alternate
the order of the modes. Per mode: wall seconds, documents/hour, Σ of the records' own
`seconds` (the documents' work), the fixed cost wall − Σ (start-up, model load, dispatch,
shutdown; for the 2-worker mode Σ counts both workers' time), the ratio to local in the same
round, and how many summaries equal the local run's (1 worker has the same threads as local;
2 workers x 1 thread may round differently). Ray's overhead per document is
(wall_ray1 − wall_local) / documents. The subset: the first documents of each eval_dev set
(sorted names), taken round-robin over the sets. Writes OUT_DIR/summary.json and prints a
Markdown table for BENCHMARKS.md. Timings need a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

MODES = {
    "local": [],
    "ray1": ["--ray", "local", "--workers", "1"],
    "ray2": ["--ray", "local", "--workers", "2", "--threads-per-worker", "1"],
}
LABELS = {"local": "local batch", "ray1": "--ray local --workers 1",
          "ray2": "--ray local --workers 2 --threads-per-worker 1"}


def pick_documents(eval_dir: Path, count: int) -> list[Path]:
    sets = [sorted(p for p in folder.glob("*.txt") if ".ref" not in p.name)
            for folder in sorted(eval_dir.iterdir()) if folder.is_dir()]
    picked: list[Path] = []
    depth = 0
    while len(picked) < count and any(depth < len(s) for s in sets):
        picked += [s[depth] for s in sets if depth < len(s)][: count - len(picked)]
        depth += 1
    return picked


def run_mode(mode: str, listfile: Path, out: Path, max_new_tokens: int) -> dict:
    out.unlink(missing_ok=True)
    # the installed console script: `python -m` from a checkout's root would put the root on
    # sys.path, where the top-level kernels/ folder shadows the `kernels` distribution
    hisparse = shutil.which("hisparse", path=str(Path(sys.executable).parent)) or "hisparse"
    cmd = [hisparse, "batch", f"@{listfile}", "--out", str(out), "--profile", "cpu", "-q",
           "--max-new-tokens", str(max_new_tokens), *MODES[mode]]
    started, launched = time.perf_counter(), time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - started
    records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    ok = [r for r in records if r["status"] == "ok"]
    busy = sum(r["seconds"] for r in records)
    return {"mode": mode, "command": " ".join(cmd), "exit": proc.returncode,
            "stderr_tail": proc.stderr[-2000:], "wall_s": wall, "documents": len(records),
            "ok": len(ok), "docs_per_hour": len(records) / wall * 3600 if wall else 0.0,
            "sum_doc_seconds": busy, "fixed_s": wall - busy,
            "summaries": {r["input"]: r.get("summary") for r in records},
            "workers": sorted({(r.get("worker") or {}).get("pid") for r in records} - {None}),
            **ray_costs(records, launched, launched + wall)}


def ray_costs(records: list[dict], launched: float, ended: float) -> dict:
    """Start-up, per-document gap and shutdown seconds from the workers' timestamps."""
    spans = sorted(((r["worker"]["pid"], r["worker"]["started_at"], r["worker"]["finished_at"])
                    for r in records if "started_at" in (r.get("worker") or {})))
    if not spans:
        return {}
    gaps = [b[1] - a[2] for a, b in zip(spans, spans[1:]) if a[0] == b[0]]
    return {"startup_s": min(s[1] for s in spans) - launched,
            "gap_per_doc_s": sum(gaps) / len(gaps) if gaps else None,
            "shutdown_s": ended - max(s[2] for s in spans)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--eval-dir", type=Path,
                    default=Path(__file__).resolve().parents[1].parent / "shared" / "eval_dev")
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--modes", default="local,ray1,ray2")
    args = ap.parse_args()
    if not args.eval_dir.is_dir():
        sys.exit(f"no eval_dev at {args.eval_dir} (give --eval-dir)")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    docs = pick_documents(args.eval_dir, args.docs)
    listfile = args.out_dir / "docs.txt"
    listfile.write_text("".join(f"{p}\n" for p in docs))
    rounds = []
    for number in range(args.rounds):
        order = modes if number % 2 == 0 else modes[::-1]
        runs = {}
        for mode in order:
            runs[mode] = run_mode(mode, listfile, args.out_dir / f"r{number}-{mode}.jsonl",
                                  args.max_new_tokens)
            print(f"round {number + 1} {mode}: {runs[mode]['wall_s']:.1f} s, "
                  f"{runs[mode]['ok']}/{runs[mode]['documents']} ok, exit {runs[mode]['exit']}",
                  file=sys.stderr, flush=True)
        base = runs.get("local")
        for run in runs.values():
            if base:
                run["vs_local"] = base["wall_s"] / run["wall_s"] if run["wall_s"] else None
                run["same_summaries"] = sum(run["summaries"].get(k) == v
                                            for k, v in base["summaries"].items())
        if base and "ray1" in runs:
            runs["ray1"]["overhead_per_doc_s"] = ((runs["ray1"]["wall_s"] - base["wall_s"])
                                                  / max(1, len(docs)))
        rounds.append({"order": order, "runs": runs})
    env = {"python": platform.python_version(), "cpus": os.cpu_count(),
           "machine": platform.machine(), "date": time.strftime("%Y-%m-%d"),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip()}
    for name in ("torch", "ray"):
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            env[name] = None
    (args.out_dir / "summary.json").write_text(json.dumps(
        {"env": env, "documents": [str(p) for p in docs], "max_new_tokens": args.max_new_tokens,
         "rounds": rounds}, indent=2))
    print(f"\n{len(docs)} documents, --max-new-tokens {args.max_new_tokens}, {env}\n")
    print("| round | mode | wall s | docs/hour | vs local | Σ doc s | wall − Σ s | "
          "summaries = local | start-up s | gap/doc s | shutdown s | (wall − local)/doc s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for number, entry in enumerate(rounds, 1):
        for mode in modes:
            r = entry["runs"][mode]
            vs = f"{r['vs_local']:.2f}×" if r.get("vs_local") else ""
            same = f"{r['same_summaries']}/{len(docs)}" if "same_summaries" in r else ""
            over = f"{r['overhead_per_doc_s']:.1f}" if "overhead_per_doc_s" in r else ""
            costs = " | ".join("" if r.get(k) is None else f"{r[k]:.2f}"
                               for k in ("startup_s", "gap_per_doc_s", "shutdown_s"))
            print(f"| {number} | {LABELS[mode]} | {r['wall_s']:.1f} | {r['docs_per_hour']:.0f} | "
                  f"{vs} | {r['sum_doc_seconds']:.1f} | {r['fixed_s']:.1f} | {same} | {costs} | "
                  f"{over} |")


if __name__ == "__main__":
    main()
