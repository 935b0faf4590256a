"""`hisparse eval` (summary quality under sparsity) and `hisparse probe train`.

    hisparse eval DIR|FILES... [--settings dense --settings w1024-g64 ...] [--out DIR]
                  [--password P]
    hisparse probe train [--model M] [--out FILE|DIR] [--texts PATH ...]

eval: every document (DIR: each <id>.txt below it, with <id>.ref.txt as its reference) is
truncated to --max-tokens and evaluated under each setting (spec language:
hisparse_cli/quality/settings.py; the dense baseline is always included) against the dense
run: attention recall, teacher-forced KL / top-1 / perplexity ratio, long-range retention,
KV memory and speed, and ROUGE of generated summaries (unless --no-rouge). stdout: the
summary table (Markdown) or, with --json, one JSON object; report.md, report.json and
fidelity_vs_kv.png go to --out. Precedence: --settings specs > profile > built-in default.

probe train: --out is a .safetensors file (its .json sidecar is written beside it) or an
existing folder (<model>.probe.safetensors inside it); anything else is refused (exit 2)
before the model is loaded. A --texts file is read like a summarize document (a missing,
binary or empty one: exit 3); folders contribute their text files.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer

probe_app = typer.Typer(help="The learned importance probe (importance='probe').")


def _progress_printer(quiet: bool):
    from hisparse_cli.console import note

    def report(what: str, done: int, total: int) -> None:
        if not quiet:
            note(f"[{done}/{total}] {what}")

    return report


def _load(model: str | None, profile_name: str, quiet: bool):
    from hisparse_cli import hub as models
    from hisparse_cli.console import stderr_console, warn
    from hisparse_cli.config.profiles import load_profile
    from hisparse_cli.summarize.runtime import load_engine, model_info

    profile = load_profile(profile_name)
    path = Path(models.resolve_model(model, progress=None if quiet else stderr_console()))
    engine, plan = load_engine(path, profile, profile.sparse_config(),
                               warn=None if quiet else warn)
    return profile, path, engine, plan, model_info(path)


def eval_command(
    paths: Annotated[list[Path], typer.Argument(
        help="Documents: folders of <id>.txt (+ <id>.ref.txt) or text files.",
        show_default=False, readable=False)],
    model: Annotated[Optional[str], typer.Option("--model", "-m", help=(
        "Model: registry name, local HF folder, .gguf file.  [default: the embedded "
        "smollm2-135m-instruct]"))] = None,
    profile: Annotated[str, typer.Option("--profile", "-p", help=(
        "Hardware profile: base sparse settings (the 'profile' setting) and device."))] = "auto",
    settings: Annotated[Optional[list[str]], typer.Option("--settings", "-s", help=(
        "A setting to evaluate (repeat the flag): dense, profile, w1024-g64, "
        "w512-g32-uniform, window=1024,globals=64,importance=snapkv.  [default: dense and "
        "profile]"))] = None,
    out: Annotated[Path, typer.Option("--out", "-o", readable=False,
                                      help="Report folder.")] = Path("eval_report"),
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=64, help=(
        "Truncate every document to this many tokens."))] = 3072,
    no_rouge: Annotated[bool, typer.Option("--no-rouge", help=(
        "Skip generation and ROUGE (teacher-forced metrics only)."))] = False,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", min=1, help=(
        "Summary length limit for ROUGE."))] = 160,
    recall_queries: Annotated[int, typer.Option("--recall-queries", min=1, help=(
        "Query positions sampled for attention recall."))] = 64,
    probe: Annotated[Optional[Path], typer.Option("--probe", readable=False, help=(
        "Probe file for importance=probe settings.  [default: the shipped one]"))] = None,
    password: Annotated[Optional[str], typer.Option("--password", help=(
        "Password of encrypted PDFs."))] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress on stderr.")] = False,
) -> None:
    """Summary quality under sparsity: fidelity, attention recall and ROUGE vs dense."""
    from hisparse_cli.console import note, write_result
    from hisparse_cli.errors import InputError
    from hisparse_cli.summarize.job import document_path
    from hisparse_cli.cli.outputs import check_output_folder
    from hisparse_cli.quality.aggregate import summarize_settings
    from hisparse_cli.quality.dataset import LayoutConfig, load_eval_documents
    from hisparse_cli.quality.harness import HarnessConfig, evaluate
    from hisparse_cli.quality.probe import load_probe
    from hisparse_cli.quality.report import summary_table, write_report
    from hisparse_cli.quality.settings import parse_settings
    from hisparse_cli.config.profiles import load_profile

    base = load_profile(profile).sparse_config()
    named = parse_settings(list(settings or ["dense", "profile"]), base)  # exit 2 before loading
    out = check_output_folder(out)  # a report folder that cannot be written: before the run
    docs = load_eval_documents([document_path(p, "PATHS") for p in paths], password=password)
    scorer = load_probe(probe) if probe is not None else None
    cfg = HarnessConfig(layout=LayoutConfig(max_tokens=max_tokens, recall_queries=recall_queries),
                        rouge=not no_rouge, max_new_tokens=max_new_tokens)
    prof, model_path, engine, plan, info = _load(model, profile, quiet)
    if not quiet:
        note(f"{len(docs)} document(s) x {len(named)} setting(s) on {plan.device}, "
             f"profile {prof.name}, model {model_path.name}")
    started = time.perf_counter()
    result = evaluate(engine, docs, named, cfg, probe=scorer, progress=_progress_printer(quiet))
    engine.release_cached_state()  # the KV storage / decode graph kept between generates
    result.meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "model": info.get("name"),
                   "model_path": str(model_path), "profile": prof.name,
                   "device": plan.device, "dtype": plan.dtype,
                   "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
                   "documents": [d.id for d in docs], "seconds": round(time.perf_counter() - started, 1)}
    try:
        written, failure = write_report(result, out), None
    except OSError as exc:  # checked before the run, yet failing now: keep the results
        written, failure = {}, exc
    summary = summarize_settings(result)
    if as_json:
        write_result(json.dumps({"meta": result.meta, "summary": summary,
                                 "files": {k: str(v) for k, v in written.items()}},
                                indent=2, default=str))
    else:
        write_result(summary_table(summary))
    if failure is not None:
        raise InputError(f"cannot write the report to {out}: {failure.strerror or failure}; "
                         "the summary was printed on stdout",
                         hint="choose another --out folder (check the free disk space and "
                              "its permissions)")
    if not quiet:
        note(f"wrote {', '.join(str(p) for p in written.values())}")


def _default_texts() -> list[Path]:
    samples = Path(__file__).resolve().parents[2] / "samples"
    if samples.is_dir():
        return [samples]
    from hisparse_cli.errors import InputError

    raise InputError("no training texts: the repository's samples/ folder is not here",
                     hint="pass --texts FILE_OR_FOLDER (text we may use, not eval data)")


def _probe_target(out: Path | None) -> Callable[[str], Path]:
    """The file `probe train` writes, given the model's folder name (checked before loading)."""
    from hisparse_cli.errors import ConfigError

    if out is None:
        return lambda model: Path(f"{model}.probe.safetensors")
    out = out.expanduser()
    if out.is_dir():
        return lambda model: out / f"{model}.probe.safetensors"
    if out.exists() and not out.is_file():
        raise ConfigError(f"--out {out} is neither a file nor a folder",
                          hint="give a .safetensors path or an existing folder")
    if out.suffix != ".safetensors":
        raise ConfigError(f"--out {out}: a probe is written as a .safetensors file (with a "
                          ".json sidecar beside it)",
                          hint=f"use --out {out.with_suffix('.safetensors')}, or an existing "
                               "folder to write <model>.probe.safetensors in it")
    return lambda model: out


