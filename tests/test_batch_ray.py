"""`hisparse batch --ray` and the Ray Data entry point, on one local Ray cluster (2 CPUs, no
dashboard) shared by the module.

Oracles: the local batch of the same inputs (same lines, summaries and ROUGE, one thread each
side), the input list (every input exactly once), the worker processes' own pids (a killed
worker's document ran again elsewhere), and `Job.run` in this process for the Ray Data rows.
Worker deaths and Ctrl-C are real: a test SIGKILLs an actor process, a document kills its
own worker, and SIGINT goes to a driver subprocess's process group as a terminal sends it.
"""

from __future__ import annotations

import json
import re
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import helpers_batch
from helpers_batch import FakeJob, docs
from helpers_tokenizer import make_tiny_model_dir
from hisparse_cli.cli.app import app

TINY_FLAGS = ["--profile", "cpu", "-n", "4", "--window", "64", "--prefill-chunk", "64",
              "--global-tokens", "8", "--recalibrate-every", "64", "--recalibrate-topk", "8"]
TINY_SETTINGS = dict(profile="cpu", max_new_tokens=4, window_size=64, prefill_chunk=64,
                     global_tokens=8, recalibrate_every=64, recalibrate_topk=8)
TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(helpers_batch)  # workers need no tests/ on their path
    for attempt in range(3):  # on a busy machine Ray's raylet can miss Ray's 30 s start-up
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                     logging_level=logging.WARNING)
            break
        except Exception:  # noqa: BLE001 - Ray raises a plain Exception for that
            ray.shutdown()
            if attempt == 2:
                raise
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        cloudpickle.unregister_pickle_by_value(helpers_batch)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("ray"), max_position_embeddings=1024)


@pytest.fixture
def one_thread(monkeypatch):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers (--threads-per-worker 1): the same arithmetic
    monkeypatch.setenv("HISPARSE_THREADS", "1")  # the thread policy too (config/threads.py)
    yield
    torch.set_num_threads(before)


def _same_words(value):
    """`value` with the guard's word counts of a rejected draft ("empty (2 words)") made equal:
    the random tiny model's drafts are near-tied logits, whose argmax a worker process may break
    the other way; the records, the digest that replaces the drafts and every action match."""
    text = json.dumps(value)
    return json.loads(re.sub(r"\((\d+) words?\)", "(N words)", text))


def show(result) -> str:
    return (f"exit {result.exit_code}\n--- stdout ---\n{result.stdout}\n--- stderr ---\n"
            f"{result.stderr}\n--- exception ---\n{result.exception!r}")


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _by_input_latest(path: Path) -> dict[str, dict]:
    return {r["input"]: r for r in _lines(path)}


def _by_input(path: Path) -> dict[str, dict]:
    lines = _lines(path)
    by_input = {r["input"]: r for r in lines}
    assert len(by_input) == len(lines), "an input was written twice"
    return by_input


# --- flags, without a cluster ---------------------------------------------------------------
def test_a_folder_that_shadows_the_kernels_distribution_leaves_a_workers_path(tmp_path,
                                                                              monkeypatch):
    """Ray puts the driver's working directory on every worker's sys.path; run from a hisparse
    checkout that is the root, whose kernels/ folder transformers would import as `kernels`.
    (The module's cluster is started from where pytest runs, the root in CI: its workers
    meet exactly that.)"""
    from hisparse_cli.cluster.worker import drop_shadowing_paths

    checkout, plain, module = tmp_path / "checkout", tmp_path / "plain", tmp_path / "module"
    (checkout / "kernels").mkdir(parents=True)
    plain.mkdir()
    module.mkdir()
    (module / "kernels.py").write_text("")
    installed = next(p for p in sys.path if "site-packages" in p)
    monkeypatch.setattr(sys, "path", [str(checkout), str(plain), installed, str(module)])
    assert drop_shadowing_paths() == [str(checkout), str(module)]
    assert sys.path == [str(plain), installed]


