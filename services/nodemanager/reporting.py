"""How what a worker did reaches the search plan: the ``BatchReporter`` port and its two adapters.

The node manager hands a reporter every event of a batch attempt in order (``event``), then exactly
once how the attempt ended (``finish``): finished, preempted, failed (by the worker's own report, a
crash, or an out-of-memory) or aborted.

* ``BusReporter`` (cluster and embedded modes): every event becomes a bus message (``stagetree.bus``),
  keyed by batch so one batch's messages stay ordered, and goes out through a ``LocalBatcher``; the
  aggregators apply them. A crash the worker could not report becomes a ``BatchFailed`` here. Topics
  come from each message's ``route()``, never from this module. GPU telemetry goes the same way.
* ``GrpcReporter`` (the direct path, no bus): collects the same messages (``message_of``, the same ids)
  and sends them in one ``ReportBatch`` through the ``MasterLink`` when the attempt ends, retrying while
  the master is away; the master applies them with the aggregators' ``Ingestor``.

An aborted attempt adds nothing more (the master already ended it); on the direct path its report still
goes, so the checkpoints and metrics it produced are recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from stagetree.bus.base import MetricBus
from stagetree.bus.batcher import LocalBatcher
from stagetree.bus.messages import (
    BatchFailed,
    BatchFinished,
    BatchMessage,
    BatchPreempted,
    BatchStarted,
    BatchTiming,
    CheckpointSaved,
    Curve,
    GpuProcess,
    GpuTelemetry,
    LogLine,
    Message,
    Metrics,
    Progress,
    Rescaled,
    make_msg_id,
)
from stagetree.core.errors import ResourceExhausted, StagetreeError
from stagetree.nodemanager.gpu import GpuSample
from stagetree.nodemanager.link import BatchReport, MasterLink

log = logging.getLogger(__name__)

EndStatus = Literal["finished", "preempted", "failed", "aborted"]
TERMINAL_EVENTS = frozenset({"batch_finished", "batch_preempted", "batch_failed"})


@dataclass(frozen=True)
class AttemptInfo:
    """Which batch attempt an event belongs to."""

    batch_id: int
    attempt: int
    plan_key: str | None = None
    slot_id: str = ""

    @property
    def key(self) -> tuple[int, int]:
        return (self.batch_id, self.attempt)


@dataclass(frozen=True)
class AttemptExit:
    """How an attempt ended. ``by_worker``: the worker emitted the terminal event itself (then the bus
    already carries it); otherwise the node manager saw it die or killed it."""

    status: EndStatus
    error: str = ""
    traceback: str = ""
    oom: bool = False
    by_worker: bool = True
    user_error: bool = False  # the trainer's own code raised (the worker says so)
    host_problem: bool = False  # this host cannot import the trainer (the worker says so): another may


class RecentKeys:
    """A set that remembers only its ``maxlen`` most recently added keys (a long-lived node manager
    must not keep every attempt it ever ran; a duplicate comes soon or never)."""

    def __init__(self, maxlen: int = 100_000) -> None:
        self._keys: dict[tuple[int, int], None] = {}
        self._maxlen = maxlen

    def add(self, key: tuple[int, int]) -> None:
        self._keys[key] = None
        if len(self._keys) > self._maxlen:
            del self._keys[next(iter(self._keys))]

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def latest(self, n: int) -> list[tuple[int, int]]:
        """The ``n`` most recently added keys, oldest first."""
        keys = list(self._keys)
        return keys[-n:] if n > 0 else []


class BatchReporter(ABC):
    """Receives one attempt's events in order, then its end, exactly once (later calls are ignored)."""

    def __init__(self) -> None:
        self._ended = RecentKeys()

    async def event(self, info: AttemptInfo, kind: str, payload: dict[str, Any]) -> None:
        """One worker event (``runtime.events.EVENT_FIELDS``)."""
        if info.key in self._ended:
            log.warning("event after the attempt ended ignored", extra={"batch_id": info.batch_id, "kind": kind})
            return
        await self._event(info, kind, payload)

    async def finish(self, info: AttemptInfo, end: AttemptExit) -> None:
        """The attempt is over; reports it unless it was reported before."""
        if info.key in self._ended:
            log.warning(
                "attempt already reported; not reporting it twice",
                extra={"batch_id": info.batch_id, "attempt": info.attempt},
            )
            return
        self._ended.add(info.key)
        await self._finish(info, end)

    async def telemetry(self, node_manager_id: str, samples: list[GpuSample]) -> None:  # noqa: B027
        """A GPU telemetry sample; adapters without a telemetry channel drop it."""

    async def close(self) -> None:  # noqa: B027  (an optional hook)
        """Deliver what is pending (as far as possible) and release resources."""

    @abstractmethod
    async def _event(self, info: AttemptInfo, kind: str, payload: dict[str, Any]) -> None: ...

    @abstractmethod
    async def _finish(self, info: AttemptInfo, end: AttemptExit) -> None: ...


