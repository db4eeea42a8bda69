"""The live adapter of the four papers' policies (``core.policies.live``): validation and the pure round."""

from __future__ import annotations

import pytest

from stagetree.core.errors import InvalidArgument
from stagetree.core.policies.hermes import TimeShareJob
from stagetree.core.policies.live import (
    Running,
    StudyPolicies,
    Work,
    eval_points,
    losses_of,
    on_reports,
    order_work,
    parse_policies,
    place_work,
    plan_round,
    preempt_for,
)
from stagetree.core.policies.pop import Verdict
from stagetree.core.slots import Slot

CPU0 = Slot("cpu0", "nm", cpu_cores=1)
CPU1 = Slot("cpu1", "nm", cpu_cores=1)


def test_parse_policies_round_trips_and_fills_defaults() -> None:
    p = parse_policies(
        {
            "time_share": "hermes",
            "time_share_params": {"quantum_s": 2, "eval_every": 10},
            "placement": "wfd",
            "placement_params": {"compute": 40},
            "qos": "urgent",
            "order": "critical_path",
        }
    )
    assert p.time_share is not None and p.time_share.quantum_s == 2.0 and p.time_share.eval_every == 10
    assert p.placement is not None and p.placement.compute == 40.0 and p.placement.oversub == 1.0
    assert p.qos == "urgent" and p.order == "critical_path"
    assert parse_policies(p.to_json()) == p


