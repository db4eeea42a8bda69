"""SHA, Hyperband and TreeML's EarlyStopTuner against hand-worked examples."""

from __future__ import annotations

import pytest

from stagetree.client.spaces import GridSearchSpace, RandomSearchSpace, TrialConfig, Uniform
from stagetree.client.tuners import SHA, EarlyStopTuner, Finish, Hyperband, Schedule, Submit, run_sync, simulate
from stagetree.client.tuners.halving import rung_steps
from stagetree.core.errors import InvalidArgument

# acc of trial x at each rung step: the ranking changes between rungs on purpose.
ACC = {
    1: [3, 7, 1, 8, 0, 6, 2, 5, 4],
    3: [0, 9, 0, 1, 0, 4, 0, 0, 0],
    9: [0, 5, 0, 0, 0, 0, 0, 0, 0],
}


def table(config: TrialConfig, step: int) -> dict[str, float]:
    return {"acc": float(ACC[step][int(config["x"].value(0))])}


def steps_of(run_submits: list[Submit]) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for s in run_submits:
        out.setdefault(s.step, set()).add(int(s.config["x"].value(0)))
    return out


def test_sha_nine_trials_eta_three_exact_survivors() -> None:
    tuner = SHA(GridSearchSpace({"x": list(range(9))}), metric="acc", eta=3, min_step=1, max_step=9)
    run = run_sync(tuner, table)
    assert steps_of(run.submits()) == {1: set(range(9)), 3: {3, 1, 5}, 9: {1}}
    best = tuner.best()
    assert best is not None and (best.trial_id, best.step, best.value) == (1, 9, 5.0)
    # rung 1 starts only when all of rung 0 reported: the 9 results come before any step-3 submit
    first_promotion = next(
        i for i, (_, acts) in enumerate(run.trace) if any(isinstance(a, Submit) and a.step == 3 for a in acts)
    )
    assert first_promotion == 9
    assert sum(isinstance(a, Finish) for _, acts in run.trace for a in acts) == 1
    assert {t.status for t in tuner.trials.values()} == {"done", "stopped"}


def test_sha_minimize_keeps_the_lowest() -> None:
    tuner = SHA(GridSearchSpace({"x": list(range(9))}), metric="acc", mode="min", eta=3, max_step=9)
    run = run_sync(tuner, table)
    # lowest at step 1: x=4 (0), x=2 (1), x=6 (2); at step 3 all 0: ties go to the lower trial id
    assert steps_of(run.submits()) == {1: set(range(9)), 3: {4, 2, 6}, 9: {2}}


def test_sha_failed_trial_is_dropped_and_survivors_still_go_on() -> None:
    def flaky(config: TrialConfig, step: int) -> dict[str, float]:
        if int(config["x"].value(0)) == 3:
            raise RuntimeError("out of memory")
        return table(config, step)

    tuner = SHA(GridSearchSpace({"x": list(range(9))}), metric="acc", eta=3, max_step=9)
    run = run_sync(tuner, flaky)
    assert steps_of(run.submits())[3] == {1, 5, 7}  # x=3 (the best at step 1) failed; the next in line goes
    assert tuner.trials[3].status == "failed" and "out of memory" in (tuner.trials[3].error or "")


def test_sha_rungs_floor_like_the_paper() -> None:
    assert rung_steps("SHA", 1, 10, 3) == [1, 3, 9]
    assert rung_steps("SHA", 2, 54, 3) == [2, 6, 18, 54]
    tuner = SHA(RandomSearchSpace({"x": Uniform(0, 1)}), metric="acc", n_trials=8, eta=3, max_step=9)
    run = run_sync(tuner, lambda c, s: {"acc": float(c["x"].value(0))})
    counts = {s: len(v) for s, v in steps_of_trials(run.submits()).items()}
    assert counts == {1: 8, 3: 2}  # floor(8/9) = 0 trials at step 9: the bracket ends early


def steps_of_trials(subs: list[Submit]) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for s in subs:
        out.setdefault(s.step, set()).add(s.trial_id)
    return out


