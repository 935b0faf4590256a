"""L2 prefetch of the weights a decode step reads next, issued while the GPU's memory is idle.

A decode step is a chain of ~11 kernels a layer. The GEMVs stream weights from DRAM; the
kernels between them (RoPE, store_kv, the sparse attention and its reduce, the norms) are
short and latency-bound and leave most of the DRAM bandwidth unused for ~20 us a layer. This
kernel fills that gap: launched in the chain (a PDL consumer, kernels/pdl.py) right before
the attention, it issues `cp.async.bulk.prefetch.L2` for byte ranges of the next GEMVs'
weights (the o projection, the first steps of each gate|up program) and returns: the copies
into L2 run on while the attention does, and those GEMVs then read part of their weights
from L2 instead of DRAM. A prefetch is a hint (never a read of data another kernel writes,
nothing is stored): issuing it before the PDL wait follows pdl.py's rules, and the results
of every kernel are the same bits with or without it.

Ranges are described by a segment table, int64 [S, 4] on the device: (address, total bytes,
run bytes, period bytes): runs of `run` bytes (the last one clipped to `total`) every
`period` bytes from `address`; a plain range has run == period. `awq_segments` makes them
for an INT4 linear in the tiled layout (awq_layout.tile_kmajor), where each program of the
split-K decode GEMV reads a contiguous chunk of every row tile: the first `fraction` of
each chunk is prefetched, so every program finds its first steps in L2.

sm_90+ only (the bulk prefetch is a Hopper instruction); elsewhere `supported` is False and
nothing is launched. Under the CPU interpreter the RECORD path stores each run's (offset
from the segment's address, size) instead, so the address arithmetic is tested there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from hisparse_cli.kernels import awq_layout
from hisparse_cli.kernels.pdl import chain_args
from hisparse_cli.kernels.pdl import enter as pdl_enter

BLOCK = 128  # runs issued per loop step of a program (one a thread, 4 warps)
PROGRAMS_PER_SM = 1  # the kernel's programs: one an SM, each issuing its share of the runs
MAX_RUN = 1 << 16  # bytes of one bulk prefetch (a run longer than this is split)
_ALIGN = 16  # the bulk prefetch's address and size granule

_ASM = tl.constexpr("""{
.reg .pred p;
setp.ne.b32 p, $3, 0;
@p cp.async.bulk.prefetch.L2.global [$1], $2;
mov.u32 $0, 0;
}""")
_ASM_LAST = tl.constexpr("""{
.reg .pred p;
.reg .b64 pol;
setp.ne.b32 p, $3, 0;
createpolicy.fractional.L2::evict_last.b64 pol, 1.0;
@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol;
mov.u32 $0, 0;
}""")


_LINE = tl.constexpr("""{
.reg .pred p;
setp.ne.b32 p, $2, 0;
@p prefetch.global.L2 [$1];
mov.u32 $0, 0;
}""")
_LINE_LAST = tl.constexpr("""{
.reg .pred p;
setp.ne.b32 p, $2, 0;
@p prefetch.global.L2::evict_last [$1];
mov.u32 $0, 0;
}""")
LINE = 128  # bytes of one line prefetch (LINES mode)


@triton.jit
def _l2_prefetch(seg_ptr, S, rec_ptr, BLOCK: tl.constexpr, EVICT_LAST: tl.constexpr,
                 RECORD: tl.constexpr, LINES: tl.constexpr = False,
                 LINE_BYTES: tl.constexpr = 128, PDL_WAIT: tl.constexpr = False,
                 PDL_TRIGGER: tl.constexpr = False):
    """Program p issues runs p * BLOCK + j (+ a multiple of programs * BLOCK) of each segment
    of seg_ptr [S, 4], then enters the chain (kernels/pdl.py). RECORD (the interpreter): run
    r of segment s stores (offset, size) at rec_ptr + 2 * (s's first run + r)."""
    pid = tl.program_id(0).to(tl.int64)
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    lane = tl.arange(0, BLOCK)
    first = pid * 0  # RECORD: segment s's first run among all segments' runs
    for s in range(S):
        addr = tl.load(seg_ptr + 4 * s)
        total = tl.load(seg_ptr + 4 * s + 1)
        run = tl.load(seg_ptr + 4 * s + 2)
        period = tl.load(seg_ptr + 4 * s + 3)
        nruns = tl.cdiv(total, period)
        for i0 in range(pid * BLOCK, nruns, step):
            i = (i0 + lane).to(tl.int64)
            off = i * period
            ok = i < nruns
            size = tl.minimum(run, tl.maximum(total - off, 0)).to(tl.int32)
            if RECORD:
                dst = rec_ptr + 2 * (first + i)
                tl.store(dst, off, mask=ok)
                tl.store(dst + 1, size.to(tl.int64), mask=ok)
            elif LINES:  # one line prefetch per LINE_BYTES of the run, no bulk operation
                for b in range(0, run, LINE_BYTES):
                    q = addr + off + b
                    on = (ok & (b < size)).to(tl.int32)
                    if EVICT_LAST:
                        tl.inline_asm_elementwise(_LINE_LAST, "=r,l,r", [q, on], dtype=tl.int32,
                                                  is_pure=False, pack=1)
                    else:
                        tl.inline_asm_elementwise(_LINE, "=r,l,r", [q, on], dtype=tl.int32,
                                                  is_pure=False, pack=1)
            else:
                p = addr + off  # a global address, as the 64-bit operand the asm takes
                if EVICT_LAST:
                    tl.inline_asm_elementwise(_ASM_LAST, "=r,l,r,r", [p, size, ok.to(tl.int32)],
                                              dtype=tl.int32, is_pure=False, pack=1)
                else:
                    tl.inline_asm_elementwise(_ASM, "=r,l,r,r", [p, size, ok.to(tl.int32)],
                                              dtype=tl.int32, is_pure=False, pack=1)
        first += nruns
    pdl_enter(PDL_WAIT, PDL_TRIGGER)


@dataclass(frozen=True)
class Segment:
    """Runs of `run` bytes every `period` bytes over `total` bytes of `tensor`'s storage from
    its first element (module doc); run == period: the whole range."""

    tensor: torch.Tensor
    total: int
    run: int
    period: int

    def __post_init__(self) -> None:
        nbytes = self.tensor.numel() * self.tensor.element_size()
        if not (0 <= self.total <= nbytes):
            raise ValueError(f"segment of {self.total} bytes in a {nbytes}-byte tensor")
        if not (0 < self.run <= self.period) or self.run % _ALIGN or self.period % _ALIGN:
            raise ValueError(f"run {self.run} / period {self.period}: multiples of {_ALIGN}, "
                             "0 < run <= period")
        if self.total % _ALIGN or self.tensor.data_ptr() % _ALIGN:
            raise ValueError(f"segment of {self.total} bytes at {self.tensor.data_ptr():#x}: "
                             f"{_ALIGN}-byte aligned")

    def runs(self) -> list[tuple[int, int]]:
        """(offset, size) of every run: what the kernel issues (the tests' oracle)."""
        return [(o, min(self.run, self.total - o)) for o in range(0, self.total, self.period)]


def whole(t: torch.Tensor, fraction: float = 1.0) -> Segment | None:
    """The first `fraction` of t's bytes (rounded down to 16 bytes) in MAX_RUN runs; None
    when that is nothing."""
    total = int(t.numel() * t.element_size() * fraction) // _ALIGN * _ALIGN
    return Segment(t, total, MAX_RUN, MAX_RUN) if total else None


def awq_segments(lin, fraction: float, sms: int, tokens: int = 1) -> list[Segment]:
    """What to prefetch of an AWQ linear (model/awq.AWQLinear) before its decode GEMV of
    `tokens` tokens on `sms` SMs: its zero points and scales whole, and of the words, in the
    tiled layout, the first `fraction` of every program's K chunk of every row tile
    (awq_layout.gemv_config's split: the chunk each program of the split-K GEMV reads);
    in the K-major layout, the first `fraction` of the tensor."""
    segs = [whole(lin.qzeros), whole(lin.scales)]
    if fraction <= 0:
        return [s for s in segs if s is not None]
    qw = lin.qweight
    if lin.layout != "tiled" or fraction >= 1:
        segs.append(whole(qw, min(fraction, 1.0)))
        return [s for s in segs if s is not None]
    n, kw = qw.shape
    t = awq_layout.tile_words(lin.group_size)
    cfg = awq_layout.gemv_config(tokens, lin.in_features, n, lin.group_size, sms)
    steps = kw // t // cfg.split  # [64, t] word blocks of one program's chunk of a row tile
    step_bytes = awq_layout.TILE_ROWS * t * qw.element_size()
    run = max(1, round(fraction * steps)) * step_bytes
    segs.append(Segment(qw, qw.numel() * qw.element_size(), run, steps * step_bytes))
    return [s for s in segs if s is not None]


def table(segments: list[Segment], device: torch.device) -> torch.Tensor:
    """The kernel's int64 [S, 4] segment table (addresses of the tensors: they must outlive
    it), runs longer than MAX_RUN split into MAX_RUN pieces."""
    rows = []
    for s in segments:
        base = s.tensor.data_ptr()
        if s.run <= MAX_RUN:
            rows.append((base, s.total, s.run, s.period))
            continue
        for k in range(0, s.run, MAX_RUN):  # piece k of every run: its own strided segment
            if k >= s.total:
                break
            size = min(MAX_RUN, s.run - k)
            rows.append((base + k, s.total - k, size, s.period))
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 4).to(device)


