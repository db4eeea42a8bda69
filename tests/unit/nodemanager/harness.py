"""A node manager driven by a scripted master (``FakeLink``) with real worker processes, for the node
manager's tests: start one, feed it assignments, wait for its reports."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stagetree.core.batch import BatchSpec
from stagetree.core.slots import SlotInfo
from stagetree.nodemanager.agent import NodeManager
from stagetree.nodemanager.examples.digits import digits_batch
from stagetree.nodemanager.link import RUN, Assignment
from stagetree.nodemanager.reporting import GrpcReporter
from stagetree.nodemanager.reuse import ReusePolicy
from stagetree.nodemanager.runtime.checkpoints import LocalCheckpointStore
from stagetree.nodemanager.slots import USER_PATH_ENV
from stagetree.nodemanager.workers import ExecLauncher, ForkserverLauncher, WorkerLauncher
from tests.unit.nodemanager.fakes import FakeLink

HP = {"lr": 0.1, "momentum": 0.9, "bs": 32}


@dataclass
class Harness:
    nm: NodeManager
    link: FakeLink
    store: LocalCheckpointStore
    stop: asyncio.Event
    task: asyncio.Task[None]
    tmp: Path

    def run(self, spec: BatchSpec, slot_id: str = "") -> None:
        a = Assignment(spec.batch_id, spec.attempt, RUN, json.dumps(spec.to_json()), slot_id=slot_id)
        self.link.feed.put_nowait(a)

    def send(self, kind: str, batch_id: int = 0, attempt: int = 1, uris: tuple[str, ...] = ()) -> None:
        self.link.feed.put_nowait(Assignment(batch_id, attempt, kind, checkpoint_uris=uris))

    async def report(self, batch_id: int, attempt: int = 1, timeout: float = 120) -> Any:
        await until(lambda: any(r.batch_id == batch_id and r.attempt == attempt for r in self.link.reports), timeout)
        return self.link.report_of(batch_id, attempt)


async def until(cond: Any, timeout: float = 120) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (got := cond()):
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.02)
    return got


def launcher_of(
    kind: str, store: LocalCheckpointStore, tmp: Path, reuse: ReusePolicy | None = None, user_path: Path | None = None
) -> WorkerLauncher:
    """A launcher of ``kind`` for a test's node manager; its workers import user modules from ``user_path``."""
    env = {USER_PATH_ENV: str(user_path)} if user_path is not None else None
    if kind == "exec":
        return ExecLauncher(
            str(store.root), tmp / "work", prestart=True, progress_interval_s=0.0, reuse=reuse, extra_env=env
        )
    return ForkserverLauncher(
        str(store.root), tmp / "work", progress_interval_s=0.0, preload=["torch._dynamo"], reuse=reuse, extra_env=env
    )


async def start_node_manager(
    tmp: Path,
    slots: int = 1,
    launcher: str = "forkserver",
    close_timeout_s: float = 10.0,
    reuse: ReusePolicy | None = None,
    user_path: Path | None = None,
    slot_infos: Sequence[SlotInfo] | None = None,  # instead of ``slots`` CPU slots
    **kw: Any,
) -> Harness:
    link = FakeLink()
    store = LocalCheckpointStore(tmp / "ckpt", fsync=False)
    nm = NodeManager(
        link,
        GrpcReporter(link, initial_backoff_s=0.01, close_timeout_s=close_timeout_s),
        list(slot_infos) if slot_infos is not None else [SlotInfo(f"cpu{i}") for i in range(slots)],
        launcher_of(launcher, store, tmp, reuse, user_path),
        node_manager_id="nm-test",
        store=store,
        reconnect_initial_s=0.01,
        reconnect_max_s=0.05,
        stop_grace_s=10,
        **kw,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(nm.run(stop))
    await until(lambda: nm.connected.is_set() or task.done())
    return Harness(nm, link, store, stop, task, tmp)


def spec_of(batch_id: int, steps: int = 10, trainer: str | None = None, **fixed: Any) -> BatchSpec:
    kw: dict[str, Any] = {"trainer": trainer} if trainer else {}
    return digits_batch(
        [(1, 0, steps, HP)], batch_id=batch_id, fixed_values=fixed, evals=[(1, steps)], saves=[(1, steps)], **kw
    )
