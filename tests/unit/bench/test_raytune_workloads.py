"""The pure parts of ``tests.bench.vs_raytune``: the workloads, their sharing, the ASHA replay, the
exactness check and the message when Ray is missing. No torch, no ray: these run in ``make test``."""

from __future__ import annotations

import os
import sys

import pytest

from stagetree.client.tuners import ASHA, Submit, run_sync
from stagetree.core.sequences import Constant, Cosine, MultiStep, Piecewise, Sequence, Warmup
from tests.bench import vs_raytune
from tests.bench.raytune_workloads import (
    S1_STEPS,
    TUNED,
    TrialWork,
    max_abs_diff,
    merge_rate,
    replay_work,
    s1_configs,
    s1_work,
    s2_asha_params,
    s2_space,
    trial_steps,
    unique_steps,
)


def test_s1_is_48_trials_of_40_steps_branching_2_4_6_with_merge_rate_3_2() -> None:
    configs = s1_configs()
    assert len(configs) == 48
    assert sorted(configs[0]) == sorted(TUNED)
    lrs = [c["lr"] for c in configs]
    assert len({lr.value(0) for lr in lrs}) == 2
    assert len({(lr.value(0), lr.value(20)) for lr in lrs}) == 8
    assert len({(lr.value(0), lr.value(20), lr.value(30)) for lr in lrs}) == 48
    work = s1_work()
    assert all(w.stop == S1_STEPS and w.evals == (S1_STEPS,) for w in work)
    assert trial_steps(work) == 1920
    assert unique_steps(work) == 2 * 20 + 8 * 10 + 48 * 10 == 600
    assert merge_rate(work) == pytest.approx(3.2)


def test_unique_steps_counts_a_shared_prefix_once() -> None:
    a: dict[str, Sequence] = {"lr": Constant(0.1)}
    b: dict[str, Sequence] = {"lr": MultiStep(0.1, [6], 0.5)}  # the same as a on [0, 6)
    c: dict[str, Sequence] = {"lr": Piecewise([0.1, 0.05], [3])}  # the same as a on [0, 3)
    assert unique_steps([TrialWork(0, a, (10,)), TrialWork(1, a, (4, 10))]) == 10
    assert unique_steps([TrialWork(0, a, (10,)), TrialWork(1, b, (10,))]) == 10 + 4
    assert unique_steps([TrialWork(0, a, (10,)), TrialWork(1, b, (10,)), TrialWork(2, c, (10,))]) == 10 + 4 + 7
    # a shorter trial on the same path costs nothing more
    assert unique_steps([TrialWork(0, b, (10,)), TrialWork(1, a, (5,))]) == 10
    # another hyper-parameter that differs from step 0 shares nothing
    d: dict[str, Sequence] = {"lr": Constant(0.1), "bs": Constant(64)}
    e: dict[str, Sequence] = {"lr": Constant(0.1), "bs": Constant(32)}
    assert unique_steps([TrialWork(0, d, (8,)), TrialWork(1, e, (8,))]) == 16
    # the tree branches on values: a warmup into a cosine and into a multistep both train step 5 at the
    # peak, so they share steps 0..5 although their segments differ from step 5 on
    cos: dict[str, Sequence] = {"lr": Warmup(0.01, 5, Cosine(0.1, 0.001, 40))}
    ms: dict[str, Sequence] = {"lr": Warmup(0.01, 5, MultiStep(0.1, [20], 0.1))}
    assert unique_steps([TrialWork(0, cos, (10,)), TrialWork(1, ms, (10,))]) == 6 + 2 * 4


def test_s2_space_and_asha_rungs() -> None:
    space = s2_space()
    assert space.size() == 64
    tuner = ASHA(space, **s2_asha_params())
    assert tuner.steps == [4, 16, 64]
    # every learning-rate schedule starts with the warmup shared by its peak
    lrs = {c["lr"] for c in space}
    assert all(isinstance(lr, Warmup) for lr in lrs)
    assert len({lr.values(0, 4).__repr__() for lr in lrs}) == 2


