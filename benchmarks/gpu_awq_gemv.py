"""Decode GEMV sweep for `gpu_awq.py --gemv-sweep`: the K-major GEMV (kernels/int4/awq_gemv.py)
against cuBLAS fp16 (F.linear), per Llama-3-8B decode shape, 1/2/4 tokens, group 128.

Timing as the engine's decode runs: back-to-back calls over rotating weight copies (>= 256 MB
a pass: nothing served from L2) replayed from one CUDA graph (gpu_awq.graph_ms). At 1 token
every candidate of awq_layout.GEMV_CANDIDATES x K split (programs_per_sm 4/8/16/32) is timed
and checked against the fp32 matmul of the dequantized weight; the table's own choice and the
best candidate then run at 2 and 4 tokens. Per-config failures are recorded, not fatal. Ends
with the GEMV_TABLE rows the timings suggest (per shape class, the candidate with the lowest
sum over its shapes of time / that shape's best time).
"""

from __future__ import annotations

import time
from dataclasses import asdict

import torch
import torch.nn.functional as F

import gpu_awq as g
from hisparse_cli.kernels.int4 import awq_layout as al
from hisparse_cli.kernels.int4.awq_gemv import _sm_count, awq_gemv_k
from hisparse_cli.kernels.int4.awq_ref import dequantize_weight

DECODE_SHAPES = {"qkv 4096x6144": (4096, 6144), "q/o 4096x4096": (4096, 4096),
                 "k/v 4096x1024": (4096, 1024), "gate_up 4096x28672": (4096, 28672),
                 "gate/up 4096x14336": (4096, 14336), "down 14336x4096": (14336, 4096),
                 "lm_head 4096x128256": (4096, 128256)}
if g.SMOKE:
    DECODE_SHAPES = {"tiny 256x64": (256, 64), "tiny 512x136": (512, 136)}
PROGRAMS_PER_SM = (4, 8, 16, 32)
GROUP = 128


