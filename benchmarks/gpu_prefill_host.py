"""Is the GPU prefill bound by the host? Where does the host time of a prefill chunk go?

    PYTHONPATH=$PWD python3 benchmarks/gpu_prefill_host.py [--context 32768] [--out DIR] [--awq]

Llama-3-8B-shaped random fp16 model (gpu_engine.build_ours), the `h200-141g` profile's sparse
settings. Reports:
  1. one prefill: wall time, the host's time to issue it (the loop returns before the GPU is
     done: if issue ~= wall, the host is the bottleneck), and the GPU kernel time under
     torch.profiler, for importance "attention" and "uniform";
  2. cProfile of the host issuing a prefill (--cprofile-tokens tokens): the top functions by
     own time and by cumulative time (what a chunk's host time is made of);
  3. host microseconds per launch (no sync, tiny tensors so the GPU never makes the host wait):
     torch.add, a Triton RMSNorm, and the sparse_attention wrapper (attention + scoring); with
     --awq also the INT4 dequantize kernel and a whole INT4 prefill linear (dequantize +
     cuBLAS) of a 1,024-token chunk, and parts 1-2 run the AWQ INT4 model (g128).
--part1: only part 1, with the top GPU kernels and (--awq) a census of the dequantize graphs.
--graph-probe: only part 3's launches and the INT4 prefill linear eager against CUDA-graph
replays of its dequantize (and of the whole linear), writing gpu_prefill_host_graph.json.
Writes DIR/gpu_prefill_host.json (DIR: --out, else $OUT, else ./out).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from gpu_engine import build_ours, pick_backend, prompt  # noqa: E402
from hisparse_cli.model.config import ModelConfig  # noqa: E402
from hisparse_cli.planner.shapes import SHAPES  # noqa: E402
from hisparse_cli.config.profiles import load_profile  # noqa: E402


def prefill(eng, ids) -> tuple[float, float]:
    """(host issue seconds, wall seconds) of one prefill in a fresh run."""
    run, _ = eng.new_run(ids.numel() + 2)
    chunk = eng.sparse.prefill_chunk
    with torch.inference_mode(), run:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for s in range(0, ids.numel(), chunk):
            run.step(eng.model, ids[s:s + chunk])
        issue = time.perf_counter() - t0
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return issue, wall


def gpu_kernels(eng, ids) -> tuple[float, list]:
    """GPU kernel ms of one prefill under torch.profiler, and the top kernels [(name, calls,
    ms)] by time (to compare a fast and a slow process kernel by kernel)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        prefill(eng, ids)
    ev = [e for e in prof.key_averages()
          if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA")]
    top = sorted(((e.key[:60], e.count, e.device_time_total / 1e3) for e in ev),
                 key=lambda r: -r[2])[:8]
    return sum(e.device_time_total for e in ev) / 1e3, top


def graph_census(model) -> dict:
    """The INT4 prefill linears' dequantize graphs (awq_triton.PreparedLinearK): how many
    linears, graphs kept, and linears whose cache is full (their further addresses launch
    eagerly)."""
    from hisparse_cli.kernels.int4.awq_triton import GRAPHS_PER_LINEAR

    preps = [m._prepared for m in model.modules() if getattr(m, "_prepared", None) is not None]
    sizes = [len(p.graphs) for p in preps if getattr(p, "graphs", None) is not None]
    return {"linears": len(preps), "graphs": sum(sizes),
            "full": sum(s >= GRAPHS_PER_LINEAR for s in sizes)}


def host_us(fn, n: int = 300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1e6 * dt / n


def awq_launch_costs(dev) -> dict:
    """Host us per call of the INT4 prefill pieces on a 4096 x 4096 layer (small GPU work, so
    the host never waits) and of the raw kernel launch without the wrapper's checks."""
    from hisparse_cli.kernels.int4 import awq_triton as at

    n = k = 4096
    g = torch.Generator(device=dev).manual_seed(0)
    qt = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 8), device=dev, dtype=torch.int32, generator=g)
    qz = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // 128, n // 8), device=dev, dtype=torch.int32, generator=g)
    sc = torch.full((k // 128, n), 1e-3, device=dev, dtype=torch.float16)
    w = torch.empty((n, k), device=dev, dtype=torch.float16)
    x = torch.randn(1024, k, device=dev, dtype=torch.float16)
    grid = ((k // 8) // 16, triton_cdiv(n, 16))
    raw = lambda: at._awq_dequant_k_kernel[grid](qt, qz, sc, w, n, k // 8, n // 8, 0, n, k,  # noqa: E731
                                                  GROUP=128, BLOCK_N=16, BLOCK_KW=16, num_warps=1)
    from hisparse_cli.model.awq import AWQLinear

    lin = AWQLinear(k, n, 128, device="meta")
    lin.qweight, lin.qzeros, lin.scales, lin.layout = qt, qz, sc, "kmajor"
    return {
        "awq_dequantize_k (wrapper)": host_us(lambda: at.awq_dequantize_k(qt, qz, sc, 128, torch.float16, out=w), 100),
        "_awq_dequant_k_kernel[grid] (raw)": host_us(raw, 100),
        "awq_dequant_matmul_k 1024 tok": host_us(lambda: at.awq_dequant_matmul_k(x, qt, qz, sc, None, 128), 50),
        "awq_dequant_matmul_k 1024 tok, checked": host_us(
            lambda: at.awq_dequant_matmul_k(x, qt, qz, sc, None, 128, checked=True), 50),
        "AWQLinear.forward 1024 tok": host_us(lambda: lin(x), 50),
        "F.linear fp16 1024 tok": host_us(lambda: torch.nn.functional.linear(x, w), 50),
    }


def graph_probe(dev) -> dict:
    """Would CUDA graphs cut the INT4 prefill linear's host time? Host us per call on the same
    4096 x 4096 layer, 1,024 tokens: the eager path (AWQLinear), the dequantize kernel
    replayed from a graph into a persistent workspace + an eager cuBLAS call, and the whole
    linear as one graph (x copied into a static input, the output a static buffer); each
    graph variant's output is checked against the eager one (bit for bit)."""
    from hisparse_cli.kernels.int4 import awq_triton as at
    from hisparse_cli.model.awq import AWQLinear

    n = k = 4096
    g = torch.Generator(device=dev).manual_seed(0)
    qt = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 8), device=dev, dtype=torch.int32, generator=g)
    qz = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // 128, n // 8), device=dev, dtype=torch.int32, generator=g)
    sc = torch.full((k // 128, n), 1e-3, device=dev, dtype=torch.float16)
    x = torch.randn(1024, k, device=dev, dtype=torch.float16, generator=g)
    lin = AWQLinear(k, n, 128, device="meta")
    lin.qweight, lin.qzeros, lin.scales, lin.layout = qt, qz, sc, "kmajor"
    ref = lin(x)
    ws = torch.empty((n, k), device=dev, dtype=torch.float16)  # the persistent workspace
    at._dequant_k_launch(qt, qz, sc, 128, ws, 0, n)  # compiled before capture
    torch.cuda.synchronize()
    g_deq = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_deq):
        at._dequant_k_launch(qt, qz, sc, 128, ws, 0, n)
    x_in = torch.empty_like(x)
    y_out = torch.empty((1024, n), device=dev, dtype=torch.float16)
    x_in.copy_(x)
    torch.matmul(x_in, ws.t(), out=y_out)
    torch.cuda.synchronize()
    g_lin = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_lin):
        at._dequant_k_launch(qt, qz, sc, 128, ws, 0, n)
        torch.matmul(x_in, ws.t(), out=y_out)

    def deq_graph_then_cublas():
        g_deq.replay()
        return torch.matmul(x, ws.t())

    def whole_graph():
        x_in.copy_(x)
        g_lin.replay()
        return y_out

    same = {"graph dequantize + cuBLAS": bool(torch.equal(deq_graph_then_cublas(), ref)),
            "whole linear graph": bool(torch.equal(whole_graph().clone(), ref))}
    torch.cuda.synchronize()
    w = torch.empty((n, k), device=dev, dtype=torch.float16)
    res = {
        "AWQLinear.forward 1024 tok (eager)": host_us(lambda: lin(x), 50),
        "dequantize graph replay only": host_us(g_deq.replay, 100),
        "graph dequantize + cuBLAS": host_us(deq_graph_then_cublas, 50),
        "whole linear graph (copy x in + replay)": host_us(whole_graph, 50),
        "F.linear fp16 1024 tok": host_us(lambda: torch.nn.functional.linear(x, w), 50),
    }
    return {"host_us": res, "same_as_eager": same}


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def launch_costs(dev) -> dict:
    from hisparse_cli.kernels.attention import attention_triton as tri
    from hisparse_cli.kernels.norm_rope.norm_rope_triton import rms_norm

    a = torch.randn(8, 64, device=dev, dtype=torch.float16)
    w = torch.ones(64, device=dev, dtype=torch.float16)
    bs, hkv, d, grp, g = 16, 8, 128, 4, 64
    k = torch.randn(8, bs, hkv, d, device=dev, dtype=torch.float16)
    q = torch.randn(16, hkv * grp, d, device=dev, dtype=torch.float16)
    ids = torch.arange(4, device=dev)
    starts = ids * bs
    gk = torch.randn(hkv, g, d, device=dev, dtype=torch.float16)
    gpos = torch.zeros(hkv, g, dtype=torch.int64, device=dev)
    score = torch.zeros(8, bs, hkv, device=dev)
    gm, gs = torch.zeros(hkv, g, device=dev), torch.zeros(hkv, g, device=dev)
    kw = dict(g_k=gk, g_v=gk, g_pos=gpos)
    return {
        "torch.add": host_us(lambda: torch.add(a, a)),
        "triton rms_norm": host_us(lambda: rms_norm(a, w, 1e-5)),
        "sparse_attention (no scores)": host_us(
            lambda: tri.sparse_attention(q, k, k, ids, starts, 48, 4, 32, 0.1, **kw)),
        "sparse_attention + scores_into (stride 4)": host_us(
            lambda: tri.sparse_attention(q, k, k, ids, starts, 48, 4, 32, 0.1, **kw,
                                         return_scores=True, score_stride=4,
                                         scores_into=(score, gm, gs))),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--cprofile-tokens", type=int, default=8192)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--awq", action="store_true", help="the AWQ INT4 model (see the docstring)")
    ap.add_argument("--graph-probe", action="store_true",
                    help="only: host us of an INT4 prefill linear eager vs replayed from CUDA graphs")
    ap.add_argument("--part1", action="store_true",
                    help="only part 1 (wall / host issue / GPU kernels of a prefill)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    if a.graph_probe:
        res = {"launch_us": launch_costs(dev), "graph_probe": graph_probe(dev)}
        print("== host us per launch:", {k: round(v, 1) for k, v in res["launch_us"].items()})
        print("== INT4 prefill linear, host us per call:",
              {k: round(v, 1) for k, v in res["graph_probe"]["host_us"].items()})
        print("== graph outputs bit-equal to eager:", res["graph_probe"]["same_as_eager"])
        (out / "gpu_prefill_host_graph.json").write_text(json.dumps(res, indent=1, default=str))
        return
    from hisparse_cli.engine.engine import Engine

    backend, _ = pick_backend(dev)
    sparse = load_profile("h200-141g").sparse_config()
    cfg = ModelConfig.from_dict(SHAPES["llama-3-8b"])
    eng = Engine(build_ours(cfg, dev, awq=a.awq, host_emb=False), cfg, sparse=sparse, device=dev,
                 kv_dtype=torch.float16, backend=backend)
    ids = torch.tensor(prompt(a.context, cfg.vocab_size), device=dev)
    res: dict = {"context": a.context, "sparse": sparse.__dict__, "awq": a.awq}
    prefill(eng, ids[: 6 * sparse.prefill_chunk])  # Triton JIT
    for imp in ("attention", "uniform"):
        eng.sparse = sparse.with_overrides(importance=imp)
        prefill(eng, ids[: 6 * sparse.prefill_chunk])
        runs = [prefill(eng, ids) for _ in range(2)]
        ms, top = gpu_kernels(eng, ids)
        res[imp] = {"issue_s": [r[0] for r in runs], "wall_s": [r[1] for r in runs],
                    "gpu_kernel_ms": ms, "top_kernels": top}
        print(f"{imp:>9}: wall {' '.join(f'{r[1]:.3f}' for r in runs)} s, host issue "
              f"{' '.join(f'{r[0]:.3f}' for r in runs)} s, GPU kernels {ms:.0f} ms", flush=True)
        print("   top kernels (calls, ms): " + "; ".join(f"{n} {c} {t:.0f}" for n, c, t in top))
    if a.awq:
        res["graph_census"] = graph_census(eng.model)
        print("   dequantize graphs:", res["graph_census"], flush=True)
    eng.sparse = sparse
    if a.part1:
        (out / "gpu_prefill_host.json").write_text(json.dumps(res, indent=1, default=str))
        return
    gen = [eng.generate(ids, max_new_tokens=1).stats.prefill_seconds for _ in range(2)]
    res["generate_prefill_s"] = gen  # the same prefill through Engine.generate (gpu_engine.py)
    print(f"Engine.generate prefill: {min(gen):.3f} s", flush=True)
    prof = cProfile.Profile()
    sub = ids[: a.cprofile_tokens]
    prof.enable()
    prefill(eng, sub)
    prof.disable()
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(22)
        text = buf.getvalue()
        res[f"cprofile_{key}"] = text
        print(f"== cProfile of issuing a {sub.numel()}-token prefill, by {key}")
        print("\n".join(line[:150] for line in text.splitlines()[6:34]))
    res["launch_us"] = launch_costs(dev)
    if a.awq:
        res["launch_us"].update(awq_launch_costs(dev))
    print("== host us per launch:", {k: round(v, 1) for k, v in res["launch_us"].items()})
    (out / "gpu_prefill_host.json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
