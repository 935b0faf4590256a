"""Where a Ray batch runs: the `--ray` options, the cluster connection and the worker plan.

    options = RayOptions("local", workers=2, threads_per_worker=1)   # validated, no Ray needed
    require_ray()                                    # ConfigError (exit 2) naming the extra
    owned = connect(options.address)                 # True when we started the cluster
    plan = worker_plan(options, profile, cluster_resources())

`--ray local` starts a private single-node cluster for this run (no dashboard; its CPUs and
GPUs are those Ray detects here; a start that fails — on a very busy machine Ray's processes
can miss Ray's own 30 s start-up limit — is tried once more, then a ResourceError, exit 5)
and shuts it down at the end; `auto` joins the cluster
`ray start` runs on this machine (or RAY_ADDRESS); any other value is a cluster address
(`host:6379`, `ray://host:10001`). A process that already called `ray.init` keeps its
connection (a notebook, the tests) and it is never shut down here.

stdout carries only the result: Ray's driver prints the raylet's error messages (a worker
that died, …) on stdout from a thread of its own; `keep_stdout_clean` sends them to stderr
(nothing with --quiet, where our own one-line warning is also not shown) until it is undone.

Defaults (`worker_plan`), when a flag is not given:
  * --gpus-per-worker: 1 for a GPU profile on a cluster with GPUs, else 0 (CPU workers);
  * --workers: the cluster's GPUs / GPUs per worker for GPU workers, else 1;
  * --threads-per-worker: 1 for GPU workers; else the cluster's CPUs / workers, at most the
    largest node's CPUs.
A private cluster that cannot hold what is asked (CPUs = workers x threads, GPUs = workers x
GPUs per worker) is refused (exit 2); on a joined cluster that is only a warning (an
autoscaler may add nodes): the workers wait for resources.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from hisparse_cli.errors import ConfigError, ResourceError

START_ATTEMPTS = 2  # a private cluster whose start timed out is tried once more
RAY_EXTRA_HINT = "install it with: pip install 'hisparse[ray]'"


@dataclass(frozen=True)
class RayOptions:
    """`--ray ADDRESS --workers N --gpus-per-worker G --threads-per-worker T` (None: the
    default of the module docstring)."""

    address: str = "local"
    workers: int | None = None
    gpus_per_worker: float | None = None
    threads_per_worker: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.address, str) or not self.address.strip():
            raise ConfigError("--ray needs local, auto or a cluster address",
                              hint="e.g. --ray local (a private cluster on this machine)")
        for name, low in (("workers", 1), ("threads_per_worker", 1)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < low):
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= {low}, "
                                  f"got {value!r}")
        gpus = self.gpus_per_worker
        if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, (int, float))
                                 or not math.isfinite(gpus) or gpus < 0
                                 or (gpus > 1 and gpus != int(gpus))):
            raise ConfigError(f"--gpus-per-worker must be 0, a fraction of one GPU or a whole "
                              f"number of GPUs, got {gpus!r}",
                              hint="e.g. 1 (one GPU each) or 0.5 (two workers share a GPU)")


@dataclass(frozen=True)
class WorkerPlan:
    workers: int
    threads: int
    gpus: float


def require_ray():
    """The `ray` module, or a ConfigError (exit 2) naming the extra that installs it."""
    try:
        import ray
    except ImportError:
        raise ConfigError("--ray needs Ray, which is not installed",
                          hint=RAY_EXTRA_HINT) from None
    return ray


def connect(address: str, *, quiet: bool = False) -> bool:
    """Connect this process to Ray (module docstring). True when this call started a private
    cluster (the caller shuts it down); ConfigError when no cluster answers."""
    ray = require_ray()
    if ray.is_initialized():
        return False
    level = logging.ERROR if quiet else logging.WARNING
    logging.getLogger("ray").setLevel(level)
    kwargs = {"log_to_driver": False, "logging_level": level}
    if address != "local":
        try:
            ray.init(address=address, **kwargs)
        except Exception as exc:  # noqa: BLE001 - Ray raises plain Exception, ConnectionError, …
            raise ConfigError(f"cannot reach a Ray cluster at {address!r}: {_line(exc)}",
                              hint="start one with `ray start --head` (then --ray auto), give "
                                   "its address, or use --ray local") from None
        return False
    for attempt in range(START_ATTEMPTS):
        try:
            ray.init(include_dashboard=False, **kwargs)
            return True
        except Exception as exc:  # noqa: BLE001 - e.g. the raylet missed Ray's 30 s start-up
            ray.shutdown()  # whatever half-started goes before the next try
            if attempt + 1 == START_ATTEMPTS:
                raise ResourceError(
                    f"the local Ray cluster did not start ({START_ATTEMPTS} tries): "
                    f"{_line(exc)}",
                    hint="a machine this busy may not start Ray's processes within Ray's own "
                         "time limit; try again later, or run the batch without --ray") from None
    return True


def _line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def keep_stdout_clean(*, quiet: bool = False):
    """Route what Ray's driver prints on stdout to stderr (dropped when `quiet`); returns the
    function that undoes it. Ray has no setting for it: its `print_to_stdstream` is wrapped
    where it exists (a Ray without it prints nothing there)."""
    try:
        from ray._private import worker as ray_worker
    except ImportError:
        return lambda: None
    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None:
        return lambda: None

    def to_stderr(data, *args, **kwargs):
        if not quiet:
            original({**data, "is_err": True}, *args, **kwargs)

    ray_worker.print_to_stdstream = to_stderr

    def undo() -> None:
        if ray_worker.print_to_stdstream is to_stderr:
            ray_worker.print_to_stdstream = original

    return undo


def cluster_resources() -> dict:
    """{"cpus", "gpus", "largest_node_cpus", "nodes"} of the connected cluster's live nodes."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    cpus = [float(n.get("Resources", {}).get("CPU", 0)) for n in nodes]
    gpus = [float(n.get("Resources", {}).get("GPU", 0)) for n in nodes]
    return {"cpus": sum(cpus), "gpus": sum(gpus), "largest_node_cpus": max(cpus, default=0),
            "nodes": len(nodes)}


