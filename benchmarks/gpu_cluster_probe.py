"""Thread-block clusters for the persistent decode step: residency and the cost of their sync.

    PYTHONPATH=$PWD python3 benchmarks/gpu_cluster_probe.py [--out DIR] [--rounds 2000]
        [--clusters 1,2,4,8,16]

The persistent decode step (hisparse_cli/kernels/cuda/decode_step.cu) spends ~8 us of each of
its four grid-wide phases a layer on barrier, x load, flush and ramp (BENCHMARKS.md, runs
132-136). Fewer grid-wide phases would need parts of a layer to run inside thread-block
clusters (q|k|v and the attention of one KV head, say, exchanging through distributed shared
memory). Before anyone rewrites the kernel for that, this measures what such a design stands
on, with the decode step's own launch shape (one CTA an SM, 17 warps, its dynamic shared
memory: kernels/cuda_step.smem_bytes):
  - per cluster size CL: the largest grid (a multiple of CL, at most one CTA an SM) whose
    CTAs are all resident together, found by running the grid barrier with a spin limit (a
    CTA that is not resident makes the others give up, not hang);
  - a grid barrier round at that grid (us), a cluster barrier round, and a DSMEM exchange
    round (store into the next rank's shared memory + cluster barrier, checked).
Prints a table; writes DIR/gpu_cluster_probe.json (DIR: --out, else $OUT, else ./out).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hisparse_cli.kernels.cuda import cuda_launch  # noqa: E402
from hisparse_cli.kernels.cuda import cuda_rt  # noqa: E402
from hisparse_cli.kernels.cuda import cuda_step  # noqa: E402

CUDA_DIR = Path(__file__).resolve().parent / "cuda"
RING = Path(cuda_step.__file__).resolve().parent / "cuda" / "ring.cuh"
_INCLUDE = re.compile(r'^#include "ring\.cuh"$', re.M)
THREADS = (cuda_step.NW + 1) * 32
ATTR_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14  # CUfunction_attribute


def source() -> str:
    """cluster_probe.cu with ring.cuh inlined (NVRTC gets one string)."""
    return _INCLUDE.sub(lambda m: RING.read_text(), (CUDA_DIR / "cluster_probe.cu").read_text())


def build(cl: int, arch: tuple[int, int]):
    return cuda_rt.compile_cubin(source(), arch=arch, options=[f"-DCL={cl}"])


def run(fn, ctas: int, smem: int, rounds: int, mode: int, spin_limit: int, dev) -> dict:
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    failed = torch.zeros(1, dtype=torch.int32, device=dev)
    out = torch.zeros(2 * ctas, dtype=torch.int64, device=dev)
    fn.launch((ctas, 1, 1), (THREADS, 1, 1), smem,
              [cuda_launch.ptr(counter), cuda_launch.ptr(failed), cuda_launch.ptr(out),
               cuda_launch.i32(rounds), cuda_launch.i32(mode), cuda_launch.u32(spin_limit)])
    torch.cuda.synchronize(dev)
    t = out.view(-1, 2).double()
    span = float((t[:, 1] - t[:, 0]).max()) / 1e3 / max(rounds, 1)  # us a round, slowest CTA
    return {"failed": int(failed.item()), "us_per_round": span}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--clusters", default="1,2,4,8,16")
    ap.add_argument("--spin-limit", type=int, default=1 << 20)
    a = ap.parse_args()
    dev = torch.device("cuda")
    arch = torch.cuda.get_device_capability(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    smem = cuda_step.smem_bytes(cuda_step.STAGES, 2, 4, True)
    print(f"{torch.cuda.get_device_name(dev)}: {sms} SMs, decode step's dynamic shared memory "
          f"{smem} B, {THREADS} threads a CTA", flush=True)
    rows = []
    for cl in [int(c) for c in a.clusters.split(",")]:
        row: dict = {"cluster": cl}
        try:
            fn = cuda_launch.load_module(build(cl, arch), dev).function("cluster_probe")
            fn.set_max_dynamic_shared_memory(smem)
            if cl > 8:
                with cuda_launch._current(fn.module.context):
                    cuda_launch._check("cuFuncSetAttribute(NON_PORTABLE_CLUSTER_SIZE_ALLOWED)",
                                       cuda_launch._driver().cuFuncSetAttribute(
                                           fn._handle, ATTR_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                                           1))
            resident = None
            for ctas in range(sms // cl * cl, 0, -cl):  # the largest co-resident grid
                r = run(fn, ctas, smem, 4, 0, a.spin_limit, dev)
                if r["failed"] == 0:
                    resident = ctas
                    break
            row["resident_ctas"] = resident
            if resident:
                for mode, key in ((0, "grid_barrier_us"), (1, "cluster_barrier_us"),
                                  (2, "dsmem_exchange_us")):
                    if mode == 0 or cl > 1:
                        r = run(fn, resident, smem, a.rounds, mode, a.spin_limit, dev)
                        row[key] = None if r["failed"] else round(r["us_per_round"], 3)
                        if r["failed"]:
                            row[f"{key}_failed"] = r["failed"]
        except Exception as exc:  # noqa: BLE001 (a size the device refuses: say so, go on)
            row["error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
        print(row, flush=True)
    print("\ncluster  resident CTAs  grid barrier us  cluster barrier us  DSMEM exchange us")
    for r in rows:
        def f(k):
            v = r.get(k)
            return "-" if v is None else str(v)
        print(f"{r['cluster']:7d}  {f('resident_ctas'):>13s}  {f('grid_barrier_us'):>15s}  "
              f"{f('cluster_barrier_us'):>18s}  {f('dsmem_exchange_us'):>17s}"
              + (f"  {r['error']}" if "error" in r else ""))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gpu_cluster_probe.json").write_text(json.dumps(
        {"command": " ".join(["python3"] + sys.argv), "sms": sms, "smem": smem,
         "threads": THREADS, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
