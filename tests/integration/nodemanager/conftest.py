"""The node manager suite runs against the shared integration fixtures (a fresh Postgres or SQLite
database per test, a ``MasterApp`` with gRPC on a free port) plus the master's scheduling loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from stagetree.master.app import MasterApp
from stagetree.master.service import CH_ROUND


@pytest.fixture
async def scheduling(app: MasterApp) -> AsyncIterator[MasterApp]:
    """The master's scheduling loop, running (rounds on wake-ups) for the test."""
    stop = asyncio.Event()
    task = asyncio.create_task(app.scheduler.run(stop))
    yield app
    stop.set()
    for _ in range(150):  # a wake-up is a hint: repeat it until the loop has seen the stop
        app.coordination.notify(CH_ROUND)
        done, _ = await asyncio.wait({task}, timeout=0.1)
        if done:
            break
    await asyncio.wait_for(task, 5)
