"""The one dispatch point: which implementation runs each kernel on a given device.

`select_backend(device)` returns a `KernelBackend`; the model and the KV cache call its
methods and never import an implementation module directly. Triton kernels are used on CUDA
when triton imports; the torch references run everywhere (and are the test oracles).
`HISPARSE_BACKEND=torch` forces the references (read once, when a backend is selected); on
the CPU the default ("auto") runs decode-sized AWQ INT4 calls through torch's packed int4
kernel (kernels/int4/awq_cpu.py), `torch` keeps the exact fp32 reference there too.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache



@lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether Triton imports (once a process). Before the import, its cache is pointed at
    hisparse's toolchain-keyed folder; after it, its compiles are counted
    (kernels/compile_cache.py, kernels/compile_log.py)."""
    from hisparse_cli.kernels.compile_cache import use_triton_cache
    from hisparse_cli.kernels.compile_log import watch_triton

    use_triton_cache()
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    watch_triton()
    return True


@dataclass(frozen=True)
class KernelBackend:
    """Names the implementation used for each kernel family on one device."""

    attention: str = "torch"  # "torch" | "triton"
    int4_linear: str = "torch"  # "torch" | "triton" | "int4pack" (CPU: kernels/int4/awq_cpu.py)
    elementwise: str = "torch"  # "torch" | "triton": RMSNorm (+ residual add), RoPE, silu * up

    # -- attention -------------------------------------------------------------------------
    def sparse_attention(self, *args, scores_into: tuple | None = None, **kwargs):
        """See kernels/attention/attention_ref.py:sparse_attention for the contract. With scores_into
        (a layer's score, global_mass, global_seen) and return_scores, the step's masses are
        added there (`attention_ref.accumulate_scores`; the Triton kernels do it themselves)
        and (out, None, None) is returned."""
        if scores_into is not None and kwargs.get("return_scores"):
            if self.attention == "triton" and not kwargs.get("score_min_distance"):
                from hisparse_cli.kernels.attention.attention_triton import sparse_attention

                kwargs.pop("memo", None)
                return sparse_attention(*args, scores_into=scores_into, **kwargs)
            from hisparse_cli.kernels.attention.attention_ref import accumulate_scores

            out, key_mass, g_mass = self.sparse_attention(*args, **kwargs)
            block_ids = args[3] if len(args) > 3 else kwargs["block_ids"]
            q = args[0] if args else kwargs["q"]
            accumulate_scores(scores_into, block_ids, key_mass, g_mass, q.shape[0])
            return out, None, None
        if self.attention == "triton":
            from hisparse_cli.kernels.attention.attention_triton import sparse_attention

            kwargs.pop("memo", None)  # a torch-reference optimisation hint
            if kwargs.get("score_min_distance"):
                # snapkv scoring is not fused in the Triton kernels yet: attention output from
                # Triton, the observation-window masses from the reference
                from hisparse_cli.kernels.attention.attention_ref import sparse_attention as ref

                kw = {k: v for k, v in kwargs.items() if k != "score_min_distance"}
                out, _, _ = sparse_attention(*args, **{**kw, "return_scores": False})
                _, km, gm = ref(*args, **kwargs)
                return out, km, gm
            kwargs.pop("score_min_distance", None)
        else:
            from hisparse_cli.kernels.attention.attention_ref import sparse_attention
        return sparse_attention(*args, **kwargs)

    def store_kv(self, *args, **kwargs):
        """See kernels/attention/attention_ref.py:store_kv for the contract."""
        if self.attention == "triton":
            from hisparse_cli.kernels.attention.attention_triton import store_kv
        else:
            from hisparse_cli.kernels.attention.attention_ref import store_kv
        return store_kv(*args, **kwargs)

    def rope_store_kv(self, qkv, hq: int, hkv: int, cos, sin, k_cache, v_cache, slot_mapping):
        """RoPE of the stacked projection's q and k heads (qkv [T, (hq + 2 hkv) D], cos/sin
        [T, D]), k and v stored at slot_mapping (norm_rope_ref.rope_store_kv) -> q [T, hq, D].
        One Triton kernel where RoPE and store_kv would both run in Triton and its layout
        applies (32 launches a Llama-3-8B token fewer; run 86: neutral in time, kept for the
        launches), else self.rope then self.store_kv: the same values."""
        t, d = qkv.shape[0], k_cache.shape[-1]
        if (self.elementwise == "triton" and self.attention == "triton"
                and qkv.dim() == 2 and qkv.stride(-1) == 1 and k_cache.stride(-1) == 1
                and cos.dtype == sin.dtype == qkv.dtype and cos.stride(-1) == 1
                and sin.stride(-1) == 1):
            from hisparse_cli.kernels.norm_rope.norm_rope_triton import rope_store_kv

            return rope_store_kv(qkv, hq, hkv, cos, sin, k_cache, v_cache, slot_mapping)
        qk = self.rope(qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d), cos, sin)
        self.store_kv(k_cache, v_cache, qk[:, hq:], qkv[:, (hq + hkv) * d:].view(t, hkv, d),
                      slot_mapping)
        return qk[:, :hq]

    # -- retrieval tier: page summaries, page scoring + top-k, the page cache --------------
    # (kernels/attention/page_score_ref.py and page_cache_ref.py have the contracts)
    def page_summary(self, pages, kind: str):
        from hisparse_cli.kernels.attention.page_score_ref import page_summary

        return page_summary(pages, kind)

    def _pow2_heads(self, d: int) -> bool:
        return self.attention == "triton" and d >= 16 and d & (d - 1) == 0

    def score_top_pages(self, q, lo, hi, k: int, scale: float):
        """[Hkv, k] best pages per KV head, ascending: Triton scoring (no [rows, pages]
        tensor) where the attention runs in Triton and the head size is a power of two."""
        if self._pow2_heads(q.shape[-1]):
            from hisparse_cli.kernels.attention.page_score_triton import score_top_pages
        else:
            from hisparse_cli.kernels.attention.page_score_ref import score_top_pages
        return score_top_pages(q, lo, hi, k, scale)

    def page_scores_in_range(self, q, lo, hi, rng, scale: float):
        """[Hkv, P] scores of the pages in the device range rng = (first, n) of whole summary
        tables, -1 elsewhere (static shapes: the CUDA-graph decode step)."""
        if self._pow2_heads(q.shape[-1]):
            from hisparse_cli.kernels.attention.page_score_triton import page_scores_in_range

            return page_scores_in_range(q, lo, hi, rng, scale)
        from hisparse_cli.kernels.attention.page_score_ref import page_scores_in_range

        return page_scores_in_range(q, lo, hi, rng, scale)

    def place_pages(self, picks, slot_page, slot_used, step, row_of_page, counts):
        """Page-cache slots of a step's picks (LRU), on the device: fill_row [Hkv, S]."""
        if self.attention == "triton":
            from hisparse_cli.kernels.attention.page_cache_triton import place_pages
        else:
            from hisparse_cli.kernels.attention.page_cache_ref import place_pages
        return place_pages(picks, slot_page, slot_used, step, row_of_page, counts)

    def fill_page_slots(self, dst_k, dst_v, src_k, src_v, fill_row, slot_page, slot_used,
                        step, gpos, pos_out) -> None:
        """The missing pages copied into their slots and the slots' positions written."""
        bs, d = dst_k.shape[2], dst_k.shape[3]
        if self._pow2_heads(d) and bs & (bs - 1) == 0:
            from hisparse_cli.kernels.attention.page_cache_triton import fill_page_slots
        else:
            from hisparse_cli.kernels.attention.page_cache_ref import fill_page_slots
        fill_page_slots(dst_k, dst_v, src_k, src_v, fill_row, slot_page, slot_used, step, gpos,
                        pos_out)

    # -- INT4 (AWQ GEMM layout) linear -----------------------------------------------------
    def awq_linear(self, x, qweight, qzeros, scales, bias, group_size, *, cpu_pack=None):
        """See kernels/int4/awq_ref.py:awq_linear for the contract. cpu_pack: the layer's
        (packed, scales-and-zeros) CPU copy (kernels/int4/awq_cpu.py), which runs calls of at most
        CPU_INT4_MAX_TOKENS rows on the CPU; the CPU backend's other calls dequantize with
        awq_cpu.dequantize_cpu (the reference's bits); other backends: the reference (or,
        with Triton, the AWQ-layout Triton kernels)."""
        if self.int4_linear == "int4pack" and x.device.type == "cpu":
            from hisparse_cli.kernels.int4.awq_cpu import (CPU_INT4_MAX_TOKENS, awq_linear_dequant,
                                                      int4pack_linear)

            if cpu_pack is not None and 0 < x.shape[:-1].numel() <= CPU_INT4_MAX_TOKENS:
                return int4pack_linear(x, cpu_pack[0], cpu_pack[1], bias, group_size)
            return awq_linear_dequant(x, qweight, qzeros, scales, bias, group_size)
        if self.int4_linear == "triton":
            from hisparse_cli.kernels.int4.awq_triton import awq_linear
        else:
            from hisparse_cli.kernels.int4.awq_ref import awq_linear
        return awq_linear(x, qweight, qzeros, scales, bias, group_size)

    def awq_linear_k(self, *args, **kwargs):
        """awq_linear with qweight in the K-major run-time layout (kernels/int4/awq_layout.py)."""
        if self.int4_linear == "triton":
            from hisparse_cli.kernels.int4.awq_triton import awq_linear_k
        else:
            from hisparse_cli.kernels.int4.awq_ref import awq_linear_k
        return awq_linear_k(*args, **kwargs)

    def prepare_awq_linear_k(self, qweight_k, qzeros, scales, bias, group_size,
                             tiled: bool = False):
        """x -> awq_linear_k(x, qweight_k, ...) with the weights' checks and launch constants
        done once (what AWQLinear calls per forward). tiled: the words are in
        awq_layout.tile_kmajor's order (the reference reads a K-major copy of them)."""
        if self.int4_linear == "triton":
            from hisparse_cli.kernels.int4.awq_triton import PreparedLinearK

            return PreparedLinearK(qweight_k, qzeros, scales, bias, group_size, tiled=tiled)
        from functools import partial

        from hisparse_cli.kernels.int4.awq_ref import awq_linear_k

        if tiled:
            from hisparse_cli.kernels.int4.awq_layout import untile_kmajor

            qweight_k = untile_kmajor(qweight_k, group_size)

        return partial(_ref_linear_k, awq_linear_k, qweight_k, qzeros, scales, bias, group_size)

    # -- RMSNorm, residual add + RMSNorm, RoPE -------------------------------------------
    # Triton where the kernel's layout applies (weight/cos/sin in x's dtype, unit stride
    # along the last dim), else the reference; see kernels/norm_rope/norm_rope_ref.py for the contracts.
    def rms_norm(self, x, weight, eps: float):
        if (self.elementwise == "triton" and x.dim() in (2, 3) and weight.dtype == x.dtype
                and x.stride(-1) == 1 and weight.is_contiguous()):
            from hisparse_cli.kernels.norm_rope.norm_rope_triton import rms_norm
        else:
            from hisparse_cli.kernels.norm_rope.norm_rope_ref import rms_norm
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x, y, weight, eps: float):
        """(x + y, rms_norm(x + y)); the Triton kernel writes both in one pass."""
        if (self.elementwise == "triton" and x.dim() == 2 and y.shape == x.shape
                and x.dtype == y.dtype == weight.dtype and x.stride(-1) == 1
                and y.stride(-1) == 1 and weight.is_contiguous()):
            from hisparse_cli.kernels.norm_rope.norm_rope_triton import add_rms_norm
        else:
            from hisparse_cli.kernels.norm_rope.norm_rope_ref import add_rms_norm
        return add_rms_norm(x, y, weight, eps)

    def silu_mul_(self, gu, inter: int):
        """gu [T, 2 inter] (gate | up) -> its gate half, now silu(gate) * up, in place."""
        if (self.elementwise == "triton" and gu.dim() == 2 and gu.stride(-1) == 1
                and gu.is_floating_point() and gu.element_size() in (2, 4)):
            from hisparse_cli.kernels.norm_rope.norm_rope_triton import silu_mul_
        else:
            from hisparse_cli.kernels.norm_rope.norm_rope_ref import silu_mul_
        return silu_mul_(gu, inter)

    def rope(self, x, cos, sin):
        if (self.elementwise == "triton" and x.dim() == 3 and x.shape[-1] % 2 == 0
                and x.stride(-1) == 1 and cos.dtype == sin.dtype == x.dtype
                and cos.stride(-1) == 1 and sin.stride(-1) == 1):
            from hisparse_cli.kernels.norm_rope.norm_rope_triton import rope
        else:
            from hisparse_cli.kernels.norm_rope.norm_rope_ref import rope
        return rope(x, cos, sin)


