"""One look at the database for every open results stream of a master process.

Each tuner follows its outstanding requests on one ``StreamResults``; a master serving fifty studies has
fifty such streams open. Waking each of them on every ``CH_RESULTS`` notice made fifty reads (and fifty
Redis subscriptions) per notice, and notices come several times a second on a busy cluster
(``tests.bench.scale``). The hub holds one subscription and, per notice, reads the finished requests
among the union of what every stream waits for in one query, then hands each stream its own.

A stream ``watch``es its ids (the hub's subscription is open by then), reads once itself (what finished
before it watched), then takes what the hub delivers. A result that finishes after the hub's last read
wakes the hub again, so none is missed; one found twice is handed over once (``ResultWatch.take``).
Ownership is checked when the stream opens: the hub only ever hands a stream the ids it named.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

from stagetree.master.coordination import Coordination
from stagetree.master.service import CH_RESULTS
from stagetree.master.store.records import RequestRecord

log = logging.getLogger(__name__)

POLL_S = 1.0  # the hub re-reads at least this often even when a wake-up is missed
# How often it reads at most follows what a read costs: after a read of t seconds the next waits for
# READ_SPACING x t (at most MAX_GAP_S), so reads take a tenth of the time at most whatever their size. On
# a busy cluster notices come ten times a second (each aggregator's every write) and a read looks up every
# request any stream waits for (1,600 ids at 1,600 slots: tens of milliseconds, a fifth of the database's
# time when read at every notice; tests.bench.scale): a few reads a second. A tuner waiting for one result
# at a time (one slot, one trial in flight) has its result read within milliseconds of the notice.
READ_SPACING = 9.0
MAX_GAP_S = 0.25


def read_gap(read_s: float) -> float:
    """How long the hub waits after a read that took ``read_s`` seconds before it reads again."""
    return min(MAX_GAP_S, READ_SPACING * max(0.0, read_s))


class ResultWatch:
    """The ids one stream waits for, and what the hub found for it since the last ``next``."""

    def __init__(self, ids: Sequence[int]) -> None:
        self.wanted = set(ids)
        self._found: list[RequestRecord] = []
        self._ready = asyncio.Event()

    def take(self, recs: Sequence[RequestRecord]) -> list[RequestRecord]:
        """The records among ``recs`` this watch still waits for; they are no longer waited for."""
        out = [r for r in recs if r.id in self.wanted]
        for r in out:
            self.wanted.discard(r.id)
        return out

    def deliver(self, recs: list[RequestRecord]) -> None:
        if recs:
            self._found += recs
            self._ready.set()

    async def next(self, timeout: float) -> list[RequestRecord]:
        """What the hub found since the last call (waits up to ``timeout`` seconds for something)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), timeout)
        self._ready.clear()
        out, self._found = self._found, []
        return out


class ResultsHub:
    """Reads finished requests for every watch of this process at once (see the module doc)."""

    def __init__(self, coordination: Coordination, finished_among: Callable[[list[int]], list[RequestRecord]]) -> None:
        self.coord = coordination
        self.finished_among = finished_among
        self._watches: set[ResultWatch] = set()
        self._task: asyncio.Task[None] | None = None
        self._subscribed: asyncio.Future[None] | None = None
        self.reads = 0  # queries made (tests and the bench read it)

    async def watch(self, ids: Sequence[int]) -> ResultWatch:
        """Start handing ``ids``' results to a new watch; returns once the hub listens for notices."""
        w = ResultWatch(ids)
        self._watches.add(w)
        if not self.running:
            self._subscribed = asyncio.get_running_loop().create_future()
            self._task = asyncio.create_task(self._run(self._subscribed), name="results-hub")
        assert self._subscribed is not None
        await asyncio.shield(self._subscribed)
        return w

    def unwatch(self, w: ResultWatch) -> None:
        self._watches.discard(w)

    async def _run(self, subscribed: asyncio.Future[None]) -> None:
        try:
            wakeups = await self.coord.subscribe(CH_RESULTS)
        except BaseException as e:
            subscribed.set_exception(e)
            raise
        subscribed.set_result(None)
        try:
            next_at = float("-inf")
            while self._watches:
                await wakeups.wait(POLL_S)
                wait = next_at - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)  # the notices meanwhile are answered by this read
                began = time.monotonic()
                await self._read_once()
                ended = time.monotonic()
                next_at = ended + read_gap(ended - began)
        except Exception:
            log.exception("results hub stopped; its streams read for themselves until the next one starts it")
        finally:
            self._task = None  # no await since the loop's last check: a watch from now on starts a new task
            await wakeups.close()

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _read_once(self) -> None:
        watches = list(self._watches)
        ids = sorted({i for w in watches for i in w.wanted})
        if not ids:
            return
        self.reads += 1
        recs = await asyncio.to_thread(self.finished_among, ids)
        for w in watches:
            w.deliver(w.take(recs))
