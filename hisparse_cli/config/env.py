"""The environment: every `HISPARSE_*` variable (and Triton's TRITON_INTERPRET and
TRITON_CACHE_DIR) is read here and nowhere else.

Each function reads `os.environ` when it is called (tests and benchmarks set variables between
runs); what a run decides from them is fixed once, in its `ExecutionPlan`
(config/execution.py), which the Engine and the memory planner both take.

| variable | read by | meaning |
|---|---|---|
| HISPARSE_HOME | `hisparse_home` | cache of models and compiled kernels (default ~/.cache/hisparse) |
| HISPARSE_DEBUG | `debug_enabled` | print tracebacks with errors |
| HISPARSE_BACKEND | `Environment.backend` | auto / torch / triton kernels |
| HISPARSE_CUDA_GRAPH | `Environment.cuda_graph` | 0: decode without CUDA graphs |
| HISPARSE_GRAPH_SAMPLER | `Environment.graph_sampler` | 0: greedy graph decodes sample between replays |
| HISPARSE_DECODE_KERNEL | `Environment.decode_kernel` | auto / persistent / layers |
| HISPARSE_PREFILL_FP8 | `Environment.prefill_fp8` | 1: INT4 prefill in W4A8 where the GPU runs it (opt-in: costs quality, QUALITY.md) |
| HISPARSE_PDL | `pdl_allowed` | 0: no programmatic dependent launch |
| HISPARSE_NVRTC | `nvrtc_override` | the libnvrtc to load |
| TRITON_INTERPRET | `triton_interpret` | Triton's CPU interpreter (tests) |
| TRITON_CACHE_DIR | `triton_cache_setting` | the user's Triton cache (else kernels/compile_cache.py's) |
| HISPARSE_THREADS, OMP_NUM_THREADS | `threads_setting` (`Environment.threads`) | CPU threads in every phase (config/threads.py) |
| OMP_WAIT_POLICY, GOMP_SPINCOUNT | `openmp_wait_setting`, `bound_openmp_spin` | OpenMP's wait; the spin is bounded before torch loads |
| CC | `c_compiler_setting` | the C compiler of the native CPU kernels (kernels/cpu/) |
| PYTORCH_CUDA_ALLOC_CONF, PYTORCH_ALLOC_CONF | `allocator_setting`, `prefer_expandable_segments` | torch's CUDA allocator: expandable segments unless the user set either |

The test-only variables (HISPARSE_SLOW_TESTS, HISPARSE_TEST_HOME) are read by tests/conftest.py.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from hisparse_cli.errors import ConfigError

BACKENDS = ("auto", "torch", "triton")
DECODE_KERNELS = ("auto", "persistent", "layers")
NVRTC_ENV = "HISPARSE_NVRTC"
TRITON_CACHE_ENV = "TRITON_CACHE_DIR"
THREADS_ENV = "HISPARSE_THREADS"
SPIN_ENV, SPIN_COUNT = "GOMP_SPINCOUNT", "10000"
ALLOC_ENVS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch >= 2.9 reads either
EXPANDABLE = "expandable_segments:True"


@dataclass(frozen=True)
class Environment:
    """The variables that choose how a run executes (validated; config/execution.py)."""

    backend: str = "auto"  # HISPARSE_BACKEND
    cuda_graph: bool = True  # HISPARSE_CUDA_GRAPH != "0"
    graph_sampler: bool = True  # HISPARSE_GRAPH_SAMPLER != "0"
    decode_kernel: str = "auto"  # HISPARSE_DECODE_KERNEL
    prefill_fp8: bool = False  # HISPARSE_PREFILL_FP8 == "1"
    threads: int | None = None  # HISPARSE_THREADS, else OMP_NUM_THREADS (None: auto)
    threads_source: str = "auto"  # the variable `threads` came from
    openmp_wait: str = "OpenMP default"  # OMP_WAIT_POLICY / GOMP_SPINCOUNT as set

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"HISPARSE_BACKEND must be auto, torch or triton, got "
                              f"{self.backend!r}")
        if self.decode_kernel not in DECODE_KERNELS:
            raise ConfigError(f"HISPARSE_DECODE_KERNEL={self.decode_kernel!r}: "
                              f"expected one of {', '.join(DECODE_KERNELS)}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"{self.threads_source} must be >= 1, got {self.threads}")


def backend_setting(environ=None) -> str:
    """HISPARSE_BACKEND as given ("auto" when unset or empty); validated by its users."""
    env = os.environ if environ is None else environ
    return env.get("HISPARSE_BACKEND") or "auto"


def decode_kernel_setting(environ=None) -> str:
    """HISPARSE_DECODE_KERNEL: unset or empty is "auto"; case and spaces do not matter; any
    value other than auto / persistent / layers is a ConfigError naming the three."""
    env = os.environ if environ is None else environ
    raw = env.get("HISPARSE_DECODE_KERNEL", "")
    value = raw.strip().lower() or "auto"
    if value not in DECODE_KERNELS:
        raise ConfigError(f"HISPARSE_DECODE_KERNEL={raw!r}: "
                          f"expected one of {', '.join(DECODE_KERNELS)}")
    return value


def threads_setting(environ=None) -> tuple[int | None, str]:
    """(count, variable): HISPARSE_THREADS, else OMP_NUM_THREADS, else (None, "auto"). A value
    that is not a whole number >= 1 is a ConfigError naming the variable."""
    env = os.environ if environ is None else environ
    for name in (THREADS_ENV, "OMP_NUM_THREADS"):
        raw = env.get(name, "").strip()
        if name == "OMP_NUM_THREADS":
            raw = raw.split(",")[0].strip()  # a nested list "4,2": the outer level is ours
        if not raw:
            continue
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value < 1:
            raise ConfigError(f"{name}={raw!r} is not a whole number of threads >= 1",
                              hint=f"unset {name} or give it a count such as 2")
        return value, name
    return None, "auto"


def openmp_wait_setting(environ=None) -> str:
    """OMP_WAIT_POLICY / GOMP_SPINCOUNT as set ("OpenMP default" when neither is)."""
    env = os.environ if environ is None else environ
    parts = [f"{k}={env[k]}" for k in ("OMP_WAIT_POLICY", SPIN_ENV) if env.get(k)]
    return ", ".join(parts) if parts else "OpenMP default"


def bound_openmp_spin(environ=None, torch_loaded: bool | None = None) -> str:
    """Bound the spin-wait of OpenMP's idle threads (GOMP_SPINCOUNT=10000, ~tens of
    microseconds; libgomp's default spins up to milliseconds on a CPU another thread needs)
    unless torch is loaded already (libgomp has read its settings) or the user chose
    OMP_WAIT_POLICY or GOMP_SPINCOUNT. Returns the wait setting the process runs with.
    config/threads.py says why; the CLI and the tests call it before torch loads."""
    env = os.environ if environ is None else environ
    if torch_loaded is None:
        torch_loaded = "torch" in sys.modules
    if not torch_loaded and not env.get("OMP_WAIT_POLICY") and not env.get(SPIN_ENV):
        env[SPIN_ENV] = SPIN_COUNT
    return openmp_wait_setting(env)


def allocator_setting(environ=None) -> str:
    """torch's CUDA allocator settings as set (PYTORCH_CUDA_ALLOC_CONF, PYTORCH_ALLOC_CONF;
    "" when neither is)."""
    env = os.environ if environ is None else environ
    return ",".join(env[k] for k in ALLOC_ENVS if env.get(k, "").strip())


def prefer_expandable_segments(environ=None, cuda_initialized: bool | None = None) -> str:
    """Run torch's CUDA caching allocator with expandable segments
    (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) unless the user set its variables or
    CUDA is initialised already (torch reads them once, when CUDA initialises). A plan that
    fits a small card can still fail on fixed-size segments: a 128K-token run of the 8B model
    in the emulated 6 GiB card stranded 343 MiB in segments too small for a 128 MiB request
    (BENCHMARKS.md). Returns the allocator settings the process runs with."""
    env = os.environ if environ is None else environ
    if cuda_initialized is None:
        torch = sys.modules.get("torch")
        cuda_initialized = torch is not None and torch.cuda.is_initialized()
    if not cuda_initialized and not allocator_setting(env):
        env[ALLOC_ENVS[0]] = EXPANDABLE
    return allocator_setting(env)


def c_compiler_setting() -> str:
    """CC: the C compiler the native CPU kernels are built with first ("" when unset)."""
    return os.environ.get("CC", "").strip()


def read_environment(environ=None) -> Environment:
    """The execution variables of `environ` (default: os.environ, read now)."""
    env = os.environ if environ is None else environ
    threads, source = threads_setting(env)
    return Environment(backend=backend_setting(env),
                       cuda_graph=env.get("HISPARSE_CUDA_GRAPH") != "0",
                       graph_sampler=env.get("HISPARSE_GRAPH_SAMPLER", "").strip() != "0",
                       decode_kernel=decode_kernel_setting(env),
                       prefill_fp8=env.get("HISPARSE_PREFILL_FP8", "").strip() == "1",
                       threads=threads,
                       threads_source=source, openmp_wait=openmp_wait_setting(env))


def hisparse_home() -> Path:
    """Root of hisparse's cache: `$HISPARSE_HOME`, else `~/.cache/hisparse` (absolute)."""
    env = os.environ.get("HISPARSE_HOME", "").strip()
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "hisparse"
    return root.absolute()


