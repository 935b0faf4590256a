"""Prefill sweep for `gpu_awq.py --prefill-sweep`: the fused dequant-GEMM
(kernels/int4/awq_gemm_k.py) against dequantize + cuBLAS (awq_dequant_matmul_k) and
fp16 cuBLAS (F.linear on the dense [N, K] weight), per Llama-3-8B decoder shape (stacked
qkv, o, stacked gate|up, down) at 64/256/1024/2048 tokens, fp16, group 128.

Timing: GPU time per call, back-to-back calls over rotating weight copies (>= 256 MB a pass:
nothing served from L2) replayed from one CUDA graph (gpu_awq.graph_ms); the engine's prefill
runs eager, but behind big matmuls, so host launch cost is hidden there as well. Every
candidate of awq_layout.GEMM_CANDIDATES (block_m cut to the tokens as gemm_config does) is
checked once against the fp32 matmul of the dequantized weight before it is timed; per-config
failures are recorded, not fatal. Ends with the GEMM_TABLE rows (per token bucket and N class:
the candidate with the lowest sum over its shapes of time / that shape's best time) and the
FUSED_MAX_TOKENS per N class that the timings suggest (the largest swept token count up to
which the suggested tile beat dequantize + cuBLAS on every shape of the class and every
smaller swept count). A bf16 check of the table's tiles runs first.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import torch
import torch.nn.functional as F

import gpu_awq as g
from hisparse_cli.kernels.int4 import awq_layout as al
from hisparse_cli.kernels.int4.awq_gemm_k import awq_gemm_k
from hisparse_cli.kernels.int4.awq_ref import dequantize_weight
from hisparse_cli.kernels.int4.awq_triton import awq_dequant_matmul_k

PREFILL_SHAPES = {"qkv 4096x6144": (4096, 6144), "o 4096x4096": (4096, 4096),
                  "gate_up 4096x28672": (4096, 28672), "down 14336x4096": (14336, 4096)}
TOKENS = (64, 256, 1024, 2048)
if g.SMOKE:
    PREFILL_SHAPES = {"tiny 256x64": (256, 64), "tiny 512x136": (512, 136)}
    TOKENS = (5, 40)
GROUP = 128


def candidates(m: int) -> list[al.GemmConfig]:
    """GEMM_CANDIDATES with block_m cut to m (as gemm_config does), deduplicated, the
    table's own tile first."""
    bm_cap = max(16, 1 << (m - 1).bit_length())
    out = []
    for bm, bn, bk, w, st in al.GEMM_CANDIDATES:
        c = al.GemmConfig(min(bm, bm_cap), bn, bk, w, st)
        if c not in out:
            out.append(c)
    return out


def _us(fns: list) -> float:
    return g.graph_ms(fns) * 1e3


def sweep_shape(name: str, k: int, n: int, deadline: float) -> list[dict]:
    r4, r16 = g.copies(g.int4_bytes(0, k, n, GROUP)), g.copies(2 * k * n)
    mats = []
    for i in range(r4):
        qw, qz, s, _ = g.make(k, n, GROUP, seed=i)
        mats.append((al.repack_kmajor(qw), qz, s))
    w32 = dequantize_weight(qw, qz, s, GROUP)  # the last copy's fp32 weight [k, n]
    del qw
    w16 = [w32.t().contiguous().half()] + [torch.randn(n, k, device=g.DEV, dtype=torch.float16)
                                            for _ in range(r16 - 1)]
    rows = []
    for m in TOKENS:
        if time.time() > deadline:
            g.log(f"prefill sweep: out of time at {name} m={m}")
            break
        x = torch.randn(m, k, device=g.DEV).half()
        ref = x.float() @ w32
        row = dict(shape=name, k=k, n=n, m=m, n_class=al.gemv_shape_class(n),
                   bucket=al.gemm_m_bucket(m), copies=(r4, r16), fused={}, errors={})
        last = mats[-1]

        def timed(key, one, many):
            try:
                err = g.rel(one(), ref)
                if not err <= g.TOL[torch.float16]:
                    row["errors"][key] = f"rel_err {err:.2e}"
                    return None
                return _us(many)
            except Exception as exc:  # noqa: BLE001 - a failing config must not end the sweep
                row["errors"][key] = f"{type(exc).__name__}: {str(exc)[:160]}"
                return None

        row["fp16_us"] = timed("fp16", lambda: F.linear(x, w16[0]),
                               [lambda w=w: F.linear(x, w) for w in w16] * 2)
        row["dequant_us"] = timed(
            "dequant", lambda: awq_dequant_matmul_k(x, *last, None, GROUP),
            [lambda w=w: awq_dequant_matmul_k(x, *w, None, GROUP) for w in mats] * 2)
        for cfg in candidates(m):
            if time.time() > deadline:
                break
            key = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
            row["fused"][key] = timed(
                key, lambda cfg=cfg: awq_gemm_k(x, *last, None, GROUP, config=cfg),
                [lambda w=w, cfg=cfg: awq_gemm_k(x, *w, None, GROUP, config=cfg)
                 for w in mats] * 2)
        tc = al.gemm_config(m, n)
        row["table_key"] = (f"{tc.block_m}x{tc.block_n}x{tc.block_k} w{tc.num_warps} "
                            f"s{tc.num_stages}")
        ok = {c: t for c, t in row["fused"].items() if t is not None}
        row["best_key"] = min(ok, key=ok.get) if ok else None
        rows.append(row)
        print_row(row)
        del x, ref
    del mats, w16, w32
    if g.DEV == "cuda":
        torch.cuda.empty_cache()
    return rows


