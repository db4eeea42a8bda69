"""Fixtures for the SDK and CLI integration tests: a real master (Postgres, or SQLite for the embedded
path) with its scheduling loop and a no-op node manager, in the test's event loop, on a database of the
test's own (``fresh_postgres_url``, ``fresh_sqlite_url`` from ``tests/integration/conftest.py``): on a
database shared with earlier tests the master found their node managers registered and gave them one
liveness TTL before moving their work, ~17 s of a test."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.integration.client.harness import Platform, in_process_master
from tests.integration.conftest import ADMIN_TOKEN, TOKENS, master_settings

__all__ = ["ADMIN_TOKEN", "TOKENS"]


@pytest.fixture
async def platform(fresh_postgres_url: str) -> AsyncIterator[Platform]:
    async with in_process_master(master_settings(fresh_postgres_url), slots=4) as p:
        yield p


@pytest.fixture
async def http_platform(fresh_postgres_url: str) -> AsyncIterator[Platform]:
    async with in_process_master(master_settings(fresh_postgres_url), slots=4, http=True) as p:
        yield p


@pytest.fixture
async def sqlite_platform(fresh_sqlite_url: str) -> AsyncIterator[Platform]:
    async with in_process_master(master_settings(fresh_sqlite_url), slots=4) as p:
        yield p
