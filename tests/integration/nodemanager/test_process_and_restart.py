"""The node manager as its own process (``stagetree nodemanager run``), its answer to a
wrong token, and a master that is killed and restarted while a worker runs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from stagetree.master.app import MasterApp
from stagetree.master.coordination import InProcessCoordination
from stagetree.master.service import CH_ROUND
from stagetree.master.settings import SchedulingSettings
from tests.integration.conftest import ADMIN_TOKEN, master_settings
from tests.integration.nodemanager.helpers import (
    ADMIN,
    FAULTY,
    config_json,
    finished,
    fixed_part,
    start_node_manager,
    submit,
    unique,
    until,
)

pytestmark = pytest.mark.timeout(600)


class NodeManagerProcess:
    """``stagetree nodemanager run`` as a child process; its stderr is collected as it comes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def start(
        cls, target: str, tmp: Path, token: str = ADMIN_TOKEN, cwd: Path | None = None, nm_id: str = ""
    ) -> NodeManagerProcess:
        env = {
            **os.environ,
            "STAGETREE_NM_MASTER_TARGET": target,
            "STAGETREE_NM_ADMIN_TOKEN": token,
            "STAGETREE_NM_NODE_MANAGER_ID": nm_id or unique("nm-proc"),
            "STAGETREE_NM_CHECKPOINT_ROOT": str(tmp / "ckpt"),
            "STAGETREE_NM_WORK_DIR": str(tmp / "work"),
            "STAGETREE_NM_CPU_SLOTS": "1",
            "STAGETREE_NM_RECONNECT_MAX_S": "1",
        }
        # the console script, as a user runs it (``python -m`` would put the working directory on sys.path)
        cmd = [str(Path(sys.executable).parent / "stagetree"), "nodemanager", "run"]
        proc = await asyncio.create_subprocess_exec(*cmd, stderr=asyncio.subprocess.PIPE, env=env, cwd=cwd)
        return cls(proc)

    async def _read(self) -> None:
        assert self.proc.stderr is not None
        async for raw in self.proc.stderr:
            self.lines.append(raw.decode(errors="replace"))

    def saw(self, text: str) -> bool:
        return any(text in line for line in self.lines)

    async def wait(self, timeout: float = 120) -> int:
        rc = await asyncio.wait_for(self.proc.wait(), timeout)
        await asyncio.wait_for(self._reader, 5)
        return rc

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()


async def test_node_manager_process_runs_batches_and_stops_on_sigterm(
    scheduling: MasterApp, grpc_target: str, tmp_path: Path
) -> None:
    # started in the user's project directory: its trainer module is found there, with no setting
    project = tmp_path / "project"
    project.mkdir()
    module = f"cwd_trainer_{unique('m').replace('-', '_')}"
    (project / f"{module}.py").write_text("from stagetree.nodemanager.examples.digits import DigitsMLP as Net\n")
    nm = await NodeManagerProcess.start(grpc_target, tmp_path, cwd=project)
    try:
        await until(lambda: nm.saw("registered with the master") or nm.proc.returncode is not None, 180, "register")
        study, ids = await submit(scheduling, [(config_json(fixed_part(f"{module}:Net", seed=9), lr=0.1), 8)])
        (rec,) = await finished(scheduling, study, ids, timeout=240)
        assert rec.state == "DONE" and set(rec.metrics or {}) == {"accuracy", "loss"}, rec.error
        nm.proc.send_signal(signal.SIGTERM)
        assert await nm.wait() == 0, "".join(nm.lines)
    finally:
        nm.kill()


async def test_a_wrong_token_exits_with_the_setting_to_fix(grpc_target: str, tmp_path: Path) -> None:
    nm = await NodeManagerProcess.start(grpc_target, tmp_path, token="not-the-admin-token")
    try:
        assert await nm.wait() == 1
    finally:
        nm.kill()
    out = "".join(nm.lines)
    assert "rejected the token" in out and "STAGETREE_NM_ADMIN_TOKEN" in out, out


class Master:
    """A master process's parts in this loop: its app, gRPC server and scheduling loop."""

    def __init__(self, app: MasterApp, server: object, port: int) -> None:
        self.app, self.server, self.port = app, server, port
        self.stop_event = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls, url: str, port: int = 0, schedule: bool = True, **settings: object) -> Master:
        app = MasterApp.build(master_settings(url, **settings), coordination=InProcessCoordination())
        server, bound = await app.start_grpc(port=port)
        master = cls(app, server, bound)
        if schedule:
            master.schedule()
        return master

    def schedule(self) -> None:
        self.task = asyncio.create_task(self.app.scheduler.run(self.stop_event))

    async def kill(self) -> None:
        self.stop_event.set()
        while self.task is not None and not self.task.done():
            self.app.coordination.notify(CH_ROUND)
            await asyncio.wait({self.task}, timeout=0.1)
        await self.server.stop(None)  # type: ignore[attr-defined]
        self.app.close()


