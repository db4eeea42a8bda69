"""Fixtures for the SDK and CLI integration tests: a real master (Postgres, or SQLite for the embedded
path) with its scheduling loop and a no-op node manager, in the test's event loop. The databases
(``pg_url``, ``sqlite_url``) come from ``tests/integration/conftest.py``."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.integration.client.harness import Platform, in_process_master
from tests.integration.conftest import ADMIN_TOKEN, TOKENS, master_settings

__all__ = ["ADMIN_TOKEN", "TOKENS"]


@pytest.fixture
async def platform(pg_url: str) -> AsyncIterator[Platform]:
    async with in_process_master(master_settings(pg_url), slots=4) as p:
        yield p


@pytest.fixture
async def http_platform(pg_url: str) -> AsyncIterator[Platform]:
    async with in_process_master(master_settings(pg_url), slots=4, http=True) as p:
        yield p


@pytest.fixture
async def sqlite_platform(sqlite_url: str) -> AsyncIterator[Platform]:
    async with in_process_master(master_settings(sqlite_url), slots=4) as p:
        yield p
