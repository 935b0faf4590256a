"""Can a weight stream run through the decode step's data dependencies? The 8B decoder's 128
INT4 GEMVs of one token, each fed by the one before, in ONE persistent CUDA launch whose
producer warp streams weights into a shared-memory ring across the grid barriers
(benchmarks/cuda/gemv_chain_ring.cu says how), against the engine's Triton GEMV chain and the
fp16 cuBLAS chain timed by gpu_gemv_chain.py in the same call.

    PYTHONPATH=$PWD python3 benchmarks/gpu_cuda_chain.py [--out DIR] [--reps 20]

Builds the .cu with the machine's nvcc (sm_90), loads it with ctypes, fills random INT4 items
(the same 3.63 GB as the engine's decoder: q|k|v 4096->6144, o 4096->4096, gate|up
4096->28672, down 14336->4096, group 128, x 32 layers), checks every GEMV of one chained run
against an fp32 dequantized matmul of the x the kernel itself used (its input rebuilt from the
previous GEMV's output), then times rows of (consumer warps, ring slots, barrier on/off):
barrier off is the same kernel with the waits skipped (x read before it is complete; a timing
floor only). Per-token milliseconds include zeroing the outputs and the barrier counter (timed
alone too). `--timeline` adds, per variant, one chained run with the kernel's timeline: where
each GEMV's time goes (barrier wait, x, items, ring waits, flush), per GEMV kind.
Writes DIR/gpu_cuda_chain.json (DIR: --out, else $OUT, else ./out).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SRC = HERE / "cuda" / "gemv_chain_ring.cu"
GROUP, LAYERS, ITEM_BYTES, ITEM_WORDS = 128, 32, 8512, 8512 // 4
SHAPES = [("qkv", 4096, 6144, 0), ("o", 4096, 4096, 0), ("gate|up", 4096, 28672, 0),
          ("down", 14336, 4096, 1)]  # name, K, N, xform that makes this GEMV's x
AWQ_BYTES_PER_ITEM = 128 * 128 // 2 + 128 * 2 + 128 // 2  # words + scales + zeros = 8512


def compile_so(src: Path, workdir: Path) -> ctypes.CDLL:
    """Build a .cu into a shared library with the machine's nvcc (sm_90), print ptxas's
    register and spill lines, load it."""
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    lib = workdir / f"lib{src.stem}.so"
    cmd = [nvcc, "-O3", "-gencode", "arch=compute_90,code=sm_90", "-Xptxas", "-v", "-shared",
           "-Xcompiler", "-fPIC", "-o", str(lib), str(src)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    regs = [ln.strip() for ln in p.stderr.splitlines() if "registers" in ln or "spill" in ln]
    print("nvcc:", " ".join(cmd[1:7]), "\n  " + "\n  ".join(regs), flush=True)
    if p.returncode:
        sys.exit(f"nvcc failed:\n{p.stderr}")
    return ctypes.CDLL(str(lib))


def build(workdir: Path) -> ctypes.CDLL:
    so = compile_so(SRC, workdir)
    so.chain_launch.restype = ctypes.c_int
    so.chain_launch.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 8 + [ctypes.c_void_p] * 2
    so.chain_smem_bytes.restype = ctypes.c_longlong
    so.chain_smem_bytes.argtypes = [ctypes.c_int]
    so.chain_error_string.restype = ctypes.c_char_p
    so.chain_error_string.argtypes = [ctypes.c_int]
    return so


def make_chain(dev):
    """Random items for the 128 GEMVs, their metadata [128, 8] and the output offsets."""
    gemvs, item_base, out_off = [], 0, 0
    for _ in range(LAYERS):
        for name, k, n, xform in SHAPES:
            t, g = n // 128, k // GROUP
            gemvs.append(dict(name=name, K=k, N=n, G=g, T=t, base=item_base, out=out_off,
                              xform=xform))
            item_base += t * g
            out_off += n
    items = torch.empty(item_base, ITEM_WORDS, dtype=torch.int32, device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    for m in gemvs:
        it = items[m["base"]:m["base"] + m["T"] * m["G"]]
        it.random_(-2 ** 31, 2 ** 31 - 1, generator=gen)  # any bits are valid nibbles
        # scales: output variance ~ input variance (E[(q - z)^2] = 42.5 for uniform nibbles)
        # (E[U^2] = 13/12 for U uniform in [0.5, 1.5])
        s = (torch.rand(it.shape[0], 128, device=dev, generator=gen) + 0.5) / (
            m["K"] * 42.5 * 13 / 12) ** 0.5
        it[:, 2048:2112] = s.half().view(torch.int32)
    meta = []
    for i, m in enumerate(gemvs):
        meta.append([m["K"], m["N"], m["G"], m["T"], m["base"], m["out"], m["xform"],
                     -1 if i == 0 else gemvs[i - 1]["out"]])
    return items, torch.tensor(meta, dtype=torch.int64, device=dev), gemvs, out_off


def dequant(items_g: torch.Tensor, t: int, g: int, mma: int = 0) -> torch.Tensor:
    """fp32 W [K, N] of one GEMV's items (layouts in gemv_chain_ring.cu: mma 0 the lanes
    layout, 1 and 2 the mma.sync fragment layout)."""
    it = items_g.view(t, g, ITEM_WORDS)
    if mma:
        return _dequant_mma(it, t, g)
    w = it[..., :2048].reshape(t, g, 16, 32, 4).transpose(3, 4).reshape(t, g, 64, 1, 32, 1)
    sh = torch.arange(4, device=w.device, dtype=torch.int32).view(1, 1, 1, 1, 1, 4) * 4
    q = torch.cat([(w >> sh) & 15, (w >> (sh + 16)) & 15], dim=3)  # [t, g, 64, 2, 32, 4]
    q = q.permute(1, 2, 3, 0, 4, 5).reshape(g * 128, t * 128).float()
    s = it[..., 2048:2112].contiguous().view(torch.float16).view(t, g, 32, 4).float()
    zw = it[..., 2112:2128].contiguous().view(torch.int16).view(t, g, 32, 1).int() & 0xFFFF
    z = (zw >> sh.view(1, 1, 1, 4)) & 15
    s = s.permute(1, 0, 2, 3).reshape(g, t * 128).repeat_interleave(128, 0)
    z = z.permute(1, 0, 2, 3).reshape(g, t * 128).float().repeat_interleave(128, 0)
    return (q - z) * s


def _dequant_mma(it: torch.Tensor, t: int, g: int) -> torch.Tensor:
    # words [T, G, rt 8, kt/4 2, lane (gg 8, tt 4), kt%4 4]; nibble pair p = 2 pk + pr at bits
    # 4 p (K even) and 16 + 4 p (K odd): row 16 rt + 8 pr + gg, K 64 kt4 + 16 c + 8 pk + 2 tt + h
    w = it[..., :2048].reshape(t, g, 8, 2, 8, 4, 4)[..., None, None, None]
    dev = w.device
    pk = torch.arange(2, device=dev, dtype=torch.int32).view(2, 1, 1)
    pr = torch.arange(2, device=dev, dtype=torch.int32).view(1, 2, 1)
    h = torch.arange(2, device=dev, dtype=torch.int32).view(1, 1, 2)
    q = (w >> (4 * (2 * pk + pr) + 16 * h)) & 15  # [T, G, rt, kt4, gg, tt, c, pk, pr, h]
    q = q.permute(1, 3, 6, 7, 5, 9, 0, 2, 8, 4).reshape(g * 128, t * 128).float()
    s = it[..., 2048:2112].contiguous().view(torch.float16).view(t, g, 8, 8, 2).float()
    zb = it[..., 2112:2128].contiguous().view(torch.uint8).view(t, g, 8, 8, 1).int()
    z = (zb >> (4 * torch.arange(2, device=dev, dtype=torch.int32))) & 15  # [T, G, gg, rt, pr]
    s = s.permute(1, 0, 3, 4, 2).reshape(g, t * 128).repeat_interleave(128, 0)
    z = z.permute(1, 0, 3, 4, 2).reshape(g, t * 128).float().repeat_interleave(128, 0)
    return (q - z) * s


def x_of(prev: torch.Tensor, k: int, xform: int, x0: torch.Tensor) -> torch.Tensor:
    """x of a GEMV from the previous output, as the kernel makes it (gemv_chain_ring.cu)."""
    f = prev[:k] * torch.sigmoid(prev[:k]) * prev[k:2 * k] if xform == 1 else prev[:k]
    return (x0.repeat(k // 4096 + 1)[:k] + 0.5 * f).half()


def check(so, items, meta, gemvs, n_out, x0, ctas, v, stages, stream, flags=1) -> dict:
    """v: (mma, split, nw, acc); flags: the barrier (1) and any of 16, 32."""
    outs = torch.zeros(n_out, dtype=torch.float32, device=x0.device)
    counter = torch.zeros(1, dtype=torch.int32, device=x0.device)
    launch(so, items, meta, x0, outs, counter, len(gemvs), ctas, v, stages, flags, stream)
    torch.cuda.synchronize()
    worst: dict[str, float] = {}
    peak, notes = 0.0, []
    for i, m in enumerate(gemvs):
        x = x0.half() if i == 0 else x_of(outs[gemvs[i - 1]["out"]:][:gemvs[i - 1]["N"]],
                                           m["K"], m["xform"], x0)
        w = dequant(items[m["base"]:m["base"] + m["T"] * m["G"]], m["T"], m["G"], v[0])
        ref = x.float() @ w
        got = outs[m["out"]:m["out"] + m["N"]]
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        if not err == err or err == float("inf") or err > 1e-2 or i in (0, 127):
            if len(notes) < 12:
                notes.append(f"gemv {i} {m['name']}: |x| {x.float().abs().max().item():.3g} "
                             f"|ref| {ref.abs().max().item():.3g} |got| "
                             f"{got.abs().max().item():.3g} err {err:.3g} w finite "
                             f"{bool(torch.isfinite(w).all())} |w| {w.abs().max().item():.3g}")
        err = err if err == err else float("inf")  # NaN: no finite result to compare
        worst[m["name"]] = max(worst.get(m["name"], 0.0), err)
        peak = max(peak, got.abs().max().item())
        del w
    finite = bool(torch.isfinite(outs).all())
    return {"notes": notes, "max_rel_err": worst, "finite": finite, "max_abs_out": peak,
            "counter": int(counter.item()),
            "expected_counter": len(gemvs) * ctas}


def launch(so, items, meta, x0, outs, counter, n_gemv, ctas, v, stages, wait, stream,
           stamps=None):
    mma, split, nw, acc = v
    e = so.chain_launch(items.data_ptr(), meta.data_ptr(), x0.data_ptr(), outs.data_ptr(),
                        counter.data_ptr(), n_gemv, ctas, mma, split, nw, acc, stages, wait,
                        None if stamps is None else stamps.data_ptr(), stream)
    if e:
        what = {-1: "no such variant", -2: "stages not a multiple of the groups",
                -3: "timeline without stamps"}.get(
            e, f"{'launch' if e >= 2000 else 'smem attribute'}: "
               f"{so.chain_error_string(e).decode()}")
        raise RuntimeError(f"mma {mma} split {split} nw {nw} acc {acc} stages {stages}: "
                           f"{what} ({e})")


def time_row(so, items, meta, gemvs, n_out, x0, ctas, v, stages, wait, stream, reps) -> float:
    outs = torch.zeros(n_out, dtype=torch.float32, device=x0.device)
    counter = torch.zeros(1, dtype=torch.int32, device=x0.device)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    for _ in range(3):
        outs.zero_(), counter.zero_()
        launch(so, items, meta, x0, outs, counter, len(gemvs), ctas, v, stages, wait, stream)
    torch.cuda.synchronize()
    ev[0].record()
    for _ in range(reps):
        outs.zero_(), counter.zero_()
        launch(so, items, meta, x0, outs, counter, len(gemvs), ctas, v, stages, wait, stream)
    ev[1].record()
    torch.cuda.synchronize()
    return ev[0].elapsed_time(ev[1]) / reps


STAMP_NAMES = ("wait", "x", "items", "ring", "flush")


def timeline(so, items, meta, gemvs, n_out, x0, ctas, v, stages, flags, stream) -> dict:
    """One chained run with the kernel's timeline on (flags | 8): per GEMV kind, the mean over
    layers of the critical path (last CTA's arrival to last CTA's arrival, globaltimer) and of
    each CTA's phases (clock64, converted per CTA): barrier wait, x ready, items (mean and
    slowest CTA), warp 0's wait for ring slots inside the items, flush + arrival."""
    dev = x0.device
    outs = torch.zeros(n_out, dtype=torch.float32, device=dev)
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    st = torch.zeros(len(gemvs), ctas, 8, dtype=torch.int64, device=dev)
    launch(so, items, meta, x0, outs, counter, len(gemvs), ctas, v, stages, flags | 8, stream,
           stamps=st)
    torch.cuda.synchronize()
    st = st.cpu().double()
    ghz = (st[-1, :, 4] - st[0, :, 1]) / (st[-1, :, 7] - st[0, :, 6])  # cycles a ns, per CTA
    us = lambda cyc: cyc / ghz / 1e3  # noqa: E731 [g, c] cycles -> us
    phases = {"wait": us(st[:, :, 1] - st[:, :, 0]), "x": us(st[:, :, 2] - st[:, :, 1]),
              "items": us(st[:, :, 3] - st[:, :, 2]), "ring": us(st[:, :, 5]),
              "flush": us(st[:, :, 4] - st[:, :, 3])}
    last = st[:, :, 7].max(dim=1).values
    crit = torch.empty(len(gemvs), dtype=torch.float64)
    crit[0] = (last[0] - st[0, :, 6].min()) / 1e3
    crit[1:] = (last[1:] - last[:-1]) / 1e3
    out = {"ghz_mean": ghz.mean().item(), "total_us": ((last[-1] - st[0, :, 6].min()) / 1e3).item(),
           "kinds": {}}
    for kind in dict.fromkeys(m["name"] for m in gemvs):
        idx = torch.tensor([i for i, m in enumerate(gemvs) if m["name"] == kind])
        row = {"crit": crit[idx].mean().item()}
        for k, t in phases.items():
            row[k] = t[idx].mean().item()
        row["items_max"] = phases["items"][idx].max(dim=1).values.mean().item()
        out["kinds"][kind] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--only", type=int, nargs=4, metavar=("MMA", "SPLIT", "NW", "ACC"),
                    help="this variant alone")
    ap.add_argument("--variants", type=str, default=None,
                    help="variants to run, 'mma,split,nw,acc;...' (default: the built-in list)")
    ap.add_argument("--timeline", type=int, nargs="*", default=None, metavar="FLAGS",
                    help="per variant, one chained run with the kernel's timeline (flag 8) "
                         "for each of these flag sets (default 1)")
    ap.add_argument("--check-flags", type=int, nargs="+", default=[1],
                    help="flag sets each variant is checked with (1, 17, 33, 49)")
    ap.add_argument("--no-check", action="store_true",
                    help="with --only: no check (for ncu: the first chain launch is then the "
                         "first --flags row's warm-up)")
    ap.add_argument("--flags", type=int, nargs="+", default=[1, 0, 3],
                    help="rows to time: 1 barrier on, 0 barrier off, 3 on without the weight "
                         "stream, 2 neither (compute, x loads and sums alone), 7 barriers, x "
                         "loads and sums without weights or item math, 6 the same without "
                         "barriers")
    a = ap.parse_args()
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    ctas = props.multi_processor_count
    smem_max = getattr(props, "shared_memory_per_block_optin", 232448)
    so = build(Path(tempfile.mkdtemp()))
    items, meta, gemvs, n_out = make_chain(dev)
    x0 = torch.randn(4096, dtype=torch.float32, device=dev)
    stream = torch.cuda.current_stream().cuda_stream
    total_bytes = items.numel() * 4
    print(f"{len(gemvs)} GEMVs, {items.shape[0]} items, {total_bytes / 1e9:.3f} GB, "
          f"{ctas} CTAs, smem opt-in {smem_max} B", flush=True)

    smax = 2
    while so.chain_smem_bytes(smax + 1) <= smem_max:
        smax += 1
    for m in gemvs:  # the kernel's shared sums hold RED_TILES (8) column tiles a CTA
        n_items = m["T"] * m["G"]
        span = max((n_items * (c + 1) // ctas - 1) // m["G"] - n_items * c // ctas // m["G"] + 1
                   for c in range(ctas))
        assert span <= 8, (m["name"], span)

    result = {"gpu": torch.cuda.get_device_name(), "ctas": ctas, "bytes": total_bytes,
              "max_stages": smax, "rows": [], "checks": []}
    # (mma, split, nw): mma 0 fp16x2 lane sums, 1 mma.sync with the 1024 offset removed
    # through x sums, 2 mma.sync on (v - 1024); split warps an item; nw consumer warps
    variants = [(1, 4, 16, 1), (1, 4, 16, 2), (1, 8, 16, 1), (1, 8, 16, 2), (1, 8, 16, 4),
                (1, 4, 12, 1), (1, 4, 12, 2), (1, 4, 12, 4), (1, 8, 8, 2), (1, 8, 8, 4),
                (0, 2, 16, 1)]
    if a.variants:
        variants = [tuple(int(x) for x in t.split(",")) for t in a.variants.split(";")]
    if a.only:
        variants = [tuple(a.only)]
    ok = []
    for v in variants:
        groups = v[2] // v[1]
        st = smax // groups * groups  # a multiple of the groups (the .cu says why)
        name = f"mma{v[0]} split{v[1]} nw{v[2]:>2} acc{v[3]} stages{st:>3}"
        if a.only and a.no_check:
            ok.append((v, st, name))
            continue
        passed = True
        for cf in a.check_flags:
            try:
                c = check(so, items, meta, gemvs, n_out, x0, ctas, v, st, stream, cf)
            except RuntimeError as e:
                print("check", e, flush=True)
                result["checks"].append({"variant": v, "flags": cf, "error": str(e)})
                torch.cuda.synchronize()
                passed = False
                break
            c.update(variant=v, stages=st, flags=cf)
            result["checks"].append(c)
            errs = " ".join(f"{k} {e:.1e}" for k, e in c["max_rel_err"].items())
            bad = max(c["max_rel_err"].values()) > 1e-2 or not c["finite"] or \
                c["counter"] != c["expected_counter"]
            print(f"check {name} flags {cf:>2}: {errs}  finite {c['finite']}  max|y| "
                  f"{c['max_abs_out']:.3g}  counter {c['counter']}/{c['expected_counter']}"
                  f"{'  FAILED' if bad else ''}", flush=True)
            if c["notes"] and bad:
                print("  " + "\n  ".join(c["notes"]), flush=True)
            passed = passed and not bad
        if passed:
            ok.append((v, st, name))

    zero = torch.zeros(n_out, dtype=torch.float32, device=dev)
    cnt = torch.zeros(1, dtype=torch.int32, device=dev)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(a.reps):
        zero.zero_(), cnt.zero_()
    ev[1].record()
    torch.cuda.synchronize()
    zero_ms = ev[0].elapsed_time(ev[1]) / a.reps
    result["zeroing_ms"] = zero_ms
    print(f"zeroing outputs + counter alone: {zero_ms * 1e3:.1f} us", flush=True)
    for v, st, name in ok:
        for wait in a.flags:
            ms = time_row(so, items, meta, gemvs, n_out, x0, ctas, v, st, wait, stream, a.reps)
            tbs = total_bytes / (ms * 1e-3) / 1e12
            result["rows"].append(dict(variant=v, stages=st, flags=wait, ms=ms, tb_s=tbs))
            what = {1: "barrier on ", 0: "barrier off", 3: "no weights ", 2: "no w, no b ",
                    7: "sync only  ", 6: "x+sums only"}.get(wait & 7, "?") + \
                (" +release" if wait & 16 else "") + (" +fused-xsum" if wait & 32 else "")
            print(f"{name} flags {wait:>2} {what:<32} {ms:7.3f} ms  {tbs:5.2f} TB/s",
                  flush=True)
        for tf in [] if a.timeline is None else (a.timeline or [1]):
            tl = timeline(so, items, meta, gemvs, n_out, x0, ctas, v, st, tf, stream)
            tl.update(variant=v, stages=st, flags=tf)
            result.setdefault("timelines", []).append(tl)
            print(f"timeline {name} flags {tf}: {tl['total_us']:.0f} us, "
                  f"{tl['ghz_mean']:.2f} GHz; us a GEMV (mean over layers; CTA phases mean "
                  f"over CTAs)", flush=True)
            print(f"  {'kind':<8} {'crit':>6} {'wait':>6} {'x':>6} {'items':>6} {'max':>6} "
                  f"{'ring':>6} {'flush':>6}", flush=True)
            for kind, r in tl["kinds"].items():
                print(f"  {kind:<8} {r['crit']:6.2f} {r['wait']:6.2f} {r['x']:6.2f} "
                      f"{r['items']:6.2f} {r['items_max']:6.2f} {r['ring']:6.2f} "
                      f"{r['flush']:6.2f}", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_cuda_chain.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
