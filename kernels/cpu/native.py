"""The CPU decode kernels of `kernels/cpu/decode.c`: built once per machine with its C
compiler, cached under `$HISPARSE_HOME/kernels/cpu/`, called through ctypes; and the torch
reference of each (the tests' oracle).

    lib = native_library()          # None where no compiler or the build failed (reason below)
    w = TiledWeight.from_linear(weight_fp32)   # the decode copy: 16-bit where exact, else fp32
    w.matvec(x, out)                 # one-row product, float32 arithmetic

`native_library()` never raises: a machine without a compiler decodes through torch, and
`native_unavailable_reason()` says why (the run's ExecutionPlan and stats show it;
HISPARSE_BACKEND=torch is decided there too, config/execution.py).
The shared object is keyed by the source, the compiler's version and this CPU's feature flags
(built with -march=native), so a HISPARSE_HOME shared between machines never loads a build
made for another CPU. Building takes ~1-2 s; the file is written atomically.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from hisparse_cli.config.env import c_compiler_setting, hisparse_home

SOURCE = Path(__file__).with_name("decode.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared",
         "-fno-math-errno")
TR, TK, QG = 8, 16, 32  # rows per tile, inputs per tile step, inputs per quantized group
W_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, "q4": 3, "q8": 4}
Q_STEP = {"q4": TR * (QG // 2 + 4), "q8": TR * (QG + 2)}  # bytes per 8-row step of 32 inputs

_REASON: list[str] = []  # why native_library() is None (filled once)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler() -> str | None:
    for name in (c_compiler_setting(), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def compiler_available() -> bool:
    """Whether native_library() can be built here (a C compiler is installed)."""
    return _compiler() is not None


def library_key(source: str, compiler_version: str) -> str:
    blob = "\0".join([source, compiler_version, " ".join(FLAGS), _cpu_flags(), platform.machine()])
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def cache_dir() -> Path:
    return hisparse_home() / "kernels" / "cpu"


def build(target: Path, compiler: str, extra: tuple[str, ...] = ()) -> None:
    """Compile decode.c into `target` (atomically: a temporary file renamed into place)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, *extra, str(SOURCE), "-o", tmp, "-lm"], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@lru_cache(maxsize=None)
def load(path: str) -> ctypes.CDLL:
    """The library at `path` with its functions' argument types declared."""
    lib = ctypes.CDLL(path)
    p, i, f, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long
    sig = {
        "hs_isa": ([], i), "hs_max_threads": ([], i),
        "hs_linear": ([p, i, p, p, p, L, L, i], None),
        "hs_rms_norm": ([p, p, f, p, L], None),
        "hs_pre_attn": ([p, p, p, p, p, p, i], None),
        "hs_post_attn": ([p, p, p, p, p, p, i], None),
        "hs_attn_scratch": ([L, i, i, i], L),
        "hs_attn_dense": ([p, p, p, p, p, L, L, L, i, i, i, f, p, p, i], None),
        "hs_tile": ([p, L, L, i, p, L, L], None),
        "hs_pack": ([p, L, L, L, L, i, p], L),
        "hs_weight_bytes": ([i, L, L], L),
    }
    for name, (args, res) in sig.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


@lru_cache(maxsize=1)
def native_library() -> ctypes.CDLL | None:
    """The built library (building it on first use), or None with the reason kept."""
    compiler = _compiler()
    if compiler is None:
        _REASON.append("no C compiler (cc/gcc/clang) found")
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout.splitlines()[0]
        target = cache_dir() / f"decode-{library_key(SOURCE.read_text(), version)}.so"
        if not target.is_file():
            build(target, compiler)
        return load(str(target))
    except subprocess.CalledProcessError as exc:
        _REASON.append(f"the C build failed: {(exc.stderr or '').strip().splitlines()[-1:]}")
    except (OSError, subprocess.SubprocessError, IndexError) as exc:
        _REASON.append(f"the C build failed: {exc}")
    return None


def native_unavailable_reason() -> str | None:
    return None if native_library() is not None else (_REASON[-1] if _REASON else "unknown")


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


# -- weights -------------------------------------------------------------------------------
def exact_dtype(*ws: torch.Tensor) -> torch.dtype:
    """The first of bfloat16 / float16 / float32 that holds every value of the float32
    tensors `ws` exactly (a checkpoint stored in a 16-bit format converts back without loss;
    bfloat16 first: a bfloat16 checkpoint's values often fit float16 too, a float16
    checkpoint's practically never fit bfloat16)."""
    for dt in (torch.bfloat16, torch.float16):
        if all(torch.equal(w.to(dt).to(torch.float32), w) for w in ws):
            return dt
    return torch.float32