def test_hyperband_bracket_sizes_match_li_et_al_table_1() -> None:
    tuner = Hyperband(RandomSearchSpace({"x": Uniform(0, 1)}, seed=1), metric="acc", eta=3, max_step=81)
    got = [(b.steps, b.counts) for b in tuner.brackets]
    assert got == [
        ([1, 3, 9, 27, 81], [81, 27, 9, 3, 1]),
        ([3, 9, 27, 81], [34, 11, 3, 1]),
        ([9, 27, 81], [15, 5, 1]),
        ([27, 81], [8, 2]),
        ([81], [5]),
    ]
    run = simulate(tuner, lambda c, s: {"acc": float(c["x"].value(0)) * s}, workers=16)
    assert len(tuner.trials) == 81 + 34 + 15 + 8 + 5
    per_bracket_step: dict[tuple[int, int], int] = {}
    for s in run.submits():
        b = tuner.bracket_of[s.trial_id]
        per_bracket_step[(b, s.step)] = per_bracket_step.get((b, s.step), 0) + 1
    for i, (steps, counts) in enumerate(got):
        assert [per_bracket_step[(i, st)] for st in steps] == counts
    best = tuner.best()
    assert best is not None and best.step == 81


def test_hyperband_cycles_a_small_grid() -> None:
    tuner = Hyperband(GridSearchSpace({"x": [1, 2, 3]}), metric="acc", eta=2, max_step=4)
    run = run_sync(tuner, lambda c, s: {"acc": float(c["x"].value(0))})
    assert [(b.steps, b.counts) for b in tuner.brackets] == [([1, 2, 4], [4, 2, 1]), ([2, 4], [3, 1]), ([4], [3])]
    assert [int(s.config["x"].value(0)) for s in run.submits() if s.trial_id < 4 and s.step == 1] == [1, 2, 3, 1]


def test_early_stop_tuner_figure_5_3() -> None:
    accs = [0.61, 0.72, 0.55, 0.80, 0.40, 0.77, 0.69, 0.58]
    space = GridSearchSpace({"x": list(range(8))})

    def evaluate(config: TrialConfig, step: int) -> dict[str, float]:
        x = int(config["x"].value(0))
        return {"test_acc": accs[x] + (0.01 * x if step == 10 else 0.0), "loss": 1.0}

    tuner = EarlyStopTuner(Schedule.from_milestones((5, 8), (10, 4)), space, "test_acc")
    run = run_sync(tuner, evaluate)
    assert steps_of_trials(run.submits()) == {5: set(range(8)), 10: {3, 5, 1, 6}}
    best = tuner.best()
    assert best is not None and (best.trial_id, best.step) == (3, 10)
    worst = EarlyStopTuner(Schedule.from_milestones((5, 8), (10, 4)), space, "test_acc", mode="min")
    assert steps_of_trials(run_sync(worst, evaluate).submits())[10] == {4, 2, 7, 0}


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda: SHA(GridSearchSpace({"x": [1]}), metric="acc", eta=1, max_step=9), "eta"),
        (lambda: SHA(GridSearchSpace({"x": [1]}), metric="acc", min_step=5, max_step=2), "max_step"),
        (lambda: SHA(GridSearchSpace({"x": [1]}), metric="acc", n_trials=2, max_step=9), "more than the 1"),
        (lambda: SHA(RandomSearchSpace({"x": Uniform(0, 1)}), metric="acc", max_step=9), "n_trials: is required"),
        (lambda: SHA(GridSearchSpace({"x": [1]}), metric="", max_step=9), "metric"),
        (lambda: SHA(GridSearchSpace({"x": [1]}), metric="acc", mode="best", max_step=9), "mode"),
        (lambda: SHA({"x": [1]}, metric="acc", max_step=9), "space"),  # type: ignore[arg-type]
        (lambda: Hyperband(GridSearchSpace({"x": [1]}), metric="acc", max_step=0), "max_step"),
        (lambda: Schedule.from_milestones(), "at least one"),
        (lambda: Schedule.from_milestones((10, 8), (5, 4)), "increasing"),
        (lambda: Schedule.from_milestones((5, 4), (10, 8)), "cannot grow"),
        (lambda: Schedule.from_milestones((5, 0)), "n_trials"),
        (lambda: Schedule.from_milestones((5,)), r"milestones\[0\]"),  # type: ignore[arg-type]
        (
            lambda: EarlyStopTuner(Schedule.from_milestones((5, 8)), GridSearchSpace({"x": [1, 2]}), "acc"),
            "more than the 2",
        ),
        (lambda: EarlyStopTuner([(5, 8)], GridSearchSpace({"x": [1]}), "acc"), "Schedule"),  # type: ignore[arg-type]
    ],
)
def test_bad_arguments(make: object, fragment: str) -> None:
    with pytest.raises(InvalidArgument, match=fragment):
        make()  # type: ignore[operator]
