"""The figures of ``tests.bench.vs_optuna`` from its sides' counted runs (no run here)."""

from __future__ import annotations

import pytest

from tests.bench.proctree import TreeUsage
from tests.bench.vs_optuna import figures, last_line, overhead


def _usage(cpu: float, wall: float, t_launch: float = 100.0) -> TreeUsage:
    return TreeUsage(cpu, wall, 0, 3, {"python": 3}, 0, t_launch)


def test_figures_are_optunas_over_stagetrees_with_startup_and_the_steps_trained_twice() -> None:
    st_out = {"best": 0.91, "merge_rate": 2.5, "steps_executed": 210, "unique_steps": 200, "first_result_at": 104.0}
    runs = {
        "optuna": [(_usage(30.0, 60.0), {"best": 0.90, "steps": 300, "first_result_at": 105.0})],
        "stagetree": [(_usage(20.0, 40.0), st_out)],
        "optuna_replay": [(_usage(28.0, 56.0), {"best": 0.90, "steps": 300})],
        "stagetree_replay": [(_usage(35.0, 70.0), {**st_out, "merge_rate": 1.0, "steps_executed": 300})],
    }
    f = {**figures(runs), **overhead(runs, [_usage(6.0, 6.0)])}
    assert f["cpu_s_ratio"] == pytest.approx(1.5)
    assert f["e2e_ratio"] == pytest.approx(1.5)
    # the replays trained the same 300 steps: the plain ratio, and the difference is the overhead
    assert f["cpu_s_ratio_no_sharing"] == pytest.approx(28.0 / 35.0)
    assert f["overhead_cpu_s_no_sharing"] == pytest.approx(7.0)
    assert f["replay_steps"] == 300
    assert f["first_trial_s"] == pytest.approx(4.0)
    assert f["steps_trained_twice"] == 10
    assert f["optuna_first_trial_s"] == pytest.approx(5.0)
    assert f["cpu_s_per_step_ratio"] == pytest.approx((30.0 / 300) / (20.0 / 210))
    assert "cpu_s_fork_from_script_vs_fresh" not in f  # only with --fork-compare's side
    assert last_line(f) == (
        "optuna_best=0.9000 stagetree_best=0.9100 merge_rate=2.50 cpu_s_ratio=1.50 e2e_ratio=1.50 "
        "cpu_s_ratio_no_sharing=0.80 first_trial_s=4.0 steps_trained_twice=10 optuna_first_trial_s=5.0 "
        "cpu_s_per_step_ratio=1.05 cpu_s_ratio_bound=1.32 fixed_cpu_s=6.0 fixed_wall_s=6.0 overhead_cpu_s=-2.8 "
        "overhead_cpu_s_no_sharing=7.0 replay_steps=300"
    )
    runs["stagetree_fresh_fork_server"] = [(_usage(25.0, 50.0), st_out)]
    f = {**figures(runs), **overhead(runs, [_usage(6.0, 6.0)])}
    assert f["cpu_s_fork_from_script_vs_fresh"] == pytest.approx(1.25)
    assert last_line(f).endswith(" cpu_s_fork_from_script_vs_fresh=1.25")


def test_overhead_is_what_stagetree_spends_beyond_the_fixed_imports_and_its_steps_at_optunas_price() -> None:
    # Optuna: 6 CPU-s of imports and 300 steps at 0.08 s; stagetree trains 210 steps (16.8 s at that price)
    st_out = {"best": 0.9, "merge_rate": 2.5, "steps_executed": 210, "unique_steps": 210, "first_result_at": 1.0}
    runs = {
        "optuna": [(_usage(30.0, 1.0), {"best": 0.9, "steps": 300})],
        "stagetree": [(_usage(25.0, 1.0), st_out)],
        # the replay: Optuna's 200 steps at 0.1 s; stagetree retried a batch and trained 5 steps more
        "optuna_replay": [(_usage(26.0, 1.0), {"best": 0.9, "steps": 200})],
        "stagetree_replay": [(_usage(31.5, 1.0), {**st_out, "steps_executed": 205})],
    }
    f = overhead(runs, [_usage(6.0, 1.0)])
    assert (f["fixed_cpu_s"], f["fixed_wall_s"]) == (6.0, 1.0)
    assert f["overhead_cpu_s"] == pytest.approx(25.0 - 6.0 - 16.8)
    assert f["cpu_s_ratio_bound"] == pytest.approx(30.0 / (6.0 + 16.8))
    # the 5 steps beyond Optuna's taken away at the replay's price: 31.0 CPU-s at equal work
    assert f["overhead_cpu_s_no_sharing"] == pytest.approx(31.0 - 26.0)
    assert f["cpu_s_ratio_no_sharing"] == pytest.approx(26.0 / 31.0)
