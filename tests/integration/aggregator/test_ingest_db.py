"""Ingest on both databases (the ``store`` fixture runs Postgres and SQLite): the Postgres COPY path and
its fallback when rows exist, odd text, non-finite values, and two writers racing on the same ids."""

from __future__ import annotations

import math
import threading
from dataclasses import replace

from stagetree.bus.messages import CheckpointSaved, Message, Metrics
from stagetree.core.lifecycle import RequestState
from stagetree.master.store.ingest import Ingestor, IngestResult
from stagetree.master.store.records import metric_value
from stagetree.master.store.store import Store
from tests.unit.aggregator.helpers import applied_count, make_world


def test_a_redelivery_mixed_with_new_messages_applies_only_the_new(store: Store) -> None:
    world = make_world(store)
    batch, reqs = world.dispatch([(world.root, s) for s in (1, 2, 3, 4)])
    msgs = [world.metrics(batch.id, world.root, s) for s in (1, 2, 3, 4)]
    ing = Ingestor(store)
    assert ing.apply(msgs[:2]).applied == 2
    res = ing.apply(msgs)  # the first two again (a rebalance), with two new ones
    assert (res.applied, res.duplicates, sorted(res.completed)) == (2, 2, sorted(r.id for r in reqs[2:]))
    assert applied_count(store, world.nm) == 4


def test_a_point_reported_again_by_a_new_message_keeps_the_first_value(store: Store) -> None:
    world = make_world(store)
    batch, _ = world.dispatch([(world.root, 7)])
    ing = Ingestor(store)
    ing.apply([world.metrics(batch.id, world.root, 7, {"loss": 1.0})])
    res = ing.apply([world.metrics(batch.id, world.root, 7, {"loss": 2.0}), world.metrics(batch.id, world.root, 8)])
    assert res.applied == 2 and res.points == 2
    assert store.requests.metrics_at(world.root, 7) == {"loss": 1.0}
    assert store.requests.metrics_at(world.root, 8) is not None


def test_odd_text_and_non_finite_values_survive_the_round_trip(store: Store) -> None:
    world = make_world(store)
    batch, _ = world.dispatch([(world.root, 9)])
    odd = 'tab\there, newline\nhere, back\\slash, "quote", é, \u2603'
    msgs: list[Message] = [
        Metrics(
            msg_id=f"{world.nm}:{batch.id}:1:{odd}",
            node_manager=world.nm,
            batch_id=batch.id,
            attempt=1,
            node=world.root,
            step=9,
            metrics={"loss": math.nan, "grad\tnorm\\": math.inf, odd: -math.inf, "ok": 0.25},
        ),
        CheckpointSaved(
            msg_id=f"{world.nm}:{batch.id}:1:ckpt",
            node_manager=world.nm,
            batch_id=batch.id,
            attempt=1,
            node=world.root,
            step=9,
            uri=f"s3://bucket/{odd}",
            bytes=2**40,
            kind="peripheral",
        ),
    ]
    ing = Ingestor(store)
    assert ing.apply(msgs).applied == 2
    assert ing.apply(msgs).duplicates == 2
    stored = store.requests.metrics_at(world.root, 9)
    assert stored is not None
    assert math.isnan(metric_value(stored["loss"]))
    assert metric_value(stored["grad\tnorm\\"]) == math.inf and metric_value(stored[odd]) == -math.inf
    assert stored["ok"] == 0.25
    assert store.checkpoints.checkpoints(world.plan_id) == {(world.root, 9): f"s3://bucket/{odd}"}


def test_two_writers_racing_on_the_same_messages_apply_each_once(store: Store) -> None:
    world = make_world(store)
    batch, reqs = world.dispatch([(world.root, s) for s in range(10, 210, 10)])
    msgs: list[Message] = [world.metrics(batch.id, world.root, s) for s in range(1, 201)]
    msgs.append(world.finished(batch.id, 200))
    results: list[IngestResult] = []
    errors: list[BaseException] = []

    def writer(order: list[Message]) -> None:
        ing = Ingestor(store)
        for i in range(0, len(order), 50):
            for attempt in range(20):  # what the aggregator does on Conflict (a busy or deadlocked database)
                try:
                    results.append(ing.apply(order[i : i + 50]))
                    break
                except Exception as e:  # recorded and asserted below
                    if attempt == 19 or not getattr(e, "retriable", False):
                        errors.append(e)
                        return

    # the same records, as two members holding one partition across a rebalance would see them
    threads = [threading.Thread(target=writer, args=(msgs,)), threading.Thread(target=writer, args=(msgs,))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sum(r.applied for r in results) == len(msgs)
    assert applied_count(store, world.nm) == len(msgs)
    assert len(_finished_once(results)) == 1
    assert world.request_states([r.id for r in reqs]) == [RequestState.DONE] * len(reqs)


def _finished_once(results: list[IngestResult]) -> list[int]:
    return [b for r in results for b in r.finished]


def test_a_host_problem_over_the_bus_requeues_uncounted_and_keeps_the_node_manager_away_until_it_registers(
    store: Store,
) -> None:
    world = make_world(store)
    batch, (req,) = world.dispatch([(world.root, 5)])
    problem = replace(
        world.failed(batch.id, "trainer entry point 'mine:Net': no module named 'mine'"), host_problem=True
    )
    assert Ingestor(store).apply([problem, replace(problem, msg_id=problem.msg_id + "-again")]).applied == 2
    (rec,) = store.requests.get_requests(world.study, [req.id])
    assert rec.state == RequestState.NOT_SCHED and rec.error is None  # requeued, no failure counted
    assert store.batches.get_batch(batch.id).state == "FAILED"
    with store.db.tx("read") as s:
        unable = store.batches.host_problems_in(s)
    assert unable == {world.plan_id: {world.nm: "trainer entry point 'mine:Net': no module named 'mine'"}}
    store.nodes.register_node_manager(world.nm, "127.0.0.1:1", [("gpu0", "cpu")])  # restarted: tried again
    with store.db.tx("read") as s:
        assert store.batches.host_problems_in(s) == {}
