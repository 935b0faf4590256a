"""`hisparse summarize PATH`: one document → summary on stdout (or JSON, or --out FILE).

Order: flags and profile are validated first (exit 2), then the --out path (2 or 3), then
the document and reference are read (exit 3), then the model is resolved and loaded (exit 4), then the run (exit 5 when it
does not fit). stdout receives only the summary (or the one JSON object); progress, warnings
and the stats table go to stderr. With --out the result is written atomically to FILE
instead of stdout; the path is checked before the document is read (outputs.py), and when
writing still fails at the end the result goes to stdout, with the error (exit 3).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from hisparse_cli.cli_options import P_OUT, RunOptions, run_options
from hisparse_cli.errors import InputError
from hisparse_cli.outputs import check_output_file, write_atomic


def build_job(opts: RunOptions):
    """Profile, sparse settings and summary settings from the flags (validated), as a Job."""
    from hisparse_cli.console import stderr_console, warn
    from hisparse_cli.job import Job

    profile = opts.load_profile()
    sparse = opts.sparse(profile)
    settings = opts.summary_settings(profile)
    progress = None if opts.quiet else stderr_console()
    return Job(profile, sparse, settings, model_spec=opts.model, probe_path=opts.probe,
               warn=None if opts.quiet else warn, model_progress=progress,
               attention=opts.attention_mode(profile), explicit_sparse=opts.explicit_sparse())


def _write_out(out: Path, text: str) -> None:
    """`write_atomic`, and when that fails after all (disk full, the folder removed during
    the run) the result goes to stdout instead of being lost, then an InputError (exit 3)."""
    from hisparse_cli.console import write_result

    try:
        write_atomic(out, text)
    except (OSError, InputError) as exc:
        what = exc.message if isinstance(exc, InputError) \
            else f"cannot write {out}: {exc.strerror or exc}"
        write_result(text)
        raise InputError(f"{what}; the result was printed on stdout instead",
                         hint="choose another --out path (check the free disk space and the "
                              "folder's permissions)") from None


def summarize(
    path: Annotated[Path, typer.Argument(help="A PDF, a text file, or a source folder.",
                                         show_default=False, readable=False)],
    reference: Annotated[Optional[Path], typer.Option(
        "--reference", "-r", rich_help_panel=P_OUT, readable=False,
        help="Reference summary (text): adds ROUGE to the output.")] = None,
    out: Annotated[Optional[Path], typer.Option(
        "--out", "-o", rich_help_panel=P_OUT, readable=False,
        help="Write the summary (the JSON with --json) to FILE atomically, not to stdout.")] = None,
    as_json: Annotated[bool, typer.Option(
        "--json", rich_help_panel=P_OUT,
        help="Print one JSON object: summary, rouge, settings, stats, document.")] = False,
    *, opts: RunOptions,
) -> None:
    """Summarize one document: summary on stdout, stats on stderr."""
    from hisparse_cli.batch import printable_record
    from hisparse_cli.console import TokenProgress, print_table, stats_table, status, write_result
    from hisparse_cli.documents import load_document
    from hisparse_cli.job import document_path, read_reference

    job = build_job(opts)
    if out is not None:
        out = check_output_file(out)  # before the run: a bad --out costs nothing
    started = time.perf_counter()
    with status(f"reading {path}", quiet=opts.quiet):
        doc = load_document(document_path(path), password=opts.password)
    ingest_seconds = time.perf_counter() - started
    reference_text = read_reference(reference) if reference is not None else None
    job.engine()
    with TokenProgress(quiet=opts.quiet) as progress:
        record = job.run(doc, reference_text=reference_text,
                         reference_path=str(reference) if reference else None,
                         ingest_seconds=ingest_seconds, progress=progress)
    job.release()
    record = printable_record(record)  # a file name that is not UTF-8 → \xNN (batch.py)
    text = json.dumps(record, ensure_ascii=False, indent=2) + "\n" if as_json \
        else record["summary"] + "\n"
    if out is not None:
        _write_out(out, text)
    else:
        write_result(text)
    if not opts.quiet:
        if not record["summary"].strip():
            from hisparse_cli.console import warn

            warn("the model produced an empty summary (it stopped at once); try "
                 "--instructions, another --model or a larger --max-new-tokens")
        print_table(stats_table(record, record["document"]))
        if out is not None:
            from hisparse_cli.console import note

            note(f"wrote {out}")


def register(app: typer.Typer) -> None:
    app.command("summarize")(run_options(summarize))
