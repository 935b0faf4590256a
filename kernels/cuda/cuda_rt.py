"""Runtime-built CUDA C++ kernels, the compile half: NVRTC makes cubins, kept on disk.

Why: the persistent decode kernel is CUDA C++ (sm_80+ / sm_90) and users have no nvcc. Every
CUDA build of torch brings libnvrtc (pip wheels nvidia-cuda-nvrtc for CUDA 13,
nvidia-cuda-nvrtc-cu12 for 12) and the driver brings libcuda.so.1, so both are reached through
ctypes: no build step, no new dependency, nothing at import (each library loads on first use).

Compile: `compile_cubin(source, arch=(9, 0), name_expressions=["k<float, 4>"])` -> `Compiled`:
real SASS for sm_XY (a cubin: nothing is JIT-compiled at load), `-std=c++17`, fast math only
when asked through `options`. Kernel sources are self-contained (no CUDA header: their own
half helpers in inline PTX), so there are no include paths. Templates are instantiated by
name expression; `Compiled.lowered` maps each one to its mangled name. Cubins are kept in
`$HISPARSE_HOME/kernels/` (file name: the sha256 of source, options, name expressions, arch,
NVRTC version, the driver's version and FORMAT: keyed like Triton's cache,
kernels/compile_cache.py, so a driver or toolkit update compiles afresh) and memoized in the
process; an entry that cannot be read or does not check out is rebuilt, a folder that cannot
be written is skipped silently. Each compile and each cubin read from disk is counted
(kernels/compile_log.py).

Launch: kernels/cuda/cuda_launch.py (the driver API: modules, launches, TMA tensor maps).

libnvrtc is looked for in this order: `$HISPARSE_NVRTC` (a file, used alone when set); the
nvidia wheel folders under every sys.path / site-packages entry (CUDA 13, then 12; 12 first
when torch was built with CUDA 12, since a newer NVRTC's cubins can need a newer driver);
torch/lib; the system linker path (`ctypes.util.find_library`); plain `libnvrtc.so`.

NVRTC failures raise `CudaRtError` (and the driver's, cuda_launch.CudaDriverError, a subclass);
a source NVRTC rejects raises `KernelCompileError` with the head of the log in its message and
the whole log in `.log`.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import glob
import hashlib
import json
import operator
import os
import site
import sys
import tempfile
import time
from collections.abc import Sequence
from ctypes import POINTER, byref, c_char_p, c_int, c_size_t, c_void_p
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch

from hisparse_cli.errors import HisparseError
from hisparse_cli.config.env import NVRTC_ENV, hisparse_home, nvrtc_override
from hisparse_cli.kernels.compile_cache import driver_version
from hisparse_cli.kernels.compile_log import record_nvrtc

__all__ = [
    "CudaRtError", "KernelCompileError", "Compiled", "nvrtc_available",
    "nvrtc_unavailable_reason", "nvrtc_candidates", "nvrtc_version", "compile_cubin",
    "cache_key", "kernel_cache_dir",
]

FORMAT = 1  # of a disk cache entry: bump when its files' layout or meaning changes
_LOG_HEAD = 20  # lines of NVRTC's log quoted in a KernelCompileError message
# nvidia wheel layouts, by CUDA major: nvidia-cuda-nvrtc (13), nvidia-cuda-nvrtc-cu12 (12)
_WHEEL_LIBS = {13: "nvidia/cu13/lib/libnvrtc.so.13", 12: "nvidia/cuda_nvrtc/lib/libnvrtc.so.12"}


class CudaRtError(HisparseError):
    """NVRTC or the CUDA driver is missing, or refused a call."""

    default_hint = ("CUDA builds of torch bring libnvrtc (pip: nvidia-cuda-nvrtc, or "
                    f"nvidia-cuda-nvrtc-cu12); {NVRTC_ENV}=/path/to/libnvrtc.so.N picks one")


class KernelCompileError(CudaRtError):
    """NVRTC rejected a kernel source (a bug in hisparse); `log` is NVRTC's whole log."""

    default_hint = "a bug in a hisparse kernel: rerun with HISPARSE_DEBUG=1 and report it"

    def __init__(self, message: str, log: str) -> None:
        super().__init__(message)
        self.log = log


