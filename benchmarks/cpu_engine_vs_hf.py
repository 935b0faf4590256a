"""CPU benchmarks of the engine against its peers, each peer measured in the same run. Every
measured process runs in its own subprocess (peak RSS per variant); `--contend` starts one
CPU-bound process at normal priority (`python -c 'while True: pass'`) beside each measured
process and kills it after; `--conditions quiet,contended` interleaves the two (the order
rotated per document / round). Prints markdown tables (BENCHMARKS.md, CPU section); --json
keeps every row.

Modes:
  engine     `Engine.generate` vs transformers' `generate` on the same prompt ids, greedy, the
             same number of new tokens forced (min_new_tokens): variants hf, dense, sparse.
             --anchor builds each document's prompt as ../shared/tools/hf_truncation_baseline.py
             does (its system line, task sentence and truncation). HF runs as a user runs it
             (OpenMP defaults); ours as the CLI does (threads.py policy).
  cli        `hisparse summarize DOC --profile cpu --json` (what users run; variants
             default, dense, t1 / t2 = --threads 1 / 2, before = the same command from the
             tree given as --before) and, with variant `anchor`, the anchor tool itself on the
             same document and --max-new: process wall time, the run's own rates.
  llama.cpp  `llama-bench` (the peer a user would pick: built from the llama.cpp vendored in
             the PyPI `llama-cpp-python` sdist, CPU only, see below) on the GGUF inside the
             default model's wheel vs the engine (dense, the same threads) on the same token
             counts: prefill pp tokens, decode tg tokens from depth 0 and from depth pp.
             --build-only: build the peer and stop; --peer-only: one llama-bench call, its
             JSON printed (the engine is not run).
  suite      `python -m pytest -q [--slow]` wall time.

    python benchmarks/cpu_engine_vs_hf.py --mode engine --anchor --docs A.txt B.txt \
        --new-tokens 256 --conditions quiet,contended --json OUT.json
    python benchmarks/cpu_engine_vs_hf.py --mode cli --variants default,dense,anchor \
        --docs samples/medical/discharge_report.txt A.txt B.txt --conditions quiet,contended
    python benchmarks/cpu_engine_vs_hf.py --mode llama.cpp --threads 2 --pp 2048 --tg 128
    python benchmarks/cpu_engine_vs_hf.py --mode llama.cpp --build-only [--version X.Y.Z]
    python benchmarks/cpu_engine_vs_hf.py --mode llama.cpp --peer-only [--threads 2] [--pp 2048]
    python benchmarks/cpu_engine_vs_hf.py --mode suite --conditions quiet,contended --slow
Documents from ../shared/eval_dev are read here only (never copied into the repo).

The llama.cpp build (~10 min on 2 cores) and the extracted GGUF are cached outside the
repository, in `--cache` (default `$HISPARSE_BENCH_CACHE`, else `~/.cache/hisparse-bench`):
    llama-cpp-python-<version>.tar.gz   the sdist (`pip download --no-binary :all:`)
    llama.cpp-<version>/                its vendored llama.cpp and the CMake build
    <wheel stem>.gguf                   the default model's GGUF, extracted from its wheel
A second call reuses all three. The wheel is read from $HISPARSE_HOME/downloads (where
`hisparse models pull` keeps it); nothing is downloaded for the model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the project's shared folder: ../shared beside the repository (a worktree one level deeper:
# ../../shared), or HISPARSE_SHARED
SHARED = Path(os.environ.get("HISPARSE_SHARED") or next(
    (p / "shared" for p in (ROOT.parent, ROOT.parent.parent) if (p / "shared").is_dir()),
    ROOT.parent / "shared"))
DEFAULT_DOC = SHARED / "eval_dev" / "gov_report" / "govreport-00.txt"
ANCHOR = SHARED / "tools" / "hf_truncation_baseline.py"
SYSTEM = "You are a helpful assistant that writes concise, faithful summaries."  # the anchor's
TASK = "Summarize the following document in one paragraph.\n\n"


@contextlib.contextmanager
def condition(name: str):
    """Run the body quiet, or beside one CPU-bound process (killed after)."""
    busy = None
    if name == "contended":
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.3)
    try:
        yield
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()


BEFORE: list[str] = []  # --before DIR: the tree whose code the `before` variant runs


def child_env(variant: str) -> dict:
    """HF, the anchor and an older tree run with the user's OpenMP defaults; ours sets its
    own (threads.py)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if variant in ("hf", "anchor", "before"):
        env.pop("GOMP_SPINCOUNT", None)
    if variant == "before":
        env["PYTHONPATH"] = BEFORE[0]
    return env


