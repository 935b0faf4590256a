"""GPU check and timing of the Triton AWQ INT4 kernels (hisparse_cli/kernels/awq_triton.py).

1. correctness: every path (GEMV, fused GEMM, dequant+cuBLAS, auto) against the fp32 matmul of
   the dequantized weight, fp16 and bf16, Llama-3-8B linear shapes, 1..4096 tokens, groups
   32/64/128; plus a CUDA-graph capture/replay of the decode call.
2. timing (triton.testing.do_bench, L2 flushed): fused GEMV vs fused GEMM vs dequant+cuBLAS vs
   fp16 cuBLAS on the dense weight, tokens 1..8192; effective GB/s on the INT4 model bytes vs
   the H200's 4.24 TB/s and vs a measured device-to-device copy.
3. small config sweeps for the GEMV (M=1) and GEMM launch parameters.

Needs only torch + triton (runs with torch 2.11 / triton 3.6). Writes $OUT/gpu_awq.json
(OUT defaults to ./out) and prints short tables.
    python benchmarks/gpu_awq.py [--quick] [--budget-s 480]
    python benchmarks/gpu_awq.py --smoke-cpu     # tiny shapes under TRITON_INTERPRET=1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
SMOKE = "--smoke-cpu" in sys.argv  # script check without a GPU: interpreter, tiny shapes
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402

from hisparse_cli.kernels import awq_triton as at  # noqa: E402
from hisparse_cli.kernels.awq_ref import dequantize_weight  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
PEAK_TBS = 4.24
SHAPES = {"q/o 4096x4096": (4096, 4096), "k/v 4096x1024": (4096, 1024),
          "gate/up 4096x14336": (4096, 14336), "down 14336x4096": (14336, 4096),
          "lm_head 4096x128256": (4096, 128256)}
TOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2}
DTYPES = (torch.float16, torch.bfloat16)
if SMOKE:  # (the 3.9 interpreter's bf16 tl.dot is wrong, so fp16 only there)
    SHAPES, DTYPES = {"tiny 128x64": (128, 64), "tiny 256x136": (256, 136)}, (torch.float16,)


def make(k: int, n: int, group: int, seed: int = 0):
    """Random valid AWQ tensors on CUDA: any int32 word is 8 valid nibbles."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    qw = torch.randint(-2**31, 2**31 - 1, (k, n // 8), device=DEV, dtype=torch.int32,
                       generator=g)
    qz = torch.randint(-2**31, 2**31 - 1, (k // group, n // 8), device=DEV,
                       dtype=torch.int32, generator=g)
    s = (torch.rand(k // group, n, device=DEV, generator=g) * 0.01 + 0.001).half()
    b = torch.randn(n, device=DEV, generator=g) * 0.1
    return qw, qz, s, b


def bench(fn) -> float:
    """Median milliseconds (L2 flushed between runs by do_bench)."""
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench

    try:
        return float(do_bench(fn, warmup=10, rep=40, return_mode="median"))
    except TypeError:  # older signature
        return float(do_bench(fn, warmup=10, rep=40))


def check_correctness(quick: bool, deadline: float) -> list[dict]:
    rows = []
    tokens = [1, 2, 3, 4, 8, 16, 33, 128, 512, 4096] if not quick else [1, 4, 33, 512]
    for name, (k, n) in SHAPES.items():
        for group in ((128,) if name.startswith("lm_head") else (32, 64, 128)):
            qw, qz, s, b = make(k, n, group)
            w = dequantize_weight(qw, qz, s, group)  # fp32 [k, n]
            for dtype in DTYPES:
                for m in tokens:
                    if time.time() > deadline:
                        return rows
                    x = torch.randn(m, k, device=DEV).to(dtype)
                    ref = x.float() @ w + b.to(dtype).float()
                    scale = float(ref.abs().max())
                    for path in ("gemv", "gemm", "dequant_matmul", "linear"):
                        if path == "gemv" and m > 16:
                            continue
                        y = getattr(at, f"awq_{path}")(x, qw, qz, s, b.to(dtype), group)
                        err = float((y.float() - ref).abs().max()) / scale
                        ok = err <= TOL[dtype] and y.dtype == dtype
                        rows.append(dict(shape=name, group=group, dtype=str(dtype)[6:], m=m,
                                         path=path, rel_err=err, ok=ok))
                        if not ok:
                            print(f"FAIL {name} g{group} {dtype} m={m} {path}: {err:.2e}")
                    del x, ref
            del w
            torch.cuda.empty_cache()
    return rows


def check_cuda_graph() -> dict:
    if SMOKE:
        return {"ok": True, "skipped": "no CUDA"}
    k, n, group = 4096, 4096, 128
    qw, qz, s, b = make(k, n, group)
    x = torch.randn(1, k, device=DEV).half()
    for _ in range(2):
        at.awq_linear(x, qw, qz, s, None, group)  # compile outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = at.awq_linear(x, qw, qz, s, None, group)
    x.copy_(torch.randn(1, k, device=DEV).half())
    g.replay()
    torch.cuda.synchronize()
    ref = x.float() @ dequantize_weight(qw, qz, s, group)
    err = float((y.float() - ref).abs().max() / ref.abs().max())
    return {"rel_err": err, "ok": err <= TOL[torch.float16]}


def model_bytes(m: int, k: int, n: int, group: int) -> int:
    return k * n // 2 + (k // group) * n * 2 + (k // group) * n // 2 + 2 * m * (k + n)


def timing(quick: bool, deadline: float) -> tuple[list[dict], float]:
    copy_src = torch.empty(1 << (20 if SMOKE else 30), dtype=torch.uint8, device=DEV)
    copy_dst = torch.empty_like(copy_src)
    copy_ms = bench(lambda: copy_dst.copy_(copy_src))
    copy_tbs = 2 * copy_src.numel() / copy_ms / 1e9
    del copy_src, copy_dst
    rows = []
    tokens = [1, 2, 4, 8, 16, 32, 64, 128, 512, 2048, 8192]
    if quick:
        tokens = [1, 8, 64, 512, 2048]
    group = 128
    for name, (k, n) in SHAPES.items():
        qw, qz, s, _ = make(k, n, group)
        w16 = dequantize_weight(qw, qz, s, group).half()
        for m in tokens:
            if time.time() > deadline:
                return rows, copy_tbs
            x = torch.randn(m, k, device=DEV).half()
            paths = {"fp16_cublas": lambda: x @ w16,
                     "gemm": lambda: at.awq_gemm(x, qw, qz, s, None, group),
                     "dequant_mm": lambda: at.awq_dequant_matmul(x, qw, qz, s, None, group),
                     "auto": lambda: at.awq_linear(x, qw, qz, s, None, group)}
            if m <= 16:
                paths["gemv"] = lambda: at.awq_gemv(x, qw, qz, s, None, group)
            row = dict(shape=name, m=m, ms={})
            for p, fn in paths.items():
                row["ms"][p] = bench(fn)
            nbytes = model_bytes(m, k, n, group)
            row["int4_GBs"] = {p: nbytes / t / 1e6 for p, t in row["ms"].items() if p != "fp16_cublas"}
            row["fp16_GBs"] = (k * n * 2 + 2 * m * (k + n)) / row["ms"]["fp16_cublas"] / 1e6
            row["tflops"] = {p: 2 * m * k * n / t / 1e9 for p, t in row["ms"].items()}
            int4 = {p: t for p, t in row["ms"].items() if p not in ("fp16_cublas", "auto")}
            row["best_int4"] = min(int4, key=int4.get)
            rows.append(row)
            print(f"{name:<20} m={m:<5} " + "  ".join(
                f"{p}={t * 1e3:8.1f}us" for p, t in row["ms"].items())
                + f"  best={row['best_int4']}  "
                f"{row['int4_GBs'][row['best_int4']]:.0f} GB/s", flush=True)
        del w16
        torch.cuda.empty_cache()
    return rows, copy_tbs


def sweeps(quick: bool, deadline: float) -> dict:
    out = {"gemv_m1": [], "gemm": []}
    group = 128
    gemv_cfgs = [(bw, bk, nw) for bw in (16, 32, 64) for bk in (32, 64, 128) for nw in (2, 4, 8)]
    if quick:
        gemv_cfgs = [(32, 32, 4), (32, 64, 4), (64, 32, 4), (16, 128, 4)]
    for name, (k, n) in SHAPES.items():
        qw, qz, s, _ = make(k, n, group)
        x = torch.randn(1, k, device=DEV).half()
        for bw, bk, nw in gemv_cfgs:
            if time.time() > deadline:
                return out
            try:
                t = bench(lambda: at.awq_gemv(x, qw, qz, s, None, group, block_w=bw,
                                              block_k=bk, num_warps=nw))
            except Exception as exc:  # noqa: BLE001  (e.g. a config over the shared-memory limit)
                out["gemv_m1"].append(dict(shape=name, block_w=bw, block_k=bk, num_warps=nw,
                                           error=f"{type(exc).__name__}: {str(exc)[:120]}"))
                continue
            out["gemv_m1"].append(dict(shape=name, block_w=bw, block_k=bk, num_warps=nw, ms=t,
                                       GBs=model_bytes(1, k, n, group) / t / 1e6))
    gemm_cfgs = [(16, 64, 64, 4, 3), (16, 128, 64, 4, 3), (32, 128, 64, 4, 3),
                 (64, 128, 64, 4, 3), (64, 128, 128, 8, 3), (128, 128, 64, 8, 3),
                 (128, 256, 64, 8, 3), (64, 256, 64, 8, 4)]
    for name, (k, n) in SHAPES.items():
        qw, qz, s, _ = make(k, n, group)
        for m in ((16, 128) if quick else (16, 64, 256, 1024)):
            x = torch.randn(m, k, device=DEV).half()
            for cfg in gemm_cfgs:
                if time.time() > deadline:
                    return out
                try:
                    t = bench(lambda: at.awq_gemm(x, qw, qz, s, None, group, config=cfg))
                except Exception as exc:  # noqa: BLE001  (shared-memory limit and the like)
                    out["gemm"].append(dict(shape=name, m=m, config=cfg,
                                            error=f"{type(exc).__name__}: {str(exc)[:120]}"))
                    continue
                out["gemm"].append(dict(shape=name, m=m, config=cfg, ms=t,
                                        tflops=2 * m * k * n / t / 1e9))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget-s", type=float, default=480.0)
    ap.add_argument("--smoke-cpu", action="store_true", help="tiny shapes, interpreter, no GPU")
    args = ap.parse_args()
    t0 = time.time()
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    res = {"device": "cpu (interpreter smoke)" if SMOKE else torch.cuda.get_device_name(),
           "torch": torch.__version__,
           "triton": triton.__version__, "thresholds": {
               "GEMV_MAX_TOKENS": at.GEMV_MAX_TOKENS,
               "FUSED_GEMM_MAX_TOKENS": at.FUSED_GEMM_MAX_TOKENS}}

    def save():
        (out_dir / "gpu_awq.json").write_text(json.dumps(res, indent=1) + "\n")

    res["correctness"] = check_correctness(args.quick, t0 + 0.3 * args.budget_s)
    bad = [r for r in res["correctness"] if not r["ok"]]
    print(f"correctness: {len(res['correctness']) - len(bad)}/{len(res['correctness'])} ok",
          flush=True)
    res["cuda_graph"] = check_cuda_graph()
    print(f"cuda graph decode: {res['cuda_graph']}", flush=True)
    save()
    res["timing"], res["copy_TBs"] = timing(args.quick, t0 + 0.75 * args.budget_s)
    print(f"measured D2D copy: {res['copy_TBs']:.2f} TB/s (nominal {PEAK_TBS})")
    save()
    res["sweeps"] = sweeps(args.quick, t0 + args.budget_s)
    for name in SHAPES:
        cands = [r for r in res["sweeps"]["gemv_m1"] if r["shape"] == name and "ms" in r]
        if cands:
            b = min(cands, key=lambda r: r["ms"])
            print(f"best GEMV m=1 {name}: bw={b['block_w']} bk={b['block_k']} "
                  f"warps={b['num_warps']} {b['ms'] * 1e3:.1f}us {b['GBs']:.0f} GB/s "
                  f"({b['GBs'] / 1e3 / PEAK_TBS:.0%} of {PEAK_TBS} TB/s)")
    wins: dict[int, dict[str, int]] = {}
    for r in res["timing"]:
        wins.setdefault(r["m"], {}).setdefault(r["best_int4"], 0)
        wins[r["m"]][r["best_int4"]] += 1
    res["wins_by_tokens"] = wins
    print("fastest INT4 path by token count (shapes won):", json.dumps(wins))
    res["seconds"] = time.time() - t0
    save()
    print(f"wrote {out_dir / 'gpu_awq.json'} in {res['seconds']:.0f} s")
    sys.exit(1 if bad or not res["cuda_graph"]["ok"] else 0)


if __name__ == "__main__":
    main()
