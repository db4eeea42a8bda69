"""ASHA against Algorithm 2 of Li et al. (MLSys 2020): by hand, and against the reference on random traces."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagetree.client.spaces import GridSearchSpace, RandomSearchSpace, TrialConfig, Uniform
from stagetree.client.tuners import (
    ASHA,
    Result,
    Submit,
    Trial,
    run_sync,
    simulate,
)
from stagetree.core.errors import InvalidArgument
from tests.sim.asha_check import asha_promotions_ok, check_asha_trace, random_asha_run

X = [5, 1, 8, 3, 9, 2, 7, 4, 6]  # trial i has metric X[i] at every step


def constant_metric(config: TrialConfig, step: int) -> dict[str, float]:
    return {"acc": float(config["x"].value(0))}


def make(workers: int = 1, **kw: object) -> ASHA:
    args: dict[str, object] = {"metric": "acc", "eta": 3, "min_step": 1, "max_step": 9, "max_concurrent": workers}
    args.update(kw)
    return ASHA(GridSearchSpace({"x": X}), **args)  # type: ignore[arg-type]


def test_promotion_sequence_by_hand_one_worker() -> None:
    tuner = make()
    run = run_sync(tuner, constant_metric)
    assert [(s.trial_id, s.step) for s in run.submits()] == [
        (0, 1), (1, 1), (2, 1),
        (2, 3),  # rung 0 = {5, 1, 8}: top 1 is trial 2 (8)
        (3, 1),  # rung 1 = {2}: floor(1/3) = 0; rung 0's top 1 is already promoted: grow
        (4, 1),
        (4, 3),  # rung 0 = {5,1,8,3,9}: top 1 is now trial 4 (9)
        (5, 1), (6, 1), (7, 1),  # top 2 = {4, 2}, both promoted
        (8, 1),
        (6, 3),  # 9 in rung 0: top 3 = {4, 2, 6}; trial 6 (7) not yet promoted
        (4, 9),  # rung 1 = {2, 4, 6}: top 1 = trial 4
    ]  # fmt: skip
    assert tuner.promotions == [(2, 1), (4, 1), (6, 1), (4, 2)]
    assert [len(r) for r in tuner.rungs] == [9, 3, 1]
    assert (
        check_asha_trace(
            run.trace, metric="acc", mode="max", eta=3, min_step=1, max_step=9, max_concurrent=1, max_trials=9
        )
        == []
    )


def test_asynchronous_two_workers_by_hand() -> None:
    # speed 1 step/unit for every trial; trial 1 (x=1) is slow: 10 units a step.
    tuner = make(workers=2, max_trials=6)
    run = simulate(tuner, constant_metric, workers=2, step_time=lambda t, c: 10.0 if t == 1 else 1.0)
    subs = [(s.trial_id, s.step) for s in run.submits()]
    # t=0: trials 0, 1 start. t=1: 0 done (rung0 {0}) -> new 2. t=2: 2 done -> rung0 {0,2}: new 3.
    # t=3: 3 done -> rung0 {0,2,3}: top1 = 2 (8) -> promote 2 to step 3 (2 more steps, done at t=5).
    # t=5: 2@3 done -> rung1 {2}; rung0 top1 promoted -> new 4. t=6: 4 (9) done -> rung0 of 4, top 1 = 4 -> promote.
    # t=8: 4@3 done -> new 5 (the last of max_trials=6). t=9: 5 done; rung0 {0,2,3,4,5} top1=4 promoted: idle.
    # t=10: the slow trial 1 reports; rung0 has 6: top 2 = {4, 2}, both promoted; rung1 {2,4}: nothing. Finish.
    assert subs == [(0, 1), (1, 1), (2, 1), (3, 1), (2, 3), (4, 1), (4, 3), (5, 1)]
    assert [r.trial_id for r in run.events() if isinstance(r, Result)] == [0, 2, 3, 2, 4, 4, 5, 1]
    assert run.makespan == 10.0
    assert tuner.finished


def test_ties_go_to_the_lower_trial_id_and_nan_ranks_last() -> None:
    tuner = make(max_trials=3)
    run_sync(tuner, lambda c, s: {"acc": 1.0})
    assert tuner.promotions == [(0, 1)]
    tuner = make(max_trials=3)
    run_sync(tuner, lambda c, s: {"acc": float("nan") if int(c["x"].value(0)) == 5 else 0.0})
    assert tuner.promotions == [(1, 1)]


def test_minimize_and_early_stopping_rate() -> None:
    tuner = make(mode="min", min_step=1, max_step=27, early_stopping_rate=1)
    assert tuner.steps == [3, 9, 27]  # r * eta**(s + k)
    run = run_sync(tuner, constant_metric)
    assert tuner.promotions[0] == (1, 1)  # rung 0 = {5, 1, 8}: the lowest is trial 1
    assert run.submits()[0].step == 3


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    workers=st.integers(1, 9),
    eta=st.integers(2, 4),
    max_step=st.sampled_from([8, 16, 27, 64]),
    max_trials=st.integers(1, 50),
    s=st.integers(0, 1),
    mode=st.sampled_from(["max", "min"]),
    fail_rate=st.sampled_from([0.0, 0.2]),
)
def test_matches_the_reference_on_random_asynchronous_traces(
    seed: int, workers: int, eta: int, max_step: int, max_trials: int, s: int, mode: str, fail_rate: float
) -> None:
    if eta**s > max_step:
        return
    assert asha_promotions_ok(
        seed, workers=workers, eta=eta, max_step=max_step, max_trials=max_trials, early_stopping_rate=s, mode=mode,
        fail_rate=fail_rate,
    )  # fmt: skip
    tuner, run = random_asha_run(
        seed, workers=workers, eta=eta, max_step=max_step, max_trials=max_trials, early_stopping_rate=s, mode=mode,
        fail_rate=fail_rate,
    )  # fmt: skip
    # never promoted twice; a promotion to rung k+1 only of a trial that completed rung k
    assert len(set(tuner.promotions)) == len(tuner.promotions)
    for trial, k in tuner.promotions:
        assert trial in tuner.rungs[k - 1]
    # at the end nothing is promotable: the top |rung k| // eta of every rung below the top were promoted
    for k in range(len(tuner.rungs) - 1):
        rung = tuner.rungs[k]
        top = sorted(rung, key=lambda t: (-rung[t], t))[: len(rung) // eta]
        assert set(top) <= tuner.promoted[k]
    assert all(job.end >= job.start for job in run.jobs)
    busy = sorted([(j.start, 1) for j in run.jobs] + [(j.end, -1) for j in run.jobs], key=lambda e: (e[0], e[1]))
    running = 0
    for _, d in busy:
        running += d
        assert running <= workers


def test_the_checker_catches_a_wrong_promotion() -> None:
    _, run = random_asha_run(3, workers=4)
    assert (
        check_asha_trace(
            run.trace, metric="acc", mode="max", eta=3, min_step=1, max_step=27, max_concurrent=4, max_trials=40
        )
        == []
    )
    # Tamper: promote someone else at the first promotion.
    i, j = next(
        (i, j)
        for i, (_, acts) in enumerate(run.trace)
        for j, a in enumerate(acts)
        if isinstance(a, Submit) and a.step == 3
    )
    event, actions = run.trace[i]
    bad = list(actions)
    victim = bad[j]
    assert isinstance(victim, Submit)
    bad[j] = dataclasses.replace(victim, trial_id=(victim.trial_id + 1) % 3)
    tampered = [*run.trace[:i], (event, bad), *run.trace[i + 1 :]]
    problems = check_asha_trace(
        tampered, metric="acc", mode="max", eta=3, min_step=1, max_step=27, max_concurrent=4, max_trials=40
    )
    assert any("expected to promote" in p for p in problems)


class CeilTop(ASHA):
    """Broken: takes the top ceil(|rung| / eta) instead of the floor."""

    def get_job(self) -> tuple[Trial, int] | None:
        for k in range(self.k_max - 1, -1, -1):
            rung = self.rungs[k]
            for t in sorted(rung, key=lambda t: (-rung[t], t))[: -(-len(rung) // self.eta)]:
                if t not in self.promoted[k]:
                    self.promoted[k].add(t)
                    return self.trials[t], k + 1
        if len(self.trials) < self.max_trials:
            return self._new_trial(self.source.next()), 0
        return None


class TiesToHigherId(ASHA):
    """Broken: breaks ties in the metric towards the higher trial id."""

    def get_job(self) -> tuple[Trial, int] | None:
        for k in range(self.k_max - 1, -1, -1):
            rung = self.rungs[k]
            for t in sorted(rung, key=lambda t: (-rung[t], -t))[: len(rung) // self.eta]:
                if t not in self.promoted[k]:
                    self.promoted[k].add(t)
                    return self.trials[t], k + 1
        if len(self.trials) < self.max_trials:
            return self._new_trial(self.source.next()), 0
        return None


class GrowsFirst(ASHA):
    """Broken: grows the bottom rung while the budget lasts, promotes only after."""

    def get_job(self) -> tuple[Trial, int] | None:
        if len(self.trials) < self.max_trials:
            return self._new_trial(self.source.next()), 0
        return super().get_job()


@pytest.mark.parametrize("broken", [CeilTop, TiesToHigherId, GrowsFirst])
def test_the_checker_catches_broken_variants(broken: type[ASHA]) -> None:
    caught = 0
    for seed in range(10):
        _, run = random_asha_run(seed, workers=3, tuner_class=broken)
        caught += bool(
            check_asha_trace(
                run.trace, metric="acc", mode="max", eta=3, min_step=1, max_step=27, max_concurrent=3, max_trials=40
            )
        )
    assert caught >= 5


@pytest.mark.parametrize(
    ("kw", "fragment"),
    [
        ({"max_concurrent": 0}, "max_concurrent"),
        ({"eta": 1}, "eta"),
        ({"max_step": 9, "early_stopping_rate": 3}, "early_stopping_rate"),
        ({"min_step": 10, "max_step": 9}, "min_step"),
        ({"max_trials": 10}, "more than the 9"),
    ],
)
def test_bad_arguments(kw: dict[str, object], fragment: str) -> None:
    with pytest.raises(InvalidArgument, match=fragment):
        make(**kw)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="max_trials: is required"):
        ASHA(RandomSearchSpace({"x": Uniform(0, 1)}), metric="acc", max_step=9, max_concurrent=2)