# -- engine mode ---------------------------------------------------------------------------
def prompt_ids(model_dir: str, doc: str, n: int, anchor: bool, new: int) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    text = Path(doc).read_text(encoding="utf-8")
    if anchor:  # hf_truncation_baseline.py's prompt
        import json as _json

        ctx = _json.loads((Path(model_dir) / "config.json").read_text())["max_position_embeddings"]
        ids = tok(text, add_special_tokens=False)["input_ids"]
        budget = ctx - new - 64
        if len(ids) > budget:
            text = tok.decode(ids[:budget])
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK + text}]
    else:
        body = tok.decode(tok(text)["input_ids"][: n - 40])
        msgs = [{"role": "user", "content": "Summarize the following report.\n\n" + body}]
    return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                   return_dict=False)


def run_variant(variant: str, model_dir: str, ids: list[int], new_tokens: int,
                threads: int | None) -> dict:
    import resource

    if variant != "hf":
        from hisparse_cli.config.env import bound_openmp_spin

        bound_openmp_spin()  # as the CLI does, before torch loads
    import torch

    if variant == "hf":
        from transformers import AutoModelForCausalLM

        if threads:
            torch.set_num_threads(threads)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        x = torch.tensor([ids])
        with torch.inference_mode():
            t0 = time.perf_counter()
            model(x, logits_to_keep=1)  # the prefill alone, for the decode rate below
            prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            wall = time.perf_counter() - t0
        toks = out[0, len(ids):].tolist()
        decode = max(wall - prefill, 1e-9)
        stats = {"prefill_tok_s": len(ids) / prefill, "decode_tok_s": (len(toks) - 1) / decode,
                 "prefill_seconds": prefill, "decode_seconds": decode,
                 "threads": {"all": [torch.get_num_threads()]}}
    else:
        from hisparse_cli.engine import Engine, SparseConfig

        sparse = SparseConfig.dense_config() if variant == "dense" else SparseConfig()
        eng = Engine.from_pretrained(model_dir, sparse=sparse, threads=threads)
        t0 = time.perf_counter()
        res = eng.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        wall = time.perf_counter() - t0
        toks = res.token_ids
        stats = res.stats.to_dict()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"variant": variant, "wall_s": wall, "tokens": toks, "peak_rss_bytes": rss,
            "stats": stats}