# -- the bus ---------------------------------------------------------------------------------------


# worker event kind -> its message (``runtime.events.EVENT_FIELDS`` names the same kinds)
WORKER_MESSAGES: dict[str, type[BatchMessage]] = {
    "batch_started": BatchStarted,
    "progress": Progress,
    "metrics": Metrics,
    "curve": Curve,
    "checkpoint_saved": CheckpointSaved,
    "rescaled": Rescaled,
    "batch_timing": BatchTiming,
    "batch_finished": BatchFinished,
    "batch_preempted": BatchPreempted,
    "batch_failed": BatchFailed,
    "log_line": LogLine,
}


class MessageIds:
    """The ids of one node manager's messages: unique per (node manager, batch, attempt, sequence number)."""

    def __init__(self, node_manager_id: str) -> None:
        self.node_manager_id = node_manager_id
        self._seq: dict[tuple[int, int], int] = {}

    def next(self, info: AttemptInfo) -> str:
        seq = self._seq.get(info.key, 0)
        self._seq[info.key] = seq + 1
        return make_msg_id(self.node_manager_id, info.batch_id, info.attempt, seq)

    def forget(self, info: AttemptInfo) -> None:
        self._seq.pop(info.key, None)


def message_of(
    node_manager_id: str, msg_id: str, info: AttemptInfo, kind: str, payload: dict[str, Any]
) -> BatchMessage:
    """The bus message of one worker event (``kind`` one of ``WORKER_MESSAGES``), whichever transport
    carries it."""
    cls = WORKER_MESSAGES[kind]
    fields = {k: v for k, v in payload.items() if k not in ("batch_id", "attempt")}
    if cls is BatchStarted:  # the start as seen here: the scheduler estimates the batch's end from it
        fields = {"started_at": time.time()}
    if cls is Curve:  # the runtime's [[step, values], ...] as the message's two aligned lists
        points = fields.pop("points")
        fields["steps"] = [int(p[0]) for p in points]
        fields["values"] = [p[1] for p in points]
    return cls(
        msg_id=msg_id,
        node_manager=node_manager_id,
        batch_id=info.batch_id,
        attempt=info.attempt,
        plan_key=info.plan_key,
        **fields,
    )


def crash_of(node_manager_id: str, msg_id: str, info: AttemptInfo, end: AttemptExit) -> BatchFailed:
    """The ``batch_failed`` of a worker that could not report its own end (it crashed, ran out of memory)."""
    return BatchFailed(
        msg_id=msg_id,
        node_manager=node_manager_id,
        batch_id=info.batch_id,
        attempt=info.attempt,
        plan_key=info.plan_key,
        error=end.error,
        traceback=end.traceback,
        oom=end.oom,
    )


