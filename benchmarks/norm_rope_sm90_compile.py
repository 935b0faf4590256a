"""Compile the RMSNorm / residual-add + RMSNorm / RoPE (+ K/V store) kernels for sm_90 without a GPU
(Triton's bundled ptxas) at the configurations the launchers pick for Llama-family shapes,
and print registers, spills and 16-byte loads/stores of each.

    python benchmarks/norm_rope_sm90_compile.py [--quick]

Pointers and strides carry the 16-divisibility Triton's launcher specializes on at run time
(the model's row strides are multiples of 16). --quick: fp16 only.

Catches what the CPU interpreter accepts but the compiler refuses. Exits non-zero on a
failure or a kernel that spills (tests/test_norm_rope_kernels.py runs it).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.6's default

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from hisparse_cli.kernels.norm_rope import norm_rope_triton as nt  # noqa: E402

DT = {"fp16": "*fp16", "bf16": "*bf16", "fp32": "*fp32"}
# as launched on sm_90 (kernels/pdl.py: a decode-chain kernel waits, then triggers)
PDL = dict(PDL_WAIT=True, PDL_TRIGGER=True)


def compile_one(fn, sig: dict, consts: dict, warps: int):
    names = list(sig)
    aligned = [n for n in names if n.endswith("_ptr") or n.startswith("s")]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in consts}},
                    constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))


def usage(k) -> tuple[int, int, int, int]:
    """(registers, local bytes, LDG.128 count, STG.128 count) of a compiled kernel."""
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(k.asm["cubin"])
        res = subprocess.run([str(bindir / "cuobjdump"), "--dump-resource-usage", str(cubin)],
                             capture_output=True, text=True).stdout
        sass = subprocess.run([str(bindir / "nvdisasm"), str(cubin)], capture_output=True,
                              text=True).stdout
    use = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    return (int(use.group(1)), int(use.group(4)), len(re.findall(r"LDG\.E\.128", sass)),
            len(re.findall(r"STG\.E\.128", sass)))


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


def main() -> int:
    bad = 0
    for name, fn, sig, consts, warps in cases("--quick" in sys.argv[1:]):
        try:
            regs, local, ldg, stg = usage(compile_one(fn, sig, consts, warps))
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


if __name__ == "__main__":
    sys.exit(main())
