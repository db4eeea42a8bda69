"""GENIE: Eq. 1-5 and Alg. 1 by hand, the lightweight-profile fit, the baselines, launching, and QoS
studies through the live round on the simulator (``tests.sim.papers.genie``)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagetree.core.errors import InvalidArgument
from stagetree.core.policies.genie import (
    LOST_TIER,
    QUEUE_POLICIES,
    WIDTH_POLICIES,
    ClusterShape,
    PerfModel,
    Placement,
    ProfileRun,
    Task,
    cer,
    choose_width,
    cost,
    deadline_met,
    ect,
    fit_perf_model,
    fit_placement,
    genie_plan,
    in_time_widths,
    launch,
    lightweight_profile_plan,
    plan_queue,
    width_policy,
)
from stagetree.core.policies.genie import widths as gpu_widths
from tests.sim.papers.genie import genie_tasks, profiled_models, run_qos, true_models

M = PerfModel(a0=0.0, a1=2.0, a2=-0.01, lambda1=0.6, lambda2=0.3, startup_s=10.0)


def test_performance_model_by_hand() -> None:
    assert M.per_gpu(50) == pytest.approx(75.0)  # 2 * 50 - 0.01 * 2500
    assert M.per_gpu(150) == pytest.approx(100.0)  # past the vertex at 100: saturated
    # Eq. 3 on 2 nodes x 2 GPUs: (0.6 * 1 * 2 + 0.3 * 1) / 3 = 0.5 GPUs lost
    assert M.overhead(Placement(2, 2)) == pytest.approx(0.5)
    assert M.overhead(Placement(1, 4)) == pytest.approx(0.3)  # within a node: lambda2
    assert M.overhead(Placement(4, 1)) == pytest.approx(0.6)  # one GPU per node: lambda1
    assert M.overhead(Placement(1, 1)) == 0.0
    # Eq. 1: (4 - 0.5) * pbar(200 / 4) = 3.5 * 75; Eq. 2: 200 * 100 / 262.5 + 10
    assert M.throughput(200, Placement(2, 2)) == pytest.approx(262.5)
    assert M.latency(200, 100, Placement(2, 2)) == pytest.approx(20000 / 262.5 + 10)


def test_ect_cost_and_cer_by_hand() -> None:
    lbar = 200 * 100 / 100 + 10  # one GPU, saturated: 210 s
    for qos, e in (("urgent", 0.0), ("prior", lbar), ("normal", 2 * lbar)):
        assert ect(Task("t", "m", 200, 100, 1000.0, qos), M) == pytest.approx(1000.0 + e)  # Eq. 4
    shape = ClusterShape(4, 4)
    assert cost(Placement(1, 1), shape, 0.5) == pytest.approx(1 / 16 + 0.5 / 4)  # Eq. 5
    assert cost(Placement(2, 2), shape, 0.5) == pytest.approx(4 / 16 + 0.5 * 2 / 4)
    t = Task("t", "m", 200, 100, 0.0)
    assert cer(t, M, Placement(2, 2), shape, 0.5) == pytest.approx(262.5 / 0.5)
    with pytest.raises(InvalidArgument):
        Task("t", "m", 1, 1, 0.0, "vip")


def test_lightweight_profile_recovers_the_model() -> None:
    plan = lightweight_profile_plan([20, 40, 60, 80], max_nodes=3, max_gpus=3, batch=200)
    assert len(plan) == 4 + 2 + 2  # B + (N - 1) + (G - 1) runs, not B * N * G
    runs = [ProfileRun(b, pl, M.throughput(b, pl)) for b, pl in plan]
    fit = fit_perf_model(runs, startup_s=10.0)
    assert (fit.a0, fit.a1, fit.a2) == pytest.approx((0.0, 2.0, -0.01), abs=1e-6)
    assert (fit.lambda1, fit.lambda2) == pytest.approx((0.6, 0.3), abs=1e-6)
    assert fit_perf_model(runs, inference=True).lambda1 == 0.0
    with pytest.raises(InvalidArgument):
        fit_perf_model(runs[:2])


SHAPE = ClusterShape(2, 2)  # costs at theta 0.5: (1,1) 0.5, (1,2) 0.75, (2,1) 1.0, (2,2) 1.5


def test_qos_guided_order_alg_1_by_hand() -> None:
    # throughput (1,1) 100, (1,2) 170, (2,1) 140, (2,2) 262.5 -> CER 200, 226.7, 140, 175;
    # latency 210, 127.6, 152.9, 86.2
    prior = Task("P", "m", 200, 100, 0.0, "prior")  # ECT 210: at t = 100 only (2,2) still meets it
    normal = Task("N", "m", 200, 100, 0.0, "normal")  # ECT 420: all meet it, the best CER is (1,2)
    urgent = Task("U", "m", 200, 100, 50.0, "urgent")  # ECT 50: none meets it, the best CER of all
    plans = genie_plan([normal, prior, urgent], 100.0, {"m": M}, SHAPE, 0.5)
    assert [p.task.id for p in plans] == ["U", "P", "N"]
    assert [p.placement for p in plans] == [Placement(1, 2), Placement(2, 2), Placement(1, 2)]
    assert plans[1].allowance == pytest.approx(210 - (100 + 20000 / 262.5 + 10))
    assert plans[2].allowance == pytest.approx(420 - (100 + 20000 / 170 + 10))
    assert plans[0].allowance < 0
    # a Prior task that can no longer meet its ECT (210: (2,2) ends at 100 + 86.2 > 150) waits behind
    # every task still in time, whatever its allowance; the Urgent one keeps the front
    late = Task("L", "m", 200, 100, -60.0, "prior")  # ECT 150
    plans = genie_plan([normal, prior, late, urgent], 100.0, {"m": M}, SHAPE, 0.5)
    assert [p.task.id for p in plans] == ["U", "P", "N", "L"]
    assert plans[3].placement == Placement(1, 2) and plans[3].allowance < plans[1].allowance


def test_baselines_place_as_described() -> None:
    t = [Task("b", "m", 200, 100, 5.0), Task("a", "m", 200, 100, 1.0)]
    models = {"m": M}
    pick = {
        p: [(x.task.id, x.placement) for x in plan_queue(p, t, 10.0, models, SHAPE, 0.5, {"n0": 2, "n1": 1})]
        for p in QUEUE_POLICIES
        if p != "genie"
    }
    assert pick["minocc"] == [("a", Placement(1, 1)), ("b", Placement(1, 1))]  # arrival order
    assert pick["perfpre"][0][1] == Placement(2, 2)
    assert pick["cerpre"][0][1] == Placement(1, 2)
    assert pick["maxocc"][0][1] == Placement(1, 2)  # 2 GPUs free on one node beats 1 + 1 across two
    assert plan_queue("maxocc", t, 0.0, models, SHAPE, 0.5, {"n0": 1, "n1": 1})[0].placement == Placement(2, 1)
    with pytest.raises(InvalidArgument, match="known"):
        plan_queue("edf", t, 0.0, models, SHAPE)


def test_fit_placement_prefers_full_nodes() -> None:
    free = {"n0": 4, "n1": 2, "n2": 1}
    assert fit_placement(Placement(1, 2), free) == {"n1": 2}
    assert fit_placement(Placement(2, 2), free) == {"n1": 2, "n0": 2}
    assert fit_placement(Placement(3, 2), free) is None


@given(
    st.dictionaries(st.sampled_from(["n0", "n1", "n2", "n3"]), st.integers(0, 4), min_size=1),
    st.lists(st.tuples(st.integers(1, 4), st.integers(1, 4)), max_size=10),
    st.booleans(),
)
def test_launch_never_overcommits(free: dict[str, int], shapes: list[tuple[int, int]], backfill: bool) -> None:
    plans = genie_plan([Task(f"t{i}", "m", 200, 10, 0.0) for i in range(len(shapes))], 0.0, {"m": M}, SHAPE, 0.5)
    plans = [type(p)(p.task, Placement(n, g), p.latency, p.allowance) for p, (n, g) in zip(plans, shapes, strict=True)]
    started = launch(plans, free, backfill)
    used: dict[str, int] = {}
    for plan, nodes in started:
        assert len(nodes) == plan.placement.nodes and set(nodes.values()) == {plan.placement.gpus_per_node}
        for n, g in nodes.items():
            used[n] = used.get(n, 0) + g
    assert all(used[n] <= free[n] for n in used)
    if not backfill and len(started) < len(plans):  # strict order stops at the first that does not fit
        assert fit_placement(plans[len(started)].placement, {n: free[n] - used.get(n, 0) for n in free}) is None


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 100), policy=st.sampled_from(sorted(WIDTH_POLICIES)))
def test_every_task_finishes_and_urgent_never_meets_its_ect(seed: int, policy: str) -> None:
    shape = ClusterShape(2, 2)
    tasks = genie_tasks(8, hours=3, seed=seed)
    believed = profiled_models(shape, seed=seed)
    run = run_qos(tasks, policy, shape, believed)
    assert run.tasks == len(tasks) == len(run.report.served_at)
    assert 0.0 <= run.qos_pct <= 100.0
    assert run.met <= sum(1 for t in tasks if t.qos != "urgent")
    assert run.makespan >= max(t.arrival for t in tasks)


def test_deadline_by_the_believed_ect() -> None:
    t = Task("t", "m", 200, 100, 0.0, "prior")
    assert deadline_met(t, 210.0, M) and not deadline_met(t, 210.5, M)
    assert not deadline_met(Task("u", "m", 200, 100, 0.0, "urgent"), 1.0, M)
    assert set(true_models()) == set(profiled_models(ClusterShape(4, 4)))


@given(st.integers(1, 16))
def test_the_widths_are_every_gpu_count_of_one_node_up_to_the_most(most: int) -> None:
    ws = gpu_widths(most)
    assert ws == sorted(set(ws)) and ws[0] == 1 and ws[-1] == most and len(ws) == most


LATENCIES = st.lists(st.floats(1.0, 1e4), min_size=1, max_size=8).map(lambda ls: list(enumerate(ls, start=1)))


@given(
    qos=st.sampled_from(["urgent", "prior", "normal"]),
    lat=LATENCIES,
    late=st.floats(0.0, 2e4),
    policy=st.sampled_from(sorted(WIDTH_POLICIES)),
)
def test_a_width_choice_and_its_other_widths(qos: str, lat: list[tuple[int, float]], late: float, policy: str) -> None:
    """Alg. 1 on one node: the chosen width is the highest-CER width that meets the ECT (else the
    highest of all); GENIE's other widths are exactly the rest of those that meet it, by decreasing CER;
    a baseline has none (its rule fixes the width)."""
    shape = ClusterShape(4, 8)
    now = 10.0 + late
    c = width_policy(policy)(qos, 10.0, lat, now, shape, 8)
    assert (c.slots, c.latency) in lat
    in_time = in_time_widths(qos, 10.0, lat, now, shape)
    lbar = lat[0][1]
    ect_abs = 10.0 + {"urgent": 0.0, "prior": lbar, "normal": 2 * lbar}[qos]
    assert all(now + t <= ect_abs for _, t in in_time)
    assert {n for n, t in lat if now + t <= ect_abs} == {n for n, _ in in_time}
    ratio = [(1.0 / t) / cost(Placement(1, n), shape, 0.02) for n, t in in_time]
    assert ratio == sorted(ratio, reverse=True)
    if policy != "genie":
        assert c.others == () and not c.hold
        return
    n, latency, allowance = choose_width(qos, 10.0, lat, now, shape)
    assert (c.slots, c.latency) == (n, latency)
    if in_time:
        assert (c.slots, c.latency) == in_time[0] and c.key == allowance >= 0 and c.hold
        assert list(c.others) == in_time[1:]
    elif qos == "urgent":  # nothing meets its ECT (its arrival): the top priority, by its allowance
        assert c.others == () and c.key == allowance < 0 and not c.hold
    else:  # its ECT is lost: after every key a task still in time can have (at most 2 lbar)
        assert c.others == () and c.key == LOST_TIER + 10.0 > 2 * max(t for _, t in lat) and not c.hold


def test_a_density_gives_the_same_tasks_however_written() -> None:
    assert genie_tasks(20, hours=2, seed=1) == genie_tasks(20.0, hours=2, seed=1)
    assert genie_tasks(20, hours=2, seed=1) != genie_tasks(10, hours=2, seed=1)
