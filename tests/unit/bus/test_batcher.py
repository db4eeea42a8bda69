"""LocalBatcher over the in-process bus: flush by count, by age, on close; order; a bus that is down."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest

from stagetree.bus.base import BusConsumer, MetricBus
from stagetree.bus.batcher import LocalBatcher
from stagetree.bus.inprocess import InProcessBus
from stagetree.bus.messages import TOPIC_METRICS, Message, Metrics, make_msg_id
from stagetree.core.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable


def _m(batch_id: int, seq: int, node_manager: str = "nm") -> Metrics:
    return Metrics(
        msg_id=make_msg_id(node_manager, batch_id, 0, seq),
        node_manager=node_manager,
        batch_id=batch_id,
        attempt=0,
        node=0,
        step=seq,
        metrics={"loss": float(seq)},
    )


def _drain(consumer: BusConsumer) -> list[Message]:
    out: list[Message] = []
    while recs := consumer.poll(timeout_s=0):
        out += [r.message for r in recs if isinstance(r.message, Message)]
    return out


class CountingBus(InProcessBus):
    """Counts flushes, and fails the next ``fail`` publishes with Unavailable."""

    def __init__(self) -> None:
        super().__init__()
        self.flushes = 0
        self.fail = 0
        self.records = 0

    def publish_many(self, topic: str, key: str, messages: Sequence[Message]) -> None:
        if self.fail:
            self.fail -= 1
            raise Unavailable("broker down (test)")
        self.records += 1
        super().publish_many(topic, key, messages)

    def flush(self, timeout_s: float | None = None) -> None:
        self.flushes += 1


def test_a_full_batch_is_published_at_once_in_one_flush() -> None:
    bus = CountingBus()
    consumer = bus.subscribe([TOPIC_METRICS], "agg")
    with LocalBatcher(bus, max_messages=5, max_age_s=60) as batcher:
        for seq in range(4):
            batcher.add(_m(1, seq))
        assert _drain(consumer) == [] and batcher.pending() == 4
        batcher.add(_m(1, 4))
        assert batcher.pending() == 0
        assert _drain(consumer) == [_m(1, s) for s in range(5)]
        assert bus.flushes == 1
        assert bus.records == 1  # one key: one bundle record


def test_a_batch_goes_out_as_one_bundle_per_key_each_in_order() -> None:
    bus = CountingBus()
    consumer = bus.subscribe([TOPIC_METRICS], "agg")
    sent = [_m(b, s) for s in range(10) for b in (1, 2, 3)]  # interleaved keys
    with LocalBatcher(bus, max_messages=30, max_age_s=60) as batcher:
        for m in sent:
            batcher.add(m)
        assert bus.records == 3
    records = consumer.poll(timeout_s=0)
    for b in (1, 2, 3):
        mine = [r for r in records if r.key == str(b)]
        assert [r.message for r in mine] == [m for m in sent if m.batch_id == b]
        assert len({r.offset for r in mine}) == 1 and [r.index for r in mine] == list(range(10))


def test_an_old_message_is_published_after_max_age() -> None:
    bus = InProcessBus()
    consumer = bus.subscribe([TOPIC_METRICS], "agg")
    with LocalBatcher(bus, max_messages=1000, max_age_s=0.05) as batcher:
        batcher.add(_m(1, 0))
        started = time.monotonic()
        records = consumer.poll(timeout_s=5)
        waited = time.monotonic() - started
        assert [r.message for r in records] == [_m(1, 0)]
        assert 0.03 <= waited < 2
        assert batcher.published == 1


def test_close_publishes_what_is_left_and_then_refuses_more() -> None:
    bus = InProcessBus()
    consumer = bus.subscribe([TOPIC_METRICS], "agg")
    batcher = LocalBatcher(bus, max_messages=1000, max_age_s=60)
    batcher.add(_m(1, 0))
    batcher.add(_m(2, 0))
    batcher.close()
    assert sorted(m.msg_id for m in _drain(consumer)) == [_m(1, 0).msg_id, _m(2, 0).msg_id]
    with pytest.raises(FailedPrecondition):
        batcher.add(_m(1, 1))
    batcher.close()  # a second close is harmless


def test_each_batch_keeps_its_order_when_many_threads_add() -> None:
    bus = InProcessBus()
    consumer = bus.subscribe([TOPIC_METRICS], "agg")
    per_thread = 300

    def worker(batch_id: int) -> None:
        for seq in range(per_thread):
            batcher.add(_m(batch_id, seq))

    with LocalBatcher(bus, max_messages=37, max_age_s=0.01) as batcher:
        threads = [threading.Thread(target=worker, args=(b,)) for b in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    got = _drain(consumer)
    assert len(got) == 8 * per_thread
    for b in range(8):
        assert [m.step for m in got if m.batch_id == b] == list(range(per_thread))  # type: ignore[attr-defined]


def test_a_failed_flush_keeps_the_messages_in_order_for_the_next_try() -> None:
    bus = CountingBus()
    consumer = bus.subscribe([TOPIC_METRICS], "agg")
    batcher = LocalBatcher(bus, max_messages=3, max_age_s=60)
    bus.fail = 2  # the first publish of the batch fails
    for seq in range(3):
        batcher.add(_m(1, seq))  # fills the batch; the flush fails, add does not raise
    assert batcher.pending() == 3
    batcher.add(_m(1, 3))
    assert _drain(consumer) == []  # still failing: the 2nd publish attempt failed too
    assert batcher.flush() == 4
    assert _drain(consumer) == [_m(1, s) for s in range(4)]
    batcher.close()


def test_close_raises_when_the_bus_is_down_and_keeps_the_messages() -> None:
    bus = CountingBus()
    batcher = LocalBatcher(bus, max_messages=10, max_age_s=60)
    batcher.add(_m(1, 0))
    bus.fail = 1
    with pytest.raises(Unavailable):
        batcher.close()
    assert batcher.pending() == 1


def test_the_timer_retries_after_the_bus_recovers() -> None:
    bus = CountingBus()
    consumer = bus.subscribe([TOPIC_METRICS], "agg")
    bus.fail = 1
    with LocalBatcher(bus, max_messages=100, max_age_s=0.02) as batcher:
        batcher.add(_m(1, 0))
        records = consumer.poll(timeout_s=5)
    assert [r.message for r in records] == [_m(1, 0)]


def test_a_full_buffer_pushes_back() -> None:
    class DownBus(InProcessBus):
        def publish_many(self, topic: str, key: str, messages: Sequence[Message]) -> None:
            raise Unavailable("down")

    batcher = LocalBatcher(DownBus(), max_messages=2, max_age_s=60, max_buffered=4)
    for seq in range(4):
        batcher.add(_m(1, seq))
    with pytest.raises(ResourceExhausted, match="waiting"):
        batcher.add(_m(1, 4))
    assert batcher.pending() == 4
    with pytest.raises(Unavailable):
        batcher.close()


def test_the_batch_being_published_counts_against_the_buffer_bound() -> None:
    class GatedBus(InProcessBus):
        """Holds each publish until ``gate`` opens, then refuses it while ``down``."""

        def __init__(self) -> None:
            super().__init__()
            self.publishing = threading.Event()
            self.gate = threading.Event()
            self.down = True

        def publish_many(self, topic: str, key: str, messages: Sequence[Message]) -> None:
            self.publishing.set()
            assert self.gate.wait(10)
            if self.down:
                raise Unavailable("down")
            super().publish_many(topic, key, messages)

    bus = GatedBus()
    consumer = bus.subscribe([TOPIC_METRICS], "agg")
    batcher = LocalBatcher(bus, max_messages=2, max_age_s=60, max_buffered=4)
    batcher.add(_m(1, 0))
    batcher.add(_m(1, 1), publish_here=False)  # a full batch: the batcher's thread takes it out to publish
    assert bus.publishing.wait(10)
    batcher.add(_m(1, 2), publish_here=False)
    batcher.add(_m(1, 3), publish_here=False)
    with pytest.raises(ResourceExhausted, match="4 bus messages"):
        batcher.add(_m(1, 4), publish_here=False)  # two queued, two in the publish that will fail
    assert batcher.pending() == 4
    bus.down = False
    bus.gate.set()
    batcher.close()
    assert _drain(consumer) == [_m(1, s) for s in range(4)]


@pytest.mark.parametrize(("max_messages", "max_age_s", "max_buffered"), [(0, 1.0, 10), (5, 0.0, 10), (5, 1.0, 4)])
def test_bad_settings_are_invalid(max_messages: int, max_age_s: float, max_buffered: int) -> None:
    bus: MetricBus = InProcessBus()
    with pytest.raises(InvalidArgument):
        LocalBatcher(bus, max_messages=max_messages, max_age_s=max_age_s, max_buffered=max_buffered)


class GatedFlushBus(CountingBus):
    """A broker round trip per flush that lasts until ``gate`` opens: what urgent adds arriving meanwhile
    share."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.flushing = threading.Event()

    def flush(self, timeout_s: float | None = None) -> None:
        self.flushing.set()
        assert self.gate.wait(10)
        super().flush(timeout_s)