def _fake_loss(config: dict[str, Sequence], step: int) -> dict[str, float]:
    lr, bs = float(config["lr"].value(step)), float(config["bs"].value(step))
    return {"loss": abs(lr - 0.06) + bs / 1000 + 1.0 / (1 + step)}


def test_replay_work_is_what_asha_submitted() -> None:
    tuner = ASHA(s2_space(), **s2_asha_params())
    run = run_sync(tuner, _fake_loss)
    submits = run.submits()
    work = replay_work(submits)
    assert [w.trial_id for w in work] == sorted(tuner.trials)
    for w in work:
        asked = sorted(s.step for s in submits if s.trial_id == w.trial_id)
        assert list(w.evals) == asked
        assert w.stop == max(tuner.trials[w.trial_id].results)
        assert w.config == tuner.trials[w.trial_id].config
        assert set(w.evals) <= {4, 16, 64}
    stops = [w.stop for w in work]
    assert stops.count(4) > stops.count(16) > stops.count(64) >= 1
    assert trial_steps(work) == sum(stops)
    assert merge_rate(work) > 2  # S2's sharing target needs this much


def test_replay_work_orders_steps_and_keeps_the_first_config() -> None:
    c0: dict[str, Sequence] = {"lr": Constant(0.1)}
    c1: dict[str, Sequence] = {"lr": Constant(0.2)}
    subs = [Submit(1, c1, 16), Submit(0, c0, 4), Submit(1, c1, 4), Submit(0, c0, 4)]
    work = replay_work(subs)
    assert [(w.trial_id, w.evals) for w in work] == [(0, (4,)), (1, (4, 16))]
    assert work[1].config_json() == {"lr": [[0, None, "const", ["float", 0.2]]]}


def test_max_abs_diff() -> None:
    assert max_abs_diff({"a": 1.0, "b": 2.0}, {"a": 1.0, "b": 2.5}) == 0.5
    assert max_abs_diff({"a": 1.0}, {}) == float("inf")
    assert max_abs_diff({}, {"a": 1.0}) == float("inf")


def _fig(system: str, metrics: dict[int, dict[str, float]], executed: int | None = None) -> vs_raytune.RunFigures:
    return vs_raytune.RunFigures(system, "S1", 1.0, 1.0, 1.0, metrics, executed=executed)


def test_check_exact() -> None:
    ref = {0: {"loss": 0.5, "accuracy": 0.9}, 1: {"loss": 0.4, "accuracy": 0.95}}
    close = {0: {"loss": 0.5 + 1e-9, "accuracy": 0.9}, 1: dict(ref[1])}
    ok, lines = vs_raytune.check_exact("S1", ref, [_fig("stagetree", close, 30), _fig("ray-tune", ref)], 30)
    assert ok and len(lines) == 2
    ok, _ = vs_raytune.check_exact("S1", ref, [_fig("stagetree", close, 31)], 30)
    assert not ok  # a shared prefix trained twice
    far = {0: {"loss": 0.5 + 1e-5, "accuracy": 0.9}, 1: dict(ref[1])}
    assert not vs_raytune.check_exact("S1", ref, [_fig("stagetree", far, 30)], 30)[0]
    missing = {0: dict(ref[0])}
    assert not vs_raytune.check_exact("S1", ref, [_fig("ray-tune", missing)], 30)[0]


def test_tree_cpu_counts_this_process() -> None:
    st = vs_raytune._stat(os.getpid())
    assert st is not None and st[0] == os.getppid()
    assert vs_raytune._tree_cpu([os.getpid()]) >= st[1]
    assert vs_raytune._tree_cpu([]) == 0.0


def test_without_ray_the_bench_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    monkeypatch.setenv("GRPC_VERBOSITY", os.environ.get("GRPC_VERBOSITY", "ERROR"))  # main() sets it

    def never(*_: object) -> int:
        raise AssertionError("the bench must not start without ray")

    assert vs_raytune.main(["--runs", "1"], runner=never) == 2
    err = capsys.readouterr().err
    assert "pip install" in err and "ray[tune]" in err and "Traceback" not in err
