"""Triton backend of the paged sparse attention contract (selected by kernels/dispatch.py).

Same signatures and semantics as kernels/attention/attention_ref.py (the torch oracle):
    store_kv(k_cache, v_cache, k, v, slot_mapping)                 -> store_kv_triton.py
    sparse_attention(q, k_cache, v_cache, block_ids, block_starts, q_start, sinks, window,
                     scale, g_k=None, g_v=None, g_pos=None, return_scores=False)
        -> (out [T, Hq, D] q.dtype, key_mass [Hkv, nb*bs] fp32 | None, global_mass | None)
plus keyword-only tuning knobs the reference does not have:
    num_splits:   key splits per (row tile, KV head); None = fill the GPU (flash-decoding)
    score_stride: importance from every r-th query (see importance_triton.py); None = exact
                  for T < 64, else `default_score_stride` (cost-aware, at most 8). Steps with
                  T*GRP <= 16 (decode) are always exact, from the logits the kernel stored.
    config:       AttnConfig overriding the tile/warp choice (benchmarks, tests).
    scores_into:  (score [capacity, block_size, Hkv] fp32, global_mass [Hkv, G], global_seen
                  [Hkv, G]) of one layer: with return_scores the mass kernels add the step's
                  masses there themselves (key j's into score[block_ids[j // bs], j % bs],
                  the globals' into global_mass, T into global_seen; `accumulate_scores` in
                  attention_ref.py is the reference) and (out, None, None) is returned: no mass
                  tensors, no index_add / add kernels after the step.

Kernels: attention_fwd_triton.py (forward + split reduce), importance_triton.py (mass). A
decode step with split keys and stored logits (the engine's decode) launches two: the forward,
whose last split program per KV head writes the rows' lse, then `_attn_reduce_mass` (the
reduce and the mass in one launch; H200 run 53: +2-6 % INT4 decode, +1-3 % fp16 at 32K against
the two launches `fuse_reduce_mass=False` makes, the tests' oracle).
Everything is launched asynchronously: no host sync, so decode steps can be graph-captured.
Invisible cache slots inside visited blocks must hold finite values (as for the reference).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton

from hisparse_cli.kernels.attention.attention_fwd_triton import _attn_fwd, _attn_reduce
from hisparse_cli.kernels.attention.importance_triton import (_attn_reduce_mass, _mass_from_logits,
                                                    _mass_recompute)
from hisparse_cli.kernels.pdl import chain_args
from hisparse_cli.kernels.attention.store_kv_triton import store_kv

__all__ = ["store_kv", "sparse_attention", "AttnConfig", "choose_config", "default_score_stride"]

MAX_SCORE_STRIDE = 8  # coarsest default query subsampling for prefill importance
SCORE_BUDGET = 0.03  # default stride keeps scoring under ~3% of a layer's weight work
EXACT_SCORE_MAX_T = 64  # steps shorter than this are scored from every query
LOGITS_MAX_ROWS = 16  # T * GRP <= this: exact mass from stored logits (no K re-read)
LOG2E = 1.4426950408889634
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class AttnConfig:
    block_m: int = 128  # rows (query x group head) per program
    block_n: int = 64  # keys per tile
    num_warps: int = 8
    num_stages: int = 2
    score_block_m: int = 64  # sampled rows per scoring tile
    score_block_n: int = 128  # keys per scoring program (H200 sweeps, runs 1 and 13: 64x128
    # tiles beat 64x64 by 15 % with exact scores and by a third at stride 16)
    score_warps: int = 4
    full_tiles: bool = True  # prefill: unmasked loop for the tiles every row sees in full


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output/workspace comes from here (tests swap it for a NaN-poisoning version)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _interpreting() -> bool:
    from hisparse_cli.config.env import triton_interpret

    return triton_interpret()


@lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: small, so CPU tests exercise the split path


@lru_cache(maxsize=64)
def choose_config(n_rows: int, head_dim: int, fp32: bool = False) -> AttnConfig:
    """Tiles for a step with n_rows = T * GRP query rows per KV head (fp32: FMA dots)."""
    if fp32:  # fallback for fp32 caches: small tiles keep the FMA dots out of local memory
        wide = head_dim > 64
        return AttnConfig(block_m=16 if n_rows <= 16 else 32, block_n=16 if wide else 32,
                          num_warps=8 if wide else 4, num_stages=2, score_block_m=32,
                          score_block_n=16 if wide else 32, score_warps=8 if wide else 4)
    if n_rows <= 16:  # decode: memory bound, a 16-row MMA is the floor
        return AttnConfig(block_m=16, block_n=64, num_warps=4, num_stages=2)
    if n_rows <= 64:
        return AttnConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)
    return AttnConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)


def default_score_stride(t_len: int, visible_keys: int, hq: int, head_dim: int) -> int:
    """Smallest power-of-two query stride whose scoring work fits SCORE_BUDGET of the layer.

    Exact scoring (q.k + exp per visible pair) costs about 0.7x the attention itself, i.e.
    ~2.8 * keys * Hq * D per query token; a Llama-family layer's projections cost ~26 * h^2
    per token with hidden size h ~= Hq * D. Ratio ~= keys / (9 * Hq * D): 1280 keys of an 8B
    model (h = 4096) give stride 1-2, a 10K-key window (8192 + chunk + globals) stride 4-8.
    """
    if t_len < EXACT_SCORE_MAX_T:
        return 1
    ratio = visible_keys / (9.0 * hq * head_dim)
    stride = 1
    while stride < MAX_SCORE_STRIDE and ratio / stride > SCORE_BUDGET:
        stride *= 2
    return stride


SPLIT_COUNTERS = 1 << 12  # (row tile, KV head) counters of the forward's lse tail


@lru_cache(maxsize=8)
def _counter_buffer(device: torch.device) -> torch.Tensor:
    """Zeros, made once per device (at the first fused decode step: the graph decoder's eager
    warm-up, before any capture); every call leaves them at zero again."""
    return torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=device)


def _split_counters(device: torch.device, n: int) -> torch.Tensor:
    assert n <= SPLIT_COUNTERS, f"{n} (row tile, KV head) pairs: more than {SPLIT_COUNTERS}"
    return _counter_buffer(device)


def _pick_splits(m_tiles: int, hkv: int, key_tiles: int, device: torch.device) -> int:
    progs = m_tiles * hkv
    target = 2 * _num_sms(device)
    if progs >= target // 2 or key_tiles < 4:
        return 1
    return max(1, min(math.ceil(target / progs), key_tiles // 2, 64))


def sparse_attention(q, k_cache, v_cache, block_ids, block_starts, q_start, sinks, window, scale,
                     g_k=None, g_v=None, g_pos=None, return_scores=False, *,
                     num_splits: int | None = None, score_stride: int | None = None,
                     config: AttnConfig | None = None, scores_into: tuple | None = None,
                     fuse_reduce_mass: bool = True):
    t_len, hq, d = q.shape
    n_blocks, bs, hkv, _ = k_cache.shape
    assert hq % hkv == 0, f"Hq={hq} is not a multiple of Hkv={hkv}"
    grp = hq // hkv
    assert q.dtype in _DTYPES and k_cache.dtype in _DTYPES and q.stride(-1) == 1
    assert k_cache.shape[-1] == d and d >= 16 and d & (d - 1) == 0, f"head_dim {d}: power of 2 >= 16"
    assert v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride()
    assert k_cache.stride(-1) == 1 and v_cache.dtype == k_cache.dtype
    assert block_ids.shape == block_starts.shape and block_ids.ndim == 1 and block_ids.numel() > 0
    assert block_ids.is_contiguous() and block_starts.is_contiguous()
    assert block_ids.dtype in (torch.int32, torch.int64) and block_starts.dtype == torch.int64
    assert q.device == k_cache.device == block_ids.device == block_starts.device
    has_g = g_k is not None and g_k.shape[1] > 0
    G = g_k.shape[1] if has_g else 0
    if has_g:
        assert g_k.shape == (hkv, G, d) and g_v.shape == g_k.shape and g_pos.shape == (hkv, G)
        assert g_k.stride(-1) == 1 and g_v.stride() == g_k.stride() and g_pos.stride(-1) == 1
        assert g_k.dtype == k_cache.dtype == g_v.dtype and g_pos.dtype == torch.int64
    assert t_len > 0
    nb = block_ids.shape[0]
    n_keys = nb * bs
    n_rows = t_len * grp
    cfg = config or choose_config(n_rows, d, fp32=k_cache.dtype == torch.float32)
    assert cfg.block_m >= 16 and cfg.block_n >= 16 and cfg.score_block_m >= 16, "MMA tiles >= 16"
    windowed = window is not None
    dev = q.device
    upcast = _interpreting() or k_cache.dtype == torch.float32
    m_tiles = triton.cdiv(n_rows, cfg.block_m)
    visible_keys = min(n_keys, (window + sinks + t_len) if windowed else n_keys)
    key_tiles = triton.cdiv(visible_keys, cfg.block_n) + triton.cdiv(G, cfg.block_n)
    splits = num_splits or _pick_splits(m_tiles, hkv, key_tiles, dev)
    store_s = return_scores and n_rows <= LOGITS_MAX_ROWS
    # reduce + mass in one launch (below); the forward's last split program writes the lse
    fused = fuse_reduce_mass and splits > 1 and store_s and m_tiles == 1
    write_lse = return_scores
    p2 = triton.next_power_of_2(splits)

    out = _alloc((t_len, hq, d), q.dtype, dev)
    f32 = (torch.float32, dev)
    lse = _alloc((hkv, n_rows), *f32) if write_lse else out
    s_ws = _alloc((hkv, n_rows, G + n_keys), *f32) if store_s else lse
    if splits > 1:
        m_ws = _alloc((splits, hkv, n_rows), *f32)
        l_ws = _alloc((splits, hkv, n_rows), *f32)
        acc_ws = _alloc((splits, hkv, n_rows, d), *f32)
    else:
        m_ws = l_ws = acc_ws = lse
    gk, gv, gp = (g_k, g_v, g_pos) if has_g else (k_cache, v_cache, block_starts)
    # q_start: an int, or a 1-element int64 device tensor read in-kernel (CUDA-graph replay)
    qs_tensor = torch.is_tensor(q_start)
    if qs_tensor:
        assert q_start.numel() == 1 and q_start.device == dev and q_start.dtype == torch.int64
    qs_ptr, q_start = (q_start, 0) if qs_tensor else (block_starts, int(q_start))
    _attn_fwd[(m_tiles, hkv, splits)](
        q, k_cache, v_cache, block_ids, block_starts, gk, gv, gp,
        out, lse, m_ws, l_ws, acc_ws, s_ws,
        t_len, nb, G, q_start, sinks if windowed else 0, window if windowed else 0,
        scale * LOG2E, splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        gk.stride(0) if has_g else 0, gk.stride(1) if has_g else 0,
        gp.stride(0) if has_g else 0,
        s_ws.stride(0) if store_s else 0, s_ws.stride(1) if store_s else 0, qs_ptr,
        _split_counters(dev, m_tiles * hkv) if fused else qs_ptr,
        LSE_TAIL=fused, SPLIT_P2=p2 if fused else 1, QS_PTR=qs_tensor, HKV=hkv, GRP=grp, D=d,
        BS=bs, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CB=256,
        WINDOWED=windowed, HAS_G=has_g, SPLIT=splits > 1, SCAN=m_tiles > 1,
        FULL_TILES=cfg.full_tiles and m_tiles > 1 and splits == 1, WRITE_LSE=write_lse,
        STORE_S=store_s, UPCAST=upcast, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **chain_args(dev))
    if splits > 1 and not fused:
        _attn_reduce[(n_rows, hkv)](
            m_ws, l_ws, acc_ws, out, lse, t_len, splits, out.stride(0), out.stride(1),
            HKV=hkv, GRP=grp, D=d, SPLIT_P2=p2, WRITE_LSE=write_lse,
            num_warps=8 if p2 * d >= 8192 else 4, **chain_args(dev))
    if not return_scores:
        return out, None, None

    accum = scores_into is not None
    if accum:  # add into the run's score tensors; nothing is returned (see the module doc)
        score_l, gmass_acc, gseen_acc = scores_into
        assert score_l.dtype == torch.float32 and score_l.is_contiguous()
        assert score_l.shape[1:] == (bs, hkv) and score_l.device == dev
        if has_g:
            assert gmass_acc.shape == gseen_acc.shape == (hkv, G)
            assert gmass_acc.is_contiguous() and gseen_acc.is_contiguous()
        key_mass, g_mass = score_l, gmass_acc if has_g else score_l
        g_seen = gseen_acc if has_g else score_l
        sb, so = score_l.stride(0), score_l.stride(1)
    else:
        key_mass = _alloc((hkv, n_keys), *f32)
        g_mass = _alloc((hkv, G), *f32) if has_g else key_mass
        g_seen, sb, so = key_mass, 0, 0
    common = dict(t_len=t_len, n_keys=n_keys, G=G, q_start=q_start,
                  sinks=sinks if windowed else 0, window=window if windowed else 0)
    if fused:
        bn = 128
        _attn_reduce_mass[(n_rows + triton.cdiv(G + n_keys, bn), hkv)](
            m_ws, l_ws, acc_ws, out, lse, s_ws, block_ids, block_starts, gp, key_mass, g_mass,
            g_seen, *common.values(), splits, out.stride(0), out.stride(1), s_ws.stride(0),
            s_ws.stride(1), gp.stride(0) if has_g else 0, sb, so, qs_ptr,
            HKV=hkv, GRP=grp, D=d, BS=bs, SPLIT_P2=p2, BLOCK_R=LOGITS_MAX_ROWS, BLOCK_N=bn,
            WINDOWED=windowed, HAS_G=has_g, QS_PTR=qs_tensor, ACCUM=accum,
            num_warps=4, **chain_args(dev))  # 4: the mass programs' tiles (most programs)
    elif store_s:
        bn = 128
        _mass_from_logits[(triton.cdiv(G + n_keys, bn), hkv)](
            s_ws, lse, block_ids, block_starts, gp, key_mass, g_mass, g_seen,
            *common.values(), s_ws.stride(0), s_ws.stride(1), gp.stride(0) if has_g else 0,
            sb, so, qs_ptr,
            QS_PTR=qs_tensor, GRP=grp, BS=bs, BLOCK_R=16, BLOCK_N=bn, WINDOWED=windowed, HAS_G=has_g,
            ACCUM=accum, num_warps=4, **chain_args(dev))
    else:
        stride = score_stride or default_score_stride(t_len, visible_keys + G, hq, d)
        assert stride >= 1
        bn = cfg.score_block_n
        _mass_recompute[(triton.cdiv(G + n_keys, bn), hkv)](
            q, k_cache, block_ids, block_starts, gk, gp, lse, key_mass, g_mass, g_seen,
            *common.values(), scale * LOG2E, stride,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            gk.stride(0) if has_g else 0, gk.stride(1) if has_g else 0,
            gp.stride(0) if has_g else 0, sb, so, qs_ptr,
            QS_PTR=qs_tensor, GRP=grp, D=d, BS=bs, BLOCK_M=cfg.score_block_m, BLOCK_N=bn, WINDOWED=windowed,
            HAS_G=has_g, UPCAST=upcast, ACCUM=accum, num_warps=cfg.score_warps, num_stages=2)
    if accum:
        return out, None, None
    return out, key_mass, (g_mass if has_g else None)