@lru_cache(maxsize=8)
def _device_ok(device: torch.device) -> bool:
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def supported(device: torch.device) -> bool:
    """Whether the bulk L2 prefetch runs on `device` (sm_90+ CUDA, compiled Triton)."""
    return _device_ok(device)


class Prefetcher:
    """One prefetch launch, planned once (its table is made on the first call, before any
    CUDA-graph capture: the engine's eager warm-up step): `__call__` issues it."""

    def __init__(self, segments: list[Segment], evict_last: bool = False,
                 lines: bool = False, side: bool = False) -> None:
        self.segments = segments
        self.evict_last = evict_last
        self.lines = lines
        self.side = side
        self._table: torch.Tensor | None = None
        self.bytes = sum(sum(sz for _, sz in s.runs()) for s in segments)

    def __call__(self) -> None:
        if not self.segments:
            return
        dev = self.segments[0].tensor.device
        if not supported(dev):
            return
        if self._table is None:
            self._table = table(self.segments, dev)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        if not self.side:  # in the chain: a PDL consumer that issues before its wait
            _l2_prefetch[(sms * PROGRAMS_PER_SM,)](
                self._table, self._table.shape[0], self._table, BLOCK=BLOCK,
                EVICT_LAST=self.evict_last, RECORD=False, LINES=self.lines, LINE_BYTES=LINE,
                num_warps=BLOCK // 32, **chain_args(dev))
            return
        # beside the chain: forked onto a side stream here (inside a CUDA-graph capture too),
        # joined by `join` at the end of the forward, so no kernel of the chain waits for it
        main = torch.cuda.current_stream(dev)
        side = _side_stream(dev)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            _l2_prefetch[(sms * PROGRAMS_PER_SM,)](
                self._table, self._table.shape[0], self._table, BLOCK=32,
                EVICT_LAST=self.evict_last, RECORD=False, LINES=self.lines, LINE_BYTES=LINE,
                num_warps=1)
        _PENDING.add(dev)


_PENDING: set = set()


@lru_cache(maxsize=8)
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def join(device: torch.device) -> None:
    """Make the current stream wait for the side prefetches forked since the last join (the
    forward's end: CausalLM.forward_hidden), so a captured graph has no unjoined work."""
    if device in _PENDING:
        _PENDING.discard(device)
        torch.cuda.current_stream(device).wait_stream(_side_stream(device))


def record(segments: list[Segment], programs: int = 3) -> list[tuple[int, int]]:
    """(address, size) of every bulk prefetch the kernel issues for `segments`, from its
    RECORD path (the CPU interpreter): what the tests compare with Segment.runs."""
    tab = table(segments, torch.device("cpu"))
    rows = tab.tolist()
    counts = [-(-r[1] // r[3]) for r in rows]
    rec = torch.full((sum(counts), 2), -1, dtype=torch.int64)
    _l2_prefetch[(programs,)](tab, tab.shape[0], rec, BLOCK=BLOCK, EVICT_LAST=False, RECORD=True)
    out, i = [], 0
    for row, c in zip(rows, counts):
        out += [(row[0] + o, sz) for o, sz in rec[i:i + c].tolist()]
        i += c
    return out


def linear_segments(lin, fraction: float, sms: int) -> list[Segment]:
    """What to prefetch of a decoder linear before its 1-token decode GEMV: awq_segments for
    an AWQ linear; of a plain one, the first `fraction` of its weight."""
    if fraction <= 0 or lin is None:
        return []
    if hasattr(lin, "qweight"):
        return awq_segments(lin, fraction, sms)
    seg = whole(lin.weight, min(fraction, 1.0))
    return [seg] if seg is not None else []


@dataclass(frozen=True)
class Plan:
    """Fractions of each layer's linears to prefetch (0: none). In the attention window
    (before the decode attention): the o projection, gate|up, down; in the MLP window
    (between gate|up and silu * up): down. evict_last: mark the prefetched lines last to
    evict in L2."""

    o: float = 1.0
    gate_up: float = 0.25
    down: float = 0.0
    mlp_down: float = 0.0
    evict_last: bool = False
    lines: bool = False
    side: bool = False


def plan_model(model, plan: Plan | None) -> int:
    """Set (plan) or clear (None) every decoder layer's prefetch hooks (model/llama.py:
    Attention.l2_prefetch, MLP.l2_prefetch) of a model whose projections are fused; returns
    the bytes a decode step prefetches. Nothing is set where `supported` is False."""
    layers = model.model.layers
    total = 0
    dev = model.lm_head.weight.device
    on = plan is not None and supported(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if on else 0
    for layer in layers:
        att, mlp = layer.self_attn, layer.mlp
        att.l2_prefetch = mlp.l2_prefetch = None
        if not on:
            continue
        segs = (linear_segments(att.o_proj, plan.o, sms)
                + linear_segments(mlp.gate_up_proj, plan.gate_up, sms)
                + linear_segments(mlp.down_proj, plan.down, sms))
        if segs:
            att.l2_prefetch = Prefetcher(segs, plan.evict_last, plan.lines, plan.side)
            total += att.l2_prefetch.bytes
        segs = linear_segments(mlp.down_proj, plan.mlp_down, sms)
        if segs:
            mlp.l2_prefetch = Prefetcher(segs, plan.evict_last, plan.lines, plan.side)
            total += mlp.l2_prefetch.bytes
    return total
