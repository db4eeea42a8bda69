"""What ``Database.rows``'s SQLite aggregate read buys: ``python -m tests.bench.sqlite_rows [--rows 2000]``.

The embedded master's store is SQLite. ``Database.rows`` reads a select as one JSON array of arrays
(``json_group_array``) instead of row by row through SQLAlchemy's result processing. This bench reads the
same select (the round's running batches: integers and text) both ways from a real SQLite file, medians
over ``--runs``, alone and beside a thread that keeps the GIL busy (as the master's other threads do), and
checks both reads return the same rows. ``float_exact_ms`` is what the aggregate costs when it also carries a
float column exactly (17 digits by ``printf``), which is why ``rows`` reads such selects the plain way.

Last line: ``rows=<n> plain_ms=<ms> aggregate_ms=<ms> speedup=<plain/aggregate> speedup_busy=<same, beside a
busy thread> same_rows=<true|false> float_exact_vs_plain=<aggregate with exact floats / plain>``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import Column, Float, Integer, MetaData, String, Table, create_engine, func, insert, select

from stagetree.master.store.database import Database
from tests.bench.record import record

META = MetaData()
BATCHES = Table(
    "batches",
    META,
    Column("id", Integer, primary_key=True),
    Column("plan_id", Integer),
    Column("attempt", Integer),
    Column("node_manager_id", String(64)),
    Column("slot_id", String(64)),
    Column("started_at", Float, nullable=True),
)
SELECT = select(BATCHES.c.id, BATCHES.c.plan_id, BATCHES.c.attempt, BATCHES.c.node_manager_id, BATCHES.c.slot_id)
WITH_FLOAT = select(*BATCHES.c)


def _median_ms(fn: Callable[[], Any], runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--runs", type=int, default=15)
    ns = p.parse_args(argv)
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        engine = create_engine(f"sqlite:///{Path(tmp) / 'rows.db'}")
        META.create_all(engine)
        db = Database(engine, check=False)
        with db.tx("fill") as s:
            s.execute(
                insert(BATCHES),
                [
                    {
                        "id": i,
                        "plan_id": i % 50,
                        "attempt": 1,
                        "node_manager_id": f"nm-{i % 200}",
                        "slot_id": f"nm-{i % 200}/cpu{i % 8}",
                        "started_at": None if i % 10 == 0 else 1.7e9 + rng.random() * 1e5,
                    }
                    for i in range(ns.rows)
                ],
            )

        def plain() -> list[Any]:
            with db.tx("plain") as s:
                return [tuple(r) for r in s.execute(SELECT).all()]

        def aggregate() -> list[Any]:
            with db.tx("aggregate") as s:
                return [tuple(r) for r in db.rows(s, SELECT)]

        def float_exact() -> list[Any]:
            sub = WITH_FLOAT.subquery()
            cols = [func.printf("%!.17g", c) if c.name == "started_at" else c for c in sub.c]
            agg = select(func.json_group_array(func.json_array(*cols))).select_from(sub)
            with db.tx("float") as s:
                return [tuple(r) for r in json.loads(s.execute(agg).scalar_one())]

        def plain_float() -> list[Any]:
            with db.tx("plain float") as s:
                return [tuple(r) for r in s.execute(WITH_FLOAT).all()]

        same = plain() == aggregate()
        floats = (_median_ms(plain_float, ns.runs), _median_ms(float_exact, ns.runs))
        alone = (_median_ms(plain, ns.runs), _median_ms(aggregate, ns.runs))
        stop = threading.Event()

        def busy() -> None:
            x = 0
            while not stop.is_set():
                x += 1

        th = threading.Thread(target=busy, daemon=True)
        th.start()
        try:
            beside = (_median_ms(plain, ns.runs), _median_ms(aggregate, ns.runs))
        finally:
            stop.set()
            th.join()
        engine.dispose()
    print(f"alone: plain {alone[0]:.2f} ms, aggregate {alone[1]:.2f} ms")
    print(f"beside a busy thread: plain {beside[0]:.2f} ms, aggregate {beside[1]:.2f} ms")
    print(f"with a float column: plain {floats[0]:.2f} ms, aggregate with exact floats {floats[1]:.2f} ms")
    print(
        record(
            "sqlite_rows",
            f"rows={ns.rows} plain_ms={alone[0]:.2f} aggregate_ms={alone[1]:.2f} speedup={alone[0] / alone[1]:.1f} "
            f"speedup_busy={beside[0] / beside[1]:.1f} same_rows={str(same).lower()} "
            f"float_exact_vs_plain={floats[1] / floats[0]:.2f}",
        )
    )


if __name__ == "__main__":
    main()