class BusReporter(BatchReporter):
    """Publishes events as bus messages through a ``LocalBatcher`` in front of ``bus``.

    The batcher is created here and closed by ``close``; the bus belongs to the caller unless
    ``own_bus`` (then ``close`` closes it too). When the batcher's buffer is full (the bus is down for
    long), ``event`` waits: the node manager stops reading that worker's events, and the worker blocks
    on its pipe until the bus recovers."""

    def __init__(
        self,
        bus: MetricBus,
        node_manager_id: str,
        *,
        max_messages: int = 200,
        max_age_s: float = 0.5,
        max_buffered: int = 100_000,
        own_bus: bool = False,
        retry_s: float = 0.5,
    ) -> None:
        super().__init__()
        self.bus = bus
        self.node_manager_id = node_manager_id
        self.batcher = LocalBatcher(bus, max_messages=max_messages, max_age_s=max_age_s, max_buffered=max_buffered)
        self._own_bus = own_bus
        self._retry_s = retry_s
        self._ids = MessageIds(node_manager_id)
        self._telemetry_seq = 0
        self._closed = False

    def _msg_id(self, info: AttemptInfo) -> str:
        return self._ids.next(info)

    async def _publish(self, message: Message, *, now: bool = False) -> None:
        """Buffer ``message`` for the next batch; with ``now``, the batcher's thread publishes it (and what
        is buffered before it) at once: a batch's end is what the scheduler waits for to start the work
        that depends on it, so it does not wait out the batcher's ``max_age_s``. The caller does not wait
        for the broker: when slots end together, their ends go out in one publish instead of queueing for
        a synchronous flush each behind the thread pool (tests.bench.scale, 30k requests at 1,600 slots:
        report-stage p99 1,610 -> 941 ms). A bus that is down keeps them queued, retried; a full buffer
        holds the worker's events here (back-pressure) until the bus takes them.

        The add runs on the event loop: it only queues (a full batch goes to the batcher's thread too).
        A hop to a thread per event queued a burst of ends behind the loop's few pool threads, and the
        slot freed, and its next batch started, only once its worker's last event was through."""
        while True:
            try:
                self.batcher.add(message, urgent=now, publish_here=False)
                return
            except ResourceExhausted as e:  # back-pressure: wait for the bus instead of dropping
                log.warning("bus buffer full; holding the worker's events", extra={"error": e.message})
                await asyncio.sleep(self._retry_s)

    async def _event(self, info: AttemptInfo, kind: str, payload: dict[str, Any]) -> None:
        if kind not in WORKER_MESSAGES:
            log.warning("unknown worker event not published", extra={"batch_id": info.batch_id, "kind": kind})
            return
        await self._publish(
            message_of(self.node_manager_id, self._msg_id(info), info, kind, payload), now=kind in TERMINAL_EVENTS
        )

    async def _finish(self, info: AttemptInfo, end: AttemptExit) -> None:
        if end.status == "failed" and not end.by_worker:
            await self._publish(crash_of(self.node_manager_id, self._msg_id(info), info, end), now=True)
        self._ids.forget(info)

    async def telemetry(self, node_manager_id: str, samples: list[GpuSample]) -> None:
        now = time.time()
        for s in samples:
            self._telemetry_seq += 1
            msg = GpuTelemetry(
                msg_id=f"{node_manager_id}:telemetry:{s.index}:{int(now * 1000)}:{self._telemetry_seq}",
                node_manager=node_manager_id,
                gpu_index=s.index,
                utilization=min(100.0, max(0.0, s.utilization)),
                memory_used=s.memory_used,
                memory_total=s.memory_total,
                processes=tuple(GpuProcess(pid=pid, memory=mem) for pid, mem in sorted(s.processes.items())),
                ts=now,
            )
            await self._publish(msg)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        def close_all() -> None:
            try:
                self.batcher.close()
            except StagetreeError as e:
                log.error("bus messages left unpublished at shutdown", extra={"error": e.message})
            if self._own_bus:
                self.bus.close()

        await asyncio.to_thread(close_all)


# -- the direct path ----------------------------------------------------------------------------


