"""The tuner protocol (events in, actions out), grid and random tuners, the registry and the drivers."""

from __future__ import annotations

import pytest

from stagetree.client.spaces import GridSearchSpace, RandomSearchSpace, TrialConfig, Uniform
from stagetree.client.tuners import (
    ASHA,
    SHA,
    TUNERS,
    Action,
    Failed,
    Finish,
    GridTuner,
    RandomTuner,
    Result,
    Start,
    Stop,
    Submit,
    Trial,
    Tuner,
    make_tuner,
    run_sync,
    simulate,
)
from stagetree.client.tuners.simulate import finished_in
from stagetree.core.errors import FailedPrecondition, InvalidArgument


def grid(n: int = 4) -> GridSearchSpace:
    return GridSearchSpace({"x": list(range(n))})


def x_of(config: TrialConfig) -> float:
    return float(config["x"].value(0))


def test_grid_tuner_trains_every_config_to_max_step_once() -> None:
    tuner = GridTuner(grid(5), metric="acc", max_step=7)
    actions = tuner.start()
    assert actions == [Submit(i, grid(5).config(i), 7) for i in range(5)]
    for i in range(4):
        assert tuner.on_result(Result(i, 7, {"acc": float(i)})) == []
    assert tuner.on_result(Result(4, 7, {"acc": 0.5})) == [Finish()]
    assert tuner.finished
    best = tuner.best()
    assert best is not None and (best.trial_id, best.value) == (3, 3.0)


def test_random_tuner_keeps_max_concurrent_outstanding_and_survives_failures() -> None:
    def evaluate(config: TrialConfig, step: int) -> dict[str, float]:
        if x_of(config) < 0.3:
            raise ValueError("bad trial")
        return {"acc": x_of(config)}

    tuner = RandomTuner(
        RandomSearchSpace({"x": Uniform(0, 1)}, seed=4), metric="acc", max_step=3, n_trials=12, max_concurrent=3
    )
    assert len(tuner.start()) == 3
    tuner2 = RandomTuner(
        RandomSearchSpace({"x": Uniform(0, 1)}, seed=4), metric="acc", max_step=3, n_trials=12, max_concurrent=3
    )
    run = simulate(tuner2, evaluate, workers=8)
    assert len(run.submits()) == 12 and finished_in(run)
    failed = [t for t in tuner2.trials.values() if t.status == "failed"]
    assert failed and all("bad trial" in (t.error or "") for t in failed)
    assert all(x_of(t.config) < 0.3 for t in failed)
    peak = max(sum(1 for j in run.jobs if j.start <= t < j.end) for t in {j.start for j in run.jobs})
    assert peak == 3


def test_best_scopes_modes_and_metrics() -> None:
    tuner = SHA(grid(3), metric="acc", eta=3, max_step=3)
    tuner.start()
    tuner.on_result(Result(0, 1, {"acc": 0.9, "loss": 0.1}))
    tuner.on_result(Result(1, 1, {"acc": 0.5, "loss": 0.05}))
    tuner.on_result(Result(2, 1, {"acc": float("nan"), "loss": 3.0}))
    tuner.on_result(Result(0, 3, {"acc": 0.7, "loss": 0.4}))
    last = tuner.best()
    assert last is not None and (last.trial_id, last.step, last.value) == (0, 3, 0.7)
    every = tuner.best(scope="all")
    assert every is not None and (every.trial_id, every.step) == (0, 1)
    low = tuner.best("loss", "min")
    assert low is not None and low.trial_id == 1
    assert tuner.best("f1") is None
    worst = tuner.best(mode="min")
    assert worst is not None and worst.trial_id == 1  # NaN is the worst in either mode
    with pytest.raises(InvalidArgument, match="scope"):
        tuner.best(scope="first")


def test_events_are_validated() -> None:
    tuner = GridTuner(grid(2), metric="acc", max_step=5)
    with pytest.raises(FailedPrecondition, match="start"):
        tuner.on_result(Result(0, 5, {"acc": 1.0}))
    tuner.start()
    with pytest.raises(FailedPrecondition, match="already"):
        tuner.start()
    with pytest.raises(InvalidArgument, match="unknown trial 9"):
        tuner.on_result(Result(9, 5, {"acc": 1.0}))
    with pytest.raises(InvalidArgument, match="for step 5"):
        tuner.on_result(Result(0, 4, {"acc": 1.0}))
    with pytest.raises(InvalidArgument, match="no metric 'acc'"):
        tuner.on_result(Result(0, 5, {"loss": 1.0}))
    with pytest.raises(InvalidArgument, match="must be a number"):
        tuner.on_result(Result(0, 5, {"acc": "high"}))  # type: ignore[dict-item]
    assert tuner.on_result(Result(0, 5, {"acc": 1.0})) == []
    assert tuner.on_result(Result(0, 5, {"acc": 1.0})) == []  # delivered twice: ignored
    assert tuner.trials[0].results == {5: {"acc": 1.0}}
    assert tuner.handle(Failed(1, "boom")) == [Finish()]
    assert tuner.on_failure(Failed(1, "again")) == []  # dead work: stale
    with pytest.raises(InvalidArgument, match="unknown event"):
        tuner.handle("result")  # type: ignore[arg-type]