# --- libnvrtc: discovery and loading -------------------------------------------------------


def _site_dirs() -> list[str]:
    """sys.path and the site-packages folders, each real folder once, in that order."""
    dirs = [*sys.path, *getattr(site, "getsitepackages", list)(), site.getusersitepackages()]
    seen: dict[str, None] = {}
    for d in dirs:
        if d and os.path.isdir(d):
            seen.setdefault(os.path.realpath(d), None)
    return list(seen)


def _torch_lib_dir() -> Path:
    return Path(torch.__file__).resolve().parent / "lib"


def _torch_majors() -> tuple[int, int]:
    """CUDA majors in search order: torch's own first when it is 12 (module doc)."""
    return (12, 13) if (torch.version.cuda or "").startswith("12.") else (13, 12)


def nvrtc_candidates(roots: Sequence[str | os.PathLike] | None = None,
                     majors: Sequence[int] | None = None) -> list[str]:
    """Where libnvrtc is looked for without $HISPARSE_NVRTC, in order: the files that exist
    (wheel folders under `roots`, default sys.path + site-packages, for each of `majors`;
    torch/lib), then names for the system loader (find_library's, plain libnvrtc.so)."""
    roots = _site_dirs() if roots is None else [os.fspath(r) for r in roots]
    found: list[str] = []
    for major in _torch_majors() if majors is None else majors:
        found += [p for r in roots if os.path.isfile(p := os.path.join(r, _WHEEL_LIBS[major]))]
    found += sorted(p for p in glob.glob(str(_torch_lib_dir() / "libnvrtc*.so*"))
                    if "builtins" not in os.path.basename(p))  # libnvrtc-builtins: NVRTC's own
    found += [n for n in (ctypes.util.find_library("nvrtc"), "libnvrtc.so") if n]
    return list(dict.fromkeys(found))


_NVRTC_SIGNATURES = {
    "nvrtcVersion": (POINTER(c_int), POINTER(c_int)),
    "nvrtcCreateProgram": (POINTER(c_void_p), c_char_p, c_char_p, c_int, c_void_p, c_void_p),
    "nvrtcAddNameExpression": (c_void_p, c_char_p),
    "nvrtcCompileProgram": (c_void_p, c_int, POINTER(c_char_p)),
    "nvrtcGetProgramLogSize": (c_void_p, POINTER(c_size_t)),
    "nvrtcGetProgramLog": (c_void_p, c_char_p),
    "nvrtcGetCUBINSize": (c_void_p, POINTER(c_size_t)),
    "nvrtcGetCUBIN": (c_void_p, c_char_p),
    "nvrtcGetLoweredName": (c_void_p, c_char_p, POINTER(c_char_p)),
    "nvrtcDestroyProgram": (POINTER(c_void_p),),
}


@dataclass(frozen=True)
class _NvrtcLib:
    lib: ctypes.CDLL | None
    where: str  # the file or name loaded, or the one-line reason none was


@lru_cache(maxsize=1)
def _nvrtc_lib() -> _NvrtcLib:
    override = nvrtc_override()
    failed: dict[str, str] = {}  # candidate -> why it did not load
    for cand in [override] if override else nvrtc_candidates():
        try:
            lib = ctypes.CDLL(cand)
            for name, argtypes in _NVRTC_SIGNATURES.items():  # nvrtcGetCUBIN: NVRTC >= 11.1
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = argtypes, c_int
        except (OSError, AttributeError) as exc:
            failed[cand] = str(exc)
            continue
        lib.nvrtcGetErrorString.argtypes, lib.nvrtcGetErrorString.restype = (c_int,), c_char_p
        return _NvrtcLib(lib, cand)
    if override:
        return _NvrtcLib(None, f"{NVRTC_ENV}={override} could not be loaded ({failed[override]})")
    files = [c for c in failed if os.path.isfile(c)]  # found, unlike a loader name that failed
    if files:
        return _NvrtcLib(None, f"libnvrtc was found but could not be loaded ({files[0]}: "
                               f"{failed[files[0]]})")
    return _NvrtcLib(None, "libnvrtc not found (no nvidia-cuda-nvrtc wheel under sys.path, "
                           "none in torch/lib or on the system linker path)")


