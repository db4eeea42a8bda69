"""Group commit for calls that arrive together.

A node manager's slots often finish together, so their ``ReportBatch`` calls arrive within a
millisecond of each other, and on SQLite every transaction takes the one write turn. ``Grouper`` runs
its function, in a worker thread, over every item that arrived while the previous call ran: the first
call of a quiet period goes at once (no added latency), and those that queue behind it share one
transaction instead of waiting for a turn each.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class Grouper(Generic[T, R]):
    """``await submit(item)`` returns ``fn(items)``'s result for ``item``. ``fn`` gets at most
    ``max_items`` items and returns, per item in order, its result or the exception for it alone. When
    ``fn`` raises for a group of several, each item is run again alone, so that one bad item fails
    only its own call."""

    def __init__(self, fn: Callable[[list[T]], Sequence[R | Exception]], *, max_items: int = 64) -> None:
        if max_items < 1:
            raise ValueError("max_items must be at least 1")
        self.fn = fn
        self.max_items = max_items
        self.calls = 0  # fn calls so far (what grouping saves shows as calls < items)
        self._pending: list[tuple[T, asyncio.Future[R]]] = []
        self._drain: asyncio.Task[None] | None = None

    async def submit(self, item: T) -> R:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[R] = loop.create_future()
        fut.add_done_callback(_retrieve)  # its caller may be gone: no "exception never retrieved"
        self._pending.append((item, fut))
        if self._drain is None:
            self._drain = loop.create_task(self._run())
        # A caller that goes away does not take its item out: a report is applied even when the node
        # manager stopped waiting for the answer (its retry is then a stale repeat, ignored).
        return await asyncio.shield(fut)

    async def _run(self) -> None:
        try:
            while self._pending:
                group, self._pending = self._pending[: self.max_items], self._pending[self.max_items :]
                results = await self._call([item for item, _ in group])
                for (_, fut), res in zip(group, results, strict=True):
                    if fut.done():
                        continue
                    if isinstance(res, Exception):
                        fut.set_exception(res)
                    else:
                        fut.set_result(res)
        finally:
            self._drain = None
            for _, fut in self._pending:  # only when this task was cancelled (the loop is closing)
                if not fut.done():
                    fut.cancel()
            self._pending = []

    async def _call(self, items: list[T]) -> list[R | Exception]:
        self.calls += 1
        try:
            got = list(await asyncio.to_thread(self.fn, items))
        except Exception as exc:
            if len(items) == 1:
                return [exc]
            log.info("a group of %d failed (%s); running each alone", len(items), exc)
            return [r for item in items for r in await self._call([item])]
        if len(got) != len(items):
            raise RuntimeError(f"grouped call returned {len(got)} results for {len(items)} items")
        return got


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()
