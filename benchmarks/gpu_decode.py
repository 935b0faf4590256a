"""Decode on the GPU: the persistent INT4 decode kernel checked and timed against the fp16
engine (`bench`), and where a decode token's time goes (`profile`).

    python3 benchmarks/gpu_decode.py bench [--out DIR] [--skip-time]
        [--contexts 32768] [--decode-tokens 256] [--profiles h200-141g,4060ti-6g]
    python3 benchmarks/gpu_decode.py profile [--out DIR] [--time-budget 230]
        [--contexts 32768,131072] [--decode-tokens 96] [--profile-steps 32] [--smoke]
        [--awq [--awq-lm-head]] [--cli-sampling]

bench: the persistent decode step (kernels/cuda/cuda_step.py, kernels/cuda/decode_step.cu),
checked against the engine's layer-by-layer Triton step, then timed inside the engine.
(a) check: small random AWQ INT4 Llamas (weights in the item layout, INT4 head and fp16 head),
    a sparse run with sinks, a window, global slots and the attention-mass importance; after a
    Triton prefill, each decode step runs the Triton step and the persistent kernel from the
    same state (the cache, scores, global masses restored between them) and compares the
    logits, the K/V stored at the token's slot in every layer, and the score / global mass /
    global seen each added; then the run goes on from the kernel's state.
(b) time (skipped with --skip-time): the Llama-3-8B shape with random weights, fp16 and INT4 +
    INT4 head (items), one kept Engine each as `hisparse batch` keeps one (the repeats replay the
    kept graph); decode tok/s of fp16 (layers), INT4 (layers) and INT4 (persistent) per profile
    and context, and the ratios to fp16 of the same call.
Writes DIR/gpu_cuda_decode.json (DIR: --out, else $OUT, else ./out).

profile: where a decode token's time goes, and what importance scoring costs (issue 4). A
Llama-3-8B-shaped model with random fp16 weights built on the device (benchmarks/gpu_engine.py's
`build_ours`: no download), the `h200-141g` profile's sparse settings (window 4096, 512 globals,
chunk 1024, recalibration every 1024), CUDA-graph decode, greedy with min_new_tokens (no EOS).
Per context:
  (a) `Engine.generate` as the benchmarks call it: prefill and decode tok/s (decode includes
      building, warming up and capturing the graph at the first step, as users pay it).
  (b) the same decode loop as `Engine._decode_graph`, instrumented: the first step (eager
      warm-up + capture) alone; then per token the wall time, the GPU time of the graph replay
      (CUDA events around `graph.replay()`), the GPU time between replays (the host loop's
      sampler, when the step does not sample itself: engine/sampling/graph.py, the default;
      eviction, input copy and any idle gap), and the host time of each part (sampler, `_prepare`, the
      replay launch, `_after_step`, the token read-back every 16 steps).
  (c) torch.profiler over --profile-steps further steps: top CPU ops by self time, the CUDA
      runtime calls that wait (stream/event/device synchronize, blocking memcpy, .item()),
      launches per token.
  (d) the graph alone: back-to-back replays (pure GPU time a token would take with no host work
      at all), and one eager decode step under the profiler: kernel count and GPU time by
      kernel family (GEMM/GEMV, Triton attention/scoring, the rest), how much is in kernels
      shorter than 5 us (launch/tail-bound small ops a graph does not make cheaper).
Importance scoring (first context only, prefill only, no decode):
  (e) prefill with importance="attention" (the profile) vs importance="uniform". "uniform"
      keeps everything else identical - the same sinks/window/512 globals in attention, the
      same eviction into candidate slots and recalibration (choosing by position instead of
      mass) - and only drops the scoring work: the attention kernels' logsumexp + mass
      kernels and the per-layer score accumulation (fused into the mass kernels) and the
      score tensor's resets. global_tokens=0 would also remove the globals from attention
      and the recalibration, so it would not isolate scoring. Reported as % of prefill;
      plus a run timing every recalibration and eviction (synchronised, so that run's
      total is not used for the ratio), and the graph replay time with "uniform" (scoring's
      share of a decode step).
Prints compact tables; writes $OUT/gpu_decode_profile.json (--out, else $OUT, else ./out).
Every phase runs in try/except and prints its error; phases that would overrun --time-budget
are skipped with the reason. --smoke: tiny shapes on any device (CPU: torch backend, no graph).
"""


from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from gpu_engine import (SMOKE, build_ours, cli_sampling, environment,  # noqa: E402
                        free_all, left, log, pick_backend, prompt, run_ours, sync)
from hisparse_cli.config.profiles import load_profile  # noqa: E402
from hisparse_cli.config.settings import GenerationConfig, SparseConfig  # noqa: E402
from hisparse_cli.model.config import ModelConfig  # noqa: E402
from hisparse_cli.planner.shapes import SHAPES  # noqa: E402


# == bench: the persistent decode kernel, checked and timed ====================================
SMALL = {"model_type": "llama", "vocab_size": 2048, "hidden_size": 1024,
         "intermediate_size": 2816, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 2, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
         "rope_theta": 500000.0, "tie_word_embeddings": False}


def to_items(model) -> None:
    """Every AWQ linear of the model (the head too, when INT4) into the item layout (as the
    Engine does itself with HISPARSE_DECODE_KERNEL=persistent on sm_90)."""
    from hisparse_cli.kernels.cuda.cuda_step import use_item_layout

    use_item_layout(model)


CHECKS = (  # (INT4 head, window, globals, prompt): one unit page a split / several / more
    (True, 256, 32, 700),   # than the attention groups (9 pages a split: each group's
    (False, 1024, 64, 1500),  # loop goes round the ring's slots more than once)
    (True, 4096, 128, 5000),
)


