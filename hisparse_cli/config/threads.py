"""The CPU thread policy of a process: how many threads torch and the native decode kernels
use in each phase of a run, and how its OpenMP threads wait.

Decided once per run, in its ExecutionPlan (config/execution.py: `threads`), from the CPUs
this process may run on (its affinity mask), its cgroup CPU quota (cgroup v2 `cpu.max`, v1
`cpu.cfs_quota_us`), and an override, by precedence

    --threads N  >  HISPARSE_THREADS  >  OMP_NUM_THREADS  >  auto

(the variables are read in config/env.py). An override is used as given, in every phase.
`auto` uses every CPU the process may use (the quota rounded down), and the engine's
`ThreadGovernor` (engine/thread_governor.py) lowers a phase's count while other work holds
CPUs: each `interval` seconds it reads the CPU time the allowed CPUs spent outside this
process (/proc/stat minus our own) and how long our runnable threads waited for a CPU
(/proc/self/task/*/schedstat), and `plan_threads` (pure) gives the count.
A CPU taken by another process costs a run that CPU and no more: OpenMP threads that must
meet at a barrier after every operation (thousands per decode token) otherwise wait for the
thread that lost its CPU, a time slice at a time (BENCHMARKS.md, CPU section: decode 25.6 ->
1.8 tok/s with one busy process). Each phase starts on the whole budget for one interval
(a probe); when lowered, the governor probes again after `probe_every` seconds (doubling
after each probe that finds the CPUs still taken, up to 8x): a process that only takes idle
CPUs (SCHED_IDLE, nice 19) yields during a probe, and the count stays up.

OpenMP (libgomp, torch's) reads its wait policy once, when torch loads:
`config.env.bound_openmp_spin()` (the CLI calls it first thing) bounds the spin of waiting threads (`GOMP_SPINCOUNT=10000`,
~tens of microseconds; the default spins up to milliseconds on a CPU another thread needs)
unless the user set OMP_WAIT_POLICY or GOMP_SPINCOUNT. Measured: the same speed as the
default on an idle machine, no collapse on a busy one (BENCHMARKS.md). Library users who
import torch first keep OpenMP's default; the governor still protects them.

For a worker pool (one process per worker): in each worker, before loading the engine,
`apply_thread_policy(resolve_thread_policy(override=threads_per_worker))`.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from hisparse_cli.config.env import Environment, bound_openmp_spin, read_environment
from hisparse_cli.errors import ConfigError

PHASES = ("prefill", "decode")


@dataclass(frozen=True)
class ThreadPolicy:
    """The decided policy (see the module docstring). `threads(phase)` is the count of a
    phase with no other work running; the governor may use fewer under `auto`."""

    cpus: int                  # CPUs in this process's affinity mask
    quota: float | None        # cgroup CPU quota in CPUs (None: no quota)
    override: int | None       # the count asked for (None: auto)
    source: str                # "auto" | "--threads" | "HISPARSE_THREADS" | "OMP_NUM_THREADS"
    openmp_wait: str           # the OpenMP wait setting this process runs with

    def __post_init__(self) -> None:
        if self.cpus < 1:
            raise ConfigError(f"cpus must be >= 1, got {self.cpus}")
        if self.override is not None and self.override < 1:
            raise ConfigError(f"threads must be >= 1, got {self.override}",
                              hint="give --threads a whole number of at least 1")

    @property
    def budget(self) -> int:
        return cpu_budget(self.cpus, self.quota)

    @property
    def adaptive(self) -> bool:
        return self.override is None

    def threads(self, phase: str, busy_elsewhere: float = 0.0) -> int:
        return plan_threads(self.cpus, self.quota, phase, self.override, busy_elsewhere)

    def describe(self) -> str:
        quota = f", quota {self.quota:g} CPUs" if self.quota is not None else ""
        if self.override is not None:
            return f"{self.override} ({self.source}; {self.cpus} CPUs{quota})"
        return f"auto ({self.cpus} CPUs{quota}; fewer while other work holds CPUs)"

    def to_dict(self) -> dict:
        return {**asdict(self), "budget": self.budget}


def cpu_budget(cpus: int, quota: float | None) -> int:
    """Threads a process may keep busy: its CPUs, or fewer under a quota (rounded down: a
    thread beyond the quota is throttled every period, and its barrier partners wait)."""
    if quota is not None:
        return max(1, min(cpus, math.floor(quota + 1e-9)))
    return max(1, cpus)


def plan_threads(cpus: int, quota: float | None, phase: str, override: int | None = None,
                 busy_elsewhere: float = 0.0) -> int:
    """Threads for `phase` ("prefill" | "decode"): the override when given; else the CPU
    budget less the CPUs other work keeps busy (`busy_elsewhere`, in CPUs, measured by the
    governor), rounded to the nearest, at least 1. Measured on the development machine:
    both phases run fastest on every free CPU (prefill's large matmuls and decode's
    one-row products alike), and one thread per CPU taken fewer is faster than keeping it
    (BENCHMARKS.md, CPU section)."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    if override is not None:
        return override
    budget = cpu_budget(cpus, quota)
    free = budget - max(0.0, busy_elsewhere)
    return max(1, min(budget, math.floor(free + 0.5)))


# -- what the process may use (read once) ----------------------------------------------------
def affinity_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def cgroup_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (v2 cpu.max or v1 cfs), None if none."""
    try:
        rel = "/"
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            parts = line.split(":", 2)
            if len(parts) == 3 and (parts[0] == "0" or "cpu" in parts[1].split(",")):
                rel = parts[2]
                if parts[0] == "0":
                    break
    except OSError:
        rel = "/"
    for folder in (root / rel.lstrip("/"), root):
        text = _read(folder / "cpu.max")
        if text:
            limit, _, period = text.partition(" ")
            if limit != "max" and period:
                return int(limit) / int(period)
            return None
        q, p = _read(folder / "cpu" / "cpu.cfs_quota_us"), _read(folder / "cpu" / "cpu.cfs_period_us")
        q = q or _read(folder / "cpu.cfs_quota_us")
        p = p or _read(folder / "cpu.cfs_period_us")
        if q and p and int(q) > 0:
            return int(q) / int(p)
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def resolve_thread_policy(override: int | None = None,
                          env: Environment | None = None) -> ThreadPolicy:
    """The policy of this process: `override` (--threads) > the environment's count
    (HISPARSE_THREADS, OMP_NUM_THREADS) > auto, over this process's CPUs and quota. env:
    the environment (default: read now; OpenMP's spin is bounded first if torch is not
    loaded yet)."""
    if env is None:
        bound_openmp_spin()
        env = read_environment()
    source = "--threads"
    if override is None:
        override, source = env.threads, env.threads_source
    return ThreadPolicy(cpus=len(affinity_cpus()), quota=cgroup_quota(), override=override,
                        source=source, openmp_wait=env.openmp_wait)


def apply_thread_policy(policy: ThreadPolicy | None = None, phase: str = "prefill") -> ThreadPolicy:
    """Make `policy` (default: resolved from the environment) this process's: OpenMP's wait
    bounded if torch is not loaded yet, torch's thread count set to the phase's count (a
    worker process of a pool calls it before it loads its engine). Returns the policy."""
    bound_openmp_spin()
    if policy is None:
        policy = resolve_thread_policy()
    import torch

    torch.set_num_threads(policy.threads(phase))
    return policy


__all__ = ["ThreadPolicy", "plan_threads", "cpu_budget", "resolve_thread_policy",
           "apply_thread_policy", "affinity_cpus", "cgroup_quota", "PHASES"]