def nvrtc_available() -> bool:
    """Whether libnvrtc loads (searched once a process, module doc)."""
    return _nvrtc_lib().lib is not None


def nvrtc_unavailable_reason() -> str | None:
    """One line saying why libnvrtc is not available; None when it is."""
    loaded = _nvrtc_lib()
    return None if loaded.lib is not None else loaded.where


def _nvrtc() -> ctypes.CDLL:
    loaded = _nvrtc_lib()
    if loaded.lib is None:
        raise CudaRtError(f"NVRTC is not available: {loaded.where}")
    return loaded.lib


def _nvrtc_check(lib: ctypes.CDLL, call: str, rc: int) -> None:
    if rc != 0:
        raise CudaRtError(f"{call} failed: {lib.nvrtcGetErrorString(rc).decode()}")


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the libnvrtc in use; CudaRtError without one."""
    lib, major, minor = _nvrtc(), c_int(), c_int()
    _nvrtc_check(lib, "nvrtcVersion", lib.nvrtcVersion(byref(major), byref(minor)))
    return major.value, minor.value


# --- compiling, and the cubin cache ---------------------------------------------------------


@dataclass(frozen=True)
class Compiled:
    """A cubin NVRTC built for one `arch`; `lowered` maps each name expression (e.g.
    "k<float, 4>") to the mangled name the module exports it under."""

    key: str  # cache_key(...): names the disk cache entry and the loaded modules
    cubin: bytes = field(repr=False)
    lowered: dict[str, str]
    arch: tuple[int, int]
    nvrtc_version: tuple[int, int]
    log: str = field(repr=False)  # NVRTC's log (warnings); empty when it had nothing to say


def cache_key(source: str, *, arch: tuple[int, int], nvrtc_version: tuple[int, int],
              name_expressions: Sequence[str] = (), options: Sequence[str] = (),
              driver: str = "") -> str:
    """sha256 (hex) of everything the cubin and its lowered names depend on, and of the
    driver that is to load it (compile_cache.driver_version())."""
    blob = json.dumps([FORMAT, source, list(options), list(name_expressions), list(arch),
                       list(nvrtc_version), driver])
    return hashlib.sha256(blob.encode()).hexdigest()


def kernel_cache_dir() -> Path:
    """Folder of the cubin cache: `$HISPARSE_HOME/kernels` (default ~/.cache/hisparse)."""
    return hisparse_home() / "kernels"


_MEMO: dict[str, Compiled] = {}  # cache_key -> Compiled, this process


def compile_cubin(source: str, *, arch: tuple[int, int], name_expressions: Sequence[str] = (),
                  options: Sequence[str] = ()) -> Compiled:
    """`source` as a cubin for sm_{arch}, from the memo, the disk cache or NVRTC (module doc).
    Raises KernelCompileError when NVRTC rejects the source, CudaRtError without NVRTC."""
    arch = (operator.index(arch[0]), operator.index(arch[1]))
    exprs, opts = tuple(name_expressions), tuple(options)
    version = nvrtc_version()
    key = cache_key(source, arch=arch, nvrtc_version=version, name_expressions=exprs,
                    options=opts, driver=driver_version())
    compiled = _MEMO.get(key)
    if compiled is None:
        folder = kernel_cache_dir()
        started = time.perf_counter()
        compiled = _read_entry(folder, key, arch, version)
        built = compiled is None
        if built:
            cubin, lowered, log = _nvrtc_compile(source, arch, exprs, opts)
            compiled = Compiled(key, cubin, lowered, arch, version, log)
            _write_entry(folder, compiled)
        record_nvrtc(f"sm_{arch[0]}{arch[1]}:{key[:12]}", built, time.perf_counter() - started)
        _MEMO[key] = compiled
    return compiled


def _nvrtc_compile(source: str, arch: tuple[int, int], name_expressions: tuple[str, ...],
                   options: tuple[str, ...]) -> tuple[bytes, dict[str, str], str]:
    """One NVRTC run: (cubin, lowered names, log)."""
    lib, prog = _nvrtc(), c_void_p()
    _nvrtc_check(lib, "nvrtcCreateProgram", lib.nvrtcCreateProgram(
        byref(prog), source.encode(), b"hisparse_kernel.cu", 0, None, None))
    try:
        for expr in name_expressions:
            _nvrtc_check(lib, "nvrtcAddNameExpression",
                         lib.nvrtcAddNameExpression(prog, expr.encode()))
        argv = [f"--gpu-architecture=sm_{arch[0]}{arch[1]}", "-std=c++17", *options]
        rc = lib.nvrtcCompileProgram(prog, len(argv), (c_char_p * len(argv))(
            *(a.encode() for a in argv)))
        size = c_size_t()
        _nvrtc_check(lib, "nvrtcGetProgramLogSize", lib.nvrtcGetProgramLogSize(prog, byref(size)))
        buf = ctypes.create_string_buffer(size.value)
        _nvrtc_check(lib, "nvrtcGetProgramLog", lib.nvrtcGetProgramLog(prog, buf))
        log = buf.value.decode(errors="replace").strip()
        if rc != 0:
            head = "\n".join(log.splitlines()[:_LOG_HEAD])
            raise KernelCompileError(f"NVRTC could not compile a kernel for sm_{arch[0]}{arch[1]} "
                                     f"({lib.nvrtcGetErrorString(rc).decode()}):\n{head}", log)
        _nvrtc_check(lib, "nvrtcGetCUBINSize", lib.nvrtcGetCUBINSize(prog, byref(size)))
        buf = ctypes.create_string_buffer(size.value)
        _nvrtc_check(lib, "nvrtcGetCUBIN", lib.nvrtcGetCUBIN(prog, buf))
        lowered = {}
        for expr in name_expressions:
            name = c_char_p()  # points into the program: copied before it is destroyed
            _nvrtc_check(lib, "nvrtcGetLoweredName",
                         lib.nvrtcGetLoweredName(prog, expr.encode(), byref(name)))
            lowered[expr] = name.value.decode()
        return buf.raw, lowered, log
    finally:
        lib.nvrtcDestroyProgram(byref(prog))


def _read_entry(folder: Path, key: str, arch: tuple[int, int],
                version: tuple[int, int]) -> Compiled | None:
    """The cached entry `key`, or None when it is missing or does not check out."""
    try:
        meta = json.loads((folder / f"{key}.json").read_text(encoding="utf-8"))
        cubin = (folder / f"{key}.cubin").read_bytes()
        if meta["format"] != FORMAT or meta["cubin_sha256"] != hashlib.sha256(cubin).hexdigest():
            return None
        lowered = {str(k): str(v) for k, v in meta["lowered"].items()}
        return Compiled(key, cubin, lowered, arch, version, str(meta["log"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _write_entry(folder: Path, compiled: Compiled) -> None:
    """Cache `compiled`: the cubin first, then the JSON that makes the entry valid (it holds
    the cubin's sha256), each written whole by rename. An unwritable folder skips caching."""
    meta = {"format": FORMAT, "cubin_sha256": hashlib.sha256(compiled.cubin).hexdigest(),
            "lowered": compiled.lowered, "log": compiled.log}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _atomic_write(folder / f"{compiled.key}.cubin", compiled.cubin)
        _atomic_write(folder / f"{compiled.key}.json", json.dumps(meta).encode())
    except OSError:
        pass  # costs a compile in the next process, nothing else


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
