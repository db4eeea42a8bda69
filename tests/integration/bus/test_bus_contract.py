"""The MetricBus contract, run against every adapter: InProcessBus and KafkaMetricBus (on Tansu).

Each test gets fresh topics and group names, so tests on the shared broker do not see each other.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from kafka import KafkaProducer

from stagetree.bus.base import BusConsumer, Malformed, MetricBus, Record, next_offsets
from stagetree.bus.batcher import LocalBatcher
from stagetree.bus.inprocess import InProcessBus
from stagetree.bus.kafka import KafkaBusConfig, KafkaMetricBus, ensure_topics
from stagetree.bus.messages import (
    ALL_TOPICS,
    BatchFinished,
    BatchStarted,
    MalformedMessage,
    Message,
    Metrics,
    UnsupportedVersion,
    encode,
    make_msg_id,
)
from stagetree.bus.tansu import TansuBroker

PARTITIONS = 4


@dataclass
class Harness:
    """What the contract needs from an adapter besides the MetricBus itself."""

    bus: MetricBus
    new_topic: Callable[[], str]
    inject: Callable[[str, str, bytes], None]  # raw bytes, as a foreign producer would write them


def _unique(prefix: str) -> str:
    return f"{prefix}.{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=["inprocess", "kafka"])
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    if request.param == "inprocess":
        bus = InProcessBus(default_partitions=PARTITIONS)

        def new_topic() -> str:
            name = _unique("test")
            bus.create_topic(name, PARTITIONS)
            return name

        with bus:
            yield Harness(bus, new_topic, lambda t, k, v: bus.inject(t, k, v))
        return

    broker: TansuBroker = request.getfixturevalue("tansu_broker")
    config = KafkaBusConfig.fast_rebalance(broker.bootstrap)
    ensure_topics(config, ALL_TOPICS, partitions=PARTITIONS)

    def new_kafka_topic() -> str:
        name = _unique("test")
        ensure_topics(config, [name], partitions=PARTITIONS)
        return name

    raw = KafkaProducer(bootstrap_servers=broker.bootstrap)

    def inject(topic: str, key: str, value: bytes) -> None:
        raw.send(topic, key=key.encode(), value=value)
        raw.flush()

    try:
        with KafkaMetricBus(config) as kbus:
            yield Harness(kbus, new_kafka_topic, inject)
    finally:
        raw.close()


def _metrics(batch_id: int, seq: int, node_manager: str = "nm-1") -> Metrics:
    return Metrics(
        msg_id=make_msg_id(node_manager, batch_id, 0, seq),
        node_manager=node_manager,
        batch_id=batch_id,
        attempt=0,
        plan_key="plan-a",
        node=1,
        step=seq,
        metrics={"loss": 1.0 / (seq + 1)},
    )


def _publish(bus: MetricBus, topic: str, messages: list[Message]) -> None:
    for m in messages:
        bus.publish(topic, m.key, m)
    bus.flush()


def _join(*consumers: BusConsumer, timeout_s: float = 60.0, expect_records: bool = False) -> list[Record]:
    """Poll until every consumer owns partitions and the group is settled (no overlap); returns the
    records polled meanwhile (there must be none unless ``expect_records``).

    Each consumer polls from its own thread, as separate aggregator processes would: kafka-python
    3.0 drops a join result that arrives while its consumer is not inside poll() and joins again,
    so polling several consumers in turn from one thread can keep a group rebalancing."""
    stop = threading.Event()
    leaked: list[Record] = []

    def keep_polling(consumer: BusConsumer) -> None:
        while not stop.is_set():
            leaked.extend(consumer.poll(timeout_s=0.05))

    def settled() -> bool:
        owned = [c.assignment() for c in consumers]
        return all(owned) and sum(map(len, owned)) == len(frozenset().union(*owned))

    threads = [threading.Thread(target=keep_polling, args=(c,)) for c in consumers]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    try:
        while not settled() and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        stop.set()
        for t in threads:
            t.join()
    if not settled():
        pytest.fail(f"consumers did not join within {timeout_s} s: {[c.assignment() for c in consumers]}")
    assert expect_records or leaked == [], f"joining returned records: {leaked}"
    return leaked


def _poll_until(consumers: list[BusConsumer], count: int, timeout_s: float = 60.0) -> list[list[Record]]:
    """Poll all consumers until they returned ``count`` records between them."""
    got: list[list[Record]] = [[] for _ in consumers]
    deadline = time.monotonic() + timeout_s
    while sum(map(len, got)) < count and time.monotonic() < deadline:
        for i, c in enumerate(consumers):
            got[i].extend(c.poll(max_records=50, timeout_s=0.05))
    assert sum(map(len, got)) == count, f"wanted {count} records, got {sum(map(len, got))}"
    return got


def _assert_quiet(consumer: BusConsumer, seconds: float = 0.5) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        extra = consumer.poll(timeout_s=0.1)
        assert extra == [], f"unexpected records: {extra}"


def _ids(records: list[Record]) -> list[str]:
    return [r.message.msg_id for r in records if isinstance(r.message, Message)]


def test_messages_of_one_key_arrive_in_order(harness: Harness) -> None:
    topic = harness.new_topic()
    batches = [11, 12, 13, 14, 15]
    sent = [_metrics(b, seq) for seq in range(20) for b in batches]  # interleaved keys
    _publish(harness.bus, topic, sent)

    with harness.bus.subscribe([topic], _unique("g")) as consumer:
        (records,) = _poll_until([consumer], len(sent))

    for b in batches:
        mine = [r for r in records if r.key == str(b)]
        assert [r.message for r in mine] == [m for m in sent if m.batch_id == b]
        assert len({r.partition for r in mine}) == 1
        assert [r.offset for r in mine] == sorted(r.offset for r in mine)
    assert consumer.malformed_count == 0


def test_consumers_in_one_group_share_the_partitions(harness: Harness) -> None:
    topic = harness.new_topic()
    group = _unique("g")
    with harness.bus.subscribe([topic], group) as a, harness.bus.subscribe([topic], group) as b:
        _join(a, b)
        assert a.assignment() | b.assignment() == {(topic, p) for p in range(PARTITIONS)}

        sent = [_metrics(batch, 0) for batch in range(40)]
        _publish(harness.bus, topic, sent)
        got_a, got_b = _poll_until([a, b], len(sent))

        assert got_a and got_b, "with 40 keys over 4 partitions both members should get records"
        assert {(r.topic, r.partition) for r in got_a} <= a.assignment()
        assert {(r.topic, r.partition) for r in got_b} <= b.assignment()
        assert set(_ids(got_a)).isdisjoint(_ids(got_b))
        assert sorted(_ids(got_a) + _ids(got_b)) == sorted(m.msg_id for m in sent)


def test_another_group_gets_everything_independently(harness: Harness) -> None:
    topic = harness.new_topic()
    sent = [_metrics(batch, 0) for batch in range(10)]
    _publish(harness.bus, topic, sent)
    with harness.bus.subscribe([topic], _unique("g")) as first:
        (records,) = _poll_until([first], len(sent))
        first.commit()
    with harness.bus.subscribe([topic], _unique("g")) as second:
        (again,) = _poll_until([second], len(sent))
    assert sorted(_ids(records)) == sorted(_ids(again)) == sorted(m.msg_id for m in sent)


def test_records_not_committed_are_delivered_again(harness: Harness) -> None:
    topic = harness.new_topic()
    group = _unique("g")
    sent = [_metrics(batch, seq) for batch in range(4) for seq in range(5)]
    _publish(harness.bus, topic, sent)

    crashed = harness.bus.subscribe([topic], group)
    (first,) = _poll_until([crashed], len(sent))
    crashed.close()  # went away before its database commit: nothing committed

    with harness.bus.subscribe([topic], group) as successor:
        (second,) = _poll_until([successor], len(sent))
        _assert_quiet(successor)
    assert sorted(_ids(first)) == sorted(_ids(second)) == sorted(m.msg_id for m in sent)


def test_a_rebalance_hands_uncommitted_records_to_the_new_owner(harness: Harness) -> None:
    topic = harness.new_topic()
    group = _unique("g")
    sent = [_metrics(batch, 0) for batch in range(24)]
    _publish(harness.bus, topic, sent)

    with harness.bus.subscribe([topic], group) as a:
        (held,) = _poll_until([a], len(sent))  # a holds every partition and commits nothing
        with harness.bus.subscribe([topic], group) as b:
            during = _join(a, b, expect_records=True)
            moved = b.assignment()
            assert moved and not moved & a.assignment()
            got_a = [r for r in during if (r.topic, r.partition) in a.assignment()]
            got_b = [r for r in during if (r.topic, r.partition) in moved]
            expected_b = sorted(_ids([r for r in held if (r.topic, r.partition) in moved]))
            deadline = time.monotonic() + 15
            while len(got_b) < len(expected_b) and time.monotonic() < deadline:
                got_a += a.poll(timeout_s=0.05)
                got_b += b.poll(timeout_s=0.05)
            _assert_quiet(a, 0.3)
    # What a polled in the partitions that moved goes to b again; a keeps its place in the others.
    assert sorted(_ids(got_b)) == expected_b
    assert got_a == []


def test_committed_records_are_not_delivered_again(harness: Harness) -> None:
    topic = harness.new_topic()
    group = _unique("g")
    before = [_metrics(batch, 0) for batch in range(8)]
    after = [_metrics(batch, 1) for batch in range(8)]
    later = [_metrics(batch, 2) for batch in range(8)]
    _publish(harness.bus, topic, before)

    with harness.bus.subscribe([topic], group) as first:
        _poll_until([first], len(before))
        first.commit()
        _publish(harness.bus, topic, after)
        (polled_not_committed,) = _poll_until([first], len(after))
    assert sorted(_ids(polled_not_committed)) == sorted(m.msg_id for m in after)

    _publish(harness.bus, topic, later)
    with harness.bus.subscribe([topic], group) as second:
        (rest,) = _poll_until([second], len(after) + len(later))
        second.commit()
        _assert_quiet(second)
    # Only the records polled after the last commit, and the new ones, come back.
    assert sorted(_ids(rest)) == sorted(m.msg_id for m in after + later)

    with harness.bus.subscribe([topic], group) as third:
        _join(third)
        _assert_quiet(third)


def test_malformed_records_are_skipped_and_counted(harness: Harness) -> None:
    topic = harness.new_topic()
    group = _unique("g")
    good_before = _metrics(7, 0)
    good_after = _metrics(7, 1)
    harness.bus.publish(topic, "7", good_before)
    harness.bus.flush()
    harness.inject(topic, "7", b"\xff\xfe not utf-8")
    harness.inject(topic, "7", b'{"v": 1, "type": "metrics", "msg_id": "x"}')  # fields missing
    harness.inject(topic, "7", json.dumps({"v": 1, "type": "no_such_kind"}).encode())
    harness.bus.publish(topic, "7", good_after)
    harness.bus.flush()

    with harness.bus.subscribe([topic], group) as consumer:
        (records,) = _poll_until([consumer], 5)
        consumer.commit()
        assert consumer.malformed_count == 3

    assert [r.message for r in records if isinstance(r.message, Message)] == [good_before, good_after]
    bad = [r.message for r in records if isinstance(r.message, Malformed)]
    assert len(bad) == 3
    assert all(isinstance(m.error, MalformedMessage) for m in bad)
    assert bad[0].raw == b"\xff\xfe not utf-8"
    assert [r.offset for r in records] == sorted(r.offset for r in records)

    # The commit moved past the bad records too: the group does not see them again.
    with harness.bus.subscribe([topic], group) as again:
        _join(again)
        _assert_quiet(again)
        assert again.malformed_count == 0


def test_unknown_schema_version_is_skipped_and_counted(harness: Harness) -> None:
    topic = harness.new_topic()
    future = json.loads(encode(_metrics(3, 0)))
    future["v"] = 2
    harness.inject(topic, "3", json.dumps(future).encode())
    harness.bus.publish(topic, "3", _metrics(3, 1))
    harness.bus.flush()

    with harness.bus.subscribe([topic], _unique("g")) as consumer:
        (records,) = _poll_until([consumer], 2)
        assert consumer.malformed_count == 1
    first, second = records
    assert isinstance(first.message, Malformed)
    assert isinstance(first.message.error, UnsupportedVersion)
    assert first.message.error.version == 2
    assert second.message == _metrics(3, 1)


def test_local_batcher_publishes_in_order_to_the_routed_topics(harness: Harness) -> None:
    node_manager = _unique("nm")
    batch_id = int(uuid.uuid4().int % 10**9)
    sent: list[Message] = [
        BatchStarted(
            msg_id=make_msg_id(node_manager, batch_id, 0, 0),
            node_manager=node_manager,
            batch_id=batch_id,
            attempt=0,
        ),
        *[_metrics(batch_id, seq, node_manager) for seq in range(1, 25)],
        BatchFinished(
            msg_id=make_msg_id(node_manager, batch_id, 0, 25),
            node_manager=node_manager,
            batch_id=batch_id,
            attempt=0,
            steps=24,
        ),
    ]
    with LocalBatcher(harness.bus, max_messages=10, max_age_s=0.05) as batcher:
        for m in sent:
            batcher.add(m)

    with harness.bus.subscribe([m.TOPIC for m in sent[:2]], _unique("g")) as consumer:
        # Earlier tests on the shared broker may have left messages of other node managers.
        deadline = time.monotonic() + 15
        mine: list[Record] = []
        while len(mine) < len(sent) and time.monotonic() < deadline:
            recs = consumer.poll(timeout_s=0.1)
            mine += [r for r in recs if isinstance(r.message, Message) and r.message.node_manager == node_manager]
    assert batcher.published == len(sent)
    by_topic = {t: [r.message for r in mine if r.topic == t] for t in {r.topic for r in mine}}
    for topic, got in by_topic.items():
        assert got == [m for m in sent if topic == m.TOPIC]
    assert sum(map(len, by_topic.values())) == len(sent)


def test_explicit_offsets_commit_only_what_was_processed(harness: Harness) -> None:
    topic = harness.new_topic()
    group = _unique("g")
    processed = [_metrics(batch, 0) for batch in range(8)]
    polled_ahead = [_metrics(batch, 1) for batch in range(8)]
    _publish(harness.bus, topic, processed)
    with harness.bus.subscribe([topic], group) as consumer:
        (done,) = _poll_until([consumer], len(processed))
        _publish(harness.bus, topic, polled_ahead)
        _poll_until([consumer], len(polled_ahead))
        consumer.commit(next_offsets(done))  # the second poll is still being applied when this commits
    with harness.bus.subscribe([topic], group) as successor:
        (again,) = _poll_until([successor], len(polled_ahead))
        _assert_quiet(successor)
    assert sorted(_ids(again)) == sorted(m.msg_id for m in polled_ahead)


def test_publish_many_bundles_a_keys_messages_into_one_record(harness: Harness) -> None:
    topic = harness.new_topic()
    sent = [_metrics(5, seq) for seq in range(30)]
    harness.bus.publish_many(topic, "5", sent)
    harness.bus.flush()
    with harness.bus.subscribe([topic], _unique("g")) as consumer:
        (records,) = _poll_until([consumer], len(sent))
    assert [r.message for r in records] == sent
    assert len({r.offset for r in records}) == 1
    assert [r.index for r in records] == list(range(len(sent)))


def test_lag_counts_what_is_not_polled_yet(harness: Harness) -> None:
    topic = harness.new_topic()
    sent = [_metrics(7, seq) for seq in range(30)]  # one key: one partition
    _publish(harness.bus, topic, sent)
    with harness.bus.subscribe([topic], _unique("g")) as consumer:
        first: list[Record] = []
        deadline = time.monotonic() + 15
        while not first and time.monotonic() < deadline:
            first = consumer.poll(max_records=5, timeout_s=0.2)
        lag = consumer.lag()
        # Kafka's figure is kafka-python's records-lag-max, from the high-water mark of the last fetch
        assert lag is None or 0 <= lag <= len(sent) - len(first)
        if isinstance(harness.bus, InProcessBus):
            assert lag == len(sent) - len(first)
        _poll_until([consumer], len(sent) - len(first))
        if isinstance(harness.bus, InProcessBus):
            assert consumer.lag() == 0
