"""Runtime-built CUDA C++ kernels: NVRTC compiles them, the driver API loads and launches them.

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
NVRTC version and FORMAT) and memoized in the process; an entry that cannot be read or does
not check out is rebuilt, a folder that cannot be written is skipped silently.

Launch: `load_module(compiled, device).function("k<float, 4>")` -> `Function`, then
`fn.launch(grid, block, shared_bytes, [ptr(y), i32(n), f32(eps), tensor_map])` on torch's
current stream, so `torch.cuda.graph` captures it like any kernel. Every scalar argument
states its width (`i32`, `u32`, `i64`, `u64`, `f32`; `ptr` for a tensor's address); a
`TensorMap` (`encode_tensor_map`, TMA, sm_90) goes by value into the kernel's
`const __grid_constant__` 128-byte parameter. Modules are never unloaded: a captured graph
keeps calling their functions.

libnvrtc is looked for in this order: `$HISPARSE_NVRTC` (a file, used alone when set); the
nvidia wheel folders under every sys.path / site-packages entry (CUDA 13, then 12; 12 first
when torch was built with CUDA 12, since a newer NVRTC's cubins can need a newer driver);
torch/lib; the system linker path (`ctypes.util.find_library`); plain `libnvrtc.so`.

NVRTC and driver failures raise `CudaRtError` (a `CudaDriverError` names the driver call and
the driver's error name and text); a source NVRTC rejects raises `KernelCompileError` with the
head of the log in its message and the whole log in `.log`.
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
from collections.abc import Iterator, Sequence
from ctypes import POINTER, byref, c_char_p, c_int, c_size_t, c_uint, c_uint32, c_uint64, c_void_p
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Union

import torch

from hisparse_cli.errors import HisparseError
from hisparse_cli.models.registry import hisparse_home

__all__ = [
    "CudaRtError", "CudaDriverError", "KernelCompileError", "Compiled", "Module", "Function",
    "FuncAttributes", "TensorMap", "nvrtc_available", "nvrtc_unavailable_reason",
    "nvrtc_candidates", "nvrtc_version", "compile_cubin", "cache_key", "kernel_cache_dir",
    "load_module", "device_arch", "encode_tensor_map", "ptr", "i32", "u32", "i64", "u64", "f32",
]

FORMAT = 1  # of a disk cache entry: bump when its files' layout or meaning changes
NVRTC_ENV = "HISPARSE_NVRTC"
_LOG_HEAD = 20  # lines of NVRTC's log quoted in a KernelCompileError message
# nvidia wheel layouts, by CUDA major: nvidia-cuda-nvrtc (13), nvidia-cuda-nvrtc-cu12 (12)
_WHEEL_LIBS = {13: "nvidia/cu13/lib/libnvrtc.so.13", 12: "nvidia/cuda_nvrtc/lib/libnvrtc.so.12"}


class CudaRtError(HisparseError):
    """NVRTC or the CUDA driver is missing, or refused a call."""

    default_hint = ("CUDA builds of torch bring libnvrtc (pip: nvidia-cuda-nvrtc, or "
                    f"nvidia-cuda-nvrtc-cu12); {NVRTC_ENV}=/path/to/libnvrtc.so.N picks one")


class CudaDriverError(CudaRtError):
    """A driver call returned an error: `call`, the CUresult `code` and its `name`."""

    default_hint = "rerun with HISPARSE_DEBUG=1 for the details"

    def __init__(self, call: str, code: int) -> None:
        self.call, self.code = call, code
        self.name, text = _driver_error_text(code)
        super().__init__(f"{call} failed: {self.name} ({text})")


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
    override = os.environ.get(NVRTC_ENV, "").strip()
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
              name_expressions: Sequence[str] = (), options: Sequence[str] = ()) -> str:
    """sha256 (hex) of everything the cubin and its lowered names depend on."""
    blob = json.dumps([FORMAT, source, list(options), list(name_expressions), list(arch),
                       list(nvrtc_version)])
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
                    options=opts)
    compiled = _MEMO.get(key)
    if compiled is None:
        folder = kernel_cache_dir()
        compiled = _read_entry(folder, key, arch, version)
        if compiled is None:
            cubin, lowered, log = _nvrtc_compile(source, arch, exprs, opts)
            compiled = Compiled(key, cubin, lowered, arch, version, log)
            _write_entry(folder, compiled)
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


# --- the driver API -------------------------------------------------------------------------

_DRIVER_SIGNATURES = {
    "cuInit": (c_uint,),
    "cuGetErrorName": (c_int, POINTER(c_char_p)),
    "cuGetErrorString": (c_int, POINTER(c_char_p)),
    "cuDeviceGet": (POINTER(c_int), c_int),
    "cuCtxGetCurrent": (POINTER(c_void_p),),
    "cuCtxSetCurrent": (c_void_p,),
    "cuCtxGetDevice": (POINTER(c_int),),
    "cuCtxPushCurrent_v2": (c_void_p,),  # cuda.h #defines the plain names to these
    "cuCtxPopCurrent_v2": (POINTER(c_void_p),),
    "cuDevicePrimaryCtxRetain": (POINTER(c_void_p), c_int),
    "cuModuleLoadData": (POINTER(c_void_p), c_char_p),
    "cuModuleGetFunction": (POINTER(c_void_p), c_void_p, c_char_p),
    "cuFuncSetAttribute": (c_void_p, c_int, c_int),
    "cuFuncGetAttribute": (POINTER(c_int), c_int, c_void_p),
    "cuLaunchKernel": (c_void_p, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint,
                       c_void_p, POINTER(c_void_p), POINTER(c_void_p)),
    "cuTensorMapEncodeTiled": (c_void_p, c_int, c_uint32, c_void_p, POINTER(c_uint64),
                               POINTER(c_uint64), POINTER(c_uint32), POINTER(c_uint32),
                               c_int, c_int, c_int, c_int),
}
# CUfunction_attribute
_ATTR_MAX_THREADS, _ATTR_STATIC_SHARED, _ATTR_LOCAL, _ATTR_REGS = 0, 1, 3, 4
_ATTR_MAX_DYNAMIC_SHARED = 8


@lru_cache(maxsize=1)
def _driver_lib() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise CudaRtError(f"the CUDA driver (libcuda.so.1) could not be loaded: {exc}") from exc
    for name, argtypes in _DRIVER_SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, c_int
    return lib


@lru_cache(maxsize=1)
def _driver() -> ctypes.CDLL:
    """libcuda, initialised."""
    lib = _driver_lib()
    _check("cuInit", lib.cuInit(0))
    return lib


def _driver_error_text(code: int) -> tuple[str, str]:
    lib, name, text = _driver_lib(), c_char_p(), c_char_p()
    if lib.cuGetErrorName(code, byref(name)) != 0 or not name.value:
        return f"CUresult {code}", "unknown error code"
    lib.cuGetErrorString(code, byref(text))
    return name.value.decode(), (text.value or b"").decode()


def _check(call: str, rc: int) -> None:
    if rc != 0:
        raise CudaDriverError(call, rc)


def _context(index: int) -> int:
    """The context for device `index`: the current one when it is that device's (torch's
    primary context), else the device's primary context, made current if none was."""
    drv, cur, dev = _driver(), c_void_p(), c_int()
    _check("cuCtxGetCurrent", drv.cuCtxGetCurrent(byref(cur)))
    _check("cuDeviceGet", drv.cuDeviceGet(byref(dev), index))
    if cur.value:
        cur_dev = c_int()
        _check("cuCtxGetDevice", drv.cuCtxGetDevice(byref(cur_dev)))
        if cur_dev.value == dev.value:
            return cur.value
    primary = c_void_p()
    _check("cuDevicePrimaryCtxRetain", drv.cuDevicePrimaryCtxRetain(byref(primary), dev))
    if not cur.value:
        _check("cuCtxSetCurrent", drv.cuCtxSetCurrent(primary))
    return primary.value


