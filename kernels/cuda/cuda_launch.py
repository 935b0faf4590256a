"""Runtime-built CUDA C++ kernels, the launch half: the CUDA driver API through ctypes.

`load_module(compiled, device).function("k<float, 4>")` -> `Function` (a cubin from
kernels/cuda/cuda_rt.py's `compile_cubin`), then `fn.launch(grid, block, shared_bytes, [ptr(y),
i32(n), f32(eps), tensor_map])` on torch's current stream, so `torch.cuda.graph` captures it
like any kernel. Every scalar argument states its width (`i32`, `u32`, `i64`, `u64`, `f32`;
`ptr` for a tensor's address); a `ctypes.Structure` goes by value as a struct parameter; a
`TensorMap` (`encode_tensor_map`, TMA, sm_90) goes by value into the kernel's
`const __grid_constant__` 128-byte parameter. Modules are never unloaded: a captured graph
keeps calling their functions. The device's primary context (torch's) is made current where
none is. A failed driver call raises `CudaDriverError` with the call, the CUresult's name and
the driver's text.
"""

from __future__ import annotations

import contextlib
import ctypes
import operator
from collections.abc import Iterator, Sequence
from ctypes import POINTER, byref, c_char_p, c_int, c_uint, c_uint32, c_uint64, c_void_p
from dataclasses import dataclass
from functools import lru_cache
from typing import Union

import torch

from hisparse_cli.kernels.cuda.cuda_rt import Compiled, CudaRtError

__all__ = [
    "CudaDriverError", "Module", "Function", "FuncAttributes", "TensorMap", "load_module",
    "device_arch", "encode_tensor_map", "ptr", "i32", "u32", "i64", "u64", "f32",
]


class CudaDriverError(CudaRtError):
    """A driver call returned an error: `call`, the CUresult `code` and its `name`."""

    default_hint = "rerun with HISPARSE_DEBUG=1 for the details"

    def __init__(self, call: str, code: int) -> None:
        self.call, self.code = call, code
        self.name, text = _driver_error_text(code)
        super().__init__(f"{call} failed: {self.name} ({text})")



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
