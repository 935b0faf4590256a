"""The decode GEMV's packed fp16 path (GemvConfig.packed, kernels/awq_gemv.py) against the
fp32 path it would replace and fp16 cuBLAS, per Llama-3-8B decode shape, group 128.

packed 0: nibbles read as fp32 subnormals, fp32 products (the kernel of runs 18-38);
packed 1: nibbles to fp16x2 pairs (LOP3 into the 1024 magic + one HFMA2), fp16 products
          summed per word, then fp32; packed 2: the same over two words per fp32 conversion.

Timing as the engine's decode runs: back-to-back calls over rotating weight copies (>= 256 MB
a pass, nothing served from L2) replayed from one CUDA graph (gpu_awq.graph_ms). Every timed
config is first checked against the fp32 matmul of the dequantized weight (relative to
max |y|, gpu_awq.TOL). Configs: the table's tile with packed 0/1/2, then packed 2 with the
VARIANTS (tile, K split, pipelining, register cap); 1 token, then the table's tile at 2 and
4 tokens, packed 0 and 2.

    PYTHONPATH=$PWD python3 benchmarks/gpu_gemv_packed.py [--out DIR] [--rows2d]
Writes DIR/gpu_gemv_packed.json (DIR: --out, else $OUT, else ./out).

--tiled: the table's tile reading the K-major layout and the tiled one (awq_layout.tile_kmajor:
each step's [64, 16] word block contiguous), at 1, 2 and 4 tokens, then TILED_TILES on the
tiled layout at 1 token (DIR/gpu_gemv_tiled.json).

--rows2d: packed 2 only; the per-row zero points and scales loaded as [BN] vectors (rows2d 0:
a layout conversion through shared memory with barriers every step) or in the word tile's
layout (rows2d 1), with and without the register prefetch of the next step, over the table's
tile and ROWS2D_TILES, at 1 token (the table's tile also at 2 and 4); then the fastest tile
per shape class (summed over the class's shapes, 1 token) as GemvTile rows, in
DIR/gpu_gemv_rows2d.json ("table"), which `gpu_awq_ab.py --table-json` A/Bs in the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import gpu_awq as g  # noqa: E402
from hisparse_cli.kernels.int4 import awq_layout as al  # noqa: E402
from hisparse_cli.kernels.int4.awq_gemv import _sm_count, awq_gemv_k  # noqa: E402
from hisparse_cli.kernels.int4.awq_ref import dequantize_weight  # noqa: E402

SHAPES = {"qkv 4096x6144": (4096, 6144), "o 4096x4096": (4096, 4096),
          "gate_up 4096x28672": (4096, 28672), "down 14336x4096": (14336, 4096),
          "lm_head 4096x128256": (4096, 128256)}
GROUP = 128
# (block_n, num_warps, programs_per_sm, num_stages, maxnreg) tried with packed 2: K splits
# for more warps in flight (the fp32 path was latency-bound with ~14 warps an SM, H200 run
# 30), cp.async pipelining (num_stages 3: LDGSTS), register caps for more resident warps
VARIANTS = ((32, 1, 16, 1, 0), (32, 1, 32, 1, 0), (32, 1, 64, 1, 0), (32, 1, 64, 1, 80),
            (32, 1, 64, 1, 64), (32, 1, 32, 3, 0), (32, 1, 64, 3, 0), (64, 2, 16, 1, 0),
            (64, 2, 32, 1, 0), (64, 2, 32, 3, 0), (16, 1, 64, 1, 0), (128, 4, 16, 1, 0))


def config(k: int, n: int, sms: int, bn: int, warps: int, pps: int, stages: int, maxnreg: int,
           packed: int, stream: int) -> al.GemvConfig:
    bkw = min(GROUP // 8, 16)
    return al.GemvConfig(block_n=bn, block_kw=bkw, split=al.gemv_split(k, n, bn, bkw, pps, sms),
                         num_warps=warps, num_stages=stages, stream=stream, packed=packed,
                         maxnreg=maxnreg)


# (block_n, num_warps, programs_per_sm) tried with rows2d 1, prefetch 0 and 1
ROWS2D_TILES = ((32, 1, 32), (64, 2, 16), (64, 2, 32), (128, 4, 8), (128, 4, 16), (128, 4, 32),
                (128, 2, 16), (256, 4, 16), (256, 8, 8))


def rows2d_todo(k: int, n: int, sms: int, base: al.GemvConfig) -> list:
    """(tokens, config, programs_per_sm) of the --rows2d sweep."""
    pps0 = al.GEMV_TABLE[al.gemv_shape_class(n)].programs_per_sm
    todo = [(m, replace(base, packed=2, rows2d=r, prefetch=pf), pps0) for m in (1, 2, 4)
            for r in (0, 1) for pf in (0, 1)]
    for bn, w, pps in ROWS2D_TILES:
        for pf in (0, 1):
            c = config(k, n, sms, bn, w, pps, 1, 0, 2, base.stream)
            todo.append((1, replace(c, rows2d=1, prefetch=pf), pps))
    return todo


# (block_n, num_warps, programs_per_sm) tried with the tiled layout (besides the table's tile)
TILED_TILES = ((32, 1, 32), (64, 2, 16), (64, 2, 32), (64, 2, 64), (128, 4, 16), (128, 4, 32),
               (128, 2, 16), (256, 4, 16), (256, 8, 8))


def tiled_todo(k: int, n: int, sms: int, base: al.GemvConfig) -> list:
    """(tokens, config, programs_per_sm) of the --tiled sweep: the table's tile on both
    layouts at 1, 2 and 4 tokens, then TILED_TILES on the tiled one at 1 token."""
    pps0 = al.GEMV_TABLE[al.gemv_shape_class(n)].programs_per_sm
    todo = [(m, replace(base, tiled=t), pps0) for m in (1, 2, 4) for t in (0, 1)]
    for bn, w, pps in TILED_TILES:
        c = config(k, n, sms, bn, w, pps, 1, 0, 2, base.stream)
        todo.append((1, replace(c, pdl=base.pdl, tiled=1), pps))
    return todo


def packed_todo(k: int, n: int, sms: int, base: al.GemvConfig) -> list:
    todo = [(1, replace(base, packed=p)) for p in (0, 1, 2)]
    todo += [(1, config(k, n, sms, *v, 2, base.stream)) for v in VARIANTS]
    todo += [(m, replace(base, packed=p)) for m in (2, 4) for p in (0, 2)]
    return todo


def shape_rows(name: str, k: int, n: int, sms: int, make_todo=packed_todo) -> list[dict]:
    nb4 = g.int4_bytes(0, k, n, GROUP)
    mats = []
    for i in range(g.copies(nb4)):
        qw, qz, s, _ = g.make(k, n, GROUP, seed=i)
        qt = al.repack_kmajor(qw)
        mats.append((qt, qz, s, al.tile_kmajor(qt, GROUP) if make_todo is tiled_todo else None))
        if i == 0:
            w_ref = dequantize_weight(qw, qz, s, GROUP)
        del qw
    x = torch.randn(4, k, device="cuda").half()
    ref = x.float() @ w_ref
    del w_ref
    w16 = [torch.randn(n, k, device="cuda", dtype=torch.float16)
           for _ in range(g.copies(2 * k * n))]
    rows = []
    base = al.gemv_config(1, k, n, GROUP, sms)
    todo = make_todo(k, n, sms, base)
    seen = set()
    t16 = {}
    for m, cfg, *pps in todo:
        if (m, cfg) in seen:
            continue
        seen.add((m, cfg))
        if m not in t16:
            t16[m] = g.graph_ms([lambda w=w: F.linear(x[:m], w) for w in w16] * 2) * 1e3
        rec = dict(shape=name, m=m, config=asdict(cfg), fp16_us=t16[m], pps=(pps or [None])[0])
        try:
            qi = 3 if cfg.tiled else 0  # the weights in the layout the config reads
            y = awq_gemv_k(x[:m], mats[0][qi], mats[0][1], mats[0][2], None, GROUP, config=cfg)
            rec["err"] = g.rel(y, ref[:m])
            rec["us"] = g.graph_ms([lambda w=w: awq_gemv_k(x[:m], w[qi], w[1], w[2], None, GROUP,
                                                           config=cfg) for w in mats] * 2) * 1e3
            rec["GBs"] = g.int4_bytes(m, k, n, GROUP) / rec["us"] / 1e3
        except Exception as exc:  # noqa: BLE001 - one bad config must not end the run
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        rows.append(rec)
        c = rec["config"]
        tag = (f"bn{c['block_n']:<3} w{c['num_warps']} split{c['split']} st{c['num_stages']} "
               f"sm{c['stream']} reg{c['maxnreg']} packed{c['packed']} pf{c['prefetch']} "
               f"r2d{c['rows2d']} t{c['tiled']}")
        if "us" in rec:
            bad = "" if rec["err"] <= g.TOL[torch.float16] else "  ERR"
            g.log(f"{name:<20} m={m} {tag:<32} {rec['us']:7.1f} us  {rec['GBs']:5.0f} GB/s  "
                  f"fp16 {t16[m]:7.1f} us  int4/fp16 speed {t16[m] / rec['us']:.2f}x  "
                  f"err {rec['err']:.1e}{bad}")
        else:
            g.log(f"{name:<20} m={m} {tag:<32} {rec['error']}")
    del mats, w16
    torch.cuda.empty_cache()
    return rows


def suggest_table(rows: list[dict]) -> dict:
    """Per shape class, the (tile, split rule, prefetch, rows2d) with the least summed 1-token
    time over the class's shapes (only configs timed and correct on every one of them)."""
    table = {}
    for cls in ("small_n", "large_n", "huge_n"):
        names = [nm for nm, (k, n) in SHAPES.items() if al.gemv_shape_class(n) == cls]
        tot: dict = {}
        for r in rows:
            if r["shape"] not in names or r["m"] != 1 or "us" not in r \
                    or r["err"] > g.TOL[torch.float16]:
                continue
            c = r["config"]
            key = (c["block_n"], c["num_warps"], c["num_stages"], r["pps"],
                   c["prefetch"], c["stream"], c["packed"], c["maxnreg"], c["rows2d"],
                   c["pdl"])
            tot.setdefault(key, {})[r["shape"]] = r["us"]
        full = {key: sum(v.values()) for key, v in tot.items() if len(v) == len(names)}
        if not full:
            continue
        best = min(full, key=full.get)
        bn, w, st, pps, pf, sm, pk, reg, r2, pdl = best
        table[cls] = dict(block_n=bn, num_warps=w, num_stages=st, programs_per_sm=pps,
                          prefetch=pf, stream=sm, packed=pk, maxnreg=reg, rows2d=r2, pdl=pdl,
                          us=full[best])
        g.log(f"suggest {cls:<8} {table[cls]}")
    return table