@dataclass
class _Collected:
    messages: list[BatchMessage] = field(default_factory=list)
    progress: Progress | None = None  # the furthest only: the master keeps no other


class GrpcReporter(BatchReporter):
    """Collects an attempt's events as the bus messages ``BusReporter`` would publish (the same ids, the
    start time included) and sends them with its end in one ``ReportBatch`` call through ``link``. A
    report the master cannot take now (a ``retriable`` error: ``Unavailable``, ``Conflict``) is retried
    with backoff until it is delivered or ``close`` gives up after ``close_timeout_s`` (the master applies
    a message once, so a report sent again changes nothing); any other error, a bug in the master
    included, is logged and the report dropped (the master would refuse it again)."""

    def __init__(
        self,
        link: MasterLink,
        *,
        node_manager_id: str = "direct",
        initial_backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        close_timeout_s: float = 10.0,
        on_reported: Callable[[BatchReport, list[int]], None] | None = None,
    ) -> None:
        super().__init__()
        self.link = link
        self.node_manager_id = node_manager_id
        self._ids = MessageIds(node_manager_id)
        self._collected: dict[tuple[int, int], _Collected] = {}
        self._initial = initial_backoff_s
        self._max = max_backoff_s
        self._close_timeout = close_timeout_s
        self._closing = asyncio.Event()
        self._inflight: set[asyncio.Task[None]] = set()
        self._on_reported = on_reported

    async def _event(self, info: AttemptInfo, kind: str, payload: dict[str, Any]) -> None:
        if kind not in WORKER_MESSAGES:
            log.warning("unknown worker event not reported", extra={"batch_id": info.batch_id, "kind": kind})
            return
        got = self._collected.setdefault(info.key, _Collected())
        msg = message_of(self.node_manager_id, self._ids.next(info), info, kind, payload)
        if isinstance(msg, Progress):
            if got.progress is None or msg.step > got.progress.step:
                got.progress = msg
        else:
            got.messages.append(msg)

    def report_of(self, info: AttemptInfo, end: AttemptExit) -> BatchReport:
        """The attempt's report: what its worker emitted, and its end where the worker could not say it
        (an aborted attempt adds nothing: the master ended it already, and keeps what it saved)."""
        got = self._collected.pop(info.key, _Collected())
        messages = got.messages if got.progress is None else [*got.messages, got.progress]
        if end.status == "failed" and not end.by_worker:
            messages.append(crash_of(self.node_manager_id, self._ids.next(info), info, end))
        self._ids.forget(info)
        return BatchReport(info.batch_id, info.attempt, tuple(messages))

    async def _finish(self, info: AttemptInfo, end: AttemptExit) -> None:
        report = self.report_of(info, end)
        task = asyncio.current_task()
        if task is not None:
            self._inflight.add(task)
        try:
            await self._deliver(report)
        finally:
            if task is not None:
                self._inflight.discard(task)

    async def _deliver(self, report: BatchReport) -> None:
        ids = {"batch_id": report.batch_id, "attempt": report.attempt}
        delay = self._initial
        while True:
            try:
                done = await self.link.report(report)
            except StagetreeError as e:
                if not e.retriable:
                    log.error("batch report refused; dropped: %s", e.message, extra=ids)
                    return
                if self._closing.is_set():
                    log.error("master unreachable at shutdown; batch report dropped", extra=ids)
                    return
                log.warning("batch report not delivered; retrying in %.1f s: %s", delay, e.message, extra=ids)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._closing.wait(), delay)
                delay = min(self._max, delay * 2)
                continue
            log.info("batch reported", extra={**ids, "ok": report.ok, "completed_requests": len(done)})
            if self._on_reported is not None:
                self._on_reported(report, done)
            return

    async def close(self) -> None:
        if self._inflight:
            _, pending = await asyncio.wait(set(self._inflight), timeout=self._close_timeout)
            if pending:
                self._closing.set()  # the remaining ones make one last try and give up
                await asyncio.wait(pending, timeout=self._close_timeout)
        self._closing.set()