def candidates(k: int, n: int, sms: int) -> dict[al.GemvConfig, list[tuple]]:
    """config -> the (block_n, num_warps, num_stages, programs_per_sm) rows that give it."""
    out: dict[al.GemvConfig, list[tuple]] = {}
    bkw = min(GROUP // 8, 16)
    for bn, warps, stages, prefetch, stream in al.GEMV_CANDIDATES:
        for pps in PROGRAMS_PER_SM:
            split = al.gemv_split(k, n, bn, bkw, pps, sms)
            cfg = al.GemvConfig(block_n=bn, block_kw=bkw, split=split, num_warps=warps,
                                num_stages=stages, prefetch=prefetch, stream=stream)
            out.setdefault(cfg, []).append((bn, warps, stages, prefetch, stream, pps))
    return out


def _time(fns: list) -> float:
    """Microseconds per call (graph replay), or raises."""
    return g.graph_ms(fns) * 1e3


def sweep_shape(name: str, k: int, n: int, sms: int, deadline: float) -> dict:
    nb4 = g.int4_bytes(0, k, n, GROUP)
    r4, r16 = g.copies(nb4), g.copies(2 * k * n)
    mats = []
    for i in range(r4):
        qw, qz, s, _ = g.make(k, n, GROUP, seed=i)
        mats.append((al.repack_kmajor(qw), None, qz, s))
        if i == 0:
            w_ref = dequantize_weight(qw, qz, s, GROUP)  # fp32 [k, n] of copy 0
        del qw
    x = torch.randn(4, k, device=g.DEV).half()
    ref = x.float() @ w_ref
    del w_ref
    row: dict = dict(shape=name, k=k, n=n, copies=(r4, r16), m={})

    def err(y, m):
        return g.rel(y, ref[:m])

    def run_new(cfg, m):
        return [lambda w=w: awq_gemv_k(x[:m], w[0], w[2], w[3], None, GROUP, config=cfg)
                for w in mats] * 2

    w16 = [torch.randn(n, k, device=g.DEV, dtype=torch.float16) for _ in range(r16)]
    for m in (1, 2, 4):
        t16 = _time([lambda w=w: F.linear(x[:m], w) for w in w16] * 2)
        row["m"][m] = dict(fp16_us=t16)
    del w16
    default = al.gemv_config(1, k, n, GROUP, sms)
    tried = []
    for cfg, rows in candidates(k, n, sms).items():
        if time.time() > deadline:
            row["truncated"] = True
            break
        rec = dict(config=asdict(cfg), rows=rows)
        try:
            rec["err"] = err(awq_gemv_k(x[:1], mats[0][0], mats[0][2], mats[0][3], None, GROUP,
                                        config=cfg), 1)
            rec["us"] = _time(run_new(cfg, 1))
        except Exception as exc:  # noqa: BLE001 - one bad config must not end the sweep
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        tried.append(rec)
    row["configs"] = tried
    ok = [r for r in tried if "us" in r and r["err"] <= g.TOL[torch.float16]]
    best = min(ok, key=lambda r: r["us"]) if ok else None
    row["best"] = best
    for m in (1, 2, 4):
        mm = row["m"][m]
        for label, cfg in (("v3_table", default),
                           ("v3_best", al.GemvConfig(**best["config"]) if best else None)):
            if cfg is None or time.time() > deadline + 20:
                continue
            try:
                y = awq_gemv_k(x[:m], mats[0][0], mats[0][2], mats[0][3], None, GROUP,
                               config=cfg)
                mm[label + "_err"] = err(y, m)
                mm[label + "_us"] = _time(run_new(cfg, m))
            except Exception as exc:  # noqa: BLE001
                mm[label + "_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    del mats
    if g.DEV == "cuda":
        torch.cuda.empty_cache()
    return row


def print_row(r: dict) -> None:
    b = r.get("best")
    cfg = b["config"] if b else {}
    tag = (f"bn{cfg['block_n']} w{cfg['num_warps']} st{cfg['num_stages']} "
           f"pf{cfg.get('prefetch', 0)} sm{cfg.get('stream', 0)} split{cfg['split']}"
           if b else "none ok")
    for m, mm in r["m"].items():
        t3, tb = mm.get("v3_table_us"), mm.get("v3_best_us")
        best_t = min(t for t in (t3, tb) if t) if (t3 or tb) else None
        gbs = g.int4_bytes(m, r["k"], r["n"], GROUP) / best_t / 1e3 if best_t else 0.0

        def us(t):
            return f"{t:7.1f}" if t else "    n/a"

        g.log(f"{r['shape']:<20} m={m} fp16 {us(mm['fp16_us'])}  "
              f"v3 table {us(t3)}  v3 best {us(tb)} [{tag}]  {gbs:5.0f} GB/s  "
              f"v3/fp16 {mm['fp16_us'] / best_t if best_t else 0:.2f}x"
              + ("" if all(mm.get(e, 0) <= g.TOL[torch.float16] for e in
                           ("v3_table_err", "v3_best_err")) else "  ERR"))


def suggest_table(rows: list[dict]) -> dict:
    """Per shape class, the (block_n, warps, stages, prefetch, stream, programs_per_sm) row with the lowest sum
    of time / best time over the class's shapes (only rows timed on every one of them)."""
    out = {}
    for cls in ("small_n", "large_n", "huge_n"):
        members = [r for r in rows if al.gemv_shape_class(r["n"]) == cls and r.get("best")]
        score: dict[tuple, list[float]] = {}
        for r in members:
            for c in r["configs"]:
                if "us" in c and c["err"] <= g.TOL[torch.float16]:
                    for key in c["rows"]:
                        score.setdefault(tuple(key), []).append(c["us"] / r["best"]["us"])
        full = {key: sum(v) / len(v) for key, v in score.items() if len(v) == len(members)}
        if full:
            key = min(full, key=full.get)
            out[cls] = dict(block_n=key[0], num_warps=key[1], num_stages=key[2],
                            prefetch=key[3], stream=key[4], programs_per_sm=key[5],
                            mean_time_over_best=full[key])
            g.log(f"suggested GEMV_TABLE[{cls!r}] = GemvTile(block_n={key[0]}, "
                  f"num_warps={key[1]}, num_stages={key[2]}, programs_per_sm={key[5]}, "
                  f"prefetch={key[3]}, stream={key[4]})  # {full[key]:.3f}x the per-shape best on average")
    return out


def warm_up(deadline: float) -> dict:
    """Compile every candidate (with and without split-K) once on a 4096x1024 layer, so that
    compile time does not eat the first shape's share (the real shapes' integer arguments
    are all multiples of 16: the same specialisations). Returns failures by candidate."""
    k, n = (4096, 1024) if not g.SMOKE else (256, 64)
    qw, qz, s, _ = g.make(k, n, GROUP)
    qt = al.repack_kmajor(qw)
    x = torch.randn(1, k, device=g.DEV).half()
    failed = {}
    for bn, warps, stages, prefetch, stream in al.GEMV_CANDIDATES:
        for split in (1, 2):
            if time.time() > deadline:
                return failed
            cfg = al.GemvConfig(block_n=bn, block_kw=min(GROUP // 8, 16), split=split,
                                num_warps=warps, num_stages=stages, prefetch=prefetch,
                                stream=stream)
            try:
                awq_gemv_k(x, qt, qz, s, None, GROUP, config=cfg)
            except Exception as exc:  # noqa: BLE001
                failed[str((bn, warps, stages, prefetch, stream, split))] = \
                    f"{type(exc).__name__}: {str(exc)[:160]}"
    if g.DEV == "cuda":
        torch.cuda.synchronize()
    return failed


def gemv_sweep(deadline: float) -> dict:
    """Sweep every decode shape until deadline; returns the JSON-ready results."""
    sms = _sm_count(torch.device(g.DEV))
    res: dict = dict(sms=sms, group=GROUP, shapes=[],
                     table_before={k: asdict(v) for k, v in al.GEMV_TABLE.items()})
    t0 = time.time()
    res["compile_failures"] = warm_up(t0 + 0.5 * (deadline - t0))
    g.log(f"gemv sweep: compiled {len(al.GEMV_CANDIDATES)} candidates x (split, no split) in "
          f"{time.time() - t0:.0f} s; failures: {res['compile_failures'] or 'none'}")
    n_shapes = len(DECODE_SHAPES)
    for i, (name, (k, n)) in enumerate(DECODE_SHAPES.items()):
        now = time.time()
        if now > deadline:
            g.log(f"gemv sweep: out of time before {name}")
            break
        share = now + (deadline - now) / (n_shapes - i)  # even split of what is left
        try:
            row = sweep_shape(name, k, n, sms, share)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory: the next shape still runs
            g.log(f"gemv sweep {name}: FAILED {type(exc).__name__}: {str(exc)[:200]}")
            res["shapes"].append(dict(shape=name, error=str(exc)[:400]))
            continue
        res["shapes"].append(row)
        print_row(row)
    res["suggested_table"] = suggest_table([r for r in res["shapes"] if "configs" in r])
    return res