class TiledWeight:
    """A linear's weight [out, in] in decode.c's tiled layout, in format `fmt`: float32,
    float16, bfloat16 (the narrowest exact one, exact_dtype), or "q4" / "q8" where every
    group of 32 inputs is exactly a GGUF Q4_1 / Q8_0 group (hs_pack verifies each value);
    with its float32 bias. `in` must be a multiple of 16 (of 32 for q4/q8)."""

    def __init__(self, data: torch.Tensor, fmt, out_features: int, in_features: int,
                 bias: torch.Tensor | None) -> None:
        self.data, self.fmt = data, fmt
        self.out_features, self.in_features = out_features, in_features
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.wtype = W_TYPES[fmt]

    @classmethod
    def from_linear(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    dtype: torch.dtype | None = None, quantized: bool = True) -> "TiledWeight":
        """quantized: try q4, then q8 first (on AVX-512 CPUs, where their kernel is the
        fast one); dtype: a float format to use (default: exact_dtype's)."""
        out_f, in_f = weight.shape
        if in_f % TK:
            raise ValueError(f"in_features {in_f} is not a multiple of {TK}")
        lib = native_library()
        w = weight.detach()
        if quantized and dtype is None and lib is not None and lib.hs_isa() == 2 and in_f % QG == 0:
            for fmt in ("q4", "q8"):
                data = torch.empty(tiled_bytes(out_f, in_f, fmt), dtype=torch.uint8)
                if lib.hs_pack(w.data_ptr(), w.stride(0), w.stride(1), out_f, in_f,
                               W_TYPES[fmt], data.data_ptr()) == 0:
                    return cls(data, fmt, out_f, in_f, bias)
        dtype = dtype or exact_dtype(w)
        groups = -(-out_f // TR)
        src = w.to(dtype)  # keeps the [out, in] strides of `weight` (any layout)
        data = torch.empty(groups * TR * in_f, dtype=dtype)
        if lib is not None:
            lib.hs_tile(src.data_ptr(), src.stride(0), src.stride(1), src.element_size(),
                        data.data_ptr(), out_f, in_f)
        else:
            data.copy_(tile_reference(src))
        return cls(data, dtype, out_f, in_f, bias)

    @property
    def fmt_name(self) -> str:
        return self.fmt if isinstance(self.fmt, str) else str(self.fmt).replace("torch.", "")

    def dense(self) -> torch.Tensor:
        """The float32 [out, in] matrix (reference and tests)."""
        groups = -(-self.out_features // TR)
        if isinstance(self.fmt, str):
            w = dequantize_reference(self.data, self.fmt, groups, self.in_features)
        else:
            w = self.data.view(groups, self.in_features // TK, TR, TK).permute(0, 2, 1, 3)
        return w.reshape(groups * TR, self.in_features)[: self.out_features].float()

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def tiled_bytes(out_features: int, in_features: int, fmt) -> int:
    """Bytes of a TiledWeight (the memory planner's count): fmt an element size in bytes
    (4, 2) or "q4" / "q8"."""
    groups = -(-out_features // TR)
    if isinstance(fmt, str):
        return groups * (in_features // QG) * Q_STEP[fmt]
    return groups * TR * in_features * fmt


def tile_reference(w: torch.Tensor) -> torch.Tensor:
    """Torch reference of hs_tile: [out, in] -> the flat tiled layout (float formats)."""
    out_f, in_f = w.shape
    groups = -(-out_f // TR)
    padded = torch.zeros(groups * TR, in_f, dtype=w.dtype)
    padded[:out_f] = w
    return padded.view(groups, TR, in_f // TK, TK).permute(0, 2, 1, 3).reshape(-1)


def dequantize_reference(data: torch.Tensor, fmt: str, groups: int, in_f: int) -> torch.Tensor:
    """Torch reference of the q4 / q8 tiles -> float32 [groups, 8, in] (decode.c's comment)."""
    steps = in_f // QG
    raw = data.view(groups, steps, Q_STEP[fmt])
    if fmt == "q4":
        qs = raw[..., : TR * 16].reshape(groups, steps, TR, 16).int()
        q = torch.cat((qs & 15, qs >> 4), dim=-1).float()  # [G, S, 8, 32]
        dm = raw[..., TR * 16:].contiguous().view(torch.float16).float()  # [G, S, 16]
        d, m = dm[..., :TR, None], dm[..., TR:, None]
        w = (d * q + m).half().float()
    else:
        q = raw[..., : TR * QG].contiguous().view(torch.int8).reshape(groups, steps, TR, QG).float()
        d = raw[..., TR * QG:].contiguous().view(torch.float16).float()[..., None]
        w = (d * q).half().float()
    return w.permute(0, 2, 1, 3).reshape(groups, TR, in_f)


# -- torch references ----------------------------------------------------------------------
def linear_reference(w: TiledWeight, x: torch.Tensor) -> torch.Tensor:
    y = w.dense() @ x.float()
    return y if w.bias is None else y + w.bias


def attn_dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """q [hq, d], k/v [hkv, n, d] -> [hq, d]: softmax(scale q.k) v, query head h reading KV
    head h // (hq / hkv)."""
    grp = q.shape[0] // k.shape[0]
    kk, vv = k.repeat_interleave(grp, 0), v.repeat_interleave(grp, 0)
    p = torch.softmax(torch.einsum("hd,hnd->hn", q, kk) * scale, dim=-1)
    return torch.einsum("hn,hnd->hd", p, vv)


__all__ = ["native_library", "compiler_available", "dequantize_reference", "native_unavailable_reason", "TiledWeight", "exact_dtype",
           "tiled_bytes", "tile_reference", "linear_reference", "attn_dense_reference",
           "build", "load", "library_key", "cache_dir", "ptr"]