@pytest.fixture
async def masters(fresh_db_url: str) -> AsyncIterator[list[Master]]:
    started: list[Master] = []
    yield started
    for m in started:
        with contextlib.suppress(Exception):
            await m.kill()


async def test_workers_survive_a_master_restart_and_report_to_the_new_master(
    fresh_db_url: str, masters: list[Master], tmp_path: Path
) -> None:
    first = await Master.start(fresh_db_url)
    masters.append(first)
    target = f"127.0.0.1:{first.port}"
    nm = await start_node_manager(target, tmp_path)
    try:
        study, ids = await submit(first.app, [(config_json(fixed_part(FAULTY, sleep_s=0.05), lr=0.1), 30)])
        await until(lambda: nm.reporter.of("batch_started"), 30, "the batch to start")
        await first.kill()
        masters.remove(first)
        assert not nm.reporter.of("batch_finished")  # the worker outlives the master...
        # ... trains on and finishes while no master is there; its report waits for the next one.
        await until(lambda: nm.reporter.of("batch_finished"), 30, "the worker to finish")
        # Liveness is in-process here (Redis keeps it across restarts in a cluster): let the node manager
        # register again before the new master's first round, or that round would find it lost.
        second = await Master.start(fresh_db_url, port=first.port, schedule=False)
        masters.append(second)
        await until(lambda: nm.nm.registrations >= 2, 30, "the node manager to register again")
        second.schedule()
        (rec,) = await finished(second.app, study, ids)
        assert rec.state == "DONE" and rec.metrics
        assert len(nm.reporter.of("batch_started")) == 1  # served by the batch that outlived its master
        ((_, end),) = nm.reporter.ends
        assert end.status == "finished"
    finally:
        await nm.close()


async def test_a_stopped_node_manager_is_alive_again_once_it_is_back_and_its_slot_gets_work(
    fresh_db_url: str, masters: list[Master], tmp_path: Path
) -> None:
    """Stopped, it has LEFT (it says so as it stops); paused past its heartbeat's lapse, it is LOST.
    Started again under its id (or resumed: heartbeating again), it is ALIVE and the rounds send its
    slot work."""
    master = await Master.start(fresh_db_url, scheduling=SchedulingSettings(heartbeat_ttl_s=2.0, round_interval_s=0.5))
    masters.append(master)
    target, nm_id = f"127.0.0.1:{master.port}", unique("nm-back")

    def state() -> str:
        (rec,) = [n for n in master.app.service.list_node_managers(ADMIN) if n.id == nm_id]
        return str(rec.state)

    async def runs_a_request_there(lr: float) -> None:  # a config of its own: nothing answers it but training
        study, ids = await submit(master.app, [(config_json(fixed_part(), lr=lr), 2)])
        (rec,) = await finished(master.app, study, ids, timeout=240)
        assert rec.state == "DONE" and rec.batch_id is not None, rec.error
        assert master.app.store.batches.get_batch(rec.batch_id).node_manager_id == nm_id

    nm = await NodeManagerProcess.start(target, tmp_path, nm_id=nm_id)
    try:
        await until(lambda: nm.saw("registered with the master") or nm.proc.returncode is not None, 180, "register")
        await runs_a_request_there(0.1)
        nm.proc.send_signal(signal.SIGTERM)
        assert await nm.wait() == 0, "".join(nm.lines)
        assert state() == "LEFT", "".join(nm.lines)
    finally:
        nm.kill()

    again = await NodeManagerProcess.start(target, tmp_path, nm_id=nm_id)
    try:
        await until(lambda: state() == "ALIVE", 180, "the node manager started again to be alive")
        await runs_a_request_there(0.2)

        again.proc.send_signal(signal.SIGSTOP)  # its heartbeats stop; the process and its connection stay
        try:
            await until(lambda: state() == "LOST", 30, "the paused node manager to be lost")
        finally:
            again.proc.send_signal(signal.SIGCONT)
        await until(lambda: state() == "ALIVE", 30, "the resumed node manager to be alive")
        await runs_a_request_there(0.3)
        await asyncio.sleep(3.0)  # past a heartbeat TTL: it stays alive
        assert state() == "ALIVE"
    finally:
        again.kill()
        await again.wait(30)  # reaped while the loop runs (its pipes close with it)
