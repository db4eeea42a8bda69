"""The assignment streams of a master process, served together.

Each node manager holds one ``StreamAssignments`` open; a master of a 200-server cluster holds 200. Each
stream used to look at the database on its own: once per wake-up (a round that placed work on fifty
node managers woke fifty streams, fifty transactions) and once every few seconds when idle (40
transactions a second for nothing; ``tests.bench.scale``). The hub changes two things:

- **Takes are grouped** (``Grouper``): the streams a round wakes claim their attempts and actions in
  one transaction, whatever their number; a lone wake-up goes at once.
- **One sweep for lost wake-ups**: every ``SWEEP_S`` the hub asks once which node managers have
  anything unsent (two looks at a few rows) and wakes only the streams of those, through the same
  channel as a round's wake-up. A stream's own look when nothing woke it is then only a last resort,
  every ``STREAM_POLL_S``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from stagetree.core.lifecycle import Assignment
from stagetree.master.api.grouping import Grouper
from stagetree.master.coordination import Coordination
from stagetree.master.service import ch_node_manager

log = logging.getLogger(__name__)

SWEEP_S = 5.0  # unsent work is found this long after a wake-up was lost, at most
STREAM_POLL_S = 30.0  # a stream looks for itself this often when nothing wakes it
TAKE_GROUP = 256  # node managers per take transaction at most


class AssignmentHub:
    def __init__(
        self,
        coordination: Coordination,
        take_many: Callable[[Sequence[str]], dict[str, list[Assignment]]],
        with_unsent: Callable[[], set[str]],
    ) -> None:
        self.coord = coordination
        self.take_many = take_many
        self.with_unsent = with_unsent
        self._takes: Grouper[str, list[Assignment]] = Grouper(self._take_group, max_items=TAKE_GROUP)
        self._open: dict[str, int] = {}  # node manager -> its streams open here (a reconnect may overlap)
        self._sweeper: asyncio.Task[None] | None = None

    @property
    def transactions(self) -> int:
        """Take transactions made so far (fewer than takes when they were grouped)."""
        return self._takes.calls

    def opened(self, nm: str) -> None:
        """A stream of ``nm`` opened here (its wake-up subscription is open by now)."""
        self._open[nm] = self._open.get(nm, 0) + 1
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="assignment-sweep")

    def closed(self, nm: str) -> None:
        n = self._open.get(nm, 0) - 1
        if n > 0:
            self._open[nm] = n
        else:
            self._open.pop(nm, None)

    async def take(self, nm: str) -> list[Assignment]:
        """``nm``'s unsent attempts and actions, each marked sent (grouped with the other streams' takes)."""
        return await self._takes.submit(nm)

    def _take_group(self, nms: list[str]) -> list[list[Assignment] | Exception]:
        got = self.take_many(nms)
        out: list[list[Assignment] | Exception] = []
        seen: set[str] = set()
        for nm in nms:  # two streams of one node manager (a reconnect): the first gets what there is
            out.append([] if nm in seen else got.get(nm, []))
            seen.add(nm)
        return out

    async def _sweep(self) -> None:
        while self._open:
            await asyncio.sleep(SWEEP_S)
            try:
                await self.sweep_once()
            except Exception as e:  # the database or Redis is away: the streams' own looks remain
                log.warning("assignment sweep failed; retrying in %.0f s (%s)", SWEEP_S, e)

    async def sweep_once(self) -> list[str]:
        """Wake the streams here of the node managers that have work unsent; returns those."""
        unsent = await asyncio.to_thread(self.with_unsent)
        mine = sorted(unsent.intersection(self._open))
        if mine:
            await asyncio.to_thread(self.coord.notify_many, [ch_node_manager(nm) for nm in mine])
        return mine
