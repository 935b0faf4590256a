"""Batch: input expansion, reference matching, the append-only results file, resume after an
interruption or a torn last line (nothing lost, nothing redone), failures recorded with their
exit codes, and the `hisparse batch` command end to end on the tiny model.

Most tests swap the summarizer for a counting fake (`FakeJob`, helpers_batch.py / a patched
`summarize_document`), so resume behaviour is checked by counting what actually ran.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from helpers_batch import FakeJob
from helpers_batch import docs as _docs
from helpers_tokenizer import make_tiny_model_dir
from hisparse_cli.summarize.batch import ResultsFile, content_sha256, expand_inputs, find_reference
from hisparse_cli.summarize.batch_runner import batch_summary, run_batch
from hisparse_cli.cli.app import app
from hisparse_cli.errors import ConfigError, InputError
from hisparse_cli.scoring import bootstrap_ci

TINY_FLAGS = ["--profile", "cpu", "-n", "4", "--window", "64", "--prefill-chunk", "64",
              "--global-tokens", "8", "--recalibrate-every", "64", "--recalibrate-topk", "8"]


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HISPARSE_HOME", str(tmp_path / "home"))


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


def test_list_files_take_trailing_comments_and_names_as_the_os_has_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    docs = _docs(tmp_path, 2)
    odd = _undecodable_name(tmp_path / "odd")
    hashed = tmp_path / "a#1.txt"
    hashed.write_text("x")
    (tmp_path / "list.txt").write_bytes(b"  # full-line comment\ndoc0.txt  # the first one\n"
                                        b"doc1.txt\t# tab, then a comment\na#1.txt\n"
                                        b"odd/caf\xe9.txt\n")  # a Latin-1 name, not UTF-8
    got = [p for _, p in expand_inputs(["@list.txt"])]
    assert got == [docs[0].resolve(), docs[1].resolve(), hashed.resolve(), odd.resolve()]


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


def test_unreadable_reference_keeps_the_summary_with_a_warning(tmp_path):
    docs = _docs(tmp_path / "in", 3)
    docs[0].with_suffix(".ref.txt").write_text("")  # empty
    docs[1].with_suffix(".ref.txt").write_bytes("Le résumé du café.".encode("cp1252"))
    docs[2].with_suffix(".ref.txt").write_bytes(b"\x00\x01\x02\x03binary")
    items = expand_inputs([str(tmp_path / "in")])
    results = ResultsFile(tmp_path / "r.jsonl")
    results.open(resume=False)
    job = FakeJob()
    outcome = run_batch(items, job, results)
    lines = _lines(tmp_path / "r.jsonl")
    assert [r["status"] for r in lines] == ["ok", "ok", "ok"]
    assert job.ran == ["doc0.txt", "doc1.txt", "doc2.txt"]  # the model ran for every one
    assert lines[0]["rouge"] is None and "is empty" in lines[0]["warnings"][0]
    assert lines[2]["rouge"] is None and "binary" in lines[2]["warnings"][0]
    assert job.references["doc1.txt"] == "Le résumé du café."  # cp1252, as for documents
    assert lines[1]["rouge"] and lines[1]["warnings"] == []
    summary = batch_summary(results, outcome.keys)
    assert (summary["ok"], summary["failed"], len(summary["warnings"])) == (3, 0, 2)


def test_reference_path_is_resolved_wherever_it_was_found(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    docs = _docs(tmp_path / "in", 2)
    docs[0].with_suffix(".ref.txt").write_text("beside")
    (tmp_path / "refs").mkdir()
    (tmp_path / "refs" / "doc1.txt").write_text("from --references")
    results = ResultsFile(tmp_path / "r.jsonl")
    results.open(resume=False)
    run_batch(expand_inputs(["in"]), FakeJob(), results, references=Path("refs"))
    refs = [r["reference"] for r in _lines(tmp_path / "r.jsonl")]
    assert refs == [str(docs[0].with_suffix(".ref.txt").resolve()),
                    str((tmp_path / "refs" / "doc1.txt").resolve())]


def test_guard_warnings_are_kept_beside_reference_warnings(tmp_path, monkeypatch):
    class GuardedJob(FakeJob):
        def run(self, doc, **kw):
            out = super().run(doc, **kw)
            out["warnings"] = ["final summary: loop (…); retried with repetition penalty 1.3"]
            return out

    monkeypatch.chdir(tmp_path)
    docs = _docs(tmp_path / "in", 1)
    docs[0].with_suffix(".ref.txt").write_bytes(b"")  # an empty reference: no ROUGE
    results = ResultsFile(tmp_path / "r.jsonl")
    results.open(resume=False)
    run_batch(expand_inputs(["in"]), GuardedJob(), results)
    [record] = _lines(tmp_path / "r.jsonl")
    assert record["status"] == "ok" and len(record["warnings"]) == 2
    assert record["warnings"][0].startswith("no ROUGE") and "retried" in record["warnings"][1]


def test_folder_sha_changes_with_content(tmp_path):
    repo = tmp_path / "r"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "a.py").write_text("x = 1\n")
    before = content_sha256(repo)
    (repo / "pkg" / "a.py").write_text("x = 2\n")
    assert content_sha256(repo) != before


def _walk_sha(folder: Path) -> str:
    """The folder fingerprint's formula written out with os.walk (oracle for plain trees)."""
    import hashlib
    import os

    digest = hashlib.sha256()
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            file = Path(root) / name
            digest.update(os.fsencode(file.relative_to(folder).as_posix()) + b"\0")
            digest.update(hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()


def test_folder_sha_covers_what_is_read_and_streams(tmp_path):
    import os
    import tracemalloc

    repo = tmp_path / "r"
    for rel, text in {"a.txt": "a\n", "pkg/m.py": "m = 1\n", "pkg/sub/q.py": "q\n",
                      "Z.md": "z\n", "a/b.md": "b\n"}.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    plain = content_sha256(repo)
    assert plain == _walk_sha(repo) == content_sha256(repo)  # stable, same as before
    (repo / ".gitignore").write_text("data/\n")
    with_ignore = content_sha256(repo)
    (repo / "data").mkdir()
    with open(repo / "data" / "weights.bin", "wb") as handle:  # sparse: no disk used
        handle.truncate(64 << 20)
    (repo / ".git").mkdir()
    (repo / ".git" / "index").write_bytes(b"changes all the time")
    with open(repo / "huge.txt", "wb") as handle:  # over the per-file limit: not read
        handle.truncate(32 << 20)
    with open(os.path.join(os.fsencode(repo), b"caf\xe9.txt"), "wb") as handle:
        handle.write(b"latin-1 name\n")
    tracemalloc.start()
    try:
        named = content_sha256(repo)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak  # nothing read whole; ignored/oversized files not read
    (repo / "data" / "weights.bin").write_bytes(b"other")
    (repo / "huge.txt").write_bytes(b"x" * (40 << 20))
    assert content_sha256(repo) == named != with_ignore
    single = repo / "big.md"
    with open(single, "wb") as handle:
        handle.truncate(48 << 20)
    tracemalloc.start()
    try:
        content_sha256(single)
        assert tracemalloc.get_traced_memory()[1] < 8 << 20
    finally:
        tracemalloc.stop()


# --- results file ------------------------------------------------------------------------------
def test_results_file_refuses_to_mix_runs_and_cuts_a_torn_tail(tmp_path):
    path = tmp_path / "r.jsonl"
    results = ResultsFile(path)
    results.open(resume=False)
    results.append({"input": "a", "sha256": "1", "status": "ok"})
    results.close()  # the first run ended
    with pytest.raises(ConfigError, match="already exists"):
        ResultsFile(path).open(resume=False)
    with open(path, "a") as handle:
        handle.write('{"input": "b", "sha2')  # killed mid-line
    again = ResultsFile(path)
    again.open(resume=True)
    assert again.torn_bytes > 0 and [r["input"] for r in again.records] == ["a"]
    assert path.read_text().endswith('"ok"}\n')  # the intact prefix, byte for byte


def _resume(path: Path) -> ResultsFile:
    results = ResultsFile(path)
    results.open(resume=True)
    return results


REC_A = '{"input": "a", "sha256": "1", "status": "ok"}\n'
REC_B = '{"input": "b", "sha256": "2", "status": "error"}\n'


@pytest.mark.parametrize("middle", ["not json at all\n", '{"input": "x", "sha2\n',
                                    '{"note": "hand-written"}\n', "[1, 2]\n"])
def test_resume_refuses_a_bad_middle_line_and_changes_nothing(tmp_path, middle):
    path = tmp_path / "r.jsonl"
    path.write_text(REC_A + middle + REC_B)
    before = path.read_bytes()
    with pytest.raises(InputError, match="line 2 is not a result record") as info:
        _resume(path)
    assert "left unchanged" in info.value.message and "line 2" in info.value.hint
    assert path.read_bytes() == before  # the later complete record is still there


def test_resume_skips_blank_lines_anywhere(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text("\n" + REC_A + "\n   \n" + REC_B + "\n")
    before = path.read_bytes()
    results = _resume(path)
    assert [r["input"] for r in results.records] == ["a", "b"] and results.torn_bytes == 0
    assert path.read_bytes() == before


def test_resume_cuts_only_a_torn_last_line(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(REC_A + '{"input": "b", "sha2\n\n')  # cut short, even with a newline
    results = _resume(path)
    assert [r["input"] for r in results.records] == ["a"] and path.read_text() == REC_A
    results.close()
    path.write_text(REC_A + "\0" * 40)  # a crash left NUL bytes where the last write went
    assert [r["input"] for r in _resume(path).records] == ["a"] and path.read_text() == REC_A
    path.write_text('{"inp')  # killed during the very first record
    assert _resume(path).records == [] and path.read_bytes() == b""


def test_resume_keeps_a_complete_last_record_without_its_newline(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(REC_A + REC_B.rstrip("\n"))
    results = _resume(path)
    assert [r["input"] for r in results.records] == ["a", "b"] and results.unterminated
    assert path.read_text() == REC_A + REC_B
    results.append({"input": "c", "sha256": "3", "status": "ok"})
    assert [r["input"] for r in _lines(path)] == ["a", "b", "c"]


@pytest.mark.parametrize("content", ["# My notes\n\nbuy milk\n", "just one line, no newline",
                                     '{"name": "config"}\n', '{"a": 1}'])
def test_resume_refuses_a_file_that_is_not_a_results_file(tmp_path, content):
    path = tmp_path / "notes.md"
    path.write_text(content)
    with pytest.raises(InputError, match="is not a hisparse results file"):
        _resume(path)
    assert path.read_text() == content


def test_batch_command_refuses_to_resume_into_a_users_file(tmp_path, monkeypatch):
    _docs(tmp_path / "in", 1)
    notes = tmp_path / "notes.md"
    notes.write_text("# Notes\nremember the milk\n")
    monkeypatch.setattr("hisparse_cli.cli.summarize.build_job", lambda opts: FakeJob())
    result = CliRunner().invoke(app, ["batch", str(tmp_path / "in"), "--out", str(notes),
                                      "--resume"])
    assert result.exit_code == 3, show(result)
    assert "is not a hisparse results file" in result.stderr and "Traceback" not in result.stderr
    assert notes.read_text() == "# Notes\nremember the milk\n"
    bad = tmp_path / "r.jsonl"
    bad.write_text(REC_A + "oops\n" + REC_B)
    result = CliRunner().invoke(app, ["batch", str(tmp_path / "in"), "--out", str(bad),
                                      "--resume"])
    assert result.exit_code == 3 and "line 2" in result.stderr, show(result)
    assert bad.read_text() == REC_A + "oops\n" + REC_B


def test_append_writes_nothing_partial_when_the_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "r.jsonl"
    results = ResultsFile(path)
    results.open(resume=False)
    results.append({"input": "a", "sha256": "1", "status": "ok"})
    real_write = os.write

    def half_then_full(fd, data):
        if len(data) > 10:
            real_write(fd, bytes(data[:10]))
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(InputError, match="No space left on device"):
        results.append({"input": "b", "sha256": "2", "status": "ok"})
    monkeypatch.undo()
    assert [r["input"] for r in _lines(path)] == ["a"]  # no torn half line


def _undecodable_name(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = Path(os.fsdecode(os.fsencode(folder) + b"/caf\xe9.txt"))  # "caf\udce9.txt"
    try:
        path.write_text("Document number 9. The provider delivers item 9 on time.\n")
    except (OSError, UnicodeEncodeError):
        pytest.skip("this file system refuses names that are not UTF-8")
    return path


def test_non_utf8_file_names_are_written_printably_and_match_on_resume(tmp_path):
    path = _undecodable_name(tmp_path / "in")
    items = expand_inputs([str(tmp_path / "in"), str(tmp_path / "in" / "gon\udce9.txt")])
    out = tmp_path / "r.jsonl"
    results = ResultsFile(out)
    results.open(resume=False)
    job = FakeJob()
    outcome = run_batch(items, job, results)
    lines = _lines(out)  # valid UTF-8 JSON
    assert [r["status"] for r in lines] == ["ok", "error"] and job.ran == [path.name]
    assert lines[0]["input"].endswith("caf\\xe9.txt")
    assert lines[0]["given"].endswith("caf\\xe9.txt")
    assert "gon\\xe9.txt" in lines[1]["error"]["message"]  # the message names it the same way
    assert batch_summary(results, outcome.keys)["documents"] == 2
    results.close()
    again = FakeJob()
    outcome = run_batch(items, again, _resume(out))
    assert again.ran == [] and outcome.skipped == 2  # both matched again


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
    results.close()  # the interrupted run ended
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
    results.close()
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
    results.close()
    docs[0].write_text("an edited document\n")
    job = FakeJob()
    again = ResultsFile(out)
    again.open(resume=True)
    run_batch(items, job, again)
    again.close()
    assert job.ran == ["doc0.txt"]  # edited → new sha; the failed doc1 is left alone
    retry = FakeJob()
    third = ResultsFile(out)
    third.open(resume=True)
    outcome = run_batch(items, retry, third, retry_failed=True)
    assert retry.ran == ["doc1.txt"]
    assert batch_summary(third, outcome.keys)["failed"] == 0  # the latest record wins


def test_resume_reports_failures_as_failed_earlier(tmp_path, capsys):
    from hisparse_cli.cli.batch import _reporter

    _docs(tmp_path / "in", 2)
    items = expand_inputs([str(tmp_path / "in")])
    out = tmp_path / "r.jsonl"
    results = ResultsFile(out)
    results.open(resume=False)
    run_batch(items, FakeJob({"doc1.txt": InputError("bad")}), results)
    results.close()
    capsys.readouterr()
    outcome = run_batch(items, FakeJob(), _resume(out), report=_reporter(False))
    err = capsys.readouterr().err
    assert (outcome.skipped, outcome.skipped_failed) == (2, 1)
    assert "doc0.txt: already done" in err
    assert "doc1.txt: failed earlier (use --retry-failed to run it again)" in err


def test_one_scored_document_has_no_interval(tmp_path):
    from hisparse_cli.cli.batch import _summary_table
    from hisparse_cli.console import stderr_console

    docs = _docs(tmp_path / "in", 2)
    docs[0].with_suffix(".ref.txt").write_text("reference")
    results = ResultsFile(tmp_path / "r.jsonl")
    results.open(resume=False)
    outcome = run_batch(expand_inputs([str(tmp_path / "in")]), FakeJob(), results)
    summary = batch_summary(results, outcome.keys)
    assert summary["rouge"]["rougeL"] == {"mean": 0.4, "lo": None, "hi": None, "n": 1}
    console = stderr_console()
    with console.capture() as captured:
        console.print(_summary_table(summary))
    assert "n/a" in captured.get() and "[0.4000, 0.4000]" not in captured.get()


def test_resume_warns_about_records_made_with_other_settings(tmp_path):
    from hisparse_cli.summarize.batch_runner import other_settings, settings_difference
    from hisparse_cli.cli.options import RunOptions
    from hisparse_cli.cli.summarize import build_job

    _docs(tmp_path / "in", 2)
    items = expand_inputs([str(tmp_path / "in")])
    out = tmp_path / "r.jsonl"
    results = ResultsFile(out)
    results.open(resume=False)
    run_batch(items, FakeJob(settings="a"), results)
    results.close()
    assert {r["settings_id"] for r in _lines(out)} == {"id-a"}
    assert other_settings(_resume(out), "id-a") == []
    assert len(other_settings(_resume(out), "id-b")) == 2
    with open(out, "a") as handle:  # a record from before settings_id: taken as matching
        handle.write('{"input": "old", "sha256": "x", "status": "ok"}\n')
    assert len(other_settings(_resume(out), "id-b")) == 2

    short = build_job(RunOptions(profile="cpu", max_new_tokens=32, quiet=True))
    long = build_job(RunOptions(profile="cpu", max_new_tokens=64, quiet=True))
    assert short.settings_id() == build_job(RunOptions(profile="cpu", max_new_tokens=32,
                                                       quiet=True)).settings_id()
    assert short.settings_id() != long.settings_id()
    record = {"settings": {**short.settings_view(), "model": {"name": "m"}, "max_positions": 8}}
    assert settings_difference(record, long.settings_view()) == ["max_new_tokens: 32 → 64"]
    assert settings_difference(record, short.settings_view()) == []


def test_batch_command_warns_on_other_settings_and_hints_retry(tmp_path, monkeypatch):
    _docs(tmp_path / "in", 2)
    out = tmp_path / "r.jsonl"
    jobs = iter([FakeJob({"doc1.txt": InputError("bad")}, settings="a"), FakeJob(settings="b")])
    monkeypatch.setattr("hisparse_cli.cli.summarize.build_job", lambda opts: next(jobs))
    args = ["batch", str(tmp_path / "in"), "--out", str(out)]
    assert CliRunner().invoke(app, args).exit_code == 6
    resumed = CliRunner().invoke(app, args + ["--resume"])
    assert resumed.exit_code == 6, show(resumed)
    assert "1 finished document(s)" in resumed.stderr and "profile: a → b" in resumed.stderr
    assert "add --retry-failed" in resumed.stderr


def test_ctrl_c_before_anything_finished_says_nothing_was_written(tmp_path, monkeypatch):
    _docs(tmp_path / "in", 2)
    out = tmp_path / "r.jsonl"
    monkeypatch.setattr("hisparse_cli.cli.summarize.build_job",
                        lambda opts: FakeJob({"doc0.txt": KeyboardInterrupt()}))
    result = CliRunner().invoke(app, ["batch", str(tmp_path / "in"), "--out", str(out)])
    assert result.exit_code == 130, show(result)
    assert "nothing was written" in result.stderr and "keeps every" not in result.stderr
    assert not out.exists()


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
    import hisparse_cli.summarize.job as job_module

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

    from hisparse_cli.summarize.job import Job

    assert inspect.signature(FakeJob.run).parameters.keys() == \
        inspect.signature(Job.run).parameters.keys()
    assert hasattr(Job, "loaded") and hasattr(Job, "engine")


def test_retry_failed_needs_resume(tmp_path, monkeypatch):
    _docs(tmp_path / "in", 1)
    job = FakeJob()
    monkeypatch.setattr("hisparse_cli.cli.summarize.build_job", lambda opts: job)
    result = CliRunner().invoke(app, ["batch", str(tmp_path / "in"), "--out",
                                      str(tmp_path / "r.jsonl"), "--retry-failed"])
    assert result.exit_code == 2 and "--resume" in result.stderr, show(result)
    assert not (tmp_path / "r.jsonl").exists() and job.ran == []


def test_results_file_inside_an_input_folder_is_not_a_document(tmp_path, monkeypatch):
    _docs(tmp_path / "in", 2)
    out = tmp_path / "in" / "results.txt"  # a document suffix, in the folder being summarized
    job = FakeJob()
    monkeypatch.setattr("hisparse_cli.cli.summarize.build_job", lambda opts: job)
    args = ["batch", str(tmp_path / "in"), "--out", str(out)]
    assert CliRunner().invoke(app, args).exit_code == 0
    resumed = CliRunner().invoke(app, args + ["--resume"])
    assert resumed.exit_code == 0, show(resumed)
    assert job.ran == ["doc0.txt", "doc1.txt"] and len(_lines(out)) == 2
