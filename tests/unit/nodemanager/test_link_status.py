"""The node manager's link against a real gRPC server (in this process) that answers with chosen status
codes: a master bug (INTERNAL, UNKNOWN) is surfaced once, not re-sent, while what a retry can fix is
retried; and the connection loop backs off ever longer while the master keeps failing a call."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from stagetree.core.errors import StagetreeError, Unavailable
from stagetree.core.slots import SlotInfo
from stagetree.nodemanager.agent import NodeManager
from stagetree.nodemanager.link import GrpcMasterLink
from stagetree.nodemanager.reporting import AttemptExit, AttemptInfo, GrpcReporter
from stagetree.nodemanager.workers import ExecLauncher
from stagetree.proto.stagetree.v1 import master_pb2 as pb
from stagetree.proto.stagetree.v1 import master_pb2_grpc as pb_grpc
from stagetree.status import SERVER_BUG
from tests.unit.nodemanager.fakes import FakeLink

pytestmark = pytest.mark.timeout(30)

INFO = AttemptInfo(batch_id=7, attempt=1)


class ScriptedMaster(pb_grpc.MasterServiceServicer):
    """Fails each call with the next code of ``codes`` (then answers), counting calls per method."""

    def __init__(self) -> None:
        self.codes: list[grpc.StatusCode] = []
        self.calls: Counter[str] = Counter()

    async def _answer(self, method: str, context: grpc.aio.ServicerContext) -> None:
        self.calls[method] += 1
        if self.codes:
            await context.abort(self.codes.pop(0), f"{method} failed (test)")

    async def ReportBatch(self, request: pb.ReportBatchRequest, context: Any) -> pb.ReportBatchResponse:
        await self._answer("ReportBatch", context)
        return pb.ReportBatchResponse(completed_request_ids=[1])

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Any) -> pb.HeartbeatResponse:
        await self._answer("Heartbeat", context)
        return pb.HeartbeatResponse()


@pytest.fixture
async def master() -> AsyncIterator[tuple[ScriptedMaster, GrpcMasterLink]]:
    servicer = ScriptedMaster()
    server = grpc.aio.server()
    pb_grpc.add_MasterServiceServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    link = GrpcMasterLink(f"127.0.0.1:{port}", "admin-token", rpc_timeout_s=5)
    try:
        yield servicer, link
    finally:
        await link.close()
        await server.stop(None)


@pytest.mark.parametrize("code", [grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN])
async def test_a_report_the_master_fails_with_a_bug_is_sent_once_and_logged_once(
    master: tuple[ScriptedMaster, GrpcMasterLink], code: grpc.StatusCode, caplog: pytest.LogCaptureFixture
) -> None:
    servicer, link = master
    servicer.codes = [code] * 100  # it would keep failing: a retry only repeats the bug
    reporter = GrpcReporter(link, initial_backoff_s=0.01, max_backoff_s=0.01)
    with caplog.at_level(logging.WARNING, logger="stagetree.nodemanager"):
        await asyncio.wait_for(reporter.finish(INFO, AttemptExit("finished")), 5)
    assert servicer.calls["ReportBatch"] == 1
    (record,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert record.levelno == logging.ERROR and SERVER_BUG in record.getMessage()
    assert "ReportBatch failed (test)" in record.getMessage() and code.name in record.getMessage()


async def test_a_report_the_master_cannot_take_yet_is_retried_until_delivered(
    master: tuple[ScriptedMaster, GrpcMasterLink],
) -> None:
    servicer, link = master
    servicer.codes = [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED]
    delivered: list[list[int]] = []
    reporter = GrpcReporter(link, initial_backoff_s=0.01, on_reported=lambda _r, done: delivered.append(done))
    await asyncio.wait_for(reporter.finish(INFO, AttemptExit("finished")), 5)
    assert servicer.calls["ReportBatch"] == 3 and delivered == [[1]]


async def test_a_heartbeat_the_master_fails_with_a_bug_is_not_retried_by_the_link(
    master: tuple[ScriptedMaster, GrpcMasterLink],
) -> None:
    servicer, link = master
    servicer.codes = [grpc.StatusCode.INTERNAL]
    with pytest.raises(StagetreeError) as got:
        await link.heartbeat("nm-1")
    assert not got.value.retriable and SERVER_BUG in got.value.message
    assert servicer.calls["Heartbeat"] == 1


class AlwaysFailingHeartbeats(FakeLink):
    """Registers fine, then fails every heartbeat with ``error``."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    async def heartbeat(self, node_manager_id: str, known: Sequence[tuple[int, int]] | None = None) -> None:
        self.heartbeats += 1
        raise self.error


async def test_the_connection_backs_off_ever_longer_while_the_master_keeps_failing_a_call(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    link = AlwaysFailingHeartbeats(StagetreeError(f"heartbeat: the master failed (INTERNAL); {SERVER_BUG}"))
    nm = NodeManager(
        link,
        GrpcReporter(link),
        [SlotInfo("cpu0")],
        ExecLauncher(str(tmp_path / "ckpt"), tmp_path / "work", prestart=False),
        node_manager_id="nm-test",
        heartbeat_interval_s=0.001,  # a session fails at once: only the backoff paces the loop
        reconnect_initial_s=0.005,
        reconnect_max_s=0.08,
    )
    stop = asyncio.Event()

    def waits(level: int, since: int = 0) -> list[float]:
        return [r.__dict__["retry_in_s"] for r in caplog.records[since:] if r.levelno == level]  # an extra= field

    with caplog.at_level(logging.WARNING, logger="stagetree.nodemanager.agent"):
        task = asyncio.create_task(nm.run(stop))
        await until(lambda: 0.08 in waits(logging.ERROR))
        # Re-registering does not reset the backoff: each session waits at least as long as the one
        # before, and once at the longest wait it re-sends at most once per wait (without: one per ms).
        assert waits(logging.ERROR) == sorted(waits(logging.ERROR))
        # Counted over the time that actually passed (a loaded machine stretches the sleep): each wait is
        # at least 0.08 s less its jitter.
        loop = asyncio.get_running_loop()
        before, started = nm.registrations, loop.time()
        await asyncio.sleep(0.4)
        elapsed = loop.time() - started
        assert nm.registrations - before <= elapsed / (0.08 * 0.8) + 1, (nm.registrations - before, elapsed)
        assert not task.done()  # the node manager stays up, and keeps trying now and then
        assert SERVER_BUG in caplog.records[0].getMessage()

        # A session ended by what a retry fixes starts again from the shortest wait.
        link.error = Unavailable("heartbeat: the master at h:1 is unavailable (UNAVAILABLE: restarting)")
        seen = len(caplog.records)
        await until(lambda: 0.005 in waits(logging.WARNING, seen))
        stop.set()
        await asyncio.wait_for(task, 10)


async def until(cond: Callable[[], bool], timeout: float = 10) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_a_master_that_does_not_know_leaving_answers_a_leave_with_an_error_the_agent_can_log(
    master: tuple[ScriptedMaster, GrpcMasterLink],
) -> None:
    _, link = master  # ScriptedMaster implements no LeaveNodeManager, as a master of an older release
    with pytest.raises(StagetreeError) as got:
        await link.leave("nm-1", [(7, 1)])
    assert "leave" in got.value.message
