"""Compile hisparse's Triton kernels for sm_90 without a GPU (Triton's bundled ptxas) and print
registers, spills, shared memory and 16-byte loads/stores of each configuration.

    python benchmarks/sm90_compile.py awq [--sass-dir DIR] [--all | --packed]
    python benchmarks/sm90_compile.py norm-rope [--quick]

Both catch what the CPU interpreter accepts but the compiler refuses (e.g. constexpr rules of
Triton 3.6). Tests import this module (`compile_one`, `compile_gemv`, `report`, `GEMV_SIG`,
`GEMV_ALIGNED`) and run `norm-rope --quick`.

awq: the K-major AWQ kernels and the item layout's dequantize, with the SASS instruction mix
of each configuration: whether loads/stores are 16 bytes wide and whether layouts convert
through shared memory (LDS/STS/BAR in the GEMV loop mean a layout conversion). The fused
prefill GEMM: the table's tiles (--all: every sweep candidate), HGMMA = wgmma on Hopper,
LDGSTS = cp.async pipelined loads.

norm-rope: the RMSNorm / residual-add + RMSNorm / RoPE (+ K/V store) / SiLU-mul kernels at
the configurations the launchers pick for Llama-family shapes. Pointers and strides carry the
16-divisibility Triton's launcher specializes on at run time (the model's row strides are
multiples of 16). --quick: fp16 only. Exits non-zero on a failure or a kernel that spills
(tests/test_norm_rope_kernels.py runs it).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be JIT functions, not interpreted
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.6's default

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from hisparse_cli.kernels.fp8 import act_quant_triton as aq  # noqa: E402
from hisparse_cli.kernels.int4 import awq_gemm_k as agk  # noqa: E402
from hisparse_cli.kernels.int4 import awq_gemv as ag  # noqa: E402
from hisparse_cli.kernels.int4 import awq_items_triton as ait  # noqa: E402
from hisparse_cli.kernels.int4 import awq_triton as at  # noqa: E402
from hisparse_cli.kernels.int4.awq_layout import (GEMM_CANDIDATES, GEMM_TABLE,  # noqa: E402
                                             GEMV_CANDIDATES, GemvConfig)
from hisparse_cli.kernels.norm_rope import norm_rope_triton as nt  # noqa: E402

OPS = ("LDG", "STG", "LDS", "STS", "BAR", "SHFL", "FFMA", "FADD", "FMUL", "LOP3", "SHF", "I2F",
       "PRMT", "F2FP", "HFMA2", "HMUL2", "HADD2")


def compile_one(fn, sig: dict, consts: dict, warps: int, aligned: tuple[str, ...],
                stages: int = 3, maxnreg: int = 0):
    # constexprs left out take their defaults, as a launch would (Triton's ASTSource does not)
    consts = {**{p.name: p.default for p in fn.params
                 if p.is_constexpr and p.has_default and p.name not in sig}, **consts}
    names = list(sig)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in consts}},
                    constexprs=consts, attrs=attrs)
    opts = dict(num_warps=warps, num_stages=stages, **({"maxnreg": maxnreg} if maxnreg else {}))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def disassemble(k, resources: bool = True) -> tuple[str, str]:
    """(cuobjdump's resource usage, nvdisasm's SASS) of a compiled kernel."""
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(k.asm["cubin"])
        res = subprocess.run([str(bindir / "cuobjdump"), "--dump-resource-usage", str(cubin)],
                             capture_output=True, text=True).stdout if resources else ""
        sass = subprocess.run([str(bindir / "nvdisasm"), str(cubin)], capture_output=True,
                              text=True).stdout
    return res, sass


def report(name: str, k, sass_dir: Path | None) -> None:
    res, sass = disassemble(k)
    use = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    ops = re.finditer(r"\b([A-Z][A-Z0-9]+)(?:\.[A-Z0-9.]+)?\s", sass)
    mix = collections.Counter(m.group(1) for m in ops if m.group(1) in OPS)
    wide = (len(re.findall(r"LDG\.E(?:\.[A-Z]+)*\.128", sass)),  # .EF/.EL: eviction hints
            len(re.findall(r"STG\.E(?:\.[A-Z]+)*\.128", sass)))
    mma = {o: len(re.findall(rf"\b{o}\.", sass)) for o in ("HGMMA", "HMMA", "LDGSTS")}
    print(f"{name:<44} regs {use.group(1):>3} stack {use.group(2)} local {use.group(4)}  "
          f"LDG.128 {wide[0]} STG.128 {wide[1]}  "
          + "".join(f"{o}={c} " for o, c in mma.items() if c)
          + " ".join(f"{o}={mix[o]}" for o in OPS if mix[o]))
    if sass_dir:
        sass_dir.mkdir(parents=True, exist_ok=True)
        (sass_dir / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.sass").write_text(sass)


GEMV_SIG = dict(x_ptr="*fp16", qt_ptr="*i32", qz_ptr="*i32", s_ptr="*fp16", b_ptr="*fp16",
                y_ptr="*fp16", p_ptr="*fp32", cnt_ptr="*i32", N="i32", KW="i32", W8="i32",
                stride_xm="i32", stride_ym="i32", stride_ps="i32", stride_pm="i32",
                KW_PER_SPLIT="i32")
GEMV_ALIGNED = ("x_ptr", "qt_ptr", "qz_ptr", "s_ptr", "b_ptr", "y_ptr", "p_ptr", "cnt_ptr", "N",
                "KW", "W8", "stride_xm", "stride_ym", "KW_PER_SPLIT")


def compile_gemv(c: GemvConfig, m: int, partial: bool, group: int, dt: str):
    """The decode GEMV for sm_90 as awq_gemv_k launches it on CUDA (ASM: the packed path's
    PTX, when c.packed and fp16 activations)."""
    sig = dict(GEMV_SIG, x_ptr=dt, b_ptr=dt, y_ptr=dt)
    return compile_one(ag._awq_gemv_kernel, sig,
                       dict(GROUP=group, M=m, BLOCK_N=c.block_n, BLOCK_KW=c.block_kw,
                            NUM_STAGES=c.num_stages, HAS_BIAS=not partial,
                            SPLIT=4 if partial else 1, PREFETCH=c.prefetch,
                            STREAM=c.stream, PACKED=c.packed if dt == "*fp16" else 0,
                            ASM=True, PDL=bool(c.pdl), PDL_TRIGGER=bool(c.pdl),
                            TILED=bool(c.tiled)),
                       c.num_warps, GEMV_ALIGNED, maxnreg=c.maxnreg)


def _loop_body(k) -> str:
    """SASS of the kernel's first loop (label to its backward branch), '' if none."""
    _, sass = disassemble(k, resources=False)
    for m in re.finditer(r"BRA `\((\.L_x_\d+)\)", sass):
        label = m.group(1)
        start = sass.find(f"\n{label}:")
        if 0 <= start < m.start():  # a backward branch: the loop
            return sass[start:m.start()]
    return ""


