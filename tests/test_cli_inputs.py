"""CLI tests of issue 40: stdin, one writer per results file, git's view and secrets with
`document.items`, folders of documents, progress lines in logs, messages, `plan PATH`, and
errors that need no model coming before torch is imported.

The tiny random model (helpers_tokenizer) keeps them fast; the oracles are the same run on a
file (stdin), git itself, a second process holding the lock (and then killed with SIGKILL),
the summarize run's own JSON (plan PATH), and `sys.modules` of a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from helpers_cli import assert_error, run, show
from helpers_tokenizer import make_tiny_model_dir
from hisparse_cli.cli.app import app

ROOT = Path(__file__).resolve().parent.parent
TINY_FLAGS = ["--profile", "cpu", "-n", "6", "--window", "64", "--prefill-chunk", "64",
              "--global-tokens", "8", "--recalibrate-every", "64", "--recalibrate-topk", "8"]
TEXT = ("The provider shall host the platform. The client pays a monthly fee of EUR 7,400 "
        "within thirty days. Either party may end the agreement with ninety days notice.\n")
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HISPARSE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HISPARSE_DEBUG", raising=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("cli40"), max_position_embeddings=1024)


@pytest.fixture
def doc(tmp_path) -> Path:
    path = tmp_path / "deal.txt"
    path.write_text(TEXT * 2, encoding="utf-8")
    return path


def run_input(*args, input: bytes):
    return CliRunner().invoke(app, [str(a) for a in args], input=input)


# --- 1. stdin --------------------------------------------------------------------------------
def test_stdin_is_summarized_like_the_same_file(tiny, doc):
    from_file = run("summarize", doc, "--model", tiny, "--json", *TINY_FLAGS)
    assert from_file.exit_code == 0, show(from_file)
    piped = run_input("summarize", "-", "--title", "deal", "--model", tiny, "--json",
                      *TINY_FLAGS, input=doc.read_bytes())
    assert piped.exit_code == 0, show(piped)
    a, b = json.loads(from_file.stdout), json.loads(piped.stdout)
    assert b["document"]["source"] == "<stdin>" and b["document"]["title"] == "deal"
    assert b["prompt_tokens"] == a["prompt_tokens"] and b["summary"] == a["summary"]
    assert b["document"]["genre"] == a["document"]["genre"]
    empty = run_input("summarize", "-", "--model", tiny, *TINY_FLAGS, input=b"")
    assert_error(empty, 3, "stdin is empty")


def test_batch_takes_a_document_or_the_list_from_stdin(tiny, doc, tmp_path):
    out = tmp_path / "r.jsonl"
    result = run_input("batch", "-", "--out", out, "--model", tiny, "-q", *TINY_FLAGS,
                       input=doc.read_bytes())
    assert result.exit_code == 0, show(result)
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["input"] == "-" and record["status"] == "ok"
    assert record["document"]["source"] == "<stdin>"
    again = run_input("batch", "-", "--out", out, "--resume", "--model", tiny, "-q",
                      *TINY_FLAGS, input=doc.read_bytes())
    assert again.exit_code == 0 and len(out.read_text().splitlines()) == 1  # same bytes: done
    listed = tmp_path / "l.jsonl"
    result = run_input("batch", "@-", "--out", listed, "--model", tiny, "-q", *TINY_FLAGS,
                       input=f"{doc}\n# a comment\n".encode())
    assert result.exit_code == 0, show(result)
    assert [json.loads(x)["input"] for x in listed.read_text().splitlines()] == [str(doc)]
    both = run_input("batch", "-", "@-", "--out", tmp_path / "x.jsonl", input=b"x\n")
    assert_error(both, 2, "stdin can be read once")


# --- 2. one writer per results file ---------------------------------------------------------
HOLDER = ("import sys, time\nfrom pathlib import Path\nfrom hisparse_cli.summarize.batch import ResultsFile\n"
          "r = ResultsFile(Path(sys.argv[1])); r.open(resume=sys.argv[2] == 'resume')\n"
          "print('locked', flush=True)\ntime.sleep(300)\n")


def _hold(path: Path, resume: bool = False) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path),
                             "resume" if resume else "new"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_writer_is_refused_and_a_killed_writers_lock_is_ignored(tiny, doc, tmp_path):
    out = tmp_path / "r.jsonl"
    holder = _hold(out)
    try:  # the model does not exist: refused before any model is resolved or loaded
        second = run("batch", doc, "--out", out, "--model", tmp_path / "no-model", *TINY_FLAGS)
        assert_error(second, 3, "being written by another hisparse run", "--out")
        resumed = run("batch", doc, "--out", out, "--resume", "--model", tmp_path / "no-model")
        assert_error(resumed, 3, "being written by another hisparse run")
    finally:
        holder.send_signal(signal.SIGKILL)  # no cleanup of any kind
        holder.wait()
    assert out.exists()  # the killed writer's (empty) file is still there, its lock is not
    result = run("batch", doc, "--out", out, "--model", tiny, "-q", *TINY_FLAGS)
    assert result.exit_code == 0, show(result)
    assert [json.loads(x)["status"] for x in out.read_text().splitlines()] == ["ok"]


def test_a_refused_or_failed_run_leaves_no_empty_results_file(doc, tmp_path):
    out = tmp_path / "r.jsonl"
    result = run("batch", doc, "--out", out, "--profile", "toaster-1g")
    assert_error(result, 2, "unknown profile")
    assert not out.exists()


# --- 3. git's view, secrets, document.items --------------------------------------------------
def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout


@needs_git
def test_repository_json_lists_every_file_read_and_reports_secrets(tiny, tmp_path):
    root = tmp_path / "repo"
    files = {".gitignore": "gen.py\n*.log\n", "app.py": "def main():\n    return 1\n",
             "gen.py": "GENERATED = True\n", "new.py": "import app\n", "run.log": "LEAK\n",
             ".env": "TOKEN=LEAK-ENV\n",
             "keys/deploy.txt": "-----BEGIN RSA PRIVATE KEY-----\nLEAK\n-----END RSA PRIVATE KEY-----\n"}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    _git(root, "init", "-q")
    _git(root, "add", ".gitignore", "app.py")
    _git(root, "add", "-f", "gen.py")  # tracked although .gitignore matches it
    result = run("summarize", root, "--model", tiny, "--json", *TINY_FLAGS)
    assert result.exit_code == 0, show(result)
    document = json.loads(result.stdout)["document"]
    items = {item["path"]: item for item in document["items"]}
    assert set(items) == {".gitignore", "app.py", "gen.py", "new.py"}
    for rel, item in items.items():
        assert item["bytes"] == (root / rel).stat().st_size and item["tokens"] > 0
    reasons = {s["item"]: s["reason"] for s in document["skipped_items"]}
    assert reasons["run.log"] == "ignored by .gitignore"
    assert reasons[".env"].startswith("secret (environment file)")
    assert reasons["keys/deploy.txt"].startswith("secret (contains a private key)")
    included = run("summarize", root, "--model", tiny, "--json", "--include-secrets", *TINY_FLAGS)
    assert included.exit_code == 0, show(included)
    paths = {i["path"] for i in json.loads(included.stdout)["document"]["items"]}
    assert {".env", "keys/deploy.txt"} <= paths and "run.log" not in paths


# --- 4. a folder of documents ---------------------------------------------------------------
def test_a_folder_of_prose_is_a_collection_not_code(tiny, tmp_path):
    from test_formats import PAGE, make_docx

    folder = tmp_path / "case"
    folder.mkdir()
    (folder / "facts.md").write_text("# Facts\n" + TEXT)
    (folder / "letter.txt").write_text(TEXT)
    (folder / "exhibit.html").write_text(PAGE)
    make_docx(folder / "contract.docx")
    result = run("summarize", folder, "--model", tiny, "--json", *TINY_FLAGS)
    assert result.exit_code == 0, show(result)
    document = json.loads(result.stdout)["document"]
    assert document["kind"] == "collection" and document["genre"] != "code"
    assert document["unit"] == "documents" and document["sections"] == 4
    assert [i["path"] for i in document["items"]] == ["contract.docx", "exhibit.html",
                                                      "facts.md", "letter.txt"]


# --- 5. progress in logs ----------------------------------------------------------------------
def test_progress_lines_in_a_log_and_none_with_quiet(tiny, doc, monkeypatch):
    import hisparse_cli.console as console

    monkeypatch.setattr(console, "LOG_EVERY_S", 0.0)  # every report past the start
    result = run("summarize", doc, "--model", tiny, "--json", *TINY_FLAGS)
    assert result.exit_code == 0, show(result)
    err = result.stderr
    assert f"hisparse: reading {doc}" in err and "hisparse: loading model llama" in err
    record = json.loads(result.stdout)
    # the first generation's lines (a random model's summary is then retried by the guard:
    # each retry logs its own lines, "summary (retry N): …")
    first = record["runs"][0]["stats"]
    prompt, new = first["prompt_tokens"], first["new_tokens"]
    assert f"hisparse: summary: prefill of {prompt:,} tokens" in err
    during = re.findall(r"summary · prefill: (\d+)/(\d+) tokens, [\d.,]+ tok/s, ETA \d+ s", err)
    assert during and all(int(a) < int(b) == prompt for a, b in during), err
    # the new-token count is the same in the log line and the JSON; the table's is the total
    assert f"summary: {prompt:,} prompt tokens" in err and f", {new:,} new tokens (" in err
    total = record["stats"]["new_tokens"]
    assert re.search(rf"new tokens\s*│?\s*{total}\b", err), err
    quiet = run("summarize", doc, "--model", tiny, "-q", *TINY_FLAGS)
    assert quiet.exit_code == 0 and quiet.stderr == "", show(quiet)


def test_progress_lines_at_most_every_interval(monkeypatch, capsys):
    import hisparse_cli.console as console

    now = [0.0]
    monkeypatch.setattr(console.time, "perf_counter", lambda: now[0])
    with console.TokenProgress(log_every_s=10.0) as progress:
        progress("summary", "prefill", 0, 1000)
        for t, done in ((4.0, 100), (10.5, 250), (12.0, 300), (21.0, 500), (25.0, 1000)):
            now[0] = t
            progress("summary", "prefill", done, 1000)
    lines = [x for x in capsys.readouterr().err.splitlines() if "·" in x]
    assert lines == ["hisparse: summary · prefill: 250/1,000 tokens, 23.8 tok/s, ETA 32 s",
                     "hisparse: summary · prefill: 500/1,000 tokens, 23.8 tok/s, ETA 21 s"]


def test_model_conversion_progress_obeys_the_same_rule(monkeypatch, capsys):
    import hisparse_cli.console as console
    from hisparse_cli.hub.convert import _quiet_transformers
    from hisparse_cli.hub.progress import Reporter

    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    now = [0.0]
    monkeypatch.setattr("time.perf_counter", lambda: now[0])

    def tick(items):
        for item in items:
            now[0] += 4.0
            yield item

    lines = []
    with _quiet_transformers(Reporter(lines.append)):  # a log: lines at most every 10 s
        assert list(gguf_utils.tqdm(tick(range(10)), desc="x", total=10)) == list(range(10))
    assert lines[0] == "dequantizing GGUF tensors: 0/10"
    assert lines[1:] == ["dequantizing GGUF tensors: 3/10 (0.2/s, ETA 28 s)",
                         "dequantizing GGUF tensors: 6/10 (0.2/s, ETA 16 s)",
                         "dequantizing GGUF tensors: 9/10 (0.2/s, ETA 4 s)"]
    with _quiet_transformers(Reporter(None)):  # -q: nothing at all
        assert list(gguf_utils.tqdm(range(3), desc="x")) == [0, 1, 2]
    assert capsys.readouterr().err == "" and gguf_utils.tqdm.__module__.startswith("tqdm")
    assert console.LOG_EVERY_S == 10.0


# --- 6. messages -------------------------------------------------------------------------------
def test_remote_code_is_ignored_with_a_warning(tiny, doc, tmp_path):
    folder = tmp_path / "custom"
    shutil.copytree(tiny, folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomModel"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_custom.py").write_text("raise SystemExit('LEAK: remote code ran')\n")
    result = run("summarize", doc, "--model", folder, *TINY_FLAGS)
    assert result.exit_code == 0, show(result)
    assert "Warning:" in result.stderr and "never runs it" in result.stderr


def test_the_pickle_refusal_never_suggests_loading_the_folder(tmp_path, doc):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "pytorch_model.bin").write_bytes(b"not loaded")
    result = run("summarize", doc, "--model", folder, "--profile", "cpu")
    assert_error(result, 4, "never pickle")
    assert "from_pretrained" not in result.stderr and "save_pretrained" not in result.stderr


NO_TORCH = ("import sys\nfrom hisparse_cli.cli.app import main\nsys.argv = ['hisparse'] + sys.argv[1:]\n"
            "try:\n    main()\nexcept SystemExit as exc:\n    code = exc.code\n"
            "print('MODULES', 'torch' in sys.modules, 'transformers' in sys.modules, code, "
            "file=sys.stderr)\n")


def _fresh(*args: str, stdin: bytes = b"") -> tuple[str, list[str]]:
    done = subprocess.run([sys.executable, "-c", NO_TORCH, *map(str, args)], input=stdin,
                          capture_output=True, env={**os.environ, "HISPARSE_DEBUG": ""})
    err = done.stderr.decode()
    return err, err.strip().splitlines()[-1].split()


def test_errors_that_need_no_model_come_before_torch_is_imported(doc, tmp_path):
    missing = tmp_path / "missing.txt"
    cases = [
        (("summarize", missing), "3", "no such file"),
        (("summarize", doc, "--out", tmp_path / "no" / "dir" / "s.txt"), "3", "does not exist"),
        (("summarize", doc, "--profile", "toaster-1g"), "2", "unknown profile"),
        (("summarize", doc, "--reference", missing), "3", "no such file"),
        (("summarize", "-"), "3", "stdin is empty"),
        (("batch", doc, "--out", tmp_path / "no" / "r.jsonl"), "3", "does not exist"),
        (("batch", missing, "--out", tmp_path / "r.jsonl", "--profile", "toaster-1g"), "2",
         "unknown profile"),
        (("plan", missing), "3", "no such file"),
    ]
    for args, code, needle in cases:
        err, last = _fresh(*args)
        assert last == ["MODULES", "False", "False", code], (args, err)
        assert needle in err, (args, err)
    holder = _hold(tmp_path / "held.jsonl")
    try:
        err, last = _fresh("batch", doc, "--out", tmp_path / "held.jsonl")
        assert last == ["MODULES", "False", "False", "3"] and "another hisparse run" in err, err
    finally:
        holder.kill()
        holder.wait()


# --- 9. plan PATH -----------------------------------------------------------------------------
def _plan_and_run(tiny, path, *extra, input: bytes | None = None):
    args = [path, "--model", tiny, "--json", *TINY_FLAGS, *extra]
    if input is None:
        planned, ran = run("plan", *args), run("summarize", *args)
    else:
        planned, ran = run_input("plan", *args, input=input), run_input("summarize", *args,
                                                                        input=input)
    assert planned.exit_code == 0, show(planned)
    assert ran.exit_code == 0, show(ran)
    return json.loads(planned.stdout), json.loads(ran.stdout)


def test_plan_path_matches_the_summarize_run_stream(tiny, doc):
    plan, record = _plan_and_run(tiny, doc)
    # the summary's prompt (the random model's summary is then retried by the guard with the
    # same prompt; the plan counts one generation)
    prompt = record["runs"][0]["stats"]["prompt_tokens"]
    assert plan["input"]["strategy"] == record["strategy"] == "stream"
    assert plan["input"]["prompt_tokens"] == prompt
    assert plan["input"]["chunk_count"] == 0 and plan["input"]["attention"] == "sparse"
    assert plan["input"]["attention_choice"] == record["settings"]["attention"]  # one rule
    assert plan["settings"]["context_tokens"] == prompt  # the memory plan
    assert plan["input"]["document"]["kind"] == "text"
    piped, from_stdin = _plan_and_run(tiny, "-", "--title", "deal", input=doc.read_bytes())
    assert (piped["input"]["prompt_tokens"] == from_stdin["runs"][0]["stats"]["prompt_tokens"]
            == prompt)


def test_plan_path_matches_the_summarize_run_map_reduce(tiny):
    sample = ROOT / "samples" / "medical" / "discharge_report.txt"
    plan, record = _plan_and_run(tiny, sample)
    assert plan["input"]["strategy"] == record["strategy"] == "map-reduce"
    parts = [c for c in record["chunks"] if c["level"] == 0]
    assert [(c["label"], c["prompt_tokens"]) for c in plan["input"]["chunks"]] == [
        (c["label"], c["prompt_tokens"]) for c in parts]
    assert plan["input"]["chunk_count"] == len(parts) >= 2


def test_plan_path_table_and_usage(tiny, doc):
    table = run("plan", doc, "--model", tiny, *TINY_FLAGS)
    assert table.exit_code == 0, show(table)
    for needle in ("document tokens", "strategy", "stream (1 chunk)", "attention", "peak allocated"):
        assert needle in table.stdout, needle
    assert_error(run("plan", doc, "--context", "100", "--model", tiny), 2, "--context")
    assert_error(run("plan", doc, "--model", "llama-3-8b"), 2, "without a tokenizer")


@pytest.mark.slow
@pytest.mark.parametrize("document", ["contract/services_agreement.pdf", "repo/tinykv"])
def test_plan_path_matches_the_real_model_run(document, real_home):
    """The embedded model (conftest.real_model_home): plan PATH's prompt tokens, strategy and
    chunks are the summarize run's."""
    path = ROOT / "samples" / document
    flags = ["--profile", "cpu", "--max-new-tokens", "16", "--json"]
    planned, ran = run("plan", path, *flags), run("summarize", path, *flags)
    assert planned.exit_code == 0, show(planned)
    assert ran.exit_code == 0, show(ran)
    plan, record = json.loads(planned.stdout)["input"], json.loads(ran.stdout)
    assert plan["strategy"] == record["strategy"]
    if record["strategy"] == "stream":  # each generation (the guard may retry) reads it all
        assert {r["stats"]["prompt_tokens"] for r in record["runs"]} == {plan["prompt_tokens"]}
    else:
        assert [(c["label"], c["prompt_tokens"]) for c in plan["chunks"]] == [
            (c["label"], c["prompt_tokens"]) for c in record["chunks"] if c["level"] == 0]
    assert [i["path"] for i in plan["document"]["items"]] == [
        i["path"] for i in record["document"]["items"]]
