"""A counting stand-in for `Job` shared by the batch tests, local and on Ray.

`FakeJob` counts what it ran and raises `fail_on[name]` for chosen documents. In a Ray
worker (built from `FakeJob.spec()`), a document's text can also ask for what a test needs
to see there:
  * a line `@hang PIDFILE`: append "<name> <pid>" to PIDFILE, then, on the first attempt
    only (the name not yet in the file), sleep `HANG_SECONDS` (the test kills the process);
  * a line `@die`: the worker process kills itself (SIGKILL) on every attempt.
Ray tests send this module by value (cloudpickle.register_pickle_by_value), so workers do
not need the tests folder on their path.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

HANG_SECONDS = 300.0


def cpu_profile():
    from hisparse_cli.config.profiles import load_profile

    return load_profile("cpu")


def _directives(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if line.startswith("@"):
            name, _, arg = line[1:].partition(" ")
            out[name] = arg.strip()
    return out


def _act_on(name: str, text: str) -> None:
    directives = _directives(text)
    if "die" in directives:
        os.kill(os.getpid(), signal.SIGKILL)
    if "hang" in directives:
        pidfile = Path(directives["hang"])
        seen = pidfile.read_text().split() if pidfile.exists() else []
        with open(pidfile, "a") as handle:
            handle.write(f"{name} {os.getpid()}\n")
        if name not in seen:
            time.sleep(HANG_SECONDS)


@dataclass(frozen=True)
class FakeJobSpec:
    fail_on: dict = field(default_factory=dict)
    settings: str = "s1"

    def build(self, warn=None) -> "FakeJob":
        return FakeJob(self.fail_on, settings=self.settings)


class FakeJob:
    """Job stand-in: counts runs; raises `fail_on[name]` for chosen documents."""

    def __init__(self, fail_on: dict | None = None, settings: str = "s1") -> None:
        self.loaded, self.ran, self.fail_on = False, [], fail_on or {}
        self.references: dict[str, str | None] = {}
        self.settings = settings
        self.profile = cpu_profile()

    def engine(self):
        self.loaded = True

    def resolve(self):
        return None

    def spec(self, model_path=None) -> FakeJobSpec:
        return FakeJobSpec(dict(self.fail_on), settings=self.settings)

    def settings_view(self) -> dict:
        return {"profile": self.settings}

    def settings_id(self) -> str:
        return f"id-{self.settings}"

    def release(self) -> None:
        pass

    def run(self, doc, *, reference_text=None, reference_path=None, ingest_seconds=0.0,
            progress=None):
        name = Path(doc.source).name
        if name in self.fail_on:
            raise self.fail_on[name]
        _act_on(name, doc.text)
        self.ran.append(name)
        self.references[name] = reference_text
        rouge = {"rouge1": 0.5, "rouge2": 0.25, "rougeL": 0.4, "rougeLsum": 0.4} \
            if reference_text else None
        return {"summary": f"summary of {name}", "strategy": "stream", "rouge": rouge,
                "reference": reference_path, "settings": self.settings_view(),
                "pid": os.getpid()}


def docs(folder: Path, n: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        path = folder / f"doc{i}.txt"
        path.write_text(f"Document number {i}. The provider delivers item {i} on time.\n")
        paths.append(path)
    return paths