def test_ray_flags_without_ray_installed_are_a_usage_error(tmp_path, monkeypatch):
    docs(tmp_path / "in", 1)
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    monkeypatch.setattr("hisparse_cli.cli.summarize.build_job", lambda opts: FakeJob())
    out = tmp_path / "r.jsonl"
    result = CliRunner().invoke(app, ["batch", str(tmp_path / "in"), "--out", str(out),
                                      "--ray", "local"])
    assert result.exit_code == 2, show(result)
    assert "hisparse[ray]" in result.stderr and "Traceback" not in result.stderr
    assert not out.exists()
    result = CliRunner().invoke(app, ["batch", str(tmp_path / "in"), "--out", str(out),
                                      "--workers", "2"])
    assert result.exit_code == 2 and "--ray" in result.stderr, show(result)


def test_worker_plan_defaults_and_refusals():
    from hisparse_cli.errors import ConfigError
    from hisparse_cli.config.profiles import load_profile
    from hisparse_cli.cluster.connect import RayOptions, worker_plan

    cpu, gpu = load_profile("cpu"), load_profile("3090-24g")
    two_cpus = {"cpus": 2.0, "gpus": 0.0, "largest_node_cpus": 2.0, "nodes": 1}
    box = {"cpus": 32.0, "gpus": 2.0, "largest_node_cpus": 32.0, "nodes": 1}
    plan = worker_plan(RayOptions("local"), cpu, two_cpus, private=True)
    assert (plan.workers, plan.threads, plan.gpus) == (1, 2, 0.0)
    plan = worker_plan(RayOptions("local", workers=2), cpu, two_cpus, private=True)
    assert (plan.workers, plan.threads) == (2, 1)
    plan = worker_plan(RayOptions("local"), gpu, box, private=True)  # one worker per GPU
    assert (plan.workers, plan.threads, plan.gpus) == (2, 1, 1.0)
    plan = worker_plan(RayOptions("auto", gpus_per_worker=0.5), gpu, box, private=False)
    assert (plan.workers, plan.gpus) == (4, 0.5)
    with pytest.raises(ConfigError, match="2 CPUs"):
        worker_plan(RayOptions("local", workers=2, threads_per_worker=2), cpu, two_cpus,
                    private=True)
    assert worker_plan(RayOptions("auto", workers=2, threads_per_worker=2), cpu, two_cpus,
                       private=False).threads == 2  # a joined cluster may grow: waits
    with pytest.raises(ConfigError, match="runs on the CPU"):
        worker_plan(RayOptions("local", gpus_per_worker=1), cpu, box, private=True)
    for bad in (dict(workers=0), dict(threads_per_worker=0), dict(gpus_per_worker=1.5),
                dict(gpus_per_worker=-1)):
        with pytest.raises(ConfigError):
            RayOptions("local", **bad)


def test_connect_retries_a_failed_private_start_then_says_why(monkeypatch):
    ray = pytest.importorskip("ray")
    from hisparse_cli.errors import ConfigError, ResourceError
    from hisparse_cli.cluster.connect import START_ATTEMPTS, connect

    calls = []

    def failing_init(**kwargs):
        calls.append(kwargs)
        raise Exception("The current node timed out during startup.\nmore")  # as Ray does

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", failing_init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    with pytest.raises(ResourceError, match="timed out during startup") as info:
        connect("local", quiet=True)
    assert info.value.exit_code == 5 and "--ray" in info.value.hint
    assert len([c for c in calls if c != "shutdown"]) == START_ATTEMPTS == 2
    with pytest.raises(ConfigError, match="cannot reach a Ray cluster at 'host:1'"):
        connect("host:1")


