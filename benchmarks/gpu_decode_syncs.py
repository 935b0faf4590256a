"""Which calls of the CUDA-graph decode loop make the host wait for the GPU, and how often.

    PYTHONPATH=$PWD python3 benchmarks/gpu_decode_syncs.py [--out DIR] [--context 8192]
        [--decode-tokens 64] [--layers 32] [--weights fp16,awq-int4] [--rounds 0]

The decode loop (`Engine._decode_graph`) is meant to read tokens back once every 16 steps (an
event wait on the read-back's copy, made after the next step is queued, so the GPU does not
drain) and otherwise never wait for the device, so the host prepares step t+1 while the GPU
runs step t.
A synchronising call in the loop (a pageable host->device copy, `.item()`, a boolean-mask
index, ...) drains the pipeline instead: the GPU then idles for the host's sampler, input
preparation and graph launch every token (`gpu_decode_profile.py` shows it as "between GPU").

Here `torch.cuda.set_sync_debug_mode("warn")` is on for the decode loop and, separately, for
each prefill chunk's `KVRun.step` (the engine's one sync after the last chunk is outside),
and every warning is recorded with the Python stack that caused it; the loop's own event
waits (the read-backs, which sync debugging does not report) are counted too. Llama-3-8B-shaped random weights
(`--layers` of them), the `h200-141g` sparse settings; per generation config (the benchmarks'
plain greedy with min_new_tokens, and the CLI's defaults: repetition penalty 1.1, no-repeat
8-grams) one generate to capture the decode graph, then a second one (the kept graph replays
from its first step) whose decode is the one counted. Prints syncs per token by call site and
the decode tok/s of the counted run; writes DIR/gpu_decode_syncs.json (DIR: --out, else $OUT,
else ./out).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from gpu_engine import build_ours, pick_backend, prompt  # noqa: E402
from hisparse_cli.engine import engine as engine_mod  # noqa: E402
from hisparse_cli.config.settings import GenerationConfig  # noqa: E402
from hisparse_cli.engine.cuda_graph import DeviceSampler  # noqa: E402
from hisparse_cli.engine.runner import KVRun  # noqa: E402
from hisparse_cli.model.config import ModelConfig  # noqa: E402
from hisparse_cli.planner.shapes import SHAPES  # noqa: E402
from hisparse_cli.config.profiles import load_profile  # noqa: E402

GENS = {"greedy, min_new_tokens (benchmarks)": dict(),
        "CLI defaults (rep. penalty 1.1, no-repeat 8-grams)": dict(repetition_penalty=1.1,
                                                                 no_repeat_ngram_size=8)}


def site(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frames of the project (hisparse_cli, benchmarks) that led to the call."""
    own = [f for f in stack if "hisparse_cli" in f.filename or "benchmarks" in f.filename]
    own = [f for f in own if not f.filename.endswith("gpu_decode_syncs.py")]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(own[-3:]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--weights", default="fp16", help="comma list of fp16, awq-int4")
    ap.add_argument("--rounds", type=int, default=0)
    a = ap.parse_args()
    dev = torch.device("cuda")
    backend, why = pick_backend(dev)
    print(f"backend {backend}: {why}", flush=True)
    cfg = ModelConfig.from_dict({**SHAPES["llama-3-8b"], "num_hidden_layers": a.layers})
    sparse = load_profile("h200-141g").sparse_config()
    ids = prompt(a.context, cfg.vocab_size)

    hits: collections.Counter = collections.Counter()
    prefill_hits: collections.Counter = collections.Counter()
    state = {"on": False, "prefill": False, "chunks": 0}
    original = engine_mod.Engine._decode_graph
    original_step = KVRun.step
    sampler_call = DeviceSampler.__call__

    def counted_step(self, model, input_ids, *args, **kw):  # a prefill chunk, sync-debugged
        if input_ids.shape[0] <= 1 or state["on"]:
            return original_step(self, model, input_ids, *args, **kw)
        state["prefill"] = True
        state["chunks"] += 1
        torch.cuda.set_sync_debug_mode("warn")
        try:
            return original_step(self, model, input_ids, *args, **kw)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            state["prefill"] = False

    real_wait = torch.cuda.Event.synchronize

    def counted_wait(ev):  # the loop's own event waits (its read-backs; sync debugging does
        caller = traceback.extract_stack()[-2]  # not see event waits; the decoder's
        if caller.name == "_decode_graph":      # _prepare waits on copies two steps old)
            hits[f"event wait (read-back) {caller.filename.split('/')[-1]}:{caller.lineno}"] += 1
        return real_wait(ev)

    def counted(self, *args, **kw):  # the decode loop with sync debugging on
        state["on"] = True
        torch.cuda.set_sync_debug_mode("warn")
        torch.cuda.Event.synchronize = counted_wait
        try:
            return original(self, *args, **kw)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.Event.synchronize = real_wait
            state["on"] = False

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message) and (state["on"] or state["prefill"]):
            (hits if state["on"] else prefill_hits)[site(traceback.extract_stack()[:-1])] += 1

    def synced(self, *args, **kw):  # the sampler as it behaved before run 41
        tok = sampler_call(self, *args, **kw)
        torch.cuda.current_stream().synchronize()
        return tok

    def tok_s(res) -> float:
        s = res.stats
        return (s.new_tokens - 1) / s.decode_seconds

    warnings.showwarning = show
    warnings.simplefilter("always")
    results = []
    for weights in a.weights.split(","):
        model = build_ours(cfg, dev, awq=weights == "awq-int4", host_emb=False)
        for label, kw in GENS.items():
            eng = engine_mod.Engine(model, cfg, sparse=sparse, device=dev,
                                    kv_dtype=torch.float16, backend=backend)
            gen = GenerationConfig(max_new_tokens=a.decode_tokens,
                                   min_new_tokens=a.decode_tokens, **kw)
            eng.generate(ids, gen=gen)  # captures the decode graph
            hits.clear()
            prefill_hits.clear()
            state["chunks"] = 0
            engine_mod.Engine._decode_graph = counted
            KVRun.step = counted_step
            try:
                res = eng.generate(ids, gen=gen)  # replays it from the first step: counted
            finally:
                engine_mod.Engine._decode_graph = original
                KVRun.step = original_step
            steps = max(res.stats.new_tokens, 1)
            row = {"weights": weights, "gen": label, "graph": res.extra.get("cuda_graph"),
                   "new_tokens": res.stats.new_tokens, "decode_tok_s": tok_s(res),
                   "syncs_per_token": {k: v / steps for k, v in hits.most_common()},
                   "prefill_chunks": state["chunks"],
                   "prefill_syncs_per_chunk": {k: v / max(state["chunks"], 1)
                                               for k, v in prefill_hits.most_common()},
                   "ab": []}
            print(f"\n== {weights}, {label}: graph {row['graph']}, {steps} tokens, decode "
                  f"{row['decode_tok_s']:.1f} tok/s; syncs per token by call site:", flush=True)
            for k, v in hits.most_common():
                print(f"  {v / steps:6.3f}  {k}", flush=True)
            if not hits:
                print("  none", flush=True)
            print(f"  prefill, {state['chunks']} chunks: syncs per chunk by call site:",
                  flush=True)
            for k, v in prefill_hits.most_common():
                print(f"  {v / max(state['chunks'], 1):6.3f}  {k}", flush=True)
            if not prefill_hits:
                print("  none", flush=True)
            for r in range(a.rounds):
                pair = {}
                for variant in (("now", "synced") if r % 2 == 0 else ("synced", "now")):
                    if variant == "synced":
                        DeviceSampler.__call__ = synced
                    try:
                        pair[variant] = tok_s(eng.generate(ids, gen=gen))
                    finally:
                        DeviceSampler.__call__ = sampler_call
                row["ab"].append(pair)
                print(f"  round {r}: decode {pair['now']:.1f} tok/s, with a sync a token "
                      f"{pair['synced']:.1f} ({pair['now'] / pair['synced']:.3f}x)", flush=True)
            results.append(row)
            del eng
        del model
        torch.cuda.empty_cache()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gpu_decode_syncs.json").write_text(json.dumps(
        {"command": " ".join(["python3"] + sys.argv), "weights": a.weights, "layers": a.layers,
         "context": a.context, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
