"""`--attention auto|dense|sparse`: the choice from constructed plans (fits → dense, does not →
the largest sparse working set that fits, with the reason), the real planner on the CPU
profile, the CLI's alias and conflicts, and the engine switch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hisparse_cli.planner.attention_choice import choose_attention, dense_of, running_under
from hisparse_cli.cli.options import Attention, RunOptions
from hisparse_cli.config.settings import SparseConfig
from hisparse_cli.errors import ConfigError
from hisparse_cli.config.profiles import HardwareProfile, load_profile

SPARSE = SparseConfig(window_size=1024, global_tokens=64, recalibrate_every=256,
                      recalibrate_topk=64)
GIB = 1 << 30


def planner(budget: int, per_token: int = 1 << 20, base: int = GIB):
    """A constructed planner: peak = base + per_token × tokens the policy keeps."""
    asked = []

    def plan(sparse: SparseConfig, context: int = 8000):
        kept = context if sparse.dense else min(context, sparse.window_size + sparse.global_tokens)
        peak = base + per_token * kept
        asked.append(sparse)
        return SimpleNamespace(fits=peak <= budget, peak_allocated_bytes=peak,
                               budget_bytes=budget)

    plan.asked = asked
    return plan


def test_auto_is_dense_when_the_whole_kv_fits():
    choice = choose_attention("auto", sparse=SPARSE, plan=planner(budget=20 * GIB),
                              context_tokens=8000, budget_name="host RAM")
    assert choice.mode == "dense" and choice.sparse.dense
    assert choice.sparse.block_size == SPARSE.block_size
    assert "fits" in choice.reason and "host RAM" in choice.reason and "8,000" in choice.reason
    assert choice.to_dict()["window_size"] is None


def test_auto_is_the_largest_sparse_set_that_fits_when_dense_does_not():
    # dense needs 1 GiB + 8000 MiB; window 1024+64 → 2.1 GiB, 2048+128 → 3.1, 4096+256 → 5.25
    plan = planner(budget=4 * GIB)
    choice = choose_attention("auto", sparse=SPARSE, plan=plan, context_tokens=8000)
    assert choice.mode == "sparse"
    assert (choice.sparse.window_size, choice.sparse.global_tokens) == (2048, 128)
    assert choice.sparse.recalibrate_every == 512 and choice.sparse.recalibrate_topk == 128
    assert "dense needs" in choice.reason and "window 2048 + 128 globals fits" in choice.reason


def test_auto_keeps_the_configured_set_when_nothing_fits():
    choice = choose_attention("auto", sparse=SPARSE, plan=planner(budget=GIB),
                              context_tokens=8000)
    assert choice.mode == "sparse" and choice.sparse == SPARSE
    assert "does not fit either" in choice.reason


def test_windows_never_grow_past_the_context():
    plan = planner(budget=100 * GIB, per_token=1 << 24)  # dense (8000 tokens) does not fit
    choice = choose_attention("auto", sparse=SPARSE, plan=plan, context_tokens=3000)
    assert choice.sparse.window_size == 2048


@pytest.mark.parametrize("requested, explicit, mode", [
    ("dense", False, "dense"), ("sparse", False, "sparse"), ("auto", True, "sparse")])
def test_asked_modes_are_taken_without_planning(requested, explicit, mode):
    plan = planner(budget=100 * GIB)
    choice = choose_attention(requested, sparse=SPARSE, plan=plan, context_tokens=8000,
                              explicit_sparse=explicit)
    assert choice.mode == mode and plan.asked == []
    assert choice.sparse == (dense_of(SPARSE) if mode == "dense" else SPARSE)


def test_unknown_mode_is_a_config_error():
    with pytest.raises(ConfigError, match="attention must be one of"):
        choose_attention("fast", sparse=SPARSE, plan=None, context_tokens=10)


def test_the_real_planner_picks_dense_for_the_default_model_on_the_cpu_profile():
    from hisparse_cli.planner.profile import plan_for_profile
    from hisparse_cli.planner.shapes import shape_config

    cfg, profile = shape_config("smollm2-135m"), load_profile("cpu")

    def plan(sparse):
        return plan_for_profile(cfg, profile, context_tokens=7900, max_new_tokens=256,
                                sparse=sparse, budget_bytes=8 * GIB)

    assert choose_attention("auto", sparse=profile.sparse_config(), plan=plan,
                            context_tokens=8156).mode == "dense"

    def tiny(sparse):  # a budget below the weights: nothing fits
        return plan_for_profile(cfg, profile, context_tokens=7900, max_new_tokens=256,
                                sparse=sparse, budget_bytes=1 << 20)

    assert choose_attention("auto", sparse=profile.sparse_config(), plan=tiny,
                            context_tokens=8156).mode == "sparse"


def test_profiles_default_to_auto_and_refuse_other_values():
    assert load_profile("cpu").attention == "auto"
    assert HardwareProfile(name="x", attention="dense").attention == "dense"
    with pytest.raises(ConfigError, match="attention must be one of"):
        HardwareProfile(name="x", attention="fast")


def test_dense_flag_is_an_alias_and_conflicts_are_usage_errors():
    profile = load_profile("cpu")
    assert RunOptions(dense=True).attention_mode(profile) == "dense"
    assert RunOptions(dense=True, attention=Attention.dense).attention_mode(profile) == "dense"
    assert RunOptions().attention_mode(profile) == "auto"
    assert RunOptions(attention=Attention.sparse).attention_mode(profile) == "sparse"
    with pytest.raises(ConfigError, match="--dense cannot be combined with --attention sparse"):
        RunOptions(dense=True, attention=Attention.sparse).attention_mode(profile)
    with pytest.raises(ConfigError, match="dense attention cannot be combined with --window"):
        RunOptions(attention=Attention.dense, sparse_flags={"window_size": 512}).sparse(profile)
    assert RunOptions(attention=Attention.dense).sparse(profile).dense
    assert RunOptions(sparse_flags={"window_size": 512}).explicit_sparse() and not RunOptions().explicit_sparse()


def test_running_under_switches_the_engine_policy_and_restores_it():
    engine = SimpleNamespace(sparse=SPARSE)
    with running_under(engine, dense_of(SPARSE)) as eng:
        assert eng.sparse.dense
    assert engine.sparse is SPARSE
    with pytest.raises(RuntimeError):
        with running_under(engine, dense_of(SPARSE)):
            raise RuntimeError("boom")
    assert engine.sparse is SPARSE


def test_the_attention_mode_is_part_of_the_batch_settings_id():
    from hisparse_cli.summarize.job import Job
    from hisparse_cli.summarize.pipeline import SummarySettings

    profile = load_profile("cpu")
    ids = {mode: Job(profile, profile.sparse_config(), SummarySettings(), attention=mode)
           for mode in ("auto", "dense", "sparse")}
    assert len({job.settings_id() for job in ids.values()}) == 3
    assert ids["auto"].settings_view()["attention"] == "auto"
    with pytest.raises(ConfigError):
        Job(profile, profile.sparse_config(), SummarySettings(), attention="fast")
