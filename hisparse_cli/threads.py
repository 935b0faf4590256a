"""The CPU thread policy of a process: how many threads torch and the native decode kernels
use in each phase of a run, and how its OpenMP threads wait.

Decided once per process (`process_thread_policy()`, or `resolve_thread_policy(override)` in
runtime.load_engine): the CPUs this process may run on (its affinity mask), its cgroup CPU
quota (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us`), and an override, by precedence

    --threads N  >  HISPARSE_THREADS  >  OMP_NUM_THREADS  >  auto

An override is used as given, in every phase. `auto` uses every CPU the process may use
(the quota rounded down), and the engine's `ThreadGovernor` lowers a phase's count while
other work holds CPUs: each `interval` seconds it reads the CPU time the allowed CPUs spent
outside this process (/proc/stat minus our own) and how long our runnable threads waited for a
CPU (/proc/self/task/*/schedstat), and `plan_threads` (pure) gives the count (`contention`).
A CPU taken by another process costs a run that CPU and no more: OpenMP threads that must
meet at a barrier after every operation (thousands per decode token) otherwise wait for the
thread that lost its CPU, a time slice at a time (BENCHMARKS.md, CPU section: decode 25.6 ->
1.8 tok/s with one busy process). Each phase starts on the whole budget for one interval
(a probe); when lowered, the governor probes again after `probe_every` seconds (doubling
after each probe that finds the CPUs still taken, up to 8x): a process that only takes idle
CPUs (SCHED_IDLE, nice 19) yields during a probe, and the count stays up.

OpenMP (libgomp, torch's) reads its wait policy once, when torch loads: `prepare_openmp()`
(the CLI calls it first thing) bounds the spin of waiting threads (`GOMP_SPINCOUNT=10000`,
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
import sys
import time
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Mapping, NamedTuple

from hisparse_cli.errors import ConfigError

PHASES = ("prefill", "decode")
SPIN_ENV = "GOMP_SPINCOUNT"
SPIN_COUNT = "10000"
ENV = "HISPARSE_THREADS"


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


def _override_from_env(env: Mapping[str, str]) -> tuple[int | None, str]:
    for name in (ENV, "OMP_NUM_THREADS"):
        raw = env.get(name, "").strip()
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


def openmp_wait_setting(env: Mapping[str, str] = os.environ) -> str:
    parts = [f"{k}={env[k]}" for k in ("OMP_WAIT_POLICY", SPIN_ENV) if env.get(k)]
    return ", ".join(parts) if parts else "OpenMP default"


def prepare_openmp(env: dict = os.environ) -> str:  # type: ignore[assignment]
    """Bound OpenMP's spin-wait (module docstring) if torch is not loaded yet and the user
    chose no wait setting. Returns the setting the process runs with."""
    if "torch" not in sys.modules and not env.get("OMP_WAIT_POLICY") and not env.get(SPIN_ENV):
        env[SPIN_ENV] = SPIN_COUNT
    return openmp_wait_setting(env)


def resolve_thread_policy(override: int | None = None,
                          env: Mapping[str, str] = os.environ) -> ThreadPolicy:
    """The policy for this process: `override` (--threads) > env > auto (module docstring).
    With the process's own environment, OpenMP's wait is bounded first (prepare_openmp)."""
    if env is os.environ:
        prepare_openmp()
    source = "--threads"
    if override is None:
        override, source = _override_from_env(env)
    return ThreadPolicy(cpus=len(affinity_cpus()), quota=cgroup_quota(), override=override,
                        source=source, openmp_wait=openmp_wait_setting(env))


@lru_cache(maxsize=1)
def process_thread_policy() -> ThreadPolicy:
    """The policy resolved from the environment, once per process (Engine's default)."""
    return resolve_thread_policy()


def apply_thread_policy(policy: ThreadPolicy | None = None, phase: str = "prefill") -> ThreadPolicy:
    """Make `policy` (default: the process's) this process's: OpenMP's wait bounded if torch
    is not loaded yet, torch's thread count set to the phase's count. Returns the policy."""
    prepare_openmp()
    if policy is None:
        policy = process_thread_policy()
    import torch

    torch.set_num_threads(policy.threads(phase))
    return policy


# -- contention, measured --------------------------------------------------------------------
class Load(NamedTuple):
    busy_elsewhere: float     # CPUs' worth of time the allowed CPUs ran other processes
    waited: float | None      # CPUs' worth of time our runnable threads waited for a CPU


class CpuLoad:
    """What the allowed CPUs did between two `sample()` calls, per wall second (Linux: the
    CPUs' busy time in /proc/stat less our own CPU time; our threads' run-queue wait from
    /proc/self/task/*/schedstat). None elsewhere, or on the first call."""

    def __init__(self, cpus: list[int] | None = None, clock: Callable[[], float] = time.monotonic):
        self.cpus = set(affinity_cpus() if cpus is None else cpus)
        self.clock = clock
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last = self._read()

    def _read(self):
        try:
            lines = Path("/proc/stat").read_text().splitlines()
        except OSError:
            return None
        busy = 0
        for line in lines:
            if not line.startswith("cpu") or line.startswith("cpu "):
                continue
            name, *vals = line.split()
            if int(name[3:]) in self.cpus:
                v = [int(x) for x in vals[:8]]
                busy += sum(v) - v[3] - v[4]  # all but idle and iowait
        t = os.times()
        return self.clock(), busy / self.hz, t.user + t.system, _run_delays()

    def sample(self) -> Load | None:
        now = self._read()
        last, self._last = self._last, now
        if now is None or last is None or now[0] - last[0] <= 0:
            return None
        wall = now[0] - last[0]
        busy = max(0.0, ((now[1] - last[1]) - (now[2] - last[2])) / wall)
        waited = None
        if now[3] is not None and last[3] is not None:
            waited = sum(max(0, d - last[3][tid]) for tid, d in now[3].items()
                         if tid in last[3]) / 1e9 / wall
        return Load(busy, waited)


def _run_delays() -> dict[str, int] | None:
    """Nanoseconds each of our threads has waited runnable for a CPU (schedstat's second
    field), by thread id; None where the kernel does not keep it."""
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tids:
        try:
            out[tid] = int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return out or None


def contention(load: Load, threads: int, budget: int) -> float:
    """CPUs other work takes from us, from one interval's load while we ran `threads`: on the
    whole budget, the time our runnable threads waited for a CPU (a process that only fills
    idle time - SCHED_IDLE, nice 19 - is preempted at once and costs nothing); below it,
    the other processes' busy time, which shows whether a CPU we leave is free (an idle-time
    filler looks busy there: the probe finds out)."""
    if threads >= budget and load.waited is not None:
        return load.waited
    return load.busy_elsewhere


class ThreadGovernor:
    """Sets torch's thread count for each phase of a run and re-checks it every `interval`
    seconds of the phase (module docstring). `used` keeps the counts each phase ran with."""

    def __init__(self, policy: ThreadPolicy, *, interval: float = 0.5, probe_every: float = 4.0,
                 load: CpuLoad | None = None, clock: Callable[[], float] = time.monotonic,
                 set_threads: Callable[[int], None] | None = None) -> None:
        self.policy, self.interval, self.probe_every, self.clock = policy, interval, probe_every, clock
        self.load = load if load is not None else (CpuLoad(clock=clock) if policy.adaptive else None)
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        self._set = set_threads
        self.phase, self.n = "prefill", policy.threads("prefill")
        self._set(self.n)
        self._checked = self._raised = clock()
        self._probing = False
        self._wait = probe_every  # until the next probe: doubled after each failed one
        self.used: dict[str, list[int]] = {}

    def begin(self, phase: str) -> int:
        """Start `phase`. Auto: on the whole budget, as a probe whose first interval decides
        (a count lowered less than `probe_every` ago stays lowered); an override: as given."""
        self.phase = phase
        self.used.setdefault(phase, [])
        now = self.clock()
        if self.load is not None and (self.n == self.policy.budget
                                      or now - self._raised >= self._wait):
            self.load.sample()  # the probe's interval starts now
            self._checked = self._raised = now
            self._probing = self.n < self.policy.budget
            self.n = self.policy.budget
            self._set(self.n)
            self._record()
        else:
            self._decide(force=True)
        return self.n

    def tick(self) -> None:
        """Call once per step (a prefill chunk, a decode token): cheap until `interval`."""
        if self.load is not None and self.clock() - self._checked >= self.interval:
            self._decide()

    def _decide(self, force: bool = False) -> None:
        n = self.n
        now = self.clock()
        if self.load is None:
            n = self.policy.threads(self.phase)
        elif now - self._checked >= min(0.1, self.interval):  # (/proc/stat counts 10 ms ticks)
            load = self.load.sample()
            self._checked = now
            if load is not None:
                budget = self.policy.budget
                want = self.policy.threads(self.phase, contention(load, self.n, budget))
                if self._probing:  # a probe's interval ends: keep the budget, or back off
                    self._probing = False
                    self._wait = (self.probe_every if want == budget
                                  else min(8 * self.probe_every, 2 * self._wait))
                    n = want
                elif want != n:  # the load moved
                    if want > n:
                        self._raised, self._wait = now, self.probe_every
                    n = want
                elif n < budget and now - self._raised >= self._wait:
                    n, self._probing, self._raised = budget, True, now
        if n != self.n or force:
            self.n = n
            self._set(n)
        self._record()

    def _record(self) -> None:
        used = self.used.setdefault(self.phase, [])
        if not used or used[-1] != self.n:
            used.append(self.n)

    def report(self) -> dict:
        """{"prefill": [2], "decode": [2, 1]}: the counts each phase ran with, in order."""
        return {k: list(v) for k, v in self.used.items()}


__all__ = ["ThreadPolicy", "plan_threads", "cpu_budget", "resolve_thread_policy",
           "process_thread_policy", "apply_thread_policy", "prepare_openmp", "ThreadGovernor",
           "CpuLoad", "Load", "contention", "affinity_cpus", "cgroup_quota", "PHASES", "ENV"]
