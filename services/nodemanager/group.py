"""A batch attempt on several slots: its rank processes, watched and ended as one worker.

``WorkerGroup`` is a ``WorkerProcess`` made of the ``n`` worker processes of one attempt (rank ``r``
on the attempt's ``r``-th slot, one ``torch.distributed`` group: ``runtime.distributed``), so the node
manager follows, preempts, kills and reports it like a one-slot worker:

* events: rank 0's, as they come, except the terminal one; the other ranks write only ``batch_failed``.
  Terminal events are held until every rank has exited, then the one that says why the group ended
  goes out (one attempt, one end);
* the first rank to end badly (a non-zero status or a signal, without the node manager killing it)
  ends the others: every other rank is SIGKILL-ed at once (they would wait in a collective for a peer
  that is gone). The group's end is its ``cause``'s: its ``batch_failed`` (an error of the user's code,
  an out of memory), or its death (its exit status, its log's tail). Of the ranks that end badly
  together (within ``SETTLE_S``, and again once all reports are in), the cause is one killed by a
  signal, else one that died without a word, else one that reported its own failure; a rank's report
  that a collective failed because a peer went away (``PEER_LOST_NOTE``) is never the end. When the
  ranks end well, rank 0's terminal event is the end; a rank still running ``STRAGGLER_GRACE_S`` after
  another ended well is killed;
* ``send_signal`` (a preemption) goes to every rank; ``kill`` kills every rank.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from stagetree.nodemanager.runtime.ranks import PEER_LOST_NOTE
from stagetree.nodemanager.workers import WorkerProcess

log = logging.getLogger(__name__)

TERMINAL = frozenset({"batch_finished", "batch_preempted", "batch_failed"})
STRAGGLER_GRACE_S = 30.0
SETTLE_S = 0.3  # after a rank ends badly, how long the ranks that end with it are waited for


class WorkerGroup(WorkerProcess):
    """The rank processes of one attempt (rank ``r`` is ``workers[r]``) as one worker."""

    def __init__(self, workers: Sequence[WorkerProcess], straggler_grace_s: float = STRAGGLER_GRACE_S) -> None:
        if len(workers) < 2:
            raise ValueError("a worker group has at least two ranks")
        first = workers[0]
        super().__init__(first.slot, first.log_path, asyncio.StreamReader(), None)
        self.workers = list(workers)
        self.cause: int | None = None  # the rank whose bad end ended the group
        self._bad: list[int] = []  # the ranks that ended badly (not killed from here), as seen to end
        self._grace = straggler_grace_s
        self._terminals: dict[int, tuple[str, dict[str, Any]]] = {}
        self._supervisor: asyncio.Task[None] | None = None

    @property
    def world_size(self) -> int:
        return len(self.workers)

    @property
    def pid(self) -> int:
        return self.workers[0].pid

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self.workers]

    @property
    def returncode(self) -> int | None:
        codes = [w.returncode for w in self.workers]
        if any(c is None for c in codes):
            return None
        if self.cause is not None:
            return codes[self.cause]
        return next((c for c in codes if c != 0), 0)

    async def wait(self) -> int:
        await asyncio.shield(self._supervise())
        code = self.returncode
        assert code is not None
        return code

    def _supervise(self) -> asyncio.Task[None]:
        if self._supervisor is None:
            self._supervisor = asyncio.get_running_loop().create_task(self._watch_ranks())
        return self._supervisor

    async def _watch_ranks(self) -> None:
        waits = {asyncio.ensure_future(w.wait()): r for r, w in enumerate(self.workers)}
        deadline: float | None = None
        loop = asyncio.get_running_loop()
        try:
            while waits:
                timeout = None if deadline is None else max(0.0, deadline - loop.time())
                done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if not done:  # ranks that outlived a rank that ended well by the grace: stuck
                    log.warning("ranks still running %.0f s after a peer ended; killing them", self._grace)
                    self._end_the_rest()
                    deadline = None
                    continue
                for fut in done:
                    rank = waits.pop(fut)
                    if fut.result() != 0:
                        self._bad.append(rank)
                    elif deadline is None and waits:
                        deadline = loop.time() + self._grace
                if self._bad and self.cause is None and not self.killed:
                    # The ranks that end in the same moment: a rank that saw its peer go fails right after it.
                    if waits:
                        more, _ = await asyncio.wait(waits, timeout=SETTLE_S)
                        for fut in more:
                            rank = waits.pop(fut)
                            if fut.result() != 0:
                                self._bad.append(rank)
                    self._settle_cause()
                    assert self.cause is not None
                    log.warning(
                        "rank %d of %d ended with status %s: ending the other ranks",
                        self.cause,
                        self.world_size,
                        self.workers[self.cause].returncode,
                        extra={"pid": self.workers[self.cause].pid},
                    )
                    self._end_the_rest()
        finally:
            for fut in waits:
                fut.cancel()

    def _settle_cause(self) -> None:
        """The rank whose end is the group's, among those that ended badly: one killed by a signal, then
        one that died without a word, then one that reported its own failure, then one that reported
        losing a peer; the first seen to end among equals. Decided when the first ranks end (to end the
        others), and again once every rank's report is in."""
        if not self._bad or self.killed:
            return

        def blame(rank: int) -> tuple[int, int]:
            code = self.workers[rank].returncode
            term = self._terminals.get(rank)
            if code is not None and code < 0:
                kind = 0
            elif term is None:
                kind = 1
            elif not str(term[1].get("error", "")).startswith(PEER_LOST_NOTE):
                kind = 2
            else:
                kind = 3
            return (kind, self._bad.index(rank))

        self.cause = min(self._bad, key=blame)
        self.log_path = self.workers[self.cause].log_path

    def _end_the_rest(self) -> None:
        for w in self.workers:
            if w.returncode is None:
                w.kill()

    async def events(self) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        queue: asyncio.Queue[tuple[int, str, dict[str, Any]] | None] = asyncio.Queue()

        async def read(rank: int, worker: WorkerProcess) -> None:
            try:
                async for kind, payload in worker.events():
                    await queue.put((rank, kind, payload))
            finally:
                await queue.put(None)

        self._supervise()
        readers = [asyncio.ensure_future(read(r, w)) for r, w in enumerate(self.workers)]
        try:
            open_streams = len(readers)
            while open_streams:
                item = await queue.get()
                if item is None:
                    open_streams -= 1
                    continue
                rank, kind, payload = item
                if kind in TERMINAL:
                    self._terminals.setdefault(rank, (kind, payload))
                elif rank == 0:
                    yield kind, payload
            await self.wait()
            self._settle_cause()  # now with every rank's report
            end = self.terminal()
            if end is not None:
                yield end
        finally:
            for t in readers:
                t.cancel()

    def terminal(self) -> tuple[str, dict[str, Any]] | None:
        """The terminal event that says how the group ended (None: it ended without one, e.g. the
        cause died silently, or the node manager killed it)."""
        if self.cause is not None:
            return self._terminals.get(self.cause)
        if self.killed:
            return None
        return self._terminals.get(0)

    def send_signal(self, sig: int) -> None:
        for w in self.workers:
            w.send_signal(sig)

    def kill(self) -> None:
        if self.returncode is None:
            self.killed = True
        for w in self.workers:
            w.kill()

    def kill_session(self) -> None:
        for w in self.workers:
            w.kill_session()

    def stderr_tail(self, max_bytes: int = 4000) -> str:
        return self.workers[self.cause or 0].stderr_tail(max_bytes)

    async def send(self, data: bytes, *, close: bool) -> None:
        raise BrokenPipeError("a worker group takes its specs rank by rank")
