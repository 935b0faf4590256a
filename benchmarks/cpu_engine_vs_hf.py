"""CPU benchmark (issue: core engine): `Engine.generate` vs transformers' own `generate` on the
same ~5K-token real-document prompt, greedy, 256 new tokens, in one run.

Each variant runs in its own subprocess so peak RSS (ru_maxrss) is per variant.
Usage:
    python benchmarks/cpu_engine_vs_hf.py [--model DIR] [--doc FILE] [--prompt-tokens 5000]
        [--new-tokens 256] [--threads 2] [--rounds N] [--json OUT.json]
Default document: ../shared/eval_dev/gov_report/govreport-00.txt (not shipped with the repo).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DOC = ROOT.parent / "shared" / "eval_dev" / "gov_report" / "govreport-00.txt"


def prompt_ids(model_dir: str, doc: str, n: int) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    text = Path(doc).read_text(encoding="utf-8")
    body = tok.decode(tok(text)["input_ids"][: n - 40])
    msgs = [{"role": "user", "content": "Summarize the following report.\n\n" + body}]
    return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)


def run_variant(variant: str, model_dir: str, ids: list[int], new_tokens: int) -> dict:
    import resource

    import torch

    if variant == "hf":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        x = torch.tensor([ids])
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            wall = time.perf_counter() - t0
        toks = out[0, len(ids):].tolist()
        extra = {}
    else:
        from hisparse_cli.engine import Engine, SparseConfig

        sparse = SparseConfig.dense_config(prefill_chunk=512) if variant == "dense" else SparseConfig()
        eng = Engine.from_pretrained(model_dir, sparse=sparse)
        t0 = time.perf_counter()
        res = eng.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        wall = time.perf_counter() - t0
        toks = res.token_ids
        extra = res.stats.to_dict()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"variant": variant, "wall_s": wall, "tokens": toks, "peak_rss_bytes": rss, "stats": extra}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--doc", default=str(DEFAULT_DOC))
    ap.add_argument("--prompt-tokens", type=int, default=5000)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default="hf,dense,sparse")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every variant this many times, interleaved; prints the median ratio")
    ap.add_argument("--json", default=None)
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._child:
        import torch

        torch.set_num_threads(a.threads)
        spec = json.loads(a._child)
        print(json.dumps(run_variant(spec["variant"], spec["model"], spec["ids"], spec["new"])))
        return
    model = a.model
    if model is None:
        from hisparse_cli.hub.resolve import resolve_model

        model = str(resolve_model(None))
    ids = prompt_ids(model, a.doc, a.prompt_tokens)
    variants = a.variants.split(",")
    rounds = []
    for r in range(a.rounds):  # each round runs every variant once, the order rotated per
        # round so that a slow stretch of this machine does not always hit the same variant
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        got = {v: run_child(v, model, ids, a) for v in order}
        rows = [got[v] for v in variants]
        rounds.append(rows)
        print_round(rows, len(ids), a, r if a.rounds > 1 else None)
    if a.rounds > 1:
        print_summary(rounds)
    if a.json:
        Path(a.json).write_text(json.dumps({"prompt_tokens": len(ids), "rows": rounds[0],
                                            "rounds": rounds}, indent=1))


def run_child(v: str, model: str, ids: list[int], a) -> dict:
    spec = json.dumps({"variant": v, "model": model, "ids": ids, "new": a.new_tokens})
    out = subprocess.run([sys.executable, __file__, "--threads", str(a.threads), "--_child", spec],
                         capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if out.returncode != 0:
        sys.exit(f"{v} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _same(r: dict, hf: dict | None):
    if hf is None:
        return None
    if r["tokens"] == hf["tokens"]:
        return True
    n_same = next((i for i, (x, y) in enumerate(zip(r["tokens"], hf["tokens"])) if x != y),
                  min(len(r["tokens"]), len(hf["tokens"])))
    return f"first {n_same}"


def print_round(rows: list[dict], n_ids: int, a, r: int | None) -> None:
    hf = next((x for x in rows if x["variant"] == "hf"), None)
    head = f"round {r + 1}: " if r is not None else ""
    print(f"{head}prompt tokens: {n_ids}, new tokens: {a.new_tokens}, threads: {a.threads}")
    print(f"{'variant':8} {'wall s':>8} {'x HF':>6} {'peak RSS MiB':>13} {'same tokens as HF':>18}")
    for x in rows:
        ratio = x["wall_s"] / hf["wall_s"] if hf else float("nan")
        print(f"{x['variant']:8} {x['wall_s']:8.2f} {ratio:6.2f} "
              f"{x['peak_rss_bytes'] / 2**20:13.0f} {str(_same(x, hf)):>18}", flush=True)


def print_summary(rounds: list[list[dict]]) -> None:
    """Per variant: the ratio to HF's time in the same round, every round, and the median."""
    print(f"over {len(rounds)} rounds (x HF's time in the same round):")
    for i, x in enumerate(rounds[0]):
        if x["variant"] == "hf":
            continue
        ratios = []
        for rows in rounds:
            hf = next((y for y in rows if y["variant"] == "hf"), None)
            if hf:
                ratios.append(rows[i]["wall_s"] / hf["wall_s"])
        if ratios:
            med = statistics.median(ratios)
            print(f"{x['variant']:8} median {med:.2f}  rounds {' / '.join(f'{q:.2f}' for q in ratios)}")


if __name__ == "__main__":
    main()
