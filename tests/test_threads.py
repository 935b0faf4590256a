"""The CPU thread policy (config/threads.py): the pure per-phase count, what the process may
use (affinity, cgroup quota, overrides: config/env.py), the OpenMP wait setting, the policy in
the ExecutionPlan, and the governor's decisions (engine/thread_governor.py) against a scripted
load, and against constructed /proc samples, with a fake clock (no timing in the assertions)."""

from __future__ import annotations

import pytest

from hisparse_cli.config import env as envmod
from hisparse_cli.config import threads as th
from hisparse_cli.config.env import read_environment
from hisparse_cli.engine import thread_governor as tg
from hisparse_cli.errors import ConfigError


@pytest.mark.parametrize("phase", th.PHASES)
@pytest.mark.parametrize("cpus, quota, override, busy, want", [
    (2, None, None, 0.0, 2),     # quiet: every CPU
    (2, None, None, 0.3, 2),     # a little background work keeps the count
    (2, None, None, 0.67, 1),    # one busy process beside two threads: one CPU left
    (2, None, None, 1.0, 1),
    (2, None, None, 5.0, 1),     # never below one
    (8, None, None, 1.0, 7),
    (8, None, None, 2.6, 5),
    (16, 4.0, None, 0.0, 4),     # a cgroup quota caps the budget
    (16, 2.5, None, 0.0, 2),     # rounded down: a thread beyond it would be throttled
    (16, 0.5, None, 0.0, 1),
    (4, 8.0, None, 0.0, 4),      # a quota above the CPUs: the CPUs
    (2, None, 3, 0.0, 3),        # an override is used as given, load or not
    (2, None, 1, 0.0, 1),
    (8, 2.0, 6, 1.5, 6),
])
def test_plan_threads(cpus, quota, override, busy, want, phase):
    assert th.plan_threads(cpus, quota, phase, override, busy) == want
    policy = th.ThreadPolicy(cpus, quota, override, "auto" if override is None else "--threads",
                             "x")
    assert policy.threads(phase, busy) == want
    assert policy.adaptive == (override is None)


def test_plan_threads_rejects_bad_input():
    with pytest.raises(ValueError, match="phase"):
        th.plan_threads(2, None, "load")
    with pytest.raises(ConfigError, match="threads must be >= 1"):
        th.ThreadPolicy(2, None, 0, "--threads", "x")


def test_resolve_precedence(monkeypatch):
    monkeypatch.setattr(th, "affinity_cpus", lambda: [0, 1, 2])
    monkeypatch.setattr(th, "cgroup_quota", lambda: None)
    env = read_environment({"HISPARSE_THREADS": "2", "OMP_NUM_THREADS": "1"})
    assert th.resolve_thread_policy(4, env).override == 4  # --threads first
    p = th.resolve_thread_policy(None, env)
    assert (p.override, p.source) == (2, "HISPARSE_THREADS")
    p = th.resolve_thread_policy(None, read_environment({"OMP_NUM_THREADS": "1"}))
    assert (p.override, p.source) == (1, "OMP_NUM_THREADS")
    p = th.resolve_thread_policy(None, read_environment({"OMP_NUM_THREADS": "3,1"}))
    assert (p.override, p.source) == (3, "OMP_NUM_THREADS")  # nested: the outer level
    p = th.resolve_thread_policy(None, read_environment({}))
    assert (p.override, p.source, p.cpus, p.budget) == (None, "auto", 3, 3)
    assert "auto (3 CPUs" in p.describe() and p.to_dict()["budget"] == 3
    p = th.resolve_thread_policy(None, read_environment({"GOMP_SPINCOUNT": "7"}))
    assert p.openmp_wait == "GOMP_SPINCOUNT=7"
    for bad in ("0", "two", "-1"):
        with pytest.raises(ConfigError, match="HISPARSE_THREADS"):
            read_environment({"HISPARSE_THREADS": bad})


