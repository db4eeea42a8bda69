"""Path changes on both databases (the ``store`` fixture runs Postgres and SQLite): the bus messages of a
batch that resumed a checkpoint on another number of ranks record one path change, however often they
are delivered; a resume on the same number records none; the catalog keeps each checkpoint's ranks."""

from __future__ import annotations

from sqlalchemy import select

from stagetree.bus.messages import Message
from stagetree.core.lifecycle import RequestState
from stagetree.master.store import models as m
from stagetree.master.store.ingest import Ingestor
from stagetree.master.store.store import Store
from tests.unit.aggregator.helpers import World, make_world


def _ranks(world: World) -> dict[int, int]:
    with world.store.db.tx("test: checkpoint ranks") as s:
        rows = s.execute(select(m.Checkpoint.step, m.Checkpoint.ranks).where(m.Checkpoint.node_id == world.root))
        return {int(st): int(r) for st, r in rows}


def test_a_rescaled_resume_delivered_twice_records_one_path_change(store: Store) -> None:
    world = make_world(store)
    # what an out of memory leaves behind: a 1-rank batch saved at 10, and its retry on 2 slots resumes there
    first, _ = world.dispatch([(world.root, 10)])
    Ingestor(store).apply([world.checkpoint(first.id, world.root, 10), world.finished(first.id, 10)])
    batch, reqs = world.dispatch([(world.root, 20)])
    msgs: list[Message] = [
        world.started(batch.id),
        world.rescaled(batch.id, world.root, 10, 1, 2),
        world.progress(batch.id, world.root, 11),
        world.checkpoint(batch.id, world.root, 20, ranks=2),
        world.metrics(batch.id, world.root, 20),
        world.finished(batch.id, 10),
    ]
    ing = Ingestor(store)
    got = ing.apply(msgs)
    assert (got.path_changes, got.applied) == (1, 4)
    again = ing.apply(msgs)  # redelivered (a rebalance): every message is a duplicate
    assert (again.path_changes, again.applied, again.duplicates) == (0, 0, 4)
    # a node manager that lost its sequence numbers republishes it under a new id: still one per attempt
    ing.apply([world.rescaled(batch.id, world.root, 10, 1, 2)])
    changes = store.paths.of_nodes([world.root, world.child])
    (change,) = changes[world.root]
    assert (change.node, change.step, change.from_ranks, change.to_ranks) == (world.root, 10, 1, 2)
    assert (change.batch_id, change.attempt, change.node_manager) == (batch.id, 1, world.nm)
    assert world.request_states([r.id for r in reqs]) == [RequestState.DONE]
    assert _ranks(world) == {10: 1, 20: 2}


def test_a_resume_on_the_same_number_of_ranks_records_none(store: Store) -> None:
    world = make_world(store)
    first, _ = world.dispatch([(world.root, 10)])
    ing = Ingestor(store)
    ing.apply([world.checkpoint(first.id, world.root, 10, ranks=2), world.finished(first.id, 10)])
    batch, _ = world.dispatch([(world.root, 20)])
    # the worker emits no ``rescaled`` when the counts agree; this is all a same-n resume publishes
    msgs: list[Message] = [
        world.started(batch.id),
        world.checkpoint(batch.id, world.root, 20, ranks=2),
        world.metrics(batch.id, world.root, 20),
        world.finished(batch.id, 10),
    ]
    assert ing.apply(msgs).path_changes == 0
    assert store.paths.of_nodes([world.root, world.child]) == {}
    assert _ranks(world) == {10: 2, 20: 2}


def test_forgetting_a_plan_forgets_its_path_changes(store: Store) -> None:
    world = make_world(store)
    batch, _ = world.dispatch([(world.root, 20)])
    Ingestor(store).apply(
        [
            world.rescaled(batch.id, world.root, 10, 2, 1),
            world.metrics(batch.id, world.root, 20),
            world.finished(batch.id, 10),
        ]
    )
    assert len(store.paths.of_nodes([world.root])[world.root]) == 1
    store.retention.forget_plan(world.plan_id)
    assert store.paths.of_nodes([world.root]) == {}
