"""Test doubles of the node manager's ports: an in-memory ``MasterLink`` driven by the test, a
trainer that records its worker's environment, and a bus that can be taken down."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from stagetree.bus.inprocess import InProcessBus
from stagetree.bus.messages import Message
from stagetree.core.errors import Unavailable
from stagetree.core.slots import SlotInfo
from stagetree.nodemanager.examples.digits import DigitsMLP
from stagetree.nodemanager.link import Assignment, BatchReport, MasterLink


class FakeLink(MasterLink):
    """The master as the test scripts it: assignments (or errors) pushed on ``feed``, reports kept."""

    def __init__(self, heartbeat_s: float = 0.05) -> None:
        self.heartbeat_s = heartbeat_s
        self.feed: asyncio.Queue[Assignment | Exception] = asyncio.Queue()
        self.registrations: list[tuple[str, list[SlotInfo]]] = []
        self.heartbeats = 0
        self.heartbeat_known: list[list[tuple[int, int]] | None] = []  # what each heartbeat listed
        self.reports: list[BatchReport] = []
        self.register_errors: list[Exception] = []
        self.heartbeat_errors: list[Exception] = []
        self.report_errors: list[Exception] = []
        self.left: list[list[tuple[int, int]]] = []  # what each leave listed, with the reports sent then
        self.reports_at_leave: list[int] = []
        self.closed = False

    async def register(self, node_manager_id: str, address: str, slots: Sequence[SlotInfo]) -> float:
        if self.register_errors:
            raise self.register_errors.pop(0)
        self.registrations.append((node_manager_id, list(slots)))
        return self.heartbeat_s

    async def heartbeat(self, node_manager_id: str, known: Sequence[tuple[int, int]] | None = None) -> None:
        self.heartbeats += 1
        self.heartbeat_known.append(None if known is None else list(known))
        if self.heartbeat_errors:
            raise self.heartbeat_errors.pop(0)

    async def assignments(self, node_manager_id: str) -> AsyncIterator[Assignment]:
        while True:
            item = await self.feed.get()
            if isinstance(item, Exception):
                raise item
            yield item

    async def leave(self, node_manager_id: str, known: Sequence[tuple[int, int]]) -> list[int]:
        self.left.append(list(known))
        self.reports_at_leave.append(len(self.reports))
        return []

    async def report(self, report: BatchReport) -> list[int]:
        if self.report_errors:
            raise self.report_errors.pop(0)
        self.reports.append(report)
        return []

    async def close(self) -> None:
        self.closed = True

    def report_of(self, batch_id: int, attempt: int = 1) -> BatchReport:
        found = [r for r in self.reports if (r.batch_id, r.attempt) == (batch_id, attempt)]
        assert len(found) == 1, f"expected one report of {batch_id}/{attempt}, got {found}"
        return found[0]


class EnvRecorder(DigitsMLP):
    """Digits, writing the worker's device and thread environment to ``fixed["env_file"]`` at init."""

    prepare_ahead = False  # its init writes a file: a warm worker must not run it ahead

    KEYS = ("CUDA_VISIBLE_DEVICES", "STAGETREE_WORKER_THREADS", "OMP_NUM_THREADS", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")

    def init(self) -> None:
        import torch

        seen = {k: os.environ.get(k) for k in self.KEYS}
        seen["torch_threads"] = str(torch.get_num_threads())
        Path(str(self.fixed["env_file"])).write_text(json.dumps(seen))
        super().init()


ENV_RECORDER = "tests.unit.nodemanager.fakes:EnvRecorder"


class FlakyBus(InProcessBus):
    """An in-process bus whose publishes fail with Unavailable while ``down`` (``refused`` counts them)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.refused = 0

    def publish(self, topic: str, key: str, message: Message) -> None:
        if self.down:
            self.refused += 1
            raise Unavailable("broker down (test)")
        super().publish(topic, key, message)

    def publish_many(self, topic: str, key: str, messages: Sequence[Message]) -> None:
        if self.down:
            self.refused += 1
            raise Unavailable("broker down (test)")
        super().publish_many(topic, key, messages)


class ForkingDigits(DigitsMLP):
    """Digits whose init forks a process that outlives the worker and holds its pipes (as a
    data-loader worker can); its pid goes to ``fixed["pid_file"]``."""

    prepare_ahead = False  # its init starts a process: a warm worker must not run it ahead

    def init(self) -> None:
        import time

        pid = os.fork()
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        Path(str(self.fixed["pid_file"])).write_text(str(pid))
        super().init()


FORKING = "tests.unit.nodemanager.fakes:ForkingDigits"
