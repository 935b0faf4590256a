"""llama.cpp on the GPU (issue 42, item 4): the peer a user would pick for a long document on
an NVIDIA card, measured on the device machine beside the engine's GPU tables.

llama.cpp is the one vendored in the PyPI `llama-cpp-python` sdist (the version the CPU
tables use, `cpu_engine_vs_hf.py`). The device has no internet, so the source travels as a
trimmed tarball in the ignored folder `.llamacpp/` (name it in `carry`), and the `gguf`
package as a wheel in `.whl/`. The model is a Llama-3-8B-shaped GGUF with random weights
(the shape of BENCHMARKS.md's "8B"), written on the device.

Subcommands:
  pack    (here, on the CPU machine) download the sdist (cached as `cpu_engine_vs_hf.py`
          does, in ~/.cache/hisparse-bench) and write `.llamacpp/llama.cpp-src.tar.gz`
          (2.4 MiB): vendor/llama.cpp with only what CMake needs to build `llama-bench` for
          CUDA or the CPU (ggml with its CPU and CUDA backends only, src, include, common,
          vendor, cmake, tools/llama-bench; tools/CMakeLists.txt rewritten to add only it).
          `--check` configures the trimmed tree (CPU; `--check-cuda` for CUDA too: nvcc and
          cuBLAS headers, no GPU); `--cpu-build` builds the CPU llama-bench from it (~7 min on
          2 cores); `--cuda-build --cublas-dir DIR` compiles the CUDA one here (nvcc 13.0,
          sm_90, ~55 min on 2 busy cores) into `.llamacpp/llama-bench-sm90.xz` (66 MiB
          stripped, 39 MiB as xz), which the device then only runs (DIR: a folder with a real
          libcublas.so.13 and ../include, e.g. unzipped from the `nvidia-cublas` wheel; it
          needs libcudart.so.13, libcublas.so.13, libcuda.so.1 and glibc >= 2.34 there).
  build   (device) `.llamacpp/llama-bench-sm90.xz` if carried and it sees the GPU
          (`--list-devices`); else extract to /tmp/llamacpp-build, configure (CUDA, sm_90
          only, Release, static libs, Ninja; FlashAttention vector kernels for the f16, q8_0
          and q4_0 KV only) and build `llama-bench` with -j$(nproc) (~5-7 min on 16 cores,
          estimated from compile times here). Ninja runs in its own process session, so it
          outlives a call cut at its time limit: a call within 30 s (the machine stays warm
          that long) finds it running and waits; a fresh machine starts over. cuBLAS comes
          from the CUDA toolkit, else from the pip `nvidia-cublas` beside python3's torch
          (a symlink shim); the binary finds them through LD_LIBRARY_PATH set here.
  gguf    (device, or the CPU for a tiny model) write the random Llama-3-8B-shaped GGUF to
          /tmp: Q4_0 linears and token_embd, Q6_K output (what `llama-quantize Q4_0` makes of a
          Llama-3-8B: 4.33 GiB, 8.03 B parameters), F32 norms of ones; an SPM ("llama")
          vocabulary of --vocab synthetic tokens (3 specials, 256 byte tokens, fillers).
          Random nibbles, per-tensor scales so the weights' std is 1/sqrt(fan_in).
  bench   (device) llama-bench, flash attention on, all layers on the GPU (token_embd stays
          on the host, as llama.cpp always does), n_batch 2048 / n_ubatch 512, 1 repetition:
          (a) f16 KV: pp512 and tg128 at depths 32768 and 131072 (`-d`: each depth filled
              once, untimed, and reused); (b) the whole prefill: pp131072 and pp32768 from
              depth 0, no warm-up (the first, longest run takes the start-up); (c) q8_0 and
              (d) q4_0 KV (`-ctk/-ctv`): pp512 and tg128 at depth 131072.
          Each llama-bench runs verbose: its buffer lines (model, KV, compute) are parsed and
          nvidia-smi is sampled every 200 ms for the process's peak device memory (its CUDA
          context, cuBLAS and ggml's pool included); the 6 GiB question is answered from them
          for (a), (c), (d) at n_ctx 131584: cap 6 GiB - 300 MiB display (as the engine's
          `4060ti-6g`), and the longest context whose KV fits beside the rest. Writes
          $OUT/gpu_llama_cpp.json (rows, memory, commands) and $OUT/gpu_llama_cpp.log;
          prints the tables. --only picks runs; a run that no longer fits the time budget
          is skipped (listed).
  all     build (the prebuilt, else compiling in the background), gguf meanwhile, then bench,
          inside --time-budget seconds (default 560); exits 3 when the build is still running
          or too little time is left for the bench (call `all` again within 30 s: it waits
          for that build, or finds it done, and goes on). Finished steps are skipped.

Device (`carry`: [".llamacpp", ".whl"]; with the prebuilt binary one call of ~6 min):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/gguf-*.whl && \\
    export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 && \\
    python3 benchmarks/gpu_llama_cpp.py all --time-budget 560
Here:
    python benchmarks/gpu_llama_cpp.py pack --version 0.3.36 --check [--cpu-build] \\
        [--cuda-build --cublas-dir /tmp/cublas/nvidia/cu13/lib]
    python benchmarks/gpu_llama_cpp.py gguf --out /tmp/tiny.gguf --layers 2 --hidden 256 \\
        --heads 4 --kv-heads 2 --ffn 512 --vocab 1024 --ctx 4096
    ~/.cache/hisparse-bench/llama.cpp-trim-0.3.36/build/bin/llama-bench -m /tmp/tiny.gguf \\
        -p 64 -n 16
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACK = ROOT / ".llamacpp" / "llama.cpp-src.tar.gz"
WORK = Path(os.environ.get("LLAMACPP_WORK", "/tmp/llamacpp-build"))
MODEL = Path("/tmp/llama3-8b-shape-q4_0.gguf")
TARGETS = ("llama-bench",)
PREBUILT = ROOT / ".llamacpp" / "llama-bench-sm90.xz"  # `pack --cuda-build`'s, if any
CAP_MIB = 6 * 1024 - 300  # a 6 GiB card less what its display takes (the engine's 4060ti-6g)

# -- pack ----------------------------------------------------------------------------------
# What the trimmed tree keeps (paths relative to vendor/llama.cpp). Everything else goes:
# docs, models (vocab files), examples, tests, gguf-py, scripts, .github, media, app, pocs,
# the other tools, and every ggml backend but the CPU and CUDA ones.
KEEP_TOP = {"CMakeLists.txt", "LICENSE", "licenses", "cmake", "include", "src", "common",
            "vendor", "ggml"}
KEEP_TOOLS = {"llama-bench"}
KEEP_BACKENDS = {"ggml-cpu", "ggml-cuda"}
# header-only vendored libraries that only tools/mtmd reads: their CMakeLists stay
DROP_FILES = {"vendor/miniaudio/miniaudio.h", "vendor/stb/stb_image.h"}
TOOLS_CMAKE = """# trimmed by hisparse benchmarks/gpu_llama_cpp.py pack: only the benchmark tools
find_package(Threads REQUIRED)
llama_add_compile_flags()
add_subdirectory(llama-bench)
"""


def keep(rel: str) -> bool:
    parts = rel.split("/")
    if rel in DROP_FILES:
        return False
    if parts[0] == "tools":
        return rel == "tools/CMakeLists.txt" or (len(parts) > 1 and parts[1] in KEEP_TOOLS)
    if parts[0] not in KEEP_TOP:
        return False
    if parts[:2] == ["ggml", "src"] and len(parts) > 3 and parts[2].startswith("ggml-"):
        return parts[2] in KEEP_BACKENDS  # a backend's directory
    return True


def cmd_pack(a) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cpu_engine_vs_hf import cache_dir, fetch_sdist

    cache = cache_dir(a.cache)
    sdist = fetch_sdist(cache, a.version)
    stem = sdist.name[: -len(".tar.gz")]  # llama_cpp_python-X.Y.Z
    version = stem.split("-")[-1]
    prefix = f"{stem}/vendor/llama.cpp/"
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    kept = dropped = 0
    kept_bytes = dropped_bytes = 0
    tmp = out.with_suffix(".part")
    with tarfile.open(sdist) as src, tarfile.open(tmp, "w:gz", compresslevel=9) as dst:
        for m in src.getmembers():
            if not m.name.startswith(prefix) or len(m.name) <= len(prefix):
                continue
            rel = m.name[len(prefix):].rstrip("/")
            if not keep(rel):
                dropped += 1
                dropped_bytes += m.size
                continue
            m.name = "llama.cpp/" + rel
            # a long name also sits in the PAX header, which would win over m.name
            m.pax_headers = {k: v for k, v in m.pax_headers.items() if k != "path"}
            if rel == "tools/CMakeLists.txt":
                data = TOOLS_CMAKE.encode()
                m.size = len(data)
                dst.addfile(m, io.BytesIO(data))
            else:
                dst.addfile(m, src.extractfile(m) if m.isfile() else None)
            kept += 1
            kept_bytes += m.size
        info = json.dumps({"sdist": sdist.name, "llama_cpp_python": version,
                           "kept_files": kept, "dropped_files": dropped,
                           "keep_top": sorted(KEEP_TOP), "tools": sorted(KEEP_TOOLS),
                           "backends": sorted(KEEP_BACKENDS)}, indent=1).encode()
        ti = tarfile.TarInfo("llama.cpp/HISPARSE_TRIM.json")
        ti.size, ti.mtime = len(info), int(time.time())
        dst.addfile(ti, io.BytesIO(info))
    tmp.rename(out)
    print(f"pack: {out} {out.stat().st_size / 2**20:.2f} MiB from {sdist.name}: kept {kept} "
          f"entries ({kept_bytes / 2**20:.1f} MiB), dropped {dropped} "
          f"({dropped_bytes / 2**20:.1f} MiB)")
    if a.check or a.check_cuda or a.cpu_build or a.cuda_build:
        work = cache / f"llama.cpp-trim-{version}"
        src_dir = extract(out, work / "src", fresh=True)
        if a.check or a.cpu_build:
            build = work / "build"
            configure(src_dir, build, cuda=False)
            print(f"pack --check: the trimmed tree configures for the CPU ({build})")
            if a.cpu_build:
                t0 = time.time()
                subprocess.run(["nice", "-n", "19", "cmake", "--build", str(build), "--target",
                                *TARGETS, "-j", str(os.cpu_count() or 1)], check=True)
                print(f"pack --cpu-build: {build / 'bin' / 'llama-bench'} in "
                      f"{time.time() - t0:.0f} s")
        if a.check_cuda and not a.cuda_build:
            build = work / "build-cuda"
            configure(src_dir, build, cuda=True, cublas_dir=a.cublas_dir)
            print(f"pack --check-cuda: the trimmed tree configures for CUDA ({build})")
        if a.cuda_build:
            cuda_build_here(a, src_dir, work, version)
    return 0


def xz(src: Path, dst: Path) -> None:
    import lzma

    with open(src, "rb") as fi, lzma.open(dst.with_name(dst.name + ".part"), "wb",
                                          preset=6) as fo:
        shutil.copyfileobj(fi, fo, 1 << 20)
    dst.with_name(dst.name + ".part").rename(dst)


def cuda_build_here(a, src: Path, work: Path, version: str) -> None:
    """`pack --cuda-build`: the CUDA llama-bench compiled on this machine (nvcc, no GPU), so
    the device only runs it. cuBLAS from --cublas-dir (a real libcublas.so.13, e.g. from the
    `nvidia-cublas` wheel; libcublasLt is not needed to link: --allow-shlib-undefined); the
    driver library from a stub made here with the cu* symbols the objects use (the device's
    own libcuda.so.1 serves at run time)."""
    build = work / "build-cuda"
    stub_dir = work / "libcuda-stub"
    stub_dir.mkdir(parents=True, exist_ok=True)
    stub = stub_dir / "libcuda.so"
    if not stub.is_file():
        subprocess.run(["gcc", "-shared", "-o", str(stub), "-Wl,-soname,libcuda.so.1", "-x", "c",
                        "/dev/null"], check=True)
    os.environ["LLAMACPP_LIBCUDA_DIRS"] = str(stub_dir)
    t0 = time.time()
    env = configure(src, build, cuda=True, cublas_dir=a.cublas_dir, version=version,
                    extra=["-DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined"])
    nice = ["nice", "-n", "19", "ninja", "-C", str(build), "-j", str(os.cpu_count() or 1)]
    subprocess.run(nice + ["ggml-cuda"], check=True, env=env)
    lib = next(build.rglob("libggml-cuda.a"))
    nm = subprocess.run(["nm", "-u", str(lib)], capture_output=True, text=True, check=True)
    syms = sorted({ln.split()[-1] for ln in nm.stdout.splitlines()
                   if re.fullmatch(r"\s*U cu[A-Z]\w*", ln)})
    (stub_dir / "stub.c").write_text("".join(f"void {x}(void) {{}}\n" for x in syms))
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(stub), "-Wl,-soname,libcuda.so.1",
                    str(stub_dir / "stub.c")], check=True)
    subprocess.run(nice + list(TARGETS), check=True, env=env)
    out = Path(a.out).parent / PREBUILT.name
    raw = out.with_suffix("")
    shutil.copy2(build / "bin" / "llama-bench", raw)
    subprocess.run(["strip", str(raw)], check=True)
    xz(raw, out)  # 66 MiB stripped, 39 MiB as xz: the travel limit is 64 MiB in all
    raw.unlink()
    (out.parent / (raw.name + ".json")).write_text(json.dumps({
        "llama_cpp_python": version, "built": time.strftime("%Y-%m-%d %H:%M"),
        "nvcc": subprocess.run(["nvcc", "--version"], capture_output=True,
                               text=True).stdout.strip().splitlines()[-1],
        "cmake": (work / "configure.log").read_text().splitlines()[0],
        "driver_symbols": syms}, indent=1))
    print(f"pack --cuda-build: {out} ({out.stat().st_size / 2**20:.1f} MiB) in "
          f"{time.time() - t0:.0f} s; the stub libcuda had {len(syms)} symbols")


# -- build ---------------------------------------------------------------------------------
def extract(tarball: Path, dest: Path, fresh: bool = False) -> Path:
    """The tarball's llama.cpp/ tree at dest (extracted once; `fresh` replaces it)."""
    if fresh and dest.exists():
        shutil.rmtree(dest)
    if not (dest / "CMakeLists.txt").is_file():
        part = dest.with_name(dest.name + ".part")
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir(parents=True)
        with tarfile.open(tarball) as tar:
            members = []
            for m in tar.getmembers():
                if m.name.startswith("llama.cpp/"):
                    m.name = m.name[len("llama.cpp/"):]
                    members.append(m)
            tar.extractall(part, members=members, filter="data")
        if dest.exists():
            shutil.rmtree(dest)
        part.rename(dest)
    return dest


