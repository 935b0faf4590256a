"""The environment: every `HISPARSE_*` variable (and Triton's TRITON_INTERPRET) is read here and
nowhere else.

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
| HISPARSE_PDL | `pdl_allowed` | 0: no programmatic dependent launch |
| HISPARSE_NVRTC | `nvrtc_override` | the libnvrtc to load |
| TRITON_INTERPRET | `triton_interpret` | Triton's CPU interpreter (tests) |

The test-only variables (HISPARSE_SLOW_TESTS, HISPARSE_TEST_HOME) are read by tests/conftest.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hisparse_cli.errors import ConfigError

BACKENDS = ("auto", "torch", "triton")
DECODE_KERNELS = ("auto", "persistent", "layers")
NVRTC_ENV = "HISPARSE_NVRTC"


@dataclass(frozen=True)
class Environment:
    """The variables that choose how a run executes (validated; config/execution.py)."""

    backend: str = "auto"  # HISPARSE_BACKEND
    cuda_graph: bool = True  # HISPARSE_CUDA_GRAPH != "0"
    graph_sampler: bool = True  # HISPARSE_GRAPH_SAMPLER != "0"
    decode_kernel: str = "auto"  # HISPARSE_DECODE_KERNEL
    # (issue 37's thread setting, HISPARSE_THREADS, belongs here)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"HISPARSE_BACKEND must be auto, torch or triton, got "
                              f"{self.backend!r}")
        if self.decode_kernel not in DECODE_KERNELS:
            raise ConfigError(f"HISPARSE_DECODE_KERNEL={self.decode_kernel!r}: "
                              f"expected one of {', '.join(DECODE_KERNELS)}")


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


def read_environment(environ=None) -> Environment:
    """The execution variables of `environ` (default: os.environ, read now)."""
    env = os.environ if environ is None else environ
    return Environment(backend=backend_setting(env),
                       cuda_graph=env.get("HISPARSE_CUDA_GRAPH") != "0",
                       graph_sampler=env.get("HISPARSE_GRAPH_SAMPLER", "").strip() != "0",
                       decode_kernel=decode_kernel_setting(env))


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


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1: Triton kernels run in its CPU interpreter (Triton reads it at import;
    the kernels read it to choose their CPU paths)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


__all__ = ["Environment", "read_environment", "backend_setting", "decode_kernel_setting",
           "hisparse_home", "debug_enabled", "pdl_allowed", "nvrtc_override",
           "triton_interpret", "BACKENDS", "DECODE_KERNELS", "NVRTC_ENV"]
