"""Where compiled GPU kernels are kept across processes, and what that place is keyed by.

Two compilers fill hisparse's GPU kernel cache under `$HISPARSE_HOME/kernels/`:
  * Triton (every @triton.jit kernel): its own cache (IR, PTX, cubin, the C launcher) goes to
    `kernels/triton/<toolchain>/`, set as TRITON_CACHE_DIR before hisparse first imports
    Triton (`use_triton_cache`; kernels/dispatch.py calls it). A TRITON_CACHE_DIR the user set
    is kept. Without this Triton would use ~/.triton/cache, shared with every other Triton
    program and never keyed by the driver.
  * NVRTC (the CUDA C++ decode kernel): `kernels/<sha256>.cubin` (kernels/cuda/cuda_rt.py),
    keyed by the source, options, GPU arch, NVRTC version and the driver version.
Both are keyed by the same facts: the compiler (Triton's version with torch's and its CUDA's;
NVRTC's version), the driver, the GPU architecture. A driver or toolkit update therefore
compiles into a fresh place instead of loading what an older one built (a cubin from a
newer toolchain than the driver can run fails to load). Old folders are left in place
(`rm -r $HISPARSE_HOME/kernels/triton` reclaims them). `hisparse warmup` fills both.

`toolchain()` -> `Toolchain`: the versions, each "" where unknown; `.slug` names a folder.
Cheap to read: the driver version comes from /proc/driver/nvidia/version (else libcuda's
cuDriverGetVersion, which needs no cuInit), Triton's version from its package metadata
(Triton is not imported), the GPU's compute capability from torch's device query (only where
torch sees a CUDA device; a CUDA run initializes CUDA anyway).
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from hisparse_cli.config.env import TRITON_CACHE_ENV, hisparse_home, triton_cache_setting

__all__ = ["Toolchain", "toolchain", "driver_version", "triton_cache_dir", "use_triton_cache",
           "TritonCache"]

_PROC_VERSION = "/proc/driver/nvidia/version"


@dataclass(frozen=True)
class Toolchain:
    """What compiled kernels depend on besides their source (module doc)."""

    triton: str = ""  # Triton's version
    torch: str = ""  # torch's version (its CUDA build, e.g. 2.11.0+cu130)
    cuda: str = ""  # torch.version.cuda: the CUDA runtime torch (and its launchers) use
    driver: str = ""  # the NVIDIA driver: "580.65.06" (or "cuda-13.0" from libcuda)
    arch: str = ""  # the current GPU's compute capability: "sm90"
    python: str = f"{sys.version_info[0]}.{sys.version_info[1]}"  # Triton's C launcher

    @property
    def slug(self) -> str:
        """A folder name that changes whenever any field does ("none" for an unknown one)."""
        fields = (("triton", self.triton), ("torch", self.torch), ("cuda", self.cuda),
                  ("driver", self.driver), ("arch", self.arch), ("py", self.python))
        return "_".join(f"{name}-{re.sub(r'[^A-Za-z0-9.+-]', '-', value) or 'none'}"
                        for name, value in fields)


def _driver_from_proc(path: str = _PROC_VERSION) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    found = re.search(r"Kernel Module(?: for \w+)?\s+([0-9][0-9.]*)", text)
    return found.group(1) if found else ""


def _driver_from_libcuda() -> str:
    """cuDriverGetVersion (needs no cuInit): the newest CUDA the driver runs, "cuda-13.0"."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(version)) != 0:
            return ""
    except (OSError, AttributeError):
        return ""
    v = version.value
    return f"cuda-{v // 1000}.{(v % 1000) // 10}" if v > 0 else ""


@lru_cache(maxsize=1)
def driver_version() -> str:
    """The NVIDIA driver's version ("" without one); read once a process."""
    return _driver_from_proc() or _driver_from_libcuda()


def _package_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return ""


def toolchain() -> Toolchain:
    """This process's Toolchain (torch is imported; Triton is not)."""
    import torch

    arch = ""
    try:
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            arch = f"sm{major}{minor}"
    except RuntimeError:  # a driver that refuses the query: the folder says "none"
        pass
    return Toolchain(triton=_package_version("triton"), torch=torch.__version__,
                     cuda=torch.version.cuda or "", driver=driver_version(), arch=arch)


def triton_cache_dir(chain: Toolchain | None = None) -> Path:
    """hisparse's Triton cache folder for `chain` (default: this process's toolchain)."""
    return hisparse_home() / "kernels" / "triton" / (chain or toolchain()).slug


@dataclass(frozen=True)
class TritonCache:
    path: str  # the folder Triton compiles into
    source: str  # "hisparse" (keyed by the toolchain) or "TRITON_CACHE_DIR" (the user's)


@lru_cache(maxsize=1)
def use_triton_cache() -> TritonCache:
    """Point TRITON_CACHE_DIR at `triton_cache_dir()` unless the user set it; once a process,
    before Triton compiles anything (it reads the variable at each compile)."""
    given = triton_cache_setting()
    if given:
        return TritonCache(given, TRITON_CACHE_ENV)
    path = str(triton_cache_dir())
    os.environ[TRITON_CACHE_ENV] = path
    return TritonCache(path, "hisparse")
