"""Same-run references for the benches' absolute rates.

This VM's speed moves 20-40% from hour to hour, so an absolute rate alone says little. Each bench that
reports a rate also measures, in the same run and on the same servers, a plain reference that moves with
the machine, and prints the ratio next to the absolute figure:

* ``raw_insert_rate``: rows a second of psycopg2 ``executemany`` of given rows into a scratch copy of a
  table (``LIKE ... INCLUDING ALL``: same columns, defaults and indexes), ``per_txn`` rows a transaction;
* ``grpc_unary_rate``: round trips a second of a bare gRPC unary call (bytes in, bytes out, no work) over
  loopback, ``concurrency`` calls in flight, as the SDK and the node managers talk to the master;
* ``kafka_rate``: messages a second of kafka-python producing ``n`` messages of ``size`` bytes to a fresh
  topic and one consumer reading them all back;
* ``python_rate``: iterations a second of a fixed pure-Python loop (dicts, tuples, sorting: what a
  scheduling round is made of), for the CPU-bound figures.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Sequence

import grpc

# The columns a submitted request writes (``requests``), for the insert reference.
REQUEST_COLUMNS = (
    "study_id",
    "plan_id",
    "node_id",
    "step",
    "state",
    "client_request_id",
    "label",
    "created_at",
    "failures",
)


def raw_insert_rate(
    dsn: str, table: str, columns: Sequence[str], rows: Sequence[tuple[object, ...]], per_txn: int = 100
) -> float:
    import psycopg2

    scratch = f"ref_{uuid.uuid4().hex[:8]}"
    conn = psycopg2.connect(dsn.replace("postgresql+psycopg2://", "postgresql://"))
    try:
        with conn.cursor() as cur:
            cur.execute(f"CREATE TABLE {scratch} (LIKE {table} INCLUDING ALL)")
        conn.commit()
        sql = f"INSERT INTO {scratch} ({', '.join(columns)}) VALUES ({', '.join(['%s'] * len(columns))})"
        t0 = time.perf_counter()
        for i in range(0, len(rows), per_txn):
            with conn.cursor() as cur:
                cur.executemany(sql, rows[i : i + per_txn])
            conn.commit()
        rate = len(rows) / (time.perf_counter() - t0)
        with conn.cursor() as cur:
            cur.execute(f"DROP TABLE {scratch}")
        conn.commit()
        return rate
    finally:
        conn.close()


async def grpc_unary_rate(calls: int = 3000, concurrency: int = 8, payload: int = 200) -> float:
    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    handler = grpc.method_handlers_generic_handler("ref.Echo", {"Call": grpc.unary_unary_rpc_method_handler(echo)})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = ch.unary_unary("/ref.Echo/Call")
            body = b"x" * payload
            await call(body)  # connect
            sem = asyncio.Semaphore(concurrency)

            async def one() -> None:
                async with sem:
                    await call(body)

            t0 = time.perf_counter()
            await asyncio.gather(*(one() for _ in range(calls)))
            return calls / (time.perf_counter() - t0)
    finally:
        await server.stop(grace=None)


def kafka_rate(bootstrap: str, n: int = 20_000, size: int = 200) -> float:
    from kafka import KafkaConsumer, KafkaProducer

    topic = f"ref-{uuid.uuid4().hex[:8]}"
    body = b"x" * size
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, acks=1)
    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        group_id=None,
        consumer_timeout_ms=30_000,
    )
    try:
        t0 = time.perf_counter()
        for i in range(n):
            producer.send(topic, body, key=str(i % 8).encode())
        producer.flush()
        seen = 0
        for _ in consumer:
            seen += 1
            if seen >= n:
                break
        return seen / (time.perf_counter() - t0)
    finally:
        producer.close()
        consumer.close()


def python_rate(seconds: float = 0.5) -> float:
    """Iterations a second of a loop shaped like a round's work (build dicts of tuples, sort, sum)."""
    rng = random.Random(0)
    data = [(rng.random(), i) for i in range(200)]
    iterations = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        index = {i: (w, i % 7) for w, i in data}
        order = sorted(index.items(), key=lambda kv: -kv[1][0])
        _ = sum(w for _, (w, _k) in order[:50])
        iterations += 1
    return iterations / (time.perf_counter() - t0)
