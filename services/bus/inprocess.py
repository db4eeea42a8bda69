"""``InProcessBus``: the :class:`~stagetree.bus.base.MetricBus` of the embedded mode, in memory.

It owns a small model of Kafka inside one process: topics split into partitions (a message goes to
``crc32(key) % partitions``), append-only logs of *encoded* records (so the embedded mode decodes and
validates exactly what the cluster mode does), and consumer groups with committed offsets and a range
assignment that is redone whenever a member joins or leaves. On a rebalance a partition that
changes owner restarts from the group's committed offset, which is what makes "polled but not
committed" records come back after a consumer goes away, as on Kafka; a member keeps its position
in the partitions it keeps (kafka-python does the same). Nothing is persisted: the
embedded master and node manager live and die together. ``publish_many`` writes bundle records, as
the Kafka adapter does, so both modes decode the same wire form.

Thread-safe: one lock guards everything, and a condition wakes pollers when records arrive.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from stagetree.bus.base import BusConsumer, Malformed, MetricBus, Record, decode_records
from stagetree.bus.messages import Message, encode, encode_many
from stagetree.core.errors import FailedPrecondition, InvalidArgument

logger = logging.getLogger(__name__)

TopicPartition = tuple[str, int]
_Fetched = tuple[TopicPartition, int, bytes | None, bytes | None]  # (where, offset, key, value)


@dataclass
class _Group:
    committed: dict[TopicPartition, int] = field(default_factory=dict)
    members: list[InProcessConsumer] = field(default_factory=list)


class InProcessBus(MetricBus):
    """In-memory topics and consumer groups; ``default_partitions`` for topics created on first use."""

    def __init__(self, default_partitions: int = 4) -> None:
        if default_partitions < 1:
            raise InvalidArgument(f"default_partitions must be >= 1, got {default_partitions}")
        self._default_partitions = default_partitions
        self._cond = threading.Condition()
        self._logs: dict[str, list[list[tuple[bytes | None, bytes | None]]]] = {}
        self._groups: dict[str, _Group] = {}
        self._member_ids = itertools.count()
        self._closed = False

    # --- topics --------------------------------------------------------------------------------------

    def create_topic(self, topic: str, partitions: int | None = None) -> None:
        """Create ``topic`` with ``partitions`` partitions; a topic that exists is left as it is."""
        n = self._default_partitions if partitions is None else partitions
        if n < 1:
            raise InvalidArgument(f"topic {topic!r}: partitions must be >= 1, got {n}")
        with self._cond:
            self._ensure_topic(topic, n)

    def partitions_for(self, topic: str) -> int:
        with self._cond:
            return len(self._ensure_topic(topic, self._default_partitions))

    def _ensure_topic(self, topic: str, partitions: int) -> list[list[tuple[bytes | None, bytes | None]]]:
        if not topic:
            raise InvalidArgument("a topic name must not be empty")
        log = self._logs.get(topic)
        if log is None:
            log = self._logs[topic] = [[] for _ in range(partitions)]
        return log

    # --- producer side -------------------------------------------------------------------------------

    def publish(self, topic: str, key: str, message: Message) -> None:
        self.inject(topic, key, encode(message))

    def publish_many(self, topic: str, key: str, messages: Sequence[Message]) -> None:
        for value in encode_many(messages):
            self.inject(topic, key, value)

    def inject(self, topic: str, key: str | None, value: bytes | None) -> None:
        """Append raw bytes as any producer could (tools, tests of the malformed path)."""
        raw_key = key.encode() if key is not None else None
        with self._cond:
            if self._closed:
                raise FailedPrecondition("the in-process bus is closed; create a new one")
            log = self._ensure_topic(topic, self._default_partitions)
            # Keyless records go to partition 0: ordering for them is not promised anyway.
            partition = zlib.crc32(raw_key) % len(log) if raw_key is not None else 0
            log[partition].append((raw_key, value))
            self._cond.notify_all()

    def flush(self, timeout_s: float | None = None) -> None:
        """Nothing to wait for: :meth:`publish` stores before it returns."""

    def close(self) -> None:
        with self._cond:
            self._closed = True

    # --- consumer side -------------------------------------------------------------------------------

    def subscribe(self, topics: Sequence[str], group: str) -> InProcessConsumer:
        if not topics:
            raise InvalidArgument("subscribe needs at least one topic")
        if not group:
            raise InvalidArgument("a consumer group name must not be empty")
        with self._cond:
            for t in topics:
                self._ensure_topic(t, self._default_partitions)
            consumer = InProcessConsumer(self, group, tuple(dict.fromkeys(topics)), next(self._member_ids))
            g = self._groups.setdefault(group, _Group())
            g.members.append(consumer)
            self._rebalance(g)
        logger.debug("consumer joined", extra={"group": group, "member": consumer.member_id})
        return consumer

    def _leave(self, consumer: InProcessConsumer) -> None:
        with self._cond:
            g = self._groups[consumer.group]
            if consumer in g.members:
                g.members.remove(consumer)
                self._rebalance(g)
        logger.debug("consumer left", extra={"group": consumer.group, "member": consumer.member_id})

    def _rebalance(self, group: _Group) -> None:
        """Range assignment per topic over the members subscribed to it."""
        owned: dict[int, list[TopicPartition]] = {m.member_id: [] for m in group.members}
        for topic in sorted({t for m in group.members for t in m.topics}):
            members = [m for m in group.members if topic in m.topics]
            n = len(self._logs[topic])
            per, extra = divmod(n, len(members))
            start = 0
            for i, m in enumerate(members):
                count = per + (1 if i < extra else 0)
                owned[m.member_id].extend((topic, p) for p in range(start, start + count))
                start += count
        for m in group.members:
            # As kafka-python does: a partition the member keeps keeps its position; one that
            # changed owner starts from the group's committed offset.
            m._positions = {tp: m._positions.get(tp, group.committed.get(tp, 0)) for tp in owned[m.member_id]}
            m._order = list(owned[m.member_id])

    def _fetch(self, consumer: InProcessConsumer, max_records: int) -> list[_Fetched]:
        out: list[_Fetched] = []
        order = consumer._order
        # Rotate the starting partition so one busy partition cannot starve the others.
        for i in range(len(order)):
            tp = order[(consumer._next + i) % len(order)]
            log = self._logs[tp[0]][tp[1]]
            pos = consumer._positions[tp]
            if pos >= len(log):  # most partitions, most wake-ups: every publish wakes every poller
                continue
            take = log[pos : pos + max_records - len(out)]
            out.extend((tp, pos + j, k, v) for j, (k, v) in enumerate(take))
            consumer._positions[tp] = pos + len(take)
            if len(out) >= max_records:
                break
        if order:
            consumer._next = (consumer._next + 1) % len(order)
        return out

    def _commit(self, consumer: InProcessConsumer, offsets: Mapping[TopicPartition, int] | None) -> None:
        with self._cond:
            if offsets is None:
                self._groups[consumer.group].committed.update(consumer._positions)
            else:  # only what this member still owns, as on Kafka
                owned = consumer._positions
                self._groups[consumer.group].committed.update({tp: o for tp, o in offsets.items() if tp in owned})


class InProcessConsumer(BusConsumer):
    """A member of an in-process consumer group (see :class:`InProcessBus`)."""

    def __init__(self, bus: InProcessBus, group: str, topics: tuple[str, ...], member_id: int) -> None:
        self._bus = bus
        self.group = group
        self.topics = topics
        self.member_id = member_id
        self._positions: dict[TopicPartition, int] = {}
        self._order: list[TopicPartition] = []
        self._next = 0
        self._malformed = 0
        self._closed = False

    def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        if max_records < 1:
            raise InvalidArgument(f"max_records must be >= 1, got {max_records}")
        if self._closed:
            raise FailedPrecondition("poll on a closed consumer; subscribe again")
        deadline = time.monotonic() + max(timeout_s, 0.0)
        with self._bus._cond:
            while True:
                raw = self._bus._fetch(self, max_records)
                remaining = deadline - time.monotonic()
                if raw or remaining <= 0:
                    break
                self._bus._cond.wait(remaining)
        records = [r for tp, offset, k, v in raw for r in decode_records(tp[0], tp[1], offset, k, v)]
        self._malformed += sum(isinstance(r.message, Malformed) for r in records)
        return records

    def commit(self, offsets: Mapping[tuple[str, int], int] | None = None) -> None:
        if self._closed:
            raise FailedPrecondition("commit on a closed consumer")
        self._bus._commit(self, offsets)

    def assignment(self) -> frozenset[tuple[str, int]]:
        with self._bus._cond:
            return frozenset(self._positions)

    @property
    def malformed_count(self) -> int:
        return self._malformed

    def lag(self) -> int | None:
        with self._bus._cond:
            return max((len(self._bus._logs[t][p]) - pos for (t, p), pos in self._positions.items()), default=0)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._bus._leave(self)