@pytest.mark.parametrize(
    ("obj", "says"),
    [
        ({"time_share": "lottery"}, "valid: ['fifo', 'hermes', 'rr', 'slaq']"),
        ({"placement": "best_fit"}, "'wfd'"),
        ({"qos": "asap"}, "'urgent', 'prior', 'normal'"),
        ({"order": "random"}, "critical_path"),
        ({"pacing": "x"}, "unknown keys ['pacing']"),
        ({"time_share_params": {"quantum_s": 1}}, "without policies.time_share"),
        ({"time_share": "hermes", "time_share_params": {"quantum": 1}}, "unknown parameters ['quantum']"),
        ({"time_share": "hermes", "time_share_params": {"quantum_s": "1"}}, "must be a float"),
        ({"time_share": "hermes", "time_share_params": {"quantum_s": 0}}, "quantum_s > 0"),
        ({"placement": "wf", "placement_params": {"compute": 150}}, "compute <= 100 * oversub"),
        ([], "must be an object"),
    ],
)
def test_parse_policies_rejects_with_the_valid_names(obj: object, says: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        parse_policies(obj)
    assert says in e.value.message


def test_genie_serves_urgent_work_before_older_longer_normal_work() -> None:
    work = [Work(0, "normal", "a", 40.0, 0.0), Work(1, "urgent", "b", 10.0, 5.0), Work(2, "plain", "c", 20.0, 1.0)]
    pols = {"urgent": StudyPolicies(qos="urgent"), "normal": StudyPolicies(qos="normal")}
    assert next(w.key for w in order_work(work, pols, {}, now=6.0)) == 1
    assert [w.key for w in order_work(work, {}, {}, now=6.0)] == [0, 1, 2]  # no class: the base order


def test_time_sharing_order_puts_never_run_work_first_then_largest_convergence() -> None:
    ts = parse_policies({"time_share": "hermes"})
    slow, fast = TimeShareJob("slow"), TimeShareJob("fast")
    slow.record([1.0, 0.99], 1.0)
    slow.record([0.98, 0.97], 2.0)
    fast.record([1.0, 0.5], 1.0)
    fast.record([0.3, 0.2], 2.0)
    work = [Work(0, "s", "slow", 1, 0), Work(1, "s", "fast", 1, 0), Work(2, "s", "new", 1, 0)]
    got = order_work(work, {"s": ts}, {"slow": slow, "fast": fast}, now=3.0)
    assert [w.job for w in got] == ["new", "fast", "slow"]


@pytest.mark.parametrize(("policy", "compute", "placed"), [("wfd", 40, 2), ("wfd", 60, 1), ("one_per_gpu", 40, 1)])
def test_packing_places_on_a_device_by_declared_compute(policy: str, compute: float, placed: int) -> None:
    pols = {"s": parse_policies({"placement": policy, "placement_params": {"compute": compute}})}
    work = [Work(0, "s", "a", 5.0, 0.0), Work(1, "s", "b", 9.0, 0.0)]
    got = place_work(work, [CPU0, CPU1], {}, [], pols)
    assert len(got) == placed
    if policy == "wfd":
        assert got[0][0] == 1  # decreasing: the longer work first


def test_packing_counts_running_work_and_plain_work_takes_first_free_slot() -> None:
    pols = {"s": parse_policies({"placement": "wf", "placement_params": {"compute": 60}})}
    running = [Running(7, "cpu0", "s", "x", 0.0)]
    assert place_work([Work(0, "s", "a", 1, 0)], [CPU1], {"cpu0": CPU0}, running, pols) == []
    assert place_work([Work(0, "plain", "a", 1, 0)], [CPU1], {"cpu0": CPU0}, running, pols) == [(0, "cpu1")]


def test_gpu_slots_of_one_gpu_form_one_device() -> None:
    a, b = Slot("gpu0.0", "nm", "A100", 0, 40), Slot("gpu0.1", "nm", "A100", 0, 40)
    c = Slot("gpu1.0", "nm", "A100", 1, 40)
    pols = {"s": parse_policies({"placement": "ff", "placement_params": {"compute": 50, "memory_bytes": 30}})}
    work = [Work(i, "s", str(i), 1, 0) for i in range(3)]
    got = dict(place_work(work, [a, b, c], {}, [], pols))
    assert sorted(got.values()) == ["gpu0.0", "gpu0.1", "gpu1.0"]  # memory 80 per GPU: two of 30 fit on gpu0


def test_hermes_preempts_a_job_whose_quantum_expired_for_never_run_work() -> None:
    pols = {"s": parse_policies({"time_share": "hermes", "time_share_params": {"quantum_s": 2}})}
    job = TimeShareJob("run", 0.0)
    job.record([2.0, 1.0], 2.0)
    running = [Running(3, "cpu0", "s", "run", 0.0)]
    waiting = [Work(0, "s", "new", 5, 1.0)]
    assert preempt_for(waiting, running, pols, {"run": job}, now=2.5) == [3]
    assert preempt_for(waiting, running, pols, {"run": job}, now=1.0) == []  # quantum not over
    assert preempt_for(waiting, running, {}, {"run": job}, now=2.5) == []  # not a time-sharing study
    assert preempt_for([], running, pols, {"run": job}, now=2.5) == []  # nothing waits


def test_plan_round_dispatches_free_slots_and_preempts_busy_ones() -> None:
    pols = {"s": parse_policies({"time_share": "rr", "time_share_params": {"quantum_s": 1}})}
    job = TimeShareJob("run", 0.0)
    job.record([1.0, 0.9], 1.0)
    running = [Running(3, "cpu0", "s", "run", 0.0)]
    work = [Work(0, "s", "a", 5, 1.0), Work(1, "s", "b", 5, 1.5)]
    plan = plan_round(work, [CPU1], {"cpu0": CPU0}, running, pols, {"run": job}, now=2.0)
    assert plan.dispatch == [(0, "cpu1")] and plan.preempt == [3] and plan.order == [0, 1]


def test_eval_points_and_losses() -> None:
    assert eval_points([(1, 0, 10), (2, 10, 23)], 5) == [(1, 5), (1, 10), (2, 15), (2, 20)]
    assert losses_of([(2.0, {"loss": 1.0}), (1.0, {"loss": 3.0}), (3.0, {"acc": 1.0})], "loss") == [3.0, 1.0]


def test_search_policies_validate_through_pop_config() -> None:
    p = parse_policies({"search": "pop", "search_params": {"target": 0.9, "kill_threshold": 0.5, "eval_every": 4}})
    assert p.search is not None and p.search.config().kill_threshold == 0.5
    assert parse_policies(p.to_json()) == p
    with pytest.raises(InvalidArgument, match="valid: \\['bandit', 'default', 'earlyterm', 'pop'\\]"):
        parse_policies({"search": "hyperband"})
    with pytest.raises(InvalidArgument, match=r"earlyterm needs PopConfig\.max_epochs"):
        parse_policies({"search": "earlyterm"})
    with pytest.raises(InvalidArgument, match="y_max > y_min"):
        parse_policies({"search": "pop", "search_params": {"y_min": 1.0, "y_max": 0.5}})


def test_pop_kills_a_poor_trial_at_its_first_boundary_and_orders_promising_first() -> None:
    sp = parse_policies({"search": "pop", "search_params": {"kill_threshold": 0.5, "eval_every": 3, "target": 0.9}})
    assert sp.search is not None
    policy = sp.search.make(2)
    assert on_reports(policy, "poor", 1, [0.1, 0.12, 0.11, 0.13], 10.0, 1.0, 1) is Verdict.TERMINATE
    assert on_reports(policy, "ok", 1, [0.6, 0.7], 10.0, 1.0, 1) is Verdict.CONTINUE  # no boundary yet
    work = [Work(0, "s", "a", 1, 0.0), Work(1, "s", "b", 1, 1.0)]

    class Promising:
        def priority(self, job: str) -> float | None:
            return 0.8 if job == "b" else None

    got = order_work(work, {"s": sp}, {}, now=2.0, search={"s": Promising()})  # type: ignore[dict-item]
    assert [w.job for w in got] == ["b", "a"]
