"""Grouper: calls that arrive while one runs share the next; a lone call goes at once; one bad item
fails only its own call."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import pytest

from stagetree.core.errors import InvalidArgument
from stagetree.master.api.grouping import Grouper


class Recorder:
    """fn for a Grouper: doubles ints, rejects negative ones, and can be held inside a call."""

    def __init__(self, *, raise_on_negative: bool = False) -> None:
        self.groups: list[list[int]] = []
        self.release = threading.Event()
        self.release.set()
        self.entered = threading.Event()
        self.raise_on_negative = raise_on_negative

    def __call__(self, items: list[int]) -> Sequence[int | Exception]:
        self.groups.append(list(items))
        self.entered.set()
        self.release.wait(10)
        if self.raise_on_negative and any(i < 0 for i in items):
            raise InvalidArgument(f"negative item in {items}")
        return [InvalidArgument(f"{i} is negative") if i < 0 else 2 * i for i in items]


async def _held_first(g: Grouper[int, int], rec: Recorder, first: int) -> asyncio.Task[int]:
    """Submit ``first`` and wait until fn is running it (and held there)."""
    rec.release.clear()
    rec.entered.clear()
    task = asyncio.ensure_future(g.submit(first))
    await asyncio.to_thread(rec.entered.wait, 10)
    return task


async def _behind_one(g: Grouper[int, int], rec: Recorder, first: int, rest: Sequence[int]) -> list[object]:
    """Submit ``first``; while fn holds it, submit ``rest``; then let fn go. Every call's result or
    exception, in submission order."""
    held = await _held_first(g, rec, first)
    queued = [asyncio.ensure_future(g.submit(i)) for i in rest]
    await asyncio.sleep(0.01)
    rec.release.set()
    return list(await asyncio.gather(held, *queued, return_exceptions=True))


async def test_a_lone_call_goes_at_once_and_those_behind_it_share_one_call() -> None:
    rec = Recorder()
    g: Grouper[int, int] = Grouper(rec)
    assert await g.submit(1) == 2
    assert await _behind_one(g, rec, 2, (3, 4, 5)) == [4, 6, 8, 10]
    assert rec.groups == [[1], [2], [3, 4, 5]]
    assert g.calls == 3


async def test_an_item_rejected_alone_fails_only_its_own_call() -> None:
    rec = Recorder()
    g: Grouper[int, int] = Grouper(rec)
    got = await _behind_one(g, rec, 1, (2, -3, 4))
    assert got[:2] == [2, 4] and got[3] == 8
    assert isinstance(got[2], InvalidArgument) and "-3 is negative" in str(got[2])
    assert rec.groups == [[1], [2, -3, 4]]


async def test_a_group_whose_call_raises_is_run_again_item_by_item() -> None:
    rec = Recorder(raise_on_negative=True)
    g: Grouper[int, int] = Grouper(rec)
    got = await _behind_one(g, rec, 1, (2, -3, 4))
    assert got[0] == 2 and got[1] == 4 and got[3] == 8 and isinstance(got[2], InvalidArgument)
    assert rec.groups == [[1], [2, -3, 4], [2], [-3], [4]]


async def test_groups_are_capped_at_max_items() -> None:
    rec = Recorder()
    g: Grouper[int, int] = Grouper(rec, max_items=2)
    assert await _behind_one(g, rec, 0, range(1, 6)) == [0, 2, 4, 6, 8, 10]
    assert rec.groups == [[0], [1, 2], [3, 4], [5]]


async def test_a_caller_that_goes_away_still_has_its_item_applied() -> None:
    rec = Recorder()
    g: Grouper[int, int] = Grouper(rec)
    first = await _held_first(g, rec, 1)
    gone = asyncio.ensure_future(g.submit(7))
    await asyncio.sleep(0.01)
    gone.cancel()
    rec.release.set()
    assert await first == 2
    with pytest.raises(asyncio.CancelledError):
        await gone
    for _ in range(100):
        if len(rec.groups) == 2:
            break
        await asyncio.sleep(0.01)
    assert rec.groups == [[1], [7]]


def test_max_items_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Grouper(Recorder(), max_items=0)
