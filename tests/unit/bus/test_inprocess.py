"""What only the in-process bus does: wake-ups across threads, partitions, closed handles.

The shared behaviour (ordering, groups, commits, malformed records) is in
tests/integration/bus/test_bus_contract.py, run against this adapter and Kafka alike."""

from __future__ import annotations

import threading
import time

import pytest

from stagetree.bus.inprocess import InProcessBus
from stagetree.bus.messages import BatchStarted
from stagetree.core.errors import FailedPrecondition, InvalidArgument


def _started(batch_id: int) -> BatchStarted:
    return BatchStarted(msg_id=f"nm:{batch_id}:0:0", node_manager="nm", batch_id=batch_id, attempt=0)


def test_a_waiting_poll_wakes_up_when_a_message_arrives() -> None:
    bus = InProcessBus()
    consumer = bus.subscribe(["t"], "g")
    timer = threading.Timer(0.05, lambda: bus.publish("t", "1", _started(1)))
    timer.start()
    started = time.monotonic()
    records = consumer.poll(timeout_s=5)
    timer.join()
    assert [r.message for r in records] == [_started(1)]
    assert time.monotonic() - started < 2


def test_poll_returns_empty_after_its_timeout() -> None:
    consumer = InProcessBus().subscribe(["t"], "g")
    started = time.monotonic()
    assert consumer.poll(timeout_s=0.05) == []
    assert 0.04 <= time.monotonic() - started < 1


def test_max_records_is_respected_and_the_rest_comes_next() -> None:
    bus = InProcessBus(default_partitions=2)
    for b in range(10):
        bus.publish("t", str(b), _started(b))
    consumer = bus.subscribe(["t"], "g")
    first = consumer.poll(max_records=4, timeout_s=0)
    rest = consumer.poll(max_records=100, timeout_s=0)
    assert len(first) == 4 and len(rest) == 6
    assert {r.message.msg_id for r in first + rest} == {_started(b).msg_id for b in range(10)}  # type: ignore[union-attr]


def test_a_topic_keeps_the_partitions_it_was_created_with() -> None:
    bus = InProcessBus(default_partitions=4)
    bus.create_topic("wide", 16)
    bus.create_topic("wide", 2)
    assert bus.partitions_for("wide") == 16
    assert bus.partitions_for("other") == 4


def test_more_members_than_partitions_leaves_some_idle() -> None:
    bus = InProcessBus()
    bus.create_topic("t", 2)
    members = [bus.subscribe(["t"], "g") for _ in range(3)]
    owned = [m.assignment() for m in members]
    assert sorted(map(len, owned)) == [0, 1, 1]
    members[0].close()
    assert sorted(len(m.assignment()) for m in members[1:]) == [1, 1]


def test_closed_handles_refuse_work() -> None:
    bus = InProcessBus()
    consumer = bus.subscribe(["t"], "g")
    consumer.close()
    with pytest.raises(FailedPrecondition):
        consumer.poll()
    with pytest.raises(FailedPrecondition):
        consumer.commit()
    bus.close()
    with pytest.raises(FailedPrecondition):
        bus.publish("t", "1", _started(1))


@pytest.mark.parametrize(
    "call",
    [
        lambda b: b.subscribe([], "g"),
        lambda b: b.subscribe(["t"], ""),
        lambda b: b.create_topic("t", 0),
        lambda b: InProcessBus(0),
    ],
)
def test_bad_arguments_are_invalid(call: object) -> None:
    with pytest.raises(InvalidArgument):
        call(InProcessBus())  # type: ignore[operator]