def print_row(r: dict) -> None:
    def us(t):
        return f"{t:8.1f}" if t is not None else "    fail"

    best = r["fused"].get(r["best_key"]) if r["best_key"] else None
    table = r["fused"].get(r["table_key"])
    fp16, dq = r["fp16_us"], r["dequant_us"]
    speed = (f"{fp16 / min(t for t in (dq, best) if t is not None):5.2f}x"
             if fp16 and (dq or best) else "    -")
    g.log(f"{r['shape']:<20} m={r['m']:<5} fp16 {us(fp16)}  dequant+cuBLAS {us(dq)}  "
          f"fused table {us(table)}  fused best {us(best)} [{r['best_key']}]  "
          f"int4(best path)/fp16 speed {speed}  errors {len(r['errors'])}")


def suggest(rows: list[dict]) -> dict:
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
        g.log(f"suggested GEMM_TABLE[({bucket!r}, {cls!r})] = GemmConfig(block_m={bm}, "
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
    g.log(f"suggested FUSED_MAX_TOKENS (huge_n not swept: keep) = "
          f"{dict(al.FUSED_MAX_TOKENS, **fused_max)}  (now {al.FUSED_MAX_TOKENS})")
    return {"gemm_table": table, "fused_max_tokens": fused_max}


def bf16_check() -> list[dict]:
    """The table's tiles in bf16 (the CPU interpreter cannot check bf16 tl.dot)."""
    out = []
    k, n = (4096, 4096 + 8 * 13) if not g.SMOKE else (256, 136)
    qw, qz, s, b = g.make(k, n, GROUP, seed=11)
    qt = al.repack_kmajor(qw)
    w = dequantize_weight(qw, qz, s, GROUP)
    for m in TOKENS[:2] + (TOKENS[-1] + 3,):
        if g.SMOKE:  # the interpreter's bf16 tl.dot is wrong (tests/test_awq_triton.py)
            break
        x = torch.randn(m, k, device=g.DEV).bfloat16()
        bb = b.bfloat16()
        try:
            err = g.rel(awq_gemm_k(x, qt, qz, s, bb, GROUP), x.float() @ w + bb.float())
            ok = err <= g.TOL[torch.bfloat16]
        except Exception as exc:  # noqa: BLE001
            err, ok = f"{type(exc).__name__}: {str(exc)[:160]}", False
        out.append(dict(m=m, k=k, n=n, rel_err=err, ok=ok, config=asdict(al.gemm_config(m, n))))
        g.log(f"prefill sweep bf16 check m={m} {k}x{n}: rel_err {err} ok={ok}")
    return out


def prefill_sweep(deadline: float) -> dict:
    t0 = time.time()
    res: dict = {"bf16_check": bf16_check(), "rows": []}
    for name, (k, n) in PREFILL_SHAPES.items():
        if time.time() > deadline:
            g.log(f"prefill sweep: out of time before {name}")
            break
        try:
            res["rows"] += sweep_shape(name, k, n, deadline)
        except Exception as exc:  # noqa: BLE001
            g.log(f"prefill sweep {name}: FAILED {type(exc).__name__}: {str(exc)[:200]}")
            res["rows"].append(dict(shape=name, failed=f"{type(exc).__name__}: {exc}"[:300]))
            if g.DEV == "cuda":
                torch.cuda.empty_cache()
    res["suggested"] = suggest([r for r in res["rows"] if "failed" not in r])
    res["seconds"] = time.time() - t0
    g.log(f"prefill sweep: {res['seconds']:.0f} s")
    return res