def _python_nvidia_dirs() -> list[Path]:
    """The `nvidia` namespace package's folders of the device's python3 (torch's CUDA libs)."""
    for py in ("python3", sys.executable):
        try:
            out = subprocess.run([py, "-c", "import nvidia; print('\\n'.join(nvidia.__path__))"],
                                 capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        dirs = [Path(x) for x in out.split() if x]
        if dirs:
            return dirs
    return []


def cuda_shim(work: Path, cublas_dir: str | None = None) -> tuple[list[str], dict, list[str]]:
    """CMake arguments, environment and notes that let FindCUDAToolkit see cuBLAS and the
    driver library where the toolkit lacks them (the device's /usr/local/cuda may be a
    pip-assembled toolkit without cuBLAS; torch's `nvidia-cublas` wheel has it, without the
    unversioned `libcublas.so` link CMake looks for)."""
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    roots = [Path(p) for p in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
                               "/usr/local/cuda") if p] + [Path(nvcc).resolve().parents[1]]
    tk_libs = [r / sub for r in roots for sub in ("lib64", "lib", "targets/x86_64-linux/lib")]
    args: list[str] = [f"-DCMAKE_CUDA_COMPILER={Path(nvcc).resolve()}"]
    env: dict = {}
    notes: list[str] = [f"nvcc {Path(nvcc).resolve()}"]
    shim = work / "shim"
    libdirs: list[Path] = []
    if not any((d / "libcublas.so").exists() for d in tk_libs):
        cands = [Path(cublas_dir)] if cublas_dir else []
        for nv in _python_nvidia_dirs():
            cands += sorted(nv.glob("*/lib"))
        lib = next((d for d in cands if list(d.glob("libcublas.so*"))), None)
        if lib is None:
            notes.append("cuBLAS: not found (the CMake configure will fail)")
        else:
            inc = lib.parent / "include"
            (shim / "lib").mkdir(parents=True, exist_ok=True)
            for name in ("libcublas", "libcublasLt"):
                real = sorted(lib.glob(f"{name}.so*"))
                if not real:
                    continue
                for link in {f"{name}.so", real[0].name}:
                    p = shim / "lib" / link
                    if p.is_symlink() or p.exists():
                        p.unlink()
                    p.symlink_to(real[0])
            libdirs.append(lib)
            args.append(f"-DCMAKE_CUDA_FLAGS=-I{inc}")
            notes.append(f"cuBLAS: {lib} (shim {shim / 'lib'}, headers {inc})")
    has_driver = any(list(d.glob("libcuda.so*")) for d in tk_libs + [d / "stubs" for d in tk_libs])
    if not has_driver:
        dirs = os.environ.get("LLAMACPP_LIBCUDA_DIRS", "/usr/local/nvidia/lib64:"
                              "/usr/local/nvidia/lib:/usr/lib/x86_64-linux-gnu:/usr/lib64:/usr/lib")
        drv = next((p for d in dirs.split(":") if d
                    for p in sorted(Path(d).glob("libcuda.so*")) if p.is_file()), None)
        if drv is not None:
            (shim / "lib").mkdir(parents=True, exist_ok=True)
            p = shim / "lib" / "libcuda.so"
            if p.is_symlink() or p.exists():
                p.unlink()
            p.symlink_to(drv)
            notes.append(f"driver library: {drv}")
        else:
            args.append("-DGGML_CUDA_NO_VMM=ON")  # else CUDA::cuda_driver is missing
            notes.append("driver library libcuda.so not found: GGML_CUDA_NO_VMM=ON")
    if (shim / "lib").is_dir():
        args += [f"-DCMAKE_LIBRARY_PATH={shim / 'lib'}",
                 f"-DCMAKE_BUILD_RPATH={';'.join(str(d) for d in [shim / 'lib', *libdirs])}"]
        env["LD_LIBRARY_PATH"] = ":".join([str(shim / "lib"), *map(str, libdirs),
                                           os.environ.get("LD_LIBRARY_PATH", "")])
    return args, env, notes


