"""GPU check + benchmark of the Triton sparse attention kernels (hisparse_cli/kernels/*_triton.py).

    python benchmarks/gpu_attention.py [SECTIONS] [--out DIR]   # repo root, a CUDA machine
    SECTIONS: comma list of correctness,prefill,decode,sweep,dsweep,ssweep (default: first four)

1. correctness: every kernel vs the torch reference (kernels/attention/attention_ref.py) over a grid of
   shapes -> max errors, PASS/FAIL;
2. prefill attention (chunk 512/1024/2048 x window 2048/4096/8192 x block 16/64, 256 globals,
   Hq 32, Hkv 8, D 128) vs torch SDPA (dense, same number of keys), TFLOP/s; importance scoring
   cost (default stride and exact) as % of the attention and of an estimated full layer
   (attention + the measured fp16 projections GEMMs of a Llama-3-8B layer);
3. decode (T=1; window up to 8192 + 512 globals; dense 32K / 128K keys) in CUDA graphs over
   rotating layer caches (no L2 reuse) vs SDPA, GB/s vs the 4.24 TB/s measured copy bandwidth;
4. a small sweep of tiles / num_warps / num_stages / splits.
5. dsweep: decode split count x key tile x warps (with scores, as the engine runs decode);
6. ssweep: scoring tiles at the h200-141g prefill shape (chunk 1024, window 4096, stride 16).
Prints compact tables; writes DIR/gpu_attention.json (DIR: --out, else $OUT, else ./out).
Self-contained: torch + triton only. Exits 1 when a check fails or a section errs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from hisparse_cli.kernels.attention import attention_ref as ref  # noqa: E402
from hisparse_cli.kernels.attention import attention_triton as tri  # noqa: E402
from hisparse_cli.kernels.attention.importance_triton import strided_mass_reference  # noqa: E402

DEV = torch.device("cuda")
COPY_BW = 4.24e12  # bytes/s, measured device-to-device copy on an H200 (device/KINDS.md)
HQ, HKV, D, SINKS, G = 32, 8, 128, 4, 256
PREFILL_T, WINDOWS, BLOCKS = (512, 1024, 2048), (2048, 4096, 8192), (16, 64)
CHECK_SHAPES = [(512, 1000, 256, 16, 32, 8, 128), (300, 77, None, 64, 8, 8, 64),  # (T, q_start,
                (1, 5000, 2048, 16, 32, 8, 128), (5, 9000, None, 32, 28, 4, 128),  # window, bs,
                (77, 333, 5, 16, 8, 1, 64), (1, 20000, None, 128, 32, 8, 128)]     # Hq, Hkv, D)
DECODE_CASES = [("win2048+g512", 2048, 512, 30_000), ("win8192+g512", 8192, 512, 30_000),
                ("dense32K", None, 0, 32_768), ("dense128K", None, 0, 131_072)]
SWEEP_PREFILL = (2048, 8192)  # (T, window)
RESULTS: dict = {"checks": [], "prefill": [], "decode": [], "sweep": [], "store_kv": {}}


def make_step(t, q_start, window, bs, *, g=G, hq=HQ, hkv=HKV, d=D, sinks=SINKS,
              dtype=torch.float16, seed=0):
    """Scattered paged cache (random garbage everywhere) + the step's block list."""
    torch.manual_seed(seed)
    last = (q_start + t - 1) // bs
    if window is None:
        logical = list(range(last + 1))
    else:
        lo = max(sinks, q_start - window + 1)
        logical = sorted(set(range(-(-sinks // bs))) | set(range(min(lo, q_start + t - 1) // bs, last + 1)))
    n_phys = len(logical) + 4
    ids = torch.randperm(n_phys, device=DEV)[: len(logical)]
    step = dict(q=torch.randn(t, hq, d, device=DEV, dtype=dtype),
                k_cache=torch.randn(n_phys, bs, hkv, d, device=DEV, dtype=dtype),
                v_cache=torch.randn(n_phys, bs, hkv, d, device=DEV, dtype=dtype),
                block_ids=ids, block_starts=torch.tensor([b * bs for b in logical], device=DEV),
                q_start=q_start, sinks=sinks if window else 0, window=window, scale=d ** -0.5)
    if g and window is not None:
        pos = torch.randint(0, max(1, q_start - window), (hkv, g), device=DEV)
        pos[0, ::5] = -1
        step.update(g_k=torch.randn(hkv, g, d, device=DEV, dtype=dtype),
                    g_v=torch.randn(hkv, g, d, device=DEV, dtype=dtype), g_pos=pos)
    return step


def attn_flops(step) -> int:
    """4 * D per (query head, visible key) pair: the FLOPs the step really needs."""
    t, hq, d = step["q"].shape
    bs, hkv = step["k_cache"].shape[1], step["k_cache"].shape[2]
    k_pos = (step["block_starts"][:, None] + torch.arange(bs, device=DEV)).reshape(-1)
    q_pos = step["q_start"] + torch.arange(t, device=DEV)
    pairs = hkv * int(ref.visibility_mask(q_pos, k_pos, step["sinks"], step["window"]).sum())
    if "g_pos" in step:
        pairs += t * int((step["g_pos"] >= 0).sum())
    return 4 * d * (hq // hkv) * pairs


def bench_ms(fn) -> float:
    try:
        return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))
    except TypeError:  # older triton
        return float(triton.testing.do_bench(fn, warmup=10, rep=60))


def graph_ms(fns, reps=20) -> float:
    """Per-call ms of `fns` (one per layer, rotating caches) replayed in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / (reps * len(fns))


def fmt(cfg) -> str:
    if cfg is None:
        return "default"
    return (f"M{cfg.block_m} N{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} "
            f"score M{cfg.score_block_m} N{cfg.score_block_n} w{cfg.score_warps}"
            + ("" if cfg.full_tiles else " masked-all"))


def err(a, b) -> float:
    return (a.float() - b.float()).abs().max().item() if a is not None else 0.0


# -- 1. correctness ---------------------------------------------------------------------------
def check(name, step, tol_out, tol_mass=2e-3, stride=1, **kw):
    o_r, km_r, gm_r = ref.sparse_attention(**step, return_scores=True)
    if stride > 1:
        km_r, gm_r = strided_mass_reference(**step, stride=stride)
    o_t, km_t, gm_t = tri.sparse_attention(**step, return_scores=True, score_stride=stride, **kw)
    o_n, _, _ = tri.sparse_attention(**step, return_scores=False, **kw)
    e = dict(out=err(o_t, o_r), out_noscore=err(o_n, o_r), key_mass=err(km_t, km_r),
             g_mass=err(gm_t, gm_r) if gm_r is not None else 0.0)
    mass_scale = max(1.0, km_r.abs().max().item())
    ok = (e["out"] <= tol_out and e["out_noscore"] <= tol_out
          and e["key_mass"] <= tol_mass * mass_scale and e["g_mass"] <= tol_mass * mass_scale
          and all(math.isfinite(v) for v in e.values()))
    RESULTS["checks"].append(dict(name=name, ok=ok, **e))
    print(f"  {'PASS' if ok else 'FAIL'} {name:44s} " + " ".join(f"{k}={v:.2e}" for k, v in e.items()))


def correctness() -> None:
    print("== correctness (Triton vs torch reference; errors are max abs)")
    tol = {torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float32: 1e-4}
    for dtype in (torch.float16, torch.bfloat16):
        for (t, qs, w, bs, hq, hkv, d) in CHECK_SHAPES:
            step = make_step(t, qs, w, bs, hq=hq, hkv=hkv, d=d, g=64, dtype=dtype, seed=t)
            check(f"{str(dtype)[6:]} T{t} q{qs} w{w} bs{bs} {hq}:{hkv} D{d}", step, tol[dtype])
    step = make_step(1, 4000, 1024, 16, g=512)
    for splits in (1, 7, 40):
        check(f"fp16 decode splits={splits}", step, tol[torch.float16], num_splits=splits)
    step = make_step(1024, 4096, 2048, 16, g=256)
    check("fp16 prefill strided scores r=8", step, tol[torch.float16], stride=8)
    step = make_step(64, 200, 100, 16, hq=8, hkv=2, d=64, g=16, dtype=torch.float32)
    check("fp32 cache fallback", step, tol[torch.float32])
    kc = torch.randn(64, 16, 8, 128, device=DEV, dtype=torch.float16)
    vc, k, v = kc.clone(), torch.randn(300, 8, 128, device=DEV), torch.randn(300, 8, 128, device=DEV)
    slots = torch.randperm(64 * 16, device=DEV)[:300]
    kr, vr = kc.clone(), vc.clone()
    ref.store_kv(kr, vr, k, v, slots)
    tri.store_kv(kc, vc, k, v, slots)
    ok = torch.equal(kc, kr) and torch.equal(vc, vr)
    RESULTS["checks"].append(dict(name="store_kv", ok=ok))
    print(f"  {'PASS' if ok else 'FAIL'} store_kv (fp32 -> fp16, scattered slots)")


# -- 2. prefill ------------------------------------------------------------------------------
def layer_gemm_ms(t: int) -> float:
    """fp16 projections of one Llama-3-8B layer for t tokens (qkv, o, gate+up, down)."""
    x = torch.randn(t, 4096, device=DEV, dtype=torch.float16)
    ws = [torch.randn(4096, n, device=DEV, dtype=torch.float16) for n in (6144, 4096, 28672)]
    wd = torch.randn(14336, 4096, device=DEV, dtype=torch.float16)
    h = torch.randn(t, 14336, device=DEV, dtype=torch.float16)
    return sum(bench_ms(lambda w=w: x @ w) for w in ws) + bench_ms(lambda: h @ wd)


def prefill() -> None:
    print("== prefill (Hq 32, Hkv 8, D 128, 256 globals, sinks 4; fp16)")
    print(f"  {'T':>5} {'win':>5} {'bs':>3} {'keys':>6} {'ms':>7} {'TF/s':>6} {'sdpa_ms':>7} {'TF/s':>6}"
          f" {'x_sdpa':>6} | {'r':>2} {'score%att':>9} {'%layer':>6} | {'exact%att':>9} {'%layer':>6}")
    gemm = {}
    for t in PREFILL_T:
        gemm[t] = layer_gemm_ms(t)
        for window in WINDOWS:
            for bs in BLOCKS:
                step = make_step(t, 3 * window, window, bs)
                n_keys = step["block_ids"].numel() * bs + G
                flops = attn_flops(step)
                ms = bench_ms(lambda: tri.sparse_attention(**step))
                r = tri.default_score_stride(t, min(n_keys - G, window + SINKS + t) + G, HQ, D)
                ms_sc = bench_ms(lambda: tri.sparse_attention(**step, return_scores=True))
                ms_ex = bench_ms(lambda: tri.sparse_attention(**step, return_scores=True, score_stride=1))
                q = step["q"].transpose(0, 1)[None]
                kd = torch.randn(1, HQ, n_keys, D, device=DEV, dtype=torch.float16)
                ms_sdpa = bench_ms(lambda: F.scaled_dot_product_attention(q, kd, kd))
                fl_sdpa = 4 * D * HQ * t * n_keys
                layer = ms + gemm[t]
                row = dict(T=t, window=window, bs=bs, keys=n_keys, ms=ms, tflops=flops / ms / 1e9,
                           sdpa_ms=ms_sdpa, sdpa_tflops=fl_sdpa / ms_sdpa / 1e9, stride=r,
                           score_pct_attn=100 * (ms_sc - ms) / ms, score_pct_layer=100 * (ms_sc - ms) / layer,
                           exact_pct_attn=100 * (ms_ex - ms) / ms, exact_pct_layer=100 * (ms_ex - ms) / layer,
                           layer_gemm_ms=gemm[t])
                RESULTS["prefill"].append(row)
                print(f"  {t:5d} {window:5d} {bs:3d} {n_keys:6d} {ms:7.3f} {row['tflops']:6.0f} {ms_sdpa:7.3f}"
                      f" {row['sdpa_tflops']:6.0f} {ms_sdpa / ms:6.2f} | {r:2d} {row['score_pct_attn']:8.1f}%"
                      f" {row['score_pct_layer']:5.1f}% | {row['exact_pct_attn']:8.1f}% {row['exact_pct_layer']:5.1f}%")
                del step, kd
    t, window = SWEEP_PREFILL
    step = make_step(t, 3 * window, window, 16)
    kv_bytes = 2 * 2 * t * HKV * D * 2  # read + write, K and V
    k, v = step["q"][:, :HKV].contiguous(), step["q"][:, HKV:2 * HKV].contiguous()
    slots = torch.randperm(step["k_cache"].shape[0] * 16, device=DEV)[:t]
    ms = bench_ms(lambda: tri.store_kv(step["k_cache"], step["v_cache"], k, v, slots))
    RESULTS["store_kv"] = dict(T=t, ms=ms, gbps=kv_bytes / ms / 1e6)
    print(f"  store_kv T={t}: {ms * 1e3:.1f} us, {kv_bytes / ms / 1e6:.0f} GB/s")


# -- 3. decode -------------------------------------------------------------------------------
def decode() -> None:
    print("== decode (T=1, Hq 32, Hkv 8, D 128, fp16; CUDA graph, rotating layer caches)")
    print(f"  {'case':>22} {'keys':>7} {'us':>7} {'GB/s':>6} {'%copy':>6} {'sdpa_us':>7} {'GB/s':>6}"
          f" {'x_sdpa':>6} {'score_us':>8} {'+%':>5}")
    for name, window, g, q_start in DECODE_CASES:
        one = make_step(1, q_start - 1, window, 16, g=g)
        n_keys = one["block_ids"].numel() * 16 + g
        bytes_ = n_keys * HKV * D * 2 * 2
        layers = max(1, min(8, int(300e6 // bytes_)))
        steps = [one] + [make_step(1, q_start - 1, window, 16, g=g, seed=i) for i in range(1, layers)]
        us = 1e3 * graph_ms([lambda s=s: tri.sparse_attention(**s) for s in steps])
        us_sc = 1e3 * graph_ms([lambda s=s: tri.sparse_attention(**s, return_scores=True) for s in steps])
        kd = [torch.randn(1, HKV, n_keys, D, device=DEV, dtype=torch.float16) for _ in steps]
        q = torch.randn(1, HQ, 1, D, device=DEV, dtype=torch.float16)
        try:
            sd = 1e3 * graph_ms([lambda k=k: F.scaled_dot_product_attention(q, k, k, enable_gqa=True) for k in kd])
        except Exception:  # no GQA support: expand K/V (more bytes, reported as such)
            kx = [k.repeat_interleave(HQ // HKV, 1) for k in kd]
            sd = 1e3 * graph_ms([lambda k=k: F.scaled_dot_product_attention(q, k, k) for k in kx])
        row = dict(case=name, keys=n_keys, us=us, gbps=bytes_ / us / 1e3,
                   sdpa_us=sd, sdpa_gbps=bytes_ / sd / 1e3, score_us=us_sc, score_pct=100 * (us_sc - us) / us,
                   layers_rotated=len(steps))
        row["pct_copy"] = 100 * (bytes_ / (us * 1e-6)) / COPY_BW
        RESULTS["decode"].append(row)
        print(f"  {name:>22} {n_keys:7d} {us:7.1f} {row['gbps']:6.0f} {row['pct_copy']:5.0f}% {sd:7.1f}"
              f" {row['sdpa_gbps']:6.0f} {sd / us:6.2f} {us_sc:8.1f} {row['score_pct']:4.0f}%")
        del steps, kd


# -- 4. sweep --------------------------------------------------------------------------------
def sweep() -> None:
    print("== sweep (ms; default config first)")
    C = tri.AttnConfig
    t, window = SWEEP_PREFILL
    pre = make_step(t, 3 * window, window, 16)
    for cfg in [None, C(full_tiles=False), C(128, 64, 8, 3), C(128, 32, 8, 3), C(64, 64, 4, 3),
                C(128, 128, 8, 2), C(64, 32, 4, 4), C(128, 64, 4, 2)]:
        try:
            ms = bench_ms(lambda: tri.sparse_attention(**pre, config=cfg))
        except Exception as e:  # a config that does not compile/fit is reported, not fatal
            ms = float("nan")
            print(f"  prefill {cfg}: {type(e).__name__}: {str(e)[:120]}")
        RESULTS["sweep"].append(dict(kind=f"prefill T{t} w{window} bs16", config=fmt(cfg), ms=ms))
        print(f"  prefill T{t} w{window} bs16 {fmt(cfg):36s} {ms:7.3f} ms")
    for sc in [(64, 64, 4), (128, 64, 8), (64, 128, 4), (128, 128, 8)]:
        cfg = C(score_block_m=sc[0], score_block_n=sc[1], score_warps=sc[2])
        try:
            ms = bench_ms(lambda: tri.sparse_attention(**pre, config=cfg, return_scores=True, score_stride=1))
        except Exception as e:
            ms = float("nan")
            print(f"  scores {sc}: {type(e).__name__}: {str(e)[:120]}")
        RESULTS["sweep"].append(dict(kind="prefill+exact scores", config=str(sc), ms=ms))
        print(f"  prefill T{t} w{window} + exact scores, score M/N/warps={sc} {ms:7.3f} ms")
    dec = [make_step(1, 3 * window, window, 16, g=512, seed=i) for i in range(8)]
    for cfg, splits in [(None, None), (C(16, 64, 8, 2), None), (C(16, 128, 4, 2), None), (C(16, 32, 4, 3), None),
                        (C(16, 64, 4, 3), None), (None, 16), (None, 64), (None, 128)]:
        try:
            us = 1e3 * graph_ms([lambda s=s: tri.sparse_attention(**s, config=cfg, num_splits=splits) for s in dec])
        except Exception as e:
            us = float("nan")
            print(f"  decode {cfg}: {type(e).__name__}: {str(e)[:120]}")
        RESULTS["sweep"].append(dict(kind=f"decode w{window}+g512", config=fmt(cfg), splits=splits, us=us))
        print(f"  decode w{window}+g512 {fmt(cfg):36s} splits={splits} {us:7.1f} us")


# -- 5. decode sweep (split count x key tile x warps, with the one-shot split reduce) -------
def dsweep() -> None:
    print("== decode sweep (us per layer call; CUDA graph over 8 rotating layer caches)")
    C = tri.AttnConfig
    for window, g in ((4096, 512), (8192, 512)):
        dec = [make_step(1, 3 * window, window, 16, g=g, seed=i) for i in range(8)]
        best = None
        for bn in (32, 64, 128):
            for warps in (2, 4):
                for splits in (None, 16, 32, 48, 64, 96, 128):
                    cfg = C(16, bn, warps, 2)
                    try:
                        us = 1e3 * graph_ms([lambda s=s: tri.sparse_attention(
                            **s, config=cfg, num_splits=splits, return_scores=True) for s in dec])
                    except Exception as e:  # noqa: BLE001
                        us = float("nan")
                        print(f"  w{window} N{bn} w{warps} splits={splits}: {type(e).__name__}: {str(e)[:100]}")
                    RESULTS["sweep"].append(dict(kind=f"decode+scores w{window}+g{g}", block_n=bn,
                                                 warps=warps, splits=splits, us=us))
                    if best is None or us < best[0]:
                        best = (us, bn, warps, splits)
                    print(f"  decode+scores w{window}+g{g} N{bn:<3} w{warps} splits={splits!s:>4} {us:7.1f} us")
        print(f"  best w{window}: {best}")


# -- 6. scoring tile sweep (prefill chunk 1024, window 4096, 512 globals, stride 16) --------
def ssweep() -> None:
    print("== scoring tile sweep (prefill T1024 w4096 g512 bs16, score_stride 16; ms per call)")
    C = tri.AttnConfig
    pre = make_step(1024, 3 * 4096, 4096, 16, g=512)
    base = bench_ms(lambda: tri.sparse_attention(**pre))
    print(f"  attention alone {base:.3f} ms")
    for sc in [(64, 64, 4), (64, 128, 4), (128, 128, 8), (32, 128, 4), (64, 256, 8), (128, 64, 4),
               (32, 64, 2), (64, 128, 8)]:
        cfg = C(score_block_m=sc[0], score_block_n=sc[1], score_warps=sc[2])
        try:
            ms = bench_ms(lambda: tri.sparse_attention(**pre, config=cfg, return_scores=True,
                                                       score_stride=16))
        except Exception as e:  # noqa: BLE001
            ms = float("nan")
            print(f"  scores {sc}: {type(e).__name__}: {str(e)[:120]}")
        RESULTS["sweep"].append(dict(kind="prefill T1024 w4096 g512 + scores stride 16",
                                     config=str(sc), ms=ms, attention_ms=base))
        print(f"  score M/N/warps={sc}: {ms:7.3f} ms (scoring {ms - base:6.3f} ms = "
              f"{100 * (ms - base) / base:4.1f} % of the attention)")


SECTIONS = {"correctness": correctness, "prefill": prefill, "decode": decode, "sweep": sweep,
            "dsweep": dsweep, "ssweep": ssweep}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sections", nargs="?", default="correctness,prefill,decode,sweep",
                    help=f"comma list of {','.join(SECTIONS)} (default: the first four)")
    ap.add_argument("--out", default=None, help="output folder (default: $OUT, else ./out)")
    a = ap.parse_args()
    names = a.sections.split(",")
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {', '.join(unknown)}: choose from {', '.join(SECTIONS)}")
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    out = Path(a.out or os.environ.get("OUT", "./out"))
    out.mkdir(parents=True, exist_ok=True)
    RESULTS["env"] = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                          triton=triton.__version__, sms=torch.cuda.get_device_properties(0).multi_processor_count)
    print(RESULTS["env"])
    t0 = time.time()
    for section in [SECTIONS[n] for n in names]:
        ts = time.time()
        try:
            section()
        except Exception as e:  # keep going: later sections still report
            RESULTS.setdefault("errors", []).append(f"{section.__name__}: {type(e).__name__}: {e}")
            print(f"!! {section.__name__} failed: {type(e).__name__}: {e}")
        print(f"  ({section.__name__}: {time.time() - ts:.0f} s)")
        torch.cuda.empty_cache()
    RESULTS["seconds"] = time.time() - t0
    n_fail = sum(not c["ok"] for c in RESULTS["checks"])
    RESULTS["all_pass"] = n_fail == 0 and "errors" not in RESULTS
    (out / "gpu_attention.json").write_text(json.dumps(RESULTS, indent=1))
    print(f"== {'ALL PASS' if RESULTS['all_pass'] else f'{n_fail} FAIL'}; {RESULTS['seconds']:.0f} s; "
          f"wrote {out / 'gpu_attention.json'}")
    return 0 if RESULTS["all_pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