def test_resolve_with_a_quota(monkeypatch):
    monkeypatch.setattr(th, "affinity_cpus", lambda: list(range(16)))
    monkeypatch.setattr(th, "cgroup_quota", lambda: 2.5)
    p = th.resolve_thread_policy(None, read_environment({}))
    assert (p.cpus, p.quota, p.budget) == (16, 2.5, 2)
    assert p.threads("prefill") == p.threads("decode") == 2
    assert p.threads("decode", busy_elsewhere=1.0) == 1
    assert "quota 2.5 CPUs" in p.describe()


def test_the_execution_plan_carries_the_policy_and_the_cpu_decode(monkeypatch, tiny_models):
    """A CPU plan's `threads` and `CPU decode` rows (hisparse plan prints them; --json
    settings carry them); a CUDA plan has neither."""
    from hisparse_cli.config.execution import resolve_execution
    from hisparse_cli.config.settings import SparseConfig
    from hisparse_cli.model.config import ModelConfig

    monkeypatch.setattr(th, "affinity_cpus", lambda: [0, 1])
    monkeypatch.setattr(th, "cgroup_quota", lambda: None)
    cfg = ModelConfig.from_folder(tiny_models["llama"][0])
    common = dict(model_cfg=cfg, sparse=SparseConfig(), compute_dtype="float32",
                  kv_dtype="float32", weight_awq=False)
    plan = resolve_execution(device="cpu", env=read_environment({"HISPARSE_THREADS": "1"}),
                             **common)
    assert plan.thread_policy.override == 1 and plan.thread_policy.source == "HISPARSE_THREADS"
    rows = {r[0]: r for r in plan.rows()}
    assert rows["threads"][1].startswith("1 (HISPARSE_THREADS")
    d = plan.to_dict()
    assert d["threads"]["policy"]["override"] == 1 and "cpu_decode" in d
    plan = resolve_execution(device="cpu", env=read_environment({}), threads=3, **common)
    assert (plan.thread_policy.override, plan.thread_policy.source) == (3, "--threads")
    plan = resolve_execution(device="cpu", env=read_environment({}), **common)
    assert plan.thread_policy.adaptive and plan.thread_policy.budget == 2
    torch_plan = resolve_execution(device="cpu", env=read_environment(
        {"HISPARSE_BACKEND": "torch"}), **common)
    assert torch_plan.cpu_decode.value == "torch"
    assert torch_plan.cpu_decode.reason == "HISPARSE_BACKEND=torch"
    awq = resolve_execution(device="cpu", env=read_environment({}),
                            **{**common, "weight_awq": True})
    assert awq.cpu_decode.value == "torch" and "AWQ" in awq.cpu_decode.reason
    cuda = resolve_execution(device="cuda", env=read_environment({}), **common)
    assert cuda.threads is None and cuda.cpu_decode.value == "none"
    assert "threads" not in {r[0] for r in cuda.rows()}


