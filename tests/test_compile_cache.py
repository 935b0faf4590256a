"""Where compiled GPU kernels are kept (kernels/compile_cache.py) and how this process's
compiles are counted (kernels/compile_log.py), without a GPU.

Oracles: the folder name is compared with the versions it is made of (each one changed alone
gives another folder); the driver's version with /proc files written here in the two formats
the NVIDIA kernel modules print; Triton's own knobs object in a fresh process (the cache
folder it will compile into); the counts with a fake Triton calling the hooks in the order
Triton 3.6's JIT does (runtime/jit.py: cache hook, compile() with its listener, post-compile
hook, then the first launch's kernel_load_end_hook) on a fake clock, and with Triton's real
compiler (sm_90, no GPU): a build, then the same kernel from the disk cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from hisparse_cli.kernels import compile_cache, compile_log

BASE = compile_cache.Toolchain(triton="3.6.0", torch="2.11.0+cu130", cuda="13.0",
                               driver="580.65.06", arch="sm90", python="3.11")


def test_the_folder_changes_with_every_version():
    changed = [replace(BASE, triton="3.7.0"), replace(BASE, torch="2.12.0+cu130"),
               replace(BASE, cuda="12.8"), replace(BASE, driver="575.57.08"),
               replace(BASE, arch="sm89"), replace(BASE, python="3.12")]
    slugs = {c.slug for c in changed}
    assert len(slugs) == len(changed) and BASE.slug not in slugs
    assert BASE.slug == ("triton-3.6.0_torch-2.11.0+cu130_cuda-13.0_driver-580.65.06_"
                         "arch-sm90_py-3.11")


def test_unknown_versions_and_odd_characters_make_a_plain_folder_name():
    slug = compile_cache.Toolchain(torch="2.13.0 cpu/x", python="3.11").slug
    assert slug == "triton-none_torch-2.13.0-cpu-x_cuda-none_driver-none_arch-none_py-3.11"
    assert "/" not in slug and " " not in slug


@pytest.mark.parametrize("text,want", [
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
     "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n", "550.54.15"),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  "
     "(dvs-builder@U16-I3-B03-4-3)  Sun Jul 27 06:54:38 UTC 2025\n", "580.65.06"),
    ("something else\n", ""),
])
def test_the_driver_version_is_read_from_the_kernel_module(tmp_path, text, want):
    path = tmp_path / "version"
    path.write_text(text)
    assert compile_cache._driver_from_proc(str(path)) == want


def test_no_proc_file_is_no_version(tmp_path):
    assert compile_cache._driver_from_proc(str(tmp_path / "missing")) == ""


def test_triton_compiles_under_hisparse_home_keyed_by_the_toolchain(tmp_path):
    """A fresh process: the first triton_available() points Triton's cache (as Triton's own
    knobs read it) at $HISPARSE_HOME/kernels/triton/<toolchain slug>, and the compile hooks
    are installed; a TRITON_CACHE_DIR the user set is kept."""
    pytest.importorskip("triton")
    code = ("import json, os\n"
            "from hisparse_cli.kernels.dispatch import triton_available\n"
            "from hisparse_cli.kernels import compile_cache, compile_log\n"
            "assert triton_available()\n"
            "import triton\n"
            "print(json.dumps({'knob': triton.knobs.cache.dir, 'slug': "
            "compile_cache.toolchain().slug, 'watching': compile_log.watching(), "
            "'source': compile_cache.use_triton_cache().source}))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
    env["HISPARSE_HOME"] = str(tmp_path / "home")
    ours = json.loads(subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                     capture_output=True, text=True).stdout)
    assert ours["knob"] == str(tmp_path / "home" / "kernels" / "triton" / ours["slug"])
    assert ours["source"] == "hisparse" and ours["watching"] is True
    env["TRITON_CACHE_DIR"] = str(tmp_path / "mine")
    theirs = json.loads(subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                       capture_output=True, text=True).stdout)
    assert theirs["knob"] == str(tmp_path / "mine") and theirs["source"] == "TRITON_CACHE_DIR"


# --- counting compiles -------------------------------------------------------------------------


class _Chain:
    """knobs.runtime.kernel_load_end_hook's HookChain: add() and call every hook."""

    def __init__(self) -> None:
        self.calls = []

    def add(self, fn) -> None:
        self.calls.append(fn)

    def __call__(self, *args) -> None:
        for fn in self.calls:
            fn(*args)


