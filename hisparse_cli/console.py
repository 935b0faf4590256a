"""Rich helpers for the CLI: the stderr console, error/warning lines, progress, stats tables.

stdout carries only results (written with `write_result`); everything here goes to stderr.
Consoles are created per call, so they follow whatever sys.stderr is at that moment (Click's
test runner swaps it). Progress bars and spinners appear only when stderr is a terminal;
otherwise (a log) `status` prints one line when a stage starts (reading, loading the model),
and `TokenProgress` one line when a generation starts, one at most every `LOG_EVERY_S`
seconds during a long prefill or decode (stage, tokens done/total, tok/s, ETA) and one when
it ends — so a batch's log shows it is alive. quiet=True (`-q`) prints none of them.
Long lines are never wrapped, so `Error: …` stays one line in logs.
"""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn
from rich.progress import TimeElapsedColumn
from rich.table import Table
from rich.text import Text


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def stdout_console() -> Console:
    return Console(highlight=False, soft_wrap=True)


def write_result(text: str) -> None:
    """The command's result on stdout, exactly as given (plus a final newline)."""
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    sys.stdout.flush()


def print_error(message: str, hint: str | None = None) -> None:
    console = stderr_console()
    console.print(Text.assemble(("Error: ", "bold red"), " ".join(message.split("\n"))))
    if hint:
        console.print(Text.assemble(("Hint: ", "bold"), " ".join(hint.split("\n"))))


def warn(message: str, console: Console | None = None) -> None:
    """A warning line on stderr (`console`: the one a live display draws on, if any)."""
    (console or stderr_console()).print(Text.assemble(("Warning: ", "bold yellow"), message))


def note(message: str, console: Console | None = None) -> None:
    (console or stderr_console()).print(Text.assemble(("hisparse: ", "dim"), message))


LOG_EVERY_S = 10.0  # off a terminal: at most one progress line this often during a phase