@contextlib.contextmanager
def _current(ctx: int) -> Iterator[None]:
    """`ctx` current on this thread for the block (pushed and popped only when it is not)."""
    drv, cur = _driver(), c_void_p()
    _check("cuCtxGetCurrent", drv.cuCtxGetCurrent(byref(cur)))
    if cur.value == ctx:
        yield
        return
    _check("cuCtxPushCurrent", drv.cuCtxPushCurrent_v2(c_void_p(ctx)))
    try:
        yield
    finally:
        drv.cuCtxPopCurrent_v2(byref(c_void_p()))


def device_arch(device: torch.device | int | str | None = None) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA device (default: the current one)."""
    major, minor = torch.cuda.get_device_capability(device)
    return major, minor


def _device_index(device: torch.device | int | str | None) -> int:
    if device is None or isinstance(device, int):
        return torch.cuda.current_device() if device is None else device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"CUDA kernels run on a CUDA device, not {device}")
    return torch.cuda.current_device() if device.index is None else device.index


@dataclass(frozen=True)
class FuncAttributes:
    """What the compiler gave a kernel (cuFuncGetAttribute)."""

    registers: int  # per thread
    local_bytes: int  # per thread: register spills and stack (0 for a kernel that fits)
    max_threads_per_block: int  # the most a launch can ask for, given the registers
    static_shared_bytes: int  # __shared__ variables; dynamic shared memory comes on top


class Function:
    """One kernel of a loaded `Module`."""

    def __init__(self, module: Module, name: str, handle: int) -> None:
        self.module, self.name, self._handle = module, name, c_void_p(handle)

    def _attribute(self, attr: int) -> int:
        value = c_int()
        _check(f"cuFuncGetAttribute({self.name})",
               _driver().cuFuncGetAttribute(byref(value), attr, self._handle))
        return value.value

    def attributes(self) -> FuncAttributes:
        with _current(self.module.context):
            return FuncAttributes(self._attribute(_ATTR_REGS), self._attribute(_ATTR_LOCAL),
                                  self._attribute(_ATTR_MAX_THREADS),
                                  self._attribute(_ATTR_STATIC_SHARED))

    def set_max_dynamic_shared_memory(self, nbytes: int) -> None:
        """Let launches ask for up to `nbytes` of dynamic shared memory (above 48 KiB a
        launch needs this first; the device's limit less the static part is the most)."""
        with _current(self.module.context):
            _check(f"cuFuncSetAttribute({self.name}, MAX_DYNAMIC_SHARED_SIZE_BYTES={nbytes})",
                   _driver().cuFuncSetAttribute(self._handle, _ATTR_MAX_DYNAMIC_SHARED, nbytes))

    def launch(self, grid: int | Sequence[int], block: int | Sequence[int], shared_bytes: int,
               args: Sequence[KernelArg], stream: torch.cuda.Stream | int | None = None) -> None:
        """Launch on `stream` (default: torch's current stream of the module's device, so
        graph capture records it). `args`: one typed value per kernel parameter, in order."""
        args = tuple(args)  # holds every value's ctypes object until cuLaunchKernel returns
        params = _kernel_params(args)
        if stream is None:
            stream = torch.cuda.current_stream(self.module.device).cuda_stream
        elif isinstance(stream, torch.cuda.Stream):
            stream = stream.cuda_stream
        with _current(self.module.context):
            _check(f"cuLaunchKernel({self.name})", _driver().cuLaunchKernel(
                self._handle, *_dim3("grid", grid), *_dim3("block", block), shared_bytes,
                c_void_p(stream), params, None))


class Module:
    """A cubin loaded into one device's context (`load_module`)."""

    def __init__(self, compiled: Compiled, index: int) -> None:
        self.compiled, self.device = compiled, torch.device("cuda", index)
        self.context = _context(index)
        handle = c_void_p()
        with _current(self.context):
            _check("cuModuleLoadData", _driver().cuModuleLoadData(byref(handle), compiled.cubin))
        self._handle = handle
        self._functions: dict[str, Function] = {}

    def function(self, name: str) -> Function:
        """The kernel `name`: a name expression given to compile_cubin, or the symbol itself
        (an `extern "C"` kernel's plain name, or a mangled one)."""
        fn = self._functions.get(name)
        if fn is None:
            symbol, handle = self.compiled.lowered.get(name, name), c_void_p()
            with _current(self.context):
                _check(f"cuModuleGetFunction({symbol})", _driver().cuModuleGetFunction(
                    byref(handle), self._handle, symbol.encode()))
            fn = self._functions[name] = Function(self, symbol, handle.value)
        return fn


_MODULES: dict[tuple[str, int], Module] = {}  # (Compiled.key, device index): loaded once


def load_module(compiled: Compiled, device: torch.device | int | str | None = None) -> Module:
    """`compiled` loaded on `device` (default: the current CUDA device), once a process."""
    index = _device_index(device)
    module = _MODULES.get((compiled.key, index))
    if module is None:
        have, want = device_arch(index), compiled.arch
        if have[0] != want[0] or have[1] < want[1]:  # SASS runs on its major, same or newer minor
            raise CudaRtError(f"the cubin is for sm_{want[0]}{want[1]} but cuda:{index} is "
                              f"sm_{have[0]}{have[1]}: compile with arch=device_arch(device)")
        module = _MODULES[(compiled.key, index)] = Module(compiled, index)
    return module


# --- launch arguments -----------------------------------------------------------------------


class TensorMap:
    """A TMA descriptor (CUtensorMap: 128 bytes, 64-byte aligned) from `encode_tensor_map`,
    passed by value as a launch argument. Holds its tensor: the memory it maps stays alive."""

    SIZE = 128

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self._buf = ctypes.create_string_buffer(self.SIZE + 63)  # ctypes has no alignas here
        self.address = (ctypes.addressof(self._buf) + 63) & ~63

    def __bytes__(self) -> bytes:
        return ctypes.string_at(self.address, self.SIZE)


_SCALARS = (ctypes.c_int32, ctypes.c_uint32, ctypes.c_int64, ctypes.c_uint64, ctypes.c_float,
            ctypes.c_void_p)
KernelArg = Union[ctypes.c_int32, ctypes.c_uint32, ctypes.c_int64, ctypes.c_uint64,
                  ctypes.c_float, ctypes.c_void_p, TensorMap]


def _int(kind: type, bits: int, signed: bool, value: int) -> ctypes._SimpleCData:
    v = operator.index(value)  # a float or a tensor is an error, not a silent truncation
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    if not lo <= v <= hi:
        raise OverflowError(f"{v} does not fit a{'n' if signed else ''} "
                            f"{'i' if signed else 'u'}{bits} kernel argument")
    return kind(v)


def i32(value: int) -> ctypes.c_int32:
    """An `int` kernel parameter."""
    return _int(ctypes.c_int32, 32, True, value)


def u32(value: int) -> ctypes.c_uint32:
    """An `unsigned` kernel parameter."""
    return _int(ctypes.c_uint32, 32, False, value)


def i64(value: int) -> ctypes.c_int64:
    """A `long long` kernel parameter."""
    return _int(ctypes.c_int64, 64, True, value)


def u64(value: int) -> ctypes.c_uint64:
    """An `unsigned long long` kernel parameter."""
    return _int(ctypes.c_uint64, 64, False, value)


def f32(value: float) -> ctypes.c_float:
    """A `float` kernel parameter (rounded to the nearest float32)."""
    return ctypes.c_float(float(value))


def ptr(value: torch.Tensor | int | None) -> ctypes.c_void_p:
    """A pointer kernel parameter: a CUDA tensor's data_ptr, a raw device address, or null."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cuda":
            raise ValueError(f"a kernel pointer must be to CUDA memory, not a {value.device} "
                             "tensor")
        value = value.data_ptr()
    return c_void_p(0 if value is None else _int(ctypes.c_uint64, 64, False, value).value)


def _kernel_params(args: tuple[KernelArg, ...]) -> ctypes.Array:
    """cuLaunchKernel's `void** kernelParams`: the address of each value's bytes. The values
    themselves are the caller's ctypes objects, alive as long as `args` is."""
    params = (c_void_p * len(args))()
    for i, arg in enumerate(args):
        if isinstance(arg, TensorMap):
            params[i] = arg.address
        elif isinstance(arg, (*_SCALARS, ctypes.Structure)):  # a Structure: a struct
            params[i] = ctypes.addressof(arg)  # parameter passed by value, field for field
        else:
            raise TypeError(f"kernel argument {i} is a {type(arg).__name__}: give each value "
                            "its width (ptr(tensor), i32, u32, i64, u64, f32), a TensorMap "
                            "or a ctypes.Structure")
    return params


def _dim3(what: str, value: int | Sequence[int]) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, int) else tuple(value)
    if not 1 <= len(dims) <= 3 or any(operator.index(d) < 1 for d in dims):
        raise ValueError(f"{what} must be 1 to 3 positive sizes, got {value!r}")
    return (*dims, 1, 1)[:3]


