"""The thread governor: sets torch's (and the native kernels') thread count for each phase of
a CPU run and lowers it while other work holds CPUs (the policy: config/threads.py).

Each `interval` seconds of a phase it measures what the allowed CPUs did (`CpuLoad`: their
busy time in /proc/stat less our own CPU time, and our threads' run-queue wait from
/proc/self/task/*/schedstat), turns that into the CPUs other work takes from us
(`contention`), and asks the policy for the count (`plan_threads`). Each phase starts on the
whole budget for one interval (a probe); when lowered, it probes again after `probe_every`
seconds, doubling the wait after each probe that finds the CPUs still taken (up to 8x).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, NamedTuple

from hisparse_cli.config.threads import ThreadPolicy, affinity_cpus


# -- contention, measured --------------------------------------------------------------------
class Load(NamedTuple):
    busy_elsewhere: float     # CPUs' worth of time the allowed CPUs ran other processes
    waited: float | None      # CPUs' worth of time our runnable threads waited for a CPU


class CpuLoad:
    """What the allowed CPUs did between two `sample()` calls, per wall second (Linux: the
    CPUs' busy time in /proc/stat less our own CPU time; our threads' run-queue wait from
    /proc/self/task/*/schedstat). None elsewhere, or on the first call. proc, own_cpu and
    hz: where /proc is, this process's CPU seconds so far, /proc/stat's ticks a second (tests
    give constructed ones)."""

    def __init__(self, cpus: list[int] | None = None, clock: Callable[[], float] = time.monotonic,
                 *, proc: Path = Path("/proc"), own_cpu: Callable[[], float] | None = None,
                 hz: int | None = None):
        self.cpus = set(affinity_cpus() if cpus is None else cpus)
        self.clock, self.proc = clock, Path(proc)
        self.own_cpu = own_cpu or _own_cpu_seconds
        self.hz = hz or (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)
        self._last = self._read()

    def _read(self):
        try:
            lines = (self.proc / "stat").read_text().splitlines()
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
        return self.clock(), busy / self.hz, self.own_cpu(), _run_delays(self.proc)

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


def _own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def _run_delays(proc: Path) -> dict[str, int] | None:
    """Nanoseconds each of our threads has waited runnable for a CPU (schedstat's second
    field), by thread id; None where the kernel does not keep it."""
    out = {}
    tasks = proc / "self" / "task"
    try:
        tids = os.listdir(tasks)
    except OSError:
        return None
    for tid in tids:
        try:
            out[tid] = int((tasks / tid / "schedstat").read_text().split()[1])
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
                    else:  # the next probe comes `_wait` seconds from now
                        self._raised = now
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


__all__ = ["ThreadGovernor", "CpuLoad", "Load", "contention"]
