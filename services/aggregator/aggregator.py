"""The aggregator's consumer loop: bus records in, database effects applied in batches, master woken.

:class:`Aggregator` owns one member of the aggregators' consumer group. Each cycle it

1. polls up to ``max_records`` messages, or whatever arrived within ``max_latency_s`` of the first one;
2. skips what did not decode (the bus logs it with topic, partition and offset; here it is counted),
   keeps the latest ``gpu_telemetry`` per GPU in memory (:meth:`Aggregator.telemetry`), written to the
   database every ``telemetry_every_s`` (``TelemetryStore``: the dashboard's cluster page reads it);
3. applies the rest with :class:`~stagetree.master.store.ingest.Ingestor` in one database transaction;
4. commits that batch's offsets only after that transaction committed;
5. notifies ``CH_RESULTS`` / ``CH_ROUND`` when requests finished or the scheduler has something new,
   and ``CH_CURVES`` when learning-curve points were stored (the dashboard draws them live).

Steps 1-2 of the next batch overlap step 3 of the current one: a writer thread applies (mostly waiting
on the database, without the GIL) while the consumer's thread polls and decodes. The consumer's
thread alone touches the consumer (kafka-python is not thread-safe), so it commits each batch's own
offsets explicitly once the writer reports that batch durable. At most one batch is in flight.

Delivery is at least once: a crash between 3 and 4 redelivers the records to whichever member takes
the partitions over, and the ingest's ``applied_messages`` makes the second apply change nothing.

Failures: a database that is busy or unreachable (``Conflict`` / ``Unavailable``) is retried with
backoff and nothing is committed meanwhile, so nothing is lost. A message the database refuses on its
own (a value a column cannot hold; or one that keeps conflicting after every retry) is found by
splitting the batch in halves, logged with its topic/partition/offset, counted in
``AggregatorStats.poison`` and skipped, so one bad record never stalls its partition. Anything else is
a bug and stops the loop with the exception (offsets uncommitted: a restart redelivers).

Runs the same on :class:`~stagetree.bus.kafka.KafkaMetricBus` (``stagetree aggregator run``) and
:class:`~stagetree.bus.inprocess.InProcessBus` (embedded mode, in a thread of the master's process:
:meth:`Aggregator.start` / :meth:`Aggregator.stop`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from sqlalchemy.exc import DataError, DBAPIError, StatementError

from stagetree.aggregator import metrics
from stagetree.bus.base import BusConsumer, Malformed, MetricBus, Record, next_offsets
from stagetree.bus.messages import ALL_TOPICS, GpuTelemetry, Message
from stagetree.core.errors import Conflict, FailedPrecondition, InvalidArgument, StagetreeError, Unavailable
from stagetree.master.service import CH_CURVES, CH_RESULTS, CH_ROUND, Wakeups
from stagetree.master.store.ingest import Ingestor, IngestResult
from stagetree.master.store.telemetry import TelemetryStore

log = logging.getLogger(__name__)

DEFAULT_GROUP = "stagetree-aggregators"
PRUNE_EVERY_S = 3600.0  # how often old applied ids are forgotten (when a retention is set)

_Pair = tuple[Record, Message]
_BUSY_POLL_S = 0.01  # how long a poll waits while a batch is being written (then its result is checked)
_MAX_POLL_RECORDS = 500  # bus records asked for in one poll


@dataclass
class _InFlight:
    """A batch handed to the writer thread, and the offsets to commit once it is applied."""

    future: Future[IngestResult | None]
    offsets: dict[tuple[str, int], int]


def _completed(result: IngestResult) -> Future[IngestResult | None]:
    future: Future[IngestResult | None] = Future()
    future.set_result(result)
    return future


@dataclass
class AggregatorStats:
    """Running totals of one aggregator (read them from any thread; one thread writes)."""

    records: int = 0  # records polled, malformed ones included
    malformed: int = 0  # records that did not decode (bad bytes, unknown type or version): skipped
    applied: int = 0  # messages whose effects were written
    duplicates: int = 0  # messages applied before (redelivered): skipped
    ignored: int = 0  # messages with no database effect (telemetry)
    started: int = 0  # batch_started messages (their attempts' start times)
    progress: int = 0  # progress messages (their attempts' furthest step)
    timings: int = 0  # batch_timing messages (where their workers' time went)
    rejected: int = 0  # messages that can never apply (unknown batch/node): logged, skipped
    poison: int = 0  # messages the database refused: logged, skipped
    points: int = 0  # metric points written
    completed: int = 0  # requests completed
    batches: int = 0  # database transactions committed
    commits: int = 0  # offset commits that succeeded
    commit_conflicts: int = 0  # offset commits refused after a rebalance (the new owner redelivers)
    retries: int = 0  # applies retried after a busy or unreachable database
    lag: int | None = None  # the consumer's lag when last polled (``BusConsumer.lag``); None: unknown


class Aggregator:
    """One consumer-group member applying bus messages to the database.

    ``bus`` opens the consumer (in the thread that runs :meth:`run`); ``ingestor`` writes; ``wakeups``
    is the master's ``Coordination`` (Redis in cluster mode, in-process in embedded mode)."""

    def __init__(
        self,
        bus: MetricBus,
        ingestor: Ingestor,
        wakeups: Wakeups,
        *,
        topics: Sequence[str] = ALL_TOPICS,
        group: str = DEFAULT_GROUP,
        max_records: int = 2000,
        max_latency_s: float = 0.05,
        poll_timeout_s: float = 0.5,
        max_conflict_retries: int = 8,
        applied_retention_s: float = 0.0,
        name: str = "aggregator",
        telemetry: TelemetryStore | None = None,
        telemetry_every_s: float = 2.0,
    ) -> None:
        if max_records < 1 or max_latency_s < 0 or poll_timeout_s <= 0 or max_conflict_retries < 1:
            raise InvalidArgument(
                "need max_records >= 1, max_latency_s >= 0, poll_timeout_s > 0 and max_conflict_retries >= 1, got "
                f"{max_records}, {max_latency_s}, {poll_timeout_s}, {max_conflict_retries}"
            )
        if not topics or not group:
            raise InvalidArgument("an aggregator needs at least one topic and a group name")
        self.bus = bus
        self.ingestor = ingestor
        self.wakeups = wakeups
        self.topics = tuple(topics)
        self.group = group
        self.max_records = max_records
        self.max_latency_s = max_latency_s
        self.poll_timeout_s = poll_timeout_s
        self.max_conflict_retries = max_conflict_retries
        self.applied_retention_s = applied_retention_s  # 0: keep applied ids forever
        self._next_prune = time.monotonic() + PRUNE_EVERY_S
        self.name = name
        self.stats = AggregatorStats()
        metrics.track(self)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._consumer: BusConsumer | None = None
        self._telemetry: dict[tuple[str, int], GpuTelemetry] = {}
        self._telemetry_dirty: set[tuple[str, int]] = set()
        self._telemetry_store = telemetry
        self._telemetry_every_s = telemetry_every_s
        self._next_telemetry = 0.0
        self._lock = threading.Lock()
        self._per_record = 50.0  # messages per bus record seen lately (records are mostly bundles)
        self._owned: frozenset[tuple[str, int]] = frozenset()
        self.on_applied: Callable[[IngestResult], None] | None = None  # a hook for tests and benches
        # called (in the consumer's thread) when this member's partitions change, e.g. once it joined
        self.on_assignment: Callable[[frozenset[tuple[str, int]]], None] | None = None

    # -- lifecycle ------------------------------------------------------------------------------------

    def start(self) -> threading.Thread:
        """Run :meth:`run` in a daemon thread (embedded mode); stop it with :meth:`stop`."""
        if self._thread is not None:
            raise FailedPrecondition(f"aggregator {self.name} was started already; create another one")
        self._thread = threading.Thread(target=self.run, name=self.name, daemon=True)
        self._thread.start()
        return self._thread

    def stop(self, timeout_s: float | None = 30.0) -> None:
        """Ask the loop to stop after the current batch (applied, offsets committed, group left) and,
        when it runs in :meth:`start`'s thread, wait up to ``timeout_s`` for it. Safe from any thread
        or a signal handler."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def assignment(self) -> frozenset[tuple[str, int]]:
        """The partitions this member owns now (empty before it joined)."""
        consumer = self._consumer
        return consumer.assignment() if consumer is not None else frozenset()

    def telemetry(self) -> dict[tuple[str, int], GpuTelemetry]:
        """The latest sample per (node manager, GPU index) this member has seen."""
        with self._lock:
            return dict(self._telemetry)

    def run(self) -> None:
        """Consume until :meth:`stop`; the batch in hand is applied and committed before leaving.

        Two stages overlap: while a writer thread applies batch k (mostly waiting on the database),
        this thread polls and decodes batch k+1; once k is durable, this thread commits k's offsets
        (explicitly, since k+1 is polled already) and hands k+1 over. One batch is in flight at most."""
        consumer = self.bus.subscribe(self.topics, self.group)
        self._consumer = consumer
        log.info("aggregator started", extra={"aggregator": self.name, "group": self.group, "topics": self.topics})
        writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.name}-writer")
        pending: _InFlight | None = None
        try:
            while not self._stop.is_set():
                records = self._gather(consumer, self.poll_timeout_s if pending is None else _BUSY_POLL_S)
                self._watch_assignment(consumer)
                self.stats.lag = consumer.lag()
                if pending is not None and (records or pending.future.done()):
                    self._finish(consumer, pending)
                    pending = None
                if records:
                    pending = self._submit(writer, records)
                if time.monotonic() >= self._next_telemetry:
                    self.flush_telemetry()
            if pending is not None:
                self._finish(consumer, pending)
                pending = None
        finally:
            if pending is not None:  # leaving on an error: wait for the write, commit nothing
                pending.future.cancel()
            writer.shutdown(wait=True)
            self.flush_telemetry()
            consumer.close()
            log.info("aggregator stopped", extra={"aggregator": self.name, **vars(self.stats)})

    def run_once(self, consumer: BusConsumer) -> int:
        """One unpipelined cycle: poll a batch, apply it, commit its offsets, wake the master; returns the
        records handled (for tests and tools that drive a consumer themselves)."""
        records = self._gather(consumer, self.poll_timeout_s)
        if not records:
            return 0
        pairs = self._triage(records)
        result = self._apply_retrying(pairs) if pairs else IngestResult()
        if result is None:
            return 0
        self._done(consumer, next_offsets(records), result)
        return len(records)

    # -- the stages -----------------------------------------------------------------------------------

    def _gather(self, consumer: BusConsumer, idle_timeout_s: float) -> list[Record]:
        """Up to ``max_records`` messages, or what came within ``max_latency_s`` of the first; [] when
        nothing came within ``idle_timeout_s`` (or the bus is unreachable: logged, retried later)."""
        out: list[Record] = []
        deadline = 0.0
        try:
            while len(out) < self.max_records:
                timeout = deadline - time.monotonic() if out else idle_timeout_s
                if out and timeout <= 0:
                    break
                # poll() counts bus records and a record may be a bundle of many messages: ask for as many
                # records as the messages still wanted would fill at the bundle size seen so far.
                want = min(_MAX_POLL_RECORDS, max(1, int((self.max_records - len(out)) / self._per_record)))
                got = consumer.poll(max_records=want, timeout_s=max(timeout, 0.0))
                if not got:
                    break
                if not out:
                    deadline = time.monotonic() + self.max_latency_s
                records = sum(1 for r in got if r.index == 0)  # each bus record starts at index 0
                self._per_record = 0.8 * self._per_record + 0.2 * (len(got) / max(records, 1))
                out.extend(got)
        except Unavailable as e:
            log.warning("bus poll failed; retrying", extra={"aggregator": self.name, "error": e.message})
            self._stop.wait(1.0)
        return out

    def _watch_assignment(self, consumer: BusConsumer) -> None:
        owned = consumer.assignment()
        if owned != self._owned:
            self._owned = owned
            log.info("aggregator partitions changed", extra={"aggregator": self.name, "partitions": len(owned)})
            if self.on_assignment is not None:
                self.on_assignment(owned)

    def _triage(self, records: list[Record]) -> list[_Pair]:
        """Count and drop what does not go to the database; the rest, in order."""
        self.stats.records += len(records)
        pairs: list[_Pair] = []
        for r in records:
            msg = r.message
            if isinstance(msg, Malformed):
                self.stats.malformed += 1  # logged with topic/partition/offset where it was decoded
            elif type(msg) is GpuTelemetry:
                self._keep_telemetry(msg)
                self.stats.ignored += 1
            else:
                pairs.append((r, msg))  # type: ignore[arg-type]  # not Malformed
        return pairs

    def _submit(self, writer: ThreadPoolExecutor, records: list[Record]) -> _InFlight:
        pairs = self._triage(records)
        future: Future[IngestResult | None] = (
            writer.submit(self._apply_retrying, pairs) if pairs else _completed(IngestResult())
        )
        return _InFlight(future, next_offsets(records))

    def _finish(self, consumer: BusConsumer, pending: _InFlight) -> None:
        result = pending.future.result()  # a bug in the apply stops the loop here, nothing committed
        if result is None:  # stopping while the database is down: leave them uncommitted, they come back
            return
        self._done(consumer, pending.offsets, result)

    def _done(self, consumer: BusConsumer, offsets: dict[tuple[str, int], int], result: IngestResult) -> None:
        """After the database commit: commit the offsets, then wake the master."""
        self._commit(consumer, offsets)
        self._notify(result)
        self._maybe_prune()

    def _apply_retrying(self, pairs: list[_Pair]) -> IngestResult | None:
        delay = 0.05
        conflicts = 0
        while True:
            try:
                result = self._apply_split(pairs, conflicts_are_poison=conflicts >= self.max_conflict_retries)
                break
            except (Conflict, Unavailable) as e:
                self.stats.retries += 1
                if isinstance(e, Conflict):
                    conflicts += 1
                elif self._stop.is_set():
                    log.warning(
                        "stopping with a batch not applied (database unavailable); it will be redelivered",
                        extra={"aggregator": self.name, "messages": len(pairs)},
                    )
                    return None
                log.warning(
                    "apply failed; retrying in %.2f s",
                    delay,
                    extra={"aggregator": self.name, "error": e.message, "messages": len(pairs)},
                )
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        self.stats.batches += 1
        s = self.stats
        s.applied += result.applied
        s.duplicates += result.duplicates
        s.ignored += result.ignored
        s.started += result.started
        s.progress += result.progress
        s.timings += result.timings
        s.rejected += result.rejected
        s.points += result.points
        s.completed += len(result.completed)
        if self.on_applied is not None:
            self.on_applied(result)
        return result

    def _apply_split(self, pairs: list[_Pair], *, conflicts_are_poison: bool) -> IngestResult:
        """Apply; when the database refuses the batch for one message's sake, apply the halves apart
        (in order) until that message stands alone, and skip it."""
        tries = 3 if len(pairs) == 1 and conflicts_are_poison else 1  # a lone conflict may still be transient
        error: Exception | None = None
        for attempt in range(tries):
            try:
                return self.ingestor.apply([msg for _, msg in pairs])
            except Exception as e:
                if not _is_poison(e, conflicts_are_poison):
                    raise
                if attempt + 1 < tries:
                    time.sleep(0.05 * (attempt + 1))
                    continue
                error = e
        if len(pairs) == 1:
            record, msg = pairs[0]
            self.stats.poison += 1
            log.error(
                "skipping a bus message the database refuses: %r",
                error,
                extra={
                    "aggregator": self.name,
                    "topic": record.topic,
                    "partition": record.partition,
                    "offset": record.offset,
                    "msg_id": msg.msg_id,
                    "type": msg.TYPE,
                },
            )
            return IngestResult()
        mid = len(pairs) // 2
        result = self._apply_split(pairs[:mid], conflicts_are_poison=conflicts_are_poison)
        result.merge(self._apply_split(pairs[mid:], conflicts_are_poison=conflicts_are_poison))
        return result

    def _commit(self, consumer: BusConsumer, offsets: dict[tuple[str, int], int]) -> None:
        try:
            consumer.commit(offsets)
            self.stats.commits += 1
        except Conflict as e:
            # The group rebalanced meanwhile: the new owner redelivers these records and finds them applied.
            self.stats.commit_conflicts += 1
            log.info("offset commit refused after a rebalance", extra={"aggregator": self.name, "error": e.message})
        except Unavailable as e:
            log.warning("offset commit failed; the next commit covers it", extra={"error": e.message})

    def _notify(self, result: IngestResult) -> None:
        wanted = (
            (CH_RESULTS, result.results_changed),
            (CH_ROUND, result.round_needed),
            (CH_CURVES, result.curve_points > 0),
        )
        for channel in [c for c, needed in wanted if needed]:
            try:
                self.wakeups.notify(channel)
            except Exception as e:  # a wake-up is a hint: the master also runs rounds on a timer
                log.warning("wake-up failed", extra={"channel": channel, "error": repr(e)})

    def _maybe_prune(self) -> None:
        if self.applied_retention_s <= 0 or time.monotonic() < self._next_prune:
            return
        self._next_prune = time.monotonic() + PRUNE_EVERY_S
        try:
            n = self.ingestor.prune_applied(self.applied_retention_s)
        except StagetreeError as e:
            log.warning("pruning applied message ids failed", extra={"error": e.message})
            return
        log.info("pruned applied message ids", extra={"aggregator": self.name, "rows": n})

    def _keep_telemetry(self, msg: GpuTelemetry) -> None:
        key = (msg.node_manager, msg.gpu_index)
        with self._lock:
            old = self._telemetry.get(key)
            if old is None or old.ts <= msg.ts:
                self._telemetry[key] = msg
                self._telemetry_dirty.add(key)

    def flush_telemetry(self) -> int:
        """Write the GPU samples that changed since the last flush to the database (when this aggregator
        has a ``telemetry`` store); returns how many. Telemetry is best effort: a failed write is logged
        and tried again at the next flush."""
        self._next_telemetry = time.monotonic() + self._telemetry_every_s
        if self._telemetry_store is None:
            return 0
        with self._lock:
            dirty, self._telemetry_dirty = self._telemetry_dirty, set()
            samples = [self._telemetry[k].to_json() for k in sorted(dirty)]
        if not samples:
            return 0
        try:
            return self._telemetry_store.keep(samples)
        except StagetreeError as e:
            log.warning(
                "gpu telemetry not written; retrying later", extra={"aggregator": self.name, "error": e.message}
            )
            with self._lock:
                self._telemetry_dirty |= dirty
            return 0


def _is_poison(e: Exception, conflicts_are_poison: bool) -> bool:
    """An error one message can cause on its own (splitting the batch isolates it)."""
    if isinstance(e, DataError):
        return True
    if isinstance(e, StatementError) and not isinstance(e, DBAPIError):
        return True  # a value the driver could not send
    if isinstance(e, StagetreeError) and not e.retriable:
        return False
    return conflicts_are_poison and isinstance(e, Conflict)