def run_child(spec: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--_child", json.dumps(spec)],
                         capture_output=True, text=True, env=child_env(spec["variant"]))
    if out.returncode != 0:
        sys.exit(f"{spec['variant']} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def engine_mode(a, model: str) -> list[dict]:
    rows = []
    variants = a.variants.split(",")
    for d, doc in enumerate(a.docs):
        ids = prompt_ids(model, doc, a.prompt_tokens, a.anchor, a.new_tokens)
        for r in range(a.rounds):
            k = d + r
            for cond in rotate(a.conditions.split(","), k):
                for v in rotate(variants, k):
                    with condition(cond):
                        res = run_child({"variant": v, "model": model, "ids": ids,
                                         "new": a.new_tokens, "threads": a.threads})
                    rows.append({"doc": Path(doc).name, "round": r, "condition": cond,
                                 "prompt_tokens": len(ids), **res})
                    print(f"{Path(doc).name} r{r} {cond:9} {v:6} {res['wall_s']:7.2f} s "
                          f"prefill {res['stats']['prefill_tok_s']:7.1f} decode "
                          f"{res['stats']['decode_tok_s']:6.1f} tok/s", flush=True)
    print_engine_table(rows)
    return rows


def rotate(items: list, k: int) -> list:
    return items[k % len(items):] + items[:k % len(items)]


def print_engine_table(rows: list[dict]) -> None:
    print("\n| document | prompt | condition | variant | wall s | x HF | prefill tok/s | "
          "decode tok/s | tokens = HF | threads | peak RSS MiB |")
    print("|---|---:|---|---|---:|---:|---:|---:|---|---|---:|")
    for x in rows:
        hf = next((y for y in rows if y["variant"] == "hf" and all(
            y[k] == x[k] for k in ("doc", "round", "condition"))), None)
        ratio = f"{x['wall_s'] / hf['wall_s']:.2f}×" if hf else ""
        same = "" if hf is None or x is hf else _same(x["tokens"], hf["tokens"])
        s = x["stats"]
        thr = ", ".join(f"{p} {'→'.join(map(str, c))}" for p, c in (s.get("threads") or {}).items())
        print(f"| {x['doc']} | {x['prompt_tokens']} | {x['condition']} | {x['variant']} | "
              f"{x['wall_s']:.2f} | {ratio} | {s['prefill_tok_s']:.0f} | {s['decode_tok_s']:.1f}"
              f" | {same} | {thr} | {x['peak_rss_bytes'] / 2**20:.0f} |")


def _same(a: list[int], b: list[int]) -> str:
    if a == b:
        return f"all {len(a)}"
    return f"first {next(i for i, (x, y) in enumerate(zip(a + [-1], b + [-2])) if x != y)}"


# -- cli mode ------------------------------------------------------------------------------
def cli_run(variant: str, doc: str, model: str, a) -> dict:
    doc = str(Path(doc).resolve())  # every variant runs from another folder (below)
    if variant == "anchor":
        cmd = [sys.executable, str(ANCHOR), model, doc, "--max-new", str(a.new_tokens)]
    else:
        extra = {"default": [], "before": [], "dense": ["--dense"], "t1": ["--threads", "1"],
                 "t2": ["--threads", "2"]}[variant]
        cmd = [sys.executable, "-m", "hisparse_cli.cli.app", "summarize", doc, "--profile", "cpu",
               "--max-new-tokens", str(a.new_tokens), "--json", "--quiet", *extra]
    # `-m` imports from the cwd first: `before` runs from its tree; the others from outside the
    # checkout, whose top-level kernels/ would shadow the `kernels` distribution transformers
    # probes (the installed package maps it to hisparse_cli.kernels)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=child_env(variant),
                         cwd=BEFORE[0] if variant == "before" else tempfile.gettempdir())
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    if variant == "anchor":
        rec = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("{")))
        return {"wall_s": wall, "generate_s": rec["seconds"], "new_tokens": rec["new_tokens"],
                "prompt_tokens": rec["doc_tokens"], "prefill_tok_s": None, "decode_tok_s": None,
                "threads": "", "rouge1": rec["rouge1"]}
    rec = json.loads(out.stdout)
    s = rec["stats"]
    thr = ", ".join(f"{p} {'→'.join(map(str, c))}" for p, c in (s.get("threads") or {}).items())
    return {"wall_s": wall, "generate_s": rec["timings"]["generate_seconds"],
            "new_tokens": s["new_tokens"], "prompt_tokens": s["prompt_tokens"],
            "prefill_tok_s": s["prefill_tok_s"], "decode_tok_s": s["decode_tok_s"],
            "threads": thr, "decode_path": s.get("decode_path", "")}


