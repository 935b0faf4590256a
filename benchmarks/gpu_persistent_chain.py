"""Can a persistent kernel stream a decode step's INT4 weights faster than 128 launches? The
8B decoder's GEMV chain (q|k|v, o, gate|up, down x 32 layers, each GEMV's input the previous
one's output) run in one process on the same weights:

  launches     awq_gemv_k once per GEMV (the engine's kernel, table config, tiled layout, PDL)
               plus a copy into the next input, replayed from one CUDA graph: the engine's way;
  units        (--mode units) one launch of a resident grid (P programs an SM) that runs the
               GEMVs in order, each program taking the GEMV's (column tile, K slice) units in
               turn with the engine's own step code (awq_gemv._gemv_step, same tile, K split,
               packed path and split-K reduction: at the engine's splits the same bits), and a
               grid barrier (an atomic counter: arrive with release, spin on an acquire load)
               between GEMVs instead of a kernel boundary;
  stream       (--mode stream, the default) one resident launch where each program streams its
               contiguous 1/P share of every GEMV's 4 KiB tiled blocks in turn, loading the
               weights 1-3 steps ahead (--depth) across tile, GEMV and barrier ends, partial
               sums added atomically in fp32, arrivals on one counter or on group counters
               with nanosleep spins (--barriers groups:ns,...).
Each persistent row is also timed without its barriers (wrong values: the streaming floor).
Checks: units against the launched chain's output (bit-equal at the engine's splits); stream,
every GEMV against an fp32 matmul of its dequantized weight (awq_ref through the AWQ layout).
A benchmark, not an engine path: a grid barrier needs every program resident at once (the grid
is sized from the compiled kernel's occupancy, and ~1 s of spinning sets an error flag instead
of hanging). H200 runs 84-85 (BENCHMARKS "Runs 84-85"): a dependency costs 3.5-6 us on the
device, as at a kernel boundary; neither kernel beats the launches (1.99 / 2.31 ms vs 1.75).

    PYTHONPATH=$PWD python3 benchmarks/gpu_persistent_chain.py [--out DIR] [--reps 20]
        [--mode stream|units|both] [--depth 1,2,3] [--barriers 1:0,32:0,32:200]
        [--per-sm 1,2,4,8,16] [--split-sm 16,4] [--warps 4,2] [--stages 1,2] [--layers 32]
    python benchmarks/gpu_persistent_chain.py --smoke-cpu   # interpreter, tiny shapes

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
from hisparse_cli.kernels.int4 import awq_layout  # noqa: E402
from hisparse_cli.kernels.int4.awq_gemv import _gemv_step, _load_rows, _load_words, _row_bases  # noqa: E402
from hisparse_cli.kernels.int4.awq_gemv import _word_ptrs, awq_gemv_k  # noqa: E402
from hisparse_cli.kernels.int4.awq_gemv import _bits2, _codes_packed2, _dot_packed2  # noqa: E402
from hisparse_cli.kernels.int4.awq_gemv import _halves1  # noqa: E402

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



@triton.jit
def _x_pair32(xp, off):
    """fp16x2 bits (fp16(x[xp + off]), fp16(x[xp + off + 16])) from fp32 activations."""
    return _bits2(tl.load(xp + off).to(tl.float16), tl.load(xp + off + 16).to(tl.float16))


@triton.jit
def _stream_step(acc, words, zw, sv, xq, zshift, BN: tl.constexpr, BKW: tl.constexpr,
                 ASM: tl.constexpr):
    """acc [BN, BKW/2] + one 4 KiB block's (q - z) s x on the packed-2 path of _gemv_step
    (two words per fp32 conversion), x in fp32 rounded to fp16 as it is read."""
    zi = ((zw >> zshift) & 0xF)[:, None]
    sc = sv.to(tl.float32)[:, None] * 128.0
    ve, vo = _codes_packed2(words, zi, BN, BKW, ASM)
    p0, r0 = _halves1(_x_pair32(xq, 0), BKW)
    p1, r1 = _halves1(_x_pair32(xq, 4), BKW)
    p2, r2 = _halves1(_x_pair32(xq, 8), BKW)
    p3, r3 = _halves1(_x_pair32(xq, 12), BKW)
    return _dot_packed2(acc, ve, vo, p0, r0, p1, r1, p2, r2, p3, r3, sc, ASM)


@triton.jit
def _sparams(tab_ptr, i):
    """Stream table row i: steps S, steps a tile (K words / 16), N, and the offsets."""
    row = tab_ptr + i * 8
    return (tl.load(row), tl.load(row + 1), tl.load(row + 2) * 64, tl.load(row + 3) * 16,
            tl.load(row + 4) * 8, tl.load(row + 5) * 64, tl.load(row + 6) * 16,
            tl.load(row + 7) * 16)


@triton.jit
def _range(S, pid, nprog):
    """This program's steps [lo, hi) of a GEMV of S steps: S / nprog each, in order."""
    return (pid * S) // nprog, ((pid + 1) * S) // nprog


