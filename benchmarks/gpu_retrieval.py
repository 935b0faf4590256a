"""Retrieval tier vs eviction-only on the GPU, at the same resident KV (issue 41; BENCHMARKS.md).

    python benchmarks/gpu_retrieval.py [--out DIR] [--contexts 32768,131056] [--budget-gib 6]
                                       [--decode-tokens 64] [--retrieval-tokens 1024]

One process, one GPU, random weights built on the device (benchmarks/gpu_engine.py's builders):
a Llama-3-8B-shaped AWQ INT4 model, embeddings in host RAM, the 4060ti-6g profile in a 6 GiB
card emulated with set_per_process_memory_fraction (--budget-gib 0: the whole card). For each
context, in the same run, two settings over the profile's:
  eviction-only  the profile's window / globals, window widened by retrieval_tokens + the
                 page-cache and summary bytes (the same resident KV; printed side by side)
  retrieval      the profile's settings + retrieval_tokens (page cache = retrieval_tokens)
Per run: prefill and decode tok/s, their ratios (retrieval / eviction-only), host->device bytes
per decoded token (RunStats.bytes_to_cache over the decode), the page-cache hit rate, pages
retrieved per step, the planner's device peak vs torch.cuda.max_memory_allocated and its host
offload store vs the pinned bytes allocated. Writes $OUT/gpu_retrieval.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import gpu_engine as ge  # noqa: E402
from hisparse_cli.config.profiles import load_profile  # noqa: E402
from hisparse_cli.model.config import ModelConfig  # noqa: E402
from hisparse_cli.planner.memory import GIB  # noqa: E402
from hisparse_cli.planner.shapes import SHAPES  # noqa: E402


def same_resident_eviction(sparse, cfg: ModelConfig, context: int):
    """The eviction-only setting whose resident KV matches the retrieval one's: the window
    widened by the page cache plus the page summaries' bytes, in tokens."""
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    pages = -(-context // sparse.block_size)
    n_summ = 1 if sparse.retrieval_summary == "mean" else 2
    summ = n_summ * cfg.num_hidden_layers * cfg.num_key_value_heads * pages * cfg.head_dim * 2
    extra = sparse.page_cache_pages * sparse.block_size + summ // per_token
    return replace(sparse, retrieval_tokens=0, window_size=sparse.window_size + extra)


def run(a) -> list[dict]:
    dev = torch.device("cuda")
    backend, why = ge.pick_backend(dev)
    ge.log(f"backend {backend}: {why}")
    calib = ge.calibrate(dev)
    prof = load_profile(a.profile)
    base = prof.sparse_config(retrieval_tokens=a.retrieval_tokens)
    cfg = ModelConfig.from_dict(SHAPES["llama-3-8b"])
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if a.budget_gib:
        from hisparse_cli.planner.vram import allocator_cap_bytes, budget_fraction

        total = torch.cuda.get_device_properties(dev).total_memory
        ctx_b = calib.get("non_allocator_bytes_after_cublas") or 500 * (1 << 20)
        cap = allocator_cap_bytes(int(a.budget_gib * GIB), card=True, context_bytes=ctx_b)
        torch.cuda.set_per_process_memory_fraction(budget_fraction(cap, total), index)
    kw = dict(weight_format="awq-int4", embeddings_on_host=True,
              budget_bytes=prof.vram_budget_bytes if a.budget_gib else None)
    model = ge.build_ours(cfg, dev, awq=True, host_emb=True)
    ge.run_ours(model, cfg, base, ge.prompt(1024, cfg.vocab_size), 2, backend, dev, **kw)
    rows = []
    try:
        for ctx in (int(c) for c in a.contexts.split(",")):
            ids = ge.prompt(ctx, cfg.vocab_size)
            pair = {}
            for name, sparse in (("eviction-only", same_resident_eviction(base, cfg, ctx)),
                                 ("retrieval", base)):
                from hisparse_cli.engine.engine import Engine

                eng = Engine(model, cfg, sparse=sparse, device=dev, kv_dtype=torch.float16,
                             backend=backend)
                plan = ge.plan_for(cfg, sparse, ctx, a.decode_tokens, backend, dev, **kw)
                ge.free_all(dev)
                pinned0 = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) \
                    if hasattr(torch.cuda, "host_memory_stats") else None
                res = eng.generate(ids, max_new_tokens=a.decode_tokens,
                                   min_new_tokens=a.decode_tokens)
                s = res.stats
                row = {"setting": name, "context": ctx, "device": torch.cuda.get_device_name(dev),
                       "window": sparse.window_size, "retrieval_tokens": sparse.retrieval_tokens,
                       "prefill_tok_s": s.prefill_tok_s,
                       "decode_tok_s": (s.new_tokens - 1) / s.decode_seconds,
                       "peak_bytes": s.peak_memory_bytes,
                       "predicted_peak_bytes": plan.peak_allocated_bytes,
                       "device_error_pct": 100.0 * (plan.peak_allocated_bytes
                                                    - s.peak_memory_bytes) / s.peak_memory_bytes,
                       "kv_bytes_peak": s.kv_bytes_peak,
                       "planned_kv_bytes_peak": plan.kv.kv_bytes_peak,
                       "planned_host_offload_bytes": plan.offload_store_bytes,
                       "pinned_bytes_before_run": pinned0,
                       "pages_offloaded": s.pages_offloaded, "offload_bytes": s.offload_bytes,
                       "cache_hit_rate": s.cache_hit_rate,
                       "pages_retrieved_per_step": s.pages_retrieved_per_step,
                       "bytes_to_cache": s.bytes_to_cache,
                       "h2d_bytes_per_token": s.bytes_to_cache / (ctx + s.new_tokens),
                       "cuda_graph": (res.extra or {}).get("cuda_graph"),
                       "decode_kernel": (res.extra or {}).get("decode_kernel")}
                eng.release_cached_state()
                del eng
                ge.free_all(dev)
                pair[name] = row
                rows.append(row)
                ge.log(json.dumps(row, default=str))
            ev, rt = pair["eviction-only"], pair["retrieval"]
            rows.append({"setting": "ratio retrieval / eviction-only", "context": ctx,
                         "decode": rt["decode_tok_s"] / ev["decode_tok_s"],
                         "prefill": rt["prefill_tok_s"] / ev["prefill_tok_s"]})
            ge.log(json.dumps(rows[-1]))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--contexts", default="32768,131056")
    ap.add_argument("--budget-gib", type=float, default=6.0)
    ap.add_argument("--profile", default="4060ti-6g")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--retrieval-tokens", type=int, default=1024)
    a = ap.parse_args()
    t0 = time.perf_counter()
    rows = run(a)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_retrieval.json").write_text(json.dumps(
        {"rows": rows, "seconds": time.perf_counter() - t0}, indent=2, default=str))
    for r in rows:
        print(json.dumps(r, default=str))


if __name__ == "__main__":
    main()
