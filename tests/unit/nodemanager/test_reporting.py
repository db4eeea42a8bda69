"""The reporter contract, run against both adapters: what an attempt's events and end become on the bus
(``BusReporter`` over an ``InProcessBus``, decoded back) and in the direct report (``GrpcReporter`` over a
fake master link), normalized to the same facts; then what only one adapter does."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from stagetree.bus.base import BusConsumer
from stagetree.bus.inprocess import InProcessBus
from stagetree.bus.messages import (
    ALL_TOPICS,
    BatchFailed,
    BatchFinished,
    BatchMessage,
    BatchPreempted,
    BatchTiming,
    CheckpointSaved,
    Curve,
    GpuTelemetry,
    LogLine,
    Message,
    Metrics,
    Progress,
    Rescaled,
)
from stagetree.core.errors import InvalidArgument, Unavailable
from stagetree.nodemanager.gpu import GpuSample
from stagetree.nodemanager.reporting import (
    AttemptExit,
    AttemptInfo,
    BatchReporter,
    BusReporter,
    GrpcReporter,
    RecentKeys,
)
from tests.unit.nodemanager.fakes import FakeLink, FlakyBus

INFO = AttemptInfo(batch_id=7, attempt=2, plan_key="plan-a", slot_id="cpu0")
URI = "file:///ckpt/plan-a/n1/s5-central-b7a2"


@dataclass
class Facts:
    """What the master ends up knowing about one attempt, whichever path it took."""

    status: str | None = None  # finished | preempted | failed | None (nothing terminal)
    metrics: list[tuple[int, int, dict[str, float]]] = field(default_factory=list)
    checkpoints: list[tuple[int, int, str, str]] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)  # of each checkpoint
    rescaled: list[tuple[int, int, str, int, int]] = field(default_factory=list)
    curve: list[tuple[int, int, dict[str, float]]] = field(default_factory=list)
    error: str = ""
    oom: bool = False
    terminals: int = 0
    reached: int = 0  # the furthest step its progress said
    timing: tuple[float, float, float, float] | None = None  # its worker's measure of its time
    lines: list[tuple[int, int, int, float, str]] = field(default_factory=list)  # (seq, node, step, at, line)


@dataclass
class Adapter:
    reporter: BatchReporter
    facts: Callable[[], Facts]


def _facts_of(messages: list[Message]) -> Facts:
    out = Facts()
    for m in messages:
        if not isinstance(m, BatchMessage) or (m.batch_id, m.attempt) != INFO.key:
            continue
        if isinstance(m, Metrics):
            out.metrics.append((m.node, m.step, m.metrics))
        elif isinstance(m, CheckpointSaved):
            out.checkpoints.append((m.node, m.step, m.uri, m.kind))
            out.ranks.append(m.ranks)
        elif isinstance(m, Rescaled):
            out.rescaled.append((m.node, m.step, m.uri, m.from_ranks, m.to_ranks))
        elif isinstance(m, Curve):
            out.curve.extend((m.node, s, dict(v)) for s, v in zip(m.steps, m.values, strict=True))
        elif isinstance(m, Progress):
            out.reached = max(out.reached, m.step)
        elif isinstance(m, BatchTiming):
            out.timing = (m.given_at, m.startup_s, m.checkpoint_s, m.train_s)
        elif isinstance(m, LogLine):
            out.lines.append((m.seq, m.node, m.step, m.at, m.line))
        elif isinstance(m, BatchFinished | BatchPreempted | BatchFailed):
            out.terminals += 1
            out.status = {BatchFinished: "finished", BatchPreempted: "preempted", BatchFailed: "failed"}[type(m)]
            if isinstance(m, BatchFailed):
                out.error, out.oom = m.error, m.oom
    return out


def _bus_facts(consumer: BusConsumer, seen: list[Message]) -> Callable[[], Facts]:
    def facts() -> Facts:
        while recs := consumer.poll(timeout_s=0):
            seen.extend(r.message for r in recs if isinstance(r.message, Message))
        return _facts_of(seen)

    return facts


def _grpc_facts(link: FakeLink) -> Callable[[], Facts]:
    """The same facts from the reports' messages: the direct path carries the bus's messages."""

    def facts() -> Facts:
        return _facts_of([m for r in link.reports for m in r.messages])

    return facts


@pytest.fixture(params=["bus", "grpc"])
async def adapter(request: pytest.FixtureRequest) -> AsyncIterator[Adapter]:
    if request.param == "bus":
        bus = InProcessBus()
        consumer = bus.subscribe(list(ALL_TOPICS), "test")
        reporter: BatchReporter = BusReporter(bus, "nm-1", max_messages=3, max_age_s=0.01)
        yield Adapter(reporter, _bus_facts(consumer, []))
    else:
        link = FakeLink()
        reporter = GrpcReporter(link, initial_backoff_s=0.01)
        yield Adapter(reporter, _grpc_facts(link))
    await reporter.close()


async def _settled(a: Adapter) -> Facts:
    """The facts once the bus batcher has flushed (the direct path reports inside ``finish``)."""
    if isinstance(a.reporter, BusReporter):
        await asyncio.to_thread(a.reporter.batcher.flush)
    return a.facts()


def ids(**payload: Any) -> dict[str, Any]:
    return {"batch_id": INFO.batch_id, "attempt": INFO.attempt, **payload}


async def test_a_finished_attempt_carries_its_metrics_checkpoints_and_curve(adapter: Adapter) -> None:
    r = adapter.reporter
    await r.event(INFO, "batch_started", ids())
    await r.event(INFO, "curve", ids(node=1, points=[[1, {"loss": 2.0}], [2, {"loss": 1.5, "lr": 0.1}]]))
    await r.event(INFO, "curve", ids(node=1, points=[[4, {"loss": 0.75}]]))
    await r.event(INFO, "progress", ids(node=1, step=5))
    await r.event(INFO, "metrics", ids(node=1, step=5, metrics={"loss": 0.5, "accuracy": 0.9}))
    await r.event(INFO, "checkpoint_saved", ids(node=1, step=5, uri=URI, bytes=123, kind="central", ranks=1))
    await r.event(INFO, "batch_finished", ids(steps=5))
    await r.finish(INFO, AttemptExit("finished"))
    facts = await _settled(adapter)
    assert facts.status == "finished" and facts.terminals == 1
    assert facts.metrics == [(1, 5, {"loss": 0.5, "accuracy": 0.9})]
    assert facts.checkpoints == [(1, 5, URI, "central")]
    assert facts.curve == [(1, 1, {"loss": 2.0}), (1, 2, {"loss": 1.5, "lr": 0.1}), (1, 4, {"loss": 0.75})]


async def test_how_far_an_attempt_trained_and_where_its_time_went_reach_the_master(adapter: Adapter) -> None:
    r = adapter.reporter
    await r.event(INFO, "batch_started", ids())
    for step in (1, 4, 3):
        await r.event(INFO, "progress", ids(node=1, step=step))
    timing = {"given_at": 1700000000.5, "startup_s": 1.5, "checkpoint_s": 0.25, "train_s": 3.0}
    await r.event(INFO, "batch_timing", ids(**timing))
    await r.event(INFO, "batch_failed", ids(error="boom", traceback="Traceback ...", oom=False, user_error=True))
    await r.finish(INFO, AttemptExit("failed", error="boom", traceback="Traceback ...", user_error=True))
    facts = await _settled(adapter)
    assert facts.reached == 4
    assert facts.timing == (1700000000.5, 1.5, 0.25, 3.0)


async def test_a_resume_on_another_number_of_ranks_and_the_ranks_of_each_checkpoint_reach_the_master(
    adapter: Adapter,
) -> None:
    r = adapter.reporter
    await r.event(INFO, "batch_started", ids())
    await r.event(INFO, "rescaled", ids(node=1, step=5, uri=URI, from_ranks=1, to_ranks=2))
    await r.event(INFO, "checkpoint_saved", ids(node=1, step=9, uri=URI + "-9", bytes=7, kind="central", ranks=2))
    await r.event(INFO, "batch_finished", ids(steps=4))
    await r.finish(INFO, AttemptExit("finished"))
    facts = await _settled(adapter)
    assert facts.rescaled == [(1, 5, URI, 1, 2)]
    assert facts.checkpoints == [(1, 9, URI + "-9", "central")] and facts.ranks == [2]


async def test_the_trainers_log_lines_reach_the_master_in_order_with_a_failed_attempt_too(adapter: Adapter) -> None:
    r = adapter.reporter
    await r.event(INFO, "batch_started", ids())
    await r.event(INFO, "log_line", ids(seq=0, node=1, step=0, at=1700000000.0, line="loading data"))
    await r.event(INFO, "log_line", ids(seq=1, node=1, step=3, at=1700000001.5, line="loss diverging: 1e9"))
    await r.event(INFO, "batch_failed", ids(error="boom", traceback="Traceback ...", oom=False))
    await r.finish(INFO, AttemptExit("failed", error="boom", traceback="Traceback ..."))
    facts = await _settled(adapter)
    assert facts.status == "failed"
    assert facts.lines == [(0, 1, 0, 1700000000.0, "loading data"), (1, 1, 3, 1700000001.5, "loss diverging: 1e9")]


async def test_the_workers_own_failure_keeps_its_error_and_oom_flag(adapter: Adapter) -> None:
    r = adapter.reporter
    error = "OutOfMemoryError: CUDA out of memory"
    await r.event(INFO, "batch_started", ids())
    await r.event(INFO, "batch_failed", ids(error=error, traceback="Traceback ...", oom=True))
    await r.finish(INFO, AttemptExit("failed", error=error, traceback="Traceback ...", oom=True))
    facts = await _settled(adapter)
    assert (facts.status, facts.terminals, facts.oom) == ("failed", 1, True)
    assert error in facts.error


async def test_a_crash_without_a_terminal_event_is_a_failure_with_the_exit_status(adapter: Adapter) -> None:
    r = adapter.reporter
    await r.event(INFO, "batch_started", ids())
    await r.event(INFO, "metrics", ids(node=1, step=2, metrics={"loss": 1.0}))
    end = AttemptExit("failed", error="worker exited with status 17 before reporting an end", by_worker=False)
    await r.finish(INFO, end)
    facts = await _settled(adapter)
    assert (facts.status, facts.terminals, facts.oom) == ("failed", 1, False)
    assert "status 17" in facts.error
    assert facts.metrics == [(1, 2, {"loss": 1.0})]  # what it produced before dying still counts


async def test_a_preempted_attempt_carries_its_peripheral_checkpoint(adapter: Adapter) -> None:
    r = adapter.reporter
    uri = URI.replace("central", "peripheral")
    await r.event(INFO, "batch_started", ids())
    await r.event(INFO, "checkpoint_saved", ids(node=1, step=9, uri=uri, bytes=10, kind="peripheral", ranks=1))
    await r.event(INFO, "batch_preempted", ids(node=1, step=9, uri=uri, ranks=1))
    await r.finish(INFO, AttemptExit("preempted"))
    facts = await _settled(adapter)
    assert (facts.status, facts.terminals) == ("preempted", 1)
    assert facts.checkpoints == [(1, 9, uri, "peripheral")]


async def test_an_attempt_is_never_reported_twice(adapter: Adapter) -> None:
    r = adapter.reporter
    await r.event(INFO, "batch_started", ids())
    end = AttemptExit("failed", error="worker killed by SIGSEGV", by_worker=False)
    await r.finish(INFO, end)
    await r.finish(INFO, end)
    await r.finish(INFO, AttemptExit("finished"))
    await r.event(INFO, "batch_finished", ids(steps=1))  # too late: ignored
    facts = await _settled(adapter)
    assert (facts.status, facts.terminals) == ("failed", 1)


# -- one adapter only -------------------------------------------------------------------------------


async def test_bus_messages_are_keyed_by_batch_with_unique_ids_and_routed_by_type() -> None:
    bus = InProcessBus()
    consumer = bus.subscribe(list(ALL_TOPICS), "test")
    reporter = BusReporter(bus, "nm-1", max_messages=100, max_age_s=0.01)
    await reporter.event(INFO, "batch_started", ids())
    await reporter.event(INFO, "progress", ids(node=1, step=1))
    await reporter.event(INFO, "metrics", ids(node=1, step=1, metrics={"loss": 2.0}))
    await reporter.event(INFO, "batch_finished", ids(steps=1))
    await reporter.finish(INFO, AttemptExit("finished"))
    await reporter.telemetry("nm-1", [GpuSample(0, 55.0, 1 << 30, 8 << 30, {1234: 1 << 20})])
    await reporter.close()
    records = []
    while recs := consumer.poll(timeout_s=0):
        records += recs
    batch = [r for r in records if isinstance(r.message, BatchMessage)]
    assert [r.message.TYPE for r in sorted(batch, key=lambda r: r.message.msg_id)] == [
        "batch_started",
        "progress",
        "metrics",
        "batch_finished",
    ]
    assert all(r.key == "7" and r.topic == type(r.message).TOPIC for r in batch)
    assert len({r.message.msg_id for r in batch}) == 4 and all(r.message.plan_key == "plan-a" for r in batch)
    (tel,) = [r for r in records if isinstance(r.message, GpuTelemetry)]
    assert tel.topic == GpuTelemetry.TOPIC and tel.key == "nm-1"
    assert tel.message.processes[0].pid == 1234 and tel.message.utilization == 55.0


async def test_bus_reporter_holds_events_while_the_bus_is_down_and_loses_none() -> None:
    bus = FlakyBus()
    consumer = bus.subscribe(list(ALL_TOPICS), "test")
    reporter = BusReporter(bus, "nm-1", max_messages=2, max_age_s=0.02, max_buffered=4, retry_s=0.02)
    bus.down = True
    sending = asyncio.create_task(
        _send_progress(reporter, 10)  # more than the buffer holds: the last ones wait
    )
    # the batcher retries the bus while the sender waits for room: each refused publish is a window in
    # which the buffer could let the sender past its bound
    deadline = time.monotonic() + 30
    while bus.refused < 5:
        assert time.monotonic() < deadline, f"the batcher retried the bus {bus.refused} times in 30 s"
        await asyncio.sleep(0.01)
    assert not sending.done() and reporter.batcher.pending() == 4
    bus.down = False
    await asyncio.wait_for(sending, 10)
    await reporter.close()
    steps = []
    while recs := consumer.poll(timeout_s=0):
        steps += [r.message.step for r in recs if r.message.TYPE == "progress"]  # type: ignore[union-attr]
    assert sorted(steps) == list(range(10)) and steps == sorted(steps)


async def _send_progress(reporter: BatchReporter, n: int) -> None:
    for step in range(n):
        await reporter.event(INFO, "progress", ids(node=1, step=step))


async def test_bus_reporter_says_nothing_more_about_an_aborted_attempt() -> None:
    bus = InProcessBus()
    consumer = bus.subscribe(list(ALL_TOPICS), "test")
    reporter = BusReporter(bus, "nm-1", max_age_s=0.01)
    t = time.time()
    await reporter.event(INFO, "batch_started", ids())
    await reporter.finish(INFO, AttemptExit("aborted", by_worker=False))
    await reporter.close()
    messages = [r.message for r in consumer.poll(timeout_s=0)]
    assert [m.TYPE for m in messages] == ["batch_started"]  # type: ignore[union-attr]
    assert t <= messages[0].started_at <= time.time()  # type: ignore[union-attr]  # stamped here


async def test_direct_report_of_an_aborted_attempt_keeps_what_it_saved() -> None:
    link = FakeLink()
    reporter = GrpcReporter(link)
    await reporter.event(INFO, "checkpoint_saved", ids(node=1, step=4, uri=URI, bytes=1, kind="central", ranks=1))
    await reporter.finish(INFO, AttemptExit("aborted", by_worker=False))
    (report,) = link.reports
    assert not report.ok and not report.preempted and report.failure is None  # the master ended it
    assert [c.uri for c in report.checkpoints] == [URI]


async def test_the_direct_report_carries_the_bus_messages_and_the_start_time() -> None:
    link = FakeLink()
    reporter = GrpcReporter(link, node_manager_id="nm-1")
    bus = InProcessBus()
    consumer = bus.subscribe(list(ALL_TOPICS), "test")
    on_bus = BusReporter(bus, "nm-1", max_age_s=0.01)
    t = time.time()
    for r in (reporter, on_bus):
        await r.event(INFO, "batch_started", ids())
        await r.event(INFO, "metrics", ids(node=1, step=4, metrics={"loss": 0.5}))
        await r.event(INFO, "batch_finished", ids(steps=4))
        await r.finish(INFO, AttemptExit("finished"))
    await on_bus.close()
    (report,) = link.reports
    published = [r.message for r in consumer.poll(timeout_s=0)]
    assert [(m.TYPE, m.msg_id) for m in report.messages] == [(m.TYPE, m.msg_id) for m in published]  # type: ignore[union-attr]
    assert t <= report.messages[0].started_at <= time.time()  # type: ignore[attr-defined]


async def test_direct_report_is_retried_while_the_master_is_unavailable() -> None:
    link = FakeLink()
    link.report_errors = [Unavailable("down"), Unavailable("still down")]
    delivered = []
    reporter = GrpcReporter(link, initial_backoff_s=0.01, on_reported=lambda r, done: delivered.append(r))
    await reporter.finish(INFO, AttemptExit("finished"))
    assert [r.batch_id for r in link.reports] == [7] and len(delivered) == 1


async def test_direct_report_refused_for_good_is_dropped_not_retried() -> None:
    link = FakeLink()
    link.report_errors = [InvalidArgument("step -1 is negative")]
    reporter = GrpcReporter(link, initial_backoff_s=0.01)
    await reporter.finish(INFO, AttemptExit("finished"))
    assert link.reports == [] and link.report_errors == []


async def test_close_gives_up_on_a_master_that_never_comes_back() -> None:
    link = FakeLink()
    link.report_errors = [Unavailable("down")] * 1000
    reporter = GrpcReporter(link, initial_backoff_s=0.01, max_backoff_s=0.05, close_timeout_s=0.2)
    pending = asyncio.create_task(reporter.finish(INFO, AttemptExit("finished")))
    await asyncio.sleep(0.05)
    await asyncio.wait_for(reporter.close(), 5)
    await asyncio.wait_for(pending, 5)
    assert link.reports == []


def test_recent_keys_forget_the_oldest() -> None:
    keys = RecentKeys(maxlen=3)
    for i in range(5):
        keys.add((i, 1))
    assert (0, 1) not in keys and (1, 1) not in keys and (4, 1) in keys and len(keys) == 3