def worker_plan(options: RayOptions, profile, resources: dict, *, private: bool) -> WorkerPlan:
    """Workers, threads and GPUs per worker (defaults and checks: module docstring)."""
    gpu_profile = getattr(profile, "vram_budget_gib", None) is not None
    gpus = options.gpus_per_worker
    if gpus is None:
        gpus = 1 if gpu_profile and resources["gpus"] >= 1 else 0
    if gpus > 0 and not gpu_profile:
        raise ConfigError(f"--gpus-per-worker {gpus:g} with profile {profile.name!r}, which "
                          "runs on the CPU",
                          hint="use a GPU profile (--profile auto or a card's name) or drop "
                               "--gpus-per-worker")
    workers = options.workers
    if workers is None:
        workers = max(1, int(resources["gpus"] // gpus)) if gpus else 1
    threads = options.threads_per_worker
    if threads is None:
        threads = 1 if gpus else max(1, min(int(resources["cpus"] // workers),
                                            int(resources["largest_node_cpus"])))
    plan = WorkerPlan(workers=workers, threads=threads, gpus=float(gpus))
    short = []
    if workers * threads > resources["cpus"]:
        short.append(f"{workers * threads} CPUs ({workers} workers x {threads} threads)")
    if workers * gpus > resources["gpus"]:
        short.append(f"{workers * gpus:g} GPUs ({workers} workers x {gpus:g})")
    if short and private:
        raise ConfigError(f"the local Ray cluster has {resources['cpus']:g} CPUs and "
                          f"{resources['gpus']:g} GPUs; the batch asks for "
                          + " and ".join(short),
                          hint="lower --workers, --threads-per-worker or --gpus-per-worker")
    return plan


def plan_shortfall(plan: WorkerPlan, resources: dict) -> str | None:
    """A warning when a joined cluster has less than the plan asks for now (None if not)."""
    need_cpus, need_gpus = plan.workers * plan.threads, plan.workers * plan.gpus
    if need_cpus <= resources["cpus"] and need_gpus <= resources["gpus"]:
        return None
    return (f"the Ray cluster has {resources['cpus']:g} CPUs and {resources['gpus']:g} GPUs "
            f"now; {plan.workers} workers need {need_cpus:g} CPUs and {need_gpus:g} GPUs: "
            "the workers that do not fit wait until nodes join")


__all__ = ["RayOptions", "WorkerPlan", "require_ray", "connect", "keep_stdout_clean",
           "cluster_resources",
           "worker_plan", "plan_shortfall", "RAY_EXTRA_HINT"]
