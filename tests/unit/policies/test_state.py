"""The policies' soft state as plain JSON (``snapshot``/``restore``): a policy restored from the snapshot of
another decides as that one does from then on (Hermes jobs, the search policies, the live step's state)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagetree.core.config import Config
from stagetree.core.errors import InvalidArgument
from stagetree.core.ids import BatchId, JobKey, PlanId, StudyId
from stagetree.core.policies import hermes, pop
from stagetree.core.policies.curves import CurveFit
from stagetree.core.policies.state import Kill, PolicyState
from stagetree.core.policies.study import parse_policies
from stagetree.core.round import RoundDecision, RunningAttempt, plan_round
from stagetree.core.round.learn import on_reports
from stagetree.core.searchplan import SearchPlan
from stagetree.core.slots import Slot
from tests.sim.inputs import plan_work, round_input


def round_trip(data: dict[str, Any]) -> Any:
    """Through strict JSON, as the database keeps it (``allow_nan=False``: no bare NaN or Infinity)."""
    return json.loads(json.dumps(data, allow_nan=False))


def same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


TIME_SHARERS: list[hermes.TimeSharePolicy] = [
    hermes.Hermes(),
    hermes.Hermes(1.0, 3.0, (0.1, 0.2)),
    hermes.Fifo(),
    hermes.RoundRobin(),
    hermes.Slaq(),
]
losses = st.lists(
    st.one_of(st.floats(0.0, 10.0), st.sampled_from([math.inf, math.nan])), min_size=1, max_size=6
)  # a diverged loss is a real case


@settings(max_examples=60, deadline=None)
@given(before=st.lists(losses, max_size=6), after=st.lists(losses, max_size=4), arrival=st.floats(0.0, 1e6))
def test_a_restored_time_sharing_job_scores_and_grows_like_the_original(
    before: list[list[float]], after: list[list[float]], arrival: float
) -> None:
    job = hermes.TimeShareJob("j", arrival)
    for i, ls in enumerate(before):
        job.record(ls, 10.0 * (i + 1), (0.3, 0.45, 0.6))
    back = hermes.TimeShareJob.restore("j", round_trip(job.snapshot()))
    assert back.snapshot() == job.snapshot()
    for i, ls in enumerate([*after, None]):
        now = 1000.0 + i
        for p in TIME_SHARERS:
            assert same(p.score(back, now), p.score(job, now)) and p.quantum(back) == p.quantum(job), p
        if ls is None:
            break
        a, b = job.record(ls, now, (0.3, 0.45, 0.6)), back.record(ls, now, (0.3, 0.45, 0.6))
        assert json.dumps(a.__dict__) == json.dumps(b.__dict__)
        assert back.milestones_passed == job.milestones_passed


class CurveOfHistory:
    """A cheap, deterministic predictor that depends on the whole curve it is given (so a restored policy
    that lost some history would predict differently): the chance of reaching the level is its mean."""

    def __call__(self, xs: Sequence[float], ys: Sequence[float], seed: int) -> CurveFit:
        n = 100
        hit = round(min(max(float(np.mean(ys)), 0.0), 1.0) * n)
        c = np.array([0.9] * hit + [0.05] * (n - hit))
        samples = np.stack([np.full(n, 1.0), c, np.zeros(n)], axis=1)
        return CurveFit(("pow3",), (1.0,), (samples,), (0.0,))


def _config() -> pop.PopConfig:
    return pop.PopConfig(target=0.8, t_max_s=1000.0, kill_threshold=0.2, eval_every=3, max_epochs=30)


events = st.lists(
    st.tuples(st.integers(0, 4), st.floats(0.0, 1.0), st.integers(0, 3)), min_size=1, max_size=60
)  # (trial, value, idle trials waiting)


def _feed(policy: pop.SearchPolicy, evs: Sequence[tuple[int, float, int]], epochs: dict[str, int], t0: float) -> list:
    out = []
    for i, (trial, value, waiting) in enumerate(evs):
        job = f"t{trial}"
        epochs[job] = epochs.get(job, 0) + 1
        out.append(policy.on_epoch(job, epochs[job], value, t0 + i, 2.0, waiting))
    return out


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(pop.SEARCH_POLICIES)), evs=events, cut=st.integers(0, 60), slots=st.integers(1, 4))
def test_a_restored_search_policy_decides_like_the_original(
    name: str, evs: list[tuple[int, float, int]], cut: int, slots: int
) -> None:
    pred = CurveOfHistory()
    original = pop.search_policy(name, _config(), slots, pred)
    epochs: dict[str, int] = {}
    _feed(original, evs[:cut], epochs, 0.0)
    restored = pop.search_policy(name, _config(), 1, pred)  # POP takes its slot count from the snapshot
    restored.restore(round_trip(original.snapshot()))
    assert restored.snapshot() == original.snapshot()
    got = _feed(restored, evs[cut:], dict(epochs), 100.0)
    want = _feed(original, evs[cut:], dict(epochs), 100.0)
    assert got == want
    jobs = [f"t{i}" for i in range(5)]
    assert [restored.priority(j) for j in jobs] == [original.priority(j) for j in jobs]
    idle = [pop.IdleJob(j, float(-i)) for i, j in enumerate(jobs)]
    assert restored.next_job(idle) == original.next_job(idle)
    assert restored.snapshot() == original.snapshot()


def test_pop_restored_with_the_real_curve_model_estimates_alike() -> None:
    cfg = pop.PopConfig(target=0.9, t_max_s=3600.0, kill_threshold=0.15, eval_every=6)
    a = pop.Pop(cfg, 2)
    curves = {f"t{k}": [0.9 - 0.6 / (1 + 0.1 * k * e) for e in range(1, 25)] for k in (1, 3, 6)}
    for e in range(13):  # two boundaries
        for job, ys in curves.items():
            a.on_epoch(job, e + 1, ys[e], 10.0 * e, 10.0, 1)
    b = pop.Pop(cfg, 1)
    b.restore(round_trip(a.snapshot()))
    for e in range(13, 24):  # two more
        for job, ys in curves.items():
            assert b.on_epoch(job, e + 1, ys[e], 10.0 * e, 10.0, 1) == a.on_epoch(job, e + 1, ys[e], 10.0 * e, 10.0, 1)
    assert b.classes() == a.classes() and b.snapshot() == a.snapshot()
    assert a.jobs["t6"].estimate is not None and b.jobs["t6"].estimate == a.jobs["t6"].estimate


TS = parse_policies({"time_share": "hermes", "time_share_params": {"quantum_s": 2}})
SEARCH = parse_policies({"search": "pop", "search_params": {"kill_threshold": 0.3, "eval_every": 2, "target": 0.9}})
POLICIES = {"hermes": TS, "pop": SEARCH}


def _pop(slots: int) -> pop.SearchPolicy:
    assert SEARCH.search is not None
    return pop.Pop(SEARCH.search.config(), slots, CurveOfHistory())


def _state() -> PolicyState:
    """Entries of two studies, as rounds leave them: a time-sharing one and a POP one."""
    s = PolicyState()
    for job, arrival, ls in (("1:1:50", 0.0, [3.0, 2.0]), ("1:2:50", 1.0, [])):
        s.jobs[job] = hermes.TimeShareJob(job, arrival)
        if ls:
            s.jobs[job].record(ls, 5.0)
        s.own_job(job, "hermes")
    s.quantum_start[7] = 5.0
    s.own_batch(7, "hermes")
    s.preempting.add(8)
    s.pending_preempts.add(8)
    s.own_batch(8, "hermes")
    s.quantum_start[99] = 1.0  # a batch of a study without policies: nobody's, never saved
    s.search["pop"] = _pop(2)
    s.search_start["pop"] = 100.0
    for job, values in (("2:5:30", [0.5, 0.6]), ("2:6:30", [0.1, 0.12])):
        s.fed_at[job] = 110.0
        s.add_reports(job, [104.0, 110.0])
        s.epochs[job] = len(values)
        on_reports(s.search["pop"], job, 1, values, 10.0, s.epoch_s(job), 1)
        s.own_job(job, "pop")
    s.killed.add("2:6:30")
    s.pending_kills["2:6:30"] = Kill("pop", JobKey.parse("2:6:30"), "poor trial")
    return s


def _restored(s: PolicyState) -> PolicyState:
    out = PolicyState()
    for study, pol in POLICIES.items():
        out.restore(study, round_trip(s.snapshot(study)), _pop(1) if pol.search else None)
    return out


def test_each_study_snapshot_restores_its_entries() -> None:
    s = _state()
    back = _restored(s)
    for study in POLICIES:
        assert back.snapshot(study) == s.snapshot(study)
    assert back.killed == {"2:6:30"} and back.pending_kills == s.pending_kills
    assert back.pending_preempts == {8} and back.preempting == {8}
    assert back.epoch_s("2:5:30") == s.epoch_s("2:5:30") == 6.0
    assert 99 not in back.quantum_start  # owned by no study with policies
    assert back.studies() == {"hermes", "pop"}
    assert s.snapshot("hermes")["search"] is None and s.snapshot("pop")["hermes"]["jobs"] == {}


def _plan(study: str, nodes: list[int], step: int) -> SearchPlan:
    """A plan of one study whose trials are the nodes ``nodes``, each to ``step``."""
    plan = SearchPlan(study, node_ids=iter(nodes))
    for n in nodes:
        plan.add_request(Config.of({"trial": n}), step, study=study)
    return plan


def _decided(dec: RoundDecision) -> tuple[object, ...]:
    snaps = {study: dec.state.snapshot(study) for study in POLICIES}
    return (
        [(d.batch.end, [s.id for s in d.slots]) for d in dec.dispatches],
        dec.preempts,
        dec.kills,
        dec.wake_at,
        snaps,
    )


def test_a_restored_state_plans_the_same_round() -> None:
    s, back = _state(), _restored(_state())
    hermes_plan = _plan("hermes", [2], 50)  # job 1:2:50 waits; 1:1:50 runs
    pop_plan = _plan("pop", [5, 9], 30)  # jobs 2:5:30 and 2:9:30 wait
    works = [plan_work(hermes_plan, PlanId(1)), plan_work(pop_plan, PlanId(2))]
    cpu0, cpu1 = Slot("cpu0", "nm", cpu_cores=1), Slot("cpu1", "nm", cpu_cores=1)
    running = [RunningAttempt(BatchId(7), 1, PlanId(1), (cpu0,), ((1, 0, 50),), StudyId("hermes"), 5.0)]
    for now in (6.0, 8.0, 20.0):
        a, b = (
            plan_round(round_input(works, [cpu1], running=running, policies=POLICIES, state=st_, now=now))
            for st_ in (s, back)
        )
        assert _decided(a) == _decided(b)
    for st_ in (s, back):  # and the search policy goes on alike
        st_.add_reports("2:5:30", [116.0])
        st_.epochs["2:5:30"] = 3
    a_v = on_reports(s.search["pop"], "2:5:30", 3, [0.7, 0.72], 20.0, s.epoch_s("2:5:30"), 1)
    b_v = on_reports(back.search["pop"], "2:5:30", 3, [0.7, 0.72], 20.0, back.epoch_s("2:5:30"), 1)
    assert a_v == b_v and back.snapshot("pop") == s.snapshot("pop")


def test_restoring_keeps_what_is_already_there_and_forgets_by_liveness() -> None:
    s = _state()
    here = PolicyState()
    here.jobs["1:1:50"] = hermes.TimeShareJob("1:1:50", 42.0)
    here.own_job("1:1:50", "other")
    here.restore("hermes", round_trip(s.snapshot("hermes")), None)
    assert here.jobs["1:1:50"].arrival == 42.0 and here.job_study["1:1:50"] == "other"  # one job, restored once
    assert here.jobs["1:2:50"].arrival == 1.0
    here.forget_jobs({"1:2:50"})
    here.forget_batches({7})
    assert set(here.jobs) == {"1:2:50"} and set(here.quantum_start) == {7}
    assert here.preempting == set() and here.pending_preempts == {8} and set(here.batch_study) == {7, 8}


@pytest.mark.parametrize(
    "bad",
    [
        {},
        {"version": 2},
        {"version": 1, "hermes": {"jobs": {"x": {"arrival": 0}}}},
        {"version": 1, "hermes": {"jobs": {}, "quantum_start": {"b": 1.0}, "preempting": []}},
    ],
)
def test_an_unreadable_snapshot_is_an_invalid_argument_and_changes_nothing(bad: dict[str, Any]) -> None:
    s = _state()
    before = {study: s.snapshot(study) for study in POLICIES}
    with pytest.raises(InvalidArgument, match="unreadable snapshot"):
        s.restore("hermes", bad, None)
    assert {study: s.snapshot(study) for study in POLICIES} == before


def test_a_kill_names_its_point_and_non_finite_floats_stay_strict_json() -> None:
    k = Kill("s", JobKey.parse("12:345:600"), "why")
    assert (k.node, k.step) == (345, 600)
    s = PolicyState()
    s.jobs["1:1:5"] = hermes.TimeShareJob("1:1:5")
    s.jobs["1:1:5"].record([math.inf, 1.0], 3.0)  # a diverged loss
    s.own_job("1:1:5", "st")
    snap = round_trip(s.snapshot("st"))
    assert snap["hermes"]["jobs"]["1:1:5"]["quanta"][0][:3] == ["Infinity", "Infinity", 1.0]
    back = PolicyState()
    back.restore("st", snap, None)
    assert back.jobs["1:1:5"].quanta[0].rep == math.inf
