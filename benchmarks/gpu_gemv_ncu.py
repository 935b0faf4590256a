"""One decode GEMV launch for Nsight Compute: the stacked gate|up of Llama-3-8B (4096 x 28672,
group 128, one token) with the GEMV_TABLE's config, after a warm-up (so the profiled launch
is not the compile). Why the GEMV streams ~2 TB/s where a read-only kernel of the same loop
reads 3.8 TB/s (BENCHMARKS.md, runs 25-26) is what the stall reasons should say.

    ncu --clock-control none --kernel-name regex:_awq_gemv_kernel --launch-skip 3 \\
        --launch-count 1 --section SpeedOfLight --section Occupancy \\
        --section SchedulerStats --section WarpStateStats \\
        python3 benchmarks/gpu_gemv_ncu.py [BLOCK_N NUM_WARPS SPLIT PREFETCH [STREAM]]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from hisparse_cli.kernels.int4.awq_gemv import awq_gemv_k  # noqa: E402
from hisparse_cli.kernels.int4.awq_layout import GemvConfig, repack_kmajor  # noqa: E402


def main() -> None:
    k, n, g = 4096, 28672, 128
    dev = torch.device("cuda")
    qw = torch.randint(-2 ** 31, 2 ** 31 - 1, (k, n // 8), device=dev, dtype=torch.int32)
    qt = repack_kmajor(qw)
    qz = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // g, n // 8), device=dev, dtype=torch.int32)
    s = torch.full((k // g, n), 1e-3, device=dev, dtype=torch.float16)
    x = torch.randn(1, k, device=dev, dtype=torch.float16)
    cfg = None  # argv: block_n num_warps split prefetch [stream] (default: the table's)
    if len(sys.argv) in (5, 6):
        bn, w, split, pf, *sm = (int(v) for v in sys.argv[1:])
        cfg = GemvConfig(block_n=bn, block_kw=16, split=split, num_warps=w, num_stages=1,
                         prefetch=pf, stream=sm[0] if sm else 0)
    for _ in range(5):
        awq_gemv_k(x, qt, qz, s, None, g, config=cfg)
    torch.cuda.synchronize()
    print("ok", flush=True)


if __name__ == "__main__":
    main()
