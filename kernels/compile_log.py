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

How Triton is observed (its knobs, Triton >= 3.4; older Triton: nothing is counted, and
`watching()` says so): `knobs.compilation.listener` is called at the end of every compile()
with `cache_hit` and the compile's own timing (`times.total`: from compile()'s start, the
disk-cache lookup included), and `knobs.runtime.kernel_load_end_hook` at the end of that
specialization's first launch setup (its C launcher, built or loaded, and the module load),
whose time is added to it. A Triton with JIT hooks but no listener: `jit_cache_hook` /
`jit_post_compile_hook` time each specialization instead, and every one counts as compiled
(a hit cannot be told apart). Hooks someone else installed keep running (ours are called
after theirs; a cache hook of theirs that returns true still skips the compile).
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
        self.pending: list[list] = []  # [name, start] of compiles in progress (JIT hooks)
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


def _name_of(src) -> str:
    """"module.kernel" of a compile's source (an ASTSource; its JITFunction's module)."""
    fn = getattr(src, "fn", None)
    module = getattr(fn, "module", "") or ""
    name = getattr(src, "name", None) or getattr(fn, "__name__", None) or str(src)
    return f"{module.rsplit('.', 1)[-1]}.{name}" if module else str(name)


def _listener(*, src=None, times=None, cache_hit: bool = False, result=None, **_) -> None:
    """Triton's compilation listener: one compile() ended (a disk-cache hit or a build)."""
    seconds = (getattr(times, "total", 0) or 0) / 1e6  # CompileTimes are in microseconds
    compiled = not cache_hit
    _TALLY.add(_name_of(src), compiled, seconds)
    _TALLY.loading = [compiled, time.perf_counter()]


def _before(*, fn=None, result=None, **_) -> None:
    """(Triton without a listener) a specialization is about to be built."""
    if not result:  # a cache hook's true result skips the compile (nothing to time)
        _TALLY.pending.append([_kernel_name(fn), time.perf_counter()])


def _after(*, fn=None, result=None, **_) -> None:
    """(Triton without a listener) the specialization is built: counted as compiled."""
    if not _TALLY.pending:
        return
    name, start = _TALLY.pending.pop()
    now = time.perf_counter()
    _TALLY.add(name, True, now - start)
    _TALLY.loading = [True, now]


def _loaded(*args, **kwargs) -> None:
    """The first launch's setup of the specialization just compiled or loaded has ended."""
    if _TALLY.loading is not None:
        compiled, start = _TALLY.loading
        _TALLY.loading = None
        _TALLY.add_seconds(compiled, time.perf_counter() - start)


def watch_triton(knobs=None) -> bool:
    """Install the hooks (module doc) into Triton's `knobs` (default: triton.knobs) once a
    process; False where this Triton has none of them (nothing is counted then)."""
    if _WATCHING:
        return _WATCHING[0]
    if knobs is None:
        try:
            from triton import knobs
        except ImportError:  # Triton before 3.4: no knobs module
            _WATCHING.append(False)
            return False
    runtime, compilation = getattr(knobs, "runtime", None), getattr(knobs, "compilation", None)
    if compilation is not None and hasattr(compilation, "listener"):
        compilation.listener = _chain(compilation.listener, _listener)
    elif all(hasattr(runtime, h) for h in ("jit_cache_hook", "jit_post_compile_hook")):
        runtime.jit_cache_hook = _chain(runtime.jit_cache_hook, _before)
        runtime.jit_post_compile_hook = _chain(runtime.jit_post_compile_hook, _after)
    else:
        _WATCHING.append(False)
        return False
    load_end = getattr(runtime, "kernel_load_end_hook", None)
    if load_end is not None and hasattr(load_end, "add"):
        load_end.add(_loaded)
    _WATCHING.append(True)
    return True