@triton.jit
def _advance(tab_ptr, i, s, hi, G, pid, nprog):
    """The next step of the program's stream: s + 1, or the first of its range in the next
    GEMV (past the last GEMV the cursor stays on its last step: a harmless reload)."""
    s = s + 1
    if s >= hi:
        if i + 1 < G:
            i = i + 1
            lo, hi = _range(tl.load(tab_ptr + i * 8), pid, nprog)
            s = lo
        else:
            s = hi - 1
    return i, s, hi


@triton.jit
def _fetch(tab_ptr, qw_base, qz_base, s_base, i, s, blk, offs_r, STREAM: tl.constexpr):
    """The 4 KiB word block of step s of GEMV i (64 rows x 16 words, contiguous in the tiled
    layout: block s of the GEMV), and its rows' zero-point words and scales."""
    S, spt, N, qw_off, qz_off, s_off, x_off, y_off = _sparams(tab_ptr, i)
    tile = s // spt
    g = s % spt  # group 128 = one step's 16 words
    words = _load_words(qw_base + qw_off + s.to(tl.int64) * 1024 + blk, STREAM)
    zw = tl.load(qz_base + qz_off + g * (N // 8) + tile * 8 + offs_r // 8)
    sv = tl.load(s_base + s_off + g * N + tile * 64 + offs_r)
    return words, zw, sv


@triton.jit
def _arrive_wait(bar_ptr, err_ptr, pid, ng, i, WAIT_ONLY: tl.constexpr, ASM: tl.constexpr,
                 SLEEP: tl.constexpr):
    """Arrive after GEMV i (WAIT_ONLY false) or wait for every program's arrival after GEMV
    i. Arrivals go to one of ng group counters (a 128-byte line each); the group's last
    arrival bumps the top counter, which the waiters read."""
    if WAIT_ONLY:
        target = (i + 1) * ng
        n = _spin_load(bar_ptr, ASM)
        e = tl.load(err_ptr, volatile=True)
        spins = 0
        while (n < target) & (spins < 1048576) & (e == 0):
            if SLEEP > 0:
                _nanosleep(SLEEP)
            n = _spin_load(bar_ptr, ASM)
            e = tl.load(err_ptr, volatile=True)
            spins += 1
        if n < target:
            tl.atomic_xchg(err_ptr, 1)
    else:
        tl.debug_barrier()
        grp = pid % ng
        members = (tl.num_programs(0) - grp + ng - 1) // ng
        old = tl.atomic_add(bar_ptr + 32 * (1 + grp), 1, sem="acq_rel", scope="gpu")
        if old == (i + 1) * members - 1:
            tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _nanosleep(ns: tl.constexpr):
    tl.inline_asm_elementwise(asm="nanosleep.u32 $1;\nmov.u32 $0, 0;", constraints="=r,r",
                              args=[tl.full([1], ns, tl.int32)], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _stream_kernel(tab_ptr, qw_base, qz_base, s_base, act_ptr, bar_ptr, err_ptr, G, ng,
                   DEPTH: tl.constexpr, STREAM: tl.constexpr, ASM: tl.constexpr,
                   SYNC: tl.constexpr, SLEEP: tl.constexpr):
    """The whole chain as one stream of 4 KiB steps per program: its slice (S / nprog
    consecutive blocks) of each GEMV in turn. The word blocks, zero points and scales of the
    next DEPTH - 1 steps are loaded into registers before the current step computes, so the
    weight reads run on across tile ends, GEMV ends and the barrier waits (weights do not
    depend on x). Partial sums go to the fp32 outputs by atomic adds at each tile end; a
    program arrives after its last step of GEMV i and waits, before its first step of GEMV
    i + 1 reads x, until every program has arrived (SYNC)."""
    BN: tl.constexpr = 64
    BKW: tl.constexpr = 16
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_r = tl.arange(0, BN)
    offs_w = tl.arange(0, BKW)
    blk = offs_r[:, None] * BKW + offs_w[None, :]
    x_lane = (offs_w // 4) * 32 + offs_w % 4
    jn = offs_r % 8
    zshift = (4 * (jn % 2) + jn // 2) * 4
    # prefetch cursor (fi, fs, fhi) and compute cursor (ci, cs, chi)
    lo, chi = _range(tl.load(tab_ptr), pid, nprog)
    ci = 0
    cs = lo
    fi = ci
    fs = cs
    fhi = chi
    b0w, b0z, b0s = _fetch(tab_ptr, qw_base, qz_base, s_base, fi, fs, blk, offs_r, STREAM)
    b1w, b1z, b1s = b0w, b0z, b0s
    b2w, b2z, b2s = b0w, b0z, b0s
    if DEPTH >= 2:
        fi, fs, fhi = _advance(tab_ptr, fi, fs, fhi, G, pid, nprog)
        b1w, b1z, b1s = _fetch(tab_ptr, qw_base, qz_base, s_base, fi, fs, blk, offs_r, STREAM)
    if DEPTH >= 3:
        fi, fs, fhi = _advance(tab_ptr, fi, fs, fhi, G, pid, nprog)
        b2w, b2z, b2s = _fetch(tab_ptr, qw_base, qz_base, s_base, fi, fs, blk, offs_r, STREAM)
    acc = tl.zeros((BN, BKW // 2), dtype=tl.float32)
    waited = 0  # the last GEMV whose inputs this program has waited for
    while ci < G:
        words, zw, sv = b0w, b0z, b0s
        if DEPTH == 3:
            b0w, b0z, b0s = b1w, b1z, b1s
            b1w, b1z, b1s = b2w, b2z, b2s
        elif DEPTH == 2:
            b0w, b0z, b0s = b1w, b1z, b1s
        fi, fs, fhi = _advance(tab_ptr, fi, fs, fhi, G, pid, nprog)
        nw, nz, ns = _fetch(tab_ptr, qw_base, qz_base, s_base, fi, fs, blk, offs_r, STREAM)
        if DEPTH == 3:
            b2w, b2z, b2s = nw, nz, ns
        elif DEPTH == 2:
            b1w, b1z, b1s = nw, nz, ns
        else:
            b0w, b0z, b0s = nw, nz, ns
        S, spt, N, qw_off, qz_off, s_off, x_off, y_off = _sparams(tab_ptr, ci)
        if SYNC:
            if ci > waited:
                _arrive_wait(bar_ptr, err_ptr, pid, ng, ci - 1, True, ASM, SLEEP)
                waited = ci
        kstep = cs % spt
        acc = _stream_step(acc, words, zw, sv, act_ptr + x_off + kstep * 128 + x_lane,
                           zshift, BN, BKW, ASM)
        last = cs + 1 >= chi
        if last | ((cs + 1) % spt == 0):  # a tile (or the range) ends: add the rows out
            tile = cs // spt
            tl.atomic_add(act_ptr + y_off + tile * BN + offs_r, tl.sum(acc, axis=1),
                          sem="relaxed")
            acc = tl.zeros((BN, BKW // 2), dtype=tl.float32)
        if last:
            if SYNC:
                _arrive_wait(bar_ptr, err_ptr, pid, ng, ci, False, ASM, SLEEP)
            ci = ci + 1
            if ci < G:
                lo, chi = _range(tl.load(tab_ptr + ci * 8), pid, nprog)
                cs = lo
        else:
            cs = cs + 1


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

    def stream_setup(self) -> None:
        """The stream kernel's table (S steps, steps a tile, N / 64, qweight / 16, qzeros / 8,
        scales / 64, x / 16, y / 16) and fp32 activations: the input, then each GEMV's
        output (GEMV i + 1 reads the first K values of GEMV i's)."""
        k0 = self.gemvs[0][1]
        rows, off, prev = [], k0, 0
        for r in self.rows:
            n, kw, _split, qo, zo, so = r[:6]
            spt = kw // 16
            rows.append([(n // 64) * spt, spt, n // 64, qo // 16, zo // 8, so // 64,
                         prev // 16, off // 16])
            assert qo % 16 == 0 and zo % 8 == 0 and so % 64 == 0 and off % 16 == 0
            prev = off
            off += n
        dev = self.qw.device
        self.srows = rows
        self.stab = torch.tensor(rows, dtype=torch.int64, device=dev)
        self.act32 = torch.zeros(off, dtype=torch.float32, device=dev)
        self.x32 = self.act[:k0].float()
        self.sbar = torch.zeros(32 * 65, dtype=torch.int32, device=dev)

    def stream_run(self, programs: int, groups: int, depth: int, sync: bool, sleep: int,
                   asm: bool, gemvs: int = 0):
        gemvs = gemvs or len(self.srows)
        assert all(r[0] >= programs for r in self.srows), "a GEMV with fewer steps than programs"
        ng = min(groups, programs, 64)
        k0 = self.gemvs[0][1]
        meta = dict(DEPTH=depth, STREAM=2, ASM=asm, SYNC=sync, SLEEP=sleep, num_warps=2,
                    num_stages=1)

        def run():
            self.act32.zero_()
            self.act32[:k0] = self.x32
            self.sbar.zero_()
            _stream_kernel[(programs,)](self.stab, self.qw, self.qz, self.s, self.act32,
                                        self.sbar, self.err, gemvs, ng, **meta)
        return run, meta

    def stream_check(self, gemvs: int = 0) -> float:
        """Largest error of any GEMV's output, relative to its largest value, against fp32
        matmuls of its input (as the kernel read it: rounded to fp16) with the dequantized
        weight (awq_ref, through the AWQ layout: an independent unpacking)."""
        from hisparse_cli.kernels.int4.awq_ref import dequantize_weight
        worst = 0.0
        for i, r in enumerate(self.srows[:gemvs or len(self.srows)]):
            n, k = r[2] * 64, r[1] * 128
            x = self.act32[r[6] * 16: r[6] * 16 + k].half().float()
            y = self.act32[r[7] * 16: r[7] * 16 + n]
            _x, qw, qz, sc, _y = self.views(i)
            w = dequantize_weight(awq_layout.kmajor_to_awq(awq_layout.untile_kmajor(qw, GROUP)),
                                  qz, sc, GROUP)
            ref = x @ w
            worst = max(worst, ((y - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item())
        return worst

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
    chain.stream_setup()
    for depth in (1, 2, 3):
        run, _meta = chain.stream_run(1, 4, depth, True, 0, asm=False)
        run()
        assert int(chain.err) == 0
        worst = chain.stream_check()
        print(f"smoke stream depth {depth}: worst GEMV error {worst:.2e} of its largest output")
        assert worst < 2e-3, worst
    # several programs (ranges that end inside tiles, atomic adds from each): one GEMV at a
    # time, since the interpreter runs programs one after another (no barrier can pass)
    for programs in (3, 5):
        run, _meta = chain.stream_run(programs, 2, 2, False, 0, asm=False, gemvs=1)
        run()
        worst = chain.stream_check(gemvs=1)
        print(f"smoke stream {programs} programs, GEMV 0: worst error {worst:.2e}")
        assert worst < 2e-3, worst


def stream_occupancy(chain: Chain, meta: dict, dev) -> dict:
    k = _stream_kernel.warmup(chain.stab, chain.qw, chain.qz, chain.s, chain.act32, chain.sbar,
                              chain.err, len(chain.srows), 1, grid=(1,), **meta)
    k._init_handles()
    threads = meta["num_warps"] * 32
    by_regs = 65536 // max(k.n_regs * threads, 1)
    smem = k.metadata.shared
    by_smem = (228 * 1024) // smem if smem else 32
    return dict(n_regs=k.n_regs, shared=smem, per_sm=min(by_regs, by_smem, 2048 // threads, 32))


def stream_main(a, dev, sms: int, results: list, save, graph_ms, t_start: float) -> None:
    """The stream kernel against the engine's launches on the same weights."""
    ints = lambda v: [int(x) for x in v.split(",")]  # noqa: E731
    chain = Chain(SHAPES, a.layers, dev, 16, sms)
    chain.stream_setup()
    calls = chain.launched()
    ms = graph_ms(calls, a.reps) * len(calls)
    print(f"launches: {len(calls)} GEMVs (+ a copy each) in a CUDA graph: {ms:.3f} ms "
          f"{chain.nbytes / ms / 1e9:.2f} TB/s", flush=True)
    results.append(dict(kind="launches", ms=ms, tb_s=chain.nbytes / ms / 1e9))
    barriers = [tuple(int(v) for v in b.split(":")) for b in a.barriers.split(",")]
    for depth in ints(a.depth):
        _run, meta = chain.stream_run(1, 1, depth, True, 0, True)
        occ = stream_occupancy(chain, meta, dev)
        print(f"stream depth {depth}: {occ['n_regs']} registers, {occ['shared']} B shared: "
              f"{occ['per_sm']} programs an SM fit", flush=True)
        for per_sm in sorted({occ["per_sm"], max(1, occ["per_sm"] // 2)}, reverse=True):
            programs = per_sm * sms
            run, _m = chain.stream_run(programs, 1, depth, False, 0, True)
            free_ms = time_ms(run, a.reps)
            for ng, sleep in barriers:
                if time.time() - t_start > a.budget_s:
                    print("budget spent: stopping", flush=True)
                    return
                run, _m = chain.stream_run(programs, ng, depth, True, sleep, True)
                chain.err.zero_()
                run()
                torch.cuda.synchronize()
                err = int(chain.err)
                worst = chain.stream_check() if (ng, sleep) == barriers[0] else float("nan")
                pms = time_ms(run, a.reps)
                row = dict(kind="stream", depth=depth, per_sm=per_sm, groups=ng, sleep=sleep,
                           ms=pms, tb_s=chain.nbytes / pms / 1e9, ms_nosync=free_ms,
                           err=err, worst_rel_err=worst, n_regs=occ["n_regs"])
                results.append(row)
                save()
                print(f"  P {per_sm:>2} groups {ng:>2} sleep {sleep:>3}: {pms:.3f} ms "
                      f"{row['tb_s']:.2f} TB/s (no barrier {free_ms:.3f} ms)  err {err}  "
                      f"worst GEMV rel. error {worst:.2e}", flush=True)


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
    ap.add_argument("--mode", default="stream", help="units, stream or both")
    ap.add_argument("--depth", default="1,2,3", help="stream: steps loaded ahead")
    ap.add_argument("--barriers", default="1:0,32:0,32:200",
                    help="stream: group counters:nanosleep ns between spins")
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

    if a.mode in ("stream", "both"):
        stream_main(a, dev, sms, results, save, graph_ms, t_start)
        if a.mode == "stream":
            return
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
