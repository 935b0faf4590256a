"""The CPU peer a user would pick: llama.cpp's `llama-bench`, built from the source vendored in
the PyPI `llama-cpp-python` sdist (CPU only), run on the GGUF inside the default model's wheel.

Used by `cpu_engine_vs_hf.py --peer llama.cpp`; runnable alone to build and print the peer:

    python benchmarks/llama_cpp_peer.py [--threads 2] [--pp 2048] [--tg 128] [--reps 3]

The build (~10 min on 2 cores) and the extracted GGUF are cached outside the repository, in
`--cache` (default `$HISPARSE_BENCH_CACHE`, else `~/.cache/hisparse-bench`):
    llama-cpp-python-<version>.tar.gz   the sdist (`pip download --no-binary :all:`)
    llama.cpp-<version>/                its vendored llama.cpp and the CMake build
    <wheel stem>.gguf                   the default model's GGUF, extracted from its wheel
A second call reuses all three. The wheel is read from $HISPARSE_HOME/downloads (where
`hisparse models pull` keeps it); nothing is downloaded for the model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

SDIST = "llama-cpp-python"
# -march=native turns on ggml's AMX matmul on CPUs that have AMX; on the development VM (a
# Sapphire Rapids guest) that path crashes in ggml::cpu::amx::tensor_traits::compute_forward
# (SIGSEGV), so the build leaves AMX out; AVX-512 (VNNI, BF16) stays on.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def cache_dir(explicit: str | None = None) -> Path:
    path = Path(explicit or os.environ.get("HISPARSE_BENCH_CACHE")
                or Path.home() / ".cache" / "hisparse-bench")
    path.mkdir(parents=True, exist_ok=True)
    return path


def fetch_sdist(cache: Path, version: str | None = None) -> Path:
    """The llama-cpp-python sdist in `cache` (downloaded once with pip)."""
    have = sorted(cache.glob("llama_cpp_python-*.tar.gz"))
    if version:
        have = [p for p in have if p.name == f"llama_cpp_python-{version}.tar.gz"]
    if have:
        return have[-1]
    req = f"{SDIST}=={version}" if version else SDIST
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    "-d", str(cache), req], check=True, stdout=subprocess.DEVNULL)
    return sorted(cache.glob("llama_cpp_python-*.tar.gz"))[-1]


def build_llama_bench(cache: Path, version: str | None = None, jobs: int | None = None) -> Path:
    """Path of a CPU-only `llama-bench` built from the sdist's vendored llama.cpp (cached)."""
    sdist = fetch_sdist(cache, version)
    stem = sdist.name[: -len(".tar.gz")]  # llama_cpp_python-X.Y.Z
    src = cache / (stem.replace("llama_cpp_python", "llama.cpp") + "-noamx")
    binary = src / "build" / "bin" / "llama-bench"
    if binary.is_file():
        return binary
    if not (src / "CMakeLists.txt").is_file():
        prefix = f"{stem}/vendor/llama.cpp/"
        src.mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                if m.name.startswith(prefix) and len(m.name) > len(prefix):
                    m.name = m.name[len(prefix):]
                    members.append(m)
            tar.extractall(src, members=members, filter="data")
    build = src / "build"
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF",
                    "-DGGML_VULKAN=OFF", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DLLAMA_BUILD_SERVER=OFF", f"-DCMAKE_C_FLAGS={NO_AMX}",
                    f"-DCMAKE_CXX_FLAGS={NO_AMX}"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-bench", "-j",
                    str(jobs or os.cpu_count() or 1)], check=True, stdout=subprocess.DEVNULL)
    return binary


def default_gguf(cache: Path) -> Path:
    """The default model's GGUF, extracted once from its wheel in $HISPARSE_HOME/downloads."""
    from hisparse_cli.hub import registry

    spec = registry.get_spec(registry.DEFAULT_MODEL)
    target = cache / (Path(spec.wheel_filename).stem + ".gguf")
    if not target.is_file():
        wheel = registry.wheel_path(spec)
        if not wheel.is_file():
            sys.exit(f"no wheel at {wheel}: run `hisparse models pull` first")
        with zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as src, \
                open(target.with_suffix(".part"), "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        target.with_suffix(".part").rename(target)
    return target


def llama_bench(binary: Path, gguf: Path, threads: int, pp: int, tg: int,
                reps: int = 3, depth: int = 0) -> dict:
    """{"pp_tok_s", "tg_tok_s", ...} from one `llama-bench` call (pp and tg tokens, `reps`
    repetitions each, after `depth` tokens of context; pp 0: tg only), flash attention off
    and on (`-fa 0,1`; its default, auto, is on for the CPU): each rate is the better of the
    two, and `*_by_fa` keeps both (at depth 2048 on the development machine, tg was 46.7
    tok/s with -fa 0 and 23.2 with -fa 1)."""
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-p", str(pp), "-n", str(tg),
           "-r", str(reps), "-d", str(depth), "-fa", "0,1", "-o", "json"]
    rows = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    shown = ["llama-bench", "-m", gguf.name] + cmd[3:]
    res = {"command": " ".join(shown), "threads": threads, "depth": depth}
    for r in rows:
        key = "tg" if r.get("n_gen") else "pp"
        fa = int(bool(r.get("flash_attn")))
        res.setdefault(f"{key}_tok_s_by_fa", {})[fa] = r["avg_ts"]
        res[f"{key}_tok_s"] = max(res.get(f"{key}_tok_s", 0.0), r["avg_ts"])
        res["build"] = f"{r.get('build_commit')} ({r.get('build_number')})"
        res["cpu"] = r.get("cpu_info")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2048)
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cache", default=None)
    ap.add_argument("--version", default=None, help="llama-cpp-python sdist version")
    ap.add_argument("--build-only", action="store_true")
    a = ap.parse_args()
    cache = cache_dir(a.cache)
    binary = build_llama_bench(cache, a.version)
    print(f"llama-bench: {binary}", file=sys.stderr)
    if a.build_only:
        return
    print(json.dumps(llama_bench(binary, default_gguf(cache), a.threads, a.pp, a.tg, a.reps)))


if __name__ == "__main__":
    main()
