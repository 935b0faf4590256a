"""`hisparse summarize PATH`: one document → summary on stdout (or JSON, or --out FILE).

PATH is a file, a folder, or `-` (the document piped in on stdin; `./-` names a file "-").
Order, cheapest first, so that a mistake costs nothing and errors that need no model come
before torch is imported: the --out path (2 or 3), whether PATH exists and can be read and
the reference (3), then flags and profile (2; `--profile auto` is where torch is first imported, to look
for a GPU), then the document is read (exit 3), then the model is resolved
and loaded (exit 4), then the run (exit 5 when it does not fit). stdout receives only the summary (or the one JSON object); progress, warnings
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

from hisparse_cli.cli.options import P_OUT, RunOptions, run_options
from hisparse_cli.errors import InputError
from hisparse_cli.cli.outputs import check_output_file, write_atomic


def build_job(opts: RunOptions):
    """Profile, sparse settings and summary settings from the flags (validated), as a Job."""
    from hisparse_cli.console import stderr_console, warn
    from hisparse_cli.summarize.job import Job

    profile = opts.load_profile()
    sparse = opts.sparse(profile)
    settings = opts.summary_settings(profile)
    from hisparse_cli.console import status

    progress = None if opts.quiet else stderr_console()
    return Job(profile, sparse, settings, model_spec=opts.model, probe_path=opts.probe,
               threads=opts.threads,
               warn=None if opts.quiet else warn, model_progress=progress,
               stage=None if opts.quiet else status,
               attention=opts.attention_mode(profile), explicit_sparse=opts.explicit_sparse())


def check_input(path: str, given: str = "PATH") -> None:
    """Before anything heavy: `path` ("-": stdin) exists and can be read (InputError)."""
    from hisparse_cli.documents.stdin import STDIN_ARG
    from hisparse_cli.summarize.job import document_path

    if path == STDIN_ARG:
        return
    checked = document_path(path, given)
    if not checked.exists():
        raise InputError(f"{checked}: no such file or directory",
                         hint="check the path (a PDF, a .docx, an HTML page, a text file, a "
                              "folder, or - for stdin)")


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


def _read_piped(path: str):
    """For `-`: stdin's bytes as a stream (read now, bounded); else None."""
    if path != "-":
        return None
    import io

    from hisparse_cli.documents import IngestLimits
    from hisparse_cli.documents.stdin import read_stdin

    return io.BytesIO(read_stdin(IngestLimits()))


def summarize(
    path: Annotated[str, typer.Argument(
        metavar="PATH", help="A PDF, .docx, HTML or text file, a folder (a code repository or a collection of "
             "documents), or - to read the document from stdin.", show_default=False)],
    reference: Annotated[Optional[Path], typer.Option(
        "--reference", "-r", rich_help_panel=P_OUT, readable=False,
        help="Reference summary (text): adds ROUGE to the output.")] = None,
    out: Annotated[Optional[Path], typer.Option(
        "--out", "-o", rich_help_panel=P_OUT, readable=False,
        help="Write the summary (the JSON with --json) to FILE atomically, not to stdout.")] = None,
    as_json: Annotated[bool, typer.Option(
        "--json", rich_help_panel=P_OUT,
        help="Print one JSON object: summary, rouge, settings, stats, document.")] = False,
    title: Annotated[Optional[str], typer.Option(
        "--title", rich_help_panel=P_OUT,
        help="The document's title in the prompt (default: its own: a PDF's or page's "
             "title, a Markdown heading, the file name; none for stdin text without a "
             "heading).")] = None,
    trace: Annotated[Optional[Path], typer.Option(
        "--trace", rich_help_panel=P_OUT, readable=False,
        help="Write one JSON line per prefill chunk and decode step to FILE: active blocks, "
             "evictions, resident blocks, recalibrations and, with the retrieval tier, "
             "offloaded pages, retrievals, page-cache hits and bytes moved.")] = None,
    *, opts: RunOptions,
) -> None:
    """Summarize one document: summary on stdout, stats on stderr."""
    from hisparse_cli.summarize.batch import printable_record
    from hisparse_cli.console import TokenProgress, print_table, stats_table, status, write_result
    from hisparse_cli.documents import load_document
    from hisparse_cli.summarize.job import read_reference

    if out is not None:
        out = check_output_file(out)  # before the run: a bad --out costs nothing
    if trace is not None:
        trace = check_output_file(trace, "--trace")
    check_input(path)
    piped = _read_piped(path)  # stdin's bytes, read before anything heavy (empty: exit 3)
    reference_text = read_reference(reference) if reference is not None else None
    job = build_job(opts)
    started = time.perf_counter()
    with status(f"reading {'stdin' if piped else path}", quiet=opts.quiet):
        doc = load_document("-" if piped else Path(path), password=opts.password,
                            include_secrets=opts.include_secrets, title=title, stdin=piped)
    ingest_seconds = time.perf_counter() - started
    engine = job.engine()
    trace_file = trace.open("w", encoding="utf-8") if trace is not None else None
    if trace_file is not None:
        engine.step_trace = lambda rec: trace_file.write(json.dumps(rec) + "\n")
    try:
        with TokenProgress(quiet=opts.quiet) as progress:
            record = job.run(doc, reference_text=reference_text,
                             reference_path=str(reference) if reference else None,
                             ingest_seconds=ingest_seconds, progress=progress)
    finally:
        if trace_file is not None:
            engine.step_trace = None
            trace_file.close()
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