# --- TMA tensor maps ------------------------------------------------------------------------

_TMA_DTYPES = {torch.uint8: 0, torch.int32: 3, torch.float16: 6, torch.float32: 7,
               torch.bfloat16: 9}  # CUtensorMapDataType
_SWIZZLES = {"none": (0, 0), "32B": (1, 32), "64B": (2, 64), "128B": (3, 128)}  # (enum, span)
_INTERLEAVE_NONE, _L2_PROMOTION_128B, _OOB_FILL_NONE = 0, 2, 0  # OOB: zeros, not NaN


def encode_tensor_map(tensor: torch.Tensor, dims: Sequence[int], strides_bytes: Sequence[int],
                      box: Sequence[int], *, swizzle: str = "none") -> TensorMap:
    """A tiled TMA descriptor over `tensor`'s memory: `dims` and `box` innermost first (dim 0
    is contiguous), `strides_bytes` for dims 1.. (rank - 1 of them), element strides 1, no
    interleave, L2 promotion 128 B, out-of-bounds elements read as zeros."""
    dims, strides, box = (tuple(operator.index(v) for v in s) for s in (dims, strides_bytes, box))
    _check_tensor_map(tensor, dims, strides, box, swizzle)
    if tensor.device.type != "cuda":
        raise ValueError(f"a tensor map describes CUDA memory, not a {tensor.device} tensor")
    rank, tmap = len(dims), TensorMap(tensor)
    _check("cuTensorMapEncodeTiled", _driver().cuTensorMapEncodeTiled(
        c_void_p(tmap.address), _TMA_DTYPES[tensor.dtype], rank, c_void_p(tensor.data_ptr()),
        (c_uint64 * rank)(*dims), (c_uint64 * (rank - 1))(*strides), (c_uint32 * rank)(*box),
        (c_uint32 * rank)(*[1] * rank), _INTERLEAVE_NONE, _SWIZZLES[swizzle][0],
        _L2_PROMOTION_128B, _OOB_FILL_NONE))
    return tmap


