"""Probe (issue 42 items 1 and 5): how fast cuBLAS runs the prefill GEMMs with FP8 operands on
this card, beside fp16, before any W4A8 path is built on them.

    python3 benchmarks/gpu_w4a8_probe.py [--tokens 512,1024,2048] [--out DIR]

Per Llama-3-8B linear (q|k|v 4096->6144, o 4096->4096, gate|up 4096->28672, down
14336->4096) and token count M: GPU time (CUDA events, median of 20 after 5 warm-ups) of
  fp16        x [M,K] @ W^T (W [N,K] fp16): the fp16 engine's GEMM
  fp8-row     torch._scaled_mm, e4m3 x and W, per-token and per-column fp32 scales
  fp8-1x128   torch._scaled_mm, e4m3, 1x128 blocks on both sides (per token per 128 inputs;
              per output column per 128 inputs: AWQ's group-128 scales as they are stored)
each with fp16 output (bf16 where fp16 is refused: said in the row). Also the error of each
against an fp32 product of the same dequantized operands. Writes $OUT/gpu_w4a8_probe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
          "down": (14336, 4096)}
F8 = torch.float8_e4m3fn


def timed(fn, reps: int = 20) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    return statistics.median(times)


def variant(row: dict, name: str, err, run) -> None:
    """Time run(out_dtype) into row[name + "_us"] with fp16 output, else bf16; a refusal is
    recorded per dtype (the first line of its message)."""
    for out_dtype in (torch.float16, torch.bfloat16):
        try:
            y = run(out_dtype)
            row[f"{name}_us"] = timed(lambda: run(out_dtype))
            row[f"{name}_out"], row[f"{name}_rel_err"] = str(out_dtype), err(y)
            return
        except Exception as exc:  # noqa: BLE001
            row[f"{name}_error_{out_dtype}"] = str(exc).splitlines()[0][:200]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="512,1024,2048")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    for name, (k, n) in SHAPES.items():
        # AWQ-like weight: codes q - z in [-15, 15] (exact in e4m3), group-128 scales
        codes = torch.randint(-8, 8, (n, k), device=dev).float()
        s = (torch.rand(k // 128, n, device=dev) * 0.004 + 0.001)  # [G, N], as AWQ stores
        w = (codes.view(n, k // 128, 128) * s.t()[:, :, None]).view(n, k)  # [N, K] fp32
        w16 = w.half()
        w8 = codes.to(F8)  # [N, K] row-major: mat_b = w8.t() is column-major [K, N]
        sb_blk = s.float().t()  # [N, K/128], strides (1, N)
        wmax = w.abs().amax(1, keepdim=True) / 448.0  # per-column scale for the row-wise form
        w8row = (w / wmax).to(F8)
        for m in (int(t) for t in a.tokens.split(",")):
            x = torch.randn(m, k, device=dev).half()
            ref = x.float() @ w.t()
            row = {"shape": name, "k": k, "n": n, "tokens": m,
                   "device": torch.cuda.get_device_name(dev)}
            row["fp16_us"] = timed(lambda: x @ w16.t())
            err = lambda y: float((y.float() - ref).norm() / ref.norm())  # noqa: E731
            row["fp16_rel_err"] = err(x @ w16.t())
            # row-wise: per-token activation scale
            sa_row = x.float().abs().amax(1, keepdim=True) / 448.0
            x8row = (x.float() / sa_row).to(F8)
            variant(row, "fp8_row", err, lambda dt: torch._scaled_mm(
                x8row, w8row.t(), scale_a=sa_row, scale_b=wmax.t().contiguous(), out_dtype=dt))
            # 1x128 blocks: per token per 128 inputs
            xb = x.float().view(m, k // 128, 128)
            sa_blk = (xb.abs().amax(-1) / 448.0).clamp_min(1e-12)  # [M, K/128]
            x8blk = (xb / sa_blk[:, :, None]).view(m, k).to(F8)
            sa_blk_cm = sa_blk.t().contiguous().t()  # strides (1, M)
            variant(row, "fp8_1x128", err, lambda dt: torch._scaled_mm(
                x8blk, w8.t(), scale_a=sa_blk_cm, scale_b=sb_blk, out_dtype=dt))
            # the same through torch's v2 API, the recipe named (torch.nn.functional.scaled_mm)
            F = torch.nn.functional
            if hasattr(F, "scaled_mm"):
                blk = F.ScalingType.BlockWise1x128
                variant(row, "fp8_1x128_v2", err, lambda dt: F.scaled_mm(
                    x8blk, w8.t(), sa_blk_cm, blk, sb_blk, blk, output_dtype=dt))
            for key in ("fp8_row_us", "fp8_1x128_us", "fp8_1x128_v2_us"):
                if key in row:
                    row[key.replace("_us", "_speedup")] = row["fp16_us"] / row[key]
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gpu_w4a8_probe.json").write_text(json.dumps(
        {"torch": torch.__version__, "cuda": torch.version.cuda, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
