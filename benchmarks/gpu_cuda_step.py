"""Would a whole-step persistent kernel reach INT4 decode >= 2.5x fp16? The skeleton of one
decode step of the 8B model (32 x [q|k|v GEMV, sparse attention over paged KV, o, gate|up,
down] + the INT4 lm_head) in ONE CUDA launch, a producer warp streaming weights and KV pages
into a shared-memory ring across the grid barriers (benchmarks/cuda/step_ring.cu says what
it does and what it leaves out).

    PYTHONPATH=$PWD python3 benchmarks/gpu_cuda_step.py [--out DIR] [--reps 20] [--keys 4608]

Builds the .cu with the machine's nvcc (sm_90), fills random INT4 items (3.63 GB decoder +
0.27 GB head, the layout of gemv_chain_ring.cu's MMA 1) and a head-major fp16 KV cache whose
pages are scattered through a block table (--keys keys a KV head and layer: 4608 = the
h200-141g profile's 4096 window + 512 globals), checks every phase of one step against a
torch reference fed with the kernel's own previous output (GEMVs: an fp32 matmul of the
dequantized weights; attention: softmax(q K^T / sqrt(128)) V over the gathered pages and
the current token), then times the step (barriers on, and off as a floor) and takes one
timeline: per phase kind, the critical path and where each CTA's time goes. Writes
DIR/gpu_cuda_step.json (DIR: --out, else $OUT, else ./out).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gpu_cuda_chain import ITEM_WORDS, compile_so, x_of  # noqa: E402
from gpu_cuda_chain import _dequant_mma as dequant  # noqa: E402

SRC = HERE / "cuda" / "step_ring.cu"
LAYERS, HKV, HQ, HD, PAGE, SPLITS, NW = 32, 8, 32, 128, 16, 16, 16
ATT_STRIDE = 4 * (HD + 2)
GEMVS = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate|up", 4096, 28672), ("down", 14336, 4096)]
VOCAB = 128256


def build(workdir: Path) -> ctypes.CDLL:
    so = compile_so(SRC, workdir)
    so.step_launch.restype = ctypes.c_int
    so.step_launch.argtypes = ([ctypes.c_void_p] * 5 + [ctypes.c_longlong] +
                               [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4 + [ctypes.c_void_p] * 3)
    so.step_smem_bytes.restype = ctypes.c_longlong
    so.step_smem_bytes.argtypes = [ctypes.c_int]
    so.step_error_string.restype = ctypes.c_char_p
    so.step_error_string.argtypes = [ctypes.c_int]
    return so


def make_step(dev, keys: int):
    """Phases (dicts) and their metadata [n, 10], the items, the KV cache and block table."""
    assert keys % (PAGE * SPLITS) == 0, "keys: a multiple of 16 pages x 16 splits"
    npg = keys // PAGE // SPLITS
    phases, item_base, out_off, prev = [], 0, 0, -1

    def gemv(name, k, n, xform, src):
        nonlocal item_base, out_off
        t, g = n // 128, k // 128
        ph = dict(kind=name, type=0, K=k, N=n, G=g, T=t, base=item_base, out=out_off,
                  xform=xform, src=src)
        item_base += t * g
        out_off += n
        phases.append(ph)
        return ph

    for layer in range(LAYERS):
        qkv = gemv("qkv", 4096, 6144, 3, prev)
        att = dict(kind="attn", type=1, layer=layer, part=layer * HKV * SPLITS * ATT_STRIDE,
                   qkv=qkv["out"], npg=npg)
        phases.append(att)
        o = gemv("o", 4096, 4096, 2, att["part"])
        o["att_layer"] = layer
        gu = gemv("gate|up", 4096, 28672, 3, o["out"])
        prev = gemv("down", 14336, 4096, 1, gu["out"])["out"]
    head = gemv("head", 4096, VOCAB, 3, prev)
    phases.append(dict(kind="argmax", type=2, logits=head["out"]))
    capacity = 2 * keys // PAGE  # the pages a sequence uses are scattered over twice as many
    gen = torch.Generator(device=dev).manual_seed(0)
    table = torch.randperm(capacity, device=dev, generator=gen)[:keys // PAGE].int()
    unused = sorted(set(range(capacity)) - set(table.tolist()))
    cur_blk = unused[0]  # the current token's block (row 5), outside the table's pages
    meta = []
    for ph in phases:
        if ph["type"] == 0:  # [9] of o: its attention's layer | pages a unit << 16 (the mass)
            meta.append([0, ph["K"], ph["N"], ph["G"], ph["T"], ph["base"], ph["out"],
                         ph["xform"], ph["src"], ph.get("att_layer", 0) | npg << 16])
        elif ph["type"] == 1:
            ph["cur_blk"] = cur_blk
            meta.append([1, HKV, SPLITS, npg, ph["layer"], ph["part"], ph["qkv"], HQ, 0,
                         cur_blk])
        else:
            meta.append([2, VOCAB, ph["logits"], 0, 0, 0, 0, 0, 0, 0])
    items = torch.empty(item_base, ITEM_WORDS, dtype=torch.int32, device=dev)
    for ph in phases:
        if ph["type"]:
            continue
        it = items[ph["base"]:ph["base"] + ph["T"] * ph["G"]]
        it.random_(-2 ** 31, 2 ** 31 - 1, generator=gen)
        s = (torch.rand(it.shape[0], 128, device=dev, generator=gen) + 0.5) / (
            ph["K"] * 42.5 * 13 / 12) ** 0.5
        it[:, 2048:2112] = s.half().view(torch.int32)
    kc = torch.randn(LAYERS, capacity, HKV, PAGE, HD, device=dev, generator=gen).half()
    vc = torch.randn(LAYERS, capacity, HKV, PAGE, HD, device=dev, generator=gen).half()
    MASS.clear()
    MASS.append(torch.zeros(LAYERS, capacity, HKV, PAGE, dtype=torch.float32, device=dev))
    assert npg <= 32 and HKV == 8, "the kernel's MASS_PAGES and HKV_N"
    return (phases, torch.tensor(meta, dtype=torch.int64, device=dev), items, kc, vc, table,
            out_off, swizzle_v(vc))


def swizzle_v(vc: torch.Tensor) -> torch.Tensor:
    """The V cache as the mma attention (flag 32) reads it: in each page row r (a key) the
    16-byte chunk j (dims 8 j .. 8 j + 7) is stored at position j ^ (r & 7)."""
    r = torch.arange(PAGE, device=vc.device).view(PAGE, 1)
    src = torch.arange(HD // 8, device=vc.device).view(1, HD // 8) ^ (r & 7)  # [row, position]
    v = vc.view(*vc.shape[:-1], HD // 8, 8)
    idx = src.view(1, 1, 1, PAGE, HD // 8, 1).expand(*v.shape)
    return torch.gather(v, -2, idx).view(vc.shape)


def attention_out(part_l: torch.Tensor) -> torch.Tensor:
    """[HQ * HD] attention output from one layer's unit partials [HKV * S * ATT_STRIDE]."""
    p = part_l.view(HKV, SPLITS, ATT_STRIDE)
    acc = p[..., :4 * HD].reshape(HKV, SPLITS, 4, HD)
    m, l = p[..., 4 * HD:4 * HD + 4], p[..., 4 * HD + 4:]
    w = torch.exp(m - m.max(dim=1, keepdim=True).values)  # [HKV, S, 4]
    out = (w[..., None] * acc).sum(1) / (w * l).sum(1)[..., None]  # [HKV, 4, HD]
    return out.reshape(HQ * HD)