def _check_tensor_map(tensor: torch.Tensor, dims: tuple[int, ...], strides: tuple[int, ...],
                      box: tuple[int, ...], swizzle: str) -> None:
    """The rules cuTensorMapEncodeTiled checks (and a few it cannot), as ValueErrors that
    name the argument; rather than the driver's bare CUDA_ERROR_INVALID_VALUE."""
    if tensor.dtype not in _TMA_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in _TMA_DTYPES)
        raise ValueError(f"a tensor map takes {names} tensors, not {tensor.dtype}")
    rank, esize = len(dims), tensor.element_size()
    if not 1 <= rank <= 5:
        raise ValueError(f"a tensor map has 1 to 5 dims, got {rank}")
    if len(box) != rank or len(strides) != rank - 1:
        raise ValueError(f"{rank} dims need {rank} box sizes and {rank - 1} strides_bytes "
                         f"(dims 1..; dim 0 is contiguous), got {len(box)} and {len(strides)}")
    for i, d in enumerate(dims):
        if not 1 <= d <= 1 << 32:
            raise ValueError(f"dims[{i}] = {d} is out of 1..2^32")
    for i, s in enumerate(strides):
        if s <= 0 or s % 16 or s >= 1 << 40:
            raise ValueError(f"strides_bytes[{i}] = {s} (dim {i + 1}) must be a positive "
                             "multiple of 16 below 2^40")
    for i, b in enumerate(box):
        if not 1 <= b <= 256:
            raise ValueError(f"box[{i}] = {b} is out of 1..256")
    row = box[0] * esize
    if row % 16:
        raise ValueError(f"the box's inner row is {row} bytes (box[0] = {box[0]} x {esize}); "
                         "it must be a multiple of 16")
    if swizzle not in _SWIZZLES:
        raise ValueError(f"swizzle {swizzle!r}: one of {', '.join(_SWIZZLES)}")
    span = _SWIZZLES[swizzle][1]
    if span and row > span:
        raise ValueError(f"swizzle {swizzle} needs the box's inner row ({row} bytes) to be at "
                         f"most {span} bytes")
    if tensor.data_ptr() % 16:
        raise ValueError(f"the tensor's address {tensor.data_ptr():#x} is not 16-byte aligned "
                         "(a view at an odd offset?)")
    reach = dims[0] * esize + sum((d - 1) * s for d, s in zip(dims[1:], strides))
    have = tensor.untyped_storage().nbytes() - tensor.storage_offset() * esize
    if reach > have:
        raise ValueError(f"dims and strides_bytes reach {reach} bytes past the tensor's address; "
                         f"its storage holds {have}")
