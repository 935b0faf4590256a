"""GPU check and timing of the Triton AWQ INT4 kernels (kernels/int4/awq_triton.py).

What `AWQLinear` runs on CUDA is the K-major path (kernels/int4/awq_layout.py: qweight repacked
once at load to int32 [N, K/8]): `awq_linear_k` = GEMV for <= 4 tokens, else (as
awq_layout.prefill_path says) the fused dequant-GEMM or dequantize W^T + cuBLAS. The
AWQ-layout kernels (`awq_gemv`, `awq_dequant_matmul`) are timed for comparison.

1. correctness: K-major GEMV (table config, split-K, pipelined, wide tile), dequantize (bit-exact vs
   the torch dequantization), dequant+cuBLAS, the fused GEMM and the auto path against the
   fp32 matmul of the dequantized weight, fp16/bf16 (fp32 on a small shape), groups
   32/64/128, partial tiles; the GPU repack against the CPU one; a CUDA-graph
   capture/replay of the decode call.
2. sweeps: --gemv-sweep times the v3 decode GEMV's candidate configs
   against the v2 kernel and fp16 cuBLAS per decode shape at 1/2/4 tokens (CUDA graphs) and
   prints the GEMV_TABLE rows to adopt; --sweep: dequantize tile configs per shape;
   --prefill-sweep times fp16 cuBLAS vs dequant+cuBLAS vs the fused
   GEMM's candidates at 64..2048 tokens (CUDA graphs) and prints the GEMM_TABLE rows and
   FUSED_MAX_TOKENS to adopt.
3. decode timing as the engine runs it: 1 token, back-to-back calls over rotating weight
   copies (>= 256 MB a pass) replayed from one CUDA graph, fp16 F.linear vs the INT4 GEMV.
4. timing (triton.testing.do_bench, L2 flushed, median): fp16 cuBLAS (F.linear on the dense
   [N, K] weight, as the engine runs it) vs the INT4 paths, tokens 1..2048; GB/s on the INT4
   bytes against a measured device-to-device copy.

Needs only torch + triton (runs with torch 2.11 / triton 3.6). Writes $OUT/gpu_awq.json
(OUT defaults to ./out) and prints short tables.
    python benchmarks/gpu_awq.py [--quick] [--sweep] [--gemv-sweep] [--prefill-sweep]
                                 [--no-timing] [--budget-s 480]
    python benchmarks/gpu_awq.py --smoke-cpu     # tiny shapes under TRITON_INTERPRET=1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

SMOKE = "--smoke-cpu" in sys.argv  # script check without a GPU: interpreter, tiny shapes
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from hisparse_cli.kernels.int4 import awq_layout as al  # noqa: E402
from hisparse_cli.kernels.int4 import awq_triton as at  # noqa: E402
from hisparse_cli.kernels.int4.awq_pack import unpack_int4  # noqa: E402
from hisparse_cli.kernels.int4.awq_ref import dequantize_weight  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
PEAK_TBS = 4.24
SHAPES = {"q/o 4096x4096": (4096, 4096), "k/v 4096x1024": (4096, 1024),
          "gate/up 4096x14336": (4096, 14336), "down 14336x4096": (14336, 4096),
          "lm_head 4096x128256": (4096, 128256)}
CHECK_SHAPES = {"q/o 4096x4096": (4096, 4096), "k/v 4096x1024": (4096, 1024),
                "partial 1024x4200": (1024, 4096 + 8 * 13), "down 14336x4096": (14336, 4096)}
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
DTYPES = (torch.float16, torch.bfloat16)
if SMOKE:
    SHAPES = {"tiny 256x64": (256, 64), "tiny 512x136": (512, 136)}
    CHECK_SHAPES = dict(SHAPES)


def log(msg: str) -> None:
    print(msg, flush=True)


def make(k: int, n: int, group: int, seed: int = 0):
    """Random valid AWQ tensors (any int32 word is 8 valid nibbles)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    qw = torch.randint(-2**31, 2**31 - 1, (k, n // 8), device=DEV, dtype=torch.int32,
                       generator=g)
    qz = torch.randint(-2**31, 2**31 - 1, (k // group, n // 8), device=DEV,
                       dtype=torch.int32, generator=g)
    s = (torch.rand(k // group, n, device=DEV, generator=g) * 0.01 + 0.001).half()
    b = torch.randn(n, device=DEV, generator=g) * 0.1
    return qw, qz, s, b


def bench(fn, rep: int = 40) -> float:
    """Median milliseconds (L2 flushed between runs by do_bench)."""
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=max(5, rep // 4), rep=rep, return_mode="median"))


def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(y.float()).all():
        return float("inf")
    return float((y.float() - ref).abs().max() / ref.abs().max())


def gemv_variants(m: int, k: int, n: int, group: int) -> dict:
    """name -> config of awq_gemv_k that the correctness pass covers (None: the table's)."""
    base = al.gemv_config(m, k, n, group, at._sm_count(torch.device(DEV)))
    v = {"default": None, "stages3": replace(base, num_stages=3),
         "bn128w4": replace(base, block_n=128, num_warps=4)}
    for split in (1, 2, 4):
        if (k // 8) % (base.block_kw * split) == 0:
            v[f"split{split}"] = replace(base, split=split)
    return v


def check_correctness(quick: bool, deadline: float) -> list[dict]:
    rows = []

    def add(ok: bool, **kw):
        rows.append(dict(kw, ok=ok))
        if not ok:
            log(f"FAIL {kw}")

    # repack on the device == repack on the CPU == the reference codes
    qw, _, _, _ = make(512, 1024, 128, seed=7)
    qt = al.repack_kmajor(qw)
    add(torch.equal(qt.cpu(), al.repack_kmajor(qw.cpu()))
        and torch.equal(al.unpack_kmajor(qt), unpack_int4(qw))
        and torch.equal(al.kmajor_to_awq(qt), qw), check="repack")
    tokens = [1, 2, 3, 4, 5, 33, 512] if not quick else [1, 3, 4, 33]
    for name, (k, n) in CHECK_SHAPES.items():
        for group in ((128,) if quick and "partial" not in name else (32, 64, 128)):
            if time.time() > deadline:
                return rows
            qw, qz, s, b = make(k, n, group, seed=group)
            qt = al.repack_kmajor(qw)
            w = dequantize_weight(qw, qz, s, group)  # fp32 [k, n]
            for dtype in DTYPES:
                wt = at.awq_dequantize_k(qt, qz, s, group, dtype)
                exact = torch.equal(wt, w.t().to(dtype))
                if SMOKE and dtype == torch.bfloat16:  # the interpreter truncates to bf16
                    exact = torch.allclose(wt.float(), w.t(), rtol=2**-7, atol=0)
                add(exact, check="dequantize_k exact", shape=name,
                    group=group, dtype=str(dtype)[6:])
                for m in tokens:
                    x = torch.randn(m, k, device=DEV).to(dtype)
                    ref = x.float() @ w + b.to(dtype).float()
                    bb = b.to(dtype)
                    paths = {"linear_k": lambda: at.awq_linear_k(x, qt, qz, s, bb, group)}
                    fused = m > 4 and al.prefill_path(m, n, x.element_size()) == "fused"
                    if SMOKE and dtype == torch.bfloat16 and fused:  # interpreter: bf16 tl.dot
                        del paths["linear_k"]  # is wrong (tests/test_awq_triton.py)
                    if m > 4:
                        paths["dequant_matmul_k"] = lambda: at.awq_dequant_matmul_k(
                            x, qt, qz, s, bb, group)
                        if not (SMOKE and dtype == torch.bfloat16):
                            paths["gemm_k"] = lambda: at.awq_gemm_k(x, qt, qz, s, bb, group)
                    else:
                        for vname, cfg in gemv_variants(m, k, n, group).items():
                            paths[f"gemv_k {vname}"] = (
                                lambda cfg=cfg: at.awq_gemv_k(x, qt, qz, s, bb, group,
                                                              config=cfg))
                    for p, fn in paths.items():
                        y = fn()
                        err = rel(y, ref)
                        add(err <= TOL[dtype] and y.dtype == dtype and y.shape == ref.shape,
                            shape=name, group=group, dtype=str(dtype)[6:], m=m, path=p,
                            rel_err=err)
            del w
            if DEV == "cuda":
                torch.cuda.empty_cache()
    # fp32 activations (the module accepts them): small shape
    qw, qz, s, b = make(256, 200 if SMOKE else 1024, 64, seed=3)
    qt = al.repack_kmajor(qw)
    w = dequantize_weight(qw, qz, s, 64)
    for m in (1, 7):
        x = torch.randn(m, 256, device=DEV)
        ref = x @ w + b
        y = at.awq_linear_k(x, qt, qz, s, b, 64)
        err = rel(y, ref)
        add(err <= 1e-4 and y.dtype == torch.float32, path="linear_k fp32", m=m, rel_err=err)
    return rows


def check_cuda_graph() -> dict:
    if SMOKE:
        return {"ok": True, "skipped": "no CUDA"}
    k, n, group = 4096, 4096, 128
    qw, qz, s, _ = make(k, n, group)
    qt = al.repack_kmajor(qw)
    x = torch.randn(1, k, device=DEV).half()
    for _ in range(2):
        at.awq_linear_k(x, qt, qz, s, None, group)  # compile outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = at.awq_linear_k(x, qt, qz, s, None, group)
    x.copy_(torch.randn(1, k, device=DEV).half())
    g.replay()
    torch.cuda.synchronize()
    err = rel(y, x.float() @ dequantize_weight(qw, qz, s, group))
    return {"rel_err": err, "ok": err <= TOL[torch.float16]}


def int4_bytes(m: int, k: int, n: int, group: int) -> int:
    return k * n // 2 + (k // group) * n * 2 + (k // group) * n // 2 + 2 * m * (k + n)


def sweep_dequant(deadline: float) -> list[dict]:
    out = []
    group = 128
    cfgs = [(64, 16, 4), (32, 16, 4), (128, 16, 8), (128, 16, 4), (64, 8, 4), (32, 16, 2),
            (16, 16, 1), (256, 16, 8)]
    for name, (k, n) in list(SHAPES.items())[:4]:
        qw, qz, s, _ = make(k, n, group)
        qt = al.repack_kmajor(qw)
        del qw
        buf = torch.empty((n, k), device=DEV, dtype=torch.float16)
        res = []
        for bn, bkw, w in cfgs:
            if time.time() > deadline:
                return out
            t = bench(lambda: at.awq_dequantize_k(qt, qz, s, group, torch.float16, out=buf,
                                                  block_n=bn, block_kw=bkw, num_warps=w),
                      rep=20)
            nbytes = int4_bytes(0, k, n, group) + 2 * k * n
            res.append(dict(shape=name, block_n=bn, block_kw=bkw, num_warps=w, ms=t,
                            GBs=nbytes / t / 1e6))
        out += res
        b = min(res, key=lambda r: r["ms"])
        log(f"best dequant {name}: bn={b['block_n']} bkw={b['block_kw']} warps={b['num_warps']}"
            f" {b['ms'] * 1e3:.1f}us {b['GBs']:.0f} GB/s (read+write); default "
            f"{res[0]['ms'] * 1e3:.1f}us")
        del buf
    return out


def graph_ms(fns: list, reps: int = 5) -> float:
    """Milliseconds per call of back-to-back calls replayed from one CUDA graph (how the
    engine's decode runs: no launch gaps, each call on weights not in L2)."""
    if SMOKE:
        return bench(fns[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    del g
    return start.elapsed_time(end) / (reps * len(fns))


def graph_us(fns: list) -> float:
    """Microseconds per call of back-to-back calls replayed from one CUDA graph, or raises."""
    return graph_ms(fns) * 1e3


def copies(nbytes: int, floor: int = 256 << 20) -> int:
    """Weight copies to rotate through so one pass moves >= floor bytes (5x the 50 MB L2)."""
    return max(1, min(16, -(-floor // nbytes)))


def decode_graph_timing(deadline: float, group: int = 128) -> list[dict]:
    """1 token: fp16 F.linear vs INT4 K-major GEMV, each as 2 passes over rotating weight
    copies captured in one CUDA graph."""
    rows = []
    for name, (k, n) in SHAPES.items():
        if time.time() > deadline:
            break
        x = torch.randn(1, k, device=DEV).half()
        r4 = copies(int4_bytes(0, k, n, group))
        int4 = []
        for i in range(r4):
            qw, qz, s, _ = make(k, n, group, seed=i)
            int4.append((al.repack_kmajor(qw), qz, s))
            del qw
        t4 = graph_ms([lambda w=w: at.awq_linear_k(x, w[0], w[1], w[2], None, group)
                       for w in int4] * 2)
        del int4
        r16 = copies(2 * k * n)
        w16 = [torch.randn(n, k, device=DEV, dtype=torch.float16) for _ in range(r16)]
        t16 = graph_ms([lambda w=w: F.linear(x, w) for w in w16] * 2)
        del w16
        if DEV == "cuda":
            torch.cuda.empty_cache()
        row = dict(shape=name, m=1, fp16_us=t16 * 1e3, int4_us=t4 * 1e3,
                   speedup_vs_fp16=t16 / t4, int4_GBs=int4_bytes(1, k, n, group) / t4 / 1e6,
                   fp16_GBs=(2 * k * n) / t16 / 1e6, copies=(r4, r16))
        rows.append(row)
        log(f"graph decode {name:<20} fp16 {row['fp16_us']:7.1f}us ({row['fp16_GBs']:.0f} GB/s)"
            f"  int4 {row['int4_us']:7.1f}us ({row['int4_GBs']:.0f} GB/s)  "
            f"int4/fp16 speed {row['speedup_vs_fp16']:.2f}x")
    return rows


def timing(quick: bool, deadline: float, old: bool) -> tuple[list[dict], float]:
    copy_src = torch.empty(1 << (20 if SMOKE else 30), dtype=torch.uint8, device=DEV)
    copy_dst = torch.empty_like(copy_src)
    copy_ms = bench(lambda: copy_dst.copy_(copy_src))
    copy_tbs = 2 * copy_src.numel() / copy_ms / 1e9
    del copy_src, copy_dst
    rows = []
    tokens = [1, 2, 4, 8, 64, 512, 2048] if not quick else [1, 4, 512, 2048]
    tokens = tokens if not SMOKE else [1, 7]
    group = 128
    for name, (k, n) in SHAPES.items():
        qw, qz, s, _ = make(k, n, group)
        qt = al.repack_kmajor(qw)
        w16t = dequantize_weight(qw, qz, s, group).t().contiguous().half()  # [n, k]
        for m in tokens:
            if time.time() > deadline or (name.startswith("lm_head") and m > 512):
                continue
            x = torch.randn(m, k, device=DEV).half()
            paths = {"fp16_cublas": lambda: F.linear(x, w16t),
                     "int4_auto": lambda: at.awq_linear_k(x, qt, qz, s, None, group)}
            if m > al.GEMV_MAX_TOKENS:
                paths["dequant_only"] = lambda: at.awq_dequantize_k(qt, qz, s, group,
                                                                    torch.float16)
            if old:
                paths["old_awq_linear"] = lambda: at.awq_linear(x, qw, qz, s, None, group)
            row = dict(shape=name, m=m, ms={p: bench(fn) for p, fn in paths.items()})
            row["int4_GBs"] = int4_bytes(m, k, n, group) / row["ms"]["int4_auto"] / 1e6
            row["speedup_vs_fp16"] = row["ms"]["fp16_cublas"] / row["ms"]["int4_auto"]
            rows.append(row)
            log(f"{name:<20} m={m:<5} " + "  ".join(
                f"{p}={t * 1e3:8.1f}us" for p, t in row["ms"].items())
                + f"  int4/fp16 speed {row['speedup_vs_fp16']:.2f}x  "
                f"{row['int4_GBs']:.0f} GB/s")
        del w16t, qw, qt
        if DEV == "cuda":
            torch.cuda.empty_cache()
    return rows, copy_tbs


# -- --gemv-sweep --------------------------------------------------------------------------------
# The decode GEMV sweep: the K-major GEMV (kernels/int4/awq_gemv.py)
# against cuBLAS fp16 (F.linear), per Llama-3-8B decode shape, 1/2/4 tokens, group 128.
#
# Timing as the engine's decode runs: back-to-back calls over rotating weight copies (>= 256 MB
# a pass: nothing served from L2) replayed from one CUDA graph (graph_ms). At 1 token
# every candidate of awq_layout.GEMV_CANDIDATES x K split (programs_per_sm 4/8/16/32) is timed
# and checked against the fp32 matmul of the dequantized weight; the table's own choice and the
# best candidate then run at 2 and 4 tokens. Per-config failures are recorded, not fatal. Ends
# with the GEMV_TABLE rows the timings suggest (per shape class, the candidate with the lowest
# sum over its shapes of time / that shape's best time).
SWEEP_GROUP = 128  # the group size both sweeps run
DECODE_SHAPES = {"qkv 4096x6144": (4096, 6144), "q/o 4096x4096": (4096, 4096),
                 "k/v 4096x1024": (4096, 1024), "gate_up 4096x28672": (4096, 28672),
                 "gate/up 4096x14336": (4096, 14336), "down 14336x4096": (14336, 4096),
                 "lm_head 4096x128256": (4096, 128256)}
if SMOKE:
    DECODE_SHAPES = {"tiny 256x64": (256, 64), "tiny 512x136": (512, 136)}
PROGRAMS_PER_SM = (4, 8, 16, 32)


def gemv_candidates(k: int, n: int, sms: int) -> dict[al.GemvConfig, list[tuple]]:
    """config -> the (block_n, num_warps, num_stages, programs_per_sm) rows that give it."""
    out: dict[al.GemvConfig, list[tuple]] = {}
    bkw = min(SWEEP_GROUP // 8, 16)
    for bn, warps, stages, prefetch, stream in al.GEMV_CANDIDATES:
        for pps in PROGRAMS_PER_SM:
            split = al.gemv_split(k, n, bn, bkw, pps, sms)
            cfg = al.GemvConfig(block_n=bn, block_kw=bkw, split=split, num_warps=warps,
                                num_stages=stages, prefetch=prefetch, stream=stream)
            out.setdefault(cfg, []).append((bn, warps, stages, prefetch, stream, pps))
    return out


def gemv_sweep_shape(name: str, k: int, n: int, sms: int, deadline: float) -> dict:
    nb4 = int4_bytes(0, k, n, SWEEP_GROUP)
    r4, r16 = copies(nb4), copies(2 * k * n)
    mats = []
    for i in range(r4):
        qw, qz, s, _ = make(k, n, SWEEP_GROUP, seed=i)
        mats.append((al.repack_kmajor(qw), None, qz, s))
        if i == 0:
            w_ref = dequantize_weight(qw, qz, s, SWEEP_GROUP)  # fp32 [k, n] of copy 0
        del qw
    x = torch.randn(4, k, device=DEV).half()
    ref = x.float() @ w_ref
    del w_ref
    row: dict = dict(shape=name, k=k, n=n, copies=(r4, r16), m={})

    def err(y, m):
        return rel(y, ref[:m])

    def run_new(cfg, m):
        return [lambda w=w: at.awq_gemv_k(x[:m], w[0], w[2], w[3], None, SWEEP_GROUP, config=cfg)
                for w in mats] * 2

    w16 = [torch.randn(n, k, device=DEV, dtype=torch.float16) for _ in range(r16)]
    for m in (1, 2, 4):
        t16 = graph_us([lambda w=w: F.linear(x[:m], w) for w in w16] * 2)
        row["m"][m] = dict(fp16_us=t16)
    del w16
    default = al.gemv_config(1, k, n, SWEEP_GROUP, sms)
    tried = []
    for cfg, rows in gemv_candidates(k, n, sms).items():
        if time.time() > deadline:
            row["truncated"] = True
            break
        rec = dict(config=asdict(cfg), rows=rows)
        try:
            rec["err"] = err(at.awq_gemv_k(x[:1], mats[0][0], mats[0][2], mats[0][3], None,
                                           SWEEP_GROUP, config=cfg), 1)
            rec["us"] = graph_us(run_new(cfg, 1))
        except Exception as exc:  # noqa: BLE001 - one bad config must not end the sweep
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        tried.append(rec)
    row["configs"] = tried
    ok = [r for r in tried if "us" in r and r["err"] <= TOL[torch.float16]]
    best = min(ok, key=lambda r: r["us"]) if ok else None
    row["best"] = best
    for m in (1, 2, 4):
        mm = row["m"][m]
        for label, cfg in (("v3_table", default),
                           ("v3_best", al.GemvConfig(**best["config"]) if best else None)):
            if cfg is None or time.time() > deadline + 20:
                continue
            try:
                y = at.awq_gemv_k(x[:m], mats[0][0], mats[0][2], mats[0][3], None, SWEEP_GROUP,
                               config=cfg)
                mm[label + "_err"] = err(y, m)
                mm[label + "_us"] = graph_us(run_new(cfg, m))
            except Exception as exc:  # noqa: BLE001
                mm[label + "_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    del mats
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return row


def gemv_print_row(r: dict) -> None:
    b = r.get("best")
    cfg = b["config"] if b else {}
    tag = (f"bn{cfg['block_n']} w{cfg['num_warps']} st{cfg['num_stages']} "
           f"pf{cfg.get('prefetch', 0)} sm{cfg.get('stream', 0)} split{cfg['split']}"
           if b else "none ok")
    for m, mm in r["m"].items():
        t3, tb = mm.get("v3_table_us"), mm.get("v3_best_us")
        best_t = min(t for t in (t3, tb) if t) if (t3 or tb) else None
        gbs = int4_bytes(m, r["k"], r["n"], SWEEP_GROUP) / best_t / 1e3 if best_t else 0.0

        def us(t):
            return f"{t:7.1f}" if t else "    n/a"

        log(f"{r['shape']:<20} m={m} fp16 {us(mm['fp16_us'])}  "
              f"v3 table {us(t3)}  v3 best {us(tb)} [{tag}]  {gbs:5.0f} GB/s  "
              f"v3/fp16 {mm['fp16_us'] / best_t if best_t else 0:.2f}x"
              + ("" if all(mm.get(e, 0) <= TOL[torch.float16] for e in
                           ("v3_table_err", "v3_best_err")) else "  ERR"))


def gemv_suggest_table(rows: list[dict]) -> dict:
    """Per shape class, the (block_n, warps, stages, prefetch, stream, programs_per_sm) row with the lowest sum
    of time / best time over the class's shapes (only rows timed on every one of them)."""
    out = {}
    for cls in ("small_n", "large_n", "huge_n"):
        members = [r for r in rows if al.gemv_shape_class(r["n"]) == cls and r.get("best")]
        score: dict[tuple, list[float]] = {}
        for r in members:
            for c in r["configs"]:
                if "us" in c and c["err"] <= TOL[torch.float16]:
                    for key in c["rows"]:
                        score.setdefault(tuple(key), []).append(c["us"] / r["best"]["us"])
        full = {key: sum(v) / len(v) for key, v in score.items() if len(v) == len(members)}
        if full:
            key = min(full, key=full.get)
            out[cls] = dict(block_n=key[0], num_warps=key[1], num_stages=key[2],
                            prefetch=key[3], stream=key[4], programs_per_sm=key[5],
                            mean_time_over_best=full[key])
            log(f"suggested GEMV_TABLE[{cls!r}] = GemvTile(block_n={key[0]}, "
                  f"num_warps={key[1]}, num_stages={key[2]}, programs_per_sm={key[5]}, "
                  f"prefetch={key[3]}, stream={key[4]})  # {full[key]:.3f}x the per-shape best on average")
    return out


def gemv_warm_up(deadline: float) -> dict:
    """Compile every candidate (with and without split-K) once on a 4096x1024 layer, so that
    compile time does not eat the first shape's share (the real shapes' integer arguments
    are all multiples of 16: the same specialisations). Returns failures by candidate."""
    k, n = (4096, 1024) if not SMOKE else (256, 64)
    qw, qz, s, _ = make(k, n, SWEEP_GROUP)
    qt = al.repack_kmajor(qw)
    x = torch.randn(1, k, device=DEV).half()
    failed = {}
    for bn, warps, stages, prefetch, stream in al.GEMV_CANDIDATES:
        for split in (1, 2):
            if time.time() > deadline:
                return failed
            cfg = al.GemvConfig(block_n=bn, block_kw=min(SWEEP_GROUP // 8, 16), split=split,
                                num_warps=warps, num_stages=stages, prefetch=prefetch,
                                stream=stream)
            try:
                at.awq_gemv_k(x, qt, qz, s, None, SWEEP_GROUP, config=cfg)
            except Exception as exc:  # noqa: BLE001
                failed[str((bn, warps, stages, prefetch, stream, split))] = \
                    f"{type(exc).__name__}: {str(exc)[:160]}"
    if DEV == "cuda":
        torch.cuda.synchronize()
    return failed


def gemv_sweep(deadline: float) -> dict:
    """Sweep every decode shape until deadline; returns the JSON-ready results."""
    sms = at._sm_count(torch.device(DEV))
    res: dict = dict(sms=sms, group=SWEEP_GROUP, shapes=[],
                     table_before={k: asdict(v) for k, v in al.GEMV_TABLE.items()})
    t0 = time.time()
    res["compile_failures"] = gemv_warm_up(t0 + 0.5 * (deadline - t0))
    log(f"gemv sweep: compiled {len(al.GEMV_CANDIDATES)} candidates x (split, no split) in "
          f"{time.time() - t0:.0f} s; failures: {res['compile_failures'] or 'none'}")
    n_shapes = len(DECODE_SHAPES)
    for i, (name, (k, n)) in enumerate(DECODE_SHAPES.items()):
        now = time.time()
        if now > deadline:
            log(f"gemv sweep: out of time before {name}")
            break
        share = now + (deadline - now) / (n_shapes - i)  # even split of what is left
        try:
            row = gemv_sweep_shape(name, k, n, sms, share)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory: the next shape still runs
            log(f"gemv sweep {name}: FAILED {type(exc).__name__}: {str(exc)[:200]}")
            res["shapes"].append(dict(shape=name, error=str(exc)[:400]))
            continue
        res["shapes"].append(row)
        gemv_print_row(row)
    res["suggested_table"] = gemv_suggest_table([r for r in res["shapes"] if "configs" in r])
    return res


# -- --prefill-sweep ------------------------------------------------------------------------------
# The prefill sweep: the fused dequant-GEMM
# (kernels/int4/awq_gemm_k.py) against dequantize + cuBLAS (awq_dequant_matmul_k) and
# fp16 cuBLAS (F.linear on the dense [N, K] weight), per Llama-3-8B decoder shape (stacked
# qkv, o, stacked gate|up, down) at 64/256/1024/2048 tokens, fp16, group 128.
#
# Timing: GPU time per call, back-to-back calls over rotating weight copies (>= 256 MB a pass:
# nothing served from L2) replayed from one CUDA graph (graph_ms); the engine's prefill
# runs eager, but behind big matmuls, so host launch cost is hidden there as well. Every
# candidate of awq_layout.GEMM_CANDIDATES (block_m cut to the tokens as gemm_config does) is
# checked once against the fp32 matmul of the dequantized weight before it is timed; per-config
# failures are recorded, not fatal. Ends with the GEMM_TABLE rows (per token bucket and N class:
# the candidate with the lowest sum over its shapes of time / that shape's best time) and the
# FUSED_MAX_TOKENS per N class that the timings suggest (the largest swept token count up to
# which the suggested tile beat dequantize + cuBLAS on every shape of the class and every
# smaller swept count). A bf16 check of the table's tiles runs first.
PREFILL_SHAPES = {"qkv 4096x6144": (4096, 6144), "o 4096x4096": (4096, 4096),
                  "gate_up 4096x28672": (4096, 28672), "down 14336x4096": (14336, 4096)}
PREFILL_TOKENS = (64, 256, 1024, 2048)
if SMOKE:
    PREFILL_SHAPES = {"tiny 256x64": (256, 64), "tiny 512x136": (512, 136)}
    PREFILL_TOKENS = (5, 40)


def prefill_candidates(m: int) -> list[al.GemmConfig]:
    """GEMM_CANDIDATES with block_m cut to m (as gemm_config does), deduplicated, the
    table's own tile first."""
    bm_cap = max(16, 1 << (m - 1).bit_length())
    out = []
    for bm, bn, bk, w, st in al.GEMM_CANDIDATES:
        c = al.GemmConfig(min(bm, bm_cap), bn, bk, w, st)
        if c not in out:
            out.append(c)
    return out


def prefill_sweep_shape(name: str, k: int, n: int, deadline: float) -> list[dict]:
    r4, r16 = copies(int4_bytes(0, k, n, SWEEP_GROUP)), copies(2 * k * n)
    mats = []
    for i in range(r4):
        qw, qz, s, _ = make(k, n, SWEEP_GROUP, seed=i)
        mats.append((al.repack_kmajor(qw), qz, s))
    w32 = dequantize_weight(qw, qz, s, SWEEP_GROUP)  # the last copy's fp32 weight [k, n]
    del qw
    w16 = [w32.t().contiguous().half()] + [torch.randn(n, k, device=DEV, dtype=torch.float16)
                                            for _ in range(r16 - 1)]
    rows = []
    for m in PREFILL_TOKENS:
        if time.time() > deadline:
            log(f"prefill sweep: out of time at {name} m={m}")
            break
        x = torch.randn(m, k, device=DEV).half()
        ref = x.float() @ w32
        row = dict(shape=name, k=k, n=n, m=m, n_class=al.gemv_shape_class(n),
                   bucket=al.gemm_m_bucket(m), copies=(r4, r16), fused={}, errors={})
        last = mats[-1]

        def timed(key, one, many):
            try:
                err = rel(one(), ref)
                if not err <= TOL[torch.float16]:
                    row["errors"][key] = f"rel_err {err:.2e}"
                    return None
                return graph_us(many)
            except Exception as exc:  # noqa: BLE001 - a failing config must not end the sweep
                row["errors"][key] = f"{type(exc).__name__}: {str(exc)[:160]}"
                return None

        row["fp16_us"] = timed("fp16", lambda: F.linear(x, w16[0]),
                               [lambda w=w: F.linear(x, w) for w in w16] * 2)
        row["dequant_us"] = timed(
            "dequant", lambda: at.awq_dequant_matmul_k(x, *last, None, SWEEP_GROUP),
            [lambda w=w: at.awq_dequant_matmul_k(x, *w, None, SWEEP_GROUP) for w in mats] * 2)
        for cfg in prefill_candidates(m):
            if time.time() > deadline:
                break
            key = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
            row["fused"][key] = timed(
                key, lambda cfg=cfg: at.awq_gemm_k(x, *last, None, SWEEP_GROUP, config=cfg),
                [lambda w=w, cfg=cfg: at.awq_gemm_k(x, *w, None, SWEEP_GROUP, config=cfg)
                 for w in mats] * 2)
        tc = al.gemm_config(m, n)
        row["table_key"] = (f"{tc.block_m}x{tc.block_n}x{tc.block_k} w{tc.num_warps} "
                            f"s{tc.num_stages}")
        ok = {c: t for c, t in row["fused"].items() if t is not None}
        row["best_key"] = min(ok, key=ok.get) if ok else None
        rows.append(row)
        prefill_print_row(row)
        del x, ref
    del mats, w16, w32
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return rows


def prefill_print_row(r: dict) -> None:
    def us(t):
        return f"{t:8.1f}" if t is not None else "    fail"

    best = r["fused"].get(r["best_key"]) if r["best_key"] else None
    table = r["fused"].get(r["table_key"])
    fp16, dq = r["fp16_us"], r["dequant_us"]
    speed = (f"{fp16 / min(t for t in (dq, best) if t is not None):5.2f}x"
             if fp16 and (dq or best) else "    -")
    log(f"{r['shape']:<20} m={r['m']:<5} fp16 {us(fp16)}  dequant+cuBLAS {us(dq)}  "
          f"fused table {us(table)}  fused best {us(best)} [{r['best_key']}]  "
          f"int4(best path)/fp16 speed {speed}  errors {len(r['errors'])}")


def prefill_suggest(rows: list[dict]) -> dict:
    """GEMM_TABLE rows and FUSED_MAX_TOKENS per N class from the timings."""
    table: dict[str, str] = {}
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["bucket"], r["n_class"]), []).append(r)
    pick: dict[tuple[str, str], str] = {}
    for (bucket, cls), rs in sorted(groups.items()):
        score: dict[str, float] = {}
        for r in rs:
            ok = {c: t for c, t in r["fused"].items() if t is not None}
            if not ok:
                continue
            best = min(ok.values())
            for c in r["fused"]:  # a failed config scores infinity on that shape
                score[c] = score.get(c, 0.0) + (ok[c] / best if c in ok else float("inf"))
        if not score:
            continue
        key = min(score, key=score.get)
        pick[(bucket, cls)] = key
        bm, bn, bk = (int(v) for v in key.split()[0].split("x"))
        w, st = int(key.split()[1][1:]), int(key.split()[2][1:])
        table[f"{bucket},{cls}"] = key
        log(f"suggested GEMM_TABLE[({bucket!r}, {cls!r})] = GemmConfig(block_m={bm}, "
              f"block_n={bn}, block_k={bk}, num_warps={w}, num_stages={st})  "
              f"(score {score[key]:.2f} over {len(rs)} shapes)")
    fused_max: dict[str, int] = {}
    for cls in sorted({r["n_class"] for r in rows}):
        limit = al.GEMV_MAX_TOKENS
        for m in sorted({r["m"] for r in rows if r["n_class"] == cls}):
            rs = [r for r in rows if r["n_class"] == cls and r["m"] == m]
            key = pick.get((al.gemm_m_bucket(m), cls))
            wins = key is not None and all(
                r["fused"].get(key) is not None and r["dequant_us"] is not None
                and r["fused"][key] <= r["dequant_us"] for r in rs)
            if not wins:
                break
            limit = m
        fused_max[cls] = limit
    log(f"suggested FUSED_MAX_TOKENS (huge_n not swept: keep) = "
          f"{dict(al.FUSED_MAX_TOKENS, **fused_max)}  (now {al.FUSED_MAX_TOKENS})")
    return {"gemm_table": table, "fused_max_tokens": fused_max}


def prefill_bf16_check() -> list[dict]:
    """The table's tiles in bf16 (the CPU interpreter cannot check bf16 tl.dot)."""
    out = []
    k, n = (4096, 4096 + 8 * 13) if not SMOKE else (256, 136)
    qw, qz, s, b = make(k, n, SWEEP_GROUP, seed=11)
    qt = al.repack_kmajor(qw)
    w = dequantize_weight(qw, qz, s, SWEEP_GROUP)
    for m in PREFILL_TOKENS[:2] + (PREFILL_TOKENS[-1] + 3,):
        if SMOKE:  # the interpreter's bf16 tl.dot is wrong (tests/test_awq_triton.py)
            break
        x = torch.randn(m, k, device=DEV).bfloat16()
        bb = b.bfloat16()
        try:
            err = rel(at.awq_gemm_k(x, qt, qz, s, bb, SWEEP_GROUP), x.float() @ w + bb.float())
            ok = err <= TOL[torch.bfloat16]
        except Exception as exc:  # noqa: BLE001
            err, ok = f"{type(exc).__name__}: {str(exc)[:160]}", False
        out.append(dict(m=m, k=k, n=n, rel_err=err, ok=ok, config=asdict(al.gemm_config(m, n))))
        log(f"prefill sweep bf16 check m={m} {k}x{n}: rel_err {err} ok={ok}")
    return out


def prefill_sweep(deadline: float) -> dict:
    t0 = time.time()
    res: dict = {"bf16_check": prefill_bf16_check(), "rows": []}
    for name, (k, n) in PREFILL_SHAPES.items():
        if time.time() > deadline:
            log(f"prefill sweep: out of time before {name}")
            break
        try:
            res["rows"] += prefill_sweep_shape(name, k, n, deadline)
        except Exception as exc:  # noqa: BLE001
            log(f"prefill sweep {name}: FAILED {type(exc).__name__}: {str(exc)[:200]}")
            res["rows"].append(dict(shape=name, failed=f"{type(exc).__name__}: {exc}"[:300]))
            if DEV == "cuda":
                torch.cuda.empty_cache()
    res["suggested"] = prefill_suggest([r for r in res["rows"] if "failed" not in r])
    res["seconds"] = time.time() - t0
    log(f"prefill sweep: {res['seconds']:.0f} s")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="dequantize tile sweep")
    ap.add_argument("--gemv-sweep", action="store_true",
                    help="decode GEMV: v3 candidates vs v2 vs fp16 per shape")
    ap.add_argument("--prefill-sweep", action="store_true",
                    help="prefill: fused GEMM candidates vs dequant+cuBLAS vs fp16 per shape")
    ap.add_argument("--old", action="store_true", help="also time the AWQ-layout kernels")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--budget-s", type=float, default=480.0)
    ap.add_argument("--smoke-cpu", action="store_true", help="tiny shapes, interpreter, no GPU")
    args = ap.parse_args()
    t0 = time.time()
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    res = {"device": "cpu (interpreter smoke)" if SMOKE else torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": triton.__version__,
           "GEMV_MAX_TOKENS": al.GEMV_MAX_TOKENS, "FUSED_MAX_TOKENS": al.FUSED_MAX_TOKENS}

    def save():
        (out_dir / "gpu_awq.json").write_text(json.dumps(res, indent=1) + "\n")

    b = args.budget_s
    res["correctness"] = check_correctness(args.quick, t0 + 0.2 * b)
    bad = [r for r in res["correctness"] if not r["ok"]]
    log(f"correctness: {len(res['correctness']) - len(bad)}/{len(res['correctness'])} ok")
    res["cuda_graph"] = check_cuda_graph()
    log(f"cuda graph decode: {res['cuda_graph']}")
    save()
    if args.gemv_sweep:
        res["gemv_sweep"] = gemv_sweep(t0 + (0.9 if args.no_timing else 0.6) * b)
        save()
    if args.prefill_sweep:
        res["prefill_sweep"] = prefill_sweep(t0 + (0.95 if args.no_timing else 0.6) * b)
        save()
    if args.sweep:
        res["sweep_dequant"] = sweep_dequant(t0 + 0.72 * b)
        save()
    if not args.no_timing:
        res["graph_decode"] = decode_graph_timing(t0 + 0.5 * b)
        save()
        res["timing"], res["copy_TBs"] = timing(args.quick, t0 + b, args.old)
        log(f"measured D2D copy: {res['copy_TBs']:.2f} TB/s (nominal {PEAK_TBS})")
    res["seconds"] = time.time() - t0
    save()
    log(f"wrote {out_dir / 'gpu_awq.json'} in {res['seconds']:.0f} s")
    sys.exit(1 if bad or not res["cuda_graph"]["ok"] else 0)


if __name__ == "__main__":
    main()
