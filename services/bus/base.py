"""The ``MetricBus`` role: how node managers publish metrics and events and aggregators consume them.

This module owns the interface only; adapters are :class:`~stagetree.bus.kafka.KafkaMetricBus` (cluster
mode) and :class:`~stagetree.bus.inprocess.InProcessBus` (embedded mode), and one contract suite
(``tests/integration/bus/test_bus_contract.py``) holds both to the same behaviour:

- messages with the same key are delivered in the order they were published;
- consumers that subscribe with the same group share the partitions (each record goes to one of them);
- delivery is at least once: :meth:`BusConsumer.commit` stores what was polled, and anything polled but
  not committed is delivered again to the next consumer of the group that takes over its partition
  (a member keeps its position in the partitions a rebalance leaves it). Commit only after the effects
  of the records are durable (the database commit), and apply idempotently (``msg_id``);
- a record that does not decode is logged, counted in :attr:`BusConsumer.malformed_count` and handed
  over as a :class:`Malformed` marker, so the caller skips it and a commit moves past it.

Errors: a broker that cannot be reached is :class:`~stagetree.core.errors.Unavailable`; a commit that
lost its partitions to a rebalance is :class:`~stagetree.core.errors.Conflict` (keep polling: the new
owner gets the uncommitted records).
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Self

from stagetree.bus.messages import MalformedMessage, Message, decode

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Malformed:
    """Stands in for a record that did not decode: why, and the raw value for a dead-letter store."""

    error: MalformedMessage
    raw: bytes | None

    @property
    def reason(self) -> str:
        return self.error.reason


@dataclass(frozen=True)
class Record:
    """One consumed record: where it came from and its decoded message (or why it did not decode)."""

    topic: str
    partition: int
    offset: int
    key: str | None
    message: Message | Malformed


def decode_record(topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None) -> Record:
    """Build the :class:`Record` for raw record bytes, logging (never raising) when they do not decode.

    Shared by the adapters so both treat bad records the same way."""
    key_text = key.decode("utf-8", errors="replace") if key is not None else None
    message: Message | Malformed
    try:
        message = decode(value)
    except MalformedMessage as e:
        logger.warning(
            "skipping malformed bus record: %s",
            e.reason,
            extra={"topic": topic, "partition": partition, "offset": offset, "key": key_text},
        )
        message = Malformed(e, value)
    return Record(topic, partition, offset, key_text, message)


class BusConsumer(abc.ABC):
    """One member of a consumer group. Use it from one thread."""

    @abc.abstractmethod
    def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        """Up to ``max_records`` records, waiting up to ``timeout_s`` when none are ready.

        Records of one partition come in offset order. Joining the group happens inside ``poll``, so
        the first calls may return nothing for a while (see the adapter's settings)."""

    @abc.abstractmethod
    def commit(self) -> None:
        """Mark everything returned by ``poll`` so far as processed for this group."""

    @abc.abstractmethod
    def assignment(self) -> frozenset[tuple[str, int]]:
        """The (topic, partition) pairs this member owns now; empty until it has joined."""

    @property
    @abc.abstractmethod
    def malformed_count(self) -> int:
        """How many undecodable records this consumer has met."""

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