def loop_length(k) -> int:
    """SASS instructions of the kernel's first loop."""
    return len(re.findall(r"/\*[0-9a-f]{4,}\*/", _loop_body(k)))


def loop_count(k, op: str) -> int:
    """How many `op` instructions (e.g. BAR: barriers of a layout conversion through shared
    memory) the kernel's first loop holds."""
    return len(re.findall(rf"\*/\s+(?:@!?U?P\w+\s+)?{op}\b", _loop_body(k)))


def compile_packed(sass_dir: Path | None) -> None:
    for m, partial in ((1, False), (1, True), (2, False), (4, True)):
        for packed in (0, 1, 2):
            c = GemvConfig(block_n=32, block_kw=16, split=1, num_warps=1, num_stages=1,
                           stream=2, packed=packed)
            k = compile_gemv(c, m, partial, 128, "*fp16")
            name = f"gemv packed{packed} m{m} p{int(partial)}"
            report(name, k, sass_dir)
            print(f"{name}: loop {loop_length(k)} instructions (16 words a thread a step)")
    for cap in (80, 64):  # GemvConfig.maxnreg: registers traded for spills
        c = GemvConfig(block_n=32, block_kw=16, split=1, num_warps=1, num_stages=1, stream=2,
                       packed=2, maxnreg=cap)
        k = compile_gemv(c, 1, True, 128, "*fp16")
        report(f"gemv packed2 m1 p1 maxnreg{cap}", k, sass_dir)
        print(f"gemv packed2 m1 p1 maxnreg{cap}: loop {loop_length(k)} instructions")
    c = GemvConfig(block_n=32, block_kw=4, split=1, num_warps=1, num_stages=1, packed=2)
    report("gemv packed2 g32 m1", compile_gemv(c, 1, False, 32, "*fp16"), sass_dir)
    # the table's tiles, with and without the register prefetch
    for bn, w in ((128, 4), (64, 2)):
        for m in (1, 2):
            for pf in (0, 1):
                c = GemvConfig(block_n=bn, block_kw=16, split=1, num_warps=w, num_stages=1,
                               stream=2, packed=2, prefetch=pf)
                k = compile_gemv(c, m, False, 128, "*fp16")
                name = f"gemv packed2 bn{bn} w{w} m{m} prefetch{pf}"
                report(name, k, sass_dir)
                print(f"{name}: loop {loop_length(k)} instructions, "
                      f"{loop_count(k, 'BAR')} barriers")


