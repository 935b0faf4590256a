"""Shared driver of the quality studies (quality_sweep.py, quality_policies.py,
quality_rouge.py): a fixed eval_dev subset, one model load, per-document checkpoints (a
killed study resumes where it stopped), and the report written by hisparse_cli.quality.

Documents are read from ../shared/eval_dev (never copied into the repository).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EVAL_DEV = Path(os.environ.get("HISPARSE_EVAL_DEV", ROOT.parent / "shared" / "eval_dev"))

# Long documents from three genres; the first k of this list form a study's subset.
SUBSET = ["sci_scisummnet/D09-1030", "med_plos/journal.pbio.1001315",
          "gov_report/govreport-01", "sci_scisummnet/A00-2034", "med_plos/journal.pcbi.1004079",
          "gov_report/govreport-02", "sci_scisummnet/C04-1197", "med_plos/journal.pcbi.1001083"]


def parser(doc: str, docs: int, max_tokens: int, out: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="/tmp/smollm2" if Path("/tmp/smollm2").is_dir() else None)
    p.add_argument("--docs", type=int, default=docs, help="first N documents of SUBSET")
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--out", default=out, help="report folder (checkpoints inside)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", nargs="*", help="evaluate only these setting names (+ dense)")
    return p


def run_study(args, specs: list[str], *, rouge: bool, max_new_tokens: int = 160,
              title: str = "") -> None:
    import torch

    from hisparse_cli.engine import Engine, SparseConfig
    from hisparse_cli.hub import resolve_model
    from hisparse_cli.quality.dataset import LayoutConfig, load_eval_documents
    from hisparse_cli.quality.harness import EvalResult, HarnessConfig, evaluate
    from hisparse_cli.quality.report import summary_table, write_report
    from hisparse_cli.quality.aggregate import summarize_settings
    from hisparse_cli.quality.settings import parse_settings

    torch.set_num_threads(args.threads)
    if args.only:
        specs = [s for s in specs if s in args.only or s == "dense"]
    base = SparseConfig()  # built-in defaults (= the cpu profile's values)
    settings = parse_settings(specs, base)
    model = Path(resolve_model(args.model))
    eng = Engine.from_pretrained(model, sparse=SparseConfig.dense_config())
    docs = load_eval_documents([EVAL_DEV / f"{d}.txt" for d in SUBSET[: args.docs]])
    cfg = HarnessConfig(layout=LayoutConfig(max_tokens=args.max_tokens), rouge=rouge,
                        max_new_tokens=max_new_tokens)
    out = Path(args.out)
    (out / "rows").mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    started = time.perf_counter()
    for doc in docs:
        ck = out / "rows" / (doc.id.replace("/", "_") + ".json")
        done = json.loads(ck.read_text()) if ck.is_file() else []
        have = {r["setting"] for r in done}
        todo = [s for s in settings if s.name not in have]
        if todo and todo[0].name != "dense":
            todo = [settings[0]] + todo  # the oracle is recomputed; its row is kept once
        if todo:
            def prog(what, i, n, _d=doc.id):
                print(f"[{time.strftime('%H:%M:%S')}] {what} ({i}/{n})", file=sys.stderr, flush=True)
            res = evaluate(eng, [doc], todo, cfg, progress=prog)
            done += [r for r in res.rows if r["setting"] not in have]
            ck.write_text(json.dumps(done, default=str))
        rows += [r for r in done if r["setting"] in {s.name for s in settings}]
    result = EvalResult(settings=settings, rows=rows, config=cfg)
    result.meta = {"study": title, "date": time.strftime("%Y-%m-%d %H:%M"),
                   "model": model.name, "machine": f"{platform.machine()}, "
                   f"{os.cpu_count()} CPUs (shared), torch {torch.__version__}, "
                   f"{args.threads} threads, float32", "documents": [d.id for d in docs],
                   "command": "python " + " ".join(sys.argv),
                   "wall_seconds_this_invocation": round(time.perf_counter() - started)}
    write_report(result, out)
    print(summary_table(summarize_settings(result)))
