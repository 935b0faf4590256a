"""Why does the INT4 prefill lose more with the item layout (the persistent decode kernel's,
HISPARSE_DECODE_KERNEL=persistent) than with the tiled one? Runs 141-145: 0.42-0.64x fp16 at
the 4060ti-6g profile's 512-token chunks against 0.77-0.98x tiled (end to end, host-bound and
noisy). This times GPU time only, per Llama-3-8B linear (q|k|v, o, gate|up, down) at M
tokens: fp16 cuBLAS, the tiled layout's forward (dequantize + cuBLAS), the item layout's
forward (AWQLinear -> PreparedItemsLinear: dequantize + cuBLAS), the plain items_linear
(checks and a Triton launch every call) and the item dequantize alone. GPU time cannot show
host overhead, so the host time to issue a call is printed too (host_us: the issuing loop's
wall time over --iters calls, before the final synchronize; the queue never fills).
Random AWQ tensors, converted with the loader's own set_layout; CUDA events over --iters
calls after a warm-up, 3 weight copies rotated so no weight stays in L2.

    PYTHONPATH=$PWD python3 benchmarks/gpu_items_prefill.py [--tokens 512,1024,2048]
        [--iters 20] [--out DIR]

Checks first that both layouts give the same product (max |diff| printed). Writes
DIR/gpu_items_prefill.json (DIR: --out, else $OUT, else ./out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hisparse_cli.kernels.int4 import awq_items  # noqa: E402
from hisparse_cli.model.awq import AWQLinear  # noqa: E402

SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate|up", 4096, 28672), ("down", 14336, 4096)]
COPIES = 3


def random_awq(k: int, n: int, dev, layout: str) -> AWQLinear:
    """A linear of random AutoAWQ tensors, loaded as the engine loads one (from_checkpoint: the
    K-major, tiled layout on CUDA), then in `layout` ("tiled" or "items")."""
    qw = torch.randint(-2 ** 31, 2 ** 31 - 1, (k, n // 8), dtype=torch.int32, device=dev)
    qz = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // 128, n // 8), dtype=torch.int32, device=dev)
    sc = torch.full((k // 128, n), 1e-3, dtype=torch.float16, device=dev)
    lin = AWQLinear.from_checkpoint(qw, qz, sc, None, 128, device=dev, dtype=torch.float16)
    assert lin.set_layout(layout), f"layout {layout} refused (loaded as {lin.layout})"
    return lin


HOST: dict = {}  # the last gpu_ms call's host issue time a call (us)


def gpu_ms(fn, calls: list, iters: int) -> float:
    """Mean GPU ms of one call, rotating over `calls` (argument tuples); HOST["us"]: the host
    time to issue one."""
    for a in calls:
        fn(*a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for i in range(iters):
        fn(*calls[i % len(calls)])
    HOST["us"] = (time.perf_counter() - t0) / iters * 1e6
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--tokens", default="512,1024,2048")
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    print(f"{'linear':8} {'M':>5} {'fp16':>8} {'tiled':>8} {'items':>8} {'plain':>8} "
          f"{'deq items':>10}  (GPU ms a call)")
    for name, k, n in SHAPES:
        torch.manual_seed(0)
        tiled = [random_awq(k, n, dev, "tiled") for _ in range(COPIES)]
        torch.manual_seed(0)  # the same weights in the item layout
        items = [random_awq(k, n, dev, "items") for _ in range(COPIES)]
        fp16 = [torch.randn(n, k, dtype=torch.float16, device=dev) * 0.02 for _ in range(COPIES)]
        for m in [int(v) for v in a.tokens.split(",")]:
            x = torch.randn(m, k, dtype=torch.float16, device=dev)
            diff = (tiled[0](x).float() - items[0](x).float()).abs().max().item()
            r = {"linear": name, "k": k, "n": n, "tokens": m, "max_diff": diff}
            r["fp16_ms"] = gpu_ms(lambda w: torch.matmul(x, w.t()), [(w,) for w in fp16], a.iters)
            r["fp16_host_us"] = HOST["us"]
            r["tiled_ms"] = gpu_ms(lambda mod: mod(x), [(mod,) for mod in tiled], a.iters)
            r["tiled_host_us"] = HOST["us"]
            r["items_ms"] = gpu_ms(lambda mod: mod(x), [(mod,) for mod in items], a.iters)
            r["items_host_us"] = HOST["us"]
            r["plain_ms"] = gpu_ms(lambda mod: awq_items.items_linear(x, mod.qweight, k, n),
                                   [(mod,) for mod in items], a.iters)
            r["plain_host_us"] = HOST["us"]
            if m == int(a.tokens.split(",")[0]):  # the dequantize alone (same at every M)
                buf = torch.empty((n, k), dtype=torch.float16, device=dev)
                r["deq_items_ms"] = gpu_ms(
                    lambda mod: awq_items.dequantize_items(mod.qweight, k, n, 0, n, out=buf),
                    [(mod,) for mod in items], a.iters)
            rows.append(r)
            print(f"{name:8} {m:5d} {r['fp16_ms']:8.3f} {r['tiled_ms']:8.3f} {r['items_ms']:8.3f} "
                  f"{r['plain_ms']:8.3f} {r.get('deq_items_ms', float('nan')):10.3f}  "
                  f"diff {diff:.2e}; host us: fp16 {r['fp16_host_us']:.0f} tiled "
                  f"{r['tiled_host_us']:.0f} items {r['items_host_us']:.0f} plain "
                  f"{r['plain_host_us']:.0f}")
        del tiled, items, fp16
        torch.cuda.empty_cache()
    for m in [int(v) for v in a.tokens.split(",")]:
        sel = [r for r in rows if r["tokens"] == m]
        f, t, i = (sum(r[key] for r in sel) for key in ("fp16_ms", "tiled_ms", "items_ms"))
        print(f"layer at M={m}: fp16 {f:.3f} ms, tiled {t:.3f} ({f / t:.2f}x fp16), "
              f"items {i:.3f} ({f / i:.2f}x fp16)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_items_prefill.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