def _published(batcher: LocalBatcher) -> None:
    deadline = time.monotonic() + 10
    while batcher.pending():
        assert time.monotonic() < deadline, f"{batcher.pending()} messages still unpublished after 10 s"
        time.sleep(0.005)


def test_an_urgent_message_goes_out_without_waiting_for_the_age_and_a_burst_shares_few_flushes() -> None:
    bus = GatedFlushBus()
    consumer = bus.subscribe([TOPIC_METRICS], "agg")
    with LocalBatcher(bus, max_messages=1000, max_age_s=60) as batcher:
        batcher.add(_m(1, 0))  # waits for its age (60 s)
        batcher.add(_m(1, 1), urgent=True)  # takes it along, now
        _published(batcher)
        assert _drain(consumer) == [_m(1, 0), _m(1, 1)]
        before = bus.flushes
        # fifty slots end together, each adding its end from its own thread while the first end's flush
        # waits on the broker: nobody waits for the broker, and the other ends go out together next
        bus.gate.clear()
        bus.flushing.clear()
        batcher.add(_m(2, 0), urgent=True)
        assert bus.flushing.wait(10)
        threads = [
            threading.Thread(target=batcher.add, args=(_m(2, s),), kwargs={"urgent": True}) for s in range(1, 50)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert not any(t.is_alive() for t in threads)  # every add returned while the broker held the flush
        bus.gate.set()
        _published(batcher)
        assert sorted(m.step for m in _drain(consumer) if m.batch_id == 2) == list(range(50))
        assert bus.flushes - before == 2
