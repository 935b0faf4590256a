"""Summary quality under sparse attention (QUALITY.md): sparse settings and the retrieval tier
against dense attention, scored by hisparse_cli.quality (attention recall, KL, top-1, ROUGE)
with bootstrap intervals over documents. One subcommand a study:

    python benchmarks/quality_sparsity.py sweep [--docs 3] [--max-tokens 2048] [--out DIR]
    python benchmarks/quality_sparsity.py policies [--docs 3] [--max-tokens 2048] [--no-rouge]
    python benchmarks/quality_sparsity.py rouge [--docs 6] [--max-tokens 2048] [--out DIR]
    python3 benchmarks/quality_sparsity.py gpu --parts .gpu_a .gpu_b --wheels .whl \
        --docs-dir .gpu_docs --out "$OUT" --time-budget 420          # on the GPU machine
    python benchmarks/quality_sparsity.py retrieval --docs @FILE --max-tokens 7168 --out DIR
    python benchmarks/quality_sparsity.py ceiling --docs @FILE --max-tokens 7168 --out DIR
    python benchmarks/quality_sparsity.py hits --docs ../shared/eval_dev --limit 8 --out DIR
    python benchmarks/quality_sparsity.py gguf-check M.gguf CONVERTED_FOLDER

sweep, policies, rouge: CPU studies on a fixed eval_dev subset (the first --docs of SUBSET),
one model load, per-document checkpoints (a killed study resumes where it stopped), the report
written by hisparse_cli.quality. Documents are read from ../shared/eval_dev (HISPARSE_EVAL_DEV;
never copied into the repository).
  sweep     study (b): one-factor-at-a-time sweep of the sparse settings around a centre point,
            with teacher-forced fidelity and attention recall only (no generation: cheap).
            Centre: sinks 4, window 256, 64 globals (attention importance, score stride 4),
            candidate pool 64, recalibration every 128 tokens, prefill chunk 64. Each line of
            SWEEP_SPECS changes one knob. The first 3 documents, truncated to 2048 tokens.
  policies  study (a): importance policies compared at equal KV budgets, with generation
            (ROUGE vs the human references; --no-rouge: teacher-forced only) and
            teacher-forced fidelity/attention recall. Policies: uniform (evenly spaced, the
            naive baseline), attention (mass received while in the window, H2O-like), snapkv
            (observation-window scoring), probe (the shipped learned probe). Budgets: window
            256 + 64 globals (~23% of dense KV at 2K tokens) and window 128 + 32 globals
            (~12%). The first 3 documents, truncated to 2048 tokens.
  rouge     ROUGE with generation over more documents: dense vs the default sparse settings
            and the small-KV settings of the policy study (attention importance, and the evenly
            spaced baseline at the smallest budget). The first 6 documents (three genres),
            truncated to 2048 tokens; 160 new tokens, greedy, the CLI's repetition control.

gpu: issue 6's missing measurement on a GPU: the embedded SmolLM2-135M-Instruct at (almost) its
full 8,192 positions, dense vs sparse settings at ~10 % and ~6 % of the dense KV memory
(attention-chosen globals, and evenly spaced ones at the smallest budget), scored by
hisparse_cli.quality: ΔROUGE-L vs dense with a paired interval, attention recall, top-1
agreement / KL, KV bytes. Self-contained for a bare GPU machine that receives only the
working tree (+ carried ignored folders):

  1. extracts the wheels of --wheels into a private folder appended to sys.path (packages the
     machine already has win; gguf/accelerate for the conversion, rouge-score & co for ROUGE);
  2. reassembles the GGUF from the `gguf.part.*` files of the --parts folders (sha256 checked
     when a `gguf.sha256` lies beside them) and converts it with hisparse's own converter;
  3. loads the engine (cuda: float16 weights + float16 KV, the product's GPU path; a smoke
     test compares the Triton attention with the torch reference and falls back to the
     reference if it fails), then evaluates documents in a fixed genre-interleaved order
     until --time-budget (seconds since start) would be exceeded by one more document;
  4. writes report.md / report.json (+ rows/<doc>.json per document as it goes) to --out.

    python3 benchmarks/quality_sparsity.py gpu --parts .gpu_a .gpu_b --wheels .whl \
        --docs-dir .gpu_docs --out "$OUT" --time-budget 420          # on the GPU machine
    python benchmarks/quality_sparsity.py gpu --parts ../main/.gpu_a ../main/.gpu_b --wheels \
        ../main/.whl --docs-dir ../shared/eval_dev --out /tmp/qg --docs 2 --max-tokens 1024
    python benchmarks/quality_sparsity.py gpu --rescore OUT_DIR --docs-dir ../shared/eval_dev
        # ROUGE recomputed here from the summaries in OUT_DIR/report.json (when the device
        # run had no rouge-score); the report is rewritten in place

retrieval: the retrieval tier vs eviction-only at the same resident KV, on CPU (QUALITY.md,
issue 41).

    HISPARSE_HOME=/work/hh chrt -i 0 python benchmarks/quality_sparsity.py retrieval \
        --docs @/work/qual/docs.txt --max-tokens 7168 --out /tmp/retrieval_q [--no-rouge] \
        [--limit N]

Runs `hisparse eval` one document at a time (a document's finished report is kept when a later
one is interrupted; a document already done is skipped on a rerun), then pools every
document's rows into one summary: means with 95% bootstrap intervals over documents, ΔROUGE-L
as paired intervals against dense (hisparse_cli/quality/aggregate.py), and prints the table
QUALITY.md quotes. Settings (SmolLM2-135M, fp32 KV, 7168 tokens; resident KV counted as
blocks at their peak + global/candidate/page-cache slots + page summaries):
  retrieval:      window=192,globals=16,chunk=64,retrieval_tokens=256
  eviction-only:  window=512,globals=32,chunk=64   (about the same resident KV)
ROUGE and recall do not depend on timing, so SCHED_IDLE (contended) runs are fine.

ceiling: the best attention recall any selection can reach at a resident budget (QUALITY.md,
issue 41). One dense teacher-forced run a document (the eval's layout: the same 64 recall
positions), then per layer, from the dense softmax at those positions
(hisparse_cli/quality/metrics.py: recall_ceiling), for resident budgets T = --fractions of the
tokens: window-only (sinks + the last T - sinks tokens), the token oracle (each query head's
own best T - sinks keys besides the sinks: no selection of T keys per head does better), and
the page oracle (sinks + a window of W, then the best (T - sinks - W) / 16 aligned 16-token
pages per KV head for this very query, shared by its query heads: the most a page-retrieval
tier of that budget can reach). Resident KV here counts keys only (no prefill chunk, no
summaries), so the ceilings are generous. One JSON a document in --out (resumable); the pooled
table has 95 % bootstrap intervals over documents.

gguf-check: checks `gpu`'s plan B against hisparse's converter. Plan B (`gpu --converter
plain`, or when hisparse's converter, transformers' GGUF reader, fails on the GPU machine's
transformers): dequantize a Llama-family GGUF with the `gguf` package alone and write float16
safetensors beside the config/tokenizer files of a folder that the converter produced
elsewhere (`meta_dir`: config.json, tokenizer*.json, ...):

    convert_plain(Path("m.gguf"), Path("meta"), Path("/tmp/smollm2"))

llama.cpp stores q/k projections with their rotary halves interleaved per head; they are
permuted back exactly as transformers does (`reverse_permute_weights`). gguf-check compares
the GGUF's tensors read this way with the converter's own output (CONVERTED_FOLDER): tensor
for tensor equal after the float16 cast.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import traceback
import zipfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START = time.monotonic()


# -- sweep, policies, rouge: the CPU studies ----------------------------------------------------
EVAL_DEV = Path(os.environ.get("HISPARSE_EVAL_DEV", ROOT.parent / "shared" / "eval_dev"))
# Long documents from three genres; the first k of this list form a study's subset.
SUBSET = ["sci_scisummnet/D09-1030", "med_plos/journal.pbio.1001315",
          "gov_report/govreport-01", "sci_scisummnet/A00-2034", "med_plos/journal.pcbi.1004079",
          "gov_report/govreport-02", "sci_scisummnet/C04-1197", "med_plos/journal.pcbi.1001083"]
SWEEP_CENTRE = "s4-w256-g64-k64-r128-c64"  # sweep: each line below changes one knob of it
SWEEP_SPECS = ["dense", SWEEP_CENTRE,
               "s4-w128-g64-k64-r128-c64", "s4-w512-g64-k64-r128-c64", "s4-w1024-g64-k64-r128-c64",
               "s4-w256-g0-k0-r128-c64", "s4-w256-g16-k16-r128-c64", "s4-w256-g256-k256-r128-c64",
               "s4-w256-g64-k64-r32-c64", "s4-w256-g64-k64-r512-c64",
               "s4-w256-g64-k16-r128-c64", "s4-w256-g64-k256-r128-c64",
               "s0-w256-g64-k64-r128-c64", "s16-w256-g64-k64-r128-c64",
               "s4-w256-g64-k64-r128-c64-t1"]
POLICY_SPECS = ["dense"] + [f"{b}-{p}" for b in ("s4-w256-g64-r128-c64", "s4-w128-g32-r128-c64")
                            for p in ("uniform", "attention", "snapkv", "probe")]
ROUGE_SPECS = ["dense", "s4-w1024-g64-r256-c256-attention", "s4-w256-g64-r128-c64-attention",
               "s4-w128-g32-r128-c64-attention", "s4-w128-g32-r128-c64-uniform"]


def add_study_args(p: argparse.ArgumentParser, docs: int, max_tokens: int, out: str) -> None:
    """The options every CPU study takes (its defaults: documents, tokens, report folder)."""
    p.add_argument("--model", default="/tmp/smollm2" if Path("/tmp/smollm2").is_dir() else None)
    p.add_argument("--docs", type=int, default=docs, help="first N documents of SUBSET")
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--out", default=out, help="report folder (checkpoints inside)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", nargs="*", help="evaluate only these setting names (+ dense)")


def run_study(args, specs: list[str], *, rouge: bool, max_new_tokens: int = 160,
              title: str = "") -> None:
    import torch

    from hisparse_cli.engine import Engine, SparseConfig
    from hisparse_cli.hub import resolve_model
    from hisparse_cli.quality.dataset import LayoutConfig, load_eval_documents
    from hisparse_cli.quality.harness import EvalResult, HarnessConfig, evaluate
    from hisparse_cli.quality.report import summary_table, write_report
    from hisparse_cli.quality.aggregate import summarize_settings
    from hisparse_cli.quality.settings import parse_settings

    torch.set_num_threads(args.threads)
    if args.only:
        specs = [s for s in specs if s in args.only or s == "dense"]
    base = SparseConfig()  # built-in defaults (= the cpu profile's values)
    settings = parse_settings(specs, base)
    model = Path(resolve_model(args.model))
    eng = Engine.from_pretrained(model, sparse=SparseConfig.dense_config())
    docs = load_eval_documents([EVAL_DEV / f"{d}.txt" for d in SUBSET[: args.docs]])
    cfg = HarnessConfig(layout=LayoutConfig(max_tokens=args.max_tokens), rouge=rouge,
                        max_new_tokens=max_new_tokens)
    out = Path(args.out)
    (out / "rows").mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    started = time.perf_counter()
    for doc in docs:
        ck = out / "rows" / (doc.id.replace("/", "_") + ".json")
        done = json.loads(ck.read_text()) if ck.is_file() else []
        have = {r["setting"] for r in done}
        todo = [s for s in settings if s.name not in have]
        if todo and todo[0].name != "dense":
            todo = [settings[0]] + todo  # the oracle is recomputed; its row is kept once
        if todo:
            def prog(what, i, n, _d=doc.id):
                print(f"[{time.strftime('%H:%M:%S')}] {what} ({i}/{n})", file=sys.stderr, flush=True)
            res = evaluate(eng, [doc], todo, cfg, progress=prog)
            done += [r for r in res.rows if r["setting"] not in have]
            ck.write_text(json.dumps(done, default=str))
        rows += [r for r in done if r["setting"] in {s.name for s in settings}]
    result = EvalResult(settings=settings, rows=rows, config=cfg)
    result.meta = {"study": title, "date": time.strftime("%Y-%m-%d %H:%M"),
                   "model": model.name, "machine": f"{platform.machine()}, "
                   f"{os.cpu_count()} CPUs (shared), torch {torch.__version__}, "
                   f"{args.threads} threads, float32", "documents": [d.id for d in docs],
                   "command": "python " + " ".join(sys.argv),
                   "wall_seconds_this_invocation": round(time.perf_counter() - started)}
    write_report(result, out)
    print(summary_table(summarize_settings(result)))

def sweep(a) -> None:
    run_study(a, SWEEP_SPECS, rouge=False, title="sweep (b)")


def policies(a) -> None:
    run_study(a, POLICY_SPECS, rouge=not a.no_rouge, title="policies (a)")


def rouge(a) -> None:
    run_study(a, ROUGE_SPECS, rouge=True, title="ROUGE over 6 documents")


# -- gpu: the embedded model at 8K tokens on a bare GPU machine ------------------------------------
# Documents that fill 8K tokens (legal_tldr has none: its documents are 300-1,300 tokens),
# genres interleaved so that any prefix covers scientific, medical and government text.
GPU_ORDER = ["sci_scisummnet/D07-1104", "med_plos/journal.pbio.1001315", "gov_report/govreport-03",
         "sci_scisummnet/D10-1115", "med_plos/journal.pcbi.1001083", "sci_scisummnet/J00-4003",
         "med_plos/journal.pbio.0040088", "med_plos/journal.pbio.1001199",
         "med_plos/journal.pcbi.1000112", "med_plos/journal.pcbi.1001051",
         "med_plos/journal.pcbi.1003292", "med_plos/journal.pbio.0020334",
         "med_plos/journal.pbio.1001473", "med_plos/journal.pcbi.1002484",
         "med_plos/journal.pcbi.1004082"]
# KV % of dense at 7,904 tokens (host bookkeeping, block 16): 9.9, 9.1, 5.9, 5.9.
GPU_SETTINGS = ["dense", "s4-w512-g96-r128-c64-attention", "s4-w256-g192-r64-c64-attention",
            "s4-w256-g64-r64-c64-attention", "s4-w256-g64-r64-c64-uniform"]


def log(msg: str) -> None:
    print(f"[{time.monotonic() - START:6.1f}s] {msg}", file=sys.stderr, flush=True)


def install_wheels(folder: Path, site: Path) -> list[str]:
    """Unzip every wheel of `folder` into `site` (appended to sys.path: installed packages win)."""
    names = []
    for whl in sorted(folder.glob("*.whl")):
        with zipfile.ZipFile(whl) as z:
            z.extractall(site)
        names.append(whl.name)
    if str(site) not in sys.path:
        sys.path.append(str(site))
    import importlib

    importlib.invalidate_caches()
    return names


def assemble_gguf(parts: list[str], dest: Path) -> Path:
    files = []
    for d in parts:
        found = sorted(glob.glob(os.path.join(d, "gguf.part.*")))
        if not found:  # on the device: the first call's carried folder did not survive
            raise SystemExit(f"{d}: no gguf.part.* files (was it carried / kept between calls?)")
        files += found
    h = hashlib.sha256()
    with open(dest, "wb") as out:
        for f in files:
            data = Path(f).read_bytes()
            h.update(data)
            out.write(data)
    sums = [Path(d) / "gguf.sha256" for d in parts if (Path(d) / "gguf.sha256").is_file()]
    if sums and sums[0].read_text().split()[0] != h.hexdigest():
        raise SystemExit(f"reassembled GGUF sha256 {h.hexdigest()} != {sums[0].read_text()}")
    log(f"GGUF reassembled from {len(files)} parts: {dest.stat().st_size:,} bytes, "
        f"sha256 {h.hexdigest()[:16]}… ({'checked' if sums else 'unchecked'})")
    return dest


def convert(gguf: Path, dest: Path) -> Path:
    from hisparse_cli.hub.convert import convert_gguf

    return convert_gguf(gguf, dest, reporter=None, source={
        "kind": "gguf-file", "file": gguf.name, "member": "SmolLM2-135M-Instruct.Q4_1.gguf"})


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for dist in ("torch", "triton", "transformers", "tokenizers", "gguf", "accelerate",
                 "rouge-score", "nltk", "numpy"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = "absent"
    return out


def rouge_available() -> str | None:
    """None when hisparse_cli.scoring works here, else why not."""
    try:
        from hisparse_cli.scoring import rouge_scores

        rouge_scores("the cat sat on the mat.", "a cat sat.")
        return None
    except Exception as exc:  # noqa: BLE001 - any failure: ROUGE is recomputed later
        return f"{type(exc).__name__}: {exc}"


def load_engine(model: Path, device: str, dtype_name: str):
    import torch

    from hisparse_cli.engine import Engine, SparseConfig

    dtype = getattr(torch, dtype_name)
    return Engine.from_pretrained(model, device=device, dtype=dtype,
                                  sparse=SparseConfig.dense_config(), kv_dtype=dtype)


def smoke_backend(eng, ids: list[int], force: bool = False) -> dict:
    """Logits of a sparse run with the engine's backend vs the torch reference (CUDA only).
    Switches the engine to the reference when the fast backend fails or disagrees."""
    import copy

    import torch

    from hisparse_cli.kernels.dispatch import select_backend
    from hisparse_cli.quality.capture import engine_with
    from hisparse_cli.quality.settings import parse_setting

    info = {"backend": eng.backend.attention}
    if eng.device.type != "cuda" and not force:
        return info
    sparse = parse_setting("s4-w64-g16-r32-c32-attention").sparse
    ref = copy.copy(engine_with(eng, sparse))
    ref.backend = select_backend(eng.device.type, "torch")
    want = ref.logits(ids)
    try:
        got = engine_with(eng, sparse).logits(ids)
        err = float((got - want).abs().max())
        agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
        info.update(smoke_max_abs_logit_err=err, smoke_argmax_agreement=agree,
                    smoke_finite=bool(torch.isfinite(got).all()))
        if not (torch.isfinite(got).all() and agree >= 0.8):  # fp16 ties may move a global
            raise RuntimeError(f"fast backend disagrees: max err {err}, argmax agree {agree}")
    except Exception as exc:  # noqa: BLE001 - measured on the reference rather than not at all
        eng.backend = ref.backend
        info.update(backend="torch", backend_fallback=f"{type(exc).__name__}: {exc}")
    info["reference_finite"] = bool(torch.isfinite(want).all())
    return info


def pick_documents(docs_dir: Path, limit: int | None):
    from hisparse_cli.quality.dataset import load_eval_documents

    ids = [d for d in GPU_ORDER if (docs_dir / f"{d}.txt").is_file()]
    missing = [d for d in GPU_ORDER if d not in ids]
    if missing:
        log(f"missing documents (skipped): {missing}")
    ids = ids[:limit] if limit else ids
    docs = load_eval_documents([docs_dir / f"{d}.txt" for d in ids])
    # load_eval_documents names a document by its stem; keep the genre folder in the id
    return [replace(d, id=i) for d, i in zip(docs, ids)]


def write(result, out: Path, settings) -> None:
    from hisparse_cli.quality.aggregate import summarize_settings
    from hisparse_cli.quality.report import summary_table, write_report

    write_report(result, out)
    table = summary_table(summarize_settings(result))
    print(table)
    log(f"report written to {out} ({len({r['doc'] for r in result.rows})} documents)")


def gpu_run(args) -> None:
    import torch

    from hisparse_cli.engine import SparseConfig
    from hisparse_cli.quality.harness import EvalResult, HarnessConfig, evaluate
    from hisparse_cli.quality.dataset import LayoutConfig
    from hisparse_cli.quality.settings import parse_settings

    out = Path(args.out or os.environ.get("OUT") or "/tmp/quality_gpu")
    (out / "rows").mkdir(parents=True, exist_ok=True)
    meta: dict = {"study": "issue 6: quality under sparsity on the GPU at 8K tokens",
                  "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
                  "time_budget_s": args.time_budget}
    if args.wheels:
        meta["wheels"] = install_wheels(Path(args.wheels), Path(args.site))
        log(f"{len(meta['wheels'])} wheels extracted into {args.site}")
    meta["versions"] = versions()
    if args.model:
        model = Path(args.model).expanduser()
    else:
        gguf = assemble_gguf(args.parts, Path(args.gguf_tmp))
        model = None
        if args.converter == "hisparse":
            try:
                model = convert(gguf, Path(args.convert_to))
                meta["converter"] = "hisparse_cli.hub.convert (transformers' GGUF reader)"
            except Exception as exc:  # noqa: BLE001 - plan B below, same weights
                log(f"hisparse converter failed ({type(exc).__name__}: {exc}); plan B")
                meta["converter_error"] = f"{type(exc).__name__}: {exc}"
        if model is None:
            meta_dir = next((Path(d) / "model_meta" for d in args.parts
                             if (Path(d) / "model_meta" / "config.json").is_file()), None)
            if meta_dir is None:
                raise SystemExit("plan B needs model_meta/ (config + tokenizer) in a --parts folder")
            model = convert_plain(gguf, meta_dir, Path(args.convert_to + "_plain"))
            meta["converter"] = ("benchmarks/quality_sparsity.py convert_plain (gguf dequantize + "
                                 "carried tokenizer)")
        log(f"converted to {model} by {meta['converter']}")
    device = args.device if args.device != "auto" else (
        "cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("float16" if device == "cuda" else "float32")
    if device == "cpu":
        torch.set_num_threads(args.threads)
    no_rouge = rouge_available()
    if no_rouge:
        log(f"ROUGE unavailable here ({no_rouge}): summaries are kept, ROUGE is set to 0 and "
            "must be recomputed with --rescore")
        import hisparse_cli.scoring as scoring

        scoring.rouge_scores = lambda s, r: {t: 0.0 for t in scoring.ROUGE_TYPES}
    meta["rouge"] = "computed on this machine" if not no_rouge else f"NOT computed: {no_rouge}"
    eng = load_engine(model, device, dtype)
    log(f"engine on {device} ({dtype}), backend {eng.backend.attention}")
    docs = pick_documents(Path(args.docs_dir), args.docs)
    meta.update(device=device, dtype=dtype, model=model.name,
                machine=f"{platform.machine()}, {os.cpu_count()} CPUs")
    if device == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(0)
    check = smoke_backend(eng, eng.tokenizer(docs[0].text)["input_ids"][:512])
    meta.update(check)
    log(f"backend check: {check}; versions: {meta['versions']}")
    settings = parse_settings(args.settings, SparseConfig())
    cfg = HarnessConfig(layout=LayoutConfig(max_tokens=args.max_tokens),
                        max_new_tokens=args.max_new_tokens)
    rows: list[dict] = []
    per_doc: dict[str, float] = {}
    skipped: list[str] = []
    failed: dict[str, str] = {}
    meta["setup_seconds"] = round(time.monotonic() - START, 1)
    try:
        for doc in docs:
            elapsed = time.monotonic() - START
            guess = 1.25 * max(per_doc.values()) if per_doc else 0.0
            if elapsed > args.time_budget or (per_doc and elapsed + guess > args.time_budget):
                skipped.append(doc.id)
                continue
            t0 = time.monotonic()

            def prog(what, i, n):
                log(f"{what} ({i}/{n})")

            try:
                res = evaluate(eng, [doc], settings, cfg, progress=prog)
            except Exception as exc:  # noqa: BLE001 - one document must not sink the study
                failed[doc.id] = f"{type(exc).__name__}: {exc}"
                log(f"{doc.id} FAILED: {traceback.format_exc()}")
                continue
            per_doc[doc.id] = round(time.monotonic() - t0, 1)
            rows += res.rows
            (out / "rows" / (doc.id.replace("/", "_") + ".json")).write_text(
                json.dumps(res.rows, default=str))
            log(f"{doc.id} done in {per_doc[doc.id]} s")
    finally:
        meta.update(documents=list(per_doc), seconds_per_document=per_doc,
                    skipped_for_time=skipped, failed=failed,
                    wall_seconds=round(time.monotonic() - START, 1),
                    max_tokens=args.max_tokens, backend_used=eng.backend.attention)
        if device == "cuda":
            meta["cuda_max_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
        if rows:
            write(EvalResult(settings=settings, rows=rows, config=cfg, meta=meta), out, settings)
        else:
            (out / "report.json").write_text(json.dumps({"meta": meta}, indent=2, default=str))
            log("no document finished: only meta written")


def gpu_rescore(args) -> None:
    """Recompute ROUGE from the summaries of a finished run and rewrite its report."""
    from hisparse_cli.engine import SparseConfig
    from hisparse_cli.quality.dataset import LayoutConfig
    from hisparse_cli.quality.harness import EvalResult, HarnessConfig
    from hisparse_cli.quality.settings import NamedSetting
    from hisparse_cli.scoring import rouge_scores

    src = Path(args.rescore)
    doc = json.loads((src / "report.json").read_text(encoding="utf-8"))
    c = dict(doc["config"])
    c["layout"] = LayoutConfig(**c["layout"])
    cfg = HarnessConfig(**c)
    settings = [NamedSetting(s["name"], SparseConfig(**s["sparse"])) for s in doc["settings"]]
    docs_dir = Path(args.docs_dir)
    for row in doc["rows"]:
        if "summary" in row:
            ref = (docs_dir / f"{row['doc']}.ref.txt").read_text(encoding="utf-8-sig")
            row["rouge"] = rouge_scores(row["summary"], ref)
    meta = dict(doc["meta"])
    meta["rouge"] = f"recomputed by --rescore on {platform.node()} {time.strftime('%Y-%m-%d %H:%M')}"
    out = Path(args.out) if args.out else src
    write(EvalResult(settings=settings, rows=doc["rows"], config=cfg, meta=meta), out, settings)


def gpu(args) -> None:
    gpu_rescore(args) if args.rescore else gpu_run(args)


# -- gguf-check: plan B's converter -------------------------------------------------------------
NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
         "output.weight": "lm_head.weight"}
LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
         "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj"}
META_FILES = ("config.json", "generation_config.json", "special_tokens_map.json",
              "tokenizer.json", "tokenizer_config.json", "hisparse.json")


def hf_name(name: str) -> str:
    if name in NAMES:
        return NAMES[name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if not m or m.group(2) not in LAYER:
        raise ValueError(f"unknown GGUF tensor {name}")
    return f"model.layers.{m.group(1)}.{LAYER[m.group(2)]}.{m.group(3)}"


def reverse_permute(w, n_head: int):
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def read_state_dict(gguf_path: Path) -> dict:
    import numpy as np
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(gguf_path))
    arch = reader.get_field("general.architecture").contents()
    n_head = int(reader.get_field(f"{arch}.attention.head_count").contents())
    n_kv = int(reader.get_field(f"{arch}.attention.head_count_kv").contents())
    out = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape(tuple(int(x) for x in reversed(t.shape)))  # GGUF shapes are [in, out]
        if t.name.endswith("attn_q.weight"):
            w = reverse_permute(w, n_head)
        elif t.name.endswith("attn_k.weight"):
            w = reverse_permute(w, n_kv)
        out[hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(w)).to(torch.float16)
    return out


def convert_plain(gguf_path: Path, meta_dir: Path, dest: Path) -> Path:
    from safetensors.torch import save_file

    dest.mkdir(parents=True, exist_ok=True)
    save_file(read_state_dict(gguf_path), str(dest / "model.safetensors"), metadata={"format": "pt"})
    for name in META_FILES:
        if (meta_dir / name).is_file():
            shutil.copy(meta_dir / name, dest / name)
    return dest


def gguf_check(a) -> None:
    from safetensors.torch import load_file

    ours, ref = read_state_dict(Path(a.gguf)), load_file(f"{a.converted}/model.safetensors")
    assert set(ours) == set(ref), set(ours) ^ set(ref)
    bad = [k for k in ref if not bool((ours[k] == ref[k]).all())]
    print(f"{len(ref)} tensors, {len(bad)} differ: {bad[:5]}")


# -- document lists of the retrieval, ceiling and hits studies ----------------------------------
def _doc_paths(spec: str) -> list[Path]:
    """--docs: @FILE (one path a line) or a folder (every *.txt below but the references)."""
    if spec.startswith("@"):
        return [Path(x) for x in Path(spec[1:]).read_text().split() if x]
    return sorted(p for p in Path(spec).rglob("*.txt") if not p.name.endswith(".ref.txt"))


def _round_robin(items: list, genre) -> list:
    """items in turn over their genres (genre(item)): a --limit run mixes them."""
    by_genre: dict[str, list] = {}
    for x in items:
        by_genre.setdefault(genre(x), []).append(x)
    return [g[i] for i in range(max(map(len, by_genre.values()), default=0))
            for g in by_genre.values() if i < len(g)]


def _doc_args(p, max_tokens: int) -> None:
    p.add_argument("--docs", required=True, help="@FILE (one path a line) or a folder")
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--min-tokens", type=int, default=4096,
                   help="only documents at least this long (tokens after truncation)")
    p.add_argument("--out", type=Path, required=True)


# -- retrieval: the retrieval tier vs eviction-only at the same resident KV --------------------
RETRIEVAL = "window=192,globals=16,chunk=64,retrieval_tokens=256"
EVICTION = "window=512,globals=32,chunk=64"


def retrieval(a) -> None:
    docs = _round_robin(_doc_paths(a.docs), lambda d: d.parent.name)
    if a.limit:
        docs = docs[:a.limit]
    rows, meta = [], None
    for doc in docs:
        out = a.out / doc.stem
        report = out / "report.json"
        if not report.exists():
            cmd = [str(Path(sys.executable).parent / "hisparse"), "eval", str(doc), "--profile", "cpu",
                   "--max-tokens", str(a.max_tokens), "--out", str(out), "--quiet", "--json",
                   "-s", "dense", *[x for s in a.settings for x in ("-s", s)]]
            if a.no_rouge:
                cmd.append("--no-rouge")
            print(f"# {doc.stem}", file=sys.stderr, flush=True)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        data = json.loads(report.read_text())
        rows += [r for r in data["rows"] if r.get("tokens", 0) >= a.min_tokens]
        meta = data
    if meta is None:
        sys.exit("no documents")
    from hisparse_cli.config.settings import SparseConfig
    from hisparse_cli.quality.aggregate import summarize_settings
    from hisparse_cli.quality.harness import EvalResult, HarnessConfig
    from hisparse_cli.quality.report import summary_table
    from hisparse_cli.quality.settings import NamedSetting

    settings = [NamedSetting(s["name"], SparseConfig(**s["sparse"])) for s in meta["settings"]]
    summary = summarize_settings(EvalResult(settings=settings, rows=rows, config=HarnessConfig()))
    print(f"{len({r['doc'] for r in rows})} documents of {a.min_tokens}-{a.max_tokens} tokens "
          f"(of {len(docs)} run)")
    print(summary_table(summary))
    (a.out / "pooled.json").write_text(json.dumps(summary, indent=2, default=str))


def ceiling(a) -> None:
    import torch

    from hisparse_cli.config.settings import SparseConfig
    from hisparse_cli.engine import Engine
    from hisparse_cli.hub import resolve_model
    from hisparse_cli.quality.capture import teacher_forced
    from hisparse_cli.quality.dataset import LayoutConfig, build_layout, load_eval_documents
    from hisparse_cli.quality.metrics import attention_probs, kept_mask, recall_ceiling
    from hisparse_cli.scoring import bootstrap_ci

    paths = _doc_paths(a.docs)
    a.out.mkdir(parents=True, exist_ok=True)
    fractions = [float(x) for x in a.fractions.split(",")]
    windows = [int(x) for x in a.windows.split(",")]
    eng = None
    for doc in load_eval_documents(paths):
        f = a.out / (doc.id.replace("/", "_") + ".json")
        if f.exists():
            continue
        if eng is None:
            torch.set_num_threads(a.threads)
            eng = Engine.from_pretrained(Path(resolve_model(a.model)),
                                         sparse=SparseConfig.dense_config())
            hkv, scale = eng.cfg.num_key_value_heads, eng.cfg.head_dim ** -0.5
        ids = eng.tokenizer(doc.text, verbose=False)["input_ids"]
        lay = build_layout(ids, LayoutConfig(max_tokens=a.max_tokens))
        if len(lay.ids) < a.min_tokens:
            f.write_text(json.dumps({"doc": doc.id, "tokens": len(lay.ids), "rows": []}))
            continue
        started = time.perf_counter()
        tr = teacher_forced(eng, lay.ids, SparseConfig.dense_config(),
                            q_positions=lay.recall_positions, capture_qk=True)
        q_pos = torch.tensor(tr.q_positions)
        n = int(q_pos.max()) + 1

        def kept(window: int) -> torch.Tensor:  # [S, N]: sinks + window, the engine's rule
            return kept_mask(q_pos, n, a.sinks, window, None, 1)[:, 0]

        sink = kept(0)
        per_layer: dict[tuple, list[float]] = {}
        for layer in range(eng.cfg.num_hidden_layers):
            p = attention_probs(tr.q[layer], tr.k[layer][:n], q_pos, scale)
            for frac in fractions:
                t = int(frac * len(lay.ids))
                got = {"window-only": recall_ceiling(p, kept(t - a.sinks), 0, hkv),
                       "token oracle": recall_ceiling(p, sink, t - a.sinks, hkv)}
                for w in (w for w in windows if w + a.sinks < t):
                    got[f"page oracle, window {w}"] = recall_ceiling(
                        p, kept(w), t - a.sinks - w, hkv, page=a.page)
                for method, r in got.items():
                    per_layer.setdefault((frac, method), []).append(float(r.mean()))
        rows = [{"fraction": frac, "tokens": int(frac * len(lay.ids)), "method": m,
                 "recall": sum(v) / len(v), "recall_min_layer": min(v)}
                for (frac, m), v in per_layer.items()]
        f.write_text(json.dumps({"doc": doc.id, "tokens": len(lay.ids), "rows": rows,
                                 "seconds": round(time.perf_counter() - started, 1)}))
        print(f"# {doc.id}: {len(lay.ids)} tokens", file=sys.stderr, flush=True)
    docs = [json.loads(f.read_text()) for f in sorted(a.out.glob("*.json")) if f.name != "pooled.json"]
    docs = [d for d in docs if d["rows"]]
    if not docs:
        sys.exit("no documents")
    pooled: dict[tuple, list[float]] = {}
    for d in docs:
        for r in d["rows"]:
            pooled.setdefault((r["fraction"], r["method"]), []).append(r["recall"])
    print(f"{len(docs)} documents of {min(d['tokens'] for d in docs)}-"
          f"{max(d['tokens'] for d in docs)} tokens; mean attention recall over layers, query "
          f"heads and the 64 recall positions; 95 % bootstrap over documents")
    print("| resident (share of the tokens) | method | recall | documents |\n|---|---|---|---:|")
    table = []
    for (frac, method), v in sorted(pooled.items()):
        mean, lo, hi = bootstrap_ci(v, n_resamples=2000)
        table.append({"fraction": frac, "method": method, "mean": mean, "lo": lo, "hi": hi,
                      "n": len(v)})
        print(f"| {frac:.0%} | {method} | {mean:.3f} [{lo:.3f}, {hi:.3f}] | {len(v)} |")
    (a.out / "pooled.json").write_text(json.dumps(table, indent=1))


def hits(a) -> None:
    """The page cache's hit rate with a real model's queries (the GPU benchmark's random weights
    give random queries): one greedy generate a document and page-cache size, prefill and
    decode rates apart, 95 % bootstrap over documents."""
    import torch

    from hisparse_cli.config.settings import SparseConfig
    from hisparse_cli.engine import Engine
    from hisparse_cli.hub import resolve_model
    from hisparse_cli.quality.dataset import load_eval_documents
    from hisparse_cli.scoring import bootstrap_ci

    torch.set_num_threads(a.threads)
    eng = Engine.from_pretrained(Path(resolve_model("default")))
    base = dict(sink_tokens=4, window_size=a.window, global_tokens=32, block_size=16,
                prefill_chunk=128, retrieval_tokens=a.retrieval_tokens)
    docs = _round_robin(load_eval_documents(_doc_paths(a.docs)), lambda d: d.id.split("/")[0])
    rows = []
    for doc in docs:
        ids = eng.tokenizer(doc.text, verbose=False)["input_ids"][:a.max_tokens]
        if len(ids) < a.min_tokens:
            continue
        for mult in (1, 2):
            eng.sparse = SparseConfig(**base, page_cache_tokens=mult * a.retrieval_tokens)
            s = eng.generate(ids, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens).stats
            rows.append({"doc": doc.id, "tokens": len(ids), "page_cache": mult,
                         "hit_rate": s.cache_hit_rate, "decode_hit_rate": s.decode_cache_hit_rate})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        if len({r["doc"] for r in rows}) >= a.limit:
            break
    print(f"{len({r['doc'] for r in rows})} documents of {a.min_tokens}-{a.max_tokens} tokens; "
          f"window {a.window}, {a.retrieval_tokens} retrieval tokens, {a.new_tokens} new tokens")
    print("| page cache | hit rate, whole run | hit rate, decode |\n|---|---|---|")
    table = []
    for mult in (1, 2):
        got = [r for r in rows if r["page_cache"] == mult]
        cells = [bootstrap_ci([r[k] for r in got], n_resamples=2000)
                 for k in ("hit_rate", "decode_hit_rate")]
        table.append({"page_cache": mult, "hit_rate": cells[0], "decode_hit_rate": cells[1]})
        print(f"| {mult}x retrieval tokens | " + " | ".join(
            f"{m:.3f} [{lo:.3f}, {hi:.3f}]" for m, lo, hi in cells) + " |")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "hits.json").write_text(json.dumps({"rows": rows, "table": table}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("sweep", help="study (b): one-factor sweep around a centre point")
    add_study_args(p, docs=3, max_tokens=2048, out="/tmp/quality_sweep")
    p.set_defaults(run=sweep)
    p = sub.add_parser("policies", help="study (a): importance policies at equal KV")
    add_study_args(p, docs=3, max_tokens=2048, out="/tmp/quality_policies")
    p.add_argument("--no-rouge", action="store_true",
                   help="teacher-forced fidelity only (documents already checkpointed with "
                        "summaries keep them)")
    p.set_defaults(run=policies)
    p = sub.add_parser("rouge", help="ROUGE with generation: dense vs default and small-KV")
    add_study_args(p, docs=6, max_tokens=2048, out="/tmp/quality_rouge")
    p.set_defaults(run=rouge)
    p = sub.add_parser("gpu", help="the embedded model at 8K tokens on a GPU (self-contained)")
    p.add_argument("--parts", nargs="*", default=[".gpu_a", ".gpu_b"],
                   help="folders holding gguf.part.* (concatenated in this order)")
    p.add_argument("--model", help="an already converted model folder (skips the GGUF steps)")
    p.add_argument("--wheels", help="folder of wheels to extract (none: use what is installed)")
    p.add_argument("--site", default="/tmp/hisparse_site")
    p.add_argument("--gguf-tmp", default="/tmp/m.gguf")
    p.add_argument("--convert-to", default="/tmp/smollm2")
    p.add_argument("--converter", default="hisparse", choices=["hisparse", "plain"],
                   help="plain: skip hisparse's converter, use convert_plain (gguf-check's)")
    p.add_argument("--docs-dir", default=str(ROOT.parent / "shared" / "eval_dev"))
    p.add_argument("--docs", type=int, help="at most this many documents of GPU_ORDER")
    p.add_argument("--out", help="report folder [default: $OUT, else /tmp/quality_gpu; "
                   "with --rescore: the folder rescored]")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"],
                   help="weights and KV [default: float16 on cuda, float32 on cpu]")
    p.add_argument("--max-tokens", type=int, default=7904,
                   help="tokens per document: 8,192 positions - 160 new - prompt - margin")
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--settings", nargs="+", default=GPU_SETTINGS)
    p.add_argument("--time-budget", type=float, default=420.0,
                   help="seconds since start after which no new document is started")
    p.add_argument("--threads", type=int, default=2, help="torch threads on the CPU")
    p.add_argument("--rescore", metavar="DIR", help="recompute ROUGE of a finished run")
    p.set_defaults(run=gpu)
    p = sub.add_parser("retrieval", help="the retrieval tier vs eviction-only at the same "
                       "resident KV (CPU, one hisparse eval a document)")
    _doc_args(p, 7168)
    p.add_argument("--no-rouge", action="store_true")
    p.add_argument("--limit", type=int, default=0, help="first N documents only")
    p.add_argument("--settings", nargs="*", default=[EVICTION, RETRIEVAL])
    p.set_defaults(run=retrieval)
    p = sub.add_parser("ceiling", help="the best recall any selection reaches at a resident "
                       "budget: window-only, token and page oracles (CPU)")
    _doc_args(p, 7168)
    p.add_argument("--model", default="default")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--fractions", default="0.05,0.08,0.10,0.15,0.25",
                   help="resident budgets as shares of the document's tokens")
    p.add_argument("--windows", default="64,128,256", help="the page oracle's windows")
    p.add_argument("--page", type=int, default=16, help="page (KV block) size in tokens")
    p.add_argument("--sinks", type=int, default=4)
    p.set_defaults(run=ceiling)
    p = sub.add_parser("hits", help="the page cache's hit rate with the real model's queries "
                       "(prefill and decode; page cache 1x and 2x the retrieval tokens)")
    _doc_args(p, 6000)
    p.add_argument("--limit", type=int, default=8, help="documents to measure")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--retrieval-tokens", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=2)
    p.set_defaults(run=hits)
    p = sub.add_parser("gguf-check", help="gpu's plan-B converter against hisparse's output")
    p.add_argument("gguf", help="the GGUF file")
    p.add_argument("converted", help="a folder hisparse's converter wrote from it")
    p.set_defaults(run=gguf_check)
    a = ap.parse_args()
    a.run(a)


if __name__ == "__main__":
    main()