def _log_best(rows: list[dict], title: str, is_base, is_cand, first: bool = False) -> None:
    """Per shape, of the 1-token rows timed and correct: the first whose config is_base
    accepts -> (first: the first is_cand accepts ->) the fastest is_cand accepts."""
    g.log(f"\nper shape, 1 token: {title}")
    for name in SHAPES:
        mine = [r for r in rows if r["shape"] == name and r["m"] == 1 and "us" in r
                and r["err"] <= g.TOL[torch.float16]]
        base = [r for r in mine if is_base(r["config"])]
        cand = [r for r in mine if is_cand(r["config"])]
        if not (base and cand):
            continue
        best = min(cand, key=lambda r: r["us"])
        c, t0 = best["config"], base[0]["us"]
        mid = f" -> {cand[0]['us']:7.1f}" if first else ""
        g.log(f"{name:<20} {t0:7.1f}{mid} -> {best['us']:7.1f} us ({t0 / best['us']:.2f}x; "
              f"bn{c['block_n']} w{c['num_warps']} split{c['split']} packed{c['packed']} "
              f"tiled{c['tiled']})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--rows2d", action="store_true",
                    help="only: rows2d 0/1 x prefetch 0/1 over tiles (packed 2); suggest a table")
    ap.add_argument("--tiled", action="store_true",
                    help="only: the K-major vs the tiled weight layout (awq_layout.tile_kmajor)")
    a = ap.parse_args()
    sms = _sm_count(torch.device("cuda"))
    rows = []
    if a.tiled:
        for name, (k, n) in SHAPES.items():
            rows += shape_rows(name, k, n, sms, tiled_todo)
        _log_best(rows, "the table's tile K-major -> tiled -> best tiled tile",
                  lambda c: not c["tiled"], lambda c: c["tiled"], first=True)
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "gpu_gemv_tiled.json").write_text(json.dumps(rows, indent=1))
        return
    if a.rows2d:
        for name, (k, n) in SHAPES.items():
            rows += shape_rows(name, k, n, sms, rows2d_todo)
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "gpu_gemv_rows2d.json").write_text(json.dumps(
            dict(rows=rows, table=suggest_table(rows)), indent=1))
        return
    for name, (k, n) in SHAPES.items():
        rows += shape_rows(name, k, n, sms)
    _log_best(rows, "table tile packed 0 -> best packed config", lambda c: c["packed"] == 0,
              lambda c: c["packed"] > 0)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gpu_gemv_packed.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
