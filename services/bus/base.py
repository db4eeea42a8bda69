"""The ``MetricBus`` role: how node managers publish metrics and events and aggregators consume them.

This module owns the interface only; adapters are :class:`~stagetree.bus.kafka.KafkaMetricBus` (cluster
mode) and :class:`~stagetree.bus.inprocess.InProcessBus` (embedded mode), and one contract suite
(``tests/integration/bus/test_bus_contract.py``) holds both to the same behaviour:

- messages with the same key are delivered in the order they were published;
- consumers that subscribe with the same group share the partitions (each record goes to one of them);
- delivery is at least once: :meth:`BusConsumer.commit` stores what was polled (or the offsets it is
  given, so a consumer can poll ahead while earlier records are still being applied), and anything polled but
  not committed is delivered again to the next consumer of the group that takes over its partition
  (a member keeps its position in the partitions a rebalance leaves it). Commit only after the effects
  of the records are durable (the database commit), and apply idempotently (``msg_id``);
- a record that does not decode is logged, counted in :attr:`BusConsumer.malformed_count` and handed
  over as a :class:`Malformed` marker, so the caller skips it and a commit moves past it;
- :meth:`MetricBus.publish_many` packs a key's consecutive messages into bundle records; consumers see
  one :class:`Record` per message either way (a bad message in a bundle is one ``Malformed``).

Errors: a broker that cannot be reached is :class:`~stagetree.core.errors.Unavailable`; a commit that
lost its partitions to a rebalance is :class:`~stagetree.core.errors.Conflict` (keep polling: the new
owner gets the uncommitted records).
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import NamedTuple, Self

from stagetree.bus.messages import MalformedMessage, Message, decode_many

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Malformed:
    """Stands in for a record that did not decode: why, and the raw value for a dead-letter store."""

    error: MalformedMessage
    raw: bytes | None

    @property
    def reason(self) -> str:
        return self.error.reason


class Record(NamedTuple):
    """One consumed message: where it came from and the message (or why it did not decode).

    A bus record that holds a bundle (see :func:`~stagetree.bus.messages.encode_many`) yields one
    ``Record`` per message, with the same offset and ``index`` its place in the bundle. (A named tuple:
    one is built per consumed message, and a frozen dataclass costs several times as much to build.)"""

    topic: str
    partition: int
    offset: int
    key: str | None
    message: Message | Malformed
    index: int = 0  # type: ignore[assignment]  # shadows tuple.index, which nothing here calls


def decode_records(topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None) -> list[Record]:
    """The :class:`Record` list for one raw record, logging (never raising) what does not decode.

    Shared by the adapters so both treat bad records the same way."""
    key_text = key.decode("utf-8", errors="replace") if key is not None else None
    out: list[Record] = []
    for index, item in enumerate(decode_many(value)):
        if isinstance(item, MalformedMessage):
            logger.warning(
                "skipping malformed bus record: %s",
                item.reason,
                extra={"topic": topic, "partition": partition, "offset": offset, "index": index, "key": key_text},
            )
            out.append(Record(topic, partition, offset, key_text, Malformed(item, value), index))
        else:
            out.append(Record(topic, partition, offset, key_text, item, index))
    return out


class BusConsumer(abc.ABC):
    """One member of a consumer group. Use it from one thread."""

    @abc.abstractmethod
    def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        """Up to ``max_records`` records, waiting up to ``timeout_s`` when none are ready.

        Records of one partition come in offset order. Joining the group happens inside ``poll``, so
        the first calls may return nothing for a while (see the adapter's settings)."""

    @abc.abstractmethod
    def commit(self, offsets: Mapping[tuple[str, int], int] | None = None) -> None:
        """Mark records processed for this group: everything returned by ``poll`` so far, or, with
        ``offsets``, the records below ``offsets[(topic, partition)]`` (the next offset to read) in the
        partitions this member still owns (the others are left to their new owner)."""

    @abc.abstractmethod
    def assignment(self) -> frozenset[tuple[str, int]]:
        """The (topic, partition) pairs this member owns now; empty until it has joined."""

    @property
    @abc.abstractmethod
    def malformed_count(self) -> int:
        """How many undecodable records this consumer has met."""

    def lag(self) -> int | None:
        """The most records past this member's position on any of its partitions (not yet polled), as far
        as it knows without asking the broker; None when unknown. Call it from the polling thread."""
        return None

    @abc.abstractmethod
    def close(self) -> None:
        """Leave the group without committing; uncommitted records go to the next owner."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class MetricBus(abc.ABC):
    """Publishes messages to topics and opens group consumers on them."""

    @abc.abstractmethod
    def publish(self, topic: str, key: str, message: Message) -> None:
        """Queue ``message`` for ``topic`` under ``key``; may return before it is stored (see flush)."""

    def publish_many(self, topic: str, key: str, messages: Sequence[Message]) -> None:
        """Queue ``messages``, in order, for ``topic`` under one ``key``, packed into as few records as
        fit (bundles; consumers get one :class:`Record` per message). This default publishes one
        record per message; the adapters bundle."""
        for message in messages:
            self.publish(topic, key, message)

    @abc.abstractmethod
    def flush(self, timeout_s: float | None = None) -> None:
        """Block until everything published so far is stored; raise Unavailable if any of it failed."""

    @abc.abstractmethod
    def subscribe(self, topics: Sequence[str], group: str) -> BusConsumer:
        """A new member of consumer group ``group`` reading ``topics``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flush and release the producer side; consumers are closed on their own."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def next_offsets(records: Sequence[Record]) -> dict[tuple[str, int], int]:
    """Per (topic, partition), the offset after the last of ``records``: what to commit once they are
    processed."""
    out: dict[tuple[str, int], int] = {}
    for r in records:
        tp = (r.topic, r.partition)
        if r.offset >= out.get(tp, -1):
            out[tp] = r.offset + 1
    return out