def _knobs(listener=True, cache_hook=None):
    """Triton's knobs as 3.6 has them (listener=False: a Triton with JIT hooks only)."""
    compilation = SimpleNamespace(listener=None) if listener else SimpleNamespace()
    return SimpleNamespace(
        runtime=SimpleNamespace(jit_cache_hook=cache_hook, jit_post_compile_hook=None,
                                kernel_load_end_hook=_Chain()),
        compilation=compilation)


@pytest.fixture
def clock(monkeypatch):
    """A fresh tally, no hooks installed yet, and a clock the test moves."""
    monkeypatch.setattr(compile_log, "_TALLY", compile_log._Tally())
    monkeypatch.setattr(compile_log, "_WATCHING", [])
    now = [100.0]
    monkeypatch.setattr(compile_log.time, "perf_counter", lambda: now[0])
    return now


def _specialize(knobs, clock, name: str, hit: bool, compile_s: float, load_s: float):
    """What Triton 3.6 does for a new specialization, hooks in its order (runtime/jit.py
    run -> _do_compile: cache hook, compile() ending in the listener with its own timing
    (CompileTimes, microseconds), post-compile hook; then the first launch's
    _init_handles: launcher and module load, kernel_load_end_hook)."""
    module = "hisparse_cli.kernels.family.some_triton"
    fn = SimpleNamespace(module=module, name=name, jit_function=None)
    hook_kw = dict(key="k", repr=name, fn=fn, compile={}, is_manual_warmup=False,
                   already_compiled=False)
    if knobs.runtime.jit_cache_hook is not None and knobs.runtime.jit_cache_hook(**hook_kw):
        return  # someone's cache hook skipped the compile
    clock[0] += compile_s
    listener = getattr(knobs.compilation, "listener", None)
    if listener is not None:
        src = SimpleNamespace(name=name, fn=SimpleNamespace(module=module, __name__=name))
        times = SimpleNamespace(total=int(compile_s * 1e6))
        listener(src=src, metadata={}, metadata_group={}, times=times, cache_hit=hit)
    if knobs.runtime.jit_post_compile_hook is not None:
        knobs.runtime.jit_post_compile_hook(**hook_kw)
    clock[0] += load_s
    knobs.runtime.kernel_load_end_hook(None, None, name, {}, "hash")


def test_cache_misses_count_as_compiles_and_hits_as_loads(clock):
    knobs = _knobs()
    assert compile_log.watch_triton(knobs) and compile_log.watching()
    assert knobs.runtime.jit_cache_hook is None  # the listener suffices: JIT hooks untouched
    start = compile_log.compile_counts()
    _specialize(knobs, clock, "_attn_fwd", hit=False, compile_s=6.0, load_s=0.5)
    _specialize(knobs, clock, "_attn_fwd", hit=True, compile_s=0.25, load_s=0.125)
    _specialize(knobs, clock, "_rms_norm", hit=True, compile_s=0.5, load_s=0.0)
    got = compile_log.compile_counts() - start
    assert (got.compiled, got.compile_seconds) == (1, 6.5)
    assert (got.loaded, got.load_seconds) == (2, 0.875)
    assert dict(got.by_kernel) == {"some_triton._attn_fwd": 2, "some_triton._rms_norm": 1}
    assert got.to_dict() == {"kernel_compiles": 1, "kernel_compile_seconds": 6.5,
                             "kernel_loads": 2, "kernel_load_seconds": 0.875}
    later = compile_log.compile_counts()
    _specialize(knobs, clock, "_rope", hit=False, compile_s=1.0, load_s=0.0)
    assert (compile_log.compile_counts() - later).compiled == 1


