"""Coordination between master processes and with node managers: liveness, leader lease, wake-ups.

``Coordination`` is the port; ``RedisCoordination`` is the cluster adapter (heartbeat keys with a TTL,
a ``SET NX PX`` leader lease renewed by its holder only, pub/sub wake-ups) and
``InProcessCoordination`` the embedded one (same semantics inside one process, thread-safe). One
contract suite runs against both.

Wake-ups are hints, not messages, and they coalesce: a loop that waits on one channel again and again
(the scheduling round, a result stream, an assignment stream) holds a ``Subscription``, which keeps a
``notify`` that arrives while the loop is busy, so the next ``wait`` returns at once. A one-off ``wait``
only sees notifies that come after it started. Every waiter still re-checks the state it waits for and
waits with a timeout (a lost connection can lose a wake-up).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any, Protocol

log = logging.getLogger(__name__)


class Subscription(Protocol):
    async def wait(self, timeout: float) -> bool:
        """True when notified since the subscription started or the previous ``wait`` returned True
        (at once if so), False after ``timeout`` seconds without one."""
        ...

    async def close(self) -> None: ...


class Coordination(Protocol):
    def notify(self, channel: str) -> None: ...

    async def subscribe(self, channel: str) -> Subscription:
        """Start keeping notifies on ``channel``; ``close`` the subscription when done."""
        ...

    async def wait(self, channel: str, timeout: float) -> bool:
        """True when woken on ``channel`` before ``timeout`` seconds."""
        ...

    def heartbeat(self, node_manager_id: str, ttl_s: float) -> None: ...

    def alive(self, node_manager_ids: Iterable[str]) -> set[str]: ...

    def acquire_lease(self, holder: str, ttl_s: float) -> bool:
        """Take the leader lease, or renew it when ``holder`` has it; False while another holds it."""
        ...

    def release_lease(self, holder: str) -> None: ...

    def close(self) -> None: ...


class InProcessCoordination:
    """Embedded mode: everything in this process's memory."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._beats: dict[str, float] = {}
        self._lease: tuple[str, float] | None = None
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]] = {}
        self._subs: dict[str, set[_InProcessSubscription]] = {}

    def notify(self, channel: str) -> None:
        with self._lock:
            waiters = self._waiters.pop(channel, [])
            subs = list(self._subs.get(channel, ()))
        for loop, fut in waiters:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting any more
                loop.call_soon_threadsafe(_resolve, fut)
        for sub in subs:
            sub.wake()

    async def subscribe(self, channel: str) -> Subscription:
        sub = _InProcessSubscription(self, channel, asyncio.get_running_loop())
        with self._lock:
            self._subs.setdefault(channel, set()).add(sub)
        return sub

    def _unsubscribe(self, sub: _InProcessSubscription) -> None:
        with self._lock:
            subs = self._subs.get(sub.channel)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._subs[sub.channel]

    async def wait(self, channel: str, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        entry = (loop, fut)
        with self._lock:
            self._waiters.setdefault(channel, []).append(entry)
        try:
            await asyncio.wait_for(fut, timeout)
            return True
        except TimeoutError:
            return False
        finally:
            with self._lock:
                lst = self._waiters.get(channel)
                if lst and entry in lst:
                    lst.remove(entry)

    def heartbeat(self, node_manager_id: str, ttl_s: float) -> None:
        with self._lock:
            self._beats[node_manager_id] = self._clock() + ttl_s

    def alive(self, node_manager_ids: Iterable[str]) -> set[str]:
        now = self._clock()
        with self._lock:
            return {n for n in node_manager_ids if self._beats.get(n, 0.0) > now}

    def acquire_lease(self, holder: str, ttl_s: float) -> bool:
        now = self._clock()
        with self._lock:
            if self._lease is None or self._lease[1] <= now or self._lease[0] == holder:
                self._lease = (holder, now + ttl_s)
                return True
            return False

    def release_lease(self, holder: str) -> None:
        with self._lock:
            if self._lease is not None and self._lease[0] == holder:
                self._lease = None

    def close(self) -> None:
        pass


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class _InProcessSubscription:
    def __init__(self, owner: InProcessCoordination, channel: str, loop: asyncio.AbstractEventLoop) -> None:
        self.owner, self.channel, self._loop = owner, channel, loop
        self._event = asyncio.Event()

    def wake(self) -> None:  # from any thread
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting any more
            self._loop.call_soon_threadsafe(self._event.set)

    async def wait(self, timeout: float) -> bool:
        if not self._event.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event.wait(), timeout)
        woken = self._event.is_set()
        self._event.clear()
        return woken

    async def close(self) -> None:
        self.owner._unsubscribe(self)


_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2])
end
return redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) and 1 or 0
"""
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


class RedisCoordination:
    """Cluster mode: Redis keys under ``prefix`` (connects lazily, on first use)."""

    def __init__(self, url: str, prefix: str = "stagetree") -> None:
        import redis

        self._url = url
        self._prefix = prefix
        self._redis = redis.Redis.from_url(url)
        self._renew = self._redis.register_script(_RENEW)
        self._release = self._redis.register_script(_RELEASE)

    def _k(self, *parts: str) -> str:
        return ":".join((self._prefix, *parts))

    def notify(self, channel: str) -> None:
        self._redis.publish(self._k("wake", channel), b"1")

    async def wait(self, channel: str, timeout: float) -> bool:
        import redis.asyncio as aredis

        client = aredis.Redis.from_url(self._url)
        try:
            async with client.pubsub() as ps:
                await ps.subscribe(self._k("wake", channel))
                deadline = time.monotonic() + timeout
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    msg = await ps.get_message(ignore_subscribe_messages=True, timeout=left)
                    if msg is not None:
                        return True
        finally:
            await client.aclose()

    async def subscribe(self, channel: str) -> Subscription:
        import redis.asyncio as aredis

        client = aredis.Redis.from_url(self._url)
        ps = client.pubsub()
        try:
            await ps.subscribe(self._k("wake", channel))
        except BaseException:
            await ps.aclose()
            await client.aclose()
            raise
        return _RedisSubscription(client, ps)

    def heartbeat(self, node_manager_id: str, ttl_s: float) -> None:
        self._redis.set(self._k("nm", node_manager_id), b"1", px=max(1, int(ttl_s * 1000)))

    def alive(self, node_manager_ids: Iterable[str]) -> set[str]:
        ids = list(node_manager_ids)
        if not ids:
            return set()
        pipe = self._redis.pipeline()
        for n in ids:
            pipe.exists(self._k("nm", n))
        return {n for n, found in zip(ids, pipe.execute(), strict=True) if found}

    def acquire_lease(self, holder: str, ttl_s: float) -> bool:
        return bool(self._renew(keys=[self._k("leader")], args=[holder, max(1, int(ttl_s * 1000))]))

    def release_lease(self, holder: str) -> None:
        self._release(keys=[self._k("leader")], args=[holder])

    def close(self) -> None:
        self._redis.close()


class _RedisSubscription:
    """One pub/sub connection kept open: a message published while nobody waits stays in the socket
    until the next ``wait`` reads it (and any others behind it: wake-ups coalesce)."""

    def __init__(self, client: Any, pubsub: Any) -> None:
        self._client, self._ps = client, pubsub

    async def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        woken = False
        while not woken:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            woken = await self._ps.get_message(ignore_subscribe_messages=True, timeout=left) is not None
        while await self._ps.get_message(ignore_subscribe_messages=True, timeout=0) is not None:
            pass  # the wake-ups behind this one ask for the same re-check
        return True

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._ps.aclose()
        with contextlib.suppress(Exception):
            await self._client.aclose()
