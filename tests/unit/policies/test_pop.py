"""HyperDrive POP and its baselines: Eq. 1-3 and the pool split by hand, the policies' rules, and search
studies through the live round on the simulator (``tests.sim.papers.pop``)."""

from __future__ import annotations

from collections.abc import Sequence
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagetree.core.errors import InvalidArgument
from stagetree.core.policies.curves import CurveFit
from stagetree.core.policies.pop import (
    SEARCH_POLICIES,
    Bandit,
    EarlyTerm,
    IdleJob,
    Pop,
    PopConfig,
    Verdict,
    expected_remaining,
    promising_slots,
    search_policy,
)
from tests.sim.papers.pop import Trace, cifar_like_traces, run_search


def test_expected_remaining_by_hand() -> None:
    # P(reached by 1, 2, 3 more epochs) = 0.1, 0.3, 0.6 -> p_m = 0.1, 0.2, 0.3
    # x = 1*0.1 + 2*0.2 + 3*0.3 = 1.4 epochs; ERT = 1.4 * 60 s = 84 s; p = 0.6
    r = expected_remaining([0.1, 0.3, 0.6], epoch_s=60.0, remaining_s=1000.0)
    assert r.epochs == pytest.approx(1.4)
    assert r.ert_s == pytest.approx(84.0)
    assert r.confidence == pytest.approx(0.6)


def test_expected_remaining_stops_at_the_time_left() -> None:
    # x after m = 1, 2: 0.1, 0.5 epochs (6 s, 30 s <= 60 s); m = 3 would make 84 s > 60 s: stop there.
    r = expected_remaining([0.1, 0.3, 0.6], epoch_s=60.0, remaining_s=60.0)
    assert r.ert_s == pytest.approx(60.0)
    assert r.confidence == pytest.approx(0.3)
    with pytest.raises(InvalidArgument):
        expected_remaining([0.5], epoch_s=0.0, remaining_s=1.0)


def test_pool_split_by_hand() -> None:
    # S = 4. p = 0.9: desired 1, deserved round(3.6) = 4 -> 1; p = 0.6: desired 2, deserved round(2.4) = 2 -> 2;
    # p = 0.5: desired 3, deserved 2 -> 2 (a tie: the higher threshold wins); p = 0.1: deserved 0.
    split = promising_slots([0.5, 0.9, 0.1, 0.6], slots=4)
    assert (split.promising_slots, split.threshold) == (2, 0.6)
    # k slots per trial doubles the desire: p = 0.6 -> min(4, 2) = 2; p = 0.9 -> min(2, 4) = 2 (higher p wins)
    assert promising_slots([0.5, 0.9, 0.1, 0.6], slots=4, k=2).threshold == 0.9
    assert promising_slots([], slots=4).promising_slots == 0


@given(st.lists(st.floats(0.0, 1.0), max_size=30), st.integers(0, 16), st.integers(1, 3))
def test_pool_split_never_exceeds_slots_or_trials(ps: list[float], slots: int, k: int) -> None:
    split = promising_slots(ps, slots, k)
    assert 0 <= split.promising_slots <= slots
    assert split.promising_slots <= k * sum(1 for p in ps if p >= split.threshold)


def test_bandit_action_elimination() -> None:
    b = Bandit(eps=0.5, eval_every=10)
    assert b.on_epoch("a", 10, 0.60, 0.0, 60.0, 0) is Verdict.CONTINUE
    assert b.on_epoch("b", 5, 0.30, 0.0, 60.0, 0) is Verdict.CONTINUE  # not on a boundary
    # 0.39 * 1.5 = 0.585 < 0.60: eliminated; 0.41 * 1.5 = 0.615 > 0.60: kept
    assert b.on_epoch("b", 10, 0.39, 0.0, 60.0, 0) is Verdict.TERMINATE
    assert b.on_epoch("c", 10, 0.41, 0.0, 60.0, 0) is Verdict.CONTINUE


class Stub:
    """A predictor whose curve reaches ``level`` by the epochs in ``at`` with probability ``p``."""

    def __init__(self, p: float, level: float = 0.9) -> None:
        self.p, self.level, self.calls = p, level, 0

    def __call__(self, xs: Sequence[float], ys: Sequence[float], seed: int) -> CurveFit:
        self.calls += 1
        n = 100
        hit = round(self.p * n)
        # pow3 samples c - a x^-alpha: `hit` of them rise to `level`, the rest stay at 0.05
        c = np.array([self.level] * hit + [0.05] * (n - hit))
        samples = np.stack([np.full(n, 1.0), c, np.zeros(n)], axis=1)  # alpha, c, a
        return CurveFit(("pow3",), (1.0,), (samples,), (0.0,))


