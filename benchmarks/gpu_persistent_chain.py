"""Can a persistent kernel stream a decode step's INT4 weights faster than 128 launches? The
8B decoder's GEMV chain (q|k|v, o, gate|up, down x 32 layers, each GEMV's input the previous
one's output) run two ways in one process, on the same weights:

  launches     awq_gemv_k once per GEMV (the engine's kernel, table config, tiled layout, PDL)
               replayed from one CUDA graph: what the engine's decode does today;
  persistent   one launch of a resident grid (P programs an SM) that runs the GEMVs in order,
               each program taking the GEMV's (column tile, K slice) units in turn with the
               engine's own step code (awq_gemv._gemv_step, same tile, K split, packed path
               and split-K reduction), and a grid barrier (an atomic counter: arrive with
               release, spin on an acquire load) between GEMVs instead of a kernel boundary.

Same tiles and splits, so the same bits: the script checks the persistent chain's final output
against the launched chain's (and every GEMV's output against the reference in the smoke run).
Run 83 (gpu_gemv_chain.py) put the 128 launches at 1.546 ms a token and the same bytes in one
launch at 0.895 ms; this measures how much of that gap a device-side barrier recovers while the
data dependencies stay. A benchmark, not an engine path: the barrier needs every program
resident at once (the grid is sized from the compiled kernel's occupancy, and a spin limit
turns a hang into an error flag).

    PYTHONPATH=$PWD python3 benchmarks/gpu_persistent_chain.py [--out DIR] [--reps 20]
        [--per-sm 1,2,4,8,16] [--split-sm 16,4] [--layers 32]
    python benchmarks/gpu_persistent_chain.py --smoke-cpu   # interpreter, tiny shapes, 1 program

Writes DIR/gpu_persistent_chain.json (DIR: --out, else $OUT, else ./out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

SMOKE = "--smoke-cpu" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hisparse_cli.kernels import awq_layout  # noqa: E402
from hisparse_cli.kernels.awq_gemv import _gemv_step, _load_rows, _load_words, _row_bases  # noqa: E402
from hisparse_cli.kernels.awq_gemv import _word_ptrs, awq_gemv_k  # noqa: E402

GROUP = 128
SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate|up", 4096, 28672), ("down", 14336, 4096)]
SMOKE_SHAPES = [("qkv", 256, 384), ("o", 256, 256), ("gate|up", 256, 1024), ("down", 512, 256)]
COLS = 8  # table row: N / 128, KW / 16, SPLIT, qweight, qzeros, scales, x, y offsets / 16


@triton.jit
def _spin_load(bar_ptr, ASM: tl.constexpr):
    """The barrier count, read at GPU scope with acquire semantics (ASM), or volatile (the
    interpreter, where one program runs at a time)."""
    if ASM:
        v = tl.inline_asm_elementwise(
            asm="ld.acquire.gpu.global.b32 $0, [$1];", constraints="=r,l",
            args=[bar_ptr + tl.zeros([1], tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
        return tl.max(v, axis=0)
    return tl.load(bar_ptr, volatile=True)


@triton.jit
def _grid_sync(bar_ptr, err_ptr, target, ASM: tl.constexpr):
    """Wait until `target` arrivals: every thread's stores done (CTA barrier), one release
    add, then spin; 2^20 spins (~0.5 s) set the error flag instead of hanging, and a set flag
    ends every later wait at once."""
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    n = _spin_load(bar_ptr, ASM)
    e = tl.load(err_ptr, volatile=True)
    spins = 0
    while (n < target) & (spins < 1048576) & (e == 0):
        n = _spin_load(bar_ptr, ASM)
        e = tl.load(err_ptr, volatile=True)
        spins += 1
    if n < target:  # a program that never started (or a bug): give up, every barrier after
        tl.atomic_xchg(err_ptr, 1)
    tl.debug_barrier()


@triton.jit
def _unit(qw_base, qz_base, s_base, act_ptr, p_ptr, cnt_ptr, u, N, KW, SPLIT, qw_off, qz_off,
          s_off, x_off, y_off, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_KW: tl.constexpr, STREAM: tl.constexpr, PACKED: tl.constexpr,
          ASM: tl.constexpr, NUM_STAGES: tl.constexpr):
    """One (column tile, K slice) unit of a GEMV, as _awq_gemv_kernel runs a program at one
    token on the tiled layout: its split-K partial, and the tile's sum by its last unit."""
    pid_n = u // SPLIT
    pid_k = u % SPLIT
    # the table holds N / 128, KW / 16 and the offsets / 16: multiplied back here, so the
    # compiler sees the alignment that 16-byte weight loads need (tl.multiple_of on a loaded
    # value does not reach Triton 3.x's alignment analysis: 4-byte loads, 167 registers)
    N = N * 128
    KW = KW * 16
    kws = (KW // SPLIT) // BLOCK_KW * BLOCK_KW
    qt_ptr = qw_base + qw_off * 16
    qz_ptr = qz_base + qz_off * 16
    s_ptr = s_base + s_off * 16
    x_ptr = act_ptr + x_off * 16
    y_ptr = act_ptr + y_off * 16
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_n  # N is a multiple of BLOCK_N here
    offs_w = tl.arange(0, BLOCK_KW)
    xo = (offs_w // 4) * 32 + offs_w % 4
    jn = rows % 8
    zshift = (4 * (jn % 2) + jn // 2) * 4
    w_row = _row_bases(qt_ptr, rows, KW, True, BLOCK_KW)
    w_start = tl.multiple_of(pid_k * kws, BLOCK_KW)
    ACC_KW: tl.constexpr = BLOCK_KW // 2 if PACKED == 2 else BLOCK_KW
    acc = tl.zeros((BLOCK_N, ACC_KW), dtype=tl.float32)
    for w0 in tl.range(w_start, w_start + kws, BLOCK_KW, num_stages=NUM_STAGES):
        words = _load_words(_word_ptrs(w_row, w0, offs_w, True, BLOCK_KW), STREAM)
        zw, sv = _load_rows(qz_ptr, s_ptr, (w0 * 8) // GROUP, N // 8, N, rows, offs_w, 0)
        acc, _a1, _a2, _a3 = _gemv_step(acc, acc, acc, acc, words, zw, sv, w0, x_ptr, xo,
                                        zshift, 0, 1, STREAM, PACKED, BLOCK_N, BLOCK_KW, ASM,
                                        0)
    out = tl.sum(acc, axis=1)
    if SPLIT == 1:
        tl.store(y_ptr + offs_n, out.to(tl.float16))
    else:
        tl.store(p_ptr + pid_k * N + offs_n, out)
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if done == SPLIT - 1:
            tot = tl.load(p_ptr + offs_n, cache_modifier=".cg")
            for sp in range(1, SPLIT):
                tot += tl.load(p_ptr + sp * N + offs_n, cache_modifier=".cg")
            tl.store(y_ptr + offs_n, tot.to(tl.float16))
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed")


@triton.jit
def _chain_kernel(tab_ptr, qw_base, qz_base, s_base, act_ptr, p_ptr, cnt_ptr, bar_ptr, err_ptr,
                  G, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
                  STREAM: tl.constexpr, PACKED: tl.constexpr, ASM: tl.constexpr,
                  NUM_STAGES: tl.constexpr, SYNC: tl.constexpr = True):
    """GEMVs 0..G-1 in order (table rows, module doc), a grid barrier after each (SYNC;
    without it the programs run ahead: wrong values, the streaming floor of the loop)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for i in range(G):
        row = tab_ptr + i * 8
        n = tl.load(row)  # / 128
        kw = tl.load(row + 1)  # / 16
        split = tl.load(row + 2)
        units = (n * 128 // BLOCK_N) * split
        for u in range(pid, units, nprog):
            _unit(qw_base, qz_base, s_base, act_ptr, p_ptr, cnt_ptr, u, n, kw, split,
                  tl.load(row + 3), tl.load(row + 4), tl.load(row + 5), tl.load(row + 6),
                  tl.load(row + 7), GROUP, BLOCK_N, BLOCK_KW, STREAM, PACKED, ASM,
                  NUM_STAGES)
        if SYNC:
            _grid_sync(bar_ptr, err_ptr, (i + 1) * nprog, ASM)


class Chain:
    """The weights of a GEMV chain in flat buffers, the activations (GEMV i reads the first
    K_i values of GEMV i-1's output; GEMV 0 a fixed input) and the table of module doc."""

    def __init__(self, shapes: list, layers: int, dev, split_sm: int, sms: int,
                 seed: int = 0) -> None:
        g = torch.Generator(device=dev).manual_seed(seed)
        self.gemvs = [(name, k, n) for _ in range(layers) for name, k, n in shapes]
        self.tile = awq_layout.gemv_config(1, 4096, 4096, GROUP, sms)  # small_n tile
        qws, qzs, ss, rows = [], [], [], []
        qw_off = qz_off = s_off = 0
        act_off = max(k for _, k, _ in self.gemvs)  # input x at 0
        prev = 0
        for _name, k, n in self.gemvs:
            cfg = awq_layout.gemv_config(1, k, n, GROUP, sms)
            split = awq_layout.gemv_split(k, n, self.tile.block_n, self.tile.block_kw,
                                          split_sm, sms)
            assert cfg.block_n == self.tile.block_n and n % self.tile.block_n == 0
            qw = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 8), dtype=torch.int32,
                               generator=g, device=dev)
            qz = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // GROUP, n // 8), dtype=torch.int32,
                               generator=g, device=dev)
            # |(q - z)| ~ 6.5 rms: scales that keep the chain's values near unit size
            sc = (torch.rand(k // GROUP, n, generator=g, device=dev) * 0.5 + 0.75) \
                / (6.5 * k ** 0.5)
            qws.append(qw.flatten())
            qzs.append(qz.flatten())
            ss.append(sc.half().flatten())
            rows.append([n, k // 8, split, qw_off, qz_off, s_off, prev, act_off])
            qw_off += qw.numel()
            qz_off += qz.numel()
            s_off += sc.numel()
            prev = act_off
            act_off += n
        self.qw = torch.cat(qws)
        del qws
        self.qz = torch.cat(qzs)
        self.s = torch.cat(ss)
        assert all(v % 16 == 0 for r in rows for v in r[3:]) and all(r[0] % 128 == 0 for r in rows)
        self.tab = torch.tensor([[r[0] // 128, r[1] // 16, r[2], *(v // 16 for v in r[3:])]
                                 for r in rows], dtype=torch.int64, device=dev)
        self.rows = rows
        self.act = torch.zeros(act_off, dtype=torch.float16, device=dev)
        self.act[: self.gemvs[0][1]] = torch.randn(self.gemvs[0][1], generator=g,
                                                   device=dev).half()
        max_part = max(r[0] * r[2] for r in rows)
        self.part = torch.zeros(max_part, dtype=torch.float32, device=dev)
        self.cnt = torch.zeros(max(r[0] for r in rows) // self.tile.block_n, dtype=torch.int32,
                               device=dev)
        self.bar = torch.zeros(1, dtype=torch.int32, device=dev)
        self.err = torch.zeros(1, dtype=torch.int32, device=dev)
        self.nbytes = (self.qw.numel() * 4 + self.qz.numel() * 4 + self.s.numel() * 2)

    def views(self, i: int) -> tuple:
        n, kw, _split, qo, zo, so, xo, yo = self.rows[i]
        k = kw * 8
        return (self.act[xo: xo + k].view(1, k), self.qw[qo: qo + n * kw].view(n, kw),
                self.qz[zo: zo + (k // GROUP) * (n // 8)].view(k // GROUP, n // 8),
                self.s[so: so + (k // GROUP) * n].view(k // GROUP, n), self.act[yo: yo + n])

    def launched(self) -> list:
        """The chain as the engine launches it: awq_gemv_k per GEMV (its own table split),
        each output copied into the next input's place (a real dependency)."""
        calls = []
        for i in range(len(self.rows)):
            x, qw, qz, s, y = self.views(i)
            calls.append(lambda x=x, qw=qw, qz=qz, s=s, y=y: y.copy_(
                awq_gemv_k(x, qw, qz, s, None, GROUP, checked=True, tiled=True)[0]))
        return calls

    def kernel_args(self) -> tuple:
        return (self.tab, self.qw, self.qz, self.s, self.act, self.part, self.cnt, self.bar,
                self.err, len(self.rows))

    def final(self) -> torch.Tensor:
        n, *_rest, yo = self.rows[-1]
        return self.act[yo: yo + n].clone()


def persistent_launch(chain: Chain, programs: int, asm: bool, stages: int, warps: int = 0,
                      sync: bool = True):
    t = chain.tile
    meta = dict(GROUP=GROUP, BLOCK_N=t.block_n, BLOCK_KW=t.block_kw, STREAM=t.stream,
                PACKED=t.packed if asm or SMOKE else 0, ASM=asm, NUM_STAGES=stages,
                SYNC=sync, num_warps=warps or t.num_warps, num_stages=1)

    def run():
        chain.bar.zero_()
        _chain_kernel[(programs,)](*chain.kernel_args(), **meta)
    return run, meta


def occupancy(chain: Chain, meta: dict, dev) -> dict:
    """Resident programs an SM of the compiled persistent kernel (registers, shared memory,
    the 32-block limit), so that the barrier never waits on a program that cannot start."""
    k = _chain_kernel.warmup(*chain.kernel_args(), grid=(1,), **meta)
    k._init_handles()
    props = torch.cuda.get_device_properties(dev)
    threads = meta["num_warps"] * 32
    regs = k.n_regs * threads
    by_regs = 65536 // max(regs, 1)
    smem = k.metadata.shared
    by_smem = (228 * 1024) // smem if smem else 32
    by_threads = 2048 // threads
    return dict(n_regs=k.n_regs, shared=smem, per_sm=min(by_regs, by_smem, by_threads, 32),
                sms=props.multi_processor_count)


def time_ms(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def smoke() -> None:
    """Interpreter: a 2-layer chain of small shapes, one program (the barrier passes at
    once), every GEMV's output against awq_gemv_k's, bits equal."""
    chain = Chain(SMOKE_SHAPES, 2, "cpu", split_sm=16, sms=4)
    x0 = chain.act.clone()
    for call in chain.launched():
        call()
    want = chain.act.clone()
    chain.act.copy_(x0)
    run, _meta = persistent_launch(chain, 1, asm=False, stages=1)
    run()
    assert int(chain.err) == 0
    diff = (chain.act.float() - want.float()).abs().max().item()
    splits = sorted({r[2] for r in chain.rows})
    print(f"smoke: {len(chain.rows)} GEMVs (splits {splits}), max |persistent - launched| = "
          f"{diff}")
    assert diff == 0.0, diff


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--per-sm", default="1,2,4,8,16",
                    help="programs an SM to try (those that fit; the most that fit always)")
    ap.add_argument("--split-sm", default="16,4", help="programs an SM the K split aims for")
    ap.add_argument("--warps", default="4,2")
    ap.add_argument("--stages", default="1,2")
    ap.add_argument("--budget-s", type=float, default=400)
    ap.add_argument("--smoke-cpu", action="store_true")
    a = ap.parse_args()
    if a.smoke_cpu:
        smoke()
        return
    from gpu_awq import graph_ms  # noqa: E402 (CUDA graphs: the engine's way)
    t_start = time.time()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    ints = lambda v: [int(x) for x in v.split(",")]  # noqa: E731
    results = []
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    def save():
        (out / "gpu_persistent_chain.json").write_text(json.dumps(
            {"rows": results, "gpu": torch.cuda.get_device_name(), "group": GROUP,
             "layers": a.layers}, indent=1))

    for split_sm in ints(a.split_sm):
        t0 = time.time()
        chain = Chain(SHAPES, a.layers, dev, split_sm, sms)
        print(f"split_sm {split_sm}: {len(chain.rows)} GEMVs, {chain.nbytes / 1e9:.2f} GB, "
              f"splits {sorted({r[2] for r in chain.rows})}, built in {time.time() - t0:.0f} s",
              flush=True)
        x0 = chain.act.clone()
        calls = chain.launched()
        for c in calls:
            c()
        want = chain.final()
        if split_sm == ints(a.split_sm)[0]:
            ms = graph_ms(calls, a.reps) * len(calls)
            tbs = chain.nbytes / ms / 1e9
            print(f"  launches: {len(calls)} GEMVs (+ a copy each) in a CUDA graph: {ms:.3f} ms "
                  f"{tbs:.2f} TB/s", flush=True)
            results.append(dict(kind="launches", ms=ms, tb_s=tbs))
        for warps in ints(a.warps):
            for stages in ints(a.stages):
                _run, meta = persistent_launch(chain, 1, True, stages, warps)
                occ = occupancy(chain, meta, dev)
                print(f"  kernel warps {warps} stages {stages}: {occ['n_regs']} registers, "
                      f"{occ['shared']} B shared: {occ['per_sm']} programs an SM fit", flush=True)
                tries = sorted({p for p in ints(a.per_sm) if p <= occ["per_sm"]}
                               | {occ["per_sm"]})
                for per_sm in tries:
                    if time.time() - t_start > a.budget_s:
                        print("  budget spent: stopping", flush=True)
                        save()
                        return
                    row = dict(kind="persistent", split_sm=split_sm, warps=warps, stages=stages,
                               per_sm=per_sm, n_regs=occ["n_regs"])
                    for sync in (True, False):
                        run, _meta = persistent_launch(chain, per_sm * sms, True, stages, warps,
                                                       sync)
                        chain.act.copy_(x0)
                        chain.err.zero_()
                        chain.cnt.zero_()
                        run()
                        torch.cuda.synchronize()
                        if sync:
                            row["err"] = int(chain.err)
                            row["max_diff"] = (chain.final().float() - want.float()).abs().max().item()
                            row["ms"] = time_ms(run, a.reps)
                        else:
                            row["ms_nosync"] = time_ms(run, a.reps)
                    row["tb_s"] = chain.nbytes / row["ms"] / 1e9
                    print(f"  P {per_sm:>2} w{warps} st{stages}: {row['ms']:.3f} ms "
                          f"{row['tb_s']:.2f} TB/s (no barrier {row['ms_nosync']:.3f} ms)  "
                          f"max|diff| {row['max_diff']:.3g} err {row['err']}", flush=True)
                    results.append(row)
                    save()
        del chain, calls
        torch.cuda.empty_cache()
    save()


if __name__ == "__main__":
    main()
