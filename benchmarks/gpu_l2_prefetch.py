"""Does the bulk L2 prefetch (kernels/l2_prefetch.py) land, and what does it buy the decode
GEMV that follows? Llama-3-8B shapes, tiled INT4 words, group 128, 1 token, fp16.

Per shape, over rotating weight copies (>= 256 MB a pass, so nothing is in L2 from the last
use), each replayed from one CUDA graph (gpu_awq.graph_ms), microseconds per sequence:
  spin            a 1-program kernel that spins ~--spin-us (the attention's latency-bound gap)
  spin+gemv       the gap, then the GEMV on a cold copy
  pf+spin+gemv    the prefetch of `fraction` of the copy (awq_segments), the gap, the GEMV
  pf+gemv         the prefetch right before the GEMV (no gap to land in)
  pf              the prefetch kernel alone (its own time in the chain)
each with bulk prefetches (cp.async.bulk.prefetch.L2) and line prefetches (prefetch.global.L2,
LINES), the latter also marked evict-last.
gemv = sequence - spin: what the GEMV costs after the gap, with and without the prefetch.

    PYTHONPATH=$PWD python3 benchmarks/gpu_l2_prefetch.py [--out DIR] [--spin-us 20]
Writes DIR/gpu_l2_prefetch.json (DIR: --out, else $OUT, else ./out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import gpu_awq as g  # noqa: E402
from hisparse_cli.kernels import awq_layout as al  # noqa: E402
from hisparse_cli.kernels import l2_prefetch as lp  # noqa: E402
from hisparse_cli.kernels.awq_gemv import _sm_count, awq_gemv_k  # noqa: E402

SHAPES = {"o 4096x4096": (4096, 4096), "gate_up 4096x28672": (4096, 28672),
          "down 14336x4096": (14336, 4096), "qkv 4096x6144": (4096, 6144)}
GROUP = 128


@triton.jit
def _spin(out_ptr, n):
    acc = tl.program_id(0).to(tl.float32)
    for _ in range(n):
        acc = acc * 0.999 + 1.0
    tl.store(out_ptr, acc)


class _Lin:
    def __init__(self, qw, qz, s, k):
        self.qweight, self.qzeros, self.scales = qw, qz, s
        self.group_size, self.layout, self.in_features = GROUP, "tiled", k


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--spin-us", type=float, default=20.0)
    a = ap.parse_args()
    dev = torch.device("cuda")
    sms = _sm_count(dev)
    sink = torch.zeros(1, device=dev)
    # calibrate the spin: iterations for ~--spin-us
    iters = 4096
    us = g.graph_ms([lambda: _spin[(1,)](sink, iters)] * 20) * 1e3
    iters = max(1, int(iters * a.spin_us / us))
    spin_us = g.graph_ms([lambda: _spin[(1,)](sink, iters)] * 20) * 1e3
    print(f"spin: {iters} iterations, {spin_us:.1f} us", flush=True)
    x = torch.randn(1, 14336, device=dev, dtype=torch.float16)
    rows = []
    for name, (k, n) in SHAPES.items():
        qw, qz, s, _ = g.make(k, n, GROUP)
        qt = al.tile_kmajor(al.repack_kmajor(qw), GROUP)
        nbytes = qt.numel() * 4 + qz.numel() * 4 + s.numel() * 2
        copies = [(qt.clone(), qz.clone(), s.clone()) for _ in range(g.copies(nbytes))]
        xs = x[:, :k]

        def gemv(c):
            return awq_gemv_k(xs, c[0], c[1], c[2], None, GROUP, tiled=True)

        def spin():
            _spin[(1,)](sink, iters)

        base = g.graph_ms([lambda c=c: (spin(), gemv(c)) for c in copies] * 2) * 1e3
        alone = g.graph_ms([lambda c=c: gemv(c) for c in copies] * 2) * 1e3
        row = dict(shape=name, mb=nbytes / 1e6, spin_us=spin_us, gemv_cold_us=alone,
                   spin_gemv_us=base, by_fraction={})
        print(f"{name:<20} {nbytes / 1e6:6.1f} MB  gemv alone {alone:6.1f} us  "
              f"spin+gemv {base:6.1f} (gemv {base - spin_us:5.1f})", flush=True)
        for f in (0.25, 0.5, 1.0):
            for last, lines in ((False, False), (False, True), (True, True)):
                pfs = [lp.Prefetcher(lp.awq_segments(_Lin(*c, k), f, sms), evict_last=last,
                                     lines=lines) for c in copies]
                t_pf = g.graph_ms([lambda p=p: p() for p in pfs] * 2) * 1e3
                t_gap = g.graph_ms([lambda c=c, p=p: (p(), spin(), gemv(c))
                                    for c, p in zip(copies, pfs)] * 2) * 1e3
                t_now = g.graph_ms([lambda c=c, p=p: (p(), gemv(c))
                                    for c, p in zip(copies, pfs)] * 2) * 1e3
                key = f"f{f}{' lines' if lines else ' bulk'}{' last' if last else ''}"
                row["by_fraction"][key] = dict(pf_spin_gemv_us=t_gap, pf_gemv_us=t_now,
                                               pf_us=t_pf, mb=pfs[0].bytes / 1e6)
                print(f"  prefetch {key:<15} {pfs[0].bytes / 1e6:6.1f} MB: pf {t_pf:5.1f}  "
                      f"pf+spin+gemv {t_gap:6.1f} (gemv {t_gap - spin_us:5.1f})  pf+gemv "
                      f"{t_now:6.1f}", flush=True)
        rows.append(row)
        del copies
        torch.cuda.empty_cache()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gpu_l2_prefetch.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
