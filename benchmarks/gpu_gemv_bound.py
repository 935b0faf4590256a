"""Is the decode GEMV bound by its arithmetic or by waiting on memory?

    PYTHONPATH=$PWD python3 benchmarks/gpu_gemv_bound.py [--out DIR]

For each Llama-3-8B decode shape and a few GEMV configurations (the table's, register
prefetch, the streaming cache hints of GemvConfig.stream), times the K-major GEMV
(kernels/awq_gemv.py) two ways, replayed from one CUDA graph:
- "stream": the real call, rotating over weight copies (>= 256 MB a pass, nothing from L2);
- "compute": the same launch with the row stride KW passed as 0, so every program reads the
  words of row 0 (L1/L2 hits): the same instructions with no DRAM traffic for the weights,
  i.e. the time the arithmetic alone needs at this occupancy.
If compute is close to stream, fewer instructions per weight word are the fix; if it is far
below, the kernel waits on memory (latency hiding is the fix). The read-only bound is
benchmarks/gpu_read_tiles.py. Writes DIR/gpu_gemv_bound.json (DIR: --out, else $OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_awq as g  # noqa: E402
from hisparse_cli.kernels.int4 import awq_gemv as ag  # noqa: E402
from hisparse_cli.kernels.int4 import awq_layout as al  # noqa: E402
from hisparse_cli.kernels.int4.awq_ref import dequantize_weight  # noqa: E402

SHAPES = {"qkv 4096x6144": (4096, 6144), "gate_up 4096x28672": (4096, 28672),
          "down 14336x4096": (14336, 4096), "q/o 4096x4096": (4096, 4096)}
GROUP = 128


def launch(x, qt, qz, s, cfg: al.GemvConfig, kw_stride: int, part, cnt):
    """awq_gemv_k's launch with the row stride of the words given explicitly."""
    m, (n, kw) = x.shape[0], qt.shape
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    tiles = triton.cdiv(n, cfg.block_n)
    common = dict(GROUP=GROUP, M=m, BLOCK_N=cfg.block_n, BLOCK_KW=cfg.block_kw,
                  NUM_STAGES=cfg.num_stages, HAS_BIAS=False, SPLIT=cfg.split,
                  PREFETCH=cfg.prefetch, STREAM=cfg.stream, num_warps=cfg.num_warps)
    if cfg.split == 1:
        ag._awq_gemv_kernel[(tiles, 1)](x, qt, qz, s, s, y, y, qz, n, kw_stride, n // 8,
                                        x.stride(0), y.stride(0), 0, 0, kw, **common)
    else:
        ag._awq_gemv_kernel[(tiles, cfg.split)](x, qt, qz, s, s, y, part, cnt, n, kw_stride,
                                                n // 8, x.stride(0), y.stride(0),
                                                part.stride(0), part.stride(1),
                                                kw // cfg.split, **common)
    return y


def configs(k: int, n: int, sms: int) -> dict[str, al.GemvConfig]:
    base = al.gemv_config(1, k, n, GROUP, sms)
    out = {"table": base}
    for pf, sm in ((1, 0), (0, 1), (0, 2), (1, 1), (1, 2)):
        out[f"pf{pf} sm{sm}"] = replace(base, prefetch=pf, stream=sm)
    wide = al.GemvConfig(block_n=64, block_kw=base.block_kw,
                         split=al.gemv_split(k, n, 64, base.block_kw, 16, sms), num_warps=1,
                         num_stages=1)
    out["bn64 w1"] = wide
    out["bn64 w1 pf1 sm2"] = replace(wide, prefetch=1, stream=2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    out = a.out or Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    sms = ag._sm_count(torch.device("cuda"))
    res = dict(device=torch.cuda.get_device_name(), sms=sms, rows=[])
    cnt = ag._tile_counters(torch.device("cuda"), 1)
    for name, (k, n) in SHAPES.items():
        nbytes = g.int4_bytes(0, k, n, GROUP)
        mats = []
        for i in range(g.copies(nbytes)):
            qw, qz, s, _ = g.make(k, n, GROUP, seed=i)
            if i == 0:
                ref = dequantize_weight(qw, qz, s, GROUP)
            mats.append((al.repack_kmajor(qw), qz, s))
            del qw
        x = torch.randn(1, k, device="cuda").half()
        want = x.float() @ ref
        del ref
        for label, cfg in configs(k, n, sms).items():
            part = torch.empty((cfg.split, 1, n), device="cuda", dtype=torch.float32)
            rec = dict(shape=name, config=label, cfg=asdict(cfg))
            try:
                y = launch(x, *mats[0], cfg, k // 8, part, cnt)
                rec["err"] = g.rel(y, want)
                rec["stream_us"] = g.graph_ms(
                    [lambda w=w: launch(x, *w, cfg, k // 8, part, cnt) for w in mats] * 2) * 1e3
                rec["compute_us"] = g.graph_ms(
                    [lambda w=w: launch(x, *w, cfg, 0, part, cnt) for w in mats] * 2) * 1e3
                rec["gbs"] = nbytes / rec["stream_us"] / 1e3
            except Exception as exc:  # noqa: BLE001 - one bad config must not end the run
                rec["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            res["rows"].append(rec)
            if "error" in rec:
                print(f"{name:<20} {label:<16} ERROR {rec['error']}", flush=True)
            else:
                print(f"{name:<20} {label:<16} split {cfg.split:>2}  stream {rec['stream_us']:6.1f} us"
                      f" ({rec['gbs']:5.0f} GB/s)  compute-only {rec['compute_us']:6.1f} us"
                      f"  err {rec['err']:.1e}", flush=True)
        del mats
        torch.cuda.empty_cache()
    (out / "gpu_gemv_bound.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
