"""Learning-curve points through the aggregator's ingest on both databases: stored once per canonical
point (a point at a child's start step is its parent's), idempotent on redelivery, the first value
winning, and a trial's curve read along its path (shared prefix, then its own)."""

from __future__ import annotations

from stagetree.bus.messages import Curve, make_msg_id
from stagetree.core.batch import Point
from stagetree.master.plans import PlanCache
from stagetree.master.store.ingest import Ingestor
from stagetree.master.store.store import Store
from tests.unit.aggregator.helpers import BRANCH, make_world


def _curve(world, batch_id: int, seq: int, node: int, steps: list[int], scale: float = 1.0) -> Curve:
    return Curve(
        msg_id=make_msg_id(world.nm, batch_id, 1, 1000 + seq),
        node_manager=world.nm,
        batch_id=batch_id,
        attempt=1,
        node=node,
        steps=steps,
        values=[{"loss": scale / s} for s in steps],
    )


def test_curve_points_are_stored_once_per_plan_point(store: Store) -> None:
    world = make_world(store)
    batch, _ = world.dispatch([(world.child, BRANCH + 20)])
    ing = Ingestor(store)
    prefix = _curve(world, batch.id, 0, world.root, list(range(1, BRANCH + 1)))
    own = _curve(world, batch.id, 1, world.child, list(range(BRANCH, BRANCH + 21)))  # BRANCH: the root's
    res = ing.apply([prefix, own])
    assert (res.applied, res.curve_points) == (2, BRANCH + 20)  # step BRANCH came twice: one point
    again = ing.apply([prefix, own, _curve(world, batch.id, 2, world.root, [1, 2], scale=9.0)])
    assert again.duplicates == 2 and again.applied == 1  # redelivery changes nothing
    counts = store.curves.counts([world.root, world.child])
    assert counts == {world.root: BRANCH, world.child: 20}
    assert store.curves.node_points([world.root])[world.root][0][2] == {"loss": 1.0}  # the first value won

    plan = PlanCache(store.plans).ensure(world.plan_id, {world.child})
    path = plan.path(Point(world.child, BRANCH + 20))
    pts = store.curves.path_points(path)
    assert [s for _, s, _ in pts] == list(range(1, BRANCH + 21))
    assert {n for n, s, _ in pts if s <= BRANCH} == {world.root} and {n for n, s, _ in pts if s > BRANCH} == {
        world.child
    }
    assert [s for _, s, _ in store.curves.path_points(path, 45, 55)] == list(range(45, 56))


def test_a_curve_on_an_unknown_node_is_rejected_and_changes_nothing(store: Store) -> None:
    world = make_world(store)
    batch, _ = world.dispatch([(world.root, 5)])
    res = Ingestor(store).apply([_curve(world, batch.id, 0, 10**9, [1, 2])])
    assert res.rejected == 1 and res.curve_points == 0


def test_the_policies_learn_from_curve_points_too(store: Store) -> None:
    from stagetree.core.ids import BatchId, PlanId, StudyId
    from stagetree.core.policies.study import parse_policies
    from stagetree.core.round import RunningAttempt
    from stagetree.master.costs import CostLearner
    from stagetree.master.plans import PlanCache
    from stagetree.master.policies import PolicyStates
    from stagetree.master.round_read import InputReader

    world = make_world(store)
    batch, _ = world.dispatch([(world.root, 4)])
    Ingestor(store).apply(
        [_curve(world, batch.id, 0, world.root, [1, 2, 3, 4]), world.metrics(batch.id, world.root, 4)]
    )
    reader = InputReader(store, PlanCache(store), CostLearner(1.0), PolicyStates(store))
    running = [RunningAttempt(BatchId(batch.id), 1, PlanId(1), (), ((world.root, 0, 4),), StudyId("s"))]
    reports = reader._reports(running, {StudyId("s"): parse_policies({"search": "pop"})})
    rows = [(st.step, st.values) for got in reports.values() for st in got]
    assert sorted(st for st, _ in rows) == [1, 2, 3, 4]
    assert next(v for st, v in rows if st == 4) == {"loss": 1.0 / 5}  # the evaluation wins at its step


def test_series_reads_one_metric_thinned_in_the_database(store: Store) -> None:
    world = make_world(store)
    batch, _ = world.dispatch([(world.root, 40)])
    mixed = Curve(
        msg_id=make_msg_id(world.nm, batch.id, 1, 5000),
        node_manager=world.nm,
        batch_id=batch.id,
        attempt=1,
        node=world.root,
        steps=list(range(1, 41)),
        values=[{"loss": 1.0 / s, **({"acc": s / 40} if s % 2 == 0 else {})} for s in range(1, 41)],
    )
    Ingestor(store).apply([mixed])
    assert store.curves.point_counts([world.root, world.child]) == {world.root: 40}
    assert store.curves.sample_names([world.root, world.child]) == ["acc", "loss"]
    full = store.curves.series({world.root: 0}, "loss")[world.root]
    assert [s for s, _ in full] == list(range(1, 41)) and full[3] == (4, 0.25)
    thin = store.curves.series({world.root: 10}, "loss")[world.root]
    assert [s for s, _ in thin] == [1, 5, 10, 15, 20, 25, 30, 35, 40]  # multiples of the stride, first and last
    assert [s for s, _ in store.curves.series({world.root: 0}, "acc")[world.root]] == list(range(2, 41, 2))
    assert store.curves.series({world.child: 0}, "loss") == {world.child: []}
