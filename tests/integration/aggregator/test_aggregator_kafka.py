"""The aggregator against a real Kafka-protocol broker (Tansu) and the real Postgres.

Each test publishes to topics of its own (a namespaced router in front of ``route()``), so tests on the
shared broker never read each other's records; the database is the session's, kept apart by a fresh
plan, study and node manager per test."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator

import pytest
from kafka import KafkaProducer

from stagetree.aggregator.aggregator import Aggregator
from stagetree.bus.batcher import LocalBatcher
from stagetree.bus.kafka import KafkaBusConfig, KafkaMetricBus, ensure_topics
from stagetree.bus.messages import ALL_TOPICS, Message, encode, route
from stagetree.bus.tansu import TansuBroker
from stagetree.core.lifecycle import BatchState, RequestState
from stagetree.master.service import CH_RESULTS, CH_ROUND
from stagetree.master.store.ingest import Ingestor
from stagetree.master.store.store import Store
from tests.unit.aggregator.fakes import Crash, CrashingBus, RecordingWakeups, wait_for
from tests.unit.aggregator.helpers import World, applied_count, make_world

PARTITIONS = 4


class Topics:
    """This test's own copies of the three topics, and the router that sends messages there."""

    def __init__(self, config: KafkaBusConfig) -> None:
        tag = uuid.uuid4().hex[:10]
        self.names = {t: f"{t}.{tag}" for t in ALL_TOPICS}
        ensure_topics(config, list(self.names.values()), partitions=PARTITIONS)

    def route(self, message: Message) -> tuple[str, str]:
        topic, key = route(message)
        return self.names[topic], key

    @property
    def all(self) -> list[str]:
        return list(self.names.values())


@pytest.fixture
def config(tansu_broker: TansuBroker) -> KafkaBusConfig:
    return KafkaBusConfig.fast_rebalance(tansu_broker.bootstrap)


@pytest.fixture
def topics(config: KafkaBusConfig) -> Topics:
    return Topics(config)


@pytest.fixture
def bus(config: KafkaBusConfig) -> Iterator[KafkaMetricBus]:
    with KafkaMetricBus(config) as b:
        yield b


@pytest.fixture
def world(pg_store: Store) -> World:
    return make_world(pg_store)


def _aggregator(bus: object, world: World, topics: Topics, group: str, **kw: object) -> Aggregator:
    return Aggregator(
        bus,  # type: ignore[arg-type]
        Ingestor(world.store),
        kw.pop("wakeups", None) or RecordingWakeups(),  # type: ignore[arg-type]
        topics=topics.all,
        group=group,
        poll_timeout_s=0.05,
        max_latency_s=0.02,
        **kw,  # type: ignore[arg-type]
    )


def _publish(bus: KafkaMetricBus, topics: Topics, messages: list[Message]) -> None:
    with LocalBatcher(bus, max_messages=25, max_age_s=0.02, router=topics.route) as batcher:
        for m in messages:
            batcher.add(m)


def _running(*aggs: Aggregator) -> Callable[[], None]:
    for a in aggs:
        a.start()

    def stop() -> None:
        for a in aggs:
            a.stop()

    return stop


def test_published_messages_become_rows_and_done_requests(bus: KafkaMetricBus, topics: Topics, world: World) -> None:
    batch, reqs = world.dispatch([(world.root, s) for s in (10, 20, 30)] + [(world.child, 70)])
    wakeups = RecordingWakeups()
    agg = _aggregator(bus, world, topics, f"g-{uuid.uuid4().hex}", wakeups=wakeups)
    stop = _running(agg)
    try:
        _publish(
            bus,
            topics,
            [
                world.started(batch.id),
                *[world.metrics(batch.id, world.root, s) for s in range(1, 51)],
                world.checkpoint(batch.id, world.child, 50),  # canonical: the root's point at the branch
                *[world.metrics(batch.id, world.child, s) for s in range(51, 71)],
                world.finished(batch.id, 70),
            ],
        )
        wait_for(lambda: world.store.batches.get_batch(batch.id).state == BatchState.DONE, what="the batch to end")
    finally:
        stop()
    assert world.request_states([r.id for r in reqs]) == [RequestState.DONE] * 4
    assert world.store.requests.metrics_at(world.child, 70) == {"loss": 1.0 / 71}
    assert world.store.checkpoints.checkpoints(world.plan_id) == {(world.root, 50): f"file:///ckpt/{world.child}/50"}
    assert {CH_RESULTS, CH_ROUND} <= set(wakeups.channels)
    assert (agg.stats.applied, agg.stats.points, agg.stats.duplicates) == (72, 70, 0)