def debug_enabled() -> bool:
    """HISPARSE_DEBUG set to anything but "", 0, false, no: tracebacks with errors."""
    return os.environ.get("HISPARSE_DEBUG", "").strip() not in ("", "0", "false", "no")


def pdl_allowed() -> bool:
    """HISPARSE_PDL=0 turns programmatic dependent launch off (kernels/pdl.py)."""
    return os.environ.get("HISPARSE_PDL", "1") != "0"


def nvrtc_override() -> str:
    """HISPARSE_NVRTC: the libnvrtc file to load alone ("" when unset)."""
    return os.environ.get(NVRTC_ENV, "").strip()


def triton_cache_setting() -> str:
    """TRITON_CACHE_DIR as the user set it ("" when unset): kept instead of hisparse's own
    toolchain-keyed folder (kernels/compile_cache.py)."""
    return os.environ.get(TRITON_CACHE_ENV, "").strip()


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1: Triton kernels run in its CPU interpreter (Triton reads it at import;
    the kernels read it to choose their CPU paths)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


__all__ = ["Environment", "read_environment", "backend_setting", "decode_kernel_setting",
           "hisparse_home", "debug_enabled", "pdl_allowed", "nvrtc_override",
           "triton_interpret", "triton_cache_setting", "threads_setting",
           "openmp_wait_setting", "bound_openmp_spin", "c_compiler_setting",
           "allocator_setting", "prefer_expandable_segments", "BACKENDS", "DECODE_KERNELS",
           "NVRTC_ENV", "TRITON_CACHE_ENV", "THREADS_ENV", "SPIN_ENV", "SPIN_COUNT",
           "ALLOC_ENVS", "EXPANDABLE"]