def test_earlyterm_kills_below_delta() -> None:
    low, high = Stub(0.02), Stub(0.5)
    et = EarlyTerm(max_epochs=120, delta=0.05, eval_every=30, predictor=low)
    for e in range(1, 30):
        assert et.on_epoch("a", e, 0.3, 0.0, 60.0, 0) is Verdict.CONTINUE
    assert low.calls == 0
    assert et.on_epoch("a", 30, 0.3, 0.0, 60.0, 0) is Verdict.TERMINATE
    et2 = EarlyTerm(max_epochs=120, predictor=high)
    assert et2.on_epoch("a", 30, 0.3, 0.0, 60.0, 0) is Verdict.CONTINUE


def config() -> PopConfig:
    return PopConfig(target=0.77, t_max_s=24 * 3600.0, kill_threshold=0.15, max_epochs=120)


def test_pop_kills_poor_keeps_promising_and_suspends_opportunistic() -> None:
    pop = Pop(config(), slots=2, predictor=Stub(0.9))
    assert pop.on_epoch("dead", 10, 0.10, 600.0, 60.0, 5) is Verdict.TERMINATE  # below the kill threshold
    assert pop.on_epoch("good", 10, 0.50, 600.0, 60.0, 5) is Verdict.CONTINUE  # p = 0.9: promising
    assert pop.classes() == {"dead": "poor", "good": "promising"}
    unlikely = Pop(config(), slots=2, predictor=Stub(0.01))
    assert unlikely.on_epoch("x", 10, 0.50, 600.0, 60.0, 5) is Verdict.TERMINATE  # p < 0.05
    meh = Pop(config(), slots=2, predictor=Stub(0.2))  # round(2 * 0.2) = 0 promising slots
    assert meh.on_epoch("m", 10, 0.50, 600.0, 60.0, 5) is Verdict.SUSPEND
    assert meh.on_epoch("n", 10, 0.50, 600.0, 60.0, 0) is Verdict.CONTINUE  # nothing waits: keep going
    assert meh.on_epoch("m", 11, 0.50, 600.0, 60.0, 5) is Verdict.CONTINUE  # not a boundary


def test_pop_serves_promising_first_then_round_robin() -> None:
    pop = Pop(config(), slots=4, predictor=Stub(0.9))
    pop.on_epoch("p", 10, 0.5, 600.0, 60.0, 0)
    idle = [IdleJob("new", 0.0), IdleJob("old", 10.0, True), IdleJob("p", 20.0, True)]
    assert pop.next_job(idle) == "p"
    assert pop.next_job(idle[:2]) == "new"  # longest idle first
    assert pop.priority("p") == pytest.approx(0.9) and pop.priority("new") is None


def test_registry_names_the_known_policies() -> None:
    assert set(SEARCH_POLICIES) == {"default", "bandit", "earlyterm", "pop"}
    with pytest.raises(InvalidArgument, match="known"):
        search_policy("nope", config(), 4)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), slots=st.integers(1, 5), policy=st.sampled_from(sorted(SEARCH_POLICIES)))
def test_search_runs_every_trial_to_an_end_and_never_loses_epochs(seed: int, slots: int, policy: str) -> None:
    traces = cifar_like_traces(n=12, max_epochs=30, seed=seed)
    with mock.patch("stagetree.core.policies.pop.fit_curve", lambda xs, ys, seed: Stub(0.3)(xs, ys, seed)):
        run = run_search(traces, policy, slots, target=2.0, eval_every=5)  # unreachable: the search runs out
    rep = run.report
    assert run.time_to_target == float("inf")
    assert len(rep.served_at) + len(rep.cancelled) == len(traces)  # every trial ends: completed or killed
    # suspending never loses or repeats an epoch: each one trained once, and the policy fed each at most
    # once (a trial's last epochs, after it completed or was killed, need no verdict)
    assert rep.duplicate_steps == 0 and rep.executed_steps <= sum(t.max_epochs for t in traces)
    assert all(run.fed.get(t, 0) <= n for t, n in run.trained.items())
    assert all(run.trained[t.id] == t.max_epochs for t in traces if t.id in rep.served_at)


def test_target_time_is_when_a_trial_first_reports_it() -> None:
    traces = [Trace("a", 60.0, (0.2, 0.5, 0.6)), Trace("b", 30.0, (0.3, 0.79, 0.9))]
    run = run_search(traces, "default", 2, target=0.78)
    assert run.time_to_target == pytest.approx(60.0)  # b's second epoch ends at 60 s
    one = run_search(traces, "default", 1, target=0.78)
    # a first (3 x 60 s), then b's second epoch (a round follows a's end by round_delay_s)
    assert one.time_to_target == pytest.approx(180.0 + 60.0, abs=0.1)
