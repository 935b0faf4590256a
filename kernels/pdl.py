"""Programmatic dependent launch (PDL, sm_90+) for the decode chain of Triton kernels.

A kernel launched with PDL (`launch_pdl=True`) may start while the kernel before it in the
stream is still running: its programs are scheduled early, do work that needs nothing from
that kernel, then `gdc_wait()` blocks until the previous kernel has completed and its writes
are visible. The INT4 decode GEMV (kernels/int4/awq_gemv.py) uses it to load its first weight
tile (weights, zero points and scales are never written by a kernel) before it reads x, the
output of the kernel before it; the producers of a GEMV's x (RMSNorm, silu * up, the
attention reduce and mass kernels) call `gdc_launch_dependents()` as they start (right after
their own wait), so the GEMV's programs can be scheduled while they run (without that call
the dependent launch begins only as the producer's programs exit); the GEMV triggers its own
dependents right after its wait. Every trigger comes after its kernel's wait (or, for a
kernel launched the ordinary way, after its predecessor ended), so a kernel launched early
never runs ahead of one more than a step back.

Rules every PDL consumer here follows: nothing before `gdc_wait()` reads memory a kernel
writes or writes memory at all; every read of x and every store or atomic comes after it.
A trigger in a producer is a hint and changes nothing when the next kernel is launched the
ordinary way. Captured into CUDA graphs as programmatic edges (CUDA >= 12.3).

The decode chain's other Triton kernels (RMSNorm, RoPE, store_kv, attention, its reduce and
mass, silu * up) are PDL consumers too, with nothing before the wait: `gdc_wait()` is their
first instruction, so all their reads and writes follow the previous kernel's completion,
as in ordinary stream order; what overlaps is their launch and scheduling with the previous
kernel's tail (`chain_args`; run 46: the producers' early trigger +5.9 % INT4 decode, +1.7 %
without it).

`pdl_enabled(device)`: a CUDA device of compute capability >= 9.0 (not ROCm), a Triton with
`gdc_wait` and the `launch_pdl` launch option, and HISPARSE_PDL not "0". Everywhere else
(CPU interpreter, older GPUs or Triton) the kernels run without it, the same bits.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from hisparse_cli.config.env import pdl_allowed, triton_interpret

try:  # Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _HAS_GDC = True
except ImportError:  # pragma: no cover - older Triton: the PDL branches are never compiled
    _HAS_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass

__all__ = ["gdc_wait", "gdc_launch_dependents", "pdl_enabled", "chain_args", "enter"]



def _triton_has_launch_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@lru_cache(maxsize=8)
def _device_ok(device: torch.device) -> bool:
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    if triton_interpret():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL and wait / trigger (module doc)."""
    if not pdl_allowed() or not _HAS_GDC:
        return False
    return _device_ok(device) and _TRITON_LAUNCH_PDL


_TRITON_LAUNCH_PDL = _triton_has_launch_pdl()


def chain_args(device: torch.device) -> dict:
    """Launch arguments of a decode-chain kernel with the PDL_WAIT / PDL_TRIGGER constexprs
    (its first statement `enter(PDL_WAIT, PDL_TRIGGER)`): waits, triggers and launch_pdl
    where enabled. launch_pdl only ever comes with PDL_WAIT (a consumer must wait)."""
    on = pdl_enabled(device)
    if on:
        return {"PDL_WAIT": True, "PDL_TRIGGER": True, "launch_pdl": True}
    return {"PDL_WAIT": False, "PDL_TRIGGER": False}


@triton.jit
def enter(WAIT: tl.constexpr, TRIGGER: tl.constexpr):
    """A chain kernel's first statement: wait for the previous kernel (WAIT: launched with
    PDL), then let the next one be scheduled (TRIGGER); compiled in only when asked."""
    if WAIT:
        gdc_wait()
    if TRIGGER:
        gdc_launch_dependents()
