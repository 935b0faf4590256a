"""Triton RMSNorm (optionally fused with the residual add before it), rotate-half RoPE (alone,
or with the step's K/V store into the paged cache: rope_store_kv), and the gated MLP's
silu(gate) * up in place.

Torch references: kernels/norm_rope/norm_rope_ref.py. One launch replaces the ~8 elementwise kernels of
an fp16 RMSNorm and the ~5 of RoPE. Rounding follows the references step by step: the
statistics in fp32, the normalised row rounded to the dtype before the weight product (done
in fp32, rounded once), RoPE's two products each rounded to the dtype before their sum, so
fp16/bf16 outputs match the references up to the fp32 sum order and rsqrt ulps (RoPE
exactly, in fp16/bf16). Outputs are new contiguous tensors and nothing else is allocated:
CUDA-graph capturable, and the planner (planner_trace.rms_norm / rope) counts only them.

v1: one program per ROWS rows of x [R, H] (ROWS > 1 for short rows such as q/k heads);
    RoPE: one program per (token, block of heads) over both halves of D; silu * up: one
    program per (token, SILU_BLOCK columns), one launch instead of torch's two (silu in
    place, then the product), reading gate and up once.
rope_store_kv (H200 run 86): RoPE's programs over all q|k|v heads of the stacked projection,
    q heads to q, k (rotated) and v heads to their cache slot: one launch a layer instead of
    rope + store_kv (attention_triton), the same bits; decode neutral (+0.1-0.2 % INT4).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hisparse_cli.kernels.pdl import chain_args
from hisparse_cli.kernels.pdl import enter as pdl_enter


@triton.jit(do_not_specialize=["R"])
def _rms_norm(x_ptr, y_ptr, w_ptr, out_ptr, sum_ptr, R, B, sxa, sxb, sya, syb, eps,
              H: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr,
              HAS_RES: tl.constexpr, PDL_WAIT: tl.constexpr = False,
              PDL_TRIGGER: tl.constexpr = False):
    """Rows r = a * B + b of x (offset a * sxa + b * sxb, unit stride along H); HAS_RES: the
    row is x + y (stored to sum_ptr, contiguous) before the norm; out is contiguous.
    PDL_WAIT / PDL_TRIGGER: kernels/pdl.py (the next kernel, often a decode GEMV, may be
    scheduled now). R (the rows: a step's tokens, 1 in decode, the chunk or a ragged last
    chunk in prefill) is not specialized: it only bounds the row mask, and Triton's value
    classes (== 1, divisible by 16) would compile up to three variants per call site; B and
    the strides are fixed per model and stay specialized (16-byte row addresses)."""
    pdl_enter(PDL_WAIT, PDL_TRIGGER)
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows < R)[:, None] & (cols < H)[None, :]
    a, b = rows // B, rows % B
    x = tl.load(x_ptr + (a * sxa + b * sxb)[:, None] + cols[None, :], mask=mask, other=0.0)
    dst = rows[:, None] * H + cols[None, :]
    if HAS_RES:
        y = tl.load(y_ptr + (a * sya + b * syb)[:, None] + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + y.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + dst, x, mask=mask)
    xf = x.to(tl.float32)
    ms = tl.sum(xf * xf, axis=1) / H
    xn = (xf * tl.rsqrt(ms + eps)[:, None]).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    tl.store(out_ptr + dst, (w[None, :] * xn.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _rope(x_ptr, cos_ptr, sin_ptr, out_ptr, NH, sxt, sxh, sct, sst,
          HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
          PDL_WAIT: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = False):
    """out[t, h] = x * cos + cat(-x2, x1) * sin for heads h of token t; out contiguous."""
    pdl_enter(PDL_WAIT, PDL_TRIGGER)
    t = tl.program_id(0).to(tl.int64)
    h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dm = d < HALF
    mask = (h < NH)[:, None] & dm[None, :]
    src = x_ptr + t * sxt + h[:, None] * sxh + d[None, :]
    dt = out_ptr.dtype.element_ty
    x1, x2, o1, o2 = _rope_rows(src, mask, cos_ptr + t * sct, sin_ptr + t * sst, d, dm, dt,
                                HALF)
    dst = out_ptr + (t * NH + h[:, None]) * (2 * HALF) + d[None, :]
    tl.store(dst, o1, mask=mask)
    tl.store(dst + HALF, o2, mask=mask)


@triton.jit
def _rope_rows(src, mask, cos_row, sin_row, d, dm, dt: tl.constexpr, HALF: tl.constexpr):
    """(x1, x2, o1, o2): the two halves [rows, BLOCK_D] at src / src + HALF (fp32) and their
    rotation in dt by one token's cos / sin rows (dm: d < HALF)."""
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_row + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_row + HALF + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_row + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_row + HALF + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    o1, o2 = _rotate(x1, x2, c1, c2, s1, s2, dt)
    return x1, x2, o1, o2