def test_a_message_delivered_twice_is_applied_once(bus: KafkaMetricBus, topics: Topics, world: World) -> None:
    batch, reqs = world.dispatch([(world.root, 5), (world.root, 9)])
    msgs: list[Message] = [world.metrics(batch.id, world.root, s) for s in range(1, 10)]
    msgs.append(world.finished(batch.id, 9))
    _publish(bus, topics, msgs)
    _publish(bus, topics, msgs)  # a node manager retrying after a partial failure
    agg = _aggregator(bus, world, topics, f"g-{uuid.uuid4().hex}")
    stop = _running(agg)
    try:
        wait_for(lambda: agg.stats.records == 2 * len(msgs), what="both copies")
    finally:
        stop()
    assert (agg.stats.applied, agg.stats.duplicates) == (len(msgs), len(msgs))
    assert applied_count(world.store, world.nm) == len(msgs)
    assert world.request_states([r.id for r in reqs]) == [RequestState.DONE, RequestState.DONE]


def test_malformed_and_unknown_version_records_are_skipped_and_counted_while_the_rest_is_applied(
    bus: KafkaMetricBus, topics: Topics, world: World, tansu_broker: TansuBroker
) -> None:
    batch, (r,) = world.dispatch([(world.root, 3)])
    good = [world.metrics(batch.id, world.root, s) for s in (1, 2, 3)]
    future = json.loads(encode(world.metrics(batch.id, world.root, 4)))
    future["v"] = 2
    metrics_topic = topics.route(good[0])[0]
    raw = KafkaProducer(bootstrap_servers=tansu_broker.bootstrap)
    try:
        key = str(batch.id).encode()
        raw.send(metrics_topic, key=key, value=encode(good[0]))
        raw.send(metrics_topic, key=key, value=b"\x00\x01 not json")
        raw.send(metrics_topic, key=key, value=json.dumps(future).encode())
        raw.send(metrics_topic, key=key, value=b'{"v": 1, "type": "gpu_party"}')
        raw.send(metrics_topic, key=key, value=encode(good[1]))
        raw.send(metrics_topic, key=key, value=encode(good[2]))
        raw.flush()
    finally:
        raw.close()
    agg = _aggregator(bus, world, topics, f"g-{uuid.uuid4().hex}")
    stop = _running(agg)
    try:
        wait_for(lambda: agg.stats.records == 6, what="all six records")
    finally:
        stop()
    assert (agg.stats.malformed, agg.stats.applied) == (3, 3)
    assert world.request_states([r.id]) == [RequestState.DONE]


def test_killed_between_database_commit_and_offset_commit_the_redelivered_messages_change_nothing(
    bus: KafkaMetricBus, topics: Topics, world: World
) -> None:
    batch, reqs = world.dispatch([(world.root, s) for s in (4, 8)])
    msgs: list[Message] = [world.metrics(batch.id, world.root, s) for s in range(1, 9)]
    msgs.append(world.finished(batch.id, 8))
    _publish(bus, topics, msgs)
    group = f"g-{uuid.uuid4().hex}"
    crashing = CrashingBus(bus)
    first = _aggregator(crashing, world, topics, group)
    with pytest.raises(Crash):
        first.run()
    assert first.stats.applied == len(msgs)
    after_crash = world.state()
    assert world.request_states([r.id for r in reqs]) == [RequestState.DONE, RequestState.DONE]

    second = _aggregator(bus, world, topics, group)
    stop = _running(second)
    try:
        wait_for(lambda: second.stats.records >= len(msgs), what="the redelivery")
    finally:
        stop()
    assert (second.stats.applied, second.stats.duplicates) == (0, len(msgs))
    assert world.state() == after_crash
    assert applied_count(world.store, world.nm) == len(msgs)


def test_two_aggregators_in_one_group_share_the_partitions_and_apply_each_message_once(
    bus: KafkaMetricBus, topics: Topics, world: World
) -> None:
    work = [world.dispatch([(world.root, 100 * b + 20)]) for b in range(12)]
    group = f"g-{uuid.uuid4().hex}"
    aggs = [_aggregator(bus, world, topics, group, name=f"agg-{i}") for i in range(2)]
    stop = _running(*aggs)
    try:
        wait_for(
            lambda: all(a.assignment() for a in aggs) and sum(len(a.assignment()) for a in aggs) == 3 * PARTITIONS,
            what="both members to own partitions",
        )
        msgs: list[Message] = []
        for b, (batch, _) in enumerate(work):
            msgs += [world.metrics(batch.id, world.root, 100 * b + s) for s in range(15, 21)]
            msgs.append(world.finished(batch.id, 100 * b + 20))
        _publish(bus, topics, msgs)
        wait_for(
            lambda: all(world.store.batches.get_batch(b.id).state != BatchState.RUNNING for b, _ in work),
            what="all batches",
        )
    finally:
        stop()
    assert all(a.stats.applied > 0 for a in aggs), [vars(a.stats) for a in aggs]
    assert sum(a.stats.applied for a in aggs) == applied_count(world.store, world.nm) == len(msgs)
    # the finish shares a partition with its batch's metrics: no batch's work went back to the queue
    assert all(world.request_states([r.id for r in reqs]) == [RequestState.DONE] for _, reqs in work)
    assert all(world.store.batches.get_batch(b.id).state == BatchState.DONE for b, _ in work)