# --- the batch on Ray -----------------------------------------------------------------------
def test_ray_batch_matches_the_local_batch_and_resumes_without_work(ray_cluster, tiny,
                                                                     tmp_path, one_thread,
                                                                     monkeypatch):
    paths = docs(tmp_path / "in", 3)
    paths[0].with_suffix(".ref.txt").write_text("The provider delivers item zero.")
    (tmp_path / "refs").mkdir()
    (tmp_path / "refs" / "doc1.txt").write_text("The provider delivers item one.")
    (tmp_path / "in" / "bad.txt").write_bytes(b"\x00\x01\x02binary\x00" * 8)  # fails alone
    monkeypatch.chdir(tmp_path)  # --references relative to here, not to the workers' folder
    args = ["batch", str(tmp_path / "in"), str(tmp_path / "missing.txt"), "--model", str(tiny),
            *TINY_FLAGS, "--json", "--references", "refs"]
    args.append("-")  # and a document piped in on stdin: it travels with its task
    stdin = b"Document from stdin. The provider delivers the piped item on time.\n"
    local = CliRunner().invoke(app, args + ["--out", str(tmp_path / "local.jsonl")],
                               input=stdin)
    assert local.exit_code == 6, show(local)
    out = tmp_path / "ray.jsonl"
    ray_args = args + ["--out", str(out), "--ray", "local", "--workers", "2",
                       "--threads-per-worker", "1"]
    result = CliRunner().invoke(app, ray_args, input=stdin)
    assert result.exit_code == 6, show(result)
    assert _same_words(json.loads(result.stdout)) == _same_words(
        json.loads(local.stdout) | {"results": str(out)})
    expected, got = _by_input(tmp_path / "local.jsonl"), _by_input(out)
    assert sorted(got) == sorted(expected) and len(got) == 6  # every input exactly once
    assert got["-"]["status"] == "ok" and got["-"]["worker"]["attempt"] == 1
    for name, record in got.items():
        want = expected[name]
        for key in ("status", "sha256", "settings_id", "summary", "rouge", "strategy",
                    "warnings", "reference"):
            assert _same_words(record.get(key)) == _same_words(want.get(key)), (name, key)
        assert (record.get("error") or {}).get("type") == (want.get("error") or {}).get("type")
        if "worker" in record:  # ran on a worker: which one, how many threads, first try
            assert record["worker"]["threads"] == 1 and record["worker"]["attempt"] == 1
    assert got[str(tmp_path / "in" / "doc1.txt")]["reference"] == str(tmp_path / "refs" /
                                                                    "doc1.txt")
    assert got[str(tmp_path / "in" / "bad.txt")]["error"]["exit_code"] == 3
    assert "worker" in got[str(tmp_path / "in" / "bad.txt")]  # failed on its worker, alone
    assert "Ray: 2 worker(s), 1 thread(s) each" in result.stderr
    before = out.read_bytes()
    resumed = CliRunner().invoke(app, ray_args + ["--resume"], input=stdin)
    assert resumed.exit_code == 6, show(resumed)
    assert out.read_bytes() == before  # nothing redone, nothing added
    assert resumed.stderr.count("already done") == 4 and "Ray:" not in resumed.stderr
    retried = CliRunner().invoke(app, ray_args + ["--resume", "--retry-failed"], input=stdin)
    assert retried.exit_code == 6, show(retried)
    assert out.read_bytes().startswith(before)  # appended only
    again = _lines(out)[len(got):]  # the failed inputs once more, nothing else
    failed = sorted(name for name, record in expected.items() if record["status"] == "error")
    assert sorted(r["input"] for r in again) == failed and len(failed) == 2
    assert all(r["status"] == "error" for r in again)
    redone = next(r for r in again if r["input"] == str(tmp_path / "in" / "bad.txt"))
    assert redone["worker"]["attempt"] == 1  # on a worker again
    assert _by_input_latest(out) == {**got, **{r["input"]: r for r in again}}


def test_killed_worker_is_retried_and_a_worker_killing_document_is_recorded(ray_cluster,
                                                                             tmp_path):
    from hisparse_cli.summarize.batch import ResultsFile, expand_inputs
    from hisparse_cli.cluster.runner import RayRunner
    from hisparse_cli.summarize.batch_runner import batch_summary, run_batch
    from hisparse_cli.cluster.connect import RayOptions

    folder = tmp_path / "in"
    docs(folder, 2)
    pidfile = tmp_path / "pids.txt"
    (folder / "hang.txt").write_text(f"A long document.\n@hang {pidfile}\n")
    (folder / "die.txt").write_text("A document that kills its worker.\n@die\n")
    items = expand_inputs([str(folder)])
    results = ResultsFile(tmp_path / "r.jsonl")
    results.open(resume=False)
    job = FakeJob()
    runner = RayRunner(job, RayOptions("local", workers=2, threads_per_worker=1))
    outcome, failure = [], []

    def batch():
        try:
            outcome.append(run_batch(items, job, results, runner=runner))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            failure.append(exc)

    thread = threading.Thread(target=batch, daemon=True)
    thread.start()
    deadline = time.monotonic() + 180
    while not pidfile.exists() and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.2)
    assert pidfile.exists(), failure
    killed = int(pidfile.read_text().split()[1])
    os.kill(killed, signal.SIGKILL)  # the worker dies mid-document
    thread.join(timeout=300)
    assert not thread.is_alive() and not failure, failure
    got = {Path(k).name: r for k, r in _by_input(tmp_path / "r.jsonl").items()}
    assert sorted(got) == ["die.txt", "doc0.txt", "doc1.txt", "hang.txt"]
    hang = got["hang.txt"]
    assert hang["status"] == "ok" and hang["worker"]["attempt"] == 2
    assert hang["worker"]["pid"] == hang["pid"] != killed  # ran again, in another process
    assert [line.split()[0] for line in pidfile.read_text().splitlines()] == ["hang.txt"] * 2
    die = got["die.txt"]
    assert die["status"] == "error" and die["error"]["type"] == "WorkerError"
    assert die["error"]["exit_code"] == 1 and "died 2 times" in die["error"]["message"]
    assert got["doc0.txt"]["status"] == got["doc1.txt"]["status"] == "ok"  # the batch went on
    assert batch_summary(results, outcome[0].keys)["failed"] == 1


