"""``NodeManager`` against a scripted master (``FakeLink``) with real worker processes running digits:
what each assignment does, how a worker's end becomes its report (exactly once), slots and queueing,
reconnection, a wrong token, shutdown, and both launchers."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from stagetree.core.batch import BatchSpec
from stagetree.core.errors import Unauthenticated, Unavailable
from stagetree.core.slots import SlotInfo
from stagetree.nodemanager.agent import LEAVE_TIMEOUT_S, NodeManager
from stagetree.nodemanager.examples.digits import DigitsMLP
from stagetree.nodemanager.examples.faults import ENTRY_POINT as FAULTY
from stagetree.nodemanager.examples.faults import EXIT_CODE
from stagetree.nodemanager.gpu import GpuInfo, GpuSample, StaticGpuProbe
from stagetree.nodemanager.link import ABORT, DELETE_CHECKPOINTS, PREEMPT, RUN, Assignment
from stagetree.nodemanager.mps import MpsDaemon
from stagetree.nodemanager.reporting import GrpcReporter
from stagetree.nodemanager.reuse import ReusePolicy
from stagetree.nodemanager.runtime.checkpoints import LocalCheckpointStore
from stagetree.nodemanager.runtime.executor import BatchRun
from tests.unit.nodemanager.fakes import ENV_RECORDER, FORKING, FakeLink
from tests.unit.nodemanager.harness import Harness, launcher_of, spec_of, start_node_manager, until

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = await start_node_manager(tmp_path)
    yield harness
    harness.stop.set()
    await asyncio.wait_for(harness.task, 120)


async def test_a_run_is_reported_with_its_metrics_and_checkpoint(h: Harness) -> None:
    h.run(spec_of(1))
    report = await h.report(1)
    assert report.ok and not report.error
    assert [(m.node, m.step, sorted(m.metrics)) for m in report.metrics] == [(1, 10, ["accuracy", "loss"])]
    (ckpt,) = report.checkpoints
    assert (ckpt.step, ckpt.kind) == (10, "central") and h.store.exists(ckpt.uri)
    assert (h.tmp / "work" / "logs" / "batch-1-a1.log").exists()
    await until(lambda: h.nm.running() == [])
    # heartbeats list it (recently ended), so the master never takes it for an assignment that got lost
    await until(lambda: any(k is not None and (1, 1) in k for k in h.link.heartbeat_known))


async def test_a_worker_oom_is_reported_as_oom(h: Harness) -> None:
    h.run(spec_of(2, trainer=FAULTY, fault="cuda_oom", fault_step=2))
    report = await h.report(2)
    assert not report.ok and report.oom and "OutOfMemoryError" in report.error


async def test_a_crash_is_a_failure_with_the_exit_status_and_last_output(h: Harness) -> None:
    h.run(spec_of(3, trainer=FAULTY, fault="exit", fault_step=2))
    report = await h.report(3)
    assert not report.ok and not report.oom and not report.preempted
    assert f"worker exited with status {EXIT_CODE}" in report.error


async def test_a_sigkill_nobody_sent_is_taken_for_the_oom_killer(h: Harness) -> None:
    h.run(spec_of(4, steps=400, trainer=FAULTY, sleep_s=0.02))
    await until(lambda: h.nm._attempts.get((4, 1)) and h.nm._attempts[(4, 1)].started)
    worker = h.nm._attempts[(4, 1)].worker
    assert worker is not None
    os.kill(worker.pid, signal.SIGKILL)
    report = await h.report(4)
    assert not report.ok and report.oom and "SIGKILL" in report.error


async def test_duplicate_run_is_ignored_and_reported_once(h: Harness) -> None:
    spec = spec_of(5, steps=5)
    h.run(spec)
    h.run(spec)
    await h.report(5)
    h.run(spec)  # even after it ended
    h.run(spec_of(50, steps=2))  # one slot, assignments in order: a duplicate that ran would report first
    assert (await h.report(50)).ok
    assert len([r for r in h.link.reports if r.batch_id == 5]) == 1


async def test_preempt_before_the_worker_is_ready_is_deferred_not_fatal(h: Harness) -> None:
    h.run(spec_of(6, steps=200, trainer=FAULTY, sleep_s=0.01))
    h.send(PREEMPT, 6)  # at once: before the worker has its signal handler
    report = await h.report(6)
    assert report.preempted and not report.ok
    (ckpt,) = report.checkpoints
    assert ckpt.kind == "peripheral" and 1 <= ckpt.step < 200 and h.store.exists(ckpt.uri)


async def test_abort_kills_a_running_worker_and_drops_a_queued_one(h: Harness) -> None:
    h.run(spec_of(7, steps=400, trainer=FAULTY, sleep_s=0.02))
    h.run(spec_of(8))  # no free slot: queued
    await until(lambda: h.nm._attempts.get((7, 1)) and h.nm._attempts[(7, 1)].started)
    assert h.nm._attempts[(8, 1)].worker is None
    h.send(ABORT, 8)
    h.send(ABORT, 7)
    r7, r8 = await h.report(7), await h.report(8)
    assert not (r7.ok or r8.ok) and r7.failure is None and r8.failure is None  # the master ended them
    assert not r8.metrics and not r8.checkpoints
    h.send(ABORT, 99)  # unknown: ignored, and the node manager goes on
    h.run(spec_of(98, steps=2))
    assert (await h.report(98)).ok
    await until(lambda: h.nm.running() == [])


async def test_a_second_batch_waits_for_the_slot_the_first_frees(h: Harness) -> None:
    h.run(spec_of(9, steps=30, trainer=FAULTY, sleep_s=0.01))
    h.run(spec_of(10, steps=5))
    r10 = await h.report(10)
    r9 = h.link.report_of(9)
    assert r9.ok and r10.ok and h.link.reports.index(r9) < h.link.reports.index(r10)


async def test_a_batch_sent_ahead_waits_for_its_named_slot_and_lets_others_pass(tmp_path: Path) -> None:
    h = await start_node_manager(tmp_path, slots=3)
    try:
        h.run(spec_of(11, steps=400, trainer=FAULTY, sleep_s=0.01), slot_id="cpu0")
        await until(lambda: h.nm._attempts.get((11, 1)) and h.nm._attempts[(11, 1)].started)
        h.run(spec_of(12, steps=5), slot_id="cpu0")  # sent ahead: cpu0 is still busy, cpu1 and cpu2 are free
        h.run(spec_of(13, steps=5), slot_id="cpu1")  # behind it in the queue, its slot free: it passes
        h.run(spec_of(14, steps=5), slot_id="elsewhere")  # names no slot here: any free one
        await h.report(13)
        await h.report(14)
        assert h.nm._attempts[(12, 1)].worker is None and 12 not in {r.batch_id for r in h.link.reports}
        assert h.link.report_of(14).ok
        h.send(PREEMPT, 11)
        await h.report(12)
        assert h.link.reports.index(h.link.report_of(11)) < h.link.reports.index(h.link.report_of(12))
        assert h.link.report_of(12).ok
    finally:
        h.stop.set()
        await asyncio.wait_for(h.task, 120)


async def test_delete_checkpoints_removes_them_and_ignores_missing_or_foreign(h: Harness) -> None:
    uri = h.store.put("plan/n1/s4-central-b1a1", lambda d: (d / "x").write_text("x")).uri
    missing = h.store.uri_of("plan/n1/s8-central-b1a1")
    h.send(DELETE_CHECKPOINTS, uris=(uri, missing, "file:///elsewhere/ckpt", "s3://bucket/key"))
    await until(lambda: not h.store.exists(uri))


async def test_an_unreadable_spec_fails_its_attempt(h: Harness) -> None:
    h.link.feed.put_nowait(Assignment(11, 1, RUN, '{"batch_id": 11}'))
    report = await h.report(11)
    assert not report.ok and "unreadable batch spec" in report.error


async def test_reconnects_and_registers_again_after_the_master_goes_away(h: Harness) -> None:
    assert len(h.link.registrations) == 1
    h.link.feed.put_nowait(Unavailable("stream broken"))
    await until(lambda: len(h.link.registrations) == 2)
    h.link.heartbeat_errors.append(Unavailable("heartbeat refused"))
    await until(lambda: len(h.link.registrations) == 3)
    h.run(spec_of(12, steps=3))
    assert (await h.report(12)).ok


async def test_an_unreachable_master_is_retried_until_it_answers(tmp_path: Path) -> None:
    link_errors = [Unavailable("connection refused")] * 3
    h = await _start_with_register_errors(tmp_path, link_errors)
    try:
        assert len(h.link.registrations) == 1 and h.link.register_errors == []
    finally:
        h.stop.set()
        await asyncio.wait_for(h.task, 120)


async def _start_with_register_errors(tmp: Path, errors: list[Exception]) -> Harness:
    link = FakeLink()
    link.register_errors = list(errors)
    store = LocalCheckpointStore(tmp / "ckpt", fsync=False)
    nm = NodeManager(
        link,
        GrpcReporter(link),
        [SlotInfo("cpu0")],
        launcher_of("forkserver", store, tmp),
        node_manager_id="nm-test",
        reconnect_initial_s=0.01,
        reconnect_max_s=0.02,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(nm.run(stop))
    await until(lambda: nm.connected.is_set() or task.done())
    return Harness(nm, link, store, stop, task, tmp)


async def test_a_wrong_token_stops_the_node_manager_at_once(tmp_path: Path) -> None:
    link = FakeLink()
    link.register_errors = [Unauthenticated("bad token; set STAGETREE_NM_ADMIN_TOKEN")]
    launcher = launcher_of("exec", LocalCheckpointStore(tmp_path / "ckpt"), tmp_path)
    nm = NodeManager(link, GrpcReporter(link), [SlotInfo("cpu0")], launcher, node_manager_id="nm-test")
    with pytest.raises(Unauthenticated, match="STAGETREE_NM_ADMIN_TOKEN"):
        await asyncio.wait_for(nm.run(asyncio.Event()), 60)
    assert link.closed and not (tmp_path / "work" / "logs").exists()  # no worker was ever started
    assert link.left == []  # never registered: nothing to leave


async def test_stop_preempts_running_workers_so_their_work_resumes_elsewhere(tmp_path: Path) -> None:
    h = await start_node_manager(tmp_path)
    h.run(spec_of(13, steps=400, trainer=FAULTY, sleep_s=0.02))
    await until(lambda: h.nm._attempts.get((13, 1)) and h.nm._attempts[(13, 1)].started)
    h.stop.set()
    await asyncio.wait_for(h.task, 120)
    report = h.link.report_of(13)
    assert report.preempted and [c.kind for c in report.checkpoints] == ["peripheral"]
    # it left the master once its report was sent, listing the attempt so that only its report ends it
    assert h.link.left == [[(13, 1)]] and h.link.reports_at_leave == [len(h.link.reports)]


class _MasterThatNeverAnswersALeave(FakeLink):
    async def leave(self, node_manager_id: str, known: Sequence[tuple[int, int]]) -> list[int]:
        await asyncio.Event().wait()  # a master away, or one that never heard of leaving
        return []


async def test_a_stop_whose_leave_goes_unanswered_still_ends_in_a_few_seconds(tmp_path: Path) -> None:
    link = _MasterThatNeverAnswersALeave()
    launcher = launcher_of("exec", LocalCheckpointStore(tmp_path / "ckpt"), tmp_path)
    nm = NodeManager(link, GrpcReporter(link), [SlotInfo("cpu0")], launcher, node_manager_id="nm-test")
    stop = asyncio.Event()
    task = asyncio.create_task(nm.run(stop))
    await until(lambda: nm.connected.is_set())
    t0 = asyncio.get_running_loop().time()
    stop.set()
    await asyncio.wait_for(task, 30)
    assert asyncio.get_running_loop().time() - t0 < LEAVE_TIMEOUT_S + 10 and link.closed


async def test_exec_launcher_with_prestart_runs_the_worker_in_its_slots_environment(tmp_path: Path) -> None:
    h = await start_node_manager(tmp_path, launcher="exec")
    try:
        env_file = tmp_path / "env.json"
        h.run(spec_of(14, steps=3, trainer=ENV_RECORDER, env_file=str(env_file)))
        assert (await h.report(14)).ok
        seen = json.loads(env_file.read_text())
        assert seen["CUDA_VISIBLE_DEVICES"] == "" and seen["OMP_NUM_THREADS"] == "1" and seen["torch_threads"] == "1"
    finally:
        h.stop.set()
        await asyncio.wait_for(h.task, 120)
    assert not list((tmp_path / "work" / "logs").glob("worker-*.log"))  # the prestarted ones are gone


async def test_forked_workers_get_the_slot_environment_too(h: Harness) -> None:
    env_file = h.tmp / "env.json"
    h.run(spec_of(15, steps=3, trainer=ENV_RECORDER, env_file=str(env_file)))
    assert (await h.report(15)).ok
    seen = json.loads(env_file.read_text())
    assert seen["CUDA_VISIBLE_DEVICES"] == "" and seen["STAGETREE_WORKER_THREADS"] == "1"


class _TelemetrySink(GrpcReporter):
    def __init__(self, link: FakeLink) -> None:
        super().__init__(link)
        self.samples: list[tuple[str, list[GpuSample]]] = []

    async def telemetry(self, node_manager_id: str, samples: list[GpuSample]) -> None:
        self.samples.append((node_manager_id, samples))


class _CountingProbe(StaticGpuProbe):
    def __init__(self, gpus: list[GpuInfo]) -> None:
        super().__init__(gpus)
        self.asked = False
        self.sampled = 0

    def gpus(self) -> list[GpuInfo]:
        self.asked = True
        return super().gpus()

    def sample(self) -> list[GpuSample]:
        self.sampled += 1
        return super().sample()


def _is_telemetry(task: asyncio.Task[Any]) -> bool:
    return getattr(task.get_coro(), "__qualname__", "").endswith("_telemetry_loop")


@pytest.mark.parametrize("gpus", [[GpuInfo(0, "NVIDIA H100", 80 << 30, "9.0")], []], ids=["gpu", "cpu-only"])
async def test_telemetry_is_sampled_with_gpus_and_skipped_without(tmp_path: Path, gpus: list[GpuInfo]) -> None:
    link = FakeLink()
    reporter = _TelemetrySink(link)
    probe = _CountingProbe(gpus)
    launcher = launcher_of("forkserver", LocalCheckpointStore(tmp_path / "ckpt"), tmp_path)
    nm = NodeManager(
        link,
        reporter,
        [SlotInfo("cpu0")],
        launcher,
        node_manager_id="nm-tel",
        probe=probe,
        telemetry_interval_s=0.02,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(nm.run(stop))
    if gpus:
        await until(lambda: len(reporter.samples) >= 3)
    else:  # the sampling loop saw no GPU and ended
        await until(lambda: probe.asked and not any(_is_telemetry(t) for t in nm._background))
    stop.set()
    await asyncio.wait_for(task, 120)
    if gpus:
        assert reporter.samples[0][0] == "nm-tel"
        assert [s.index for s in reporter.samples[0][1]] == [0]
    else:
        assert reporter.samples == [] and probe.sampled == 0


async def test_the_mps_daemon_lives_as_long_as_the_node_manager(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "bin" / "nvidia-cuda-mps-control"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$* $(cat)" >> {calls}\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    link = FakeLink()
    launcher = launcher_of("forkserver", LocalCheckpointStore(tmp_path / "ckpt"), tmp_path)
    mps = MpsDaemon(tmp_path / "w", [0])
    nm = NodeManager(link, GrpcReporter(link), [SlotInfo("cpu0")], launcher, node_manager_id="nm-mps", mps=mps)
    stop = asyncio.Event()
    task = asyncio.create_task(nm.run(stop))
    await until(nm.connected.is_set)
    assert mps.running and calls.read_text().split() == ["-d"]
    stop.set()
    await asyncio.wait_for(task, 120)
    assert not mps.running and calls.read_text().split() == ["-d", "quit"]


async def test_stop_with_the_master_gone_does_not_wait_forever_for_reports(tmp_path: Path) -> None:
    h = await start_node_manager(tmp_path, close_timeout_s=0.5)
    h.run(spec_of(16, steps=400, trainer=FAULTY, sleep_s=0.02))
    await until(lambda: h.nm._attempts.get((16, 1)) and h.nm._attempts[(16, 1)].started)
    h.link.report_errors = [Unavailable("master gone")] * 10_000
    loop = asyncio.get_running_loop()
    started = loop.time()
    h.stop.set()
    await asyncio.wait_for(h.task, 120)
    # retrying 10,000 failures would take hours: the close timeout (0.5 s) is what ended it
    assert loop.time() - started < 45 and h.link.reports == []


async def test_a_process_the_worker_leaves_behind_does_not_hold_up_the_report(h: Harness) -> None:
    pid_file = h.tmp / "grandchild.pid"
    h.run(spec_of(17, steps=3, trainer=FORKING, pid_file=str(pid_file)))
    report = await h.report(17)
    assert report.ok and report.metrics
    grandchild = int(pid_file.read_text())

    def gone() -> bool:
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            return True
        return False

    await until(gone)


def _metrics_in_process(spec: BatchSpec, store: LocalCheckpointStore) -> list[dict[str, Any]]:
    """The metrics events of ``spec`` run here, by a trainer built for it (one torch thread, as a worker)."""
    events: list[dict[str, Any]] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        BatchRun(spec, DigitsMLP, store, lambda kind, p: events.append(p) if kind == "metrics" else None).run()
    finally:
        torch.set_num_threads(threads)
    return [e["metrics"] for e in events]


@pytest.mark.parametrize("launcher", ["forkserver", "exec"])
async def test_a_worker_started_ahead_builds_the_trainer_and_the_batch_trains_the_same(
    tmp_path: Path, launcher: str
) -> None:
    # Workers not reused: each batch's worker goes, and the one started ahead to replace it prepares the
    # fixed part of the slot's last batch (as after a failure or a preemption with reuse on).
    h = await start_node_manager(tmp_path, launcher=launcher, reuse=ReusePolicy(reuse=False))
    specs = [spec_of(1, steps=2, hidden=24), spec_of(2, steps=4, hidden=24), spec_of(3, steps=4, hidden=16)]
    try:
        reports = []
        for spec in specs:
            h.run(spec)
            reports.append(await h.report(spec.batch_id))
    finally:
        h.stop.set()
        await asyncio.wait_for(h.task, 120)
    logs = {s.batch_id: (tmp_path / "work" / "logs" / f"batch-{s.batch_id}-a1.log").read_text() for s in specs}
    assert "trainer built ahead" in logs[2]  # the same fixed part as batch 1's
    assert "trainer built ahead" not in logs[3] and "for another fixed part" in logs[3]
    direct = LocalCheckpointStore(tmp_path / "direct", fsync=False)
    for spec, report in zip(specs[1:], reports[1:], strict=True):
        assert report.ok
        assert [dict(m.metrics) for m in report.metrics] == _metrics_in_process(spec, direct)


async def test_a_cpu_slots_worker_runs_its_batches_and_the_next_starts_when_it_exits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = await start_node_manager(tmp_path)
    launcher = h.nm.launcher
    logs = tmp_path / "work" / "logs"
    pids: dict[int, int] = {}  # batch id -> its worker's pid, as the node manager got it
    start_worker = h.nm._start_worker

    async def recording(att: Any) -> Any:  # batch 2 ends within milliseconds: polling could miss it
        worker = await start_worker(att)
        pids[att.info.batch_id] = worker.pid
        return worker

    monkeypatch.setattr(h.nm, "_start_worker", recording)
    try:
        await h.nm.workers_ready()
        await until(lambda: "cpu0" in launcher._fresh)  # the one prestarted at start-up
        h.run(spec_of(1, steps=30, trainer=FAULTY, sleep_s=0.02))
        h.run(spec_of(2, trainer=FAULTY, fault="say_and_exit", fault_step=1))  # queued behind it (one slot)
        await until(lambda: h.nm._attempts.get((1, 1)) and h.nm._attempts[(1, 1)].started)
        while not any(r.batch_id == 1 for r in h.link.reports):  # while batch 1 trains, nothing else starts
            assert "cpu0" not in launcher._fresh and "cpu0" not in launcher._starting
            await asyncio.sleep(0.01)
        await until(lambda: 2 in pids)
        assert (await h.report(1)).ok
        # batch 2 runs on the worker batch 1 ran on, handed over at once: what it wrote before dying
        # reaches the report, from the log under the batch's name
        failed = await h.report(2)
        assert pids[2] == pids[1]
        assert not failed.ok and "dying on purpose" in failed.error
        assert "dying on purpose" in (logs / "batch-2-a1.log").read_text()
        assert "dying on purpose" not in (logs / "batch-1-a1.log").read_text()
        await until(lambda: "cpu0" in launcher._fresh)  # the next one started at the worker's exit
        assert launcher._fresh["cpu0"].pid != pids[1]
        await until(lambda: len(list(logs.glob("worker-*.log"))) == 1)  # only that one's first name is left
    finally:
        h.stop.set()
        await asyncio.wait_for(h.task, 120)