def test_an_event_for_work_never_submitted_is_an_error() -> None:
    tuner = SHA(grid(3), metric="acc", eta=3, max_step=3)
    tuner.start()
    tuner.on_result(Result(0, 1, {"acc": 1.0}))  # trial 0 waits for the rest of its rung
    with pytest.raises(InvalidArgument, match="outstanding Submit is for step None"):
        tuner.on_result(Result(0, 3, {"acc": 1.0}))
    with pytest.raises(InvalidArgument, match="no outstanding Submit"):
        tuner.on_failure(Failed(0, "boom"))


def test_close_stops_outstanding_work_and_late_results_are_ignored() -> None:
    tuner = GridTuner(grid(3), metric="acc", max_step=5)
    tuner.start()
    tuner.on_result(Result(0, 5, {"acc": 1.0}))
    assert tuner.close() == [Stop(1), Stop(2), Finish()]
    assert tuner.close() == []
    assert tuner.on_result(Result(1, 5, {"acc": 2.0})) == []
    assert tuner.pending() == {}
    with pytest.raises(FailedPrecondition):
        tuner.handle(Start())


class Race(Tuner):
    """Two trials race to step 10; the first to report wins and the other is stopped."""

    def _on_start(self) -> list[Action]:
        return [self._submit(self._new_trial(grid(2).config(i)), 10) for i in range(2)]

    def _on_result(self, trial: Trial, step: int) -> list[Action]:
        actions: list[Action] = []
        for other in self.trials.values():
            if other is not trial:
                actions.extend(self._stop(other))
        return actions

    def _on_failure(self, trial: Trial) -> list[Action]:
        return []


def test_stop_cancels_running_work_in_the_simulator() -> None:
    tuner = Race(metric="acc")
    run = simulate(tuner, lambda c, s: {"acc": 1.0}, workers=2, step_time=lambda t, c: 1.0 + t)
    assert run.trace[1][1] == [Stop(1), Finish()]
    cancelled = [j for j in run.jobs if j.cancelled]
    assert len(cancelled) == 1 and cancelled[0].trial_id == 1 and cancelled[0].end == 10.0
    assert run.makespan == 10.0
    assert tuner.trials[1].status == "stopped"
    # one worker: the loser is still queued when the winner reports, and never runs
    run = simulate(Race(metric="acc"), lambda c, s: {"acc": 1.0}, workers=1)
    assert [j.trial_id for j in run.jobs] == [0]
    run = run_sync(Race(metric="acc"), lambda c, s: {"acc": 1.0})
    assert [j.trial_id for j in run.jobs] == [0]


def test_simulated_durations_resume_from_the_last_step() -> None:
    tuner = ASHA(grid(9), metric="acc", eta=3, max_step=9, max_concurrent=1)
    run = simulate(tuner, lambda c, s: {"acc": x_of(c)}, workers=1, step_time=2.0)
    promoted = [j for j in run.jobs if j.step == 3]
    assert promoted and all(j.from_step == 1 and j.end - j.start == 4.0 for j in promoted)
    assert run.makespan == sum(j.end - j.start for j in run.jobs)


def test_registry() -> None:
    assert set(TUNERS) == {"grid", "random", "sha", "asha", "hyperband", "median", "pbt", "early_stop"}
    tuner = make_tuner("asha", grid(), metric="acc", max_step=9, max_concurrent=2)
    assert isinstance(tuner, ASHA)
    with pytest.raises(InvalidArgument, match=r"unknown tuner 'bohb'; known tuners: \['asha', 'early_stop'"):
        make_tuner("bohb")
    with pytest.raises(TypeError):
        TUNERS["grid"] = GridTuner  # type: ignore[index]


def test_drivers_reject_bad_arguments() -> None:
    with pytest.raises(InvalidArgument, match="workers"):
        simulate(GridTuner(grid(), metric="acc", max_step=1), lambda c, s: {"acc": 0.0}, workers=0)
    with pytest.raises(InvalidArgument, match="step_time"):
        simulate(GridTuner(grid(), metric="acc", max_step=1), lambda c, s: {"acc": 0.0}, workers=1, step_time=-1.0)
    with pytest.raises(InvalidArgument, match="finite"):
        GridTuner(RandomSearchSpace({"x": Uniform(0, 1)}), metric="acc", max_step=1)
