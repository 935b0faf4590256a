"""The `hisparse` command line: the Typer app, its one error handler, and command registration.

Commands live in cli_*.py modules (thin: parse flags, call library functions, render):
    summarize, batch            cli_summarize.py, cli_batch.py (shared flags: cli_options.py)
    score, profiles, models     cli_misc.py
    plan, quantize, eval,       optional modules, registered when present (EXTRA_COMMANDS)
    warmup

Error handling, in one place (`HisparseGroup`): a `HisparseError` prints `Error: …` and
`Hint: …` on stderr and exits with its code (errors.py); Ctrl-C exits 130; a torch or host
out-of-memory error becomes a ResourceError (5); any other exception is an internal error
(1). Usage errors (bad flag values, a missing argument or command: no command prints its
help instead) keep Click's exit code 2 in the same two-line form. A traceback is printed only with HISPARSE_DEBUG=1. Heavy imports happen inside commands, so
`hisparse --help` stays instant.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import re
import sys
import traceback
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

try:  # recent Typer vendors Click; its exception classes are the ones raised
    from typer import _click as click
except ImportError:  # pragma: no cover - older Typer runs on the click package
    import click

from hisparse_cli import __version__
from hisparse_cli.errors import EXIT_INTERNAL, EXIT_INTERRUPTED, HisparseError, ResourceError

EXTRA_COMMANDS = ("hisparse_cli.cli.plan", "hisparse_cli.cli.quantize", "hisparse_cli.cli.eval",
                  "hisparse_cli.cli.warmup")


def as_resource_error(exc: BaseException) -> ResourceError | None:
    """A ResourceError for out-of-memory exceptions (torch CUDA OOM, host MemoryError, the
    CPU allocator refusing an allocation): vram.oom_error."""
    from hisparse_cli.planner.vram import oom_error

    return oom_error(exc)


def report_exception(exc: BaseException) -> int:
    """Print the one-line error for `exc` (traceback only with HISPARSE_DEBUG=1); return
    the exit code."""
    from hisparse_cli.config.env import debug_enabled
    from hisparse_cli.console import print_error

    if debug_enabled():
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    if isinstance(exc, KeyboardInterrupt):
        print_error("interrupted")
        return EXIT_INTERRUPTED
    err = exc if isinstance(exc, HisparseError) else as_resource_error(exc)
    if err is not None:
        print_error(err.message, err.hint)
        return err.exit_code
    print_error(f"internal error: {type(exc).__name__}: {exc}",
                hint="this is a bug; rerun with HISPARSE_DEBUG=1 for the traceback and report it")
    return EXIT_INTERNAL


def uniform_commands(command: click.Command) -> None:
    """The same conventions for `command` and every subcommand, whichever module made it:

    * help texts are plain text for Rich: each `[` is escaped, so notes such as
      `[default: the profile's]` show as written instead of being taken for (and dropped
      as) Rich markup. Idempotent: a `[` already escaped as `\\[` is left alone;
    * no `no_args_is_help`: a missing argument or subcommand is a usage error (`Error:` and
      `Hint:` on stderr, exit 2), not the help text on stdout.
    """
    def escape(text):
        return _UNESCAPED_BRACKET.sub(r"\\[", text) if isinstance(text, str) else text

    command.help = escape(command.help)
    command.short_help = escape(command.short_help)
    command.no_args_is_help = False
    for param in command.params:
        if hasattr(param, "help"):
            param.help = escape(param.help)
    for sub in getattr(command, "commands", {}).values():
        uniform_commands(sub)


def usage_error(exc: click.ClickException) -> tuple[str, str]:
    """(message, hint) for a Click usage error: `missing argument PATH`, `missing command`
    (the hint lists them), and for an unknown option only close matches as suggestions
    (Click offers anything difflib rates 0.6, e.g. --out for --bogus-opt)."""
    ctx = getattr(exc, "ctx", None)
    path = ctx.command_path if ctx is not None else "hisparse"
    see = f"see `{path} --help`"
    if isinstance(exc, click.exceptions.MissingParameter) and exc.param is not None:
        param = exc.param
        kind = getattr(param, "param_type_name", "argument")
        name = param.opts[0] if kind == "option" and param.opts else (param.name or "").upper()
        return f"missing {kind} {name}", see
    if isinstance(exc, click.exceptions.NoSuchOption):
        close = difflib.get_close_matches(exc.option_name, exc.possibilities or [], n=3,
                                          cutoff=CLOSE_OPTION_MATCH)
        message = f"no such option: {exc.option_name}"
        return message, (f"did you mean {' or '.join(close)}? {see}" if close else see)
    if isinstance(exc, click.exceptions.UsageError) and exc.message == "Missing command." and ctx:
        names = ", ".join(ctx.command.list_commands(ctx))
        return "missing command", f"one of: {names}; {see}"
    return exc.format_message(), see


CLOSE_OPTION_MATCH = 0.75  # --windw → --window (0.93), --modle → --model (0.86); not --out


_UNESCAPED_BRACKET = re.compile(r"(?<!\\)\[")


class HisparseGroup(TyperGroup):
    """Typer group with the error handling described in the module docstring; every command
    follows `uniform_commands`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        uniform_commands(self)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort, click.ClickException, BrokenPipeError):
            raise  # Click's own handling (BrokenPipeError: stdout closed, e.g. `| head`)
        except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - the one handler
            raise typer.Exit(report_exception(exc)) from None

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True,
             **extra):
        from hisparse_cli.console import print_error

        try:
            rv = super().main(args=args, prog_name=prog_name or "hisparse",
                              complete_var=complete_var, standalone_mode=False, **extra)
        except click.ClickException as exc:
            if not standalone_mode:
                raise
            print_error(*usage_error(exc))
            sys.exit(exc.exit_code)
        except typer.Abort:
            if not standalone_mode:
                raise
            print_error("aborted")
            sys.exit(EXIT_INTERRUPTED)
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)


app = typer.Typer(
    name="hisparse", cls=HisparseGroup, add_completion=False,
    pretty_exceptions_enable=False, rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Summarize long documents (PDF, text, code repositories) with a paged, sparse-"
         "attention KV cache. Results go to stdout; progress and logs to stderr.")


def _version(value: bool) -> None:
    if value:
        sys.stdout.write(f"hisparse {__version__}\n")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[Optional[bool], typer.Option(
        "--version", "-V", callback=_version, is_eager=True,
        help="Print the version and exit.")] = None) -> None:
    """hisparse: long-document summarizer with sparse attention."""
    from hisparse_cli.config.env import bound_openmp_spin, prefer_expandable_segments

    bound_openmp_spin()  # before any command loads torch (libgomp reads it once)
    prefer_expandable_segments()  # before CUDA initialises (torch reads it once)


def _register() -> None:
    from hisparse_cli.cli import batch as cli_batch
    from hisparse_cli.cli import misc as cli_misc
    from hisparse_cli.cli import summarize as cli_summarize

    cli_summarize.register(app)
    cli_batch.register(app)
    cli_misc.register(app)
    for name in EXTRA_COMMANDS:  # commands other modules add: present → registered
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name).register(app)


_register()


def main() -> None:
    """Console-script entry point (`hisparse = hisparse_cli.cli.app:main`)."""
    try:
        app()
    except KeyboardInterrupt:  # outside a command (e.g. during start-up)
        sys.stderr.write("Error: interrupted\n")
        sys.exit(EXIT_INTERRUPTED)


if __name__ == "__main__":  # pragma: no cover
    main()
