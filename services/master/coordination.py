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
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from stagetree.core.errors import Unavailable

log = logging.getLogger(__name__)


class Subscription(Protocol):
    async def wait(self, timeout: float) -> bool:
        """True when notified since the subscription started or the previous ``wait`` returned True
        (at once if so), False after ``timeout`` seconds without one."""
        ...

    async def close(self) -> None: ...


class Coordination(Protocol):
    def notify(self, channel: str) -> None: ...

    def notify_many(self, channels: Iterable[str]) -> None:
        """``notify`` each channel (in one round trip where the transport allows)."""
        ...

    async def subscribe(self, channel: str) -> Subscription:
        """Start keeping notifies on ``channel``; ``close`` the subscription when done."""
        ...

    async def wait(self, channel: str, timeout: float) -> bool:
        """True when woken on ``channel`` before ``timeout`` seconds."""
        ...

    def heartbeat(self, node_manager_id: str, ttl_s: float) -> None: ...

    def heartbeat_many(self, node_manager_ids: Iterable[str], ttl_s: float) -> None:
        """``heartbeat`` each (in one round trip where the transport allows)."""
        ...

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
        self._subs: dict[str, set[_InProcessSubscription]] = {}

    def notify(self, channel: str) -> None:
        with self._lock:
            subs = list(self._subs.get(channel, ()))
        for sub in subs:
            sub.wake()

    def notify_many(self, channels: Iterable[str]) -> None:
        for channel in channels:
            self.notify(channel)

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
        sub = await self.subscribe(channel)
        try:
            return await sub.wait(timeout)
        finally:
            await sub.close()

    def heartbeat(self, node_manager_id: str, ttl_s: float) -> None:
        self.heartbeat_many([node_manager_id], ttl_s)

    def heartbeat_many(self, node_manager_ids: Iterable[str], ttl_s: float) -> None:
        until = self._clock() + ttl_s
        with self._lock:
            for n in node_manager_ids:
                self._beats[n] = until

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
    """Cluster mode: Redis keys under ``prefix`` (connects lazily, on first use).

    Redis going away (restarted, unreachable) must not stop a master or an aggregator: ``notify`` only
    logs (a wake-up is a hint, every waiter also polls), a subscription's ``wait`` reconnects and
    reports a wake-up (so its loop re-checks the state), and the calls whose answer matters
    (``heartbeat``, ``alive``, the lease) raise the core's retriable ``Unavailable``."""

    def __init__(self, url: str, prefix: str = "stagetree") -> None:
        import redis

        self._url = url
        self._prefix = prefix
        self._redis = redis.Redis.from_url(url)
        self._renew = self._redis.register_script(_RENEW)
        self._release = self._redis.register_script(_RELEASE)

    def _k(self, *parts: str) -> str:
        return ":".join((self._prefix, *parts))

    @contextlib.contextmanager
    def _unavailable(self, what: str) -> Iterator[None]:
        import redis

        try:
            yield
        except redis.RedisError as e:
            raise Unavailable(f"{what}: Redis at {self._url} is unavailable ({e}); it is retried") from e

    def notify(self, channel: str) -> None:
        import redis

        try:
            self._redis.publish(self._k("wake", channel), b"1")
        except redis.RedisError as e:  # a lost hint: every waiter also re-checks on a timer
            log.warning("wake-up not published: Redis unavailable (%s)", e, extra={"channel": channel})

    def notify_many(self, channels: Iterable[str]) -> None:
        """One pipelined round trip: a round wakes up to a few hundred node managers' streams."""
        import redis

        names = list(channels)
        if not names:
            return
        try:
            pipe = self._redis.pipeline(transaction=False)
            for channel in names:
                pipe.publish(self._k("wake", channel), b"1")
            pipe.execute()
        except redis.RedisError as e:
            log.warning("wake-ups not published: Redis unavailable (%s)", e, extra={"channels": len(names)})

    async def wait(self, channel: str, timeout: float) -> bool:
        sub = await self.subscribe(channel)
        try:
            return await sub.wait(timeout)
        finally:
            await sub.close()

    async def subscribe(self, channel: str) -> Subscription:
        sub = _RedisSubscription(self._url, self._k("wake", channel))
        await sub.connect()  # best effort: a Redis that is down now is retried by wait
        return sub

    def heartbeat(self, node_manager_id: str, ttl_s: float) -> None:
        self.heartbeat_many([node_manager_id], ttl_s)

    def heartbeat_many(self, node_manager_ids: Iterable[str], ttl_s: float) -> None:
        ids = list(node_manager_ids)
        if not ids:
            return
        with self._unavailable("heartbeat"):
            pipe = self._redis.pipeline(transaction=False)
            for n in ids:
                pipe.set(self._k("nm", n), b"1", px=max(1, int(ttl_s * 1000)))
            pipe.execute()

    def alive(self, node_manager_ids: Iterable[str]) -> set[str]:
        ids = list(node_manager_ids)
        if not ids:
            return set()
        with self._unavailable("liveness"):
            pipe = self._redis.pipeline()
            for n in ids:
                pipe.exists(self._k("nm", n))
            return {n for n, found in zip(ids, pipe.execute(), strict=True) if found}

    def acquire_lease(self, holder: str, ttl_s: float) -> bool:
        with self._unavailable("leader lease"):
            return bool(self._renew(keys=[self._k("leader")], args=[holder, max(1, int(ttl_s * 1000))]))

    def release_lease(self, holder: str) -> None:
        with self._unavailable("leader lease"):
            self._release(keys=[self._k("leader")], args=[holder])

    def close(self) -> None:
        self._redis.close()


