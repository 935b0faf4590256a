"""The W4A8 prefill product on CUDA: an INT4 linear's W^T rows dequantized to their e4m3 codes
(q - z, exact) with the group scales beside them, the activations quantized in 1x128 blocks
(act_quant_triton.py), and cuBLAS's block-scaled FP8 GEMM (`scaled_mm_1x128`, 1x128 scales on
both sides: CUDA >= 12.9, compute capability 9.x). Contract: w4a8_ref.py.

Where it runs: `device_support()` says whether a GPU runs it and why not (the execution plan
prints the same answer); the Engine turns it on for its runs (`set_enabled`) where its plan
says w4a8, which needs HISPARSE_PREFILL_FP8=1 (opt-in: the activations' rounding costs
quality, QUALITY.md); then a linear uses it for prefill-sized calls (more than
GEMV_MAX_TOKENS rows) when its group is 128. The fp16 path (dequantize to fp16, cuBLAS) stays
for the rest: other GPUs, other groups, decode, and every caller that did not turn it on.
"""

from __future__ import annotations

import functools

import torch

from hisparse_cli.kernels.fp8.w4a8_ref import BLOCK, E4M3

_STATE = {"on": False}  # the last set_enabled (an Engine's plan, every generate)


@functools.lru_cache(maxsize=None)
def device_support(index: int) -> str | None:
    """None where CUDA device `index` runs the block-scaled FP8 GEMM, else why not."""
    if not torch.cuda.is_available():
        return "not a CUDA device"
    major, minor = torch.cuda.get_device_capability(index)
    if major != 9:
        return f"compute capability {major}.{minor}: cuBLAS's 1x128 FP8 scaling is sm_90 only"
    ver = torch.version.cuda or "0.0"
    if tuple(int(p) for p in ver.split(".")[:2]) < (12, 9):
        return f"CUDA {ver}: cuBLAS's 1x128 FP8 scaling needs 12.9"
    return _probe(torch.device("cuda", index))


def _probe(device: torch.device) -> str | None:
    """One small block-scaled product on the device against the reference (w4a8_ref): None
    where cuBLAS runs it and agrees, else why not (a cuBLAS or torch build that refuses the
    1x128 recipe or fp16 output keeps W4A16 instead of failing in a prefill)."""
    from hisparse_cli.kernels.fp8.w4a8_ref import quantize_act_ref, w4a8_matmul_ref

    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 256, generator=g).half()
    codes = torch.randint(-15, 16, (64, 256), generator=g).float().to(E4M3)
    s = torch.rand(2, 64, generator=g) / 64 + 1e-3
    x8, sa = quantize_act_ref(x)
    ref = w4a8_matmul_ref(x8, sa, codes, s, torch.float32)
    try:
        y = scaled_mm_1x128(x8.to(device), codes.to(device).t(), sa.to(device).t(),
                            s.to(device).t(), torch.float16)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 - any refusal means: not here
        return f"cuBLAS's 1x128 FP8 GEMM refused: {str(exc).splitlines()[0][:120]}"
    err = float((y.float().cpu() - ref).abs().max() / ref.abs().max())
    if not err < 4e-3:
        return f"cuBLAS's 1x128 FP8 GEMM disagrees with the reference (relative error {err:.1e})"
    return None


def scaled_mm_1x128(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                    scale_b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """cuBLAS's FP8 GEMM with 1x128 block scales on both sides: a [M, K] e4m3 row-major, b
    [K, N] e4m3 column-major, scale_a [M, K/128] strides (1, M), scale_b [N, K/128] strides
    (1, N). Through torch's v2 API, which names the recipe (torch.nn.functional.scaled_mm;
    torch 2.11's `_scaled_mm` refuses the 1x128 x 1x128 form: "Invalid scaling
    configuration", H100, 2026-12-07), else the v1 one."""
    F = torch.nn.functional
    if hasattr(F, "scaled_mm"):
        blk = F.ScalingType.BlockWise1x128
        return F.scaled_mm(a, b, scale_a, blk, scale_b, blk, output_dtype=out_dtype)
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


def set_enabled(on: bool) -> None:
    """The run's choice (Engine, from its execution plan: w4a8 or not)."""
    _STATE["on"] = bool(on)


def active(device: torch.device) -> bool:
    """Whether prefill-sized INT4 products on `device` take the W4A8 path now."""
    if device.type != "cuda" or not _STATE["on"]:
        return False
    return device_support(device.index if device.index is not None
                          else torch.cuda.current_device()) is None


def usable(group_size: int, in_features: int) -> bool:
    """A linear whose scales are the GEMM's 1x128 weight blocks."""
    return group_size == BLOCK and in_features % BLOCK == 0


def workspace(rows: int, k: int, device: torch.device) -> torch.Tensor:
    """One uint8 buffer for `rows` W^T rows of codes and their [G, rows] fp32 scales (one
    address: the dequantize's CUDA graph is keyed by it)."""
    return torch.empty(rows * k + 4 * (k // BLOCK) * rows, dtype=torch.uint8, device=device)


def split_workspace(ws: torch.Tensor, rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [rows, K] e4m3, scales [G, rows] fp32) views of a workspace."""
    codes = ws[: rows * k].view(E4M3).view(rows, k)
    scales = ws[rows * k: rows * k + 4 * (k // BLOCK) * rows].view(torch.float32)
    return codes, scales.view(k // BLOCK, rows)


def w4a8_matmul(x2: torch.Tensor, n: int, k: int, chunk: int, launch, bias=None) -> torch.Tensor:
    """y [M, n] = x2 [M, k] @ W (+ bias) in x2's dtype, W^T's codes made `chunk` rows at a
    time by launch(ws, n0, n1) into a workspace (see workspace())."""
    from hisparse_cli.kernels.fp8.act_quant_triton import quantize_act

    x8, sa = quantize_act(x2)
    sa_t = sa.t()  # [M, G], strides (1, M): cuBLAS's 1x128 layout
    if chunk >= n:
        ws = workspace(n, k, x2.device)
        launch(ws, 0, n)
        codes, sc = split_workspace(ws, n, k)
        y = scaled_mm_1x128(x8, codes.t(), sa_t, sc.t(), x2.dtype)
    else:
        y = torch.empty((x2.shape[0], n), device=x2.device, dtype=x2.dtype)
        for n0 in range(0, n, chunk):
            n1 = min(n, n0 + chunk)
            ws = workspace(n1 - n0, k, x2.device)
            launch(ws, n0, n1)
            codes, sc = split_workspace(ws, n1 - n0, k)
            y[:, n0:n1] = scaled_mm_1x128(x8, codes.t(), sa_t, sc.t(), x2.dtype)
            del ws, codes, sc  # freed before the next chunk's workspace (the planner's trace)
    if bias is not None:
        y += bias.to(y.dtype)
    return y