def gemv_candidates(every: bool) -> list[tuple[GemvConfig, int, bool]]:
    """(config, tokens, split-K?) to compile: every sweep candidate (awq_layout.GEMV_CANDIDATES)
    at 1 token, or the first few; plus 2..4 tokens with and without split-K."""
    tiles = GEMV_CANDIDATES if every else GEMV_CANDIDATES[:3]
    out = [(GemvConfig(block_n=bn, block_kw=16, split=1, num_warps=w, num_stages=st,
                       prefetch=pf, stream=sm), 1, p)
           for bn, w, st, pf, sm in tiles for p in (False, True)]
    if not every:  # the register-prefetch and streaming variants too
        out += [(GemvConfig(block_n=32, block_kw=16, split=1, num_warps=1, num_stages=1,
                            prefetch=pf, stream=sm), 1, p)
                for pf, sm in ((1, 0), (0, 1), (0, 2), (1, 2)) for p in (False, True)]
    out += [(out[0][0], 4, False), (out[0][0], 3, True), (out[0][0], 2, False)]
    return out


def awq(a) -> int:
    """The AWQ kernels (args: sass_dir, all, packed)."""
    if a.packed:
        compile_packed(a.sass_dir)
        return 0
    cands = [(c, m, p, 128, "*fp16") for c, m, p in gemv_candidates(a.all)]
    c0 = cands[0][0]
    cands += [(c0, 3, False, 128, "*bf16"), (c0, 1, True, 128, "*bf16"),  # bf16 activations
              (GemvConfig(block_n=64, block_kw=4, split=1, num_warps=2, num_stages=1), 2, False,
               32, "*fp16")]  # group 32: 4 words a step
    for c, m, partial, group, dt in cands:
        k = compile_gemv(c, m, partial, group, dt)
        report(f"gemv {dt[1:]} g{group} m{m} bn{c.block_n} bkw{c.block_kw} w{c.num_warps} "
               f"st{c.num_stages} pf{c.prefetch} sm{c.stream} p{int(partial)}", k, a.sass_dir)
    for dt in ("*fp16", "*bf16", "*fp8e4nv"):  # fp8: the W4A8 codes (CODES)
        codes = dt == "*fp8e4nv"
        sc = "*fp32" if codes else dt
        for bn, bkw, warps in ((16, 16, 1), (64, 16, 4), (128, 16, 8), (64, 8, 4), (64, 4, 4)):
            k = compile_one(at._awq_dequant_k_kernel,
                            dict(qt_ptr="*i32", qz_ptr="*i32", s_ptr="*fp16", w_ptr=dt, N="i32",
                                 KW="i32", W8="i32", n0="i32", n1="i32", stride_wn="i32",
                                 sc_ptr=sc, stride_sc="i32"),
                            dict(GROUP=128, BLOCK_N=bn, BLOCK_KW=bkw, CODES=codes), warps,
                            ("qt_ptr", "qz_ptr", "s_ptr", "w_ptr", "N", "KW", "W8", "n0",
                             "stride_wn", "sc_ptr", "stride_sc"))
            report(f"dequant {dt[1:]} bn{bn} bkw{bkw} w{warps}", k, a.sass_dir)
        for brt, warps in ((8, 8), (8, 4), (4, 4), (2, 2)):  # the item layout's dequantize
            k = compile_one(ait._dequant_items_kernel,
                            dict(it_ptr="*i32", s_ptr="*fp16", z_ptr="*u8", w_ptr=dt, G="i32",
                                 tile0="i32", stride_wn="i32", sc_ptr=sc, stride_sc="i32"),
                            dict(ITEM=2128, SCALES=2048, ZEROS=2112, BLOCK_RT=brt, CODES=codes),
                            warps, ("it_ptr", "s_ptr", "z_ptr", "w_ptr", "stride_wn", "sc_ptr",
                                    "stride_sc"), stages=1)
            report(f"dequant items {dt[1:]} brt{brt} w{warps}", k, a.sass_dir)
    k = compile_one(aq._act_quant_kernel,  # the W4A8 activation quantizer
                    dict(x_ptr="*fp16", x8_ptr="*fp8e4nv", sa_ptr="*fp32", M="i32", K="i32",
                         stride_xm="i32"), dict(BLOCK_M=aq.BLOCK_M, BLOCK_K=128), 4,
                    ("x_ptr", "x8_ptr", "sa_ptr", "K", "stride_xm"))
    report("fp8 act quant", k, a.sass_dir)
    gemm_sig = dict(x_ptr="*fp16", qt_ptr="*i32", qz_ptr="*i32", s_ptr="*fp16", b_ptr="*fp16",
                    y_ptr="*fp16", M="i32", N="i32", KW="i32", W8="i32", stride_xm="i32",
                    stride_ym="i32")
    gemm_aligned = ("x_ptr", "qt_ptr", "qz_ptr", "s_ptr", "b_ptr", "y_ptr", "N", "KW", "W8",
                    "stride_xm", "stride_ym")
    tiles = sorted({(c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages)
                    for c in GEMM_TABLE.values()} | set(GEMM_CANDIDATES if a.all else ()))
    gemm = [(t, dt, 128, True) for t in tiles for dt in ("*fp16", "*bf16")]
    gemm += [(tiles[0], "*fp16", 32, False), (tiles[0], "*fp32", 64, False),
             ((16,) + tiles[0][1:], "*fp16", 128, True)]  # block_m cut for 5..16 tokens
    for (bm, bn, bk, warps, stages), dt, group, bias in gemm:
        bk = min(bk, group)
        packed = dt == "*fp16"  # as awq_gemm_k launches it on CUDA
        k = compile_one(agk._awq_gemm_k_kernel, dict(gemm_sig, x_ptr=dt, b_ptr=dt, y_ptr=dt),
                        dict(GROUP=group, BLOCK_M=bm, BLOCK_N=bn, BLOCK_KW=bk // 8,
                             HAS_BIAS=bias, IEEE=dt == "*fp32", PACKED=packed, ASM=True,
                             TILED=True, T=16), warps, gemm_aligned, stages)
        report(f"gemm {dt[1:]} g{group} bm{bm} bn{bn} bk{bk} w{warps} st{stages}"
               f"{' packed' if packed else ''}: loop {loop_length(k)}", k, a.sass_dir)
    return 0


