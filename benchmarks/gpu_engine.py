"""GPU benchmark and planner validation (issue: GPU path, exact memory planner, VRAM budgets).

    python benchmarks/gpu_engine.py [--out DIR] [--time-budget 540] [--budget-gib 6] [--smoke]
    python benchmarks/gpu_engine.py --retrieval [--out DIR] [--contexts 32768,131056]
        [--budget-gib 6] [--decode-tokens 64] [--retrieval-tokens 1024] [--window N]
        [--lm-head-format checkpoint|int8] [--every 1,4,8]

One run, one H200, random weights built on the device (no download, no files):
  (a) planner vs measured: `plan_memory(...).peak_allocated_bytes` against the
      torch.cuda.max_memory_allocated of Engine.generate (reset at its start) for (context,
      profile) pairs on a Llama-3-8B-shaped fp16 model; plus the calibration constants the
      planner ships (CUDA context, cuBLAS workspace), measured here.
  (b) speed at 8K/32K/128K: our engine (h200-141g profile) vs HF transformers dense (SDPA,
      fp16, DynamicCache, logits_to_keep=1 as generate sets it) and HF static cache with the
      auto-compiled decode step (generate(cache_implementation="static"): torch.compile,
      mode reduce-overhead), same weights (HF's tensors are shared with ours), same prompt.
  (c) the bandwidth-bound decode limit: device copy bandwidth / bytes read per decode token
      (weights + KV actually read), and each system's fraction of it.
  (d) a 6 GiB card driving a display emulated with set_per_process_memory_fraction
      (hisparse_cli.planner.vram: the allocator may reserve card - DISPLAY_BYTES - the CUDA
      context measured here; each row records the reserved peak beside the allocated one): the
      4060ti-6g profile, 32K and 128K prompts, an 8B-shaped random AWQ INT4 model with host
      embeddings and a Llama-3.2-1B-shaped fp16 model, each run only if the planner says it fits.
  (e) --awq-vs-fp16: the same 8B shape with fp16 and with AWQ INT4 (g128) weights, same sparse
      settings, same prompts: prefill and decode tok/s and the INT4/fp16 ratios.
  (f) --profile-prefill [--sweep K=V,...] [--breakdown]: 4060ti-6g as the CLI runs it (AWQ 8B,
      host embeddings, INT8 head, --attention auto's working set) in the emulated --budget-gib
      card, each --sweep override a row, against h200-141g (AWQ 8B on the whole card) at the
      last of --contexts; with --breakdown a torch.profiler kernel table of a 16K prefill each.
Prints compact tables; writes $OUT/gpu_engine.json (OUT env or --out, default ./out).

--retrieval (issue 41; BENCHMARKS.md): the retrieval tier vs eviction-only at the same resident
KV, alone: a Llama-3-8B-shaped AWQ INT4 model, embeddings in host RAM, the --profile
(4060ti-6g) in a --budget-gib card emulated with set_per_process_memory_fraction (0: the whole
card). For each context, in the same run, three settings over the profile's:
  eviction-only  the profile's window / globals, window widened by retrieval_tokens + the
                 page-cache and summary bytes (the same resident KV; printed side by side)
  eviction-only, layers   the same, decoded layer by layer (HISPARSE_DECODE_KERNEL=layers)
  retrieval      the profile's settings + retrieval_tokens (page cache = retrieval_tokens),
                 decoded as the run decodes it (auto: the persistent kernel, which reads the
                 page cache beside the globals; the page choice runs before it); with
                 --every 1,4,8 one row per retrieval_every (decode steps a choice serves)
  retrieval ..., layers   the same, decoded layer by layer (with --retrieval-layers)
Per run: prefill and decode tok/s, their ratios (retrieval / eviction-only), host->device bytes
per decoded token (RunStats.bytes_to_cache over the decode), the page-cache hit rate, pages
retrieved per step, the planner's device peak vs torch.cuda.max_memory_allocated and its host
offload store vs the pinned bytes allocated. Each timed run follows an untimed one of the same
setting on the same Engine (compilation, the graph's capture and the pinned store's allocation
stay out of the row; its decode replays the kept graph), whose decode rate is kept beside it.
Writes $OUT/gpu_retrieval.json, after every row ("complete": false until the run ends).
Attention backend: Triton when kernels/attention/attention_triton.py imports and agrees with the torch
reference on a smoke shape, else the torch reference (HISPARSE_BACKEND=torch), said loudly.
Phases that would overrun --time-budget are skipped with the reason printed.
--smoke: tiny shapes and contexts (also runs on a CPU, without the memory/bandwidth parts).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from hisparse_cli.config.env import prefer_expandable_segments  # noqa: E402

ALLOC_CONF = prefer_expandable_segments()  # the CLI's allocator, unless PYTORCH_*ALLOC_CONF is set

import torch  # noqa: E402
from torch import nn  # noqa: E402

from hisparse_cli.config.settings import SparseConfig  # noqa: E402
from hisparse_cli.model.config import ModelConfig  # noqa: E402
from hisparse_cli.planner.memory import CUDA_CONTEXT_BYTES, GIB, plan_memory  # noqa: E402
from hisparse_cli.planner.shapes import SHAPES  # noqa: E402
from hisparse_cli.config.profiles import load_profile  # noqa: E402
from hisparse_cli.engine.retrieval_sizes import summary_bytes  # noqa: E402

MIB = 1 << 20
T0 = time.perf_counter()
LLAMA_1B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
            "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "tie_word_embeddings": True,
            "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
SMOKE = {"model_type": "llama", "vocab_size": 4096, "hidden_size": 256,
         "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 2, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
         "rope_theta": 10000.0, "tie_word_embeddings": False}
SKIPPED: list[str] = []


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def left(budget: float) -> float:
    return budget - (time.perf_counter() - T0)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def free_all(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def gib(n) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


# -- environment, calibration, backend ---------------------------------------------------------
def environment(dev: torch.device) -> dict:
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__,
           "device": str(dev), "python": sys.version.split()[0], "cuda_alloc_conf": ALLOC_CONF}
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as exc:  # noqa: BLE001
        env["triton"] = f"unavailable: {exc}"
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        env.update(gpu=p.name, sms=p.multi_processor_count, total_bytes=p.total_memory)
    return env


def calibrate(dev: torch.device) -> dict:
    """CUDA context (device memory outside torch's allocator) and cuBLAS workspace bytes."""
    if dev.type != "cuda":
        return {}
    torch.cuda.init()
    torch.empty(1, device=dev)
    free, total = torch.cuda.mem_get_info(dev)
    context = total - free - torch.cuda.memory_reserved(dev)
    a = torch.randn(256, 256, device=dev, dtype=torch.float16)
    b = torch.randn(256, device=dev, dtype=torch.float16)
    sync(dev)
    base = torch.cuda.memory_allocated(dev)
    c = a @ a
    del c
    sync(dev)
    ws_mm = torch.cuda.memory_allocated(dev) - base
    c = torch.nn.functional.linear(a, a, b)
    del c
    sync(dev)
    ws_all = torch.cuda.memory_allocated(dev) - base
    free, total = torch.cuda.mem_get_info(dev)
    return {"cuda_context_bytes_at_start": context, "cublas_workspace_bytes_mm": ws_mm,
            "cublas_workspace_bytes_incl_lt": ws_all,
            "non_allocator_bytes_after_cublas": total - free - torch.cuda.memory_reserved(dev)}


def pick_backend(dev: torch.device) -> tuple[str, str]:
    """("triton" | "torch", why). Triton must import and match the reference on a smoke step."""
    if dev.type != "cuda":
        return "torch", "no CUDA device"
    try:
        from hisparse_cli.kernels.attention import attention_ref
        from hisparse_cli.kernels.attention import attention_triton

        g = torch.Generator(device=dev).manual_seed(0)
        kc = torch.randn(8, 16, 2, 64, device=dev, dtype=torch.float16, generator=g)
        vc = torch.randn(8, 16, 2, 64, device=dev, dtype=torch.float16, generator=g)
        q = torch.randn(32, 8, 64, device=dev, dtype=torch.float16, generator=g)
        ids, starts = torch.arange(6, device=dev), torch.arange(6, device=dev) * 16
        args = (q, kc, vc, ids, starts, 64, 4, 48, 0.125)
        got = attention_triton.sparse_attention(*args, return_scores=True)
        ref = attention_ref.sparse_attention(*args, return_scores=True, score_stride=1)
        err = float((got[0].float() - ref[0].float()).abs().max())
        if not math.isfinite(err) or err > 2e-2:
            raise RuntimeError(f"max |triton - ref| = {err}")
        return "triton", f"triton attention matches the reference (max err {err:.1e})"
    except Exception as exc:  # noqa: BLE001 - any failure means: run the reference
        os.environ["HISPARSE_BACKEND"] = "torch"
        return "torch", f"TRITON UNAVAILABLE, running the torch reference: {type(exc).__name__}: {exc}"


# -- models with random weights, built on the device -------------------------------------------
def build_hf(shape: dict, dev: torch.device):
    """HF LlamaForCausalLM (SDPA) with random fp16 weights, materialized on `dev`."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    kw = {k: v for k, v in shape.items() if k not in ("model_type", "quantization_config")}
    config = LlamaConfig(**kw)
    with torch.device("meta"):
        try:
            hf = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                  dtype=torch.float16)
        except TypeError:
            hf = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                  torch_dtype=torch.float16)
    hf = hf.to_empty(device=dev).to(torch.float16)
    g = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=g)
    rot = hf.model.rotary_emb
    hf.model.rotary_emb = type(rot)(config=hf.config).to(dev)
    hf.eval()
    hf.requires_grad_(False)
    return hf


def ours_sharing(hf, cfg: ModelConfig, dev: torch.device):
    """Our CausalLM over the HF model's tensors (same names, no copy)."""
    from hisparse_cli.model.llama import FUSIONS, CausalLM, fuse_projections

    params = dict(hf.named_parameters())
    with torch.device("meta"):
        model = CausalLM(cfg)
    for name, _ in list(model.named_parameters()):
        mod, _, attr = name.rpartition(".")
        setattr(model.get_submodule(mod), attr, nn.Parameter(params[name], requires_grad=False))
    model.init_rope(dev)
    # the engine stacks q|k|v and gate|up (model/llama.py:fuse_projections); do it here and
    # point HF's linears at row views of the stacked weights, so the two still share storage
    fuse_projections(model)
    for ours, theirs in zip(model.model.layers, hf.model.layers):
        for sub, attr, parts in FUSIONS:
            w, o = getattr(getattr(ours, sub), attr).weight, 0
            for p in parts:
                lin = getattr(getattr(theirs, sub), p)
                n = lin.out_features
                lin.weight = nn.Parameter(w[o:o + n], requires_grad=False)
                o += n
    return model.eval()


def build_ours(cfg: ModelConfig, dev: torch.device, awq: bool, host_emb: bool, seed: int = 0,
               awq_lm_head: bool = False, int8_lm_head: bool = False):
    """Our CausalLM with random weights: fp16, or AWQ INT4 (random codes, zeros and scales)
    for every decoder linear (and the head too with awq_lm_head, as `hisparse quantize
    --quantize-lm-head` writes it); the embedding table in host RAM when host_emb; with
    int8_lm_head the head is an Int8Linear quantized from a random fp16 head made on the
    host, as the loader does for `lm_head_format = "int8"` (the fp16 head never on the device)."""
    from hisparse_cli.model.awq import AWQLinear
    from hisparse_cli.model.llama import FUSIONS, CausalLM

    g = torch.Generator(device=dev).manual_seed(seed)
    fp16 = torch.float16

    def rnd(out_f: int, in_f: int) -> nn.Parameter:
        w = torch.empty(out_f, in_f, device=dev, dtype=fp16).normal_(0, in_f ** -0.5, generator=g)
        return nn.Parameter(w, requires_grad=False)

    with torch.device("meta"):
        model = CausalLM(cfg)
    if host_emb:  # made on the host: a device copy would not fit a small budget
        table = torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=fp16,
                            generator=torch.Generator().manual_seed(seed))
        model.model.embed_tokens.weight = nn.Parameter(table * cfg.hidden_size ** -0.5,
                                                       requires_grad=False)
        from hisparse_cli.kernels.cuda.host_rows import map_table

        map_table(model.model.embed_tokens.weight)  # as the loader does (kernels/cuda/host_rows.py)
        if int8_lm_head:
            from hisparse_cli.model.int8_linear import Int8Linear

            head = torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=fp16,
                               generator=torch.Generator().manual_seed(seed + 1))
            model.lm_head = Int8Linear.from_float(head * cfg.hidden_size ** -0.5, dev)
        else:
            model.lm_head.weight = rnd(cfg.vocab_size, cfg.hidden_size)  # loader: a device copy
    else:
        model.model.embed_tokens.weight = rnd(cfg.vocab_size, cfg.hidden_size)
        model.lm_head.weight = (model.model.embed_tokens.weight if cfg.tie_word_embeddings
                                else rnd(cfg.vocab_size, cfg.hidden_size))

    def awq_linear(i: int, o: int) -> AWQLinear:
        words = lambda r: torch.randint(-2 ** 31, 2 ** 31 - 1, (r, o // 8),  # noqa: E731
                                        device=dev, dtype=torch.int32, generator=g)
        scales = torch.full((i // 128, o), 1.0 / (6.5 * i ** 0.5), device=dev, dtype=fp16)
        return AWQLinear.from_checkpoint(words(i), words(i // 128), scales, None, 128, dev, fp16)

    # q|k|v and gate|up are made stacked, as the engine runs them (model/llama.py:
    # fuse_projections), so no stacking copy is made at run time
    for layer in model.model.layers:
        for sub, attr, parts in FUSIONS:
            parent = getattr(layer, sub)
            lins = [getattr(parent, p) for p in parts]
            i, o = lins[0].in_features, sum(lin.out_features for lin in lins)
            if awq:
                fused = awq_linear(i, o)
            else:
                with torch.device("meta"):
                    fused = nn.Linear(i, o, bias=False)
                fused.weight = rnd(o, i)
            setattr(parent, attr, fused)
            for p in parts:
                setattr(parent, p, None)
        for parent, attr in ((layer.self_attn, "o_proj"), (layer.mlp, "down_proj")):
            lin = getattr(parent, attr)
            if awq:
                setattr(parent, attr, awq_linear(lin.in_features, lin.out_features))
            else:
                lin.weight = rnd(lin.out_features, lin.in_features)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight = nn.Parameter(torch.ones(cfg.hidden_size, device=dev, dtype=fp16),
                                       requires_grad=False)
    model.model.norm.weight = nn.Parameter(torch.ones(cfg.hidden_size, device=dev, dtype=fp16),
                                           requires_grad=False)
    if awq and awq_lm_head:  # an untied INT4 head; the fp16 table stays for the lookup
        model.lm_head = awq_linear(cfg.hidden_size, cfg.vocab_size)
    model.init_rope(dev)
    return model.eval()


# -- runs ---------------------------------------------------------------------------------------
def prompt(n: int, vocab: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def plan_for(cfg, sparse, ctx, new, backend, dev, **kw):
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" \
        else 132
    return plan_memory(cfg, weight_format=kw.pop("weight_format", "fp16"), sparse=sparse,
                       context_tokens=ctx, max_new_tokens=new, kv_dtype="float16",
                       compute_dtype="float16", device_kind=dev.type,
                       backend=backend if dev.type == "cuda" else "torch", num_sms=sms, **kw)


GEN_EXTRA: dict = {}  # --cli-sampling: the CLI's default penalty and n-gram ban as well


def cli_sampling() -> dict:
    """The CLI's default repetition penalty and n-gram ban, as `generate` keywords."""
    from hisparse_cli.cli.options import RunOptions

    d = RunOptions()
    return dict(repetition_penalty=d.repetition_penalty, no_repeat_ngram_size=d.no_repeat_ngram)


def run_ours(model, cfg, sparse, ids, new, backend, dev, engine=None, **plan_kw) -> dict:
    """One Engine.generate. engine: a kept Engine (its sparse settings must be `sparse`), as a
    batch keeps one: a run of the same shapes after the first replays the kept CUDA graph
    (no warm-up step, no capture); default a new Engine, whose first decode step captures."""
    from hisparse_cli.engine.engine import Engine

    eng = engine or Engine(model, cfg, sparse=sparse, device=dev, kv_dtype=torch.float16,
                           backend=backend)
    plan = plan_for(cfg, sparse, len(ids), new, backend, dev, **plan_kw)
    free_all(dev)
    base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None
    res = eng.generate(ids, max_new_tokens=new, min_new_tokens=new, **GEN_EXTRA)
    s = res.stats
    measured = s.peak_memory_bytes if dev.type == "cuda" else None
    out = {"system": "hisparse", "context": len(ids), "new_tokens": s.new_tokens,
           "prefill_s": s.prefill_seconds, "prefill_tok_s": s.prefill_tok_s,
           "decode_s": s.decode_seconds,
           "decode_tok_s": (s.new_tokens - 1) / s.decode_seconds if s.decode_seconds else None,
           "peak_bytes": measured, "predicted_peak_bytes": plan.peak_allocated_bytes,
           "predicted_weights_bytes": plan.weights_bytes, "allocated_before_bytes": base,
           "reserved_peak_bytes": torch.cuda.max_memory_reserved(dev) if measured else None,
           "kv_blocks_peak": s.kv_blocks_peak, "predicted_kv_blocks_peak":
           plan.kv.peak_live_blocks, "kv_bytes_peak": s.kv_bytes_peak, "peak_when": plan.peak_when,
           "backend": s.backend, "plan": plan,
           "cuda_graph": res.extra.get("cuda_graph") if res.extra else None,
           "decode_kernel": res.extra.get("decode_kernel") if res.extra else None,
           "decode_kernel_note": res.extra.get("decode_kernel_note") if res.extra else None}
    out["error_pct"] = (100.0 * (plan.peak_allocated_bytes - measured) / measured
                        if measured else None)
    return out


def run_hf(hf, ids, new, dev, static: bool) -> dict:
    from transformers import LogitsProcessor, LogitsProcessorList

    class Clock(LogitsProcessor):  # called once per generated token, after its forward
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            sync(dev)
            self.times.append(time.perf_counter())
            return scores

    clock = Clock()
    x = torch.tensor([ids], device=dev)
    kw = {"cache_implementation": "static"} if static else {}
    free_all(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    sync(dev)
    t0 = time.perf_counter()
    out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                      min_new_tokens=new, do_sample=False, pad_token_id=0,
                      logits_processor=LogitsProcessorList([clock]), **kw)  # no_grad inside
    sync(dev)
    n = int(out.shape[1] - x.shape[1])
    del out
    t = clock.times
    skip = 3 if static else 0  # compile + CUDA-graph recording happen in the first decode steps
    dec = (len(t) - 1 - skip) / (t[-1] - t[skip]) if len(t) - 1 - skip > 0 else None
    return {"system": "hf-static-compiled" if static else "hf-dense-sdpa", "context": len(ids),
            "new_tokens": n, "prefill_s": t[0] - t0, "prefill_tok_s": len(ids) / (t[0] - t0),
            "decode_tok_s": dec, "first_decode_steps_s": (t[skip] - t[0]) if static else None,
            "peak_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
            "compiled": bool(getattr(hf, "_compiled_call", None)) if static else False}


def copy_bandwidth(dev: torch.device, nbytes: int = 2 * GIB, reps: int = 10) -> float:
    """Bytes moved per second by a device-to-device copy (read + write)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        b.copy_(a)
    end.record()
    sync(dev)
    bw = 2 * nbytes * reps / (start.elapsed_time(end) / 1000)
    del a, b
    free_all(dev)
    return bw


def decode_bytes(plan, cfg: ModelConfig, sparse: SparseConfig | None, position: int) -> int:
    """Bytes one decode step reads: device weights (one embedding row) + K/V it attends to."""
    from hisparse_cli.planner.run import policy, visible_count

    emb = next(i.bytes for i in plan.items if i.name == "weights.embeddings")
    weights = plan.weights_bytes - emb + cfg.hidden_size * 2
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    if sparse is None:  # dense HF cache: every position
        return weights + position * per_token
    seq = policy(sparse, cfg.sliding_window)
    seq.append(position + 1)
    seq.evict()
    keys = visible_count(seq, position, 1) * sparse.block_size + plan.kv.global_slots
    return weights + keys * per_token


# -- tables ---------------------------------------------------------------------------------------
def table(title: str, rows: list[dict], cols: list[tuple[str, str, int]]) -> None:
    print(f"\n== {title}")
    print("  ".join(f"{name:>{w}}" for name, _, w in cols))
    for r in rows:
        cells = []
        for _, key, w in cols:
            v = r.get(key)
            if v is None:
                v = "-"
            elif key.endswith("bytes"):
                v = gib(v)
            elif isinstance(v, float):
                v = f"{v:,.1f}" if abs(v) >= 10 else f"{v:.3g}"
            cells.append(f"{v!s:>{w}}")
        print("  ".join(cells), flush=True)


def jsonable(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        r = dict(r)
        plan = r.pop("plan", None)
        if plan is not None:
            r["plan_items"] = [i.__dict__ for i in plan.items]
        out.append(r)
    return out


# -- phases ---------------------------------------------------------------------------------------
def phase_ours(a, model, cfg, dev, backend, contexts, profiles) -> list[dict]:
    rows = []
    combos = [(c, "h200-141g") for c in contexts] + [
        (contexts[0], "4060ti-6g"), (contexts[min(1, len(contexts) - 1)], "3090-24g"),
        (contexts[-1], "4060ti-6g")]
    if "h200-alt" in profiles:  # --h200-alt: the same contexts under other sparse settings
        combos[len(contexts):len(contexts)] = [(c, "h200-alt") for c in contexts]
    for ctx, name in combos:
        new = a.decode_tokens if name.startswith("h200") else 16
        need = 10 + ctx / 8000
        if left(a.time_budget) - a.reserve < need:
            SKIPPED.append(f"hisparse {name} at {ctx}: {need:.0f} s needed, "
                           f"{left(a.time_budget) - a.reserve:.0f} s left")
            log("skip " + SKIPPED[-1])
            continue
        try:
            r = run_ours(model, cfg, profiles[name], prompt(ctx, cfg.vocab_size), new, backend,
                         dev)
        except Exception as exc:  # noqa: BLE001 - recorded, the other runs go on
            import traceback

            traceback.print_exc()
            rows.append({"system": "hisparse", "profile": name, "context": ctx,
                         "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"})
            free_all(dev)
            continue
        r["profile"] = name
        rows.append(r)
        log(f"hisparse {name} ctx {ctx}: prefill {r['prefill_tok_s']:,.0f} tok/s, decode "
            f"{r['decode_tok_s'] or 0:,.1f} tok/s, peak {gib(r['peak_bytes'])} GiB "
            f"(predicted {gib(r['predicted_peak_bytes'])}, {r['error_pct'] or 0:+.2f}%)")
    return rows


def phase_hf(a, hf, cfg, dev, contexts) -> list[dict]:
    rows = []
    for static in (False, True):
        if static and a.skip_static:
            SKIPPED.append("hf static: --skip-static")
            continue
        order = [contexts[0]] + contexts[:0:-1] if static else contexts  # 8K, 128K, 32K
        for ctx in order:
            new = a.decode_tokens if ctx <= 40000 else 16
            need = (8 + ctx / 10000 + new * 0.05) * (1 if not static else 2) + (
                120 if static else 0)
            tag = f"{'hf-static-compiled' if static else 'hf-dense-sdpa'} at {ctx}"
            if left(a.time_budget) - a.reserve < need:
                SKIPPED.append(f"{tag}: about {need:.0f} s needed, "
                               f"{left(a.time_budget) - a.reserve:.0f} s left")
                log("skip " + SKIPPED[-1])
                continue
            try:
                r = run_hf(hf, prompt(ctx, cfg.vocab_size), new, dev, static)
            except Exception as exc:  # noqa: BLE001 - OOM or a compile failure: recorded
                import traceback

                traceback.print_exc()
                kind = "OOM" if isinstance(exc, torch.OutOfMemoryError) else type(exc).__name__
                r = {"system": tag.split(" at")[0], "context": ctx,
                     "error": f"{kind}: {str(exc).splitlines()[0][:160]}"}
                free_all(dev)
            rows.append(r)
            log(f"{tag}: {r}")
    return rows


def phase_awq_vs_fp16(a, dev, backend) -> list[dict]:
    """(e) the same 8B shape with fp16 and with AWQ INT4 (g128) weights, same sparse settings
    (h200-141g, or --awq-profile's), same prompts: prefill and decode tok/s and the INT4/fp16
    ratios."""
    from hisparse_cli.engine.engine import Engine

    base = load_profile(a.awq_profile).sparse_config()  # the sparse settings (not the budget)
    chunks = [int(c) for c in a.awq_chunks.split(",")] if a.awq_chunks else [base.prefill_chunk]
    cfg = ModelConfig.from_dict(SHAPES["llama-3-8b"])
    rows = []
    systems = [("fp16", False, False), ("awq-int4", True, False)]
    if a.awq_lm_head:
        systems.append(("awq-int4+int4-lm_head", True, True))
    if a.prefill_cache:
        systems.append(("awq-int4+prefill-cache", True, False))
    for label, awq, head in systems:
        model = build_ours(cfg, dev, awq=awq, host_emb=False, awq_lm_head=head)
        kw = dict(weight_format="awq-int4" if awq else "fp16", awq_lm_head=head)
        if label.endswith("+prefill-cache"):  # every layer's W^T kept (Engine.keep_prefill_
            # weights; what summarize keeps where the budget has room), planned so
            from hisparse_cli.engine.engine import Engine

            held = Engine(model, cfg, sparse=base, device=dev, kv_dtype=torch.float16,
                          backend=backend).keep_prefill_weights(cfg.num_hidden_layers)
            kw["prefill_cache_layers"] = cfg.num_hidden_layers
            log(f"(e) {label}: {gib(held)} GiB of W^T kept for prefill")
        run_ours(model, cfg, base, prompt(4096, cfg.vocab_size), 4, backend, dev, **kw)
        for chunk in chunks:  # --awq-chunks: the same rows at other prefill chunks
            sparse = base.with_overrides(prefill_chunk=chunk)
            for ctx in [int(c) for c in a.contexts.split(",")]:
                if left(a.time_budget) < 20 + ctx / 5000:
                    SKIPPED.append(f"(e) {label} at {ctx}, chunk {chunk}: out of time")
                    continue
                # --ab-env VAR=A,B (--ab-graph-sampler: HISPARSE_GRAPH_SAMPLER=0,1): an Engine
                # (and its kept graph) a value, their repeats interleaved in this process
                modes = list(a.ab_values) if a.ab_var else [None]
                seen = {m: [] for m in modes}
                dec_seen = {m: [] for m in modes}
                graphs = {m: [] for m in modes}
                last: dict = {}
                # --reuse-engine: one Engine for the repeats, as `hisparse batch` keeps one:
                # the repeats after the first replay the kept decode graph
                # (an Engine resolves its execution plan from the environment when it is
                # built: each mode's Engine is built with its value set)
                def engine_for(m):
                    if m is not None:
                        os.environ[a.ab_var] = m
                    return Engine(model, cfg, sparse=sparse, device=dev,
                                  kv_dtype=torch.float16, backend=backend)

                engs = {m: engine_for(m) if a.reuse_engine else None for m in modes}
                for _ in range(a.repeat):  # the last repeat is kept (the first graph decode
                    # of a context size in a process has run slow: specializations compile)
                    for m in modes:
                        if m is not None:
                            os.environ[a.ab_var] = m
                        r = run_ours(model, cfg, sparse, prompt(ctx, cfg.vocab_size),
                                     a.decode_tokens, backend, dev, engine=engs[m], **kw)
                        seen[m].append(r["prefill_tok_s"])
                        dec_seen[m].append(r["decode_tok_s"])
                        graphs[m].append(r["cuda_graph"])
                        last[m] = r
                del engs
                for m in modes:
                    r = last[m]
                    r.update(system=label, weights_bytes=r["plan"].weights_bytes,
                             repeats=a.repeat, prefill_chunk=chunk, ab=m,
                             prefill_tok_s_repeats=seen[m], decode_tok_s_repeats=dec_seen[m],
                             cuda_graph_repeats=graphs[m])
                    if m is not None:  # the median of the repeats after the first
                        r["decode_tok_s"] = statistics.median(dec_seen[m][1:] or dec_seen[m])
                    r.pop("plan")
                    rows.append(r)
                    tag = "" if m is None else f" {a.ab_var}={m}"
                    log(f"(e) {label}{tag} ctx {ctx} chunk {chunk}: prefill "
                        f"{r['prefill_tok_s']:,.0f} tok/s, decode {r['decode_tok_s']:.1f} tok/s"
                        f"{' (median)' if m is not None else ''}, peak {gib(r['peak_bytes'])} "
                        f"GiB, weights {gib(r['weights_bytes'])} GiB; decode by repeat "
                        f"{', '.join(f'{d:.1f} ({g})' for d, g in zip(dec_seen[m], graphs[m]))}")
        del model
        free_all(dev)
    for r in rows:
        fp = next((x for x in rows if x["system"] == "fp16" and x["context"] == r["context"]
                   and x["prefill_chunk"] == r["prefill_chunk"]
                   and x["ab"] == r["ab"]), None)
        if fp and r["system"] != "fp16":
            r["decode_vs_fp16"] = r["decode_tok_s"] / fp["decode_tok_s"]
            r["prefill_vs_fp16"] = r["prefill_tok_s"] / fp["prefill_tok_s"]
            tag = "" if r["ab"] is None else f" {a.ab_var}={r['ab']}"
            log(f"(e) {r['system']}{tag} ctx {r['context']} chunk {r['prefill_chunk']}: "
                f"INT4/fp16 decode {r['decode_vs_fp16']:.2f}x, prefill "
                f"{r['prefill_vs_fp16']:.2f}x")
    return rows


def phase_budget(a, dev, backend, calib) -> list[dict]:
    """A 6 GiB card emulated on this GPU: the allocator may reserve what such a card driving
    a display leaves, card - planner.vram.DISPLAY_BYTES - the CUDA context measured here."""
    from hisparse_cli.planner.vram import (DISPLAY_BYTES, allocator_cap_bytes, budget_fraction,
                                           oom_guard)
    from hisparse_cli.errors import ResourceError

    prof = load_profile("4060ti-6g")
    sparse = prof.sparse_config()
    context = calib.get("non_allocator_bytes_after_cublas") or CUDA_CONTEXT_BYTES
    total = torch.cuda.get_device_properties(dev).total_memory
    cap = allocator_cap_bytes(int(a.budget_gib * GIB), card=True, context_bytes=context)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(budget_fraction(cap, total), index)
    log(f"budget: a {a.budget_gib:g} GiB card: allocator cap {gib(cap)} GiB (display "
        f"{gib(DISPLAY_BYTES)} GiB, context {gib(context)} GiB); planner budget = profile "
        f"4060ti-6g {prof.vram_budget_gib} GiB")
    rows = []
    models = [("llama-3-8b AWQ-int4, host embeddings", SHAPES["llama-3-8b"], True),
              ("llama-3.2-1b-shaped fp16, host embeddings", LLAMA_1B, False)]
    try:
        for label, shape, awq in models:
            cfg = ModelConfig.from_dict(shape)
            int8_head = prof.lm_head_format == "int8"  # as the loader makes it
            kw = dict(weight_format="awq-int4" if awq else "fp16", embeddings_on_host=True,
                      budget_bytes=prof.vram_budget_bytes, lm_head_int8=int8_head)
            ctxs = [32768, 131072 - 16]
            plans = [plan_for(cfg, sparse, c, 16, backend, dev, **dict(kw)) for c in ctxs]
            if not all(p.fits for p in plans):
                rows += [{"model": label, "context": c, "fits": False, "predicted_peak_bytes":
                          p.peak_allocated_bytes, "result": "not run: the planner says it does "
                          "not fit"} for c, p in zip(ctxs, plans)]
                continue
            if left(a.time_budget) < 25:
                SKIPPED.append(f"budget run {label}: out of time")
                continue
            free_all(dev)
            try:
                with oom_guard(f"building {label}"):
                    model = build_ours(cfg, dev, awq=awq, host_emb=True, int8_lm_head=int8_head)
                    run_ours(model, cfg, sparse, prompt(1024, cfg.vocab_size), 2, backend, dev,
                             **dict(kw))  # compile the kernels this model uses
            except ResourceError as exc:
                rows.append({"model": label, "context": 0, "result": exc.message})
                model = None  # a model built before the failure must not stay for the next
                free_all(dev)  # one (run 137: the 1B model could not load after the 8B's OOM)
                continue
            for ctx, plan in zip(ctxs, plans):
                if left(a.time_budget) < 10 + ctx / 8000:
                    SKIPPED.append(f"budget run {label} at {ctx}: out of time")
                    continue
                row = {"model": label, "context": ctx, "fits": True,
                       "predicted_peak_bytes": plan.peak_allocated_bytes}
                try:
                    with oom_guard(f"{label} at {ctx}"):
                        r = run_ours(model, cfg, sparse, prompt(ctx, cfg.vocab_size), 16,
                                     backend, dev, **dict(kw))
                    row.update(result="ok", peak_bytes=r["peak_bytes"],
                               reserved_peak_bytes=r["reserved_peak_bytes"],
                               error_pct=r["error_pct"], prefill_tok_s=r["prefill_tok_s"],
                               decode_tok_s=r["decode_tok_s"],
                               decode_kernel=r["decode_kernel"],
                               decode_kernel_note=r["decode_kernel_note"])
                except ResourceError as exc:
                    row.update(result=exc.message)
                rows.append(row)
                log(f"budget {label} ctx {ctx}: {row['result']}")
            del model
            free_all(dev)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)
    return rows


def auto_sparse(cfg, prof, context: int, new: int, backend, dev, **kw) -> SparseConfig:
    """The working set `--attention auto` picks for this profile and context (the CLI's
    default: the configured one, widened while the plan still fits the profile's budget)."""
    from hisparse_cli.planner.attention_choice import choose_attention

    return choose_attention("auto", sparse=prof.sparse_config(), context_tokens=context + new,
                            plan=lambda sp: plan_for(cfg, sp, context, new, backend, dev,
                                                     budget_bytes=prof.vram_budget_bytes,
                                                     **dict(kw))).sparse


def kernel_breakdown(fn, top: int = 18) -> list[dict]:
    """fn() under torch.profiler: the CUDA kernels by total device time (name, ms, calls)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t:
            rows.append({"kernel": e.key[:90], "ms": t / 1e3, "calls": e.count})
    rows.sort(key=lambda r: -r["ms"])
    total = sum(r["ms"] for r in rows)
    for r in rows[:top]:
        log(f"  {r['ms']:9.1f} ms {100 * r['ms'] / total:5.1f} % x{r['calls']:<6} {r['kernel']}")
    log(f"  total device time {total:,.1f} ms")
    return rows[:top] + [{"kernel": "(total)", "ms": total, "calls": 0}]


def phase_profile_prefill(a, dev, backend, calib) -> dict:
    """(f) issue 42 item 2: the 4060ti-6g profile as the CLI runs it (AWQ INT4 8B, host
    embeddings, INT8 head, `--attention auto`'s working set) in the emulated --budget-gib card,
    with each --sweep override, against the h200-141g profile (AWQ INT4, embeddings and head
    on the device, its sparse settings) on the whole card, one context (--contexts' last)."""
    from hisparse_cli.planner.vram import allocator_cap_bytes, budget_fraction

    ctx = [int(c) for c in a.contexts.split(",")][-1]
    new = a.decode_tokens
    cfg = ModelConfig.from_dict(SHAPES["llama-3-8b"])
    prof = load_profile("4060ti-6g")
    kw = dict(weight_format="awq-int4", embeddings_on_host=True,
              lm_head_int8=prof.lm_head_format == "int8")
    base = auto_sparse(cfg, prof, ctx, new, backend, dev, **kw)
    log(f"(f) 4060ti-6g auto at {ctx}: window {base.window_size}, globals {base.global_tokens}, "
        f"chunk {base.prefill_chunk}, stride {base.score_stride}")
    sweeps = [dict()] + [{k: int(v) for k, v in (i.split("=") for i in s.split(":"))}
                         for s in (a.sweep.split(",") if a.sweep else [])]
    out: dict = {"context": ctx, "auto_sparse": str(base), "rows": []}
    context = calib.get("non_allocator_bytes_after_cublas") or CUDA_CONTEXT_BYTES
    total = torch.cuda.get_device_properties(dev).total_memory
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    cap = allocator_cap_bytes(int(a.budget_gib * GIB), card=True, context_bytes=context)
    torch.cuda.set_per_process_memory_fraction(budget_fraction(cap, total), index)
    try:
        model = build_ours(cfg, dev, awq=True, host_emb=True, int8_lm_head=kw["lm_head_int8"])
        for ov in sweeps:
            sparse = base.with_overrides(**ov) if ov else base
            plan = plan_for(cfg, sparse, ctx, new, backend, dev, budget_bytes=prof.vram_budget_bytes,
                            **dict(kw))
            row = {"profile": "4060ti-6g", "overrides": ov, "sparse": str(sparse),
                   "fits": plan.fits, "predicted_peak_bytes": plan.peak_allocated_bytes}
            if plan.fits is False:
                row["result"] = "the planner says it does not fit"
            else:
                try:
                    from hisparse_cli.engine.engine import Engine

                    eng = Engine(model, cfg, sparse=sparse, device=dev, kv_dtype=torch.float16,
                                 backend=backend)
                    run_ours(model, cfg, sparse, prompt(4096, cfg.vocab_size), 4, backend, dev,
                             engine=eng, **dict(kw))  # compile and capture outside the row
                    r = run_ours(model, cfg, sparse, prompt(ctx, cfg.vocab_size), new, backend,
                                 dev, engine=eng, **dict(kw))
                    r.pop("plan")
                    row.update(result="ok", **{k: r[k] for k in (
                        "prefill_tok_s", "decode_tok_s", "peak_bytes", "error_pct")})
                    if a.breakdown and not ov:
                        log("(f) kernel breakdown: 4060ti-6g, a 16K prefill")
                        row["breakdown"] = kernel_breakdown(lambda: eng.generate(
                            prompt(16384, cfg.vocab_size), max_new_tokens=1))
                    del eng
                except torch.OutOfMemoryError as exc:
                    row["result"] = f"out of memory: {str(exc).splitlines()[0][:120]}"
            out["rows"].append(row)
            log(f"(f) 4060ti-6g {ov or 'auto'}: {row.get('result')} prefill "
                f"{row.get('prefill_tok_s', 0):,.0f} tok/s, decode {row.get('decode_tok_s') or 0:.1f}"
                f", peak {gib(row.get('peak_bytes') or 0)} (plan {gib(plan.peak_allocated_bytes)})")
            free_all(dev)
        del model
        free_all(dev)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)
    big = load_profile("h200-141g").sparse_config()
    model = build_ours(cfg, dev, awq=True, host_emb=False)
    from hisparse_cli.engine.engine import Engine

    eng = Engine(model, cfg, sparse=big, device=dev, kv_dtype=torch.float16, backend=backend)
    run_ours(model, cfg, big, prompt(4096, cfg.vocab_size), 4, backend, dev, engine=eng,
             weight_format="awq-int4")
    r = run_ours(model, cfg, big, prompt(ctx, cfg.vocab_size), new, backend, dev, engine=eng,
                 weight_format="awq-int4")
    r.pop("plan")
    peer = {"profile": "h200-141g", "sparse": str(big), "result": "ok",
            **{k: r[k] for k in ("prefill_tok_s", "decode_tok_s", "peak_bytes", "error_pct")}}
    if a.breakdown:
        log("(f) kernel breakdown: h200-141g, a 16K prefill")
        peer["breakdown"] = kernel_breakdown(lambda: eng.generate(
            prompt(16384, cfg.vocab_size), max_new_tokens=1))
    out["peer"] = peer
    log(f"(f) h200-141g: prefill {peer['prefill_tok_s']:,.0f} tok/s, decode "
        f"{peer['decode_tok_s']:.1f}")
    for row in out["rows"]:
        if row.get("result") == "ok":
            row["prefill_vs_h200_141g"] = row["prefill_tok_s"] / peer["prefill_tok_s"]
            log(f"(f) 4060ti-6g {row['overrides'] or 'auto'}: prefill "
                f"{row['prefill_vs_h200_141g']:.2f}x h200-141g's")
    del eng, model
    free_all(dev)
    return out


def same_resident_eviction(sparse, cfg: ModelConfig, context: int):
    """The eviction-only setting whose resident KV matches the retrieval one's: the window
    widened by the page cache plus the page summaries' bytes, in tokens."""
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    pages = -(-context // sparse.block_size)
    summ = summary_bytes(cfg.num_hidden_layers * cfg.num_key_value_heads, pages, cfg.head_dim,
                         sparse.retrieval_summary)
    extra = sparse.page_cache_pages * sparse.block_size + summ // per_token
    return replace(sparse, retrieval_tokens=0, window_size=sparse.window_size + extra)


def rss_bytes() -> int:
    """This process's resident set size (VmRSS), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def phase_retrieval(a, save=None) -> list[dict]:
    """--retrieval: eviction-only and retrieval rows per context, and their ratios; each row
    logged as it is measured and, with `save`, handed to save(rows) at once (a run cut short
    by a timeout keeps what it measured)."""
    from hisparse_cli.engine.engine import Engine

    dev = torch.device("cuda")
    backend, why = pick_backend(dev)
    log(f"backend {backend}: {why}")
    calib = calibrate(dev)
    prof = load_profile(a.profile)
    base = prof.sparse_config(retrieval_tokens=a.retrieval_tokens, window_size=a.window,
                              prefill_chunk=a.chunk)
    int8_head = a.lm_head_format == "int8" or (a.lm_head_format is None
                                                and prof.lm_head_format == "int8")
    cfg = ModelConfig.from_dict(SHAPES["llama-3-8b"])
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if a.budget_gib:
        from hisparse_cli.planner.vram import allocator_cap_bytes, budget_fraction

        total = torch.cuda.get_device_properties(dev).total_memory
        ctx_b = calib.get("non_allocator_bytes_after_cublas") or CUDA_CONTEXT_BYTES
        cap = allocator_cap_bytes(int(a.budget_gib * GIB), card=True, context_bytes=ctx_b)
        torch.cuda.set_per_process_memory_fraction(budget_fraction(cap, total), index)
    kw = dict(weight_format="awq-int4", embeddings_on_host=True, lm_head_int8=int8_head,
              budget_bytes=prof.vram_budget_bytes if a.budget_gib else None)
    model = build_ours(cfg, dev, awq=True, host_emb=True, int8_lm_head=int8_head)
    log(f"lm_head: {'INT8' if int8_head else 'fp16'}; retrieval settings {base}")
    run_ours(model, cfg, base, prompt(1024, cfg.vocab_size), 2, backend, dev, **kw)
    # the rows that decode layer by layer get a model no persistent engine has converted to the
    # item layout (a shared one decodes every product through the items' dequantize); on an
    # emulated card there is room for one model only, and they share it (said in the row)
    layers_model = model if a.budget_gib else build_ours(cfg, dev, awq=True, host_emb=True,
                                                         int8_lm_head=int8_head)

    def device_bytes(m) -> int:  # parameters and buffers the model holds on the device
        seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*m.parameters(), *m.buffers()) if t.device.type == "cuda"}
        return sum(seen.values())

    rows = []

    def keep(row: dict) -> None:
        rows.append(row)
        log(json.dumps(row, default=str))
        if save is not None:
            save(rows)

    try:
        for ctx in (int(c) for c in a.contexts.split(",")):
            ids = prompt(ctx, cfg.vocab_size)
            pair = {}
            evict = same_resident_eviction(base, cfg, ctx)
            settings = [("retrieval" if e == 1 else f"retrieval every {e}",
                         replace(base, retrieval_every=e), "auto") for e in a.every]
            if a.retrieval_layers:
                settings += [(f"{n}, layers", sp, "layers") for n, sp, _ in settings]
            peers = [] if a.no_peers else [("eviction-only", evict, "auto"),
                                           ("eviction-only, layers", evict, "layers")]
            # on an emulated card the retrieval rows first: an out-of-memory peer (its widened
            # window, the allocator's fragmentation after the rows before it) cannot hide them
            settings = settings + peers if a.budget_gib else peers + settings
            for name, sparse, kernel in settings:
                # the row is the second generate of one Engine: the first (untimed) compiles
                # the kernels and captures the decode graph, which the second replays with the
                # kept cache and retrieval tier (a cold machine's first run paid ~25 s of
                # compilation, and a 32-layer graph capture costs more than 64 tokens' decode)
                plan = plan_for(cfg, sparse, ctx, a.decode_tokens, backend, dev, **kw)
                if a.budget_gib and not plan.fits:  # (the widened eviction-only window, say)
                    row = {"setting": name, "context": ctx, "window": sparse.window_size,
                           "predicted_peak_bytes": plan.peak_allocated_bytes,
                           "result": "not run: the planner says it does not fit the budget"}
                    keep(row)
                    continue
                try:
                    rss0 = rss_bytes()
                    os.environ["HISPARSE_DECODE_KERNEL"] = kernel  # read when an Engine is made
                    own = model if kernel == "auto" else layers_model
                    eng = Engine(own, cfg, sparse=sparse, device=dev, kv_dtype=torch.float16,
                                 backend=backend)
                    os.environ.pop("HISPARSE_DECODE_KERNEL")
                    first = eng.generate(ids, max_new_tokens=a.decode_tokens,
                                         min_new_tokens=a.decode_tokens)
                    free_all(dev)
                    pinned0 = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) \
                        if hasattr(torch.cuda, "host_memory_stats") else None
                    runs = [eng.generate(ids, max_new_tokens=a.decode_tokens,
                                         min_new_tokens=a.decode_tokens)
                            for _ in range(max(1, a.repeat))]  # timed: the median of these
                    res = runs[-1]
                    s = res.stats
                    prefills = [r.stats.prefill_tok_s for r in runs]
                    decodes = [(r.stats.new_tokens - 1) / r.stats.decode_seconds for r in runs]
                    state = getattr(eng, "_decode_state", None)
                    tier = getattr(state, "tier", None)
                    pinned1 = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) \
                        if hasattr(torch.cuda, "host_memory_stats") else None
                    other = 0 if layers_model is model else device_bytes(
                        layers_model if own is model else model)
                    row = {"setting": name, "context": ctx,
                           "device": torch.cuda.get_device_name(dev),
                           "alloc_conf": ALLOC_CONF,
                           "window": sparse.window_size,
                           "retrieval_tokens": sparse.retrieval_tokens,
                           "retrieval_every": sparse.retrieval_every,
                           "lm_head": "int8" if int8_head else "fp16",
                           "prefill_tok_s": statistics.median(prefills),
                           "decode_tok_s": statistics.median(decodes),
                           "prefill_tok_s_runs": prefills, "decode_tok_s_runs": decodes,
                           "peak_bytes": s.peak_memory_bytes,
                           # the other model's bytes, where two are loaded (not this run's)
                           "other_model_bytes": other,
                           "predicted_peak_bytes": plan.peak_allocated_bytes,
                           "device_error_pct": 100.0 * (plan.peak_allocated_bytes + other
                                                        - s.peak_memory_bytes) / (
                               s.peak_memory_bytes - other),
                           "kv_bytes_peak": s.kv_bytes_peak,
                           "planned_kv_bytes_peak": plan.kv.kv_bytes_peak,
                           "planned_host_offload_bytes": plan.offload_store_bytes,
                           "pinned_bytes_before_run": pinned0,
                           "pinned_bytes_after_run": pinned1,
                           # the host side measured: the store's allocation and the process's
                           # resident memory grown since before the Engine (the planner's peer)
                           "host_store_bytes": tier.host_bytes() if tier is not None else None,
                           "host_rss_growth_bytes": rss_bytes() - rss0,
                           "pages_offloaded": s.pages_offloaded, "offload_bytes": s.offload_bytes,
                           "cache_hit_rate": s.cache_hit_rate,
                           "pages_retrieved_per_step": s.pages_retrieved_per_step,
                           "bytes_to_cache": s.bytes_to_cache,
                           "h2d_bytes_per_token": s.bytes_to_cache / (ctx + s.new_tokens),
                           "decode_cache_hit_rate": s.decode_cache_hit_rate,
                           "decode_h2d_bytes_per_token": s.decode_bytes_to_cache / max(
                               1, s.new_tokens - 1),
                           "first_run_decode_tok_s": (first.stats.new_tokens - 1)
                           / first.stats.decode_seconds,
                           "cuda_graph": (res.extra or {}).get("cuda_graph"),
                           "decode_kernel": (res.extra or {}).get("decode_kernel"),
                           "shared_model": own is model}
                    if a.breakdown:  # a third generate under the profiler: its kernels
                        log(f"kernel breakdown, {name}, {ctx} tokens:")
                        row["kernels"] = kernel_breakdown(lambda: eng.generate(
                            ids, max_new_tokens=a.decode_tokens,
                            min_new_tokens=a.decode_tokens), top=24)
                    eng.release_cached_state()
                    del eng
                    free_all(dev)
                    pair[name] = row
                    keep(row)
                except torch.OutOfMemoryError as exc:  # the emulated card: the row says so
                    os.environ.pop("HISPARSE_DECODE_KERNEL", None)
                    eng = None
                    free_all(dev)
                    row = {"setting": name, "context": ctx, "window": sparse.window_size,
                           "predicted_peak_bytes": plan.peak_allocated_bytes,
                           "result": "out of memory: " + str(exc).split(".")[0],
                           "message": str(exc)[:700],
                           "max_reserved_bytes": torch.cuda.max_memory_reserved(dev),
                           "max_allocated_bytes": torch.cuda.max_memory_allocated(dev)}
                    keep(row)
            for name in (n for n, _, _ in settings if n.startswith("retrieval") and n in pair):
                rt = pair[name]
                for peer in (p for p in ("eviction-only", "eviction-only, layers") if p in pair):
                    ev = pair[peer]
                    keep({"setting": f"ratio {name} / {peer}", "context": ctx,
                          "decode": rt["decode_tok_s"] / ev["decode_tok_s"],
                          "prefill": rt["prefill_tok_s"] / ev["prefill_tok_s"]})
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)
    return rows


def retrieval_main(a) -> None:
    """--retrieval alone: its rows into $OUT/gpu_retrieval.json and onto stdout."""
    t0 = time.perf_counter()
    out = Path(a.out or os.environ.get("OUT") or "out")
    out.mkdir(parents=True, exist_ok=True)

    def save(rows: list[dict], complete: bool = False) -> None:
        (out / "gpu_retrieval.json").write_text(json.dumps(
            {"rows": rows, "seconds": time.perf_counter() - t0, "complete": complete},
            indent=2, default=str))

    rows = phase_retrieval(a, save)
    save(rows, complete=True)
    for r in rows:
        print(json.dumps(r, default=str))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output folder (default: $OUT or ./out)")
    ap.add_argument("--time-budget", type=float, default=540.0, help="seconds for the script")
    ap.add_argument("--reserve", type=float, default=100.0,
                    help="seconds kept for the bandwidth and budget phases")
    ap.add_argument("--contexts", default=None,
                    help="default 8192,32768,131072; with --retrieval 32768,131056")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--budget-gib", type=float, default=6.0, help="card size for (d); 0: skip")
    ap.add_argument("--skip-static", action="store_true", help="skip the torch.compile peer")
    ap.add_argument("--repeat", type=int, default=1,
                    help="(e): run each context this many times, keep the last; --retrieval: "
                    "time each row this many times (after its warm-up), the median")
    ap.add_argument("--h200-alt", default=None,
                    help="also run h200-141g with these SparseConfig overrides, e.g. "
                         "window_size=4096,prefill_chunk=1024 (rows labelled h200-alt)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (a few seconds)")
    ap.add_argument("--only-budget", action="store_true", help="run only phase (d)")
    ap.add_argument("--awq-lm-head", action="store_true",
                    help="with --awq-vs-fp16: also a row whose lm_head is INT4 too")
    ap.add_argument("--awq-chunks", default=None,
                    help="with --awq-vs-fp16: prefill chunks to run (default: the profile's), "
                         "e.g. 1024,2048")
    ap.add_argument("--awq-profile", default="h200-141g",
                    help="(e): the profile whose sparse settings both rows use")
    ap.add_argument("--reuse-engine", action="store_true",
                    help="(e): one Engine per model and context for the --repeat runs (the "
                         "repeats after the first replay the kept decode graph, as in a batch)")
    ap.add_argument("--prefill-cache", action="store_true",
                    help="(e): also an INT4 row whose layers keep W^T for prefill (the prefill "
                    "weight cache summarize keeps where the budget has room)")
    ap.add_argument("--awq-vs-fp16", action="store_true",
                    help="run only (e): 8B-shaped AWQ INT4 vs fp16, h200-141g settings, "
                         "embeddings on the device (CUDA-graph decode for both)")
    ap.add_argument("--ab-env", default=None, metavar="VAR=A,B[,...]",
                    help="(e): each system with the environment variable VAR at each value (one "
                         "the engine reads each generate), an Engine a value, repeats "
                         "interleaved in this order; decode rows are the median after the first")
    ap.add_argument("--ab-graph-sampler", action="store_true",
                    help="(e): --ab-env HISPARSE_GRAPH_SAMPLER=<--ab-order>")
    ap.add_argument("--ab-order", default="0,1",
                    help="--ab-graph-sampler's order within a repeat (1,0: the sampler first)")
    ap.add_argument("--cli-sampling", action="store_true",
                    help="decode with the CLI's default sampler settings (repetition penalty "
                    "1.1, no-repeat n-gram 8) instead of plain greedy")
    ap.add_argument("--profile-prefill", action="store_true",
                    help="run only (f): 4060ti-6g (CLI's auto working set, emulated "
                    "--budget-gib card) vs h200-141g prefill, AWQ 8B, --contexts' last")
    ap.add_argument("--sweep", default=None, metavar="K=V[:K=V],...",
                    help="(f): extra 4060ti-6g rows, SparseConfig overrides each, e.g. "
                    "prefill_chunk=1024,score_stride=16")
    ap.add_argument("--breakdown", action="store_true",
                    help="(f): also a torch.profiler kernel breakdown of a 16K prefill each; "
                    "--retrieval: of a third generate of each row")
    ap.add_argument("--retrieval", action="store_true",
                    help="run only the retrieval tier vs eviction-only at the same resident KV "
                    "(writes gpu_retrieval.json)")
    ap.add_argument("--profile", default="4060ti-6g", help="--retrieval: the sparse settings")
    ap.add_argument("--retrieval-tokens", type=int, default=1024,
                    help="--retrieval: the retrieval tier's tokens (and page cache)")
    ap.add_argument("--every", default="1", type=lambda s: [int(x) for x in s.split(",")],
                    help="--retrieval: retrieval_every values, a retrieval row each (e.g. 1,4,8)")
    ap.add_argument("--retrieval-layers", action="store_true",
                    help="--retrieval: each retrieval row also decoded layer by layer")
    ap.add_argument("--chunk", type=int, default=None,
                    help="--retrieval: the prefill chunk (default: the profile's)")
    ap.add_argument("--no-peers", action="store_true",
                    help="--retrieval: the retrieval rows only (no eviction-only peers)")
    ap.add_argument("--window", type=int, default=None,
                    help="--retrieval: the retrieval row's window (default: the profile's)")
    ap.add_argument("--lm-head-format", choices=("checkpoint", "int8"), default=None,
                    help="--retrieval: the output head (default: the profile's)")
    a = ap.parse_args()
    if a.contexts is None:
        a.contexts = "32768,131056" if a.retrieval else "8192,32768,131072"
    if a.retrieval:
        retrieval_main(a)
        return
    if a.ab_graph_sampler and not a.ab_env:
        a.ab_env = "HISPARSE_GRAPH_SAMPLER=" + a.ab_order
    a.ab_var, a.ab_values = None, ()
    if a.ab_env:
        var, _, values = a.ab_env.partition("=")
        a.ab_var, a.ab_values = var.strip(), tuple(v.strip() for v in values.split(","))
        if not a.ab_var or len(a.ab_values) < 2:
            ap.error(f"--ab-env wants VAR=A,B: got {a.ab_env!r}")
    if a.cli_sampling:
        GEN_EXTRA.update(cli_sampling())
    out_dir = Path(a.out or os.environ.get("OUT") or "out")
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    res: dict = {"command": " ".join([Path(sys.executable).name] + sys.argv),
                 "env": environment(dev), "calibration": calibrate(dev)}
    log(f"env {res['env']}")
    log(f"calibration {res['calibration']}")
    if res["calibration"]:
        from hisparse_cli.planner import memory as planner

        cal = res["calibration"]
        log(f"planner constants: CUDA_CONTEXT_BYTES shipped {planner.CUDA_CONTEXT_BYTES}, "
            f"measured {cal['non_allocator_bytes_after_cublas']} (after cuBLAS init); "
            f"CUBLAS_WORKSPACE_BYTES shipped {planner.CUBLAS_WORKSPACE_BYTES}, measured "
            f"{cal['cublas_workspace_bytes_mm']} (mm) / {cal['cublas_workspace_bytes_incl_lt']}"
            " (+ addmm/Lt)")
    backend, why = pick_backend(dev)
    res["backend"], res["backend_reason"] = backend, why
    log(f"backend: {why}")
    shape = SMOKE if a.smoke else SHAPES["llama-3-8b"]
    cfg = ModelConfig.from_dict(shape)
    new_max = a.decode_tokens
    contexts = [512, 1024, 2048] if a.smoke else [
        min(int(c), cfg.max_position_embeddings - new_max) for c in a.contexts.split(",")]
    profiles = {n: load_profile(n).sparse_config() for n in ("h200-141g", "3090-24g", "4060ti-6g")}
    if a.smoke:
        small = SparseConfig(window_size=256, global_tokens=16, recalibrate_topk=16,
                             prefill_chunk=128, recalibrate_every=128)
        profiles = {n: small for n in profiles}
    if a.h200_alt:
        kv = dict(item.split("=", 1) for item in a.h200_alt.split(","))
        profiles["h200-alt"] = profiles["h200-141g"].with_overrides(
            **{k: (int(v) if v.lstrip("-").isdigit() else v) for k, v in kv.items()})
        res["h200_alt"] = a.h200_alt
    if a.awq_vs_fp16 and dev.type == "cuda":
        res["awq_vs_fp16"] = phase_awq_vs_fp16(a, dev, backend)
        (out_dir / "gpu_engine_awq.json").write_text(json.dumps(res, indent=2, default=str))
        return
    if a.profile_prefill and dev.type == "cuda":
        res["profile_prefill"] = phase_profile_prefill(a, dev, backend, res["calibration"])
        (out_dir / "gpu_profile_prefill.json").write_text(json.dumps(res, indent=2,
                                                                     default=str))
        return
    if a.only_budget and dev.type == "cuda":
        res["budget"] = phase_budget(a, dev, backend, res["calibration"])
        print(json.dumps(jsonable(res["budget"]), indent=1))
        (out_dir / "gpu_engine_budget.json").write_text(json.dumps(res, indent=2, default=str))
        return
    hf = build_hf(shape, dev)
    model = ours_sharing(hf, cfg, dev)
    log(f"built {'smoke' if a.smoke else 'llama-3-8b'}-shaped fp16 model (shared by all systems)")
    w = profiles["h200-141g"]
    run_ours(model, cfg, w, prompt(min(w.window_size + 3 * w.prefill_chunk, 16384),
                                   cfg.vocab_size), 4, backend, dev)  # Triton JIT warm-up
    run_hf(hf, prompt(512, cfg.vocab_size), 2, dev, static=False)
    log("warm-up done")
    ours = phase_ours(a, model, cfg, dev, backend, contexts, profiles)
    table("(a) planner vs measured (torch.cuda.max_memory_allocated over generate)", ours, [
        ("profile", "profile", 10), ("context", "context", 8),
        ("base", "allocated_before_bytes", 7), ("predicted", "predicted_peak_bytes", 9),
        ("measured", "peak_bytes", 9), ("err %", "error_pct", 7),
        ("kv blk pred", "predicted_kv_blocks_peak", 11), ("kv blk", "kv_blocks_peak", 7),
        ("reserved", "reserved_peak_bytes", 9), ("peak at", "peak_when", 40)])
    peers = phase_hf(a, hf, cfg, dev, contexts)
    bench = [r for r in ours if r["profile"].startswith("h200")] + peers
    if dev.type == "cuda":
        bw = copy_bandwidth(dev)
        res["copy_bandwidth_bytes_s"] = bw
        plan8 = ours[0]["plan"] if ours else plan_for(cfg, w, contexts[0], 1, backend, dev)
        for r in bench:
            pos = r["context"] + max(r.get("new_tokens", 1) - 1, 0)
            sp = profiles[r["profile"]] if r["system"] == "hisparse" else None
            r["bytes_per_token"] = decode_bytes(plan8, cfg, sp, pos)
            r["limit_tok_s"] = bw / r["bytes_per_token"]
            if r.get("decode_tok_s"):
                r["fraction_of_limit"] = r["decode_tok_s"] / r["limit_tok_s"]
        log(f"(c) device copy bandwidth {bw / 1e9:,.0f} GB/s (read + write)")
    table("(b, c) speed, memory, bandwidth-bound decode limit", bench, [
        ("system", "system", 18), ("profile", "profile", 9), ("context", "context", 8),
        ("prefill t/s", "prefill_tok_s", 11),
        ("decode t/s", "decode_tok_s", 10), ("peak GiB", "peak_bytes", 8),
        ("GB/token", "bytes_per_token", 9), ("limit t/s", "limit_tok_s", 9),
        ("of limit", "fraction_of_limit", 8), ("note", "error", 30)])
    for r in bench:
        if r.get("bytes_per_token"):
            r["bytes_per_token"] = int(r["bytes_per_token"])
    res.update(planner_validation=jsonable(ours), bench=jsonable(bench))
    del model, hf
    try:  # torch.compile's caches and CUDA-graph pools keep the HF model (and memory) alive
        torch._dynamo.reset()
        from torch._inductor import cudagraph_trees

        cudagraph_trees.reset_cudagraph_trees()
    except Exception as exc:  # noqa: BLE001
        log(f"compile reset: {exc}")
    free_all(dev)
    if dev.type == "cuda":
        res["left_before_budget_bytes"] = {"allocated": torch.cuda.memory_allocated(dev),
                                           "reserved": torch.cuda.memory_reserved(dev)}
        log(f"before (d): {res['left_before_budget_bytes']} (counts against the cap)")
    if a.budget_gib > 0 and dev.type == "cuda":
        rows = phase_budget(a, dev, backend, res["calibration"])
        table(f"(d) {a.budget_gib:g} GiB card (set_per_process_memory_fraction)", rows, [
            ("model", "model", 40), ("context", "context", 8),
            ("predicted", "predicted_peak_bytes", 9), ("measured", "peak_bytes", 9),
            ("err %", "error_pct", 7), ("reserved", "reserved_peak_bytes", 9),
            ("decode t/s", "decode_tok_s", 10), ("result", "result", 40)])
        res["budget"] = rows
    res["skipped"] = SKIPPED
    res["wall_s"] = time.perf_counter() - T0
    path = out_dir / "gpu_engine.json"
    path.write_text(json.dumps(res, indent=2, default=str))
    for s in SKIPPED:
        print(f"skipped: {s}")
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
