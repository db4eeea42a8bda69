"""Coordination contract: the same behaviour from real Redis and the in-process implementation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest

from stagetree.master.coordination import Coordination, InProcessCoordination, RedisCoordination
from tests.integration.master.conftest import REDIS_URL
from tests.integration.master.helpers import unique


@pytest.fixture(params=["redis", "inprocess"])
def coord(request: pytest.FixtureRequest) -> Iterator[Coordination]:
    c: Coordination = (
        RedisCoordination(REDIS_URL, prefix=unique("st")) if request.param == "redis" else InProcessCoordination()
    )
    yield c
    c.close()


# TTLs of seconds, and their lapse waited for: on a loaded machine a few tenths of a second can pass
# between two lines of a test.
TTL_S = 3.0


def _within(seconds: float, cond: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_heartbeat_keys_expire(coord: Coordination) -> None:
    coord.heartbeat("a", TTL_S)
    coord.heartbeat("b", 120)
    assert coord.alive(["a", "b", "c"]) == {"a", "b"}
    assert _within(60, lambda: coord.alive(["a", "b", "c"]) == {"b"})
    assert coord.alive([]) == set()


def test_leader_lease_is_exclusive_until_it_lapses(coord: Coordination) -> None:
    assert coord.acquire_lease("m1", TTL_S)
    assert not coord.acquire_lease("m2", TTL_S)
    assert coord.acquire_lease("m1", TTL_S)  # renew
    assert _within(60, lambda: coord.acquire_lease("m2", 5))  # the standby takes over once it lapses
    assert not coord.acquire_lease("m1", 5)
    coord.release_lease("m1")  # not the holder: no effect
    assert not coord.acquire_lease("m1", 5)
    coord.release_lease("m2")
    assert coord.acquire_lease("m1", 5)


async def test_wait_is_woken_by_notify_and_times_out_otherwise(coord: Coordination) -> None:
    assert not await coord.wait("ch", 0.1)
    waiter = asyncio.create_task(coord.wait("ch", 5))
    await asyncio.sleep(0.1)  # let it subscribe
    t0 = time.monotonic()
    await asyncio.to_thread(coord.notify, "ch")
    assert await waiter
    assert time.monotonic() - t0 < 2
    assert not await coord.wait("other", 0.05)


async def test_a_subscription_keeps_a_notify_that_comes_while_nobody_waits(coord: Coordination) -> None:
    # a round loop is busy when the wake-up comes: its next wait must return at once, not time out
    sub = await coord.subscribe("busy")
    try:
        assert not await sub.wait(0.05)
        await asyncio.to_thread(coord.notify, "busy")
        await asyncio.to_thread(coord.notify, "busy")
        await asyncio.sleep(0.05)  # the notifies land while nobody waits
        t0 = time.monotonic()
        assert await sub.wait(5)
        assert time.monotonic() - t0 < 1
        assert not await sub.wait(0.05)  # the two coalesced into one wake-up
        assert not await coord.wait("busy", 0.01)  # a one-off wait does not see old notifies
    finally:
        await sub.close()
    await asyncio.to_thread(coord.notify, "busy")  # closed: nothing left to wake, nothing raises


async def test_notify_many_wakes_each_channel_named_and_no_other(coord: Coordination) -> None:
    subs = {ch: await coord.subscribe(ch) for ch in ("nm-a", "nm-b", "nm-c")}
    try:
        await asyncio.to_thread(coord.notify_many, ["nm-a", "nm-c"])
        await asyncio.to_thread(coord.notify_many, [])  # nothing to wake: no error
        assert await subs["nm-a"].wait(5) and await subs["nm-c"].wait(5)
        assert not await subs["nm-b"].wait(0.1)
    finally:
        for sub in subs.values():
            await sub.close()