# -- norm / RoPE ------------------------------------------------------------------------------
DT = {"fp16": "*fp16", "bf16": "*bf16", "fp32": "*fp32"}
# as launched on sm_90 (kernels/pdl.py: a decode-chain kernel waits, then triggers)
PDL = dict(PDL_WAIT=True, PDL_TRIGGER=True)


def usage(k) -> tuple[int, int, int, int]:
    """(registers, local bytes, LDG.128 count, STG.128 count) of a compiled kernel."""
    res, sass = disassemble(k)
    use = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    return (int(use.group(1)), int(use.group(4)), len(re.findall(r"LDG\.E\.128", sass)),
            len(re.findall(r"STG\.E\.128", sass)))


def aligned_args(sig: dict) -> tuple[str, ...]:
    """The norm/RoPE kernels' 16-divisible arguments: pointers and strides."""
    return tuple(n for n in sig if n.endswith("_ptr") or n.startswith("s"))


def cases(quick: bool = False):
    """(name, fn, signature, constexprs, num_warps) for each dtype and shape."""
    for dt in ("fp16",) if quick else ("fp16", "bf16", "fp32"):
        p = DT[dt]
        for h in (64, 128, 2048, 4096, 5120, 8192):  # q/k heads (qwen3) .. hidden sizes
            block, rows, warps = nt.norm_config(h)
            for res in (False, True):
                sig = {"x_ptr": p, "y_ptr": p, "w_ptr": p, "out_ptr": p, "sum_ptr": p,
                       "R": "i32", "B": "i32", "sxa": "i32", "sxb": "i32", "sya": "i32",
                       "syb": "i32", "eps": "fp32"}
                yield (f"rms_norm{'+res' if res else ''} {dt} H={h}", nt._rms_norm, sig,
                       dict(H=h, BLOCK_H=block, ROWS=rows, HAS_RES=res, **PDL), warps)
        for heads, d in ((40, 128), (48, 128), (6, 64), (20, 96)):
            bh, bd, warps = nt.rope_config(heads, d // 2)
            sig = {"x_ptr": p, "cos_ptr": p, "sin_ptr": p, "out_ptr": p, "NH": "i32",
                   "sxt": "i32", "sxh": "i32", "sct": "i32", "sst": "i32"}
            yield (f"rope {dt} heads={heads} D={d}", nt._rope, sig,
                   dict(HALF=d // 2, BLOCK_H=bh, BLOCK_D=bd, **PDL), warps)
        for hq, hkv, d in ((32, 8, 128), (28, 4, 128), (9, 3, 64)):  # Llama-3-8B, Qwen2, SmolLM2
            bh, bd, warps = nt.rope_config(hq + 2 * hkv, d // 2)
            sig = {"qkv_ptr": p, "cos_ptr": p, "sin_ptr": p, "q_ptr": p, "kc_ptr": p,
                   "vc_ptr": p, "slot_ptr": "*i64", "sxt": "i32", "sct": "i32", "sst": "i32",
                   "stride_cb": "i32", "stride_cs": "i32", "stride_ch": "i32"}
            yield (f"rope_store_kv {dt} {hq}/{hkv} D={d}", nt._rope_store_kv, sig,
                   dict(HQ=hq, HKV=hkv, HALF=d // 2, BLOCK_H=bh, BLOCK_D=bd, BS=16, **PDL),
                   warps)
        sig = {"gu_ptr": p, "INTER": "i32", "stride_t": "i32"}
        yield (f"silu_mul {dt}", nt._silu_mul, sig, dict(BLOCK=nt.SILU_BLOCK, **PDL), 4)


def norm_rope(a) -> int:
    """The norm/RoPE kernels (args: quick)."""
    bad = 0
    for name, fn, sig, consts, warps in cases(a.quick):
        try:
            regs, local, ldg, stg = usage(compile_one(fn, sig, consts, warps, aligned_args(sig)))
        except Exception as exc:  # noqa: BLE001 - report every failing configuration
            print(f"{name:<36} FAILED: {type(exc).__name__}: {exc}")
            bad += 1
            continue
        flag = "  SPILLS" if local else ""
        bad += bool(local)
        print(f"{name:<36} warps {warps:>2} regs {regs:>3} local {local} "
              f"LDG.128 {ldg} STG.128 {stg}{flag}")
    print("ok" if not bad else f"{bad} failing configuration(s)")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("awq", help="the K-major AWQ kernels, the item dequantize, the fused GEMM")
    p.add_argument("--sass-dir", type=Path, help="write each configuration's SASS here")
    p.add_argument("--all", action="store_true",
                   help="every GEMV candidate of gpu_awq.py --gemv-sweep (default: a few)")
    p.add_argument("--packed", action="store_true",
                   help="only the GEMV's packed fp16 path (GemvConfig.packed 1, 2: its PTX "
                        "inline assembly) at 1 and 2 tokens, with and without split-K, and "
                        "the fp32 path's tile for comparison; prints the loop's length")
    p.set_defaults(run=awq)
    p = sub.add_parser("norm-rope", help="the RMSNorm / RoPE / K/V store / SiLU-mul kernels "
                       "(exits 1 on a failure or a spill)")
    p.add_argument("--quick", action="store_true", help="fp16 only")
    p.set_defaults(run=norm_rope)
    a = ap.parse_args()
    return a.run(a)


if __name__ == "__main__":
    sys.exit(main())