class _RedisSubscription:
    """One pub/sub connection kept open: a message published while nobody waits stays in the socket
    until the next ``wait`` reads it (and any others behind it: wake-ups coalesce).

    When the connection breaks (Redis restarted), ``wait`` reports a wake-up, since notifies may have
    been lost, and subscribes again on its next call; while Redis stays away it waits out its timeout
    between tries, so its loop falls back to polling."""

    RETRY_S = 0.5

    def __init__(self, url: str, channel: str) -> None:
        self._url, self._channel = url, channel
        self._client: Any = None
        self._ps: Any = None
        self._broken = False  # the connection broke since the last wait: report a wake-up

    async def connect(self) -> bool:
        import redis
        import redis.asyncio as aredis

        if self._ps is not None:
            return True
        client = aredis.Redis.from_url(self._url)
        ps = client.pubsub()
        try:
            await ps.subscribe(self._channel)
        except redis.RedisError as e:
            log.warning("wake-ups not subscribed: Redis unavailable (%s)", e, extra={"channel": self._channel})
            await self._drop(client, ps)
            self._broken = True
            return False
        self._client, self._ps = client, ps
        return True

    async def wait(self, timeout: float) -> bool:
        import redis

        deadline = time.monotonic() + timeout
        if not await self.connect():
            await asyncio.sleep(max(0.0, min(timeout, self.RETRY_S)))
            return False
        if self._take_broken():
            return True  # resubscribed: what was notified meanwhile is lost, so re-check now
        try:
            woken = False
            while not woken:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                woken = await self._ps.get_message(ignore_subscribe_messages=True, timeout=left) is not None
            while await self._ps.get_message(ignore_subscribe_messages=True, timeout=0) is not None:
                pass  # the wake-ups behind this one ask for the same re-check
            return True
        except (redis.RedisError, OSError) as e:
            log.warning("wake-up subscription lost; resubscribing (%s)", e, extra={"channel": self._channel})
            client, ps = self._client, self._ps
            self._client = self._ps = None
            await self._drop(client, ps)
            await asyncio.sleep(max(0.0, min(deadline - time.monotonic(), self.RETRY_S)))
            return True

    def _take_broken(self) -> bool:
        broken, self._broken = self._broken, False
        return broken

    @staticmethod
    async def _drop(client: Any, ps: Any) -> None:
        with contextlib.suppress(Exception):
            await ps.aclose()
        with contextlib.suppress(Exception):
            await client.aclose()

    async def close(self) -> None:
        if self._ps is not None:
            await self._drop(self._client, self._ps)
        self._client = self._ps = None
