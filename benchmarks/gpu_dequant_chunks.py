"""Does the INT4 prefill path lose less to fp16 when its dequantized weight stays in L2? The
prefill linears (M > 4 tokens) dequantize W^T into an fp16 workspace and hand it to cuBLAS
(awq_triton._dequant_matmul), in chunks of at most awq_layout.DEQUANT_CHUNK_ELEMS values
(64 Mi: every Llama-3-8B linear one chunk, a 56-224 MiB workspace written to HBM and read
back). A chunk that fits in L2 (50 MiB on the H200) could be written and read there; the price
is more launches (one dequantize and one cuBLAS call a chunk), which a host-bound prefill
pays in wall time. This times GPU time only: one Llama-3-8B layer's four linears (q|k|v, o,
gate|up, down) at M tokens, replayed from a CUDA graph over rotating weight copies (no
weight stays in L2 between calls), fp16 cuBLAS against dequantize + cuBLAS per chunk size.

    PYTHONPATH=$PWD python3 benchmarks/gpu_dequant_chunks.py [--out DIR] [--tokens 512,1024,2048]
        [--chunks 2,4,8,16,32,64] (Mi values a chunk)

Reports each chunked result's max |diff| from the largest chunk's (the same dequantized
values; cuBLAS may block a narrower product differently). Writes
DIR/gpu_dequant_chunks.json (DIR: --out, else $OUT, else ./out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_awq import graph_ms  # noqa: E402
from hisparse_cli.kernels.int4 import awq_layout  # noqa: E402
from hisparse_cli.kernels.int4.awq_triton import _dequant_matmul  # noqa: E402

GROUP = 128
SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate|up", 4096, 28672), ("down", 14336, 4096)]
COPIES = 3  # weight copies rotated: 3 x 113 MB INT4 (3 x 436 MB fp16) a pass, L2 50 MB


def int4(k: int, n: int, dev) -> tuple:
    """Random tiled words [n, k/8], zero-point words, and scales that keep outputs finite."""
    qw = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 8), dtype=torch.int32, device=dev)
    qz = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // GROUP, n // 8), dtype=torch.int32, device=dev)
    sc = torch.full((k // GROUP, n), 1e-3, dtype=torch.float16, device=dev)
    return qw, qz, sc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--tokens", default="512,1024,2048")
    ap.add_argument("--chunks", default="2,4,8,16,32,64")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    print(f"{props.name}: L2 {getattr(props, 'L2_cache_size', 0) / 2 ** 20:.0f} MiB", flush=True)
    w4 = [[int4(k, n, dev) for _, k, n in SHAPES] for _ in range(COPIES)]
    w16 = [[torch.randn(n, k, dtype=torch.float16, device=dev) * 0.02 for _, k, n in SHAPES]
           for _ in range(COPIES)]
    rows = []
    for m in [int(v) for v in a.tokens.split(",")]:
        xs = {k: torch.randn(m, k, dtype=torch.float16, device=dev) for k in (4096, 14336)}
        fp_calls = [lambda x=xs[k], w=w: torch.nn.functional.linear(x, w)
                    for c in range(COPIES) for (_, k, _n), w in zip(SHAPES, w16[c])]
        fp_us = graph_ms(fp_calls, a.reps) * len(SHAPES) * 1e3  # a layer's four linears
        print(f"M {m}: fp16 cuBLAS {fp_us:8.1f} us a layer", flush=True)
        ref = None
        for mi in sorted((int(v) for v in a.chunks.split(",")), reverse=True):  # one chunk first
            elems = mi << 20
            chunks = [awq_layout.dequant_chunk(k, n, elems) for _, k, n in SHAPES]

            def call(x, w, k, n, chunk):
                qw, qz, sc = w
                return _dequant_matmul(x, qw, qz, sc, None, GROUP, n, k, chunk, tiled=True)

            calls = [lambda x=xs[k], w=w, k=k, n=n, ch=ch: call(x, w, k, n, ch)
                     for c in range(COPIES) for (_, k, n), w, ch in zip(SHAPES, w4[c], chunks)]
            outs = [f() for f in calls[:len(SHAPES)]]
            if ref is None:
                ref = outs
            diff = max((o.float() - r.float()).abs().max().item() for o, r in zip(outs, ref))
            us = graph_ms(calls, a.reps) * len(SHAPES) * 1e3
            n_chunks = [-(-n // ch) for (_, _k, n), ch in zip(SHAPES, chunks)]
            rows.append(dict(tokens=m, chunk_mi=mi, int4_us=us, fp16_us=fp_us,
                             ratio=fp_us / us, chunks=n_chunks, max_diff=diff))
            print(f"  chunk {mi:>3} Mi values ({'/'.join(map(str, n_chunks))} chunks): INT4 "
                  f"{us:8.1f} us a layer, INT4/fp16 speed {fp_us / us:.3f}  max|diff| {diff:.3g}",
                  flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_dequant_chunks.json").write_text(json.dumps(
        {"rows": rows, "gpu": props.name, "group": GROUP}, indent=1))


if __name__ == "__main__":
    main()