def _ref_linear_k(fn, qweight_k, qzeros, scales, bias, group_size, x):
    return fn(x, qweight_k, qzeros, scales, bias, group_size)


def select_backend(device_type: str, prefer: str | None = None) -> KernelBackend:
    """Backend for a device type ("cpu", "cuda", ...). prefer: "torch" | "triton" | None
    (None: $HISPARSE_BACKEND, else "auto"). Memoised per (device type, preference): layers
    ask on every call, and on a slow host a fresh dataclass each time showed in the profile."""
    from hisparse_cli.config.env import backend_setting

    return _backend_for(device_type, prefer or backend_setting())


@lru_cache(maxsize=32)
def _backend_for(device_type: str, prefer: str) -> KernelBackend:
    """(errors are raised, never cached)"""
    if prefer not in ("auto", "torch", "triton"):
        from hisparse_cli.errors import ConfigError

        raise ConfigError(f"HISPARSE_BACKEND must be auto, torch or triton, got {prefer!r}")
    use_triton = device_type == "cuda" and triton_available() and prefer != "torch"
    if prefer == "triton" and not use_triton:
        from hisparse_cli.errors import ConfigError

        raise ConfigError("the triton backend needs a CUDA device and the triton package",
                          hint="unset HISPARSE_BACKEND or install triton on a CUDA machine")
    name = "triton" if use_triton else "torch"
    int4 = name
    if device_type == "cpu" and prefer == "auto":
        from hisparse_cli.kernels.int4.awq_cpu import int4pack_available

        int4 = "int4pack" if int4pack_available() else "torch"
    return KernelBackend(attention=name, int4_linear=int4, elementwise=name)
