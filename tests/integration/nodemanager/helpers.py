"""Helpers of the node manager's integration tests: digits configs, waiting, a recording reporter, and
a node manager running in the test's event loop against the test's master."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stagetree.core.batch import BatchSpec
from stagetree.master.app import MasterApp
from stagetree.master.auth import Principal
from stagetree.master.service import SubmitItem
from stagetree.master.store.records import RequestRecord
from stagetree.nodemanager.agent import NodeManager
from stagetree.nodemanager.app import build_node_manager
from stagetree.nodemanager.gpu import StaticGpuProbe
from stagetree.nodemanager.link import GrpcMasterLink
from stagetree.nodemanager.reporting import AttemptExit, AttemptInfo, BatchReporter, GrpcReporter
from stagetree.nodemanager.settings import NodeManagerSettings
from tests.integration.conftest import ADMIN_TOKEN

ALICE = Principal("alice")
ADMIN = Principal("admin", admin=True)
DIGITS = "stagetree.nodemanager.examples.digits:DigitsMLP"
FAULTY = "stagetree.nodemanager.examples.faults:FaultyDigits"
FINISHED_STATES = ("DONE", "FAILED", "CANCELLED")


def unique(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def fixed_part(trainer: str = DIGITS, seed: int = 0, **values: Any) -> dict[str, Any]:
    return {"trainer": trainer, "dataset": "sklearn-digits", "model": "", "seed": seed, "values": values}


def config_json(fixed: Mapping[str, Any], **tuned: Any) -> str:
    tuned = {k: (v.to_json() if hasattr(v, "to_json") else v) for k, v in tuned.items()}
    return json.dumps({"fixed": dict(fixed), "tuned": tuned})


async def until(cond: Callable[[], Any], timeout: float = 120.0, what: str = "condition") -> Any:
    """Poll ``cond`` (sync, cheap) until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.05)


async def submit(app: MasterApp, items: list[tuple[str, int]], study: str | None = None) -> tuple[str, list[int]]:
    """Submit ``(config_json, step)`` items as alice; returns the study id and the request ids."""
    if study is None:
        study = (await asyncio.to_thread(app.service.create_study, ALICE, unique("study"))).id
    sub = [SubmitItem(unique("r"), cfg, step) for cfg, step in items]
    recs = await asyncio.to_thread(app.service.submit, ALICE, study, sub)
    return study, [r.id for r in recs]


async def finished(app: MasterApp, study: str, ids: list[int], timeout: float = 180.0) -> list[RequestRecord]:
    """Wait until every request is DONE, FAILED or CANCELLED; the records in ``ids`` order."""

    def check() -> list[RequestRecord] | None:
        recs = {r.id: r for r in app.service.get_requests(ALICE, study, ids)}
        if all(recs[i].state in FINISHED_STATES for i in ids):
            return [recs[i] for i in ids]
        return None

    result: list[RequestRecord] = await until(check, timeout, f"requests {ids} to finish")
    return result


class RecordingReporter(BatchReporter):
    """Records every event and end, then hands them to ``inner``."""

    def __init__(self, inner: BatchReporter) -> None:
        super().__init__()
        self.inner = inner
        self.events: list[tuple[AttemptInfo, str, dict[str, Any]]] = []
        self.ends: list[tuple[AttemptInfo, AttemptExit]] = []

    async def _event(self, info: AttemptInfo, kind: str, payload: dict[str, Any]) -> None:
        self.events.append((info, kind, payload))
        await self.inner.event(info, kind, payload)

    async def _finish(self, info: AttemptInfo, end: AttemptExit) -> None:
        self.ends.append((info, end))
        await self.inner.finish(info, end)

    async def close(self) -> None:
        await self.inner.close()

    def of(self, kind: str, batch_id: int | None = None) -> list[dict[str, Any]]:
        return [p for i, k, p in self.events if k == kind and (batch_id is None or i.batch_id == batch_id)]

    def progress(self, batch_id: int) -> int:
        return max((p["step"] for p in self.of("progress", batch_id)), default=-1)

    def steps_trained(self) -> int:
        return sum(p["steps"] for p in self.of("batch_finished"))


@dataclass
class RunningNodeManager:
    nm: NodeManager
    reporter: RecordingReporter
    stop: asyncio.Event
    task: asyncio.Task[None]
    checkpoint_root: Path
    specs: list[BatchSpec] = field(default_factory=list)

    async def close(self, timeout: float = 30.0) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, timeout)


def nm_settings(target: str, tmp: Path, **overrides: Any) -> NodeManagerSettings:
    values: dict[str, Any] = {
        "master_target": target,
        "admin_token": ADMIN_TOKEN,
        "node_manager_id": unique("nm"),
        "checkpoint_root": str(tmp / "ckpt"),
        "work_dir": str(tmp / "work"),
        "cpu_slots": 1,
        "threads_per_worker": 1,
        "progress_interval_s": 0.0,
        "reconnect_initial_s": 0.1,
        "reconnect_max_s": 0.5,
        "stop_grace_s": 10.0,
    }
    values.update(overrides)
    return NodeManagerSettings(**values)


async def start_node_manager(target: str, tmp: Path, **overrides: Any) -> RunningNodeManager:
    """A node manager (CPU-only, direct reports) running in this loop, connected to the master."""
    settings = nm_settings(target, tmp, **overrides)
    link = GrpcMasterLink(target, ADMIN_TOKEN, max_backoff_s=settings.reconnect_max_s)
    reporter = RecordingReporter(GrpcReporter(link, max_backoff_s=settings.reconnect_max_s))
    built = build_node_manager(settings, link=link, reporter=reporter, probe=StaticGpuProbe())
    stop = asyncio.Event()
    task = asyncio.create_task(built.run(stop))
    await until(lambda: built.connected.is_set() or task.done(), 30, "the node manager to connect")
    if task.done():
        task.result()
    return RunningNodeManager(built, reporter, stop, task, Path(settings.checkpoint_root))
