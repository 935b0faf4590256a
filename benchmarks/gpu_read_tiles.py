"""How fast can a GEMV-shaped Triton kernel *read* the K-major INT4 words, by tile shape?

    PYTHONPATH=$PWD python3 benchmarks/gpu_read_tiles.py [--out DIR]

The decode GEMV (kernels/awq_gemv.py) reads its words in [BLOCK_N rows, 16 words] tiles (one
group of K per step, 64 bytes of each row) and streams ~1.9 TB/s on the H200 whatever its
block_n / warps / split / stages (H200 run 6 sweep: 30.9-32.4 us for gate|up). This script
separates the read from the arithmetic: a kernel that only loads the same words with the
same loop structure and xors them into one value per row (nothing else), timed for several
tile shapes (rows x words per step), against a device-to-device copy of the same bytes. If
the 64-byte row segments cap the read rate, wider steps (or a tiled storage layout) are the
fix; if every tile reads at the copy rate, the GEMV's arithmetic is what binds.
Writes DIR/gpu_read_tiles.json (DIR: --out, else $OUT, else ./out).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import triton
import triton.language as tl


@triton.jit
def _read_kernel(w_ptr, y_ptr, KW, KW_PER_SPLIT, BLOCK_N: tl.constexpr,
                 BLOCK_KW: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs = tl.arange(0, BLOCK_KW)
    base = w_ptr + rows.to(tl.int64)[:, None] * KW
    acc = tl.zeros((BLOCK_N, BLOCK_KW), dtype=tl.int32)
    start = pid_k * KW_PER_SPLIT
    for w0 in range(start, start + KW_PER_SPLIT, BLOCK_KW):
        acc ^= tl.load(base + (w0 + offs)[None, :])
    out = tl.xor_sum(acc, axis=1)
    tl.store(y_ptr + pid_k * (tl.num_programs(0) * BLOCK_N) + rows, out)


def time_us(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(4):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) * 1e3 / (4 * reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    shapes = {"gate_up 4096x28672": (28672, 512), "down 14336x4096": (4096, 1792),
              "qkv 4096x6144": (6144, 512)}
    res: dict = {"sms": sms, "rows": []}
    for name, (n, kw) in shapes.items():
        copies = max(2, -(-256 * 2 ** 20 // (n * kw * 4)))  # >= 256 MB a pass: not from L2
        ws = [torch.randint(-2 ** 31, 2 ** 31 - 1, (n, kw), device=dev, dtype=torch.int32)
              for _ in range(copies)]
        nbytes = n * kw * 4
        dst = torch.empty_like(ws[0])
        t_copy = time_us(lambda: [dst.copy_(w) for w in ws] and None) / copies
        print(f"{name}: {nbytes / 2 ** 20:.1f} MiB, copy {t_copy:.1f} us "
              f"({2 * nbytes / t_copy / 1e6:.0f} GB/s read+write)", flush=True)
        res["rows"].append({"shape": name, "kind": "copy", "us": t_copy,
                            "read_gbs": nbytes / t_copy / 1e3})
        for bn, bkw, warps in ((32, 16, 1), (16, 16, 1), (8, 16, 1), (64, 16, 2),
                               (32, 32, 1), (16, 32, 1), (8, 64, 1), (16, 64, 2), (32, 64, 2),
                               (8, 128, 1), (16, 128, 4), (4, 128, 1), (32, 32, 2)):
            tiles = n // bn
            steps = kw // bkw
            best = None
            for pps in (8, 16, 32):
                split = 1
                while tiles * split * 2 <= pps * sms and steps % (2 * split) == 0 \
                        and steps // (2 * split) >= 2:
                    split *= 2
                y = torch.empty(split * n, device=dev, dtype=torch.int32)
                try:
                    t = time_us(lambda: [_read_kernel[(tiles, split)](
                        w, y, kw, kw // split, BLOCK_N=bn, BLOCK_KW=bkw, num_warps=warps)
                        for w in ws] and None) / copies
                except Exception as exc:  # noqa: BLE001 - record, go on
                    res["rows"].append({"shape": name, "bn": bn, "bkw": bkw, "warps": warps,
                                        "pps": pps, "error": str(exc)[:200]})
                    continue
                row = {"shape": name, "bn": bn, "bkw": bkw, "warps": warps, "pps": pps,
                       "split": split, "us": t, "read_gbs": nbytes / t / 1e3}
                res["rows"].append(row)
                if best is None or t < best["us"]:
                    best = row
            if best:
                print(f"  rows {bn:3d} x words {bkw:3d} ({bkw * 4:3d} B/row/step) warps {warps}: "
                      f"{best['us']:6.1f} us  {best['read_gbs']:5.0f} GB/s  "
                      f"(split {best['split']}, {best['pps']}/SM)", flush=True)
        del ws
        torch.cuda.empty_cache()
    (out / "gpu_read_tiles.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
