"""Coordination between master processes and with node managers: liveness, leader lease, wake-ups.

``Coordination`` is the port; ``RedisCoordination`` is the cluster adapter (heartbeat keys with a TTL,
a ``SET NX PX`` leader lease renewed by its holder only, pub/sub wake-ups) and
``InProcessCoordination`` the embedded one (same semantics inside one process, thread-safe). One
contract suite runs against both.

Wake-ups are hints, not messages: a ``notify`` that happens before a ``wait`` starts is not kept, so
every waiter re-checks the state it waits for and waits with a timeout.
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


class Coordination(Protocol):
    def notify(self, channel: str) -> None: ...

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

    def notify(self, channel: str) -> None:
        with self._lock:
            waiters = self._waiters.pop(channel, [])
        for loop, fut in waiters:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting any more
                loop.call_soon_threadsafe(_resolve, fut)

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
