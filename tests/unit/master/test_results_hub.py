"""The results hub: one read per notice for every open stream, each stream given only its own ids."""

from __future__ import annotations

import asyncio

import pytest

from stagetree.core.lifecycle import RequestState
from stagetree.master.api.results_hub import MAX_GAP_S, ResultsHub, read_gap
from stagetree.master.coordination import InProcessCoordination
from stagetree.master.service import CH_RESULTS
from stagetree.master.store.records import RequestRecord


class Ledger:
    """Finished requests by id, and the reads made of them."""

    def __init__(self) -> None:
        self.done: dict[int, RequestRecord] = {}
        self.reads: list[list[int]] = []

    def finish(self, *ids: int) -> None:
        for i in ids:
            self.done[i] = RequestRecord(i, f"s{i // 100}", 1, i, 10, RequestState.DONE, f"c{i}", None, {"loss": i})

    def finished_among(self, ids: list[int]) -> list[RequestRecord]:
        self.reads.append(ids)
        return [self.done[i] for i in ids if i in self.done]


async def _until(pred, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    async def poll() -> None:
        while not pred():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout)


def test_one_read_per_notice_serves_every_stream_its_own_ids() -> None:
    async def go() -> None:
        coord, ledger = InProcessCoordination(), Ledger()
        hub = ResultsHub(coord, ledger.finished_among)
        watches = [await hub.watch([s * 100 + k for k in range(3)]) for s in range(20)]
        await asyncio.sleep(0.05)
        before = len(ledger.reads)
        ledger.finish(101, 102, 1901)
        coord.notify(CH_RESULTS)
        got = {i: await w.next(2.0) for i, w in enumerate(watches) if i in (1, 19)}
        assert [r.id for r in got[1]] == [101, 102] and [r.id for r in got[19]] == [1901]
        assert len(ledger.reads) - before == 1  # twenty streams, one read
        assert ledger.reads[-1] == sorted(s * 100 + k for s in range(20) for k in range(3))  # the union, once
        assert watches[1].wanted == {100} and watches[0].wanted == {0, 1, 2}
        assert await watches[0].next(0.05) == []  # nothing of its own finished
        for w in watches:
            hub.unwatch(w)
        await _until(lambda: not hub.running)  # no watch left: the hub stops and lets its subscription go

    asyncio.run(go())


def test_a_result_found_twice_is_handed_over_once_and_a_new_watch_restarts_the_hub() -> None:
    async def go() -> None:
        coord, ledger = InProcessCoordination(), Ledger()
        hub = ResultsHub(coord, ledger.finished_among)
        w = await hub.watch([7, 8])
        ledger.finish(7)
        assert [r.id for r in w.take(ledger.finished_among([7, 8]))] == [7]  # the stream's own first look
        coord.notify(CH_RESULTS)
        await asyncio.sleep(0.1)
        assert await w.next(0.05) == []  # the hub found 7 too: not handed over again
        hub.unwatch(w)
        await _until(lambda: not hub.running)
        w2 = await hub.watch([9])
        assert hub.running
        ledger.finish(9)
        coord.notify(CH_RESULTS)
        assert [r.id for r in await w2.next(2.0)] == [9]
        assert w2.wanted == set()
        hub.unwatch(w2)
        await _until(lambda: not hub.running)

    asyncio.run(go())


def test_reads_are_spaced_by_their_own_cost_up_to_a_cap() -> None:
    # a tuner waiting on one result at a time: a millisecond's read lets the next come 9 ms later
    assert read_gap(0.001) == pytest.approx(0.009)
    # 1,600 waited-for ids at 1,600 slots: tens of milliseconds a read, a few reads a second
    assert read_gap(0.02) == pytest.approx(0.18)
    assert read_gap(0.1) == MAX_GAP_S == read_gap(10.0)
    assert read_gap(-1.0) == 0.0  # a clock step back
