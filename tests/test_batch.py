"""Batch: input expansion, reference matching, the append-only results file, resume after an
interruption or a torn last line (nothing lost, nothing redone), failures recorded with their
exit codes, and the `hisparse batch` command end to end on the tiny model.

Most tests swap the summarizer for a counting fake (`FakeJob` / a patched
`summarize_document`), so resume behaviour is checked by counting what actually ran.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from helpers_tokenizer import make_tiny_model_dir
from hisparse_cli.batch import ResultsFile, content_sha256, expand_inputs, find_reference
from hisparse_cli.batch_runner import batch_summary, run_batch
from hisparse_cli.cli import app
from hisparse_cli.errors import ConfigError, InputError
from hisparse_cli.scoring import bootstrap_ci

TINY_FLAGS = ["--profile", "cpu", "-n", "4", "--window", "64", "--prefill-chunk", "64",
              "--global-tokens", "8", "--recalibrate-every", "64", "--recalibrate-topk", "8"]


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HISPARSE_HOME", str(tmp_path / "home"))


def _docs(folder: Path, n: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        path = folder / f"doc{i}.txt"
        path.write_text(f"Document number {i}. The provider delivers item {i} on time.\n")
        paths.append(path)
    return paths


class FakeJob:
    """Job stand-in: counts runs; raises `fail_on[name]` for chosen documents."""

    def __init__(self, fail_on: dict | None = None) -> None:
        self.loaded, self.ran, self.fail_on = False, [], fail_on or {}

    def engine(self):
        self.loaded = True

    def run(self, doc, *, reference_text=None, reference_path=None, ingest_seconds=0.0,
            progress=None):
        name = Path(doc.source).name
        if name in self.fail_on:
            raise self.fail_on[name]
        self.ran.append(name)
        rouge = {"rouge1": 0.5, "rouge2": 0.25, "rougeL": 0.4, "rougeLsum": 0.4} \
            if reference_text else None
        return {"summary": f"summary of {name}", "strategy": "stream", "rouge": rouge,
                "reference": reference_path}


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --- inputs and references ---------------------------------------------------------------------
def test_expand_inputs_files_folders_and_list_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    docs = _docs(tmp_path / "in", 3)
    (tmp_path / "in" / "doc0.ref.txt").write_text("ref")  # a reference, not a document
    (tmp_path / "in" / ".hidden.txt").write_text("x")
    (tmp_path / "in" / "image.png").write_bytes(b"\x89PNG")
    (tmp_path / "in" / "sub").mkdir()
    (tmp_path / "in" / "sub" / "deep.md").write_text("# deep")
    repo = tmp_path / "repo"
    repo.mkdir()
    (tmp_path / "list.txt").write_text("# my batch\nin/doc2.txt\n\nrepo\nmissing.txt\n")
    got = expand_inputs(["in", str(docs[0]), "@list.txt"])
    assert [p for _, p in got] == [d.resolve() for d in docs] + [repo.resolve(),
                                                                 (tmp_path / "missing.txt").resolve()]
    deep = expand_inputs(["in"], recursive=True)
    assert (tmp_path / "in" / "sub" / "deep.md").resolve() in [p for _, p in deep]
    with pytest.raises(InputError, match="input list"):
        expand_inputs(["@nope.txt"])


def test_find_reference_rules(tmp_path):
    doc = _docs(tmp_path / "in", 1)[0]
    assert find_reference(doc) is None
    beside = tmp_path / "in" / "doc0.ref.txt"
    beside.write_text("beside")
    assert find_reference(doc) == beside
    refs = tmp_path / "refs"
    refs.mkdir()
    (refs / "doc0.md").write_text("md")
    assert find_reference(doc, refs) == refs / "doc0.md"
    (refs / "doc0.ref.txt").write_text("ref")
    assert find_reference(doc, refs) == refs / "doc0.ref.txt"
    assert find_reference(doc, tmp_path / "in") == beside  # never the document itself
    repo = tmp_path / "in" / "tinykv"
    repo.mkdir()
    (tmp_path / "in" / "tinykv.ref.txt").write_text("repo ref")
    assert find_reference(repo) == tmp_path / "in" / "tinykv.ref.txt"


def test_folder_sha_changes_with_content(tmp_path):
    repo = tmp_path / "r"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "a.py").write_text("x = 1\n")
    before = content_sha256(repo)
    (repo / "pkg" / "a.py").write_text("x = 2\n")
    assert content_sha256(repo) != before


# --- results file ------------------------------------------------------------------------------
def test_results_file_refuses_to_mix_runs_and_cuts_a_torn_tail(tmp_path):
    path = tmp_path / "r.jsonl"
    results = ResultsFile(path)
    results.open(resume=False)
    results.append({"input": "a", "sha256": "1", "status": "ok"})
    with pytest.raises(ConfigError, match="already exists"):
        ResultsFile(path).open(resume=False)
    with open(path, "a") as handle:
        handle.write('{"input": "b", "sha2')  # killed mid-line
    again = ResultsFile(path)
    again.open(resume=True)
    assert again.torn_bytes > 0 and [r["input"] for r in again.records] == ["a"]
    assert path.read_text().endswith('"ok"}\n')  # the intact prefix, byte for byte


# --- the loop ------------------------------------------------------------------------------------
def test_failures_are_recorded_and_the_batch_goes_on(tmp_path):
    docs = _docs(tmp_path / "in", 3)
    job = FakeJob({"doc1.txt": ConfigError("too long", hint="shorter")})
    items = expand_inputs([str(tmp_path / "in"), str(tmp_path / "gone.txt")])
    results = ResultsFile(tmp_path / "r.jsonl")
    results.open(resume=False)
    outcome = run_batch(items, job, results)
    lines = _lines(tmp_path / "r.jsonl")
    assert [r["status"] for r in lines] == ["ok", "error", "ok", "error"]
    assert lines[1]["error"] == {"type": "ConfigError", "message": "too long", "hint": "shorter",
                                 "exit_code": 2}
    assert lines[3]["error"]["exit_code"] == 3 and lines[3]["sha256"] is None
    assert job.ran == ["doc0.txt", "doc2.txt"] and outcome.processed == 4
    summary = batch_summary(results, outcome.keys)
    assert (summary["documents"], summary["ok"], summary["failed"]) == (4, 2, 2)
    assert [f["input"] for f in summary["failures"]] == [str(docs[1].resolve()),
                                                         str((tmp_path / "gone.txt").resolve())]


def test_interrupted_batch_resumes_without_loss_or_repeats(tmp_path):
    _docs(tmp_path / "in", 5)
    items = expand_inputs([str(tmp_path / "in")])
    out = tmp_path / "r.jsonl"
    first = FakeJob({"doc3.txt": KeyboardInterrupt()})  # Ctrl-C while doc3 runs
    results = ResultsFile(out)
    results.open(resume=False)
    with pytest.raises(KeyboardInterrupt):
        run_batch(items, first, results)
    assert [Path(r["input"]).name for r in _lines(out)] == ["doc0.txt", "doc1.txt", "doc2.txt"]
    second = FakeJob()
    resumed = ResultsFile(out)
    resumed.open(resume=True)
    outcome = run_batch(items, second, resumed)
    assert second.ran == ["doc3.txt", "doc4.txt"] and outcome.skipped == 3
    names = [Path(r["input"]).name for r in _lines(out)]
    assert sorted(names) == [f"doc{i}.txt" for i in range(5)]  # each exactly once


def test_torn_last_line_is_redone_on_resume(tmp_path):
    _docs(tmp_path / "in", 3)
    items = expand_inputs([str(tmp_path / "in")])
    out = tmp_path / "r.jsonl"
    results = ResultsFile(out)
    results.open(resume=False)
    run_batch(items, FakeJob(), results)
    data = out.read_bytes()
    out.write_bytes(data[: len(data) - 25])  # a kill while the third line was being written
    job = FakeJob()
    resumed = ResultsFile(out)
    resumed.open(resume=True)
    run_batch(items, job, resumed)
    assert job.ran == ["doc2.txt"]
    assert [Path(r["input"]).name for r in _lines(out)] == ["doc0.txt", "doc1.txt", "doc2.txt"]


def test_resume_redoes_edited_documents_and_failures_only_when_asked(tmp_path):
    docs = _docs(tmp_path / "in", 2)
    items = expand_inputs([str(tmp_path / "in")])
    out = tmp_path / "r.jsonl"
    results = ResultsFile(out)
    results.open(resume=False)
    run_batch(items, FakeJob({"doc1.txt": InputError("bad")}), results)
    docs[0].write_text("an edited document\n")
    job = FakeJob()
    again = ResultsFile(out)
    again.open(resume=True)
    run_batch(items, job, again)
    assert job.ran == ["doc0.txt"]  # edited → new sha; the failed doc1 is left alone
    retry = FakeJob()
    third = ResultsFile(out)
    third.open(resume=True)
    outcome = run_batch(items, retry, third, retry_failed=True)
    assert retry.ran == ["doc1.txt"]
    assert batch_summary(third, outcome.keys)["failed"] == 0  # the latest record wins


def test_rouge_means_come_with_bootstrap_intervals(tmp_path):
    docs = _docs(tmp_path / "in", 3)
    for doc in docs:
        doc.with_suffix(".ref.txt").write_text("reference")
    items = expand_inputs([str(tmp_path / "in")])
    results = ResultsFile(tmp_path / "r.jsonl")
    results.open(resume=False)
    outcome = run_batch(items, FakeJob(), results)
    rouge = batch_summary(results, outcome.keys)["rouge"]
    assert rouge["rougeL"]["n"] == 3
    mean, lo, hi = bootstrap_ci([0.4, 0.4, 0.4])
    assert (rouge["rougeL"]["mean"], rouge["rougeL"]["lo"], rouge["rougeL"]["hi"]) == (mean, lo, hi)


# --- the command ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("batch"), max_position_embeddings=1024)


def show(result) -> str:
    return f"exit {result.exit_code}\n--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"


def test_batch_command_end_to_end(tiny, tmp_path):
    docs = _docs(tmp_path / "in", 2)
    docs[0].with_suffix(".ref.txt").write_text("The provider delivers item zero.")
    out = tmp_path / "results.jsonl"
    args = ["batch", str(tmp_path / "in"), str(tmp_path / "missing.pdf"), "--out", str(out),
            "--json", "--model", str(tiny), *TINY_FLAGS]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 6, show(result)  # one input failed
    summary = json.loads(result.stdout)
    assert (summary["documents"], summary["ok"], summary["failed"]) == (3, 2, 1)
    assert set(summary["rouge"]["rouge1"]) == {"mean", "lo", "hi", "n"}
    lines = _lines(out)
    assert [r["status"] for r in lines] == ["ok", "ok", "error"]
    assert lines[0]["rouge"] and lines[0]["reference"].endswith("doc0.ref.txt")
    assert lines[0]["settings"]["profile"] == "cpu" and lines[0]["document"]["kind"] == "text"
    assert "failed" in result.stderr and "rouge1" in result.stderr  # per-doc line + table
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 2 and "--resume" in again.stderr, show(again)
    resumed = CliRunner().invoke(app, args + ["--resume"])
    assert resumed.exit_code == 6 and len(_lines(out)) == 3, show(resumed)  # nothing redone


def test_batch_ctrl_c_then_resume(tiny, tmp_path, monkeypatch):
    import hisparse_cli.job as job_module

    _docs(tmp_path / "in", 3)
    out = tmp_path / "r.jsonl"
    args = ["batch", str(tmp_path / "in"), "--out", str(out), "--model", str(tiny), *TINY_FLAGS]
    real = job_module.summarize_document
    ran = []

    def interrupt_third(doc, *a, **kw):
        if Path(doc.source).name == "doc2.txt" and not ran.count("resume"):
            raise KeyboardInterrupt
        ran.append(Path(doc.source).name)
        return real(doc, *a, **kw)

    monkeypatch.setattr(job_module, "summarize_document", interrupt_third)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 130, show(result)
    assert "--resume" in result.stderr and len(_lines(out)) == 2
    ran.append("resume")
    resumed = CliRunner().invoke(app, args + ["--resume"])
    assert resumed.exit_code == 0, show(resumed)
    assert ran == ["doc0.txt", "doc1.txt", "resume", "doc2.txt"]
    assert sorted(Path(r["input"]).name for r in _lines(out)) == ["doc0.txt", "doc1.txt",
                                                                  "doc2.txt"]


def test_batch_model_error_stops_before_writing(tmp_path):
    _docs(tmp_path / "in", 2)
    out = tmp_path / "r.jsonl"
    result = CliRunner().invoke(app, ["batch", str(tmp_path / "in"), "--out", str(out),
                                      "--model", str(tmp_path / "no-model")])
    assert result.exit_code == 4, show(result)
    assert not out.exists() or out.read_text() == ""


def test_batch_with_no_documents_is_an_input_error(tmp_path):
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(app, ["batch", str(tmp_path / "empty"), "--out",
                                      str(tmp_path / "r.jsonl")])
    assert result.exit_code == 3 and "no documents" in result.stderr, show(result)


def test_fake_job_matches_job_interface():
    import inspect

    from hisparse_cli.job import Job

    assert inspect.signature(FakeJob.run).parameters.keys() == \
        inspect.signature(Job.run).parameters.keys()
    assert hasattr(Job, "loaded") and hasattr(Job, "engine")
