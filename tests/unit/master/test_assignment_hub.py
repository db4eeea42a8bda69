"""The assignment hub: the takes of streams woken together share a transaction, and one sweep (not a look
per stream) finds the work whose wake-up was lost."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence

import pytest

from stagetree.core.lifecycle import Assignment
from stagetree.master.api import assignment_hub
from stagetree.master.api.assignment_hub import AssignmentHub
from stagetree.master.coordination import InProcessCoordination
from stagetree.master.service import ch_node_manager


class Outbox:
    """Unsent assignments per node manager, and the transactions that took them."""

    def __init__(self) -> None:
        self.unsent: dict[str, list[Assignment]] = {}
        self.takes: list[list[str]] = []
        self.looks = 0
        self.slow = threading.Event()  # set: a take waits a little (so others queue behind it)
        self._lock = threading.Lock()

    def put(self, nm: str, batch_id: int) -> None:
        with self._lock:
            self.unsent.setdefault(nm, []).append(Assignment(batch_id, 1, spec_json=f'{{"batch_id":{batch_id}}}'))

    def take_many(self, nms: Sequence[str]) -> dict[str, list[Assignment]]:
        if self.slow.is_set():
            time.sleep(0.05)
        with self._lock:
            self.takes.append(list(nms))
            return {nm: self.unsent.pop(nm, []) for nm in dict.fromkeys(nms)}

    def with_unsent(self) -> set[str]:
        self.looks += 1
        with self._lock:
            return {nm for nm, got in self.unsent.items() if got}


def test_streams_woken_together_take_in_a_few_transactions_each_getting_its_own() -> None:
    async def go() -> None:
        box = Outbox()
        hub = AssignmentHub(InProcessCoordination(), box.take_many, box.with_unsent)
        nms = [f"nm{i}" for i in range(50)]
        for i, nm in enumerate(nms):
            box.put(nm, 100 + i)
        box.slow.set()
        got = await asyncio.gather(*(hub.take(nm) for nm in nms))
        assert [[a.batch_id for a in g] for g in got] == [[100 + i] for i in range(50)]
        assert hub.transactions <= 3 < len(nms)  # the first alone, the rest behind it together
        assert sorted(nm for t in box.takes for nm in t) == sorted(nms)

    asyncio.run(go())


def test_two_streams_of_one_node_manager_in_one_group_get_its_work_once() -> None:
    box = Outbox()
    box.put("nm", 7)
    hub = AssignmentHub(InProcessCoordination(), box.take_many, box.with_unsent)
    first, second = hub._take_group(["nm", "nm"])
    assert [a.batch_id for a in first] == [7] and second == []  # type: ignore[union-attr]


def test_the_sweep_wakes_only_the_streams_here_with_work_unsent(monkeypatch: pytest.MonkeyPatch) -> None:
    async def go() -> None:
        coord, box = InProcessCoordination(), Outbox()
        hub = AssignmentHub(coord, box.take_many, box.with_unsent)
        subs = {nm: await coord.subscribe(ch_node_manager(nm)) for nm in ("a", "b", "c")}
        for nm in ("a", "b"):
            hub.opened(nm)  # c's stream is on another master
        box.put("a", 1)  # its wake-up was lost
        box.put("c", 2)
        assert await hub.sweep_once() == ["a"]
        assert await subs["a"].wait(1.0)
        assert not await subs["b"].wait(0.05) and not await subs["c"].wait(0.05)
        hub.closed("a")
        hub.closed("b")
        for sub in subs.values():
            await sub.close()

    asyncio.run(go())


def test_the_sweeper_runs_while_streams_are_open_and_one_look_serves_them_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(assignment_hub, "SWEEP_S", 0.02)

    async def go() -> None:
        box = Outbox()
        hub = AssignmentHub(InProcessCoordination(), box.take_many, box.with_unsent)
        sweeps = 0
        sweep_once = hub.sweep_once

        async def counted() -> list[str]:
            nonlocal sweeps
            sweeps += 1
            return await sweep_once()

        hub.sweep_once = counted  # type: ignore[method-assign]
        for i in range(200):
            hub.opened(f"nm{i}")
        await until(lambda: sweeps >= 3)
        assert sweeps - 1 <= box.looks <= sweeps  # one look per sweep for 200 streams, not 200
        for i in range(200):
            hub.closed(f"nm{i}")
        sweeper = hub._sweeper
        assert sweeper is not None
        await until(sweeper.done)  # no stream open: the sweeper stops
        assert box.looks == sweeps

    asyncio.run(go())


async def until(cond: Callable[[], bool], timeout_s: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)