def cli_mode(a, model: str) -> list[dict]:
    rows = []
    for d, doc in enumerate(a.docs):
        for r in range(a.rounds):
            for cond in rotate(a.conditions.split(","), d + r):
                for v in rotate(a.variants.split(","), d + r):
                    with condition(cond):
                        res = cli_run(v, doc, model, a)
                    rows.append({"doc": Path(doc).name, "round": r, "condition": cond,
                                 "variant": v, **res})
                    print(f"{Path(doc).name} r{r} {cond:9} {v:7} wall {res['wall_s']:7.2f} s "
                          f"generate {res['generate_s']:7.2f} s new {res['new_tokens']} "
                          f"{res['threads']}", flush=True)
    print("\n| document | variant | quiet wall s | contended wall s | contended / quiet | "
          "quiet generate s | new tokens | quiet decode tok/s | threads (contended) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for doc in dict.fromkeys(x["doc"] for x in rows):
        for v in a.variants.split(","):
            q = [x for x in rows if (x["doc"], x["variant"], x["condition"]) == (doc, v, "quiet")]
            c = [x for x in rows if (x["doc"], x["variant"], x["condition"]) == (doc, v, "contended")]
            qw = statistics.median(x["wall_s"] for x in q) if q else None
            cw = statistics.median(x["wall_s"] for x in c) if c else None
            ratio = f"{cw / qw:.2f}×" if qw and cw else ""
            dec = q[0]["decode_tok_s"] if q and q[0]["decode_tok_s"] else None
            print(f"| {doc} | {v} | {_f(qw)} | {_f(cw)} | {ratio} | "
                  f"{_f(q[0]['generate_s'] if q else None)} | {q[0]['new_tokens'] if q else ''} | "
                  f"{_f(dec, 1)} | {c[0]['threads'] if c else ''} |")
    return rows


def _f(x, nd: int = 2) -> str:
    return "" if x is None else f"{x:.{nd}f}"


# -- llama.cpp mode ------------------------------------------------------------------------
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


def engine_pp_tg(model: str, threads: int, pp: int, tg: int) -> dict:
    """The engine's (dense) prefill of pp tokens, then decode of tg tokens from depth 0 and
    from depth pp (random ids, as llama-bench)."""
    from hisparse_cli.config.env import bound_openmp_spin

    bound_openmp_spin()
    import torch

    from hisparse_cli.engine import Engine, SparseConfig

    eng = Engine.from_pretrained(model, sparse=SparseConfig.dense_config(), threads=threads)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, eng.cfg.vocab_size, (pp,), generator=g).tolist()
    eng.generate(ids[:64], max_new_tokens=8, min_new_tokens=8)  # warm-up
    deep = eng.generate(ids, max_new_tokens=tg + 1, min_new_tokens=tg + 1)
    shallow = eng.generate(ids[:1], max_new_tokens=tg + 1, min_new_tokens=tg + 1)
    return {"pp_tok_s": deep.stats.prefill_tok_s, "tg_tok_s": shallow.stats.decode_tok_s,
            "tg_depth_tok_s": deep.stats.decode_tok_s, "decode_path": deep.stats.decode_path,
            "threads": deep.stats.threads}