def configure(src: Path, build: Path, cuda: bool, cublas_dir: str | None = None,
              version: str = "", extra: list[str] | None = None) -> dict:
    """Run CMake (Ninja) once; returns the environment the build and the binaries need."""
    env = dict(os.environ)
    args = ["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja",
            "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=OFF",
            "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF",
            "-DLLAMA_BUILD_TOOLS=ON", "-DGGML_METAL=OFF", "-DGGML_VULKAN=OFF", "-DGGML_CCACHE=OFF"]
    if version:
        args.append(f"-DLLAMA_BUILD_COMMIT=llama-cpp-python-{version}")
    if cuda:
        shim_args, shim_env, notes = cuda_shim(build.parent, cublas_dir)
        for n in notes:
            print(f"build: {n}", flush=True)
        env.update(shim_env)
        # sm_90 only; FlashAttention vector kernels only for the KV types measured (the
        # default list less bf16-bf16); no NCCL (one GPU)
        # no OpenMP: the CPU backend's threads are ggml's own (it runs no layer here), and a
        # binary built elsewhere then needs no libgomp
        args += ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90",
                 "-DGGML_CUDA_FA_QUANTS=f16-f16;q8_0-q8_0;q4_0-q4_0", "-DGGML_CUDA_NCCL=OFF",
                 "-DGGML_OPENMP=OFF", *shim_args]
    else:
        args += ["-DGGML_CUDA=OFF", "-DGGML_NATIVE=ON"]
        if "amx" in Path("/proc/cpuinfo").read_text():  # as cpu_engine_vs_hf.py: AMX crashes here
            no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
            args += [f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"]
    args += extra or []
    if not (build / "build.ninja").is_file():
        build.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        r = subprocess.run(args, env=env, capture_output=True, text=True)
        (build.parent / "configure.log").write_text(" ".join(args) + "\n" + r.stdout + r.stderr)
        if r.returncode != 0:
            print(r.stdout[-4000:] + r.stderr[-4000:], file=sys.stderr)
            (build / "CMakeCache.txt").unlink(missing_ok=True)
            raise SystemExit(f"cmake configure failed (log {build.parent / 'configure.log'})")
        print(f"build: configured in {time.time() - t0:.1f} s", flush=True)
    (build.parent / "env.json").write_text(json.dumps(
        {k: env[k] for k in ("LD_LIBRARY_PATH",) if k in env}))
    return env


def binaries(work: Path = WORK) -> dict:
    return {t: work / "build" / "bin" / t for t in TARGETS}


def runtime_libdirs() -> list[str]:
    """Where the CUDA runtime, cuBLAS and the driver library are on this machine."""
    dirs = [Path(p) / sub for p in (os.environ.get("CUDA_HOME"), "/usr/local/cuda") if p
            for sub in ("lib64", "targets/x86_64-linux/lib")]
    for nv in _python_nvidia_dirs():
        dirs += sorted(nv.glob("*/lib"))
    dirs += [Path("/usr/local/nvidia/lib64")]
    return [str(d) for d in dirs if d.is_dir()]


def run_env(work: Path = WORK) -> dict:
    env = dict(os.environ)
    f = work / "env.json"
    if f.is_file():
        env.update(json.loads(f.read_text()))
    env["LD_LIBRARY_PATH"] = ":".join(x for x in [env.get("LD_LIBRARY_PATH", ""),
                                                  *runtime_libdirs()] if x)
    return env


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _progress(log: Path) -> str:
    if not log.is_file():
        return ""
    steps = re.findall(rb"\[(\d+)/(\d+)\]", log.read_bytes()[-20000:])
    return f"{int(steps[-1][0])}/{int(steps[-1][1])}" if steps else ""


class Build:
    """The CUDA build in WORK, its ninja in a process session of its own."""

    def __init__(self, a):
        self.a, self.work = a, WORK
        self.bins = binaries(self.work)
        self.log = self.work / "ninja.log"
        self.pidfile = self.work / "ninja.pid"
        self.proc: subprocess.Popen | None = None
        self.t0 = time.time()

    def done(self) -> bool:
        return all(p.is_file() for p in self.bins.values())

    def start(self) -> str:
        """'done', 'running' (ours or a previous call's) or 'started'."""
        if self.done():
            return "done"
        if self.try_prebuilt():
            return "done"
        if self.pidfile.is_file():
            pid = int(self.pidfile.read_text().split()[0])
            if _alive(pid):
                print(f"build: a ninja started earlier is running (pid {pid}, "
                      f"{_progress(self.log)}); waiting for it", flush=True)
                return "running"
        tarball = Path(self.a.tarball)
        if not tarball.is_file():
            raise SystemExit(f"no {tarball}: run `pack` here and carry .llamacpp")
        src = extract(tarball, self.work / "src")
        version = json.loads((src / "HISPARSE_TRIM.json").read_text()).get("llama_cpp_python", "")
        env = configure(src, self.work / "build", cuda=True, cublas_dir=self.a.cublas_dir,
                        version=version)
        jobs = str(self.a.jobs or os.cpu_count() or 1)
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen(["ninja", "-C", str(self.work / "build"), "-j", jobs,
                                          *TARGETS], stdout=fh, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)
        self.pidfile.write_text(f"{self.proc.pid} {time.time():.0f}")
        print(f"build: ninja -j{jobs} {' '.join(TARGETS)} started (pid {self.proc.pid}, log "
              f"{self.log}, {_progress(self.log) or 'fresh'})", flush=True)
        return "started"

    def try_prebuilt(self) -> bool:
        """The binary `pack --cuda-build` made, if carried and it sees the GPU."""
        pre = Path(self.a.prebuilt) if self.a.prebuilt else None
        if pre is None or not pre.is_file():
            return False
        import lzma

        dst = self.bins["llama-bench"]
        dst.parent.mkdir(parents=True, exist_ok=True)
        with (lzma.open(pre) if pre.suffix == ".xz" else open(pre, "rb")) as fi, \
                open(dst, "wb") as fo:
            shutil.copyfileobj(fi, fo, 1 << 20)
        dst.chmod(0o755)
        r = subprocess.run([str(dst), "--list-devices"], capture_output=True, text=True,
                           env=run_env(self.work), timeout=120)
        if r.returncode == 0 and "CUDA0" in r.stdout + r.stderr:
            dev = next((ln.strip() for ln in (r.stdout + r.stderr).splitlines()
                        if "CUDA0" in ln), "")
            print(f"build: the prebuilt {pre.name} runs here ({dev}): no compile", flush=True)
            return True
        dst.unlink()
        print(f"build: the prebuilt {pre.name} does not run here (rc {r.returncode}): "
              f"{(r.stdout + r.stderr).strip()[-800:]}\nbuild: compiling from source", flush=True)
        return False

    def wait(self, deadline: float) -> bool:
        """True once built; False at the deadline (ninja keeps running)."""
        last = 0.0
        while not self.done():
            if self.proc is not None:
                rc = self.proc.poll()
                if rc is not None and not self.done():
                    tail = self.log.read_bytes()[-6000:].decode(errors="replace")
                    raise SystemExit(f"build: ninja failed (rc {rc}):\n{tail}")
            elif not (self.pidfile.is_file()
                      and _alive(int(self.pidfile.read_text().split()[0]))):
                if self.done():
                    break
                tail = self.log.read_bytes()[-6000:].decode(errors="replace")
                raise SystemExit(f"build: the earlier ninja ended without the binaries:\n{tail}")
            if time.time() >= deadline:
                print(f"build: still compiling at the time budget ({_progress(self.log)}, "
                      f"{time.time() - self.t0:.0f} s this call); ninja goes on in the "
                      f"background: call again within 30 s", flush=True)
                return False
            if time.time() - last > 30:
                print(f"build: {_progress(self.log)} after {time.time() - self.t0:.0f} s",
                      flush=True)
                last = time.time()
            time.sleep(2)
        print(f"build: done, {time.time() - self.t0:.0f} s this call: "
              f"{' '.join(str(p) for p in self.bins.values())}", flush=True)
        return True


def cmd_build(a) -> int:
    b = Build(a)
    state = b.start()
    if state == "done":
        print(f"build: {b.bins['llama-bench']} ready")
        return 0
    return 0 if b.wait(b.t0 + a.time_budget) else 3


# -- gguf ----------------------------------------------------------------------------------
QK4_0, QK_K = 32, 256
Q4_0_BYTES, Q6_K_BYTES = 18, 210
Q4_0_STD = math.sqrt(sum((k - 8) ** 2 for k in range(16)) / 16)  # 4.61: std of (code - 8)
Q6_K_STD = math.sqrt(sum((k - 32) ** 2 for k in range(64)) / 64)  # 18.5: std of (code - 32)
Q6_K_SCALE = 4  # every sub-block's int8 scale; d carries the rest


def q4_0_pack(codes, d):
    """Q4_0 blocks of codes (rows, cols) in 0..15 with scales d (rows, cols // 32): per block
    the fp16 d, then 16 bytes; element j < 16 is the low nibble of byte j, element 16 + j its
    high nibble; value = (code - 8) * d."""
    import numpy as np

    rows, cols = codes.shape
    c = codes.reshape(rows, cols // QK4_0, 2, 16).astype(np.uint8)
    qs = c[:, :, 0, :] | (c[:, :, 1, :] << 4)
    out = np.empty((rows, cols // QK4_0, Q4_0_BYTES), np.uint8)
    out[:, :, :2] = np.asarray(d, "<f2").reshape(rows, cols // QK4_0, 1).view(np.uint8)
    out[:, :, 2:] = qs
    return out.reshape(rows, -1)


def random_bytes(n: int, rng):
    """n random bytes as uint8 (the bit generator's raw 64-bit words: ~4x rng.bytes)."""
    import numpy as np

    return rng.bit_generator.random_raw(-(-n // 8)).view(np.uint8)[:n]


def q4_0_random(rows: int, cols: int, d: float, rng):
    """Q4_0 bytes (rows, cols / 32 * 18): random nibbles, every block's scale d."""
    import numpy as np

    nb = rows * (cols // QK4_0)
    out = np.empty((nb, Q4_0_BYTES), np.uint8)
    out[:, :2] = np.array([d], "<f2").view(np.uint8)
    out[:, 2:] = random_bytes(nb * 16, rng).reshape(nb, 16)
    return out.reshape(rows, -1)


def q6_k_random(rows: int, cols: int, d: float, rng):
    """Q6_K bytes (rows, cols / 256 * 210): random 6-bit codes (ql 128 B, qh 64 B), every
    sub-block scale Q6_K_SCALE, super-block scale d; value = d * scale * (code - 32)."""
    import numpy as np

    nb = rows * (cols // QK_K)
    out = np.empty((nb, Q6_K_BYTES), np.uint8)
    out[:, :192] = random_bytes(nb * 192, rng).reshape(nb, 192)
    out[:, 192:208] = Q6_K_SCALE
    out[:, 208:] = np.array([d], "<f2").view(np.uint8)
    return out.reshape(rows, -1)


def model_tensors(L: int, H: int, heads: int, kv_heads: int, F: int, V: int, out_type: str):
    """(name, numpy shape (rows = out features, cols = in), kind, fan_in) in file order."""
    kv = H // heads * kv_heads
    ts = [("token_embd.weight", (V, H), "q4_0", H)]
    for i in range(L):
        b = f"blk.{i}."
        ts += [(b + "attn_norm.weight", (H,), "ones", 0),
               (b + "attn_q.weight", (H, H), "q4_0", H),
               (b + "attn_k.weight", (kv, H), "q4_0", H),
               (b + "attn_v.weight", (kv, H), "q4_0", H),
               (b + "attn_output.weight", (H, H), "q4_0", H),
               (b + "ffn_norm.weight", (H,), "ones", 0),
               (b + "ffn_gate.weight", (F, H), "q4_0", H),
               (b + "ffn_up.weight", (F, H), "q4_0", H),
               (b + "ffn_down.weight", (H, F), "q4_0", F)]
    ts += [("output_norm.weight", (H,), "ones", 0), ("output.weight", (V, H), out_type, H)]
    return ts


def write_gguf(path: str | Path, layers: int = 32, hidden: int = 4096, heads: int = 32,
               kv_heads: int = 8, ffn: int = 14336, vocab: int = 128256, ctx: int = 131072,
               rope_theta: float = 500000.0, rms_eps: float = 1e-5, output_type: str = "q6_k",
               seed: int = 0, log=print) -> dict:
    """Write the random Llama-shaped GGUF; returns {tensor name: block scale d} (the fp16 d
    each Q4_0 / Q6_K block carries) and stats."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter, TokenType

    assert hidden % heads == 0 and heads % kv_heads == 0 and hidden % QK_K == 0
    assert ffn % QK4_0 == 0 and vocab >= 259
    t0 = time.time()
    path = Path(path)
    part = path.with_name(path.name + ".part")
    w = GGUFWriter(str(part), "llama")
    w.add_name(f"random Llama-3-8B shape (hisparse gpu_llama_cpp.py, seed {seed})")
    w.add_context_length(ctx)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_vocab_size(vocab)
    w.add_file_type(2)  # LLAMA_FTYPE_MOSTLY_Q4_0
    w.add_quantization_version(2)
    # SPM vocabulary: <unk> <s> </s>, the 256 byte tokens, unique fillers
    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    toks += [f"\u2581t{i}" for i in range(vocab - len(toks))]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    types += [TokenType.NORMAL] * (vocab - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(vocab - 259)])
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)

    specs = model_tensors(layers, hidden, heads, kv_heads, ffn, vocab, output_type)
    scales, nbytes = {}, 0
    for name, shape, kind, fan_in in specs:
        if kind == "ones":
            w.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * 4)
            nbytes += shape[0] * 4
            continue
        rows, cols = shape
        if kind == "q4_0":
            d = float(np.float16(1.0 / (Q4_0_STD * fan_in ** 0.5)))
            bshape, qt = (rows, cols // QK4_0 * Q4_0_BYTES), Q.Q4_0
        else:
            d = float(np.float16(1.0 / (Q6_K_SCALE * Q6_K_STD * fan_in ** 0.5)))
            bshape, qt = (rows, cols // QK_K * Q6_K_BYTES), Q.Q6_K
        scales[name] = d
        w.add_tensor_info(name, bshape, np.dtype(np.uint8), bshape[0] * bshape[1], raw_dtype=qt)
        nbytes += bshape[0] * bshape[1]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape, kind, _ in specs:
        if kind == "ones":
            w.write_tensor_data(np.ones(shape, np.float32))
        elif kind == "q4_0":
            w.write_tensor_data(q4_0_random(shape[0], shape[1], scales[name], rng))
        else:
            w.write_tensor_data(q6_k_random(shape[0], shape[1], scales[name], rng))
    w.close()
    part.rename(path)
    n_params = sum(int(np.prod(s)) for _, s, _, _ in specs)
    stats = {"path": str(path), "bytes": path.stat().st_size, "tensor_bytes": nbytes,
             "n_params": n_params, "seconds": round(time.time() - t0, 1)}
    log(f"gguf: {path} {stats['bytes'] / 2**30:.2f} GiB, {n_params / 1e9:.3f} B parameters, "
        f"{len(specs)} tensors, written in {stats['seconds']} s")
    return {"scales": scales, **stats}


GGUF_ARGS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "ctx", "rope_theta",
             "rms_eps", "output_type", "seed")


def cmd_gguf(a) -> int:
    out = Path(a.out)
    if out.is_file() and not a.force:
        print(f"gguf: {out} exists ({out.stat().st_size / 2**30:.2f} GiB), skipped")
        return 0
    write_gguf(out, **{k: getattr(a, k) for k in GGUF_ARGS})
    return 0


# -- bench ---------------------------------------------------------------------------------
BUF_RE = {
    "model": re.compile(r"(\S+) model buffer size =\s*([\d.]+) MiB"),
    "kv": re.compile(r"(\S+) KV buffer size =\s*([\d.]+) MiB"),
    "compute": re.compile(r"(\S+) compute buffer size =\s*([\d.]+) MiB"),
    "output": re.compile(r"(\S+)\s+output buffer size =\s*([\d.]+) MiB"),
}


class GpuMem:
    """nvidia-smi's memory.used (MiB) sampled every 200 ms in a thread: baseline and peak."""

    def __init__(self):
        self.samples: list[int] = []
        self.proc = None
        self.base = self._once()

    @staticmethod
    def _once() -> int | None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used",
                                  "--format=csv,noheader,nounits", "-i", "0"],
                                 capture_output=True, text=True, timeout=20).stdout
            return int(out.split()[0])
        except (OSError, ValueError, IndexError, subprocess.SubprocessError):
            return None

    def __enter__(self):
        try:
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=memory.used",
                                          "--format=csv,noheader,nounits", "-i", "0",
                                          "-lms", "200"], stdout=subprocess.PIPE, text=True)
        except OSError:
            return self

        def read():
            for line in self.proc.stdout:
                if line.strip().isdigit():
                    self.samples.append(int(line))
        threading.Thread(target=read, daemon=True).start()
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)

    def result(self) -> dict:
        peak = max(self.samples) if self.samples else None
        return {"smi_baseline_mib": self.base, "smi_peak_mib": peak,
                "smi_process_peak_mib": (peak - self.base) if peak is not None
                and self.base is not None else None}


def gpu_info() -> dict:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20).stdout.strip().splitlines()[0]
        name, total, driver = (x.strip() for x in out.split(","))
        return {"gpu": name, "memory_total": total, "driver": driver}
    except (OSError, IndexError, ValueError, subprocess.SubprocessError):
        return {}


class Bench:
    def __init__(self, a, model: Path, binary: Path):
        self.a, self.model, self.binary = a, model, binary
        self.out = Path(a.out_dir or os.environ.get("OUT") or "out")
        self.out.mkdir(parents=True, exist_ok=True)
        self.json = self.out / "gpu_llama_cpp.json"
        self.logf = open(self.out / "gpu_llama_cpp.log", "a")
        self.res = {"table": "BENCHMARKS.md: llama.cpp on the GPU (issue 42 item 4)",
                    "date": time.strftime("%Y-%m-%d %H:%M"), "argv": sys.argv[1:],
                    "model": {"path": str(model), "bytes": model.stat().st_size,
                              "shape": "Llama-3-8B (32 layers, hidden 4096, 32/8 heads, ffn "
                                       "14336, vocab 128256), random weights, Q4_0 with a "
                                       "Q6_K output"},
                    **gpu_info(), "runs": [], "rows": [], "memory": [], "skipped": []}
        self.save()

    def save(self):
        self.json.write_text(json.dumps(self.res, indent=1))

    def log(self, text: str):
        self.logf.write(text)
        self.logf.flush()

    def run(self, name: str, args: list[str], kv: str) -> bool:
        cmd = [str(self.binary), "-m", str(self.model), "-ngl", "99", "-fa", "1", "-r", "1",
               "-o", "json", "-v", "--progress", *args]
        shown = "llama-bench -m MODEL " + " ".join(cmd[3:])
        print(f"\nbench[{name}]: {shown}", flush=True)
        t0 = time.time()
        with GpuMem() as mem:
            r = subprocess.run(cmd, capture_output=True, text=True, env=run_env())
        wall = time.time() - t0
        self.log(f"\n===== {name}: {shown} (rc {r.returncode}, {wall:.1f} s)\n")
        err_lines = r.stderr.splitlines()
        keep = [ln for ln in err_lines if any(k in ln for k in (
            "buffer size", "llama-bench:", "error", "CUDA", "ggml_cuda", "flash", "n_ctx",
            "print_info: file", "print_info: model", "failed", "warn"))]
        self.log("\n".join(keep) + "\n----- stderr tail\n" + "\n".join(err_lines[-40:]) + "\n")
        run = {"name": name, "command": shown, "rc": r.returncode, "wall_s": round(wall, 1),
               "kv_type": kv, **mem.result()}
        bufs = {}
        for key, rx in BUF_RE.items():
            for dev, mib in rx.findall(r.stderr):
                # the largest allocation of each kind per device (the 128K context's)
                k = f"{key}:{dev}"
                bufs[k] = max(bufs.get(k, 0.0), float(mib))
        run["buffers_mib"] = bufs
        try:
            rows = json.loads(r.stdout) if r.stdout.strip() else []
        except json.JSONDecodeError:
            rows = []
            self.log("----- stdout (not JSON)\n" + r.stdout[-4000:] + "\n")
        for row in rows:
            test = f"pp{row['n_prompt']}" if row.get("n_prompt") else f"tg{row['n_gen']}"
            self.res["rows"].append({
                "run": name, "test": test, "depth": row.get("n_depth", 0), "kv_type": kv,
                "tok_s": row.get("avg_ts"), "stddev_tok_s": row.get("stddev_ts"),
                "samples_ns": row.get("samples_ns"), "n_batch": row.get("n_batch"),
                "n_ubatch": row.get("n_ubatch"), "flash_attn": row.get("flash_attn"),
                "type_k": row.get("type_k"), "type_v": row.get("type_v"),
                "model_type": row.get("model_type"), "model_size": row.get("model_size"),
                "model_n_params": row.get("model_n_params"), "gpu_info": row.get("gpu_info"),
                "build": f"{row.get('build_commit')} ({row.get('build_number')})",
                "backends": row.get("backends")})
        run["tests"] = len(rows)
        self.res["runs"].append(run)
        if r.returncode != 0:
            print(f"bench[{name}]: llama-bench failed (rc {r.returncode}):\n"
                  + "\n".join(err_lines[-25:]), flush=True)
        self.save()
        return r.returncode == 0

    def memory(self, run: dict, n_ctx: int) -> dict:
        """The 6 GiB question for one KV type at n_ctx from one llama-bench run."""
        b = run["buffers_mib"]
        gpu = lambda kind: sum(v for k, v in b.items()  # noqa: E731
                               if k.startswith(kind + ":") and k.split(":")[1].startswith("CUDA")
                               and "Host" not in k)
        model, kv, compute = gpu("model"), gpu("kv"), gpu("compute")
        bufsum = model + kv + compute
        proc = run.get("smi_process_peak_mib")
        # the process's peak, never below its buffers (a 200 ms sample can miss the peak)
        need = max(proc or 0, bufsum)
        other = (proc - bufsum) if proc else None  # CUDA context, cuBLAS, the ggml pool
        kv_tok = kv / n_ctx if kv else None
        fixed = need - kv
        m = {"kv_type": run["kv_type"], "n_ctx": n_ctx, "model_gpu_mib": round(model, 1),
             "kv_gpu_mib": round(kv, 1), "compute_gpu_mib": round(compute, 1),
             "buffers_gpu_mib": round(bufsum, 1), "process_peak_mib": proc,
             "need_mib": round(need, 1),
             "other_mib": round(other, 1) if other is not None else None,
             "host_buffers_mib": {k: v for k, v in b.items() if "Host" in k or "CPU" in k},
             "cap_mib": CAP_MIB, "fits_cap": need <= CAP_MIB,
             "max_ctx_in_cap": int((CAP_MIB - fixed) / kv_tok) if kv_tok and CAP_MIB > fixed
             else 0}
        self.res["memory"].append(m)
        self.save()
        return m

    def table(self):
        print("\n| run | KV | test | depth | tok/s |\n|---|---|---|---:|---:|")
        for r in self.res["rows"]:
            print(f"| {r['run']} | {r['kv_type']} | {r['test']} | {r['depth']:,} | "
                  f"{r['tok_s']:,.1f} |")
        if self.res["memory"]:
            print(f"\n| KV | n_ctx | model | KV | compute | buffers | process peak (nvidia-smi) "
                  f"| fits {CAP_MIB} MiB | max ctx in cap |\n|---|---:|---:|---:|---:|---:|"
                  f"---:|---|---:|")
            for m in self.res["memory"]:
                print(f"| {m['kv_type']} | {m['n_ctx']:,} | {m['model_gpu_mib']:,.0f} | "
                      f"{m['kv_gpu_mib']:,.0f} | {m['compute_gpu_mib']:,.0f} | "
                      f"{m['buffers_gpu_mib']:,.0f} | {m['process_peak_mib'] or '–'} | "
                      f"{'yes' if m['fits_cap'] else 'no'} | {m['max_ctx_in_cap']:,} |")
        if self.res["skipped"]:
            print(f"skipped (time budget): {', '.join(self.res['skipped'])}")


# (name, llama-bench arguments, KV type, estimated seconds on an H100, memory row's n_ctx)
def bench_plan(depths: list[int], long: int) -> list[tuple]:
    d = ",".join(map(str, depths))
    # the longest first: with no warm-up, it takes the first calls' start-up (<1 % of it)
    pp = ",".join(map(str, sorted(depths, reverse=True)))
    return [
        ("f16-depth", ["-p", "512", "-n", "128", "-d", d], "f16", 90, long + 512),
        ("f16-prefill", ["-p", pp, "-n", "0", "-d", "0", "--no-warmup"], "f16", 70, 0),
        ("q8_0-depth", ["-ctk", "q8_0", "-ctv", "q8_0", "-p", "512", "-n", "128", "-d",
                        str(long)], "q8_0", 75, long + 512),
        ("q4_0-depth", ["-ctk", "q4_0", "-ctv", "q4_0", "-p", "512", "-n", "128", "-d",
                        str(long)], "q4_0", 75, long + 512),
    ]


def cmd_bench(a, deadline: float | None = None) -> int:
    deadline = deadline or time.time() + a.time_budget
    model, binary = Path(a.model), binaries()["llama-bench"]
    for p in (model, binary):
        if not p.is_file():
            raise SystemExit(f"bench: no {p} (run `build` / `gguf`, or `all`)")
    depths = [int(x) for x in a.depths.split(",")]
    b = Bench(a, model, binary)
    for name, args, kv, est, n_ctx in bench_plan(depths, max(depths)):
        if a.only and name not in a.only.split(","):
            continue
        if time.time() + est > deadline:
            print(f"bench[{name}]: skipped, ~{est} s left no room in the time budget", flush=True)
            b.res["skipped"].append(name)
            b.save()
            continue
        ok = b.run(name, args, kv)
        if ok and n_ctx:
            b.memory(b.res["runs"][-1], n_ctx)
    b.table()
    print(f"\nbench: {b.json}")
    return 0


def cmd_all(a) -> int:
    t0 = time.time()
    deadline = t0 + a.time_budget
    build = Build(a)
    state = build.start()
    if not Path(a.model).is_file():
        write_gguf(a.model, **{k: getattr(a, k) for k in GGUF_ARGS})
    else:
        print(f"gguf: {a.model} exists, skipped")
    depths = [int(x) for x in a.depths.split(",")]
    bench_s = sum(p[3] for p in bench_plan(depths, max(depths))
                  if not a.only or p[0] in a.only.split(","))  # estimated, on an H100
    if state != "done" and not build.wait(deadline - 60):
        return 3
    if deadline - time.time() < bench_s:
        print(f"all: built, {deadline - time.time():.0f} s of the time budget left, the bench "
              f"needs ~{bench_s} s: call `all` again within 30 s (the build and the model stay "
              f"in /tmp while the machine is warm)")
        return 3
    return cmd_bench(a, deadline)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="(CPU) the trimmed llama.cpp source tarball")
    p.add_argument("--version", default=None, help="llama-cpp-python sdist version (default: "
                   "the newest cached, else PyPI's newest)")
    p.add_argument("--cache", default=None, help="default $HISPARSE_BENCH_CACHE, else "
                   "~/.cache/hisparse-bench")
    p.add_argument("--out", default=str(PACK))
    p.add_argument("--check", action="store_true", help="configure the trimmed tree (CPU)")
    p.add_argument("--check-cuda", action="store_true", help="configure it for CUDA too")
    p.add_argument("--cpu-build", action="store_true", help="build the CPU llama-bench from it")
    p.add_argument("--cuda-build", action="store_true", help="compile the CUDA llama-bench here "
                   "(nvcc, no GPU needed; ~40 min on 2 cores) into .llamacpp/llama-bench-sm90")
    p.add_argument("--cublas-dir", default=None, help="a folder with libcublas.so* (its "
                   "../include the headers) where neither the toolkit nor python3 has one")

    def build_args(p):
        p.add_argument("--tarball", default=str(PACK))
        p.add_argument("--prebuilt", default=str(PREBUILT), help="a llama-bench built by "
                       "`pack --cuda-build`, used when it runs here ('' to compile anyway)")
        p.add_argument("--jobs", type=int, default=None, help="default: all cores")
        p.add_argument("--cublas-dir", default=None)

    def gguf_args(p, out):
        p.add_argument("--layers", type=int, default=32)
        p.add_argument("--hidden", type=int, default=4096)
        p.add_argument("--heads", type=int, default=32)
        p.add_argument("--kv-heads", type=int, default=8)
        p.add_argument("--ffn", type=int, default=14336)
        p.add_argument("--vocab", type=int, default=128256)
        p.add_argument("--ctx", type=int, default=131072)
        p.add_argument("--rope-theta", type=float, default=500000.0)
        p.add_argument("--rms-eps", type=float, default=1e-5)
        p.add_argument("--output-type", choices=("q6_k", "q4_0"), default="q6_k")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument(out, default=str(MODEL))

    def bench_args(p):
        p.add_argument("--depths", default="32768,131072")
        p.add_argument("--only", default=None, help="comma list of runs: f16-depth, "
                       "f16-prefill, q8_0-depth, q4_0-depth")
        p.add_argument("--out-dir", default=None, help="default $OUT, else ./out")

    p = sub.add_parser("build", help="(device) the CUDA llama-bench")
    build_args(p)
    p.add_argument("--time-budget", type=float, default=560)
    p = sub.add_parser("gguf", help="the random Llama-3-8B-shaped Q4_0 GGUF")
    gguf_args(p, "--out")
    p.add_argument("--force", action="store_true")
    p = sub.add_parser("bench", help="(device) llama-bench runs and the 6 GiB question")
    p.add_argument("--model", default=str(MODEL))
    bench_args(p)
    p.add_argument("--time-budget", type=float, default=560)
    p = sub.add_parser("all", help="(device) build, gguf, bench in one call")
    build_args(p)
    gguf_args(p, "--model")
    bench_args(p)
    p.add_argument("--time-budget", type=float, default=560)
    a = ap.parse_args()
    return {"pack": cmd_pack, "build": cmd_build, "gguf": cmd_gguf, "bench": cmd_bench,
            "all": cmd_all}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
