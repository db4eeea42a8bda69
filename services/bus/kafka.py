"""``KafkaMetricBus``: the :class:`~stagetree.bus.base.MetricBus` of the cluster mode, on kafka-python.

It owns the Kafka client settings (:class:`KafkaBusConfig`), the producer (batched with ``linger_ms``,
``acks=all`` and idempotence, so retries neither lose nor reorder a key's records; ``publish_many``
sends a key's messages as bundle records of at most ``max_record_bytes``), the group consumers (manual
commit only: everything polled, or explicit offsets of the partitions still owned) and
:func:`ensure_topics`. Install the ``crc32c`` package beside kafka-python: without it the client
checks and computes record CRCs in pure Python, which costs more CPU than the rest of consuming.

kafka-python errors stop here: an unreachable broker becomes :class:`~stagetree.core.errors.Unavailable`,
a commit refused after a rebalance becomes :class:`~stagetree.core.errors.Conflict`.

Only standard Kafka protocol features are used, so the same code runs against Apache Kafka (compose)
and the Tansu broker the integration tests start.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.errors import (
    CommitFailedError,
    InvalidProducerEpochError,
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    ProducerFencedError,
    TopicAlreadyExistsError,
)
from kafka.structs import OffsetAndMetadata, TopicPartition

from stagetree.bus.base import BusConsumer, Malformed, MetricBus, Record, decode_records
from stagetree.bus.messages import ALL_TOPICS, MAX_RECORD_BYTES, Message, encode, encode_many
from stagetree.core.errors import (
    Conflict,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)

logger = logging.getLogger(__name__)

# failures after which a producer never sends again (besides its transaction manager's fatal state)
NEW_PRODUCER_ERRORS = (InvalidProducerEpochError, ProducerFencedError)


@dataclass(frozen=True)
class KafkaBusConfig:
    """Client settings; the services' settings classes build one of these.

    Group timing: ``session_timeout_ms`` is how long a silent member keeps its partitions (Apache
    Kafka refuses values below its ``group.min.session.timeout.ms``, 6 s by default);
    ``max_poll_interval_ms`` is also the rebalance timeout, i.e. how long a join waits for the other
    members to rejoin, so it bounds the time between two ``poll`` calls of one consumer. See
    :meth:`fast_rebalance` for the values the tests use.
    """

    bootstrap_servers: str
    client_id: str = "stagetree"
    bootstrap_timeout_ms: int = 30_000  # how long a new client waits for the first broker answer
    # producer
    linger_ms: int = 20
    batch_size: int = 64 * 1024
    max_block_ms: int = 10_000
    # how long a flush without a timeout of its own waits for the broker's acknowledgements; past it the
    # producer is replaced (``KafkaMetricBus.flush``)
    flush_timeout_ms: int = 60_000
    max_record_bytes: int = MAX_RECORD_BYTES  # bundles are split to stay below this (and the broker's limit)
    compression_type: Literal["gzip", "snappy", "lz4", "zstd"] | None = None
    # consumer
    session_timeout_ms: int = 10_000
    heartbeat_interval_ms: int = 3_000
    max_poll_interval_ms: int = 60_000
    request_timeout_ms: int = 30_000
    fetch_max_wait_ms: int = 200
    auto_offset_reset: Literal["earliest", "latest"] = "earliest"

    def __post_init__(self) -> None:
        if not self.bootstrap_servers:
            raise InvalidArgument("bootstrap_servers is empty; give host:port[,host:port...]")
        if self.heartbeat_interval_ms >= self.session_timeout_ms:
            raise InvalidArgument(
                f"heartbeat_interval_ms ({self.heartbeat_interval_ms}) must be below session_timeout_ms "
                f"({self.session_timeout_ms}); a third of it is usual"
            )

    @classmethod
    def fast_rebalance(cls, bootstrap_servers: str, **overrides: Any) -> KafkaBusConfig:
        """Settings for tests and single-host setups: a consumer joins its group in about a second.

        Tansu answers a JoinGroup after about max(1 s, session_timeout / 2); Apache Kafka needs its
        ``group.min.session.timeout.ms`` lowered to accept 2 s."""
        settings: dict[str, Any] = {
            "session_timeout_ms": 2_000,
            "heartbeat_interval_ms": 300,
            "max_poll_interval_ms": 5_000,
            "request_timeout_ms": 10_000,
            "fetch_max_wait_ms": 100,
            "linger_ms": 5,
        }
        settings.update(overrides)
        return cls(bootstrap_servers, **settings)


def ensure_topics(
    config: KafkaBusConfig,
    topics: Sequence[str] | Mapping[str, int] = ALL_TOPICS,
    partitions: int = 8,
    replication_factor: int = 1,
) -> None:
    """Create the topics that do not exist yet (a mapping gives partitions per topic)."""
    wanted = dict(topics) if isinstance(topics, Mapping) else dict.fromkeys(topics, partitions)
    try:
        admin = KafkaAdminClient(
            bootstrap_servers=config.bootstrap_servers,
            client_id=f"{config.client_id}-admin",
            request_timeout_ms=config.request_timeout_ms,
            bootstrap_timeout_ms=config.bootstrap_timeout_ms,
        )
    except KafkaError as e:
        raise Unavailable(f"cannot reach Kafka at {config.bootstrap_servers}: {e!r}; is the broker up?") from e
    try:
        existing = set(admin.list_topics())
        missing = [t for t in wanted if t not in existing]
        if missing:
            new = {t: {"num_partitions": wanted[t], "replication_factor": replication_factor} for t in missing}
            # Another process may create one between the listing and here; that is fine.
            with contextlib.suppress(TopicAlreadyExistsError):
                admin.create_topics(new, wait_for_metadata=True)
            logger.info("created topics", extra={"topics": missing})
    except KafkaError as e:
        raise Unavailable(f"cannot create topics {sorted(wanted)}: {e!r}") from e
    finally:
        admin.close()


class KafkaMetricBus(MetricBus):
    """Kafka producer (created on first publish) and group consumers built from one config."""

    def __init__(self, config: KafkaBusConfig) -> None:
        self.config = config
        self._producer: KafkaProducer | None = None
        self._lock = threading.Lock()
        self._failures: list[BaseException] = []
        self._closed = False

    def _get_producer(self) -> KafkaProducer:
        with self._lock:
            if self._closed:
                raise FailedPrecondition("the Kafka bus is closed; create a new one")
            if self._producer is None:
                c = self.config
                try:
                    self._producer = KafkaProducer(
                        bootstrap_servers=c.bootstrap_servers,
                        client_id=c.client_id,
                        acks="all",
                        enable_idempotence=True,
                        linger_ms=c.linger_ms,
                        batch_size=c.batch_size,
                        max_block_ms=c.max_block_ms,
                        request_timeout_ms=c.request_timeout_ms,
                        compression_type=c.compression_type,
                        bootstrap_timeout_ms=c.bootstrap_timeout_ms,
                    )
                except KafkaError as e:
                    raise Unavailable(f"cannot reach Kafka at {c.bootstrap_servers}: {e!r}") from e
            return self._producer

    def publish(self, topic: str, key: str, message: Message) -> None:
        self._send(topic, key, encode(message), message, 1)

    def publish_many(self, topic: str, key: str, messages: Sequence[Message]) -> None:
        values = encode_many(messages, self.config.max_record_bytes)
        if len(values) == 1:
            self._send(topic, key, values[0], messages[0], len(messages))
            return
        for value in values:  # bundles split by size; the first message only names them in errors
            self._send(topic, key, value, messages[0], 0)

    def _send(self, topic: str, key: str, value: bytes, first: Message, count: int) -> None:
        producer = self._get_producer()
        try:
            future = producer.send(topic, key=key.encode(), value=value)
        except MessageSizeTooLargeError as e:
            raise ResourceExhausted(
                f"{first.TYPE} {first.msg_id} is {len(value)} bytes, over the producer's limit; "
                "report fewer metrics per message"
            ) from e
        except KafkaError as e:
            self._drop_if_broken(producer, [e])
            raise Unavailable(f"cannot publish to {topic}: {e!r}") from e
        msg_id = first.msg_id if count == 1 else f"bundle@{first.msg_id}"
        future.add_errback(self._on_send_error, producer, topic, key, msg_id)

    def _on_send_error(self, producer: KafkaProducer, topic: str, key: str, msg_id: str, exc: BaseException) -> None:
        with self._lock:
            if producer is not self._producer:
                return  # a replaced producer's: the flush or publish that replaced it said to publish again
            self._failures.append(exc)
        logger.error("bus publish failed: %r", exc, extra={"topic": topic, "key": key, "msg_id": msg_id})

    def flush(self, timeout_s: float | None = None) -> None:
        """See ``MetricBus.flush``; without ``timeout_s``, ``flush_timeout_ms``. A producer whose records
        are still unacknowledged then is replaced: after a broker restart one can wait on them for good
        (no error, no expiry: seen on a node manager whose batch ended during a Tansu restart), and every
        later flush with it. The caller publishes them again on the new one (the batcher does); consumers
        drop what arrives twice by ``msg_id``."""
        producer = self._producer
        if producer is not None:
            wait = self.config.flush_timeout_ms / 1000 if timeout_s is None else timeout_s
            try:
                producer.flush(timeout=wait)
            except KafkaTimeoutError as e:
                self._drop(producer, e)
                raise Unavailable(f"flush did not finish in {wait} s: {e!r}; publish again") from e
            except KafkaError as e:
                raise Unavailable(f"flush did not finish in {wait} s: {e!r}") from e
        with self._lock:
            failures, self._failures = self._failures, []
        if producer is not None and failures:
            self._drop_if_broken(producer, failures)
        if failures:
            raise Unavailable(
                f"{len(failures)} published message(s) were not stored, first: {failures[0]!r}; "
                "publish them again (consumers deduplicate on msg_id)"
            )

    def _drop_if_broken(self, producer: KafkaProducer, failures: Sequence[BaseException]) -> None:
        """Forget ``producer`` when it cannot send again, so that the next publish makes a new one.

        An idempotent producer whose broker restarted without its producer state gets an out-of-order
        sequence; kafka-python then bumps the producer's epoch, and a broker that refuses the bump (Tansu
        answers it with an unknown error) leaves the producer in a fatal state: every later send fails.
        A new producer has a new producer id and starts its sequences again; what it sends twice, the
        consumers drop by ``msg_id``."""
        manager = getattr(producer, "_transaction_manager", None)
        fatal = manager is not None and manager.has_fatal_error()
        if not fatal and not any(isinstance(f, NEW_PRODUCER_ERRORS) for f in failures):
            return
        self._drop(producer, failures[0])

    def _drop(self, producer: KafkaProducer, why: BaseException) -> None:
        """Forget ``producer`` (unless another thread did already) so that the next publish makes a new one,
        and the failures of its records: the caller was told to publish again what it had not stored."""
        with self._lock:
            current = self._producer is producer  # else another thread replaced it already
            if current:
                self._producer = None
                self._failures = []  # its records': the caller is told to publish again
        if not current:
            return
        logger.warning("the Kafka producer cannot send again; the next publish uses a new one: %r", why)
        try:
            producer.close(timeout=0)
        except KafkaError:  # kafka-python's close flushes first: with records pending, that times out at once
            sender = getattr(producer, "_sender", None)  # and its sender thread is left running: stop it
            if sender is not None:
                sender.force_close()

    def subscribe(self, topics: Sequence[str], group: str) -> KafkaBusConsumer:
        if not topics:
            raise InvalidArgument("subscribe needs at least one topic")
        if not group:
            raise InvalidArgument("a consumer group name must not be empty")
        return KafkaBusConsumer(self.config, list(dict.fromkeys(topics)), group)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.flush()
        finally:
            if self._producer is not None:
                self._producer.close()


class KafkaBusConsumer(BusConsumer):
    """A kafka-python group consumer with auto-commit off.

    Poll it in a loop from one thread. kafka-python 3.0 drops a JoinGroup/SyncGroup result that
    arrives while the consumer is not inside ``poll`` and starts another join round, so a consumer
    left unpolled while its group rebalances (or several consumers polled in turn by one thread)
    can take several rounds to join."""

    def __init__(self, config: KafkaBusConfig, topics: list[str], group: str) -> None:
        self.group = group
        try:
            self._consumer = KafkaConsumer(
                bootstrap_servers=config.bootstrap_servers,
                client_id=config.client_id,
                group_id=group,
                enable_auto_commit=False,
                auto_offset_reset=config.auto_offset_reset,
                session_timeout_ms=config.session_timeout_ms,
                heartbeat_interval_ms=config.heartbeat_interval_ms,
                max_poll_interval_ms=config.max_poll_interval_ms,
                request_timeout_ms=config.request_timeout_ms,
                fetch_max_wait_ms=config.fetch_max_wait_ms,
                bootstrap_timeout_ms=config.bootstrap_timeout_ms,
            )
        except KafkaError as e:
            raise Unavailable(f"cannot reach Kafka at {config.bootstrap_servers}: {e!r}") from e
        self._consumer.subscribe(topics)
        self._malformed = 0
        self._closed = False

    def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        if max_records < 1:
            raise InvalidArgument(f"max_records must be >= 1, got {max_records}")
        if self._closed:
            raise FailedPrecondition("poll on a closed consumer; subscribe again")
        try:
            batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        except KafkaError as e:
            raise Unavailable(f"poll failed for group {self.group}: {e!r}") from e
        records = [
            rec
            for tp, rs in batches.items()
            for r in rs
            for rec in decode_records(tp.topic, tp.partition, r.offset, r.key, r.value)
        ]
        self._malformed += sum(isinstance(r.message, Malformed) for r in records)
        return records

    def commit(self, offsets: Mapping[tuple[str, int], int] | None = None) -> None:
        if self._closed:
            raise FailedPrecondition("commit on a closed consumer")
        explicit = None
        if offsets is not None:
            owned = self._consumer.assignment()
            explicit = {
                tp: OffsetAndMetadata(offset, "", -1)
                for (topic, partition), offset in offsets.items()
                if (tp := TopicPartition(topic, partition)) in owned
            }
            if not explicit:
                return
        try:
            self._consumer.commit(explicit)
        except CommitFailedError as e:
            raise Conflict(
                f"group {self.group} rebalanced before the commit; the records polled since the last "
                "commit go to their new owner again (apply is idempotent), keep polling"
            ) from e
        except KafkaError as e:
            raise Unavailable(f"commit failed for group {self.group}: {e!r}") from e

    def assignment(self) -> frozenset[tuple[str, int]]:
        return frozenset((tp.topic, tp.partition) for tp in self._consumer.assignment())

    @property
    def malformed_count(self) -> int:
        return self._malformed

    def lag(self) -> int | None:
        # kafka-python's own fetch metric (from the high-water marks of recent fetches): no broker request
        fetch = self._consumer.metrics().get("consumer-fetch-manager-metrics", {})
        value = fetch.get("records-lag-max")
        if not isinstance(value, int | float) or value != value or value in (float("inf"), float("-inf")):
            return None
        return max(0, int(value))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._consumer.close(autocommit=False)