def rope(x: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over the last dim (128) with cs = [cos 64, sin 64]."""
    c, s = cs[:64], cs[64:]
    a, b = x[..., :64], x[..., 64:]
    return torch.cat([a * c - b * s, b * c + a * s], -1)


def rope_table(pos: int, base: float = 500000.0) -> torch.Tensor:
    inv = base ** (-torch.arange(0, HD, 2, dtype=torch.float64) / HD)
    ang = pos * inv
    return torch.cat([torch.cos(ang), torch.sin(ang)]).float()


def attention_ref(qkv: torch.Tensor, kc_l, vc_l, table, cs):
    """Keys and values of the pages in table, plus the current token (RoPE on q and its k):
    the output [HQ * HD] and each page key's probability summed over its 4 query heads."""
    q = rope(qkv[:HQ * HD].view(HKV, 4, HD), cs) / math.sqrt(HD)
    kcur = rope(qkv[HQ * HD:HQ * HD + HKV * HD].view(HKV, 1, HD), cs).half().float()
    vcur = qkv[HQ * HD + HKV * HD:].view(HKV, 1, HD).half().float()
    k = kc_l[table.long()].permute(1, 0, 2, 3).reshape(HKV, -1, HD).float()  # [HKV, keys, HD]
    v = vc_l[table.long()].permute(1, 0, 2, 3).reshape(HKV, -1, HD).float()
    k, v = torch.cat([k, kcur], 1), torch.cat([v, vcur], 1)
    p = torch.softmax(q @ k.transpose(1, 2), dim=-1)  # [HKV, 4, keys + 1]
    return (p @ v).reshape(HQ * HD), p[:, :, :-1].sum(1)  # output; the pages' keys' mass


MASS: list[torch.Tensor] = []  # [L, capacity, HKV, PAGE] fp32: the importance mass (flag 64)


def launch(so, st, outs, part, counter, ctas, stages, flags, stream, stamps=None):
    phases, meta, items, kc, vc, table, _, vc_swizzled = st
    if flags & 32:
        vc = vc_swizzled
    e = so.step_launch(items.data_ptr(), meta.data_ptr(), kc.data_ptr(), vc.data_ptr(),
                       table.data_ptr(), kc.shape[1], X0[0].data_ptr(), outs.data_ptr(),
                       part.data_ptr(), counter.data_ptr(), len(phases), ctas, stages, flags,
                       None if stamps is None else stamps.data_ptr(),
                       MASS[0].data_ptr() if flags & 64 else None, stream)
    if e:
        raise RuntimeError(f"launch failed: {e} "
                           f"{so.step_error_string(e).decode() if e > 0 else 'stages'}")


X0: list[torch.Tensor] = []


def check(so, st, ctas, stages, stream, flags=1) -> dict:
    phases, meta, items, kc, vc, table, n_out, _ = st
    dev = items.device
    x0 = X0[0]
    outs = torch.zeros(n_out, dtype=torch.float32, device=dev)
    part = torch.zeros(LAYERS * HKV * SPLITS * ATT_STRIDE, dtype=torch.float32, device=dev)
    counter = torch.zeros(4, dtype=torch.int32, device=dev)
    vcache = st[7] if flags & 32 else vc
    # row 5 of every block: the kernel stores the current token there (checked below); the
    # V copy it does not read must agree with the one it does (the reference reads vc)
    kc[:, :, :, 5].zero_(), vc[:, :, :, 5].zero_(), st[7][:, :, :, 5].zero_()
    MASS[0].zero_()
    launch(so, st, outs, part, counter, ctas, stages, flags, stream)
    torch.cuda.synchronize()
    worst: dict[str, float] = {}
    cs = x0[8192:8320]
    stored_ok, k_worst, v_exact = True, 0.0, True
    for i, ph in enumerate(phases):
        if ph["type"] == 2:  # the greedy token: argmax of the kernel's own logits
            key = counter[2:4].view(torch.int64).item() & 0xFFFFFFFFFFFFFFFF
            got_tok = 0xFFFFFFFF - (key & 0xFFFFFFFF)
            ref_tok = int(torch.argmax(outs[ph["logits"]:ph["logits"] + VOCAB]).item())
            worst["argmax"] = 0.0 if got_tok == ref_tok else float("inf")
            continue
        if ph["type"] == 1:
            qkv = outs[ph["qkv"]:ph["qkv"] + 6144]
            got = attention_out(part[ph["part"]:ph["part"] + HKV * SPLITS * ATT_STRIDE])
            ref, mass_ref = attention_ref(qkv, kc[ph["layer"]], vc[ph["layer"]], table, cs)
            if flags & 64:  # each page key's probability summed over its 4 query heads
                mass_got = MASS[0][ph["layer"]][table.long()].permute(1, 0, 2).reshape(HKV, -1)
                e = ((mass_got - mass_ref).abs().max() / mass_ref.abs().max()).item()
                worst["mass"] = max(worst.get("mass", 0.0), e if e == e else float("inf"))
            # the current token's rotated k and its v, stored in the cache (fp16)
            v_ref = qkv[HQ * HD + HKV * HD:].view(HKV, HD).half()
            v_got = vcache[ph["layer"], ph["cur_blk"], :, 5]
            if flags & 32:  # row 5 of the swizzled V: position p holds chunk p ^ 5
                v_got = v_got.view(HKV, 16, 8)[:, torch.arange(16, device=dev) ^ 5].reshape(
                    HKV, HD)
            # k: the kernel's fp32 rotation may contract to an FMA (1 fp32 ulp) before the
            # fp16 rounding, so its fp16 k must be within one fp16 ulp of the fp32 rotation
            k32 = rope(qkv[HQ * HD:HQ * HD + HKV * HD].view(HKV, HD), cs)
            ulp = torch.exp2(torch.floor(torch.log2(k32.abs().clamp_min(2 ** -14))) - 10)
            k_got = kc[ph["layer"], ph["cur_blk"], :, 5].float()
            k_err = ((k_got - k32).abs() / ulp).max()  # in fp16 ulps
            k_worst = max(k_worst, k_err.item())
            v_exact = v_exact and torch.equal(v_got, v_ref)
            stored_ok = stored_ok and k_err.item() <= 1.0 and v_exact
        else:
            if ph["xform"] == 3:  # RMSNorm of x0 + f / 2 (f: the previous output)
                v = x0[:4096] + (0.5 * outs[ph["src"]:ph["src"] + 4096] if ph["src"] >= 0 else 0)
                x = (v * torch.rsqrt(v.pow(2).mean() + 1e-5) * x0[4096:8192]).half()
            elif ph["src"] < 0:
                x = x0[:4096].half()
            elif ph["xform"] == 2:
                att = attention_out(part[ph["src"]:ph["src"] + HKV * SPLITS * ATT_STRIDE])
                x = (x0[:4096] + 0.5 * att).half()
            else:
                prev = phases[i - 1] if phases[i - 1]["type"] == 0 else phases[i - 2]
                x = x_of(outs[prev["out"]:prev["out"] + prev["N"]], ph["K"], ph["xform"],
                         x0[:4096])
            w = dequant(items[ph["base"]:ph["base"] + ph["T"] * ph["G"]].view(
                ph["T"], ph["G"], ITEM_WORDS), ph["T"], ph["G"])
            ref = x.float() @ w
            got = outs[ph["out"]:ph["out"] + ph["N"]]
            del w
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        err = err if err == err else float("inf")
        worst[ph["kind"]] = max(worst.get(ph["kind"], 0.0), err)
    return {"max_rel_err": worst, "finite": bool(torch.isfinite(outs).all()),
            "counter": int(counter[0].item()), "expected_counter": len(phases) * ctas,
            "stored_kv_exact": stored_ok, "stored_k_rel_err": k_worst, "stored_v_exact": v_exact}


def time_step(so, st, ctas, stages, flags, stream, reps) -> float:
    dev = st[2].device
    outs = torch.zeros(st[6], dtype=torch.float32, device=dev)
    part = torch.zeros(LAYERS * HKV * SPLITS * ATT_STRIDE, dtype=torch.float32, device=dev)
    counter = torch.zeros(4, dtype=torch.int32, device=dev)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    for r in range(reps + 3):
        if r == 3:
            ev[0].record()
        outs.zero_(), counter.zero_()
        launch(so, st, outs, part, counter, ctas, stages, flags, stream)
    ev[1].record()
    torch.cuda.synchronize()
    return ev[0].elapsed_time(ev[1]) / reps


def timeline(so, st, ctas, stages, stream, flags=1) -> dict:
    phases = st[0]
    dev = st[2].device
    outs = torch.zeros(st[6], dtype=torch.float32, device=dev)
    part = torch.zeros(LAYERS * HKV * SPLITS * ATT_STRIDE, dtype=torch.float32, device=dev)
    counter = torch.zeros(4, dtype=torch.int32, device=dev)
    stamps = torch.zeros(len(phases), ctas, 12, dtype=torch.int64, device=dev)
    launch(so, st, outs, part, counter, ctas, stages, flags | 8, stream, stamps)
    torch.cuda.synchronize()
    s = stamps.cpu().double()
    ghz = (s[-1, :, 4] - s[0, :, 1]) / (s[-1, :, 7] - s[0, :, 6])
    us = lambda cyc: cyc / ghz / 1e3  # noqa: E731
    ph = {"wait": us(s[:, :, 1] - s[:, :, 0]), "in": us(s[:, :, 2] - s[:, :, 1]),
          "work": us(s[:, :, 3] - s[:, :, 2]), "out": us(s[:, :, 4] - s[:, :, 3]),
          "ring": us(s[:, :, 5])}
    last = s[:, :, 7].max(dim=1).values
    crit = torch.empty(len(phases), dtype=torch.float64)
    crit[0] = (last[0] - s[0, :, 6].min()) / 1e3
    crit[1:] = (last[1:] - last[:-1]) / 1e3
    res = {"ghz": ghz.mean().item(), "total_us": (last[-1] - s[0, :, 6].min()).item() / 1e3,
           "kinds": {}}
    for kind in dict.fromkeys(p["kind"] for p in phases):
        idx = torch.tensor([i for i, p in enumerate(phases) if p["kind"] == kind])
        row = {"n": len(idx), "crit": crit[idx].mean().item()}
        for k, t in ph.items():
            row[k] = t[idx].mean().item()
        row["work_max"] = ph["work"][idx].max(dim=1).values.mean().item()
        if kind == "attn":  # the units' CTAs (8 x 16): q load, warp 0's page math, merge
            u = slice(0, HKV * SPLITS)
            sa = s[idx][:, u]
            g = ghz[u]
            row["q_load"] = ((sa[:, :, 8] - sa[:, :, 2]) / g / 1e3).mean().item()
            row["page_math_w0"] = (sa[:, :, 9] / g / 1e3).mean().item()
            row["page_wait_w0"] = (sa[:, :, 5] / g / 1e3).mean().item()
            row["loop_w0"] = ((sa[:, :, 10] - sa[:, :, 8]) / g / 1e3).mean().item()
            row["merge"] = ((sa[:, :, 3] - sa[:, :, 10]) / g / 1e3).mean().item()
        res["kinds"][kind] = row
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--keys", type=int, nargs="+", default=[4608],
                    help="keys a KV head and layer (each a multiple of 256)")
    ap.add_argument("--stages", type=int, default=16, help="ring slots (a multiple of 4)")
    ap.add_argument("--position", type=int, default=32768, help="the token's RoPE position")
    ap.add_argument("--timeline-flags", type=int, nargs="+", default=[1],
                    help="flag sets of the timeline runs (1; 16: o's x load in one round; 32: "
                         "mma attention)")
    ap.add_argument("--check-flags", type=int, nargs="+", default=[1],
                    help="flag sets the step is checked with")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 33, 0],
                    help="flag sets to time (1 barriers, 16 o's x in one round, 32 mma "
                         "attention; 0 no barriers: a floor with wrong values)")
    a = ap.parse_args()
    dev = torch.device("cuda")
    ctas = torch.cuda.get_device_properties(dev).multi_processor_count
    so = build(Path(tempfile.mkdtemp()))
    # x0 (4096) then the RMSNorm weights (4096, around 1)
    X0.append(torch.cat([torch.randn(4096, device=dev), 0.5 + torch.rand(4096, device=dev),
                         rope_table(a.position).to(dev)]))
    stream = torch.cuda.current_stream().cuda_stream
    result = {"gpu": torch.cuda.get_device_name(), "ctas": ctas, "stages": a.stages,
              "smem": so.step_smem_bytes(a.stages), "rows": []}
    print(f"{ctas} CTAs, {a.stages} slots, {so.step_smem_bytes(a.stages)} B shared", flush=True)
    for keys in a.keys:
        st = make_step(dev, keys)
        weight_bytes = st[2].numel() * 4
        kv_bytes = 2 * LAYERS * HKV * keys * HD * 2
        row = {"keys": keys, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "checks": []}
        bad = False
        for cf in a.check_flags:
            c = check(so, st, ctas, a.stages, stream, cf)
            errs = " ".join(f"{k} {e:.1e}" for k, e in c["max_rel_err"].items())
            fail = max(c["max_rel_err"].values()) > 1e-2 or not c["finite"] or \
                c["counter"] != c["expected_counter"] or not c["stored_kv_exact"]
            print(f"keys {keys} flags {cf}: check {errs} finite {c['finite']} counter "
                  f"{c['counter']}/{c['expected_counter']} stored k (fp16 ulps "
                  f"{c['stored_k_rel_err']:.2f}), v exact {c['stored_v_exact']}"
                  f"{'  FAILED' if fail else ''}",
                  flush=True)
            row["checks"].append(dict(c, flags=cf))
            bad = bad or fail
        if not bad:
            for flags in a.rows:
                what = ("barriers on" if flags & 1 else "barriers off (floor, wrong values)") + \
                    (", o's x in one round" if flags & 16 else "") + \
                    (", mma attention" if flags & 32 else "") + \
                    (", importance mass" if flags & 64 else "")
                ms = time_step(so, st, ctas, a.stages, flags, stream, a.reps)
                row[f"ms_flags{flags}"] = ms
                print(f"keys {keys}: step {what}: {ms:.3f} ms, "
                      f"{(weight_bytes + kv_bytes) / ms / 1e9:.2f} TB/s of weights + KV "
                      f"({(weight_bytes + kv_bytes) / 1e9:.3f} GB)", flush=True)
            for tf in a.timeline_flags:
                tl = timeline(so, st, ctas, a.stages, stream, tf)
                row.setdefault("timelines", []).append(dict(tl, flags=tf))
                print(f"  timeline (flags {tf}): {tl['total_us']:.0f} us at {tl['ghz']:.2f} GHz; "
                      f"us a phase (mean over layers; CTA parts mean over CTAs)", flush=True)
                print(f"  {'kind':<8} {'crit':>6} {'wait':>6} {'in':>6} {'work':>6} {'max':>6} "
                      f"{'ring':>6} {'out':>6} {'x n':>4} {'sum':>7}", flush=True)
                for kind, r in tl["kinds"].items():
                    print(f"  {kind:<8} {r['crit']:6.2f} {r['wait']:6.2f} {r['in']:6.2f} "
                          f"{r['work']:6.2f} {r['work_max']:6.2f} {r['ring']:6.2f} {r['out']:6.2f} "
                          f"{r['n']:4d} {r['crit'] * r['n']:7.1f}", flush=True)
                at = tl["kinds"]["attn"]
                print(f"  attn units: q load {at['q_load']:.2f}, warp 0's page loop "
                      f"{at['loop_w0']:.2f} (page math {at['page_math_w0']:.2f}, waits "
                      f"{at['page_wait_w0']:.2f}), merge {at['merge']:.2f} us", flush=True)
        result["rows"].append(row)
        del st
        torch.cuda.empty_cache()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_cuda_step.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
