"""Allocation traces of one engine step, op by op, as the code allocates (no torch).

`Trace` is a live-bytes simulator: `alloc` / `free` named tensors, remember the peak and what
was live at it. The functions below replay, in order, the tensors that model/llama.py,
kernels/attention/attention_ref.py, kernels/attention/attention_triton.py, kernels/awq_*.py,
kernels/norm_rope/norm_rope_triton.py and engine/kv_cache.py create and drop while a step runs (a
view or an in-place op allocates nothing; a temporary dies when the statement that made it
ends). They are transcriptions of
that code: when it changes, these must follow (tests/test_planner.py replays a real CPU run
under an allocation-recording dispatch mode to catch drift; benchmarks/gpu_engine.py compares
with torch.cuda.max_memory_allocated on the GPU).

Not modelled: buffers kernels allocate internally without returning them (CPU SDPA scratch,
topk/sort scratch on CUDA), which torch's CUDA allocator does count.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


MIB = 1 << 20


def cuda_block_bytes(nbytes: int) -> int:
    """Bytes torch's CUDA caching allocator counts as allocated for a request, when it is
    served by a fresh segment: requests round up to 512 B; a request of 10 MiB or more gets a
    segment rounded up to 2 MiB, and the rest stays in the block (is not split off) when it is
    1 MiB or less. (A request served by a cached block may keep a different remainder.)"""
    if nbytes <= 0:
        return 0
    r = cdiv(nbytes, 512) * 512
    if r >= 10 * MIB:
        seg = cdiv(r, 2 * MIB) * 2 * MIB
        if seg - r <= MIB:
            return seg
    return r


class Trace:
    """Live bytes of simulated allocations; `cuda`: with the CUDA allocator's rounding."""

    def __init__(self, cuda: bool = False) -> None:
        self.cuda = cuda
        self.cur = 0
        self.peak = 0
        self.peak_live: dict[str, int] = {}
        self.peak_label = ""
        self.label = ""
        self._live: dict[int, tuple[str, int]] = {}
        self._next = 0

    def size(self, nbytes: int) -> int:
        if self.cuda:
            return cuda_block_bytes(nbytes)
        return max(nbytes, 0)

    def alloc(self, name: str, nbytes: int) -> int:
        n = self.size(nbytes)
        if n == 0:
            return -1
        h = self._next
        self._next += 1
        self._live[h] = (name, n)
        self.cur += n
        if self.cur > self.peak:
            self._snapshot(self.cur, {})
        return h

    def free(self, *handles: int | None) -> None:
        for h in handles:
            if h is not None and h >= 0:
                self.cur -= self._live.pop(h)[1]

    def live_by_name(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, n in self._live.values():
            out[name] = out.get(name, 0) + n
        return out

    def bump(self, sub: "SubPeak", label: str) -> None:
        """A sub-trace (measured from zero) runs on top of the current live set."""
        if self.cur + sub.peak > self.peak:
            self._snapshot(self.cur + sub.peak, sub.live, label)

    def _snapshot(self, value: int, extra: dict[str, int], label: str | None = None) -> None:
        self.peak = value
        live = self.live_by_name()
        for name, n in extra.items():
            live[name] = live.get(name, 0) + n
        self.peak_live = live
        self.peak_label = label if label is not None else self.label


@dataclass(frozen=True)
class SubPeak:
    peak: int
    live: dict[str, int] = field(default_factory=dict)  # what was live at the peak

    @classmethod
    def of(cls, tr: Trace) -> "SubPeak":
        return cls(tr.peak, dict(tr.peak_live))


@dataclass(frozen=True)
class StepShape:
    """Everything about the model, dtypes and backend that a step's tensors depend on."""

    layers: int
    hidden: int
    inter: int
    vocab: int
    hq: int
    hkv: int
    d: int
    cb: int  # compute dtype bytes (weights, activations)
    kvb: int  # KV cache dtype bytes
    cuda: bool
    backend: str  # "torch" | "triton" (attention and INT4 linear)
    awq: bool
    group: int
    awq_lm_head: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    bs: int
    sinks: int
    window: int | None
    G: int  # global slots per layer/head (0: none)
    C: int  # candidate slots per layer/head
    track_scores: bool  # attention mass is computed (importance attention / snapkv)
    score_tensor: bool  # the cache holds per-token scores (tracked mass, or a probe's scores)
    score_stride: int  # passed to the kernel only when > 1 and scores are tracked
    min_distance: int  # snapkv: score_min_distance passed to the kernel (0: none)
    importance: str
    num_sms: int
    cpu_int4: bool = False  # CPU AWQ linears keep the packed decode copy (kernels/int4/awq_cpu.py)
    fp8_prefill: bool = False  # prefill INT4 products in W4A8 (kernels/fp8/w4a8_linear.py)
    # every decoder layer keeps W^T for prefill (AWQLinear.keep_prefill_weight): prefill-sized
    # products are one F.linear, without a dequantize workspace
    prefill_cached: bool = False
    # CausalLM.forward_hidden's residual chain (model/llama.py; Triton elementwise kernels)
    residual_chain: bool = False

    @property
    def grp(self) -> int:
        return self.hq // self.hkv

    @property
    def attn_b(self) -> int:
        """Bytes of the torch reference's attention compute dtype (fp32 on CPU)."""
        return 4 if not self.cuda else self.cb


# -- linears -------------------------------------------------------------------------------
def linear(tr: Trace, s: StepShape, name: str, m: int, k: int, n: int, quant: bool,
           bias: bool = False) -> int:
    """y [m, n] of x [m, k] @ W; returns y's handle (temporaries freed)."""
    cb = s.cb
    if not quant:  # F.linear: one addmm/mm output
        return tr.alloc(name, m * n * cb)
    if s.backend == "triton":  # K-major kernels for every dtype (kernels/int4/awq_layout.py)
        from hisparse_cli.kernels.int4.awq_layout import GEMV_MAX_TOKENS

        if s.prefill_cached and m > GEMV_MAX_TOKENS and name != "lm_head":
            return tr.alloc(name, m * n * cb)  # F.linear over the kept W^T
        return _awq_triton(tr, s, name, m, k, n)
    if s.cpu_int4 and not s.cuda:
        from hisparse_cli.kernels.int4.awq_cpu import CPU_INT4_MAX_TOKENS, int4pack_applies

        if m <= CPU_INT4_MAX_TOKENS and int4pack_applies(k, n, s.group):
            return _awq_int4pack(tr, s, name, m, k, n)
        return _awq_cpu_dequant(tr, s, name, m, k, n, bias)
    return _awq_ref(tr, s, name, m, k, n, bias)


def _awq_cpu_dequant(tr: Trace, s: StepShape, name: str, m: int, k: int, n: int,
                     bias: bool) -> int:
    """awq_cpu.awq_linear_dequant: the broadcasting dequantize, then the reference's matmul."""
    el, gz, t = k * n, (k // s.group) * n, name + ".dequant"
    a = tr.alloc(t, el * 4)  # words >> shifts (int32 [k, n/8, 8])
    q = tr.alloc(t, el * 4)  # & 0xF
    tr.free(a)
    a = tr.alloc(t, gz * 4)  # zeros: the same on [k/group, n]
    z = tr.alloc(t, gz * 4)
    tr.free(a)
    sf = tr.alloc(t, gz * 4)  # scales.float()
    w = tr.alloc(t, el * 4)  # q - z written into it, then * s in place
    tr.free(q, z, sf)
    return _cpu_matmul(tr, s, name, t, m, k, n, bias, w)


def _awq_int4pack(tr: Trace, s: StepShape, name: str, m: int, k: int, n: int) -> int:
    """awq_cpu.int4pack_linear: x in bf16, the kernel's bf16 y, y in the compute dtype (the
    bias is added in place)."""
    xb = tr.alloc(name + ".int4pack_x", m * k * 2)
    yb = tr.alloc(name + ".int4pack_y", m * n * 2)
    tr.free(xb)
    y = tr.alloc(name, m * n * s.cb)
    tr.free(yb)
    return y


def _awq_triton(tr: Trace, s: StepShape, name: str, m: int, k: int, n: int) -> int:
    """awq_triton.awq_linear_k (the K-major layout AWQLinear holds on CUDA; any dtype)."""
    from hisparse_cli.kernels.int4.awq_layout import (DEQUANT_CHUNK_ELEMS, GEMV_MAX_TOKENS,
                                                 dequant_chunk, gemv_config, prefill_path)

    cb = s.cb
    if m <= GEMV_MAX_TOKENS:  # awq_gemv_k: y, then fp32 split-K partials when split
        y = tr.alloc(name, m * n * cb)
        split = gemv_config(m, k, n, s.group, s.num_sms).split
        if split > 1:
            tr.free(tr.alloc(name + ".gemv_partial", split * m * n * 4))
        return y
    if prefill_path(m, n, cb) == "fused":  # awq_gemm_k: dequantizes in registers, y only
        return tr.alloc(name, m * n * cb)
    chunk = dequant_chunk(k, n, DEQUANT_CHUNK_ELEMS)  # awq_dequant_matmul_k: W^T row chunks
    if s.fp8_prefill and s.group == 128 and k % 128 == 0:
        return _w4a8(tr, name, m, k, n, cb, chunk)
    if chunk >= n:
        w = tr.alloc(name + ".dequant_w", k * n * cb)
        y = tr.alloc(name, m * n * cb)
        tr.free(w)
        return y
    y = tr.alloc(name, m * n * cb)
    tr.free(tr.alloc(name + ".dequant_buf", k * chunk * cb))
    return y


def _w4a8(tr: Trace, name: str, m: int, k: int, n: int, cb: int, chunk: int) -> int:
    """w4a8_linear.w4a8_matmul: e4m3 x and its scales, then per W^T row chunk a workspace of
    codes and fp32 scales and cuBLAS's output (copied into y's columns when chunked)."""
    g = k // 128
    xq = (tr.alloc(name + ".fp8_x", m * k), tr.alloc(name + ".fp8_x_scales", 4 * g * m))
    if chunk >= n:
        ws = tr.alloc(name + ".fp8_w", n * k + 4 * g * n)
        y = tr.alloc(name, m * n * cb)
        tr.free(ws)
    else:
        y = tr.alloc(name, m * n * cb)
        ws = tr.alloc(name + ".fp8_w", chunk * k + 4 * g * chunk)
        tr.free(tr.alloc(name + ".fp8_part", m * chunk * cb))
        tr.free(ws)
    tr.free(*xq)
    return y


def _awq_ref(tr: Trace, s: StepShape, name: str, m: int, k: int, n: int, bias: bool) -> int:
    el, gz, t = k * n, (k // s.group) * n, name + ".dequant"
    a = tr.alloc(t, el * 4)  # unpack: words >> shifts (int32 [k, n/8, 8])
    b = tr.alloc(t, el * 4)  # & 0xF
    tr.free(a)
    u8 = tr.alloc(t, el)
    tr.free(b)
    q = tr.alloc(t, el * 2)  # .to(int16)
    tr.free(u8)
    a = tr.alloc(t, gz * 4)  # zeros: the same unpack on [k/group, n]
    b = tr.alloc(t, gz * 4)
    tr.free(a)
    u8 = tr.alloc(t, gz)
    tr.free(b)
    z16 = tr.alloc(t, gz * 2)
    tr.free(u8)
    z = tr.alloc(t, el * 2)  # repeat_interleave(group)
    tr.free(z16)
    sf = tr.alloc(t, gz * 4)  # scales.float()
    sc = tr.alloc(t, el * 4)
    tr.free(sf)
    diff = tr.alloc(t, el * 2)  # q - z
    f = tr.alloc(t, el * 4)  # .float()
    tr.free(diff)
    w = tr.alloc(t, el * 4)  # * s
    tr.free(f, q, z, sc)
    if not s.cuda:
        return _cpu_matmul(tr, s, name, t, m, k, n, bias, w)
    cb = s.cb
    wc = tr.alloc(t, el * cb) if cb != 4 else -1
    y = tr.alloc(name, m * n * cb)
    tr.free(wc)
    if bias:
        y2 = tr.alloc(name, m * n * cb)
        tr.free(y)
        y = y2
    tr.free(w)
    return y


def _cpu_matmul(tr: Trace, s: StepShape, name: str, t: str, m: int, k: int, n: int,
                bias: bool, w: int) -> int:
    """The reference's CPU tail after the dequantized fp32 w: fp32 matmul, one rounding at
    the end; w is freed last."""
    cb = s.cb
    xf = tr.alloc(t, m * k * 4) if cb != 4 else -1
    y = tr.alloc(name if cb == 4 else t, m * n * 4)
    tr.free(xf)
    if bias:
        bf = tr.alloc(t, n * 4) if cb != 4 else -1
        y2 = tr.alloc(name if cb == 4 else t, m * n * 4)
        tr.free(y, bf)
        y = y2
    if cb != 4:
        out = tr.alloc(name, m * n * cb)
        tr.free(y)
        y = out
    tr.free(w)
    return y


# -- norms and RoPE ------------------------------------------------------------------------
def add_rms_norm(tr: Trace, s: StepShape, name: str, rows: int, dim: int) -> tuple[int, int]:
    """The Triton backend's residual add + RMSNorm (KernelBackend.add_rms_norm) of [rows, dim]
    -> (sum, normed) handles, allocated in that order; nothing else."""
    el = rows * dim * s.cb
    return tr.alloc("residual", el), tr.alloc(name, el)


def rms_norm(tr: Trace, s: StepShape, name: str, rows: int, dim: int) -> int:
    """RMSNorm of [rows, dim] in the compute dtype (model/llama.py:RMSNorm)."""
    el, cb = rows * dim, s.cb
    if s.backend == "triton":  # kernels/norm_rope/norm_rope_triton.py: the output only
        return tr.alloc(name, el * cb)
    xf = tr.alloc(name, el * 4) if cb != 4 else -1  # x.float() (no-op in fp32)
    p = tr.alloc(name, el * 4)  # pow(2)
    r1 = tr.alloc(name, rows * 4)  # mean
    tr.free(p)
    r2 = tr.alloc(name, rows * 4)  # + eps
    tr.free(r1)
    r3 = tr.alloc(name, rows * 4)  # rsqrt
    tr.free(r2)
    x2 = tr.alloc(name, el * 4)  # xf * r
    tr.free(xf, r3)
    xc = tr.alloc(name, el * cb) if cb != 4 else -1  # .to(dtype)
    out = tr.alloc(name, el * cb)  # weight * x
    tr.free(xc, x2)
    return out


def rope(tr: Trace, s: StepShape, name: str, t: int, heads: int) -> int:
    """RoPE of [t, heads, d]: returns the rotated tensor (input kept by the caller)."""
    el, cb = t * heads * s.d, s.cb
    if s.backend == "triton":  # kernels/norm_rope/norm_rope_triton.py: the output only
        return tr.alloc(name, el * cb)
    # norm_rope_ref.rope_tabled: x * cos + x.roll(d / 2) * sin_rot
    xc = tr.alloc(name, el * cb)  # x * cos
    rot = tr.alloc(name, el * cb)  # roll
    rs = tr.alloc(name, el * cb)  # * sin_rot
    tr.free(rot)
    out = tr.alloc(name, el * cb)
    tr.free(xc, rs)
    return out


def cos_sin(tr: Trace, s: StepShape, t: int) -> tuple[int, int]:
    """RotaryEmbedding.cos_sin for t positions -> (cos, sin) [t, d] in the compute dtype,
    then (torch elementwise ops) CausalLM.forward_hidden's rope_tables of them."""
    a = tr.alloc("rope", t * 4)  # positions.to(float32)
    freqs = tr.alloc("rope", t * s.d // 2 * 4)
    tr.free(a)
    emb = tr.alloc("rope", t * s.d * 4)  # cat((freqs, freqs))
    out = []
    for _ in range(2):
        c1 = tr.alloc("rope", t * s.d * 4)  # .cos() / .sin()
        c2 = tr.alloc("rope", t * s.d * 4)  # * scaling
        tr.free(c1)
        if s.cb != 4:
            c3 = tr.alloc("rope", t * s.d * s.cb)
            tr.free(c2)
            c2 = c3
        out.append(c2)
    tr.free(emb, freqs)
    if s.backend != "triton":  # norm_rope_ref.rope_tables: sin with the sign folded in
        neg = tr.alloc("rope", t * s.d // 2 * s.cb)
        sin_rot = tr.alloc("rope", t * s.d * s.cb)  # cat
        tr.free(neg, out[1])
        out[1] = sin_rot
    return out[0], out[1]
