"""The persistent decode step (kernels/cuda/cuda_step.py, kernels/cuda/decode_step.cu) on the GPU:
checked against the engine's layer-by-layer Triton step, then timed inside the engine.

    python3 benchmarks/gpu_cuda_decode.py [--out DIR] [--skip-time]
        [--contexts 32768] [--decode-tokens 256] [--profiles h200-141g,4060ti-6g]

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
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from hisparse_cli.config.settings import SparseConfig  # noqa: E402
from hisparse_cli.model.config import ModelConfig  # noqa: E402

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
    from gpu_engine import build_ours, prompt

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
    from gpu_engine import build_ours, prompt, run_ours

    from hisparse_cli.engine.engine import Engine
    from hisparse_cli.planner.shapes import SHAPES
    from hisparse_cli.config.profiles import load_profile

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-time", action="store_true")
    ap.add_argument("--check-steps", type=int, default=40)
    ap.add_argument("--contexts", default="32768")
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--profiles", default="h200-141g,4060ti-6g")
    ap.add_argument("--check-variants", default="", help="builds checked too, ';'-separated: "
                    "ATT_WARPS=2 (the 2-warp attention build) or ATT_WARPS=4")
    ap.add_argument("--peer-again", action="store_true",
                    help="run the fp16 rows again after the INT4 ones; ratios against the "
                    "mean of the two (the peer varies 3-5 %% between runs)")
    ap.add_argument("--systems", default="", help="e.g. int4+head/persistent (default: all)")
    ap.add_argument("--check-shape", default="small", help="the checks' model: small (4 "
                    "layers, hidden 1024) or llama-3-8b:N (the 8B shape with N layers: every "
                    "CTA has many items a phase, so the ring goes round)")
    ap.add_argument("--check-cases", default="", help="indices into CHECKS (default: all)")
    ap.add_argument("--no-default-check", action="store_true",
                    help="check only the --check-variants builds")
    ap.add_argument("--bisect", action="store_true", help="before the first checked step, "
                    "run the step stopped after each phase (finds a faulting phase; use "
                    "with CUDA_LAUNCH_BLOCKING=1)")
    a = ap.parse_args()
    out = Path(a.out or os.environ.get("OUT") or "out")
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    res = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "check": []}
    if a.check_shape == "small":
        cfg = ModelConfig.from_dict(SMALL)
    else:
        from hisparse_cli.planner.shapes import SHAPES
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


if __name__ == "__main__":
    main()