def test_someone_elses_listener_keeps_running(clock):
    heard = []
    knobs = _knobs()
    knobs.compilation.listener = lambda **kw: heard.append(kw["cache_hit"])
    compile_log.watch_triton(knobs)
    _specialize(knobs, clock, "k", hit=True, compile_s=0.5, load_s=0.0)
    assert heard == [True] and compile_log.compile_counts().loaded == 1


def test_without_a_listener_the_jit_hooks_count_every_specialization_as_compiled(clock):
    seen = []

    def theirs(**kw):
        seen.append(kw["repr"])
        return kw["repr"] == "skip_me"  # true: Triton skips that compile

    knobs = _knobs(listener=False, cache_hook=theirs)
    assert compile_log.watch_triton(knobs)
    _specialize(knobs, clock, "skip_me", hit=False, compile_s=1.0, load_s=0.0)
    _specialize(knobs, clock, "built", hit=True, compile_s=2.0, load_s=0.25)
    assert seen == ["skip_me", "built"]
    counts = compile_log.compile_counts()
    assert (counts.compiled, counts.compile_seconds, counts.loaded) == (1, 2.25, 0)


def test_a_triton_without_hooks_counts_nothing(clock):
    old = SimpleNamespace(runtime=SimpleNamespace(), compilation=SimpleNamespace())
    assert compile_log.watch_triton(old) is False and not compile_log.watching()
    assert compile_log.compile_counts() == compile_log.CompileCounts()
    assert compile_log.watch_triton(_knobs()) is False  # decided once a process


def test_hooks_are_installed_once(clock):
    knobs = _knobs()
    assert compile_log.watch_triton(knobs)
    listener = knobs.compilation.listener
    assert compile_log.watch_triton(knobs) and knobs.compilation.listener is listener
    assert len(knobs.runtime.kernel_load_end_hook.calls) == 1


_REAL_COMPILE = """
import json, sys
sys.path.insert(0, 'benchmarks')
import sm90_compile as c
from hisparse_cli.kernels import compile_log
from hisparse_cli.kernels.norm_rope import norm_rope_triton as nr
assert compile_log.watch_triton()
sig = dict(x_ptr='*fp32', y_ptr='*fp32', w_ptr='*fp32', out_ptr='*fp32', sum_ptr='*fp32',
           R='i32', B='i32', sxa='i32', sxb='i32', sya='i32', syb='i32', eps='fp32')
consts = dict(H=64, BLOCK_H=64, ROWS=16, HAS_RES=False)
runs = []
for _ in range(2):  # the same kernel twice: built, then found in the disk cache
    c.compile_one(nr._rms_norm, sig, consts, 4, ())
    n = compile_log.compile_counts()
    runs.append([n.compiled, n.loaded, n.compile_seconds, dict(n.by_kernel)])
print(json.dumps(runs))
"""


def test_triton_compiles_and_cache_hits_are_told_apart(tmp_path):
    """Triton's real compiler (for sm_90, no GPU needed) in a fresh process: a new cache folder
    compiles the kernel (counted as compiled, with its time), the same compile again is a
    disk-cache hit (counted as loaded)."""
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the real JIT
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    r = subprocess.run([sys.executable, "-c", _REAL_COMPILE], cwd=root, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (c1, l1, s1, k1), (c2, l2, s2, k2) = json.loads(r.stdout.strip().splitlines()[-1])
    assert (c1, l1) == (1, 0) and s1 > 0 and k1 == {"norm_rope_triton._rms_norm": 1}
    assert (c2, l2) == (1, 1) and s2 == s1 and k2 == {"norm_rope_triton._rms_norm": 2}
