"""CliRunner helpers shared by the CLI test modules (test_cli.py, test_cli_io.py)."""

from __future__ import annotations

from typer.testing import CliRunner

from hisparse_cli.cli.app import app


def run(*args, env: dict | None = None):
    """`hisparse ARGS` through Typer's CliRunner (stdout and stderr kept apart)."""
    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def show(result) -> str:
    return (f"exit {result.exit_code}\n--- stdout ---\n{result.stdout}\n--- stderr ---\n"
            f"{result.stderr}\n--- exception ---\n{result.exception!r}")


def assert_error(result, code: int, *needles: str) -> None:
    """Exit `code`, nothing on stdout, exactly an `Error:` and a `Hint:` line on stderr (no
    traceback; stage lines a log gets before them, `hisparse: reading …`, aside), each
    needle in stderr."""
    assert result.exit_code == code, show(result)
    assert result.stdout == "", show(result)
    lines = [line for line in result.stderr.strip().splitlines()
             if not line.startswith("hisparse: ")]
    assert len(lines) == 2, show(result)
    assert lines[0].startswith("Error: ") and lines[1].startswith("Hint: "), show(result)
    assert "Traceback" not in result.stderr, show(result)
    for needle in needles:
        assert needle in result.stderr, show(result)
