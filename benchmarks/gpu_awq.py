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
2. sweeps: --gemv-sweep (gpu_awq_gemv.py) times the v3 decode GEMV's candidate configs
   against the v2 kernel and fp16 cuBLAS per decode shape at 1/2/4 tokens (CUDA graphs) and
   prints the GEMV_TABLE rows to adopt; --sweep: dequantize tile configs per shape;
   --prefill-sweep (gpu_awq_prefill.py) times fp16 cuBLAS vs dequant+cuBLAS vs the fused
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
from dataclasses import replace
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="dequantize tile sweep")
    ap.add_argument("--gemv-sweep", action="store_true",
                    help="decode GEMV: v3 candidates vs v2 vs fp16 per shape (gpu_awq_gemv.py)")
    ap.add_argument("--prefill-sweep", action="store_true",
                    help="prefill: fused GEMM candidates vs dequant+cuBLAS vs fp16 per shape "
                         "(gpu_awq_prefill.py)")
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
        from gpu_awq_gemv import gemv_sweep

        res["gemv_sweep"] = gemv_sweep(t0 + (0.9 if args.no_timing else 0.6) * b)
        save()
    if args.prefill_sweep:
        from gpu_awq_prefill import prefill_sweep

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
