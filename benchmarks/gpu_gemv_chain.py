"""What the kernel boundaries of a decode step cost the weight stream: the 8B decoder's 128
INT4 GEMVs of one token as separate launches (as the engine runs them) against the same bytes
in fewer, larger launches, and the fp16 cuBLAS chain of the same shapes.

    PYTHONPATH=$PWD python3 benchmarks/gpu_gemv_chain.py [--out DIR] [--reps 20]

Rows (each one CUDA graph, replayed; per-token milliseconds and TB/s of weight bytes: INT4
words + fp16 scales + zero-point words; fp16: the weights):
  chain-128   32 layers x (q|k|v 4096->6144, o 4096->4096, gate|up 4096->28672, down
              14336->4096): the engine's decoder GEMVs, awq_gemv_k with its table config, the
              tiled layout and PDL as in the engine (every x is its own buffer: no data
              dependency, so this is the GEMVs' floor inside the chain, not the step);
  chain-32    32 launches of one K 4096 GEMV each holding one layer's bytes (the boundary
              count of a design with one weight launch a layer);
  one-launch  one K 4096 GEMV holding all the decoder's bytes (the huge_n class: what a
              persistent kernel streaming the whole step's weights could reach);
  fp16 chain  the 128 shapes as fp16 cuBLAS matmuls of one row (what fp16 decode streams).
Random words: the timing does not depend on the values. Needs torch, triton,
hisparse_cli's kernels and gpu_awq.py; writes DIR/gpu_gemv_chain.json (DIR: --out, else $OUT, else ./out).
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
from hisparse_cli.kernels.int4.awq_gemv import awq_gemv_k  # noqa: E402

GROUP, LAYERS = 128, 32
SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate|up", 4096, 28672), ("down", 14336, 4096)]


def int4_bytes(k: int, n: int) -> int:
    """INT4 words + zero-point words + fp16 scales of a [k -> n] linear at GROUP."""
    return n * (k // 8) * 4 + (k // GROUP) * (n // 8) * 4 + (k // GROUP) * n * 2


def int4_weight(k: int, n: int, dev) -> tuple:
    """Random K-major INT4 words [n, k/8] (in tiled order when the engine tiles: random words
    either way), zero-point words [k/g, n/8] and fp16 scales [k/g, n]; and their bytes."""
    qw = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 8), dtype=torch.int32, device=dev)
    qz = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // GROUP, n // 8), dtype=torch.int32, device=dev)
    sc = torch.full((k // GROUP, n), 1e-3, dtype=torch.float16, device=dev)
    return (qw, qz, sc), int4_bytes(k, n)


def replay_ms(calls: list, reps: int) -> float:
    """Milliseconds of one pass of `calls` replayed from a CUDA graph (gpu_awq.graph_ms)."""
    return graph_ms(calls, reps) * len(calls)


def gemv_call(x, w):
    qw, qz, sc = w
    tiled = awq_layout.TILED_WEIGHTS
    return lambda: awq_gemv_k(x, qw, qz, sc, None, GROUP, checked=True, tiled=tiled)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = []

    def row(name, ms, nbytes, launches):
        tbs = nbytes / (ms * 1e-3) / 1e12
        rows.append(dict(name=name, ms=ms, bytes=nbytes, tb_s=tbs, launches=launches))
        print(f"{name:<12} {launches:>4} launches  {ms:7.3f} ms  {nbytes / 1e9:6.2f} GB  "
              f"{tbs:5.2f} TB/s", flush=True)

    xs = {k: torch.randn(1, k, dtype=torch.float16, device=dev) for k in (4096, 14336)}
    weights, total = [], 0
    for _ in range(LAYERS):
        for _, k, n in SHAPES:
            w, b = int4_weight(k, n, dev)
            weights.append((k, w))
            total += b
    calls = [gemv_call(xs[k], w) for k, w in weights]
    row("chain-128", replay_ms(calls, a.reps), total, len(calls))
    layer_bytes = total // LAYERS
    del weights, calls
    torch.cuda.empty_cache()

    # one K-4096 GEMV per layer's bytes (n rounded to whole 128-column tiles)
    n_layer = layer_bytes // int4_bytes(4096, 128) * 128
    ws = [int4_weight(4096, n_layer, dev)[0] for _ in range(LAYERS)]
    row("chain-32", replay_ms([gemv_call(xs[4096], w) for w in ws], a.reps),
        LAYERS * int4_bytes(4096, n_layer), LAYERS)
    del ws
    torch.cuda.empty_cache()
    n_all = n_layer * LAYERS
    w, b1 = int4_weight(4096, n_all, dev)
    row("one-launch", replay_ms([gemv_call(xs[4096], w)], a.reps), b1, 1)
    del w
    torch.cuda.empty_cache()

    fp = []  # nn.Linear's [n, k] weights through F.linear, as the fp16 engine's decode
    for _ in range(LAYERS):
        for _, k, n in SHAPES:
            fp.append((k, torch.randn(n, k, dtype=torch.float16, device=dev)))
    fbytes = sum(w.numel() * 2 for _, w in fp)
    linear = torch.nn.functional.linear
    row("fp16 chain", replay_ms([lambda x=xs[k], w=w: linear(x, w) for k, w in fp], a.reps),
        fbytes, len(fp))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_gemv_chain.json").write_text(json.dumps(
        {"rows": rows, "tiled": awq_layout.TILED_WEIGHTS, "group": GROUP,
         "gpu": torch.cuda.get_device_name()}, indent=1))


if __name__ == "__main__":
    main()
