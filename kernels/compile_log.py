"""What this process has compiled: Triton specializations and NVRTC cubins, with their time.

Every kernel a run needs is compiled once per machine (kept in the disk caches of
kernels/compile_cache.py) and, in each process, loaded once per specialization: Triton
makes one per distinct set of constexprs, dtypes and integer/pointer value classes, from
its disk cache (a hit: the cubin and its launcher are loaded) or by compiling it (a miss:
codegen, LLVM, ptxas and a C launcher, seconds). This module counts both kinds:

    compiled   the compiler ran (a Triton cache miss, an NVRTC compile): what `hisparse
               warmup` does ahead so that a user's run reports 0
    loaded     taken from the disk cache into this process (Triton's JIT binding and module
               load, an NVRTC cubin read from disk): what every new process pays

`compile_counts()` -> `CompileCounts`, the process's running totals since
`watch_triton()` (called by kernels/dispatch.py when Triton is first imported); subtract
two to get what happened in between (the engine reports that per generate call). Nothing
here imports triton or torch.

How Triton is observed (Triton >= 3.3's knobs; older Triton: nothing is counted, and
`watching()` says so): `knobs.runtime.jit_cache_hook` runs before a specialization is
built and `jit_post_compile_hook` after it (their time apart is the JIT compile or disk
load), `knobs.compilation.listener` says whether the disk cache had it (`cache_hit`), and
`knobs.runtime.kernel_load_end_hook` ends the first launch's setup (the launcher build and
module load, which come after the post-compile hook), whose time is added to the same
specialization. Hooks someone else installed keep running (ours call them first; a cache
hook that returns true still skips the compile, as it would without us).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

__all__ = ["CompileCounts", "compile_counts", "watch_triton", "watching", "record_nvrtc"]


@dataclass(frozen=True)
class CompileCounts:
    """Running totals (or, as a difference of two, what happened in between)."""

    compiled: int = 0  # compiler runs: Triton cache misses + NVRTC compiles
    compile_seconds: float = 0.0
    loaded: int = 0  # specializations / cubins loaded from the disk cache
    load_seconds: float = 0.0
    by_kernel: tuple[tuple[str, int], ...] = field(default=(), compare=False)  # name -> both

    def __sub__(self, other: "CompileCounts") -> "CompileCounts":
        mine, theirs = Counter(dict(self.by_kernel)), Counter(dict(other.by_kernel))
        return CompileCounts(self.compiled - other.compiled,
                             self.compile_seconds - other.compile_seconds,
                             self.loaded - other.loaded, self.load_seconds - other.load_seconds,
                             tuple(sorted((mine - theirs).items())))

    def to_dict(self) -> dict:
        """The run stats' form (engine RunStats; summarize sums them over generations)."""
        return {"kernel_compiles": self.compiled, "kernel_compile_seconds": self.compile_seconds,
                "kernel_loads": self.loaded, "kernel_load_seconds": self.load_seconds}


class _Tally:
    """The process's totals and the specialization being built (hooks run in the launching
    thread; Triton compiles one specialization at a time there)."""

    def __init__(self) -> None:
        self.counts = CompileCounts()
        self.kernels: Counter = Counter()
        self.pending: list[list] = []  # [name, start, cache_hit] of compiles in progress
        self.loading: list | None = None  # [bucket, start of the load after a compile]

    def add(self, name: str, compiled: bool, seconds: float) -> None:
        c = self.counts
        self.kernels[name] += 1
        self.counts = CompileCounts(
            c.compiled + compiled, c.compile_seconds + (seconds if compiled else 0.0),
            c.loaded + (not compiled), c.load_seconds + (0.0 if compiled else seconds))

    def add_seconds(self, compiled: bool, seconds: float) -> None:
        c = self.counts
        self.counts = CompileCounts(
            c.compiled, c.compile_seconds + (seconds if compiled else 0.0), c.loaded,
            c.load_seconds + (0.0 if compiled else seconds))


_TALLY = _Tally()  # one per process, like Triton's own kernel caches
_WATCHING: list[bool] = []  # [True] once the hooks are in (False: this Triton has none)


def compile_counts() -> CompileCounts:
    """The process's totals so far (by_kernel: specializations per kernel name)."""
    return CompileCounts(_TALLY.counts.compiled, _TALLY.counts.compile_seconds,
                         _TALLY.counts.loaded, _TALLY.counts.load_seconds,
                         tuple(sorted(_TALLY.kernels.items())))


def record_nvrtc(name: str, compiled: bool, seconds: float) -> None:
    """An NVRTC cubin this process got: compiled now, or read from the disk cache."""
    _TALLY.add(f"nvrtc:{name}", compiled, seconds)


def watching() -> bool:
    """Whether Triton's compiles are being counted (its hooks exist and are ours)."""
    return bool(_WATCHING and _WATCHING[0])


def _kernel_name(fn) -> str:
    module, name = getattr(fn, "module", ""), getattr(fn, "name", "")
    return f"{module.rsplit('.', 1)[-1]}.{name}" if module else str(name or fn)


def _chain(previous, ours):
    """A hook calling `previous` (someone else's, or None) first; its result is returned."""
    if previous is None:
        return ours

    def both(*args, **kwargs):
        result = previous(*args, **kwargs)
        ours(*args, result=result, **kwargs)
        return result

    return both


def _before(*, fn=None, result=None, **_) -> None:
    if not result:  # a cache hook's true result skips the compile (nothing to time)
        _TALLY.pending.append([_kernel_name(fn), time.perf_counter(), None])


def _listener(*, cache_hit: bool = False, result=None, **_) -> None:
    if _TALLY.pending:
        _TALLY.pending[-1][2] = bool(cache_hit)


def _after(*, fn=None, result=None, **_) -> None:
    if not _TALLY.pending:
        return
    name, start, hit = _TALLY.pending.pop()
    now = time.perf_counter()
    compiled = hit is not True  # no listener (unknown): counted as compiled
    _TALLY.add(name, compiled, now - start)
    _TALLY.loading = [compiled, now]


def _loaded(*args, **kwargs) -> None:
    """The first launch's setup of the specialization just built has ended."""
    if _TALLY.loading is not None:
        compiled, start = _TALLY.loading
        _TALLY.loading = None
        _TALLY.add_seconds(compiled, time.perf_counter() - start)


def watch_triton(knobs=None) -> bool:
    """Install the hooks (module doc) into Triton's `knobs` (default: triton.knobs) once a
    process; False where this Triton has no such hooks (nothing is counted then)."""
    if _WATCHING:
        return _WATCHING[0]
    if knobs is None:
        try:
            from triton import knobs
        except ImportError:  # Triton before 3.3: no knobs module
            _WATCHING.append(False)
            return False
    runtime, compilation = getattr(knobs, "runtime", None), getattr(knobs, "compilation", None)
    if not all(hasattr(runtime, h) for h in ("jit_cache_hook", "jit_post_compile_hook")):
        _WATCHING.append(False)
        return False
    runtime.jit_cache_hook = _chain(runtime.jit_cache_hook, _before)
    runtime.jit_post_compile_hook = _chain(runtime.jit_post_compile_hook, _after)
    if compilation is not None and hasattr(compilation, "listener"):
        compilation.listener = _chain(compilation.listener, _listener)
    load_end = getattr(runtime, "kernel_load_end_hook", None)
    if load_end is not None and hasattr(load_end, "add"):
        load_end.add(_loaded)
    _WATCHING.append(True)
    return True