@probe_app.command("train")
def probe_train(
    model: Annotated[Optional[str], typer.Option("--model", "-m", help=(
        "Model to distill from.  [default: the embedded smollm2-135m-instruct]"))] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help=(
        "Output .safetensors file (a .json sidecar is written beside it), or an existing "
        "folder to write <model>.probe.safetensors in.  [default: "
        "./<model>.probe.safetensors]"))] = None,
    texts: Annotated[Optional[list[Path]], typer.Option("--texts", "-t", readable=False, help=(
        "Training documents (text or PDF, read as summarize reads them) or folders of text "
        "files (repeat).  [default: the repository's samples/]"))] = None,
    window: Annotated[int, typer.Option("--window", min=8, help=(
        "Window whose attention mass is the target."))] = 512,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=32, help=(
        "Tokens per training piece."))] = 2048,
    epochs: Annotated[int, typer.Option("--epochs", min=1)] = 40,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress on stderr.")] = False,
) -> None:
    """Train the importance probe on the model's own attention; print its sidecar JSON."""
    from hisparse_cli.console import note, write_result
    from hisparse_cli.config.settings import SparseConfig
    from hisparse_cli.errors import InputError
    from hisparse_cli.config.profiles import load_profile
    from hisparse_cli.quality.probe import save_probe
    from hisparse_cli.quality.probe_train import (TEXT_SUFFIXES, ProbeTrainConfig, read_texts,
                                                  train_probe)

    cfg = ProbeTrainConfig(window=window, max_tokens=max(max_tokens, window), epochs=epochs,
                           seed=seed)
    target_for = _probe_target(out)  # exit 2 before anything is read or loaded
    pairs = read_texts(list(texts) if texts else _default_texts())
    if not pairs:
        raise InputError("no training text found in " + ", ".join(map(str, texts or [])),
                         hint=f"folders contribute their {' '.join(TEXT_SUFFIXES)} files "
                              "(binary and empty ones are skipped); pass text files")
    _, model_path, engine, _, _ = _load(model, "cpu", quiet)
    engine.sparse = SparseConfig.dense_config()
    module, meta = train_probe(engine, pairs, cfg, progress=None if quiet else note,
                               model_name=model_path.name)
    weights, sidecar = save_probe(module, target_for(model_path.name), meta)
    if not quiet:
        note(f"wrote {weights} and {sidecar} ({module.num_parameters()} parameters)")
    write_result(sidecar.read_text(encoding="utf-8"))


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_command)
    app.add_typer(probe_app, name="probe")
