"""Compile the K-major AWQ kernels for sm_90 without a GPU (Triton's bundled ptxas) and print
registers, spills, shared memory and the SASS instruction mix of each configuration.

    python benchmarks/awq_sm90_compile.py [--sass-dir DIR]

Catches what the CPU interpreter accepts but the compiler refuses (e.g. constexpr rules of
Triton 3.6) and shows whether loads/stores are 16 bytes wide and whether layouts convert
through shared memory (LDS/STS/BAR in the GEMV loop mean a layout conversion).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from hisparse_cli.kernels import awq_triton as at  # noqa: E402

OPS = ("LDG", "STG", "LDS", "STS", "BAR", "SHFL", "FFMA", "FADD", "FMUL", "LOP3", "SHF", "I2F")


def compile_one(fn, sig: dict, consts: dict, warps: int, aligned: tuple[str, ...]):
    names = list(sig)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in consts}},
                    constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))


def report(name: str, k, sass_dir: Path | None) -> None:
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(k.asm["cubin"])
        res = subprocess.run([str(bindir / "cuobjdump"), "--dump-resource-usage", str(cubin)],
                             capture_output=True, text=True).stdout
        sass = subprocess.run([str(bindir / "nvdisasm"), str(cubin)], capture_output=True,
                              text=True).stdout
    use = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    ops = re.finditer(r"\b([A-Z][A-Z0-9]+)(?:\.[A-Z0-9.]+)?\s", sass)
    mix = collections.Counter(m.group(1) for m in ops if m.group(1) in OPS)
    wide = len(re.findall(r"LDG\.E\.128", sass)), len(re.findall(r"STG\.E\.128", sass))
    print(f"{name:<44} regs {use.group(1):>3} stack {use.group(2)} local {use.group(4)}  "
          f"LDG.128 {wide[0]} STG.128 {wide[1]}  "
          + " ".join(f"{o}={mix[o]}" for o in OPS if mix[o]))
    if sass_dir:
        sass_dir.mkdir(parents=True, exist_ok=True)
        (sass_dir / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.sass").write_text(sass)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sass-dir", type=Path)
    a = ap.parse_args()
    gemv_sig = dict(x_ptr="*fp16", qt_ptr="*i32", qz_ptr="*i32", s_ptr="*fp16", b_ptr="*fp16",
                    y_ptr="*fp16", N="i32", KW="i32", W8="i32", stride_xm="i32",
                    stride_ym="i32", stride_ys="i32", KW_PER_SPLIT="i32")
    aligned = ("x_ptr", "qt_ptr", "qz_ptr", "s_ptr", "b_ptr", "y_ptr", "N", "KW", "W8",
               "stride_xm", "stride_ym", "KW_PER_SPLIT")
    for bn, bkw, warps in ((64, 16, 2), (128, 16, 4), (32, 16, 1), (64, 8, 1), (256, 16, 8)):
        for sf in (2, 1, 0):
            for pf in (False, True):
                for partial in (False, True):
                    if partial and (pf or sf != 2):
                        continue
                    sig = dict(gemv_sig, y_ptr="*fp32") if partial else gemv_sig
                    k = compile_one(at._awq_gemv_k_kernel, sig,
                                    dict(GROUP=128, BLOCK_N=bn, BLOCK_KW=bkw, HAS_BIAS=not partial,
                                         PARTIAL=partial, PREFETCH=pf, NIBBLES=sf),
                                    warps, aligned)
                    report(f"gemv bn{bn} bkw{bkw} w{warps} nib{sf} pf{int(pf)} p{int(partial)}",
                           k, a.sass_dir)
    k = compile_one(at._splitk_reduce_kernel,
                    dict(p_ptr="*fp32", b_ptr="*fp16", y_ptr="*fp16", total="i32", N="i32",
                         stride_ps="i32"), dict(SPLIT=4, HAS_BIAS=True, BLOCK=1024), 4,
                    ("p_ptr", "b_ptr", "y_ptr", "N", "stride_ps"))
    report("splitk_reduce 4", k, a.sass_dir)
    for dt in ("*fp16", "*bf16"):
        for bn, bkw, warps in ((16, 16, 1), (64, 16, 4), (128, 16, 8), (64, 8, 4), (64, 4, 4)):
            k = compile_one(at._awq_dequant_k_kernel,
                            dict(qt_ptr="*i32", qz_ptr="*i32", s_ptr="*fp16", w_ptr=dt, N="i32",
                                 KW="i32", W8="i32", n0="i32", n1="i32", stride_wn="i32"),
                            dict(GROUP=128, BLOCK_N=bn, BLOCK_KW=bkw), warps,
                            ("qt_ptr", "qz_ptr", "s_ptr", "w_ptr", "N", "KW", "W8", "n0",
                             "stride_wn"))
            report(f"dequant {dt[1:]} bn{bn} bkw{bkw} w{warps}", k, a.sass_dir)


if __name__ == "__main__":
    main()