def phase_check(model, run, dec, step) -> dict:
    """The kernel stopped after its first phase (layer 0's q|k|v) and after its second (the
    attention: the current K/V stored), against torch on the kernel's own inputs."""
    from hisparse_cli.kernels.int4.awq_items import dequantize_items_ref
    from hisparse_cli.kernels.norm_rope.norm_rope_ref import rms_norm, rope

    cfg, cache = model.cfg, run.cache
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    layer = model.model.layers[0]
    lin = layer.self_attn.qkv_proj
    out = {}
    saved = [t.clone() for t in (cache.k, cache.v)]
    full = step.params.n_phase
    try:
        step.params.n_phase = 1
        step()
        torch.cuda.synchronize()
        n = (hq + 2 * hkv) * 128
        got = step.ws[step.off_qkv:step.off_qkv + n].clone()
        x = rms_norm(model.model.embed_tokens.weight[dec.tok], layer.input_layernorm.weight,
                     layer.input_layernorm.eps).float()
        w = dequantize_items_ref(lin.qweight, lin.in_features, lin.out_features)
        ref = (x @ w.t())[0]
        out["qkv"] = ((got - ref).abs().max() / ref.abs().max()).item()
        out["h"] = (step.h - model.model.embed_tokens.weight[dec.tok][0].float()).abs().max().item()
        step.params.n_phase = 2
        step()
        torch.cuda.synchronize()
        qkv = step.ws[step.off_qkv:step.off_qkv + n].half()
        cos, sin = model.rope.cos_sin(dec.dev[0:1], torch.float16)
        k = rope(qkv[hq * 128:(hq + hkv) * 128].view(1, hkv, 128), cos, sin)
        v = qkv[(hq + hkv) * 128:].view(hkv, 128)
        slot, bs = int(dec.dev[1].item()), run.sparse.block_size
        ks, vs = cache.k[0, slot // bs, slot % bs], cache.v[0, slot // bs, slot % bs]
        out["k_store"] = ((ks.float() - k[0].float()).abs().max() / k.float().abs().max()).item()
        out["v_store"] = ((vs.float() - v.float()).abs().max() / v.float().abs().max()).item()
    finally:
        step.params.n_phase = full
        for t, b in zip((cache.k, cache.v), saved):
            t.copy_(b)
    return out


def bisect_phases(step) -> None:
    """Run the step stopped after each phase in turn, synchronizing after each, and say which
    ran (with CUDA_LAUNCH_BLOCKING=1 a faulting build dies right after the last phase named:
    the next one is the faulty phase). The cache is restored by the caller's own steps."""
    full = step.params.n_phase
    try:
        for n in range(1, full + 1):
            step.params.n_phase = n
            step()
            torch.cuda.synchronize()
            print(f"  bisect: phases 1..{n} ran (last: {step.kinds[n - 1]})", flush=True)
    finally:
        step.params.n_phase = full


def check_one(cfg: ModelConfig, head_int4: bool, window: int, globals_: int, steps: int,
              prompt_len: int, dev, variant: str = "", bisect: bool = False) -> dict:
    from hisparse_cli.engine.block_pool import BlockPool
    from hisparse_cli.engine.cuda_graph import GraphDecoder
    from hisparse_cli.engine.runner import KVRun
    from hisparse_cli.kernels.cuda.cuda_step import CudaDecodeStep, unsupported
    from hisparse_cli.kernels.dispatch import select_backend

    model = build_ours(cfg, dev, awq=True, host_emb=False, awq_lm_head=head_int4, seed=3)
    to_items(model)
    sparse = SparseConfig(sink_tokens=4, window_size=window, global_tokens=globals_,
                          block_size=16, recalibrate_every=128, recalibrate_topk=globals_,
                          prefill_chunk=256, importance="attention")
    backend = select_backend("cuda")
    model.backend = backend
    pool = BlockPool(None)
    total = prompt_len + steps + 1
    run = KVRun(cfg, sparse, dev, torch.float16, backend, pool, total_tokens=total)
    ids = torch.tensor(prompt(prompt_len, cfg.vocab_size, seed=5), device=dev)
    with torch.inference_mode(), run:
        logits = None
        for s in range(0, prompt_len, sparse.prefill_chunk):
            logits = run.step(model, ids[s:s + sparse.prefill_chunk])
        dec = GraphDecoder(model, run, total, capture=False)
        why = unsupported(model, run)
        assert why is None, why
        att = {"": None, "ATT_WARPS=2": 2, "ATT_WARPS=4": 4}[variant]  # the builds there are
        step = CudaDecodeStep(model, run, dec.dev, dec.tok, dec.nb_max, att_warps=att)
        cache = run.cache
        state = [t for t in (cache.k, cache.v, cache.score, cache.gmass, cache.gseen)]
        worst = {"logits": 0.0, "k": 0.0, "v": 0.0, "score": 0.0, "gmass": 0.0, "gseen": 0.0}
        agree = 0
        tok = logits[-1].argmax().reshape(1)
        for i in range(steps):
            dec._prepare()
            dec.tok.copy_(tok)
            if i == 0:
                if bisect:
                    saved = [t.clone() for t in state]
                    bisect_phases(step)
                    for t, b in zip(state, saved):
                        t.copy_(b)
                print("phases:", phase_check(model, run, dec, step), flush=True)
            before = [t.clone() for t in state]
            ref = model(dec.tok, dec.dev[0:1], dec.ctx).clone()
            after_ref = [t.clone() for t in state]
            for t, b in zip(state, before):
                t.copy_(b)
            got = step().clone()
            torch.cuda.synchronize()
            scale = ref.abs().max().item()
            worst["logits"] = max(worst["logits"], (got - ref).abs().max().item() / scale)
            agree += int(got.argmax().item() == ref.argmax().item())
            slot = int(dec.dev[1].item())
            bs = sparse.block_size
            for name, t, r in (("k", cache.k, after_ref[0]), ("v", cache.v, after_ref[1])):
                a = t[:, slot // bs, slot % bs].float()
                b = r[:, slot // bs, slot % bs].float()
                worst[name] = max(worst[name], ((a - b).abs().amax(dim=(1, 2))
                                                / b.abs().amax(dim=(1, 2))).max().item())
            for name, t, r, b0 in (("score", cache.score, after_ref[2], before[2]),
                                   ("gmass", cache.gmass, after_ref[3], before[3]),
                                   ("gseen", cache.gseen, after_ref[4], before[4])):
                d_got, d_ref = t - b0, r - b0
                den = d_ref.abs().max().item() or 1.0
                worst[name] = max(worst[name], (d_got - d_ref).abs().max().item() / den)
            dec.steps += 1
            dec._after_step()
            tok = got[-1].argmax().reshape(1)
    return {"head": "int4" if head_int4 else "fp16", "window": window, "globals": globals_,
            "variant": variant,
            "steps": steps, "prompt": prompt_len, "unit_pages": step.unit_pages,
            "argmax_agree": agree, "worst_rel": worst, "ctas": step.ctas, "splits": step.S,
            "smem": step.smem, "att_warps": step.att_warps, "stages": step.params.stages}


def event_ms(fn, reps: int = 30) -> float:
    """ms a call of fn, by CUDA events over reps calls after 3 warm-up calls."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.inference_mode():
        for _ in range(3):
            fn()
        start.record()
        for _ in range(reps):
            fn()
        end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def timeline(step) -> torch.Tensor:
    """One step of the profiling build (the step's own with -DTIMELINE=1) -> int64 [n_phase,
    CTAs, 5] globaltimer ns: phase start, past the barrier, x (or the attention's q) ready,
    items (or pages) done, arrived (0 where a CTA had no such point). step.kinds names the
    phases."""
    from hisparse_cli.kernels.cuda.cuda_step import F_TIMELINE

    stamps = torch.zeros((step.params.n_phase, step.ctas, 5), dtype=torch.int64,
                         device=step.ws.device)
    step._load_build(step.att_warps, ("-DTIMELINE=1",))
    step.params.stamps, step.params.flags = stamps.data_ptr(), step.params.flags | F_TIMELINE
    try:
        step()
        torch.cuda.synchronize(step.ws.device)
    finally:
        step.params.stamps, step.params.flags = 0, step.params.flags & ~F_TIMELINE
        step._load_build(step.att_warps)
    return stamps


def phase_table(step) -> dict:
    """One step's timeline by phase kind (us summed over the step): crit = the phase's share
    of the critical path (last arrival minus the previous phase's last arrival); then CTA
    means of the barrier wait, the x (or q) load, the items (or pages) and the flush."""
    st = timeline(step).double() / 1e3  # [n_phase, CTAs, 5] us
    kinds = step.kinds  # qkv, attn, o, mlp a layer, then head
    end = st[:, :, 4].max(dim=1).values
    out: dict = {}
    for i, kind in enumerate(kinds):
        r = out.setdefault(kind, {"crit": 0.0, "wait": 0.0, "x": 0.0, "work": 0.0, "flush": 0.0})
        row = st[i]
        has = row[:, 2] > 0
        r["crit"] += (end[i] - (end[i - 1] if i else row[:, 0].min())).item()
        r["wait"] += (row[:, 1] - row[:, 0]).mean().item()
        if has.any():
            h = row[has]
            r["x"] += (h[:, 2] - h[:, 1]).mean().item()
            r["work"] += (h[:, 3] - h[:, 2]).mean().item()
            r["flush"] += (h[:, 4] - h[:, 3]).mean().item()
    return out


def time_rows(a, dev) -> list[dict]:
    from hisparse_cli.engine.engine import Engine

    cfg = ModelConfig.from_dict(SHAPES["llama-3-8b"])
    backend = "triton"
    rows = []
    systems = [("fp16", False, "layers"), ("int4+head", True, "layers"),
               ("int4+head", True, "persistent")]
    if a.peer_again:  # the peer once more at the end: the ratios use the mean of its two rows
        systems.append(("fp16", False, "layers"))
    for label, awq, kernel in systems:
        if a.systems and f"{label}/{kernel}" not in a.systems.split(","):
            continue
        model = build_ours(cfg, dev, awq=awq, host_emb=False, awq_lm_head=awq)
        if kernel == "persistent":  # the layer-by-layer rows keep the engine's tiled layout
            to_items(model)
        os.environ["HISPARSE_DECODE_KERNEL"] = kernel
        kw = dict(weight_format="awq-int4" if awq else "fp16", awq_lm_head=awq)
        for prof in a.profiles.split(","):
            sparse = load_profile(prof).sparse_config()
            for ctx in [int(c) for c in a.contexts.split(",")]:
                eng = Engine(model, cfg, sparse=sparse, device=dev, kv_dtype=torch.float16,
                             backend=backend)
                seen, notes, pre = [], [], []
                try:
                    for _ in range(a.repeat):
                        r = run_ours(model, cfg, sparse, prompt(ctx, cfg.vocab_size),
                                     a.decode_tokens, backend, dev, engine=eng, **kw)
                        seen.append(r["decode_tok_s"])
                        notes.append(r.get("cuda_graph"))
                        pre.append(r["prefill_tok_s"])
                except Exception:
                    traceback.print_exc()
                    eng.release_cached_state()
                    continue
                dec = eng._decode_state.decoder
                kernel_used = dec.cuda_step is not None
                timing = {"replay_ms": event_ms(dec.graph.replay)}
                if kernel_used:  # the kernel (+ its memset) alone, and its phases
                    timing["step_ms"] = event_ms(dec.cuda_step)
                    with torch.inference_mode():
                        timing["phases_us"] = phase_table(dec.cuda_step)
                    dec.release()  # the profiling build was loaded and unloaded meanwhile
                print("   ", {k: round(v, 4) for k, v in timing.items()
                             if not k.startswith("phases_us")}, flush=True)
                for name, table in timing.items():
                    if not name.startswith("phases_us"):
                        continue
                    if name != "phases_us":
                        print(f"      {name}")
                    for kind, r in table.items():
                        print(f"      {kind:8s} " + " ".join(f"{k} {v:7.1f}" for k, v in r.items()))
                eng.release_cached_state()
                del eng
                row = {"system": label, "kernel": kernel, "persistent_ran": kernel_used, **timing,
                       "profile": prof, "context": ctx, "decode_tok_s": seen[-1],
                       "prefill_tok_s": pre[-1],
                       "decode_tok_s_repeats": seen, "graphs": notes}
                rows.append(row)
                print(f"{label:10s} {kernel:10s} {prof:10s} {ctx:6d}: "
                      f"{', '.join(f'{x:.1f}' for x in seen)} tok/s "
                      f"(persistent ran: {kernel_used})", flush=True)
        del model
        torch.cuda.empty_cache()
    os.environ.pop("HISPARSE_DECODE_KERNEL", None)
    for r in rows:
        fps = [x for x in rows if x["system"] == "fp16" and x["profile"] == r["profile"]
               and x["context"] == r["context"]]  # two with --peer-again: their mean
        fd = sum(x["decode_tok_s"] for x in fps) / len(fps) if fps else float("nan")
        fpre = sum(x["prefill_tok_s"] for x in fps) / len(fps) if fps else float("nan")
        r["vs_fp16"] = r["decode_tok_s"] / fd
        r["prefill_vs_fp16"] = r["prefill_tok_s"] / fpre
    print("\nsystem     kernel     profile    context  decode  x fp16  prefill  x fp16")
    for r in rows:
        print(f"{r['system']:10s} {r['kernel']:10s} {r['profile']:10s} {r['context']:7d} "
              f"{r['decode_tok_s']:6.1f} {r['vs_fp16']:6.2f} {r['prefill_tok_s']:8.0f} "
              f"{r['prefill_vs_fp16']:6.2f}")
    return rows


def run_bench(a) -> None:
    """`bench`: the checks, then (unless --skip-time) the timed rows."""
    out = Path(a.out or os.environ.get("OUT") or "out")
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    res = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "check": []}
    if a.check_shape == "small":
        cfg = ModelConfig.from_dict(SMALL)
    else:
        name, _, layers = a.check_shape.partition(":")
        cfg = ModelConfig.from_dict({**SHAPES[name], "num_hidden_layers": int(layers or 2)})
    cases = [CHECKS[int(i)] for i in a.check_cases.split(",")] if a.check_cases else CHECKS
    builds = ([] if a.no_default_check else [""]) + list(filter(None, a.check_variants.split(";")))
    checks = [(c, v) for v in builds for c in cases]
    for (head_int4, window, globals_, prompt_len), variant in checks:
        try:
            r = check_one(cfg, head_int4, window, globals_, a.check_steps, prompt_len, dev,
                          variant, a.bisect)
        except Exception:  # reported, and the timing still runs
            traceback.print_exc()
            res["check"].append({"head_int4": head_int4, "window": window,
                                 "error": traceback.format_exc()})
            continue
        res["check"].append(r)
        w = r["worst_rel"]
        print(f"check [{variant or 'default'}] head {r['head']} window {window} globals "
              f"{globals_} ({r['unit_pages']} pages a split, {r['att_warps']} warps a page, "
              f"{r['stages']} slots): argmax agree {r['argmax_agree']}/{r['steps']}, worst rel "
              + " ".join(f"{k} {v:.2e}" for k, v in w.items()), flush=True)
    print(f"check done in {time.perf_counter() - t0:.1f} s", flush=True)
    if not a.skip_time:
        res["time"] = time_rows(a, dev)
    (out / "gpu_cuda_decode.json").write_text(json.dumps(res, indent=1, default=str))


# == profile: where a decode token's time goes ==============================================
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
         "aten::item", "aten::_local_scalar_dense", "aten::nonzero")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC",
            "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")


def phase(name: str, res: dict, budget: float, need: float, fn, *args):
    """Run fn unless it would overrun the budget; any error is printed and recorded."""
    have = left(budget)
    if have < need:
        res.setdefault("skipped", []).append(f"{name}: ~{need:.0f} s needed, {have:.0f} s left")
        log("skip " + res["skipped"][-1])
        return None
    log(f"{name} ...")
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - recorded; the other phases go on
        traceback.print_exc()
        res.setdefault("errors", []).append(f"{name}: {type(exc).__name__}: {exc}"[:300])
        log(f"{name} FAILED: {type(exc).__name__}: {exc}")
        return None


def us(xs) -> dict:
    xs = list(xs)
    if not xs:
        return {}
    return {"mean_us": 1e6 * statistics.fmean(xs), "median_us": 1e6 * statistics.median(xs),
            "max_us": 1e6 * max(xs), "n": len(xs)}


class Stamp:
    """Wraps a bound method: host seconds of each call appended to `times`."""

    def __init__(self, fn, times: list) -> None:
        self.fn, self.times = fn, times

    def __call__(self, *a, **k):
        t = time.perf_counter()
        r = self.fn(*a, **k)
        self.times.append(time.perf_counter() - t)
        return r


class TimedGraph:
    """Stands in for the captured CUDAGraph: CUDA events around each replay, host launch time."""

    def __init__(self, graph, launch: list, events: list) -> None:
        self.graph, self.launch, self.events = graph, launch, events

    def replay(self) -> None:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        a.record()
        self.graph.replay()
        b.record()
        self.launch.append(time.perf_counter() - t)
        self.events.append((a, b))


# -- (a) the engine as benchmarked ----------------------------------------------------------
GEN_EXTRA: dict = {}  # --cli-sampling: the CLI's default penalty and n-gram ban as well


def engine_generate(eng, ids, new) -> dict:
    res = eng.generate(ids, max_new_tokens=new, min_new_tokens=new, **GEN_EXTRA)
    s = res.stats
    return {"prefill_s": s.prefill_seconds, "prefill_tok_s": s.prefill_tok_s,
            "decode_s": s.decode_seconds, "new_tokens": s.new_tokens,
            "decode_tok_s_as_gpu_engine": (s.new_tokens - 1) / s.decode_seconds,
            "recalibrations": s.recalibrations, "peak_bytes": s.peak_memory_bytes}


def prefill(eng, run, ids) -> tuple[torch.Tensor, float]:
    chunk, logits = eng.sparse.prefill_chunk, None
    ids = ids.to(eng.device)  # run.step takes token ids on the model's device
    sync(eng.device)
    t0 = time.perf_counter()
    for s in range(0, ids.numel(), chunk):
        logits = run.step(eng.model, ids[s:s + chunk])
    prefill.last_launch_s = time.perf_counter() - t0  # host time to issue it (no sync inside)
    sync(eng.device)
    return logits, time.perf_counter() - t0


# -- (b)-(d) the instrumented decode loop ----------------------------------------------------
def decode_profile(eng, ids, steps: int, prof_steps: int, replays: int) -> dict:
    from hisparse_cli.engine.cuda_graph import GraphDecoder
    from hisparse_cli.engine.sampling.device import DeviceSampler

    dev, out = eng.device, {}
    total = steps + prof_steps + 2
    gen = GenerationConfig(max_new_tokens=total, min_new_tokens=total, **GEN_EXTRA)
    eos = set(eng.cfg.eos_token_ids or [0])
    eos_t = torch.tensor(sorted(eos), dtype=torch.int64, device=dev)
    run, _ = eng.new_run(ids.numel() + total)
    with torch.inference_mode(), run:
        logits, out["prefill_s"] = prefill(eng, run, ids)
        dec = GraphDecoder(eng.model, run, ids.numel() + total,
                           persistent=eng.execution.persistent)
        # as Engine._decode_graph: the step samples itself (the plan's default on CUDA)
        fused = eng.execution.graph_sampler.value and dec.sample_in_graph(gen, eos)
        out["graph_sampler"] = fused
        if fused:
            dec.sample_first(logits)
            toks = dec.sampler.toks
        else:
            sampler = DeviceSampler(gen, logits.shape[-1], dev)
            toks = torch.empty(total, dtype=torch.int64, device=dev)
        host: dict[str, list] = {k: [] for k in ("sample", "prepare", "after_step", "readback",
                                                 "replay_launch", "step_total")}
        dec._prepare = Stamp(dec._prepare, host["prepare"])
        dec._after_step = Stamp(dec._after_step, host["after_step"])
        events: list = []
        state = {"i": 0, "read": 0}

        cuda = dev.type == "cuda"
        pinned = torch.empty(total, dtype=torch.int64, pin_memory=cuda)
        ready = torch.cuda.Event() if cuda else None

        def one() -> torch.Tensor:  # one iteration of Engine._decode_graph's loop: the
            nonlocal logits         # read-back copy queued, the next step queued, then the wait
            i = state["i"]
            t0 = time.perf_counter()
            tok = None
            if not fused:
                tok = sampler(logits, eos_t)
                toks[i:i + 1].copy_(tok)
            t1 = time.perf_counter()
            host["sample"].append(t1 - t0)
            due = (i + 1) % 16 == 0
            if due:
                pinned[state["read"]:i + 1].copy_(toks[state["read"]:i + 1], non_blocking=cuda)
                if ready is not None:
                    ready.record()
            logits = dec.step(tok)
            if due:
                t2 = time.perf_counter()
                if ready is not None:
                    ready.synchronize()
                pinned[state["read"]:i + 1].tolist()
                state["read"] = i + 1
                host["readback"].append(time.perf_counter() - t2)
            host["step_total"].append(time.perf_counter() - t0)
            state["i"] += 1
            return logits

        t0 = time.perf_counter()
        one()  # eager warm-up + capture (CUDA), or a plain static step (CPU)
        sync(dev)
        out["first_step_ms"] = 1e3 * (time.perf_counter() - t0)
        for v in host.values():
            v.clear()
        if dec.graph is not None:
            dec.graph = TimedGraph(dec.graph, host["replay_launch"], events)
        t0 = time.perf_counter()
        for _ in range(steps):
            one()
        sync(dev)
        wall = (time.perf_counter() - t0) / steps
        out["steady_ms_per_token"] = 1e3 * wall
        out["steady_tok_s"] = 1.0 / wall
        out["host"] = {k: us(v) for k, v in host.items()}
        out["host_per_token_us"] = {k: 1e6 * sum(v) / steps for k, v in host.items()}
        if events:
            rep = [a.elapsed_time(b) for a, b in events]
            gap = [b.elapsed_time(a2) for (_, b), (a2, _) in zip(events, events[1:])]
            out["gpu_replay_ms"] = {"mean": statistics.fmean(rep), "median": statistics.median(rep),
                                    "max": max(rep)}
            out["gpu_between_replays_ms"] = {"mean": statistics.fmean(gap),
                                             "median": statistics.median(gap), "max": max(gap)}
        out["profiler"] = guarded(out, "profiler", profile_steps, one, prof_steps, dev)
        sync(dev)
        # (d) the graph alone, then one eager step's kernels (state is scratch from here on)
        out["replay_only"] = guarded(out, "replay_only", replay_only, dec, replays, dev)
        out["eager_step_kernels"] = guarded(out, "eager_kernels", eager_kernels, dec, dev)
    return out


def guarded(out: dict, name: str, fn, *args):
    """A sub-part of a phase: its error is printed and recorded, the phase's other numbers kept."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        out.setdefault("errors", []).append(f"{name}: {type(exc).__name__}: {exc}"[:300])
        return None


def replay_only(dec, replays: int, dev) -> dict | None:
    if dec.graph is None:
        return None
    g = dec.graph.graph
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    a.record()
    t0 = time.perf_counter()
    for _ in range(replays):
        g.replay()
    t_launch = time.perf_counter() - t0
    b.record()
    sync(dev)
    return {"gpu_ms": a.elapsed_time(b) / replays, "launch_host_us": 1e6 * t_launch / replays}


def _dev_time(e) -> float:
    for k in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(e, k):
            return float(getattr(e, k))
    return 0.0


def _on_device(e) -> bool:
    """A kernel/memcpy event (not a CPU op with its kernels attributed to it)."""
    from torch.autograd import DeviceType

    return getattr(e, "device_type", None) == DeviceType.CUDA


def exclusive_us(spans: list[tuple[str, float, float]]) -> dict[str, float]:
    """Device time of each kernel name on the critical path of one stream's timeline: spans
    (name, start, end) in any order; each span is charged only the part after everything
    that started before it has ended. With programmatic dependent launch (kernels/pdl.py) a
    kernel's span starts at its early launch and overlaps its predecessor, so the profiler's
    per-kernel totals add up to more than the busy time; these add up to the union."""
    out: dict[str, float] = {}
    busy_until = float("-inf")
    for name, start, end in sorted(spans, key=lambda t: (t[1], t[2])):
        out[name] = out.get(name, 0.0) + max(0.0, end - max(start, busy_until))
        busy_until = max(busy_until, end)
    return out


def _device_spans(prof) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every device event (kernels, copies) of a profile."""
    spans = []
    for e in prof.events():
        if _on_device(e):
            spans.append((e.name[:70], float(e.time_range.start), float(e.time_range.end)))
    return spans


def profile_steps(one, n: int, dev) -> dict:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(n):
            one()
        sync(dev)
    ka = prof.key_averages()
    cpu = sorted(ka, key=lambda e: e.self_cpu_time_total, reverse=True)
    top = [{"name": e.key[:60], "calls_per_token": e.count / n,
            "self_cpu_us_per_token": e.self_cpu_time_total / n} for e in cpu[:15]]
    waits = {e.key: {"calls_per_token": e.count / n, "us_per_token": e.self_cpu_time_total / n}
             for e in ka if any(e.key.startswith(w) for w in WAITS)
             and not e.key.startswith("cudaMemcpyAsync")}
    launches = {e.key: e.count / n for e in ka if e.key in LAUNCHES}
    kern = sorted((e for e in ka if _on_device(e)),
                  key=_dev_time, reverse=True)
    gpu = [{"name": e.key[:70], "calls_per_token": e.count / n, "gpu_us_per_token": _dev_time(e) / n}
           for e in kern[:12]]
    out = {"steps": n, "top_cpu_ops": top, "waits": waits, "launches_per_token": launches,
           "top_gpu_kernels": gpu, "gpu_kernels_per_token": sum(e.count for e in kern) / n}
    try:  # the event API differs between torch versions: never lose the rest to it
        excl = exclusive_us(_device_spans(prof))
        out["critical_path_kernels"] = [{"name": k, "exclusive_us_per_token": v / n} for k, v
                                        in sorted(excl.items(), key=lambda kv: -kv[1])[:12]]
        out["device_busy_us_per_token"] = sum(excl.values()) / n
    except Exception as exc:  # noqa: BLE001
        out["critical_path_error"] = f"{type(exc).__name__}: {exc}"
    return out


def family(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("gemm", "gemv", "cutlass", "cublas", "sm90_xmma", "nvjet", "splitk")):
        return "gemm/gemv"
    if any(k in n for k in ("_attn", "_mass", "store_kv", "triton")):
        return "triton attention+scoring"
    if "index" in n or "scatter" in n or "gather" in n:
        return "index ops"
    return "elementwise/reduce/other"


def eager_kernels(dec, dev) -> dict:
    """The decode step's body run eagerly once under the profiler: its kernels (the graph
    replays the same list)."""
    if dev.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    dec._body()
    sync(dev)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        dec._body()
        sync(dev)
    fam: dict[str, dict] = {}
    small_n, small_us, n_all, t_all = 0, 0.0, 0, 0.0
    for e in prof.events():
        if not _on_device(e):
            continue
        t = float(e.device_time_total)
        f = fam.setdefault(family(e.key), {"kernels": 0, "gpu_us": 0.0})
        f["kernels"] += 1
        f["gpu_us"] += t
        n_all, t_all = n_all + 1, t_all + t
        if t < 5.0:
            small_n, small_us = small_n + 1, small_us + t
    return {"kernels": n_all, "gpu_us_sum": t_all, "by_family": fam,
            "kernels_under_5us": small_n, "gpu_us_in_kernels_under_5us": small_us}


# -- (e) importance scoring -------------------------------------------------------------------
def scoring(eng, ids, sparse: SparseConfig, repeats: int, replays: int) -> dict:
    from hisparse_cli.engine.cuda_graph import GraphDecoder
    from hisparse_cli.engine.kv_cache import PagedKVCache

    out: dict = {"context": ids.numel(), "baseline": "importance='uniform'"}
    times = {"attention": [], "uniform": []}
    for _ in range(repeats):
        for imp in ("attention", "uniform"):
            eng.sparse = sparse.with_overrides(importance=imp)
            run, _ = eng.new_run(ids.numel() + 2)
            with torch.inference_mode(), run:
                _, t = prefill(eng, run, ids)
                if imp == "uniform" and eng.device.type == "cuda" and "uniform_replay_ms" not in out:
                    dec = GraphDecoder(eng.model, run, ids.numel() + 2,
                                       persistent=eng.execution.persistent)
                    tok = torch.zeros(1, dtype=torch.int64, device=eng.device)
                    dec.step(tok)  # warm-up + capture
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    for _ in range(replays):
                        dec.graph.replay()
                    b.record()
                    sync(eng.device)
                    out["uniform_replay_ms"] = a.elapsed_time(b) / replays
            times[imp].append(t)
            out.setdefault("host_launch_s", {}).setdefault(imp, []).append(prefill.last_launch_s)
            free_all(eng.device)
    eng.sparse = sparse
    best = {k: min(v) for k, v in times.items()}
    out["prefill_s"] = times
    out["prefill_s_best"] = best
    out["scoring_pct_of_prefill"] = 100.0 * (best["attention"] - best["uniform"]) / best["attention"]
    if eng.device.type == "cuda":  # which kernels/ops the difference is made of
        by = {imp: prefill_kernels(eng, ids, sparse.with_overrides(importance=imp))
              for imp in ("attention", "uniform")}
        eng.sparse = sparse
        names = set(by["attention"]["gpu"]) | set(by["uniform"]["gpu"])
        diff = []
        for n in names:
            a_, u_ = by["attention"]["gpu"].get(n, [0, 0.0]), by["uniform"]["gpu"].get(n, [0, 0.0])
            diff.append({"name": n[:70], "calls_attention": a_[0], "calls_uniform": u_[0],
                         "gpu_ms_attention": a_[1] / 1e3, "gpu_ms_uniform": u_[1] / 1e3,
                         "delta_ms": (a_[1] - u_[1]) / 1e3})
        diff.sort(key=lambda r: -abs(r["delta_ms"]))
        out["kernel_delta"] = diff[:14]
        out["gpu_ms_total"] = {k: v["gpu_total_us"] / 1e3 for k, v in by.items()}
        out["kernels_total"] = {k: v["kernels"] for k, v in by.items()}
        out["cpu_ops_total"] = {k: v["cpu_ops"] for k, v in by.items()}
    # recalibration / eviction times: synchronised around each call (own run)
    rec: dict[str, list] = {"recalibrate": [], "evict_to_candidates": []}
    orig = {k: getattr(PagedKVCache, k) for k in rec}

    def timed(name):
        def w(self, *a, **k):
            sync(self.device)
            t = time.perf_counter()
            r = orig[name](self, *a, **k)
            sync(self.device)
            rec[name].append(time.perf_counter() - t)
            return r
        return w

    try:
        for k in rec:
            setattr(PagedKVCache, k, timed(k))
        run, _ = eng.new_run(ids.numel() + 2)
        with torch.inference_mode(), run:
            _, t = prefill(eng, run, ids)
    finally:
        for k, f in orig.items():
            setattr(PagedKVCache, k, f)
    out["synchronised_run_prefill_s"] = t
    for k, v in rec.items():
        out[k] = {**us(v), "total_ms": 1e3 * sum(v),
                  "pct_of_prefill": 100.0 * sum(v) / best["attention"]}
    return out


def prefill_kernels(eng, ids, sparse: SparseConfig) -> dict:
    """One prefill under torch.profiler: GPU time and count per kernel name, CPU op count."""
    from torch.profiler import ProfilerActivity, profile

    eng.sparse = sparse
    run, _ = eng.new_run(ids.numel() + 2)
    with torch.inference_mode(), run:
        prefill(eng, run, ids[: 4 * sparse.prefill_chunk])  # warm (same shapes)
    run, _ = eng.new_run(ids.numel() + 2)
    with torch.inference_mode(), run, profile(activities=[ProfilerActivity.CPU,
                                                          ProfilerActivity.CUDA]) as prof:
        prefill(eng, run, ids)
    gpu: dict[str, list] = {}
    n_cpu = 0
    for e in prof.key_averages():
        if _on_device(e):
            g = gpu.setdefault(e.key, [0, 0.0])
            g[0] += e.count
            g[1] += _dev_time(e)
        elif e.key.startswith("aten::"):
            n_cpu += e.count
    free_all(eng.device)
    return {"gpu": gpu, "gpu_total_us": sum(v[1] for v in gpu.values()),
            "kernels": sum(v[0] for v in gpu.values()), "cpu_ops": n_cpu}


# -- report ---------------------------------------------------------------------------------
def report(res: dict) -> None:
    samplers = {(r.get("decode") or {}).get("graph_sampler") for r in res["contexts"]}
    print(f"\n== decode per token (ms unless said); {res.get('weights')}, sampling "
          f"{res.get('sampling')}, sampler in the graph: {', '.join(map(str, samplers))}")
    hdr = ("ctx", "gen tok/s", "steady tok/s", "wall", "replay GPU", "between GPU", "graph-only",
           "1st step", "host: sample", "prepare", "launch", "after", "readback")
    print("  ".join(f"{h:>12}" for h in hdr))
    for r in res["contexts"]:
        d, e, h = r.get("decode") or {}, r.get("engine") or {}, (r.get("decode") or {}).get(
            "host_per_token_us", {})

        def f(x, fmt="{:.3f}"):
            return "-" if x is None else fmt.format(x)

        cells = [r["context"], f(e.get("decode_tok_s_as_gpu_engine"), "{:.1f}"),
                 f(d.get("steady_tok_s"), "{:.1f}"), f(d.get("steady_ms_per_token")),
                 f((d.get("gpu_replay_ms") or {}).get("median")),
                 f((d.get("gpu_between_replays_ms") or {}).get("median")),
                 f((d.get("replay_only") or {}).get("gpu_ms")), f(d.get("first_step_ms"), "{:.1f}")] + [
                 f(h.get(k, 0) / 1e3) for k in ("sample", "prepare", "replay_launch",
                                                 "after_step", "readback")]
        print("  ".join(f"{c!s:>12}" for c in cells))
    for r in res["contexts"]:
        p = (r.get("decode") or {}).get("profiler") or {}
        if p:
            print(f"\n== ctx {r['context']}: torch.profiler over {p['steps']} steps "
                  f"(GPU kernels/token {p['gpu_kernels_per_token']:.0f})")
            print("  waits/token:", {k: round(v["calls_per_token"], 2) for k, v in p["waits"].items()})
            print("  launches/token:", {k: round(v, 1) for k, v in p["launches_per_token"].items()})
            for o in p["top_cpu_ops"][:10]:
                print(f"  {o['name']:<60} {o['calls_per_token']:6.1f}/tok {o['self_cpu_us_per_token']:8.1f} us")
            for o in p["top_gpu_kernels"][:8]:
                print(f"  GPU {o['name']:<66} {o['calls_per_token']:6.1f}/tok {o['gpu_us_per_token']:8.1f} us")
            for o in p.get("critical_path_kernels", [])[:8]:  # overlap-free (PDL)
                print(f"  critical path {o['name']:<56} {o['exclusive_us_per_token']:8.1f} us")
        k = (r.get("decode") or {}).get("eager_step_kernels") or {}
        if k:
            print(f"  eager step: {k['kernels']} kernels, {k['gpu_us_sum'] / 1e3:.2f} ms GPU; "
                  f"{k['kernels_under_5us']} under 5 us ({k['gpu_us_in_kernels_under_5us'] / 1e3:.2f} ms); "
                  + ", ".join(f"{n}: {v['kernels']} / {v['gpu_us'] / 1e3:.2f} ms"
                              for n, v in k["by_family"].items()))
    s = res.get("scoring")
    if s:
        b = s["prefill_s_best"]
        print(f"\n== importance scoring at {s['context']} (prefill only; baseline {s['baseline']})")
        print(f"  prefill attention {b['attention']:.3f} s, uniform {b['uniform']:.3f} s -> scoring "
              f"{s['scoring_pct_of_prefill']:.1f} % of prefill (target < 5 %)")
        if s.get("host_launch_s"):
            print("  host time to issue the prefill (s):",
                  {k: [round(x, 3) for x in v] for k, v in s["host_launch_s"].items()})
        for k in ("recalibrate", "evict_to_candidates"):
            v = s.get(k) or {}
            if v:
                print(f"  {k}: {v['n']} calls, mean {v['mean_us'] / 1e3:.2f} ms, max "
                      f"{v['max_us'] / 1e3:.2f} ms, total {v['total_ms']:.1f} ms "
                      f"({v['pct_of_prefill']:.1f} % of prefill)")
        if s.get("kernel_delta"):
            print(f"  one prefill under the profiler: GPU kernel time {s['gpu_ms_total']}, kernels "
                  f"{s['kernels_total']}, aten ops {s['cpu_ops_total']}")
            for r in s["kernel_delta"]:
                print(f"  {r['name']:<70} {r['calls_attention']:6d} / {r['calls_uniform']:6d} calls "
                      f"{r['gpu_ms_attention']:8.2f} / {r['gpu_ms_uniform']:8.2f} ms  delta {r['delta_ms']:+7.2f}")
        if "uniform_replay_ms" in s:
            print(f"  decode graph replay with uniform: {s['uniform_replay_ms']:.3f} ms")


def run_profile(a) -> None:
    """`profile`: phases (a)-(e) per context, then the report."""
    if a.cli_sampling:
        GEN_EXTRA.update(cli_sampling())
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    res: dict = {"argv": sys.argv, "contexts": []}
    try:
        res["env"] = environment(dev)
    except Exception as exc:  # noqa: BLE001
        res["env"] = {"error": str(exc)}
    backend, why = pick_backend(dev)
    res["backend"], res["backend_reason"] = backend, why
    log(f"device {dev}; backend: {why}")
    sparse = load_profile("h200-141g").sparse_config()
    shape = SHAPES["llama-3-8b"]
    extra = a.decode_tokens + a.profile_steps + 2
    contexts = [min(int(c), shape["max_position_embeddings"] - extra) for c in a.contexts.split(",")]
    if a.smoke:
        shape = SMOKE
        sparse = sparse.with_overrides(window_size=256, global_tokens=32, recalibrate_topk=32,
                                       prefill_chunk=128, recalibrate_every=128)
        contexts = [1024, 2048]
        a.decode_tokens, a.profile_steps, a.replays = min(a.decode_tokens, 40), min(a.profile_steps, 8), 5
    res["sparse"] = sparse.__dict__
    res["weights"] = ("awq-int4" + ("+int4-lm_head" if a.awq_lm_head else "")) if a.awq \
        else "fp16"
    res["sampling"] = GEN_EXTRA or "greedy"
    cfg = ModelConfig.from_dict(shape)
    from hisparse_cli.engine.engine import Engine

    def build():
        model = build_ours(cfg, dev, awq=a.awq, host_emb=False, awq_lm_head=a.awq_lm_head)
        return model.float() if dev.type == "cpu" else model

    model = phase("build model", res, a.time_budget, 0, build)
    if model is None:
        (out_dir / "gpu_decode_profile.json").write_text(json.dumps(res, indent=2, default=str))
        return
    kv = torch.float16 if dev.type == "cuda" else torch.float32
    eng = Engine(model, cfg, sparse=sparse, device=dev, kv_dtype=kv, backend=backend)
    log("model built")
    warm = sparse.window_size + 3 * sparse.prefill_chunk
    phase("warm-up (Triton JIT)", res, a.time_budget, 20, engine_generate, eng,
          torch.tensor(prompt(warm, cfg.vocab_size)), 4)
    for i, ctx in enumerate(contexts):
        ids = torch.tensor(prompt(ctx, cfg.vocab_size))
        row: dict = {"context": ctx}
        res["contexts"].append(row)
        need = 8 + ctx / 6000
        row["engine"] = phase(f"(a) generate ctx {ctx}", res, a.time_budget, need,
                              engine_generate, eng, ids, a.decode_tokens)
        free_all(dev)
        row["decode"] = phase(f"(b-d) decode profile ctx {ctx}", res, a.time_budget, need + 10,
                              decode_profile, eng, ids, a.decode_tokens, a.profile_steps, a.replays)
        free_all(dev)
        if i == 0 and not a.no_scoring:
            res["scoring"] = phase(f"(e) scoring ctx {ctx}", res, a.time_budget, 4 * need,
                                   scoring, eng, ids, sparse, 2, a.replays)
            free_all(dev)
        (out_dir / "gpu_decode_profile.json").write_text(json.dumps(res, indent=2, default=str))
    try:
        report(res)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    (out_dir / "gpu_decode_profile.json").write_text(json.dumps(res, indent=2, default=str))
    log(f"wrote {out_dir / 'gpu_decode_profile.json'}; skipped: {res.get('skipped', [])}; "
        f"errors: {res.get('errors', [])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("bench", help="the persistent INT4 decode kernel: checked against the "
                       "Triton step, then timed against the fp16 engine")
    p.add_argument("--out", default=None, help="output folder (default: $OUT, else ./out)")
    p.add_argument("--skip-time", action="store_true")
    p.add_argument("--check-steps", type=int, default=40)
    p.add_argument("--contexts", default="32768")
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--profiles", default="h200-141g,4060ti-6g")
    p.add_argument("--check-variants", default="", help="builds checked too, ';'-separated: "
                   "ATT_WARPS=2 (the 2-warp attention build) or ATT_WARPS=4")
    p.add_argument("--peer-again", action="store_true",
                   help="run the fp16 rows again after the INT4 ones; ratios against the "
                   "mean of the two (the peer varies 3-5 %% between runs)")
    p.add_argument("--systems", default="", help="e.g. int4+head/persistent (default: all)")
    p.add_argument("--check-shape", default="small", help="the checks' model: small (4 "
                   "layers, hidden 1024) or llama-3-8b:N (the 8B shape with N layers: every "
                   "CTA has many items a phase, so the ring goes round)")
    p.add_argument("--check-cases", default="", help="indices into CHECKS (default: all)")
    p.add_argument("--no-default-check", action="store_true",
                   help="check only the --check-variants builds")
    p.add_argument("--bisect", action="store_true", help="before the first checked step, "
                   "run the step stopped after each phase (finds a faulting phase; use "
                   "with CUDA_LAUNCH_BLOCKING=1)")
    p.set_defaults(run=run_bench)
    p = sub.add_parser("profile", help="where a decode token's time goes; what importance "
                       "scoring costs")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--contexts", default="32768,131072")
    p.add_argument("--decode-tokens", type=int, default=96, help="(a) and (b) decode steps")
    p.add_argument("--profile-steps", type=int, default=32)
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--time-budget", type=float, default=230.0, help="seconds for the whole run")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU ok)")
    p.add_argument("--awq", action="store_true", help="AWQ INT4 (g128) linears instead of fp16")
    p.add_argument("--awq-lm-head", action="store_true", help="with --awq: the lm_head INT4 too")
    p.add_argument("--cli-sampling", action="store_true",
                   help="decode with the CLI's default penalty and n-gram ban (not plain greedy)")
    p.add_argument("--no-scoring", action="store_true", help="skip phase (e)")
    p.set_defaults(run=run_profile)
    a = ap.parse_args()
    a.run(a)


if __name__ == "__main__":
    main()
