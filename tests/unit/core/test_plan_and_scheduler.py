"""Search plan, stage tree, scheduler and simulator: hand-worked cases and properties."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagetree.core.batch import Point
from stagetree.core.config import Config, divergence
from stagetree.core.errors import InvalidArgument, NotFound
from stagetree.core.round import plan_round
from stagetree.core.scheduler import ORDER_POLICIES, order_policy, steps_cost
from stagetree.core.searchplan import ROOTS_JUDGED, Checkpoint, SearchPlan, keeps_snapshots
from stagetree.core.sequences import Constant, MultiStep, Piecewise, Warmup
from stagetree.core.simulator import Ask, Simulator, simulate, synthetic_curve
from stagetree.core.slots import Slot
from stagetree.core.stagetree import InflightBatch, InflightStage, build_stage_tree
from tests.sim.drivers import ASHADriver, GridDriver
from tests.sim.inputs import plan_input


def cfg(m1: int, g: float = 0.1, warm: int = 0, bs: int = 32) -> Config:
    lr = MultiStep(0.1, [m1], g)
    return Config.of({"lr": Warmup(0.0, warm, lr) if warm else lr, "bs": bs})


def test_nodes_branch_at_divergence_and_never_split() -> None:
    plan = SearchPlan()
    a = plan.add_request(cfg(30), 50).point
    b = plan.add_request(cfg(20), 50).point
    c = plan.add_request(cfg(20, g=0.5), 50).point
    root = plan.nodes[a.node]
    assert root.parent is None
    assert (plan.nodes[b.node].parent, plan.nodes[b.node].start) == (root.id, 20)
    assert (plan.nodes[c.node].parent, plan.nodes[c.node].start) == (root.id, 20)
    # Constant(0.1) agrees with the root (MultiStep at 30) on [0, 30): a request at 25 lands on the root.
    d = plan.add_request(Config.of({"lr": Constant(0.1), "bs": 32}), 25).point
    assert d == Point(root.id, 25)
    assert len(plan.nodes) == 3


def test_existing_metrics_answer_at_once_and_points_are_canonical() -> None:
    plan = SearchPlan()
    p = plan.add_request(cfg(30), 20).point
    plan.record_metrics(p, {"loss": 0.5})
    again = plan.add_request(cfg(40), 20)  # shares [0, 20) with cfg(30)
    assert again.request is None and again.metrics == {"loss": 0.5}
    child = plan.add_request(cfg(20), 40).point
    assert plan.canonical(Point(child.node, 20)) == Point(p.node, 20)


def test_cancel_semantics() -> None:
    plan = SearchPlan()
    r1 = plan.add_request(cfg(30), 50).request
    r2 = plan.add_request(cfg(30), 50).request
    r3 = plan.add_request(cfg(30), 40).request
    assert r1 and r2 and r3
    assert plan.cancel(r3.id).deleted
    plan.mark_scheduled([r1.id, r2.id], batch=7)
    first = plan.cancel(r1.id)
    assert not first.deleted and first.abort_batch is None  # r2 still needs batch 7
    assert plan.cancel(r2.id).abort_batch == 7
    with pytest.raises(NotFound):
        plan.cancel(999)


def test_bad_steps_are_rejected() -> None:
    plan = SearchPlan()
    with pytest.raises(InvalidArgument):
        plan.add_request(cfg(30), -1)
    with pytest.raises(InvalidArgument):
        plan.add_request(cfg(30), True)  # type: ignore[arg-type]
    assert not plan.nodes


def test_stage_tree_starts_from_latest_checkpoint() -> None:
    plan = SearchPlan()
    root = plan.add_request(cfg(30), 30).point.node
    plan.record_checkpoint(Checkpoint(Point(root, 20), "file:///c20", 10))
    plan.record_checkpoint(Checkpoint(Point(root, 10), "file:///c10", 10))
    child = plan.add_request(cfg(25), 40).point
    forest = build_stage_tree(plan.nodes, plan.checkpoint_steps(), [(r.id, r.point) for r in plan.pending()])
    shape = sorted((s.node, s.start, s.end, s.source) for s in forest.stages)
    assert shape == [
        (root, 20, 25, Point(root, 20)),
        (root, 25, 30, None),
        (child.node, 25, 40, None),
    ]
    # evicting the checkpoint at 20 makes the work start from the one at 10
    plan.drop_checkpoint(Point(root, 20))
    forest = build_stage_tree(plan.nodes, plan.checkpoint_steps(), [(r.id, r.point) for r in plan.pending()])
    assert min((s.start, s.source) for s in forest.stages if s.source) == (10, Point(root, 10))


def test_inflight_batches_promise_what_they_save_and_nothing_else() -> None:
    plan = SearchPlan()
    root = plan.add_request(cfg(60), 60).point.node
    saves = frozenset({Point(root, 20), Point(root, 60)})
    running = InflightBatch(1, (InflightStage(root, 0, 60, progress=10),), saves)
    for r in plan.pending():
        plan.mark_scheduled([r.id], 1)
    plan.add_request(cfg(60), 30)  # inside the running batch, where it saves nothing
    child = plan.add_request(cfg(40), 80).point  # branches at 40, where it saves nothing either
    after = plan.add_request(cfg(60), 90).point  # past its end, which it saves
    pending = [(r.id, r.point) for r in plan.pending()]
    forest = build_stage_tree(plan.nodes, plan.checkpoint_steps(), pending, [running])
    roots = sorted((forest.stages[i].node, forest.stages[i].start, forest.stages[i].ready) for i in forest.roots)
    # 30 and the branch at 40 wait for the save at 20 (not for points the batch will not keep); 90 for its end
    assert roots == [(root, 20, False), (root, 60, False)]
    assert after.node == root and child.node != root
    snapping = InflightBatch(1, running.stages, saves, snapshots=True)  # it keeps every step: wait for 30, 40
    forest = build_stage_tree(plan.nodes, plan.checkpoint_steps(), pending, [snapping])
    roots = sorted((forest.stages[i].node, forest.stages[i].start, forest.stages[i].ready) for i in forest.roots)
    assert roots == [(root, 60, False), (child.node, 40, False)]


def test_unknown_policy_lists_known_ones() -> None:
    with pytest.raises(InvalidArgument) as err:
        order_policy("fastest")
    for name in ORDER_POLICIES:
        assert name in str(err.value)


def test_critical_path_serves_longest_path_first() -> None:
    plan = SearchPlan()
    short = plan.add_request(Config.of({"lr": 0.5, "bs": 32}), 10).point
    long = plan.add_request(Config.of({"lr": 0.1, "bs": 32}), 100).point
    res = plan_round(plan_input(plan, [Slot("only")], cost=steps_cost(), order="critical_path"))
    assert [d.batch.end for d in res.dispatches] == [long]
    res = plan_round(plan_input(plan, [Slot("only")], cost=steps_cost(), order="bfs"))
    assert res.dispatches[0].batch.end in (short, long)


def test_the_simulator_decides_with_the_cost_it_is_given_and_times_with_the_true_one() -> None:
    # one worker, two independent trials: 12 steps at bs=32, and 10 steps at bs=128 that really cost 4x
    cheap, dear = Config.of({"lr": 0.1, "bs": 32}), Config.of({"lr": 0.2, "bs": 128})

    def step_time(c: Config, step: int) -> float:
        return 4.0 if c.values_at(step)["bs"] == 128 else 1.0

    def first_trained(sim: Simulator) -> Config:
        sim.run()
        plan_id, node, _, _ = min(sim.executed, key=lambda e: sim.step_done[(sim.by_id[e[0]].key, e[1], e[2] + 1)])
        return sim.by_id[plan_id].plan.nodes[node].config

    oracle = Simulator(GridDriver([cheap, dear], 10, evals=[10]), 1, step_time=step_time, record_steps=True)
    assert first_trained(oracle) == dear  # it knows the bs=128 trial is the longer path
    believer = Simulator(GridDriver([cheap, dear], 10), 1, step_time=step_time, decision_cost=steps_cost())
    believer.run()
    # whatever it decides, time comes from the true costs (and a round follows each end by round_delay_s)
    assert believer.report.makespan == pytest.approx(oracle.report.makespan) == pytest.approx(50.01)
    longer = Simulator(GridDriver([cheap], 12), 1, step_time=step_time, decision_cost=steps_cost(), record_steps=True)
    longer._submit([Ask("dear", dear, 10)])
    assert first_trained(longer) == cheap  # 12 steps > 10 steps: what it believes, not what is true


# -- properties ---------------------------------------------------------------------------------

space = st.tuples(
    st.sampled_from([0, 3]), st.sampled_from([10, 20, 30]), st.sampled_from([0.1, 0.5]), st.sampled_from([0, 1])
)


def make(c: tuple[int, int, float, int]) -> Config:
    warm, m1, g, bs = c
    bsq = Constant(32) if bs == 0 else Piecewise([Constant(32), Constant(64)], [25])
    base = MultiStep(0.1, [m1], g)
    return Config.of({"lr": Warmup(0.0, warm, base) if warm else base, "bs": bsq})


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(space, st.integers(min_value=1, max_value=50)), min_size=1, max_size=25),
    st.integers(min_value=1, max_value=6),
    st.sampled_from(sorted(ORDER_POLICIES)),
)
def test_stage_tree_paths_reconstruct_each_request(reqs, _w, _policy) -> None:  # type: ignore[no-untyped-def]
    plan = SearchPlan()
    configs = {}
    for c, step in reqs:
        res = plan.add_request(make(c), step)
        if res.request:
            configs[res.request.id] = (make(c), step)
    pending = [(r.id, r.point) for r in plan.pending()]
    forest = build_stage_tree(plan.nodes, plan.checkpoint_steps(), pending)
    by_request = {rid: s for s in forest.stages for rid in s.requests}
    assert set(by_request) == set(configs)  # every request served by exactly one stage end
    for rid, stage in by_request.items():
        config, step = configs[rid]
        chain = []
        s = stage
        while True:
            chain.append(s)
            if s.parent is None:
                break
            s = forest.stages[s.parent]
        chain.reverse()
        assert chain[0].source == Point(chain[0].node, 0) or chain[0].source.step == chain[0].start
        assert chain[0].start == 0 and chain[-1].end == step
        for a, b in itertools.pairwise(chain):
            assert a.end == b.start
        for s in chain:  # each stage trains this request's own schedule
            assert divergence(plan.nodes[s.node].config, config, s.start, s.end) == s.end


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(space, st.sampled_from([10, 25, 40, 50])), min_size=1, max_size=30),
    st.integers(min_value=1, max_value=8),
    st.sampled_from(sorted(ORDER_POLICIES)),
)
def test_simulated_grid_serves_once_and_trains_each_step_once(reqs, workers, policy) -> None:  # type: ignore[no-untyped-def]
    configs = [make(c) for c, _ in reqs]
    evals = sorted({s for _, s in reqs})
    rep = simulate(GridDriver(configs, max(evals), evals), workers, policy, load_s=0.3)
    assert rep.served == rep.requests
    assert rep.duplicate_steps == 0
    assert rep.executed_steps == rep.unique_steps
    assert rep.makespan >= rep.lower_bound - 1e-9
    assert rep.makespan >= max(rep.critical_path, rep.work / workers) - 1e-9


@settings(max_examples=25, deadline=None)
@given(
    st.lists(space, min_size=4, max_size=40, unique=True),
    st.integers(min_value=1, max_value=6),
    st.sampled_from(sorted(ORDER_POLICIES)),
    st.integers(min_value=0, max_value=3),
)
def test_simulated_asha_serves_every_request(configs, workers, policy, seed) -> None:  # type: ignore[no-untyped-def]
    curve = synthetic_curve(seed)
    driver = ASHADriver([make(c) for c in configs], 2, 3, 18, concurrency=2 * workers, curve=curve)
    rep = simulate(driver, workers, policy, curve=curve, load_s=0.2)
    assert rep.served == rep.requests
    assert rep.executed_steps >= rep.unique_steps
    assert rep.makespan >= rep.lower_bound - 1e-9


_START_VALUES = st.sampled_from([0.1, 0.2, 0.3, 1, True, "a"])


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 30), st.integers(1, 5), _START_VALUES, _START_VALUES, st.booleans()), max_size=30
    ),
    st.integers(0, 10),
)
def test_a_plan_keeps_snapshots_unless_its_trials_start_apart(adds, probation) -> None:  # type: ignore[no-untyped-def]
    plan = SearchPlan()
    for parent_pick, start, lr, m, undo in adds:
        ids = sorted(plan.nodes)
        parent = ids[parent_pick % len(ids)] if ids and parent_pick % 3 else None  # some roots, some children
        node = plan.add_node(
            parent, 0 if parent is None else plan.nodes[parent].start + start, Config.of({"lr": lr, "m": m})
        )
        if undo:  # a walk's node that another writer's node replaced
            plan.forget_node(node.id)
        branched = any(n.parent is not None for n in plan.nodes.values())
        assert plan.branched == branched
        firsts = [plan.nodes[r].config.values_at(0) for r in plan.roots]  # at most 30 roots: all judged
        apart = len(firsts) > 1 and any(
            len({(type(v[name]).__name__, v[name]) for v in firsts}) == len(firsts) for name in ("lr", "m")
        )
        assert plan.roots_apart == apart
        want = probation == 0 or len(plan.roots) < probation or branched or not apart
        assert keeps_snapshots(plan, probation) == want


def test_a_plan_judges_whether_its_trials_start_apart_by_its_first_roots() -> None:
    plan = SearchPlan()
    for i in range(ROOTS_JUDGED):
        plan.add_node(None, 0, Config.of({"lr": 0.001 * (i + 1), "bs": 32}))
    assert plan.roots_apart and not keeps_snapshots(plan, 8)  # lr tells every root apart
    plan.add_node(None, 0, Config.of({"lr": 0.001, "bs": 64}))  # repeats the first lr, past the judged roots
    assert plan.roots_apart and len(plan.roots) == ROOTS_JUDGED + 1
    grid = SearchPlan()
    grid.add_node(None, 0, Config.of({"lr": 0.1, "bs": 32}))
    grid.add_node(None, 0, Config.of({"lr": 0.1, "bs": 64}))
    assert grid.roots_apart  # bs tells the two apart
    grid.add_node(None, 0, Config.of({"lr": 0.2, "bs": 32}))
    assert not grid.roots_apart  # each value repeats: neither tells every root apart
