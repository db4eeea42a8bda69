"""The consumer loop on the in-process bus and SQLite: apply, commit after the database, skip what does
not decode, survive a crash between the two commits, stop gracefully, isolate a poison message."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from sqlalchemy.exc import DataError

from stagetree.aggregator.aggregator import Aggregator
from stagetree.bus.batcher import LocalBatcher
from stagetree.bus.inprocess import InProcessBus
from stagetree.bus.messages import ALL_TOPICS, TOPIC_METRICS, GpuTelemetry, Message, encode
from stagetree.core.errors import Conflict, InvalidArgument
from stagetree.core.lifecycle import BatchState, RequestState
from stagetree.master.service import CH_RESULTS, CH_ROUND
from stagetree.master.store.ingest import Ingestor, IngestResult
from stagetree.master.store.store import Store
from tests.unit.aggregator.fakes import Crash, CrashingBus, RecordingWakeups, wait_for
from tests.unit.aggregator.helpers import World, applied_count


def _aggregator(bus: Any, world: World, wakeups: Any = None, **kw: Any) -> Aggregator:
    kw.setdefault("poll_timeout_s", 0.05)
    kw.setdefault("max_latency_s", 0.01)
    return Aggregator(bus, Ingestor(world.store), wakeups or RecordingWakeups(), group="agg", **kw)


def _stream(world: World, batch_id: int, steps: list[int]) -> list[Message]:
    """What a node manager publishes for a batch that trains to the last of ``steps`` and finishes."""
    return [
        world.started(batch_id),
        *[world.progress(batch_id, world.root, s) for s in steps[:1]],
        *[world.metrics(batch_id, world.root, s) for s in steps],
        world.checkpoint(batch_id, world.root, steps[-1]),
        world.finished(batch_id, steps[-1]),
    ]


def test_published_messages_become_rows_done_requests_and_wake_ups(world: World) -> None:
    bus = InProcessBus()
    batch, reqs = world.dispatch([(world.root, 10), (world.root, 20)])
    wakeups = RecordingWakeups()
    agg = _aggregator(bus, world, wakeups)
    agg.start()
    try:
        with LocalBatcher(bus, max_messages=3, max_age_s=0.01) as batcher:
            for m in _stream(world, batch.id, [10, 20]):
                batcher.add(m)
        wait_for(lambda: world.store.batches.get_batch(batch.id).state == BatchState.DONE, what="the batch to end")
    finally:
        agg.stop()
    assert world.request_states([r.id for r in reqs]) == [RequestState.DONE, RequestState.DONE]
    assert world.store.requests.metrics_at(world.root, 20) == {"loss": 1.0 / 21}
    assert world.store.checkpoints.checkpoints(world.plan_id) == {(world.root, 20): f"file:///ckpt/{world.root}/20"}
    assert CH_RESULTS in wakeups.channels and CH_ROUND in wakeups.channels
    s = agg.stats
    assert (s.applied, s.points, s.completed, s.ignored, s.malformed, s.duplicates) == (4, 2, 2, 0, 0, 0)
    assert (s.started, s.progress) == (1, 1)


def test_malformed_and_unknown_version_records_are_counted_skipped_and_committed_past(world: World) -> None:
    bus = InProcessBus()
    batch, (r,) = world.dispatch([(world.root, 10)])
    good = world.metrics(batch.id, world.root, 10)
    future = json.loads(encode(world.metrics(batch.id, world.root, 11)))
    future["v"] = 2
    bus.inject(TOPIC_METRICS, str(batch.id), b"\xff not json")
    bus.inject(TOPIC_METRICS, str(batch.id), json.dumps(future).encode())
    bus.inject(TOPIC_METRICS, str(batch.id), b'{"v": 1, "type": "metrics", "msg_id": "x"}')
    bus.publish(TOPIC_METRICS, str(batch.id), good)
    agg = _aggregator(bus, world)
    agg.start()
    try:
        wait_for(lambda: agg.stats.applied == 1, what="the good message")
    finally:
        agg.stop()
    assert agg.stats.malformed == 3 and agg.stats.records == 4
    assert world.request_states([r.id]) == [RequestState.DONE]
    with bus.subscribe(ALL_TOPICS, "agg") as again:  # the group committed past the bad records too
        assert again.poll(timeout_s=0.05) == []


def test_killed_between_database_commit_and_offset_commit_the_redelivery_changes_nothing(world: World) -> None:
    bus = InProcessBus()
    batch, reqs = world.dispatch([(world.root, s) for s in (10, 20, 30)])
    sent = _stream(world, batch.id, [10, 20, 30])
    for m in sent:
        bus.publish(m.TOPIC, m.key, m)
    crashing = CrashingBus(bus)
    first = _aggregator(crashing, world)
    with pytest.raises(Crash):
        first.run()  # applies, commits the database, then "dies" before the offset commit
    assert crashing.consumers[0].commits_attempted == 1
    after_crash = world.state()
    assert world.request_states([r.id for r in reqs]) == [RequestState.DONE] * 3  # the effects were durable first
    assert world.store.batches.get_batch(batch.id).state == BatchState.DONE

    second = _aggregator(bus, world)
    second.start()
    try:
        wait_for(lambda: second.stats.records == len(sent), what="the redelivery")
    finally:
        second.stop()
    assert (second.stats.applied, second.stats.duplicates, second.stats.points) == (0, 5, 0)
    assert world.state() == after_crash
    assert applied_count(world.store, world.nm) == 5


def test_stop_finishes_the_batch_in_hand_commits_it_and_leaves(world: World) -> None:
    bus = InProcessBus()
    batch, _ = world.dispatch([(world.root, 10)])
    agg = _aggregator(bus, world, max_latency_s=0.2)
    thread = agg.start()
    wait_for(lambda: bool(agg.assignment()), what="the join")
    for s in range(1, 41):
        m = world.metrics(batch.id, world.root, s)
        bus.publish(m.TOPIC, m.key, m)
    wait_for(lambda: agg.stats.records > 0, what="the first poll")
    agg.stop()
    assert not thread.is_alive()
    assert agg.stats.points == 40 and agg.stats.commits >= 1
    with bus.subscribe(ALL_TOPICS, "agg") as successor:
        assert successor.poll(timeout_s=0.05) == []  # nothing left uncommitted


class _FlakyIngestor(Ingestor):
    """Conflicts ``conflicts`` times, and refuses (DataError) any batch holding ``poison``."""

    def __init__(self, store: Store, poison: str = "", conflicts: int = 0) -> None:
        super().__init__(store)
        self.poison = poison
        self.conflicts = conflicts
        self.calls = 0

    def apply(self, messages: Any) -> IngestResult:
        self.calls += 1
        if self.conflicts:
            self.conflicts -= 1
            raise Conflict("deadlock detected (test)")
        if any(m.msg_id == self.poison for m in messages):
            raise DataError("INSERT ...", {}, Exception("value out of range (test)"))
        return super().apply(messages)


def test_a_message_the_database_refuses_is_isolated_and_skipped(world: World) -> None:
    bus = InProcessBus(default_partitions=1)
    batch, _ = world.dispatch([(world.root, 10)])
    msgs = [world.metrics(batch.id, world.root, s) for s in range(1, 9)]
    for m in msgs:
        bus.publish(m.TOPIC, m.key, m)
    agg = Aggregator(bus, _FlakyIngestor(world.store, poison=msgs[5].msg_id), RecordingWakeups())
    consumer = bus.subscribe(ALL_TOPICS, agg.group)
    assert agg.run_once(consumer) == 8
    assert agg.stats.poison == 1 and agg.stats.points == 7
    assert (
        world.store.requests.metrics_at(world.root, 6) is None
        and world.store.requests.metrics_at(world.root, 7) is not None
    )
    assert consumer.poll(timeout_s=0) == []


def test_a_busy_database_is_retried_never_skipped(world: World) -> None:
    bus = InProcessBus()
    batch, (r,) = world.dispatch([(world.root, 10)])
    m = world.metrics(batch.id, world.root, 10)
    bus.publish(m.TOPIC, m.key, m)
    flaky = _FlakyIngestor(world.store, conflicts=2)
    agg = Aggregator(bus, flaky, RecordingWakeups())
    consumer = bus.subscribe(ALL_TOPICS, agg.group)
    agg.run_once(consumer)
    assert flaky.calls == 3 and agg.stats.retries == 2 and agg.stats.poison == 0
    assert world.request_states([r.id]) == [RequestState.DONE]


def test_two_members_of_one_group_apply_each_message_once_and_keep_each_batch_in_order(world: World) -> None:
    bus = InProcessBus(default_partitions=4)
    work = [world.dispatch([(world.root, 100 + b), (world.root, 107)]) for b in range(8)]
    aggs = [_aggregator(bus, world, name=f"agg-{i}") for i in range(2)]
    for a in aggs:
        a.start()
    try:
        wait_for(lambda: all(a.assignment() for a in aggs), what="both members to own partitions")
        with LocalBatcher(bus, max_messages=7, max_age_s=0.01) as batcher:
            for batch, _ in work:
                for m in [world.metrics(batch.id, world.root, 100 + s) for s in range(0, 8)]:
                    batcher.add(m)
                batcher.add(world.finished(batch.id))
        wait_for(
            lambda: all(world.store.batches.get_batch(b.id).state != BatchState.RUNNING for b, _ in work),
            what="all batches",
        )
    finally:
        for a in aggs:
            a.stop()
    assert all(a.stats.applied > 0 for a in aggs)
    assert sum(a.stats.applied for a in aggs) == applied_count(world.store, world.nm)
    for batch, reqs in work:
        # the finish came after the metrics on the batch's partition: nothing was sent back to the queue
        assert world.request_states([r.id for r in reqs]) == [RequestState.DONE, RequestState.DONE], batch.id


def test_the_latest_gpu_sample_is_kept(world: World) -> None:
    bus = InProcessBus()

    def sample(i: int, ts: float, util: float) -> GpuTelemetry:
        return GpuTelemetry(
            msg_id=f"t{i}", node_manager="nm", gpu_index=0, utilization=util, memory_used=1, memory_total=2, ts=ts
        )

    for i, (ts, util) in enumerate([(1.0, 10), (3.0, 30), (2.0, 20)]):
        m = sample(i, ts, util)
        bus.publish(m.TOPIC, m.key, m)
    agg = _aggregator(bus, world, telemetry=world.store.telemetry)
    consumer = bus.subscribe(ALL_TOPICS, agg.group)
    agg.run_once(consumer)
    assert agg.telemetry()[("nm", 0)].utilization == 30
    assert applied_count(world.store) == 0
    # written for the master's dashboard (another process in cluster mode): the latest sample, once
    assert agg.flush_telemetry() == 1 and agg.flush_telemetry() == 0
    (row,) = world.store.telemetry.latest(now=3.0)
    assert (row["node_manager"], row["gpu_index"], row["utilization"]) == ("nm", 0, 30)


def test_start_twice_and_bad_settings_are_refused(world: World) -> None:
    bus = InProcessBus()
    with pytest.raises(InvalidArgument):
        _aggregator(bus, world, max_records=0)
    agg = _aggregator(bus, world)
    agg.start()
    try:
        with pytest.raises(Exception, match="started already"):
            agg.start()
    finally:
        agg.stop()
    assert not any(t.name == agg.name and t.is_alive() for t in threading.enumerate())