def test_cgroup_quota_v2_and_v1(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert th.cgroup_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert th.cgroup_quota(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("200000")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000")
    assert th.cgroup_quota(tmp_path) == 2.0
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1")
    assert th.cgroup_quota(tmp_path) is None
    assert th.cgroup_quota(tmp_path / "nowhere") is None


def test_openmp_spin_is_bounded_only_when_nothing_was_chosen():
    bound = envmod.bound_openmp_spin
    env: dict = {}
    assert bound(env, torch_loaded=False) == "GOMP_SPINCOUNT=10000"
    assert env == {"GOMP_SPINCOUNT": "10000"}
    env = {"OMP_WAIT_POLICY": "active"}
    assert bound(env, torch_loaded=False) == "OMP_WAIT_POLICY=active"
    assert "GOMP_SPINCOUNT" not in env
    env = {"GOMP_SPINCOUNT": "5"}
    assert bound(env, torch_loaded=False) == "GOMP_SPINCOUNT=5"


def test_openmp_spin_leaves_a_loaded_openmp_alone():
    import torch  # noqa: F401  (loaded: libgomp has read its settings already)

    env: dict = {}
    assert envmod.bound_openmp_spin(env) == "OpenMP default" and env == {}


class FakeLoad:
    """sample() returns, for the number of busy CPUs elsewhere scripted at the clock's time, what
    a real competitor shows: its busy time, and our wait while we hold every CPU (a process
    that needs c CPUs beside our n threads on b CPUs: each of the n + c runnable threads gets
    b / (n + c) of a CPU)."""

    def __init__(self, clock, script, budget, threads):
        self.clock, self.script, self.budget, self.threads = clock, script, budget, threads

    def sample(self):
        now = self.clock()
        c = [v for t, v in self.script if t <= now][-1]
        n = self.threads()
        waited = n * max(0.0, 1 - self.budget / (n + c)) if c else 0.0
        return tg.Load(busy_elsewhere=c, waited=waited)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def governor(script, cpus=2, override=None, **kw):
    clock = Clock()
    set_to = []
    load = FakeLoad(clock, script, cpus, lambda: set_to[-1]) if override is None else None
    gov = tg.ThreadGovernor(th.ThreadPolicy(cpus, None, override, "auto", "x"), load=load,
                            clock=clock, set_threads=set_to.append, **kw)
    return gov, clock, set_to


def run_for(gov, clock, seconds, step=0.05):
    end = clock.t + seconds
    while clock.t < end - 1e-9:
        clock.t += step
        gov.tick()


def test_governor_quiet_keeps_every_cpu():
    gov, clock, set_to = governor([(0, 0.0)])
    gov.begin("prefill")
    run_for(gov, clock, 3)
    gov.begin("decode")
    run_for(gov, clock, 3)
    assert gov.report() == {"prefill": [2], "decode": [2]} and set(set_to) == {2}


def test_governor_lowers_under_contention_and_probes_with_backoff():
    gov, clock, set_to = governor([(0, 0.0), (1.0, 1.0)], interval=0.5, probe_every=4.0)
    gov.begin("prefill")
    run_for(gov, clock, 1.0)
    assert gov.n == 2
    run_for(gov, clock, 0.6)  # the busy process shows in the next interval
    assert gov.n == 1
    run_for(gov, clock, 40)
    probes = [n for n in set_to[2:] if n == 2]
    # probes after 4, 8, 16, 32 s (each one interval long, each back to 1)
    assert 3 <= len(probes) <= 5 and gov.n == 1
    assert gov.report()["prefill"][:3] == [2, 1, 2]


def test_governor_rises_when_the_other_work_ends():
    gov, clock, _ = governor([(0, 0.9), (5.0, 0.0)])
    gov.begin("decode")
    run_for(gov, clock, 1.0)
    assert gov.n == 1
    run_for(gov, clock, 5.0)
    assert gov.n == 2


def test_governor_stays_up_where_the_other_work_only_fills_idle_time():
    """A SCHED_IDLE / nice 19 neighbour shows as busy while we leave a CPU idle and yields
    when we use it (we never wait for it): the CPUs stay ours."""
    clock = Clock()
    state = {"n": 1}

    class Filler:
        def sample(self):  # takes exactly what we leave; never makes us wait
            return tg.Load(busy_elsewhere=2 - state["n"] + 0.02, waited=0.01)

    gov = tg.ThreadGovernor(th.ThreadPolicy(2, None, None, "auto", "x"), load=Filler(),
                            clock=clock, set_threads=lambda n: state.update(n=n))
    gov.begin("prefill")
    run_for(gov, clock, 10)
    assert state["n"] == 2 and gov.report() == {"prefill": [2]}


def test_governor_with_an_override_never_measures():
    gov, clock, set_to = governor(None, override=3)
    assert gov.load is None
    gov.begin("prefill")
    run_for(gov, clock, 2)
    gov.begin("decode")
    assert gov.report() == {"prefill": [3], "decode": [3]} and set(set_to) == {3}


def test_contention_reads_our_wait_on_the_whole_budget_else_the_others_busy_time():
    load = tg.Load(busy_elsewhere=1.0, waited=0.05)  # a filler beside our one thread
    assert tg.contention(load, 1, 2) == 1.0
    assert tg.contention(tg.Load(0.02, 0.02), 2, 2) == 0.02  # the filler yields to two
    assert tg.contention(tg.Load(0.8, 0.8), 2, 2) == 0.8  # a real competitor
    assert tg.contention(tg.Load(0.8, None), 2, 2) == 0.8  # no schedstat: the busy time


def test_cpu_load_reads_proc_stat():
    load = tg.CpuLoad()
    if load._last is None:
        pytest.skip("no /proc/stat")
    sum(i * i for i in range(200_000))
    got = load.sample()
    assert got is not None and got.busy_elsewhere >= 0.0
    assert got.waited is None or got.waited >= 0.0


# -- constructed /proc samples -----------------------------------------------------------------
class FakeProc:
    """A /proc with `stat` (two CPUs, ticks of 10 ms) and our threads' schedstat, advanced by
    hand: `tick(seconds, ours=, others=, waited=)` adds `ours` + `others` CPUs' worth of busy
    time to the CPUs, `ours` to this process's CPU time, and `waited` CPUs' worth of run-queue
    wait to our threads."""

    def __init__(self, root, tids=("100", "101")):
        self.root, self.tids = root, tids
        self.busy, self.idle, self.own, self.delay = [0, 0], [0, 0], 0.0, {t: 0 for t in tids}
        self.clock = Clock()
        self._write()

    def _write(self):
        lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
        for i in range(2):  # user nice system idle iowait irq softirq steal
            lines.append(f"cpu{i} {self.busy[i]} 0 0 {self.idle[i]} 0 0 0 0 0 0")
        (self.root / "stat").write_text("\n".join(lines) + "\n")
        for tid, d in self.delay.items():
            folder = self.root / "self" / "task" / tid
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "schedstat").write_text(f"123 {d} 7\n")

    def tick(self, seconds, *, ours, others, waited):
        busy = (ours + others) * seconds * 100  # ticks over both CPUs
        for i in range(2):
            self.busy[i] += round(busy / 2)
            self.idle[i] += round(max(0.0, 2 * seconds * 100 - busy) / 2)
        self.own += ours * seconds
        for tid in self.delay:
            self.delay[tid] += round(waited * seconds * 1e9 / len(self.delay))
        self.clock.t += seconds
        self._write()

    def load(self):
        return tg.CpuLoad([0, 1], self.clock, proc=self.root, own_cpu=lambda: self.own, hz=100)


def test_cpu_load_from_constructed_proc_samples(tmp_path):
    proc = FakeProc(tmp_path)
    load = proc.load()
    proc.tick(1.0, ours=2.0, others=0.0, waited=0.0)
    assert load.sample() == pytest.approx(tg.Load(0.0, 0.0))
    proc.tick(0.5, ours=1.0, others=1.0, waited=0.6)  # a busy neighbour took a CPU
    got = load.sample()
    assert got.busy_elsewhere == pytest.approx(1.0) and got.waited == pytest.approx(0.6)
    (tmp_path / "self" / "task" / "100" / "schedstat").unlink()  # a thread that ended
    proc.delay.pop("100")
    proc.tick(1.0, ours=1.0, others=0.5, waited=0.2)
    got = load.sample()
    assert got.busy_elsewhere == pytest.approx(0.5) and got.waited == pytest.approx(0.2)  # 101
    assert load.sample() is None  # no time passed
    assert tg.CpuLoad([0, 1], proc.clock, proc=tmp_path / "none").sample() is None


def test_governor_from_constructed_proc_samples(tmp_path):
    """The governor over CpuLoad over a constructed /proc: quiet keeps 2 threads; a neighbour
    that makes our threads wait lowers the count to 1 at the next interval; once it is gone,
    the probe (after probe_every) finds the CPUs free and the count stays 2."""
    proc = FakeProc(tmp_path)
    set_to = []
    gov = tg.ThreadGovernor(th.ThreadPolicy(2, None, None, "auto", "x"), load=proc.load(),
                            clock=proc.clock, set_threads=set_to.append, interval=0.5,
                            probe_every=2.0)

    def run(seconds, **load):
        for _ in range(round(seconds / 0.1)):
            n = gov.n
            proc.tick(0.1, ours=float(n), **load)
            gov.tick()

    gov.begin("decode")
    run(1.0, others=0.0, waited=0.0)
    assert gov.n == 2
    run(0.6, others=1.0, waited=0.7)  # on both CPUs we wait ~0.7 CPUs for the neighbour
    assert gov.n == 1
    run(1.0, others=1.0, waited=0.0)  # one thread: the neighbour's CPU shows busy
    assert gov.n == 1
    run(3.0, others=0.0, waited=0.0)  # the neighbour ended: the next check or probe rises
    assert gov.n == 2
    assert gov.report()["decode"][:2] == [2, 1] and gov.report()["decode"][-1] == 2


# -- the CLI and the engine ------------------------------------------------------------------
def test_threads_flag_and_env_reach_the_run(tmp_path, monkeypatch):
    """--threads N runs every phase on N threads and says so in --json (settings and
    stats); HISPARSE_THREADS does the same, a bad value is a usage error (exit 2)."""
    import json

    from helpers_cli import assert_error, run, show
    from helpers_tokenizer import make_tiny_model_dir

    monkeypatch.setenv("HISPARSE_HOME", str(tmp_path / "home"))
    model = make_tiny_model_dir(tmp_path / "m")
    doc = tmp_path / "d.txt"
    doc.write_text("The client pays a monthly fee within thirty days. " * 20)
    flags = ["--model", model, "--profile", "cpu", "-n", "4", "--json"]
    res = run("summarize", doc, "--threads", "1", *flags)
    assert res.exit_code == 0, show(res)
    record = json.loads(res.stdout)
    policy = record["settings"]["device"]["threads"]
    assert (policy["override"], policy["source"]) == (1, "--threads")
    assert record["stats"]["threads"] == {"prefill": [1], "decode": [1]}
    assert record["stats"]["decode_path"]
    res = run("summarize", doc, *flags, env={"HISPARSE_THREADS": "2"})
    assert res.exit_code == 0, show(res)
    record = json.loads(res.stdout)
    assert record["settings"]["device"]["threads"]["source"] == "HISPARSE_THREADS"
    assert set(record["stats"]["threads"]["decode"]) == {2}
    assert_error(run("summarize", doc, *flags, env={"HISPARSE_THREADS": "many"}), 2,
                 "HISPARSE_THREADS")
    res = run("summarize", doc, "--threads", "0", *flags)
    assert res.exit_code == 2 and "--threads" in res.stderr


def test_engine_threads_argument(tiny_models):
    from hisparse_cli.engine import Engine, SparseConfig

    path, _ = tiny_models["llama"]
    eng = Engine.from_pretrained(path, sparse=SparseConfig.dense_config(), threads=1)
    res = eng.generate([3, 4, 5], max_new_tokens=3, eos_token_ids=())
    assert res.stats.threads == {"prefill": [1], "decode": [1]}
    assert eng.governor.policy.source == "--threads" and eng.governor.load is None
    assert eng.execution.thread_policy.override == 1
    assert eng.replan().thread_policy.override == 1  # a replan keeps the engine's count


@pytest.mark.slow
def test_summarize_completes_beside_a_busy_process(real_home):
    """One CPU-bound process at normal priority beside a short summarize with the automatic
    policy: it completes (how long it takes is a benchmark's business, BENCHMARKS.md)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from helpers_cli import run, show

    sample = Path(__file__).resolve().parent.parent / "samples" / "medical" / "discharge_report.txt"
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        res = run("summarize", sample, "--profile", "cpu", "--max-new-tokens", "16", "--json")
    finally:
        busy.kill()
        busy.wait()
    assert res.exit_code == 0, show(res)
    record = json.loads(res.stdout)
    assert record["summary"].strip() and record["stats"]["new_tokens"] > 0
    assert record["settings"]["device"]["threads"]["source"] == "auto"
