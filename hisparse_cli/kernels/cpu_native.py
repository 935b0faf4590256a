"""The CPU decode kernels of `kernels/cpu/decode.c`: built once per machine with its C
compiler, cached under `$HISPARSE_HOME/kernels/cpu/`, called through ctypes; and the torch
reference of each (the tests' oracle).

    lib = native_library()          # None where no compiler or the build failed (reason below)
    w = TiledWeight.from_linear(weight_fp32)   # the decode copy: 16-bit where exact, else fp32
    w.matvec(x, out)                 # one-row product, float32 arithmetic

`native_library()` never raises: a machine without a compiler (or with HISPARSE_BACKEND=torch)
decodes through torch, and `native_unavailable_reason()` says why (shown in the run's stats).
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

SOURCE = Path(__file__).with_name("cpu") / "decode.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared",
         "-fno-math-errno")
TR, TK = 8, 16  # rows per tile, inputs per tile step (decode.c)
W_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

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
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def compiler_available() -> bool:
    """Whether native_library() can be built here (a compiler, not HISPARSE_BACKEND=torch)."""
    return (os.environ.get("HISPARSE_BACKEND", "").strip().lower() != "torch"
            and _compiler() is not None)


def library_key(source: str, compiler_version: str) -> str:
    blob = "\0".join([source, compiler_version, " ".join(FLAGS), _cpu_flags(), platform.machine()])
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def cache_dir() -> Path:
    from hisparse_cli.models.registry import hisparse_home

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
    }
    for name, (args, res) in sig.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


@lru_cache(maxsize=1)
def native_library() -> ctypes.CDLL | None:
    """The built library (building it on first use), or None with the reason kept."""
    if os.environ.get("HISPARSE_BACKEND", "").strip().lower() == "torch":
        _REASON.append("HISPARSE_BACKEND=torch")
        return None
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
    """A linear's weight [out, in] in decode.c's tiled layout, in `dtype` (exact: see
    exact_dtype), with its float32 bias. `in` must be a multiple of 16."""

    def __init__(self, data: torch.Tensor, out_features: int, in_features: int,
                 bias: torch.Tensor | None) -> None:
        self.data, self.out_features, self.in_features = data, out_features, in_features
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.wtype = W_TYPES[data.dtype]

    @classmethod
    def from_linear(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    dtype: torch.dtype | None = None) -> "TiledWeight":
        out_f, in_f = weight.shape
        if in_f % TK:
            raise ValueError(f"in_features {in_f} is not a multiple of {TK}")
        dtype = dtype or exact_dtype(weight.detach())
        groups = -(-out_f // TR)
        src = weight.detach().to(dtype)  # keeps the [out, in] strides of `weight` (any layout)
        data = torch.empty(groups * TR * in_f, dtype=dtype)
        lib = native_library()
        if lib is not None:
            lib.hs_tile(src.data_ptr(), src.stride(0), src.stride(1), src.element_size(),
                        data.data_ptr(), out_f, in_f)
        else:
            data.copy_(tile_reference(src))
        return cls(data, out_f, in_f, bias)

    def dense(self) -> torch.Tensor:
        """The float32 [out, in] matrix (reference and tests)."""
        groups = -(-self.out_features // TR)
        w = self.data.view(groups, self.in_features // TK, TR, TK).permute(0, 2, 1, 3)
        return w.reshape(groups * TR, self.in_features)[: self.out_features].float()

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def tiled_bytes(out_features: int, in_features: int, element_size: int) -> int:
    """Bytes of a TiledWeight (the memory planner's count)."""
    return -(-out_features // TR) * TR * in_features * element_size


def tile_reference(w: torch.Tensor) -> torch.Tensor:
    """Torch reference of hs_tile: [out, in] -> the flat tiled layout."""
    out_f, in_f = w.shape
    groups = -(-out_f // TR)
    padded = torch.zeros(groups * TR, in_f, dtype=w.dtype)
    padded[:out_f] = w
    return padded.view(groups, TR, in_f // TK, TK).permute(0, 2, 1, 3).reshape(-1)


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


__all__ = ["native_library", "compiler_available", "native_unavailable_reason", "TiledWeight", "exact_dtype",
           "tiled_bytes", "tile_reference", "linear_reference", "attn_dense_reference",
           "build", "load", "library_key", "cache_dir", "ptr"]
