"""Test doubles for the aggregator suites: wake-up recorder, a bus whose consumers die before committing,
and waiting helpers. Shared by the unit (in-process bus) and integration (Kafka) suites."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence

from stagetree.bus.base import BusConsumer, MetricBus, Record
from stagetree.bus.messages import Message


class RecordingWakeups:
    """The master's ``Coordination.notify``, remembering the channels."""

    def __init__(self) -> None:
        self.channels: list[str] = []
        self._lock = threading.Lock()

    def notify(self, channel: str) -> None:
        with self._lock:
            self.channels.append(channel)


class Crash(Exception):
    """Stands for the process dying (kill -9) at the point where it is raised."""


class CrashBeforeCommitConsumer(BusConsumer):
    """Delegates to a real consumer, but "dies" at the first commit: the consumer leaves without
    committing, exactly as a killed aggregator's partitions go to the next member uncommitted."""

    def __init__(self, inner: BusConsumer) -> None:
        self.inner = inner
        self.commits_attempted = 0

    def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        return self.inner.poll(max_records, timeout_s)

    def commit(self, offsets: Mapping[tuple[str, int], int] | None = None) -> None:
        self.commits_attempted += 1
        raise Crash("killed between the database commit and the offset commit")

    def assignment(self) -> frozenset[tuple[str, int]]:
        return self.inner.assignment()

    @property
    def malformed_count(self) -> int:
        return self.inner.malformed_count

    def close(self) -> None:
        self.inner.close()


class CrashingBus(MetricBus):
    """A bus whose consumers crash before their first offset commit (publishing goes to ``inner``)."""

    def __init__(self, inner: MetricBus) -> None:
        self.inner = inner
        self.consumers: list[CrashBeforeCommitConsumer] = []

    def publish(self, topic: str, key: str, message: Message) -> None:
        self.inner.publish(topic, key, message)

    def flush(self, timeout_s: float | None = None) -> None:
        self.inner.flush(timeout_s)

    def subscribe(self, topics: Sequence[str], group: str) -> BusConsumer:
        consumer = CrashBeforeCommitConsumer(self.inner.subscribe(topics, group))
        self.consumers.append(consumer)
        return consumer

    def close(self) -> None:
        pass


def wait_for(condition: Callable[[], bool], timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)