def eta_text(seconds: float) -> str:
    """"ETA 42 s" / "ETA 3 min 5 s" / "ETA 1 h 02 min"."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"ETA {seconds} s"
    if seconds < 3600:
        return f"ETA {seconds // 60} min {seconds % 60} s"
    return f"ETA {seconds // 3600} h {seconds % 3600 // 60:02d} min"


def human_bytes(n: float | int | None) -> str:
    if not n:
        return "0 B"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


class _RateColumn(ProgressColumn):
    def render(self, task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:,.1f} tok/s" if speed else "", style="cyan")


class TokenProgress:
    """Pipeline progress (step, phase, done, total) → Rich bars on a terminal; otherwise one
    short log line per finished generation (prefill and decode rates). Use as a context
    manager; pass the object as the pipeline's `progress`.

    A phase's time runs from its start: the callback that reports it with done == 0 (the
    pipeline reports every prefill so), else the callback before it (the end of the previous
    phase) or entering the context. Never from the phase's own first report, which for a
    one-chunk prefill is also its last (that gave rates of millions of tok/s)."""

    def __init__(self, quiet: bool = False, prefix: str = "",
                 log_every_s: float | None = None) -> None:
        self.console = stderr_console()
        self.quiet, self.prefix = quiet, prefix
        self.log_every_s = LOG_EVERY_S if log_every_s is None else log_every_s
        self.live = self.console.is_terminal and not quiet
        self._progress: Progress | None = None
        self._task = None
        self._key: tuple[str, str] | None = None
        self._started = self._last = time.perf_counter()
        self._logged = self._last  # when the last log line was printed
        self._phases: dict[str, tuple[int, float, int]] = {}  # phase -> (done, s, total)

    def __enter__(self) -> "TokenProgress":
        self._last = time.perf_counter()
        if self.live:
            self._progress = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                _RateColumn(), TimeElapsedColumn(), console=self.console, transient=True)
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
        elif exc[0] is None:
            self._log_step()

    def _log_step(self) -> None:
        if self._key is None or self.quiet or self.live:
            return
        parts = []
        for phase, (n, sec, total) in self._phases.items():
            if phase in ("prefill", "decode"):
                noun = "prompt" if phase == "prefill" else "new"
                rate = f" ({n / sec:,.1f} tok/s)" if sec > 0 else ""  # 0: not measurable
                parts.append(f"{n:,} {noun} tokens{rate}")
            else:
                parts.append(f"{phase} {n:,}/{total:,} ({sec:.1f} s)")
        note(f"{self.prefix}{self._key[0]}: " + ", ".join(parts))
        self._phases = {}

    def __call__(self, step: str, phase: str, done: int, total: int) -> None:
        if self.quiet:
            return
        if self._key is None or self._key[0] != step:
            self._log_step()
        now = time.perf_counter()
        if (step, phase) != self._key:  # a new phase: it started now, or at the last report
            if not self.live and (self._key is None or self._key[0] != step):
                note(f"{self.prefix}{step}: {phase} of {total:,} tokens")  # a generation starts
                self._logged = now
            self._key, self._started = (step, phase), now if done == 0 else self._last
            if self._progress is not None:
                if self._task is not None:
                    self._progress.remove_task(self._task)
                self._task = self._progress.add_task(f"{self.prefix}{step} · {phase}",
                                                     total=total)
        self._phases[phase] = (done, now - self._started, total)
        self._last = now
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=done, total=total)
        elif now - self._logged >= self.log_every_s and 0 < done < total:
            self._log_progress(step, phase, done, total, now - self._started)
            self._logged = now

    def _log_progress(self, step: str, phase: str, done: int, total: int, sec: float) -> None:
        """One line during a long phase: tokens done/total, rate, ETA (decode: at most, it
        may stop early at the end-of-text token)."""
        rate = done / sec if sec > 0 else 0.0
        eta = ""
        if rate > 0:
            eta = (", " + ("at most " if phase == "decode" else "")
                   + eta_text((total - done) / rate))
        note(f"{self.prefix}{step} · {phase}: {done:,}/{total:,} tokens, {rate:,.1f} tok/s{eta}")


def status(message: str, quiet: bool = False):
    """A stage: a spinner on a terminal; otherwise one log line as it starts; nothing when
    quiet (a context manager either way)."""
    from contextlib import nullcontext

    console = stderr_console()
    if quiet:
        return nullcontext()
    if not console.is_terminal:
        note(message)
        return nullcontext()
    return console.status(message)


def stats_table(result: dict, document: dict | None = None) -> Table:
    """The summarize stats table from a summarize JSON object (see cli_summarize)."""
    stats = result["stats"]
    table = Table(title="hisparse summarize", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")
    chunks = len([c for c in result.get("chunks", []) if c["level"] == 0]) or 1
    noun = "document" if result["strategy"] == "collection" else "chunk"
    rows = [
        ("strategy", f"{result['strategy']} ({chunks} {noun}{'s' if chunks > 1 else ''})"),
        ("prompt tokens", f"{stats['prompt_tokens']:,}"),
        ("new tokens", f"{stats['new_tokens']:,}"),
        ("prefill", f"{stats['prefill_tok_s']:,.1f} tok/s"),
        ("decode", f"{stats['decode_tok_s']:,.1f} tok/s"),
        ("peak KV blocks", f"{stats['kv_blocks_peak']:,}"),
        ("peak KV bytes", human_bytes(stats["kv_bytes_peak"])),
        ("recalibrations", f"{stats['recalibrations']:,}"),
        *([("offloaded pages", f"{stats['pages_offloaded']:,} "
                               f"({human_bytes(stats.get('offload_bytes', 0))} host)"),
           ("retrieved pages / step", f"{stats.get('pages_retrieved_per_step', 0.0):,.1f}"),
           ("page cache hit rate", f"{stats.get('cache_hit_rate', 0.0):.1%}"),
           ("bytes into page cache", human_bytes(stats.get("bytes_to_cache", 0)))]
          if stats.get("pages_offloaded") else []),
        ("peak memory", f"{human_bytes(stats['peak_memory_bytes'])} ({stats['peak_memory_kind']})"),
        ("device", f"{stats['device']} / {stats['backend']}"),
        *_compile_rows(stats),
        *_summary_rows(result),
        ("time", f"{result['timings']['total_seconds']:.1f} s"),
    ]
    if document:
        size = (f"{document['sections']:,} {document['unit']}" if document["unit"] != "sections"
                else f"{document['chars']:,} chars")
        skipped = f", {document['skipped']} skipped" if document.get("skipped") else ""
        rows.insert(0, ("document", f"{document['kind']} ({document.get('genre', '')}), "
                                    f"{size}{skipped}"))
    for name, value in rows:
        table.add_row(name, value)
    for name, value in (result.get("rouge") or {}).items():
        table.add_row(name, f"{value:.4f}")
    return table


def _compile_rows(stats: dict) -> list[tuple[str, str]]:
    """GPU kernels the run compiled (0 after `hisparse warmup`) and loaded from the disk
    cache, with their time; no row on the CPU, where nothing is compiled."""
    compiled, loaded = stats.get("kernel_compiles", 0), stats.get("kernel_loads", 0)
    if not (compiled or loaded or str(stats.get("device", "")).startswith("cuda")):
        return []
    text = f"{compiled:,} ({stats.get('kernel_compile_seconds', 0.0):.1f} s)"
    if loaded:
        seconds = stats.get("kernel_load_seconds", 0.0)
        text += f", {loaded:,} loaded from the cache ({seconds:.1f} s)"
    return [("kernel compiles", text)]


def _summary_rows(result: dict) -> list[tuple[str, str]]:
    """Attention choice, length against its target, and the guard's work (when known)."""
    rows = []
    attention = (result.get("settings") or {}).get("attention")
    if attention:
        shape = "dense" if attention.get("window_size") is None else (
            f"sparse, window {attention['window_size']}, {attention['global_tokens']} globals")
        rows.append(("attention", f"{shape} ({attention['requested']}: {attention['reason']})"))
    length = result.get("length")
    if length:
        rows.append(("summary length", f"{length['words']:,} words (target "
                                       f"{length['target_words']:,}, cap "
                                       f"{length['max_new_tokens']:,} tokens)"))
    guard = result.get("guard")
    if guard:
        rows.append(("guard", f"{guard.get('retries', 0)} retries, {guard.get('repairs', 0)} "
                              f"repairs, {guard.get('digests', 0)} digests"))
    return rows


def print_table(table: Table, to_stdout: bool = False) -> None:
    """Print `table` on stdout or stderr. Where that is not a terminal (a pipe, a file, a
    log), the table gets its natural width: Rich's default 80 columns would cut names
    (`smollm2-135m-instr…`) in what a script reads."""
    console = stdout_console() if to_stdout else stderr_console()
    if not console.is_terminal:
        console = Console(stderr=not to_stdout, highlight=False, soft_wrap=True,
                          width=UNBOUNDED_WIDTH)
    console.print(table)


UNBOUNDED_WIDTH = 10_000  # wider than any table's natural width


__all__ = ["stderr_console", "stdout_console", "write_result", "print_error", "warn", "note",
           "TokenProgress", "status", "stats_table", "print_table", "human_bytes",
           "LOG_EVERY_S", "eta_text"]
