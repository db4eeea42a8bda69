"""A process busy with gRPC, as a test run, a user's script that used the SDK or a node manager is when it
starts a process: ``with busy_grpc() as noise:`` runs a gRPC server in this process, blocking channels
calling it from threads, a ``grpc.aio`` channel calling it from an event loop of its own, and a thread
that keeps the CPU busy, until the ``with`` ends. ``noise.calls`` counts the calls answered, so a test
can check the traffic flowed while it did its work.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc

_METHOD = "/stagetree.test.Noise/Echo"


@dataclass
class Noise:
    calls: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self) -> None:
        with self._lock:
            self.calls += 1


def _echo(request: bytes, context: grpc.ServicerContext) -> bytes:
    return request


@contextmanager
def busy_grpc(blocking_callers: int = 3, aio_concurrency: int = 8) -> Iterator[Noise]:
    noise = Noise()
    handler = grpc.method_handlers_generic_handler(
        "stagetree.test.Noise", {"Echo": grpc.unary_unary_rpc_method_handler(_echo)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    target = f"127.0.0.1:{port}"

    def blocking() -> None:
        with grpc.insecure_channel(target) as channel:
            echo = channel.unary_unary(_METHOD)
            while not noise.stop.is_set():
                try:
                    echo(b"x", timeout=5)
                except grpc.RpcError:
                    continue
                noise.count()

    async def aio() -> None:
        async with grpc.aio.insecure_channel(target) as channel:
            echo = channel.unary_unary(_METHOD)

            async def one() -> None:
                try:
                    await echo(b"y", timeout=5)
                except grpc.RpcError:
                    return
                noise.count()

            while not noise.stop.is_set():
                await asyncio.gather(*(one() for _ in range(aio_concurrency)))

    def spin() -> None:
        while not noise.stop.is_set():
            sum(range(10_000))

    threads = [threading.Thread(target=blocking, daemon=True) for _ in range(blocking_callers)]
    threads.append(threading.Thread(target=lambda: asyncio.run(aio()), daemon=True))
    threads.append(threading.Thread(target=spin, daemon=True))
    for t in threads:
        t.start()
    try:
        yield noise
    finally:
        noise.stop.set()
        for t in threads:
            t.join(timeout=10)
        server.stop(grace=None).wait(10)
