"""Same-process A/B of two INT4 launch choices in the engine (Llama-3-8B-shaped AWQ model,
h200-141g sparse settings, CUDA-graph decode), alternating variants so drift hits both:

  decode: GEMV_TABLE as it is vs the table before H200 run 31 (no cache hints, 16 programs
          per SM for large_n) - decode tok/s over --decode-tokens at an 8K context;
  prefill: the dequantize + cuBLAS path's temp W^T capped at 2^26 elements (gate|up of an 8B
           model in two chunks) vs 2^27 (one chunk: one dequantize and one cuBLAS launch
           fewer per layer, 128 MiB more temp) - prefill tok/s at --context.

    PYTHONPATH=$PWD python3 benchmarks/gpu_awq_ab.py [--out DIR] [--rounds 3] [--graphs]
--graphs: only the INT4 prefill with its dequantize replayed from CUDA graphs vs launched
eagerly, with fp16 in the same rounds (gpu_awq_ab_graphs.json).
--packed: only decode at --context: the fp16 model, INT4 with GEMV_TABLE as it is (packed 2
since run 39), the same tiles with packed 0 (the fp32 path), and the table of runs 31-38
(RUN31_TABLE, packed 0); order rotated each round; INT4/fp16 decode per round
(gpu_awq_ab_packed.json).
--silu: only the gated MLP's silu(gate) * up as one Triton kernel (KernelBackend.silu_mul_)
vs torch's two in-place ops, for fp16 and INT4: decode and prefill tok/s at --context, the
order alternating each round (gpu_awq_ab_silu.json).
--table-json FILE: only decode at --context: fp16, INT4 with GEMV_TABLE as it is and with the
table FILE suggests (`gpu_gemv_packed.py --rows2d` writes it: gpu_gemv_rows2d.json), with
--with-rows2d also GEMV_TABLE's tiles at rows2d 1 (zero points / scales loaded in the word
tile's layout); order rotated each round (gpu_awq_ab_table.json).
--pdl: only decode at --context: fp16, INT4 with GEMV_TABLE's launches at pdl 0, with the
GEMVs launched with programmatic dependent launch (pdl 1, kernels/pdl.py) but the producers
of x not triggering early, and with both; order rotated each round (gpu_awq_ab_pdl.json).
--pdl-chain: only decode at --context, fp16 and INT4, with the decode chain's other Triton
kernels (norm, RoPE, store_kv, attention, silu * up) launched as PDL consumers or the
ordinary way (kernels/pdl.CHAIN); the order rotated each round (gpu_awq_ab_chain.json).
--fuse-mass: only decode at --context, fp16 and INT4, with the decode attention's split
reduce and importance mass in one kernel or two (attention_triton.FUSE_REDUCE_MASS); the
order rotated each round (gpu_awq_ab_fuse_mass.json).
--pair-prmt: only decode at --context, fp16 and INT4, with the packed GEMV's x pairs built by
one PRMT each or by bit operations (awq_gemv.PAIR_PRMT; fp16's pair is the noise control);
the order rotated each round (gpu_awq_ab_pair_prmt.json).
--fuse-residual: only decode at --context, fp16 and INT4, with each decoder layer's closing
residual add run inside the next norm (llama.FUSE_RESIDUAL_NORM) or as its own op; the order
rotated each round (gpu_awq_ab_fuse_residual.json).
--fuse-rope-store: only decode at --context, fp16 and INT4, with each layer's RoPE and K/V
store in one kernel (norm_rope_triton.rope_store_kv, dispatch.FUSE_ROPE_STORE) or two; the
order rotated each round (gpu_awq_ab_fuse_rope_store.json).
--compact: only decode at --context: the INT4 model as built (twice: the spread between two
builds in one process), and a third build with every AWQ linear's words, zero points and
scales copied into one allocation in layer order (compact_awq_buffers), and fp16 as the
noise control; the order rotated each round (gpu_awq_ab_compact.json).
--tiled: only decode at --context, fp16 and INT4, with the INT4 words stored tiled under
GEMV_TABLE (AWQLinear.set_tiled, awq_layout.tile_kmajor; what awq_layout.TILED_WEIGHTS loads)
or K-major under KMAJOR_TABLE (the K-major tiles of runs 46-64); the order rotated each round
(gpu_awq_ab_tiled.json).
--host-gather: only decode at --context, fp16 and INT4 with the embedding table in host memory,
the token's row gathered in the graph by a kernel (kernels/host_rows.py) or read through the
host each step (engine/cuda_graph.HOST_GATHER); the order rotated each round
(gpu_awq_ab_host_gather.json).
Writes DIR/gpu_awq_ab.json (DIR: --out, else $OUT, else ./out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from gpu_engine import build_ours, pick_backend, prompt, run_ours  # noqa: E402
from hisparse_cli.kernels.int4 import awq_layout  # noqa: E402
from hisparse_cli.kernels.int4 import awq_triton  # noqa: E402
from hisparse_cli.model.awq import AWQLinear  # noqa: E402
from hisparse_cli.model.config import ModelConfig  # noqa: E402
from hisparse_cli.planner.shapes import SHAPES  # noqa: E402
from hisparse_cli.config.profiles import load_profile  # noqa: E402

OLD_TABLE = dict(awq_layout.GEMV_TABLE,
                 small_n=awq_layout.GemvTile(block_n=32, num_warps=1, num_stages=1,
                                             programs_per_sm=16),
                 large_n=awq_layout.GemvTile(block_n=32, num_warps=1, num_stages=1,
                                             programs_per_sm=16))
NEW_TABLE = dict(awq_layout.GEMV_TABLE)
# the table of runs 46-64, tuned on the K-major words (--tiled's "off" side)
KMAJOR_TABLE = dict(awq_layout.GEMV_TABLE,
                    large_n=awq_layout.GemvTile(block_n=64, num_warps=2, num_stages=1,
                                                programs_per_sm=32, stream=2, packed=2, pdl=1),
                    huge_n=awq_layout.GemvTile(block_n=64, num_warps=2, num_stages=3,
                                               programs_per_sm=4, packed=2, pdl=1))


def unprepare(model) -> None:
    """Drop every AWQLinear's prepared launch (made again, with the current module
    constants, on its next call)."""
    for m in model.modules():
        if isinstance(m, AWQLinear):
            m._prepared = m._prepared_key = None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--decode-tokens", type=int, default=257)
    ap.add_argument("--packed", action="store_true",
                    help="only: decode with GEMV_TABLE (packed fp16 GEMV) vs its tiles at packed 0, "
                         "RUN31_TABLE and fp16, interleaved")
    ap.add_argument("--graphs", action="store_true",
                    help="only: prefill with the dequantize replayed from CUDA graphs vs launched "
                         "eagerly, and fp16, interleaved")
    ap.add_argument("--silu", action="store_true",
                    help="only: fused silu * up kernel vs torch's two ops, fp16 and INT4")
    ap.add_argument("--table-json", type=Path,
                    help="only: decode with GEMV_TABLE vs its tiles at rows2d 1 vs the table "
                         "this gpu_gemv_rows2d.json suggests, and fp16, interleaved")
    ap.add_argument("--with-rows2d", action="store_true",
                    help="with --table-json: also GEMV_TABLE's tiles at rows2d 1")
    ap.add_argument("--pdl", action="store_true",
                    help="only: decode with the GEMVs launched with PDL (with / without the "
                         "producers' early trigger) vs without, and fp16, interleaved")
    for flag, what in (  # decode, fp16 and INT4, with each switch on and off, interleaved
            ("--pdl-chain", "the chain's kernels launched with PDL or not"),
            ("--fuse-mass", "the attention's split reduce and mass kernel in one launch or two"),
            ("--pair-prmt", "the packed GEMV's x pairs built by PRMT or by bit operations"),
            ("--fuse-residual", "each layer's residual add inside the next norm or as its own op"),
            ("--fuse-rope-store", "each layer's RoPE and K/V store in one kernel or two"),
            ("--compact", "the INT4 buffers as built (two builds) or in one allocation"),
            ("--tiled", "the INT4 words stored in the tiled layout or K-major"),
            ("--host-gather", "the embedding table in host memory, its row gathered by a kernel "
                              "or read through the host")):
        ap.add_argument(flag, action="store_true",
                        help=f"only: decode, fp16 and INT4, with {what}, interleaved")
    a = ap.parse_args()
    dev = torch.device("cuda")
    backend = pick_backend(dev)[0]
    cfg = ModelConfig.from_dict(SHAPES["llama-3-8b"])
    sparse = load_profile("h200-141g").sparse_config()
    model = build_ours(cfg, dev, awq=True, host_emb=False)
    kw = dict(weight_format="awq-int4")
    run_ours(model, cfg, sparse, prompt(4096, cfg.vocab_size), 8, backend, dev, **kw)  # JIT
    for flag, only in ((a.graphs, graphs_ab), (a.packed, packed_ab), (a.table_json, table_ab),
                       (a.pdl, pdl_ab), (a.pdl_chain, chain_ab), (a.silu, silu_ab),
                       (a.fuse_mass, fuse_mass_ab), (a.pair_prmt, pair_prmt_ab),
                       (a.fuse_residual, fuse_residual_ab), (a.host_gather, host_gather_ab),
                       (a.fuse_rope_store, fuse_rope_store_ab), (a.compact, compact_ab),
                       (a.tiled, tiled_ab)):
        if flag:  # the --flag modes: one A/B each, then done
            only(a, model, cfg, sparse, backend, dev)
            return
    res: dict = {"decode": [], "prefill": []}
    short = prompt(8192, cfg.vocab_size)
    for r in range(a.rounds):
        for label, table in (("table before run 31", OLD_TABLE), ("table now", NEW_TABLE)):
            awq_layout.GEMV_TABLE.clear()
            awq_layout.GEMV_TABLE.update(table)
            out = run_ours(model, cfg, sparse, short, a.decode_tokens, backend, dev, **kw)
            res["decode"].append(dict(round=r, variant=label, decode_tok_s=out["decode_tok_s"]))
            print(f"decode  round {r} {label:<20} {out['decode_tok_s']:7.1f} tok/s", flush=True)
    awq_layout.GEMV_TABLE.clear()
    awq_layout.GEMV_TABLE.update(NEW_TABLE)
    long = prompt(a.context, cfg.vocab_size)
    for r in range(a.rounds):
        for elems in (1 << 26, 1 << 27):
            awq_triton.DEQUANT_CHUNK_ELEMS_K = elems
            unprepare(model)
            out = run_ours(model, cfg, sparse, long, 2, backend, dev, **kw)
            res["prefill"].append(dict(round=r, dequant_chunk_elems=elems,
                                       prefill_tok_s=out["prefill_tok_s"],
                                       peak_bytes=out["peak_bytes"]))
            print(f"prefill round {r} chunk 2^{elems.bit_length() - 1}: "
                  f"{out['prefill_tok_s']:9,.0f} tok/s  peak {out['peak_bytes'] / 2**30:.2f} GiB",
                  flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gpu_awq_ab.json").write_text(json.dumps(res, indent=1))


def silu_ab(a, model, cfg, sparse, backend, dev) -> None:
    """Decode and prefill tok/s at --context over --decode-tokens, fp16 and INT4, with the
    fused silu * up kernel and with KernelBackend.silu_mul_ patched to the torch reference
    (F.silu in place, then mul_: the model's ops before the kernel), alternating."""
    from hisparse_cli.kernels.norm_rope import norm_rope_ref
    from hisparse_cli.kernels.dispatch import KernelBackend

    fused = KernelBackend.silu_mul_
    fp16 = build_ours(cfg, dev, awq=False, host_emb=False)
    run_ours(fp16, cfg, sparse, prompt(4096, cfg.vocab_size), 8, backend, dev,
             weight_format="fp16")
    long = prompt(a.context, cfg.vocab_size)
    res: list = []
    for r in range(a.rounds):
        for fmt, m in (("fp16", fp16), ("awq-int4", model)):
            row = {}
            for variant in (("kernel", "torch ops") if r % 2 == 0 else ("torch ops", "kernel")):
                if variant == "torch ops":
                    KernelBackend.silu_mul_ = lambda self, gu, inter: norm_rope_ref.silu_mul_(
                        gu, inter)
                try:
                    out = run_ours(m, cfg, sparse, long, a.decode_tokens, backend, dev,
                                   weight_format=fmt)
                finally:
                    KernelBackend.silu_mul_ = fused
                row[variant] = {k: out[k] for k in ("decode_tok_s", "prefill_tok_s")}
            k, t = row["kernel"], row["torch ops"]
            print(f"round {r} {fmt:<8} decode {k['decode_tok_s']:6.1f} vs {t['decode_tok_s']:6.1f}"
                  f" tok/s ({k['decode_tok_s'] / t['decode_tok_s']:.3f}x), prefill "
                  f"{k['prefill_tok_s']:8,.0f} vs {t['prefill_tok_s']:8,.0f} "
                  f"({k['prefill_tok_s'] / t['prefill_tok_s']:.3f}x)", flush=True)
            res.append(dict(round=r, weights=fmt, **row))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gpu_awq_ab_silu.json").write_text(json.dumps(res, indent=1))


def graphs_ab(a, model, cfg, sparse, backend, dev) -> None:
    """Prefill tok/s at --context: INT4 with the dequantize replayed from CUDA graphs
    (awq_triton.PreparedLinearK) vs launched eagerly (GRAPHS_PER_LINEAR = 0), and the fp16
    model, the order rotated each round; the INT4 / fp16 ratio per round."""
    fp16 = build_ours(cfg, dev, awq=False, host_emb=False)
    long = prompt(a.context, cfg.vocab_size)
    run_ours(fp16, cfg, sparse, prompt(4096, cfg.vocab_size), 2, backend, dev, weight_format="fp16")
    cap = awq_triton.GRAPHS_PER_LINEAR
    variants = [("fp16", fp16, None), ("int4 eager dequantize", model, 0),
                ("int4 graph dequantize", model, cap)]
    res: list = []
    for r in range(a.rounds):
        row = {}
        for label, m, graphs in variants[r % 3:] + variants[: r % 3]:
            if graphs is not None:
                awq_triton.GRAPHS_PER_LINEAR = graphs
                unprepare(m)
                run_ours(m, cfg, sparse, prompt(4096, cfg.vocab_size), 2, backend, dev,
                         weight_format="awq-int4")  # graphs captured outside the timing
            out = run_ours(m, cfg, sparse, long, 2, backend, dev,
                           weight_format="fp16" if graphs is None else "awq-int4")
            row[label] = out["prefill_tok_s"]
            print(f"round {r} {label:<22} prefill {out['prefill_tok_s']:9,.0f} tok/s", flush=True)
        ratios = {k: row[k] / row["fp16"] for k in row if k != "fp16"}
        print(f"round {r} INT4/fp16 prefill: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()),
              flush=True)
        res.append(dict(round=r, prefill_tok_s=row, ratio=ratios))
    awq_triton.GRAPHS_PER_LINEAR = cap
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gpu_awq_ab_graphs.json").write_text(json.dumps(res, indent=1))


# GEMV_TABLE of runs 31-38 (before the packed fp16 GEMV): the A/B's baseline
RUN31_TABLE = {
    "small_n": awq_layout.GemvTile(block_n=32, num_warps=1, num_stages=1, programs_per_sm=16,
                                   stream=2),
    "large_n": awq_layout.GemvTile(block_n=32, num_warps=1, num_stages=1, programs_per_sm=32,
                                   stream=2),
    "huge_n": awq_layout.GemvTile(block_n=64, num_warps=2, num_stages=3, programs_per_sm=4),
}


def table_ab(a, model, cfg, sparse, backend, dev) -> None:
    """Decode tok/s at --context over --decode-tokens: fp16, INT4 with GEMV_TABLE, with the
    table --table-json suggests (classes it lacks keep GEMV_TABLE's row), and (--with-rows2d)
    with GEMV_TABLE's tiles at rows2d 1; the order rotated each round."""
    from dataclasses import replace

    table = dict(awq_layout.GEMV_TABLE)
    sugg = json.loads(a.table_json.read_text())["table"]
    fields = set(awq_layout.GemvTile.__dataclass_fields__)
    suggested = dict(table, **{c: awq_layout.GemvTile(**{k: v for k, v in t.items()
                                                         if k in fields})
                               for c, t in sugg.items()})
    print("suggested table:", suggested, flush=True)
    tables = {"int4 table": table, "int4 suggested": suggested}
    if a.with_rows2d:
        tables["int4 table rows2d"] = {k: replace(t, rows2d=1) for k, t in table.items()}
    _decode_ab(a, model, cfg, sparse, backend, dev, tables, "gpu_awq_ab_table.json",
               extra=dict(suggested={k: str(v) for k, v in suggested.items()}))


def chain_ab(a, model, cfg, sparse, backend, dev) -> None:
    """kernels/pdl.CHAIN on and off (gpu_awq_ab_chain.json)."""
    from hisparse_cli.kernels import pdl

    assert pdl.pdl_enabled(dev), "PDL is off on this device / Triton (kernels/pdl.py)"
    _switch_ab(a, model, cfg, sparse, backend, dev, "chain",
               lambda on: setattr(pdl, "CHAIN", on), "gpu_awq_ab_chain.json")


def fuse_mass_ab(a, model, cfg, sparse, backend, dev) -> None:
    """attention_triton.FUSE_REDUCE_MASS on and off (gpu_awq_ab_fuse_mass.json)."""
    from hisparse_cli.kernels.attention import attention_triton

    _switch_ab(a, model, cfg, sparse, backend, dev, "fused",
               lambda on: setattr(attention_triton, "FUSE_REDUCE_MASS", on),
               "gpu_awq_ab_fuse_mass.json")


def pair_prmt_ab(a, model, cfg, sparse, backend, dev) -> None:
    """awq_gemv.PAIR_PRMT on and off (gpu_awq_ab_pair_prmt.json); the fp16 model does not
    use the GEMV, so its on/off pair measures the rounds' noise."""
    from hisparse_cli.kernels.int4 import awq_gemv

    _switch_ab(a, model, cfg, sparse, backend, dev, "prmt",
               lambda on: setattr(awq_gemv, "PAIR_PRMT", on), "gpu_awq_ab_pair_prmt.json",
               left_on=False)


def fuse_residual_ab(a, model, cfg, sparse, backend, dev) -> None:
    """llama.FUSE_RESIDUAL_NORM on and off (gpu_awq_ab_fuse_residual.json)."""
    from hisparse_cli.model import llama

    _switch_ab(a, model, cfg, sparse, backend, dev, "fused",
               lambda on: setattr(llama, "FUSE_RESIDUAL_NORM", on),
               "gpu_awq_ab_fuse_residual.json", left_on=False)


def fuse_rope_store_ab(a, model, cfg, sparse, backend, dev) -> None:
    """dispatch.FUSE_ROPE_STORE on and off (gpu_awq_ab_fuse_rope_store.json)."""
    from hisparse_cli.kernels import dispatch

    _switch_ab(a, model, cfg, sparse, backend, dev, "fused",
               lambda on: setattr(dispatch, "FUSE_ROPE_STORE", on),
               "gpu_awq_ab_fuse_rope_store.json", left_on=dispatch.FUSE_ROPE_STORE)


def compact_awq_buffers(model, align: int = 512) -> int:
    """Copy every AWQLinear's qweight, qzeros and scales, in module order, into one device
    allocation (each at a multiple of `align` bytes) and rebind the buffers to views of it;
    the old tensors are freed. Returns the allocation's bytes."""
    mods = [m for m in model.modules() if isinstance(m, AWQLinear)]
    names = ("qweight", "qzeros", "scales")
    size = lambda t: -(-t.numel() * t.element_size() // align) * align  # noqa: E731
    total = sum(size(getattr(m, n)) for m in mods for n in names)
    buf = torch.empty(total, dtype=torch.uint8, device=mods[0].qweight.device)
    off = 0
    for m in mods:
        for n in names:
            t = getattr(m, n)
            nb = t.numel() * t.element_size()
            view = buf[off:off + nb].view(t.dtype).view(t.shape)
            view.copy_(t)
            setattr(m, n, view)  # a registered buffer: rebinds it (prepared again on use)
            off += size(t)
    torch.cuda.empty_cache()
    return total


def compact_ab(a, model, cfg, sparse, backend, dev) -> None:
    """Decode tok/s at --context over --decode-tokens: INT4 as built (this model and a second
    build), INT4 with its buffers in one allocation (a third build, compacted), and fp16; the
    order rotated each round (gpu_awq_ab_compact.json)."""
    fp16 = build_ours(cfg, dev, awq=False, host_emb=False)
    second = build_ours(cfg, dev, awq=True, host_emb=False)
    compact = build_ours(cfg, dev, awq=True, host_emb=False)
    nbytes = compact_awq_buffers(compact)
    print(f"compacted: {nbytes / 2 ** 30:.2f} GiB in one allocation", flush=True)
    long = prompt(a.context, cfg.vocab_size)
    variants = [("fp16", fp16, "fp16"), ("int4 built", model, "awq-int4"),
                ("int4 built again", second, "awq-int4"), ("int4 compacted", compact, "awq-int4")]
    for _, m, fmt in variants:  # compile at the timed shapes, outside the timing
        run_ours(m, cfg, sparse, long, 8, backend, dev, weight_format=fmt)
    res = []
    for r in range(a.rounds):
        row = {}
        k = r % len(variants)
        for label, m, fmt in variants[k:] + variants[:k]:
            out = run_ours(m, cfg, sparse, long, a.decode_tokens, backend, dev, weight_format=fmt)
            row[label] = out["decode_tok_s"]
            print(f"round {r} {label:<18} decode {out['decode_tok_s']:7.1f} tok/s  prefill "
                  f"{out['prefill_tok_s']:9,.0f} tok/s", flush=True)
        print(f"round {r}: compacted / built {row['int4 compacted'] / row['int4 built']:.3f}, "
              f"/ built again {row['int4 compacted'] / row['int4 built again']:.3f}; built again"
              f" / built {row['int4 built again'] / row['int4 built']:.3f}", flush=True)
        res.append(dict(round=r, decode_tok_s=row))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gpu_awq_ab_compact.json").write_text(json.dumps(res, indent=1))


def tiled_ab(a, model, cfg, sparse, backend, dev) -> None:
    """The INT4 model's words stored tiled with GEMV_TABLE (AWQLinear.set_tiled,
    awq_layout.tile_kmajor: what awq_layout.TILED_WEIGHTS makes at load) or K-major with
    KMAJOR_TABLE (its tiles before run 65), every kernel reading them so
    (gpu_awq_ab_tiled.json); the fp16 pair measures the rounds' noise."""
    table = dict(awq_layout.GEMV_TABLE)

    def switch(on: bool) -> None:
        awq_layout.GEMV_TABLE.clear()
        awq_layout.GEMV_TABLE.update(table if on else KMAJOR_TABLE)
        for m in model.modules():
            if isinstance(m, AWQLinear):
                m.set_tiled(on)  # a copy per linear; prepared again on the next call

    _switch_ab(a, model, cfg, sparse, backend, dev, "tiled", switch, "gpu_awq_ab_tiled.json",
               left_on=awq_layout.TILED_WEIGHTS)


def host_gather_ab(a, model, cfg, sparse, backend, dev) -> None:
    """engine/cuda_graph.HOST_GATHER on and off, both models with the embedding table in host
    memory (registered for the device, as the loader does): the graph's row gathered by a
    kernel (kernels/host_rows.py) or the token read on the host every step
    (gpu_awq_ab_host_gather.json)."""
    from hisparse_cli.engine import cuda_graph

    int4 = build_ours(cfg, dev, awq=True, host_emb=True)
    _switch_ab(a, int4, cfg, sparse, backend, dev, "gather",
               lambda on: setattr(cuda_graph, "HOST_GATHER", on),
               "gpu_awq_ab_host_gather.json", left_on=True, host_emb=True)


def _switch_ab(a, model, cfg, sparse, backend, dev, what: str, switch, name: str,
               left_on: bool = True, host_emb: bool = False) -> None:
    """Decode tok/s at --context over --decode-tokens for fp16 and INT4, each with a module
    switch on and off (switch(bool) sets it; left at left_on), the order rotated each round;
    per round the gain per format and INT4/fp16 with and without it. host_emb: the fp16
    model's table in host memory too."""
    fp16 = build_ours(cfg, dev, awq=False, host_emb=host_emb)
    long = prompt(a.context, cfg.vocab_size)
    variants = [(f"{fmt} {what} {'on' if on else 'off'}", m, fmt, on)
                for fmt, m in (("fp16", fp16), ("awq-int4", model)) for on in (False, True)]
    for _, m, fmt, on in variants:  # compile at the timed shapes, outside the timing
        switch(on)
        run_ours(m, cfg, sparse, long, 8, backend, dev, weight_format=fmt)
    res: list = []
    try:
        for r in range(a.rounds):
            row = {}
            k = r % len(variants)
            for label, m, fmt, on in variants[k:] + variants[:k]:
                switch(on)
                out = run_ours(m, cfg, sparse, long, a.decode_tokens, backend, dev,
                               weight_format=fmt)
                row[label] = out["decode_tok_s"]
                print(f"round {r} {label:<20} decode {out['decode_tok_s']:7.1f} tok/s  prefill "
                      f"{out['prefill_tok_s']:9,.0f} tok/s", flush=True)
            gain = {f: row[f"{f} {what} on"] / row[f"{f} {what} off"]
                    for f in ("fp16", "awq-int4")}
            ratio = {o: row[f"awq-int4 {what} {o}"] / row[f"fp16 {what} {o}"]
                     for o in ("on", "off")}
            print(f"round {r} {what} on/off: " + ", ".join(f"{k} {v:.3f}" for k, v in gain.items())
                  + "; INT4/fp16: " + ", ".join(f"{what} {k} {v:.3f}" for k, v in ratio.items()),
                  flush=True)
            res.append(dict(round=r, decode_tok_s=row, gain=gain, ratio=ratio))
    finally:
        switch(left_on)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / name).write_text(json.dumps(res, indent=1))


def pdl_ab(a, model, cfg, sparse, backend, dev) -> None:
    """Decode tok/s at --context over --decode-tokens: fp16, INT4 with the table's tiles at
    pdl 0 (producers not triggering), pdl 1 without and with the producers' early trigger."""
    from dataclasses import replace

    from hisparse_cli.kernels import pdl

    assert pdl.pdl_enabled(dev), "PDL is off on this device / Triton (kernels/pdl.py)"
    table = dict(awq_layout.GEMV_TABLE)
    off = {k: replace(t, pdl=0) for k, t in table.items()}
    on = {k: replace(t, pdl=1) for k, t in table.items()}
    _decode_ab(a, model, cfg, sparse, backend, dev,
               {"int4 no pdl": (off, False), "int4 pdl": (on, False),
                "int4 pdl + triggers": (on, True)}, "gpu_awq_ab_pdl.json")


def _decode_ab(a, model, cfg, sparse, backend, dev, tables: dict, name: str,
               extra: dict | None = None) -> None:
    """fp16 and INT4 under each of `tables` (label -> GEMV_TABLE, or (GEMV_TABLE, producers
    trigger early: kernels/pdl.TRIGGERS)), decode tok/s at --context, the order rotated each
    round; INT4/fp16 per round. GEMV_TABLE and the trigger switch are restored after."""
    from hisparse_cli.kernels import pdl

    tables = {k: v if isinstance(v, tuple) else (v, pdl.TRIGGERS) for k, v in tables.items()}
    saved_trigger = pdl.TRIGGERS
    fp16 = build_ours(cfg, dev, awq=False, host_emb=False)
    run_ours(fp16, cfg, sparse, prompt(4096, cfg.vocab_size), 8, backend, dev,
             weight_format="fp16")
    long = prompt(a.context, cfg.vocab_size)
    saved = dict(awq_layout.GEMV_TABLE)
    run_ours(fp16, cfg, sparse, long, 8, backend, dev, weight_format="fp16")
    for t, trig in tables.values():  # compile the kernels (the context's shapes included)
        awq_layout.GEMV_TABLE.clear()  # outside the timing
        awq_layout.GEMV_TABLE.update(t)
        pdl.TRIGGERS = trig
        run_ours(model, cfg, sparse, long, 8, backend, dev, weight_format="awq-int4")
    pdl.TRIGGERS = saved_trigger
    variants = [("fp16", fp16, None)] + [(k, model, t) for k, t in tables.items()]
    res: list = []
    try:
        for r in range(a.rounds):
            row = {}
            k = r % len(variants)
            for label, m, tab in variants[k:] + variants[:k]:
                pdl.TRIGGERS = saved_trigger
                if tab is not None:
                    awq_layout.GEMV_TABLE.clear()
                    awq_layout.GEMV_TABLE.update(tab[0])
                    pdl.TRIGGERS = tab[1]
                out = run_ours(m, cfg, sparse, long, a.decode_tokens, backend, dev,
                               weight_format="fp16" if tab is None else "awq-int4")
                row[label] = out["decode_tok_s"]
                print(f"round {r} {label:<20} decode {out['decode_tok_s']:7.1f} tok/s  prefill "
                      f"{out['prefill_tok_s']:9,.0f} tok/s", flush=True)
            ratios = {k: row[k] / row["fp16"] for k in row if k != "fp16"}
            print(f"round {r} INT4/fp16 decode: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()), flush=True)
            res.append(dict(round=r, decode_tok_s=row, ratio=ratios))
    finally:
        awq_layout.GEMV_TABLE.clear()
        awq_layout.GEMV_TABLE.update(saved)
        pdl.TRIGGERS = saved_trigger
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / name).write_text(json.dumps(dict(rounds=res, **(extra or {})), indent=1))


def packed_ab(a, model, cfg, sparse, backend, dev) -> None:
    """Decode tok/s at --context over --decode-tokens: fp16, INT4 with GEMV_TABLE as it is,
    with its tiles at packed 0, and with RUN31_TABLE; the order rotated each round (a new
    Engine per run: each captures its own decode graph with the table of the moment)."""
    from dataclasses import replace

    table = dict(awq_layout.GEMV_TABLE)
    _decode_ab(a, model, cfg, sparse, backend, dev,
               {"int4 table": table,
                "int4 table packed 0": {k: replace(t, packed=0) for k, t in table.items()},
                "int4 run-31 table": dict(RUN31_TABLE)}, "gpu_awq_ab_packed.json")


if __name__ == "__main__":
    main()
