"""The one dispatch point: which implementation runs each kernel on a given device.

`select_backend(device)` returns a `KernelBackend`; the model and the KV cache call its
methods and never import an implementation module directly. Triton kernels are used on CUDA
when triton imports; the torch references run everywhere (and are the test oracles).
`HISPARSE_BACKEND=torch` forces the references (read once, when a backend is selected).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache


@lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


@dataclass(frozen=True)
class KernelBackend:
    """Names the implementation used for each kernel family on one device."""

    attention: str = "torch"  # "torch" | "triton"
    int4_linear: str = "torch"  # "torch" | "triton"

    # -- attention -------------------------------------------------------------------------
    def sparse_attention(self, *args, **kwargs):
        """See kernels/attention_ref.py:sparse_attention for the contract."""
        if self.attention == "triton":
            from hisparse_cli.kernels.attention_triton import sparse_attention

            kwargs.pop("memo", None)  # a torch-reference optimisation hint
            if kwargs.get("score_min_distance"):
                # snapkv scoring is not fused in the Triton kernels yet: attention output from
                # Triton, the observation-window masses from the reference
                from hisparse_cli.kernels.attention_ref import sparse_attention as ref

                kw = {k: v for k, v in kwargs.items() if k != "score_min_distance"}
                out, _, _ = sparse_attention(*args, **{**kw, "return_scores": False})
                _, km, gm = ref(*args, **kwargs)
                return out, km, gm
            kwargs.pop("score_min_distance", None)
        else:
            from hisparse_cli.kernels.attention_ref import sparse_attention
        return sparse_attention(*args, **kwargs)

    def store_kv(self, *args, **kwargs):
        """See kernels/attention_ref.py:store_kv for the contract."""
        if self.attention == "triton":
            from hisparse_cli.kernels.attention_triton import store_kv
        else:
            from hisparse_cli.kernels.attention_ref import store_kv
        return store_kv(*args, **kwargs)

    # -- INT4 (AWQ GEMM layout) linear -----------------------------------------------------
    def awq_linear(self, *args, **kwargs):
        """See kernels/awq_ref.py:awq_linear for the contract."""
        if self.int4_linear == "triton":
            from hisparse_cli.kernels.awq_triton import awq_linear
        else:
            from hisparse_cli.kernels.awq_ref import awq_linear
        return awq_linear(*args, **kwargs)


    def awq_linear_k(self, *args, **kwargs):
        """awq_linear with qweight in the K-major run-time layout (kernels/awq_layout.py)."""
        if self.int4_linear == "triton":
            from hisparse_cli.kernels.awq_triton import awq_linear_k
        else:
            from hisparse_cli.kernels.awq_ref import awq_linear_k
        return awq_linear_k(*args, **kwargs)


def select_backend(device_type: str, prefer: str | None = None) -> KernelBackend:
    """Backend for a device type ("cpu", "cuda", ...). prefer: "torch" | "triton" | None."""
    prefer = prefer or os.environ.get("HISPARSE_BACKEND") or "auto"
    if prefer not in ("auto", "torch", "triton"):
        from hisparse_cli.errors import ConfigError

        raise ConfigError(f"HISPARSE_BACKEND must be auto, torch or triton, got {prefer!r}")
    use_triton = device_type == "cuda" and triton_available() and prefer != "torch"
    if prefer == "triton" and not use_triton:
        from hisparse_cli.errors import ConfigError

        raise ConfigError("the triton backend needs a CUDA device and the triton package",
                          hint="unset HISPARSE_BACKEND or install triton on a CUDA machine")
    name = "triton" if use_triton else "torch"
    return KernelBackend(attention=name, int4_linear=name)