DRIVER = """
import sys
sys.path.insert(0, {tests!r})
import helpers_batch
from ray import cloudpickle
cloudpickle.register_pickle_by_value(helpers_batch)
import hisparse_cli.cli.summarize
hisparse_cli.cli.summarize.build_job = lambda opts: helpers_batch.FakeJob()
from hisparse_cli.cli.app import main
sys.argv = ["hisparse"] + sys.argv[1:]
main()
"""


def test_ctrl_c_stops_at_once_and_writes_nothing_partial(ray_cluster, tmp_path):
    """Also: Ray's own messages about a dead worker never reach stdout (--json: nothing
    there when interrupted)."""
    import psutil

    folder = tmp_path / "in"
    docs(folder, 1)
    pidfile = tmp_path / "pids.txt"
    (folder / "die.txt").write_text("A document that kills its worker.\n@die\n")
    (folder / "hang.txt").write_text(f"A long document.\n@hang {pidfile}\n")
    out = tmp_path / "r.jsonl"
    proc = subprocess.Popen(  # joins the module's cluster by its address
        [sys.executable, "-c", DRIVER.format(tests=str(TESTS)), "batch", str(folder),
         "--out", str(out), "--json", "--ray", ray_cluster, "--workers", "2",
         "--threads-per-worker", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a shell's job
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None and not (
                pidfile.exists() and out.exists() and out.read_text().count("\n") == 2):
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()
        hung = int(pidfile.read_text().split()[1])
        second = CliRunner().invoke(app, ["batch", str(folder), "--out", str(out), "--resume"])
        assert second.exit_code == 3, show(second)  # the Ray driver holds the file's lock
        assert "being written by another hisparse run" in second.stderr
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in the terminal
        stdout, stderr = proc.communicate(timeout=120)  # long before the 300 s document
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert stdout == "", stdout
    assert "Traceback" not in stderr and "rerun with --resume" in stderr, stderr
    lines = {Path(r["input"]).name: r for r in _lines(out)}  # hang.txt: nothing
    assert sorted(lines) == ["die.txt", "doc0.txt"] and out.read_text().endswith("\n")
    assert lines["die.txt"]["error"]["type"] == "WorkerError"
    deadline = time.monotonic() + 60
    while psutil.pid_exists(hung) and time.monotonic() < deadline:  # its actor was killed
        time.sleep(0.2)
    assert not psutil.pid_exists(hung)


# --- Ray Data ---------------------------------------------------------------------------------
def test_ray_data_summarizer_on_an_in_memory_dataset(ray_cluster, tiny, tmp_path, one_thread):
    import ray
    from ray.data import ActorPoolStrategy

    from hisparse_cli.cli.options import RunOptions
    from hisparse_cli.cli.summarize import build_job
    from hisparse_cli.documents import load_document
    from hisparse_cli.cluster.ray_data import Summarizer, text_document
    from hisparse_cli.scoring import rouge_scores

    text = "The supplier shall deliver the goods within thirty days of the order. " * 6
    reference = "The supplier delivers within thirty days."
    path = docs(tmp_path, 1)[0]
    rows = [{"path": None, "text": text, "reference": reference},
            {"path": str(path), "text": None, "reference": None},
            {"path": None, "text": "   ", "reference": None},
            {"path": str(tmp_path / "missing.txt"), "text": None, "reference": "x"}]
    out = ray.data.from_items(rows).map_batches(
        Summarizer, fn_constructor_kwargs={**TINY_SETTINGS, "model": str(tiny), "threads": 1},
        compute=ActorPoolStrategy(size=1), batch_size=1, num_cpus=1).take_all()  # a null
    # column alone in its batch reaches the class as float NaN
    assert len(out) == 4
    def cell(value):  # a null passed through from a null-only batch is NaN
        return None if isinstance(value, float) and value != value else value

    by_key = {(cell(r["path"]), cell(r["text"])): r for r in out}
    job = build_job(RunOptions.from_settings(**TINY_SETTINGS, model=str(tiny), quiet=True))
    first = by_key[(None, text)]
    want = job.run(text_document(text), reference_text=reference)
    assert first["summary"] == want["summary"] and first["error"] is None
    assert first["rouge"] == pytest.approx(rouge_scores(want["summary"], reference))
    assert first["stats"]["prompt_tokens"] == want["stats"]["prompt_tokens"]
    second = by_key[(str(path), None)]
    assert second["summary"] == job.run(load_document(path))["summary"]
    assert second["rouge"] is None
    empty, missing = by_key[(None, "   ")], by_key[(str(tmp_path / "missing.txt"), None)]
    assert empty["summary"] is None and empty["error"]["type"] == "InputError"
    assert missing["error"]["exit_code"] == 3 and "no such file" in missing["error"]["message"]
    assert {r["settings_id"] for r in out} == {job.settings_id()}


# --- the real model -----------------------------------------------------------------------------
@pytest.mark.slow
def test_ray_batch_with_the_default_model(tmp_path):
    pytest.importorskip("ray")
    samples = TESTS.parent / "samples"
    folder = tmp_path / "in"
    folder.mkdir()
    for name in ("contract/services_agreement", "medical/discharge_report"):
        for suffix in (".txt", ".ref.txt"):
            (folder / (Path(name).name + suffix)).write_bytes(
                (samples / (name + suffix)).read_bytes())
    (folder / "broken.pdf").write_bytes(b"%PDF-1.4\nnot really a pdf\n")
    out = tmp_path / "r.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if os.environ.get("HISPARSE_TEST_HOME"):
        env["HISPARSE_HOME"] = os.environ["HISPARSE_TEST_HOME"]
    cmd = [sys.executable, "-m", "hisparse_cli.cli.app", "batch", str(folder), "--out", str(out),
           "--profile", "cpu", "-n", "48", "--ray", "local", "--workers", "2",
           "--threads-per-worker", "1"]
    # from tmp_path: `python -m` puts the working directory on sys.path (a checkout's root
    # would shadow the `kernels` distribution with its kernels/ folder)
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1500,
                            cwd=tmp_path)
    assert result.returncode == 6, result.stderr  # the broken PDF failed, alone
    got = {Path(k).name: r for k, r in _by_input(out).items()}
    assert sorted(got) == ["broken.pdf", "discharge_report.txt", "services_agreement.txt"]
    assert got["broken.pdf"]["status"] == "error" and got["broken.pdf"]["error"]["exit_code"] == 3
    for name in ("discharge_report.txt", "services_agreement.txt"):
        assert got[name]["status"] == "ok" and got[name]["summary"].strip()
        assert got[name]["rouge"]["rougeL"] > 0 and got[name]["worker"]["threads"] == 1
    alone = subprocess.run(  # the same document by `summarize` (one thread too): same summary
        [sys.executable, "-m", "hisparse_cli.cli.app", "summarize",
         str(folder / "discharge_report.txt"), "--profile", "cpu", "-n", "48", "--json", "-q"],
        capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    assert alone.returncode == 0, alone.stderr
    assert json.loads(alone.stdout)["summary"] == got["discharge_report.txt"]["summary"]
    before = out.read_bytes()
    again = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, env=env,
                           timeout=600, cwd=tmp_path)
    assert again.returncode == 6 and out.read_bytes() == before, again.stderr