@triton.jit
def _rotate(x1, x2, c1, c2, s1, s2, dt: tl.constexpr):
    """Rotate-half RoPE of the halves x1, x2 (fp32) in dtype dt: each product rounded to dt,
    then their sum (the reference's three roundings)."""
    o1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
    o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    return o1.to(dt), o2.to(dt)


@triton.jit
def _rope_store_kv(qkv_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr, vc_ptr, slot_ptr, sxt, sct, sst,
                   stride_cb, stride_cs, stride_ch, HQ: tl.constexpr, HKV: tl.constexpr,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                   BS: tl.constexpr, PDL_WAIT: tl.constexpr = False,
                   PDL_TRIGGER: tl.constexpr = False):
    """Heads h of token t's stacked projection row (q | k | v heads of 2 HALF values): q heads
    rotated into q [T, HQ, D]; k heads rotated and v heads as they are, into the paged cache
    at slot_mapping[t] (converted to the cache dtype; a negative slot writes nothing). The
    rotation is _rope's, so q and the stored k are bit-identical to rope() then store_kv()."""
    pdl_enter(PDL_WAIT, PDL_TRIGGER)
    t = tl.program_id(0).to(tl.int64)
    h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dm = (d < HALF)[None, :]
    mask = (h < HQ + 2 * HKV)[:, None] & dm
    src = qkv_ptr + t * sxt + h[:, None] * (2 * HALF) + d[None, :]
    dt = q_ptr.dtype.element_ty
    x1, x2, o1, o2 = _rope_rows(src, mask, cos_ptr + t * sct, sin_ptr + t * sst, d, d < HALF,
                                dt, HALF)
    qd = q_ptr + (t * HQ + h[:, None]) * (2 * HALF) + d[None, :]
    qm = (h < HQ)[:, None] & dm
    tl.store(qd, o1, mask=qm)
    tl.store(qd + HALF, o2, mask=qm)
    slot = tl.load(slot_ptr + t)
    base = (slot // BS) * stride_cb + (slot % BS) * stride_cs + d[None, :]
    is_v = (h >= HQ + HKV)[:, None]
    kv_h = tl.where(is_v, h[:, None] - HQ - HKV, h[:, None] - HQ)
    cdt = kc_ptr.dtype.element_ty
    lo = tl.where(is_v, x1.to(dt), o1).to(cdt)  # v: the projection's values (dtype dt)
    hi = tl.where(is_v, x2.to(dt), o2).to(cdt)
    dst = base + kv_h * stride_ch
    n_kv = tl.where(slot >= 0, HKV, 0)  # a padding slot stores no head
    km = ((h >= HQ) & (h < HQ + n_kv))[:, None] & dm
    vm = ((h >= HQ + HKV) & (h < HQ + HKV + n_kv))[:, None] & dm
    tl.store(kc_ptr + dst, lo, mask=km)
    tl.store(kc_ptr + dst + HALF, hi, mask=km)
    tl.store(vc_ptr + dst, lo, mask=vm)
    tl.store(vc_ptr + dst + HALF, hi, mask=vm)


def _warps(elems: int) -> int:
    return 16 if elems >= 8192 else 8 if elems >= 2048 else 4


def norm_config(h: int) -> tuple[int, int, int]:
    """(BLOCK_H, ROWS, num_warps) for rows of h elements."""
    block = triton.next_power_of_2(h)
    rows = max(1, min(16, 1024 // block))
    return block, rows, _warps(block * rows)


def _rows_view(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(rows of the outer dim, inner count B, stride of the outer dim, of the inner) for x
    [A, H] or [A, B, H] with unit stride along H."""
    assert x.stride(-1) == 1 or x.shape[-1] == 1, "rows must be contiguous along H"
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    assert x.dim() == 3, f"rms_norm takes [R, H] or [T, heads, H], got {tuple(x.shape)}"
    return x.shape[0], x.shape[1], x.stride(0), x.stride(1)


def _launch_norm(x, y, weight, eps, out, s):
    h = x.shape[-1]
    a, b, sxa, sxb = _rows_view(x)
    _, _, sya, syb = _rows_view(y) if y is not None else (a, b, 0, 0)
    r = a * b
    if r == 0:
        return
    block, rows, warps = norm_config(h)
    _rms_norm[(triton.cdiv(r, rows),)](
        x, y if y is not None else x, weight, out, s if s is not None else out, r, b,
        sxa, sxb, sya, syb, float(eps), H=h, BLOCK_H=block, ROWS=rows,
        HAS_RES=y is not None, num_warps=warps, **chain_args(x.device))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [R, H] or [T, heads, H] (any outer strides), weight [H] in x's dtype -> a new
    contiguous tensor of x's shape (norm_rope_ref.rms_norm)."""
    assert weight.shape == (x.shape[-1],) and weight.dtype == x.dtype, (weight.shape, x.dtype)
    assert weight.is_contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_norm(x, None, weight, eps, out, None)
    return out


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, y [R, H] (any row strides) -> (s = x + y, rms_norm(s)), both new and contiguous
    (norm_rope_ref.add_rms_norm); s is allocated first."""
    assert x.dim() == 2 and y.shape == x.shape and y.dtype == x.dtype, (x.shape, y.shape)
    assert weight.shape == (x.shape[-1],) and weight.dtype == x.dtype and weight.is_contiguous()
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_norm(x, y, weight, eps, out, s)
    return s, out


@triton.jit
def _silu_mul(gu_ptr, INTER, stride_t, BLOCK: tl.constexpr, PDL_WAIT: tl.constexpr = False,
              PDL_TRIGGER: tl.constexpr = False):
    """gu[t, c] = rnd(rnd(silu(gu[t, c])) * gu[t, INTER + c]) for c < INTER (in place)."""
    pdl_enter(PDL_WAIT, PDL_TRIGGER)  # kernels/pdl.py: the down projection's GEMV may start
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    row = gu_ptr + t * stride_t
    g = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(row + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(gu_ptr.dtype.element_ty).to(tl.float32)
    tl.store(row + cols, (s * u).to(gu_ptr.dtype.element_ty), mask=mask)


SILU_BLOCK = 1024  # columns per program (4 warps, 8 elements a thread)


def silu_mul_(gu: torch.Tensor, inter: int) -> torch.Tensor:
    """gu [T, 2 inter] (unit stride along columns, any row stride) -> its gate half, now
    silu(gate) * up, in place (norm_rope_ref.silu_mul_); nothing is allocated."""
    assert gu.dim() == 2 and gu.shape[1] == 2 * inter and gu.stride(1) == 1, (gu.shape,
                                                                              gu.stride())
    if gu.numel():
        _silu_mul[(gu.shape[0], triton.cdiv(inter, SILU_BLOCK))](
            gu, inter, gu.stride(0), BLOCK=SILU_BLOCK, num_warps=4, **chain_args(gu.device))
    return gu[:, :inter]


def rope_config(heads: int, half: int) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_D, num_warps): up to 2048 elements of each half per program."""
    bd = triton.next_power_of_2(half)
    bh = max(1, min(triton.next_power_of_2(heads), 2048 // bd))
    return bh, bd, _warps(bh * bd)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (any strides over T and H, unit along D), cos/sin [T, D] in x's dtype ->
    a new contiguous [T, H, D] (norm_rope_ref.rope)."""
    t, nh, d = x.shape
    assert d % 2 == 0 and x.stride(2) == 1, (x.shape, x.stride())
    assert cos.shape == (t, d) and sin.shape == (t, d), (cos.shape, sin.shape, x.shape)
    assert cos.dtype == x.dtype and sin.dtype == x.dtype, (cos.dtype, x.dtype)
    assert cos.stride(1) == 1 and sin.stride(1) == 1, "cos/sin must be contiguous along D"
    out = torch.empty((t, nh, d), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    bh, bd, warps = rope_config(nh, d // 2)
    _rope[(t, triton.cdiv(nh, bh))](x, cos, sin, out, nh, x.stride(0), x.stride(1),
                                    cos.stride(0), sin.stride(0), HALF=d // 2, BLOCK_H=bh,
                                    BLOCK_D=bd, num_warps=warps, **chain_args(x.device))
    return out


def rope_store_kv(qkv: torch.Tensor, hq: int, hkv: int, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> torch.Tensor:
    """The stacked projection's output qkv [T, (hq + 2 hkv) D] (unit stride along columns) ->
    q = rope(q heads), a new contiguous [T, hq, D]; rope(k heads) and the v heads are written
    into k_cache / v_cache [num_blocks, block_size, hkv, D] at slot_mapping[t] (negative:
    skipped). One launch for what rope() and store_kv() do in two (norm_rope_ref.rope_store_kv)."""
    t = qkv.shape[0]
    nb, bs, hkv_c, d = k_cache.shape
    assert qkv.dim() == 2 and qkv.shape[1] == (hq + 2 * hkv) * d and qkv.stride(1) == 1, \
        (qkv.shape, qkv.stride(), hq, hkv, d)
    assert hkv_c == hkv and v_cache.shape == k_cache.shape and \
        v_cache.stride() == k_cache.stride() and k_cache.stride(-1) == 1, "cache layout"
    assert d % 2 == 0 and cos.shape == (t, d) and sin.shape == (t, d), (cos.shape, d)
    assert cos.dtype == sin.dtype == qkv.dtype and cos.stride(1) == 1 and sin.stride(1) == 1
    assert slot_mapping.shape == (t,) and slot_mapping.dtype in (torch.int32, torch.int64)
    q = torch.empty((t, hq, d), dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    slots = slot_mapping if slot_mapping.is_contiguous() else slot_mapping.contiguous()
    heads = hq + 2 * hkv
    bh, bd, warps = rope_config(heads, d // 2)
    _rope_store_kv[(t, triton.cdiv(heads, bh))](
        qkv, cos, sin, q, k_cache, v_cache, slots, qkv.stride(0), cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), HQ=hq, HKV=hkv, HALF=d // 2,
        BLOCK_H=bh, BLOCK_D=bd, BS=bs, num_warps=warps, **chain_args(qkv.device))
    return q
