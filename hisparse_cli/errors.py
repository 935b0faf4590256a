"""One exception hierarchy for every user-facing failure, mapped to one exit-code table.

The CLI catches `HisparseError`, prints `Error: <message>` and `Hint: <hint>` on stderr and
exits with `exit_code`. Library code raises the most specific subclass; nothing else in the
package decides exit codes.

Exit codes (documented in the README):
    0  success
    1  unexpected internal error (a bug; traceback with HISPARSE_DEBUG=1)
    2  bad usage: unknown option value, invalid setting, unknown profile
    3  input problem: missing/unreadable/encrypted/scanned/corrupt document, bad repository,
       a results file `batch --resume` cannot continue or write, an --out path that cannot
       be written
    4  model problem: model not found, unsupported architecture or format, offline with no cache
    5  resources: does not fit the memory budget, out of memory
    6  batch finished but at least one document failed
     (a document whose Ray worker died twice is recorded as a WorkerError, exit 1 in its record)
  130  interrupted (Ctrl-C)
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_INPUT = 3
EXIT_MODEL = 4
EXIT_RESOURCES = 5
EXIT_BATCH_FAILURES = 6
EXIT_INTERRUPTED = 130


class HisparseError(Exception):
    """Base class: a failure with a one-line message, a hint and an exit code. Without a
    hint of its own an error gets its class's `default_hint`, so the CLI always prints the
    `Hint:` line the README promises."""

    exit_code: int = EXIT_INTERNAL
    default_hint: str | None = "rerun with HISPARSE_DEBUG=1 for the details"

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint if hint else self.default_hint

    def __str__(self) -> str:
        return self.message


class ConfigError(HisparseError):
    """An invalid setting (profile field, sparse config, CLI value). Message names the field."""

    exit_code = EXIT_USAGE
    default_hint = ("check the value (`hisparse COMMAND --help` lists every option; `hisparse "
                    "profiles show cpu` every profile field)")


class InputError(HisparseError):
    """A document or repository that cannot be read."""

    exit_code = EXIT_INPUT
    default_hint = "check the path and that it is a readable document"


class ModelError(HisparseError):
    """A model that cannot be found, fetched, converted or loaded."""

    exit_code = EXIT_MODEL
    default_hint = ("check the model folder (config.json + *.safetensors + tokenizer); a damaged "
                    "download: fetch it again (`hisparse models pull NAME --force`)")


class ResourceError(HisparseError):
    """The run does not fit the memory budget (planner refusal, pool cap, or a real OOM)."""

    exit_code = EXIT_RESOURCES
    default_hint = ("`hisparse plan` shows what fits; try a smaller profile, --window or "
                    "--max-new-tokens")


class WorkerError(HisparseError):
    """A batch worker process (a Ray actor) died: killed, crashed, or lost with its node."""

    exit_code = EXIT_INTERNAL
    default_hint = ("the worker's log is in the Ray session logs (/tmp/ray/session_latest/logs "
                    "on its node); rerun with --resume --retry-failed to try it again")