def llama_cpp_mode(a, model: str) -> list[dict]:
    cache = cache_dir(a.cache)
    binary, gguf = build_llama_bench(cache, a.version), default_gguf(cache)
    rows = []
    whos = ["llama.cpp", "hisparse", "hisparse auto"]  # auto: our thread policy (threads.py)
    for r in range(a.rounds):
        for cond in rotate(a.conditions.split(","), r):
            for who in rotate(whos, r):
                with condition(cond):
                    if who == "llama.cpp":
                        res = llama_bench(binary, gguf, a.threads, a.pp, a.tg, a.reps)
                        res["tg_depth_tok_s"] = llama_bench(
                            binary, gguf, a.threads, 0, a.tg, a.reps, depth=a.pp)["tg_tok_s"]
                    else:
                        spec = {"variant": "pp_tg", "model": model, "pp": a.pp, "tg": a.tg,
                                "threads": a.threads if who == "hisparse" else None}
                        res = run_child(spec)
                rows.append({"round": r, "condition": cond, "who": who, **res})
                print(f"r{r} {cond:9} {who:13} pp{a.pp} {res['pp_tok_s']:7.1f} tg{a.tg} "
                      f"{res['tg_tok_s']:6.1f} tg{a.tg}@d{a.pp} {res['tg_depth_tok_s']:6.1f} tok/s",
                      flush=True)
    print(f"\n| round | condition | hisparse threads | llama.cpp pp{a.pp} | hisparse | ratio | "
          f"llama.cpp tg{a.tg} | hisparse | ratio | llama.cpp tg{a.tg} @ depth {a.pp} | "
          "hisparse | ratio |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in range(a.rounds):
        for cond in a.conditions.split(","):
            lc = next(x for x in rows if (x["round"], x["condition"], x["who"]) == (r, cond, "llama.cpp"))
            for who in whos[1:]:
                hs = next(x for x in rows if (x["round"], x["condition"], x["who"]) == (r, cond, who))
                cells = []
                for k in ("pp_tok_s", "tg_tok_s", "tg_depth_tok_s"):
                    cells += [f"{lc[k]:.1f}", f"{hs[k]:.1f}", f"**{hs[k] / lc[k]:.2f}×**"]
                thr = f"{a.threads}" if who == "hisparse" else "auto " + ", ".join(
                    f"{p} {'→'.join(map(str, c))}" for p, c in hs["threads"].items())
                print(f"| {r} | {cond} | {thr} | " + " | ".join(cells) + " |")
    return rows


# -- suite mode ----------------------------------------------------------------------------
def suite_mode(a, model: str) -> list[dict]:
    rows = []
    for r in range(a.rounds):
        for cond in rotate(a.conditions.split(","), r):
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"] + (
                ["--slow"] if a.slow else [])
            with condition(cond):
                t0 = time.perf_counter()
                out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
                wall = time.perf_counter() - t0
            tail = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
            rows.append({"round": r, "condition": cond, "wall_s": wall, "rc": out.returncode,
                         "summary": tail, "command": " ".join(cmd[2:])})
            print(f"r{r} {cond:9} {wall / 60:6.1f} min rc={out.returncode} {tail}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("engine", "cli", "llama.cpp", "suite"), default="engine")
    ap.add_argument("--model", default=None)
    ap.add_argument("--docs", nargs="+", default=[str(DEFAULT_DOC)])
    ap.add_argument("--anchor", action="store_true", help="engine: the anchor tool's prompts")
    ap.add_argument("--prompt-tokens", type=int, default=5000)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None, help="ours: --threads (default auto); "
                    "llama.cpp mode: both (default 2)")
    ap.add_argument("--variants", default=None)
    ap.add_argument("--conditions", default="quiet")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--pp", type=int, default=2048)
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cache", default=None, help="llama.cpp: the build cache (default "
                    "$HISPARSE_BENCH_CACHE, else ~/.cache/hisparse-bench)")
    ap.add_argument("--version", default=None, help="llama.cpp: the llama-cpp-python sdist "
                    "version (default: the newest cached, else PyPI's newest)")
    ap.add_argument("--build-only", action="store_true",
                    help="llama.cpp: build llama-bench (cached) and stop")
    ap.add_argument("--peer-only", action="store_true", help="llama.cpp: one llama-bench call "
                    "(--threads, default 2, --pp, --tg, --reps), its JSON printed")
    ap.add_argument("--slow", action="store_true")
    ap.add_argument("--before", default=None, help="cli: a tree (e.g. a worktree of the "
                    "previous commit) whose `hisparse summarize` the variant `before` runs")
    ap.add_argument("--json", default=None)
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._child:
        spec = json.loads(a._child)
        if spec["variant"] == "pp_tg":
            res = engine_pp_tg(spec["model"], spec["threads"], spec["pp"], spec["tg"])
        else:
            res = run_variant(spec["variant"], spec["model"], spec["ids"], spec["new"],
                              spec["threads"])
        print(json.dumps(res))
        return
    if a.build_only or a.peer_only:  # the llama.cpp peer alone
        cache = cache_dir(a.cache)
        binary = build_llama_bench(cache, a.version)
        print(f"llama-bench: {binary}", file=sys.stderr)
        if a.peer_only:
            print(json.dumps(llama_bench(binary, default_gguf(cache), a.threads or 2, a.pp, a.tg,
                                         a.reps)))
        return
    model = a.model
    if model is None:
        from hisparse_cli.hub.resolve import resolve_model

        model = str(resolve_model(None))
    a.variants = a.variants or {"engine": "hf,dense,sparse", "cli": "default,dense,anchor"}.get(
        a.mode, "")
    if a.mode == "llama.cpp":
        a.threads = a.threads or 2
    if a.before:
        BEFORE.append(str(Path(a.before).resolve()))
    started = time.strftime("%Y-%m-%d %H:%M")
    rows = {"engine": engine_mode, "cli": cli_mode, "llama.cpp": llama_cpp_mode,
            "suite": suite_mode}[a.mode](a, model)
    if a.json:
        Path(a.json).write_text(json.dumps({"started": started, "argv": sys.argv[1:],
                                            "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
