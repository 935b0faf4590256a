"""`hisparse batch INPUTS… --out results.jsonl`: many documents, one engine, resumable.

Input forms, reference matching and the results-file format are in batch.py. The results
file is locked for the whole run (a second run on the same file is refused, exit 3, before
any model loads). stderr gets one line per document and a final table (counts, mean ROUGE with 95% bootstrap intervals);
stdout gets nothing, or the batch summary as one JSON object with --json. Exit codes: 0 all
documents succeeded (a document whose reference could not be read succeeded, with a warning
and no ROUGE), 6 at least one failed (recorded in the file), 130 interrupted (finished lines
stay; rerun with --resume), or the setup error's own code (bad flags 2, a results file
--resume cannot continue 3, model 4).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, List, Optional

import typer

from hisparse_cli.cli.options import P_OUT, RunOptions, run_options
from hisparse_cli.errors import EXIT_BATCH_FAILURES, ConfigError, InputError

RETRY_HINT = "use --retry-failed to run it again"


def _reporter(quiet: bool):
    from rich.text import Text

    from hisparse_cli.summarize.batch import printable
    from hisparse_cli.console import stderr_console

    def report(event: str, index: int, total: int, given: str, record: dict | None) -> None:
        if quiet or event == "start":
            return
        head = f"[{index}/{total}] {printable(given)}: "
        if event == "skip" and (record or {}).get("status") == "ok":
            line = Text.assemble(head, ("already done", "dim"))
        elif event == "skip":
            line = Text.assemble(head, ("failed earlier", "dim"), f" ({RETRY_HINT})")
        elif record and record.get("status") == "ok":
            rouge = record.get("rouge") or {}
            extra = f", rougeL {rouge['rougeL']:.3f}" if "rougeL" in rouge else ""
            warned = "".join(f"; {w}" for w in record.get("warnings") or ())
            line = Text.assemble(head, ("ok", "green"), f" ({record['seconds']:.1f} s, "
                                                        f"{record['strategy']}{extra})",
                                 (warned, "yellow"))
        else:
            err = (record or {}).get("error") or {}
            line = Text.assemble(head, ("failed", "bold red"),
                                 f" ({err.get('type')}, exit {err.get('exit_code')}): "
                                 f"{err.get('message')}")
        stderr_console().print(line)

    return report


def _summary_table(summary: dict):
    from rich.table import Table

    table = Table(title=f"hisparse batch → {summary['results']}", title_justify="left")
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    table.add_column("95% CI", justify="right")
    table.add_row("documents", str(summary["documents"]), "")
    table.add_row("succeeded", str(summary["ok"]), "")
    table.add_row("failed", str(summary["failed"]), "")
    if summary["warnings"]:
        table.add_row("with warnings", str(len(summary["warnings"])), "")
    for name, ci in summary["rouge"].items():
        interval = "n/a" if ci["lo"] is None else f"[{ci['lo']:.4f}, {ci['hi']:.4f}]"
        table.add_row(f"{name} (n={ci['n']})", f"{ci['mean']:.4f}", interval)
    return table


def batch(
    inputs: Annotated[List[str], typer.Argument(
        help="Files, folders (their document files), @list.txt (one path per line; a "
             "folder named there is one document: a repository or a collection), - (the "
             "document on stdin) or @- (the list on stdin).", show_default=False)],
    out: Annotated[Path, typer.Option("--out", "-o", rich_help_panel=P_OUT,
                                      help="Results file (JSON lines, appended).")],
    references: Annotated[Optional[Path], typer.Option(
        "--references", rich_help_panel=P_OUT,
        help="Folder of reference summaries: <stem>.ref.txt, <stem>.txt or <stem>.md "
             "(<stem>.ref.txt beside an input is used too).")] = None,
    resume: Annotated[bool, typer.Option(
        "--resume", rich_help_panel=P_OUT,
        help="Continue an existing results file: skip documents already in it.")] = False,
    retry_failed: Annotated[bool, typer.Option(
        "--retry-failed", rich_help_panel=P_OUT,
        help="With --resume: summarize documents that failed before again.")] = False,
    recursive: Annotated[bool, typer.Option(
        "--recursive", "-R", rich_help_panel=P_OUT,
        help="Take document files from subfolders of folder inputs too.")] = False,
    as_json: Annotated[bool, typer.Option(
        "--json", rich_help_panel=P_OUT,
        help="Print the batch summary (counts, ROUGE CIs) as one JSON object.")] = False,
    *, opts: RunOptions,
) -> None:
    """Summarize many documents into a JSON-lines file (one engine, resumable)."""
    from hisparse_cli.summarize.batch import ResultsFile, expand_inputs

    if retry_failed and not resume:
        raise ConfigError("--retry-failed reruns failed documents of an existing results file",
                          hint="add --resume (--retry-failed only works with it)")
    if references is not None and not references.is_dir():
        raise InputError(f"--references {references} is not a folder",
                         hint="give the folder that holds the reference summaries")
    items = expand_inputs(inputs, recursive=recursive)
    out_path = out.expanduser().resolve()
    items = [(given, path) for given, path in items if path != out_path]  # not its own input
    if not items:
        raise InputError("no documents found in the given inputs",
                         hint="folders contribute files ending in .pdf, .docx, .txt, .md, …; "
                              "name a repository folder inside an @list file")
    results = ResultsFile(out)
    results.open(resume=resume)  # takes the file's lock: a second writer stops here (exit 3)
    try:
        _run(results, items, opts, out=out, references=references, retry_failed=retry_failed,
             as_json=as_json)
    finally:
        results.close()


def _run(results, items, opts: RunOptions, *, out: Path, references: Path | None,
         retry_failed: bool, as_json: bool) -> None:
    from hisparse_cli.summarize.batch_runner import batch_summary, run_batch
    from hisparse_cli.cli.summarize import build_job
    from hisparse_cli.console import TokenProgress, note, print_table, warn, write_result

    job = build_job(opts)
    if results.torn_bytes and not opts.quiet:
        note(f"removed an incomplete last line ({results.torn_bytes} bytes) from {out}")
    if results.unterminated and not opts.quiet:
        note(f"added the missing newline after the last record of {out}")
    if not opts.quiet:
        _warn_other_settings(results, job, warn)

    def progress_factory(index: int, total: int):
        return TokenProgress(quiet=opts.quiet, prefix=f"[{index}/{total}] ")

    try:
        outcome = run_batch(items, job, results, references=references, password=opts.password,
                            retry_failed=retry_failed, progress_factory=progress_factory,
                            report=_reporter(opts.quiet), include_secrets=opts.include_secrets)
    except KeyboardInterrupt:
        if opts.quiet:
            pass
        elif results.records:
            note(f"stopped; {out} keeps every finished document — rerun with --resume")
        else:
            note(f"stopped before the first document finished; nothing was written to {out}")
        raise
    summary = batch_summary(results, outcome.keys)
    summary["skipped_already_done"] = outcome.skipped
    summary["skipped_failed_earlier"] = outcome.skipped_failed
    if not opts.quiet:
        print_table(_summary_table(summary))
        if outcome.skipped_failed:
            note(f"{outcome.skipped_failed} document(s) failed earlier and were not run again; "
                 "add --retry-failed to run them again")
    if as_json:
        write_result(json.dumps(summary, ensure_ascii=False, indent=2))
    if summary["failed"]:
        raise typer.Exit(EXIT_BATCH_FAILURES)


def _warn_other_settings(results, job, warn) -> None:
    """One warning when finished records in the file were made with other settings (they are
    still skipped as done: the file then mixes settings)."""
    from hisparse_cli.summarize.batch_runner import other_settings, settings_difference

    others = other_settings(results, job.settings_id())
    if not others:
        return
    changes = sorted({c for r in others for c in settings_difference(r, job.settings_view())})
    what = "; ".join(changes[:4]) + ("; …" if len(changes) > 4 else "") if changes \
        else "the model, --probe or --chunk-new-tokens"
    warn(f"{len(others)} finished document(s) in {results.path} were summarized with other "
         f"settings ({what}); they are kept and not redone, so the results mix settings — "
         "use another --out to summarize them with these settings")


def register(app: typer.Typer) -> None:
    app.command("batch")(run_options(batch))
